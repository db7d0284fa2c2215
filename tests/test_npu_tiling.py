"""CPU unit test of the NPU tiling (csrc/npu/tiling.h), the host logic of the
AscendC kernels that needs no CANN: compiles tests/npu_tiling_test.cpp with
the system C++ compiler into a temporary directory and runs it. Covers
V = 151936, V not a multiple of the 64-element alignment, N < core count,
N = 0, strided rows, vocab-shard label columns, argument validation, and the
shared online-softmax math streamed over the plan's tiles."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) found")
def test_npu_tiling(tmp_path):
    exe = tmp_path / "npu_tiling_test"
    build = subprocess.run(
        [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc"),
         os.path.join(ROOT, "tests", "npu_tiling_test.cpp"), "-o", str(exe)],
        capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks passed" in run.stdout, run.stdout
