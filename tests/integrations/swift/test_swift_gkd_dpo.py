"""ms-swift's own GKD (a local teacher's full logits, and its top k) and DPO, 3 steps on the CPU with a tiny Qwen2, as
shipped and with twinkle-mem's plugin: equal losses, logged metrics and parameters within 1e-5 (fp32), the step
count asserted (GKD with small data and its default accumulation trains 0 steps). GKD's loss came from
``linear_gkd_full`` / ``linear_gkd_topk`` (the student's logits never built), DPO's log-probs from the op."""

import pytest

import swift_helpers as h
from standins import swift_cpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    student, teacher = str(folder / "student"), str(folder / "teacher")
    swift_cpu.save_tiny_qwen2(student)
    swift_cpu.save_tiny_qwen2(teacher, seed=1)  # (teacher = student gives 0)
    return student, teacher


@pytest.mark.parametrize("teacher_kind", [dict(), dict(gkd_logits_topk=8, temperature=0.7)], ids=["full", "top8-T0.7"])
def test_gkd_trains_as_ms_swift_ships_it_without_the_students_logits(tmp_path, models, teacher_kind):
    arguments = swift_cpu.gkd_arguments(str(tmp_path), *models, **teacher_kind)
    shipped, shipped_params = h.run_rlhf(str(tmp_path), arguments)
    fused, fused_params = h.run_rlhf(str(tmp_path), arguments, twinkle_mem=True)
    h.assert_same_training(shipped, shipped_params, fused, fused_params)
    assert all(entry["loss"] > 0 for entry in h.step_logs(shipped))
    head = "twinkle_mem.linear_gkd_topk" if teacher_kind else "twinkle_mem.linear_gkd_full"
    assert fused["calls"] == {head: 3} and shipped["calls"] == {}


def test_dpo_trains_as_ms_swift_ships_it_on_the_op(tmp_path, models):
    arguments = swift_cpu.dpo_arguments(str(tmp_path), models[0])
    shipped, shipped_params = h.run_rlhf(str(tmp_path), arguments)
    fused, fused_params = h.run_rlhf(str(tmp_path), arguments, twinkle_mem=True)
    h.assert_same_training(shipped, shipped_params, fused, fused_params)
    assert any(entry["rewards/margins"] != 0 for entry in h.step_logs(shipped))
    calls = shipped["calls"]["rlhf_mixin.selective_log_softmax"]  # (policy and reference, each step)
    assert calls == 6 and fused["calls"] == {"twinkle_mem.selective_log_softmax": calls}
