"""Per-row statistics in Python: the finishing steps of csrc/common/online_softmax.h that the
composite kernel and the combination of vocab shards (tensor parallelism, vocab blocks) share."""
from __future__ import annotations

import torch


def label_matrix(labels: torch.Tensor, lead_dims: int) -> torch.Tensor:
    """The op's labels as [N, k] int64 (k = 1 for labels without a trailing dim)."""
    n = 1
    for s in labels.shape[:lead_dims]:
        n *= s
    return labels.reshape(n, -1).long() if labels.dim() > lead_dims else labels.reshape(n, 1).long()


def output_shift(shift, log_sum, inv_temperature, out_dtype):
    """online_softmax.h output_shift(): (shift, log_sum) as a forward returns them.

    From a row's statistics in float64 (shift: any reference logit, log_sum
    against it): shift moved to the log-normalizer in logit units rounded to
    out_dtype, log_sum the small remainder; rows without a finite normalizer keep
    their own. Each u = (x - shift) / T - log_sum of the backward then carries only
    its own rounding, not a shared rounding of log_sum.
    """
    shift, log_sum = shift.double(), log_sum.double()
    lse_x = shift + log_sum / inv_temperature
    rebased = lse_x.to(out_dtype)
    ok = torch.isfinite(lse_x) & torch.isfinite(rebased)
    rest = (shift - rebased.double()) * inv_temperature + log_sum
    return (torch.where(ok, rebased, shift.to(out_dtype)), torch.where(ok, rest, log_sum).to(out_dtype))


def combine_shard_stats(shift, log_sum, logp, entropy, owner, ignored, inv_temperature):
    """Combine per-shard statistics in shard order; pure local arithmetic.

    shift, log_sum: [R, N]; logp: [R, N, k] (each against its own shard);
    entropy: [R, N] or None; owner: [N, k] long, the shard holding each label;
    ignored: [N, k] bool. Returns full-vocab (logp [N, k], entropy [N] or None,
    shift [N], log_sum [N]); ignored labels give logp 0, rows whose labels are
    all ignored (k >= 1) give 0 everywhere. Computed in float64 (O(N) values)
    and rounded once, as the single-process kernels finish a row.
    """
    out_dtype = shift.dtype
    shift, log_sum, logp = shift.double(), log_sum.double(), logp.double()
    entropy = None if entropy is None else entropy.double()
    neg_inf = float("-inf")
    present = log_sum != neg_inf  # shards with a finite logit (NaN counts: it must propagate)
    big = torch.where(present, shift, torch.full_like(shift, neg_inf)).amax(dim=0)
    big = torch.where(big == neg_inf, torch.zeros_like(big), big)
    a = torch.where(present, (shift - big) * inv_temperature + log_sum, torch.full_like(shift, neg_inf))
    total = torch.logsumexp(a, dim=0)
    a_owner = a.unsqueeze(-1).expand(-1, -1, owner.shape[-1]).gather(0, owner.unsqueeze(0)).squeeze(0)  # [N, k]
    logp_owner = logp.gather(0, owner.unsqueeze(0)).squeeze(0)
    # An owner shard of only -inf has a = -inf: the label's logit is -inf (NaN where another shard's NaN makes the
    # normalizer NaN: -inf - NaN).
    total_k = total.unsqueeze(-1)
    logp_full = torch.where((a_owner == neg_inf) & ~total_k.isnan(), torch.full_like(a_owner, neg_inf),
                            logp_owner + (a_owner - total_k))
    zero = torch.zeros((), dtype=shift.dtype, device=shift.device)
    logp_full = torch.where(ignored, zero, logp_full)
    skipped = ignored.all(dim=-1) if ignored.shape[-1] > 0 else ignored.new_zeros(ignored.shape[:-1])
    big = torch.where(skipped, zero, big)
    total = torch.where(skipped, zero, total)
    if entropy is None:
        return (logp_full.to(out_dtype), None) + output_shift(big, total, inv_temperature, out_dtype)
    w = torch.exp(a - total)
    # Shards with w = 0 (only -inf there, or negligible) add nothing; their H_r may be NaN.
    terms = torch.where(w == 0, zero, w * (entropy + (total - a)))
    h = terms[0].clone()
    for r in range(1, terms.shape[0]):  # fixed order: the same rounding on every rank
        h += terms[r]
    shift_out, log_sum_out = output_shift(big, total, inv_temperature, out_dtype)
    return logp_full.to(out_dtype), torch.where(skipped, zero, h).to(out_dtype), shift_out, log_sum_out


def fold_normalizer(state, shift, log_sum, inv_temperature):
    """A row's running (shift, log_sum) after one more part (a vocab block): combine_shard_stats' normalizer of the
    two, in float64. state: the parts so far, or None (then the part's own)."""
    if state is None:
        return shift, log_sum
    neg_inf = float("-inf")
    (shift_a, log_sum_a), (shift_b, log_sum_b) = state, (shift, log_sum)
    present_a, present_b = log_sum_a != neg_inf, log_sum_b != neg_inf  # (NaN counts: it must propagate)
    big = torch.maximum(torch.where(present_a, shift_a, neg_inf), torch.where(present_b, shift_b, neg_inf))
    big = torch.where(big == neg_inf, 0.0, big)
    a = torch.where(present_a, (shift_a - big) * inv_temperature + log_sum_a, neg_inf)
    b = torch.where(present_b, (shift_b - big) * inv_temperature + log_sum_b, neg_inf)
    return big, torch.logaddexp(a, b)


def combine_shard_stats_in_tiles(tile, shift, log_sum, logp, entropy, owner, ignored, inv_temperature):
    """``combine_shard_stats`` over tiles of ``tile`` rows, one call per tile (the last may hold fewer: a call's
    last row tile, rounded to the plan's row quantum, heads/engine.py).

    Why: torch's CPU loops give an element a result that can depend on where it sits in the tensor
    (a vector body or a scalar tail, the split across threads), and exp / logsumexp differ there
    in the last bit. Every call here sees tensors of a few fixed shapes, each a whole number of the loops'
    vectors (16 rows), so a row's merged statistics depend on its own values only, not on N (the fused heads'
    batch invariance relies on it: heads/engine.py). A GPU's elementwise kernels give an element the same bits
    wherever it sits: there ``tile`` is all the rows.
    """
    n = shift.shape[-1]
    parts = []
    for r0 in range(0, n, tile):
        s = slice(r0, r0 + tile)
        parts.append(combine_shard_stats(shift[:, s], log_sum[:, s], logp[:, s], None if entropy is None else
                                         entropy[:, s], owner[s], ignored[s], inv_temperature))
    if len(parts) == 1:
        return parts[0]
    logp_out, entropy_out, shift_out, log_sum_out = zip(*parts)
    return (torch.cat(logp_out), None if entropy is None else torch.cat(entropy_out), torch.cat(shift_out),
            torch.cat(log_sum_out))
