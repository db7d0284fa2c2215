"""bench/bench_head_peers.py (issue 51): its dry run on the CPU reports every peer in every cell, checks the edge rows
against float64, counts ATen ops, and compares the fused head only with peers that give the cell's outputs."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def peers_bench():
    if str(BENCH) not in sys.path:  # where `python bench/...py` finds bench_common
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("bench_head_peers")


def dry_run(tmp_path, *args):
    out = tmp_path / "head_peers"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_head_peers.py"), "--dry-run", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text()), proc


def check_every_cell(data, peers, shapes, n_cells_per_shape=5):
    rows = data["rows"]
    cells = {(r["shape"], r["output"], r["head"]) for r in rows}
    assert len(cells) == n_cells_per_shape * len(shapes)  # 2 gradient outputs x 2 head kinds + the forward
    for cell in cells:
        assert sorted(r["peer"] for r in rows if (r["shape"], r["output"], r["head"]) == cell) == sorted(peers)
    return rows


def test_dry_run_reports_every_peer_and_checks_the_edge_rows(tmp_path, peers_bench):
    peers = [p for p in peers_bench.PEERS if p != "compiled"]  # (torch.compile: the e2e tier's full dry run)
    data, proc = dry_run(tmp_path, "--shapes", "32x777", "--peers", ",".join(peers), "--count-ops")
    rows = check_every_cell(data, peers, ["32x777"])
    for r in rows:
        assert r["status"], r
        if r["peer"] in ("twinkle_fused", "unfused_op", "unfused_torch"):
            assert r["status"] == "ok" and r["logp_ok"] and r["logp_err_rounded"] <= 1e-5, r
            assert r["ms"] > 0 and r["ops"]["aten_ops"] > 0 and r["ops"]["matmuls"] >= 1 and r["ops"]["kernels"] is None
            assert r["logp_err_exact"] > r["logp_err_rounded"]  # bf16 logits: the exact reference is further off
        if r["peer"] == "verl_triton":
            assert r["status"] == "cannot run: verl's Triton kernel runs on CUDA only"
        if r["peer"] in ("liger_flce", "liger_grpo", "cce"):  # not installed here (or without triton)
            assert r["status"].startswith(("not installed", "cannot run", "failed")) or r["status"] in (
                "logp only (no entropy)", "a GRPO loss"), r
    fused = [r for r in rows if r["peer"] == "twinkle_fused"]
    assert all("vs_unfused" in r for r in fused)
    text = proc.stdout
    assert text.count("target 32x777") == 5 and "DRY RUN" in text and "twinkle-mem ran: cpu backend" in text
    assert (tmp_path / "head_peers.md").read_text() in text
    assert (tmp_path / "head_peers.png").stat().st_size > 10_000
    assert data["meta"]["dry_run"] is True and data["meta"]["n"] == 64


@pytest.mark.e2e
def test_the_whole_dry_run(tmp_path, peers_bench):
    data, _ = dry_run(tmp_path)
    rows = check_every_cell(data, list(peers_bench.PEERS), list(peers_bench.DRY_SHAPES))
    assert all(r["status"] == "ok" for r in rows if r["peer"] == "compiled")


def test_the_fused_head_is_compared_only_with_peers_giving_the_same_outputs(peers_bench):
    def row(peer, ms, status="ok"):
        return {"peer": peer, "shape": "1x2", "output": "both_grad", "head": "frozen", "ms": ms, "status": status}
    rows = [row("twinkle_fused", 10.0), row("unfused_op", 8.0), row("liger_flce", 1.0, "logp only (no entropy)"),
            row("liger_grpo", 2.0, "a GRPO loss"), row("verl_torch", 12.0), row("compiled", 20.0),
            {"peer": "cce", "shape": "1x2", "output": "both_grad", "head": "frozen", "status": "not installed: x"}]
    peers_bench.add_ratios(rows)
    fused = rows[0]
    assert fused["vs_unfused"] == 10.0 / 8.0 and fused["best_peer"] == "verl_torch"
    assert fused["vs_best_peer"] == 10.0 / 12.0  # Liger's faster logp-only call and the GRPO loss are not the cell's
    table = peers_bench.render(rows, {"n": 2, "dtype": "bf16", "device": "cpu", "reps": 1, "warmup": 0,
                                      "torch": "x", "dry_run": True})
    assert "target 1x2 both_grad frozen: 1.25x unfused (<= 1.05: FAIL); 0.83x the fastest peer" in table
    assert "| cce | not installed: x |" in table.replace("1x2 | both_grad | frozen | ", "")


def test_count_ops_counts_the_top_level_aten_ops(peers_bench):
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    ops = peers_bench.count_ops(lambda: (a @ b).sum(), peers_bench.Device("cpu"))
    # matmul dispatches mm (and views) beneath it: one top-level matmul, one sum
    assert ops == {"aten_ops": 2, "matmuls": 1, "kernels": None}
    ops = peers_bench.count_ops(lambda: [torch.mm(a, b) for _ in range(5)], peers_bench.Device("cpu"))
    assert ops["aten_ops"] == 5 and ops["matmuls"] == 5


def test_a_peer_that_gives_less_is_timed_and_marked(peers_bench, monkeypatch):
    def logp_only(ctx):
        return (lambda h, w, y, entropy_grad: (torch.log_softmax(h @ w.t(), -1).gather(-1, y[:, None])[:, 0], None),
                "logp only")
    monkeypatch.setitem(peers_bench.PEERS, "fake", ("a logp-only peer", logp_only))
    args = peers_bench.parse_args(["--dry-run", "--reps", "2"])
    data = peers_bench.inputs(8, 50, 16, torch.float32, "cpu")
    rows = list(range(4)) + list(range(12, 16))
    ctx = {"device": "cpu", "n": 16, "notes": set(), "rows": rows,
           "reference": peers_bench.reference(data[0], data[1], data[2], rows, torch.float32)}
    row = peers_bench.run_cell("fake", "both_grad", "trainable", data, ctx, args, peers_bench.Device("cpu"))
    assert row["status"] == "logp only (no entropy)" and row["reps"] == 2 and row["logp_err_exact"] < 1e-5
    assert "entropy_err_exact" not in row


def test_twinkle_mems_own_failure_fails_the_run(peers_bench, monkeypatch, tmp_path, capsys):
    def wrong(ctx):  # log-probs off by 1e-3: beyond the 1e-5 bound against float64
        fn, gives = peers_bench._unfused_op(ctx)
        return (lambda h, w, y, entropy_grad: (lambda out: (out[0] + 1e-3, out[1]))(fn(h, w, y, entropy_grad))), gives
    monkeypatch.setitem(peers_bench.PEERS, peers_bench.FUSED, ("off by 1e-3", wrong))
    argv = ["--dry-run", "--shapes", "16x300", "--outputs", "forward", "--peers", "twinkle_fused,unfused_op,cce",
            "--reps", "1", "--out", str(tmp_path / "x")]
    assert peers_bench.main(argv) == 1
    assert "FAILED: twinkle_fused 16x300 forward -: ok, log-probs beyond 1e-5 of float64" in capsys.readouterr().out
    monkeypatch.setitem(peers_bench.PEERS, peers_bench.FUSED, ("the op", peers_bench._unfused_op))
    assert peers_bench.main(argv) == 0  # (cce not installed: its row says so, the run passes)


def test_cells_past_the_time_budget_are_reported_not_run(peers_bench, tmp_path):
    # The device check's call limit: what the budget leaves out is in the table, and the run does not fail for it.
    argv = ["--dry-run", "--shapes", "16x300", "--peers", "twinkle_fused,unfused_op", "--time-budget", "0",
            "--out", str(tmp_path / "x")]
    assert peers_bench.main(argv) == 0
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert len(rows) == 10 and all(r["status"] == "not run: the time budget (0 s) was spent" for r in rows)
