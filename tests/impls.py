"""The implementations of the op contract that run here, for tests/numerics.py.

- cpu: the native CPU kernels (torch.ops.twinkle_mem on CPU tensors);
- composite: python/twinkle_mem/composite.py called directly;
- each CPU emulation of a device kernel adds itself below.
"""
from __future__ import annotations

import torch

from numerics import Impl
from twinkle_mem import composite

ops = torch.ops.twinkle_mem


def _native_backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start,
                     inplace):
    if inplace:
        ops.selective_log_softmax_bwd_(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore,
                                       vocab_start)
        return logits
    return ops.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore,
                                         vocab_start)


def _composite_backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start,
                        inplace):
    if inplace:
        composite.selective_log_softmax_bwd_(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t,
                                             ignore, vocab_start, budget_bytes=16 << 10)
        return logits
    return composite.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t,
                                               ignore, vocab_start, budget_bytes=16 << 10)


def _composite_forward(*args):
    return composite.selective_log_softmax_fwd(*args, budget_bytes=16 << 10)  # vocab blocks merged


IMPLS = [
    Impl("cpu", ops.selective_log_softmax_fwd, _native_backward),
    Impl("composite", _composite_forward, _composite_backward),
]
