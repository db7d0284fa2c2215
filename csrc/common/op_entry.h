// The op's entry points, written once for every backend: the only C++ that names
// the schemas' positional arguments (python/twinkle_mem/schemas.def). Each backend
// registers OpEntries<Backend>::fwd / bwd / bwd_ for its dispatch key; they check
// the arguments (op_checks.h) and call the backend with OpOptions and BackwardInputs
// (op_options.h). A Backend provides, for its tensor type Tensor:
//   forward(logits, labels, const OpOptions&) -> (logp, entropy, shift, log_sum)
//   backward(const BackwardInputs<Tensor>&, const OpOptions&) -> grad_logits
//   backward_inplace(const BackwardInputs<Tensor>&, Tensor& logits, const OpOptions&)
//   check(logits): the backend's own checks, after the shared ones
//
// Templates over the tensor type, like op_checks.h: torch::stable::Tensor for the
// CPU and CUDA libraries, at::Tensor for the torch_npu glue.
#pragma once

#include <optional>
#include <tuple>
#include <utility>

#include "op_checks.h"
#include "op_options.h"

namespace twinkle_mem {

template <typename Backend>
struct OpEntries {
  using Tensor = typename Backend::Tensor;

  static std::tuple<Tensor, Tensor, Tensor, Tensor> fwd(const Tensor& logits, const Tensor& labels,
                                                        double inv_temperature, int64_t ignore_index,
                                                        int64_t vocab_start, int64_t vocab_size, bool with_entropy,
                                                        bool inplace_backward) {
    const OpOptions o{inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy, inplace_backward};
    check_forward_args(logits, labels, o);
    Backend::check(logits);
    return Backend::forward(logits, labels, o);
  }

  static Tensor bwd(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, const Tensor& logits,
                    const Tensor& labels, const Tensor& shift, const Tensor& log_sum,
                    const std::optional<Tensor>& entropy, double inv_temperature, int64_t ignore_index,
                    int64_t vocab_start) {
    const BackwardInputs<Tensor> in{grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy};
    return Backend::backward(in, checked_backward(in, inv_temperature, ignore_index, vocab_start, false));
  }

  static void bwd_(const Tensor& grad_logp, const std::optional<Tensor>& grad_entropy, Tensor& logits,
                   const Tensor& labels, const Tensor& shift, const Tensor& log_sum,
                   const std::optional<Tensor>& entropy, double inv_temperature, int64_t ignore_index,
                   int64_t vocab_start) {
    const BackwardInputs<Tensor> in{grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy};
    Backend::backward_inplace(in, logits, checked_backward(in, inv_temperature, ignore_index, vocab_start, true));
  }

 private:
  // The backward's options (vocab_size: this shard's end; with_entropy: grad_entropy given), checked.
  static OpOptions checked_backward(const BackwardInputs<Tensor>& in, double inv_temperature, int64_t ignore_index,
                                    int64_t vocab_start, bool inplace) {
    const int64_t V = in.logits.dim() >= 1 ? in.logits.size(in.logits.dim() - 1) : 0;
    const OpOptions o{inv_temperature, ignore_index, vocab_start, vocab_start + V, in.grad_entropy.has_value(),
                      inplace};
    check_backward_args(in, o);
    Backend::check(in.logits);
    return o;
  }
};

// The other way, options back to the schema's arguments: for a backend that
// hands a call on to another dispatch key's kernel (the NPU's fp64 logits go to
// the CPU kernel). `op` is called with the schema's arguments in order.
template <typename Op, typename TensorT>
auto call_forward(Op&& op, const TensorT& logits, const TensorT& labels, const OpOptions& o) {
  return op(logits, labels, o.inv_temperature, o.ignore_index, o.vocab_start, o.vocab_size, o.with_entropy,
            o.inplace_backward);
}

template <typename Op, typename TensorT>
auto call_backward(Op&& op, const BackwardInputs<TensorT>& in, const OpOptions& o) {
  return op(in.grad_logp, in.grad_entropy, in.logits, in.labels, in.shift, in.log_sum, in.entropy,
            o.inv_temperature, o.ignore_index, o.vocab_start);
}

}  // namespace twinkle_mem
