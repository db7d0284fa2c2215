"""CPU unit test of the NPU host logic that needs no CANN (csrc/npu/tiling.h,
csrc/npu/scalar_math.h): compiles tests/backends/npu/npu_tiling_test.cpp with the system
C++ compiler into a temporary directory and runs it. Covers every plan fitting
the 184 KiB UB budget of the 220 architecture (a sweep of V, dtypes, modes and
tile caps), tiles independent of N, V = 151936, tails, N < core count, N = 0,
[B, S, V] row offsets against layout.h, k labels, vocab-shard label columns and
out-of-range labels, argument validation, the SoC's bf16 matching, the
kernel's scalar helpers (16-bit floats, expm1, log1p) against the C library,
and the shared online-softmax math streamed over the plan's tiles."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) found")
def test_npu_tiling(tmp_path):
    exe = tmp_path / "npu_tiling_test"
    build = subprocess.run(
        [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc"),
         os.path.join(ROOT, "tests", "backends", "npu", "npu_tiling_test.cpp"), "-o", str(exe)],
        capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks passed" in run.stdout, run.stdout
