"""The float64 math of twinkle's generalized JSD (GKDLoss), per row, shared by every distillation op.

From the student's logits x and the teacher's logits or log-probs t over the same entries of a row (its
top k, or the whole vocab in blocks): the normalized log-probs ls, lt of x / T and t / T, the per-entry
terms of the loss L (and of K = KL(student || mixture) for 0 < beta < 1), and dL/dx in closed form
(derived in docs/distillation.md):

    s = x / T,  t = teacher / T      (both sides, as twinkle does; each shifted by its row max first)
    ls = log_softmax(s),  lt = log_softmax(t),  p = exp(ls),  q = exp(lt)   (over the row's entries)
    beta = 0:  L = sum_j q (lt - ls)                         = KL(teacher || student)
    beta = 1:  L = sum_j p (ls - lt)                         = KL(student || teacher)
    else:      lm = log((1 - beta) p + beta q)
               L = beta sum_j q (lt - lm) + (1 - beta) sum_j p (ls - lm)

    dL/dx_j = (p_j - q_j) / T                                 beta = 0
            = p_j (ls_j - lt_j - L) / T                       beta = 1
            = (1 - beta) p_j (ls_j - lm_j - K) / T            else, K = sum_j p_j (ls_j - lm_j)

A term whose weight (q or p) is exactly 0 counts 0 (the limit 0 log 0 = 0): twinkle's code, through
``F.kl_div(..., log_target=True)`` = exp(target) (target - input), makes it NaN where a teacher
log-prob is -inf (and at beta = 1 where the student's is); everywhere else the values are twinkle's.
Callers: heads/gkd_topk.py and topk_teacher.py (a top-k teacher, the k entries of a row at once),
local_teacher.py (a local teacher's logits, rows in chunks), heads/gkd_full.py (the whole vocab, by
vocab blocks: gkd_terms and gkd_grad per block). ``gkd_average``: GKDLoss's scalar from the per-token loss.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

# Every op below maps each element alone through the same code wherever it sits in the tensor (plain
# arithmetic, exp, log; no alpha != 1, no torch.logaddexp: their CPU loops round a tensor's last elements
# unlike the others), so that a row's bits do not depend on the rows around it. What they write in place
# (out=) are temporaries of their own making, never a caller's tensor.
LOG_TINY = -746.0  # below log(2^-1074): lm's floor where both parts of the mixture underflow


def _weighted_log_ratio(w: Tensor, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """w (a - b), 0 where w == 0 (the limit 0 log 0 = 0; NaN in w still propagates); into ``out`` (which may
    be a or b: elementwise, each element read before it is written) or a new tensor (always under autograd,
    which has no out=: gkd_rows is differentiable too)."""
    if out is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (w, a, b)):
        out = None
    return torch.sub(a, b, out=out).mul_(w).masked_fill_(w == 0, 0.0)


def _scaled(x: Tensor, temperature: float) -> Tensor:
    """(x - max_k x) / T in float64: log_softmax's own shift, taken before the division, so that a
    finfo.min logit (a mask) stays finite at T < 1 where x / T overflows (as the op computes
    (x - shift) / T, docs/numerics.md); a row of -inf or NaN stays NaN, as in twinkle."""
    x = x.double()
    return (x - x.amax(-1, keepdim=True)) / temperature


def log_add_exp(a: Tensor, b: Tensor) -> Tensor:
    """log(exp(a) + exp(b)), each element's bits independent of where it sits in the tensor (torch.logaddexp's
    are not: a row's float64 value changed with the number of rows in the batch)."""
    m = torch.maximum(a, b)
    out = m + torch.exp(-(a - b).abs()).log1p()
    return torch.where(m == float("-inf"), m, out)  # (both -inf: -inf, as logaddexp, not NaN)


def _mixture(p: Tensor, q: Tensor, beta: float) -> Tensor:
    """lm = log((1 - beta) p + beta q), from the probabilities: (q beta / (1 - beta) + p) (1 - beta), then the
    log (relative error of the sum a few 2^-53: lm within a few 2^-53 absolute, however small p and q;
    the logaddexp of the log-probs rounds at 2^-53 |ls| instead). Where both parts underflow to 0 while a
    weight is not 0 (p or q below 2^-1074 / beta), lm is LOG_TINY instead of -inf: those terms are
    below 2^-1000 and count 0 either way."""
    return torch.mul(q, beta / (1 - beta)).add_(p).mul_(1 - beta).log_().clamp_(min=LOG_TINY)


def gkd_terms(ls: Tensor, lt: Tensor, beta: float) -> tuple[Tensor, Optional[Tensor]]:
    """Per entry, from the student's and teacher's normalized log-probs (float64): (the loss's terms, the
    terms of K = KL(student || M) for 0 < beta < 1, else None). A row's L and K are their sums."""
    if beta == 0:
        return _weighted_log_ratio(lt.exp(), lt, ls), None
    p = ls.exp()
    if beta == 1:
        return _weighted_log_ratio(p, ls, lt), None
    q = lt.exp()
    lm = _mixture(p, q, beta)
    k_student = _weighted_log_ratio(p, ls, lm)
    # beta (teacher's terms) + (1 - beta) k_student, as ((beta / (1 - beta)) teacher's + k_student) (1 - beta),
    # in lm's buffer (lm is not needed after the teacher's terms)
    terms = _weighted_log_ratio(q, lt, lm, out=lm).mul_(beta / (1 - beta)).add_(k_student).mul_(1 - beta)
    return terms, k_student


def gkd_grad(ls: Tensor, lt: Tensor, loss: Tensor, k_student: Optional[Tensor], beta: float,
             temperature: float) -> Tensor:
    """dL/dx per entry (the formulas of this module's docstring), given the row's L and K ([.., 1]); ``temperature``
    the student's."""
    p = ls.exp()
    if beta == 0:
        d = p.sub_(lt.exp())
    elif beta == 1:
        d = _weighted_log_ratio(p, ls, lt + loss)
    else:
        lm_k = _mixture(p, lt.exp(), beta).add_(k_student)
        d = _weighted_log_ratio(p, ls, lm_k, out=lm_k).mul_(1 - beta)
    return d.div_(temperature)


def gkd_rows(x: Tensor, teacher_logprobs: Tensor, beta: float, temperature: float,
             teacher_temperature: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """(L [m], dL/dx [m, k]) in float64 from the student's logits x [m, k] at the teacher's ids and the
    teacher's log-probs [m, k]; the teacher's divided by ``teacher_temperature`` (``temperature`` if None)."""
    ls = _scaled(x, temperature).log_softmax(-1)
    lt = _scaled(teacher_logprobs, temperature if teacher_temperature is None else teacher_temperature).log_softmax(-1)
    terms, k_terms = gkd_terms(ls, lt, beta)
    loss = terms.sum(-1)
    k_student = None if k_terms is None else k_terms.sum(-1, keepdim=True)
    return loss, gkd_grad(ls, lt, loss.unsqueeze(-1), k_student, beta, temperature)


def gkd_average(per_token: Tensor, labels: Optional[Tensor] = None, ignore_index: int = -100) -> Tensor:
    """GKDLoss's scalar from a per-token GKD loss (linear_gkd_topk, linear_gkd_full, gkd_from_logits,
    gkd_topk_from_logits): the sum over the kept tokens divided by their number (0 when none is kept, as
    GKDLoss returns)."""
    if labels is None:
        count = per_token.numel()
    else:
        count = int((labels != ignore_index).sum())
    return per_token.sum() / count if count else per_token.sum() * 0.0
