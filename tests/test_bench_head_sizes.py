"""bench/bench_head_sizes.py runs as written: small sizes, each call size and mode timed in a child of its own,
against another checkout (--base-tree: here the installed twinkle_mem's, as a tree whose python/ holds it), its
table, JSON and figure written."""
import json
import os
import subprocess
import sys

import twinkle_mem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_head_sizes_bench_runs(tmp_path):
    out = tmp_path / "sizes"
    # the installed package (CI's source tree has no library built in python/), in this process and as the base
    base = tmp_path / "base"
    base.mkdir()
    (base / "python").symlink_to(os.path.dirname(os.path.dirname(twinkle_mem.__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bench"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_head_sizes.py"), "--n", "7", "40",
                           "--h", "32", "--vocab", "3000", "--reps", "1", "--threads", "1", "--cpu-time",
                           "--base-tree", str(base), "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "sizes.json").read_text())["rows"]
    assert {(r["n"], r["mode"], r["tree"]) for r in rows} == {
        (n, m, t) for n in (7, 40) for m in ("fwd", "frozen", "trainable") for t in ("this tree", "base")}
    assert all(r["fused_s"] > 0 and r["unfused_s"] > 0 and r["ratio"] == r["fused_s"] / r["unfused_s"] for r in rows)
    assert (tmp_path / "sizes.png").stat().st_size > 1000 and "fused / unfused" in (tmp_path / "sizes.md").read_text()
