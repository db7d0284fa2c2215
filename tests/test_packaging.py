"""The Apache-2.0 license text ships in the sdist and the wheel (and so in the installed .dist-info); the
wheel holds the package and the start-up hook, and pip installs and uninstalls the hook (wheel and editable)."""
import importlib.metadata
import os
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
    assert HOOK_FILES <= set(names) and "twinkle_mem/_C_cpu.so" in names, names


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
