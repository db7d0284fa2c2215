"""Vocab-parallel selective_log_softmax (process_group=...) on gloo worlds of 2 and 4 CPU processes.

The worlds and the per-(world, case) pytest items come from tests/helpers.py (``Cases``).

The reference is the float64 result on the concatenated vocab (twinkle_mem.reference),
with the bound of tests/numerics.py (check_outputs); the single-process native op on
the full vocab must give the same NaN pattern.
"""

import pytest
import torch
import torch.distributed as dist

from helpers import Cases

cases = Cases(__name__, timeout_s=150)
case = cases.register


# ----------------------------------------------------------------- comparison
def _full_case(world, shard, n, dtype, seed, ignore_frac=0.0, ignore_index=-100, scale=4.0):
    """The same full-vocab logits and labels on every rank; labels on every rank's shard."""
    from helpers import make_case
    torch.manual_seed(seed)
    full, _ = make_case(n, world * shard, dtype, scale=scale)
    labels = (torch.arange(n) % world) * shard + torch.randint(0, shard, (n,))
    if ignore_frac:
        labels[torch.rand(n) < ignore_frac] = ignore_index
    return full, labels


def _grads(labels, lead, with_entropy, seed):
    g = torch.Generator().manual_seed(seed + 1)  # replicated upstream gradients (Megatron's convention)
    return (torch.randn(labels.shape, generator=g),
            torch.randn(lead, generator=g) if with_entropy else None)


def _shard_of(full, rank, world):
    shard = full.shape[-1] // world
    return full[..., rank * shard:(rank + 1) * shard].clone()


def _gather(t, group=None):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def run_and_check(rank, world, *, shard=301, n=48, dtype=torch.float32, temperature=1.0, ignore_index=None,
                  ignore_frac=0.0, with_entropy=True, inplace=False, impl=None, seed=0, group=None,
                  full_and_labels=None, use_entropy_grad=True):
    """Runs `impl` on this rank's shard, compares values and the shard's gradient with the
    float64 reference on the full vocab (tests/numerics.py's bound)."""
    import twinkle_mem
    from numerics import check_outputs

    impl = impl or twinkle_mem.selective_log_softmax
    if full_and_labels is None:
        full_and_labels = _full_case(world, shard, n, dtype, seed, ignore_frac, ignore_index or -100)
    full, labels = full_and_labels
    x = _shard_of(full, rank, world).requires_grad_()
    out = impl(x, labels, with_entropy, temperature=temperature, ignore_index=ignore_index,
               inplace_backward=inplace, process_group=group if group is not None else dist.group.WORLD)
    logp, entropy = out if with_entropy else (out, None)
    g_logp, g_entropy = _grads(labels, full.shape[:-1], with_entropy and use_entropy_grad, seed)
    version = x._version
    total = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if g_entropy is not None else 0)
    (grad,) = torch.autograd.grad(total, x)
    # Collectives done; everything below is local.
    everyone = [_gather(logp.detach(), group)] + ([_gather(entropy.detach(), group)] if with_entropy else [])

    xf = full.clone().requires_grad_()
    nat = twinkle_mem.selective_log_softmax(xf, labels, with_entropy, temperature=temperature,
                                            ignore_index=ignore_index)
    nat_logp, nat_entropy = nat if with_entropy else (nat, None)
    total = (nat_logp * g_logp).sum() + ((nat_entropy * g_entropy).sum() if g_entropy is not None else 0)
    (nat_grad,) = torch.autograd.grad(total, xf)

    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    for r, others in enumerate(everyone):
        assert all(torch.equal(o, others[0]) for o in others), f"output {r} differs across ranks"
    if with_entropy:
        assert entropy.shape == full.shape[:-1]
    assert grad.shape == x.shape and grad.dtype == x.dtype
    assert torch.equal(torch.isnan(logp), torch.isnan(nat_logp)), "logp: NaN pattern differs from the native op"
    assert torch.equal(torch.isnan(grad), torch.isnan(_shard_of(nat_grad, rank, world))), "grad: NaN pattern differs"
    s_ = full.shape[-1] // world
    check_outputs(f"tp{world} rank {rank}", full, labels, temperature, ignore_index, g_logp, g_entropy, logp,
                  entropy if g_entropy is not None else None, grad, vocab_slice=slice(rank * s_, (rank + 1) * s_))
    if with_entropy and g_entropy is None:  # entropy returned but not in the loss: still checked
        from helpers import assert_stats_close
        from twinkle_mem.op.reference import selective_log_softmax_ref
        assert_stats_close(entropy, selective_log_softmax_ref(full, labels, temperature, ignore_index)[1], "entropy")
    if inplace:
        assert grad.data_ptr() == x.data_ptr() and x._version > version, "in-place gradient not in the shard"
    return logp, grad


def naive_vocab_parallel(logits, labels, return_entropy=False, *, temperature=1.0, ignore_index=None,
                         inplace_backward=False, process_group=None):
    """The known-wrong pattern: global statistics from a plain (non-autograd) all_reduce,
    added to the local ones as constants. Forward values are right; autograd sees
    only the local shard's lse (a softmax over the shard), so the gradient is wrong."""
    rank = dist.get_rank(process_group)
    shard = logits.shape[-1]
    z = logits.float() / temperature
    local = labels.long() - rank * shard
    on_shard = (local >= 0) & (local < shard)
    lse_local = torch.logsumexp(z, -1)
    mean_local = (torch.softmax(z, -1) * z).sum(-1)
    z_y_local = torch.where(on_shard, z.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    with torch.no_grad():
        m = z.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=process_group)
        e = torch.exp(z - m.unsqueeze(-1))
        stats = torch.stack([e.sum(-1), (e * z).sum(-1), z_y_local])
        dist.all_reduce(stats, group=process_group)
        lse_global = m + stats[0].log()
        mean_global = stats[1] / stats[0]
    lse = lse_local + (lse_global - lse_local)
    logp = z_y_local + (stats[2] - z_y_local) - lse
    entropy = lse - (mean_local + (mean_global - mean_local))
    if ignore_index is not None:
        keep = labels != ignore_index
        logp, entropy = logp * keep, entropy * keep
    return (logp, entropy) if return_entropy else logp


# ----------------------------------------------------------------- cases
@case()
def fp32_entropy_labels_on_every_rank(rank, world):
    run_and_check(rank, world, dtype=torch.float32)


@case()
def bf16_ignore_index_temperature(rank, world):
    run_and_check(rank, world, dtype=torch.bfloat16, temperature=0.7, ignore_index=-100, ignore_frac=0.3, seed=1)


@case()
def fp16_logp_only(rank, world):
    run_and_check(rank, world, dtype=torch.float16, with_entropy=False, temperature=1.3, seed=2)


@case()
def entropy_returned_but_not_in_loss(rank, world):
    run_and_check(rank, world, use_entropy_grad=False, seed=3)


@case()
def inplace_backward_bf16(rank, world):
    run_and_check(rank, world, dtype=torch.bfloat16, inplace=True, ignore_index=-100, ignore_frac=0.2, seed=4)


@case()
def double_backward_raises(rank, world):
    import twinkle_mem
    full, labels = _full_case(world, 53, 6, torch.float64, seed=11)
    x = _shard_of(full, rank, world).clone().requires_grad_()
    logp = twinkle_mem.selective_log_softmax(x, labels, process_group=dist.group.WORLD)
    (grad,) = torch.autograd.grad(logp.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twinkle_mem.selective_log_softmax does not support double backward"):
        torch.autograd.grad(grad.pow(2).sum(), x, allow_unused=True)


@case()
def leading_dims_and_int32_labels(rank, world):
    full, labels = _full_case(world, 97, 2 * 7, torch.float32, seed=5)
    run_and_check(rank, world, full_and_labels=(full.view(2, 7, -1), labels.view(2, 7).int()))


@case()
def large_logits_and_qwen_shard(rank, world):
    # Offsets far from 0 (|lse| ~ 1e3) and a Qwen-sized vocab split over the ranks, few rows.
    full, labels = _full_case(world, 151936 // world, 3, torch.bfloat16, seed=6, scale=8.0)
    run_and_check(rank, world, full_and_labels=(full + 1000, labels), dtype=torch.bfloat16)


@case()
def masked_vocab_on_one_rank(rank, world):
    # Rows whose last shard is all -inf (masked vocab), one label on a masked entry (logp -inf).
    full, labels = _full_case(world, 64, 16, torch.float32, seed=7, ignore_index=-100)
    last = (world - 1) * 64
    full[:8, last:] = float("-inf")
    labels[:8] = torch.randint(0, last, (8,))
    labels[0] = last + 5
    logp, _grad = run_and_check(rank, world, full_and_labels=(full, labels))
    assert logp[0] == float("-inf") and torch.isfinite(logp[1:]).all()


@case()
def training_inputs_finfo_min_peaked_offsets(rank, world):
    # The numerics classes that matter most under TP: a shard of finfo.min masks (the transformers
    # convention), peaked rows (the label at the argmax on another rank), large offsets, T = 0.05.
    for dtype in (torch.bfloat16, torch.float32):
        full, labels = _full_case(world, 128, 12, dtype, seed=16)
        full = full.float()
        full[:4, :128] = torch.finfo(dtype).min  # rank 0's shard masked on 4 rows
        labels[:4] = 128 + labels[:4] % 128
        full[4:8, 200] += 60  # peaked on rank 1's shard
        full[8:] += 1e4
        full = full.to(dtype)
        run_and_check(rank, world, full_and_labels=(full, labels), dtype=dtype, seed=17)
        run_and_check(rank, world, full_and_labels=(full, labels), dtype=dtype, temperature=0.05, seed=18)


@case()
def k_labels_per_row_and_sliced_sequence(rank, world):
    # index [B, S, k] (top-k form) with repeated and ignored entries, on a [B, S, V] view (logits[:, :-1]).
    b, s, shard = 2, 5, 97
    full, _ = _full_case(world, shard, b * (s + 1), torch.bfloat16, seed=19)
    full = full.view(b, s + 1, -1)[:, :-1]
    g = torch.Generator().manual_seed(20)
    labels = torch.randint(0, world * shard, (b, s, 3), generator=g)
    labels[:, :, 2] = labels[:, :, 0]
    labels[0, 1, 1] = -100
    labels[1, 2, :] = -100
    run_and_check(rank, world, full_and_labels=(full, labels), dtype=torch.bfloat16, ignore_index=-100,
                  temperature=0.8, seed=21)
    run_and_check(rank, world, full_and_labels=(full, labels), dtype=torch.bfloat16, ignore_index=-100,
                  inplace=True, seed=22)


@case()
def empty_rows(rank, world):
    run_and_check(rank, world, n=0)


@case()
def only_saves_the_shard_and_row_statistics(rank, world):
    import twinkle_mem
    full, labels = _full_case(world, 500, 32, torch.bfloat16, seed=8)
    x = _shard_of(full, rank, world).requires_grad_()
    from helpers import saved_for_backward
    with saved_for_backward() as saved:
        logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, process_group=dist.group.WORLD)
    (logp.sum() + entropy.sum()).backward()
    assert saved, "nothing saved?"
    for t in saved:
        if t.data_ptr() == x.data_ptr():
            assert t.shape == x.shape and t.dtype == x.dtype  # the shard itself, not a copy
        else:
            assert t.numel() <= labels.numel(), f"saved {tuple(t.shape)} {t.dtype}: not O(N)"


@case()
def bitwise_repeatable(rank, world):
    a = run_and_check(rank, world, dtype=torch.bfloat16, seed=9)
    b = run_and_check(rank, world, dtype=torch.bfloat16, seed=9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@case()
def naive_non_autograd_all_reduce_is_caught(rank, world):
    # The same check run on the naive implementation must fail, and on the gradient (log-probs only:
    # its forward values are right there).
    full_and_labels = _full_case(world, 301, 48, torch.float32, seed=10)
    try:
        run_and_check(rank, world, impl=naive_vocab_parallel, full_and_labels=full_and_labels, with_entropy=False)
    except AssertionError as e:
        assert "grad" in str(e), f"naive implementation failed, but not on its gradient: {e}"
    else:
        raise AssertionError("the check accepted the naive non-autograd all_reduce")
    run_and_check(rank, world, full_and_labels=full_and_labels)  # control: the real one passes


@case()
def tp_subgroups_use_group_rank(rank, world):
    # Pairs of ranks as TP groups (DP x TP): each group has its own data and the group rank sets the shard.
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = groups[rank // 2]
    full_and_labels = _full_case(2, 211, 24, torch.float32, seed=11 + rank // 2)
    run_and_check(dist.get_rank(group), 2, group=group, full_and_labels=full_and_labels,
                  temperature=0.9, seed=11 + rank // 2)
    dist.destroy_process_group(group)


@case()
def group_of_one_is_the_plain_path(rank, world):
    import twinkle_mem
    groups = [dist.new_group([r]) for r in range(world)]
    full, labels = _full_case(world, 50, 8, torch.float32, seed=12)
    got = twinkle_mem.selective_log_softmax(full, labels, True, process_group=groups[rank])
    want = twinkle_mem.selective_log_softmax(full, labels, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    dist.destroy_process_group(groups[rank])


@case(2)
def ranks_that_disagree_raise(rank, world):
    import twinkle_mem
    full, labels = _full_case(world, 40, 6, torch.float32, seed=13)
    x = _shard_of(full, rank, world)
    errors = []
    labels = labels.clamp(max=75)  # in range on both ranks even with the short shard below
    for kwargs, shard in (({}, x[:, :38] if rank == 1 else x),  # unequal shards
                          ({"temperature": 1.0 + rank}, x),  # temperature differs
                          ({"ignore_index": -100 if rank else None}, x)):  # ignore_index on one rank only
        try:
            twinkle_mem.selective_log_softmax(shard, labels, True, process_group=dist.group.WORLD, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 3 and all("disagree" in e for e in errors), errors
    assert "shard 38" in errors[0] and "shard 40" in errors[0], errors[0]


@case(2)
def bad_labels_raise_on_every_rank_before_communicating(rank, world):
    import twinkle_mem
    full, labels = _full_case(world, 40, 6, torch.float32, seed=14)
    labels[2] = 80  # global vocab is 80: out of range on every rank
    with pytest.raises(RuntimeError, match="out of range"):
        twinkle_mem.selective_log_softmax(_shard_of(full, rank, world), labels, process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="temperature"):
        twinkle_mem.selective_log_softmax(_shard_of(full, rank, world), labels, temperature=0.0,
                                          process_group=dist.group.WORLD)


@case(2)
def twinkle_adapter_under_megatron_tp(rank, world):
    # twinkle-kit's selective_log_softmax after install(), with Megatron's TP group of size 2:
    # entropy works, and log-probs and gradients agree with Megatron's own vocab-parallel CE.
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from twinkle_mem.integrations import twinkle as integration
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        import twinkle.loss.grpo as grpo
        full, labels = _full_case(world, 128, 2 * 6, torch.float32, seed=15)
        full, labels = full.view(6, 2, -1), labels.view(6, 2)  # Megatron's [s, b, V]
        x = _shard_of(full, rank, world).requires_grad_()
        integration.install(mask_skip="never", logits_guard=False)
        try:
            logp, entropy = grpo.selective_log_softmax(x, labels, return_entropy=True)
        finally:
            integration.uninstall()
        (grad,) = torch.autograd.grad(logp.sum(), x)
        y = x.detach().clone().requires_grad_()  # Megatron's CE works in place on its input
        loss = vocab_parallel_cross_entropy(y, labels)
        (meg_grad,) = torch.autograd.grad(-loss.sum(), y)
        run_and_check(rank, world, full_and_labels=(full, labels))
    finally:
        mpu.destroy_model_parallel()
    torch.testing.assert_close(logp, -loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, meg_grad, rtol=0, atol=1e-6)
    assert entropy.shape == labels.shape and torch.isfinite(entropy).all()


# ----------------------------------------------------------------- worlds
@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_vocab_parallel(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
