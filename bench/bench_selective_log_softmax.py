"""Benchmark: per-token log-probs + entropy, forward + backward, every peer side by side.

Each (peer, N) runs in a fresh process so that its peak RSS is its own:
  naive          log_softmax(logits.float()) + gather (+ entropy from the same tensor)
  twinkle_loop   twinkle-kit 0.5.1's selective_log_softmax (its per-row loop, bf16 branch),
                 imported from twinkle-kit when installed, else an equivalent written here
  chunked_fp32   a chunked fp32 recompute autograd.Function in PyTorch (the fix proposed
                 for twinkle-kit)
  compiled       torch.compile of naive
  twinkle_mem    this package; twinkle_mem_inplace: with inplace_backward=True; each once per CPU
                 kernel path of --paths (default: the one an op call takes on this machine, e.g.
                 twinkle_mem@avx512_bf16; --paths all: every path this CPU runs, the portable one too)
Reported at every N: forward+backward time (median of --reps calls after a warm-up call, and
their spread), its ratio to the floor (below), peak RSS beyond logits and grad, bytes saved for
backward (beyond the logits reference), max error of logp and entropy against float64 (first 64
rows). Also recorded: where twinkle_loop came from, and how loaded the machine was (load average,
other processes' CPU; a warning when it was loaded). Prints a table, writes JSON and a PNG: one
figure, fwd+bwd time and peak memory against N, every peer (--replot redraws it from the JSON
without measuring). A run writes to bench/results/local/ (not tracked); --record writes the
committed bench/results/ files.

The floors, measured in each peer's process, alternating with its calls: one streaming read of the
logits (torch.max over their int16 view) and one in-place read + write (bitwise_xor_(0) on it);
each call's time is divided by the floor measured just before it, and the median of those ratios is
reported with their quartiles. twinkle_mem_inplace@<path> also times the op itself against them
(--op-reps alternating calls each; issue 34's ratios and issue 41's): forward without entropy / read,
forward with entropy / read, forward with entropy + in-place backward / (read + read-write) (the raw
ops), the in-place backward alone / read-write, and the public path: selective_log_softmax(...,
inplace_backward=True) and .backward() through autograd, on logits that are an intermediate (a view of
a leaf: its own backward costs nothing) and on leaf logits (the gradient kept in their .grad), each /
(read + read-write). Every twinkle_mem row, the table and the JSON say which backend ran (the native CPU
kernels or the composite) and on which CPU kernel path; a run where twinkle_mem's native CPU library is not
loaded (a source tree on PYTHONPATH with no library built) refuses to start unless --allow-composite.

  python bench/bench_selective_log_softmax.py                      # N=512,1024,2048, V=151936, this CPU's path
  python bench/bench_selective_log_softmax.py --paths all          # every CPU kernel path, the portable one too
  python bench/bench_selective_log_softmax.py --sizes 2048 --peers twinkle_mem_inplace --op-reps 31
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

from bench_common import (ChildFailed, MachineLoad, Progress, add_allow_composite, check_twinkle_mem, load_warning,
                          local_out, merge_ran, new_figure, ran_line, read_json, run_child, run_metadata, save_png,
                          twinkle_mem_ran, write_json)

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ["naive", "twinkle_loop", "chunked_fp32", "compiled", "twinkle_mem", "twinkle_mem_inplace"]
PATH_PEERS = ("twinkle_mem", "twinkle_mem_inplace")  # run once per CPU kernel path, as peer@path
CPU_ISA_ENV = "TWINKLE_MEM_CPU_ISA"  # the cap of the CPU kernel path (twinkle_mem.op.native)
# The op against its floors (issues 34 and 41, N=2048, 2 threads): name -> (target, floor it is divided by).
OP_TARGETS = {"fwd": 1.6, "fwd_entropy": 2.0, "fwd_entropy_bwd_inplace": 2.0, "bwd_inplace": 2.0,
              "public_intermediate": 2.0, "public_leaf": 2.0}
OP_FLOORS = {"fwd": "read", "fwd_entropy": "read", "fwd_entropy_bwd_inplace": "read+rw", "bwd_inplace": "rw",
             "public_intermediate": "read+rw", "public_leaf": "read+rw"}
NAME = "selective_log_softmax"
RECORDED = os.path.join(HERE, "results", NAME)  # the committed results: --record
LOCAL = local_out(NAME)  # a user's run (bench/results/local/ is not tracked)
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


def floor_functions(logits):
    """The floors: one streaming read of the logits, one in-place read + write (their values unchanged)."""
    import torch
    bits = logits.detach().view(torch.int16)
    return (lambda: bits.max()), (lambda: bits.bitwise_xor_(0))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def op_ratios(base_logits, labels, reps):
    """The op itself against its floors, alternating (OP_TARGETS: issue 34's ratios and issue 41's): per
    call, the ratio to the floor timed just before it; their median and quartiles, and the floors'
    median times. The raw ops (torch.ops.twinkle_mem) and the public function through autograd."""
    import torch

    import twinkle_mem
    ops = torch.ops.twinkle_mem
    n, v = base_logits.shape
    x = base_logits.clone()
    read, read_write = floor_functions(x)
    g_logp, g_entropy = torch.randn(n), torch.randn(n) * 0.01
    no_ignore = -(2**63)
    leaf = x.detach().requires_grad_()  # x's storage as a leaf: what the public path's backward writes over

    def forward(with_entropy):
        return ops.selective_log_softmax_fwd(x, labels, 1.0, no_ignore, 0, v, with_entropy)

    stats = {}

    def backward_inplace():
        _, entropy, shift, log_sum = stats["fwd"]
        ops.selective_log_softmax_bwd_(g_logp, g_entropy, x, labels, shift, log_sum, entropy, 1.0, no_ignore, 0)

    def forward_backward_inplace():
        stats["fwd"] = forward(True)
        backward_inplace()

    def public(intermediate):
        def run():
            logits = leaf.view(n, v) if intermediate else leaf  # a view: a non-leaf, as an LM head's output is
            logp, entropy = twinkle_mem.selective_log_softmax(logits, labels, True, inplace_backward=True)
            ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        return run

    ratios = {name: [] for name in OP_TARGETS}
    floors = {"read_s": [], "read_write_s": []}
    for fn in (read, read_write, lambda: forward(True)):  # warm-up
        fn()
    variants = (("fwd", lambda: forward(False)), ("fwd_entropy", lambda: forward(True)),
                ("fwd_entropy_bwd_inplace", forward_backward_inplace), ("bwd_inplace", backward_inplace),
                ("public_intermediate", public(True)), ("public_leaf", public(False)))
    for _ in range(reps):
        for name, fn in variants:  # (bwd_inplace takes the statistics of the call before, of the same logits)
            x.copy_(base_logits)  # an in-place backward wrote gradients over them
            leaf.grad = None
            t_read = timed(read) if "read" in OP_FLOORS[name] else 0.0
            t_rw = timed(read_write) if "rw" in OP_FLOORS[name] else 0.0
            ratios[name].append(timed(fn) / (t_read + t_rw))
            if t_read:
                floors["read_s"].append(t_read)
            if t_rw:
                floors["read_write_s"].append(t_rw)
    x.copy_(base_logits)
    return {**{name: ratio_summary(r) for name, r in ratios.items()},
            **{name: ratio_summary(t)["median"] for name, t in floors.items()}}


def ratio_summary(values) -> dict:
    """Median and quartiles of ``values`` (the spread of alternating measurements)."""
    values = sorted(values)

    def at(q):
        pos = q * (len(values) - 1)
        lo = int(pos)
        return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (pos - lo)
    return {"median": at(0.5), "q1": at(0.25), "q3": at(0.75), "n": len(values)}


def child(peer, n, v, reps, op_reps=0):
    import torch

    from twinkle_mem.measure import peak_rss

    torch.manual_seed(0)
    fn = peer_functions(torch)[peer]
    base_logits = (torch.randn(n, v) * 2).bfloat16()
    labels = torch.randint(0, v, (n,))
    logits_bytes = base_logits.numel() * base_logits.element_size()
    read, read_write = floor_functions(base_logits)

    def run_once():
        logits = base_logits.clone().requires_grad_() if peer == "twinkle_mem_inplace" else base_logits.requires_grad_()
        floor = timed(read) + timed(read_write)
        with peak_rss() as peak:
            t0 = time.perf_counter()
            logp, entropy = fn(logits, labels)
            (grad,) = torch.autograd.grad(logp.sum() + 0.01 * entropy.sum(), logits)
            elapsed = time.perf_counter() - t0
        grad_bytes = 0 if grad.data_ptr() == logits.data_ptr() else logits_bytes
        return elapsed, floor, peak.bytes - grad_bytes, logp.detach(), entropy.detach()

    run_once()  # warm-up (and compile)
    times, floor_ratios, extra_peak = [], [], None
    for r in range(reps):
        elapsed, floor, extra, logp, entropy = run_once()
        times.append(elapsed)
        floor_ratios.append(elapsed / floor)
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
    out = {"peer": peer, "n": n, "v": v, **time_summary(times), "vs_floor": ratio_summary(floor_ratios),
           "extra_peak_bytes": extra_peak, "logits_bytes": logits_bytes, "saved_bytes": saved_bytes,
           "err_logp": err_logp, "err_entropy": err_entropy, "logp_dtype": str(logp.dtype)}
    if peer == "twinkle_loop":
        out["source"] = twinkle_loop_source()
    if peer in PATH_PEERS:
        out.update(twinkle_mem_ran())  # backend, cpu_path, library, package (where: the parent names the run)
        if peer == "twinkle_mem_inplace" and op_reps:
            out["op"] = op_ratios(base_logits, labels, op_reps)
    return out


def time_summary(times) -> dict:
    """The median of the calls and their spread ((max - min) / median): one call can be an outlier."""
    times = sorted(times)
    median = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
    return {"time_s": median, "times_s": times, "spread": (times[-1] - times[0]) / median if median else 0.0}


# ----------------------------------------------------------------- orchestration (parent)
def cpu_paths() -> list[str]:
    """The CPU kernel paths this CPU runs, widest first (none when twinkle_mem's library is not loaded)."""
    from twinkle_mem.op import native as _native
    try:
        return [p for p in _native.CPU_PATHS if _native.cpu_kernel_path(p) == p]
    except ValueError:
        return []


def default_paths() -> list[str]:
    """The CPU kernel path an op call takes on this machine now (the widest it runs, under TWINKLE_MEM_CPU_ISA's
    cap): what a user's run gets. The others (the portable path took 406 s of a 1,138 s run) only by --paths."""
    from twinkle_mem.op import native as _native
    try:
        path = _native.cpu_kernel_path()
    except ValueError:
        return []
    return [path] if path else []


def chosen_paths(paths: str | None) -> list[str]:
    """--paths: a comma-separated list, "all" (every path this CPU runs), or None (default_paths())."""
    if paths is None:
        return default_paths()
    return cpu_paths() if paths == "all" else paths.split(",")


def peer_runs(peers, paths):
    """(label, peer, path) of each process to run: PATH_PEERS once per path (label peer@path)."""
    runs = []
    for peer in peers:
        if peer in PATH_PEERS and paths:
            runs += [(f"{peer}@{path}", peer, path) for path in paths]
        else:
            runs.append((peer, peer, None))
    return runs


def run_peer(peer, n, v, reps, timeout, path=None, op_reps=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--sizes", str(n), "--vocab", str(v),
           "--reps", str(reps), "--op-reps", str(op_reps)]
    env = dict(os.environ)
    if path is not None:
        env[CPU_ISA_ENV] = path
    label = peer if path is None else f"{peer}@{path}"
    try:
        result = {**run_child(cmd, timeout, env), "peer": label}
        if "backend" in result:
            result["where"] = label  # the run's record (bench_common.twinkle_mem_ran) names its process
        return result
    except subprocess.TimeoutExpired:
        return {"peer": label, "n": n, "v": v, "error": f"timed out after {timeout}s"}
    except ChildFailed as e:
        return {"peer": label, "n": n, "v": v, "error": e.last_line[:200]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024,2048", help="token counts N")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--paths", help="CPU kernel paths for twinkle_mem's peers, comma-separated, or all (every path this "
                                    "CPU runs); default: the path an op call takes on this machine")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per (peer, N), after a warm-up call")
    ap.add_argument("--op-reps", type=int, default=15,
                    help="alternating calls of each op variant against its floor (twinkle_mem_inplace@path)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (peer, N) process")
    ap.add_argument("--out", help=f"results path without extension (default {os.path.relpath(LOCAL)}; "
                                  f"with --record {os.path.relpath(RECORDED)}, the committed results)")
    ap.add_argument("--record", action="store_true", help="write (or --replot) the committed results")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT.png from OUT.json (no measurement)")
    add_allow_composite(ap)
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
        print(json.dumps(child(args.child, sizes[0], args.vocab, args.reps, args.op_reps)))
        return

    parent = check_twinkle_mem(args.allow_composite)  # the children import the same twinkle_mem
    paths = chosen_paths(args.paths)
    runs = peer_runs(args.peers.split(","), paths)
    results = []
    progress = Progress(len(runs) * len(sizes), stream=sys.stderr)
    load = MachineLoad()
    for n, (label, peer, path) in ((n, r) for n in sizes for r in runs):
        progress.step(f"{label:32s} N={n:6d} V={args.vocab}")
        r = run_peer(peer, n, args.vocab, args.reps, args.timeout, path, args.op_reps)
        results.append(r)
        progress.done(r.get("error") or f"{r['time_s']:.3f} s (spread {r['spread']:.0%}), "
                                        f"{r['vs_floor']['median']:.1f}x the floor, extra peak "
                                        f"{r['extra_peak_bytes'] / 2**20:.0f} MiB")
    meta = run_metadata(ran_records(results) or parent, vocab=args.vocab, reps=args.reps, op_reps=args.op_reps,
                        load=load.record())
    print()
    print(render_table(results, meta))
    ops_table = render_op_table(results, meta)
    if ops_table:
        print()
        print(ops_table)
    warning = load_warning(meta["load"])
    if warning:
        print(warning)
    write_json(args.out + ".json", {"meta": meta, "results": results}, indent=1)
    print(f"\nwrote {args.out}.json")
    write_plot(args.out)


def render_table(results, meta) -> str:
    """The console table: every N, each peer's median time, the spread of its calls, the ratio against
    torch.compile at the same N and against the floor (read + read/write of the logits), memory, saved
    bytes and errors; a footnote where twinkle_loop is not twinkle-kit's own."""
    lines = [f"selective log-softmax + entropy, fwd+bwd, V={meta['vocab']}, bf16 logits, torch {meta['torch']}, "
             f"{meta['threads']} threads, {meta['cpu']}; median of {meta['reps']} calls"]
    header = f"{'N':>6s} {'peer':32s} {'fwd+bwd s':>10s} {'spread':>7s} {'vs compiled':>11s} {'vs floor':>8s} " \
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
                lines.append(f"{n:6d} {name:32s} {r['error']}")
                continue
            ratio = f"{ref_time / r['time_s']:.1f}x" if ref_time else "-"
            floor = f"{r['vs_floor']['median']:.1f}x" if "vs_floor" in r else "-"
            peak = f"{r['extra_peak_bytes'] / 2**20:8.0f} MiB ({r['extra_peak_bytes'] / r['logits_bytes']:5.1%})"
            lines.append(f"{n:6d} {name:32s} {r['time_s']:10.3f} {r.get('spread', 0):7.0%} {ratio:>11s} {floor:>8s} "
                         f"{peak:>24s} {r['saved_bytes']:12d} {r['err_logp']:9.1e} {r['err_entropy']:9.1e}")
    lines.append("vs floor: each call over one read + one in-place read/write of the logits timed just before it "
                 "(median)")
    note = backend_note(results)
    if note:
        lines.append(note)
    if copies:
        lines.append(f"* twinkle_loop: {TWINKLE_LOOP_COPY}; install twinkle-kit (`.[test]`) to time its own function")
    return "\n".join(lines)


def render_op_table(results, meta) -> str:
    """The op itself against its floors, per CPU kernel path and N (twinkle_mem_inplace@path runs):
    median ratio of alternating calls [quartiles], the targets (issues 34 and 41), and the floors' times.
    Columns a run did not measure (results recorded before issue 41) show as -."""
    rows = [r for r in results if "op" in r]
    if not rows:
        return ""
    cols = [("fwd", "fwd / read"), ("fwd_entropy", "fwd+H / read"), ("fwd_entropy_bwd_inplace", "fwd+H+bwd_ / (r+rw)"),
            ("bwd_inplace", "bwd_ / rw"), ("public_intermediate", "public, intermediate"),
            ("public_leaf", "public, leaf .grad")]
    lines = [f"the op against one pass over the logits (bf16, V={meta.get('vocab')}, {meta.get('threads')} threads): "
             f"median of {meta.get('op_reps')} alternating calls [q1, q3]; public: selective_log_softmax(..., "
             "inplace_backward=True) + .backward(), / (read + rw)"]
    header = f"{'N':>6s} {'path':12s} " + " ".join(f"{title:>22s}" for _, title in cols) + f" {'read ms':>8s} {'rw ms':>8s}"
    lines += [header, "-" * len(header)]

    def cell(op, key):
        if key not in op:
            return "-"
        return f"{op[key]['median']:.2f} [{op[key]['q1']:.2f}, {op[key]['q3']:.2f}]"
    for r in rows:
        cells = [cell(r["op"], k) for k, _ in cols]
        lines.append(f"{r['n']:6d} {r.get('cpu_path') or '?':12s} " + " ".join(f"{c:>22s}" for c in cells) +
                     f" {r['op']['read_s'] * 1e3:8.1f} {r['op']['read_write_s'] * 1e3:8.1f}")
    lines.append(f"{'':6s} {'target':12s} " + " ".join(f"{'<= ' + str(OP_TARGETS[k]):>22s}" for k, _ in cols) +
                 "   (issues 34 and 41: N=2048, 2 threads)")
    note = backend_note(rows)
    return "\n".join(lines + ([note] if note else []))


RAN_KEYS = ("backend", "cpu_path", "library", "package", "device", "where")


def ran_records(results) -> list:
    """What the twinkle_mem runs of ``results`` ran (bench_common.twinkle_mem_ran's records, one per row)."""
    return [{k: r.get(k) for k in RAN_KEYS} for r in results if "backend" in r]


def backend_note(results) -> str:
    """One line: which backend and CPU kernel path each twinkle_mem run took ("" where none says)."""
    return ran_line({"twinkle_mem_ran": merge_ran(ran_records(results))})


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
