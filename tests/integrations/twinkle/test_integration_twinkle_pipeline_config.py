"""A fused-head configuration error under pipeline parallelism (PP = 2, gloo, 2 CPU processes) fails every
stage before megatron's schedule starts, with one message (issue 27).

``install(fused_lm_head=True, fused_chunk_bytes=...)`` with a value below one row tile of the output layer's
vocab block can only be judged against the model, which only the last stage holds. Raised there inside the
schedule, it left the first stage waiting in its p2p receive (gloo: until its timeout; NCCL: until the
watchdog ends the job). The world has its own deadline (``Cases(timeout_s=...)``, in a module of its own so
that a stalled stage fails only this test): a stage left waiting fails the test instead of hanging it.
"""

import pytest
import torch
from standins.megatron import gpt_step_in_world
from helpers import ADVANTAGES, LENGTHS, PROMPT, VOCAB, Cases, grpo, twinkle_wrapped

pytestmark = pytest.mark.e2e  # a distributed Megatron matrix (a gloo world): the end-to-end tier

WORLD = 2
BAD_CHUNK = 16384  # the value: below one row tile (512 rows x 1018 columns x 4 bytes) of this model


cases = Cases(__name__, timeout_s=150, setup=gpt_step_in_world)
case = cases.register(WORLD)


@case
def pp2_chunk_bytes_below_one_tile_fails_every_stage_before_the_schedule(rank, world):
    from standins import megatron as th
    from megatron.core import parallel_state as mpu

    from twinkle_mem.integrations import twinkle as integration
    mpu.initialize_model_parallel(pipeline_model_parallel_size=WORLD)
    integration.install(mask_skip="never", fused_lm_head=True, fused_chunk_bytes=BAD_CHUNK)
    try:
        chunk = th.gpt_model(VOCAB, layers=2)
        forwards = []
        chunk.register_forward_pre_hook(lambda *_: forwards.append(1))
        model = th.twinkle_megatron_model(chunk, loss=twinkle_wrapped(grpo(False)), pp_size=WORLD)
        samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
        with pytest.raises(ValueError) as err:
            th.run_step(model, False, ADVANTAGES, inputs=samples, micro_batch_size=1, temperature=0.7)
        # the same words on both stages, and no stage ran a micro-batch: the schedule never started
        from twinkle_mem.heads import frozen, matmul, plans
        cpu, device = plans.PLANS["cpu"], torch.device("cpu")
        need = plans.block_need(VOCAB, 32, torch.float32, cpu, matmul.product_sums(torch.float32, device),
                                frozen.vectors_at_most(torch.float32, device))
        assert str(err.value) == (
            f"twinkle-mem fused LM head: install(fused_chunk_bytes={BAD_CHUNK}) does not fit this model: "
            f"chunk_bytes = {BAD_CHUNK} is below one step of a vocab block ({cpu.row_tile} rows x {VOCAB} columns, "
            f"H = 32, torch.float32: {need} bytes); pass a larger fused_chunk_bytes, or None for the "
            "default"), f"rank {rank}: {err.value}"
        assert forwards == [], f"rank {rank} ran {len(forwards)} forward(s) of the model"
    finally:
        integration.uninstall()
        mpu.destroy_model_parallel()


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"pp{v}" if isinstance(v, int) else v)
def test_pipeline_config_error(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
