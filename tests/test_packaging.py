"""The Apache-2.0 license text ships in the sdist and the wheel (and so in the installed .dist-info)."""
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LICENSE = (ROOT / "LICENSE").read_bytes()


def test_license_is_the_apache_2_0_text():
    text = LICENSE.decode()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for line in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "END OF TERMS AND CONDITIONS",
                 "limitations under the License."):
        assert line in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_sdist_and_wheel_hold_the_license(tmp_path):
    # The PEP 517 hooks pip calls, without build isolation (the venv's setuptools and torch), in a copy
    # of the source tree (the build leaves egg-info and build/ behind); the wheel compiles the CPU
    # library only.
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", ".whl", "*.so", "*.egg-info",
                                                             "__pycache__", "results"))
    env = dict(os.environ, TWINKLE_MEM_NO_CUDA="1")
    # (the path read first: build_meta rewrites sys.argv)
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                           "out = sys.argv[1]; b.build_sdist(out); b.build_wheel(out)", str(dist)],
                          cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sdist,) = dist.glob("twinkle_mem-*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        assert tar.extractfile(f"{top}/LICENSE").read() == LICENSE
        assert b"License-File: LICENSE" in tar.extractfile(f"{top}/PKG-INFO").read()
    (wheel,) = dist.glob("twinkle_mem-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        (dist_info,) = {n.split("/")[0] for n in whl.namelist() if n.split("/")[0].endswith(".dist-info")}
        # the package alone: no device stand-in (tests/standins/), no CPU harness (cpu_harness/)
        assert {n.split("/")[0] for n in whl.namelist()} == {"twinkle_mem", dist_info}, whl.namelist()
        assert whl.read(f"{dist_info}/licenses/LICENSE") == LICENSE
        metadata = whl.read(f"{dist_info}/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_installed_package_holds_the_license():
    # CI tests the pip-installed package: its distribution carries the license. In a source checkout
    # (PYTHONPATH=python) nothing is installed; the wheel built above is the check there.
    import twinkle_mem
    if Path(twinkle_mem.__file__).resolve().is_relative_to(ROOT):
        return
    dist = importlib.metadata.distribution("twinkle-mem")
    licenses = [f for f in dist.files or () if f.name == "LICENSE"]
    assert licenses and licenses[0].read_binary() == LICENSE
