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

Batch invariance (docs/linear.md): every matmul and merge is cut from the device's plan (plans.PLANS: its row
tiles) and plans.block_width (V and H) alone; ``chunk_bytes`` only decides how many tiles share one op call
(plans.tiles_in_flight), or narrows the blocks where one step of the widest does not fit (plans.fit_width). Memory (beyond inputs, outputs and gradients: the block buffer within
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
from .engine import Needs, Rows, backward_sweep, check_head_args, fake_grads, forward_sweep, frozen_head
from .frozen import FrozenGrads, frozen_grad, recompute_is_cheaper, vectors_at_most
from .plans import BlockPlan, plan_blocks

def vectors_summed(frozen: bool, with_entropy: bool, entropy_grad: Optional[bool]) -> int:
    """How many gradient vectors a frozen head's forward sums: S, and E where the caller said the entropy will
    receive a gradient (entropy_grad True); otherwise a gradient reaching the entropy is recomputed in the
    backward."""
    return (1 + bool(with_entropy and entropy_grad)) if frozen else 0


class LogprobOptions(NamedTuple):
    """The fused log-prob head's scalars, one value (its ops' schemas name them alike; the vocab shard is a
    vocab_parallel.VocabShard). inv_temperature: 1/T, a 0-dim CPU tensor across the op boundary
    (ops.inv_temperature_tensor: no recompile when T changes under torch.compile), a float inside the ops.
    chunk_bytes: 0 for the device plan's default."""
    inv_temperature: object
    ignore_index: int
    with_entropy: bool
    chunk_bytes: int
    frozen: bool  # the head needs no gradient: the forward sums grad_hidden's vectors (heads/frozen.py)
    entropy_grad: bool  # the entropy's vector summed in the forward too (the caller said it will be trained)


def _plan(hidden: Tensor, shard: int, chunk_bytes: int, backward: bool, vectors: int = 0) -> BlockPlan:
    """The call's blocks (plans.plan_blocks: the same in its forward and backward, with autograd on or off), as
    many row tiles per step as this pass's budget holds, logits in the input dtype (the op reads them as the
    model's layer would give them)."""
    return plan_blocks(hidden, shard, chunk_bytes or None, backward, vectors,
                       most=vectors_at_most(hidden.dtype, hidden.device))


# ------------------------------------------------------------------ forward op
def _shard_stats(rows: Rows, weight: Tensor, bias: Optional[Tensor], labels: Tensor, opts: LogprobOptions,
                 shard: VocabShard, vectors: int):
    """This weight's (shard's) statistics for the padded kept rows, in float64: (logp [M, k] against
    the shard's own normalizer, 0 for labels elsewhere; entropy [M] of the shard's softmax or None;
    shift [M]; log_sum [M]), M = rows.tiles.padded. labels: [M, k] int64, ignore_index on the padding.
    With ``vectors`` (a frozen head), also the rows' FrozenGrads, summed block by block.

    Each step keeps the op's fp32 statistics of its block; after the sweep the blocks are combined in block order,
    in float64, as tensor-parallel shards are (row_stats.combine_shard_stats: on the CPU one row tile per call, so
    that a row's result depends on nothing but its row): a few ops per step, whatever N. A frozen head also folds
    each block's normalizer into a running one as it goes (FrozenGrads.block): its vectors are rescaled block by
    block.
    """
    width = weight.shape[0]
    local = labels - shard.vocab_start
    ignored = labels == opts.ignore_index
    plan = _plan(rows.tiles.rows, width, opts.chunk_bytes, backward=False, vectors=vectors)
    blocks = -(-width // plan.width)
    kept = []  # each step's (logp, entropy, shift, log_sum), block by block, each block's steps in row order
    grads = None
    if vectors:
        grads = FrozenGrads(rows, weight, labels, opts.ignore_index, shard.vocab_start, shard.vocab_size,
                            opts.inv_temperature, vectors == 2, plan)

    def step(v0, v1, rs, x):  # the op on a block's logits, its statistics kept
        raw = ops.fwd(x, labels[rs], opts.inv_temperature, opts.ignore_index, shard.vocab_start + v0,
                      shard.vocab_size, opts.with_entropy, False)
        kept.append(raw)
        if grads is not None:  # the block's vectors, from the logits still at hand (x is overwritten)
            grads.block(v0, v1, rs, x, raw[2], raw[3], raw[1] if vectors == 2 else None)

    forward_sweep(rows.tiles, weight, bias, plan, step)
    m = rows.tiles.padded
    logp_b, entropy_b, shift_b, log_sum_b = (
        torch.cat(parts).double().view(blocks, m, *parts[0].shape[1:]) if i != 1 or opts.with_entropy else None
        for i, parts in enumerate(zip(*kept)))
    kept.clear()  # (the steps' own tensors: freed before the merge)
    if grads is not None:
        grads.label_share(shift_b, log_sum_b)
    owner = torch.where(ignored, 0, local.div(plan.width, rounding_mode="floor")).clamp(0, blocks - 1)
    logp, entropy, shift, log_sum = combine_shard_stats_in_tiles(
        rows.tiles.fold_rows, shift_b, log_sum_b, logp_b, entropy_b, owner, ignored, opts.inv_temperature)
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
        shard_stats, stats = stats, combine_shard_stats_in_tiles(rows.tiles.fold_rows, *gathered,
                                                                 opts.inv_temperature)
        if grads is not None:  # this rank's share of the whole vocab's vectors
            vecs = grads.vectors(rows, *((t[2], t[3], t[1]) for t in (shard_stats, stats)))
    elif grads is not None:
        final = (stats[2], stats[3], stats[1])
        vecs = grads.vectors(rows, final, final)
    outs = (logp, entropy, shift, log_sum) if with_entropy else (logp, None, shift, log_sum)
    tile = rows.tiles.fold_rows
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


def _known_zeros(t: Tensor) -> bool:
    """Whether ``t`` holds zeros only, where its values can be read (not while a graph is traced: it cannot branch
    on them)."""
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode(t) is not None:
        return False
    return not bool(t.any())


def _setup_context(ctx, inputs, output):
    args = named_inputs(linear_fwd, inputs)
    ctx.options, ctx.shard = pick(LogprobOptions, linear_fwd, inputs), pick(VocabShard, linear_fwd, inputs)
    _logp, entropy, shift, log_sum, vec_logp, vec_entropy = output
    ctx.set_materialize_grads(False)  # an output no loss used gets None: it costs nothing
    opts = ctx.options
    # A frozen head saves its vectors; where the entropy's was not summed (a metric, as far as the caller said),
    # also the statistics a recompute of the entropy's gradient needs, should one reach it after all: O(N).
    recompute = opts.frozen and opts.with_entropy and vec_entropy.numel() == 0
    keep_stats = not opts.frozen or recompute
    ctx.save_for_backward(args["hidden"], args["weight"], args["bias"], args["labels"],
                          shift if keep_stats else None, log_sum if keep_stats else None,
                          entropy if keep_stats and opts.with_entropy else None,
                          vec_logp if opts.frozen else None, vec_entropy if opts.frozen else None)
    ctx.mark_non_differentiable(shift, log_sum, vec_logp, vec_entropy)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum, _grad_vec_logp, _grad_vec_entropy):
    opts = ctx.options
    grad_entropy = grad_entropy if opts.with_entropy else None
    hidden, weight, bias, labels, shift, log_sum, entropy, vec_logp, vec_entropy = ctx.saved_tensors
    needs = Needs.of(ctx, linear_fwd, bias)
    if opts.frozen and not needs.hidden:
        return {"hidden": None}
    if opts.frozen and grad_entropy is not None and not vec_entropy.numel() and _known_zeros(grad_entropy):
        grad_entropy = None  # zeros (the entropy times 0 in a loss) add exactly nothing: no recompute for them
    if opts.frozen and (grad_entropy is None or vec_entropy.numel()):  # g S (+ g_H E) from the forward's vectors
        return {"hidden": call(frozen_grad, grad_logp, grad_entropy, vec_logp, vec_entropy, hidden, weight, labels,
                               opts, ctx.shard)}
    if opts.frozen:
        # The entropy was not declared trained, yet a gradient reached it: the backward of a trainable head,
        # grad_hidden alone, recomputes the logits (S unused: the whole gradient from one product per block, rounded
        # once, as a peaked row's cancellations between the two outputs' terms need). Under torch.compile every
        # output gets a gradient, zeros where unused, which a compiled graph cannot tell from others without a
        # branch on the values: there a frozen head's undeclared entropy always takes it.
        needs = Needs(True, False, False)
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
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool)
                                    or chunk_bytes < 1):
        raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
    return multi


def linear_selective_log_softmax(hidden, weight, index, return_entropy=False, *, bias=None, temperature=1.0,
                                 ignore_index=None, chunk_bytes=None, process_group=None, entropy_grad=None):
    """``selective_log_softmax(hidden @ weight.T + bias, index, ...)`` without the [N, V] logits.

    hidden: [..., H] bf16/fp16/fp32 (fp64 for gradcheck); weight: [V, H] of hidden's dtype (under
    ``process_group``, this rank's vocab shard, Megatron's split); bias: [V] or None; index: [...]
    or [..., k] int64/int32 global token ids. Returns fp32 ``logp`` of the index's shape (fp64 for
    fp64 hidden), or ``(logp, entropy)`` with entropy [...] when ``return_entropy``; ``temperature``
    divides the logits. An index equal to ``ignore_index`` gives logp 0 and no gradient; a row
    whose indices are all ignored gives entropy 0 and costs no matmul. Gradients flow to hidden,
    weight and bias from logp and entropy. ``chunk_bytes`` (default: the device's plan, 256 MiB on the
    CPU and 1 GiB on a GPU, or one step of a vocab block where that is more) bounds the block working memory of
    both passes. Under ``process_group`` (world size > 1) the outputs are the full-vocab ones on every rank and the
    hidden gradient is this rank's partial sum (all-reduce it, as Megatron's copy_to_tensor_model_parallel_region
    does). Labels outside [0, V) (other than ignore_index) raise RuntimeError.

    A frozen head (``weight`` and ``bias`` need no gradient while ``hidden`` does: LoRA) is differentiated in the
    forward: it sums each row's d logp / d hidden as it goes, saves those [N, H] vectors and recomputes no logits in
    the backward (heads/frozen.py). The entropy's vector is summed too only where ``entropy_grad=True`` says the
    entropy will be trained (an entropy bonus in the loss; except bf16 on a CPU that multiplies bf16 natively,
    where the recompute is cheaper: frozen.recompute_is_cheaper). By default (None, or False: a metric) it is not:
    the entropy costs nothing beyond its value, and a gradient that reaches it all the same is honoured by
    recomputing what it needs in the backward. Details: module docstring, docs/linear.md.
    """
    multi = _check_args(hidden, weight, bias, index, temperature, ignore_index, chunk_bytes)
    h_size = hidden.shape[-1]
    n = math.prod(hidden.shape[:-1])
    trained_entropy = bool(return_entropy) and entropy_grad is True
    frozen = frozen_head(hidden, weight, bias) and not recompute_is_cheaper(hidden.dtype, hidden.device,
                                                                             trained_entropy)
    # Refuse, before any work, a chunk_bytes below one step of the narrowest vocab block: V, H, dtype, device.
    plan_blocks(hidden, weight.shape[0], chunk_bytes, backward=True, most=vectors_at_most(hidden.dtype, hidden.device))
    rows = hidden.reshape(n, h_size)  # a view unless the leading dims cannot be merged
    labels = index.reshape(n, index.shape[-1] if multi else 1)
    opts = LogprobOptions(ops.inv_temperature_tensor(temperature), ignore_value(ignore_index), bool(return_entropy),
                          0 if chunk_bytes is None else int(chunk_bytes), frozen, trained_entropy)
    shard = VocabShard.of(process_group, weight.shape[0], "weight")
    logp, entropy, *_ = call(linear_fwd, rows, weight, bias, labels, opts, shard)
    logp = logp.view(index.shape)
    if return_entropy:
        return logp, entropy.view(hidden.shape[:-1])
    return logp
