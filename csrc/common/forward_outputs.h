// The forward's outputs and the backward's gradient, allocated alike by the
// stable-ABI backends (CPU, CUDA): fp32 (fp64 for fp64 logits) outputs on the
// logits' device, logp in the labels' shape, entropy / shift / log_sum in the
// logits' leading shape (entropy [0] without with_entropy), all contiguous.
// Also the backward's per-row inputs, made contiguous alike.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
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

// The backward's per-row inputs, contiguous: grad_logp [rows * k], shift,
// log_sum, and with_entropy grad_entropy and entropy [rows] (without it, both
// stand-ins that no kernel reads). They are O(N): the copies (asynchronous on
// a GPU) cost nothing next to the rows.
struct BackwardRowInputs {
  torch::stable::Tensor grad_logp, shift, log_sum, grad_entropy, entropy;
  bool with_entropy;
};

inline BackwardRowInputs contiguous_row_inputs(const torch::stable::Tensor& grad_logp,
                                               const std::optional<torch::stable::Tensor>& grad_entropy,
                                               const torch::stable::Tensor& shift,
                                               const torch::stable::Tensor& log_sum,
                                               const std::optional<torch::stable::Tensor>& entropy) {
  const torch::stable::Tensor g_logp_c = torch::stable::contiguous(grad_logp),
                              shift_c = torch::stable::contiguous(shift), log_sum_c = torch::stable::contiguous(log_sum);
  const bool with_entropy = grad_entropy.has_value();
  const torch::stable::Tensor g_entropy_c = with_entropy ? torch::stable::contiguous(*grad_entropy) : shift_c;
  const torch::stable::Tensor entropy_c = with_entropy ? torch::stable::contiguous(*entropy) : shift_c;
  return {g_logp_c, shift_c, log_sum_c, g_entropy_c, entropy_c, with_entropy};
}

}  // namespace twinkle_mem
