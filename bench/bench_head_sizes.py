"""The fused LM head against the unfused path, call size by call size: short calls pay for their rows (issue 51).

    python bench/bench_head_sizes.py                          # N = 7, 128, 200, 2048; H 1024, V 151936, bf16
    python bench/bench_head_sizes.py --n 2048 --vocab 32768 --modes frozen --dtype fp32   # issue 52's frozen head
    python bench/bench_head_sizes.py --base-tree DIR          # the same calls from another checkout, side by side

For each N and each mode, one warm process times the fused head (``twinkle_mem.linear_selective_log_softmax``) and
the unfused path (``hidden @ weight.T``, then ``twinkle_mem.selective_log_softmax`` with its in-place backward), the
calls alternating, after one warm-up call of each; the table gives each one's median and the ratio. Modes:
- ``fwd``: the forward under ``no_grad`` (verl's ``compute_log_prob``);
- ``frozen``: LoRA's head (the weight needs no gradient): forward + backward of the log-probs, the entropy returned
  as a metric, with the defaults (``--entropy-grad true`` declares it trained, and the loss then takes it too);
- ``trainable``: forward + backward of the log-probs, gradients to hidden and weight.
``--threads 1 --cpu-time`` times each call's process CPU time on one thread: on a machine other jobs share, the
least disturbed figure (each parallel region of two threads waits for a core that another process holds; a
fused call has one per block). ``--base-tree DIR`` runs the same in a child whose twinkle_mem is DIR/python's.
Writes bench/results/local/head_sizes.{json,md,png} (--out); progress on stderr.
"""
import os
import statistics
import sys
import time

from bench_common import (Progress, bench_parser, check_twinkle_mem, markdown_table, new_figure, parse_or_answer_child,
                          probe_twinkle_mem, refuse_composite, run_config, run_metadata, save_png, write_results)

MODES = ("fwd", "frozen", "trainable")


def measure(config: dict) -> dict:
    """One (N, mode) in this process: the medians of the fused and the unfused calls, alternating."""
    import torch

    import twinkle_mem
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    clock = time.process_time if config["cpu_time"] else time.perf_counter
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[config["dtype"]]
    n, h, v, mode = config["n"], config["h"], config["vocab"], config["mode"]
    entropy_grad = {"none": None, "true": True}[config["entropy_grad"]]
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(v, h, generator=gen) * h**-0.5).to(dtype)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)

    def loss(logp, entropy):
        return logp.sum() + (entropy.sum() if entropy_grad else 0)

    def unfused(x, w):
        if mode == "fwd":
            with torch.no_grad():
                return twinkle_mem.selective_log_softmax(x @ w.t(), labels, True)
        loss(*twinkle_mem.selective_log_softmax(x @ w.t(), labels, True, inplace_backward=True)).backward()

    def fused(x, w):
        kwargs = {} if entropy_grad is None else {"entropy_grad": entropy_grad}
        if mode == "fwd":
            with torch.no_grad():
                return twinkle_mem.linear_selective_log_softmax(x, w, labels, True, **kwargs)
        loss(*twinkle_mem.linear_selective_log_softmax(x, w, labels, True, **kwargs)).backward()

    times = {"fused": [], "unfused": []}
    for rep in range(config["reps"] + 1):
        for name, call in (("unfused", unfused), ("fused", fused)):
            x = hidden.clone().requires_grad_(mode != "fwd")
            w = weight.clone().requires_grad_(True) if mode == "trainable" else weight
            start = clock()
            call(x, w)
            if rep:  # (the first round warms up)
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = bench_parser(__doc__, out="head_sizes", h=1024, vocab=151936, reps=3, threads=0)
    p.add_argument("--n", type=int, nargs="+", default=[7, 128, 200, 2048])
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--entropy-grad", choices=["none", "true"], default="none",
                   help="the fused call's entropy_grad (true: the entropy trained, in the loss too)")
    p.add_argument("--cpu-time", action="store_true", help="each call's process CPU time, not its wall time")
    p.add_argument("--base-tree", default=None, help="another checkout: its fused head beside this one's")
    args = parse_or_answer_child(p, measure, argv)
    ran = check_twinkle_mem(args.allow_composite)
    trees = {"this tree": None, **({"base": os.path.abspath(args.base_tree)} if args.base_tree else {})}
    envs = {tree: None if path is None else dict(os.environ, PYTHONPATH=os.path.join(path, "python"))
            for tree, path in trees.items()}
    if args.base_tree:  # the base tree's kernels too, not its composite (a checkout whose library is not built)
        refuse_composite(probe_twinkle_mem(envs["base"], where="the base tree's children"), args.allow_composite)
    cells = [(n, mode, tree) for n in args.n for mode in args.modes for tree in trees]
    progress, rows = Progress(len(cells), stream=sys.stderr), []
    for n, mode, tree in cells:
        progress.step(f"N={n} {mode} ({tree})")
        config = dict(n=n, mode=mode, h=args.h, vocab=args.vocab, dtype=args.dtype, reps=args.reps,
                      threads=args.threads, cpu_time=args.cpu_time, entropy_grad=args.entropy_grad)
        got = run_config(__file__, config, envs[tree])
        rows.append(dict(n=n, mode=mode, tree=tree, fused_s=got["fused"], unfused_s=got["unfused"],
                         ratio=got["fused"] / got["unfused"]))
        progress.done(f"{rows[-1]['ratio']:.2f}x")
    clock = "process CPU time" if args.cpu_time else "wall time"
    meta = run_metadata(ran, h=args.h, vocab=args.vocab, dtype=args.dtype, reps=args.reps, clock=clock,
                        entropy_grad=args.entropy_grad, base_tree=args.base_tree,
                        **({"threads": args.threads} if args.threads else {}))
    table = (f"Fused head / unfused path, medians of {args.reps} alternating calls in one warm process ({clock}), "
             f"H {args.h}, V {args.vocab}, {args.dtype}, {meta['threads']} thread(s), {meta['cpu']}\n\n"
             + markdown_table(["N", "mode", "tree", "fused", "unfused", "fused / unfused"],
                              [[r["n"], r["mode"], r["tree"], f"{r['fused_s'] * 1e3:.1f} ms",
                                f"{r['unfused_s'] * 1e3:.1f} ms", f"**{r['ratio']:.2f}x**"] for r in rows],
                              "rlllrr"))
    write_results(args.out, meta, rows, table, figure)
    return 0


def figure(rows, meta, path):
    """The ratio fused / unfused against N, a line per (mode, tree)."""
    fig = new_figure((7, 4))
    ax = fig.subplots()
    for key in sorted({(r["mode"], r["tree"]) for r in rows}):
        pts = [(r["n"], r["ratio"]) for r in rows if (r["mode"], r["tree"]) == key]
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} ({key[1]})")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("rows in the call (N)")
    ax.set_ylabel("fused / unfused time")
    ax.legend(fontsize=8)
    ax.set_title(f"Fused LM head by call size, H {meta['h']}, V {meta['vocab']}, {meta['dtype']} ({meta['clock']})",
                 fontsize=9)
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
