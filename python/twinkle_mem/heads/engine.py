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
from .matmul import add_matmul, logits_into, mixed_addmm

# Every matmul and merge is cut from these constants and H alone, never from N or chunk_bytes: a row's results depend
# only on its hidden state and the weight. (EPYC, H 1024, fp32: 512 x 8192 tiles ran as fast as whole matmuls.)
ROW_TILE = 512  # rows per matmul (the last tile zero-padded): the BLAS sees one M whatever N is
VOCAB_BLOCK = 8192  # vocab columns per block at H >= 1024 (the last one ragged): blocks and merge order from V, H
# Below H = 1024 that is too little work per matmul for the Xeon's BLAS (docs/cpu.md): blocks widen by whole
# VOCAB_BLOCKs, up to MAX_WIDEN, keeping cols x H <= VOCAB_BLOCK x 1024 (no more bytes than at H = 1024).
MAX_WIDEN = 4


def reduced(dtype: torch.dtype) -> bool:
    """bf16 / fp16: their products are summed in fp32."""
    return dtype in (torch.bfloat16, torch.float16)


def block_width(shard: int, hidden_size: int) -> int:
    """Columns of the vocab blocks from the (shard of the) vocab and H alone; the whole shard when smaller."""
    widen = max(1, min(MAX_WIDEN, 1024 // max(1, hidden_size)))
    return min(VOCAB_BLOCK * widen, shard)


def vocab_blocks(shard: int, width: int):
    """[v0, v1) of each vocab block of ``width`` columns, in order (the last one ragged)."""
    for v0 in range(0, shard, width):
        yield v0, min(v0 + width, shard)


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


# ------------------------------------------------------------------ the chunk budget
def tile_bytes(cols: int, hidden_size: int, dtype: torch.dtype, backward: bool) -> tuple[int, int]:
    """(bytes per row tile of a block, fixed bytes per block) of the block working memory, logits in ``dtype``.

    Per tile: its logits [ROW_TILE, cols]. Fixed, in the backward for bf16/fp16 (fp32 accumulation): the fp32
    copies of the weight block, of one gradient tile and of one hidden tile, and the fp32 accumulators of the
    block's grad_weight and grad_bias."""
    per_tile = ROW_TILE * cols * dtype.itemsize
    fixed = 4 * (2 * cols * hidden_size + cols + ROW_TILE * (cols + hidden_size)) if backward and reduced(dtype) else 0
    return per_tile, fixed


def tiles_in_flight(cols: int, hidden_size: int, dtype: torch.dtype, chunk_bytes: int, backward: bool) -> int:
    """How many row tiles of a block one buffer holds within chunk_bytes (>= 1, else ValueError); a block widened
    past VOCAB_BLOCK that many fewer (>= 1): its buffer no larger than VOCAB_BLOCK-wide blocks' at the same rows.

    This is all that chunk_bytes decides: how many fixed tiles go through one step, never a matmul's shape
    nor an order of summation."""
    per_tile, fixed = tile_bytes(cols, hidden_size, dtype, backward)
    tiles = (chunk_bytes - fixed) // per_tile
    if tiles < 1:
        raise ValueError(f"chunk_bytes = {chunk_bytes} is below one row tile of a vocab block ({ROW_TILE} rows x "
                         f"{cols} columns, H = {hidden_size}, {dtype}: {per_tile + fixed} bytes)")
    return max(1, tiles // max(1, cols // VOCAB_BLOCK))


# ------------------------------------------------------------------ kept rows, row tiles
def pad_rows(t: Optional[Tensor], rows: int, value=0) -> Optional[Tensor]:
    """t [m, ...] extended to [rows, ...] with ``value`` (O(N): labels, statistics, upstream gradients)."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


class RowTiles:
    """The rows of an [m, H] tensor as tiles of ``tile`` rows (ROW_TILE by default): views, but for a last
    partial tile, which is a zero-padded [tile, H] copy (``write_back`` returns its rows to the tensor)."""

    def __init__(self, rows: Tensor, tile: Optional[int] = None):
        self.rows = rows
        self.tile = ROW_TILE if tile is None else tile
        m = rows.shape[0]
        self.count = -(-m // self.tile)
        self.padded = self.count * self.tile
        self.tail = m - (self.count - 1) * self.tile  # rows in the last tile
        self.last = None
        if self.tail < self.tile:
            self.last = rows.new_zeros((self.tile, rows.shape[1]))
            self.last[: self.tail] = rows[(self.count - 1) * self.tile:]

    def __getitem__(self, j: int) -> Tensor:
        if j == self.count - 1 and self.last is not None:
            return self.last
        return self.rows[j * self.tile:(j + 1) * self.tile]

    def write_back(self) -> None:
        if self.last is not None:
            self.rows[(self.count - 1) * self.tile:] = self.last[: self.tail]


class Rows:
    """The rows a head works on: those of ``hidden`` [N, H] with a label other than ``ignore_index`` (labels
    [N], [N, k]: kept if any of its k is, a row of k = 0 labels too; None: every row), as row tiles; per-row
    tensors are taken alike (``take``) and results put back in place (``put``, ``spread``)."""

    def __init__(self, hidden: Tensor, labels: Optional[Tensor], ignore_index: int, tile: Optional[int] = None):
        self.n = hidden.shape[0]
        self.index = kept_rows(labels, ignore_index)  # None when every row is kept
        self.m = self.n if self.index is None else self.index.numel()
        self.tiles = RowTiles(self.select(hidden), tile) if self.m else None

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
class Operands:
    """The operands of a sweep's fp32 (fp64) sums: the inputs as they are where the device sums bf16/fp16
    products in fp32 (matmul.mixed_addmm) and the other operand has their dtype, else fp32 copies, made one
    weight block and one row tile at a time."""

    def __init__(self, dtype: torch.dtype, device: torch.device, logits_dtype: torch.dtype):
        self.acc = acc_dtype(dtype)
        self.copies = reduced(dtype) and (logits_dtype != dtype or not mixed_addmm(device))

    def __call__(self, t: Tensor) -> Tensor:
        return t.to(self.acc) if self.copies else t


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


class Plan(NamedTuple):
    """How a head's sweep cuts the work: vocab blocks of ``width`` columns, ``group`` row tiles per buffer of
    logits (the chunk budget), logits in ``logits_dtype`` (the input dtype, as the model's layer would give
    them; or the accumulation dtype, for math in fp32 / fp64)."""
    width: int
    group: int
    logits_dtype: torch.dtype


def _groups(tiles: RowTiles, plan: Plan, buf: Tensor, cols: int):
    """(the padded rows' slice, their logits' view of the buffer [rows, cols]) of each group of row tiles."""
    for g0 in range(0, tiles.count, plan.group):
        g1 = min(g0 + plan.group, tiles.count)
        rows = (g1 - g0) * tiles.tile
        yield range(g0, g1), slice(g0 * tiles.tile, g1 * tiles.tile), buf[: rows * cols].view(rows, cols)


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
def _group_logits(tiles: RowTiles, tile_ids: range, x: Tensor, w: Tensor, b: Optional[Tensor],
                  operand: Optional[Callable[[Tensor], Tensor]]) -> Tensor:
    """x = the logits of a group's row tiles, each hidden tile as ``operand`` makes it (None: as it is); returns
    the last tile's operand."""
    for i, j in enumerate(tile_ids):
        h = tiles[j] if operand is None else operand(tiles[j])
        logits_into(x[i * tiles.tile:(i + 1) * tiles.tile], h, w, b, VOCAB_BLOCK)  # a widened block: in pieces
    return h


def forward_sweep(tiles: RowTiles, weight: Tensor, bias: Optional[Tensor], plan: Plan,
                  step: Callable[[int, int, slice, Tensor], None]) -> None:
    """step(v0, v1, rows, x) for each vocab block [v0, v1) in order and, within it, each group of row tiles in
    order: x [rows, v1 - v0], the logits of the padded rows ``rows`` (a slice) in plan.logits_dtype, is one
    reused buffer (consumed before the next step)."""
    operands = Operands(tiles.rows.dtype, tiles.rows.device, plan.logits_dtype)
    straight = plan.logits_dtype == tiles.rows.dtype
    buf = tiles.rows.new_empty(plan.group * tiles.tile * plan.width, dtype=plan.logits_dtype)
    for v0, v1 in vocab_blocks(weight.shape[0], plan.width):
        w, b = _block_operands(weight, bias, v0, v1, operands, straight)
        for tile_ids, rows, x in _groups(tiles, plan, buf, v1 - v0):
            _group_logits(tiles, tile_ids, x, w, b, None if straight else operands)
            step(v0, v1, rows, x)


def backward_sweep(rows: Rows, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], plan: Plan, needs: Needs,
                   block_grad: Callable[[int, int, slice, Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight, grad_bias) from block_grad(v0, v1, rows, x) -> d: the gradient of the
    loss w.r.t. the logits x of a forward_sweep step ([rows, v1 - v0], any float dtype; it may be x itself,
    overwritten). The padding rows' d is zeroed here; grad_weight[v0:v1] += d.T @ hidden_tile, grad_bias[v0:v1]
    += d.sum(0), grad_hidden_tile += d @ weight[v0:v1], tile by tile in tile order and block by block in block
    order, in the accumulation dtype, rounded once. A gradient that ``needs`` does not ask for is an empty [0]."""
    n, h_size = hidden.shape
    dtype = hidden.dtype
    operands = Operands(dtype, hidden.device, plan.logits_dtype)
    acc = operands.acc
    sum_apart = reduced(dtype) and rows.m > 0  # every block of grad_weight / grad_bias written whole from acc
    new_grad = (lambda t: t.new_empty(t.shape)) if sum_apart else (lambda t: t.new_zeros(t.shape))  # noqa: E731
    grad_weight = new_grad(weight) if needs.weight else hidden.new_empty(0)
    grad_bias = new_grad(bias) if needs.bias else hidden.new_empty(0)
    if not needs.hidden:
        grad_hidden = gh = None
    elif rows.index is None and not reduced(dtype):
        grad_hidden = gh = hidden.new_zeros((n, h_size))  # summed into the gradient itself
    else:  # grad_hidden made from gh after the blocks, so that it is not alive beside them
        grad_hidden, gh = None, hidden.new_zeros((rows.m, h_size), dtype=acc)
    if rows.m == 0:
        return (hidden.new_zeros((n, h_size)) if needs.hidden else hidden.new_empty(0)), grad_weight, grad_bias

    tiles = rows.tiles
    gh_tiles = RowTiles(gh, tiles.tile) if needs.hidden else None
    straight = plan.logits_dtype == dtype
    buf = hidden.new_empty(plan.group * tiles.tile * plan.width, dtype=plan.logits_dtype)
    gw_acc = weight.new_empty((plan.width, h_size), dtype=acc) if needs.weight and sum_apart else None
    gb_acc = weight.new_empty((plan.width,), dtype=acc) if needs.bias and sum_apart else None
    for v0, v1 in vocab_blocks(weight.shape[0], plan.width):
        c = v1 - v0
        w, b = _block_operands(weight, bias, v0, v1, operands, straight)  # the logits' operands
        w_acc = (w if not straight else operands(w)) if needs.hidden else None
        gw = gw_acc[:c].zero_() if gw_acc is not None else grad_weight[v0:v1]
        gb = gb_acc[:c].zero_() if gb_acc is not None else grad_bias[v0:v1]
        for tile_ids, rs, x in _groups(tiles, plan, buf, c):
            h_acc = _group_logits(tiles, tile_ids, x, w, b, None if straight else operands)
            h_acc = h_acc if not straight and len(tile_ids) == 1 else None  # one fp32 hidden tile, cast once
            d = block_grad(v0, v1, rs, x)
            if tile_ids[-1] == tiles.count - 1 and tiles.tail < tiles.tile:  # padding adds exactly 0 (even where NaN)
                d[d.shape[0] - tiles.tile + tiles.tail:] = 0
            for i, j in enumerate(tile_ids):  # tile by tile, in tile order: the sums do not see the grouping
                dj = operands(d[i * tiles.tile:(i + 1) * tiles.tile])
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
        grad_hidden = rows.spread(gh.to(dtype)) if needs.hidden else hidden.new_empty(0)
    return grad_hidden, grad_weight, grad_bias


# ------------------------------------------------------------------ the other block shape: each row's own k weight rows
def _gathered(weight: Tensor, ids: Tensor, tile: int, acc: torch.dtype) -> Tensor:
    """weight[ids] of a row tile padded to ``tile`` rows (id 0 on the padding): [tile, k, H] in acc."""
    ids = pad_rows(ids, tile)
    return weight.index_select(0, ids.reshape(-1)).view(tile, ids.shape[1], -1).to(acc)


def gathered_logits(tiles: RowTiles, weight: Tensor, bias: Optional[Tensor], ids: Tensor) -> Tensor:
    """x [m, k] = row . weight[ids[row, j]] + bias[ids[row, j]] for the tiles' m rows, in the accumulation dtype:
    per row tile, its k weight rows gathered ([tile, k, H] in fp32: the block of this shape) and one batched
    matmul."""
    acc = acc_dtype(tiles.rows.dtype)
    x = tiles.rows.new_empty(ids.shape, dtype=acc)
    for j in range(tiles.count):
        r0, r1 = j * tiles.tile, min((j + 1) * tiles.tile, ids.shape[0])
        xt = torch.bmm(_gathered(weight, ids[r0:r1], tiles.tile, acc), tiles[j].to(acc).unsqueeze(2)).squeeze(2)
        x[r0:r1] = xt[: r1 - r0] if bias is None else xt[: r1 - r0] + bias[ids[r0:r1]].to(acc)
    return x


def gathered_backward(rows: Rows, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, own: Tensor,
                      g: Tensor, needs: Needs, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight, grad_bias) from g [m, k], the gradient of the loss w.r.t. the kept rows'
    gathered_logits (0 where ``own`` is False: ids another shard holds); an empty [0] for one not needed.
    grad_hidden per row tile (a batched matmul with the tile's gathered weight rows, summed in fp32, rounded
    once); grad_weight[v] += g[n, j] hidden[n] (grad_bias: g[n, j]) over the entries with id v, vocab block
    by vocab block (one fp32 accumulator of a block for bf16/fp16, rounded once), ``budget`` bytes of
    gathered rows at a time."""
    n, h_size = hidden.shape
    acc = acc_dtype(hidden.dtype)
    grad_hidden = hidden.new_zeros((n, h_size)) if needs.hidden else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight) if needs.weight else hidden.new_empty(0)
    grad_bias = torch.zeros_like(bias) if needs.bias else hidden.new_empty(0)
    if rows.m == 0:
        return grad_hidden, grad_weight, grad_bias
    tiles = rows.tiles
    for j in range(tiles.count) if needs.hidden else ():
        r0, r1 = j * tiles.tile, min((j + 1) * tiles.tile, rows.m)
        w = _gathered(weight, ids[r0:r1], tiles.tile, acc)
        part = torch.bmm(pad_rows(g[r0:r1], tiles.tile).unsqueeze(1), w).squeeze(1)[: r1 - r0]
        rows.put(grad_hidden, r0, part.to(hidden.dtype))
    targets = (grad_weight if needs.weight else None, grad_bias if needs.bias else None)
    if targets == (None, None):
        return grad_hidden, grad_weight, grad_bias
    k = ids.shape[1]
    chunk = max(1, budget // (4 * h_size))  # entries per index_add
    for v0, v1 in vocab_blocks(weight.shape[0], block_width(weight.shape[0], h_size)):
        entries = (own & (ids >= v0) & (ids < v1)).flatten().nonzero().squeeze(1)
        if entries.numel() == 0:
            continue
        blocks = [None if t is None else (t[v0:v1] if t.dtype == acc else t[v0:v1].to(acc)) for t in targets]
        for e0 in range(0, entries.numel(), chunk):  # entries in row-major order
            e = entries[e0:e0 + chunk]
            at = ids.flatten()[e] - v0
            ge = g.flatten()[e]
            if blocks[0] is not None:
                blocks[0].index_add_(0, at, tiles.rows.index_select(0, e // k).to(acc) * ge.unsqueeze(1))
            if blocks[1] is not None:
                blocks[1].index_add_(0, at, ge)
        for t, b in zip(targets, blocks):
            if t is not None and t.dtype != acc:
                t[v0:v1] = b
    return grad_hidden, grad_weight, grad_bias
