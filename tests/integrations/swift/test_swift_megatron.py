"""Megatron-SWIFT's log-probs (``compute_logps_and_entropy_from_logits``: GRPO's loss, old and reference log-probs)
on twinkle-mem's op over the TP group, in a gloo world of 2 (tensor parallelism 2, megatron-core's parallel state):
each rank's vocab shard of the same logits, the log-probs and entropy against a single process's float64 ones and
each rank's shard of the logits' gradient against the single process's, within 1e-5 (fp32); ms-swift's own function
beside it, the same checks (its log-prob gradient under TP > 1 is what PR #9947 fixed)."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from helpers import Cases

VOCAB, TOLERANCE = 96, 1e-5


@contextlib.contextmanager
def tensor_parallel():
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


cases = Cases(__name__, timeout_s=240, setup=tensor_parallel)


def inputs(temperature):
    """The whole logits [2, 7, V] (as the model's output divided by the temperature), labels with -100, and the
    upstream gradients of the log-probs and entropy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, generator=g, dtype=torch.float64) * 3 / temperature
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    labels[:, :2] = -100
    return logits, labels, torch.randn(2, 7, generator=g, dtype=torch.float64), torch.randn(
        2, 7, generator=g, dtype=torch.float64)


def single_process(logits, labels, g_logp, g_entropy):
    """float64 log-probs (0 where -100), entropy and the logits' gradient of sum(g_logp logp + g_entropy entropy)."""
    x = logits.clone().requires_grad_()
    log_p = x.log_softmax(-1)
    kept = labels != -100
    logp = log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * kept
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((g_logp * logp).sum() + (g_entropy * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), x.grad


def on_this_rank(compute, rank, world, temperature):
    logits, labels, g_logp, g_entropy = inputs(temperature)
    want = single_process(logits, labels, g_logp, g_entropy)
    shard = VOCAB // world
    leaf = logits[..., rank * shard:(rank + 1) * shard].float().requires_grad_()
    logp, entropy = compute(leaf * 1.0, labels, compute_entropy=True)  # (a non-leaf: ms-swift's works in place)
    ((g_logp.float() * logp).sum() + (g_entropy.float() * entropy).sum()).backward()
    errors = {"logp": (logp.double() - want[0]).abs().max().item(),
              "entropy": (entropy.double() - want[1]).abs().max().item(),
              "grad": (leaf.grad.double() - want[2][..., rank * shard:(rank + 1) * shard]).abs().max().item()}
    assert all(e <= TOLERANCE for e in errors.values()), errors


def shipped():
    from swift.megatron.trainers import vocab_parallel_utils
    function = vocab_parallel_utils.compute_logps_and_entropy_from_logits
    return getattr(function, "__wrapped__", function)


@cases.register(2)
def twinkle_mem_op_at_tp2(rank, world):
    from twinkle_mem.integrations.swift.logits_path import megatron_logps_and_entropy
    for temperature in (1.0, 0.7):
        on_this_rank(megatron_logps_and_entropy(shipped(), None), rank, world, temperature)


@cases.register(2)
def ms_swift_as_shipped_at_tp2(rank, world):
    on_this_rank(shipped(), rank, world, 1.0)


@pytest.mark.parametrize("world, name", cases.params())
def test_megatron_log_probs_at_tp2(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
