"""The op's public functions: selective_log_softmax and entropy_from_logits.

A thin layer over torch.ops.twinkle_mem.selective_log_softmax_fwd: checks the
arguments (ValueError naming the argument), brings the tensors to the op's
row form without copying the logits (rows.py) and restores the caller's
shapes on the outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops
from .contract import check_logits_args, ignore_value
from .rows import to_op_rows
from .vocab_parallel import vocab_parallel_selective_log_softmax


def selective_log_softmax(logits, index, return_entropy=False, *, temperature=1.0, ignore_index=None,
                          inplace_backward=False, process_group=None):
    """Log-probabilities of the indexed tokens, and optionally the entropy, per row.

    logits: [..., V] bf16/fp16/fp32/fp64, read in place with any strides on the
    leading dims whose rows do not overlap (overlapping rows, e.g. an expanded
    dim, raise RuntimeError; a vocab stride other than 1 costs a copy); index:
    [...] int64/int32 labels, or [..., k] for k labels per row. Returns fp32
    ``logp`` of the index's shape (fp64 for fp64 logits), or ``(logp, entropy)``
    with entropy [...] when ``return_entropy``.
    ``temperature`` divides the logits (in-register). An index equal to
    ``ignore_index`` gives logp 0 and no gradient; a row whose indices are all
    ignored gives entropy 0 too. Nothing full-vocab is kept for backward beyond
    a reference to the logits. With ``inplace_backward=True`` the gradient is
    written over the logits, which then hold the gradient (their version counter
    is bumped, so any other autograd use of them raises instead of reading wrong
    values; where autograd keeps the gradient in a ``.grad``, of leaf logits, that
    is the same memory, not a copy). With ``process_group`` (world size > 1), ``logits`` are this rank's
    vocab shard ``[rank * V/tp, (rank + 1) * V/tp)`` and ``index`` holds global
    ids: the outputs are the full-vocab ones, the same on every rank
    (``twinkle_mem.vocab_parallel``; docs/vocab_parallel.md).
    """
    multi = check_logits_args(logits, index, temperature, ignore_index)
    rows = to_op_rows(logits, index, multi)
    ignore = ignore_value(ignore_index)
    if process_group is not None and dist.get_world_size(process_group) > 1:
        logp, entropy = vocab_parallel_selective_log_softmax(rows.logits, rows.labels, return_entropy,
                                                             1.0 / temperature, ignore, inplace_backward,
                                                             process_group)
    else:
        vocab = rows.logits.shape[-1]
        if torch.compiler.is_compiling():
            # 1/T as a tensor: a temperature that changes between compiled calls then costs no recompile.
            forward, inv_temperature = ops.fwd_t, ops.inv_temperature_tensor(temperature)
        else:  # eager: the native op straight away (the same double; no Python custom op in between)
            forward, inv_temperature = ops.fwd, 1.0 / temperature
        logp, entropy, _shift, _log_sum = forward(rows.logits, rows.labels, inv_temperature, ignore, 0, vocab,
                                                  bool(return_entropy), bool(inplace_backward))
    logp = logp.view(rows.logp_shape)
    if return_entropy:
        return logp, entropy.view(rows.lead_shape)
    return logp


def entropy_from_logits(logits, chunk_size=None, *, temperature=1.0, inplace_backward=False):
    """Entropy of softmax(logits / temperature) per row, fp32 (fp64 for fp64 logits).

    ``chunk_size`` is accepted for drop-in compatibility with TRL's function of
    the same name and ignored: the kernel streams each row without chunks.
    """
    if isinstance(logits, torch.Tensor) and logits.dim() >= 1:
        no_labels = torch.zeros((*logits.shape[:-1], 0), dtype=torch.int32, device=logits.device)
    else:
        no_labels = None
    _logp, entropy = selective_log_softmax(logits, no_labels, True, temperature=temperature,
                                           inplace_backward=inplace_backward)
    return entropy
