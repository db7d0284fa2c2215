"""Vocab-parallel log-probs + entropy under tensor parallelism: twinkle-mem's path vs
gathering the full-vocab logits, on a gloo world of CPU processes (one thread each).

    python bench/bench_vocab_parallel.py [--n 1024] [--vocab 151936] [--tp 2 4] [--reps 3] [--out STEM]

Both paths compute full-vocab log-probs and entropy (temperature 1) from the
per-rank vocab shards [N, V/tp] bf16 and the gradient of each rank's shard:

- twinkle-mem: ``twinkle_mem.selective_log_softmax(shard, labels, True, process_group=...)``:
  one all_gather of O(N) fp32 statistics in the forward, nothing in the backward;
- gather logits: ``all_gather_into_tensor`` of the shards, a copy into [N, V] rows,
  then the single-process op on the full vocab (same kernels), the shard's
  gradient a slice of the full one (every rank computes the same; no scatter needed).

Bytes are counted from the tensors handed to the collectives, as received by one
rank from the others (all_gather: (tp - 1) x the per-rank message). Times are
the slowest rank's, median over --reps after one warm-up; peak is the largest
rise of a rank's resident-set high-water mark over one forward + backward
(above the shard, inputs allocated). The machine's cores are shared among the
tp processes: with tp > cores the timings are oversubscribed. What twinkle-mem ran in every rank (backend, CPU
kernel path) is named in the table and the JSON; where it would run the composite fallback, the run refuses to
start unless --allow-composite. Writes bench/results/local/vocab_parallel.{json,md,png} (another stem: --out; the
recorded results: --out bench/results/vocab_parallel).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from bench_common import (add_allow_composite, check_twinkle_mem, local_out, markdown_table, new_figure, ran_line,
                          run_metadata, save_png, twinkle_mem_ran, write_json)
from twinkle_mem.measure import peak_rss

MODES = ("twinkle-mem vocab-parallel", "all_gather logits + single-process op")


class _Counter:
    """Wraps an all_gather-style collective(out, inp, group=...) and counts the bytes received."""

    def __init__(self, fn):
        self.fn, self.bytes, self.calls = fn, 0, 0

    def __call__(self, out, inp, group=None, **kw):
        self.bytes += (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size()
        self.calls += 1
        return self.fn(out, inp, group=group, **kw)


def _worker(rank, world, mode, n, vocab, reps, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        import twinkle_mem
        import twinkle_mem.op.vocab_parallel as vp
        shard_v = vocab // world
        gen = torch.Generator().manual_seed(1234 + rank)
        shard = (torch.randn(n, shard_v, generator=gen) * 4).bfloat16()
        labels = torch.randint(0, shard_v * world, (n,), generator=torch.Generator().manual_seed(99))
        g = torch.Generator().manual_seed(7)
        g_logp, g_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)
        counter = _Counter(vp._all_gather_single)  # all_gather_single (or all_gather_into_tensor)
        if mode == 0:
            vp._all_gather_single = counter

        def step():
            x = shard.detach().requires_grad_()
            t0 = time.perf_counter()
            if mode == 0:
                logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, process_group=dist.group.WORLD)
            else:
                gathered = torch.empty(world * n, shard_v, dtype=x.dtype)
                counter(gathered, x.detach(), group=dist.group.WORLD)
                # [tp, N, V/tp] -> [N, V] rows (a copy); this rank's gradient is a slice of the full one.
                full = gathered.view(world, n, shard_v).permute(1, 0, 2).reshape(n, world * shard_v)
                full.requires_grad_()
                logp, entropy = twinkle_mem.selective_log_softmax(full, labels, True)
            t1 = time.perf_counter()
            if mode == 0:
                (grad,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), x)
            else:
                (grad_full,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), full)
                grad = grad_full[:, rank * shard_v:(rank + 1) * shard_v]
            t2 = time.perf_counter()
            return logp.detach(), entropy.detach(), grad, t1 - t0, t2 - t1

        step()  # warm-up
        counter.bytes = counter.calls = 0
        fwd, bwd = [], []
        for _ in range(reps):
            dist.barrier()
            logp, entropy, grad, tf, tb = step()
            t = torch.tensor([tf, tb], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            fwd.append(t[0].item())
            bwd.append(t[1].item())
        bytes_per_step = counter.bytes / reps
        calls_per_step = counter.calls / reps
        del logp, entropy, grad
        dist.barrier()
        with peak_rss() as rise:
            out = step()
        peak = torch.tensor([rise.bytes], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        ran = [None] * world
        dist.all_gather_object(ran, twinkle_mem_ran(where=f"tp={world} rank {rank}"))
        if rank == 0:
            torch.save(dict(logp=out[0], entropy=out[1]), os.path.join(out_dir, "out.pt"))
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(dict(fwd=fwd, bwd=bwd, bytes_per_step=bytes_per_step, calls_per_step=calls_per_step,
                               peak_bytes=peak.item(), shard_bytes=shard.numel() * shard.element_size(), ran=ran), f)
    finally:
        dist.destroy_process_group()


def _run(world, mode, args):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, mode, args.n, args.vocab, args.reps, os.path.join(tmp, "store"),
                                          tmp), nprocs=world, join=True, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
        out = torch.load(os.path.join(tmp, "out.pt"))
    return result, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=local_out("vocab_parallel"),
                        help="results file stem: writes OUT.json, OUT.md, OUT.png (default under bench/results/local/, "
                             "not tracked)")
    add_allow_composite(parser)
    args = parser.parse_args()
    check_twinkle_mem(args.allow_composite)  # the ranks import the same twinkle_mem
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for tp in args.tp:
        if args.vocab % tp:
            raise SystemExit(f"--vocab {args.vocab} is not divisible by tp {tp}")

    rows, ran = [], []
    for tp in args.tp:
        outs = []
        for mode, name in enumerate(MODES):
            r, out = _run(tp, mode, args)
            outs.append(out)
            ran += r["ran"]
            step = [f + b for f, b in zip(r["fwd"], r["bwd"])]
            row = dict(tp=tp, path=name, n=args.n, vocab=args.vocab, fwd_ms=1e3 * statistics.median(r["fwd"]),
                       bwd_ms=1e3 * statistics.median(r["bwd"]), step_ms=1e3 * statistics.median(step),
                       step_ms_all=[1e3 * s for s in step], collectives_per_step=r["calls_per_step"],
                       bytes_per_step=r["bytes_per_step"], bytes_per_token=r["bytes_per_step"] / args.n,
                       peak_bytes=r["peak_bytes"], shard_bytes=r["shard_bytes"])
            rows.append(row)
            print(f"tp={tp} {name:40} fwd {row['fwd_ms']:8.1f} ms  fwd+bwd {row['step_ms']:8.1f} ms  "
                  f"{row['bytes_per_token']:10.1f} B/token received per rank  "
                  f"peak +{row['peak_bytes'] / 2**20:7.1f} MiB", flush=True)
        diff = max((outs[0][k] - outs[1][k]).abs().max().item() for k in ("logp", "entropy"))
        for row in rows[-2:]:
            row["max_abs_diff_between_paths"] = diff

    meta = run_metadata(ran, n=args.n, vocab=args.vocab, dtype="bfloat16", reps=args.reps, threads=1,
                        threads_per_rank=1, backend="gloo")
    write_json(args.out + ".json", dict(meta=meta, rows=rows))
    table = _table(rows, meta)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    _plot(rows, meta, args.out + ".png")


def _table(rows, meta):
    title = (f"N={meta['n']}, V={meta['vocab']} bf16, gloo on CPU ({meta['cores']} cores, {meta['cpu']}), "
             f"1 thread per rank, torch {meta['torch']}, median of {meta['reps']}\n\n")
    header = ["tp", "path", "fwd ms", "fwd+bwd ms", "collectives / step", "bytes received / token / rank",
              "peak rise / rank MiB", "max abs diff logp/entropy between paths"]
    cells = [[r["tp"], r["path"], f"{r['fwd_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['collectives_per_step']:.0f}",
              f"{r['bytes_per_token']:,.1f}", f"{r['peak_bytes'] / 2**20:.0f}",
              f"{r['max_abs_diff_between_paths']:.2g}"] for r in rows]
    line = ran_line(meta)  # (none in a run recorded before it: its table re-renders as it was)
    return title + markdown_table(header, cells) + (f"\n{line}\n" if line else "")


def _plot(rows, meta, path):
    fig = new_figure((15, 4.2))
    axes = fig.subplots(1, 3)
    labels = [f"tp={r['tp']}\n{r['path'].split(' ')[0]}" for r in rows]
    colors = ["tab:green" if r["path"] == MODES[0] else "tab:red" for r in rows]
    for ax, key, scale, xlabel, log in ((axes[0], "step_ms", 1, "fwd+bwd time, slowest rank (ms)", False),
                                        (axes[1], "bytes_per_token", 1, "bytes received per token per rank", True),
                                        (axes[2], "peak_bytes", 2**-20, "peak memory rise per rank (MiB)", False)):
        ax.barh(labels, [r[key] * scale for r in rows], color=colors)
        ax.set_xlabel(xlabel)
        if log:
            ax.set_xscale("log")
        if ax is not axes[0]:
            ax.set_yticklabels([])
    fig.suptitle(f"vocab-parallel log-probs + entropy, N={meta['n']}, V={meta['vocab']} bf16, gloo CPU, "
                 f"green: twinkle-mem, red: all_gather logits")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
