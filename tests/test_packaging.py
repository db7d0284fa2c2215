"""The Apache-2.0 license text ships in the sdist and the wheel (and so in the installed .dist-info); the
wheel holds the package and the start-up hook, and pip installs and uninstalls the hook (wheel and editable).
Issue 42: what the build leaves out (the CUDA library under a CPU-only torch, nvcc present) reaches the user:
the terminal during a plain `pip install .`, the package's record, `python -m twinkle_mem`, a warning under a
CUDA torch."""
import importlib.metadata
import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LICENSE = (ROOT / "LICENSE").read_bytes()


def test_license_is_the_apache_2_0_text():
    text = LICENSE.decode()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for line in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "END OF TERMS AND CONDITIONS",
                 "limitations under the License."):
        assert line in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


HOOK_FILES = {"twinkle_mem_startup.py", "twinkle_mem_startup.pth"}  # the start-up hook (TWINKLE_MEM_INSTALL)


def _source_copy(dest):
    # (the build leaves egg-info and build/ behind: build in a copy of the source tree)
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "build", "dist", ".whl", "*.so", "*.egg-info",
                                                              "__pycache__", "results"))
    return dest


def _build(src, out, hooks):
    # The PEP 517 hooks pip calls, without build isolation (the venv's setuptools and torch); the CPU library only.
    # (the path read first: build_meta rewrites sys.argv)
    calls = "; ".join(f"b.{hook}(out)" for hook in hooks)
    proc = subprocess.run([sys.executable, "-c", f"import sys; from setuptools import build_meta as b; "
                           f"out = sys.argv[1]; {calls}", str(out)],
                          cwd=src, env=dict(os.environ, TWINKLE_MEM_NO_CUDA="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist and the wheel, built once for this module."""
    tmp = tmp_path_factory.mktemp("packaging")
    _build(_source_copy(tmp / "src"), tmp / "dist", ("build_sdist", "build_wheel"))
    (sdist,) = (tmp / "dist").glob("twinkle_mem-*.tar.gz")
    (wheel,) = (tmp / "dist").glob("twinkle_mem-*.whl")
    return sdist, wheel


@pytest.mark.e2e  # (every test of the built sdist and wheels: the end-to-end tier)
def test_sdist_and_wheel_hold_the_license(built):
    sdist, wheel = built
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        assert tar.extractfile(f"{top}/LICENSE").read() == LICENSE
        assert b"License-File: LICENSE" in tar.extractfile(f"{top}/PKG-INFO").read()
    with zipfile.ZipFile(wheel) as whl:
        (dist_info,) = {n.split("/")[0] for n in whl.namelist() if n.split("/")[0].endswith(".dist-info")}
        # the package and its start-up hook alone: no stand-in (standins/), no test
        assert {n.split("/")[0] for n in whl.namelist()} == {"twinkle_mem", dist_info, *HOOK_FILES}, whl.namelist()
        assert whl.read(f"{dist_info}/licenses/LICENSE") == LICENSE
        metadata = whl.read(f"{dist_info}/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert wheel.name.endswith("-cp310-abi3-linux_x86_64.whl"), wheel.name  # still one abi3 wheel


@pytest.mark.e2e
def test_a_wheel_built_from_the_sdist_holds_the_package_and_the_hook(built, tmp_path):
    # what pip does where no wheel fits the machine (another CPU, an NPU host): build from the sdist
    with tarfile.open(built[0]) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = tmp_path.glob("twinkle_mem-*")
    _build(src, tmp_path / "dist", ("build_wheel",))
    (wheel,) = (tmp_path / "dist").glob("twinkle_mem-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        info = json.loads(whl.read("twinkle_mem/_build_info.json"))  # what the build left out, and why
    assert HOOK_FILES <= set(names) and "twinkle_mem/_C_cpu.so" in names, names
    assert info["cuda"] == {"built": False, "why_not": "TWINKLE_MEM_NO_CUDA=1", "nvcc": info["cuda"]["nvcc"],
                            "disabled": True}
    assert info["npu"]["built"] is False and info["npu"]["why_not"] and info["torch"]


def _bare_venv(path):
    """A fresh virtual environment with pip and nothing else; returns (python, site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def _pip(python, *args):
    proc = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _ours(site):
    return sorted(p.name for p in site.iterdir() if p.name.startswith("twinkle_mem"))


HOOK_ACTIVE = "import sys, twinkle_mem_startup as m; print(m.__file__, any(type(f).__name__ == 'TwinkleImportHook' for f in sys.meta_path))"


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_install_puts_the_start_up_hook_in_site_packages_and_uninstall_removes_it(built, tmp_path, kind):
    """pip install (of the wheel, or editable) puts the .pth and its module where every interpreter start of
    that environment runs them; pip uninstall leaves nothing of twinkle-mem in site-packages."""
    python, site = _bare_venv(tmp_path / "venv")
    if kind == "wheel":
        target, source = built[1], site
    else:
        src = _source_copy(tmp_path / "src")
        _build(src, tmp_path / "dist", ("build_editable",))
        (target,) = (tmp_path / "dist").glob("twinkle_mem-*.whl")
        source = src / "python"  # the editable install runs the source tree's module
    _pip(python, "install", "--no-deps", "--no-index", str(target))
    assert (site / "twinkle_mem_startup.pth").read_text() == (ROOT / "python" / "twinkle_mem_startup.pth").read_text()
    started = subprocess.run([python, "-c", HOOK_ACTIVE], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr  # (torch is not in this venv: the hook needs none of it)
    assert started.stdout.split() == [str(source / "twinkle_mem_startup.py"), "True"]
    _pip(python, "uninstall", "-y", "twinkle-mem")
    assert _ours(site) == []
    after = subprocess.run([python, "-c", "import sys; print(any(type(f).__name__ == 'TwinkleImportHook' "
                            "for f in sys.meta_path))"], capture_output=True, text=True, timeout=60)
    assert after.stdout.strip() == "False" and after.stderr == ""


def test_installed_package_holds_the_license():
    # CI tests the pip-installed package: its distribution carries the license. In a source checkout
    # (PYTHONPATH=python) nothing is installed; the wheel built above is the check there.
    import twinkle_mem
    if Path(twinkle_mem.__file__).resolve().is_relative_to(ROOT):
        return
    dist = importlib.metadata.distribution("twinkle-mem")
    licenses = [f for f in dist.files or () if f.name == "LICENSE"]
    assert licenses and licenses[0].read_binary() == LICENSE


# ------------------------------------------------------------------ issue 42: what the build left out, told
def _setup(monkeypatch, nvcc, cuda_libs, **env):
    """setup.py's namespace (setup() not run) with nvcc found at ``nvcc`` (or not) and a build torch with or
    without libtorch_cuda."""
    for name in ("TWINKLE_MEM_NO_CUDA", "FORCE_CUDA"):
        monkeypatch.delenv(name, raising=False)
    ns = runpy.run_path(str(ROOT / "setup.py"), run_name="twinkle_mem_setup")
    functions = ns["cuda_decision"].__globals__  # (run_path returns a copy of them)
    functions["_find_nvcc"] = lambda: nvcc
    functions["_torch_has_cuda_libs"] = lambda: cuda_libs
    for name, value in env.items():  # (after: setup.py decides once as it loads)
        monkeypatch.setenv(name, value)
    return ns


def test_the_cuda_decision_says_why_not(monkeypatch):
    import torch
    ns = _setup(monkeypatch, "/opt/cuda", False)
    home, why = ns["cuda_decision"]()  # this machine's case: nvcc, a CPU-only torch in the build environment
    assert home is None and why.startswith("nvcc found (/opt/cuda), but the build environment's torch")
    assert f"torch {torch.__version__} is CPU-only" in why and "`pip install --no-build-isolation .`" in why
    assert _setup(monkeypatch, "/opt/cuda", True)["cuda_decision"]() == ("/opt/cuda", None)
    assert _setup(monkeypatch, None, True)["cuda_decision"]() == (None, "no nvcc found (CUDA_HOME, CUDA_PATH, PATH, "
                                                                        "/usr/local/cuda)")
    ns = _setup(monkeypatch, "/opt/cuda", True, TWINKLE_MEM_NO_CUDA="1")
    assert ns["cuda_decision"]() == (None, "TWINKLE_MEM_NO_CUDA=1")
    ns = _setup(monkeypatch, "/opt/cuda", False, FORCE_CUDA="1")
    with pytest.raises(SystemExit, match="FORCE_CUDA=1 but the build environment's torch has no CUDA"):
        ns["cuda_decision"]()


def test_the_build_tells_the_terminal_where_pip_hides_its_output(monkeypatch, capsys):
    # pip captures the build's stdout (shown only with -v or on failure): the line also goes to /dev/tty.
    ns = _setup(monkeypatch, None, False)
    written = []

    class Tty:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            written.append(text)

    opened = []
    monkeypatch.setitem(ns["tell_user"].__globals__, "open", lambda path, mode: opened.append(path) or Tty())
    ns["tell_user"]("twinkle-mem: not building the CUDA library")
    assert capsys.readouterr().out == "twinkle-mem: not building the CUDA library\n"  # (stdout: pip -v)
    assert opened == ["/dev/tty"] and written == ["\ntwinkle-mem: not building the CUDA library\n"]

    def no_tty(path, mode):
        raise OSError(6, "No such device or address")
    monkeypatch.setitem(ns["tell_user"].__globals__, "open", no_tty)
    ns["tell_user"]("no terminal")  # CI, a log: stdout (and the package's record) only
    assert capsys.readouterr().out == "no terminal\n"


SKIPPED = {"torch": "x", "cuda": {"built": False, "why_not": "nvcc found (/opt/cuda), but the build environment's "
                                  "torch x is CPU-only", "nvcc": "/opt/cuda", "disabled": False},
           "npu": {"built": False, "why_not": "ASCEND_HOME_PATH is not set (no CANN)"}}
WARNS = r"""
import json, sys, warnings, torch
torch.version.cuda = "13.0"  # a CUDA torch (the loader looks for _C_cuda)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import twinkle_mem
    backends = twinkle_mem.backends()
print(json.dumps({"backends": backends, "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}))
"""


@pytest.mark.parametrize("record", ["skipped", "disabled", "none"])
def test_the_package_says_what_its_build_left_out(tmp_path, record):
    # backends() and `python -m twinkle_mem` name why a library is not built; a CUDA torch warns where nvcc was
    # there and the build skipped the CUDA library anyway (not where TWINKLE_MEM_NO_CUDA=1 asked for that).
    import twinkle_mem
    pkg = tmp_path / "twinkle_mem"
    shutil.copytree(Path(twinkle_mem.__file__).parent, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__",
                                                                                          "_build_info.json"))
    info = json.loads(json.dumps(SKIPPED))
    if record == "disabled":
        info["cuda"].update(why_not="TWINKLE_MEM_NO_CUDA=1", disabled=True)
    if record != "none":
        (pkg / "_build_info.json").write_text(json.dumps(info))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    cli = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    got = json.loads(subprocess.run([sys.executable, "-c", WARNS], capture_output=True, text=True, env=env,
                                    cwd=tmp_path, timeout=300).stdout.splitlines()[-1])
    if record == "none":  # a tree never built (or before the record): as before
        assert "  cuda  library not built; GPU:" in cli.stdout and got["backends"]["cuda"] == "not built"
        assert got["warnings"] == []
        return
    why = info["cuda"]["why_not"]
    assert f"  cuda  library not built (at build time: {why}); GPU:" in cli.stdout, cli.stdout
    assert "  npu   not built (at build time: ASCEND_HOME_PATH is not set (no CANN))" in cli.stdout
    assert got["backends"]["cuda"] == f"not built (at build time: {why})"
    if record == "skipped":
        assert got["warnings"] == [f"twinkle-mem's CUDA library was not built ({why}): CUDA tensors run the composite "
                                   "PyTorch fallback (`python -m twinkle_mem` lists the backends)"]
    else:
        assert got["warnings"] == []
