"""Installable and importable anywhere: a native library that fails to load never
breaks `import twinkle_mem` (the composite runs, backends() says why), the schemas
are written once, and the build accepts any nvcc (setup.py).

Each load scenario runs in a fresh interpreter on a copy of the package whose
libraries are replaced by a deliberately broken file.
"""
import glob
import json
import os
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

import twinkle_mem
from twinkle_mem.op import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.dirname(os.path.abspath(twinkle_mem.__file__))  # the package under test: installed in CI

PROBE = r"""
import json, sys, torch
if len(sys.argv) > 1:
    torch.version.cuda = sys.argv[1]  # pretend a CUDA torch, so that the loader opens _C_cuda
import twinkle_mem
x = torch.randn(4, 300, dtype=torch.float64, requires_grad=True)
y = torch.tensor([1, 2, 299, 0])
logp, entropy = twinkle_mem.selective_log_softmax(x, y, True)
(grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), x)
ref = x.detach().log_softmax(-1)
x2 = x.detach().clone().requires_grad_(True)
r = x2.log_softmax(-1)
(g2,) = torch.autograd.grad(r.gather(1, y[:, None]).sum() - (r.exp() * r).sum(), x2)
ok = torch.allclose(logp, ref.gather(1, y[:, None])[:, 0]) and torch.allclose(grad, g2)
cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("twinkle_mem::selective_log_softmax_fwd", "CPU")
print(json.dumps({"backends": twinkle_mem.backends(), "ok": bool(ok), "native_cpu_kernel": cpu_kernel}))
"""


def _package_copy(tmp_path, libs):
    """A copy of the package whose native libraries are `libs` ({name: bytes or a path to copy})."""
    dst = tmp_path / "twinkle_mem"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name, content in libs.items():
        if isinstance(content, bytes):
            (dst / name).write_bytes(content)
        else:
            shutil.copy(content, dst / name)
    return tmp_path


def _probe(path, *args):
    env = dict(os.environ, PYTHONPATH=str(path))
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env,
                          cwd=str(path))
    assert proc.returncode == 0, f"import twinkle_mem failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_lib():
    hits = glob.glob(os.path.join(PKG, "_C_cpu*.so"))
    if not hits:
        pytest.skip(f"_C_cpu is not built in {PKG}")
    return hits[0]


CORRUPT = b"\x7fELF" + b"\x00" * 60 + b"not a shared library" * 10


def test_corrupt_cpu_library_falls_back_to_the_composite(tmp_path):
    out = _probe(_package_copy(tmp_path, {"_C_cpu.so": CORRUPT}))
    assert out["backends"]["cpu"].startswith("failed to load (_C_cpu.so: "), out
    assert native.FALLBACK in out["backends"]["cpu"]
    assert not out["native_cpu_kernel"] and out["ok"], out


def test_missing_cpu_library_falls_back_to_the_composite(tmp_path):
    out = _probe(_package_copy(tmp_path, {}))
    assert out["backends"]["cpu"].startswith("not built"), out
    assert out["ok"], out


def test_corrupt_cuda_library_is_reported_and_the_cpu_kernels_still_load(tmp_path):
    out = _probe(_package_copy(tmp_path, {"_C_cpu.so": _cpu_lib(), "_C_cuda.so": CORRUPT}), "13.0")
    assert out["backends"]["cpu"] == "loaded", out
    assert out["backends"]["cuda"].startswith("failed to load (_C_cuda.so: "), out
    assert out["native_cpu_kernel"] and out["ok"], out


def test_cli_says_why(tmp_path):
    path = _package_copy(tmp_path, {"_C_cpu.so": CORRUPT})
    env = dict(os.environ, PYTHONPATH=str(path))
    proc = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, env=env,
                          cwd=str(path))
    assert proc.returncode == 0, proc.stderr
    assert "cpu   failed to load (_C_cpu.so:" in proc.stdout and native.FALLBACK in proc.stdout, proc.stdout


def test_schemas_are_written_once():
    """The schemas the native library registers are the text op/native.py reads from schemas.def."""
    if twinkle_mem.backends()["cpu"] != "loaded":
        pytest.skip("_C_cpu is not loaded")
    registered = {str(getattr(torch.ops.twinkle_mem, s.split("(")[0]).default._schema) for s in native.schemas()}
    parsed = {f"twinkle_mem::{s}" for s in native.schemas()}
    assert len(parsed) == 3 and registered == parsed


# ----------------------------------------------------------------- the build
def _nvcc_home():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def test_build_accepts_an_nvcc_of_another_major(monkeypatch):
    """torch's own check refuses an nvcc whose major differs from torch.version.cuda; setup.py's
    check holds the nvcc against itself (simulated: torch.version.cuda one major away)."""
    home = _nvcc_home()
    if home is None:
        pytest.skip("no nvcc")
    import torch.utils.cpp_extension as cpp_ext

    setup_ns = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="twinkle_mem_setup")  # setup() not run
    nvcc = setup_ns["_nvcc_version"](home)
    other = f"{int(nvcc.split('.')[0]) - 1}.8"
    monkeypatch.setattr(cpp_ext, "CUDA_HOME", home)
    monkeypatch.setattr(torch.version, "cuda", other)
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")
    compiler = ("gcc", cpp_ext.TorchVersion("12.2.0"))
    with pytest.raises(RuntimeError):
        cpp_ext._check_cuda_version(*compiler)  # torch's check: major mismatch
    setup_ns["check_cuda_version_any_nvcc"](cpp_ext._check_cuda_version, home)(*compiler)
    assert torch.version.cuda == other, "the check restores torch.version.cuda"


def test_cuda_build_keeps_subnormals():
    """No --use_fast_math, no -ftz=true in the CUDA build (docs/cuda.md, "No fast math"): they flush
    subnormal gradients to 0 (the kernels' one .ftz instruction never sees one: test_cuda_emulation.py)."""
    setup_ns = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="twinkle_mem_setup")  # setup() not run
    flags = setup_ns["NVCC_FLAGS"] + setup_ns["gencode_flags"](setup_ns["DEFAULT_CUDA_ARCHS"])[0]
    flushing = [f for f in flags if "fast_math" in f.replace("-", "_") or "ftz=true" in f or "ftz true" in f]
    assert not flushing, f"the CUDA build flushes subnormals: {flushing}"


def test_built_cuda_library_needs_no_cudart_soname():
    libs = glob.glob(os.path.join(PKG, "_C_cuda*.so"))
    if not libs or shutil.which("readelf") is None:
        pytest.skip(f"no _C_cuda built in {PKG} (or no readelf)")
    dynamic = subprocess.run(["readelf", "-d", libs[0]], capture_output=True, text=True).stdout
    assert "libcudart" not in dynamic, dynamic


def _built_libraries():
    return [pytest.param(lib, id=name) for name in ("cpu", "cuda")
            for lib in glob.glob(os.path.join(PKG, f"_C_{name}*.so"))]


@pytest.mark.parametrize("lib", _built_libraries())
def test_native_library_shares_libtorchs_cxx_runtime(lib):
    """The argument checks throw and libtorch catches: one libstdc++ for both (setup.py's SHARED_CXX_RUNTIME).
    A statically linked copy crashed the process on the H200 image instead of raising."""
    if shutil.which("readelf") is None:
        pytest.fail("readelf (binutils) is needed to read the library's dynamic section")
    dynamic = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in dynamic, dynamic


FAILED_CHECK = r"""
import sys, torch, twinkle_mem
device = sys.argv[1]
x = torch.randn(4, 10, device=device)
y = torch.randint(0, 10, (2,), device=device)
try:
    torch.ops.twinkle_mem.selective_log_softmax_fwd(x, y, 1.0, -100, 0, 10, False, False)
except RuntimeError as e:
    print(e)
"""


@pytest.mark.parametrize("on", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or twinkle_mem.backends().get("cuda") != "loaded",
    reason="needs a GPU and the CUDA library loaded"))])
def test_failed_check_raises_whole_in_a_fresh_process(on):
    """A failed argument check is a RuntimeError with its whole message, not a crash (a fresh interpreter: a
    crash must not take the test run with it)."""
    proc = subprocess.run([sys.executable, "-c", FAILED_CHECK, on], capture_output=True, text=True)
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-1500:]}"
    assert "twinkle_mem: labels must have the logits' leading shape" in proc.stdout, proc.stdout + proc.stderr[-1500:]
