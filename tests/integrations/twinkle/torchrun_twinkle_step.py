"""One twinkle Megatron step at TP = 2, as a torchrun child runs it (tests/integrations/twinkle/test_startup_hook.py
starts it).

    torchrun --standalone --nproc_per_node 2 tests/integrations/twinkle/torchrun_twinkle_step.py OUT MODE

MODE ``env``: the script never calls install(); whatever twinkle-mem does comes from TWINKLE_MEM_INSTALL
through the start-up hook. MODE ``explicit``: the script calls ``install(fused_lm_head=True, fused_chunk_bytes=64 KiB)`` itself.
Each rank saves to OUT/rank<r>.pt: twinkle-mem's settings in this process, the step's loss and
log-probs, the parameter gradients, and the tensors of the vocab (or its shard) as last dim seen
during the step.
"""
import os
import sys

import torch
import torch.distributed as dist

TESTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # tests/helpers.py and standins/

from helpers import ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, SEQ, VOCAB, VocabTensors, blocks, grpo  # noqa: E402


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from standins import megatron as th  # twinkle is imported on its first use below: the hook runs then
    from megatron.core import parallel_state as mpu

    from twinkle_mem.integrations import twinkle as integration
    if mode == "explicit":
        integration.install(fused_lm_head=True, fused_chunk_bytes=CHUNK)
    # small vocab blocks, as in the other integration tests: several blocks, none as wide as the vocab shard
    with th.cpu_schedules(), th.megatron_gpt_cpu(), th.cpu_platform("cpu"), blocks(*FUSED_BLOCKS):
        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
        chunk = th.gpt_model(VOCAB)
        model = th.twinkle_megatron_model(chunk, loss=grpo(entropy=False), tp_size=world)
        samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
        spy = VocabTensors((VOCAB, VOCAB // world), 2 * SEQ * VOCAB // world // 2)
        with spy:
            out = th.run_step(model, False, ADVANTAGES, inputs=samples, micro_batch_size=2, temperature=0.7)
        grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters() if p.grad is not None}
        mpu.destroy_model_parallel()
    torch.save(dict(settings=integration.installed_settings(), pid=os.getpid(), loss=float(out["loss"]),
                    logps=out["logps"].detach(),
                    labels=th.step_labels(model, False), grads=grads, vocab_last_dim=spy.last_dim, ops=spy.ops),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
