"""How the Python API's tensors reach the op: rows without copies.

The native op (csrc/ops.cpp) takes logits [N, V] or [B, S, V] with unit stride
on the vocab and any strides on the one or two leading dims as long as no two
rows overlap (csrc/common/op_checks.h: an expanded, stride-0, dim of size > 1
raises), and labels of the same leading shape (any strides), optionally with a
trailing dim of k labels per row. This module brings the API's ``logits [..., V]`` and
``index [...]`` / ``index [..., k]`` to that form:

- up to two leading dims: passed as they are, whatever their strides
  (``logits[:, :-1]``, ``logits[:, -r - 1:-1]`` of a batch are views, not copies);
- more leading dims: grouped into two (or one) where a view allows; the labels
  follow the same grouping (``reshape``: a view when their strides allow, else an
  O(N) copy of the labels, never of the logits);
- only logits that no view can bring there (a vocab stride other than 1, or
  more than two leading dims that no grouping merges) are copied, with a warning.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch


@dataclass
class OpRows:
    logits: torch.Tensor  # [N, V] or [B, S, V]
    labels: torch.Tensor  # logits' leading shape, or that + [k]
    lead_shape: torch.Size  # the caller's leading shape (entropy's shape)
    logp_shape: torch.Size  # the caller's index shape (logp's shape)


def _groupings(lead):
    """Ways to cut the leading dims into at most two contiguous groups, one group first."""
    yield (len(lead),)
    for cut in range(1, len(lead)):
        yield (cut, len(lead) - cut)


def _grouped_view(logits: torch.Tensor):
    """logits [..., V] as [N, V] or [B, S, V] without a copy, or None."""
    lead = logits.shape[:-1]
    vocab = logits.shape[-1]
    if vocab > 1 and logits.stride(-1) != 1:
        return None
    if len(lead) <= 2:
        return logits if len(lead) >= 1 else logits.unsqueeze(0)
    for groups in _groupings(lead):
        sizes, at = [], 0
        for g in groups:
            sizes.append(math.prod(lead[at:at + g]))
            at += g
        try:
            return logits.view(*sizes, vocab)
        except RuntimeError:
            continue
    return None


def to_op_rows(logits: torch.Tensor, index: torch.Tensor, multi: bool) -> OpRows:
    """The op's logits and labels for the API's arguments (checked by the caller).

    ``multi``: ``index`` is ``[..., k]`` (k labels per row) rather than ``[...]``.
    """
    lead_shape = logits.shape[:-1]
    rows = _grouped_view(logits)
    if rows is None:
        warnings.warn(
            f"twinkle_mem: logits of shape {tuple(logits.shape)} and strides {logits.stride()} cannot be viewed as "
            "[N, V] or [B, S, V] rows with unit vocab stride; a contiguous copy is made",
            stacklevel=4,
        )
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
    op_lead = rows.shape[:-1]
    if multi:
        labels = index.reshape(*op_lead, index.shape[-1]) if tuple(op_lead) != tuple(lead_shape) else index
    else:
        labels = index.reshape(op_lead) if tuple(op_lead) != tuple(lead_shape) else index
    return OpRows(rows, labels, lead_shape, index.shape)


def kept_rows(labels, ignore_index: int):
    """The indices of the rows a call works on, those with a label other than ``ignore_index`` (labels [N];
    [N, k]: kept if any of its k is, a row of k = 0 labels too), or None when every row is (labels None too).
    The fused heads drop the others before any matmul."""
    if labels is None or labels.numel() == 0:
        return None
    keep = labels != ignore_index
    kept = (keep.any(dim=1) if keep.dim() == 2 else keep).nonzero().squeeze(1)
    return None if kept.numel() == labels.shape[0] else kept
