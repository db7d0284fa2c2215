// The forward's outputs, allocated alike by the stable-ABI backends (CPU, CUDA):
// logp and lse [N]; entropy and mean [N] with entropy, else [0]; fp32 (fp64
// for fp64 logits), on the logits' device.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <tuple>

#include "op_checks.h"

namespace twinkle_mem {

inline std::tuple<torch::stable::Tensor, torch::stable::Tensor, torch::stable::Tensor, torch::stable::Tensor>
new_forward_outputs(const torch::stable::Tensor& logits, bool with_entropy) {
  const int64_t n = logits.size(0), n_stats = with_entropy ? n : 0;
  const ScalarType dtype = stats_dtype(logits.scalar_type());
  return {torch::stable::new_empty(logits, {n}, dtype), torch::stable::new_empty(logits, {n_stats}, dtype),
          torch::stable::new_empty(logits, {n}, dtype), torch::stable::new_empty(logits, {n_stats}, dtype)};
}

}  // namespace twinkle_mem
