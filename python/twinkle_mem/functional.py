"""Public functions: selective_log_softmax and entropy_from_logits.

A thin layer over torch.ops.twinkle_mem.selective_log_softmax_fwd: checks the
arguments (ValueError naming the argument), brings the tensors to the op's
row form without copying the logits (rows.py) and restores the caller's
shapes on the outputs.
"""
from __future__ import annotations

import math

import torch

from . import ops
from .rows import to_op_rows

# A label value no int32/int64 label can take when the caller ignores nothing.
NO_IGNORE_INDEX = -(2**63)


def check_args(logits, index, temperature, ignore_index) -> bool:
    """Raises ValueError naming the bad argument; returns whether ``index`` is ``[..., k]``."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"logits dtype {logits.dtype} is not supported (bf16, fp16, fp32, fp64)")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocab dim of size >= 1, got shape {tuple(logits.shape)}")
    return check_index_and_options(index, logits, "logits", temperature, ignore_index)


def check_index_and_options(index, rows, rows_name, temperature, ignore_index) -> bool:
    """The checks shared by every public function whose rows are ``rows [..., X]`` (the logits, or the
    hidden states of linear_selective_log_softmax): index of the leading shape (+ [k]) on the same device,
    temperature, ignore_index. Returns whether ``index`` is ``[..., k]``."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index must be an int64 or int32 tensor, got {getattr(index, 'dtype', type(index))}")
    lead = tuple(rows.shape[:-1])
    multi = index.dim() == rows.dim()
    if not (tuple(index.shape) == lead or (multi and tuple(index.shape[:-1]) == lead)):
        raise ValueError(f"index shape {tuple(index.shape)} must be {rows_name}.shape[:-1] = {lead}, or that plus a "
                         "trailing dim of k indices per row")
    if index.device != rows.device:
        raise ValueError(f"index is on {index.device} but {rows_name} are on {rows.device}")
    if isinstance(temperature, torch.Tensor):
        raise ValueError("temperature must be a Python number, not a tensor")
    # Comparisons, not math.isfinite: under torch.compile a temperature that changed between calls is a
    # SymFloat, which the comparisons keep symbolic (NaN fails both).
    if not (0 < temperature < math.inf):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if ignore_index is not None and not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")
    return multi


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
    values). With ``process_group`` (world size > 1), ``logits`` are this rank's
    vocab shard ``[rank * V/tp, (rank + 1) * V/tp)`` and ``index`` holds global
    ids: the outputs are the full-vocab ones, the same on every rank
    (``twinkle_mem.vocab_parallel``; docs/vocab_parallel.md).
    """
    multi = check_args(logits, index, temperature, ignore_index)
    rows = to_op_rows(logits, index, multi)
    ignore = NO_IGNORE_INDEX if ignore_index is None else int(ignore_index)
    if process_group is not None and torch.distributed.get_world_size(process_group) > 1:
        from .vocab_parallel import vocab_parallel_selective_log_softmax
        logp, entropy = vocab_parallel_selective_log_softmax(rows.logits, rows.labels, return_entropy,
                                                             1.0 / temperature, ignore, inplace_backward,
                                                             process_group)
    else:
        vocab = rows.logits.shape[-1]
        # 1/T as a tensor: a temperature that changes between torch.compile'd calls then costs no recompile.
        logp, entropy, _shift, _log_sum = ops.fwd_t(rows.logits, rows.labels, ops.inv_temperature_tensor(temperature),
                                                    ignore, 0, vocab, bool(return_entropy), bool(inplace_backward))
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
