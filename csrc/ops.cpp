// The op contract: one set of schemas, implemented per dispatch key by
// csrc/cpu, csrc/cuda and csrc/npu (and by the composite fallback in Python).
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(twinkle_mem, m) {
  // Rows of logits [N, V] (a vocab shard [vocab_start, vocab_start + V) of a
  // vocab of vocab_size) against labels [N]. Returns fp32 (fp64 for fp64 logits)
  // logp [N], entropy [N] (empty unless with_entropy), lse [N], mean [N] (E_p[x/T],
  // empty unless with_entropy). logp is 0 for ignored rows and for rows whose
  // label is on another shard. inplace_backward does not change the forward: it
  // tells autograd to write the gradient into the logits' storage.
  m.def(
      "selective_log_softmax_fwd(Tensor logits, Tensor labels, float inv_temperature, "
      "int ignore_index, int vocab_start, int vocab_size, bool with_entropy, "
      "bool inplace_backward=False) -> (Tensor logp, Tensor entropy, Tensor lse, Tensor mean)");
  // grad_logits = [g_logp (onehot - p) - g_H p (x/T - mean)] / T; 0 on ignored rows.
  m.def(
      "selective_log_softmax_bwd(Tensor grad_logp, Tensor? grad_entropy, Tensor logits, "
      "Tensor labels, Tensor lse, Tensor? mean, float inv_temperature, int ignore_index, "
      "int vocab_start) -> Tensor");
  // Same, written over the logits (which are lost).
  m.def(
      "selective_log_softmax_bwd_(Tensor grad_logp, Tensor? grad_entropy, Tensor(a!) logits, "
      "Tensor labels, Tensor lse, Tensor? mean, float inv_temperature, int ignore_index, "
      "int vocab_start) -> ()");
}
