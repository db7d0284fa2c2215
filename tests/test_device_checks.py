"""bench/gpu_check.sh and bench/npu_check.sh bring their results back through the device tool, which
returns at most 8 files from $OUT (16 MiB each, at most 2 folders down, names of letters, digits,
'.', '_', '-'): the summaries as files, every log in one archive (bench/pack_results.py)."""
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_pack():
    spec = importlib.util.spec_from_file_location("pack_results", ROOT / "bench" / "pack_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pack_results = _load_pack()


def assert_all_comes_back(out: Path):
    files = pack_results.returned_files(str(out))
    assert 0 < len(files) <= 8, files
    for rel in files:
        parts = Path(rel).parts
        assert len(parts) - 1 <= 2 and all(pack_results.NAME.match(p) for p in parts), rel
        assert (out / rel).stat().st_size <= 16 << 20, rel
    assert pack_results.problems(str(out)) == []
    return files


def test_pack_results_many_logs_and_a_huge_one(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    (results / "sub").mkdir(parents=True)
    for i in range(12):
        (results / f"step{i}.log").write_text(f"log {i}\n" * 100)
    (results / "sub" / "nested name.log").write_text("a name the tool would drop, archived\n")
    rng = random.Random(0)  # incompressible: the archive must clip it to fit
    (results / "sanitizer.log").write_text("".join(f"{rng.getrandbits(64):016x}\n" for _ in range(2_000_000)))
    (results / "summary.json").write_text('{"failed": 0}')
    files = pack_results.pack(str(results), str(out), ["summary.json", "absent.json"], "logs.tar.gz")
    assert files == ["logs.tar.gz", "summary.json"]
    assert_all_comes_back(out)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
        assert names == {f"step{i}.log" for i in range(12)} | {"sub/nested name.log", "sanitizer.log"}
        assert tar.extractfile("step3.log").read() == b"log 3\n" * 100  # small logs whole
        clipped = tar.extractfile("sanitizer.log").read()
        assert b"bytes cut by pack_results.py" in clipped and clipped.endswith(b"\n")
    # Broken on purpose: the old copy of every file to $OUT is more than comes back.
    flat = tmp_path / "flat"
    shutil.copytree(results, flat)
    assert any("files (at most 8" in p for p in pack_results.problems(str(flat)))


@pytest.mark.e2e  # (the whole script, its benchmarks and a collection of the suite: the end-to-end tier)
def test_gpu_check_dry_run_returns_every_log_within_the_limits(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), TMPDIR=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = assert_all_comes_back(out)
    assert {"gpu_check.json", "gpu_check.md", "bench_cuda.json", "ptxas.json", "gpu_check_logs.tar.gz"} <= set(files)
    summary = json.loads((out / "gpu_check.json").read_text())
    logs = {word.strip(",") for step in summary["steps"] for word in step["note"].split() if word.endswith(".log")}
    assert {"pytest.log", "smoke.log", "bench.log"} <= logs
    left_in_results = set(pack_results.returned_files(str(tmp_path / "twinkle_mem_gpu_check_dry_run")))
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        archived = set(tar.getnames())
    assert logs <= archived  # every step's log
    assert archived | set(files) - {"gpu_check_logs.tar.gz"} == left_in_results  # and every other file


@pytest.mark.parametrize("script", ["bench/gpu_check.sh", "bench/npu_check.sh"])
def test_device_checks_install_nothing_from_a_registry(script):
    # The device machines have no package registry: carried wheels are unpacked, never pip-installed.
    text = (ROOT / script).read_text()
    assert "pip install" not in text and "pip download" not in text
    assert "-m zipfile -e" in text and "bench/pack_results.py" in text
    assert "cp -r" not in text  # nothing copied to $OUT around the packer


STUB_PYTHON = """#!/usr/bin/env bash
# Stands in for the CANN node's Python: the script's own machinery (wheel unpacking, the step table, the
# packer) runs on the real interpreter; every check "passes" except the benchmark, which fails.
case "$1" in
  -m) [ "$2" = zipfile ] && exec {real} "$@"; echo "stub: $*" ;;
  -c) exec {real} "$@" ;;
  bench/pack_results.py | bench/bench_common.py) exec {real} "$@" ;;
  bench/bench_npu.py) echo "stub benchmark fails"; exit 3 ;;
  -) cat >/dev/null; echo "stub: a heredoc check" ;;
  *) echo "stub: $*" ;;
esac
"""


def test_npu_check_returns_every_step_log_within_the_limits(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON.replace("{real}", sys.executable))
    stub.chmod(0o755)
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHON=str(stub), ASCEND_HOME_PATH=str(tmp_path),
               NPU_CHECK_RESULTS=str(results))
    proc = subprocess.run(["bash", "bench/npu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "FAILED: benchmark" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    files = assert_all_comes_back(out)
    assert files == ["npu_check.json", "npu_check.md", "npu_check_logs.tar.gz"]  # (no bench_npu.json: it failed)
    steps = json.loads((out / "npu_check.json").read_text())["steps"]
    assert len(steps) == 8 and [s["status"] for s in steps].count("FAIL") == 1 and steps[-1]["status"] == "FAIL"
    with tarfile.open(out / "npu_check_logs.tar.gz") as tar:
        assert set(tar.getnames()) == {f"step{i}.log" for i in range(1, 9)}
        assert b"stub benchmark fails" in tar.extractfile("step8.log").read()
