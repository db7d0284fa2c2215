"""Benchmark: sliced [B, S, V] logits (views) against the same logits made contiguous.

RL code slices the sequence before taking log-probs: TRL's ``logits[:, :-1]`` and
verl's ``logits[:, -r - 1:-1]``. twinkle-mem reads such views in place (separate
batch and sequence strides); this measures that the view costs no time next to
the contiguous copy of the same rows (the copy itself is not timed: it is what a
view saves). Forward + backward with entropy, out of place and in place. Each
measurement runs in a fresh process (as bench_selective_log_softmax.py does):
in one process, gradients of two sizes alternating would meet a different
allocator state (reused, already touched pages or fresh ones) and time that
instead. Bitwise equality of logp and the gradient is checked in one process. The table and the JSON name
what twinkle-mem ran in each process (backend, CPU kernel path); where it would run the composite fallback, the
run refuses to start unless --allow-composite. Writes bench/results/local/sliced_views.{json,png} (another stem:
--out; the recorded results: --out bench/results/sliced_views).

  python bench/bench_sliced_views.py                       # B=4, S=2048, V=151936, bf16
  python bench/bench_sliced_views.py --s 512 --reps 5
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import twinkle_mem
from bench_common import (Progress, add_allow_composite, check_twinkle_mem, local_out, new_figure, ran_line, run_config,
                          run_metadata, save_png, twinkle_mem_ran, write_json)


def make_inputs(b, s, v, layout):
    torch.manual_seed(0)
    full = (torch.randn(b, s + 1, v) * 4).bfloat16()
    ids = torch.randint(0, v, (b, s + 2))
    r = s // 4
    view, labels = {"trl": (full[:, :-1], ids[:, 1:-1]), "verl": (full[:, -r - 1:-1], ids[:, -r - 1:-1])}[layout]
    return view, labels


def step(x, labels, inplace):
    x = x.detach().clone().requires_grad_() if inplace else x.detach().requires_grad_()
    t0 = time.perf_counter()
    logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, inplace_backward=inplace)
    (grad,) = torch.autograd.grad(logp.sum() + 0.1 * entropy.sum(), x)
    return time.perf_counter() - t0, logp, grad


def child(spec):
    """One (layout, dense?, inplace) measurement: best seconds over reps, after a warm-up (the least
    disturbed by first-touch page faults and the rest of the machine)."""
    view, labels = make_inputs(spec["b"], spec["s"], spec["vocab"], spec["layout"])
    x = view.contiguous() if spec["dense"] else view
    if spec["dense"]:
        del view
    times = [step(x, labels, spec["inplace"])[0] for _ in range(spec["reps"] + 1)][1:]
    print(json.dumps({"s": min(times), "ran": twinkle_mem_ran()}))


def bitwise_equal(b, s, v, layout, inplace):
    view, labels = make_inputs(b, s, v, layout)
    _, logp_v, grad_v = step(view, labels, inplace)
    _, logp_d, grad_d = step(view.contiguous(), labels.contiguous(), inplace)
    return torch.equal(logp_v, logp_d) and torch.equal(grad_v, grad_d)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--s", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=local_out("sliced_views"),
                    help="results file stem (default under bench/results/local/, not tracked)")
    add_allow_composite(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    ran = [check_twinkle_mem(args.allow_composite, where="this process (bitwise check)")]
    b, s, v = args.b, args.s, args.vocab
    names = {"trl": "trl logits[:, :-1]", "verl": "verl logits[:, -r-1:-1]"}
    rows = []
    progress = Progress(8, stream=sys.stderr)
    for layout in ("trl", "verl"):
        for inplace in (False, True):
            best = {}
            for dense in (False, True):
                spec = dict(b=b, s=s, vocab=v, layout=layout, inplace=inplace, dense=dense, reps=args.reps)
                progress.step(f"{names[layout]:24s} {'in place' if inplace else 'out of place':12s} "
                              f"{'contiguous' if dense else 'view'}")
                got = run_config(__file__, spec)
                best["contiguous" if dense else "view"] = got["s"]
                ran.append(dict(got["ran"], where="timed children"))
                progress.done(f"{best['contiguous' if dense else 'view']:.3f} s")
            rows_n = b * (s if layout == "trl" else s // 4)
            rows.append({"layout": names[layout], "inplace": inplace, "rows": rows_n, "view_s": best["view"],
                         "contiguous_s": best["contiguous"], "ratio": best["view"] / best["contiguous"],
                         "bitwise_equal": bitwise_equal(b, min(s, 64), v, layout, inplace)})

    title = (f"sliced logits vs contiguous, fwd+bwd with entropy, B={b}, V={v}, bf16, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {platform.machine()}, best of {args.reps}")
    print(title)
    print(f"{'layout':26s}{'backward':>14s}{'rows':>7s}{'view s':>9s}{'contig s':>10s}{'view/contig':>13s}"
          f"{'bitwise':>9s}")
    for row in rows:
        print(f"{row['layout']:26s}{'in place' if row['inplace'] else 'out of place':>14s}{row['rows']:>7d}"
              f"{row['view_s']:>9.3f}{row['contiguous_s']:>10.3f}{row['ratio']:>13.3f}"
              f"{str(row['bitwise_equal']):>9s}")
    meta = run_metadata(ran, b=b, s=s, vocab=v, dtype="bfloat16", reps=args.reps)
    print(ran_line(meta))
    write_json(args.out + ".json", {"title": title, "meta": meta, "rows": rows}, indent=1)
    try:
        fig = new_figure((7, 3))
        ax = fig.subplots()
        labels_ = [f"{r_['layout']}\n{'in place' if r_['inplace'] else 'out of place'}" for r_ in rows]
        ax.barh(labels_, [r_["ratio"] for r_ in rows], color="tab:green")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(1.05, color="tab:red", lw=0.8, ls="--")
        ax.set_xlabel("time of the view / time of the contiguous copy (fwd+bwd)")
        ax.set_title(title, fontsize=7)
        fig.tight_layout()
        save_png(fig, args.out + ".png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no PNG)")


if __name__ == "__main__":
    main()
