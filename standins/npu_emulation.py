"""The AscendC kernels (csrc/npu/selective_log_softmax_kernel.cpp) run on the CPU.

The real kernel source is compiled with g++ against the project's stand-in of
the AscendC API (standins/ascendc/ascendc_standin.h) into a small shared
library, built once per source version into a temporary directory, and called
here through ctypes with the tensors' pointers, strides and the plan inputs the
torch_npu glue would pass (tiling.h). A violation of the API's rules that the
stand-in checks (alignment, UB budget, a missing pipe synchronisation, a
global-memory access outside the tensors, ...) raises AssertionError.

``standin_ub`` runs the kernel with another UB budget than the plan's (tests
check that the plan's byte count is exactly what the kernel allocates).
``forward`` / ``backward`` follow the op contract (csrc/ops.cpp) on CPU
tensors; ``IMPL`` is the ``Impl`` that tests/impls.py registers.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
NPU = os.path.join(CSRC, "npu")
STANDIN = os.path.join(ROOT, "standins", "ascendc")
STANDIN_SOURCES = [os.path.join(STANDIN, f) for f in ("emulate_kernels.cpp", "ascendc_standin.h", "kernel_operator.h")]
# The kernel's sources, relative to a copy of csrc/ (tests build deliberately broken kernels).
KERNEL_SOURCES = [os.path.join("npu", f) for f in ("selective_log_softmax_kernel.cpp", "tiling.h", "scalar_math.h")]
KERNEL_SOURCES += [os.path.join("common", "row_index.h")]
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-DASCENDC_CPU_DEBUG=1"]

# A 910B's vector cores (20 AI cores x 2 AIV on 910B3/B4; 24 x 2 on 910B1/B2) and
# the UB the kernel may use on the 220 architecture (192 KiB less the library's 8 KiB).
DEFAULT_CORES = 40
UB_BUDGET_220 = 184 * 1024
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TILING_FIELDS = ["n_rows", "vocab", "vocab_start", "vocab_size", "ignore_index",
                 "x_inner", "x_outer_stride", "x_inner_stride", "g_inner", "g_outer_stride", "g_inner_stride",
                 "y_inner", "y_outer_stride", "y_inner_stride", "label_k", "label_k_stride", "elem_bytes",
                 "label_bytes", "with_entropy", "mode", "used_cores", "rows_per_core", "front_cores", "tile_len",
                 "num_tiles", "tail_len", "reduce_work_elems", "ub_bytes_used"]

_libs: dict[tuple, ctypes.CDLL] = {}
last_plan: dict = {}  # the plan of the latest call (tests read tile_len, num_tiles, ...)


def available() -> Optional[str]:
    """None when the emulation can be built here, else why not."""
    return None if CXX else "no C++ compiler (g++) found"


def library(extra_flags: tuple = (), csrc_dir: str = CSRC) -> ctypes.CDLL:
    """The emulation library, compiled on first use (cached by source content and flags).

    ``csrc_dir``: another copy of csrc/ to build the kernel from (tests build deliberately broken kernels).
    """
    key = (tuple(extra_flags), csrc_dir)
    if key in _libs:
        return _libs[key]
    digest = hashlib.sha256()
    for path in STANDIN_SOURCES + [os.path.join(csrc_dir, f) for f in KERNEL_SOURCES]:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(FLAGS + list(extra_flags)).encode())
    cache = os.path.join(tempfile.gettempdir(), "twinkle_mem_npu_emulation")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"emu_{digest.hexdigest()[:16]}.so")
    if not os.path.exists(so):
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = [CXX, *FLAGS, *extra_flags, "-I", STANDIN, "-I", os.path.join(csrc_dir, "npu"),
               os.path.join(STANDIN, "emulate_kernels.cpp"), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"building the AscendC emulation failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    p = ctypes.c_void_p
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.tm_npu_emu_forward.argtypes = [i64p, i64p, i64p, p, p, ctypes.c_int64, p, p, p, p, ctypes.c_float, i64p,
                                       ctypes.c_char_p, ctypes.c_int64]
    lib.tm_npu_emu_backward.argtypes = [i64p, i64p, i64p, i64p, p, p, p, p, ctypes.c_int64, p, p, p, p,
                                        ctypes.c_float, i64p, ctypes.c_char_p, ctypes.c_int64]
    lib.tm_npu_emu_set_transcendental_ulp.argtypes = [ctypes.c_int]
    lib.tm_npu_emu_tiling_words.restype = ctypes.c_int64
    lib.tm_npu_emu_stats.argtypes = [i64p]
    assert lib.tm_npu_emu_tiling_words() == len(TILING_FIELDS), "standins/npu_emulation.py TILING_FIELDS is stale"
    _libs[key] = lib
    return lib


def _i64(values):
    return (ctypes.c_int64 * len(values))(*[int(v) for v in values])


def _rows(t: torch.Tensor, lead_dims: int):
    """layout.h RowIndex {inner, outer_stride, inner_stride} of a [N, ...] or [B, S, ...] tensor."""
    if lead_dims == 1:
        return (max(t.shape[0], 1), 0, t.stride(0))
    return (max(t.shape[1], 1), t.stride(0), t.stride(1))


def _span(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element of a view."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _ptr(t: Optional[torch.Tensor]):
    return ctypes.c_void_p(t.data_ptr()) if t is not None and t.numel() > 0 else None


def _label_layout(labels, lead_dims):
    if labels.dim() > lead_dims:
        return labels.shape[-1], labels.stride(-1)
    return 1, 1


def _request(logits, labels, vocab_start, vocab_size, ignore_index, with_entropy, cores, ub_bytes, max_tile,
             standin_ub):
    lead = logits.dim() - 1
    k, k_stride = _label_layout(labels, lead)
    n = math.prod(logits.shape[:-1])
    return [n, logits.shape[-1], vocab_start, vocab_size, ignore_index, k, k_stride, logits.element_size(),
            labels.element_size(), int(bool(with_entropy)), cores, ub_bytes, max_tile, DTYPE_CODE[logits.dtype],
            standin_ub]


def _plan(words):
    global last_plan
    last_plan = dict(zip(TILING_FIELDS, list(words)))


def _check(rc, err):
    if rc != 0:
        raise AssertionError(err.value.decode(errors="replace"))


def forward(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy, *,
            cores=DEFAULT_CORES, ub_bytes=UB_BUDGET_220, max_tile=0, standin_ub=0, lib=None):
    """selective_log_softmax_fwd through the AscendC forward kernel: (logp, entropy, shift, log_sum)."""
    if logits.dtype == torch.float64:  # as the glue: fp64 runs on the CPU kernel
        return torch.ops.twinkle_mem.selective_log_softmax_fwd(logits, labels, inv_temperature, ignore_index,
                                                               vocab_start, vocab_size, with_entropy)
    lead = logits.shape[:-1]
    logp = torch.empty(labels.shape, dtype=torch.float32)
    entropy = torch.empty(lead if with_entropy else (0,), dtype=torch.float32)
    shift = torch.empty(lead, dtype=torch.float32)
    log_sum = torch.empty(lead, dtype=torch.float32)
    if shift.numel() == 0:
        return logp, entropy, shift, log_sum
    lib = lib or library()
    req = _request(logits, labels, vocab_start, vocab_size, ignore_index, with_entropy, cores, ub_bytes, max_tile,
                   standin_ub)
    plan = _i64([0] * len(TILING_FIELDS))
    err = ctypes.create_string_buffer(2048)
    rc = lib.tm_npu_emu_forward(_i64(req), _i64(_rows(logits, len(lead))), _i64(_rows(labels, len(lead))),
                                _ptr(logits), _ptr(labels), _span(labels), _ptr(logp), _ptr(entropy), _ptr(shift),
                                _ptr(log_sum), float(inv_temperature), plan, err, len(err))
    _check(rc, err)
    _plan(plan)
    return logp, entropy, shift, log_sum


def backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_temperature, ignore_index, vocab_start,
             inplace, *, cores=DEFAULT_CORES, ub_bytes=UB_BUDGET_220, max_tile=0, standin_ub=0, lib=None):
    """selective_log_softmax_bwd(_) through the AscendC backward kernel; returns the gradient (the logits when inplace)."""
    if logits.dtype == torch.float64:
        op = torch.ops.twinkle_mem
        if inplace:
            op.selective_log_softmax_bwd_(g_logp, g_entropy, logits, labels, shift, log_sum, entropy,
                                          inv_temperature, ignore_index, vocab_start)
            return logits
        return op.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy,
                                            inv_temperature, ignore_index, vocab_start)
    from twinkle_mem.op.contract import new_grad_like

    lead = logits.dim() - 1
    grad = logits if inplace else new_grad_like(logits)
    if shift.numel() == 0:
        return grad
    with_entropy = g_entropy is not None
    gl = g_logp.contiguous().float()
    ge = g_entropy.contiguous().float() if with_entropy else None
    ent = entropy.contiguous().float() if with_entropy else None
    sh, ls = shift.contiguous(), log_sum.contiguous()
    lib = lib or library()
    v = logits.shape[-1]
    req = _request(logits, labels, vocab_start, vocab_start + v, ignore_index, with_entropy, cores, ub_bytes,
                   max_tile, standin_ub)
    plan = _i64([0] * len(TILING_FIELDS))
    err = ctypes.create_string_buffer(2048)
    rc = lib.tm_npu_emu_backward(_i64(req), _i64(_rows(logits, lead)), _i64(_rows(labels, lead)),
                                 _i64(_rows(grad, lead)), _ptr(gl), _ptr(ge), _ptr(logits), _ptr(labels),
                                 _span(labels), _ptr(sh), _ptr(ls), _ptr(ent), _ptr(grad), float(inv_temperature),
                                 plan, err, len(err))
    _check(rc, err)
    _plan(plan)
    return grad


def copy_in_stats() -> tuple[int, int]:
    """(copy-ins, copy-ins issued while an earlier one still waited) of the latest call."""
    out = _i64([0, 0])
    library().tm_npu_emu_stats(out)
    return int(out[0]), int(out[1])


def set_transcendental_ulp(n: int) -> None:
    """Move every exp / ln result of the stand-in by up to n ulp (0: the host's expf / logf)."""
    library().tm_npu_emu_set_transcendental_ulp(int(n))
