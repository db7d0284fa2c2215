"""A local teacher's full logits: twinkle's GKDLoss with ``teacher_logits=`` (the whole vocab, or ``topk=``).

``gkd_from_logits(student_logits, teacher_logits, labels, topk=None)`` returns per token what twinkle-kit's
``GKDLoss(beta, temperature)`` sums for that token when the teacher's logits are local: over the whole
vocab (``topk=None``), or over the teacher's top-k ids (``topk=k``: the teacher's k largest logits and the
student's logits at those ids, each renormalized over the k). The math is divergence.gkd_rows (written
once; ``k = V`` for the whole vocab): the same formulas, the same limit 0 log 0 = 0, float64 inside, the
per-token loss rounded once to fp32 (fp64 for fp64 inputs).

Memory: twinkle's chunk loop keeps each chunk's autograd graph (about 7 [N, V] at beta = 0.5). Here the
rows go through the math in chunks of ``chunk_rows(V, chunk_bytes)`` rows, nothing of a chunk is kept:
saved for backward are the two logits (references), the labels, and for ``topk`` the teacher's ids and
dL/dx [N, k]; the whole-vocab backward recomputes each chunk's dL/dx from the logits and writes it into the
student's gradient. Peak beyond the inputs and the student's gradient: one chunk (``chunk_bytes``,
default 256 MiB), however many rows. Rows whose label is ``ignore_index`` give 0 and are not computed.
No gradient flows to the teacher (its logits must not require one). Plain torch on every device: the
op is a few [rows, V] elementwise passes and reductions, which torch runs at memory speed, and its
float64 math is what makes a divergence of 1e-7 between close distributions exact (docs/distillation.md).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..op.contract import check_float_tensor, stats_dtype
from ..op.op_args import call, named_inputs, pick, register_autograd
from ..op.rows import kept_rows
from .arguments import GkdOptions, check_teacher_logits, checked_gkd, flat_teacher, teacher_rows
from .divergence import gkd_rows

DEFAULT_CHUNK_BYTES = 256 << 20
# float64 [rows, V] tensors alive at once inside gkd_rows (and the chunk's copies), counted generously
TEMPORARIES = 20


# ------------------------------------------------------------------ a local teacher's full logits
def chunk_rows(vocab: int, chunk_bytes: int) -> int:
    """Rows per chunk: the float64 working tensors of the k-wide (here V-wide) math within chunk_bytes."""
    return max(1, chunk_bytes // (TEMPORARIES * 8 * vocab))


def _chunks(kept: Optional[Tensor], n: int, rows: int):
    """Index tensors of the kept rows, ``rows`` at a time."""
    all_rows = torch.arange(n) if kept is None else kept.cpu()
    for c0 in range(0, all_rows.numel(), rows):
        yield all_rows[c0:c0 + rows]


@torch.library.custom_op("twinkle_mem::gkd_logits_fwd", mutates_args=())
def gkd_logits_fwd(student: Tensor, teacher: Tensor, labels: Optional[Tensor], beta: float, temperature: float,
                   ignore_index: int, topk: int, chunk_bytes: int) -> tuple[Tensor, Tensor, Tensor]:
    """student [N, V], teacher [N, V] (or [..., V] of N rows); labels [N] or None; topk 0 (the whole vocab) or k.
    Returns (loss [N] fp32 (fp64 for fp64 student), dL/dx [N, k] at the teacher's top-k ids, those ids [N, k]
    int64); [N, 0] for the whole vocab. Rows whose label is ignore_index: 0, ids 0."""
    n, v = student.shape
    acc = stats_dtype(student)
    loss = student.new_zeros((n,), dtype=acc)
    coef = student.new_zeros((n, topk), dtype=acc)
    ids = torch.zeros((n, topk), dtype=torch.int64, device=student.device)
    kept = kept_rows(labels, ignore_index)
    for rows in _chunks(kept, n, chunk_rows(v, chunk_bytes)):
        rows = rows.to(student.device)
        x, t = student.index_select(0, rows), teacher_rows(teacher, rows)
        if topk:
            t, top = t.topk(topk, dim=-1)
            x = x.gather(-1, top)
            ids.index_copy_(0, rows, top)
        rows_loss, d = gkd_rows(x, t, beta, temperature)
        loss.index_copy_(0, rows, rows_loss.to(acc))
        if topk:
            coef.index_copy_(0, rows, d.to(acc))
    return loss, coef, ids


@gkd_logits_fwd.register_fake
def _gkd_logits_fwd_fake(student, teacher, labels, beta, temperature, ignore_index, topk, chunk_bytes):
    n = student.shape[0]
    acc = stats_dtype(student)
    return (student.new_empty((n,), dtype=acc), student.new_empty((n, topk), dtype=acc),
            student.new_empty((n, topk), dtype=torch.int64))


@torch.library.custom_op("twinkle_mem::gkd_logits_bwd", mutates_args=())
def gkd_logits_bwd(grad_loss: Tensor, coef: Tensor, ids: Tensor, student: Tensor, teacher: Tensor,
                   labels: Optional[Tensor], beta: float, temperature: float, ignore_index: int,
                   chunk_bytes: int) -> Tensor:
    """The student's gradient [N, V] (its dtype): scattered from dL/dx at the top-k ids, or, for the whole
    vocab, dL/dx recomputed chunk by chunk from the logits and written once per row."""
    n, v = student.shape
    grad = torch.zeros_like(student)
    if ids.shape[1]:  # top-k: the ids of a row are distinct (torch.topk); ignored rows add 0 at id 0
        g = grad_loss.to(coef.dtype).unsqueeze(1) * coef
        return grad.scatter_add_(1, ids, g.to(student.dtype))
    for rows in _chunks(kept_rows(labels, ignore_index), n, chunk_rows(v, chunk_bytes)):
        rows = rows.to(student.device)
        _loss, d = gkd_rows(student.index_select(0, rows), teacher_rows(teacher, rows), beta, temperature)
        g = grad_loss.index_select(0, rows).double().unsqueeze(1) * d
        grad.index_copy_(0, rows, g.to(student.dtype))
    return grad


@gkd_logits_bwd.register_fake
def _gkd_logits_bwd_fake(grad_loss, coef, ids, student, teacher, labels, beta, temperature, ignore_index,
                         chunk_bytes):
    return torch.empty_like(student)


def _setup_context(ctx, inputs, output):
    args = named_inputs(gkd_logits_fwd, inputs)
    ctx.gkd, ctx.chunk_bytes = pick(GkdOptions, gkd_logits_fwd, inputs), args["chunk_bytes"]
    _loss, coef, ids = output
    ctx.save_for_backward(args["student"], args["teacher"], args["labels"], coef, ids)
    ctx.mark_non_differentiable(coef, ids)


def _backward(ctx, grad_loss, _grad_coef, _grad_ids):
    student, teacher, labels, coef, ids = ctx.saved_tensors
    return {"student": call(gkd_logits_bwd, grad_loss, coef, ids, student, teacher, labels, ctx.gkd,
                            {"chunk_bytes": ctx.chunk_bytes})}


register_autograd(gkd_logits_fwd, _backward, _setup_context)


def gkd_from_logits(student_logits, teacher_logits, labels=None, *, topk=None, beta=0.5, temperature=1.0,
                    ignore_index=-100, chunk_bytes=None):
    """twinkle's GKDLoss per token with a local teacher's full logits (``topk=None``: over the whole vocab;
    ``topk=k``: over the teacher's top-k ids), saving no per-chunk graph.

    student_logits, teacher_logits: [..., V] (any float dtypes; the teacher's without gradient); labels:
    [...] or None. Returns the per-token loss [...], fp32 (fp64 for fp64 student logits), with the
    gradient to the student's logits; ``distill.gkd_average`` gives GKDLoss's scalar. Memory: one chunk of
    ``chunk_bytes`` (default 256 MiB) beyond the inputs and the student's gradient. See the module
    docstring and docs/distillation.md.
    """
    check_float_tensor("student_logits", student_logits)
    if student_logits.dim() < 1:
        raise ValueError("student_logits must have a vocab dim")
    check_teacher_logits(teacher_logits, student_logits.shape, student_logits, "student_logits")
    lead, v = tuple(student_logits.shape[:-1]), student_logits.shape[-1]
    gkd = checked_gkd(labels, student_logits, "student_logits", GkdOptions(beta, temperature, None, ignore_index))
    if topk is not None and (not isinstance(topk, int) or not 1 <= topk <= v):
        raise ValueError(f"topk must be None or an int in [1, V = {v}], got {topk!r}")
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
    n = student_logits.numel() // v
    loss, _coef, _ids = call(gkd_logits_fwd, student_logits.reshape(n, v), flat_teacher(teacher_logits),
                             None if labels is None else labels.reshape(n), gkd,
                             {"topk": int(topk or 0), "chunk_bytes": int(chunk_bytes)})
    return loss.view(lead)
