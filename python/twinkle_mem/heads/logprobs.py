"""Log-probs and entropy from the LM head's input: ``hidden @ weight.T + bias`` is never built.

``linear_selective_log_softmax(hidden, weight, index)`` returns what
``selective_log_softmax(hidden @ weight.T + bias, index)`` returns. It runs on the blockwise engine
(heads/engine.py: kept rows, row tiles, vocab blocks, the chunk budget, fp32 sums, needed gradients) and supplies
the per-block math, which is the op's own (csrc/ops.cpp):

Forward, per vocab block ``[v0, v1)`` of this rank's weight and group of row tiles (engine.forward_sweep,
the logits in the input dtype, as the model's layer would give them): the op's forward with
vocab_start = shard start + v0 gives the block's (shift, log_sum, logp, entropy), which
``op/row_stats.combine_shard_stats_in_tiles`` folds into a float64 state of the rows, in block order, one row
tile per call (the same merge as across tensor-parallel ranks); under tensor parallelism one all_gather of
O(N) statistics (``op/vocab_parallel.gather_shard_stats``) and the same merge combine the ranks.

Backward, per block and group (engine.backward_sweep): the op's in-place backward with the GLOBAL
(shift, log_sum, entropy) turns the recomputed logits into their gradient, from which the engine sums
grad_weight, grad_bias and grad_hidden.

Batch invariance (docs/linear.md): every matmul and merge is cut from engine.ROW_TILE and
engine.block_width (V and H) alone; ``chunk_bytes`` only decides how many tiles share one op call
(engine.tiles_in_flight). Memory (beyond inputs, outputs and gradients: the block buffer within
``chunk_bytes``, O(N) statistics, nothing [N, V]) and tensor parallelism (``weight`` is this rank's vocab
shard; ``grad_hidden`` is this rank's partial sum, Megatron's ColumnParallelLinear convention): see
docs/linear.md.

torch.compile: two custom ops (``twinkle_mem::linear_selective_log_softmax_fwd`` / ``_bwd``) with fake
kernels and ``register_autograd``; ``fullgraph=True`` traces the call (a process group travels as its name).
The public function, ``linear_selective_log_softmax``, is at the end.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..op import ops
from ..op.contract import check_index_and_options, check_op_label_range, ignore_value, stats_dtype
from ..op.op_args import call, named_inputs, pick, register_autograd
from ..op.row_stats import combine_shard_stats_in_tiles, output_shift
from ..op.vocab_parallel import VocabShard, gather_shard_stats
from .engine import (Needs, Plan, Rows, backward_sweep, block_width, check_head_args, fake_grads, forward_sweep,
                     tile_bytes, tiles_in_flight)

DEFAULT_CHUNK_BYTES = 256 << 20


def default_chunk_bytes(cols: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The chunk_bytes of a call that gives none: DEFAULT_CHUNK_BYTES, or one row tile of a vocab block
    where that needs more (the bf16/fp16 backward's fp32 copies: H above about 3,600 at 8192 columns)."""
    return max(DEFAULT_CHUNK_BYTES, sum(tile_bytes(cols, hidden_size, dtype, backward=True)))


class LogprobOptions(NamedTuple):
    """The fused log-prob head's scalars, one value (its ops' schemas name them alike; the vocab shard is a
    vocab_parallel.VocabShard). inv_temperature: 1/T, a 0-dim CPU tensor across the op boundary
    (ops.inv_temperature_tensor: no recompile when T changes under torch.compile), a float inside the ops."""
    inv_temperature: object
    ignore_index: int
    with_entropy: bool
    chunk_bytes: int


def _plan(hidden: Tensor, shard: int, chunk_bytes: int, backward: bool) -> Plan:
    """Vocab blocks of block_width columns, as many row tiles per op call as chunk_bytes holds, logits in the
    input dtype (the op reads them as the model's layer would give them)."""
    cols = block_width(shard, hidden.shape[1])
    return Plan(cols, tiles_in_flight(cols, hidden.shape[1], hidden.dtype, chunk_bytes, backward), hidden.dtype)


# ------------------------------------------------------------------ forward op
def _shard_stats(rows: Rows, weight: Tensor, bias: Optional[Tensor], labels: Tensor, opts: LogprobOptions,
                 shard: VocabShard):
    """This weight's (shard's) statistics for the padded kept rows, in float64: (logp [M, k] against
    the shard's own normalizer, 0 for labels elsewhere; entropy [M] of the shard's softmax or None;
    shift [M]; log_sum [M]), M = rows.tiles.padded. labels: [M, k] int64, ignore_index on the padding.

    Each block's fp32 statistics are folded into a float64 state in block order, one row tile at a
    time (row_stats.combine_shard_stats_in_tiles), so the fold adds no rounding of its own and a
    row's result depends on nothing but its row.
    """
    width = weight.shape[0]
    local = labels - shard.vocab_start
    ignored = labels == opts.ignore_index
    state = [None] * 4  # logp, entropy, shift, log_sum of the rows: float64

    def step(v0, v1, rs, x):  # the op on a block's logits, folded into the rows' state
        block = [t.double() for t in ops.fwd(x, labels[rs], opts.inv_temperature, opts.ignore_index,
                                             shard.vocab_start + v0, shard.vocab_size, opts.with_entropy, False)]
        block[1] = block[1] if opts.with_entropy else None
        if v0 == 0:  # the first block: the op's own statistics
            for i, t in enumerate(block):
                if t is not None:
                    state[i] = t.new_empty((rows.tiles.padded, *t.shape[1:])) if state[i] is None else state[i]
                    state[i][rs] = t
            return
        logp_b, entropy_b, shift_b, log_sum_b = block
        in_block = (local[rs] >= v0) & (local[rs] < v1) & ~ignored[rs]  # owner 1: the label's logit is here
        merged = combine_shard_stats_in_tiles(
            rows.tiles.tile, torch.stack([state[2][rs], shift_b]), torch.stack([state[3][rs], log_sum_b]),
            torch.stack([state[0][rs], logp_b]), None if entropy_b is None else torch.stack([state[1][rs], entropy_b]),
            in_block.long(), ignored[rs], opts.inv_temperature)
        for i, t in enumerate(merged):
            if t is not None:
                state[i][rs] = t

    forward_sweep(rows.tiles, weight, bias, _plan(rows.tiles.rows, width, opts.chunk_bytes, backward=False), step)
    logp, entropy, shift, log_sum = state
    # Labels on another rank's shard: 0 here, as the op gives (the ranks' merge takes the owner's).
    on_shard = (local >= 0) & (local < width) & ~ignored
    return torch.where(on_shard, logp, 0), entropy, shift, log_sum


@torch.library.custom_op("twinkle_mem::linear_selective_log_softmax_fwd", mutates_args=())
def linear_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, inv_temperature: Tensor,
               ignore_index: int, with_entropy: bool, chunk_bytes: int, vocab_start: int, vocab_size: int,
               group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], weight [Vs, H] (the vocab [vocab_start, vocab_start + Vs) of vocab_size),
    bias [Vs] or None, labels [N, k] global ids. Returns fp32 (fp64 for fp64 hidden) full-vocab
    logp [N, k], entropy [N] (or [0]), shift [N], log_sum [N]; the rows whose labels are all
    ignore_index give 0 everywhere. group_name: the TP group ('' for none)."""
    opts = LogprobOptions(inv_temperature.item(), ignore_index, with_entropy, chunk_bytes)
    shard = VocabShard(vocab_start, vocab_size, group_name)
    n, k = labels.shape
    # Checked here, on the caller's labels: the op's own check would see a row tile's and name its entry.
    check_op_label_range(labels, labels == ignore_index, vocab_size, ignore_index)
    acc = stats_dtype(hidden)
    logp = hidden.new_zeros((n, k), dtype=acc)
    entropy = hidden.new_zeros((n if with_entropy else 0,), dtype=acc)
    shift = hidden.new_zeros((n,), dtype=acc)
    log_sum = hidden.new_zeros((n,), dtype=acc)
    rows = Rows(hidden, labels, ignore_index)
    if rows.m == 0:  # (the same on every rank: the labels are)
        return logp, entropy, shift, log_sum
    y = rows.take(labels.long(), ignore_index)
    stats = _shard_stats(rows, weight, bias, y, opts, shard)
    if group_name:  # the ranks' merge, in float64 too (O(N) bytes on the wire), by row tiles as above
        group = shard.group()
        gathered = gather_shard_stats(*stats, y, weight.shape[0], opts.inv_temperature, ignore_index, group,
                                      dist.get_world_size(group))
        stats = combine_shard_stats_in_tiles(rows.tiles.tile, *gathered, opts.inv_temperature)
    outs = (logp, entropy, shift, log_sum) if with_entropy else (logp, None, shift, log_sum)
    tile = rows.tiles.tile
    for r0 in range(0, rows.m, tile):  # the last step by row tiles too (row_stats.combine_shard_stats_in_tiles)
        s = slice(r0, r0 + tile)
        logp_k, entropy_k, shift_k, log_sum_k = (None if t is None else t[s] for t in stats)
        shift_k, log_sum_k = output_shift(shift_k, log_sum_k, opts.inv_temperature, acc)
        r1 = min(r0 + tile, rows.m)
        for out, val in zip(outs, (logp_k, entropy_k, shift_k, log_sum_k)):
            if out is not None:
                rows.put(out, r0, val[: r1 - r0].to(acc).view((r1 - r0, *out.shape[1:])))
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
    rows = Rows(hidden, labels, ignore_index)
    plan = _plan(hidden, weight.shape[0], chunk_bytes, backward=True)
    needs = Needs(need_hidden, need_weight, need_bias)
    if rows.m == 0:
        return backward_sweep(rows, hidden, weight, bias, plan, needs, None)
    y = rows.take(labels.long(), ignore_index)  # the padding: ignored, zero gradient
    g_logp = rows.take(grad_logp).contiguous()
    use_entropy = grad_entropy is not None and entropy is not None
    g_entropy = rows.take(grad_entropy).contiguous() if use_entropy else None
    ent = rows.take(entropy) if use_entropy else None
    shift_k, log_sum_k = rows.take(shift), rows.take(log_sum)

    def block_grad(v0, v1, rs, x):  # the op's in-place backward with the full-vocab statistics: x becomes d
        ops.bwd_inplace(g_logp[rs], None if g_entropy is None else g_entropy[rs], x, y[rs], shift_k[rs],
                        log_sum_k[rs], None if ent is None else ent[rs], inv_temperature, ignore_index,
                        vocab_start + v0)
        return x

    return backward_sweep(rows, hidden, weight, bias, plan, needs, block_grad)


@linear_bwd.register_fake
def _linear_bwd_fake(grad_logp, grad_entropy, hidden, weight, bias, labels, shift, log_sum, entropy,
                     inv_temperature, ignore_index, chunk_bytes, vocab_start, need_hidden, need_weight, need_bias):
    return fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _setup_context(ctx, inputs, output):
    args = named_inputs(linear_fwd, inputs)
    ctx.options, ctx.shard = pick(LogprobOptions, linear_fwd, inputs), pick(VocabShard, linear_fwd, inputs)
    _logp, entropy, shift, log_sum = output
    ctx.save_for_backward(args["hidden"], args["weight"], args["bias"], args["labels"], shift, log_sum,
                          entropy if ctx.options.with_entropy else None)
    ctx.mark_non_differentiable(shift, log_sum)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum):
    hidden, weight, bias, labels, shift, log_sum, entropy = ctx.saved_tensors
    needs = Needs.of(ctx, linear_fwd, bias)
    if grad_logp is None:
        grad_logp = shift.new_zeros(labels.shape)
    grad_entropy = grad_entropy if ctx.options.with_entropy else None
    return needs.grads(*call(linear_bwd, grad_logp, grad_entropy, hidden, weight, bias, labels, shift, log_sum,
                             entropy, ctx.options, ctx.shard, needs.args()))


register_autograd(linear_fwd, _backward, _setup_context)


# ------------------------------------------------------------------ the public function
def _check_args(hidden, weight, bias, index, temperature, ignore_index, chunk_bytes) -> bool:
    """Raises ValueError naming the bad argument; returns whether ``index`` is ``[..., k]``."""
    check_head_args(hidden, weight, bias)
    multi = check_index_and_options(index, hidden, "hidden", temperature, ignore_index)
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
    return multi


def linear_selective_log_softmax(hidden, weight, index, return_entropy=False, *, bias=None, temperature=1.0,
                                 ignore_index=None, chunk_bytes=None, process_group=None):
    """``selective_log_softmax(hidden @ weight.T + bias, index, ...)`` without the [N, V] logits.

    hidden: [..., H] bf16/fp16/fp32 (fp64 for gradcheck); weight: [V, H] of hidden's dtype (under
    ``process_group``, this rank's vocab shard, Megatron's split); bias: [V] or None; index: [...]
    or [..., k] int64/int32 global token ids. Returns fp32 ``logp`` of the index's shape (fp64 for
    fp64 hidden), or ``(logp, entropy)`` with entropy [...] when ``return_entropy``; ``temperature``
    divides the logits. An index equal to ``ignore_index`` gives logp 0 and no gradient; a row
    whose indices are all ignored gives entropy 0 and costs no matmul. Gradients flow to hidden,
    weight and bias from logp and entropy. ``chunk_bytes`` (default 256 MiB, or one row tile of a
    vocab block where that is more) bounds the block working memory of both passes. Under
    ``process_group`` (world size > 1) the outputs are the full-vocab ones on every rank and the hidden
    gradient is this rank's partial sum (all-reduce it, as Megatron's copy_to_tensor_model_parallel_region
    does). Details: module docstring,
    docs/linear.md. Labels outside [0, V) (other than ignore_index) raise RuntimeError.
    """
    multi = _check_args(hidden, weight, bias, index, temperature, ignore_index,
                        DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    h_size = hidden.shape[-1]
    n = math.prod(hidden.shape[:-1])
    cols = block_width(weight.shape[0], h_size)
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(cols, h_size, hidden.dtype)
    # Refuse, before any work, a chunk_bytes below one row tile of a vocab block (the backward's need,
    # the larger): it depends on V, H and the dtype only.
    tiles_in_flight(cols, h_size, hidden.dtype, chunk_bytes, backward=True)
    rows = hidden.reshape(n, h_size)  # a view unless the leading dims cannot be merged
    labels = index.reshape(n, index.shape[-1] if multi else 1)
    opts = LogprobOptions(ops.inv_temperature_tensor(temperature), ignore_value(ignore_index), bool(return_entropy),
                          int(chunk_bytes))
    shard = VocabShard.of(process_group, weight.shape[0], "weight")
    logp, entropy, _shift, _log_sum = call(linear_fwd, rows, weight, bias, labels, opts, shard)
    logp = logp.view(index.shape)
    if return_entropy:
        return logp, entropy.view(hidden.shape[:-1])
    return logp
