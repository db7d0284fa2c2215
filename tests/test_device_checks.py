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
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = assert_all_comes_back(out)
    assert {"gpu_check.json", "gpu_check.md", "bench_cuda.json", "ptxas.json", "gpu_check_logs.tar.gz",
            "head_peers.json", "head_peers.png"} <= set(files)
    summary = json.loads((out / "gpu_check.json").read_text())
    logs = {word.strip(",") for step in summary["steps"] for word in step["note"].split() if word.endswith(".log")}
    assert {"pytest.log", "smoke.log", "bench.log", "head_peers.log"} <= logs
    assert summary["steps"][-1]["step"] == "ncu" and summary["folder"] == "twinkle_mem_gpu_check_dry_run"
    verl = next(step for step in summary["steps"] if step["step"] == "verl forward")  # run, or refused by name
    assert verl["status"] == "PASS" or verl["status"] == "SKIP" and "not installed here" in verl["note"]
    left_in_results = set(pack_results.returned_files(str(tmp_path / "twinkle_mem_gpu_check_dry_run")))
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        archived = set(tar.getnames())
    assert logs <= archived  # every step's log
    assert archived | set(files) - {"gpu_check_logs.tar.gz"} == left_in_results  # and every other file


def gpu_check_plan(*args):
    """The steps bench/gpu_check.sh would run with ``args`` (--list) and their estimates; (rc, stderr) if refused."""
    proc = subprocess.run(["bash", "bench/gpu_check.sh", *args, "--list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        return proc.returncode, proc.stderr
    lines = proc.stdout.split("\n")
    return {line.split()[0]: int(line.split()[1]) for line in lines if line and not line.startswith("total")}


def test_gpu_check_step_lists_and_the_two_calls_fit():
    every = ["build", "tests", "invariance", "sanitizers", "op", "heads", "verl", "ncu"]
    assert list(gpu_check_plan()) == every  # all by default, in their order
    first, second = gpu_check_plan("--call", "1"), gpu_check_plan("--call", "2")
    assert list(first) == ["build", "tests", "invariance", "sanitizers", "op"]
    assert list(second) == ["build", "heads", "verl", "ncu"]
    assert set(first) | set(second) == set(every)  # two calls run every step
    limit = 570
    assert sum(first.values()) < limit and sum(second.values()) <= limit  # each within a call's limit
    assert list(gpu_check_plan("--steps", "verl,heads")) == ["build", "heads", "verl"]  # build added, in order
    rc, err = gpu_check_plan("--steps", "heads,bogus")
    assert rc == 2 and "unknown step 'bogus'" in err
    rc, err = gpu_check_plan("--call", "3")
    assert rc == 2 and "--call takes 1 or 2" in err


def test_pack_keeps_what_fits_and_record_makes_one_folder_of_two_calls(tmp_path):
    # Call 1 and call 2 of one check, each packed as the device tool returns them, recorded into one folder.
    into = tmp_path / "results"
    for call, (steps, kept) in enumerate([("build,tests,op", ["bench_cuda.json", "ptxas.json"]),
                                          ("build,heads,verl", ["head_peers.json", "verl_forward.json"])], 1):
        results, out = tmp_path / f"call{call}", tmp_path / f"out{call}"
        results.mkdir()
        for name in kept + [f"extra{i}.json" for i in range(8)]:  # more results than files come back
            (results / name).write_text(f'{{"call": {call}}}')
        (results / "build.log").write_text(f"build of call {call}\n")  # the same name in both calls
        (results / f"only{call}.log").write_text("x\n")
        (results / "gpu_check.json").write_text(json.dumps({"folder": "gpu_check_h200_2026-12-24", "steps": steps}))
        (results / "gpu_check.md").write_text(f"| step |\n|---|\n| call {call} |\n")
        keep = ["gpu_check.json", "gpu_check.md"] + kept + [f"extra{i}.json" for i in range(8)] + ["absent.png"]
        files = pack_results.pack(str(results), str(out), keep, "gpu_check_logs.tar.gz")
        assert len(files) == 8 and "gpu_check_logs.tar.gz" in files and set(kept) <= set(files)
        assert_all_comes_back(out)
        with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:  # what did not fit is in the archive
            assert set(tar.getnames()) | set(files) == set(pack_results.returned_files(str(results))) | {
                "gpu_check_logs.tar.gz"}
        assert pack_results.record(str(out), str(into)) == str(into / "gpu_check_h200_2026-12-24")
    folder = into / "gpu_check_h200_2026-12-24"
    calls = json.loads((folder / "gpu_check.json").read_text())["calls"]
    assert [c["steps"] for c in calls] == ["build,tests,op", "build,heads,verl"]
    md = (folder / "gpu_check.md").read_text()
    assert md.index("## call 1 (steps build,tests,op)") < md.index("| call 1 |") < md.index("## call 2") < md.index(
        "| call 2 |")
    names = {p.name for p in folder.iterdir()}
    assert {"bench_cuda.json", "head_peers.json", "only1.log", "only2.log", "build.log", "build.call2.log",
            "extra0.json", "extra0.call2.json"} <= names and "gpu_check_logs.tar.gz" not in names
    assert (folder / "build.call2.log").read_text() == "build of call 2\n"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "gpu_check.json").write_text('{"steps": []}')  # a check recorded before issue 51
    with pytest.raises(SystemExit, match="names no results folder"):
        pack_results.record(str(tmp_path / "old"), str(into))


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
    summary = json.loads((out / "npu_check.json").read_text())
    steps = summary["steps"]
    assert len(steps) == 9 and [s["status"] for s in steps].count("FAIL") == 1 and steps[7]["status"] == "FAIL"
    assert steps[8]["step"].startswith("fused heads vs unfused") and summary["folder"] == "results"
    with tarfile.open(out / "npu_check_logs.tar.gz") as tar:
        assert set(tar.getnames()) == {f"step{i}.log" for i in range(1, 10)}
        assert b"stub benchmark fails" in tar.extractfile("step8.log").read()
        assert b"bench/bench_head_peers.py --device npu" in tar.extractfile("step9.log").read()
    # A step list: the heads alone (with the build and the load they need)
    proc = subprocess.run(["bash", "bench/npu_check.sh", "--steps", "heads"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = json.loads((out / "npu_check.json").read_text())["steps"]
    assert [s["step"].split()[0] for s in steps] == ["build", "_C_npu", "fused"]
    refused = subprocess.run(["bash", "bench/npu_check.sh", "--steps", "heads,bogus"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown step 'bogus'" in refused.stderr
