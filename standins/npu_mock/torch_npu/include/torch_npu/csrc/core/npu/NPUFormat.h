// Declarations of the torch_npu 2.14 format query the twinkle_mem glue uses, for the build check.
#pragma once
#include <ATen/ATen.h>

namespace at_npu {
namespace native {
int64_t get_npu_format(const at::Tensor& tensor);
}  // namespace native
}  // namespace at_npu
