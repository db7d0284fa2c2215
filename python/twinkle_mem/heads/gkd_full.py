"""Distillation over the whole vocab from the LM head's input: twinkle's GKDLoss with ``teacher_logits=``
(``topk=None``), the student's logits never built whole.

``linear_gkd_full(hidden, weight, teacher_logits, labels)`` returns per token what
``gkd_from_logits(hidden @ weight.T + bias, teacher_logits, labels)`` returns (distill/divergence.py's formulas with
k = V), with gradients to hidden, weight and bias. It runs on the blockwise engine (engine.py: kept rows,
row tiles of FULL_ROWS rows, vocab blocks of FULL_BLOCK columns, fp32 sums, needed gradients) and
supplies the per-block math, in float64, on one [FULL_ROWS, FULL_BLOCK] block of the student's logits (fp32,
fp64 for fp64 inputs) at a time:

forward, two sweeps:  1. each row's (max, log-sum-exp) of s = x / T and of t, folded in block order (float64);
                      2. the blocks' ls = (x - M_s) / T - L_s, lt likewise, divergence.gkd_terms, the row's L
                         and K summed in block order.
backward, one sweep:  recompute ls, lt; D = g divergence.gkd_grad(ls, lt, L, K) (float64, then fp32), from
                      which the engine sums grad_hidden, grad_weight and grad_bias in fp32, each rounded once.

Saved for backward: the inputs (references) and six float64 values per row. Memory beyond inputs and
gradients, at every dtype: a block's float64 working tensors (about 16 of [FULL_ROWS, FULL_BLOCK]), one fp32
weight block and one fp32 hidden tile (bf16 / fp16: the engine's copies), the fp32 accumulators of
grad_hidden [N_kept, H] and of a block of grad_weight; a gradient autograd does not ask for is not built.
Rows whose label is ignore_index give 0 and are dropped before any matmul. Fixed tile and block shapes: a
row's results are bitwise the same whatever the batch. No tensor parallelism (the top-k op has it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..distill.arguments import GkdOptions, check_teacher_logits, checked_gkd, flat_teacher, teacher_rows
from ..distill.divergence import gkd_grad, gkd_terms, log_add_exp
from ..op.contract import stats_dtype
from ..op.op_args import call, named_inputs, pick, register_autograd
from .engine import (BlockProducts, Needs, Rows, acc_dtype, backward_sweep, check_head_args, fake_grads, forward_sweep,
                     frozen_head)
from .matmul import product_sums
from .plans import BlockPlan, device_plan
from .frozen import grad_from_vectors, save_one_output

FULL_BLOCK = 2048  # vocab columns per block of the float64 math
FULL_ROWS = 512  # rows per block, the last tile zero-padded
# The rows' statistics, saved for backward: [N, STATS] float64.
M_S, L_S, M_T, L_T, LOSS, K = range(6)
STATS = 6


def _plan(hidden: Tensor, v: int) -> BlockPlan:
    """Blocks of FULL_BLOCK columns, one row tile at a time, logits in fp32 (fp64 for fp64): the float64 math
    takes them as they are."""
    acc = acc_dtype(hidden.dtype)
    return BlockPlan(min(FULL_BLOCK, v), 1, acc, device_plan(hidden.device), product_sums(hidden.dtype,
                                                                                          hidden.device, acc))


def _rows(hidden: Tensor, labels: Optional[Tensor], ignore_index: int) -> Rows:
    """The kept rows in whole row tiles of FULL_ROWS: the float64 math of a [FULL_ROWS, FULL_BLOCK] block is split
    across the CPU's threads at offsets that depend on its size (row_stats.combine_shard_stats_in_tiles), so every
    block keeps one shape."""
    return Rows(hidden, labels, ignore_index, FULL_ROWS)


def _fold(state, z: Tensor, temperature: float):
    """(M, L) of the rows after one more block z [r, c] (logits of any float dtype): M the max, L = log sum
    exp((z - M) / T), in float64 (z - M formed in float64: exact for fp32 z), one float64 copy of the block
    worked in place. state None: the first block."""
    mb = z.amax(-1).double()
    lb = z.double().sub_(mb.unsqueeze(-1)).div_(temperature).exp_().sum(-1).log_()
    empty = mb == float("-inf")  # a block of -inf only adds nothing (its own (M, L) would be NaN)
    lb = torch.where(empty, float("-inf"), lb)
    if state is None:
        return mb, lb
    m, l_ = state
    new = torch.maximum(m, mb)
    term = lambda mm, ll: torch.where(ll == float("-inf"), ll, (mm - new) / temperature + ll)  # noqa: E731
    return new, log_add_exp(term(m, l_), term(mb, lb))


def _teacher_block(teacher: Tensor, ids: Tensor, v0: int, v1: int) -> Tensor:
    """The rows ``ids`` of a teacher block, in the teacher's dtype (each use widens it to float64, exactly)."""
    return teacher_rows(teacher[..., v0:v1], ids)


def _normalized(x: Tensor, t: Tensor, stats: Tensor, gkd: GkdOptions) -> tuple[Tensor, Tensor]:
    """ls, lt of a block (float64) from the rows' stats [r, STATS]: (x - M) / T - L, x - M formed in float64,
    in place on one float64 copy of each."""
    ls = x.double().sub_(stats[:, M_S:M_S + 1]).div_(gkd.temperature).sub_(stats[:, L_S:L_S + 1])
    lt = t.double().sub_(stats[:, M_T:M_T + 1]).div_(gkd.teacher_temp()).sub_(stats[:, L_T:L_T + 1])
    return ls, lt


@torch.library.custom_op("twinkle_mem::linear_gkd_full_fwd", mutates_args=())
def gkd_full_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], teacher: Tensor, labels: Optional[Tensor],
                 beta: float, temperature: float, teacher_temperature: float, ignore_index: int,
                 frozen: bool) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] or None, teacher [N, V] (or [..., V] of N rows), labels [N] or
    None. Returns (loss [N] fp32 (fp64 for fp64 hidden), the rows' stats [N, STATS] float64, and for a ``frozen``
    head dL/dhidden [N, H] in fp32 (fp64), else an empty [0]); ignored rows 0."""
    gkd = GkdOptions(beta, temperature, teacher_temperature, ignore_index)
    n, v = hidden.shape[0], teacher.shape[-1]
    loss = hidden.new_zeros((n,), dtype=stats_dtype(hidden))
    stats = hidden.new_zeros((n, STATS), dtype=torch.float64)
    vectors = hidden.new_zeros((n, hidden.shape[1]) if frozen else (0,), dtype=stats_dtype(hidden))
    rows = _rows(hidden, labels, ignore_index)
    if rows.m == 0:
        return loss, stats, vectors
    ids = rows.ids()
    st = hidden.new_zeros((rows.tiles.padded, STATS), dtype=torch.float64)
    plan = _plan(hidden, v)

    def fold(v0, v1, rs, x):  # pass 1: each row's (max, log-sum-exp) of s = x / T and of t, in block order
        first = v0 == 0
        s = _fold(None if first else (st[rs, M_S], st[rs, L_S]), x, gkd.temperature)
        t = _fold(None if first else (st[rs, M_T], st[rs, L_T]), _teacher_block(teacher, ids[rs], v0, v1),
                  gkd.teacher_temp())
        st[rs, M_S], st[rs, L_S] = s
        st[rs, M_T], st[rs, L_T] = t

    def terms(v0, v1, rs, x):  # pass 2: the row's L and K, summed in block order
        ls, lt = _normalized(x, _teacher_block(teacher, ids[rs], v0, v1), st[rs], gkd)
        loss_terms, k_terms = gkd_terms(ls, lt, gkd.beta)
        st[rs, LOSS] += loss_terms.sum(-1)
        if k_terms is not None:
            st[rs, K] += k_terms.sum(-1)

    forward_sweep(rows.tiles, weight, bias, plan, fold)
    forward_sweep(rows.tiles, weight, bias, plan, terms)
    rows.put(stats, 0, st[:rows.m])
    rows.put(loss, 0, st[:rows.m, LOSS].to(loss.dtype))
    if frozen:  # pass 3: dL/dx of each block, now that L and K are known, summed into dL/dhidden (no backward sweep)
        acc = hidden.new_zeros((rows.tiles.padded, hidden.shape[1]), dtype=stats_dtype(hidden))
        products = BlockProducts(weight, plan.logits_dtype, rows.tiles)

        def grad(v0, v1, rs, x):
            products(acc[rs], v0, v1, _block_grad(x, teacher, ids, st, None, gkd, v0, v1, rs), accumulate=True)

        forward_sweep(rows.tiles, weight, bias, plan, grad)
        rows.put(vectors, 0, acc[:rows.m])
    return loss, stats, vectors


@gkd_full_fwd.register_fake
def _gkd_full_fwd_fake(hidden, weight, bias, teacher, labels, beta, temperature, teacher_temperature, ignore_index,
                       frozen):
    n = hidden.shape[0]
    return (hidden.new_empty((n,), dtype=stats_dtype(hidden)), hidden.new_empty((n, STATS), dtype=torch.float64),
            hidden.new_empty((n, hidden.shape[1]) if frozen else (0,), dtype=stats_dtype(hidden)))


@torch.library.custom_op("twinkle_mem::linear_gkd_full_bwd", mutates_args=())
def gkd_full_bwd(grad_loss: Tensor, stats: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                 teacher: Tensor, labels: Optional[Tensor], beta: float, temperature: float,
                 teacher_temperature: float, ignore_index: int, need_hidden: bool, need_weight: bool,
                 need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight [V, H], grad_bias [V]); an empty [0] for a gradient not needed."""
    gkd = GkdOptions(beta, temperature, teacher_temperature, ignore_index)
    rows = _rows(hidden, labels, ignore_index)
    needs = Needs(need_hidden, need_weight, need_bias)
    plan = _plan(hidden, teacher.shape[-1])
    if rows.m == 0:
        return backward_sweep(rows, hidden, weight, bias, plan, needs, None)
    ids = rows.ids()
    st = stats.index_select(0, ids)
    g = grad_loss.index_select(0, ids).double().unsqueeze(1)

    def block_grad(v0, v1, rs, x):
        return _block_grad(x, teacher, ids, st, g, gkd, v0, v1, rs)

    return backward_sweep(rows, hidden, weight, bias, plan, needs, block_grad)


def _block_grad(x: Tensor, teacher: Tensor, ids: Tensor, st: Tensor, g: Optional[Tensor], gkd: GkdOptions, v0: int,
                v1: int, rs: slice) -> Tensor:
    """D = g dL/dx of a block (g None: 1), from ls, lt recomputed and the rows' L and K; float64, then x's dtype."""
    ls, lt = _normalized(x, _teacher_block(teacher, ids[rs], v0, v1), st[rs], gkd)
    d = gkd_grad(ls, lt, st[rs, LOSS:LOSS + 1], st[rs, K:K + 1], gkd.beta, gkd.temperature)
    return (d if g is None else d.mul_(g[rs])).to(x.dtype)


@gkd_full_bwd.register_fake
def _gkd_full_bwd_fake(grad_loss, stats, hidden, weight, bias, teacher, labels, beta, temperature,
                       teacher_temperature, ignore_index, need_hidden, need_weight, need_bias):
    return fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _setup_context(ctx, inputs, output):
    args = named_inputs(gkd_full_fwd, inputs)
    ctx.gkd, ctx.frozen = pick(GkdOptions, gkd_full_fwd, inputs), args["frozen"]
    save_one_output(ctx, ctx.frozen, args, output, ("teacher", "labels"))


def _backward(ctx, grad_loss, _grad_stats, _grad_vectors):
    if ctx.frozen:
        return grad_from_vectors(ctx, grad_loss)
    hidden, weight, bias, teacher, labels, stats = ctx.saved_tensors
    needs = Needs.of(ctx, gkd_full_fwd, bias)
    return needs.grads(*call(gkd_full_bwd, grad_loss, stats, hidden, weight, bias, teacher, labels, ctx.gkd,
                             needs.args()))


register_autograd(gkd_full_fwd, _backward, _setup_context)


def linear_gkd_full(hidden, weight, teacher_logits, labels=None, *, bias=None, beta=0.5, temperature=1.0,
                    ignore_index=-100, teacher_temperature=None, loss_grad=None):
    """twinkle's GKDLoss per token over the whole vocab (``teacher_logits=``, ``topk=None``) from the LM
    head's input; the student's [N, V] logits never exist, one [FULL_ROWS, FULL_BLOCK] block at a time.

    hidden [..., H], weight [V, H] (hidden's dtype), bias [V] or None, teacher_logits [..., V] (any float
    dtype, no gradient; a view such as twinkle's ``teacher_logits[:, :L]`` is read in place), labels [...] or
    None. ``teacher_temperature``: the teacher's, ``temperature`` when None (twinkle divides both sides by
    one). Returns the per-token loss [...] fp32 (fp64 for fp64 hidden), with gradients to hidden, weight and
    bias. ``loss_grad=True`` says the loss will be trained: a frozen head (LoRA's) then sums dL/dhidden in a third
    forward sweep; by default (None) a frozen head's backward recomputes it, as a trainable one's does (the same
    sweeps, none spent on a loss that gets no gradient). See the module docstring and docs/distillation.md.
    """
    check_head_args(hidden, weight, bias)
    check_teacher_logits(teacher_logits, (*hidden.shape[:-1], weight.shape[0]), hidden, "hidden")
    gkd = checked_gkd(labels, hidden, "hidden", GkdOptions(beta, temperature, teacher_temperature, ignore_index))
    n = teacher_logits.numel() // weight.shape[0]
    loss, *_ = call(gkd_full_fwd, hidden.reshape(n, hidden.shape[-1]), weight, bias, flat_teacher(teacher_logits),
                    None if labels is None else labels.reshape(n), gkd,
                    {"frozen": loss_grad is True and frozen_head(hidden, weight, bias)})
    return loss.view(hidden.shape[:-1])
