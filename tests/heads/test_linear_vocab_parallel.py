"""linear_selective_log_softmax under tensor parallelism: gloo worlds of 2 and 4 CPU processes.

Every rank holds the same hidden states and labels and its vocab shard of the
LM head (Megatron's split). Checked against the single-process call on the
whole weight and against float64:
- logp and entropy: the full-vocab values, identical on every rank;
- grad_weight / grad_bias: this rank's shard of the single-process gradient;
- grad_hidden: this rank's partial sum; the sum over ranks (the all-reduce of
  Megatron's copy_to_tensor_model_parallel_region) is the single-process gradient,
  also through Megatron's own mapping and parallel_state groups.
Each world is started once (spawn) and runs every case; each case does its
collectives first and asserts after, so a failing rank cannot leave the others
waiting.
"""

import pytest
import torch
import torch.distributed as dist

from head_helpers import make_head, op_bound, through_matmul, tp_head_leaves, vocab_shard
from helpers import Cases, assert_stats_close, blocks
from numerics import ulp
from twinkle_mem.heads.reference import linear_selective_log_softmax_ref

cases = Cases(__name__, timeout_s=180)
case = cases.register


def run_and_check(rank, world, *, chunk_cols=None, **kw):
    """chunk_cols: vocab blocks of that width (and row tiles of 16) instead of the defaults."""
    with blocks(chunk_cols, 16 if chunk_cols else None):
        return _run_and_check(rank, world, **kw)


def _run_and_check(rank, world, *, n=24, h=32, shard=250, dtype=torch.float32, bias=True, k=None,
                   ignore_frac=0.0, temperature=1.0, seed=0, group=None, through_megatron=False, frozen=False):
    import twinkle_mem
    group = group if group is not None else dist.group.WORLD
    v = world * shard
    hidden, weight, b, labels = make_head(n, h, v, dtype, bias=bias, k=k, ignore_frac=ignore_frac, seed=seed)
    ignore = -100 if ignore_frac else None
    chunk = None
    gen = torch.Generator().manual_seed(seed + 7)  # replicated upstream gradients (Megatron's convention)
    g_logp = torch.randn(labels.shape, generator=gen)
    g_ent = torch.randn(n, generator=gen)

    hp, w, bb, x = tp_head_leaves(hidden, weight, b if bias else None, rank, world, through_megatron, frozen)
    logp, ent = twinkle_mem.linear_selective_log_softmax(x, w, labels, True, bias=bb, temperature=temperature,
                                                         ignore_index=ignore, chunk_bytes=chunk, process_group=group)
    grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(),
                                [t for t in (hp, w, bb) if t is not None and t.requires_grad])
    grad_h = grads[0]
    summed = grad_h.clone()
    if not through_megatron:
        dist.all_reduce(summed, group=group)  # what the caller's all-reduce makes of the partial sums
    outs = [torch.empty_like(t) for _ in range(world) for t in (logp, ent)]
    dist.all_gather(outs[0::2], logp.contiguous(), group=group)
    dist.all_gather(outs[1::2], ent.contiguous(), group=group)
    # Collectives done; everything below is local.

    for o in outs[2::2]:
        assert torch.equal(o, outs[0]), "logp differs across ranks"
    for o in outs[3::2]:
        assert torch.equal(o, outs[1]), "entropy differs across ranks"
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bs = b.clone().requires_grad_() if bias else None
    one_logp, one_ent = twinkle_mem.linear_selective_log_softmax(hs, ws, labels, True, bias=bs,
                                                                 temperature=temperature, ignore_index=ignore,
                                                                 chunk_bytes=chunk)
    one = torch.autograd.grad((one_logp * g_logp).sum() + (one_ent * g_ent).sum(),
                              [t for t in (hs, ws, bs) if t is not None])
    ref = linear_selective_log_softmax_ref(hidden, weight, b, labels, g_logp, g_ent, temperature, ignore)
    for name, got, single, r in (("logp", logp, one_logp, ref["logp"]), ("entropy", ent, one_ent, ref["entropy"])):
        assert_stats_close(got, r.view(got.shape), f"{name} vs float64")
        assert ((got.double() - single.double()).abs() <= 2 * (1e-6 + 1e-6 * r.view(got.shape).abs())).all(), \
            f"{name} vs single process"

    d = ref["d"]
    e = op_bound(d, dtype)
    d_shard, e_shard = vocab_shard(d.t(), rank, world), vocab_shard(e.t(), rank, world)
    checks = [("grad_hidden summed over ranks", summed, one[0], d @ weight.double(),
               through_matmul(e, d, weight.double().abs()))]
    if not frozen:  # (a frozen head: grad_hidden alone, its rank's share of the vectors summed in the forward)
        checks.append(("grad_weight shard", grads[1], vocab_shard(one[1], rank, world), d_shard @ hidden.double(),
                       through_matmul(e_shard, d_shard, hidden.double().abs())))
    if bias and not frozen:
        ones = torch.ones(n, 1, dtype=torch.float64)
        checks.append(("grad_bias shard", grads[2], vocab_shard(one[2], rank, world), d_shard.sum(1),
                       through_matmul(e_shard, d_shard, ones)[:, 0]))
    for name, got, single, r, bound in checks:
        assert got.shape == single.shape and got.dtype == dtype, name
        allowed = ulp(r, dtype) + bound
        err = (got.double() - r).abs()
        assert (err <= allowed).all(), f"{name} vs float64: max err/allowed {(err / allowed).max().item():.3g}"
        err = (got.double() - single.double()).abs()
        assert (err <= 2 * allowed).all(), f"{name} vs single process: max err/allowed {(err / allowed).max():.3g}"
    if not through_megatron:
        partial_is_partial = not torch.allclose(grad_h, summed)
        assert partial_is_partial, "grad_hidden is already the all-reduced sum (documented: this rank's partial sum)"
    return logp, grads


# ----------------------------------------------------------------- cases
@case()
def fp32_bias_entropy_temperature(rank, world):
    run_and_check(rank, world, temperature=0.8, seed=1)


@case()
def fp32_ignored_rows_several_blocks_pervocab_shard(rank, world):
    run_and_check(rank, world, ignore_frac=0.75, chunk_cols=64, seed=2)


@case()
def bf16_no_bias_k2_labels(rank, world):
    run_and_check(rank, world, dtype=torch.bfloat16, bias=False, k=2, ignore_frac=0.3, chunk_cols=100, seed=3)


@case()
def fp16_one_column_blocks(rank, world):
    run_and_check(rank, world, dtype=torch.float16, shard=9, chunk_cols=1, temperature=2.0, seed=4)


@case()
def frozen_head_fp32_several_blocks_ignored_rows(rank, world):
    # LoRA's frozen head: each rank sums its shard's share of grad_hidden's vectors in the forward
    run_and_check(rank, world, ignore_frac=0.5, chunk_cols=64, temperature=0.7, seed=12, frozen=True)


@case()
def frozen_head_bf16_k3_labels_on_other_shards(rank, world):
    # bf16 with the entropy's gradient: summed in the forward from fp32 copies, or, on a CPU that multiplies bf16
    # natively, recomputed in the backward (heads/frozen.py, recompute_is_cheaper): both, whatever this CPU is
    from twinkle_mem.heads import engine, frozen
    for native in (False, True):
        frozen.native_reduced_products = engine.native_reduced_products = lambda dtype, device, n=native: n
        run_and_check(rank, world, dtype=torch.bfloat16, bias=False, k=3, ignore_frac=0.3, chunk_cols=100,
                      temperature=0.7, seed=13, frozen=True)


@case()
def frozen_head_through_megatron(rank, world):
    from megatron.core import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        run_and_check(rank, world, group=mpu.get_tensor_model_parallel_group(), through_megatron=True, seed=14,
                      chunk_cols=90, frozen=True)
    finally:
        mpu.destroy_model_parallel()


@case()
def tp_subgroups_use_group_rank(rank, world):
    # Pairs of ranks as TP groups (DP x TP): each group its own data; the group rank picks the shard.
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = groups[rank // 2]
    run_and_check(dist.get_rank(group), 2, group=group, seed=5 + rank // 2, chunk_cols=70)
    dist.destroy_process_group(group)


@case()
def megatron_copy_to_tp_region_gives_the_full_gradient(rank, world):
    from megatron.core import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        run_and_check(rank, world, group=mpu.get_tensor_model_parallel_group(), through_megatron=True, seed=6,
                      chunk_cols=90)
    finally:
        mpu.destroy_model_parallel()


@case()
def saves_only_inputs_and_row_statistics(rank, world):
    import twinkle_mem
    n = 20
    hidden, weight, b, labels = make_head(n, 16, world * 100, torch.float32, ignore_frac=0.3, seed=7)
    h = hidden.clone().requires_grad_()
    w = vocab_shard(weight, rank, world).clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logp, ent = twinkle_mem.linear_selective_log_softmax(h, w, labels, True, ignore_index=-100,
                                                             process_group=dist.group.WORLD)
    (logp.sum() + ent.sum()).backward()
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, labels)}
    assert saved
    for t in saved:
        assert t.untyped_storage().data_ptr() in inputs or t.numel() <= n, f"saved {tuple(t.shape)}"


@case()
def compile_fullgraph_with_process_group(rank, world):
    import twinkle_mem
    hidden, weight, b, labels = make_head(10, 16, world * 64, torch.float32, seed=8)
    w = vocab_shard(weight, rank, world)
    group = dist.group.WORLD

    def f(h, w):
        return twinkle_mem.linear_selective_log_softmax(h, w, labels, True, temperature=0.9, process_group=group)

    def run(fn):
        h, ws = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = fn(h, ws)
        return [logp.detach(), ent.detach(), *torch.autograd.grad(logp.sum() + ent.sum(), (h, ws))]
    torch._dynamo.reset()
    got = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    want = run(f)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@case()
def rows_bitwise_whatever_the_batch(rank, world):
    # For one TP size: rows alone (N = 1) and inside a batch of 600 (two row tiles, a third of the
    # other rows dropped) give bitwise the same logp, entropy and partial grad_hidden on every rank.
    import twinkle_mem
    gen = torch.Generator().manual_seed(11)
    n, h, v = 600, 32, world * 4500  # two vocab blocks per shard at TP = 2, the last ragged
    hidden = torch.randn(n, h, generator=gen)
    weight, bias = torch.randn(v, h, generator=gen) * 0.3, torch.randn(v, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::3] = -100
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    w, b = vocab_shard(weight, rank, world), vocab_shard(bias, rank, world)

    def call(rows):
        x = hidden[rows].clone().requires_grad_()
        logp, ent = twinkle_mem.linear_selective_log_softmax(x, w, labels[rows], True, bias=b, temperature=0.7,
                                                             ignore_index=-100, process_group=dist.group.WORLD)
        (gh,) = torch.autograd.grad((logp * g_logp[rows]).sum() + (ent * g_ent[rows]).sum(), x)
        return logp.detach(), ent.detach(), gh
    probes = [1, 2, 511, 512, 599]  # kept rows (not multiples of 3), both tiles
    batch = call(torch.arange(n))
    alone = [call(torch.tensor([p])) for p in probes]
    # Collectives done; everything below is local.
    for i, p in enumerate(probes):
        for what, a, r in zip(("logp", "entropy", "grad_hidden"), batch, alone[i]):
            assert torch.equal(a[p:p + 1], r), f"row {p} {what}: {(a[p:p + 1] - r).abs().max().item():.3g}"


@case()
def old_and_new_logprobs_bitwise(rank, world):
    # PPO's old log-probs (no_grad) and the training forward's (grad enabled), a frozen head and a trainable one,
    # fp32 and bf16, at the default budget and at the smallest one each shard accepts (its blocks narrowed): bitwise
    # the same on every rank (issue 52: a frozen forward summing vectors once narrowed its blocks alone).
    import twinkle_mem
    from twinkle_mem.heads import plans
    from twinkle_mem.heads.frozen import vectors_at_most
    from twinkle_mem.heads.matmul import product_sums
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(21)
        n, h, v = 70, 16, world * 20003  # (blocks of 32768 at this H: narrowed to 8192 at the smallest budget)
        hidden = torch.randn(n, h, generator=gen).to(dtype)
        weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
        labels = torch.randint(0, v, (n,), generator=gen)
        w = vocab_shard(weight, rank, world)
        plan = plans.device_plan(cpu)
        smallest = plans.block_need(plan.vocab_block, h, dtype, plan, product_sums(dtype, cpu),
                                     vectors_at_most(dtype, cpu))
        for chunk in (None, smallest):
            with torch.no_grad():
                old = twinkle_mem.linear_selective_log_softmax(hidden, w, labels, True, temperature=0.9,
                                                               chunk_bytes=chunk, process_group=dist.group.WORLD)
            for frozen in (True, False):
                ws = w.clone().requires_grad_(not frozen)
                new = twinkle_mem.linear_selective_log_softmax(hidden.clone().requires_grad_(), ws, labels, True,
                                                               temperature=0.9, chunk_bytes=chunk,
                                                               process_group=dist.group.WORLD)
                for what, a, b in zip(("logp", "entropy"), old, new):
                    assert torch.equal(a, b.detach()), (f"{dtype}, chunk_bytes={chunk}, frozen={frozen}: {what} "
                                                        f"{(a - b.detach()).abs().max().item():.3g}")


@case(2)
def bad_labels_raise_on_every_rank_before_communicating(rank, world):
    import twinkle_mem
    hidden, weight, b, labels = make_head(6, 8, 80, torch.float32, seed=9)
    labels[2] = 80  # global vocab is 80: out of range on every rank
    with pytest.raises(RuntimeError, match="out of range"):
        twinkle_mem.linear_selective_log_softmax(hidden, vocab_shard(weight, rank, world), labels,
                                                 process_group=dist.group.WORLD)


# ----------------------------------------------------------------- worlds
@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_linear_vocab_parallel(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
