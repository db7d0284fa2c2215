"""bench/bench_swift.py's measure of a GRPO step (ms-swift not needed): the rollout's peak and the peak of the step
after it apart, each seeing its own temporaries only, and the table's row from every process's record."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # where `python bench/<script>.py` finds it
    sys.path.insert(0, str(BENCH))

import bench_swift  # noqa: E402

# A step that allocates 160 MiB before its rollout (neither part's); a rollout of 96 MiB at its peak that leaves 8 MiB
# held and 64 MiB in an unreferenced cycle; then 32 MiB after it, once the collector ran (as it may, anywhere): without
# the garbage dropped before the mark reset, the 64 MiB it frees would hide the 32. Each temporary touched and freed.
# A second step calls two rollouts.
STEP = textwrap.dedent("""
    import gc, json, sys
    import torch
    sys.path.insert(0, {bench!r})
    from bench_swift import StepMeter

    class Trainer:
        def rollout(self):
            generated = torch.ones(88 << 18)
            self.kept = torch.ones(8 << 18)
            del generated
            cycle = [torch.ones(64 << 18)]
            cycle.append(cycle)

        def step(self, rollouts=1):
            before = torch.ones(160 << 18)
            del before
            for _ in range(rollouts):
                self.rollout()
            gc.collect()
            after = torch.ones(32 << 18)
            del after

    gc.disable()  # (the collector runs where the test says)
    meter = StepMeter()
    Trainer.step, Trainer.rollout = meter.step(Trainer.step), meter.rollout(Trainer.rollout)
    Trainer().step()
    try:
        Trainer().step(rollouts=2)
    except RuntimeError as refused:
        print(refused)
    print(json.dumps(meter.records))
""")


def test_the_rollout_and_the_step_after_it_are_measured_apart():
    out = subprocess.run([sys.executable, "-c", STEP.format(bench=str(BENCH))], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "the step called 2 rollouts: its measure expects 1"
    [record] = json.loads(out[1])
    assert 92 <= record["rollout"]["peak_mib"] <= 104, record  # 88 + 8 MiB, not the 160 before it
    assert 30 <= record["after_rollout"]["peak_mib"] <= 40, record  # 32 MiB, not the rollout's 96 nor 32 - 64
    assert record["garbage_mib"][1] >= 60, record  # the rollout's cycle, dropped before the mark reset
    assert record["seconds"] >= record["rollout"]["seconds"] + record["after_rollout"]["seconds"] - 0.01


def _record(after, rollout, seconds, rollout_seconds, logit_rows, loss, installed=False):
    return dict(step=dict(seconds=seconds, rollout=dict(peak_mib=rollout, seconds=rollout_seconds),
                          after_rollout=dict(peak_mib=after, seconds=seconds - rollout_seconds),
                          garbage_mib=[0.0, 1.0]),
                micro_batch=dict(sequences=8, tokens=4096, logit_rows=logit_rows), loss=loss, completion_tokens=442,
                twinkle_mem_installed=installed)


def test_a_row_takes_the_largest_peaks_the_slowest_times_and_one_process_logits():
    records = [_record(2374.2, 2906.0, 100.0, 80.0, 4096, None), _record(2300.0, 2950.4, 109.4, 70.0, 4096, 0.5)]
    records[0]["twinkle_mem_installed"] = True  # (the table says what the first process says)
    row = bench_swift.summarize("megatron_twinkle", records, vocab=151936)
    peaks_and_times = (row["peak_mib"], row["rollout_peak_mib"], row["seconds"], row["rollout_seconds"])
    assert peaks_and_times == (2374.2, 2950.4, 109.4, 80.0)
    assert row["logits_mib"] == 4096 * 151936 // 2 * 4 / 2**20 and row["loss"] == 0.5  # TP = 2: half the vocab
    dp = bench_swift.summarize("shipped", [_record(8000.0, 20.0, 60.0, 30.0, 3544, 0.25)] * 2, vocab=151936)
    assert dp["logits_mib"] == 3544 * 151936 * 4 / 2**20  # DP: the whole vocab
    text = bench_swift.table([dp, row])
    assert "| path | step peak after the rollout | rollout peak | step time | of which rollout |" in text
    assert ("| twinkle-mem's plugin (the output layer's input) | 2,374 MiB | 2,950 MiB | 109.4 s | 80.0 s | 29.4 s "
            "| 1,187 MiB (8 x 512) | 0.5 | yes |") in text
    assert ("| ms-swift 4.6 as shipped | 8,000 MiB | 20 MiB | 60.0 s | 30.0 s | 30.0 s | 2,054 MiB (8 x 512) | 0.25 "
            "| no |") in text
