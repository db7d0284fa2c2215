"""What TWINKLE_MEM_INSTALL and its start-up hook (twinkle_mem_startup.pth) cost a Python process.

1. Every process: `python -c pass`, best of --repeats runs interleaved, in two fresh virtual environments
   made from this interpreter's base Python: one bare, one holding only the hook's two files (the .pth and
   its module, copied from the installed package, else from python/), with the variable unset and set (a
   process that never imports twinkle does nothing with it). Also checks that neither torch nor twinkle_mem
   is imported at start-up. The hook's cost is the difference of the best times; the bound is 5 ms.
2. A process that imports twinkle: `python -c "import twinkle"` in this environment (its twinkle-kit, the
   hook and twinkle-mem as this interpreter imports them: PYTHONPATH is kept, --pythonpath goes first),
   --repeats fresh processes per value of the variable, interleaved, after one warm-up each that writes the
   bytecode a pip install would have written (PYTHONDONTWRITEBYTECODE is dropped for these processes: a source
   tree on PYTHONPATH would otherwise compile twinkle-mem's modules in every one): wall time and peak RSS (the
   child's ru_maxrss), median of the runs. The bound (issue 31): with the variable set, within 10% of the time and
   50 MiB of the peak RSS of `import twinkle` unset, every value (fused_chunk_bytes included: its check imports
   nothing). Whole-process times move with the machine's load: the install the variable runs is also timed
   inside each process (twinkle imported with the variable unset, then the hook's install run with it set), with
   the peak RSS it adds.

What twinkle-mem runs here (backend, CPU kernel path) is printed and recorded in the JSON (the measured processes
run no kernel: torch is not imported there); where it would run the composite fallback, the run refuses to start
unless --allow-composite. Writes bench/results/local/startup.{json,png} (the recorded results: --out
bench/results/startup).

    python bench/bench_startup.py [--repeats 15] [--pythonpath DIR] [--out bench/results/local/startup]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import (ROOT, Progress, add_allow_composite, check_twinkle_mem, local_out, markdown_table, new_figure,
                          ran_line, run_metadata, save_png, write_json)

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
                ("fused_lm_head,fused_chunk_bytes=128M", "fused_lm_head,fused_chunk_bytes=128M"))
BOUND_TIME, BOUND_RSS_MIB = 0.10, 50


def _import_env(pythonpath) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_MEM_INSTALL", "PYTHONDONTWRITEBYTECODE")}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    return env


def import_twinkle_once(value, pythonpath) -> tuple:
    """(wall seconds, CPU seconds, peak RSS MiB) of one `python -c "import twinkle"` in a fresh process."""
    env = _import_env(pythonpath)
    if value is not None:
        env["TWINKLE_MEM_INSTALL"] = value
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", "import twinkle"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"import twinkle with TWINKLE_MEM_INSTALL={value!r} failed: {proc.stderr.read()[-2000:]}")
    proc.stderr.close()
    return elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # (Linux: KiB)


INSTALL_PROBE = """
import logging, os, resource, sys, time
import twinkle
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
os.environ["TWINKLE_MEM_INSTALL"] = "fused_lm_head"
logging.getLogger("twinkle_mem.startup").setLevel(logging.WARNING)
import twinkle_mem_startup
start = time.perf_counter()
twinkle_mem_startup._install_from_variable()
print(time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
      "torch" in sys.modules)
"""


def measure_install_in_process(repeats, pythonpath) -> dict:
    """The install TWINKLE_MEM_INSTALL=fused_lm_head runs at `import twinkle`, timed inside fresh processes."""
    env = _import_env(pythonpath)
    runs = {"ms": [], "mib": [], "torch_imported": False}
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", INSTALL_PROBE], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        runs["ms"].append(round(float(out[0]) * 1e3, 1))
        runs["mib"].append(round(float(out[1]), 1))
        runs["torch_imported"] |= out[2] == "True"
    return runs


def measure_import_twinkle(repeats, pythonpath) -> dict:
    runs = {label: {"s": [], "cpu_s": [], "mib": []} for _, label in IMPORT_CASES}
    for value, _ in IMPORT_CASES:  # warm-up: the bytecode written
        import_twinkle_once(value, pythonpath)
    progress = Progress(repeats)
    for _ in range(repeats):
        progress.step("python -c 'import twinkle', each value once")
        for value, label in IMPORT_CASES:
            seconds, cpu, mib = import_twinkle_once(value, pythonpath)
            runs[label]["s"].append(round(seconds, 4))
            runs[label]["cpu_s"].append(round(cpu, 4))
            runs[label]["mib"].append(round(mib, 1))
        progress.done(", ".join(f"{statistics.median(r['s']):.2f} s" for r in runs.values()) + " (medians so far)")
    return runs


def import_twinkle_table(runs) -> tuple:
    """The table, and whether every value held to the bound is within it by wall time (and by CPU time, which
    other processes on a loaded machine move less)."""
    base = {k: statistics.median(runs["unset"][k]) for k in ("s", "cpu_s", "mib")}
    rows, within = [], {"s": True, "cpu_s": True}
    for (value, label), r in zip(IMPORT_CASES, runs.values()):
        med = {k: statistics.median(r[k]) for k in ("s", "cpu_s", "mib")}
        held = value is not None
        ok = {k: med[k] <= base[k] * (1 + BOUND_TIME) and med["mib"] <= base["mib"] + BOUND_RSS_MIB for k in within}
        for k in within:
            within[k] &= ok[k] or not held
        bound = " / ".join("within" if ok[k] else "OUTSIDE" for k in ("s", "cpu_s")) if held else "-"
        rows.append([label, f"{med['s']:.2f}", f"{med['s'] / base['s']:.2f}x", f"{med['cpu_s']:.2f}",
                     f"{med['cpu_s'] / base['cpu_s']:.2f}x", f"{med['mib']:.0f}", f"{med['mib'] - base['mib']:+.0f}",
                     bound])
    table = markdown_table(["TWINKLE_MEM_INSTALL", "median wall s", "vs unset", "median CPU s", "vs unset",
                            "median peak RSS MiB", "vs unset, MiB", "bound (10%, 50 MiB): wall / CPU"], rows,
                           "lrrrrrrl")
    return table, within


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--pythonpath", default=None, help="a folder put first on PYTHONPATH for `import twinkle` "
                   "(another twinkle-kit, installed with pip install --no-deps --target DIR)")
    p.add_argument("--out", default=local_out("startup"),
                   help="path prefix of the .json and .png written (default under bench/results/local/, not tracked)")
    add_allow_composite(p)
    args = p.parse_args()
    ran = check_twinkle_mem(args.allow_composite, where="this process (the measured ones run no kernel)")
    twinkle_runs = measure_import_twinkle(args.repeats, args.pythonpath)
    install_runs = measure_install_in_process(args.repeats, args.pythonpath)
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
    print(f"import twinkle with the variable set: {'within' if within['s'] else 'OUTSIDE'} the bound by wall time, "
          f"{'within' if within['cpu_s'] else 'OUTSIDE'} by CPU time (+{BOUND_TIME:.0%} time, +{BOUND_RSS_MIB} MiB "
          f"peak RSS of unset); load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"the install TWINKLE_MEM_INSTALL=fused_lm_head runs at import twinkle, inside the process: median "
          f"{statistics.median(install_runs['ms']):.0f} ms (min {min(install_runs['ms']):.0f}, max "
          f"{max(install_runs['ms']):.0f}), +{statistics.median(install_runs['mib']):.1f} MiB peak RSS; torch "
          f"imported: {install_runs['torch_imported']}")
    record = run_metadata(ran, repeats=args.repeats, hook_files_from=hook_source_dir(), hook_active=hook_active,
                          imported_at_startup=imported_at_start,
                          cases={label: [round(x * 1e3, 3) for x in t] for label, t in times.items()},
                          best_ms={label: round(min(t) * 1e3, 3) for label, t in times.items()},
                          import_twinkle=twinkle_runs, import_twinkle_within_bound=within,
                          load_average=os.getloadavg(),
                          install_in_process=install_runs,
                          twinkle_pythonpath=args.pythonpath)
    print(ran_line(record))
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
    ax2.set_xlabel(f"import twinkle: median wall s ({args.repeats} processes); labels: peak RSS")
    for i, r in enumerate(twinkle_runs.values()):
        ax2.text(statistics.median(r["s"]), i, f" {statistics.median(r['mib']):.0f} MiB", va="center", fontsize=7)
    fig.tight_layout()
    print("wrote", save_png(fig, args.out + ".png"))


if __name__ == "__main__":
    main()
