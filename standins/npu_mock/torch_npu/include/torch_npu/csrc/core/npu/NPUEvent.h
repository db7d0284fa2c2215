// Declarations of the torch_npu 2.14 event API the twinkle_mem glue uses, for the build check.
#pragma once
#include "torch_npu/csrc/core/npu/NPUStream.h"

namespace c10_npu {
struct NPUEvent {
  NPUEvent();
  ~NPUEvent();
  NPUEvent(const NPUEvent&) = delete;
  NPUEvent& operator=(const NPUEvent&) = delete;
  bool query() const;
  void record(const NPUStream& stream);
  void synchronize() const;
};
}  // namespace c10_npu
