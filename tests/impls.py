"""The implementations of the op contract that run here, for tests/numerics.py.

- cpu: the native CPU kernels (torch.ops.twinkle_mem on CPU tensors);
- composite: python/twinkle_mem/composite.py called directly;
- each CPU emulation of a device kernel adds itself below (npu_emulated: the
  AscendC kernels compiled against the stand-in of the AscendC API, tests/npu_emulation.py).
"""
from __future__ import annotations

import torch

import npu_emulation
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
                                             ignore, vocab_start, budget_bytes=64 << 10)
        return logits
    return composite.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t,
                                               ignore, vocab_start, budget_bytes=64 << 10)


def _composite_forward(*args):
    return composite.selective_log_softmax_fwd(*args, budget_bytes=64 << 10)  # vocab blocks merged


IMPLS = [
    Impl("cpu", ops.selective_log_softmax_fwd, _native_backward),
    Impl("composite", _composite_forward, _composite_backward),
    Impl("npu_emulated", npu_emulation.forward, npu_emulation.backward),
]
