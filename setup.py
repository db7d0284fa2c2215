"""Builds twinkle-mem's native libraries against the LibTorch stable ABI.

- _C_cpu: op schemas + CPU kernels; loads into any torch >= 2.10 (CPU or CUDA build).
- _C_cuda: CUDA kernels, built when nvcc is found (or FORCE_CUDA=1); the loader
  opens it only under a CUDA torch.
- _C_npu: AscendC kernels + torch_npu glue, built through CMake when CANN
  (ASCEND_HOME_PATH) and torch_npu are present.
Each is a py_limited_api (abi3) library loaded with torch.ops.load_library.

_C_cuda is built with whatever nvcc the machine has, whatever CUDA version the
build environment's torch was made for (the stable ABI needs only its headers
and libtorch_cuda), and links the CUDA runtime statically: it depends on no
libcudart soname, so it loads under a torch built for another CUDA major.
TWINKLE_MEM_SIMULATE_TORCH_CUDA=12.8 (CI) makes the build see that torch
version, to prove the point where only one nvcc is installed.

What the build left out, and why (no nvcc; nvcc found but the build environment's
torch is CPU-only; no CANN), goes where a user sees it: pip shows a build's output
only on failure or with -v, so the build also writes the line to the terminal
itself (/dev/tty, where there is one) and records it in the package
(twinkle_mem/_build_info.json), which `python -m twinkle_mem` and backends() report,
and which makes the first use of twinkle-mem under a CUDA torch warn.
"""
import json
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
import torch
import torch.utils.cpp_extension as cpp_ext
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

if os.environ.get("TWINKLE_MEM_SIMULATE_TORCH_CUDA"):  # CI: pretend torch was built for another CUDA
    torch.version.cuda = os.environ["TWINKLE_MEM_SIMULATE_TORCH_CUDA"]

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_TARGET_VERSION = "0x020a000000000000"  # stable ABI of torch 2.10
STABLE_DEFINES = [("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION), ("Py_LIMITED_API", "0x030A0000")]


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _find_nvcc():
    """The CUDA toolkit root: the first candidate holding bin/nvcc and include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a link or a wrapper script: try its real home, then the usual one.
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
                os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def _torch_has_cuda_libs():
    """The build environment's torch ships libtorch_cuda (which _C_cuda links)."""
    return bool(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.*")))


def cuda_decision():
    """Whether this build makes _C_cuda: (the CUDA toolkit root, None) to build it, or (None, why not) where it
    does not; a contradiction with FORCE_CUDA=1 ends the build."""
    if os.environ.get("TWINKLE_MEM_NO_CUDA") == "1":
        return None, "TWINKLE_MEM_NO_CUDA=1"
    cuda_home = _find_nvcc()
    forced = os.environ.get("FORCE_CUDA") == "1"
    if forced and cuda_home is None:
        sys.exit("FORCE_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    if cuda_home is None:
        return None, "no nvcc found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
    if not _torch_has_cuda_libs():
        if forced:
            sys.exit("FORCE_CUDA=1 but the build environment's torch has no CUDA libraries (libtorch_cuda)")
        return None, (f"nvcc found ({cuda_home}), but the build environment's torch {torch.__version__} is CPU-only "
                      "(no libtorch_cuda to link); to build it, install a CUDA build of torch and run "
                      "`pip install --no-build-isolation .`")
    return cuda_home, None


def tell_user(message):
    """A line the user sees: on stdout (pip shows it under -v), and, where pip captures the build's output (a
    plain `pip install .` shows none of it), on the terminal itself where the build has one."""
    print(message, flush=True)
    if sys.stdout.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\n{message}\n")
    except OSError:  # no terminal (CI, a log): stdout and _build_info.json carry it
        pass


def _nvcc_version(cuda_home):
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def check_cuda_version_any_nvcc(original, cuda_home):
    """torch's _check_cuda_version, but held against the nvcc found instead of the CUDA
    version torch was built with: a major mismatch is no error for a stable-ABI library
    (headers only; the CUDA runtime is linked statically). The compiler-bounds part of
    torch's check still runs for that nvcc."""

    def check(compiler_name, compiler_version):
        built_for = torch.version.cuda
        found = _nvcc_version(cuda_home)
        if found and built_for and found.split(".")[0] != built_for.split(".")[0]:
            print(f"twinkle-mem: nvcc {found} builds _C_cuda for a torch built with CUDA {built_for}: fine for "
                  "the stable ABI (the CUDA runtime is linked statically)")
        torch.version.cuda = found or built_for
        try:
            original(compiler_name, compiler_version)
        finally:
            torch.version.cuda = built_for

    return check


cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-psabi"]
# The argument checks throw; libtorch catches. Thrower and catcher must share one C++ runtime: a compiler that
# links libstdc++ statically by default (the H200 image's /opt/gcc g++ does) gave each library its own copy, and a
# failed check killed the process (SIGSEGV) instead of raising. On that image `-lstdc++` finds no shared linker
# name (g++ -print-file-name=libstdc++.so finds nothing, libstdc++.a is there), and at the end of the line it left
# _C_cuda without the shared runtime. So the shared object is named by file (-l:, never an archive), first among
# the libraries, right after the objects. tests/op/test_native_loading.py checks both libraries; the H200 runs are
# in bench/results/gpu_check_h200_2026-12-04_run2/fix_runs.log.
SHARED_CXX_RUNTIME = [":libstdc++.so.6"]
ext_modules = [
    CppExtension(
        name="twinkle_mem._C_cpu",
        sources=["csrc/ops.cpp"] + _rel("csrc/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=STABLE_DEFINES,
        extra_compile_args={"cxx": cxx_flags},
        libraries=list(SHARED_CXX_RUNTIME),  # a copy: the Extension classes append torch's own to it
        py_limited_api=True,
    )
]

cuda_home, CUDA_NOT_BUILT = cuda_decision()
cuda_sources = _rel("csrc/cuda/*.cu")
# No --use_fast_math: it implies -ftz=true, which flushes subnormal gradients
# (e^-100 in fp32/bf16) to 0; the contract wants them correctly rounded.
NVCC_FLAGS = ["-O3", "-std=c++17", "-Xptxas=-v", "-lineinfo"]
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"  # TORCH_CUDA_ARCH_LIST when unset


def gencode_flags(arch_list):
    """nvcc -gencode flags of a TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX": SASS for each,
    plus PTX for those marked +PTX), and the real archs (["sm_80", "sm_90"]).
    .ci/check_cuda_build.py compiles with the same."""
    flags, real = [], []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        num = arch.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        real.append(f"sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags, real


if cuda_home and cuda_sources:
    os.environ["CUDA_HOME"] = cuda_home
    cpp_ext.CUDA_HOME = cuda_home  # torch guesses /usr/local from /usr/local/bin/nvcc
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    gencode, _ = gencode_flags(arch_list)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    cuda_ext = CUDAExtension(
        name="twinkle_mem._C_cuda",
        sources=cuda_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=STABLE_DEFINES + [("USE_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": NVCC_FLAGS + gencode},
        # The runtime's symbols stay inside _C_cuda (no clash with torch's own libcudart).
        libraries=list(SHARED_CXX_RUNTIME),  # a copy: the Extension classes append torch's own to it
        extra_link_args=["-Wl,--exclude-libs,libcudart_static.a"],
        py_limited_api=True,
    )
    # Static CUDA runtime instead of libcudart.so.<major> (CUDAExtension links the shared one).
    cuda_ext.libraries = [lib for lib in cuda_ext.libraries if lib != "cudart"] + ["cudart_static", "rt", "pthread",
                                                                                  "dl"]
    cuda_ext.library_dirs.append(os.path.join(cuda_home, "lib64"))
    ext_modules.append(cuda_ext)


BUILD_INFO = "_build_info.json"  # in the package, beside the libraries: what this build left out, and why


class BuildExt(BuildExtension):
    """BuildExtension that accepts any nvcc (see check_cuda_version_any_nvcc), plus the
    CMake build of the AscendC library when CANN is present; says what it left out (tell_user) and records it
    in the package (BUILD_INFO, read by twinkle_mem/op/native.py)."""

    def build_extensions(self):
        original = cpp_ext._check_cuda_version
        if cuda_home:
            cpp_ext._check_cuda_version = check_cuda_version_any_nvcc(original, cuda_home)
        try:
            super().build_extensions()
        finally:
            cpp_ext._check_cuda_version = original

    def run(self):
        if CUDA_NOT_BUILT and _find_nvcc() and os.environ.get("TWINKLE_MEM_NO_CUDA") != "1":  # (asked for: silent)
            tell_user(f"twinkle-mem: not building the CUDA library (_C_cuda): {CUDA_NOT_BUILT}. CUDA tensors will "
                      "run the composite PyTorch fallback; `python -m twinkle_mem` shows this again.")
        super().run()
        npu_not_built = self._build_npu()
        info = {"torch": torch.__version__,
                "cuda": {"built": CUDA_NOT_BUILT is None, "why_not": CUDA_NOT_BUILT, "nvcc": _find_nvcc(),
                         "disabled": os.environ.get("TWINKLE_MEM_NO_CUDA") == "1"},
                "npu": {"built": npu_not_built is None, "why_not": npu_not_built}}
        for folder in {os.path.dirname(self.get_ext_fullpath(ext.name)) for ext in self.extensions}:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, BUILD_INFO), "w") as f:
                json.dump(info, f, indent=1)

    def get_outputs(self):
        return super().get_outputs() + [os.path.join(os.path.dirname(self.get_ext_fullpath(self.extensions[0].name)),
                                                     BUILD_INFO)]

    def _build_npu(self):
        """Build the AscendC library where CANN and torch_npu are present; returns why not (None where built)."""
        cann = os.environ.get("ASCEND_HOME_PATH")
        if not cann:
            return "ASCEND_HOME_PATH is not set (no CANN)"
        if not os.path.exists(os.path.join(ROOT, "csrc", "npu", "CMakeLists.txt")):
            return "csrc/npu/CMakeLists.txt is missing from this source"
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            tell_user("twinkle-mem: ASCEND_HOME_PATH is set but torch_npu is not importable; skipping NPU kernels")
            return "ASCEND_HOME_PATH is set, but torch_npu was not importable"
        build_dir = os.path.join(self.build_temp, "npu")
        out_dir = os.path.join(os.path.abspath(self.build_lib), "twinkle_mem")
        os.makedirs(build_dir, exist_ok=True)
        subprocess.check_call(
            ["cmake", ROOT, f"-DTWINKLE_MEM_NPU_OUTPUT_DIR={out_dir}", f"-DTWINKLE_MEM_PYTHON={sys.executable}",
             "-DCMAKE_BUILD_TYPE=Release"], cwd=build_dir
        )
        subprocess.check_call(["cmake", "--build", ".", "-j"], cwd=build_dir)
        if self.inplace:
            for so in glob.glob(os.path.join(out_dir, "_C_npu*.so")):
                shutil.copy(so, os.path.join(ROOT, "python", "twinkle_mem"))
        return None


STARTUP_PTH = "twinkle_mem_startup.pth"  # beside twinkle_mem_startup.py; see that module


class BuildPy(build_py):
    """build_py that also puts the start-up hook's .pth at the top of the wheel, so in site-packages;
    pip's RECORD then lists it, and `pip uninstall` removes it."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(ROOT, "python", STARTUP_PTH), os.path.join(self.build_lib, STARTUP_PTH),
                       preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, STARTUP_PTH)]


class EditableWheel(editable_wheel):
    """An editable wheel holds only setuptools' own path .pth, not build_py's files: add the hook's .pth
    beside it (the files setuptools writes into the wheel's top from this method go into site-packages).
    Both methods are setuptools' own, not public API: the check fails the build if the .pth is missing."""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(os.path.join(ROOT, "python", STARTUP_PTH), os.path.join(installation_dir, STARTUP_PTH))

    def _create_wheel_file(self, bdist_wheel):
        import zipfile
        path = super()._create_wheel_file(bdist_wheel)
        with zipfile.ZipFile(path) as wheel:
            if STARTUP_PTH not in wheel.namelist():
                raise RuntimeError(f"this setuptools' editable wheel lacks {STARTUP_PTH} (setup.py's EditableWheel "
                                   "needs updating for it); install without -e meanwhile")
        return path


if __name__ == "__main__":  # pip's build backend runs this file as __main__; tests import its helpers
    setup(
        packages=find_packages("python"),
        py_modules=["twinkle_mem_startup"],  # the start-up hook: TWINKLE_MEM_INSTALL, docs/cluster_jobs.md
        package_dir={"": "python"},
        package_data={"twinkle_mem": ["schemas.def"]},  # read by op/native.py when no native library loads
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExt.with_options(no_python_abi_suffix=True), "build_py": BuildPy,
                  "editable_wheel": EditableWheel},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
