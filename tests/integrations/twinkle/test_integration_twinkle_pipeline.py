"""twinkle-kit's Megatron step under pipeline parallelism (PP = 2, gloo, 2 CPU processes) with
install(fused_lm_head=True): a micro-batch that fails in twinkle's forward step under
TWINKLE_FAIL_FAST=0 behaves as it does unfused, and no stage stalls.

twinkle's forward step catches a data-processing error of a micro-batch (TWINKLE_FAIL_FAST=0) so that
the pipeline keeps moving; a stage that raised inside megatron's schedule instead would leave the other
stage waiting in its p2p receive (gloo's timeout does not bound it; NCCL hangs until its watchdog).
The world has its own deadline (``Cases(timeout_s=...)``): a stalled stage fails the test instead of
hanging it. Each case runs the unfused and the fused step, then compares on every rank: the loss
(broadcast by twinkle to both stages), every parameter gradient of the stage, and on the last stage
the log-probs (NaN rows for the failed micro-batch) and the FailedMicroBatchWarning naming it.
"""
import warnings

import pytest
from standins.megatron import gpt_step_in_world
import torch
from helpers import (ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, VOCAB, Cases, assert_close, grpo, scale_output,
                     twinkle_has, twinkle_wrapped)

pytestmark = pytest.mark.e2e  # a distributed Megatron matrix (gloo worlds): the end-to-end tier

WORLD = 2


cases = Cases(__name__, timeout_s=180, setup=gpt_step_in_world)
case = cases.register(WORLD)


def _pp_step(fused, failing, *, entropy, forward_only=False, micro_batch_size=1, edit=None):
    """One twinkle step at PP = 2 on a fresh two-layer GPTModel (the same seed: the same weights):
    (output, this stage's gradients, FailedMicroBatchWarnings, labels)."""
    from standins import megatron as th
    from megatron.core import parallel_state as mpu
    from twinkle.processor.base import InputProcessor

    from twinkle_mem.integrations import twinkle as integration
    mpu.initialize_model_parallel(pipeline_model_parallel_size=WORLD)
    integration.install(mask_skip="never", fused_lm_head=fused, fused_chunk_bytes=CHUNK if fused else None)
    monkeypatch = pytest.MonkeyPatch()
    try:
        # the fused op's small test blocks (helpers.FUSED_BLOCKS; undone with monkeypatch)
        from twinkle_mem.heads import plans
        monkeypatch.setitem(plans.PLANS, "cpu", plans.PLANS["cpu"]._replace(
            vocab_block=FUSED_BLOCKS[0], max_widen=1, row_tile=FUSED_BLOCKS[1]))
        # only the last stage unpacks in its forward steps (the other stages' calls come after the schedule)
        th.fail_unpacking(monkeypatch, InputProcessor, failing=failing if mpu.is_pipeline_last_stage() else set())
        chunk = th.gpt_model(VOCAB, layers=2)
        if edit is not None:
            edit(chunk)
        model = th.twinkle_megatron_model(chunk, loss=twinkle_wrapped(grpo(entropy)), pp_size=WORLD)
        samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
        kwargs = dict(inputs=samples, micro_batch_size=micro_batch_size, temperature=0.7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", integration.FailedMicroBatchWarning)
            out = th.run_step(model, forward_only, ADVANTAGES, **kwargs)
        labels = th.step_labels(model, forward_only)
        grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters() if p.grad is not None}
        failed = [(w.message.micro_batches, w.message.rows) for w in caught
                  if isinstance(w.message, integration.FailedMicroBatchWarning)]
        return dict(out=out, grads=grads, failed=failed, labels=labels)
    finally:
        monkeypatch.undo()
        integration.uninstall()
        mpu.destroy_model_parallel()


def _fused_failure_as_unfused(rank, *, entropy, forward_only, micro_batch_size, failing):
    from megatron.core import parallel_state as mpu
    want = _pp_step(False, failing, entropy=entropy, forward_only=forward_only, micro_batch_size=micro_batch_size)
    got = _pp_step(True, failing, entropy=entropy, forward_only=forward_only, micro_batch_size=micro_batch_size)
    # both stages returned from both steps: no stage raised inside the schedule, none stalled
    last = rank == WORLD - 1
    assert got["out"]["loss"] == pytest.approx(want["out"]["loss"], rel=1e-4, abs=1e-6)
    assert got["grads"].keys() == want["grads"].keys() and (forward_only or want["grads"])
    for name, ref in want["grads"].items():
        assert_close(got["grads"][name], ref, torch.float32, f"grad of {name} (rank {rank})")
    if not last:
        assert got["failed"] == want["failed"] == [] and got["out"]["logps"] is None
        return
    rows = [range(i * micro_batch_size, (i + 1) * micro_batch_size) for i in sorted(failing)]
    assert got["failed"] == want["failed"] == [(sorted(failing), rows)]
    logps, ref_logps = got["out"]["logps"], want["out"]["logps"]
    assert logps.shape == ref_logps.shape == want["labels"].shape
    bad = torch.zeros(logps.shape[0], dtype=torch.bool)
    for r in rows:
        bad[r.start:r.stop] = True
    assert torch.isnan(logps[bad]).all() and torch.isnan(ref_logps[bad]).all()
    mask = (want["labels"] != -100) & ~bad[:, None]
    assert_close(logps[mask], ref_logps[mask], torch.float32, "logps of the micro-batches that did not fail")
    assert not torch.isnan(logps[mask]).any() and mpu is not None


@case
def pp2_failed_micro_batch_logp(rank, world):
    _fused_failure_as_unfused(rank, entropy=False, forward_only=False, micro_batch_size=1, failing={2})


@case
def pp2_failed_micro_batch_entropy(rank, world):
    _fused_failure_as_unfused(rank, entropy=True, forward_only=False, micro_batch_size=2, failing={0})


@case
def pp2_failed_micro_batch_forward_only(rank, world):
    _fused_failure_as_unfused(rank, entropy=True, forward_only=True, micro_batch_size=1, failing={1})


@case
def pp2_refusal_raises_after_the_step(rank, world):
    """The fused head's own refusal on the last stage (its output transformed after the layer), swallowed by
    twinkle's catch and SafeLossWrapper: the last stage raises once the schedule has returned, the first
    stage finishes the step."""
    from megatron.core import parallel_state as mpu
    edit = scale_output if rank == WORLD - 1 else None  # the last stage's GPTModel returns the logits
    error = None
    try:
        out = _pp_step(True, set(), entropy=False, edit=edit)
    except RuntimeError as e:
        error = str(e)
    assert mpu is not None
    if rank == WORLD - 1:
        assert error is not None and "where the fused head refused: micro-batch 0:" in error, error
        assert "not the output layer's pending placeholder" in error
    else:
        assert error is None and out["grads"] and out["out"]["logps"] is None


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"pp{v}" if isinstance(v, int) else v)
def test_pipeline_fused_failure(world, name):
    if not twinkle_has("megatron_catches_step_errors"):
        pytest.skip("this twinkle-kit (0.4.0) catches no micro-batch's error in its forward step: an error raises "
                    "inside megatron's schedule, and the other stage waits in its receive, fused or not")
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
