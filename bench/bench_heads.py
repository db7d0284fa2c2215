"""Every fused head, this tree against another checkout's (and the unfused equivalent), side by side in one run:
time and peak memory.

    python bench/bench_heads.py --base-python /path/to/other/checkout/python \\
        [--n 512] [--h 1024] [--vocab 151936] [--k 64] [--dtypes bfloat16 float32] [--reps 2] [--out DIR] \\
        [--head trainable|frozen] [--unfused] [--allow-composite]

The heads: ``linear_selective_log_softmax`` (log-probs and entropy), ``linear_gkd_topk`` (a top-k teacher,
k = --k) and ``linear_gkd_full`` (a whole-vocab teacher), each one forward + backward (gradients of hidden
and weight, or of hidden alone for a ``--head frozen``, LoRA's; a quarter of the rows ignored, the prompt) in a
fresh process, after a small warm-up call there. ``this tree`` imports the twinkle_mem this interpreter imports
(the installed package, or a tree on PYTHONPATH), ``base`` the --base-python directory (its own native library,
built in place); with ``--unfused``, ``unfused`` is this tree's
same loss from the logits ``hidden @ weight.T`` (``selective_log_softmax``, ``gkd_topk_from_logits``,
``gkd_from_logits``). The reps alternate the trees, so that the machine's load falls on all; the table
gives the fastest time and the largest peak. Peak: the rise of the resident set's high-water mark over the
call (glibc's mmap threshold fixed, so that freed buffers go back to the OS); "beyond" subtracts the
outputs and the gradients: the head's working memory. Each child records what twinkle-mem ran there
(backend, CPU kernel path), named in the table and the JSON; where either tree would run the composite
fallback, the run refuses to start unless --allow-composite. Writes DIR/heads.{json,md,png} (DIR: --out,
bench/results/local by default); progress on stderr.
"""
import argparse
import os
import sys
import time

from bench_common import (MachineLoad, Progress, add_allow_composite, check_twinkle_mem, load_warning, local_out,
                          markdown_table, parse_or_answer_child, peak_and_time_figure, probe_twinkle_mem, ran_line,
                          refuse_composite, run_config, run_metadata, twinkle_mem_ran, write_json)

HEADS = ("logprobs", "gkd_topk", "gkd_full")
TREES = ("base", "this tree", "unfused")
MIB = 1 << 20


def child(cfg: dict) -> dict:
    import torch

    import twinkle_mem
    from twinkle_mem.measure import peak_rss
    torch.manual_seed(0)
    dtype = getattr(torch, cfg["dtype"])
    n, h, v, k = cfg["n"], cfg["h"], cfg["vocab"], cfg["k"]
    hidden_all = torch.randn(n, h).to(dtype)
    weight_all = (torch.randn(v, h) * 0.05).to(dtype)
    labels_all = torch.randint(0, v, (n,))
    labels_all[::4] = -100
    ids_all = torch.randint(0, v, (n, k))
    logprobs_all = torch.randn(n, k).log_softmax(-1)
    teacher_all = (torch.randn(n, v) * 2).to(dtype) if cfg["head"] == "gkd_full" else None

    def leaves(rows, vocab):  # the call's inputs, made before the measured block
        hidden = hidden_all[:rows].clone().requires_grad_()
        weight = weight_all[:vocab].clone().requires_grad_(cfg["train_head"])
        labels = labels_all[:rows] % vocab
        labels[::4] = -100
        teacher = None if teacher_all is None else teacher_all[:rows, :vocab].contiguous()
        return hidden, weight, labels, ids_all[:rows] % vocab, logprobs_all[:rows], teacher

    def once(hidden, weight, labels, ids, logprobs, teacher):
        if cfg["unfused"]:  # the same loss from the logits
            logits = hidden @ weight.t()
            if cfg["head"] == "logprobs":
                outs = twinkle_mem.selective_log_softmax(logits, labels, True, ignore_index=-100)
            elif cfg["head"] == "gkd_topk":
                outs = (twinkle_mem.gkd_topk_from_logits(logits, ids, logprobs, labels),)
            else:
                outs = (twinkle_mem.gkd_from_logits(logits, teacher, labels),)
        elif cfg["head"] == "logprobs":
            outs = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, ignore_index=-100)
        elif cfg["head"] == "gkd_topk":
            outs = (twinkle_mem.linear_gkd_topk(hidden, weight, ids, logprobs, labels),)
        else:
            outs = (twinkle_mem.linear_gkd_full(hidden, weight, teacher, labels),)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs), [t for t in (hidden, weight) if t.requires_grad])
        return (*outs, *grads)

    once(*leaves(16, 1024))  # warm-up: imports, first allocations
    inputs = leaves(n, v)
    with peak_rss() as peak:
        t0 = time.perf_counter()
        kept = once(*inputs)
        seconds = time.perf_counter() - t0
    held = sum(t.numel() * t.element_size() for t in kept)
    return {"seconds": seconds, "peak_mib": peak.bytes / MIB, "beyond_mib": (peak.bytes - held) / MIB,
            "checksum": float(sum(t.double().sum() for t in kept)), "module": twinkle_mem.__file__,
            "ran": twinkle_mem_ran()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-python", help="python/ of the checkout to compare with (required)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--head", choices=["trainable", "frozen"], default="trainable",
                    help="frozen: the weight needs no gradient (LoRA's LM head), grad_hidden alone")
    ap.add_argument("--unfused", action="store_true", help="also this tree's same loss from the logits")
    ap.add_argument("--out", default=local_out(""), help="results folder (default bench/results/local/, not tracked)")
    add_allow_composite(ap)
    args = parse_or_answer_child(ap, child)
    if not args.base_python:
        ap.error("--base-python is required")
    trees = TREES if args.unfused else TREES[:2]
    this = check_twinkle_mem(args.allow_composite)  # this tree's children import the same twinkle_mem
    src = {"base": os.path.abspath(args.base_python), "this tree": this["package"], "unfused": this["package"]}
    env = {t: dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") for t in trees}
    env["base"]["PYTHONPATH"] = src["base"]
    refuse_composite(probe_twinkle_mem(env["base"], where="base"), args.allow_composite)
    load = MachineLoad()
    cases = [(head, dtype) for head in args.heads for dtype in args.dtypes]
    runs = {f"{head} {dtype}": {t: [] for t in trees} for head, dtype in cases}
    progress = Progress(args.reps * len(cases) * len(trees), stream=sys.stderr)
    for rep in range(args.reps):
        for head, dtype in cases:
            for tree in trees if rep % 2 == 0 else trees[::-1]:
                cfg = dict(head=head, dtype=dtype, n=args.n, h=args.h, vocab=args.vocab, k=args.k,
                           train_head=args.head == "trainable", unfused=tree == "unfused")
                progress.step(f"{head} {dtype} {tree}")
                r = run_config(__file__, cfg, env[tree])
                r["ran"]["where"] = tree
                runs[f"{head} {dtype}"][tree].append(r)
                progress.done(f"{r['seconds']:.2f} s, peak {r['peak_mib']:.0f} MiB")
    best = {case: {t: {"seconds": min(r["seconds"] for r in rs), "peak_mib": max(r["peak_mib"] for r in rs),
                       "beyond_mib": max(r["beyond_mib"] for r in rs), "checksum": rs[0]["checksum"]}
                   for t, rs in by_tree.items()} for case, by_tree in runs.items()}
    unfused = (lambda b: [f"{b['unfused']['seconds']:.2f}", f"{b['this tree']['seconds'] / b['unfused']['seconds']:.2f}",
                          f"{b['unfused']['peak_mib']:.0f}"]) if args.unfused else (lambda b: [])  # noqa: E731
    rows = [[case, f"{b['base']['seconds']:.2f}", f"{b['this tree']['seconds']:.2f}",
             f"{b['base']['seconds'] / b['this tree']['seconds']:.2f}", *unfused(b), f"{b['base']['peak_mib']:.0f}",
             f"{b['this tree']['peak_mib']:.0f}", f"{b['base']['beyond_mib']:.0f}", f"{b['this tree']['beyond_mib']:.0f}",
             "yes" if b["base"]["checksum"] == b["this tree"]["checksum"] else "no"] for case, b in best.items()]
    header = ["head dtype", "base s", "this tree s", "base / this",
              *(["unfused s", "this / unfused", "unfused peak MiB"] if args.unfused else []), "base peak MiB",
              "this peak MiB", "base beyond MiB", "this beyond MiB", "bitwise same sums"]
    ran = [r["ran"] for by_tree in runs.values() for rs in by_tree.values() for r in rs]
    record = run_metadata(ran, n=args.n, h=args.h, vocab=args.vocab, k=args.k, reps=args.reps, base=src["base"],
                          head=args.head, load=load.record())
    table = (f"{args.head} head, N = {args.n}, H = {args.h}, V = {args.vocab}, k = {args.k}, fastest of {args.reps}\n\n"
             + markdown_table(header, rows, "l" + "r" * (len(header) - 2) + "c") + f"\n{ran_line(record)}\n")
    warning = load_warning(record["load"])
    print(table + (f"\n{warning}\n" if warning else ""))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "heads.json"), {"meta": record, "runs": runs, "best": best})
    with open(os.path.join(args.out, "heads.md"), "w") as f:
        f.write(table + (f"\n{warning}\n" if warning else ""))
    series = {t: ([best[c][t]["peak_mib"] for c in best], [best[c][t]["seconds"] for c in best]) for t in trees}
    try:
        peak_and_time_figure(list(best), series, args.n * args.vocab * 4 / MIB, "fused heads: base vs this tree",
                             os.path.join(args.out, "heads.png"), peak_label="peak RSS rise over the call (MiB)")
    except ImportError:
        print("(no matplotlib: no PNG)", file=sys.stderr)
    print(f"wrote {args.out}/heads.{{json,md,png}}", file=sys.stderr)


if __name__ == "__main__":
    main()
