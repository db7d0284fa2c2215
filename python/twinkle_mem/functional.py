"""Public functions: selective_log_softmax and entropy_from_logits.

A thin layer over torch.ops.twinkle_mem.selective_log_softmax_fwd: checks the
arguments (ValueError naming the argument), flattens leading dims to rows and
restores them on the outputs.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import ops

# A label value no int32/int64 label can take when the caller ignores nothing.
NO_IGNORE_INDEX = -(2**63)


def _check_args(logits, index, temperature, ignore_index):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"logits dtype {logits.dtype} is not supported (bf16, fp16, fp32, fp64)")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocab dim of size >= 1, got shape {tuple(logits.shape)}")
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index must be an int64 or int32 tensor, got {getattr(index, 'dtype', type(index))}")
    if tuple(index.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"index shape {tuple(index.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}")
    if index.device != logits.device:
        raise ValueError(f"index is on {index.device} but logits are on {logits.device}")
    if isinstance(temperature, torch.Tensor):
        raise ValueError("temperature must be a Python number, not a tensor")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if ignore_index is not None and not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V] rows with unit vocab stride, without a copy whenever a view allows it."""
    vocab = logits.shape[-1]
    try:
        rows = logits.view(-1, vocab)
        if vocab <= 1 or rows.stride(1) == 1:
            return rows
    except RuntimeError:
        pass
    warnings.warn(
        f"twinkle_mem: logits of shape {tuple(logits.shape)} and strides {logits.stride()} cannot be viewed as "
        "[N, V] rows with unit vocab stride; a contiguous copy is made (slice the labels instead of the logits "
        "to avoid it)",
        stacklevel=3,
    )
    return logits.reshape(-1, vocab).contiguous()


def selective_log_softmax(logits, index, return_entropy=False, *, temperature=1.0, ignore_index=None,
                          inplace_backward=False, process_group=None):
    """Log-probabilities of the label tokens, and optionally the entropy, per row.

    logits: [..., V] bf16/fp16/fp32/fp64; index: [...] int64/int32 labels.
    Returns fp32 ``logp`` [...] (fp64 for fp64 logits), or ``(logp, entropy)``
    when ``return_entropy``. ``temperature`` divides the logits (in-register).
    Rows whose label equals ``ignore_index`` give logp 0, entropy 0 and no
    gradient. Nothing full-vocab is kept for backward beyond a reference to the
    logits. With ``inplace_backward=True`` the gradient is written over the
    logits, which then hold the gradient (their version counter is bumped, so
    any other autograd use of them raises instead of reading wrong values).
    With ``process_group`` (world size > 1), ``logits`` are this rank's vocab
    shard ``[rank * V/tp, (rank + 1) * V/tp)`` and ``index`` holds global ids:
    the outputs are the full-vocab ones, the same on every rank
    (``twinkle_mem.vocab_parallel``; docs/vocab_parallel.md).
    """
    _check_args(logits, index, temperature, ignore_index)
    if process_group is not None and torch.distributed.get_world_size(process_group) > 1:
        from .vocab_parallel import vocab_parallel_selective_log_softmax
        return vocab_parallel_selective_log_softmax(logits, index, return_entropy, temperature, ignore_index,
                                                    inplace_backward, process_group)
    lead_shape = logits.shape[:-1]
    rows = _as_rows(logits)
    labels = index.reshape(-1)
    vocab = rows.shape[1]
    logp, entropy, _lse, _mean = ops.fwd(
        rows, labels, 1.0 / float(temperature), NO_IGNORE_INDEX if ignore_index is None else ignore_index,
        0, vocab, bool(return_entropy), bool(inplace_backward))
    logp = logp.view(lead_shape)
    if return_entropy:
        return logp, entropy.view(lead_shape)
    return logp


def entropy_from_logits(logits, chunk_size=None, *, temperature=1.0, inplace_backward=False):
    """Entropy of softmax(logits / temperature) per row, fp32 (fp64 for fp64 logits).

    ``chunk_size`` is accepted for drop-in compatibility with TRL's function of
    the same name and ignored: the kernel streams each row without chunks.
    """
    if isinstance(logits, torch.Tensor) and logits.dim() >= 1:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.int32, device=logits.device)
    else:
        labels = None
    _logp, entropy = selective_log_softmax(logits, labels, True, temperature=temperature,
                                           inplace_backward=inplace_backward)
    return entropy
