"""Log-probs and entropy from the LM head's input: ``hidden @ weight.T + bias`` is never built.

``linear_selective_log_softmax(hidden, weight, index)`` returns what
``selective_log_softmax(hidden @ weight.T + bias, index)`` returns, working
through one reused buffer of logits for a block of vocab columns at a time.
This module only orchestrates matmuls and the op (csrc/ops.cpp); the math is
the op's own, and the merge of per-block statistics is
``row_stats.combine_shard_stats``.

Rows whose labels are all ``ignore_index`` (prompt tokens in RL) are dropped before any matmul
(logp 0, entropy 0, zero gradient); the kept rows are gathered once per pass (none when all are kept).

Batch invariance (docs/linear.md): a row's results depend on nothing but the row. Every
matmul takes the kept rows in tiles of exactly ROW_TILE rows (the last one zero-padded),
the vocab is cut into blocks of VOCAB_BLOCK columns from V alone, and ``chunk_bytes`` only
decides how many tiles share one op call (``tiles_in_flight``).

Forward, for each vocab block ``[v0, v1)`` of this rank's weight, for each group of tiles:
    buf[tile] = hidden_tile @ weight[v0:v1].T (+ bias[v0:v1])     # [ROW_TILE, v1 - v0] each
    op forward with vocab_start = shard start + v0 -> the block's (shift, log_sum, logp, entropy)
then ``row_stats.combine_shard_stats_in_tiles`` folds the block into a float64 state of the
rows, in block order, one row tile per call (the same merge as across tensor-parallel
ranks); under tensor parallelism one all_gather of O(N) statistics
(``vocab_parallel.gather_shard_stats``) and the same merge combine the ranks.

Backward, for each vocab block, for each group of tiles: recompute ``buf``, the op's
in-place backward with the GLOBAL (shift, log_sum, entropy) turns it into d logits, then
tile by tile, in tile order:
    grad_weight[v0:v1] += d_tile.T @ hidden_tile
    grad_bias[v0:v1]   += d_tile.sum(0)
    grad_hidden_tile   += d_tile @ weight[v0:v1]     (over blocks in block order)
all summed in fp32 for bf16/fp16 and rounded once.

Memory (beyond inputs, outputs and gradients: the block buffer within ``chunk_bytes``, O(N)
statistics, nothing [N, V]) and tensor parallelism (``weight`` is this rank's vocab shard;
``grad_hidden`` is this rank's partial sum, Megatron's ColumnParallelLinear convention): see
docs/linear.md.

torch.compile: two custom ops (``twinkle_mem::linear_selective_log_softmax_fwd`` / ``_bwd``) with fake
kernels and ``register_autograd``; ``fullgraph=True`` traces the call (a process group travels as its name).
The public function, ``linear_selective_log_softmax``, is in functional.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from ._contract import check_op_label_range, stats_dtype
from ._matmul import add_matmul, logits_tile, mixed_addmm
from .row_stats import combine_shard_stats_in_tiles, output_shift
from .vocab_parallel import gather_shard_stats

DEFAULT_CHUNK_BYTES = 256 << 20


# ------------------------------------------------------------------ planning
# Every matmul, op call and merge is cut from these two constants alone, never from N or chunk_bytes,
# so that a row's results depend only on its own hidden state and the weight (batch invariance):
# (Sizes measured on the 2-core build machine, fp32, H = 1024: 512 x 8192 tiles run the matmuls about as
# fast as one matmul over 1024 rows and 65536 columns; 256 x 4096 tiles were ~30% slower on 2 threads.)
ROW_TILE = 512  # rows per matmul (the last tile zero-padded): the BLAS sees one M whatever N is
VOCAB_BLOCK = 8192  # vocab columns per block (the last one ragged): blocks and their merge order from V alone


def _accumulates_in_fp32(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def block_width(shard: int) -> int:
    """Columns of the vocab blocks: VOCAB_BLOCK, or the whole (shard of the) vocab when smaller."""
    return min(VOCAB_BLOCK, shard)


def tile_bytes(cols: int, hidden_size: int, dtype: torch.dtype, backward: bool) -> tuple[int, int]:
    """(bytes per row tile of a block, fixed bytes per block) of the block working memory.

    Per tile: its logits [ROW_TILE, cols]. Fixed, in the backward for bf16/fp16 (fp32 accumulation):
    the fp32 copies of the weight block, of one gradient tile and of one hidden tile, and the fp32
    accumulators of the block's grad_weight and grad_bias."""
    per_tile = ROW_TILE * cols * dtype.itemsize
    fixed = 4 * (2 * cols * hidden_size + cols + ROW_TILE * (cols + hidden_size)) \
        if backward and _accumulates_in_fp32(dtype) else 0
    return per_tile, fixed


def default_chunk_bytes(cols: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The chunk_bytes of a call that gives none: DEFAULT_CHUNK_BYTES, or one row tile of a vocab block
    where that needs more (the bf16/fp16 backward's fp32 copies: H above about 3,600 at 8192 columns)."""
    return max(DEFAULT_CHUNK_BYTES, sum(tile_bytes(cols, hidden_size, dtype, backward=True)))


def tiles_in_flight(cols: int, hidden_size: int, dtype: torch.dtype, chunk_bytes: int, backward: bool) -> int:
    """How many row tiles of a block one buffer holds within chunk_bytes (>= 1, else ValueError).

    This is all that chunk_bytes decides: how many fixed tiles go through one op call, never a
    matmul's shape nor an order of summation."""
    per_tile, fixed = tile_bytes(cols, hidden_size, dtype, backward)
    tiles = (chunk_bytes - fixed) // per_tile
    if tiles < 1:
        raise ValueError(f"chunk_bytes = {chunk_bytes} is below one row tile of a vocab block ({ROW_TILE} rows x "
                         f"{cols} columns, H = {hidden_size}, {dtype}: {per_tile + fixed} bytes)")
    return tiles


def _kept_rows(labels: Tensor, ignore_index: int) -> Optional[Tensor]:
    """Indices of the rows with a label other than ignore_index, or None when every row is kept.

    A row with k = 0 labels (entropy only) is kept, as the op keeps it.
    """
    if labels.shape[1] == 0 or labels.shape[0] == 0:
        return None
    kept = (labels != ignore_index).any(dim=1).nonzero().squeeze(1)
    return None if kept.numel() == labels.shape[0] else kept


class _RowTiles:
    """The rows of an [m, H] tensor as tiles of ROW_TILE rows: views, but for a last partial tile,
    which is a zero-padded [ROW_TILE, H] copy (``write_back`` returns its rows to the tensor)."""

    def __init__(self, rows: Tensor):
        self.rows = rows
        m = rows.shape[0]
        self.count = -(-m // ROW_TILE)
        self.padded = self.count * ROW_TILE
        self.tail = m - (self.count - 1) * ROW_TILE  # rows in the last tile
        self.last = None
        if self.tail < ROW_TILE:
            self.last = rows.new_zeros((ROW_TILE, rows.shape[1]))
            self.last[: self.tail] = rows[(self.count - 1) * ROW_TILE:]

    def __getitem__(self, j: int) -> Tensor:
        if j == self.count - 1 and self.last is not None:
            return self.last
        return self.rows[j * ROW_TILE:(j + 1) * ROW_TILE]

    def write_back(self) -> None:
        if self.last is not None:
            self.rows[(self.count - 1) * ROW_TILE:] = self.last[: self.tail]


def _pad_rows(t: Optional[Tensor], rows: int, value=0) -> Optional[Tensor]:
    """t [m, ...] extended to [rows, ...] with `value` (O(N): labels, statistics, upstream gradients)."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def _tile_buffer(buf: Tensor, g0: int, g1: int, cols: int) -> Tensor:
    """The front of the flat buffer as the logits of tiles [g0, g1): [(g1 - g0) ROW_TILE, cols]."""
    rows = (g1 - g0) * ROW_TILE
    return buf[: rows * cols].view(rows, cols)


def _select(t: Optional[Tensor], kept: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or kept is None:
        return t
    return t.index_select(0, kept)


def _resolve_group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


# ------------------------------------------------------------------ forward op
def _shard_stats(tiles, weight, bias, labels, inv_temperature, ignore_index, with_entropy, vocab_start,
                 vocab_size, chunk_bytes):
    """This weight's (shard's) statistics for the padded kept rows, in float64: (logp [M, k] against
    the shard's own normalizer, 0 for labels elsewhere; entropy [M] of the shard's softmax or None;
    shift [M]; log_sum [M]), M = tiles.padded. labels: [M, k] int64, ignore_index on the padding.

    The blocks' fp32 statistics are folded into a float64 state in block order, one row tile at a
    time (row_stats.combine_shard_stats_in_tiles), so the fold adds no rounding of its own and a
    row's result depends on nothing but its row.
    """
    h = tiles.rows.shape[1]
    shard = weight.shape[0]
    cols = block_width(shard)
    group = min(tiles_in_flight(cols, h, tiles.rows.dtype, chunk_bytes, backward=False), tiles.count)
    buf = tiles.rows.new_empty(group * ROW_TILE * cols)
    local = labels - vocab_start
    ignored = labels == ignore_index
    state = None
    for v0 in range(0, shard, cols):
        v1 = min(v0 + cols, shard)
        parts = []
        for g0 in range(0, tiles.count, group):
            g1 = min(g0 + group, tiles.count)
            x = _tile_buffer(buf, g0, g1, v1 - v0)
            for j in range(g0, g1):
                logits_tile(x[(j - g0) * ROW_TILE:(j - g0 + 1) * ROW_TILE], tiles[j], weight, bias, v0, v1)
            parts.append(ops.fwd(x, labels[g0 * ROW_TILE:g1 * ROW_TILE], inv_temperature, ignore_index,
                                 vocab_start + v0, vocab_size, with_entropy, False))
        logp_b, entropy_b, shift_b, log_sum_b = (torch.cat(t).double() if len(t) > 1 else t[0].double()
                                                 for t in zip(*parts))
        entropy_b = entropy_b if with_entropy else None
        if state is None:  # the first block: the op's own statistics
            state = (logp_b, entropy_b, shift_b, log_sum_b)
            continue
        logp_s, entropy_s, shift_s, log_sum_s = state
        in_block = (local >= v0) & (local < v1) & ~ignored  # owner 1: the label's logit is in this block
        state = combine_shard_stats_in_tiles(
            ROW_TILE, torch.stack([shift_s, shift_b]), torch.stack([log_sum_s, log_sum_b]),
            torch.stack([logp_s, logp_b]), None if entropy_b is None else torch.stack([entropy_s, entropy_b]),
            in_block.long(), ignored, inv_temperature)
    del buf
    logp, entropy, shift, log_sum = state
    # Labels on another rank's shard: 0 here, as the op gives (the ranks' merge takes the owner's).
    on_shard = (local >= 0) & (local < shard) & ~ignored
    return torch.where(on_shard, logp, 0), entropy, shift, log_sum


@torch.library.custom_op("twinkle_mem::linear_selective_log_softmax_fwd", mutates_args=())
def linear_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, inv_temperature: Tensor,
               ignore_index: int, with_entropy: bool, chunk_bytes: int, vocab_start: int, vocab_size: int,
               group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [Vs, H] (the vocab [vocab_start, vocab_start + Vs) of vocab_size),
    bias [Vs] or None, labels [N, k] global ids. Returns fp32 (fp64 for fp64 hidden) full-vocab
    logp [N, k], entropy [N] (or [0]), shift [N], log_sum [N]; the rows whose labels are all
    ignore_index give 0 everywhere. group_name: the TP group ('' for none). inv_temperature: 1/T as
    a 0-dim CPU tensor (ops.inv_temperature_tensor: no recompile when T changes under torch.compile)."""
    inv_temperature = inv_temperature.item()
    n, k = labels.shape
    # Checked here, on the caller's labels: the op's own check would see a row tile's and name its entry.
    check_op_label_range(labels, labels == ignore_index, vocab_size, ignore_index)
    acc = stats_dtype(hidden)
    logp = hidden.new_zeros((n, k), dtype=acc)
    entropy = hidden.new_zeros((n if with_entropy else 0,), dtype=acc)
    shift = hidden.new_zeros((n,), dtype=acc)
    log_sum = hidden.new_zeros((n,), dtype=acc)
    kept = _kept_rows(labels, ignore_index)
    h = _select(hidden, kept)
    m = h.shape[0]
    if m == 0:  # (the same on every rank: the labels are)
        return logp, entropy, shift, log_sum
    tiles = _RowTiles(h)
    y = _pad_rows(_select(labels, kept).long(), tiles.padded, ignore_index)
    stats = _shard_stats(tiles, weight, bias, y, inv_temperature, ignore_index, with_entropy, vocab_start,
                         vocab_size, chunk_bytes)
    if group_name:  # the ranks' merge, in float64 too (O(N) bytes on the wire), by row tiles as above
        group = _resolve_group(group_name)
        gathered = gather_shard_stats(*stats, y, weight.shape[0], inv_temperature, ignore_index, group,
                                      dist.get_world_size(group))
        stats = combine_shard_stats_in_tiles(ROW_TILE, *gathered, inv_temperature)
    outs = (logp, entropy, shift, log_sum) if with_entropy else (logp, None, shift, log_sum)
    for r0 in range(0, m, ROW_TILE):  # the last step by row tiles too (row_stats.combine_shard_stats_in_tiles)
        s = slice(r0, r0 + ROW_TILE)
        logp_k, entropy_k, shift_k, log_sum_k = (None if t is None else t[s] for t in stats)
        shift_k, log_sum_k = output_shift(shift_k, log_sum_k, inv_temperature, acc)
        r1 = min(r0 + ROW_TILE, m)
        for out, val in zip(outs, (logp_k, entropy_k, shift_k, log_sum_k)):
            if out is None:
                continue
            val = val[: r1 - r0].to(acc)
            if kept is None:
                out[r0:r1] = val.view(out[r0:r1].shape)
            else:
                out.index_copy_(0, kept[r0:r1], val.view((-1, *out.shape[1:])))
    return logp, entropy, shift, log_sum


@linear_fwd.register_fake
def _linear_fwd_fake(hidden, weight, bias, labels, inv_temperature, ignore_index, with_entropy, chunk_bytes,
                     vocab_start, vocab_size, group_name):
    n, k = labels.shape
    acc = stats_dtype(hidden)
    return (hidden.new_empty((n, k), dtype=acc), hidden.new_empty((n if with_entropy else 0,), dtype=acc),
            hidden.new_empty((n,), dtype=acc), hidden.new_empty((n,), dtype=acc))


# ------------------------------------------------------------------ backward op
@torch.library.custom_op("twinkle_mem::linear_selective_log_softmax_bwd", mutates_args=())
def linear_bwd(grad_logp: Tensor, grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
               bias: Optional[Tensor], labels: Tensor, shift: Tensor, log_sum: Tensor, entropy: Optional[Tensor],
               inv_temperature: Tensor, ignore_index: int, chunk_bytes: int, vocab_start: int, need_hidden: bool,
               need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight [Vs, H], grad_bias [Vs]); an empty [0] for a gradient not needed.
    shift, log_sum, entropy: the forward's full-vocab statistics. grad_hidden is this weight's
    (shard's) term of d_logits @ weight."""
    inv_temperature = inv_temperature.item()
    n, h_size = hidden.shape
    shard = weight.shape[0]
    none = lambda: hidden.new_empty(0)  # noqa: E731  (a fresh one each: outputs may not alias)
    kept = _kept_rows(labels, ignore_index)
    h = _select(hidden, kept)
    m = h.shape[0]
    reduced = _accumulates_in_fp32(hidden.dtype)
    # bf16/fp16 with kept rows: every block of grad_weight / grad_bias is written whole from its fp32
    # accumulator below, so nothing needs zeroing first; fp32 sums into the gradients themselves.
    new_grad = (lambda t: t.new_empty(t.shape)) if reduced and m > 0 else (lambda t: t.new_zeros(t.shape))  # noqa: E731
    grad_weight = new_grad(weight) if need_weight else none()
    grad_bias = new_grad(bias) if need_bias else none()
    acc_dtype = torch.float32 if reduced else hidden.dtype
    if not need_hidden:
        grad_hidden = acc = none()
    elif kept is None and not reduced:
        grad_hidden = acc = hidden.new_zeros((n, h_size))  # accumulate into the gradient itself
    else:  # grad_hidden is made from acc after the blocks, so that it is not alive beside them
        grad_hidden = None
        acc = hidden.new_zeros((m, h_size), dtype=acc_dtype)
    if m == 0:
        return (hidden.new_zeros((n, h_size)) if grad_hidden is None else grad_hidden), grad_weight, grad_bias

    tiles = _RowTiles(h)
    acc_tiles = _RowTiles(acc) if need_hidden else None
    pad = tiles.padded
    y = _pad_rows(_select(labels, kept).long(), pad, ignore_index)  # the padding: ignored, zero gradient
    g_logp = _pad_rows(_select(grad_logp, kept), pad).contiguous()
    use_entropy = grad_entropy is not None and entropy is not None
    g_entropy = _pad_rows(_select(grad_entropy, kept), pad).contiguous() if use_entropy else None
    ent = _pad_rows(_select(entropy, kept), pad) if use_entropy else None
    shift_k, log_sum_k = _pad_rows(_select(shift, kept), pad), _pad_rows(_select(log_sum, kept), pad)

    cols = block_width(shard)
    group = min(tiles_in_flight(cols, h_size, hidden.dtype, chunk_bytes, backward=True), tiles.count)
    buf = hidden.new_empty(group * ROW_TILE * cols)
    copies = reduced and not mixed_addmm(hidden.device)  # fp32 copies of the operands (CPU)
    as_acc = (lambda t: t.to(acc_dtype)) if copies else (lambda t: t)  # noqa: E731
    gw_acc = weight.new_empty((cols, h_size), dtype=acc_dtype) if need_weight and reduced else None
    gb_acc = weight.new_empty((cols,), dtype=acc_dtype) if need_bias and reduced else None
    for v0 in range(0, shard, cols):
        v1 = min(v0 + cols, shard)
        c = v1 - v0
        w_block = as_acc(weight[v0:v1]) if need_hidden else None
        gw = gw_acc[:c].zero_() if gw_acc is not None else grad_weight[v0:v1]
        gb = gb_acc[:c].zero_() if gb_acc is not None else grad_bias[v0:v1]
        for g0 in range(0, tiles.count, group):
            g1 = min(g0 + group, tiles.count)
            x = _tile_buffer(buf, g0, g1, c)
            for j in range(g0, g1):
                logits_tile(x[(j - g0) * ROW_TILE:(j - g0 + 1) * ROW_TILE], tiles[j], weight, bias, v0, v1)
            rs = slice(g0 * ROW_TILE, g1 * ROW_TILE)
            ops.bwd_inplace(g_logp[rs], None if g_entropy is None else g_entropy[rs], x, y[rs], shift_k[rs],
                            log_sum_k[rs], None if ent is None else ent[rs], inv_temperature, ignore_index,
                            vocab_start + v0)
            if g1 == tiles.count and tiles.tail < ROW_TILE:  # padding rows add exactly 0 (even where d was NaN)
                x[(g1 - 1 - g0) * ROW_TILE + tiles.tail:].zero_()
            for j in range(g0, g1):  # tile by tile, in tile order: the sums over rows do not see the grouping
                d = as_acc(x[(j - g0) * ROW_TILE:(j - g0 + 1) * ROW_TILE])
                if need_weight:
                    add_matmul(gw, d.t(), as_acc(tiles[j]))
                if need_bias:
                    gb.add_(d.sum(dim=0, dtype=acc_dtype))
                if need_hidden:
                    add_matmul(acc_tiles[j], d, w_block)
        if gw_acc is not None:
            grad_weight[v0:v1] = gw
        if gb_acc is not None:
            grad_bias[v0:v1] = gb
    del buf
    if need_hidden:
        acc_tiles.write_back()
    if grad_hidden is None:
        grad_hidden = acc.to(hidden.dtype) if kept is None else \
            hidden.new_zeros((n, h_size)).index_copy_(0, kept, acc.to(hidden.dtype))
    return grad_hidden, grad_weight, grad_bias


@linear_bwd.register_fake
def _linear_bwd_fake(grad_logp, grad_entropy, hidden, weight, bias, labels, shift, log_sum, entropy,
                     inv_temperature, ignore_index, chunk_bytes, vocab_start, need_hidden, need_weight, need_bias):
    return (hidden.new_empty(hidden.shape if need_hidden else 0), weight.new_empty(weight.shape if need_weight else 0),
            bias.new_empty(bias.shape) if need_bias else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, labels, inv_temperature, ignore_index, with_entropy, chunk_bytes, vocab_start,
     _vocab_size, _group_name) = inputs
    _logp, entropy, shift, log_sum = output
    ctx.save_for_backward(hidden, weight, bias, labels, shift, log_sum, entropy if with_entropy else None)
    ctx.args = (inv_temperature, ignore_index, chunk_bytes, vocab_start)
    ctx.with_entropy = with_entropy
    ctx.mark_non_differentiable(shift, log_sum)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum):
    hidden, weight, bias, labels, shift, log_sum, entropy = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    if grad_logp is None:
        grad_logp = shift.new_zeros(labels.shape)
    grads = linear_bwd(grad_logp, grad_entropy if ctx.with_entropy else None, hidden, weight, bias, labels, shift,
                       log_sum, entropy, *ctx.args, need_hidden, need_weight, need_bias)
    grads = [g if need else None for g, need in zip(grads, (need_hidden, need_weight, need_bias))]
    return (*grads, None, None, None, None, None, None, None, None)


linear_fwd.register_autograd(_backward, setup_context=_setup_context)
