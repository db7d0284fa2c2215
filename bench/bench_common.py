"""What the benchmarks in bench/ share: the run's metadata record, what twinkle-mem ran (its backend and CPU
kernel path, in each process a benchmark starts: twinkle_mem_ran; the refusal to measure the composite fallback
unless ``--allow-composite``: refuse_composite), the default output folder (bench/results/local/, not tracked:
the committed bench/results/ only through ``--out``), how loaded the machine was (MachineLoad),
writing results as JSON, running one measurement in a fresh process and reading back its JSON line (a script
measuring in children of itself: run_config, parse_or_answer_child), numbered
progress lines, the command line's common options (bench_parser), Markdown tables, matplotlib figures written
as PNG files, and the step table of the device checks (gpu_check.sh, npu_check.sh:
``python bench/bench_common.py steps ...``). Measuring itself (peak RSS, the CPU's name) lives in
``twinkle_mem.measure``, which the tests use too.

The scripts import it as ``bench_common`` (Python puts a script's own folder on ``sys.path``); it puts
the repository root there too, so that the twinkle-kit benchmarks import ``standins`` (the CPU stand-ins
they share with tests/: standins/README.md; bench/ imports nothing from tests/). At import it needs only the
standard library: the device checks run it before anything is built.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.append(ROOT)  # last: the script's folder and PYTHONPATH come first (the package is under python/)


# ------------------------------------------------------------------ the command line
RESULTS = os.path.join(HERE, "results")  # the committed results: written only where --out names them
LOCAL_RESULTS = os.path.join(RESULTS, "local")  # every benchmark's default output folder (not tracked by git)
ALLOW_COMPOSITE = "--allow-composite"  # the one flag that lets a benchmark measure the composite fallback


def local_out(name: str) -> str:
    """The default output path of a benchmark's results named ``name`` (a file stem, a file or a folder):
    bench/results/local/NAME, which git ignores; the committed bench/results/ only through ``--out``."""
    return os.path.join(LOCAL_RESULTS, name) if name else LOCAL_RESULTS


def add_allow_composite(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--allow-composite`` (args.allow_composite): run even where twinkle-mem would run without its native
    library for the device (refuse_composite)."""
    parser.add_argument(ALLOW_COMPOSITE, action="store_true",
                        help="measure twinkle-mem's composite fallback where its native library for the device "
                             "is not loaded (without it, such a run refuses to start)")
    return parser


def bench_parser(doc: str, out: str | None = None, **ints: int) -> argparse.ArgumentParser:
    """A benchmark's parser: described by its docstring's first line, an int option ``--name`` for each
    keyword (its default, in the order given), ``--allow-composite``, and ``--out`` (a results file stem,
    default bench/results/local/OUT) when ``out`` is given. The script adds its other options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in ints.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    add_allow_composite(parser)
    if out is not None:
        parser.add_argument("--out", default=local_out(out),
                            help="results file stem: writes OUT.json and OUT.png (default under bench/results/local/, "
                                 "not tracked; the committed results: --out bench/results/...)")
    return parser


def split_names(parser: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    """A comma-separated option's names, each one of ``known`` (else the parser's error naming the others)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def time_calls_ms(fn, reps: int, accel=None) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``: with a device's events where ``accel`` (torch.cuda,
    torch.npu) is given, else the host's clock."""
    times = []
    for _ in range(reps):
        if accel is None:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


# ------------------------------------------------------------------ what twinkle-mem ran
def twinkle_mem_ran(device: str = "cpu", where: str = "this process") -> dict:
    """What twinkle-mem runs on ``device`` in this process, for the run's record:

    - ``backend``: the native library of the device ("cpu", "cuda", "npu") where it is loaded, else
      "composite" (the PyTorch fallback); None where twinkle_mem does not import;
    - ``cpu_path``: the CPU kernel path an op call on CPU tensors takes now (TWINKLE_MEM_CPU_ISA applied),
      None without the CPU library, "unknown" where this twinkle_mem cannot say (an older tree);
    - ``library``: twinkle_mem.backends()'s line for the device ("loaded", or why not);
    - ``package``: the folder twinkle_mem was imported from (an installed package, or a tree's python/);
    - ``device``, and ``where``: which process(es) this is.

    It imports only twinkle_mem, so the processes a benchmark starts (children, Ray workers, another tree's)
    record their own."""
    try:
        import twinkle_mem
        status = twinkle_mem.backends()
    except Exception as error:  # noqa: BLE001  (a broken tree still gets its run recorded)
        return {"backend": None, "cpu_path": None, "library": f"twinkle_mem does not import: {error}",
                "package": None, "device": device, "where": where}
    library = status.get(device, f"no {device} backend in this twinkle_mem")
    cpu_path = None
    if status.get("cpu") == "loaded":
        try:
            from twinkle_mem.op import native
            cpu_path = native.cpu_kernel_path() or "unknown"
        except (ImportError, AttributeError, ValueError):  # an older tree; a cap naming no path
            cpu_path = "unknown"
    return {"backend": device if library == "loaded" else "composite", "cpu_path": cpu_path, "library": library,
            "package": os.path.dirname(os.path.abspath(twinkle_mem.__file__)), "device": device, "where": where}


def merge_ran(records: list[dict]) -> list[dict]:
    """``records`` (twinkle_mem_ran of several processes) with each distinct run once, the ``where`` of the
    processes that ran it joined ("driver, worker 0, worker 1"), in the order first seen."""
    merged: dict[tuple, tuple[dict, list]] = {}
    for record in records:
        key = tuple(record.get(k) for k in ("backend", "cpu_path", "library", "package", "device"))
        first, wheres = merged.setdefault(key, (record, []))
        where = record.get("where") or "?"
        if where not in wheres:
            wheres.append(where)
    return [dict(first, where=", ".join(wheres)) for first, wheres in merged.values()]


def ran_fields(records: list[dict]) -> dict:
    """The run's metadata fields of ``records``: ``twinkle_mem_backend`` and ``twinkle_mem_cpu_path`` (each
    distinct value, joined by ", "), and ``twinkle_mem_ran``, every distinct run with where it ran."""
    merged = merge_ran(records)

    def joined(key):
        return ", ".join(dict.fromkeys(str(r.get(key)) for r in merged)) if merged else None
    return {"twinkle_mem_backend": joined("backend"), "twinkle_mem_cpu_path": joined("cpu_path"),
            "twinkle_mem_ran": merged}


def describe_ran(record: dict) -> str:
    """One run in words: "cpu backend, CPU path avx2" or "composite (cpu: not built ...), no CPU kernel path"."""
    backend = record.get("backend")
    if backend == "composite":
        text = f"composite (the native library: {record.get('library')})"
    elif backend is None:
        text = f"nothing ({record.get('library')})"
    else:
        text = f"{backend} backend"
    path = record.get("cpu_path")
    return text + (f", CPU path {path}" if path else ", no CPU kernel path")


def ran_line(meta: dict) -> str:
    """The line a benchmark's table carries: what twinkle-mem ran, in which processes ("" for a run recorded
    before benchmarks recorded it, so that its table re-renders as it was)."""
    merged = meta.get("twinkle_mem_ran")
    if not merged:
        return ""
    return "twinkle-mem ran: " + "; ".join(f"{describe_ran(r)} ({r.get('where')})" for r in merged)


def composite_refusal(record: dict, script: str | None = None) -> str:
    """Why a benchmark refuses to run where ``record`` (twinkle_mem_ran) says the composite would run, and
    what to do (several lines)."""
    script = script or os.path.basename(sys.argv[0]) or "this benchmark"
    package = record.get("package")
    source = package is not None and os.path.realpath(package) == os.path.realpath(os.path.join(ROOT, "python",
                                                                                              "twinkle_mem"))
    source = source and str(record.get("library")).startswith("not built")
    lines = [f"{script}: not run: twinkle-mem's native {record.get('device')} library is not loaded, so this run would "
             "measure the composite fallback, not twinkle-mem's kernels.",
             f"  {record.get('where')}: {record.get('library')}"]
    if package:
        note = " (this source tree, e.g. through PYTHONPATH=python: no library is built in it)" if source else ""
        lines.append(f"  twinkle_mem imported from {package}{note}")
    lines += ["Fix: install the package (`pip install .` in the repository root) and run the benchmark without "
              "PYTHONPATH=python,",
              "  or build the library in place (`python setup.py build_ext --inplace`).",
              f"To measure the composite on purpose, pass {ALLOW_COMPOSITE}."]
    return "\n".join(lines)


def refuse_composite(records, allowed: bool, script: str | None = None) -> None:
    """Exit (SystemExit with composite_refusal's message) where a record of ``records`` (one twinkle_mem_ran or a
    list) ran the composite, unless ``allowed`` (``--allow-composite``)."""
    for record in [records] if isinstance(records, dict) else records:
        if record.get("backend") == "composite" and not allowed:
            raise SystemExit(composite_refusal(record, script))


def check_twinkle_mem(allowed: bool, device: str = "cpu", where: str = "this process") -> dict:
    """This process's twinkle_mem_ran(device), after refuse_composite; what a benchmark calls before measuring."""
    record = twinkle_mem_ran(device, where)
    refuse_composite(record, allowed)
    return record


# Appended to the setup of standins.memory.measure_in_subprocess (whose process has the parent's sys.path and
# an EXTRA dict it returns): what twinkle-mem runs in that process, read before anything is measured.
RAN_SETUP = "\nimport bench_common\nEXTRA['ran'] = bench_common.twinkle_mem_ran(where='measuring process')\n"

PROBE = ("import json, sys; sys.path.insert(0, {here!r}); import bench_common; "
         "print(json.dumps(bench_common.twinkle_mem_ran({device!r}, {where!r})))")


def probe_twinkle_mem(env: dict | None = None, device: str = "cpu", where: str = "a child") -> dict:
    """twinkle_mem_ran(device) in a fresh process of this interpreter with ``env`` (another tree's PYTHONPATH):
    what the children a benchmark starts there will run, known before it starts them."""
    return run_child([sys.executable, "-c", PROBE.format(here=HERE, device=device, where=where)], timeout=300,
                     env=env)


# ------------------------------------------------------------------ the run's record
def git_commit() -> str | None:
    """The commit checked out in this source tree (uncommitted changes are not recorded), or None
    where the tree is not a git checkout of its own (a copy without .git, even inside another repository)."""
    try:
        done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or os.path.realpath(lines[0]) != os.path.realpath(ROOT):
        return None
    return lines[1]


def run_metadata(ran: dict | list[dict] | None = None, **fields) -> dict:
    """The record each results file carries: torch, twinkle_mem (None where it does not import) and
    python versions, the machine, CPU model and core count, torch's thread count, the git commit and
    the date; what twinkle-mem ran (ran_fields: its backend and CPU kernel path, and in which processes)
    from ``ran``, the twinkle_mem_ran records of the processes that measured (default: this process's, on
    the CPU); then ``fields`` (the run's shape and settings), which override a default of the same
    name (``threads=1`` where the measured processes run with one thread)."""
    import torch

    try:
        import twinkle_mem
        from twinkle_mem.measure import cpu_name

        twinkle_mem_version, cpu = twinkle_mem.__version__, cpu_name()
    except Exception:  # a broken build still gets its timings recorded, without a version
        twinkle_mem_version, cpu = None, platform.processor() or platform.machine()
    meta = {"torch": torch.__version__, "twinkle_mem": twinkle_mem_version, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "git_commit": git_commit(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    meta.update(ran_fields([twinkle_mem_ran()] if ran is None else [ran] if isinstance(ran, dict) else ran))
    meta.update(fields)
    return meta


def write_json(path: str, data, indent: int = 2) -> str:
    """Write ``data`` to ``path`` as JSON (its folder created if missing); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    return path


def write_results(stem: str, meta: dict, rows: list, table: str, figure=None) -> None:
    """Print a benchmark's ``table`` and write STEM.json ({"meta", "rows"}), STEM.md (the table) and, with
    ``figure``, STEM.png (``figure(rows, meta, path)``)."""
    print(table)
    write_json(stem + ".json", {"meta": meta, "rows": rows}, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table)
    if figure is not None:
        figure(rows, meta, stem + ".png")
        print(f"wrote {stem}.json, .md, .png")


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------ how loaded the machine was
def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has run since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in (fields + ["0"] * 8)[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()  # this process and the children it waited for (the measurements)
    return t.user + t.system + t.children_user + t.children_system


class MachineLoad:
    """What else ran while a benchmark measured: the load average at start and end, and the CPU that
    other processes took meanwhile, in cores (the machine's busy time minus this process and its
    measurement children, over the wall time). Timings, and above all ratios between peers measured one
    after another, move with it."""

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        self._busy, self._own, self._wall = _busy_cpu_seconds(), _own_cpu_seconds(), time.monotonic()

    def record(self) -> dict:
        """The load record for the run's metadata (call when the measuring is done)."""
        wall = time.monotonic() - self._wall
        busy = _busy_cpu_seconds()
        others = None
        if busy is not None and self._busy is not None and wall > 0:
            others = max(0.0, (busy - self._busy) - (_own_cpu_seconds() - self._own)) / wall
        return {"cores": self.cores, "load_average_start": self.load_start,
                "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                "other_processes_cpu_cores": None if others is None else round(others, 2),
                "wall_s": round(wall, 1)}


def load_warning(load: dict) -> str | None:
    """A warning line when ``load`` (MachineLoad.record()) says other work shared the machine, else None:
    other processes' CPU over the run, or the 1-min load average at its start, of a quarter of the cores
    or more (at least half a core)."""
    limit = max(0.5, load["cores"] / 4)
    others = load.get("other_processes_cpu_cores")
    start = (load.get("load_average_start") or [0.0])[0]
    if (others is None or others < limit) and start < limit:
        return None
    took = "unknown" if others is None else f"{others:.1f}"
    return (f"WARNING: the machine was loaded during this run (other processes took {took} of "
            f"{load['cores']} cores on average; 1-min load average {start:.1f} at the start): times, and "
            "ratios between peers measured one after another, are not comparable with a quiet run")


# ------------------------------------------------------------------ one measurement per process
class ChildFailed(RuntimeError):
    """A child measurement exited with an error; ``last_line`` is the last line of its stderr
    (else of its stdout), where Python puts the exception."""

    def __init__(self, returncode: int, last_line: str, stderr: str):
        super().__init__(f"child exited with {returncode}: {last_line}\n{stderr[-3000:]}")
        self.returncode, self.last_line = returncode, last_line


def run_child(cmd: list[str], timeout: float | None = None, env: dict | None = None) -> dict:
    """Run ``cmd`` in a fresh process (its peak RSS and allocator state its own) and return the JSON
    object it prints as the last line of its stdout. Raises :class:`ChildFailed` on a non-zero exit
    and ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise ChildFailed(done.returncode, tail[0], done.stderr)
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise ChildFailed(0, "no output", done.stderr)
    return json.loads(lines[-1])


# A script measuring in children of itself: ``script --child CONFIG`` (hidden) measures the JSON config CONFIG and
# prints its JSON record as its last line (run_config reads it back; parse_or_answer_child answers).
def run_config(script: str, config: dict, env: dict | None = None, timeout: float | None = None) -> dict:
    """``script`` (a benchmark's ``__file__``) run as a child of itself that measures ``config``, in a fresh
    process (run_child): the record it prints."""
    return run_child([sys.executable, os.path.abspath(script), "--child", json.dumps(config)], timeout, env)


def parse_or_answer_child(parser: argparse.ArgumentParser, child, argv: list[str] | None = None):
    """``parser``'s arguments, with the hidden ``--child CONFIG`` added; in a child (run_config), ``child(CONFIG)``'s
    record printed as JSON, and the process exits."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        sys.exit(0)
    return args


# ------------------------------------------------------------------ progress of a long run
class Progress:
    """Numbered progress lines: ``[3/12] what ... result (41 s elapsed)``, flushed as they come, so
    a long run shows where it is (stdout by default; ``stream=sys.stderr`` keeps stdout for the
    results)."""

    def __init__(self, total: int, stream=None):
        self.total, self.count, self.stream = total, 0, stream
        self.started = time.time()

    def step(self, what: str) -> None:
        self.count += 1
        print(f"[{self.count}/{self.total}] {what} ... ", end="", flush=True, file=self.stream or sys.stdout)

    def done(self, result: str) -> None:
        print(f"{result} ({self.elapsed():.0f} s elapsed)", flush=True, file=self.stream or sys.stdout)

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.time() - self.started


# ------------------------------------------------------------------ tables and figures
_ALIGN = {"l": "---", "r": "---:", "c": ":---:"}


def markdown_table(header: list[str], rows: list[list], align: str = "") -> str:
    """A Markdown table, one line per row, ending in a newline. ``align``: one letter per column,
    l / r / c (default: l for every column)."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"markdown_table: every row needs {len(header)} cells (one per header)")
    marks = [_ALIGN[a] for a in (align or "l" * len(header))]
    if len(marks) != len(header):
        raise ValueError(f"markdown_table: align {align!r} needs one letter per column ({len(header)})")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def new_figure(figsize: tuple[float, float]):
    """A matplotlib Figure that belongs to no pyplot state (nothing to close, no display needed);
    raises ImportError without matplotlib. Its panels: ``fig.subplots(...)``."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def peak_and_time_figure(labels: list[str], series: dict, line_mib: float | None, title: str, path: str,
                         peak_label: str = "peak RSS rise over the step (MiB)", time_label: str = "step time (s)",
                         lines: list | None = None) -> str:
    """Two panels of grouped bars, each series a bar at each label: its peak memory (MiB; a dashed line at
    ``line_mib``, one micro-batch's logits) and its time (s). ``series``: name -> (peaks, seconds), one value per
    label; ``lines``: (MiB, label, line style) of each line on the memory panel, in place of ``line_mib``'s. Written
    to ``path`` as PNG. More than 6 labels are written on one slanted line each (side by side, two-line labels
    overlap)."""
    crowded = len(labels) > 6
    fig = new_figure((11, 5.4 if crowded else 4.2))
    axes = fig.subplots(1, 2)
    for panel, (ax, unit) in enumerate(((axes[0], peak_label), (axes[1], time_label))):
        grouped_bars(ax, [label.replace("\n", " ") for label in labels] if crowded else labels,
                     {name: values[panel] for name, values in series.items()}, fontsize=8)
        if crowded:
            ax.tick_params(axis="x", labelrotation=35)
            for tick in ax.get_xticklabels():
                tick.set_horizontalalignment("right")
        ax.set_ylabel(unit)
    for mib, label, style in lines if lines is not None else [(line_mib, "one micro-batch's logits shard", "--")]:
        axes[0].axhline(mib, color="k", ls=style, lw=1, label=label)
    axes[0].legend(fontsize=8)
    return finish_figure(fig, title, path, fontsize=10)


def grouped_bars(ax, labels: list[str], series: dict, width: float | None = None,
                 fontsize: float | None = None) -> None:
    """Each series (name -> one value per label) a bar at each of ``labels``, the series side by side (``width``
    each, default 0.8 / the series' count), its name the bar's legend label; ``labels`` on the x axis."""
    width = width or 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=fontsize)


def logits_line(ax, mib: float, label: str = "one micro-batch's logits") -> None:
    """A dashed line at ``mib`` MiB: one micro-batch's logits, what the step holds at least without twinkle-mem."""
    ax.axhline(mib, color="k", ls="--", lw=1, label=label)


def finish_figure(fig, title: str, path: str, dpi: int = 110, **title_options) -> str:
    """``fig`` titled (``title_options``: suptitle's), laid out and written to ``path`` as PNG (save_png)."""
    fig.suptitle(title, **title_options)
    fig.tight_layout()
    return save_png(fig, path, dpi)


def save_png(fig, path: str, dpi: int = 110) -> str:
    """Write ``fig`` (laid out by the caller) to ``path`` as PNG, its folder created if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


# ------------------------------------------------------------------ a framework's step, a world of CPU processes a case
# bench_verl and bench_swift: each case a fresh world of --workers processes of 1 thread (``units``: what the script
# calls one, singular and plural), a row a case: its processes' records ("workers"), its largest peak, slowest time.
def world_parser(doc: str, name: str, units: tuple[str, str], cases: dict) -> argparse.ArgumentParser:
    """Such a benchmark's options: the sizes (``--vocab``, ``--tokens`` per process, ``--hidden``), ``--workers``,
    ``--cases``, ``--timeout`` per case, ``--out`` (default bench/results/local/NAME), ``--replot``,
    ``--allow-composite``, and a process's own (hidden): ``--child CASE``, ``--rank``. The script adds its others."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=4096, help=f"tokens per micro-batch (one per {units[0]})")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cases", default=",".join(cases))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per case")
    parser.add_argument("--out", default=local_out(name),
                        help="results file stem (OUT.json, OUT.md, OUT.png); the default is not tracked by git")
    parser.add_argument("--replot", action="store_true", help="redraw OUT.png from OUT.json, measuring nothing")
    add_allow_composite(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a process of a case: the case it runs
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    return parser


def replot(args, figure) -> bool:
    """With ``--replot``, OUT.png redrawn from OUT.json (``figure(rows, meta, path)``), measuring nothing; whether
    it was asked for."""
    if args.replot:
        recorded = read_json(args.out + ".json")
        print(f"wrote {figure(recorded['rows'], recorded['meta'], args.out + '.png')}")
    return args.replot


def logits_mib(args) -> float:
    """One process's fp32 logits of one micro-batch, MiB."""
    return args.tokens * args.vocab * 4 / 2**20


def write_world_results(args, what: str, units: tuple[str, str], rows: list, text: str, figure, **fields) -> None:
    """The run's record (every process's twinkle_mem_ran, the sizes, fp32, 1 thread, then ``fields``: the
    ``temperature``, ``load``, ...) and write_results: a header (``what`` ran, the sizes, the CPU, what twinkle-mem
    ran), ``text`` and the load warning; OUT.png by ``figure``."""
    meta = run_metadata([w["ran"] for row in rows for w in row["workers"]], vocab=args.vocab,
                        tokens_per_micro_batch=args.tokens, hidden=args.hidden, workers=args.workers, dtype="float32",
                        threads=1, **fields)
    header = (f"{what}, V = {args.vocab}, {args.tokens} tokens per micro-batch, H = {args.hidden}, fp32, "
              f"T = {meta['temperature']}, {args.workers} CPU {units[1]} of 1 thread; {meta['cpu']}\n"
              f"{ran_line(meta)}\n\n")
    warning = load_warning(meta["load"])
    write_results(args.out, meta, rows, header + text + (f"\n{warning}\n" if warning else ""), figure)


def step_figure(rows: list, meta: dict, short: dict, what: str, units: tuple[str, str], path: str) -> str:
    """The peak and time of each row's step (``rows``: ``case``, ``peak_mib``, ``seconds``), labelled by ``short``,
    a dashed line at one micro-batch's fp32 logits; titled by ``what`` ran and the sizes."""
    title = (f"{what}, V={meta['vocab']}, {meta['tokens_per_micro_batch']} tokens per micro-batch, "
             f"{meta['workers']} CPU {units[1]} ({meta['twinkle_mem_cpu_path']})")
    return peak_and_time_figure([short[r["case"]] for r in rows],
                                {"step": ([r["peak_mib"] for r in rows], [r["seconds"] for r in rows])},
                                meta["tokens_per_micro_batch"] * meta["vocab"] * 4 / 2**20, title, path,
                                peak_label=f"largest {units[0]}'s peak RSS rise (MiB)")


class measured:
    """The peak RSS rise (MiB, ``twinkle_mem.measure.peak_rss``) and seconds of a block, filled in when it exits
    (``with measured() as m: ...``; ``m.record()`` for a JSON record)."""

    def __enter__(self):
        from twinkle_mem.measure import peak_rss
        self._peak = peak_rss()
        self.peak = self._peak.__enter__()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self._peak.__exit__(*exc)
        self.peak_mib = self.peak.bytes / 2**20
        return False

    def record(self):
        return {"peak_mib": round(self.peak_mib, 1), "seconds": round(self.seconds, 2)}


def chosen_cases(spec: str, known: dict) -> list[str]:
    """The cases a comma-separated ``--cases`` names, in its order; exits naming any that ``known`` lacks."""
    cases = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(known))
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {', '.join(known)}")
    return cases


# ------------------------------------------------------------------ the device checks' step table
STEP_FIELDS = ("step", "status", "seconds", "note")


def write_steps(lines: list[str], md_path: str, json_path: str, fields: dict) -> str:
    """The step table of a device check from its ``name|status|seconds|note`` lines: Markdown to
    ``md_path`` (returned, for the console), JSON ``{**fields, "steps": [...], "time": ...}`` to
    ``json_path``."""
    steps = [dict(zip(STEP_FIELDS, line.rstrip("\n").split("|", 3))) for line in lines if line.strip()]
    table = markdown_table(list(STEP_FIELDS), [[s.get(k, "") for k in STEP_FIELDS] for s in steps])
    with open(md_path, "w") as f:
        f.write(table)
    write_json(json_path, {**fields, "steps": steps, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1)
    return table


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="The device checks' step table: reads name|status|seconds|note "
                                            "lines on stdin, writes MD and JSON, prints the table.")
    sub = p.add_subparsers(dest="command", required=True)
    steps = sub.add_parser("steps")
    steps.add_argument("md")
    steps.add_argument("json")
    steps.add_argument("fields", nargs="*", metavar="KEY=VALUE", help="top-level JSON fields; VALUE read as JSON")
    args = p.parse_args(argv)
    fields = {}
    for item in args.fields:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"field {item!r}: expected KEY=VALUE")
        fields[key] = json.loads(value)
    print(write_steps(sys.stdin.readlines(), args.md, args.json, fields), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
