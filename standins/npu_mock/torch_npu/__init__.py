"""An empty stand-in of the torch_npu package for tests/backends/npu/test_npu_cmake.py (headers in include/)."""
