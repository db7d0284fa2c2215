# Finds the CANN toolkit for building AscendC kernels.
#
# Input (cache variable or environment): ASCEND_HOME_PATH (set by CANN's
# set_env.sh), SOC_VERSION (e.g. Ascend910B2; detected from the first NPU
# through torch_npu when not given).
# Output: CANN_FOUND, ASCEND_HOME_PATH, SOC_VERSION, ASCENDC_CMAKE_DIR (holding
# ascendc.cmake, which provides ascendc_library()), CANN_INCLUDE_DIRS,
# CANN_LIBRARY_DIRS, TWINKLE_MEM_NPU_HAS_BF16.
include(FindPackageHandleStandardArgs)

if(NOT ASCEND_HOME_PATH AND DEFINED ENV{ASCEND_HOME_PATH})
  set(ASCEND_HOME_PATH "$ENV{ASCEND_HOME_PATH}")
endif()
if(NOT ASCEND_HOME_PATH AND DEFINED ENV{ASCEND_TOOLKIT_HOME})
  set(ASCEND_HOME_PATH "$ENV{ASCEND_TOOLKIT_HOME}")
endif()
set(ASCEND_HOME_PATH "${ASCEND_HOME_PATH}" CACHE PATH "CANN toolkit root (source set_env.sh)")

# ascendc.cmake moved between CANN releases; look in each known place.
find_path(ASCENDC_CMAKE_DIR ascendc.cmake
  PATHS
    ${ASCEND_HOME_PATH}/compiler/tikcpp/ascendc_kernel_cmake
    ${ASCEND_HOME_PATH}/tools/tikcpp/ascendc_kernel_cmake
    ${ASCEND_HOME_PATH}/ascendc_devkit/tikcpp/samples/cmake
    ${ASCEND_HOME_PATH}/aarch64-linux/tikcpp/ascendc_kernel_cmake
    ${ASCEND_HOME_PATH}/x86_64-linux/tikcpp/ascendc_kernel_cmake
  NO_DEFAULT_PATH)

if(NOT SOC_VERSION AND DEFINED ENV{SOC_VERSION})
  set(SOC_VERSION "$ENV{SOC_VERSION}")
endif()
if(NOT SOC_VERSION AND TORCHNPU_PYTHON)
  # The SoC of NPU 0, as torch_npu names it (Ascend910B2, Ascend910_9392, ...).
  execute_process(
    COMMAND ${TORCHNPU_PYTHON} -c "import torch, torch_npu; print(torch_npu.npu.get_device_name(0))"
    OUTPUT_VARIABLE _soc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _soc_rc)
  if(_soc_rc EQUAL 0 AND _soc)
    set(SOC_VERSION "${_soc}")
  endif()
endif()
set(SOC_VERSION "${SOC_VERSION}" CACHE STRING "Ascend SoC to compile the kernels for (e.g. Ascend910B2)")

# bf16 vector instructions exist from the 220 architecture on: Atlas A2 (910B*),
# A3 (910_93*) and 950; not on 310P / 310B / the first-generation 910. SoC names
# come in any case (Ascend910B2, ascend910b2, Ascend910_9392, Ascend950PR_9599):
# the same rule as soc_supports_bf16() in csrc/npu/tiling.h.
string(TOLOWER "${SOC_VERSION}" _soc_lower)
if(_soc_lower MATCHES "^ascend(910b|910_93|950)")
  set(TWINKLE_MEM_NPU_HAS_BF16 ON)
else()
  set(TWINKLE_MEM_NPU_HAS_BF16 OFF)
  if(SOC_VERSION)
    message(STATUS "FindCANN: ${SOC_VERSION} has no bf16 vector instructions: bf16 kernels are not built")
  endif()
endif()

set(CANN_INCLUDE_DIRS ${ASCEND_HOME_PATH}/include)
set(CANN_LIBRARY_DIRS ${ASCEND_HOME_PATH}/lib64)

find_package_handle_standard_args(CANN
  REQUIRED_VARS ASCEND_HOME_PATH ASCENDC_CMAKE_DIR SOC_VERSION
  FAIL_MESSAGE "CANN not found: source <CANN>/set_env.sh (ASCEND_HOME_PATH), and pass -DSOC_VERSION=<soc> if no NPU is visible")
