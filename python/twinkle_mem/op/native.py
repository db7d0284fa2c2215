"""Loads the native libraries that hold twinkle-mem's kernels.

_C_cpu (op schemas + CPU kernels) always; _C_cuda only under a CUDA build of
torch (it links libtorch_cuda, which a CPU torch lacks); _C_npu only when
torch_npu is importable. Each is built against the LibTorch stable ABI, so one
build serves any torch >= 2.10.

A library that fails to load, for any reason, never breaks ``import
twinkle_mem``: its device then runs the composite (composite.py, registered
for every device without a native kernel), and ``status`` / ``backends()`` /
``python -m twinkle_mem`` say why. When _C_cpu, which defines the schemas,
does not load, the schemas are defined here from the same text
(schemas.def, which csrc/ops.cpp includes).

_C_cpu's kernels come in paths (AVX-512 with or without BF16, AVX2, portable), picked per call from
what the CPU reports; TWINKLE_MEM_CPU_ISA caps the path (cpu_kernel_path).

The build records what it left out and why in _build_info.json beside the libraries (setup.py): a library
that is not built says why in ``status``; where the build found nvcc but skipped _C_cuda (its torch was
CPU-only) and this torch has CUDA, loading warns (pip showed the build's line only under -v).
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import warnings

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the libraries and schemas.def lie there
SCHEMAS_FILE = os.path.join(_PACKAGE, "schemas.def")
BUILD_INFO_FILE = os.path.join(_PACKAGE, "_build_info.json")  # written by setup.py's build
FALLBACK = "the composite runs on this device"

# backend -> "loaded" | "not built" | "built, not loaded: <why>" | "failed to load (<file>: <error>); <FALLBACK>"
status: dict[str, str] = {}
_python_schemas = None  # the torch.library.Library holding schemas defined from Python, kept alive
_cpu_library = None  # the loaded _C_cpu, for cpu_kernel_path
CPU_ISA_ENV = "TWINKLE_MEM_CPU_ISA"
CPU_PATHS = ("avx512_bf16", "avx512", "avx2", "portable")  # widest first


def _find(name: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(_PACKAGE, f"{name}*.so")))
    return hits[0] if hits else None


def schemas() -> list[str]:
    """The op schemas, as written in schemas.def (C string literals of each m.def(...))."""
    with open(SCHEMAS_FILE) as f:
        text = "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("//"))
    literal = r'"((?:[^"\\]|\\.)*)"'
    calls = re.findall(r'm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)\s*;', text)
    return ["".join(re.findall(literal, call)) for call in calls]


def _define_schemas_in_python() -> None:
    global _python_schemas
    if _python_schemas is not None or hasattr(torch.ops.twinkle_mem, "selective_log_softmax_fwd"):
        return
    lib = torch.library.Library("twinkle_mem", "DEF")
    for schema in schemas():
        lib.define(schema)
    _python_schemas = lib


def _try_load(backend: str, path: str) -> bool:
    try:
        torch.ops.load_library(path)
    except Exception as e:  # noqa: BLE001 (any reason: missing soname, bad file, undefined symbol, ...)
        cause = f": {e.__cause__}" if e.__cause__ is not None else ""  # torch wraps the dlopen error
        reason = " ".join(f"{e}{cause}".split()) or type(e).__name__
        status[backend] = f"failed to load ({os.path.basename(path)}: {reason}); {FALLBACK}"
        return False
    status[backend] = "loaded"
    return True


def build_info() -> dict:
    """What the build of this package left out and why: {"cuda": {"built": bool, "why_not": str | None,
    "nvcc": the toolkit it found or None, "disabled": TWINKLE_MEM_NO_CUDA=1}, "npu": {"built", "why_not"},
    "torch": the build environment's torch}; {} where no build recorded it (a source tree never built, a
    build before the record)."""
    try:
        with open(BUILD_INFO_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _not_built(backend: str) -> str:
    why = (build_info().get(backend) or {}).get("why_not")
    return f"not built (at build time: {why})" if why else "not built"


def _load(backend: str, name: str, wanted: bool, why_not: str) -> None:
    path = _find(name)
    if path is None:
        status[backend] = _not_built(backend)
    elif not wanted:
        status[backend] = f"built, not loaded: {why_not}"
    else:
        _try_load(backend, path)


def cpu_kernel_path(cap: str | None = None) -> str | None:
    """The CPU kernel path an op call runs now (one of CPU_PATHS), the widest this CPU
    reports at or below the cap TWINKLE_MEM_CPU_ISA (or ``cap`` when given; "" for none). None when
    _C_cpu is not loaded. A cap that names no path raises ValueError here (and RuntimeError in the op)."""
    if _cpu_library is None:
        return None
    cap = os.environ.get(CPU_ISA_ENV, "") if cap is None else cap
    name = _cpu_library.twinkle_mem_cpu_kernel_path(cap.encode())
    if name is None:
        raise ValueError(f"{CPU_ISA_ENV}={cap!r} names no CPU kernel path (one of {', '.join(CPU_PATHS)})")
    return name.decode()


def _open_cpu_library(path: str) -> None:
    """The loaded _C_cpu for cpu_kernel_path (left None by a library without that entry, a build older
    than the paths: import goes on, the path shows as unknown)."""
    global _cpu_library
    try:
        lib = ctypes.CDLL(path)  # the library torch just loaded: the same handle
        lib.twinkle_mem_cpu_kernel_path.argtypes = [ctypes.c_char_p]
        lib.twinkle_mem_cpu_kernel_path.restype = ctypes.c_char_p
    except (OSError, AttributeError):
        return
    _cpu_library = lib


def load() -> None:
    path = _find("_C_cpu")
    if path is None:
        status["cpu"] = f"not built (install with `pip install .`, which compiles the kernels); {FALLBACK}"
    elif _try_load("cpu", path):
        _open_cpu_library(path)
    if status["cpu"] != "loaded":
        _define_schemas_in_python()
    _load("cuda", "_C_cuda", torch.version.cuda is not None, "this torch has no CUDA")
    cuda_build = build_info().get("cuda") or {}
    if torch.version.cuda is not None and _find("_C_cuda") is None and cuda_build.get("nvcc") and \
            cuda_build.get("why_not") and not cuda_build.get("disabled"):
        warnings.warn(f"twinkle-mem's CUDA library was not built ({cuda_build['why_not']}): CUDA tensors run the "
                      "composite PyTorch fallback (`python -m twinkle_mem` lists the backends)", RuntimeWarning,
                      stacklevel=2)
    try:
        import torch_npu  # noqa: F401

        has_npu = True
    except ImportError:
        has_npu = False
    _load("npu", "_C_npu", has_npu, "torch_npu is not installed")
