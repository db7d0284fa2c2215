"""Loads the native libraries that hold twinkle-mem's kernels.

_C_cpu (op schemas + CPU kernels) always; _C_cuda only under a CUDA build of
torch (it links libtorch_cuda and the CUDA runtime, which a CPU torch lacks);
_C_npu only when torch_npu is importable. Each is built against the LibTorch
stable ABI, so one build serves any torch >= 2.10.
"""
from __future__ import annotations

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))

# backend -> "loaded" | "not built" | "not loaded: <reason>"
status: dict[str, str] = {}


def _find(name: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(_HERE, f"{name}*.so")))
    return hits[0] if hits else None


def _load(backend: str, name: str, wanted: bool, why_not: str) -> None:
    path = _find(name)
    if path is None:
        status[backend] = "not built"
    elif not wanted:
        status[backend] = f"built, not loaded: {why_not}"
    else:
        torch.ops.load_library(path)
        status[backend] = "loaded"


def load() -> None:
    path = _find("_C_cpu")
    if path is None:
        raise ImportError(
            "twinkle_mem: the native library _C_cpu was not found next to the package; "
            "install with `pip install .` (it compiles the kernels)"
        )
    torch.ops.load_library(path)
    status["cpu"] = "loaded"
    _load("cuda", "_C_cuda", torch.version.cuda is not None, "this torch has no CUDA")
    try:
        import torch_npu  # noqa: F401

        has_npu = True
    except ImportError:
        has_npu = False
    _load("npu", "_C_npu", has_npu, "torch_npu is not installed")
