// The op's arguments past the schema boundary, as one value each.
//
// op_entry.h unpacks the schemas' positional arguments (python/twinkle_mem/schemas.def)
// into these once, for every backend; kernels, host plans and the CPU emulations
// of the device kernels take an OpOptions (and the backward its BackwardInputs)
// instead of restating the argument list. A new scalar argument is a field here,
// set in op_entry.h, read by the kernels that use it.
//
// Plain C++ (no torch header): the CUDA host plan includes it in its CPU emulation too.
#pragma once

#include <cstdint>
#include <optional>

namespace twinkle_mem {

struct OpOptions {
  double inv_temperature;  // 1 / T
  int64_t ignore_index;    // labels equal to it give logp 0 and no gradient
  int64_t vocab_start;     // the logits' first vocab id (a tensor-parallel shard)
  int64_t vocab_size;      // the whole vocab; the backward's is vocab_start + V (the forward checked the labels)
  bool with_entropy;       // forward: compute the entropy; backward: grad_entropy was given
  bool inplace_backward;   // forward: autograd's choice, no kernel reads it; backward: the _bwd_ variant
};

// The backward's tensors, as the schema passes them (references: nothing is copied).
template <typename TensorT>
struct BackwardInputs {
  const TensorT& grad_logp;
  const std::optional<TensorT>& grad_entropy;
  const TensorT& logits;
  const TensorT& labels;
  const TensorT& shift;
  const TensorT& log_sum;
  const std::optional<TensorT>& entropy;
};

}  // namespace twinkle_mem
