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
from .engine import (VOCAB_BLOCK, BlockPlan, Needs, Rows, backward_sweep, check_head_args, fake_grads, fit_width,
                     forward_sweep, frozen_head, tile_budget, tiles_in_flight)
from .frozen import FrozenGrads, frozen_grad, recompute_is_cheaper

DEFAULT_CHUNK_BYTES = 256 << 20


def default_chunk_bytes(shard: int, hidden_size: int, dtype: torch.dtype, vectors: int = 0) -> int:
    """The chunk_bytes of a call that gives none: DEFAULT_CHUNK_BYTES, or one row tile of an unwidened vocab block
    where that needs more (the bf16/fp16 backward's fp32 copies: H above about 3,600 at 8192 columns)."""
    return max(DEFAULT_CHUNK_BYTES, tile_budget(min(VOCAB_BLOCK, shard), hidden_size, dtype, vectors))


def vectors_summed(frozen: bool, with_entropy: bool, entropy_grad: bool) -> int:
    """How many gradient vectors a frozen head's forward sums: S, and E where the entropy may receive a gradient."""
    return (1 + (with_entropy and entropy_grad)) if frozen else 0


class LogprobOptions(NamedTuple):
    """The fused log-prob head's scalars, one value (its ops' schemas name them alike; the vocab shard is a
    vocab_parallel.VocabShard). inv_temperature: 1/T, a 0-dim CPU tensor across the op boundary
    (ops.inv_temperature_tensor: no recompile when T changes under torch.compile), a float inside the ops."""
    inv_temperature: object
    ignore_index: int
    with_entropy: bool
    chunk_bytes: int
    frozen: bool  # the head needs no gradient: the forward sums grad_hidden's vectors (heads/frozen.py)
    entropy_grad: bool  # the entropy may receive a gradient (False: a metric; a gradient reaching it raises)


def _plan(hidden: Tensor, shard: int, chunk_bytes: int, backward: bool, vectors: int = 0) -> BlockPlan:
    """Vocab blocks of engine.fit_width columns (the same for a call's forward and backward), as many row tiles per
    op call as chunk_bytes holds, logits in the input dtype (the op reads them as the model's layer would give
    them)."""
    h_size, dtype = hidden.shape[1], hidden.dtype
    cols = fit_width(shard, h_size, dtype, chunk_bytes, vectors)
    return BlockPlan(cols, tiles_in_flight(cols, h_size, dtype, chunk_bytes, backward, vectors), dtype)


# ------------------------------------------------------------------ forward op
def _shard_stats(rows: Rows, weight: Tensor, bias: Optional[Tensor], labels: Tensor, opts: LogprobOptions,
                 shard: VocabShard, vectors: int):
    """This weight's (shard's) statistics for the padded kept rows, in float64: (logp [M, k] against
    the shard's own normalizer, 0 for labels elsewhere; entropy [M] of the shard's softmax or None;
    shift [M]; log_sum [M]), M = rows.tiles.padded. labels: [M, k] int64, ignore_index on the padding.
    With ``vectors`` (a frozen head), also the rows' FrozenGrads, folded block by block alike.

    Each block's fp32 statistics are folded into a float64 state in block order, one row tile at a
    time (row_stats.combine_shard_stats_in_tiles), so the fold adds no rounding of its own and a
    row's result depends on nothing but its row.
    """
    width = weight.shape[0]
    local = labels - shard.vocab_start
    ignored = labels == opts.ignore_index
    state = [None] * 4  # logp, entropy, shift, log_sum of the rows: float64
    plan = _plan(rows.tiles.rows, width, opts.chunk_bytes, backward=False, vectors=vectors)
    grads = None
    if vectors:
        grads = FrozenGrads(rows, weight, labels, opts.ignore_index, shard.vocab_start, shard.vocab_size,
                            opts.inv_temperature, vectors == 2, plan)

    def running(rs):  # the rows' (shift, log_sum, entropy) in float64 (copies: the fold writes over the state)
        return tuple(None if state[i] is None else state[i][rs].clone() for i in (2, 3, 1))

    def step(v0, v1, rs, x):  # the op on a block's logits, folded into the rows' state
        raw = ops.fwd(x, labels[rs], opts.inv_temperature, opts.ignore_index, shard.vocab_start + v0,
                      shard.vocab_size, opts.with_entropy, False)
        block = [t.double() for t in raw]
        block[1] = block[1] if opts.with_entropy else None
        before = None if v0 == 0 or grads is None else running(rs)
        if v0 == 0:  # the first block: the op's own statistics
            for i, t in enumerate(block):
                if t is not None:
                    state[i] = t.new_empty((rows.tiles.padded, *t.shape[1:])) if state[i] is None else state[i]
                    state[i][rs] = t
        else:
            logp_b, entropy_b, shift_b, log_sum_b = block
            in_block = (local[rs] >= v0) & (local[rs] < v1) & ~ignored[rs]  # owner 1: the label's logit is here
            merged = combine_shard_stats_in_tiles(
                rows.tiles.tile, torch.stack([state[2][rs], shift_b]), torch.stack([state[3][rs], log_sum_b]),
                torch.stack([state[0][rs], logp_b]),
                None if entropy_b is None else torch.stack([state[1][rs], entropy_b]), in_block.long(), ignored[rs],
                opts.inv_temperature)
            for i, t in enumerate(merged):
                if t is not None:
                    state[i][rs] = t
        if grads is not None:  # the block's vectors, from the logits still at hand (x is overwritten)
            grads.block(v0, v1, rs, x, (raw[2], raw[3], raw[1] if vectors == 2 else None), before, running(rs))

    forward_sweep(rows.tiles, weight, bias, plan, step)
    logp, entropy, shift, log_sum = state
    # Labels on another rank's shard: 0 here, as the op gives (the ranks' merge takes the owner's).
    on_shard = (local >= 0) & (local < width) & ~ignored
    return (torch.where(on_shard, logp, 0), entropy, shift, log_sum), grads


@torch.library.custom_op("twinkle_mem::linear_selective_log_softmax_fwd", mutates_args=())
def linear_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, inv_temperature: Tensor,
               ignore_index: int, with_entropy: bool, chunk_bytes: int, vocab_start: int, vocab_size: int,
               group_name: str, frozen: bool, entropy_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                          Tensor]:
    """hidden [N, H], weight [Vs, H] (the vocab [vocab_start, vocab_start + Vs) of vocab_size),
    bias [Vs] or None, labels [N, k] global ids. Returns fp32 (fp64 for fp64 hidden) full-vocab
    logp [N, k], entropy [N] (or [0]), shift [N], log_sum [N], and for a ``frozen`` head the gradient vectors
    d logp / d hidden [N, H] and (with_entropy and entropy_grad) d entropy / d hidden [N, H] (this shard's share;
    heads/frozen.py), else empty [0]; the rows whose labels are all ignore_index give 0 everywhere. group_name:
    the TP group ('' for none)."""
    opts = LogprobOptions(inv_temperature.item(), ignore_index, with_entropy, chunk_bytes, frozen, entropy_grad)
    shard = VocabShard(vocab_start, vocab_size, group_name)
    vectors = vectors_summed(frozen, with_entropy, entropy_grad)
    n, k = labels.shape
    # Checked here, on the caller's labels: the op's own check would see a row tile's and name its entry.
    check_op_label_range(labels, labels == ignore_index, vocab_size, ignore_index)
    acc = stats_dtype(hidden)
    logp = hidden.new_zeros((n, k), dtype=acc)
    entropy = hidden.new_zeros((n if with_entropy else 0,), dtype=acc)
    shift = hidden.new_zeros((n,), dtype=acc)
    log_sum = hidden.new_zeros((n,), dtype=acc)
    rows = Rows(hidden, labels, ignore_index)
    vecs = tuple(hidden.new_zeros((n, hidden.shape[1]) if i < vectors else (0,), dtype=acc) for i in range(2))
    if rows.m == 0:  # (the same on every rank: the labels are)
        return logp, entropy, shift, log_sum, *vecs
    y = rows.take(labels.long(), ignore_index)
    stats, grads = _shard_stats(rows, weight, bias, y, opts, shard, vectors)
    if group_name:  # the ranks' merge, in float64 too (O(N) bytes on the wire), by row tiles as above
        group = shard.group()
        gathered = gather_shard_stats(*stats, y, weight.shape[0], opts.inv_temperature, ignore_index, group,
                                      dist.get_world_size(group))
        shard_stats, stats = stats, combine_shard_stats_in_tiles(rows.tiles.tile, *gathered, opts.inv_temperature)
        if grads is not None:  # this rank's share of the whole vocab's vectors
            vecs = grads.vectors(rows, *((t[2], t[3], t[1]) for t in (shard_stats, stats)))
    elif grads is not None:
        final = (stats[2], stats[3], stats[1])
        vecs = grads.vectors(rows, final, final)
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
    return logp, entropy, shift, log_sum, *vecs


@linear_fwd.register_fake
def _linear_fwd_fake(hidden, weight, bias, labels, inv_temperature, ignore_index, with_entropy, chunk_bytes,
                     vocab_start, vocab_size, group_name, frozen, entropy_grad):
    n, k = labels.shape
    acc = stats_dtype(hidden)
    vectors = vectors_summed(frozen, with_entropy, entropy_grad)
    return (hidden.new_empty((n, k), dtype=acc), hidden.new_empty((n if with_entropy else 0,), dtype=acc),
            hidden.new_empty((n,), dtype=acc), hidden.new_empty((n,), dtype=acc),
            *(hidden.new_empty((n, hidden.shape[1]) if i < vectors else (0,), dtype=acc) for i in range(2)))


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


METRIC_GRADIENT = ("linear_selective_log_softmax: the entropy was declared a metric (entropy_grad=False), yet a "
                   "gradient reached it; pass entropy_grad=True to differentiate it, or detach() it where it enters "
                   "the loss")


def _setup_context(ctx, inputs, output):
    args = named_inputs(linear_fwd, inputs)
    ctx.options, ctx.shard = pick(LogprobOptions, linear_fwd, inputs), pick(VocabShard, linear_fwd, inputs)
    _logp, entropy, shift, log_sum, vec_logp, vec_entropy = output
    ctx.set_materialize_grads(False)  # an output no loss used gets None: the entropy's rule below
    if ctx.options.frozen:  # the gradient vectors instead of the inputs: the backward recomputes nothing
        ctx.save_for_backward(args["hidden"], args["weight"], None, args["labels"], vec_logp, vec_entropy, None)
    else:
        ctx.save_for_backward(args["hidden"], args["weight"], args["bias"], args["labels"], shift, log_sum,
                              entropy if ctx.options.with_entropy else None)
    ctx.mark_non_differentiable(shift, log_sum, vec_logp, vec_entropy)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum, _grad_vec_logp, _grad_vec_entropy):
    opts = ctx.options
    grad_entropy = grad_entropy if opts.with_entropy else None
    if grad_entropy is not None and not opts.entropy_grad:  # a metric: a nonzero gradient raises, zeros are nothing
        if torch.compiler.is_compiling():  # (traced: every output has a gradient; the values decide at run time)
            torch._assert_async(grad_entropy.eq(0).all(), METRIC_GRADIENT)
        elif grad_entropy.any():
            raise RuntimeError(METRIC_GRADIENT)
        grad_entropy = None
    hidden, weight, bias, labels, *saved = ctx.saved_tensors
    needs = Needs.of(ctx, linear_fwd, bias)
    if opts.frozen:
        vec_logp, vec_entropy, _ = saved
        return {"hidden": call(frozen_grad, grad_logp, grad_entropy, vec_logp, vec_entropy, hidden, weight, labels,
                               opts, ctx.shard) if needs.hidden else None}
    shift, log_sum, entropy = saved
    if grad_logp is None:
        grad_logp = shift.new_zeros(labels.shape)
    return needs.grads(*call(linear_bwd, grad_logp, grad_entropy, hidden, weight, bias, labels, shift, log_sum,
                             entropy, opts, ctx.shard, needs.args()))


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
                                 ignore_index=None, chunk_bytes=None, process_group=None, entropy_grad=True):
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
    does). Labels outside [0, V) (other than ignore_index) raise RuntimeError.

    A frozen head (``weight`` and ``bias`` need no gradient while ``hidden`` does: LoRA) is differentiated in the
    forward: it sums each row's d logp / d hidden (and d entropy / d hidden) as it goes, saves those [N, H]
    vectors and recomputes no logits in the backward (heads/frozen.py; except bf16 with the entropy's gradient on
    a CPU that multiplies bf16 natively, where the recompute is cheaper: frozen.recompute_is_cheaper).
    ``entropy_grad=False`` declares the entropy a metric: its vector is not summed, and a gradient reaching it
    raises RuntimeError (never a silently wrong gradient). Details: module docstring, docs/linear.md.
    """
    multi = _check_args(hidden, weight, bias, index, temperature, ignore_index,
                        DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    h_size = hidden.shape[-1]
    n = math.prod(hidden.shape[:-1])
    frozen = frozen_head(hidden, weight, bias) and not recompute_is_cheaper(
        hidden.dtype, hidden.device, bool(return_entropy and entropy_grad))
    vectors = vectors_summed(frozen, bool(return_entropy), bool(entropy_grad))
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(weight.shape[0], h_size, hidden.dtype, vectors)
    # Refuse, before any work, a chunk_bytes below one row tile of an unwidened vocab block (the larger pass's
    # need): it depends on V, H and the dtype only.
    fit_width(weight.shape[0], h_size, hidden.dtype, chunk_bytes, vectors)
    rows = hidden.reshape(n, h_size)  # a view unless the leading dims cannot be merged
    labels = index.reshape(n, index.shape[-1] if multi else 1)
    opts = LogprobOptions(ops.inv_temperature_tensor(temperature), ignore_value(ignore_index), bool(return_entropy),
                          int(chunk_bytes), frozen, bool(entropy_grad))
    shard = VocabShard.of(process_group, weight.shape[0], "weight")
    logp, entropy, *_ = call(linear_fwd, rows, weight, bias, labels, opts, shard)
    logp = logp.view(index.shape)
    if return_entropy:
        return logp, entropy.view(hidden.shape[:-1])
    return logp
