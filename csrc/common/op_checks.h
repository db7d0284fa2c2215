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
#include <utility>
#include <stdexcept>

#include "label_message.h"
#include "op_options.h"

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

// Logits [N, V] or [B, S, V]: unit stride on the vocab, any strides on the
// leading dims as long as no two rows overlap (the in-place backward writes them).
template <typename TensorT>
void check_logits(const TensorT& logits) {
  STD_TORCH_CHECK(logits.dim() == 2 || logits.dim() == 3,
                  "twinkle_mem: logits must be [N, V] or [B, S, V] (the Python API flattens other leading dims), got ",
                  logits.dim(), "-D");
  STD_TORCH_CHECK(is_float_logits(logits.scalar_type()),
                  "twinkle_mem: logits must be bfloat16, float16, float32 or float64");
  const int last = static_cast<int>(logits.dim()) - 1;
  const int64_t V = logits.size(last);
  int64_t rows = 1;
  for (int d = 0; d < last; ++d) rows *= logits.size(d);
  STD_TORCH_CHECK(V >= 1 || rows == 0, "twinkle_mem: logits must have a vocab dim of size >= 1");
  STD_TORCH_CHECK(V <= 1 || logits.stride(last) == 1,
                  "twinkle_mem: logits must have unit stride on the vocab dim, got stride ", logits.stride(last));
  // No two rows overlap: the leading dims of size > 1 (at most two), the one
  // with the smaller stride first, each stepping past everything inside it.
  int dims[2];
  int n = 0;
  for (int d = 0; d < last; ++d) {
    if (logits.size(d) > 1) dims[n++] = d;
  }
  if (n == 2 && logits.stride(dims[1]) < logits.stride(dims[0])) std::swap(dims[0], dims[1]);
  int64_t extent = V;
  for (int i = 0; i < n; ++i) {
    const int64_t stride = logits.stride(dims[i]);
    STD_TORCH_CHECK(stride >= extent, "twinkle_mem: logits rows must not overlap (stride ", stride, " of dim ",
                    dims[i], " < ", extent, " elements inside it)");
    extent += (logits.size(dims[i]) - 1) * stride;
  }
}

// Labels: the logits' leading shape, or that plus a trailing dim of k labels per row.
template <typename TensorT>
void check_labels(const TensorT& labels, const TensorT& logits) {
  const int64_t lead = logits.dim() - 1;
  bool ok = labels.dim() == lead || labels.dim() == lead + 1;
  for (int64_t d = 0; ok && d < lead; ++d) ok = labels.size(d) == logits.size(d);
  STD_TORCH_CHECK(ok, "twinkle_mem: labels must have the logits' leading shape, optionally with a trailing dim "
                      "of k labels per row (labels ", labels.dim(), "-D, logits ", logits.dim(), "-D)");
  STD_TORCH_CHECK(labels.scalar_type() == ScalarType::Long || labels.scalar_type() == ScalarType::Int,
                  "twinkle_mem: labels must be int64 or int32");
  STD_TORCH_CHECK(labels.device() == logits.device(),
                  "twinkle_mem: labels and logits must be on the same device");
}

template <typename TensorT>
bool same_shape(const TensorT& a, const TensorT& b, int64_t dims) {
  if (a.dim() != dims || b.dim() < dims) return false;
  for (int64_t d = 0; d < dims; ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  return true;
}

// A per-row fp32/fp64 tensor (shift, log_sum, entropy, grad_entropy: the logits'
// leading shape) or per-label one (grad_logp: the labels' shape); any strides.
template <typename TensorT>
void check_stats_tensor(const TensorT& t, const char* name, const TensorT& like, int64_t dims,
                        const TensorT& logits) {
  STD_TORCH_CHECK(same_shape(t, like, dims), "twinkle_mem: ", name, " must have the shape of ",
                  dims == logits.dim() - 1 ? "the logits' leading dims" : "the labels");
  STD_TORCH_CHECK(t.scalar_type() == stats_dtype(logits.scalar_type()), "twinkle_mem: ", name,
                  " must be float32 (float64 for float64 logits)");
  STD_TORCH_CHECK(t.device() == logits.device(), "twinkle_mem: ", name, " must be on the logits' device");
}

inline void check_inv_temperature(double inv_temperature) {
  STD_TORCH_CHECK(std::isfinite(inv_temperature) && inv_temperature > 0,
                  "twinkle_mem: inv_temperature must be finite and > 0 (temperature > 0), got ",
                  inv_temperature);
}

template <typename TensorT>
void check_forward_args(const TensorT& logits, const TensorT& labels, const OpOptions& o) {
  check_logits(logits);
  check_labels(labels, logits);
  check_inv_temperature(o.inv_temperature);
  const int64_t V = logits.size(logits.dim() - 1);
  STD_TORCH_CHECK(o.vocab_start >= 0 && o.vocab_start + V <= o.vocab_size,
                  "twinkle_mem: the logits' vocab shard [vocab_start, vocab_start + V) = [", o.vocab_start,
                  ", ", o.vocab_start + V, ") must lie within [0, vocab_size = ", o.vocab_size, ")");
}

template <typename TensorT>
void check_backward_args(const BackwardInputs<TensorT>& in, const OpOptions& o) {
  check_logits(in.logits);
  check_labels(in.labels, in.logits);
  const int64_t lead = in.logits.dim() - 1;
  check_stats_tensor(in.grad_logp, "grad_logp", in.labels, in.labels.dim(), in.logits);
  check_stats_tensor(in.shift, "shift", in.logits, lead, in.logits);
  check_stats_tensor(in.log_sum, "log_sum", in.logits, lead, in.logits);
  if (in.grad_entropy.has_value()) {
    check_stats_tensor(*in.grad_entropy, "grad_entropy", in.logits, lead, in.logits);
    STD_TORCH_CHECK(in.entropy.has_value(), "twinkle_mem: grad_entropy needs entropy (run the forward with_entropy)");
    check_stats_tensor(*in.entropy, "entropy", in.logits, lead, in.logits);
  }
  check_inv_temperature(o.inv_temperature);
  // The forward's shard check without a vocab_size: labels shifted by a negative start would take
  // the gradient of other columns.
  STD_TORCH_CHECK(o.vocab_start >= 0, "twinkle_mem: vocab_start must be >= 0 (the logits' shard starts at a token "
                  "id), got ", o.vocab_start);
}

// Labels must be ignore_index or within [0, vocab_size) (online_softmax.h's
// label_in_range). The host-side checks (the CPU's loop, the NPU's reduction)
// raise with label_message.h's message; CUDA checks on the device and asserts
// with the same text (docs/cuda.md).
//
// Thrown as a plain std::runtime_error (a RuntimeError in Python) so that the
// message leads with what is wrong and names no source path of the build machine.
[[noreturn]] inline void fail_label_out_of_range(int64_t index, int64_t label, int64_t vocab_size,
                                                 int64_t ignore_index) {
  Message m;
  m.add_label_out_of_range(index, label, vocab_size, ignore_index);
  throw std::runtime_error(m.text);
}

}  // namespace twinkle_mem
