"""Distillation over the whole vocab from the LM head's input: twinkle's GKDLoss with ``teacher_logits=``
(``topk=None``), the student's logits never built whole.

``linear_gkd_full(hidden, weight, teacher_logits, labels)`` returns per token what
``gkd_from_logits(hidden @ weight.T + bias, teacher_logits, labels)`` returns (distill.py's formulas with
k = V), with gradients to hidden, weight and bias, working on one [ROW_TILE, FULL_BLOCK] block of the
student's logits at a time (ROW_TILE = engine.ROW_TILE rows, FULL_BLOCK vocab columns; the last of each
zero-padded / ragged), their math in float64:

forward, per row tile:   pass 1 over the blocks: each row's (max, log-sum-exp) of s = x / T and of t,
                         folded in block order (float64); pass 2: the blocks' ls = (x - M_s) / T - L_s,
                         lt likewise, gkd_math.gkd_terms, the row's L and K summed in block order.
backward, per block:     recompute ls, lt; D = g gkd_math.gkd_grad(ls, lt, L, K) (float64, then fp32);
                         grad_hidden_tile += D @ weight_block, grad_weight_block += D^T hidden_tile,
                         grad_bias_block += D.sum(0), all in fp32 and rounded once.

The logits x are summed in fp32 (fp32 copies of bf16/fp16 operands; fp64 for fp64). Saved for backward:
the inputs (references) and six float64 values per row. Memory beyond inputs and gradients: a block's
float64 working tensors (about 16 of [ROW_TILE, FULL_BLOCK]: 64 MiB), the fp32 copies of a weight block
and of a tile, the fp32 accumulators of grad_hidden [N_kept, H] and of a block of grad_weight. Rows
whose label is ignore_index give 0 and are dropped before any matmul. Fixed tile and block shapes: a
row's results are bitwise the same whatever the batch. No tensor parallelism (the top-k op has it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import engine
from ._contract import stats_dtype
from .distill import _kept_rows, _select, check_gkd_options, checked_teacher_temperature
from .distill_logits import check_teacher_logits, flat_teacher, teacher_rows
from .gkd_math import gkd_grad, gkd_terms, log_add_exp
from .functional import check_head_args

FULL_BLOCK = 2048  # vocab columns per block of the float64 math


def _acc_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _blocks(v: int):
    cols = min(FULL_BLOCK, v)
    for v0 in range(0, v, cols):
        yield v0, min(v0 + cols, v)


def _fold(state, z: Tensor, temperature: float):
    """(M, L) of the rows after one more block z [r, c] (fp32 logits, or float64): M the max, L = log sum
    exp((z - M) / T), in float64 (z - M formed in float64: exact for fp32 z), one float64 copy of the block
    worked in place."""
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


class _Tile:
    """One row tile of the kept rows: hidden (acc dtype, zero-padded), the rows' teacher indices."""

    def __init__(self, h: Tensor, rows: Tensor, r0: int, acc):
        n = min(engine.ROW_TILE, h.shape[0] - r0)
        self.count = n
        self.h = engine.pad_rows(h[r0:r0 + n], engine.ROW_TILE).to(acc)
        self.rows = engine.pad_rows(rows[r0:r0 + n], engine.ROW_TILE)


def _logits(tile: _Tile, w_block: Tensor, b_block: Optional[Tensor]) -> Tensor:
    """The block's logits in acc (fp32, fp64 for fp64 inputs): the float64 math takes them as they are."""
    return tile.h @ w_block.t() if b_block is None else torch.addmm(b_block, tile.h, w_block.t())


def _teacher(teacher: Tensor, tile: _Tile, v0: int, v1: int) -> Tensor:
    """The tile's rows of a teacher block, in the teacher's dtype (bf16 / fp16 to fp32)."""
    t = teacher_rows(teacher[..., v0:v1], tile.rows)
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _normalized(x: Tensor, t: Tensor, stats: Tensor, temperature: float,
                teacher_temperature: float) -> tuple[Tensor, Tensor]:
    """ls, lt of a block (float64) from the rows' stats [r, 6] = (M_s, L_s, M_t, L_t, loss, K): (x - M) / T - L,
    x - M formed in float64, in place on one float64 copy of each."""
    ls = x.double().sub_(stats[:, 0:1]).div_(temperature).sub_(stats[:, 1:2])
    lt = t.double().sub_(stats[:, 2:3]).div_(teacher_temperature).sub_(stats[:, 3:4])
    return ls, lt


def _tiles(h, rows, acc):
    for r0 in range(0, h.shape[0], engine.ROW_TILE):
        yield r0, _Tile(h, rows, r0, acc)


@torch.library.custom_op("twinkle_mem::linear_gkd_full_fwd", mutates_args=())
def gkd_full_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], teacher: Tensor, labels: Optional[Tensor],
                 beta: float, temperature: float, teacher_temperature: float,
                 ignore_index: int) -> tuple[Tensor, Tensor]:
    """hidden [N, H], weight [V, H], bias [V] or None, teacher [N, V] (or [..., V] of N rows), labels [N] or
    None. Returns (loss [N]
    fp32 (fp64 for fp64 hidden), the rows' stats [N, 6] float64); ignored rows 0."""
    n, v = hidden.shape[0], teacher.shape[-1]
    acc = _acc_dtype(hidden)
    loss = hidden.new_zeros((n,), dtype=stats_dtype(hidden))
    stats = hidden.new_zeros((n, 6), dtype=torch.float64)
    kept = _kept_rows(labels, n, ignore_index)
    rows = torch.arange(n, device=hidden.device) if kept is None else kept
    h = _select(hidden, kept)
    wb = [(weight[v0:v1].to(acc), None if bias is None else bias[v0:v1].to(acc)) for v0, v1 in _blocks(v)] \
        if h.shape[0] else []
    for r0, tile in _tiles(h, rows, acc):
        s_state = t_state = None
        for (v0, v1), (w_b, b_b) in zip(_blocks(v), wb):
            s_state = _fold(s_state, _logits(tile, w_b, b_b), temperature)
            t_state = _fold(t_state, _teacher(teacher, tile, v0, v1), teacher_temperature)
        st = torch.stack([*s_state, *t_state, torch.zeros_like(s_state[0]), torch.zeros_like(s_state[0])], dim=1)
        for (v0, v1), (w_b, b_b) in zip(_blocks(v), wb):
            ls, lt = _normalized(_logits(tile, w_b, b_b), _teacher(teacher, tile, v0, v1), st, temperature,
                                 teacher_temperature)
            terms, k_terms = gkd_terms(ls, lt, beta)
            st[:, 4] += terms.sum(-1)
            if k_terms is not None:
                st[:, 5] += k_terms.sum(-1)
        stats.index_copy_(0, tile.rows[:tile.count], st[:tile.count])
        loss.index_copy_(0, tile.rows[:tile.count], st[:tile.count, 4].to(loss.dtype))
    return loss, stats


@gkd_full_fwd.register_fake
def _gkd_full_fwd_fake(hidden, weight, bias, teacher, labels, beta, temperature, teacher_temperature, ignore_index):
    n = hidden.shape[0]
    return hidden.new_empty((n,), dtype=stats_dtype(hidden)), hidden.new_empty((n, 6), dtype=torch.float64)


@torch.library.custom_op("twinkle_mem::linear_gkd_full_bwd", mutates_args=())
def gkd_full_bwd(grad_loss: Tensor, stats: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                 teacher: Tensor, labels: Optional[Tensor], beta: float, temperature: float,
                 teacher_temperature: float, ignore_index: int,
                 need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight [V, H], grad_bias [V] or [0])."""
    n, v = hidden.shape[0], teacher.shape[-1]
    acc = _acc_dtype(hidden)
    kept = _kept_rows(labels, n, ignore_index)
    rows = torch.arange(n, device=hidden.device) if kept is None else kept
    h = _select(hidden, kept)
    grad_weight = torch.zeros_like(weight)
    grad_bias = torch.zeros_like(bias) if need_bias else hidden.new_empty(0)
    gh = hidden.new_zeros((h.shape[0], hidden.shape[1]), dtype=acc)
    tiles = [tile for _r0, tile in _tiles(h, rows, acc)]
    for v0, v1 in _blocks(v) if h.shape[0] else []:
        w_b = weight[v0:v1].to(acc)
        b_b = None if bias is None else bias[v0:v1].to(acc)
        gw = torch.zeros_like(w_b)
        gb = torch.zeros((v1 - v0,), dtype=acc, device=hidden.device)
        for j, tile in enumerate(tiles):
            st = stats.index_select(0, tile.rows)
            ls, lt = _normalized(_logits(tile, w_b, b_b), _teacher(teacher, tile, v0, v1), st, temperature,
                                 teacher_temperature)
            d = gkd_grad(ls, lt, st[:, 4:5], st[:, 5:6], beta, temperature)
            d.mul_(grad_loss.index_select(0, tile.rows).double().unsqueeze(1))
            d[tile.count:] = 0  # the padding rows add exactly nothing
            d = d.to(acc)
            r0 = j * engine.ROW_TILE
            gh[r0:r0 + tile.count] += (d @ w_b)[:tile.count]
            gw.addmm_(d.t(), tile.h)
            gb += d.sum(0)
        grad_weight[v0:v1] = gw
        if need_bias:
            grad_bias[v0:v1] = gb
    grad_hidden = hidden.new_zeros(hidden.shape)
    grad_hidden.index_copy_(0, rows, gh.to(hidden.dtype))
    return grad_hidden, grad_weight, grad_bias


@gkd_full_bwd.register_fake
def _gkd_full_bwd_fake(grad_loss, stats, hidden, weight, bias, teacher, labels, beta, temperature,
                       teacher_temperature, ignore_index, need_bias):
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if need_bias else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, teacher, labels, beta, temperature, teacher_temperature, ignore_index = inputs
    ctx.save_for_backward(hidden, weight, bias, teacher, labels, output[1])
    ctx.args = (beta, temperature, teacher_temperature, ignore_index)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_loss, _grad_stats):
    hidden, weight, bias, teacher, labels, stats = ctx.saved_tensors
    need_bias = ctx.needs_input_grad[2] and bias is not None
    gh, gw, gb = gkd_full_bwd(grad_loss, stats, hidden, weight, bias, teacher, labels, *ctx.args, need_bias)
    return (gh if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None,
            gb if need_bias else None, None, None, None, None, None, None)


gkd_full_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_gkd_full(hidden, weight, teacher_logits, labels=None, *, bias=None, beta=0.5, temperature=1.0,
                    ignore_index=-100, teacher_temperature=None):
    """twinkle's GKDLoss per token over the whole vocab (``teacher_logits=``, ``topk=None``) from the LM
    head's input; the student's [N, V] logits never exist, one [ROW_TILE, FULL_BLOCK] block at a time.

    hidden [..., H], weight [V, H] (hidden's dtype), bias [V] or None, teacher_logits [..., V] (any float
    dtype, no gradient; a view such as twinkle's ``teacher_logits[:, :L]`` is read in place), labels [...] or
    None. ``teacher_temperature``: the teacher's, ``temperature`` when None (twinkle divides both sides by
    one). Returns the per-token loss [...] fp32 (fp64 for fp64 hidden), with gradients to hidden, weight and
    bias. See the module docstring and docs/distillation.md.
    """
    check_head_args(hidden, weight, bias)
    check_teacher_logits(teacher_logits, (*hidden.shape[:-1], weight.shape[0]), hidden, "hidden")
    check_gkd_options(labels, hidden, "hidden", beta, temperature, ignore_index)
    teacher_temperature = checked_teacher_temperature(teacher_temperature, temperature)
    n = teacher_logits.numel() // weight.shape[0]
    loss, _stats = gkd_full_fwd(hidden.reshape(n, hidden.shape[-1]), weight, bias, flat_teacher(teacher_logits),
                                None if labels is None else labels.reshape(n), float(beta), float(temperature),
                                teacher_temperature, int(ignore_index))
    return loss.view(hidden.shape[:-1])
