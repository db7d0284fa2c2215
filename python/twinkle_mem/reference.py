"""Float64 reference of the op, used by the tests and the benchmarks.

Computes from the same input values (logits upcast exactly to float64), so the
only differences from a kernel are the kernel's own rounding.
"""
from __future__ import annotations

import torch


def selective_log_softmax_ref(logits, index, temperature=1.0, ignore_index=None):
    """Returns float64 (logp, entropy, lse, mean) with the kernel's conventions."""
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    p = logp_all.exp()
    # p * z at z = -inf (p = 0) is 0, its limit. Clamping z to a finite value
    # below any fp32 logit gives that and keeps autograd free of NaN (a where()
    # would not, nor would float64's lowest, whose products overflow).
    pz = p * z.clamp(min=-1e100)
    mean = pz.sum(-1)
    entropy = lse - mean
    ignored = torch.zeros_like(index, dtype=torch.bool) if ignore_index is None else index == ignore_index
    safe_index = torch.where(ignored, torch.zeros_like(index), index).long()
    logp = z.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1) - lse
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    return (torch.where(ignored, zero, logp), torch.where(ignored, zero, entropy),
            torch.where(ignored, zero, lse), torch.where(ignored, zero, mean))


def selective_log_softmax_grad_ref(logits, index, grad_logp, grad_entropy=None, temperature=1.0,
                                   ignore_index=None):
    """float64 gradient of sum(grad_logp * logp + grad_entropy * entropy) w.r.t. logits."""
    x = logits.detach().double().requires_grad_(True)
    logp, entropy, _, _ = selective_log_softmax_ref(x, index, temperature, ignore_index)
    total = (grad_logp.double() * logp).sum()
    if grad_entropy is not None:
        total = total + (grad_entropy.double() * entropy).sum()
    (grad,) = torch.autograd.grad(total, x)
    return grad
