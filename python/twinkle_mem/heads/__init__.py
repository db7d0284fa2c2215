"""The fused LM heads: losses and statistics of ``hidden @ weight.T + bias`` computed from the LM head's
input without building the logits. One blockwise engine (engine.py, its matmuls in matmul.py) and a module
per head, each its per-block math and its public function: log-probs and entropy (logprobs.py), GKD over a
top-k teacher (gkd_topk.py) and over a whole-vocab teacher (gkd_full.py); and the argmax of the logits
(argmax.py: twinkle's Accuracy on the fused path); their float64 references (reference.py). Built on op/ and
distill/ (docs/architecture.md, "Adding a fused head")."""
