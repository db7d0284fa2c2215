// Declarations of the torch_npu 2.14 stream API the twinkle_mem glue uses, for the build check.
#pragma once
#include <acl/acl.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace c10_npu {
class NPUStream {
 public:
  c10::StreamId id() const;
  aclrtStream stream() const;
  aclrtStream stream(const bool need_empty) const;  // false: without emptying the task queue
};
NPUStream getCurrentNPUStream(c10::DeviceIndex device_index = -1);
}  // namespace c10_npu
