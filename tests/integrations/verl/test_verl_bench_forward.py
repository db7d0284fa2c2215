"""bench/bench_verl_forward.py's dry run (issue 51, point 4): verl's own forward through apply_monkey_patch on the
CPU with a tiny Qwen2 config, every path (the Triton kernel reported as unable to run here), the fused paths'
log-probs against each other."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_dry_run_runs_every_path(tmp_path):
    out = tmp_path / "verl_forward"
    proc = subprocess.run([sys.executable, "bench/bench_verl_forward.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["path"]: r for r in data["rows"]}
    assert list(rows) == ["logits", "torch", "triton", "twinkle"]
    assert rows["triton"]["status"] == "cannot run: verl's Triton kernel runs on CUDA only"
    for path in ("logits", "torch", "twinkle"):
        row = rows[path]
        assert row["status"] == "ok" and row["fwd_bwd_ms"] > 0 and row["no_grad_ms"] > 0, row
        assert len(row["edge_logp"]) == 8 and all(x < 0 for x in row["edge_logp"])
    # twinkle's fp32 log-probs of the same bf16 model against verl's torch backend's: one bf16 model, the same tokens
    assert max(abs(a - b) for a, b in zip(rows["twinkle"]["edge_logp"], rows["torch"]["edge_logp"])) < 0.05
    assert data["meta"]["tokens"] == 128 and data["meta"]["verl"]
    assert "twinkle path" in proc.stdout  # the table names what twinkle-mem ran in the twinkle path's process
