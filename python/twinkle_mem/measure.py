"""Measurement helpers shared by the tests and the benchmarks (Linux).

``peak_rss()`` gives the rise of the process's resident-set high-water mark
over a block of code. It first resets the mark to the current RSS (writing 5
to /proc/self/clear_refs), so one process can measure several blocks in turn.
Torch's CPU allocator hands large blocks back to the OS, so every large
temporary shows in the mark.
"""
from __future__ import annotations

import contextlib
import platform
from typing import Iterator


def proc_status_bytes(key: str) -> int:
    """A /proc/self/status entry given in kB (VmRSS, VmHWM, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRSS:
    """Filled in when the ``peak_rss()`` block exits."""

    bytes: int = 0


@contextlib.contextmanager
def peak_rss() -> Iterator[PeakRSS]:
    """``with peak_rss() as m: ...``; then ``m.bytes`` is the peak RSS rise over the block."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    result = PeakRSS()
    base = proc_status_bytes("VmRSS")
    try:
        yield result
    finally:
        result.bytes = proc_status_bytes("VmHWM") - base


def cpu_name() -> str:
    """The CPU model, for benchmark records."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
