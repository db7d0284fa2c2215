"""install() and install(fused_lm_head=True) on twinkle's GKD calls under Megatron's model parallelism
(issue 26): a gloo world of 2 CPU processes running twinkle's real MegatronModel around a real
megatron-core GPTModel.

- TP = 2: each rank's output layer is its vocab shard, the teacher's ids global. twinkle-kit as shipped
  gathers the global ids from the shard's logits (an index error for ids past the shard, wrong values for
  the others); the fused call's loss and every parameter
  gradient (this rank's shard) equal twinkle's GKD at TP = 1 computed in float64, and no tensor with the
  vocab or its shard as last dim appears.
- TP = 2, install() alone: the loss from the logits' vocab shards equals the same reference; so does a
  local teacher's topk= with either install.
- PP = 2: the fused step's loss (twinkle broadcasts it to both stages) and each stage's gradients equal the
  unfused step's with GKD in float64.
"""
import contextlib

import pytest
from standins.megatron import gpt_step_in_world
import torch
from helpers import (CHUNK, FUSED_BLOCKS, GKD_K, LENGTHS, PROMPT, VOCAB, Cases, VocabTensors, assert_close, blocks,
                     gkd_in_float64, gkd_local_teacher, gkd_teacher, twinkle_has)

pytestmark = pytest.mark.e2e  # a distributed Megatron matrix (gloo worlds): the end-to-end tier

WORLD = 2


cases = Cases(__name__, timeout_s=240, setup=gpt_step_in_world)
case = cases.register(WORLD)


def _gkd_step(*, fused, tp=1, pp=1, beta=0.5, spy=None, shipped=False, teacher=gkd_teacher):
    """One twinkle GKD step (forward_backward, temperature 0.7) on a fresh GPTModel (the same seed: the same
    weights): install(fused_lm_head=fused); fused=None: twinkle's GKD in float64 (the exact reference);
    shipped: twinkle-kit as shipped."""
    from standins import megatron as th
    from megatron.core import parallel_state as mpu
    from twinkle.loss.gkd import GKDLoss

    from twinkle_mem.integrations import twinkle as integration
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if fused is not None and shipped is False:
        integration.install(mask_skip="never", fused_lm_head=fused, fused_chunk_bytes=CHUNK if fused else None)
    try:
        with blocks(*FUSED_BLOCKS), gkd_in_float64() if fused is None else contextlib.nullcontext():
            chunk = th.gpt_model(VOCAB, layers=pp)
            model = th.twinkle_megatron_model(chunk, loss=GKDLoss(beta=beta, temperature=0.7), tp_size=tp, pp_size=pp)
            samples, teacher = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT), teacher()
            with spy if spy is not None else contextlib.nullcontext():
                out = model.forward_backward(inputs=samples, micro_batch_size=2, temperature=0.7, **teacher)
        grads = {n: (p.grad.detach().clone(), getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", 0))
                 for n, p in chunk.named_parameters() if p.grad is not None}
        return dict(loss=float(out["loss"]), grads=grads)
    finally:
        integration.uninstall()
        mpu.destroy_model_parallel()


@case
def gkd_tp2(rank, world):
    want = _gkd_step(fused=None)  # TP = 1 on each rank: the whole model, GKD in float64
    spy = VocabTensors((VOCAB, VOCAB // WORLD), 10 ** 9)
    got = _gkd_step(fused=True, tp=WORLD, spy=spy)
    try:  # twinkle-kit's GKD gathers the teacher's global ids from this rank's vocab shard of the logits
        shipped = _gkd_step(fused=False, tp=WORLD, shipped=True)
    except RuntimeError as error:  # ids past the shard (both ranks raise alike, before any collective)
        shipped = str(error)
    # all collectives done
    assert "out of bounds" in shipped if isinstance(shipped, str) else abs(shipped["loss"] - want["loss"]) > 1e-3
    _assert_tp_step_is_tp1s(got, want, rank, "fused")
    # (twinkle-kit 0.4.0 computes log-probs for every loss: a GKD call keeps its logits there)
    assert spy.ops > 100 and (spy.last_dim == []) == twinkle_has("megatron_skips_unused_log_probs"), spy.last_dim[:5]


def _assert_tp_step_is_tp1s(got, want, rank, what):
    """A TP = WORLD step's loss and gradients (this rank's shard of the vocab-parallel ones) against TP = 1."""
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7), what
    assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) > 3, what
    for name, (grad, sharded, dim) in got["grads"].items():
        full = want["grads"][name][0]
        expected = full.chunk(WORLD, dim=dim)[rank] if sharded else full
        assert_close(grad, expected, torch.float32, f"{what}: grad of {name} (rank {rank}{', shard' * sharded})")


@case
def gkd_tp2_from_logits(rank, world):
    """install() alone at TP = 2: the logits exist as vocab shards and the loss comes from them
    (gkd_topk_from_logits combines the k columns over the TP group)."""
    want = _gkd_step(fused=None)
    got = _gkd_step(fused=False, tp=WORLD)
    _assert_tp_step_is_tp1s(got, want, rank, "install()")


@case
def gkd_tp2_local_topk(rank, world):
    """A local teacher's logits with topk= at TP = 2: install() takes its k largest logits (global ids) through
    gkd_topk_from_logits over the logits' shards, the fused path through linear_gkd_topk; both equal
    twinkle's GKD at TP = 1 in float64."""
    local = lambda: gkd_local_teacher(GKD_K)  # noqa: E731
    want = _gkd_step(fused=None, teacher=local)
    got = {fused: _gkd_step(fused=fused, tp=WORLD, teacher=local) for fused in (False, True)}
    # all collectives done
    for fused, step in got.items():
        _assert_tp_step_is_tp1s(step, want, rank, f"fused={fused}")


@case
def gkd_pp2(rank, world):
    want = _gkd_step(fused=None, pp=WORLD)
    got = _gkd_step(fused=True, pp=WORLD)
    # both stages returned from both steps: none stalled
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
    assert got["grads"].keys() == want["grads"].keys() and got["grads"]
    for name, (grad, _, _) in got["grads"].items():
        assert_close(grad, want["grads"][name][0], torch.float32, f"grad of {name} (stage {rank})")


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"world{v}" if isinstance(v, int) else v)
def test_fused_gkd_model_parallel(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)


