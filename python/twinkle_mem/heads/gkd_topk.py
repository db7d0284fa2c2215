"""Distillation from the LM head's input: twinkle's GKDLoss over a top-k teacher, per token, in fp32.

``linear_gkd_topk(hidden, weight, teacher_ids, teacher_logprobs, labels)`` returns, per token, the loss
twinkle-kit's ``GKDLoss(beta, temperature)`` sums for that token in its top-k mode (twinkle/loss/gkd.py,
``teacher_topk_logprobs`` / ``teacher_topk_indices``), and ``gkd_average`` (distill/divergence.py) its
average over the kept tokens. The student's logits are needed only at the teacher's k ids, so only those
are computed:

    x[n, j] = hidden[n] . weight[ids[n, j]] + bias[ids[n, j]]          (fp32 sums; fp64 for fp64 inputs)

then the loss and dL/dx of twinkle's generalized JSD over the k entries of each row (distill/divergence.py:
the formulas, float64, the loss rounded once; distill/topk_teacher.topk_rows, shared with
gkd_topk_from_logits). Repeated ids (the recipe's padding rows: k ids 0 with log-probs 0.0) are k separate
entries, as in twinkle.

It runs on the blockwise engine (heads/engine.py) in its other block shape: per row tile of ``tile_rows(k, H)``
rows (fixed by k and H: a row's results do not depend on the batch; the last tile zero-padded), the tile's
k weight rows gathered ([R, k, H], fp32) and one batched matmul with the hidden rows
(engine.gathered_logits). Rows whose label is ``ignore_index`` are dropped before any of it. Saved for
backward: the inputs (references) and dL/dx [N, k]. Backward (engine.gathered_backward):

    grad_hidden[n] = sum_j g_n dL/dx[n, j] weight[ids[n, j]]     (per row tile, fp32, rounded once)
    grad_weight[v] = sum_{(n, j): ids[n, j] = v} g_n dL/dx[n, j] hidden[n]   (per vocab block of
                     plans.block_width columns, an fp32 accumulator for bf16/fp16, rounded once)
    grad_bias[v]   likewise with 1 for hidden[n].

Tensor parallelism (``process_group``): ``weight`` / ``bias`` are this rank's vocab shard
``[r Vs, (r + 1) Vs)`` and the ids global. Each rank computes the x of the ids it holds (0 elsewhere),
one all_reduce (sum) of x [N_kept, k] makes the full x on every rank (each id is held by one rank, the
others add exact zeros), and every rank computes the same loss. Backward: no collective; the upstream
gradient is the same on every rank, grad_weight / grad_bias are this shard's, and grad_hidden is this
rank's partial sum (Megatron's ColumnParallelLinear convention, as linear_selective_log_softmax).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..distill.arguments import GkdOptions, check_topk_teacher, checked_gkd
from ..distill.divergence import gkd_rows
from ..distill.topk_teacher import check_teacher_ids, topk_rows, topk_upstream
from ..op.contract import stats_dtype
from ..op.op_args import call, named_inputs, pick, register_autograd
from ..op.vocab_parallel import VocabShard
from .engine import Needs, Rows, check_head_args, fake_grads, frozen_head, pad_rows
from .frozen import grad_from_vectors, save_one_output
from .gathered import gathered_backward, gathered_logits, gathered_tiles

# The gathered weight rows of one row tile, in fp32: R k H 4 bytes at most this (and R <= MAX_TILE_ROWS).
# With the tile's copy in the input dtype and the hidden tile, a pass holds about twice this at once.
GATHER_BYTES = 32 << 20
MAX_TILE_ROWS = 512


def tile_rows(k: int, hidden_size: int) -> int:
    """Rows per tile: from k and H alone (never N), so that a row's matmuls have one shape whatever the batch."""
    return max(1, min(MAX_TILE_ROWS, GATHER_BYTES // max(1, 4 * k * hidden_size)))


# ------------------------------------------------------------------ forward op
def frozen_in_forward(frozen: bool, group_name: str) -> bool:
    """Whether the forward sums dL/dhidden (a frozen head, one process): then each row tile's k weight rows are
    gathered once, for x and for the vector. Under tensor parallelism the loss needs every rank's x first, so the
    gather would be made twice and the vectors (N H) would outweigh dL/dx (N k): the backward gathers, as for a
    trainable head."""
    return frozen and not group_name


def _frozen_rows(rows: Rows, weight: Tensor, bias: Optional[Tensor], teacher_ids: Tensor, teacher_logprobs: Tensor,
                 gkd: GkdOptions, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(loss [N], dL/dhidden [N, H]) in acc, 0 on the rows not kept: per row tile, its k weight rows gathered once,
    x, the tile's loss and dL/dx (divergence.gkd_rows, float64), and sum_j dL/dx_j weight[ids_j] from the same
    rows (fp32 sums, rounded once)."""
    n, h = rows.n, weight.shape[1]
    loss, vectors = weight.new_zeros((n,), dtype=acc), weight.new_zeros((n, h), dtype=acc)
    ids = rows.select(teacher_ids).long()
    if ids.numel() == 0:
        return loss, vectors
    check_teacher_ids(ids, weight.shape[0])
    teacher = rows.select(teacher_logprobs)
    for r0, r1, w, x in gathered_tiles(rows.tiles, weight, bias, ids):
        tile_loss, coef = gkd_rows(x, teacher[r0:r1], gkd.beta, gkd.temperature, gkd.teacher_temp())
        rows.put(loss, r0, tile_loss.to(acc))
        tile_coef = pad_rows(coef.to(acc), w.shape[0]).unsqueeze(1)  # the whole tile: one shape whatever N is
        rows.put(vectors, r0, torch.bmm(tile_coef, w).squeeze(1)[: r1 - r0])
    return loss, vectors


@torch.library.custom_op("twinkle_mem::linear_gkd_topk_fwd", mutates_args=())
def gkd_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], teacher_ids: Tensor, teacher_logprobs: Tensor,
            labels: Optional[Tensor], beta: float, temperature: float, teacher_temperature: float, ignore_index: int,
            vocab_start: int, vocab_size: int, group_name: str, frozen: bool) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [Vs, H] (the vocab [vocab_start, vocab_start + Vs) of vocab_size), bias [Vs]
    or None, teacher_ids [N, k] global ids, teacher_logprobs [N, k], labels [N] or None. Returns
    (loss [N] fp32 (fp64 for fp64 hidden), dL/dx [N, k] float64, an empty [0]), or for a frozen head in one
    process (frozen_in_forward) (loss, an empty [0], dL/dhidden [N, H] fp32 (fp64)); 0 on rows whose label is
    ignore_index."""
    gkd = GkdOptions(beta, temperature, teacher_temperature, ignore_index)
    rows = Rows(hidden, labels, ignore_index, tile_rows(teacher_ids.shape[1], hidden.shape[1]))
    acc = stats_dtype(hidden)
    empty = hidden.new_empty(0, dtype=acc)
    if frozen_in_forward(frozen, group_name):
        loss, vectors = _frozen_rows(rows, weight, bias, teacher_ids, teacher_logprobs, gkd, acc)
        return loss, empty.double(), vectors
    loss, coef = topk_rows(lambda local: gathered_logits(rows.tiles, weight, bias, local), teacher_ids,
                           teacher_logprobs, rows.index, gkd, VocabShard(vocab_start, vocab_size, group_name),
                           weight.shape[0], acc)
    return loss, coef, empty


@gkd_fwd.register_fake
def _gkd_fwd_fake(hidden, weight, bias, teacher_ids, teacher_logprobs, labels, beta, temperature, teacher_temperature,
                  ignore_index, vocab_start, vocab_size, group_name, frozen):
    n, k = teacher_ids.shape
    acc = stats_dtype(hidden)
    forward = frozen_in_forward(frozen, group_name)
    return (hidden.new_empty((n,), dtype=acc), hidden.new_empty((0,) if forward else (n, k), dtype=torch.float64),
            hidden.new_empty((n, hidden.shape[1]) if forward else (0,), dtype=acc))


# ------------------------------------------------------------------ backward op
@torch.library.custom_op("twinkle_mem::linear_gkd_topk_bwd", mutates_args=())
def gkd_bwd(grad_loss: Tensor, coef: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
            teacher_ids: Tensor, labels: Optional[Tensor], ignore_index: int, vocab_start: int, need_hidden: bool,
            need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight [Vs, H], grad_bias [Vs]); an empty [0] for one not needed.
    coef: the forward's dL/dx. grad_hidden is this shard's term (the ids it holds)."""
    rows = Rows(hidden, labels, ignore_index, tile_rows(teacher_ids.shape[1], hidden.shape[1]))
    upstream = topk_upstream(grad_loss, coef, teacher_ids, rows.index, VocabShard(vocab_start), weight.shape[0],
                             stats_dtype(hidden))
    local, own, g = upstream if upstream is not None else (None, None, None)
    return gathered_backward(rows, hidden, weight, bias, local, own, g, Needs(need_hidden, need_weight, need_bias),
                             GATHER_BYTES)


@gkd_bwd.register_fake
def _gkd_bwd_fake(grad_loss, coef, hidden, weight, bias, teacher_ids, labels, ignore_index, vocab_start, need_hidden,
                  need_weight, need_bias):
    return fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _setup_context(ctx, inputs, output):
    args = named_inputs(gkd_fwd, inputs)
    ctx.gkd, ctx.shard = pick(GkdOptions, gkd_fwd, inputs), pick(VocabShard, gkd_fwd, inputs)
    ctx.in_forward = frozen_in_forward(args["frozen"], args["group_name"])
    save_one_output(ctx, ctx.in_forward, args, output, ("teacher_ids", "labels"))


def _backward(ctx, grad_loss, _grad_coef, _grad_vectors):
    if ctx.in_forward:
        return grad_from_vectors(ctx, grad_loss)
    hidden, weight, bias, teacher_ids, labels, coef = ctx.saved_tensors
    needs = Needs.of(ctx, gkd_fwd, bias)
    return needs.grads(*call(gkd_bwd, grad_loss, coef, hidden, weight, bias, teacher_ids, labels, ctx.gkd, ctx.shard,
                             needs.args()))


register_autograd(gkd_fwd, _backward, _setup_context)


# ------------------------------------------------------------------ public functions
def linear_gkd_topk(hidden, weight, teacher_ids, teacher_logprobs, labels=None, *, bias=None, beta=0.5,
                    temperature=1.0, ignore_index=-100, process_group=None, teacher_temperature=None, loss_grad=None):
    """twinkle's GKDLoss per token over a top-k teacher, from the LM head's input; nothing [N, V].

    hidden: [..., H] bf16/fp16/fp32/fp64; weight: [V, H] of hidden's dtype (under ``process_group``, this
    rank's vocab shard, Megatron's split); bias: [V] or None; teacher_ids: [..., k] int64/int32 global ids;
    teacher_logprobs: [..., k] (fp32 from the recipes); labels: [...] or None (every row kept): a row whose
    label is ``ignore_index`` gives 0 and costs nothing. Returns the per-token loss [...], fp32 (fp64 for
    fp64 hidden), with gradients to hidden, weight and bias; ``gkd_average`` gives GKDLoss's scalar. Under
    ``process_group`` (world size > 1) the loss is the same on every rank and the hidden gradient is this
    rank's partial sum (all-reduce it, as Megatron's copy_to_tensor_model_parallel_region does).
    ``teacher_temperature``: the teacher's, ``temperature`` when None (twinkle divides both sides by one).
    ``loss_grad=True`` says the loss will be trained: a frozen head (LoRA's) in one process then sums dL/dhidden in
    the forward from the k weight rows it gathers once; by default (None) its backward gathers them again, as a
    trainable head's does (nothing spent on a loss that gets no gradient).
    Formulas, memory and semantics: the module docstring and docs/distillation.md.
    """
    check_head_args(hidden, weight, bias)
    check_topk_teacher(teacher_ids, teacher_logprobs, hidden, "hidden")
    gkd = checked_gkd(labels, hidden, "hidden", GkdOptions(beta, temperature, teacher_temperature, ignore_index))
    h_size = hidden.shape[-1]
    n = math.prod(hidden.shape[:-1])
    k = teacher_ids.shape[-1]
    loss, *_ = call(gkd_fwd, hidden.reshape(n, h_size), weight, bias, teacher_ids.reshape(n, k),
                    teacher_logprobs.reshape(n, k), None if labels is None else labels.reshape(n), gkd,
                    VocabShard.of(process_group, weight.shape[0], "weight"),
                    {"frozen": loss_grad is True and frozen_head(hidden, weight, bias)})
    return loss.view(hidden.shape[:-1])
