"""bench/bench_selective_log_softmax.py's figure: one figure, fwd+bwd time and peak memory against N,
a line per peer, drawn from the JSON the benchmark writes (no measurement)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_selective_log_softmax.py"


@pytest.fixture(scope="module")
def bench():
    if str(BENCH.parent) not in sys.path:  # where `python bench/...py` finds bench_common
        sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_selective_log_softmax", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_results():
    rows = []
    for peer, seconds, mib in (("naive", 1.0, 900.0), ("compiled", 0.5, 200.0), ("twinkle_mem", 0.1, 0.0)):
        for n in (512, 1024, 2048):
            rows.append({"peer": peer, "n": n, "time_s": seconds * n / 512, "extra_peak_bytes": int(mib * n) << 10})
    rows.append({"peer": "broken", "n": 512, "error": "timed out"})  # failed runs are not drawn
    return {"meta": {"torch": "x", "threads": 2, "machine": "m", "vocab": 151936}, "results": rows}


def test_figure_has_time_and_memory_panels_with_every_peer(bench):
    data = synthetic_results()
    fig = bench.results_figure(data)
    axes = fig.get_axes()
    assert len(axes) == 2
    ax_time, ax_mem = axes
    assert "time" in ax_time.get_ylabel() and ax_time.get_yscale() == "log" and ax_time.get_xscale() == "log"
    assert "peak" in ax_mem.get_ylabel() and ax_mem.get_yscale() == "symlog"
    for ax, value in ((ax_time, lambda r: r["time_s"]), (ax_mem, lambda r: r["extra_peak_bytes"] / 2**20)):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert sorted(lines) == ["compiled", "naive", "twinkle_mem"]
        for peer, line in lines.items():
            mine = [r for r in data["results"] if r["peer"] == peer]
            assert list(line.get_xdata()) == [r["n"] for r in mine]
            assert list(line.get_ydata()) == pytest.approx([value(r) for r in mine])
    assert ax_mem.get_ylim()[0] < 0 < ax_mem.get_ylim()[1]  # twinkle-mem's 0 MiB is drawn


def test_recorded_results_replot_without_measuring(bench, tmp_path):
    recorded = json.loads((BENCH.parent / "results" / "selective_log_softmax.json").read_text())
    out = tmp_path / "replotted"
    (tmp_path / "replotted.json").write_text(json.dumps(recorded))
    proc = subprocess.run([sys.executable, str(BENCH), "--replot", "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "replotted.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "replotted.json").read_text()) == recorded  # read, not rewritten
    peers = {r["peer"] for r in recorded["results"] if "error" not in r}
    for ax in bench.results_figure(recorded).get_axes():
        assert {line.get_label() for line in ax.get_lines()} == peers == set(bench.PEERS)
