"""Log-probs (+ entropy) and their gradients from hidden states and the LM-head weight:
twinkle-mem's fused path against the unfused path and the chunked peers, side by side in one run.

    python3 -m venv /tmp/linear-peers-venv
    /tmp/linear-peers-venv/bin/pip install torch==2.13.0 trl cut-cross-entropy matplotlib
    /tmp/linear-peers-venv/bin/pip install --no-deps verl      # its torch module only (no Ray)
    /tmp/linear-peers-venv/bin/pip install .                 # twinkle-mem itself, its native library built
    /tmp/linear-peers-venv/bin/python bench/bench_linear_selective_log_softmax.py \\
        [--n 1024 4096] [--h 1024] [--vocab 151936] [--dtype fp32|bf16] [--reps 2] [--chunk-mib 256] \\
        [--rss-n 4096 16384] [--device cpu|cuda|npu] [--head trainable frozen] [--no-entropy-grad] \\
        [--warm-reps 3]

Every timed call runs in its own subprocess, after one warm-up call (compiles what compiles) at a
small vocab: forward + backward (gradients of hidden, and of weight for a trainable --head, from logp,
and from entropy where the peer gives it, unless --no-entropy-grad: the entropy a metric). Both kinds of
LM head run, one after the other, each with its own table and files (``--head trainable`` or ``--head frozen``
for one): a trainable head, and a frozen one, LoRA's case, where the head needs no gradient (twinkle-mem's fused
head then sums grad_hidden's vectors in its forward; heads/frozen.py). The --reps calls of each peer go round
robin with the other peers' (a shared machine's load falls on all alike); the table gives the fastest. Then
(--warm-reps, 3 by default; 0 for none) one more process runs every peer of this tree (not --base-tree's)
alternating, after a warm-up call of each at the full size, and the table adds each one's median and quartiles
there, beside the fresh processes' figure: the figure of a training
loop's warm process, where a whole product can run faster than in a fresh one (with glibc's own malloc
settings, as a training process has them: the fixed threshold below made every buffer of 64 KiB or more, the
BLAS's scratch of each row tile's product among them, fresh pages at each call). Peak memory is the rise of the
resident set's high-water mark over the call (CPU; glibc's mmap threshold is fixed so that freed
buffers go back to the OS), or the device allocator's peak, the largest over the reps; "beyond" subtracts the outputs and
the gradients of hidden and weight, so it is the peer's working memory. Log-probs and entropy are
compared with the unfused path's (same inputs, fp32 logits). Peers, imported from their installed
packages:
- one ``hidden @ weight.T``, forward only (the unit: a matmul of the logits' size);
- twinkle-mem fused: ``twinkle_mem.linear_selective_log_softmax`` (chunk_bytes = --chunk-mib),
  and again with 3/4 of the rows ignored (the prompt tokens of RL);
- with ``--base-tree DIR`` (another checkout of twinkle-mem, built in place): its fused path, the same
  call imported from DIR/python, side by side with this tree's (the twinkle_mem this interpreter imports);
- unfused: ``hidden @ weight.T`` then ``twinkle_mem.selective_log_softmax``;
- TRL ``trl.kernels.ChunkedLogProbFunction`` (its torch path off Triton devices), vocab chunk
  width set so that its logits tile has the same bytes as twinkle-mem's chunk;
- verl ``FusedLinearForPPOFunction`` (verl/utils/experimental/torch_functional.py, loaded from the
  installed package without verl/__init__, which needs Ray), token chunks of the same bytes;
- Cut Cross-Entropy ``linear_cross_entropy(..., impl="torch_compile", reduction="none")``, its
  implementation off CUDA (log-probs only, no entropy).
--rss-n runs twinkle-mem's fused path alone at those N (one timed call) for the memory figures.
Every child records what twinkle-mem ran there (backend, CPU kernel path); the table and the JSON name them.
A run whose twinkle-mem (this tree's or --base-tree's) would take the composite fallback on --device refuses to
start unless --allow-composite.
Writes bench/results/local/linear_selective_log_softmax_{trainable,frozen}.{json,md,png} (one head kind:
linear_selective_log_softmax.*; --out, --name); progress on stderr.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import (ChildFailed, Progress, add_allow_composite, check_twinkle_mem, local_out, markdown_table,
                          new_figure, probe_twinkle_mem, ran_line, read_json, refuse_composite, run_config,
                          run_metadata, save_png, twinkle_mem_ran, write_json)

IGNORE = -100

PEERS = {
    "one matmul hidden @ weight.T (forward)": "matmul",
    "twinkle-mem fused": "fused",
    "twinkle-mem fused, --base-tree": "fused_base",
    "twinkle-mem fused, 3/4 rows ignored": "fused_ignored",
    "unfused: matmul + twinkle_mem op": "unfused",
    "TRL ChunkedLogProbFunction": "trl",
    "verl FusedLinearForPPO (torch)": "verl",
    "Cut Cross-Entropy (torch_compile)": "cce",
}
CHUNKED = ("trl", "verl")
PEER_NAMES = {kind: name for name, kind in PEERS.items()}
TWINKLE_KINDS = ("fused", "fused_base", "fused_ignored", "unfused")  # the peers that run twinkle-mem


# ------------------------------------------------------------------ the peers (run in the child)
def _make_step(kind, hidden, weight, labels, chunk_bytes, elem, entropy_grad=True):
    """A function running one forward + backward: returns (logp, entropy or None, grad_hidden[, grad_weight]:
    the weight's where it requires grad)."""
    import torch

    n, v = hidden.shape[0], weight.shape[0]
    leaves = tuple(t for t in (hidden, weight) if t.requires_grad)

    def grads(logp, entropy):
        loss = logp.sum() + (entropy.sum() if entropy is not None and entropy_grad else 0)
        return torch.autograd.grad(loss, leaves)

    if kind in TWINKLE_KINDS:
        import twinkle_mem  # (the parent checked the backend of both trees: composite only if asked)

    if kind in ("fused", "fused_base", "fused_ignored"):
        # (a base tree before the option has no entropy_grad: its entropy is then left out of the loss alone)
        metric = {} if entropy_grad or kind == "fused_base" else {"entropy_grad": False}

        def step():
            logp, ent = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, ignore_index=IGNORE,
                                                                 chunk_bytes=chunk_bytes, **metric)
            return (logp, ent, *grads(logp, ent))
    elif kind == "matmul":
        def step():
            with torch.no_grad():
                return (hidden @ weight.t(),)
    elif kind == "unfused":
        def step():
            logp, ent = twinkle_mem.selective_log_softmax(hidden @ weight.t(), labels, True, ignore_index=IGNORE)
            return (logp, ent, *grads(logp, ent))
    elif kind == "trl":
        from trl.kernels import ChunkedLogProbFunction
        cols = max(1, chunk_bytes // (min(n, 4096) * elem))  # its tile: [min(N, 4096), chunk_size]

        def step():
            logp, ent, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, cols, None, 1.0,
                                                         ("entropy",))
            return (logp, ent, *grads(logp, ent))
    elif kind == "verl":
        import importlib.metadata
        import importlib.util
        path = importlib.metadata.distribution("verl").locate_file("verl/utils/experimental/torch_functional.py")
        spec = importlib.util.spec_from_file_location("verl_torch_functional", str(path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        rows = max(1, chunk_bytes // (v * 4))  # its fp32 logits chunk: [chunk_size, V]

        def step():
            logp, ent = module.FusedLinearForPPOFunction.apply(hidden, weight, labels, 1.0, rows)
            return (logp, ent, *grads(logp, ent))
    elif kind == "cce":
        from cut_cross_entropy import linear_cross_entropy

        def step():
            logp = -linear_cross_entropy(hidden, weight, labels, impl="torch_compile", reduction="none")
            return (logp, None, *grads(logp, None))
    else:
        raise ValueError(kind)
    return step


def child(cfg):
    """One (peer, N): warm-up, timed calls, peak memory; prints JSON, saves logp/entropy."""
    import torch

    from twinkle_mem.measure import peak_rss
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]]
    device = torch.device(cfg["device"])
    n, h, v = cfg["n"], cfg["h"], cfg["vocab"]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * h**-0.5 * 2).to(dtype).to(device).requires_grad_(
        cfg["head"] == "trainable")
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    if cfg["kind"] == "fused_ignored":
        labels[torch.arange(n, device=device) % 4 != 3] = IGNORE  # 3/4 of the rows
    elem = hidden.element_size()
    if cfg.get("warm"):
        return warm_child(cfg, hidden, weight, labels, elem)
    try:
        step = _make_step(cfg["kind"], hidden, weight, labels, cfg["chunk_bytes"], elem, cfg["entropy_grad"])
        # Warm-up at a small vocab: code paths, thread pools, compilation (CCE recompiles for new
        # shapes with dynamic=True only where it must; its first full-size call is timed).
        small_w = weight[:4096].detach().requires_grad_(weight.requires_grad)
        small = _make_step(cfg["kind"], hidden, small_w, labels % 4096 if cfg["kind"] != "fused_ignored" else
                           torch.where(labels == IGNORE, labels, labels % 4096), cfg["chunk_bytes"], elem,
                           cfg["entropy_grad"])
        small()
    except ImportError as e:
        print(json.dumps({"error": f"not installed: {e}"}))
        return

    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (  # noqa: E731
        (lambda: torch.npu.synchronize()) if device.type == "npu" else (lambda: None))
    times, peak = [], None
    for rep in range(cfg["reps"]):
        if device.type == "cpu" and rep == 0:
            with peak_rss() as m:
                t0 = time.perf_counter()
                out = step()
                times.append(time.perf_counter() - t0)
            peak = m.bytes
        else:
            accel = getattr(torch, device.type, None) if device.type != "cpu" else None
            if rep == 0 and accel is not None:
                accel.reset_peak_memory_stats()
                base = accel.memory_allocated()
            sync()
            t0 = time.perf_counter()
            out = step()
            sync()
            times.append(time.perf_counter() - t0)
            if rep == 0 and accel is not None:
                peak = accel.max_memory_allocated() - base
        held = sum(t.numel() * t.element_size() for t in out if t is not None)
        if rep == 0 and cfg["kind"] != "matmul":
            logp, ent = out[0].detach().float().cpu(), (None if out[1] is None else out[1].detach().float().cpu())
            torch.save({"logp": logp, "entropy": ent}, cfg["out"])
        del out
    ran = twinkle_mem_ran(cfg["device"]) if cfg["kind"] in TWINKLE_KINDS else None  # (after the timed calls)
    print(json.dumps({"times": times, "peak": peak, "held": held, "threads": torch.get_num_threads(), "ran": ran}))


def warm_child(cfg, hidden, weight, labels, elem):
    """Every kind of cfg["kinds"] in this one process: a full-size warm-up call of each, then cfg["reps"] rounds
    of one call of each in turn; prints JSON {kind: [seconds, ...]} (CPU: no device sync needed)."""
    import torch
    steps = {}
    for kind in cfg["kinds"]:
        try:
            steps[kind] = _make_step(kind, hidden, weight, labels, cfg["chunk_bytes"], elem, cfg["entropy_grad"])
            steps[kind]()
        except ImportError:
            continue
    times = {kind: [] for kind in steps}
    sync = torch.cuda.synchronize if hidden.device.type == "cuda" else (lambda: None)
    for _ in range(cfg["reps"]):
        for kind, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[kind].append(time.perf_counter() - t0)
    ran = twinkle_mem_ran(cfg["device"]) if set(steps) & set(TWINKLE_KINDS) else None
    print(json.dumps({"times": times, "threads": torch.get_num_threads(), "ran": ran}))


# ------------------------------------------------------------------ the parent
def _env(base_tree=None, warm=False):
    """A child's environment: this interpreter's (the twinkle_mem it imports), or with ``base_tree``'s python/
    first on PYTHONPATH; glibc's mmap threshold fixed for the peak RSS, but in the warm process (times only)."""
    env = dict(os.environ) if warm else dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    if base_tree:
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(base_tree, "python"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(cfg):
    """One child run of ``cfg`` (its own process: its own peak RSS); its JSON, with ``wall_s``, and what
    twinkle-mem ran there (``ran``, named after the peer)."""
    env = _env(cfg["base_tree"] if cfg["kind"] == "fused_base" else None, warm=bool(cfg.get("warm")))
    t0 = time.monotonic()
    try:
        res = run_config(__file__, cfg, env)
    except ChildFailed as e:
        res = {"error": f"exit {e.returncode}: {e.last_line[:300]}"}
    res["wall_s"] = time.monotonic() - t0
    if res.get("ran"):
        res["ran"]["where"] = "warm process" if cfg.get("warm") else PEER_NAMES[cfg["kind"]]
    return res


def _loadavg():
    try:
        return os.getloadavg()
    except OSError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--reps", type=int, default=2, help="timed calls per peer and N, each in its own process")
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--rss-n", type=int, nargs="*", default=[16384])
    p.add_argument("--peers", nargs="+", default=[k for k in PEERS.values() if k != "fused_base"],
                   choices=list(PEERS.values()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--head", nargs="+", choices=["trainable", "frozen"], default=["trainable", "frozen"],
                   help="the LM head's kinds, each run in turn (default both); frozen: the head needs no gradient "
                        "(LoRA), grad_hidden alone")
    p.add_argument("--no-entropy-grad", dest="entropy_grad", action="store_false",
                   help="the entropy a metric: the loss is sum(logp) (twinkle-mem: entropy_grad=False)")
    p.add_argument("--warm-reps", type=int, default=3,
                   help="then one process running every peer of this tree this many times, alternating (0: none)")
    p.add_argument("--out", default=local_out(""), help="results folder (default bench/results/local/, not tracked)")
    p.add_argument("--name", default="linear_selective_log_softmax",
                   help="file stem of the results in --out (with both heads: <name>_trainable, <name>_frozen)")
    p.add_argument("--base-tree", help="another twinkle-mem checkout (built in place): the fused_base peer")
    p.add_argument("--replot", action="store_true", help="redraw the table and PNG from the JSON in --out")
    add_allow_composite(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    heads = list(dict.fromkeys(args.head))
    names = {head: args.name if len(heads) == 1 else f"{args.name}_{head}" for head in heads}
    if args.replot:
        for name in names.values():
            stem = os.path.join(args.out, name)
            saved = read_json(stem + ".json")
            print(_table(saved["rows"], saved["meta"]))
            _plot(saved["rows"], saved["meta"], stem + ".png")
        return 0

    if "fused_base" in args.peers and not args.base_tree:
        p.error("the fused_base peer needs --base-tree")
    ran = [check_twinkle_mem(args.allow_composite, args.device, "this process")]
    if "fused_base" in args.peers:  # the base tree's children: known before any starts
        ran.append(probe_twinkle_mem(_env(args.base_tree), args.device, "--base-tree"))
        refuse_composite(ran[-1], args.allow_composite)
    for head, name in names.items():
        _measure(argparse.Namespace(**dict(vars(args), head=head, name=name)), list(ran))
    return 0


def _measure(args, ran):
    """Every peer's fresh-process calls, then the warm process, for one head kind (args.head); writes and prints."""
    import torch

    names = PEER_NAMES
    # Round robin: rep r of every peer at one N before rep r + 1 of any, so that a change of load on a
    # shared machine falls on all peers alike. Each run is its own process with one timed call.
    plan = [(n, kind, rep) for n in args.n for rep in range(args.reps) for kind in args.peers]
    plan += [(n, "fused", 0) for n in args.rss_n if n not in args.n]
    results = {}
    load_before = _loadavg()
    progress = Progress(len(plan) + (len(args.n) if args.warm_reps else 0), stream=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        for n, kind, rep in plan:
            progress.step(f"{names[kind]}, N={n}, H={args.h}, V={args.vocab}, {args.dtype}, rep {rep + 1}")
            cfg = {"kind": kind, "n": n, "h": args.h, "vocab": args.vocab, "dtype": args.dtype, "reps": 1,
                   "chunk_bytes": args.chunk_mib << 20, "device": args.device, "base_tree": args.base_tree,
                   "out": os.path.join(tmp, f"{kind}_{n}.pt"), "head": args.head, "entropy_grad": args.entropy_grad}
            res = _run(cfg)
            acc = results.setdefault((n, kind), {"peer": names[kind], "kind": kind, "n": n, "times": [],
                                                 "peaks": [], "wall_s": 0.0})
            acc["wall_s"] += res.get("wall_s", 0.0)
            ran += [res["ran"]] if res.get("ran") else []
            if res.get("error"):
                acc["error"] = res["error"]
                progress.done(f"failed: {res['error'][:200]}")
                continue
            acc["times"] += res["times"]
            acc["peaks"].append(res["peak"])
            acc["held"], acc["threads"] = res["held"], res["threads"]
            progress.done(f"{res['times'][0]:.2f} s, peak rise {(res['peak'] or 0) / 2**20:.0f} MiB, beyond outputs+grads "
                          f"{((res['peak'] or 0) - res['held']) / 2**20:.0f} MiB")
        for n in args.n if args.warm_reps else ():
            kinds = [k for k in args.peers if k != "fused_base"]
            progress.step(f"warm process: {', '.join(kinds)} alternating, {args.warm_reps} rounds, N={n}")
            res = _run({"kind": "warm", "warm": True, "kinds": kinds, "n": n, "h": args.h, "vocab": args.vocab,
                        "dtype": args.dtype, "reps": args.warm_reps, "chunk_bytes": args.chunk_mib << 20,
                        "device": args.device, "head": args.head, "entropy_grad": args.entropy_grad})
            if res.get("error"):
                progress.done(f"failed: {res['error'][:200]}")
                continue
            ran += [res["ran"]] if res.get("ran") else []
            for kind, ts in res["times"].items():
                q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
                results.setdefault((n, kind), {"peer": names[kind], "kind": kind, "n": n, "times": [], "peaks": [],
                                               "wall_s": 0.0}).update(warm_times=ts, warm_median_s=q[1],
                                                                      warm_quartiles=[q[0], q[2]])
            progress.done("medians " + ", ".join(f"{k} {statistics.median(t):.2f} s" for k, t in res["times"].items()))
        rows = list(results.values())
        for row in rows:
            if row["times"]:
                row["time_s"] = min(row["times"])
                row["time_median_s"] = statistics.median(row["times"])
                peaks = [p for p in row["peaks"] if p is not None]
                row["peak"] = max(peaks) if peaks else None
                row["beyond"] = None if row["peak"] is None else row["peak"] - row["held"]
        # accuracy against the unfused path, and the time ratios
        for row in rows:
            base = next((r for r in rows if r["kind"] == "unfused" and r["n"] == row["n"] and r.get("time_s")), None)
            if row.get("time_s") and base:
                row["vs_unfused"] = row["time_s"] / base["time_s"]
            if row.get("warm_median_s") and base and base.get("warm_median_s"):
                row["warm_vs_unfused"] = row["warm_median_s"] / base["warm_median_s"]
            f, fb = os.path.join(tmp, f"{row['kind']}_{row['n']}.pt"), os.path.join(tmp, f"unfused_{row['n']}.pt")
            if row.get("time_s") and base and os.path.exists(f) and row["kind"] not in ("fused_ignored", "matmul"):
                a, b = torch.load(f), torch.load(fb)
                row["max_dlogp"] = (a["logp"] - b["logp"]).abs().max().item()
                if a["entropy"] is not None:
                    row["max_dentropy"] = (a["entropy"] - b["entropy"]).abs().max().item()
            full = next((r for r in rows if r["kind"] == "fused" and r["n"] == row["n"] and r.get("time_s")), None)
            base_tree = next((r for r in rows if r["kind"] == "fused_base" and r["n"] == row["n"] and r.get("time_s")),
                             None)
            if row["kind"] == "fused" and row.get("time_s") and base_tree:
                row["vs_base_tree"] = row["time_s"] / base_tree["time_s"]
            if row["kind"] == "fused_ignored" and row.get("time_s") and full:
                row["vs_all_rows"] = row["time_s"] / full["time_s"]
    ran = [r for r in ran if r["where"] not in ("this process", "--base-tree")] or ran  # the children's, if any
    meta = run_metadata(ran, h=args.h, vocab=args.vocab, dtype=args.dtype, reps=args.reps, chunk_mib=args.chunk_mib,
                        device=args.device, head=args.head, entropy_grad=args.entropy_grad,
                        warm_reps=args.warm_reps, loadavg_before=load_before, loadavg_after=_loadavg(),
                        total_s=progress.elapsed(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                        base_tree=args.base_tree)
    if args.base_tree:
        meta["base_commit"] = subprocess.run(["git", "-C", args.base_tree, "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True).stdout.strip()
    stem = os.path.join(args.out, args.name)
    os.makedirs(args.out, exist_ok=True)
    write_json(stem + ".json", {"meta": meta, "rows": rows}, indent=1)
    table = _table(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)
    _plot(rows, meta, stem + ".png")
    print(f"done in {meta['total_s']:.0f} s; load average before {load_before}, after {meta['loadavg_after']}",
          file=sys.stderr)


def _mib(x):
    return "" if x is None else f"{x / 2**20:,.0f}"


def _table(rows, meta):
    head = meta.get("head", "trainable")
    recorded_before_41 = "head" not in meta  # (no head kind, no warm process: its table re-renders as it was)
    grad = "logp and entropy" if meta.get("entropy_grad", True) else "logp (the entropy a metric)"
    title = (f"fwd+bwd of log-probs (+ entropy) from hidden [N, {meta['h']}] and weight [{meta['vocab']}, "
             f"{meta['h']}], a {head} head (gradients to hidden{'' if head == 'frozen' else ' and weight'} from "
             f"{grad}), {meta['dtype']}, {meta['device']} ({meta['cpu']}, {meta['threads']} threads), "
             f"chunk {meta['chunk_mib']} MiB, fresh processes: min of {meta['reps']}"
             f"{'; one warm process: median [q1, q3] of ' + str(meta['warm_reps']) if meta.get('warm_reps') else ''}"
             f"; torch {meta['torch']}")
    if recorded_before_41:
        title = (f"fwd+bwd of log-probs (+ entropy) from hidden [N, {meta['h']}] and weight [{meta['vocab']}, "
                 f"{meta['h']}], {meta['dtype']}, {meta['device']} ({meta['cpu']}, {meta['threads']} threads), "
                 f"chunk {meta['chunk_mib']} MiB, min of {meta['reps']}; torch {meta['torch']}")
    cells = []
    for r in rows:
        if r.get("error"):
            cells.append([r["peer"], r["n"], "", r["error"][:60], "", "", "", "", "", ""])
            continue
        ratio = f"{r['vs_unfused']:.2f}x" if r.get("vs_unfused") else ""
        if r.get("vs_all_rows"):
            ratio += f" ({r['vs_all_rows']:.2f}x of all rows)"
        if r.get("vs_base_tree"):
            ratio += f" ({r['vs_base_tree']:.2f}x of the base tree)"
        warm = ""
        if r.get("warm_median_s"):
            q1, q3 = r["warm_quartiles"]
            warm = f"{r['warm_median_s']:.2f} [{q1:.2f}, {q3:.2f}]" + (
                f", {r['warm_vs_unfused']:.2f}x" if r.get("warm_vs_unfused") else "")
        cells.append([r["peer"], r["n"], "no" if r["kind"] in ("cce", "matmul") else "yes",
                      f"{r['time_s']:.2f}" if r.get("time_s") else "",
                      ratio, warm, _mib(r.get("peak")), _mib(r.get("beyond")),
                      f"{r.get('max_dlogp', float('nan')):.2g}", f"{r.get('max_dentropy', float('nan')):.2g}"])
    header = ["peer", "N", "entropy", "time (s)", "vs unfused", "warm process (s), vs unfused", "peak rise (MiB)",
              "beyond outputs + grads (MiB)", "max abs dlogp vs unfused", "max abs dentropy"]
    align = "lrcrrrrrrr"
    if recorded_before_41:
        header.pop(5)
        cells, align = [c[:5] + c[6:] for c in cells], align[:-1]
    line = ran_line(meta)  # (none in a run recorded before it: its table re-renders as it was)
    return title + "\n\n" + markdown_table(header, cells, align=align) + (f"\n{line}\n" if line else "")


def _plot(rows, meta, path):
    try:
        fig = new_figure((14, 2.6 + 2.2 * len({r["n"] for r in rows if r.get("time_s") is not None})))
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    done = [r for r in rows if r.get("time_s") is not None]
    ns = sorted({r["n"] for r in done})
    axes = fig.subplots(len(ns), 2, squeeze=False)
    for row_axes, n in zip(axes, ns):
        rs = [r for r in done if r["n"] == n]
        labels = [r["peer"] for r in rs]
        colors = ["tab:green" if r["kind"].startswith("fused") else
                  ("tab:gray" if r["kind"] == "unfused" else "tab:red") for r in rs]
        row_axes[0].barh(labels, [r["time_s"] for r in rs], color=colors)
        only = " (memory run: twinkle-mem alone, 1 call)" if len(rs) == 1 else ""
        row_axes[0].set_xlabel(f"N={n}: forward + backward time (s){only}")
        row_axes[1].barh(labels, [max(r.get("beyond") or 0, 1 << 20) / 2**20 for r in rs], color=colors)
        row_axes[1].set_xscale("log")
        row_axes[1].set_xlim(64, 8192)
        row_axes[1].set_xlabel(f"N={n}: peak memory beyond outputs and gradients (MiB, log)")
        row_axes[1].axvline(meta["chunk_mib"], color="k", lw=0.8, ls="--")
        row_axes[1].set_yticklabels([])
    fig.suptitle(f"LM head log-probs from hidden states: H={meta['h']}, V={meta['vocab']}, {meta['dtype']}, "
                 f"{meta['device']} ({meta['threads']} threads); dashed: chunk_bytes", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
