"""Selective log-softmax and entropy over a vocab split across tensor-parallel ranks.

Layout (Megatron's): the ``tp`` ranks of ``process_group`` hold equal shards,
rank r the vocab ``[r * Vs, (r + 1) * Vs)`` of a vocab of ``tp * Vs``; labels are
global ids, identical on every rank.

Forward: the native kernel runs on the local shard (``vocab_start = r * Vs``)
and gives per-row, per-shard statistics (schemas.def): ``shift_r`` (a reference
logit; the kernels return the shard's log-normalizer), ``log_sum_r``, ``H_r`` (the entropy of the shard's own softmax) and
``logp_r`` (against the shard's own normalizer, on the rank that holds the
label, else 0). One ``all_gather`` of these (fp32, 3 + k values per row with
entropy, plus a 3-value header) gives every rank all of them; each rank then
combines them in rank order 0..tp-1 (``combine_shard_stats``), so the result is
bit-identical on every rank:

    M       = max_r shift_r                       (over shards with any finite logit)
    a_r     = (shift_r - M) / T + log_sum_r       (the shard's log-sum against M)
    log_sum = log sum_r exp(a_r)                  w_r = exp(a_r - log_sum)
    logp    = logp_o + (a_o - log_sum)            o = the shard that holds the label
    H       = sum_r w_r (H_r + log_sum - a_r)     (every term >= 0)

Backward: no collective. Under Megatron's convention everything computed from
the (replicated) log-probs and entropy is replicated across the TP ranks, so
the upstream gradients are the same on every rank and the gradient of a shard
is the shard's slice of the full-vocab gradient: the native backward with
``vocab_start`` and the GLOBAL (M, log_sum, H) computes exactly that. (The
gradient then flows into the column-parallel output layer, whose backward
all-reduces the gradient of its input, as it does for any vocab-parallel loss.)

Saved for backward: the shard (a reference), the labels and O(N) fp32
statistics. Nothing vocab-sized is allocated besides the gradient.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .contract import OpOptions
from .row_stats import combine_shard_stats, label_matrix

# The all_gather without the FutureWarning of newer torch; the same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Header gathered with the statistics so that a configuration that differs across
# ranks raises instead of silently combining unrelated shards:
# [shard vocab size, inverse temperature, ignore_index (low 32 bits)].
# (N, k and return_entropy set the message size: they must agree for the
# collective itself, which reports a mismatch its own way: gloo aborts, NCCL waits.)
_HEADER = 3
# (group, header) pairs whose agreement across ranks is already established: the
# check needs the gathered header on the host, a sync on accelerators, so it runs
# once per configuration (every call on the CPU, where it costs nothing).
_checked: set = set()


def vocab_parallel_selective_log_softmax(logits_shard, labels, return_entropy, inv_temperature, ignore_index,
                                         inplace_backward, process_group):
    """Full-vocab log-probs (and entropy) from this rank's vocab shard; fp32 outputs, replicated.

    ``logits_shard``: the op's rows ([N, Vs] or [B, S, Vs], rows.py), this rank's
    slice ``[rank * Vs, (rank + 1) * Vs)``; ``labels``: global ids in the op's
    label layout (same on every rank). Returns ``(logp, entropy or None)`` in the
    op's output shapes, identical on every rank of ``process_group``. One
    all_gather of O(N k) statistics in the forward, none in the backward (the
    upstream gradients must be replicated across the group, as they are for
    anything computed from these outputs under Megatron TP).

    Called by ``twinkle_mem.selective_log_softmax(..., process_group=...)``,
    which checks the arguments.
    """
    rank, world = rank_and_world(process_group, logits_shard.shape[-1], "logits")
    options = OpOptions(inv_temperature, ignore_index, rank * logits_shard.shape[-1], bool(return_entropy),
                        bool(inplace_backward))
    logp, entropy = _VocabParallelSelectiveLogSoftmax.apply(logits_shard, labels, options, process_group, world)
    return logp, (entropy if return_entropy else None)


def rank_and_world(process_group, shard: int, what: str) -> tuple[int, int]:
    """This process's rank in ``process_group`` and the group's size, checked: a member, and
    ``world x shard`` (the full vocab) within the int64 vocab index."""
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("process_group: this process is not a member of the group")
    if world * shard >= 2**63:
        raise ValueError(f"{what}: shard size {shard} x {world} ranks overflows the vocab index")
    return rank, world


class VocabShard(NamedTuple):
    """This rank's part of a vocab split across a tensor-parallel group (Megatron's split: rank r holds
    ``[r Vs, (r + 1) Vs)``), as the fused heads' and GKD ops' schemas carry it: ``vocab_start``, ``vocab_size``
    (the whole vocab) and ``group_name`` ("" without tensor parallelism: the whole vocab here). A backward op
    takes vocab_start only (the others: 0 and "")."""
    vocab_start: int
    vocab_size: int = 0
    group_name: str = ""

    @classmethod
    def of(cls, process_group, shard: int, what: str) -> "VocabShard":
        """This rank's ``shard`` columns under ``process_group`` (None or a group of one: the whole vocab)."""
        if process_group is None or dist.get_world_size(process_group) == 1:
            return cls(0, shard, "")
        rank, world = rank_and_world(process_group, shard, what)
        return cls(rank * shard, world * shard, process_group.group_name)

    def group(self):
        """The process group, or None without tensor parallelism."""
        return dist.distributed_c10d._resolve_process_group(self.group_name) if self.group_name else None

    def sum(self, x: Tensor) -> Tensor:
        """x summed over the group's ranks, in place (one all_reduce); x itself without tensor parallelism."""
        if self.group_name:
            dist.all_reduce(x, group=self.group())
        return x

    def local_ids(self, ids: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """(global ``ids`` as this shard's ``width`` columns, 0 where another rank holds them; whether this one does)."""
        local = ids - self.vocab_start
        own = (local >= 0) & (local < width)
        return torch.where(own, local, 0), own


def gather_combine_shard_stats(logp_r, entropy_r, shift_r, log_sum_r, y, shard, inv_temperature, ignore_index,
                               group, world):
    """Full-vocab statistics from this rank's per-shard ones: one all_gather, then combine_shard_stats.

    logp_r: this shard's log-probs (N k values, 0 for labels elsewhere); entropy_r,
    shift_r, log_sum_r: N values each (entropy_r None without entropy); y: [N, k]
    int64 global labels, the same on every rank; shard: this rank's vocab size.
    Returns (logp [N, k], entropy [N] or None, shift [N], log_sum [N]), identical
    on every rank of ``group``.
    """
    return combine_shard_stats(*gather_shard_stats(logp_r, entropy_r, shift_r, log_sum_r, y, shard, inv_temperature,
                                                   ignore_index, group, world), inv_temperature)


def gather_shard_stats(logp_r, entropy_r, shift_r, log_sum_r, y, shard, inv_temperature, ignore_index, group, world):
    """The all_gather of gather_combine_shard_stats: every rank's statistics, ready for combine_shard_stats.

    Returns (shift [R, N], log_sum [R, N], logp [R, N, k], entropy [R, N] or None, owner [N, k],
    ignored [N, k]), R = world, the same on every rank of ``group``.
    """
    n, k = y.shape
    with_entropy = entropy_r is not None
    cols = 2 + (1 if with_entropy else 0) + k
    dtype = shift_r.dtype
    device = shift_r.device
    send = torch.empty(_HEADER + cols * n, dtype=dtype, device=device)
    header = (float(shard), float(inv_temperature), float(ignore_index & 0xFFFFFFFF))
    send[:_HEADER] = torch.tensor(header, dtype=dtype)
    stats = send[_HEADER:].view(cols, n)
    stats[0] = shift_r.reshape(n)
    stats[1] = log_sum_r.reshape(n)
    if with_entropy:
        stats[2] = entropy_r.reshape(n)
    stats[cols - k:] = logp_r.reshape(n, k).t()
    recv = torch.empty(world * send.numel(), dtype=dtype, device=device)
    _all_gather_single(recv, send, group=group)
    recv = recv.view(world, send.numel())
    _check_header(recv[:, :_HEADER], group, header, device)

    gathered = recv[:, _HEADER:].view(world, cols, n)
    ignored = y == ignore_index
    owner = torch.where(ignored, 0, y.div(shard, rounding_mode="floor")).clamp(0, world - 1)
    return (gathered[:, 0], gathered[:, 1], gathered[:, cols - k:].transpose(1, 2),
            gathered[:, 2] if with_entropy else None, owner, ignored)


class _VocabParallelSelectiveLogSoftmax(torch.autograd.Function):

    @staticmethod
    def forward(ctx, rows, labels, options: OpOptions, group, world):
        shard = rows.shape[-1]
        lead_dims = rows.dim() - 1
        with_entropy = options.with_entropy
        logp_r, entropy_r, shift_r, log_sum_r = ops.fwd(rows, labels, options.inv_temperature, options.ignore_index,
                                                        options.vocab_start, world * shard, with_entropy, False)
        logp, entropy, shift, log_sum = gather_combine_shard_stats(
            logp_r, entropy_r if with_entropy else None, shift_r, log_sum_r, label_matrix(labels, lead_dims), shard,
            options.inv_temperature, options.ignore_index, group, world)
        lead = rows.shape[:-1]
        shift, log_sum = shift.view(lead), log_sum.view(lead)
        entropy = entropy.view(lead) if with_entropy else None
        ctx.save_for_backward(rows, labels, shift, log_sum, entropy)
        ctx.options = options
        logp = logp.view(labels.shape)
        if entropy is None:
            entropy = logp.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # a double backward raises (ops.backward_into_logits)
        rows, labels, shift, log_sum, entropy = ctx.saved_tensors
        others = (None,) * (len(ctx.needs_input_grad) - 1)  # the labels and the call's settings
        if not ctx.needs_input_grad[0]:
            return None, *others
        return ops.backward_into_logits(rows, labels, shift, log_sum, entropy, grad_logp, grad_entropy,
                                        ctx.options), *others


def _check_header(headers, group, header, device):
    key = (id(group), header)
    if key in _checked:
        return
    got = headers.double().cpu()
    want = torch.tensor(header, dtype=headers.dtype).double()  # rounded as the ranks sent it
    bad = [r for r in range(got.shape[0]) if not torch.equal(got[r], want)]
    if bad:
        rows = "; ".join(f"rank {r}: shard {int(got[r, 0])}, 1/T {got[r, 1].item():.9g}, "
                         f"ignore_index (low 32 bits) {int(got[r, 2])}" for r in range(got.shape[0]))
        raise ValueError("twinkle_mem vocab-parallel: the ranks of process_group disagree on the call "
                         "(every rank must pass an equal vocab shard [N, V / tp], the same labels, "
                         f"return_entropy, temperature and ignore_index): {rows}")
    if device.type != "cpu":
        _checked.add(key)
