// The forward's outputs and the backward's gradient, allocated alike by the
// stable-ABI backends (CPU, CUDA): fp32 (fp64 for fp64 logits) outputs on the
// logits' device, logp in the labels' shape, entropy / shift / log_sum in the
// logits' leading shape (entropy [0] without with_entropy), all contiguous.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <tuple>
#include <vector>

#include "layout.h"
#include "op_checks.h"

namespace twinkle_mem {

inline std::vector<int64_t> sizes_of(const torch::stable::Tensor& t, int64_t dims) {
  std::vector<int64_t> out(dims);
  for (int64_t d = 0; d < dims; ++d) out[d] = t.size(d);
  return out;
}

inline std::tuple<torch::stable::Tensor, torch::stable::Tensor, torch::stable::Tensor, torch::stable::Tensor>
new_forward_outputs(const torch::stable::Tensor& logits, const torch::stable::Tensor& labels, bool with_entropy) {
  const ScalarType dtype = stats_dtype(logits.scalar_type());
  const std::vector<int64_t> lead = sizes_of(logits, logits.dim() - 1);
  const std::vector<int64_t> label_shape = sizes_of(labels, labels.dim());
  const std::vector<int64_t> entropy_shape = with_entropy ? lead : std::vector<int64_t>{0};
  return {torch::stable::new_empty(logits, label_shape, dtype), torch::stable::new_empty(logits, entropy_shape, dtype),
          torch::stable::new_empty(logits, lead, dtype), torch::stable::new_empty(logits, lead, dtype)};
}

// The out-of-place gradient: the logits' shape, with their strides where
// layout.h's rule allows (rows aligned as the logits' rows are), else contiguous.
inline torch::stable::Tensor new_grad_like(const torch::stable::Tensor& logits) {
  const int ndim = static_cast<int>(logits.dim());
  int64_t sizes[3], strides[3], alloc[3];
  for (int d = 0; d < ndim; ++d) {
    sizes[d] = logits.size(d);
    strides[d] = logits.stride(d);
  }
  if (!strided_grad_alloc(ndim, sizes, strides, alloc)) return torch::stable::new_empty(logits, sizes_of(logits, ndim));
  torch::stable::Tensor grad = torch::stable::new_empty(logits, std::vector<int64_t>(alloc, alloc + ndim));
  for (int d = 0; d < ndim; ++d) {
    if (alloc[d] != sizes[d]) grad = torch::stable::narrow(grad, d, 0, sizes[d]);
  }
  return grad;
}

}  // namespace twinkle_mem
