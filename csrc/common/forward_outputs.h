// The forward's outputs and the backward's gradient, allocated alike by the
// stable-ABI backends (CPU, CUDA): fp32 (fp64 for fp64 logits) outputs on the
// logits' device, logp in the labels' shape, entropy / shift / log_sum in the
// logits' leading shape (entropy [0] without with_entropy), all contiguous.
// Also the backward's per-row inputs, made contiguous alike, and StableBackend:
// the op_entry.h Backend that both are, around their kernels.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "layout.h"
#include "op_checks.h"
#include "op_entry.h"
#include "op_options.h"

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
  return new_grad_like(
      logits,
      [](const torch::stable::Tensor& like, const std::vector<int64_t>& sizes) {
        return torch::stable::new_empty(like, sizes);
      },
      [](torch::stable::Tensor t, int dim, int64_t len) { return torch::stable::narrow(t, dim, 0, len); });
}

// The backward's per-row inputs, contiguous: grad_logp [rows * k], shift,
// log_sum, and with_entropy grad_entropy and entropy [rows] (without it, both
// stand-ins that no kernel reads). They are O(N): the copies (asynchronous on
// a GPU) cost nothing next to the rows.
struct BackwardRowInputs {
  torch::stable::Tensor grad_logp, shift, log_sum, grad_entropy, entropy;
  bool with_entropy;
};

inline BackwardRowInputs contiguous_row_inputs(const BackwardInputs<torch::stable::Tensor>& in) {
  const torch::stable::Tensor g_logp_c = torch::stable::contiguous(in.grad_logp),
                              shift_c = torch::stable::contiguous(in.shift),
                              log_sum_c = torch::stable::contiguous(in.log_sum);
  const bool with_entropy = in.grad_entropy.has_value();
  const torch::stable::Tensor g_entropy_c = with_entropy ? torch::stable::contiguous(*in.grad_entropy) : shift_c;
  const torch::stable::Tensor entropy_c = with_entropy ? torch::stable::contiguous(*in.entropy) : shift_c;
  return {g_logp_c, shift_c, log_sum_c, g_entropy_c, entropy_c, with_entropy};
}

// op_entry.h's Backend for a stable-ABI library: outputs and the gradient
// allocated here, filled by Kernels, which provides
//   forward(logits, labels, const OpOptions&, logp, entropy, shift, log_sum)
//   backward(const BackwardInputs<Tensor>&, const OpOptions&, grad)  (grad may be the logits)
template <typename Kernels>
struct StableBackend {
  using Tensor = torch::stable::Tensor;

  static void check(const Tensor&) {}

  static std::tuple<Tensor, Tensor, Tensor, Tensor> forward(const Tensor& logits, const Tensor& labels,
                                                            const OpOptions& o) {
    auto out = new_forward_outputs(logits, labels, o.with_entropy);
    Kernels::forward(logits, labels, o, std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out));
    return out;
  }

  static Tensor backward(const BackwardInputs<Tensor>& in, const OpOptions& o) {
    Tensor grad = new_grad_like(in.logits);
    Kernels::backward(in, o, grad);
    return grad;
  }

  static void backward_inplace(const BackwardInputs<Tensor>& in, Tensor& logits, const OpOptions& o) {
    Kernels::backward(in, o, logits);
  }
};

}  // namespace twinkle_mem
