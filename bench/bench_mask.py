"""Dense causal mask at collate time: twinkle-kit's builder vs twinkle-mem's skip vs
its one-allocation builder, peak memory and time, each case in a fresh process.

    python bench/bench_mask.py [--batch 1] [--seq 16384] [--reps 5]

Two levels: the mask builder alone, and twinkle's whole ``InputProcessor`` call as
``MegatronModel.forward_backward`` makes it (a simulated NPU for the skip, CUDA for
the dense path, tensors on the CPU). Peak = rise of the resident-set high-water mark
during one call (``/proc/self/status`` VmHWM, reset through ``clear_refs``).
What twinkle-mem ran in each measuring process (backend, CPU kernel path) is printed and recorded in the JSON;
where it would run the composite fallback, the run refuses to start unless --allow-composite.
Writes bench/results/local/bench_mask.json and .png (another stem: --out; the recorded results: --out
bench/results/bench_mask).
"""
import statistics

from bench_common import (RAN_SETUP, bench_parser, check_twinkle_mem, new_figure, ran_line, run_metadata, save_png,
                          write_json)
from standins import memory  # importable once bench_common has put the repository root on sys.path

BUILDER_SETUP = """
import torch
from twinkle.processor.base import InputProcessor
from twinkle_mem.processor import batch_attention_mask, dense_causal_mask
samples = [torch.ones({seq}, dtype=torch.long) for _ in range({batch})]
lengths = [{seq}] * {batch}
"""

PROCESSOR_SETUP = """
import torch
from standins import megatron as th
from twinkle.processor.base import InputProcessor
from twinkle_mem.integrations import twinkle as integration
platform = th.cpu_platform({platform!r})
platform.__enter__()
if {install!r}:
    integration.install(log_softmax=False, logits_guard=False)
processor = InputProcessor(framework="megatron")
"""

PROCESSOR_STMT = """
samples = th.lm_samples([{seq}] * {batch}, 32000)
out = processor(samples, micro_batch_size={batch}, variable_seq_lengths=False, attention_mask_type=None)
EXTRA["mask"] = None if out[0]["attention_mask"] is None else list(out[0]["attention_mask"].shape)
return out
"""

CASES = [
    # (level, name, setup, statement)
    ("builder", "twinkle-kit _create_4d_attention_mask", BUILDER_SETUP,
     "return InputProcessor._create_4d_attention_mask(samples)"),
    ("builder", "twinkle-mem skip (batch_attention_mask on npu)", BUILDER_SETUP,
     "return batch_attention_mask(lengths, device_type='npu')"),
    ("builder", "twinkle-mem dense_causal_mask", BUILDER_SETUP, "return dense_causal_mask(lengths)"),
    ("collate", "twinkle-kit 0.5.1, NPU", PROCESSOR_SETUP.replace("{platform!r}", "'npu'").replace(
        "{install!r}", "False"), PROCESSOR_STMT),
    ("collate", "twinkle-mem installed, NPU (skip)", PROCESSOR_SETUP.replace("{platform!r}", "'npu'").replace(
        "{install!r}", "True"), PROCESSOR_STMT),
    ("collate", "twinkle-mem installed, CUDA (dense)", PROCESSOR_SETUP.replace("{platform!r}", "'cuda'").replace(
        "{install!r}", "True"), PROCESSOR_STMT),
]


def main():
    parser = bench_parser(__doc__, "bench_mask", batch=1, seq=16384, reps=5)
    args = parser.parse_args()
    check_twinkle_mem(args.allow_composite)  # the measuring processes import the same twinkle_mem

    import twinkle.version
    mask_bytes = args.batch * args.seq * args.seq
    rows = []
    for level, name, setup, stmt in CASES:
        fmt = dict(batch=args.batch, seq=args.seq)
        got = memory.measure_in_subprocess(setup.format(**fmt) + RAN_SETUP, stmt.format(**fmt), reps=args.reps)
        times = sorted(t * 1e3 for t in got["times"])
        rows.append(dict(level=level, case=name, peak_bytes=got["peak"], peak_x_mask=got["peak"] / mask_bytes,
                         ms_median=statistics.median(times), ms_min=times[0], ms_max=times[-1],
                         mask=got["extra"].get("mask"), ran=dict(got["extra"]["ran"], where=f"{level}: {name}")))
        r = rows[-1]
        print(f"{level:8} {name:48} peak {r['peak_bytes'] / 2**20:8.1f} MiB ({r['peak_x_mask']:4.2f}x mask)"
              f"  median {r['ms_median']:8.2f} ms  [min {r['ms_min']:.2f}, max {r['ms_max']:.2f}]", flush=True)

    ran = [r["ran"] for r in rows]
    meta = run_metadata(ran, batch=args.batch, seq=args.seq, mask_bytes=mask_bytes, reps=args.reps, threads=1,
                        twinkle_kit=twinkle.version.__version__)
    print(ran_line(meta))
    write_json(args.out + ".json", dict(meta=meta, rows=rows))
    _plot(rows, meta, args.out + ".png")


def _plot(rows, meta, path):
    fig = new_figure((12, 4.5))
    ax_mem, ax_time = fig.subplots(1, 2)
    labels = [f"{r['level']}: {r['case']}" for r in rows]
    colors = ["tab:red" if "twinkle-kit" in r["case"] else "tab:green" for r in rows]
    ax_mem.barh(labels, [r["peak_bytes"] / 2**20 for r in rows], color=colors)
    ax_mem.axvline(meta["mask_bytes"] / 2**20, color="k", ls="--", lw=1, label="mask size")
    ax_mem.set_xlabel("peak memory rise (MiB)")
    ax_mem.legend()
    ax_time.barh(labels, [r["ms_median"] for r in rows], color=colors)
    ax_time.set_xlabel("median time (ms)")
    ax_time.set_yticklabels([])
    fig.suptitle(f"[B={meta['batch']}, 1, S={meta['seq']}, S] bool mask, CPU, 1 thread, torch {meta['torch']}")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
