"""Selective log-softmax and entropy over a vocab split across tensor-parallel ranks.

Layout (Megatron's): the ``tp`` ranks of ``process_group`` hold equal shards,
rank r the vocab ``[r * Vs, (r + 1) * Vs)`` of a vocab of ``tp * Vs``; labels are
global ids, identical on every rank.

Forward: the native kernel runs on the local shard (``vocab_start = r * Vs``)
and gives per-row, per-shard statistics: ``lse_r``, ``logp_r`` (``z_y - lse_r``
on the rank that holds the label, else 0) and ``H_r`` (the entropy of the
shard's own softmax). One ``all_gather`` of these (fp32, 2 or 3 values per row,
plus a 3-value header) gives every rank all of them; each rank then combines
them in rank order 0..tp-1, so the result is bit-identical on every rank:

    lse  = log sum_r exp(lse_r)                      w_r = exp(lse_r - lse)
    logp = logp_o + (lse_o - lse)                    o = the rank that holds the label
    H    = sum_r w_r (H_r + lse - lse_r)             (= lse - sum_r w_r E_r[z]; every term >= 0)
    mean = E_p[z] = lse - H

Backward: no collective. Under Megatron's convention everything computed from
the (replicated) log-probs and entropy is replicated across the TP ranks, so
the upstream gradients are the same on every rank and the gradient of a shard
is the shard's slice of the full-vocab gradient
``[g_logp (onehot - p) - g_H p (z - mean)] / T`` with the GLOBAL lse and mean:
the native backward with ``vocab_start`` computes exactly that. (The gradient
then flows into the column-parallel output layer, whose backward all-reduces
the gradient of its input, as it does for any vocab-parallel loss.)

Saved for backward: the shard (a reference), the labels and two O(N) fp32
statistics (lse, mean). Nothing vocab-sized is allocated besides the gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import ops
from .functional import NO_IGNORE_INDEX, _as_rows

# The all_gather without the FutureWarning of newer torch; the same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Header gathered with the statistics so that a configuration that differs across
# ranks raises instead of silently combining unrelated shards:
# [shard vocab size, inverse temperature, ignore_index (low 32 bits)].
# (N and return_entropy set the message size: they must agree for the collective
# itself, which reports a mismatch its own way: gloo aborts, NCCL waits.)
_HEADER = 3
# (group, header) pairs whose agreement across ranks is already established: the
# check needs the gathered header on the host, a sync on accelerators, so it runs
# once per configuration (every call on the CPU, where it costs nothing).
_checked: set = set()


def vocab_parallel_selective_log_softmax(logits_shard, labels, return_entropy=False, temperature=1.0,
                                         ignore_index=None, inplace_backward=False, process_group=None):
    """Full-vocab log-probs (and entropy) from this rank's vocab shard; fp32 outputs, replicated.

    ``logits_shard``: [..., Vs], this rank's slice ``[rank * Vs, (rank + 1) * Vs)``;
    ``labels``: [...] global ids (same on every rank). Returns ``logp`` or
    ``(logp, entropy)``, identical on every rank of ``process_group``. One
    all_gather of O(N) statistics in the forward, none in the backward (the
    upstream gradients must be replicated across the group, as they are for
    anything computed from these outputs under Megatron TP).

    Arguments are checked by ``twinkle_mem.selective_log_softmax``, the public
    entry point (``process_group=``); this function assumes checked arguments.
    """
    if process_group is None:
        raise ValueError("process_group is required for the vocab-parallel path")
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("process_group: this process is not a member of the group")
    lead_shape = labels.shape
    rows = _as_rows(logits_shard)
    shard = rows.shape[1]
    if world * shard >= 2**63:
        raise ValueError(f"logits: shard size {shard} x {world} ranks overflows the vocab index")
    logp, entropy = _VocabParallelSelectiveLogSoftmax.apply(
        rows, labels.reshape(-1), 1.0 / float(temperature),
        NO_IGNORE_INDEX if ignore_index is None else int(ignore_index), bool(return_entropy),
        bool(inplace_backward), process_group, rank, world)
    logp = logp.view(lead_shape)
    if return_entropy:
        return logp, entropy.view(lead_shape)
    return logp


def combine_shard_stats(gathered, labels, shard, ignore_index, with_entropy):
    """Combine gathered per-rank statistics [tp, k, N] (k = lse, logp, [entropy]) in rank order.

    Returns (logp, entropy or None, lse, mean or None) for the full vocab; ignored
    rows give logp = entropy = 0. Pure local arithmetic: the same on every rank.
    """
    lse_r, logp_r = gathered[:, 0], gathered[:, 1]
    lse = torch.logsumexp(lse_r, dim=0)
    ignored = labels == ignore_index
    owner = torch.where(ignored, 0, labels.div(shard, rounding_mode="floor")).long().unsqueeze(0)
    lse_o = lse_r.gather(0, owner).squeeze(0)
    logp_o = logp_r.gather(0, owner).squeeze(0)
    # A shard of only -inf has lse_o = -inf and a NaN logp_o; its label logit is -inf.
    neg_inf = torch.full_like(lse, float("-inf"))
    logp = torch.where(lse_o == float("-inf"), neg_inf - lse, logp_o + (lse_o - lse))
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    logp = torch.where(ignored, zero, logp)
    if not with_entropy:
        return logp, None, lse, None
    w = torch.exp(lse_r - lse)
    # Shards with w = 0 (only -inf there, or negligible) add nothing; their H_r may be NaN.
    terms = torch.where(w == 0, zero, w * (gathered[:, 2] + (lse - lse_r)))
    entropy = terms[0].clone()
    for r in range(1, terms.shape[0]):  # fixed order: the same rounding on every rank
        entropy += terms[r]
    mean = lse - entropy
    return logp, torch.where(ignored, zero, entropy), lse, mean


class _VocabParallelSelectiveLogSoftmax(torch.autograd.Function):

    @staticmethod
    def forward(ctx, rows, labels, inv_temperature, ignore_index, with_entropy, inplace_backward, group, rank,
                world):
        shard = rows.shape[1]
        logp_r, entropy_r, lse_r, _mean_r = ops.fwd(rows, labels, inv_temperature, ignore_index, rank * shard,
                                                    world * shard, with_entropy, False)
        n = labels.shape[0]
        k = 3 if with_entropy else 2
        dtype = lse_r.dtype
        send = torch.empty(_HEADER + k * n, dtype=dtype, device=rows.device)
        header = (float(shard), float(inv_temperature), float(ignore_index & 0xFFFFFFFF))
        send[:_HEADER] = torch.tensor(header, dtype=dtype)
        stats = send[_HEADER:].view(k, n)
        stats[0] = lse_r
        stats[1] = logp_r
        if with_entropy:
            stats[2] = entropy_r
        recv = torch.empty(world * send.numel(), dtype=dtype, device=rows.device)
        _all_gather_single(recv, send, group=group)
        recv = recv.view(world, send.numel())
        _check_header(recv[:, :_HEADER], group, header, rows.device)

        logp, entropy, lse, mean = combine_shard_stats(recv[:, _HEADER:].view(world, k, n), labels, shard,
                                                       ignore_index, with_entropy)
        ctx.save_for_backward(rows, labels, lse, mean)
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.vocab_start = rank * shard
        ctx.with_entropy = with_entropy
        ctx.inplace_backward = inplace_backward
        if entropy is None:
            entropy = logp.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        rows, labels, lse, mean = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None, ) * 9
        if grad_logp is None:
            grad_logp = lse.new_zeros(lse.shape)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        args = (grad_logp.contiguous(), grad_entropy.contiguous() if use_entropy else None)
        rest = (labels, lse, mean if use_entropy else None, ctx.inv_temperature, ctx.ignore_index, ctx.vocab_start)
        if ctx.inplace_backward:
            ops.bwd_inplace(*args, rows, *rest)
            # As in ops.py: the dispatcher does not bump the version of a tensor a
            # custom op mutates; do it, so any other saved use of the logits raises.
            torch.autograd.graph.increment_version(rows)
            grad = rows
        else:
            grad = ops.bwd(*args, rows, *rest)
        return grad, None, None, None, None, None, None, None, None


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
