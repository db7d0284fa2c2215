"""One twinkle Megatron step and one TransformersModel step, in a fresh interpreter whose twinkle-kit is the one
first on PYTHONPATH (tests/integrations/twinkle/test_integration_twinkle_fixed.py puts a twinkle-kit with the three
fixes merged there: standins/twinkle_copies.py).

    python tests/integrations/twinkle/fixed_twinkle_step.py OUT MODE      MODE: shipped | install | fused

``install``: install(); ``fused``: install(fused_lm_head=True). Saves to OUT: each step's loss, log-probs,
entropies, labels and parameter gradients; what install() replaced; how often twinkle-mem's op, its fused head,
its logits guard and the twinkle-kit's own selective_log_softmax ran; the logits each micro-batch reported to
reduce_loss; and what collate built for the attention mask (on an NPU and elsewhere).
"""
import os
import sys

import torch

TESTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # tests/helpers.py and standins/

from helpers import ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, VOCAB, blocks, grpo  # noqa: E402


def counting(owner, name, counts, key):
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return real(*args, **kwargs)

    setattr(owner, name, spy)


def main(out: str, mode: str) -> None:
    torch.set_num_threads(1)
    import twinkle.utils.torch_utils as torch_utils

    import twinkle_mem
    from standins import megatron as th
    from twinkle_mem.integrations import twinkle as integration
    from twinkle_mem.integrations.twinkle import megatron_steps, patches
    counts = {}
    counting(torch_utils, "_fixed_selective_log_softmax_function", counts, "twinkle's own selective_log_softmax")
    counting(twinkle_mem, "selective_log_softmax", counts, "twinkle-mem's op")
    counting(twinkle_mem, "linear_selective_log_softmax", counts, "twinkle-mem's fused head")
    counting(megatron_steps, "_logits_guard", counts, "twinkle-mem's logits guard")
    if mode != "shipped":
        integration.install(fused_lm_head=mode == "fused", fused_chunk_bytes=CHUNK if mode == "fused" else None)
    from twinkle.model.megatron.strategy.megatron import MegatronStrategy
    reported = []
    real_reduce = MegatronStrategy.reduce_loss

    def reduce_loss(self, local_loss, local_count, logits, logps):
        reported.append(None if logits is None else tuple(logits.shape))
        return real_reduce(self, local_loss, local_count, logits, logps)

    MegatronStrategy.reduce_loss = reduce_loss
    steps = {}
    with blocks(*FUSED_BLOCKS):
        with th.gpt_step_on_cpu():
            chunk = th.gpt_model(VOCAB)
            loss = grpo(entropy=True)
            model = th.twinkle_megatron_model(chunk, loss=loss)
            step = th.run_step(model, False, ADVANTAGES, inputs=th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT),
                               micro_batch_size=2, temperature=0.7)
            grads = {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}
            steps["megatron"] = dict(loss=float(step["loss"]), logps=step["logps"].detach(),
                                     entropies=[e.detach() for _, e in loss.seen], labels=th.step_labels(model, False),
                                     grads=grads)
        with th.cpu_platform("cpu"):
            loss = grpo(entropy=True)
            model = th.twinkle_transformers_model(VOCAB, loss=loss)
            step = th.run_step(model, False, ADVANTAGES, inputs=th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT),
                               temperature=0.7)
            steps["transformers"] = dict(loss=float(step["loss"]), logps=step["logps"].detach(),
                                         entropies=[e.detach() for _, e in loss.seen],
                                         labels=th.step_status(model, False).inputs["labels"],
                                         grads={n: p.grad.clone() for n, p in model.model.named_parameters()
                                                if p.grad is not None})
    masks = {}
    from twinkle.processor.base import InputProcessor
    for platform in ("npu", "cpu"):
        with th.cpu_platform(platform):
            features = InputProcessor(framework="megatron")(th.lm_samples([24, 17], VOCAB), micro_batch_size=2,
                                                            attention_mask_type=None)
        mask = features[0].get("attention_mask")
        masks[platform] = mask if isinstance(mask, torch.Tensor) else None
    torch.save(dict(steps=steps, counts=counts, reported=reported, masks=masks, refused=integration.refused(),
                    patched=sorted(f"{getattr(o, '__qualname__', getattr(o, '__name__', ''))}.{n}"
                                   for o, n in patches.patched())), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
