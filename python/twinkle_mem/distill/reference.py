"""Float64 references of the distillation functions, used by the tests, in the op's style (``op/reference.py``).
Their whole-loss reference is twinkle's own ``GKDLoss`` run on float64 inputs (the tests call it); what twinkle
does not give, the per-token losses, is taken from it here."""
from __future__ import annotations

import torch


def gkd_per_token_ref(loss_fn, labels, logits, **teacher):
    """The per-token losses that ``gkd_from_logits``, ``gkd_topk_from_logits``, ``linear_gkd_topk`` and
    ``linear_gkd_full`` return, from twinkle's ``GKDLoss`` (``loss_fn``), which returns their average: the
    loss of each kept token alone, whose average over one token is that token's value (float64
    [labels.shape], 0 on tokens labelled -100). ``teacher``: the loss's teacher keyword arguments."""
    per_token = torch.zeros(labels.shape, dtype=torch.float64)
    for i in (labels != -100).nonzero():
        one = torch.full_like(labels, -100)
        one[tuple(i)] = 0
        per_token[tuple(i)] = loss_fn({"labels": one}, {"logits": logits.detach()}, **teacher)["loss"]
    return per_token
