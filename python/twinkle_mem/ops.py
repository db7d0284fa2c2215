"""Fake (meta) kernels and autograd for the native ops torch.ops.twinkle_mem.*.

The schemas live in csrc/ops.cpp. The forward saves only the logits
reference, the labels and O(N) statistics (lse, mean); the backward is one
native call, out of place or written over the logits (inplace_backward).
"""
from __future__ import annotations

import torch

from . import _native

_native.load()

fwd = torch.ops.twinkle_mem.selective_log_softmax_fwd.default
bwd = torch.ops.twinkle_mem.selective_log_softmax_bwd.default
bwd_inplace = torch.ops.twinkle_mem.selective_log_softmax_bwd_.default


def _stats_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.register_fake("twinkle_mem::selective_log_softmax_fwd")
def _fwd_fake(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy,
              inplace_backward=False):
    torch._check(logits.dim() == 2, lambda: "twinkle_mem: logits must be 2-D [N, V]")
    torch._check(labels.dim() == 1 and labels.shape[0] == logits.shape[0],
                 lambda: "twinkle_mem: labels must be 1-D of length N")
    n = logits.shape[0]
    dtype = _stats_dtype(logits)
    n_stats = n if with_entropy else 0
    return (logits.new_empty(n, dtype=dtype), logits.new_empty(n_stats, dtype=dtype),
            logits.new_empty(n, dtype=dtype), logits.new_empty(n_stats, dtype=dtype))


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd")
def _bwd_fake(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index, vocab_start):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd_")
def _bwd_inplace_fake(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                      vocab_start):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, inv_temperature, ignore_index, vocab_start, _vocab_size, with_entropy, *rest = inputs
    _logp, _entropy, lse, mean = output
    ctx.save_for_backward(logits, labels, lse, mean)
    ctx.inv_temperature = inv_temperature
    ctx.ignore_index = ignore_index
    ctx.vocab_start = vocab_start
    ctx.with_entropy = with_entropy
    ctx.inplace_backward = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(lse, mean)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse, _grad_mean):
    logits, labels, lse, mean = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = lse.new_zeros(lse.shape)
    use_entropy = ctx.with_entropy and grad_entropy is not None
    args = (grad_logp, grad_entropy if use_entropy else None)
    rest = (labels, lse, mean if use_entropy else None, ctx.inv_temperature, ctx.ignore_index, ctx.vocab_start)
    if ctx.inplace_backward:
        bwd_inplace(*args, logits, *rest)
        # The dispatcher does not bump the version of a tensor a custom op
        # mutates: do it, so that any other saved use of the logits raises.
        torch.autograd.graph.increment_version(logits)
        grad_logits = logits
    else:
        grad_logits = bwd(*args, logits, *rest)
    return grad_logits, None, None, None, None, None, None, None


torch.library.register_autograd("twinkle_mem::selective_log_softmax_fwd", _backward, setup_context=_setup_context)
