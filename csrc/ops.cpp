// The op contract: one set of schemas, implemented per dispatch key by
// csrc/cpu, csrc/cuda and csrc/npu (and by the composite fallback in Python).
// The math is csrc/common/online_softmax.h, the indexing csrc/common/layout.h.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(twinkle_mem, m) {
  // logits [N, V] or [B, S, V] (unit stride on V, any strides on the leading
  // dims; a vocab shard [vocab_start, vocab_start + V) of a vocab of vocab_size);
  // labels of the logits' leading shape L, or L + [k] for k labels per row (any
  // strides). Returns fp32 (fp64 for fp64 logits), contiguous:
  //   logp    labels' shape: (x_y - shift) / T - log_sum; 0 for an ignored label
  //           and for a label on another shard;
  //   entropy L (or [0] unless with_entropy);
  //   shift   L: a reference logit: the row's log-normalizer in logit units
  //           (shift + T log_sum for the max as shift), rounded; 0 when all are -inf;
  //   log_sum L: log sum exp((x - shift) / T) against that shift (small).
  // A row whose labels are all ignore_index (k >= 1) is skipped: every output 0.
  // inplace_backward does not change the forward: it tells autograd to write
  // the gradient into the logits' storage.
  m.def(
      "selective_log_softmax_fwd(Tensor logits, Tensor labels, float inv_temperature, "
      "int ignore_index, int vocab_start, int vocab_size, bool with_entropy, "
      "bool inplace_backward=False) -> (Tensor logp, Tensor entropy, Tensor shift, Tensor log_sum)");
  // grad_logits_v = [sum_{j: y_j = v} g_j - G p_v - g_H p_v (u_v + entropy)] / T,
  // u = log p = (x - shift) / T - log_sum, G = sum of the non-ignored g_j;
  // 0 on skipped rows. grad_logp has the labels' shape; grad_entropy, shift,
  // log_sum, entropy the logits' leading shape. The result has the logits'
  // shape (and their strides when layout.h's strided_grad_alloc allows).
  m.def(
      "selective_log_softmax_bwd(Tensor grad_logp, Tensor? grad_entropy, Tensor logits, "
      "Tensor labels, Tensor shift, Tensor log_sum, Tensor? entropy, float inv_temperature, "
      "int ignore_index, int vocab_start) -> Tensor");
  // Same, written over the logits (which are lost).
  m.def(
      "selective_log_softmax_bwd_(Tensor grad_logp, Tensor? grad_entropy, Tensor(a!) logits, "
      "Tensor labels, Tensor shift, Tensor log_sum, Tensor? entropy, float inv_temperature, "
      "int ignore_index, int vocab_start) -> ()");
}
