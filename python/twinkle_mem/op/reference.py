"""Float64 reference of the op, used by the tests and the benchmarks.

Computes from the same input values (logits upcast exactly to float64), so the
only differences from a kernel are the kernel's own rounding.
"""
from __future__ import annotations

import torch


def log_probs_ref(logits, temperature):
    """float64 (log p [..., V], entropy [...], lse [...]) without cancellation.

    log p = (z - max) - log1p(sum of exp(z - max) over all but the first max):
    exact for a confident row, whose p_max = 1 - eps has eps below float64's
    resolution of 1 + eps (lse - E_p[z] would cancel to 0 there).
    """
    z = logits.double() / temperature
    top = z.argmax(dim=-1, keepdim=True)
    shift = z.gather(-1, top)
    shift = torch.where(shift == float("-inf"), torch.zeros_like(shift), shift)
    gap = z - shift
    log_norm = torch.log1p(torch.exp(gap).scatter(-1, top, 0.0).sum(-1, keepdim=True))
    log_p = gap - log_norm
    # p log p at p = 0 (log p = -inf) is 0, its limit: clamping log p to a finite
    # value keeps it (and autograd) free of NaN.
    entropy = -(torch.exp(log_p) * log_p.clamp(min=-1e100)).sum(-1)
    return log_p, entropy, (shift + log_norm).squeeze(-1)


def _label_layout(logits, index, ignore_index):
    """index as [..., k], its ignored mask, safe gather indices, skipped rows."""
    multi = index.dim() == logits.dim()
    idx = index if multi else index.unsqueeze(-1)
    ignored = torch.zeros_like(idx, dtype=torch.bool) if ignore_index is None else idx == ignore_index
    safe = torch.where(ignored, torch.zeros_like(idx), idx).long()
    skipped = ignored.all(-1) if idx.shape[-1] > 0 else torch.zeros(idx.shape[:-1], dtype=torch.bool,
                                                                      device=idx.device)
    return multi, ignored, safe, skipped


def selective_log_softmax_ref(logits, index, temperature=1.0, ignore_index=None):
    """float64 (logp, entropy, lse, mean) with the kernel's conventions.

    index: [...] or [..., k] (when index.dim() == logits.dim()). An ignored
    index gives logp 0; a row whose indices are all ignored gives 0 everywhere.
    """
    log_p, entropy, lse = log_probs_ref(logits, temperature)
    multi, ignored, safe, skipped = _label_layout(logits, index, ignore_index)
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    logp = torch.where(ignored, zero, log_p.gather(-1, safe))
    logp = logp if multi else logp.squeeze(-1)
    mean = lse - entropy
    return (logp, torch.where(skipped, zero, entropy), torch.where(skipped, zero, lse),
            torch.where(skipped, zero, mean))


def selective_log_softmax_grad_ref(logits, index, grad_logp, grad_entropy=None, temperature=1.0,
                                   ignore_index=None):
    """float64 gradient of sum(grad_logp * logp + grad_entropy * entropy) w.r.t. logits.

    Written out rather than taken by autograd, whose sum of terms cancels to 0
    for a confident row's label (1 - p with p = 1 - 1e-22):
      d_v = [sum_{j: y_j = v} g_j (1 - p_v) - (G - sum_{j: y_j = v} g_j) p_v - g_H p_v (log p_v + H)] / T
    with 1 - p_v = -expm1(log p_v).
    """
    log_p, entropy, _ = log_probs_ref(logits.detach(), temperature)
    multi, ignored, safe, skipped = _label_layout(logits, index, ignore_index)
    g = grad_logp.double().to(logits.device)
    g = (g if multi else g.unsqueeze(-1)).masked_fill(ignored, 0.0)
    here = torch.zeros_like(log_p).scatter_add(-1, safe, g)  # upstream gradient at each position
    total = g.sum(-1, keepdim=True)
    p = torch.exp(log_p)
    grad = here * -torch.expm1(log_p) - (total - here) * p
    if grad_entropy is not None:
        g_h = grad_entropy.double().to(logits.device).unsqueeze(-1)
        grad = grad - g_h * torch.where(p == 0, torch.zeros_like(p), p * (log_p + entropy.unsqueeze(-1)))
    grad = grad.masked_fill(skipped.unsqueeze(-1), 0.0)
    return grad / temperature
