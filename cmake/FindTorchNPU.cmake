# Finds torch and torch_npu through the Python that will import the library.
#
# Input: TWINKLE_MEM_PYTHON (cache or environment), else Python3_EXECUTABLE, else
# the active virtualenv's / first python3 found.
# Output: TORCHNPU_FOUND, TORCHNPU_PYTHON, TORCH_INCLUDE_DIRS, TORCH_LIBRARY_DIR,
# TORCH_NPU_INCLUDE_DIRS, TORCH_NPU_LIBRARY_DIR, TORCH_CXX11_ABI (0/1),
# TORCH_VERSION, TWINKLE_MEM_NPU_CXX_STANDARD (20 for torch >= 2.10, whose ATen
# requires C++20; else 17).
include(FindPackageHandleStandardArgs)

if(NOT TWINKLE_MEM_PYTHON AND DEFINED ENV{TWINKLE_MEM_PYTHON})
  set(TWINKLE_MEM_PYTHON "$ENV{TWINKLE_MEM_PYTHON}")
endif()
if(NOT TWINKLE_MEM_PYTHON)
  if(NOT Python3_EXECUTABLE)
    set(Python3_FIND_VIRTUALENV FIRST)
    find_package(Python3 COMPONENTS Interpreter QUIET)
  endif()
  set(TWINKLE_MEM_PYTHON "${Python3_EXECUTABLE}")
endif()
set(TORCHNPU_PYTHON "${TWINKLE_MEM_PYTHON}")

execute_process(
  COMMAND ${TORCHNPU_PYTHON} -c "
import os, torch
import torch.utils.cpp_extension as ext
inc = ext.include_paths()
print(','.join(inc))
print(os.path.join(os.path.dirname(torch.__file__), 'lib'))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__.split('+')[0])
try:
    import torch_npu
    root = os.path.dirname(torch_npu.__file__)
    print(os.path.join(root, 'include') + ',' + os.path.join(root, 'include', 'third_party', 'acl', 'inc'))
    print(os.path.join(root, 'lib'))
except ImportError:
    print('')
    print('')
"
  OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_VARIABLE _err)
if(_rc EQUAL 0)
  string(REPLACE "\n" ";" _lines "${_out}")
  list(GET _lines 0 _torch_inc)
  string(REPLACE "," ";" TORCH_INCLUDE_DIRS "${_torch_inc}")
  list(GET _lines 1 TORCH_LIBRARY_DIR)
  list(GET _lines 2 TORCH_CXX11_ABI)
  list(GET _lines 3 TORCH_VERSION)
  list(GET _lines 4 _npu_inc)
  list(GET _lines 5 TORCH_NPU_LIBRARY_DIR)
  if(_npu_inc)
    string(REPLACE "," ";" TORCH_NPU_INCLUDE_DIRS "${_npu_inc}")
  endif()
  if(TORCH_VERSION VERSION_GREATER_EQUAL "2.10")
    set(TWINKLE_MEM_NPU_CXX_STANDARD 20)
  else()
    set(TWINKLE_MEM_NPU_CXX_STANDARD 17)
  endif()
else()
  message(STATUS "FindTorchNPU: ${TORCHNPU_PYTHON} could not report torch: ${_err}")
endif()

find_package_handle_standard_args(TorchNPU
  REQUIRED_VARS TORCHNPU_PYTHON TORCH_LIBRARY_DIR TORCH_NPU_LIBRARY_DIR TORCH_NPU_INCLUDE_DIRS
  VERSION_VAR TORCH_VERSION
  FAIL_MESSAGE "torch and torch_npu must be importable by ${TORCHNPU_PYTHON} (set -DTWINKLE_MEM_PYTHON=<python>)")
