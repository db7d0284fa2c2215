"""TWINKLE_MEM_INSTALL reaches twinkle's Ray workers (issue 25), with a real Ray on the CPU.

tests/integrations/twinkle/ray_twinkle_step.py runs twinkle's Ray mode as its RL recipes do: a training model and a
reference model (TransformersModel with remote_group) in Ray workers, the variable set only in the driver and only
after ray.init (so it reaches the workers through twinkle's copy of the driver's environment, not through
Ray's own processes). No install() is called anywhere. Both workers must report twinkle-mem installed with
the variable's options and log their line, and their log-probs must be bitwise those of the same step with
install() in-process (fp32, and different from twinkle-kit as shipped: a bf16 model there gives bf16
log-probs). The workarounds twinkle-kit 0.5.1 needs on a CPU-only machine are named and explained in that
script. Each run is a process group of its own, killed whatever happens, so Ray never outlives the test.
"""
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from ray_twinkle_step import LENGTHS, PROMPT, VAR

from standins.twinkle_ray import run_driver

pytestmark = pytest.mark.e2e  # a real Ray session: the end-to-end tier (pyproject.toml)

HERE = Path(__file__).resolve().parent
VALUE = "fused_lm_head"


@pytest.fixture(scope="module")
def tiny_bf16_model(tmp_path_factory):
    from standins.mcore_bridge import save_tiny_qwen3
    path = tmp_path_factory.mktemp("tiny_qwen3_bf16")
    save_tiny_qwen3(str(path), dtype=torch.bfloat16)
    return path


def run_step(out: Path, model_dir: Path, mode: str, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != VAR}  # the Ray run's driver sets it itself
    cmd = [sys.executable, "-W", "ignore", str(HERE / "ray_twinkle_step.py"), str(out), str(model_dir), mode, VALUE]
    started = time.time()
    returncode, output = run_driver(cmd, env, timeout)  # its process group (Ray's GCS, raylet, workers) ended
    assert returncode == 0, output[-6000:]
    return torch.load(out, weights_only=False), output, time.time() - started


def test_ray_workers_installed_by_the_driver_variable_alone(tmp_path, tiny_bf16_model):
    ray_run, output, seconds = run_step(tmp_path / "ray.pt", tiny_bf16_model, "ray")
    in_process, _, _ = run_step(tmp_path / "installed.pt", tiny_bf16_model, "local-installed")
    shipped, _, _ = run_step(tmp_path / "shipped.pt", tiny_bf16_model, "local")
    print(f"Ray run: {seconds:.1f} s")

    assert ray_run["plain_task_sees"] is None  # Ray's own processes never saw the variable
    workers = ray_run["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers} | {ray_run["driver_pid"]}) == 3
    for worker in workers:  # the training model's and the reference model's
        assert worker["variable"] == VALUE
        assert worker["settings"] == {"log_softmax": True, "mask_skip": "npu", "logits_guard": True,
                                      "fused_lm_head": True, "fused_chunk_bytes": None}
        lines = [line for line in output.splitlines() if f"pid={worker['pid']})" in line and "twinkle_mem.startup" in line]
        assert len(lines) == 1 and "install(fused_lm_head=True)" in lines[0] and "rank 0" in lines[0], output[-6000:]

    keep = torch.ones(len(LENGTHS), max(LENGTHS), dtype=torch.bool)  # the positions whose labels count
    for row, n in enumerate(LENGTHS):
        keep[row, :PROMPT] = False
        keep[row, n - 1:] = False
    assert ray_run["loss"] == in_process["loss"]
    for key in ("logps", "ref_logps"):  # the training model's forward_backward, the reference's forward_only
        assert ray_run[key].dtype == in_process[key].dtype == torch.float32
        assert torch.equal(ray_run[key], in_process[key]), key
        assert shipped[key].dtype == torch.bfloat16
        assert (shipped[key].float() - ray_run[key])[keep].abs().max() > 1e-3  # shipped's bf16 rounding
