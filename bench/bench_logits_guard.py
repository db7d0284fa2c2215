"""Logits kept alive across twinkle-kit's Megatron ``forward_backward`` with 2 micro-batches,
before and after twinkle-mem's logits guard, each case in a fresh process.

    python bench/bench_logits_guard.py [--seq 4096] [--vocab 32000] [--reps 2]

twinkle-kit 0.5.1's real ``MegatronModel.forward_backward`` / ``forward_only`` on
megatron-core 0.16.1's real no-pipelining scheduler (gloo, world size 1, CPU),
around a one-layer bf16 toy LM (``standins.megatron.ToyLM``), ``return_logits=False``.
Per case: logits bytes still alive when the scheduler returns (weak references to
the logits' storages), the most logits bytes alive at once, the rise of the
resident-set high-water mark over the call, and its time.
What twinkle-mem ran in each measuring process (backend, CPU kernel path) is printed and recorded in the JSON;
where it would run the composite fallback, the run refuses to start unless --allow-composite.
Writes bench/results/local/bench_logits_guard.json and .png (another stem: --out; the recorded results: --out
bench/results/bench_logits_guard).
"""
import statistics

from bench_common import (RAN_SETUP, bench_parser, check_twinkle_mem, finish_figure, grouped_bars, logits_line,
                          new_figure, ran_line, run_metadata, write_json)
from standins import memory  # importable once bench_common has put the repository root on sys.path

VARIANTS = [
    ("twinkle-kit 0.5.1", None),
    ("+ logits guard", "integration.install(log_softmax=False, mask_skip='never')"),
    ("+ guard + twinkle-mem op", "integration.install(mask_skip='never')"),
]

SETUP = """
import torch
from standins import megatron as th
from twinkle_mem.integrations import twinkle as integration
megatron = th.megatron_cpu()  # kept referenced: left when the process ends
megatron.__enter__()
cpu = th.cpu_platform("cpu")
cpu.__enter__()
{install}
toy = th.ToyLM({vocab}, hidden={hidden}, dtype=torch.bfloat16)
model = th.twinkle_megatron_model(toy)
"""

STMT = """
toy.tracker = th.LogitsTracker()
samples = th.lm_samples([{seq}, {seq}], {vocab})
for s in samples:
    del s["attention_mask"]  # no dense mask: only logits differ between the cases
live = []
with th.sample_after_scheduler(toy.tracker, live):
    out = model.forward_backward(inputs=samples, micro_batch_size=1, forward_only={forward_only})
EXTRA.update(retained=live[0], peak_live=toy.tracker.peak, loss=out["loss"])
return out
"""


def main():
    parser = bench_parser(__doc__, "bench_logits_guard", seq=4096, vocab=32000, hidden=16, reps=2)
    args = parser.parse_args()
    check_twinkle_mem(args.allow_composite)  # the measuring processes import the same twinkle_mem

    import megatron.core
    import twinkle.version
    logits_bytes = args.seq * args.vocab * 2  # one micro-batch, bf16
    rows = []
    for forward_only in (False, True):
        for name, install in VARIANTS:
            got = memory.measure_in_subprocess(
                SETUP.format(install=install or "", vocab=args.vocab, hidden=args.hidden) + RAN_SETUP,
                STMT.format(seq=args.seq, vocab=args.vocab, forward_only=forward_only), reps=args.reps)
            extra = got["extra"]
            rows.append(dict(mode="forward_only" if forward_only else "forward_backward", case=name,
                             retained_bytes=extra["retained"], peak_live_logits_bytes=extra["peak_live"],
                             peak_rss_bytes=got["peak"], s_median=statistics.median(got["times"]),
                             loss=extra["loss"], ran=dict(extra["ran"], where=name)))
            r = rows[-1]
            print(f"{r['mode']:16} {name:26} retained {r['retained_bytes'] / 2**20:7.1f} MiB"
                  f"  peak live logits {r['peak_live_logits_bytes'] / 2**20:7.1f} MiB"
                  f"  peak RSS rise {r['peak_rss_bytes'] / 2**20:7.1f} MiB  {r['s_median']:6.2f} s"
                  f"  loss {r['loss']:.4f}", flush=True)

    ran = [r["ran"] for r in rows]
    meta = run_metadata(ran, seq=args.seq, vocab=args.vocab, hidden=args.hidden, micro_batches=2,
                        micro_batch_size=1, dtype="bfloat16", logits_bytes_per_micro_batch=logits_bytes,
                        reps=args.reps, threads=1,
                        twinkle_kit=twinkle.version.__version__, megatron_core=megatron.core.__version__)
    print(ran_line(meta))
    write_json(args.out + ".json", dict(meta=meta, rows=rows))
    _plot(rows, meta, args.out + ".png")


def _plot(rows, meta, path):
    modes = ["forward_backward", "forward_only"]
    fig = new_figure((12, 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    bars = (("retained_bytes", "retained at scheduler return"), ("peak_live_logits_bytes", "peak live logits"),
            ("peak_rss_bytes", "peak RSS rise"))
    for ax, mode in zip(axes, modes):
        sel = [r for r in rows if r["mode"] == mode]
        grouped_bars(ax, [r["case"] for r in sel], {label: [r[key] / 2**20 for r in sel] for key, label in bars},
                     width=0.27, fontsize=8)
        logits_line(ax, meta["logits_bytes_per_micro_batch"] / 2**20)
        ax.set_title(mode)
        ax.set_ylabel("MiB")
    axes[0].legend(fontsize=8)
    finish_figure(fig, f"twinkle-kit Megatron forward_backward, 2 micro-batches of [1, {meta['seq']}, "
                       f"{meta['vocab']}] bf16 logits, return_logits=False", path)


if __name__ == "__main__":
    main()
