"""Log-probs and entropy from the LM head's input: ``hidden @ weight.T + bias`` is never built.

``linear_selective_log_softmax(hidden, weight, index)`` returns what
``selective_log_softmax(hidden @ weight.T + bias, index)`` returns, working
through one reused buffer of logits for a block of vocab columns at a time.
This module only orchestrates matmuls and the op (csrc/ops.cpp); the math is
the op's own, and the merge of per-block statistics is
``row_stats.combine_shard_stats``.

Rows: the rows whose labels are all ``ignore_index`` (prompt tokens in RL) are
dropped before any matmul; they give logp 0, entropy 0 and zero gradient. The
``m`` kept rows are gathered once per pass (``hidden[kept]``, an [m, H] copy;
none when every row is kept).

Forward, for each vocab block ``[v0, v1)`` of this rank's weight:
    buf = hidden_kept @ weight[v0:v1].T (+ bias[v0:v1])          # [m, v1 - v0]
    op forward with vocab_start = shard start + v0 -> the block's (shift, log_sum, logp, entropy)
then ``row_stats.combine_shard_stats`` merges the blocks in order (exact: the same merge
as across tensor-parallel ranks), and under tensor parallelism one all_gather
of O(N) statistics merges the ranks (``vocab_parallel.gather_combine_shard_stats``).

Backward, for each vocab block: recompute ``buf``, the op's in-place backward
with the GLOBAL (shift, log_sum, entropy) turns it into d logits, then
    grad_weight[v0:v1] = buf.T @ hidden_kept       one matmul over all kept rows: rounded once
    grad_hidden       += buf @ weight[v0:v1]       accumulated over blocks (see below)
    grad_bias[v0:v1]   = buf.sum(0)

Memory, beyond the inputs, the outputs and the gradients:
- the block buffer, sized so that every block-sized tensor fits in ``chunk_bytes``
  (default 256 MiB): in the forward the logits block; in the backward the block
  and, for bf16/fp16, its fp32 copy and the fp32 copy of the weight block (so
  that grad_hidden is accumulated in fp32, not rounded once per block);
- O(N) statistics, the only tensors saved for backward besides the inputs;
- O(N H), only where it cannot be avoided: the kept-row copy of hidden when rows
  are dropped, and the fp32 [m, H] accumulator of grad_hidden when hidden is
  bf16/fp16 or rows are dropped (for fp32/fp64 with every row kept the
  accumulator is grad_hidden itself).
Nothing [N, V], nothing weight-sized besides grad_weight.

Tensor parallelism (``process_group`` of world size tp > 1): ``weight`` (and
``bias``) are this rank's vocab shard, rank r holding ``[r * Vs, (r + 1) * Vs)``
as Megatron splits it; ``index`` holds global ids, the same on every rank. The
outputs are the full-vocab ones, identical on every rank. ``grad_weight`` and
``grad_bias`` are this rank's shard's. ``grad_hidden`` is this rank's PARTIAL sum
(its vocab shard's term of ``d_logits @ weight``), Megatron's
ColumnParallelLinear convention: the caller's ``copy_to_tensor_model_parallel_region``
(an identity whose backward all-reduces over the TP group) in front of the
head sums the ranks' terms. The upstream gradients of logp/entropy must be the
same on every rank (they are, for anything computed from these replicated
outputs). The backward has no collective.

torch.compile: the work is two custom ops (``twinkle_mem::linear_selective_log_softmax_fwd``
and ``_bwd``, opaque to the compiler, fake kernels for shapes, autograd by
``register_autograd``), so ``torch.compile(fullgraph=True)`` traces the call,
with or without a process group (the group travels as its name).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from ._contract import check_float_tensor, check_index_and_options, ignore_value
from .row_stats import combine_shard_stats, output_shift
from .vocab_parallel import gather_combine_shard_stats, rank_and_world

DEFAULT_CHUNK_BYTES = 256 << 20


# ------------------------------------------------------------------ planning
def _accumulates_in_fp32(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def block_bytes_per_column(rows: int, hidden_size: int, dtype: torch.dtype, backward: bool) -> int:
    """Bytes that one vocab column of a block costs: the logits column, and in the backward for
    bf16/fp16 the fp32 copies of the gradient column and of the weight row (fp32 accumulation)."""
    size = rows * dtype.itemsize
    if backward and _accumulates_in_fp32(dtype):
        size += 4 * (rows + hidden_size)
    return size


def block_columns(rows: int, hidden_size: int, vocab: int, dtype: torch.dtype, chunk_bytes: int,
                  backward: bool) -> int:
    """Width of the vocab blocks: as wide as ``chunk_bytes`` allows, a multiple of 64 when cut."""
    per_col = block_bytes_per_column(rows, hidden_size, dtype, backward)
    cols = chunk_bytes // max(per_col, 1)
    if cols < 1:
        raise ValueError(f"chunk_bytes = {chunk_bytes} is below one vocab column of the block ({per_col} bytes for "
                         f"{rows} rows, H = {hidden_size}, {dtype})")
    if cols >= vocab:
        return vocab
    return cols - cols % 64 if cols >= 128 else cols


def _kept_rows(labels: Tensor, ignore_index: int) -> Optional[Tensor]:
    """Indices of the rows with a label other than ignore_index, or None when every row is kept.

    A row with k = 0 labels (entropy only) is kept, as the op keeps it.
    """
    if labels.shape[1] == 0 or labels.shape[0] == 0:
        return None
    kept = (labels != ignore_index).any(dim=1).nonzero().squeeze(1)
    return None if kept.numel() == labels.shape[0] else kept


def _logits_block(buf: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int) -> Tensor:
    """hidden @ weight[v0:v1].T (+ bias[v0:v1]) written into the front of the flat buffer, as [m, v1 - v0]."""
    x = buf[: hidden.shape[0] * (v1 - v0)].view(hidden.shape[0], v1 - v0)
    if bias is None:
        torch.mm(hidden, weight[v0:v1].t(), out=x)
    else:
        torch.addmm(bias[v0:v1], hidden, weight[v0:v1].t(), out=x)
    return x


_addmm_out_dtype_works: dict = {}  # device type -> False once torch.addmm(out_dtype=) failed there


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with the products in acc's dtype: for bf16/fp16 a and b into an fp32 acc, no
    block's term is rounded to the input dtype before the sum over blocks."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if acc.device.type == "cuda" and _addmm_out_dtype_works.get(acc.device.type, True):
        try:  # cuBLAS: bf16/fp16 inputs, fp32 output, no fp32 copies (not exercised on CPU-only CI)
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except torch.OutOfMemoryError:
            raise  # the fallback below needs more memory, not less
        except (RuntimeError, TypeError):
            _addmm_out_dtype_works[acc.device.type] = False  # not in this build: ask once, not once per block
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))  # fp32 copies of the block: counted in chunk_bytes


def _select(t: Optional[Tensor], kept: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or kept is None:
        return t
    return t.index_select(0, kept)


def _resolve_group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


# ------------------------------------------------------------------ forward op
def _shard_stats(hidden, weight, bias, labels, inv_temperature, ignore_index, with_entropy, vocab_start,
                 vocab_size, chunk_bytes):
    """This weight's (shard's) statistics for the kept rows, in float64: (logp [m, k] against the
    shard's own normalizer, 0 for labels elsewhere; entropy [m] of the shard's softmax or None;
    shift [m]; log_sum [m]).

    The blocks' fp32 statistics are merged in float64, so that the merge adds no rounding of its own:
    the results carry the blocks' roundings only, as the op's single pass carries its own.
    """
    m, h = hidden.shape
    shard = weight.shape[0]
    cols = block_columns(m, h, shard, hidden.dtype, chunk_bytes, backward=False)
    buf = hidden.new_empty(m * cols)
    per_block = []
    for v0 in range(0, shard, cols):
        v1 = min(v0 + cols, shard)
        x = _logits_block(buf, hidden, weight, bias, v0, v1)
        per_block.append(ops.fwd(x, labels, inv_temperature, ignore_index, vocab_start + v0, vocab_size,
                                 with_entropy, False))
    del buf
    logp_b, entropy_b, shift_b, log_sum_b = (torch.stack(t).double() for t in zip(*per_block))
    entropy_b = entropy_b if with_entropy else None
    if len(per_block) == 1:  # the op's own statistics: nothing to merge
        return logp_b[0], (None if entropy_b is None else entropy_b[0]), shift_b[0], log_sum_b[0]
    y = labels.long()
    local = y - vocab_start
    on_shard = (local >= 0) & (local < shard) & (y != ignore_index)
    owner = torch.where(on_shard, local.div(cols, rounding_mode="floor"), 0)
    logp, entropy, shift, log_sum = combine_shard_stats(shift_b, log_sum_b, logp_b, entropy_b, owner,
                                                        y == ignore_index, inv_temperature)
    # Labels on another rank's shard: 0 here, as the op gives (the ranks' merge takes the owner's).
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
    acc = ops.stats_dtype(hidden)
    logp = hidden.new_zeros((n, k), dtype=acc)
    entropy = hidden.new_zeros((n if with_entropy else 0,), dtype=acc)
    shift = hidden.new_zeros((n,), dtype=acc)
    log_sum = hidden.new_zeros((n,), dtype=acc)
    kept = _kept_rows(labels, ignore_index)
    h, y = _select(hidden, kept), _select(labels, kept)
    if h.shape[0] == 0:  # (the same on every rank: the labels are)
        return logp, entropy, shift, log_sum
    stats = _shard_stats(h, weight, bias, y, inv_temperature, ignore_index, with_entropy, vocab_start, vocab_size,
                         chunk_bytes)
    if group_name:  # the ranks' merge, in float64 too (O(N) bytes on the wire)
        group = _resolve_group(group_name)
        stats = gather_combine_shard_stats(*stats, y.long(), weight.shape[0], inv_temperature, ignore_index, group,
                                           dist.get_world_size(group))
    logp_k, entropy_k, shift_k, log_sum_k = stats
    shift_k, log_sum_k = output_shift(shift_k, log_sum_k, inv_temperature, acc)
    outs = (logp, entropy, shift, log_sum) if with_entropy else (logp, None, shift, log_sum)
    for out, val in zip(outs, (logp_k, entropy_k, shift_k, log_sum_k)):
        if out is None:
            continue
        if kept is None:
            out.copy_(val.view(out.shape))
        else:
            out.index_copy_(0, kept, val.view((-1, *out.shape[1:])).to(out.dtype))
    return logp, entropy, shift, log_sum


@linear_fwd.register_fake
def _linear_fwd_fake(hidden, weight, bias, labels, inv_temperature, ignore_index, with_entropy, chunk_bytes,
                     vocab_start, vocab_size, group_name):
    n, k = labels.shape
    acc = ops.stats_dtype(hidden)
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
    grad_weight = (weight.new_zeros(weight.shape) if m == 0 else weight.new_empty(weight.shape)) if need_weight \
        else none()
    grad_bias = (bias.new_zeros(bias.shape) if m == 0 else bias.new_empty(bias.shape)) if need_bias else none()
    acc_dtype = torch.float32 if _accumulates_in_fp32(hidden.dtype) else hidden.dtype
    if not need_hidden:
        grad_hidden = acc = none()
    elif kept is None and acc_dtype == hidden.dtype:
        grad_hidden = acc = hidden.new_zeros((n, h_size))  # accumulate into the gradient itself
    else:  # grad_hidden is made from acc after the blocks, so that it is not alive beside them
        grad_hidden = None
        acc = hidden.new_zeros((m, h_size), dtype=acc_dtype)
    if m == 0:
        return (hidden.new_zeros((n, h_size)) if grad_hidden is None else grad_hidden), grad_weight, grad_bias

    y = _select(labels, kept)
    g_logp = _select(grad_logp, kept).contiguous()
    use_entropy = grad_entropy is not None and entropy is not None
    g_entropy = _select(grad_entropy, kept).contiguous() if use_entropy else None
    ent = _select(entropy, kept) if use_entropy else None
    shift_k, log_sum_k = _select(shift, kept), _select(log_sum, kept)

    cols = block_columns(m, h_size, shard, hidden.dtype, chunk_bytes, backward=True)
    buf = hidden.new_empty(m * cols)
    for v0 in range(0, shard, cols):
        v1 = min(v0 + cols, shard)
        d = _logits_block(buf, h, weight, bias, v0, v1)
        ops.bwd_inplace(g_logp, g_entropy, d, y, shift_k, log_sum_k, ent, inv_temperature, ignore_index,
                        vocab_start + v0)
        if need_weight:
            torch.mm(d.t(), h, out=grad_weight[v0:v1])
        if need_bias:
            torch.sum(d, dim=0, out=grad_bias[v0:v1])
        if need_hidden:
            _add_matmul(acc, d, weight[v0:v1])
    del buf
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


# ------------------------------------------------------------------ public function
def _check_args(hidden, weight, bias, index, temperature, ignore_index, chunk_bytes) -> bool:
    """Raises ValueError naming the bad argument; returns whether ``index`` is ``[..., k]``."""
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
        if not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {getattr(bias, 'shape', type(bias))}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"bias must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                             f"{bias.dtype}, {bias.device}")
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
    weight and bias from logp and entropy. ``chunk_bytes`` (default 256 MiB) bounds the block
    working memory of both passes. Under ``process_group`` (world size > 1) the outputs are the
    full-vocab ones on every rank and the hidden gradient is this rank's partial sum (all-reduce it,
    as Megatron's copy_to_tensor_model_parallel_region does). Details: module docstring,
    docs/linear.md. Labels outside [0, V) (other than ignore_index) raise RuntimeError.
    """
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    multi = _check_args(hidden, weight, bias, index, temperature, ignore_index, chunk_bytes)
    h_size = hidden.shape[-1]
    n = math.prod(hidden.shape[:-1])
    # Every block holds all kept rows. Refuse, before any work, a chunk_bytes below one block column of
    # all N rows: the kept rows are known only inside the op (finding them here would sync the device).
    block_columns(n, h_size, weight.shape[0], hidden.dtype, chunk_bytes, backward=True)
    rows = hidden.reshape(n, h_size)  # a view unless the leading dims cannot be merged
    labels = index.reshape(n, index.shape[-1] if multi else 1)
    ignore = ignore_value(ignore_index)
    shard = weight.shape[0]
    rank, world, group_name = 0, 1, ""
    if process_group is not None and dist.get_world_size(process_group) > 1:
        rank, world = rank_and_world(process_group, shard, "weight")
        group_name = process_group.group_name
    inv_temperature = ops.inv_temperature_tensor(temperature)
    logp, entropy, _shift, _log_sum = linear_fwd(rows, weight, bias, labels, inv_temperature, ignore,
                                                 bool(return_entropy), int(chunk_bytes), rank * shard, world * shard,
                                                 group_name)
    logp = logp.view(index.shape)
    if return_entropy:
        return logp, entropy.view(hidden.shape[:-1])
    return logp
