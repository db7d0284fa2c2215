"""Build check of the NPU CMake project without CANN or torch_npu.

Configures the real top-level CMakeLists.txt (cmake/FindCANN.cmake,
cmake/FindTorchNPU.cmake, csrc/npu/CMakeLists.txt) against a mock CANN whose
ascendc.cmake records its calls and sets CMAKE_SKIP_RPATH as CANN's does, and a
mock torch_npu package (headers that declare the torch_npu / ACL API the glue
calls; standins/npu_mock/), then builds _C_npu: the real glue compiled against
this machine's torch headers, linked against empty stub libraries. Checks:
  - _C_npu carries $ORIGIN in its run path despite CMAKE_SKIP_RPATH;
  - ASCENDC_DUMP=0 reaches the kernel library in Release, not in Debug;
  - bf16 kernels are built exactly for the 910B / 910_93 / 950 families, any case.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MOCK = os.path.join(ROOT, "standins", "npu_mock")
CMAKE = shutil.which("cmake")
CC = shutil.which("gcc") or shutil.which("cc")
READELF = shutil.which("readelf")

pytestmark = pytest.mark.skipif(not (CMAKE and CC and READELF), reason="needs cmake, a C compiler and readelf")


def _stub_library(path, cc):
    """An empty shared library named `path` (the link needs -ltorch_npu / -lascendcl to resolve)."""
    src = path + ".c"
    with open(src, "w") as f:
        f.write("int twinkle_mem_mock_stub;\n")
    subprocess.run([cc, "-shared", "-fPIC", src, "-o", path], check=True, capture_output=True)


@pytest.fixture(scope="module")
def mock_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("npu_cmake")
    cann = base / "cann"
    shutil.copytree(os.path.join(MOCK, "cann"), cann)
    (cann / "include").mkdir()
    (cann / "lib64").mkdir()
    _stub_library(str(cann / "lib64" / "libascendcl.so"), CC)
    site = base / "site"
    shutil.copytree(os.path.join(MOCK, "torch_npu"), site / "torch_npu")
    (site / "torch_npu" / "lib").mkdir()
    _stub_library(str(site / "torch_npu" / "lib" / "libtorch_npu.so"), CC)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["ASCEND_HOME_PATH"] = str(cann)
    env.pop("SOC_VERSION", None)
    return base, env


def _configure(build, env, soc, build_type="Release"):
    build.mkdir(exist_ok=True)
    record = build / "mock_ascendc.txt"
    if record.exists():
        record.unlink()
    proc = subprocess.run([CMAKE, "-S", ROOT, "-B", str(build), f"-DSOC_VERSION={soc}",
                           f"-DCMAKE_BUILD_TYPE={build_type}", f"-DTWINKLE_MEM_PYTHON={sys.executable}",
                           f"-DTWINKLE_MEM_NPU_OUTPUT_DIR={build / 'out'}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return record.read_text()


@pytest.mark.e2e  # (the whole CMake build: the end-to-end tier)
def test_build_links_origin_rpath_and_turns_dump_off(mock_env):
    base, env = mock_env
    build = base / "release"
    calls = _configure(build, env, "Ascend910B2")
    assert "definitions twinkle_mem_npu_kernels -DASCENDC_DUMP=0" in calls, calls
    assert "TWINKLE_MEM_NPU_NO_BF16" not in calls, calls
    assert "library twinkle_mem_npu_kernels STATIC" in calls and "selective_log_softmax_kernel.cpp" in calls
    proc = subprocess.run([CMAKE, "--build", str(build), "-j", "2"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "warning" not in proc.stdout.lower() + proc.stderr.lower(), proc.stdout[-4000:] + proc.stderr[-4000:]
    so = build / "out" / "_C_npu.so"
    assert so.exists()
    dyn = subprocess.run([READELF, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    paths = [line.split("[", 1)[1].rstrip("]") for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line]
    assert any("$ORIGIN" in p.split(":") for p in paths), paths  # exactly $ORIGIN, not $$ORIGIN


def test_debug_keeps_dump(mock_env):
    base, env = mock_env
    calls = _configure(base / "debug", env, "Ascend910B2", build_type="Debug")
    assert "ASCENDC_DUMP" not in calls, calls


@pytest.mark.parametrize("soc,bf16", [("ascend910b4", True), ("Ascend910_9392", True), ("Ascend950PR_9599", True),
                                      ("Ascend310P3", False), ("Ascend910A", False), ("Ascend910", False)])
def test_bf16_kernels_follow_the_soc(mock_env, soc, bf16):
    base, env = mock_env
    calls = _configure(base / "socs", env, soc)
    assert ("TWINKLE_MEM_NPU_NO_BF16" not in calls) == bf16, calls
