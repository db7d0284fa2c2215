"""ms-swift's own GRPO, 3 steps on the CPU with a tiny Qwen2, as shipped and with twinkle-mem's plugin in
``--external_plugins``: equal losses, logged metrics and parameters within 1e-5 (fp32), the step count asserted, a
reward that varies (its standard deviation is logged above 0); the log-probs of the plugin's run came from
``linear_selective_log_softmax`` (old, reference and the loss's), TRL's functions never called there. Full and LoRA
in one process; sequence parallelism 2 in two (torchrun, gloo: ms-swift's Ulysses split runs on the CPU)."""
import pytest

import swift_helpers as h
from standins import swift_cpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    swift_cpu.save_tiny_qwen2(str(folder))
    return str(folder)


@pytest.mark.parametrize("tuning, processes", [
    (dict(tuner_type="full"), 1), (dict(tuner_type="lora", temperature=0.7), 1),
    (dict(tuner_type="full", sequence_parallel_size=2, temperature=0.7), 2)], ids=["full", "lora-T0.7", "sp2-T0.7"])
def test_grpo_trains_as_ms_swift_ships_it_without_the_logits(tmp_path, model, tuning, processes):
    arguments = swift_cpu.grpo_arguments(str(tmp_path), model, **tuning)
    shipped, shipped_params = h.run_rlhf(str(tmp_path), arguments, processes=processes)
    fused, fused_params = h.run_rlhf(str(tmp_path), arguments, twinkle_mem=True, processes=processes)
    h.assert_same_training(shipped, shipped_params, fused, fused_params)
    assert any(entry["reward_std"] > 0 for entry in h.step_logs(shipped))  # the advantages are not all 0
    assert any(entry["grad_norm"] > 0 for entry in h.step_logs(shipped))
    assert shipped["installed"] is None and fused["installed"]["fused_lm_head"] and fused["refused"] == {}
    assert shipped["calls"].get("grpo_trainer.selective_log_softmax", 0) >= 3 * 2  # the loss's, the reference's
    assert "grpo_trainer.selective_log_softmax" not in fused["calls"]
    assert fused["calls"]["twinkle_mem.linear_selective_log_softmax"] == shipped["calls"][
        "grpo_trainer.selective_log_softmax"]
