"""linear_gkd_full's forward + backward time on the CPU: this tree against an earlier commit's (the ratio measured
in the same run, the two alternating), and twinkle's GKDLoss on the full logits for scale.

    python bench/bench_gkd_full.py [--base REV] [--n 1024] [--h 128] [--v 32768] [--reps 2]
        [--mmap-threshold 65536] [--out PATH] [--allow-composite]

Each measurement is one forward + backward (gradients of hidden and weight; beta 0.5, T 1, fp32, every
row kept) in a fresh process, after a small warm-up call there: ``this tree`` imports the twinkle_mem this
interpreter imports (the installed package, or a tree on PYTHONPATH), ``base`` the package of REV (``git archive``,
with the native library of the twinkle_mem this interpreter imports), and
``twinkle`` runs GKDLoss(beta=0.5) on ``hidden @ weight.T`` (the whole [N, V] logits). Paths alternate
rep by rep, so that a change in the machine's load hits both; the table gives the medians and the ratio
base / this tree. Each child records what twinkle-mem ran there (backend, CPU kernel path), named in the table
and the JSON; where twinkle-mem would run its composite fallback, the run refuses to start unless
--allow-composite. Writes bench/results/local/gkd_full_speed.json (another path: --out).
"""
import argparse
import glob
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench_common import (ROOT, MachineLoad, add_allow_composite, check_twinkle_mem, load_warning, local_out,
                          markdown_table, parse_or_answer_child, probe_twinkle_mem, ran_line, refuse_composite,
                          run_config, run_metadata, twinkle_mem_ran, write_json)

PATHS = ("base", "this tree", "twinkle")


def child(cfg: dict) -> dict:
    import torch

    import twinkle_mem
    gen = torch.Generator().manual_seed(0)
    n, h, v = cfg["n"], cfg["h"], cfg["v"]
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.05
    teacher = torch.randn(n, v, generator=gen) * 2
    labels = torch.randint(0, v, (n,), generator=gen)

    def once(rows):
        hd, w = hidden[:rows].clone().requires_grad_(), weight.clone().requires_grad_()
        t0 = time.perf_counter()
        if cfg["path"] == "twinkle":
            from twinkle.loss.gkd import GKDLoss
            loss = GKDLoss(beta=0.5)({"labels": labels[:rows].view(1, -1)}, {"logits": (hd @ w.t()).view(1, rows, v)},
                                     teacher_logits=teacher[:rows].view(1, rows, v))["loss"]
        else:
            loss = twinkle_mem.gkd_average(twinkle_mem.linear_gkd_full(hd, w, teacher[:rows], labels[:rows], beta=0.5))
        t1 = time.perf_counter()
        torch.autograd.grad(loss, (hd, w))
        return t1 - t0, time.perf_counter() - t1, float(loss)

    once(min(n, 16))  # warm-up (imports, first allocations)
    fwd, bwd, loss = once(n)
    return {"fwd_s": fwd, "bwd_s": bwd, "loss": loss, "module": twinkle_mem.__file__,
            "ran": twinkle_mem_ran() if cfg["path"] != "twinkle" else None}


def base_tree(rev: str, tmp: str, package: str) -> str:
    """python/ of ``rev`` under tmp, with the native library of ``package`` (the twinkle_mem folder this interpreter
    imports: the CPU kernels are not what changes)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "python"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    for lib in glob.glob(os.path.join(package, "_C_*.so")):
        shutil.copy(lib, os.path.join(tmp, "python", "twinkle_mem"))
    return os.path.join(tmp, "python")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="9324b17", help="the commit to compare with (default: before the speed work)")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--h", type=int, default=128)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="MALLOC_MMAP_THRESHOLD_ for the children (65536: as the peak-memory tests run theirs, every "
                         "large tensor fresh pages from the OS, so that allocations cost what they cost there)")
    ap.add_argument("--out", default=local_out("gkd_full_speed.json"))
    add_allow_composite(ap)
    args = parse_or_answer_child(ap, child)
    this = check_twinkle_mem(args.allow_composite)  # "this tree" and "twinkle": the children import the same
    load = MachineLoad()
    times = {p: [] for p in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        env = {p: dict(os.environ) for p in PATHS}
        env["base"]["PYTHONPATH"] = base_tree(args.base, tmp, this["package"])
        refuse_composite(probe_twinkle_mem(env["base"], where="base"), args.allow_composite)
        for path in PATHS if args.mmap_threshold is not None else ():
            env[path]["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        for rep in range(args.reps):
            for path in PATHS:
                cfg = dict(n=args.n, h=args.h, v=args.v, path=path)
                r = run_config(__file__, cfg, env[path])
                if r["ran"]:
                    r["ran"]["where"] = path
                times[path].append(r)
                print(f"rep {rep} {path}: forward {r['fwd_s']:.2f} s, backward {r['bwd_s']:.2f} s, loss {r['loss']:.9g}",
                      flush=True)
    med = {p: {k: statistics.median(r[k] for r in times[p]) for k in ("fwd_s", "bwd_s")} for p in PATHS}
    total = {p: med[p]["fwd_s"] + med[p]["bwd_s"] for p in PATHS}
    rows = [[p, f"{med[p]['fwd_s']:.2f}", f"{med[p]['bwd_s']:.2f}", f"{total[p]:.2f}",
             f"{total['base'] / total[p]:.2f}x"] for p in PATHS]
    ran = [r["ran"] for p in PATHS for r in times[p] if r["ran"]]
    record = run_metadata(ran, n=args.n, h=args.h, v=args.v, beta=0.5, dtype="float32", base=args.base, reps=args.reps,
                          mmap_threshold=args.mmap_threshold, load=load.record())
    print(markdown_table(["path", "forward s", "backward s", "total s", "base / path"], rows, "lrrrr"))
    print(ran_line(record))
    warning = load_warning(record["load"])
    if warning:
        print(warning)
    write_json(args.out, {"meta": record, "runs": times, "median": med, "speedup_total": total["base"] / total["this tree"]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
