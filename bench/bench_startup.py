"""What the start-up hook (TWINKLE_MEM_INSTALL, twinkle_mem_startup.pth) costs every Python process.

`python -c pass`, best of --repeats runs interleaved, in two fresh virtual environments made from this
interpreter's base Python: one bare, one holding only the hook's two files (the .pth and its module,
copied from the installed package, else from python/), with the variable unset and set (a process that
never imports twinkle does nothing with it). Also checks that neither torch nor twinkle_mem is imported at
start-up. The hook's cost is the difference of the best times; the issue's bound is 5 ms.

    python bench/bench_startup.py [--repeats 15] [--out bench/results/startup]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "startup"),
                   help="path prefix of the .json and .png written")
    args = p.parse_args()
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
    record = run_metadata(repeats=args.repeats, hook_files_from=hook_source_dir(), hook_active=hook_active,
                          imported_at_startup=imported_at_start,
                          cases={label: [round(x * 1e3, 3) for x in t] for label, t in times.items()},
                          best_ms={label: round(min(t) * 1e3, 3) for label, t in times.items()})
    print("wrote", write_json(args.out + ".json", record))
    fig = new_figure((7, 3))
    ax = fig.subplots()
    labels = list(times)
    ax.barh(range(len(labels)), [min(t) * 1e3 for t in times.values()], label="best")
    ax.scatter([statistics.median(t) * 1e3 for t in times.values()], range(len(labels)), color="k", zorder=3,
               label="median")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel(f"python -c pass, ms ({args.repeats} runs, interleaved)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    print("wrote", save_png(fig, args.out + ".png"))


if __name__ == "__main__":
    main()
