"""What TWINKLE_MEM_INSTALL and its start-up hook (twinkle_mem_startup.pth) cost a Python process.

1. Every process: `python -c pass`, best of --repeats runs interleaved, in two fresh virtual environments
   made from this interpreter's base Python: one bare, one holding only the hook's two files (the .pth and
   its module, copied from the installed package, else from python/), with the variable unset and set (a
   process that never imports twinkle does nothing with it). Also checks that neither torch nor twinkle_mem
   is imported at start-up. The hook's cost is the difference of the best times; the bound is 5 ms.
2. A process that imports twinkle: `python -c "import twinkle"` in this environment (its twinkle-kit, the
   hook and twinkle-mem as this interpreter imports them: PYTHONPATH is kept, --pythonpath goes first),
   --repeats fresh processes per value of the variable, interleaved: wall time and peak RSS (the child's
   ru_maxrss), median of the runs. The bound (issue 31): with the variable set, within 10% of the time and
   50 MiB of the peak RSS of `import twinkle` unset. A value with fused_chunk_bytes imports torch to judge
   the size against the fused head's tiles: shown apart, not held to the bound.

    python bench/bench_startup.py [--repeats 15] [--pythonpath DIR] [--out bench/results/startup]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, Progress, markdown_table, new_figure, run_metadata, save_png, write_json

HOOK_FILES = ("twinkle_mem_startup.pth", "twinkle_mem_startup.py")
CASES = (("bare venv", "bare", None), ("venv + hook, variable unset", "hook", None),
         ("venv + hook, TWINKLE_MEM_INSTALL=fused_lm_head", "hook", "fused_lm_head"))


def hook_source_dir() -> str:
    """Where the hook's files are: the installed package's site-packages, else the source tree."""
    try:
        import twinkle_mem_startup
        folder = os.path.dirname(twinkle_mem_startup.__file__)
        if all(os.path.exists(os.path.join(folder, name)) for name in HOOK_FILES):
            return folder
    except ImportError:
        pass
    return os.path.join(ROOT, "python")


def make_venv(path: str, with_hook: bool) -> str:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if with_hook:
        for name in HOOK_FILES:
            shutil.copy(os.path.join(hook_source_dir(), name), site)
        # its bytecode, as pip writes it at install (PYTHONDONTWRITEBYTECODE would leave it compiling every start)
        subprocess.run([python, "-m", "py_compile", os.path.join(site, "twinkle_mem_startup.py")], check=True)
    return python


def run_once(python: str, value) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_MEM_INSTALL", "PYTHONPATH")}
    if value is not None:
        env["TWINKLE_MEM_INSTALL"] = value
    start = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


IMPORT_CASES = ((None, "unset"), ("1", "1"), ("fused_lm_head", "fused_lm_head"),
                ("fused_lm_head,fused_chunk_bytes=128M", "fused_lm_head,fused_chunk_bytes=128M (imports torch)"))
BOUND_TIME, BOUND_RSS_MIB = 0.10, 50


def import_twinkle_once(value, pythonpath) -> tuple:
    """(wall seconds, peak RSS MiB) of one `python -c "import twinkle"` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TWINKLE_MEM_INSTALL"}
    if value is not None:
        env["TWINKLE_MEM_INSTALL"] = value
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", "import twinkle"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"import twinkle with TWINKLE_MEM_INSTALL={value!r} failed: {proc.stderr.read()[-2000:]}")
    proc.stderr.close()
    return elapsed, usage.ru_maxrss / 1024  # (Linux: KiB)


def measure_import_twinkle(repeats, pythonpath) -> dict:
    runs = {label: {"s": [], "mib": []} for _, label in IMPORT_CASES}
    progress = Progress(repeats)
    for _ in range(repeats):
        progress.step("python -c 'import twinkle', each value once")
        for value, label in IMPORT_CASES:
            seconds, mib = import_twinkle_once(value, pythonpath)
            runs[label]["s"].append(round(seconds, 4))
            runs[label]["mib"].append(round(mib, 1))
        progress.done(", ".join(f"{statistics.median(r['s']):.2f} s" for r in runs.values()) + " (medians so far)")
    return runs


def import_twinkle_table(runs) -> tuple:
    base_s, base_mib = (statistics.median(runs["unset"][k]) for k in ("s", "mib"))
    rows, within = [], True
    for (value, label), r in zip(IMPORT_CASES, runs.values()):
        s, mib = statistics.median(r["s"]), statistics.median(r["mib"])
        held = value is not None and "fused_chunk_bytes" not in value
        ok = s <= base_s * (1 + BOUND_TIME) and mib <= base_mib + BOUND_RSS_MIB
        within &= ok or not held
        bound = ("within" if ok else "OUTSIDE") if held else "-"
        rows.append([label, f"{s:.2f}", f"{s / base_s:.2f}x", f"{mib:.0f}", f"{mib - base_mib:+.0f}", bound])
    table = markdown_table(["TWINKLE_MEM_INSTALL", "median s", "vs unset", "median peak RSS MiB", "vs unset, MiB",
                            "bound (10%, 50 MiB)"], rows, "lrrrrl")
    return table, within


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--pythonpath", default=None, help="a folder put first on PYTHONPATH for `import twinkle` "
                   "(another twinkle-kit, installed with pip install --no-deps --target DIR)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "startup"),
                   help="path prefix of the .json and .png written")
    args = p.parse_args()
    twinkle_runs = measure_import_twinkle(args.repeats, args.pythonpath)
    with tempfile.TemporaryDirectory() as tmp:
        pythons = {"bare": make_venv(os.path.join(tmp, "bare"), False),
                   "hook": make_venv(os.path.join(tmp, "hook"), True)}
        probe = subprocess.run([pythons["hook"], "-c", "import sys; print(sorted({'torch', 'twinkle_mem'} & "
                                "set(sys.modules)), any(type(f).__name__ == 'TwinkleImportHook' for f in "
                                "sys.meta_path))"], env=dict(os.environ, TWINKLE_MEM_INSTALL="fused_lm_head"),
                               capture_output=True, text=True, check=True).stdout.split()
        imported_at_start, hook_active = probe[0] != "[]", probe[-1] == "True"
        times = {label: [] for label, _, _ in CASES}
        progress = Progress(args.repeats)
        for _ in range(args.repeats):
            progress.step("python -c pass, each case once")
            for label, venv, value in CASES:
                times[label].append(run_once(pythons[venv], value))
            progress.done(", ".join(f"{min(t) * 1e3:.1f}" for t in times.values()) + " ms best so far")
    bare = min(times[CASES[0][0]])
    rows = [[label, f"{min(t) * 1e3:.2f}", f"{statistics.median(t) * 1e3:.2f}", f"{(min(t) - bare) * 1e3:+.2f}"]
            for label, t in times.items()]
    table = markdown_table(["case", "best ms", "median ms", "best - bare, ms"], rows, "lrrr")
    print(table)
    print(f"hook on sys.meta_path: {hook_active}; torch or twinkle_mem imported at start-up: {imported_at_start}")
    twinkle_table, within = import_twinkle_table(twinkle_runs)
    print()
    print(twinkle_table)
    print(f"import twinkle with the variable set: {'within' if within else 'OUTSIDE'} the bound "
          f"(+{BOUND_TIME:.0%} time, +{BOUND_RSS_MIB} MiB peak RSS of unset)")
    record = run_metadata(repeats=args.repeats, hook_files_from=hook_source_dir(), hook_active=hook_active,
                          imported_at_startup=imported_at_start,
                          cases={label: [round(x * 1e3, 3) for x in t] for label, t in times.items()},
                          best_ms={label: round(min(t) * 1e3, 3) for label, t in times.items()},
                          import_twinkle=twinkle_runs, import_twinkle_within_bound=within,
                          twinkle_pythonpath=args.pythonpath)
    print("wrote", write_json(args.out + ".json", record))
    fig = new_figure((11, 3.2))
    ax, ax2 = fig.subplots(1, 2)
    labels = list(times)
    ax.barh(range(len(labels)), [min(t) * 1e3 for t in times.values()], label="best")
    ax.scatter([statistics.median(t) * 1e3 for t in times.values()], range(len(labels)), color="k", zorder=3,
               label="median")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel(f"python -c pass, ms ({args.repeats} runs, interleaved)")
    ax.legend(fontsize=8)
    labels = list(twinkle_runs)
    ax2.barh(range(len(labels)), [statistics.median(r["s"]) for r in twinkle_runs.values()], label="median s")
    ax2.set_yticks(range(len(labels)), labels, fontsize=7)
    ax2.set_xlabel(f"python -c 'import twinkle', s ({args.repeats} fresh processes); peak RSS MiB in the labels")
    for i, r in enumerate(twinkle_runs.values()):
        ax2.text(statistics.median(r["s"]), i, f" {statistics.median(r['mib']):.0f} MiB", va="center", fontsize=7)
    fig.tight_layout()
    print("wrote", save_png(fig, args.out + ".png"))


if __name__ == "__main__":
    main()
