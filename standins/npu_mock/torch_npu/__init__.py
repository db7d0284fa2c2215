"""An empty stand-in of the torch_npu package for tests/test_npu_cmake.py (headers in include/)."""
