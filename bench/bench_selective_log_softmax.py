"""Benchmark: per-token log-probs + entropy, forward + backward, every peer side by side.

Each (peer, N) runs in a fresh process so that its peak RSS is its own:
  naive          log_softmax(logits.float()) + gather (+ entropy from the same tensor)
  twinkle_loop   twinkle-kit 0.5.1's selective_log_softmax (its per-row loop, bf16 branch),
                 imported from twinkle-kit when installed, else an equivalent written here
  chunked_fp32   a chunked fp32 recompute autograd.Function in PyTorch (the fix proposed
                 for twinkle-kit)
  compiled       torch.compile of naive
  twinkle_mem    this package; twinkle_mem_inplace: with inplace_backward=True
Reported at every N: forward+backward time (median of --reps calls after a warm-up call, and
their spread), peak RSS beyond logits and grad, bytes saved for backward (beyond the logits
reference), max error of logp and entropy against float64 (first 64 rows). Also recorded: where
twinkle_loop came from, and how loaded the machine was (load average, other processes' CPU; a
warning when it was loaded). Prints a table, writes JSON and a PNG: one figure, fwd+bwd time and
peak memory against N, every peer (--replot redraws it from the JSON without measuring). A run
writes to bench/results/local/ (not tracked); --record writes the committed bench/results/ files.

  python bench/bench_selective_log_softmax.py                      # N=512,1024,2048, V=151936
  python bench/bench_selective_log_softmax.py --sizes 16384 --peers twinkle_mem_inplace --reps 1
  python bench/bench_selective_log_softmax.py --replot --record       # the committed PNG from its JSON
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench_common import (ChildFailed, MachineLoad, Progress, load_warning, new_figure, read_json, run_child,
                          run_metadata, save_png, write_json)

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ["naive", "twinkle_loop", "chunked_fp32", "compiled", "twinkle_mem", "twinkle_mem_inplace"]
NAME = "selective_log_softmax"
RECORDED = os.path.join(HERE, "results", NAME)  # the committed results: --record
LOCAL = os.path.join(HERE, "results", "local", NAME)  # a user's run (bench/results/local/ is not tracked)
TWINKLE_LOOP_COPY = "this script's copy of its algorithm (twinkle-kit not installed)"


def twinkle_loop_source() -> str:
    """Where the twinkle_loop peer comes from: twinkle-kit, or (without it, as with `.[bench]` alone)
    the copy written here."""
    try:
        from twinkle.utils.torch_utils import selective_log_softmax  # noqa: F401
    except ImportError:
        return TWINKLE_LOOP_COPY
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"twinkle-kit {version('twinkle-kit')}"
    except PackageNotFoundError:
        return "twinkle-kit"


# ----------------------------------------------------------------- peers (run in the child)
def peer_functions(torch):
    import torch.nn.functional as F

    def naive(logits, labels):
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def twinkle_loop(logits, labels):
        try:
            from twinkle.utils.torch_utils import selective_log_softmax
        except ImportError:  # the same algorithm: one full-vocab log_softmax per leading row, in bf16
            def selective_log_softmax(lg, index, return_entropy=False):
                logps, ents = [], []
                for row, row_labels in zip(lg, index):
                    row_logps = F.log_softmax(row, dim=-1)
                    logps.append(row_logps.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1))
                    ents.append(-(row_logps.exp() * row_logps).sum(-1))
                return torch.stack(logps), torch.stack(ents)
        logp, entropy = selective_log_softmax(logits.unsqueeze(0), labels.unsqueeze(0), return_entropy=True)
        return logp[0], entropy[0]

    class ChunkedFP32(torch.autograd.Function):
        CHUNK = 256

        @staticmethod
        def forward(ctx, logits, labels):
            logp = torch.empty(logits.shape[0], dtype=torch.float32)
            entropy = torch.empty_like(logp)
            lse = torch.empty_like(logp)
            mean = torch.empty_like(logp)
            for s in range(0, logits.shape[0], ChunkedFP32.CHUNK):
                x = logits[s:s + ChunkedFP32.CHUNK].float()
                lse[s:s + x.shape[0]] = torch.logsumexp(x, -1)
                p = torch.exp(x - lse[s:s + x.shape[0], None])
                mean[s:s + x.shape[0]] = (p * x).sum(-1)
                logp[s:s + x.shape[0]] = x.gather(-1, labels[s:s + x.shape[0], None])[:, 0] - lse[s:s + x.shape[0]]
            entropy = lse - mean
            ctx.save_for_backward(logits, labels, lse, mean)
            return logp, entropy

        @staticmethod
        def backward(ctx, g_logp, g_entropy):
            logits, labels, lse, mean = ctx.saved_tensors
            grad = torch.empty_like(logits)
            for s in range(0, logits.shape[0], ChunkedFP32.CHUNK):
                e = min(s + ChunkedFP32.CHUNK, logits.shape[0])
                x = logits[s:e].float()
                p = torch.exp(x - lse[s:e, None])
                d = -g_logp[s:e, None] * p - g_entropy[s:e, None] * p * (x - mean[s:e, None])
                d.scatter_add_(-1, labels[s:e, None], g_logp[s:e, None])
                grad[s:e] = d
            return grad, None

    def chunked_fp32(logits, labels):
        return ChunkedFP32.apply(logits, labels)

    def twinkle_mem_fn(inplace):
        import twinkle_mem

        def run(logits, labels):
            return twinkle_mem.selective_log_softmax(logits, labels, True, inplace_backward=inplace)
        return run

    return {
        "naive": naive,
        "twinkle_loop": twinkle_loop,
        "chunked_fp32": chunked_fp32,
        "compiled": torch.compile(naive, dynamic=False),
        "twinkle_mem": twinkle_mem_fn(False),
        "twinkle_mem_inplace": twinkle_mem_fn(True),
    }


def child(peer, n, v, reps):
    import torch

    from twinkle_mem.measure import peak_rss

    torch.manual_seed(0)
    fn = peer_functions(torch)[peer]
    base_logits = (torch.randn(n, v) * 2).bfloat16()
    labels = torch.randint(0, v, (n,))
    logits_bytes = base_logits.numel() * base_logits.element_size()

    def run_once():
        logits = base_logits.clone().requires_grad_() if peer == "twinkle_mem_inplace" else base_logits.requires_grad_()
        with peak_rss() as peak:
            t0 = time.perf_counter()
            logp, entropy = fn(logits, labels)
            (grad,) = torch.autograd.grad(logp.sum() + 0.01 * entropy.sum(), logits)
            elapsed = time.perf_counter() - t0
        grad_bytes = 0 if grad.data_ptr() == logits.data_ptr() else logits_bytes
        return elapsed, peak.bytes - grad_bytes, logp.detach(), entropy.detach()

    run_once()  # warm-up (and compile)
    times, extra_peak = [], None
    for r in range(reps):
        elapsed, extra, logp, entropy = run_once()
        times.append(elapsed)
        extra_peak = extra if extra_peak is None else min(extra_peak, extra)

    # Saved for backward, beyond the logits reference.
    saved = []
    logits = base_logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(logits, labels)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved
                      if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr())

    rows = slice(0, min(64, n))
    z = base_logits[rows].double()
    ref_lse = torch.logsumexp(z, -1)
    ref_logp = z.gather(-1, labels[rows, None])[:, 0] - ref_lse
    ref_entropy = ref_lse - (torch.softmax(z, -1) * z).sum(-1)
    err_logp = (logp[rows].double() - ref_logp).abs().max().item()
    err_entropy = (entropy[rows].double() - ref_entropy).abs().max().item()
    out = {"peer": peer, "n": n, "v": v, **time_summary(times), "extra_peak_bytes": extra_peak,
           "logits_bytes": logits_bytes, "saved_bytes": saved_bytes, "err_logp": err_logp,
           "err_entropy": err_entropy, "logp_dtype": str(logp.dtype)}
    if peer == "twinkle_loop":
        out["source"] = twinkle_loop_source()
    return out


def time_summary(times) -> dict:
    """The median of the calls and their spread ((max - min) / median): one call can be an outlier."""
    times = sorted(times)
    median = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
    return {"time_s": median, "times_s": times, "spread": (times[-1] - times[0]) / median if median else 0.0}


# ----------------------------------------------------------------- orchestration (parent)
def run_peer(peer, n, v, reps, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--sizes", str(n), "--vocab", str(v),
           "--reps", str(reps)]
    try:
        return run_child(cmd, timeout)
    except subprocess.TimeoutExpired:
        return {"peer": peer, "n": n, "v": v, "error": f"timed out after {timeout}s"}
    except ChildFailed as e:
        return {"peer": peer, "n": n, "v": v, "error": e.last_line[:200]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024,2048", help="token counts N")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--reps", type=int, default=5, help="timed calls per (peer, N), after a warm-up call")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (peer, N) process")
    ap.add_argument("--out", help=f"results path without extension (default {os.path.relpath(LOCAL)}; "
                                  f"with --record {os.path.relpath(RECORDED)}, the committed results)")
    ap.add_argument("--record", action="store_true", help="write (or --replot) the committed results")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT.png from OUT.json (no measurement)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = RECORDED if args.record else LOCAL
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        write_plot(args.out)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(child(args.child, sizes[0], args.vocab, args.reps)))
        return

    peers = args.peers.split(",")
    results = []
    progress = Progress(len(peers) * len(sizes))
    load = MachineLoad()
    for n, peer in ((n, p) for n in sizes for p in peers):
        progress.step(f"{peer:20s} N={n:6d} V={args.vocab}")
        r = run_peer(peer, n, args.vocab, args.reps, args.timeout)
        results.append(r)
        progress.done(r.get("error") or f"{r['time_s']:.3f} s (spread {r['spread']:.0%}), extra peak "
                                        f"{r['extra_peak_bytes'] / 2**20:.0f} MiB")
    meta = run_metadata(vocab=args.vocab, reps=args.reps, load=load.record())
    print()
    print(render_table(results, meta))
    warning = load_warning(meta["load"])
    if warning:
        print(warning)
    write_json(args.out + ".json", {"meta": meta, "results": results}, indent=1)
    print(f"\nwrote {args.out}.json")
    write_plot(args.out)


def render_table(results, meta) -> str:
    """The console table: every N, each peer's median time, the spread of its calls, the ratio against
    torch.compile at the same N, memory, saved bytes and errors; a footnote where twinkle_loop is not
    twinkle-kit's own."""
    lines = [f"selective log-softmax + entropy, fwd+bwd, V={meta['vocab']}, bf16 logits, torch {meta['torch']}, "
             f"{meta['threads']} threads, {meta['cpu']}; median of {meta['reps']} calls"]
    header = f"{'N':>6s} {'peer':22s} {'fwd+bwd s':>10s} {'spread':>7s} {'vs compiled':>11s} " \
             f"{'peak beyond logits+grad':>24s} {'saved bytes':>12s} {'err logp':>9s} {'err H':>9s}"
    lines += [header, "-" * len(header)]
    copies = False
    for n in sorted({r["n"] for r in results}):
        rows = [r for r in results if r["n"] == n]
        ref_time = next((r["time_s"] for r in rows if r["peer"] == "compiled" and "error" not in r), None)
        for r in rows:
            name = r["peer"]
            if r.get("source") == TWINKLE_LOOP_COPY:
                name, copies = name + " *", True
            if "error" in r:
                lines.append(f"{n:6d} {name:22s} {r['error']}")
                continue
            ratio = f"{ref_time / r['time_s']:.1f}x" if ref_time else "-"
            peak = f"{r['extra_peak_bytes'] / 2**20:8.0f} MiB ({r['extra_peak_bytes'] / r['logits_bytes']:5.1%})"
            lines.append(f"{n:6d} {name:22s} {r['time_s']:10.3f} {r.get('spread', 0):7.0%} {ratio:>11s} "
                         f"{peak:>24s} {r['saved_bytes']:12d} {r['err_logp']:9.1e} {r['err_entropy']:9.1e}")
    if copies:
        lines.append(f"* twinkle_loop: {TWINKLE_LOOP_COPY}; install twinkle-kit (`.[test]`) to time its own function")
    return "\n".join(lines)


# ----------------------------------------------------------------- figure
def results_figure(data):
    """One figure, two panels against N: fwd+bwd time (log-log) and peak memory beyond logits + grad
    (symlog: twinkle-mem's 0 stays on the axis), a line per peer. ``data``: the JSON this script writes."""
    results = [r for r in data["results"] if "error" not in r]
    peers = list(dict.fromkeys(r["peer"] for r in results))
    fig = new_figure((12, 4.5))
    ax_time, ax_mem = fig.subplots(1, 2)
    markers = "osD^vP*X"
    for i, peer in enumerate(peers):
        mine = sorted((r for r in results if r["peer"] == peer), key=lambda r: r["n"])
        n = [r["n"] for r in mine]
        style = dict(marker=markers[i % len(markers)], linestyle="-" if i % 2 == 0 else "--", label=peer)
        ax_time.plot(n, [r["time_s"] for r in mine], **style)
        ax_mem.plot(n, [r["extra_peak_bytes"] / 2**20 for r in mine], **style)
    sizes = sorted({r["n"] for r in results})
    ax_time.set_xscale("log", base=2)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("forward + backward time (s)")
    reps = data.get("meta", {}).get("reps")  # (results recorded before it: reps at the largest N only)
    ax_time.set_title(f"fwd+bwd time (median of {reps} calls)" if reps else
                      "fwd+bwd time (median of reps at the largest N, else 1 call)", fontsize=9)
    ax_mem.set_xscale("log", base=2)
    ax_mem.set_yscale("symlog", linthresh=1)
    ax_mem.set_ylabel("peak RSS beyond logits + grad (MiB)")
    ax_mem.set_title("fwd+bwd peak memory", fontsize=9)
    ax_mem.set_ylim(bottom=-0.3)  # 0 MiB (twinkle-mem) on the axis, not under it
    for ax in (ax_time, ax_mem):
        ax.set_xlabel("tokens N")
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xticks([], minor=True)
        ax.grid(alpha=0.3, which="both")
    handles, labels = ax_time.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    meta = data.get("meta", {})
    fig.suptitle(f"selective log-softmax + entropy, V={meta.get('vocab')}, bf16 logits, torch {meta.get('torch')}, "
                 f"{meta.get('threads')} threads, {meta.get('machine')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    return fig


def write_plot(out):
    """``out``.png from ``out``.json (no measurement)."""
    data = read_json(out + ".json")
    try:
        fig = results_figure(data)
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    save_png(fig, out + ".png")
    print(f"wrote {out}.png")

if __name__ == "__main__":
    main()
