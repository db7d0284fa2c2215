"""What the ms-swift tests share beyond the CPU stand-ins (``standins/swift_cpu.py``): ms-swift's own trainers run
for a few steps in a fresh interpreter (``run_rlhf``, ``swift_run.py``), recording what they logged (losses and
metrics at every step) and the trained parameters, and the comparison of two such runs."""
import json
import os

import torch

from standins.swift_cpu import OFFLINE


def run_rlhf(folder, arguments, *, twinkle_mem=None, env=None, timeout=600, processes=1, megatron=False):
    """ms-swift's training in a fresh interpreter (``swift_run.py``; ``processes`` > 1: as many under torchrun, gloo,
    one thread each; ``megatron``: Megatron-SWIFT's), as shipped or with twinkle-mem's plugin (``twinkle_mem=True``:
    its file added to ``--external_plugins``). Returns (the writing rank's result, the parameters)."""
    import subprocess
    import sys
    out = os.path.join(folder, "as_shipped" if not twinkle_mem else "twinkle_mem")
    os.makedirs(out, exist_ok=True)
    if twinkle_mem:
        from twinkle_mem.integrations.swift import PLUGIN
        arguments = {**arguments, "external_plugins": [*arguments.get("external_plugins", []), PLUGIN]}
    arguments = {**arguments, "output_dir": os.path.join(out, "train")}
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swift_run.py")
    environment = {**os.environ, **OFFLINE, **(env or {})}
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", "29593"]
        environment["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([*launcher, runner, json.dumps(arguments), out, *(["megatron"] if megatron else [])],
                          env=environment, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ms-swift's run failed ({done.returncode}):\n{done.stderr[-6000:]}")
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    result["stderr"] = done.stderr
    return result, torch.load(os.path.join(out, "params.pt"))


def step_logs(result):
    """The logged entries of each optimizer step (ms-swift's keys), the run's summary left out."""
    return [entry for entry in result["log_history"] if "train_runtime" not in entry]


TOLERANCE = 1e-5  # the bound, fp32: relative to the value where that is above 1 (DPO's summed log-probs)
TIMINGS = ("step_time", "train_speed(s/it)", "elapsed_time", "remaining_time", "train_runtime",
           "train_samples_per_second", "train_steps_per_second")


def assert_same_training(shipped, shipped_params, fused, fused_params, steps=3):
    """Both runs trained ``steps`` optimizer steps, logged the same keys with the same values at every step (the
    timings aside) and ended with the same parameters, within :data:`TOLERANCE`."""
    assert shipped["global_step"] == fused["global_step"] == steps
    a, b = step_logs(shipped), step_logs(fused)
    assert len(a) == len(b) == steps
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert set(x) == set(y), (step, set(x) ^ set(y))
        for key, value in x.items():
            if key in TIMINGS or not isinstance(value, (int, float)):
                continue
            assert abs(value - y[key]) <= TOLERANCE * max(1.0, abs(value)), (step, key, value, y[key])
    assert set(shipped_params) == set(fused_params)
    for name, value in shipped_params.items():
        assert (value - fused_params[name]).abs().max().item() <= TOLERANCE, name
