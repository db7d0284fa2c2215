"""The CUDA kernels, run on the CPU: standins/cuda/emulated_ops.cpp (the
kernels and host plan of csrc/cuda/ over a stand-in of the CUDA device API) built
with the host C++ compiler into a shared library and called through ctypes.

``forward`` and ``backward`` take and return CPU tensors with the op contract's
arguments (tests/numerics.py's Impl interface). Outputs and the out-of-place
gradient are allocated as the CUDA glue allocates them (contiguous outputs,
``new_grad_like`` for the gradient), per-row inputs are made contiguous as the
glue does; everything else (row and label indexing, segments, block size,
alignment, workspaces, launches) is the CUDA source's own host plan.

The library is cached by a hash of its sources under
``$TWINKLE_MEM_EMULATION_CACHE`` (default: the temp dir).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

from twinkle_mem.op.contract import new_grad_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
STANDIN = os.path.join(ROOT, "standins", "cuda")
SOURCE = os.path.join(STANDIN, "emulated_ops.cpp")
DEPENDS = [SOURCE, os.path.join(STANDIN, "fake_cuda.h"),
           os.path.join(CSRC, "cuda", "selective_log_softmax_kernels.cuh"),
           os.path.join(CSRC, "cuda", "selective_log_softmax_plan.cuh")] + [
    os.path.join(CSRC, "common", h) for h in ("online_softmax.h", "layout.h", "row_index.h", "op_options.h")]

MAX_GRID = 3  # few blocks: each loops over several tasks (the grid-stride path)
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


class OpOptions(ctypes.Structure):
    """csrc/common/op_options.h's OpOptions, field for field."""
    _fields_ = [("inv_temperature", ctypes.c_double), ("ignore_index", ctypes.c_int64),
                ("vocab_start", ctypes.c_int64), ("vocab_size", ctypes.c_int64), ("with_entropy", ctypes.c_bool),
                ("inplace_backward", ctypes.c_bool)]


class TensorRef(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("dim", ctypes.c_int), ("sizes", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4)]


def _ref(t: torch.Tensor) -> TensorRef:
    r = TensorRef()
    r.ptr = t.data_ptr()
    r.dim = t.dim()
    for d in range(t.dim()):
        r.sizes[d] = t.shape[d]
        r.strides[d] = t.stride(d)
    return r


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build() -> str:
    """Path of the emulation library, built when its sources changed."""
    h = hashlib.sha256()
    for path in DEPENDS:
        with open(path, "rb") as f:
            h.update(f.read())
    cache = os.environ.get("TWINKLE_MEM_EMULATION_CACHE") or os.path.join(tempfile.gettempdir(), "twinkle_mem_emu")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"emulated_ops_{h.hexdigest()[:16]}.so")
    if not os.path.exists(lib):
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler for the CUDA emulation (set CXX)")
        tmp = f"{lib}.{os.getpid()}.tmp"
        proc = subprocess.run([cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-Wno-unknown-pragmas", f"-I{CSRC}",
                               f"-I{STANDIN}", SOURCE, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CUDA emulation failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib


_lib = None


def library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(build())
        ref_p, opt_p = ctypes.POINTER(TensorRef), ctypes.POINTER(OpOptions)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.tm_emu_forward.argtypes = [ctypes.c_int, ref_p, ref_p, ctypes.c_int, opt_p, ptr, ptr, ptr, ptr, i64, i64,
                                       ctypes.c_char_p, i64]
        lib.tm_emu_backward.argtypes = [ctypes.c_int, ref_p, ref_p, ref_p, ctypes.c_int, opt_p, ptr, ptr, ptr, ptr,
                                        ptr, i64, i64, ctypes.c_char_p, i64]
        lib.tm_emu_split.argtypes = [i64, i64, i64, ctypes.POINTER(i64)]
        lib.tm_emu_split.restype = None
        lib.tm_emu_take_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.tm_emu_take_counters.restype = None
        lib.tm_emu_segment_bytes.argtypes = []
        lib.tm_emu_segment_bytes.restype = i64
        lib.tm_emu_options_layout.argtypes = [ctypes.POINTER(i64)]
        lib.tm_emu_options_layout.restype = None
        layout = (i64 * (1 + len(OpOptions._fields_)))()
        lib.tm_emu_options_layout(layout)
        mirror = [ctypes.sizeof(OpOptions)] + [getattr(OpOptions, name).offset for name, _ in OpOptions._fields_]
        assert list(layout) == mirror, f"cuda_emulation.OpOptions {mirror} is stale: op_options.h has {list(layout)}"
        _lib = lib
    return _lib


def _segment_bytes(segment_bytes: int | None) -> int:
    """segment_bytes, or by default the CUDA build's kSegmentBytes (read from the library)."""
    return library().tm_emu_segment_bytes() if segment_bytes is None else segment_bytes


def split(v: int, dtype: torch.dtype, segment_bytes: int | None = None) -> tuple[int, int, int]:
    """(segments, segment_len, threads) of the CUDA plan for rows of v elements."""
    out = (ctypes.c_int64 * 3)()
    library().tm_emu_split(v, torch.empty((), dtype=dtype).element_size(),
                           _segment_bytes(segment_bytes), out)
    return tuple(out)


def take_counters() -> dict[str, int]:
    """Slot loads and stores by width since the last call (the scalar tails are not counted)."""
    out = (ctypes.c_uint64 * 4)()
    library().tm_emu_take_counters(out)
    return dict(zip(("vector_loads", "narrow_loads", "vector_stores", "narrow_stores"), out))


def _ptr(t):
    return None if t is None else t.data_ptr()


def _raise(rc: int, message) -> None:
    if rc != 0:
        raise RuntimeError(f"device-side assert (emulated): {message.value.decode()}")


def forward(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy,
            inplace_backward=False, *, segment_bytes=None, max_grid=MAX_GRID):
    """The CUDA selective_log_softmax_fwd, emulated: (logp, entropy, shift, log_sum)."""
    assert logits.dim() in (2, 3) and (logits.shape[-1] <= 1 or logits.stride(-1) == 1)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lead = logits.shape[:-1]
    logp = torch.empty(labels.shape, dtype=acc)
    entropy = torch.empty(lead if with_entropy else (0,), dtype=acc)
    shift = torch.empty(lead, dtype=acc)
    log_sum = torch.empty(lead, dtype=acc)
    message = ctypes.create_string_buffer(512)
    options = OpOptions(float(inv_temperature), ignore_index, vocab_start, vocab_size, bool(with_entropy),
                        bool(inplace_backward))
    rc = library().tm_emu_forward(DTYPES[logits.dtype], _ref(logits), _ref(labels), labels.dtype == torch.int64,
                                  ctypes.byref(options), _ptr(logp), _ptr(entropy) if with_entropy else None,
                                  _ptr(shift), _ptr(log_sum), _segment_bytes(segment_bytes), max_grid, message, 512)
    _raise(rc, message)
    return logp, entropy, shift, log_sum


def backward(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature, ignore_index,
             vocab_start, inplace, *, segment_bytes=None, max_grid=MAX_GRID):
    """The CUDA selective_log_softmax_bwd (or _bwd_ when inplace), emulated: the gradient."""
    grad = logits if inplace else new_grad_like(logits)
    with_entropy = grad_entropy is not None
    per_row = [t.contiguous() if t is not None else None
               for t in (grad_logp, grad_entropy if with_entropy else None, entropy if with_entropy else None, shift,
                         log_sum)]
    # The backward's options as op_entry.h derives them from the schema's arguments.
    options = OpOptions(float(inv_temperature), ignore_index, vocab_start, vocab_start + logits.shape[-1],
                        with_entropy, bool(inplace))
    message = ctypes.create_string_buffer(512)
    rc = library().tm_emu_backward(DTYPES[logits.dtype], _ref(logits), _ref(grad), _ref(labels),
                                   labels.dtype == torch.int64, ctypes.byref(options), *[_ptr(t) for t in per_row],
                                   _segment_bytes(segment_bytes), max_grid, message, 512)
    _raise(rc, message)
    return grad
