"""Fake (meta) kernels and autograd for the native ops torch.ops.twinkle_mem.*.

The schemas live in schemas.def (registered by csrc/ops.cpp). The forward saves only the logits
reference, the labels and O(N) statistics (shift, log_sum, and entropy when
computed); the backward is one native call, out of place or written over the
logits (inplace_backward).
"""
from __future__ import annotations

import torch

from . import _native

_native.load()

fwd = torch.ops.twinkle_mem.selective_log_softmax_fwd.default
bwd = torch.ops.twinkle_mem.selective_log_softmax_bwd.default
bwd_inplace = torch.ops.twinkle_mem.selective_log_softmax_bwd_.default


def stats_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def strided_grad_alloc(sizes, strides):
    """csrc/common/layout.h strided_grad_alloc(): sizes to allocate for a gradient
    with the logits' strides, or None for a contiguous gradient."""
    ndim = len(sizes)
    if ndim not in (2, 3) or any(s < 1 for s in sizes):
        return None
    vocab = sizes[-1]
    if vocab > 1 and strides[-1] != 1:
        return None
    if strides[-2] < vocab:
        return None
    alloc = [0] * ndim
    alloc[-1] = strides[-2]
    for d in range(ndim - 2, 0, -1):
        if strides[d] <= 0 or strides[d - 1] % strides[d] != 0:
            return None
        alloc[d] = strides[d - 1] // strides[d]
        if alloc[d] < sizes[d]:
            return None
    alloc[0] = sizes[0]
    numel = 1
    span = 1
    for s, a in zip(sizes, alloc):
        numel *= s
        span *= a
    return alloc if numel < span and span - numel <= numel // 8 else None


def new_grad_like(logits: torch.Tensor) -> torch.Tensor:
    """The out-of-place gradient's layout, as the native backends allocate it."""
    sizes = list(logits.shape)
    alloc = strided_grad_alloc(sizes, list(logits.stride()))
    if alloc is None:
        return logits.new_empty(sizes)
    grad = logits.new_empty(alloc)
    for d, (s, a) in enumerate(zip(sizes, alloc)):
        if s != a:
            grad = grad.narrow(d, 0, s)
    return grad


@torch.library.register_fake("twinkle_mem::selective_log_softmax_fwd")
def _fwd_fake(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy,
              inplace_backward=False):
    torch._check(logits.dim() in (2, 3), lambda: "twinkle_mem: logits must be [N, V] or [B, S, V]")
    lead = logits.shape[:-1]
    torch._check(labels.dim() in (len(lead), len(lead) + 1) and labels.shape[:len(lead)] == lead,
                 lambda: "twinkle_mem: labels must have the logits' leading shape (+ [k])")
    dtype = stats_dtype(logits)
    return (logits.new_empty(labels.shape, dtype=dtype), logits.new_empty(lead if with_entropy else (0,), dtype=dtype),
            logits.new_empty(lead, dtype=dtype), logits.new_empty(lead, dtype=dtype))


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd")
def _bwd_fake(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature, ignore_index,
              vocab_start):
    return new_grad_like(logits)


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd_")
def _bwd_inplace_fake(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                      ignore_index, vocab_start):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, inv_temperature, ignore_index, vocab_start, _vocab_size, with_entropy, *rest = inputs
    _logp, entropy, shift, log_sum = output
    ctx.save_for_backward(logits, labels, shift, log_sum, entropy if with_entropy else None)
    ctx.inv_temperature = inv_temperature
    ctx.ignore_index = ignore_index
    ctx.vocab_start = vocab_start
    ctx.with_entropy = with_entropy
    ctx.inplace_backward = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(shift, log_sum)


def backward_into_logits(logits, labels, shift, log_sum, entropy, grad_logp, grad_entropy, inv_temperature,
                         ignore_index, vocab_start, inplace):
    """One native backward call; returns the gradient (the logits themselves when ``inplace``)."""
    if grad_logp is None:
        grad_logp = shift.new_zeros(labels.shape)
    use_entropy = entropy is not None and grad_entropy is not None
    args = (grad_logp, grad_entropy if use_entropy else None)
    rest = (labels, shift, log_sum, entropy if use_entropy else None, inv_temperature, ignore_index, vocab_start)
    if inplace:
        bwd_inplace(*args, logits, *rest)
        # The dispatcher does not bump the version of a tensor a custom op
        # mutates: do it, so that any other saved use of the logits raises.
        torch.autograd.graph.increment_version(logits)
        return logits
    return bwd(*args, logits, *rest)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum):
    logits, labels, shift, log_sum, entropy = ctx.saved_tensors
    grad_logits = backward_into_logits(logits, labels, shift, log_sum, entropy, grad_logp,
                                       grad_entropy if ctx.with_entropy else None, ctx.inv_temperature,
                                       ctx.ignore_index, ctx.vocab_start, ctx.inplace_backward)
    return grad_logits, None, None, None, None, None, None, None


torch.library.register_autograd("twinkle_mem::selective_log_softmax_fwd", _backward, setup_context=_setup_context)
