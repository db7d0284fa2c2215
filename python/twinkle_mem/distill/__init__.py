"""Distillation: twinkle-kit's GKDLoss in fp32 with a float64 core. Its math per row (divergence.py), the
arguments every GKD function takes (arguments.py), and the losses from the student's logits: over a top-k
teacher (topk_teacher.py) or a local teacher's full logits (local_teacher.py); their per-token reference from
twinkle's GKDLoss (reference.py). Built on op/; the losses from the LM head's input are fused heads
(heads/gkd_topk.py, heads/gkd_full.py)."""
