// Argument checks shared by every backend's host code. Each check names the
// argument it rejects; all run before any kernel reads or writes memory.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cmath>
#include <optional>

namespace twinkle_mem {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

inline bool is_float_logits(ScalarType t) {
  return t == ScalarType::BFloat16 || t == ScalarType::Half ||
         t == ScalarType::Float || t == ScalarType::Double;
}

// Statistics and outputs are fp32, or fp64 for fp64 logits.
inline ScalarType stats_dtype(ScalarType logits_dtype) {
  return logits_dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

inline void check_logits(const Tensor& logits) {
  STD_TORCH_CHECK(logits.dim() == 2, "twinkle_mem: logits must be 2-D [N, V] (flatten leading dims), got ",
                  logits.dim(), "-D");
  STD_TORCH_CHECK(is_float_logits(logits.scalar_type()),
                  "twinkle_mem: logits must be bfloat16, float16, float32 or float64");
  STD_TORCH_CHECK(logits.size(1) >= 1 || logits.size(0) == 0,
                  "twinkle_mem: logits must have a vocab dim of size >= 1");
  STD_TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1,
                  "twinkle_mem: logits must have unit stride on the vocab dim, got stride ",
                  logits.stride(1));
  STD_TORCH_CHECK(logits.size(0) <= 1 || logits.stride(0) >= logits.size(1),
                  "twinkle_mem: logits rows must not overlap (row stride ", logits.stride(0),
                  " < vocab size ", logits.size(1), ")");
}

inline void check_labels(const Tensor& labels, const Tensor& logits) {
  STD_TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0),
                  "twinkle_mem: labels must be 1-D of length N = ", logits.size(0));
  STD_TORCH_CHECK(labels.scalar_type() == ScalarType::Long || labels.scalar_type() == ScalarType::Int,
                  "twinkle_mem: labels must be int64 or int32");
  STD_TORCH_CHECK(labels.device() == logits.device(),
                  "twinkle_mem: labels and logits must be on the same device");
}

// A per-row fp32/fp64 vector argument (lse, mean, grad_logp, grad_entropy).
inline void check_row_vector(const Tensor& t, const char* name, const Tensor& logits) {
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), "twinkle_mem: ", name,
                  " must be 1-D of length N = ", logits.size(0));
  STD_TORCH_CHECK(t.scalar_type() == stats_dtype(logits.scalar_type()), "twinkle_mem: ", name,
                  " must be float32 (float64 for float64 logits)");
  STD_TORCH_CHECK(t.device() == logits.device(), "twinkle_mem: ", name,
                  " must be on the logits' device");
}

inline void check_forward_args(const Tensor& logits, const Tensor& labels, double inv_temperature,
                               int64_t vocab_start, int64_t vocab_size) {
  check_logits(logits);
  check_labels(labels, logits);
  STD_TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
                  "twinkle_mem: inv_temperature must be finite and > 0 (temperature > 0), got ",
                  inv_temperature);
  STD_TORCH_CHECK(vocab_start >= 0 && vocab_start + logits.size(1) <= vocab_size,
                  "twinkle_mem: the logits' vocab shard [vocab_start, vocab_start + V) = [", vocab_start,
                  ", ", vocab_start + logits.size(1), ") must lie within [0, vocab_size = ", vocab_size, ")");
}

inline void check_backward_args(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy,
                                const Tensor& logits, const Tensor& labels, const Tensor& lse,
                                const std::optional<Tensor>& mean, double inv_temperature) {
  check_logits(logits);
  check_labels(labels, logits);
  check_row_vector(grad_logp, "grad_logp", logits);
  check_row_vector(lse, "lse", logits);
  if (grad_entropy.has_value()) {
    check_row_vector(*grad_entropy, "grad_entropy", logits);
    STD_TORCH_CHECK(mean.has_value(), "twinkle_mem: grad_entropy needs mean (run the forward with_entropy)");
    check_row_vector(*mean, "mean", logits);
  }
  STD_TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
                  "twinkle_mem: inv_temperature must be finite and > 0, got ", inv_temperature);
}

}  // namespace twinkle_mem
