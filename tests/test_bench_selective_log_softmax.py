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
    paths = list(dict.fromkeys(r["cpu_path"] for r in recorded["results"] if "cpu_path" in r))
    assert paths, "the recorded run names no CPU kernel path"
    for ax in bench.results_figure(recorded).get_axes():
        assert {line.get_label() for line in ax.get_lines()} == peers == {label for label, _, _ in
                                                                          bench.peer_runs(bench.PEERS, paths)}


# ------------------------------------------------------------------ issue 27: what a newcomer's run shows
class _LoadedMachine:
    def record(self):
        return {"cores": 2, "load_average_start": [3.5, 3.0, 2.0], "load_average_end": [3.8, 3.1, 2.1],
                "other_processes_cpu_cores": 1.4, "wall_s": 12.0}


def test_every_size_takes_the_median_of_several_calls(bench, monkeypatch, tmp_path, capsys):
    calls = []

    def run_peer(peer, n, v, reps, timeout, path=None, op_reps=0):
        calls.append((peer, n, reps))
        times = [0.1 * n / 512 * (1 + 0.1 * i) for i in range(reps)]
        label = peer if path is None else f"{peer}@{path}"
        return {"peer": label, "n": n, "v": v, **bench.time_summary(times), "extra_peak_bytes": 0,
                "vs_floor": bench.ratio_summary([3.0, 2.0, 4.0]), "logits_bytes": 2 * n * v, "saved_bytes": 8 * n,
                "err_logp": 1e-7, "err_entropy": 1e-7}

    monkeypatch.setattr(bench, "run_peer", run_peer)
    monkeypatch.setattr(bench, "MachineLoad", _LoadedMachine)
    monkeypatch.setattr(bench, "write_plot", lambda out: None)
    out = tmp_path / "run"
    bench.main(["--sizes", "512,1024,2048", "--peers", "compiled,twinkle_mem", "--paths", "avx2", "--reps", "3",
                "--out", str(out)])
    assert sorted({(n, reps) for _, n, reps in calls}) == [(512, 3), (1024, 3), (2048, 3)]
    printed = capsys.readouterr().out
    table = printed[printed.index("selective log-softmax"):]
    assert "spread" in table and "median of 3 calls" in table and "vs floor" in table
    assert sum(line.split()[:2] == [str(n), "twinkle_mem@avx2"] and line.split()[5] == "3.0x"
               for line in table.splitlines() for n in (512, 1024, 2048)) == 3
    assert "WARNING: the machine was loaded" in printed and "1.4 of 2 cores" in printed
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["meta"]["load"]["other_processes_cpu_cores"] == 1.4 and data["meta"]["reps"] == 3
    assert data["meta"]["twinkle_mem_backend"] == "cpu"  # (these rows record none: the parent's, the same library)
    assert all(r["spread"] == pytest.approx(0.2 / 1.1) for r in data["results"])


def test_a_run_leaves_the_committed_results_alone(bench):
    out = bench.parse_args([]).out
    assert Path(out).resolve() != Path(bench.RECORDED).resolve()
    ignored = subprocess.run(["git", "-C", str(BENCH.parent), "check-ignore", "-q", out + ".json"])
    assert ignored.returncode == 0, f"{out}.json would show as a change in a fresh clone"
    assert bench.parse_args(["--record"]).out == bench.RECORDED


def test_twinkle_loop_says_where_it_comes_from(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "twinkle.utils.torch_utils", None)  # twinkle-kit not installed
    assert bench.twinkle_loop_source() == bench.TWINKLE_LOOP_COPY
    row = {"peer": "twinkle_loop", "n": 512, "time_s": 1.0, "spread": 0.0, "extra_peak_bytes": 0,
           "logits_bytes": 1, "saved_bytes": 0, "err_logp": 0.0, "err_entropy": 0.0,
           "source": bench.twinkle_loop_source()}
    table = bench.render_table([row], {"vocab": 8, "torch": "x", "threads": 1, "cpu": "c", "reps": 1})
    assert "twinkle_loop *" in table and table.splitlines()[-1].startswith("* twinkle_loop: this script's copy")


def test_the_child_records_the_twinkle_loop_source(bench):
    pytest.importorskip("twinkle.utils.torch_utils")
    proc = subprocess.run([sys.executable, str(BENCH), "--child", "twinkle_loop", "--sizes", "4", "--vocab", "16",
                           "--reps", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["source"].startswith("twinkle-kit 0.5.1")


# ------------------------------------------------------------------ issue 34: the op against its floors
def test_path_peers_run_once_per_cpu_path(bench):
    runs = bench.peer_runs(["compiled", "twinkle_mem_inplace"], ["avx512", "avx2"])
    assert runs == [("compiled", "compiled", None), ("twinkle_mem_inplace@avx512", "twinkle_mem_inplace", "avx512"),
                    ("twinkle_mem_inplace@avx2", "twinkle_mem_inplace", "avx2")]


def test_op_ratios_time_each_variant_against_its_floor(bench):
    import torch
    torch.manual_seed(0)
    logits = (torch.randn(8, 4096) * 2).bfloat16()
    before = logits.clone()
    op = bench.op_ratios(logits, torch.randint(0, 4096, (8,)), reps=3)
    assert set(op) == set(bench.OP_TARGETS) | {"read_s", "read_write_s"} and set(bench.OP_FLOORS) == set(bench.OP_TARGETS)
    assert {"bwd_inplace", "public_intermediate", "public_leaf"} <= set(op)  # issue 41: the backward, the public path
    for name in bench.OP_TARGETS:
        assert op[name]["n"] == 3 and 0 < op[name]["q1"] <= op[name]["median"] <= op[name]["q3"]
    assert op["read_s"] > 0 and op["read_write_s"] > 0
    assert torch.equal(logits, before)  # the in-place backward ran on a copy


def test_twinkle_mem_rows_say_which_backend_and_path_ran(bench, monkeypatch):
    from twinkle_mem.op import native
    ran = bench.twinkle_mem_ran()  # what the child records (bench_common's, issue 42)
    assert ran["cpu_path"] == native.cpu_kernel_path() and ran["backend"] == "cpu"
    rows = [{"peer": "naive", "n": 8}, {"peer": "twinkle_mem@avx2", "n": 8, **ran, "where": "twinkle_mem@avx2"},
            {"peer": "twinkle_mem_inplace@avx2", "n": 8, **ran, "where": "twinkle_mem_inplace@avx2"}]
    assert bench.backend_note(rows) == (f"twinkle-mem ran: cpu backend, CPU path {ran['cpu_path']} "
                                        "(twinkle_mem@avx2, twinkle_mem_inplace@avx2)")
    assert bench.backend_note(rows[:1]) == ""
    # The parent names each child's record after the run (peer@path): what that process ran.
    monkeypatch.setattr(bench, "run_child",
                        lambda cmd, timeout, env: {"n": 8, **ran, "cpu_path": env[bench.CPU_ISA_ENV]})
    got = bench.run_peer("twinkle_mem", 8, 16, 1, 60, path="portable")
    assert got["peer"] == got["where"] == "twinkle_mem@portable" and got["cpu_path"] == "portable"


def test_op_table_shows_each_path_with_the_targets(bench):
    summary = lambda m: {"median": m, "q1": m - 0.1, "q3": m + 0.2, "n": 15}  # noqa: E731
    row = {"peer": "twinkle_mem_inplace@avx2", "n": 2048, "cpu_path": "avx2",
           "op": {"fwd": summary(1.5), "fwd_entropy": summary(1.9), "fwd_entropy_bwd_inplace": summary(2.1),
                  "read_s": 0.036, "read_write_s": 0.037}}
    table = bench.render_op_table([row, {"peer": "compiled", "n": 2048}], {"vocab": 8, "threads": 2, "op_reps": 15})
    lines = table.splitlines()
    assert "median of 15 alternating calls" in lines[0]
    assert lines[3].split() == ["2048", "avx2", "1.50", "[1.40,", "1.70]", "1.90", "[1.80,", "2.10]", "2.10", "[2.00,",
                                "2.30]", "-", "-", "-", "36.0", "37.0"]  # (a run recorded before issue 41's columns)
    assert lines[4].split()[:4] == ["target", "<=", "1.6", "<="]
    row["op"].update(bwd_inplace=summary(1.8), public_intermediate=summary(1.95), public_leaf=summary(1.97))
    row.update(backend="cpu", library="loaded", where="twinkle_mem_inplace@avx2")
    lines = bench.render_op_table([row], {"vocab": 8, "threads": 2, "op_reps": 15}).splitlines()
    assert lines[3].split()[11:] == ["1.80", "[1.70,", "2.00]", "1.95", "[1.85,", "2.15]", "1.97", "[1.87,", "2.17]",
                                     "36.0", "37.0"]
    assert lines[-1] == "twinkle-mem ran: cpu backend, CPU path avx2 (twinkle_mem_inplace@avx2)"
    assert bench.render_op_table([{"peer": "compiled", "n": 2048}], {}) == ""


def test_default_paths_are_the_one_an_op_call_takes(bench, monkeypatch):
    # Issue 51: the README's job times the CPU path this machine uses; the others (portable) only when asked.
    from twinkle_mem.op import native
    taken = native.cpu_kernel_path()
    assert bench.chosen_paths(None) == [taken] and "portable" not in bench.chosen_paths(None)
    assert bench.chosen_paths("all") == bench.cpu_paths() and bench.cpu_paths()[-1] == "portable"
    assert bench.chosen_paths("avx2,portable") == ["avx2", "portable"]
    monkeypatch.setenv(native.CPU_ISA_ENV, "portable")  # a user's cap: their calls take the portable path
    assert bench.chosen_paths(None) == ["portable"]
    runs = bench.peer_runs(["naive", "twinkle_mem", "twinkle_mem_inplace"], bench.chosen_paths(None))
    assert [label for label, _, _ in runs] == ["naive", "twinkle_mem@portable", "twinkle_mem_inplace@portable"]
