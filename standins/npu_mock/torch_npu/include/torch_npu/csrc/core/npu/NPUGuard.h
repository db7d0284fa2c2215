// Declarations of the torch_npu 2.14 device guard the twinkle_mem glue uses, for the build check.
#pragma once
#include <c10/core/Device.h>

namespace c10_npu {
struct NPUGuard {
  explicit NPUGuard(c10::Device device);
  ~NPUGuard();
};
}  // namespace c10_npu
