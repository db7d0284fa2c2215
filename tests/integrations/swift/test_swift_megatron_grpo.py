"""Megatron-SWIFT's own GRPO (``megatron_rlhf_main``), 3 steps on the CPU with a tiny Qwen2 in a gloo world of 2
(torchrun; the stand-ins of ``standins/swift_megatron.py``, vLLM's rollout by ms-swift's transformers generation), as
shipped and with twinkle-mem's plugin in ``--external_plugins``: equal losses, logged metrics (ms-swift's
``logging.jsonl``) and trained parameters (its last checkpoint) within 1e-5 (fp32); the step count asserted, a
reward that varies. In the plugin's run every log-prob (the loss's, the old and the reference's) came from
``linear_selective_log_softmax`` from the output layer's input, Megatron's vocab-parallel cross entropy on the
logits never called. Layouts: TP = 2; TP = 2 with sequence parallelism and padding-free batches (Megatron-SWIFT's
default), LoRA (a frozen output layer) and the entropy logged and masking the loss (``top_entropy_quantile``);
PP = 2 (the output layer on the last stage only)."""
import pytest

import swift_helpers as h
from standins import swift_cpu, swift_megatron

LAYOUTS = {
    "tp2": dict(),
    "tp2-sp-padding_free-lora-entropy": dict(sequence_parallel=True, padding_free=True, tuner_type="lora",
                                             log_entropy=True, top_entropy_quantile=0.5),
    "pp2": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    swift_cpu.save_tiny_qwen2(str(folder))
    return str(folder)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_megatron_grpo_trains_as_shipped_without_the_logits(tmp_path, model, layout):
    arguments = swift_megatron.megatron_grpo_arguments(str(tmp_path), model, **layout)
    shipped, shipped_params = h.run_rlhf(str(tmp_path), arguments, processes=2, megatron=True)
    fused, fused_params = h.run_rlhf(str(tmp_path), arguments, twinkle_mem=True, processes=2, megatron=True)
    h.assert_same_training(shipped, shipped_params, fused, fused_params)
    assert any(entry["reward_std"] > 0 for entry in h.step_logs(shipped))  # the advantages are not all 0
    assert all(entry["grad_norm"] > 0 for entry in h.step_logs(shipped))
    if layout.get("log_entropy"):
        assert all(entry["entropy/entropy_mean"] > 0 for entry in h.step_logs(shipped))
    assert shipped["installed"] is None and fused["installed"]["fused_lm_head"] and fused["refused"] == {}
    log_probs = 3 * 4 * 3  # (the loss's, the old and the reference's) x 4 micro-batches x 3 steps
    assert shipped["calls"] == {"vocab_parallel_cross_entropy": log_probs}
    assert fused["calls"] == {"twinkle_mem.linear_selective_log_softmax": log_probs}
