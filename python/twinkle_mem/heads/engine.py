"""The blockwise engine every fused LM head runs on.

A fused head computes something of the logits ``x = hidden @ weight.T + bias`` (log-probs and entropy, a
distillation loss) without building them. The engine cuts the work into blocks and owns everything about
them; a head supplies its per-block math (docs/architecture.md, "Adding a fused head"):

- kept rows (``Rows``): rows whose labels are all ``ignore_index`` are dropped before any matmul;
- row tiles (``RowTiles``): every matmul takes a fixed number of rows, the last tile zero-padded, so that a
  row's results depend on nothing but the row (batch invariance, docs/linear.md);
- vocab blocks (``vocab_blocks``): ``[v0, v1)`` slices of the weight, of a width fixed by V and H (``block_width``);
  or, for a top-k teacher, each row's own k weight rows (``gathered_logits`` / ``gathered_backward``);
- the accumulation dtype (``acc_dtype``, the op's): fp32, fp64 for fp64 inputs; bf16/fp16 products summed in fp32,
  through ``matmul.mixed_addmm`` where the device can, else from fp32 copies of one weight block and one
  row tile at a time (``Operands``), never more;
- the chunk budget (``tiles_in_flight``): how many row tiles share one buffer of logits;
- the needed gradients (``Needs``): only those are built;
- tensor parallelism: the weight is a vocab shard (``vocab_parallel.VocabShard``: its place in the vocab
  and its collectives).

``forward_sweep`` hands a head the logits of each (vocab block, group of row tiles) in a fixed order;
``backward_sweep`` asks the head for the gradient d of those logits and sums ``grad_weight``, ``grad_bias``
and ``grad_hidden`` from it, block by block and tile by tile in a fixed order, in the accumulation dtype,
each rounded once.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ..op.contract import acc_dtype, check_float_tensor  # acc_dtype: the op's rule is the heads' (fp32; fp64)
from ..op.op_args import arg_names
from ..op.rows import kept_rows
from .matmul import (Operands, RoundedSums, add_matmul, batched_logits_into, logits_into, matmul_into,
                     native_reduced_products, reduced)
from .plans import PIECE_ROWS, BlockPlan, DevicePlan, device_plan, fold_in_tiles, vocab_blocks

def frozen_head(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether autograd will ask a head for grad_hidden alone (LoRA's frozen LM head): then its forward sums the
    hidden-gradient vectors of its outputs and its backward recomputes no logits (heads/frozen.py; a head may
    still recompute where that is cheaper: frozen.recompute_is_cheaper)."""
    return (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and (bias is None or not bias.requires_grad))


def check_head_args(hidden, weight, bias) -> None:
    """The LM head's hidden states, weight and bias (every fused head): ValueError naming the bad argument."""
    check_float_tensor("hidden", hidden)
    check_float_tensor("weight", weight)
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must be [..., H] with H >= 1, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with V >= 1 and H = hidden.shape[-1] = {hidden.shape[-1]}, got shape "
                         f"{tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype} (cast one of them, "
                         "e.g. hidden.to(weight.dtype), as the linear layer would compute in one dtype)")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {getattr(bias, 'shape', type(bias))}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"bias must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                             f"{bias.dtype}, {bias.device}")


# ------------------------------------------------------------------ kept rows, row tiles
def pad_rows(t: Optional[Tensor], rows: int, value=0) -> Optional[Tensor]:
    """t [m, ...] extended to [rows, ...] with ``value`` (O(N): labels, statistics, upstream gradients)."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


class RowTiles:
    """The rows of an [m, H] tensor as tiles of the plan's row_tile rows, the last holding the rest rounded up to
    its row_quantum with zero rows (``tile``: tiles of that many rows, the last padded whole). Views of the rows,
    but for a padded last tile: a copy of the tail (``write_back`` returns its rows to the tensor), or, for a plan
    that multiplies a step's tiles at once (``batched``), of all the rows."""

    def __init__(self, rows: Tensor, plan: DevicePlan, tile: Optional[int] = None):
        self.tile = plan.row_tile if tile is None else tile
        quantum = self.tile if tile is not None else min(plan.row_quantum, self.tile)
        self.batched = bool(plan.step_rows) and tile is None
        m = rows.shape[0]
        self.count = -(-m // self.tile)
        self.tail = m - (self.count - 1) * self.tile  # rows of the last tile, and with its zero rows:
        self.last_rows = -(-self.tail // quantum) * quantum
        self.padded = (self.count - 1) * self.tile + self.last_rows
        # rows per call of the heads' per-row float64 math: a tile on the CPU, whose loops give an element vector or
        # scalar code by where it sits (row_stats.combine_shard_stats_in_tiles); all at once on a GPU's batched plan
        self.fold_rows = self.padded if self.batched and not fold_in_tiles(rows.device) else self.tile
        self.rows, self.last = rows, None
        if self.last_rows > self.tail and self.batched:
            self.rows = pad_rows(rows, self.padded)
        elif self.last_rows > self.tail:
            self.last = rows.new_zeros((self.last_rows, rows.shape[1]))
            self.last[: self.tail] = rows[(self.count - 1) * self.tile:]

    def __getitem__(self, j: int) -> Tensor:
        if j == self.count - 1 and self.last is not None:
            return self.last
        return self.rows[j * self.tile:(j + 1) * self.tile]

    def step(self, tile_ids: range) -> Tensor:
        """The rows of consecutive tiles as one [tiles, row_tile, H] tensor (a batched plan)."""
        return self.rows[tile_ids[0] * self.tile:(tile_ids[-1] + 1) * self.tile].view(len(tile_ids), self.tile, -1)

    def write_back(self) -> None:
        if self.last is not None:
            self.rows[(self.count - 1) * self.tile:] = self.last[: self.tail]


class Rows:
    """The rows a head works on: those of ``hidden`` [N, H] with a label other than ``ignore_index`` (labels
    [N], [N, k]: kept if any of its k is, a row of k = 0 labels too; None: every row), as row tiles of the
    device's plan (``tile``: of that many rows, RowTiles); per-row tensors are taken alike (``take``) and results
    put back in place (``put``, ``spread``)."""

    def __init__(self, hidden: Tensor, labels: Optional[Tensor], ignore_index: int, tile: Optional[int] = None):
        self.n = hidden.shape[0]
        self.plan, self.tile = device_plan(hidden.device), tile
        self.index = kept_rows(labels, ignore_index)  # None when every row is kept
        self.m = self.n if self.index is None else self.index.numel()
        self.tiles = self.tiled(self.select(hidden)) if self.m else None

    def tiled(self, t: Tensor) -> RowTiles:
        """An [m, ...] tensor of the kept rows as row tiles alike."""
        return RowTiles(t, self.plan, self.tile)

    def select(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """t's kept rows (t itself when every row is kept)."""
        return t if t is None or self.index is None else t.index_select(0, self.index)

    def take(self, t: Optional[Tensor], value=0) -> Optional[Tensor]:
        """t's kept rows padded to the tiles' rows with ``value``."""
        return pad_rows(self.select(t), self.tiles.padded, value)

    def ids(self) -> Tensor:
        """The kept rows' indices, padded like ``take`` (0 on the padding)."""
        index = torch.arange(self.n, device=self.tiles.rows.device) if self.index is None else self.index
        return pad_rows(index, self.tiles.padded)

    def put(self, out: Tensor, r0: int, values: Tensor) -> None:
        """out[kept rows r0 .. r0 + len(values)] = values."""
        if self.index is None:
            out[r0:r0 + values.shape[0]] = values
        else:
            out.index_copy_(0, self.index[r0:r0 + values.shape[0]], values)

    def spread(self, values: Tensor) -> Tensor:
        """values [m, ...] of the kept rows as [N, ...], zero elsewhere (values itself when every row is kept)."""
        if self.index is None:
            return values
        return values.new_zeros((self.n, *values.shape[1:])).index_copy_(0, self.index, values)


# ------------------------------------------------------------------ operands, needed gradients
class Needs(NamedTuple):
    """Which gradients a backward builds; the others are not allocated."""
    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, ctx, op, bias: Optional[Tensor]) -> "Needs":
        """From autograd's needs_input_grad of ``op``, whose inputs named hidden, weight and bias are the head's."""
        need = dict(zip(arg_names(op), ctx.needs_input_grad))
        return cls(need["hidden"], need["weight"], need["bias"] and bias is not None)

    def args(self) -> dict:
        """The backward ops' need_hidden, need_weight, need_bias arguments (op_args.call)."""
        return {"need_hidden": self.hidden, "need_weight": self.weight, "need_bias": self.bias}

    def grads(self, grad_hidden: Tensor, grad_weight: Tensor, grad_bias: Tensor) -> dict:
        """A backward op's three results as autograd's gradients by input name (op_args.register_autograd)."""
        return {"hidden": grad_hidden if self.hidden else None, "weight": grad_weight if self.weight else None,
                "bias": grad_bias if self.bias else None}


def logits_buffer(tiles: RowTiles, plan: BlockPlan) -> Tensor:
    """The reused buffer of a sweep's logits: plan.group row tiles of plan.width columns, never more rows than
    the call's tiles hold (a 22-row call holds 32 rows on the CPU, not the budget's)."""
    rows = min(plan.group * tiles.tile, tiles.padded)
    return tiles.rows.new_empty(rows * plan.width, dtype=plan.logits_dtype)


def _groups(tiles: RowTiles, plan: BlockPlan, buf: Tensor, cols: int):
    """(the step's tiles, their padded rows' slice, their logits' view of the buffer [rows, cols]) of each step."""
    for g0 in range(0, tiles.count, plan.group):
        g1 = min(g0 + plan.group, tiles.count)
        r0, r1 = g0 * tiles.tile, min(g1 * tiles.tile, tiles.padded)
        yield range(g0, g1), slice(r0, r1), buf[: (r1 - r0) * cols].view(r1 - r0, cols)


def _block_operands(weight, bias, v0, v1, operands: Operands, straight: bool):
    w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
    if straight:
        return w, b
    return operands(w), None if b is None else b.to(operands.acc)  # the one fp32 weight block


def fake_grads(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], need_hidden: bool, need_weight: bool,
               need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Every head's backward, as its fake kernel gives it: a gradient not needed is an empty [0]."""
    return (hidden.new_empty(hidden.shape if need_hidden else 0), weight.new_empty(weight.shape if need_weight else 0),
            bias.new_empty(bias.shape) if need_bias else hidden.new_empty(0))


# ------------------------------------------------------------------ the sweeps over vocab blocks
def _step_logits(tiles: RowTiles, tile_ids: range, x: Tensor, w: Tensor, b: Optional[Tensor],
                 operand: Optional[Callable[[Tensor], Tensor]], piece: int) -> Optional[Tensor]:
    """x = the logits of a step's row tiles, each hidden tile as ``operand`` makes it (None: as it is): one product
    per tile (a widened block in pieces of ``piece`` columns), or for a batched plan one batched product over the
    step's tiles. Returns the last hidden operand (one tile's: made once where the step has one tile)."""
    if tiles.batched:
        h = tiles.step(tile_ids)
        h = h if operand is None else operand(h)
        batched_logits_into(x.view(len(tile_ids), tiles.tile, -1), h, w, b)
        return h
    for i, j in enumerate(tile_ids):
        h = tiles[j] if operand is None else operand(tiles[j])
        logits_into(x[i * tiles.tile:i * tiles.tile + h.shape[0]], h, w, b, piece)
    return h


def forward_sweep(tiles: RowTiles, weight: Tensor, bias: Optional[Tensor], plan: BlockPlan,
                  step: Callable[[int, int, slice, Tensor], None]) -> None:
    """step(v0, v1, rows, x) for each vocab block [v0, v1) in order and, within it, each step's row tiles in
    order: x [rows, v1 - v0], the logits of the padded rows ``rows`` (a slice) in plan.logits_dtype, is one
    reused buffer (consumed before the next step)."""
    operands = Operands(tiles.rows.dtype, tiles.rows.device, plan.logits_dtype)
    straight = plan.logits_dtype == tiles.rows.dtype
    buf = logits_buffer(tiles, plan)
    for v0, v1 in vocab_blocks(weight.shape[0], plan.width):
        w, b = _block_operands(weight, bias, v0, v1, operands, straight)
        for tile_ids, rows, x in _groups(tiles, plan, buf, v1 - v0):
            _step_logits(tiles, tile_ids, x, w, b, None if straight else operands, plan.device.vocab_block)
            step(v0, v1, rows, x)


class BlockProducts:
    """out [rows, H] = d @ weight[v0:v1] for a block's d [rows, v1 - v0] (written over a forward_sweep step's
    logits), one product per row tile (a batched plan: one batched product over the step's tiles) in the
    accumulation dtype, as backward_sweep's grad_hidden: a frozen head's forward (heads/frozen.py) turns a block
    into per-row vectors while its logits are at hand. The weight block's operand (an fp32 copy for bf16/fp16 where
    the device cannot sum their products in fp32) is made once per block. ``rounded`` (for bf16 d and weight, on a
    CPU that multiplies bf16 natively: matmul.native_reduced_products): instead of fp32 copies, one bf16 product
    per row tile and block (summed in fp32 inside the BLAS and rounded to bf16 once per row tile and block, where
    the unfused backward rounds its one product over the whole vocab once), added into out in fp32."""

    def __init__(self, weight: Tensor, logits_dtype: torch.dtype, tiles: RowTiles, rounded: bool = False):
        self.weight, self.tile, self.batched = weight, tiles.tile, tiles.batched
        self.operands = Operands(weight.dtype, weight.device, logits_dtype)
        self.rounded = (rounded and self.operands.copies and logits_dtype == weight.dtype and not self.batched
                        and native_reduced_products(weight.dtype, weight.device))
        self.sums = RoundedSums(weight, self.tile, self.tile) if self.rounded else None
        self.block = (None, None)  # (v0, its operand)

    def __call__(self, out: Tensor, v0: int, v1: int, d: Tensor, accumulate: bool = False) -> Tensor:
        """out = (or += with ``accumulate``) d @ weight[v0:v1]."""
        if self.block[0] != v0:
            self.block = (None, None)  # the last block's copy freed first
            self.block = (v0, self.weight[v0:v1] if self.rounded else self.operands(self.weight[v0:v1]))
        if self.batched:
            steps = d.shape[0] // self.tile
            o, t = out.view(steps, self.tile, -1), self.operands(d).view(steps, self.tile, -1)
            w = self.block[1].unsqueeze(0).expand(steps, *self.block[1].shape)
            (add_matmul if accumulate else matmul_into)(o, t, w)
            return out
        for r0 in range(0, d.shape[0], self.tile):
            o, t = out[r0:r0 + self.tile], d[r0:r0 + self.tile]
            if self.rounded:
                self.sums.add(o, t, self.block[1], accumulate)
            else:
                (add_matmul if accumulate else matmul_into)(o, self.operands(t), self.block[1])
        return out


def backward_sweep(rows: Rows, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], plan: BlockPlan, needs: Needs,
                   block_grad: Callable[[int, int, slice, Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight, grad_bias) from block_grad(v0, v1, rows, x) -> d: the gradient of the
    loss w.r.t. the logits x of a forward_sweep step ([rows, v1 - v0], any float dtype; it may be x itself,
    overwritten). The padding rows' d is zeroed here; grad_weight[v0:v1] += d.T @ hidden_rows, grad_bias[v0:v1]
    += d.sum(0), grad_hidden_rows += d @ weight[v0:v1], tile by tile in tile order (a batched plan: step by step,
    its sums over rows in one product of the step's fixed rows) and block by block in block order, in the
    accumulation dtype, rounded once (bf16 on a CPU that multiplies it natively: plan.sums "rounded", one bf16
    product per row tile and block summed in fp32). A gradient that ``needs`` does not ask for is an empty [0]."""
    n, h_size = hidden.shape
    dtype = hidden.dtype
    operands = Operands(dtype, hidden.device, plan.logits_dtype)
    rounded = plan.sums == "rounded" and plan.logits_dtype == dtype and rows.m > 0 and not rows.tiles.batched
    acc = operands.acc
    sum_apart = reduced(dtype) and rows.m > 0  # every block of grad_weight / grad_bias written whole from acc
    new_grad = (lambda t: t.new_empty(t.shape)) if sum_apart else (lambda t: t.new_zeros(t.shape))  # noqa: E731
    grad_weight = new_grad(weight) if needs.weight else hidden.new_empty(0)
    grad_bias = new_grad(bias) if needs.bias else hidden.new_empty(0)
    if rows.m == 0:
        return (hidden.new_zeros((n, h_size)) if needs.hidden else hidden.new_empty(0)), grad_weight, grad_bias
    tiles = rows.tiles
    if not needs.hidden:
        grad_hidden = gh = None
    elif rows.index is None and not reduced(dtype) and not tiles.batched:
        grad_hidden = gh = hidden.new_zeros((n, h_size))  # summed into the gradient itself
    else:  # grad_hidden made from gh after the blocks, so that it is not alive beside them
        grad_hidden, gh = None, hidden.new_zeros((tiles.padded if tiles.batched else rows.m, h_size), dtype=acc)

    gh_tiles = rows.tiled(gh) if needs.hidden else None
    straight = plan.logits_dtype == dtype
    buf = logits_buffer(tiles, plan)
    # bf16 products of one row tile (a short call: a GRPO completion): each block's grad_weight is one product,
    # rounded once into the gradient, as the unfused path's one product is; no fp32 sum to make and copy
    one_product = rounded and tiles.count == 1
    gw_acc = weight.new_empty((plan.width, h_size), dtype=acc) if needs.weight and sum_apart and not one_product \
        else None
    gb_acc = weight.new_empty((plan.width,), dtype=acc) if needs.bias and sum_apart else None
    gw_sums = RoundedSums(weight, plan.width, PIECE_ROWS) if rounded and needs.weight and not one_product else None
    gh_sums = RoundedSums(weight, tiles.tile, tiles.tile) if rounded and needs.hidden else None
    for v0, v1 in vocab_blocks(weight.shape[0], plan.width):
        c = v1 - v0
        w, b = _block_operands(weight, bias, v0, v1, operands, straight)  # the logits' operands
        w_acc = (w if rounded or not straight else operands(w)) if needs.hidden else None
        gw = gw_acc[:c].zero_() if gw_acc is not None else grad_weight[v0:v1]
        gb = gb_acc[:c].zero_() if gb_acc is not None else grad_bias[v0:v1]
        for tile_ids, rs, x in _groups(tiles, plan, buf, c):
            h_acc = _step_logits(tiles, tile_ids, x, w, b, None if straight else operands, plan.device.vocab_block)
            h_acc = h_acc if not straight and len(tile_ids) == 1 else None  # one fp32 hidden tile, cast once
            d = block_grad(v0, v1, rs, x)
            if tile_ids[-1] == tiles.count - 1 and tiles.tail < tiles.last_rows:  # padding adds exactly 0 (NaN too)
                d[d.shape[0] - tiles.last_rows + tiles.tail:] = 0
            if tiles.batched:  # the step's sums over rows in one product (K: its fixed rows), grad_hidden batched
                dj = operands(d)
                if needs.weight:
                    add_matmul(gw, dj.t(), operands(tiles.step(tile_ids)).flatten(0, 1))
                if needs.bias:
                    gb.add_(dj.sum(dim=0, dtype=acc))
                if needs.hidden:
                    steps = len(tile_ids)
                    add_matmul(gh_tiles.step(tile_ids), dj.view(steps, tiles.tile, c),
                            w_acc.unsqueeze(0).expand(steps, *w_acc.shape))
                continue
            for i, j in enumerate(tile_ids):  # tile by tile, in tile order: the sums do not see the grouping
                rows_j = tiles[j].shape[0]
                dj = d[i * tiles.tile:i * tiles.tile + rows_j]
                if rounded:
                    if needs.weight and one_product:
                        torch.mm(dj.t(), tiles[j], out=gw)
                    elif needs.weight:
                        gw_sums.add(gw, dj.t(), tiles[j], True)
                    if needs.bias:
                        gb.add_(dj.sum(dim=0, dtype=acc))
                    if needs.hidden:
                        gh_sums.add(gh_tiles[j], dj, w_acc, True)
                    continue
                dj = operands(dj)
                if needs.weight:
                    add_matmul(gw, dj.t(), operands(tiles[j]) if h_acc is None else h_acc)
                if needs.bias:
                    gb.add_(dj.sum(dim=0, dtype=acc))
                if needs.hidden:
                    add_matmul(gh_tiles[j], dj, w_acc)
        if gw_acc is not None:
            grad_weight[v0:v1] = gw
        if gb_acc is not None:
            grad_bias[v0:v1] = gb
    del buf
    if needs.hidden:
        gh_tiles.write_back()
    if grad_hidden is None:
        grad_hidden = rows.spread(gh[:rows.m].to(dtype)) if needs.hidden else hidden.new_empty(0)
    return grad_hidden, grad_weight, grad_bias
