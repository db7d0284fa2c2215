"""Builds twinkle-mem's native libraries against the LibTorch stable ABI.

- _C_cpu: op schemas + CPU kernels; loads into any torch >= 2.10 (CPU or CUDA build).
- _C_cuda: CUDA kernels, built when nvcc is found (or FORCE_CUDA=1); the loader
  opens it only under a CUDA torch.
- _C_npu: AscendC kernels + torch_npu glue, built through CMake when CANN
  (ASCEND_HOME_PATH) and torch_npu are present.
Each is a py_limited_api (abi3) library loaded with torch.ops.load_library.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

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


def _want_cuda():
    if os.environ.get("TWINKLE_MEM_NO_CUDA") == "1":
        return None
    cuda_home = _find_nvcc()
    if os.environ.get("FORCE_CUDA") == "1" and cuda_home is None:
        sys.exit("FORCE_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    return cuda_home


cxx_flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-psabi"]
ext_modules = [
    CppExtension(
        name="twinkle_mem._C_cpu",
        sources=["csrc/ops.cpp"] + _rel("csrc/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=STABLE_DEFINES,
        extra_compile_args={"cxx": cxx_flags},
        py_limited_api=True,
    )
]

cuda_home = _want_cuda()
cuda_sources = _rel("csrc/cuda/*.cu")
if cuda_home and cuda_sources:
    os.environ["CUDA_HOME"] = cuda_home
    import torch.utils.cpp_extension as cpp_ext

    cpp_ext.CUDA_HOME = cuda_home  # torch guesses /usr/local from /usr/local/bin/nvcc
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    gencode = []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        ptx = arch.endswith("+PTX")
        num = arch.replace("+PTX", "").replace(".", "")
        gencode.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            gencode.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    ext_modules.append(
        CUDAExtension(
            name="twinkle_mem._C_cuda",
            sources=cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=STABLE_DEFINES + [("USE_CUDA", None)],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-Xptxas=-v", "-lineinfo"] + gencode,
            },
            py_limited_api=True,
        )
    )


class BuildExt(BuildExtension):
    """BuildExtension, plus the CMake build of the AscendC library when CANN is present."""

    def run(self):
        super().run()
        self._build_npu()

    def _build_npu(self):
        cann = os.environ.get("ASCEND_HOME_PATH")
        if not cann or not os.path.exists(os.path.join(ROOT, "csrc", "npu", "CMakeLists.txt")):
            return
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            print("twinkle-mem: ASCEND_HOME_PATH is set but torch_npu is not importable; skipping NPU kernels")
            return
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


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt.with_options(no_python_abi_suffix=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
