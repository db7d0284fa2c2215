"""linear_gkd_topk (and gkd_topk_from_logits) under tensor parallelism: gloo worlds of 2 and 4 CPU processes,
against TP = 1.

Every rank holds the same hidden states, teacher top-k and labels and its vocab shard of the LM head
(Megatron's split); the teacher ids are global. Checked against the single-process call on the whole
weight, in the same process:
- the per-token loss: bitwise the single-process one on every rank (each id's logit comes from the one
  rank holding it, the others add exact zeros);
- grad_weight / grad_bias: this rank's shard of the single-process gradient;
- grad_hidden: this rank's partial sum (not yet the full gradient); the sum over ranks (the caller's
  all-reduce, also Megatron's copy_to_tensor_model_parallel_region) is the single-process gradient.
Gradient bound: both sides within 1 ulp of their dtype + (m + 4) 2^-24 sum |terms| of the exact value
(tests/distill/test_distill.py's bound), so they differ by at most twice that; for grad_hidden each rank's partial
is rounded to the dtype before the sum, one ulp at sum |terms| per rank (a bf16 partial can be much larger
than the sum of the partials). Each case does its collectives
first and asserts after, so a failing rank cannot leave the others waiting.
"""
import pytest
import torch
import torch.distributed as dist

from distill_helpers import gkd_grad_bounds, gkd_logits_case, gkd_topk_teacher
from head_helpers import make_head, tp_head_leaves, vocab_shard
from helpers import Cases
from numerics import ulp

cases = Cases(__name__, timeout_s=180)
case = cases.register
EPS = 2.0**-24


def make_inputs(n, h, v, k, dtype, bias, seed, neg_inf=False):
    hidden, weight, b, _ = make_head(n, h, v, dtype, bias=bias, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    ids = teacher.topk(k, dim=-1).indices
    lp = teacher.log_softmax(-1).gather(-1, ids).float()
    ids[: n // 5] = 0  # the recipe's padding rows
    lp[: n // 5] = 0.0
    if k > 1:
        ids[n // 5:, 1] = ids[n // 5:, 0]  # repeated ids
    if neg_inf and k > 1:
        lp[n // 5:, -1] = float("-inf")
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    return hidden, weight, b, ids, lp, labels


def bounds(hidden, weight, bias, ids, lp, labels, g_out, beta, temperature):
    """Per element of (grad_hidden, grad_weight, grad_bias): distill_helpers.gkd_grad_bounds, the terms' sizes from
    the exact logits (dyadic heads) and the op's float64 math, plus the row's largest (see test_distill);
    grad_hidden also one rounding of a rank's partial (up to the sum of its terms' sizes)."""
    from twinkle_mem.distill.divergence import gkd_rows
    x = (hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())).gather(-1, ids)
    _loss, d = gkd_rows(x, lp, beta, temperature)
    d = (d.abs() + d.abs().amax(-1, keepdim=True)) * (g_out.abs() * (labels != -100)).double().unsqueeze(1)
    bh, bw, bb = gkd_grad_bounds(hidden, weight, ids, d, EPS)
    sizes = torch.einsum("nk,nkh->nh", d, weight.double().abs()[ids])
    return bh + ulp(sizes, hidden.dtype), bw, bb


def run_and_check(rank, world, *, n=30, h=32, shard=120, k=8, dtype=torch.float32, bias=True, beta=0.5,
                  temperature=0.7, seed=0, group=None, neg_inf=False, through_megatron=False, frozen=False):
    import twinkle_mem
    group = group if group is not None else dist.group.WORLD
    hidden, weight, b, ids, lp, labels = make_inputs(n, h, world * shard, k, dtype, bias, seed, neg_inf)
    g_out = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2))  # replicated (Megatron's convention)
    hp, w, bb, x = tp_head_leaves(hidden, weight, b if bias else None, rank, world, through_megatron, frozen)
    per = twinkle_mem.linear_gkd_topk(x, w, ids, lp, labels, bias=bb, beta=beta, temperature=temperature,
                                      process_group=group)
    grads = torch.autograd.grad((per * g_out).sum(), [t for t in (hp, w, bb) if t is not None and t.requires_grad])
    summed = grads[0].double()
    if not through_megatron:
        dist.all_reduce(summed, group=group)  # what the caller's all-reduce makes of the partial sums
    losses = [torch.empty_like(per) for _ in range(world)]
    dist.all_gather(losses, per.contiguous(), group=group)
    # Collectives done; everything below is local.

    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bs = b.clone().requires_grad_() if bias else None
    one_per = twinkle_mem.linear_gkd_topk(hs, ws, ids, lp, labels, bias=bs, beta=beta, temperature=temperature)
    one = torch.autograd.grad((one_per * g_out).sum(), [t for t in (hs, ws, bs) if t is not None])
    # (k = 1: one entry renormalized over itself on both sides: the loss and its gradients are exactly 0)
    assert torch.isfinite(one_per).all() and (one_per[labels != -100] != 0).any() == (k > 1)
    for r, other in enumerate(losses):
        assert torch.equal(other, one_per), f"rank {r}'s loss differs from the single-process loss"
    bh, bw, bb_ = bounds(hidden, weight, b, ids, lp, labels, g_out, beta, temperature)
    checks = [("grad_hidden summed over ranks", summed, one[0], bh, world)]
    if frozen:  # LoRA's head: grad_hidden alone (the single process's weight is trainable: the same grad_hidden)
        assert len(grads) == 1
    else:
        checks.append(("grad_weight shard", grads[1], vocab_shard(one[1], rank, world), vocab_shard(bw, rank, world), 1))
    if bias and not frozen:
        checks.append(("grad_bias shard", grads[2], vocab_shard(one[2], rank, world), vocab_shard(bb_, rank, world), 1))
    for name, got, single, bound, parts in checks:
        assert got.shape == single.shape, name
        allowed = 2 * (ulp(single.double(), dtype) + parts * bound)  # parts: the ranks' partials, each rounded
        err = (got.double() - single.double()).abs()
        assert (err <= allowed).all(), f"{name} vs single process: max err/allowed {(err / allowed).max():.3g}"
    if not through_megatron and k > 1:
        assert not torch.allclose(grads[0].double(), summed), "grad_hidden is the all-reduced sum, not the partial"
    return per


# ----------------------------------------------------------------- cases
@case()
def fp32_bias_beta_half_temperature(rank, world):
    run_and_check(rank, world, seed=1)


@case()
def bf16_no_bias_beta0_k64(rank, world):
    run_and_check(rank, world, dtype=torch.bfloat16, bias=False, beta=0.0, k=64, temperature=1.0, seed=2)


@case()
def fp32_beta1_and_beta03_with_neg_inf_teacher(rank, world):
    run_and_check(rank, world, beta=1.0, temperature=1.0, seed=3)
    run_and_check(rank, world, beta=0.3, neg_inf=True, seed=4)


@case()
def k1_one_id_per_row(rank, world):
    per = run_and_check(rank, world, k=1, seed=5)
    assert not per.any()


@case(4)
def tp_subgroups_use_group_rank(rank, world):
    # Pairs of ranks as TP groups (DP x TP): each group its own data; the group rank picks the shard.
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = groups[rank // 2]
    run_and_check(dist.get_rank(group), 2, group=group, seed=6 + rank // 2)
    dist.destroy_process_group(group)


@case()
def frozen_head_fp32_and_bf16(rank, world):
    # LoRA's frozen head under TP: grad_hidden alone, each rank's partial sum (the coefficients kept, the k weight
    # rows gathered again in the backward: heads/gkd_topk.py, frozen_in_forward)
    run_and_check(rank, world, frozen=True, seed=12)
    run_and_check(rank, world, frozen=True, dtype=torch.bfloat16, bias=False, k=16, seed=13)


@case()
def megatron_copy_to_tp_region_gives_the_full_gradient(rank, world):
    from megatron.core import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        run_and_check(rank, world, group=mpu.get_tensor_model_parallel_group(), through_megatron=True, seed=8)
    finally:
        mpu.destroy_model_parallel()


@case()
def saves_only_inputs_and_o_nk(rank, world):
    import twinkle_mem
    n, k = 20, 8
    hidden, weight, b, ids, lp, labels = make_inputs(n, 16, world * 100, k, torch.float32, True, 9)
    h = hidden.clone().requires_grad_()
    w = vocab_shard(weight, rank, world).clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        per = twinkle_mem.linear_gkd_topk(h, w, ids, lp, labels, process_group=dist.group.WORLD)
    per.sum().backward()
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, ids, lp, labels)}
    assert saved
    for t in saved:
        assert t.untyped_storage().data_ptr() in inputs or t.numel() <= n * k, f"saved {tuple(t.shape)}"


@case()
def rows_bitwise_whatever_the_batch(rank, world):
    # For one TP size: rows alone and inside a batch of 300 (a third of the rows dropped; random heads, so
    # the matmul's rounding shows) give bitwise the same loss and partial grad_hidden on every rank.
    import twinkle_mem
    gen = torch.Generator().manual_seed(11)
    n, h, v, k = 300, 32, world * 500, 16
    hidden = torch.randn(n, h, generator=gen)
    weight, bias = torch.randn(v, h, generator=gen) * 0.3, torch.randn(v, generator=gen)
    ids = torch.randint(0, v, (n, k), generator=gen)
    lp = torch.randn(n, k, generator=gen).log_softmax(-1)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::3] = -100
    g_out = torch.randn(n, generator=gen)
    w, b = vocab_shard(weight, rank, world), vocab_shard(bias, rank, world)

    def call(rows):
        x = hidden[rows].clone().requires_grad_()
        per = twinkle_mem.linear_gkd_topk(x, w, ids[rows], lp[rows], labels[rows], bias=b, temperature=0.7,
                                          process_group=dist.group.WORLD)
        (gh,) = torch.autograd.grad((per * g_out[rows]).sum(), x)
        return per.detach(), gh
    probes = [1, 2, 200, 299]  # kept rows (not multiples of 3)
    batch = call(torch.arange(n))
    alone = [call(torch.tensor([p])) for p in probes]
    # Collectives done; everything below is local.
    for i, p in enumerate(probes):
        for what, a, r in zip(("loss", "grad_hidden"), batch, alone[i]):
            assert torch.equal(a[p:p + 1], r), f"row {p} {what}: {(a[p:p + 1] - r).abs().max().item():.3g}"


@case(2)
def bad_ids_raise_on_every_rank_before_communicating(rank, world):
    import twinkle_mem
    hidden, weight, b, ids, lp, labels = make_inputs(6, 8, 80, 4, torch.float32, True, 10)
    labels[2] = 1
    ids[2, 1] = 80  # the global vocab is 80: out of range on every rank
    with pytest.raises(RuntimeError, match="out of range"):
        twinkle_mem.linear_gkd_topk(hidden, vocab_shard(weight, rank, world), ids, lp, labels,
                                    process_group=dist.group.WORLD)


@case()
def topk_from_logits_shards_give_the_single_process_loss_and_gradient(rank, world):
    """gkd_topk_from_logits: each rank's vocab shard of the student's logits; every rank's loss and its shard of
    the gradient bitwise the single-process ones (no collective after the TP call)."""
    import twinkle_mem
    shard = 90
    for dtype, beta in ((torch.float32, 0.5), (torch.bfloat16, 0.0), (torch.float32, 1.0)):
        student, teacher, labels = gkd_logits_case("random", 24, world * shard, dtype, beta, seed=11)
        ids, lp = gkd_topk_teacher(teacher, 8)
        g_out = torch.randn(labels.shape, generator=torch.Generator().manual_seed(12))
        mine = vocab_shard(student.transpose(0, -1), rank, world).transpose(0, -1).clone().requires_grad_()
        per = twinkle_mem.gkd_topk_from_logits(mine, ids, lp, labels, beta=beta, temperature=0.7,
                                               process_group=dist.group.WORLD)
        (grad,) = torch.autograd.grad((per * g_out).sum(), mine)
        one = student.clone().requires_grad_()
        one_per = twinkle_mem.gkd_topk_from_logits(one, ids, lp, labels, beta=beta, temperature=0.7)
        (one_grad,) = torch.autograd.grad((one_per * g_out).sum(), one)
        assert torch.equal(per, one_per), dtype
        assert torch.equal(grad, one_grad[..., rank * shard:(rank + 1) * shard]), dtype


# ----------------------------------------------------------------- worlds
@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_distill_vocab_parallel(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
