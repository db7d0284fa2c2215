// Argument checks shared by every backend's host code. Each check names the
// argument it rejects; all run before any kernel reads or writes memory.
//
// Templates over the tensor type: the CPU and CUDA libraries pass
// torch::stable::Tensor, the torch_npu glue (regular torch API) at::Tensor.
// Both offer dim(), size(i), stride(i), scalar_type() and device() ==.
// STD_TORCH_CHECK throws std::runtime_error: a RuntimeError in Python.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace twinkle_mem {

using torch::headeronly::ScalarType;

inline bool is_float_logits(ScalarType t) {
  return t == ScalarType::BFloat16 || t == ScalarType::Half ||
         t == ScalarType::Float || t == ScalarType::Double;
}

// Statistics and outputs are fp32, or fp64 for fp64 logits.
inline ScalarType stats_dtype(ScalarType logits_dtype) {
  return logits_dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

template <typename TensorT>
void check_logits(const TensorT& logits) {
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

template <typename TensorT>
void check_labels(const TensorT& labels, const TensorT& logits) {
  STD_TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0),
                  "twinkle_mem: labels must be 1-D of length N = ", logits.size(0));
  STD_TORCH_CHECK(labels.scalar_type() == ScalarType::Long || labels.scalar_type() == ScalarType::Int,
                  "twinkle_mem: labels must be int64 or int32");
  STD_TORCH_CHECK(labels.device() == logits.device(),
                  "twinkle_mem: labels and logits must be on the same device");
}

// A per-row fp32/fp64 vector argument (lse, mean, grad_logp, grad_entropy).
template <typename TensorT>
void check_row_vector(const TensorT& t, const char* name, const TensorT& logits) {
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), "twinkle_mem: ", name,
                  " must be 1-D of length N = ", logits.size(0));
  STD_TORCH_CHECK(t.scalar_type() == stats_dtype(logits.scalar_type()), "twinkle_mem: ", name,
                  " must be float32 (float64 for float64 logits)");
  STD_TORCH_CHECK(t.device() == logits.device(), "twinkle_mem: ", name,
                  " must be on the logits' device");
}

inline void check_inv_temperature(double inv_temperature) {
  STD_TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
                  "twinkle_mem: inv_temperature must be finite and > 0 (temperature > 0), got ",
                  inv_temperature);
}

template <typename TensorT>
void check_forward_args(const TensorT& logits, const TensorT& labels, double inv_temperature,
                        int64_t vocab_start, int64_t vocab_size) {
  check_logits(logits);
  check_labels(labels, logits);
  check_inv_temperature(inv_temperature);
  STD_TORCH_CHECK(vocab_start >= 0 && vocab_start + logits.size(1) <= vocab_size,
                  "twinkle_mem: the logits' vocab shard [vocab_start, vocab_start + V) = [", vocab_start,
                  ", ", vocab_start + logits.size(1), ") must lie within [0, vocab_size = ", vocab_size, ")");
}

template <typename TensorT>
void check_backward_args(const TensorT& grad_logp, const std::optional<TensorT>& grad_entropy,
                         const TensorT& logits, const TensorT& labels, const TensorT& lse,
                         const std::optional<TensorT>& mean, double inv_temperature) {
  check_logits(logits);
  check_labels(labels, logits);
  check_row_vector(grad_logp, "grad_logp", logits);
  check_row_vector(lse, "lse", logits);
  if (grad_entropy.has_value()) {
    check_row_vector(*grad_entropy, "grad_entropy", logits);
    STD_TORCH_CHECK(mean.has_value(), "twinkle_mem: grad_entropy needs mean (run the forward with_entropy)");
    check_row_vector(*mean, "mean", logits);
  }
  check_inv_temperature(inv_temperature);
}

// Labels must be ignore_index or within [0, vocab_size). Each backend finds
// the first bad row its own way (a host loop, a device flag, a reduction) and
// raises with this one message.
inline bool label_in_range(int64_t label, int64_t ignore_index, int64_t vocab_size) {
  return label == ignore_index || (label >= 0 && label < vocab_size);
}

inline void fail_label_out_of_range(int64_t row, int64_t label, int64_t vocab_size, int64_t ignore_index) {
  STD_TORCH_CHECK(false, "twinkle_mem: labels[", row, "] = ", label, " is out of range [0, ", vocab_size,
                  ") and is not ignore_index (", ignore_index, ")");
}

}  // namespace twinkle_mem
