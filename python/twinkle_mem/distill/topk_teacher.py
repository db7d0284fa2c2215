"""A top-k teacher (twinkle's ``teacher_topk_indices`` / ``teacher_topk_logprobs``: the recipes' vLLM
``prompt_logprobs = k``): GKD over the teacher's k ids, whichever way the student's logits at those ids are
read.

``topk_rows`` / ``topk_upstream``: the kept rows' loss and dL/dx from the student's logits x at the ids, and
the upstream gradient at the ids, for this rank's vocab shard (ids held by another rank: 0, one all_reduce of
x combines the ranks); shared by heads/gkd_topk.py (x from the LM head's input) and
``gkd_topk_from_logits`` here (x read from the student's logits: saved for backward dL/dx [N, k] and the
ids, not the logits). The math: divergence.gkd_rows, k entries per row.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..op.contract import check_float_tensor, stats_dtype
from ..op.op_args import call, named_inputs, pick, register_autograd
from ..op.rows import kept_rows
from ..op.vocab_parallel import VocabShard
from .arguments import GkdOptions, check_topk_teacher, checked_gkd
from .divergence import gkd_rows


def _select(t: Optional[Tensor], kept: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or kept is None else t.index_select(0, kept)


def check_teacher_ids(ids: Tensor, vocab_size: int) -> None:
    """Every kept teacher id in [0, vocab_size); checked before any collective (every rank holds the same ids
    and raises alike)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        i, k = int(bad.flatten().nonzero()[0]), ids.shape[1]
        raise RuntimeError(f"twinkle_mem: teacher id out of range: {int(ids.flatten()[i])} is not in "
                           f"[0, {vocab_size}) (at kept row {i // k}, entry {i % k})")


def topk_rows(student_x, teacher_ids: Tensor, teacher_logprobs: Tensor, kept: Optional[Tensor], gkd: GkdOptions,
              shard: VocabShard, width: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """A top-k teacher's (loss [N] in acc, dL/dx [N, k] float64; 0 on the rows not ``kept``), the student's logits
    at the kept rows' ids read by ``student_x(local)`` ([m, k] in acc) for the ids this shard (``width``
    columns) holds and summed over its group. Shared by linear_gkd_topk (x from the hidden states) and
    gkd_topk_from_logits (x read from the logits). dL/dx stays float64 (O(N k)): a row's repeated ids, whose
    terms can cancel, are summed before one rounding."""
    n, k = teacher_ids.shape
    loss = teacher_logprobs.new_zeros((n,), dtype=acc)
    coef = teacher_logprobs.new_zeros((n, k), dtype=torch.float64)
    ids = _select(teacher_ids, kept).long()
    if ids.numel() == 0:  # (the same on every rank: the labels are)
        return loss, coef
    check_teacher_ids(ids, shard.vocab_size)
    local, own = shard.local_ids(ids, width)
    x = shard.sum(torch.where(own, student_x(local), 0.0))  # each id held by one rank: the others add 0
    rows_loss, rows_coef = gkd_rows(x, _select(teacher_logprobs, kept), gkd.beta, gkd.temperature, gkd.teacher_temp())
    if kept is None:
        return rows_loss.to(acc), rows_coef
    return loss.index_copy_(0, kept, rows_loss.to(acc)), coef.index_copy_(0, kept, rows_coef)


def topk_upstream(grad_loss: Tensor, coef: Tensor, teacher_ids: Tensor, kept: Optional[Tensor], shard: VocabShard,
                  width: int, acc: torch.dtype):
    """(the kept rows' local ids [m, k], whether this shard holds each, g = grad_loss dL/dx [m, k] in acc, 0 at ids
    this shard does not hold), or None where no row is kept: what both top-k backwards start from."""
    ids = _select(teacher_ids, kept).long()
    if ids.numel() == 0:
        return None
    local, own = shard.local_ids(ids, width)
    g = _select(grad_loss, kept).to(acc).unsqueeze(1) * _select(coef, kept).to(acc)
    return local, own, torch.where(own, g, 0.0)


# ------------------------------------------------------------------ from the student's logits
DEDUP_ENTRIES = 1 << 24  # rows x k x k at a time when summing a row's repeated ids (bools)


@torch.library.custom_op("twinkle_mem::gkd_topk_logits_fwd", mutates_args=())
def gkd_topk_logits_fwd(student: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, labels: Optional[Tensor],
                        beta: float, temperature: float, ignore_index: int, vocab_start: int, vocab_size: int,
                        group_name: str) -> tuple[Tensor, Tensor]:
    """student [N, Vs] (the vocab [vocab_start, vocab_start + Vs) of vocab_size), teacher_ids [N, k] global,
    teacher_logprobs [N, k], labels [N] or None. Returns (loss [N] fp32 (fp64 for fp64), dL/dx [N, k] float64)."""
    kept = kept_rows(labels, ignore_index)
    rows = (torch.arange(student.shape[0], device=student.device) if kept is None else kept).unsqueeze(1)
    acc = stats_dtype(student)
    return topk_rows(lambda local: student[rows, local].to(acc),  # [m, k]: no row of the logits copied
                     teacher_ids, teacher_logprobs, kept, GkdOptions(beta, temperature, None, ignore_index),
                     VocabShard(vocab_start, vocab_size, group_name), student.shape[1], acc)


@gkd_topk_logits_fwd.register_fake
def _gkd_topk_logits_fwd_fake(student, teacher_ids, teacher_logprobs, labels, beta, temperature, ignore_index,
                              vocab_start, vocab_size, group_name):
    n, k = teacher_ids.shape
    return student.new_empty((n,), dtype=stats_dtype(student)), student.new_empty((n, k), dtype=torch.float64)


def _sum_repeated(g: Tensor, local: Tensor) -> Tensor:
    """g [m, k] with each row's entries of one id summed into the first of them (the others 0): scattered
    into the gradient, every column then gets one value, rounded once to the logits' dtype."""
    out = torch.empty_like(g)
    rows = max(1, DEDUP_ENTRIES // g.shape[1] ** 2)
    for r0 in range(0, g.shape[0], rows):
        ids, part = local[r0:r0 + rows], g[r0:r0 + rows]
        first = (ids.unsqueeze(2) == ids.unsqueeze(1)).byte().argmax(-1)  # each entry's first entry of its id
        out[r0:r0 + rows] = torch.zeros_like(part).scatter_add_(1, first, part)
    return out


@torch.library.custom_op("twinkle_mem::gkd_topk_logits_bwd", mutates_args=())
def gkd_topk_logits_bwd(grad_loss: Tensor, coef: Tensor, teacher_ids: Tensor, labels: Optional[Tensor],
                        ignore_index: int, vocab_start: int, shard: int, dtype: torch.dtype) -> Tensor:
    """The student's gradient [N, shard] in ``dtype``: g dL/dx at the ids this shard holds, 0 elsewhere."""
    n = teacher_ids.shape[0]
    grad = coef.new_zeros((n, shard), dtype=dtype)
    kept = kept_rows(labels, ignore_index)
    upstream = topk_upstream(grad_loss, coef, teacher_ids, kept, VocabShard(vocab_start), shard, torch.float64)
    if upstream is None:
        return grad
    local, _own, g = upstream
    rows = (torch.arange(n, device=grad.device) if kept is None else kept).unsqueeze(1).expand_as(local)
    return grad.index_put_((rows, local), _sum_repeated(g, local).to(dtype), accumulate=True)


@gkd_topk_logits_bwd.register_fake
def _gkd_topk_logits_bwd_fake(grad_loss, coef, teacher_ids, labels, ignore_index, vocab_start, shard, dtype):
    return coef.new_empty((teacher_ids.shape[0], shard), dtype=dtype)


def _topk_setup_context(ctx, inputs, output):
    args = named_inputs(gkd_topk_logits_fwd, inputs)
    ctx.gkd, ctx.vocab = pick(GkdOptions, gkd_topk_logits_fwd, inputs), pick(VocabShard, gkd_topk_logits_fwd, inputs)
    ctx.student = {"shard": args["student"].shape[1], "dtype": args["student"].dtype}  # not the logits themselves
    ctx.save_for_backward(output[1], args["teacher_ids"], args["labels"])
    ctx.mark_non_differentiable(output[1])


def _topk_backward(ctx, grad_loss, _grad_coef):
    coef, teacher_ids, labels = ctx.saved_tensors
    return {"student": call(gkd_topk_logits_bwd, grad_loss, coef, teacher_ids, labels, ctx.gkd, ctx.vocab,
                            ctx.student)}


register_autograd(gkd_topk_logits_fwd, _topk_backward, _topk_setup_context)


def gkd_topk_from_logits(student_logits, teacher_ids, teacher_logprobs, labels=None, *, beta=0.5, temperature=1.0,
                         ignore_index=-100, process_group=None):
    """twinkle's GKDLoss per token over a top-k teacher (``teacher_topk_indices`` / ``teacher_topk_logprobs``),
    from the student's logits: what ``linear_gkd_topk`` computes from hidden states, for callers that hold
    the logits.

    student_logits: [..., V] any float dtype (under ``process_group``: this rank's vocab shard, Megatron's
    split); teacher_ids [..., k] int64/int32 global ids; teacher_logprobs [..., k]; labels [...] or None.
    Returns the per-token loss [...], fp32 (fp64 for fp64 logits), its math in float64, with the gradient to
    the student's logits (a row's repeated ids summed before one rounding to the logits' dtype). Saved for
    backward: O(N k), not the logits. Under ``process_group`` every rank returns the same loss.
    """
    check_float_tensor("student_logits", student_logits)
    if student_logits.dim() < 1:
        raise ValueError("student_logits must have a vocab dim")
    check_topk_teacher(teacher_ids, teacher_logprobs, student_logits, "student_logits")
    gkd = checked_gkd(labels, student_logits, "student_logits", GkdOptions(beta, temperature, None, ignore_index))
    v, k = student_logits.shape[-1], teacher_ids.shape[-1]
    n = math.prod(student_logits.shape[:-1])
    loss, _coef = call(gkd_topk_logits_fwd, student_logits.reshape(n, v), teacher_ids.reshape(n, k),
                       teacher_logprobs.reshape(n, k), None if labels is None else labels.reshape(n), gkd,
                       VocabShard.of(process_group, v, "student_logits"))
    return loss.view(student_logits.shape[:-1])
