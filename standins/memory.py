"""Memory of a statement, measured where nothing else runs: ``measure_in_subprocess()`` /
``peak_rss_delta()`` (peak resident memory and time, in a fresh interpreter) and
``large_allocations()`` (the large CPU allocations torch's profiler saw, in this process).
"""
import json
import os
import subprocess
import sys
import textwrap

_MEASURE_SCRIPT = """
import json, sys, time
sys.path[:0] = {path!r}
from twinkle_mem.measure import peak_rss

EXTRA = {{}}
{setup}

def _run():
{stmt}

_out = _run()  # warm-up: lazy initialisation is not what is measured
del _out
_peaks, _times = [], []
for _ in range({reps}):
    with peak_rss() as _peak:
        _start = time.perf_counter()
        _out = _run()
        _times.append(time.perf_counter() - _start)
    _peaks.append(_peak.bytes)
    del _out
print(json.dumps({{"peak": max(_peaks), "times": _times, "extra": EXTRA}}))
"""


def measure_in_subprocess(setup: str, stmt: str, reps: int = 1, threads: int = 1) -> dict:
    """Run ``stmt`` (a function body) in a fresh interpreter after ``setup`` and one
    warm-up run, ``reps`` times. Returns ``peak``: the largest rise of the resident-set
    high-water mark over one run (bytes), ``times`` (seconds) and ``extra``: whatever
    the statement put in the dict ``EXTRA``.

    The peak is meaningful for allocations of tens of MiB: glibc serves those with
    mmap, so each one is touched in and returned page by page."""
    script = _MEASURE_SCRIPT.format(path=list(sys.path), setup=textwrap.dedent(setup), reps=reps,
                                    stmt=textwrap.indent(textwrap.dedent(stmt), "    "))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_rss_delta(setup: str, stmt: str) -> int:
    """Peak resident-memory rise (bytes) while ``stmt`` runs; see :func:`measure_in_subprocess`."""
    return measure_in_subprocess(setup, stmt)["peak"]


def large_allocations(fn, min_bytes: int):
    """Run ``fn`` under torch's profiler; return (its result, the sizes of the CPU
    allocations of at least ``min_bytes`` it made), as torch's allocator reported them.

    The profiler charges each allocation to the op that made it (net of what that
    op freed), so every separate tensor of the mask's size shows up once."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage >= min_bytes]
    return result, sizes
