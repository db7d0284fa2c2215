# Mock of CANN's ascendc.cmake for tests/backends/npu/test_npu_cmake.py: the functions the
# project calls, each recording its arguments in <build>/mock_ascendc.txt; the
# kernel library is a C stub of the launchers. CANN's host configuration sets
# CMAKE_SKIP_RPATH (host_config.cmake, bisheng_config.cmake): so does this.
set(CMAKE_SKIP_RPATH TRUE)
set(_MOCK_ASCENDC_DIR ${CMAKE_CURRENT_LIST_DIR})

function(_mock_ascendc_record)
  string(REPLACE ";" " " _line "${ARGN}")
  file(APPEND ${CMAKE_BINARY_DIR}/mock_ascendc.txt "${_line}\n")
endfunction()

function(ascendc_library target_name target_type)
  _mock_ascendc_record(library ${target_name} ${target_type} ${ARGN})
  add_library(${target_name} ${target_type} ${_MOCK_ASCENDC_DIR}/launch_stub.c)
  set_target_properties(${target_name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

function(ascendc_compile_definitions target_name target_scope)
  _mock_ascendc_record(definitions ${target_name} ${ARGN})
endfunction()

function(ascendc_include_directories target_name target_scope)
  _mock_ascendc_record(includes ${target_name} ${ARGN})
endfunction()

function(ascendc_compile_options target_name target_scope)
  _mock_ascendc_record(options ${target_name} ${ARGN})
endfunction()
