"""bench/bench_common.py, the benchmarks' shared helper: the metadata record every results file
carries, JSON written and read back, the fresh-process measurement, progress lines, Markdown tables;
and a recorded results file re-rendered through it unchanged."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # where `python bench/<script>.py` finds it
    sys.path.insert(0, str(BENCH))

import bench_common  # noqa: E402

METADATA_KEYS = {"torch", "twinkle_mem", "python", "machine", "cpu", "cores", "threads", "git_commit", "date"}


def test_run_metadata_has_every_key_and_the_run_fields_override():
    import torch

    import twinkle_mem

    meta = bench_common.run_metadata(vocab=151936, threads=1)
    assert METADATA_KEYS | {"vocab"} == set(meta)
    assert meta["vocab"] == 151936 and meta["threads"] == 1  # the caller's value, not torch's thread count
    assert meta["torch"] == torch.__version__ and meta["twinkle_mem"] == twinkle_mem.__version__
    assert meta["cpu"] and meta["cores"] >= 1
    assert bench_common.run_metadata()["threads"] == torch.get_num_threads()
    head = subprocess.run(["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert meta["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    json.dumps(meta)  # goes into a JSON file as it is


def test_run_metadata_without_an_importable_twinkle_mem(monkeypatch):
    # bench_cuda.py on a GPU whose build failed still writes its JSON (peers' timings, no version).
    monkeypatch.setitem(sys.modules, "twinkle_mem", None)  # `import twinkle_mem` raises ImportError
    meta = bench_common.run_metadata()
    assert METADATA_KEYS == set(meta) and meta["twinkle_mem"] is None and meta["cpu"]


def test_write_json_creates_the_folder_and_reads_back(tmp_path):
    data = {"meta": {"torch": "x"}, "rows": [{"n": 1, "s": 0.5}]}
    path = bench_common.write_json(str(tmp_path / "new" / "r.json"), data, indent=1)
    assert bench_common.read_json(path) == data
    assert (tmp_path / "new" / "r.json").read_text() == json.dumps(data, indent=1)


def test_run_child_returns_the_last_json_line_and_reports_failures():
    got = bench_common.run_child([sys.executable, "-c", "print('progress'); print('{\"s\": 1.5}')"])
    assert got == {"s": 1.5}
    with pytest.raises(bench_common.ChildFailed) as failed:
        bench_common.run_child([sys.executable, "-c", "print('{\"s\": 1}'); raise ValueError('bad peer')"])
    assert failed.value.returncode == 1 and failed.value.last_line == "ValueError: bad peer"
    with pytest.raises(bench_common.ChildFailed, match="no output"):
        bench_common.run_child([sys.executable, "-c", "pass"])
    with pytest.raises(subprocess.TimeoutExpired):
        bench_common.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)


def test_progress_lines_are_numbered(capsys):
    progress = bench_common.Progress(2)
    progress.step("naive N=512")
    progress.done("0.1 s")
    progress.step("twinkle_mem N=512")
    progress.done("timed out")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[1/2] naive N=512 ... 0.1 s", "[2/2] twinkle_mem N=512 ... timed out"]
    assert all(line.endswith(" s elapsed)") for line in lines)


def test_markdown_table():
    table = bench_common.markdown_table(["peer", "N", "s"], [["a", 1, "0.5"], ["b", 2, "0.25"]], align="lrr")
    assert table == "| peer | N | s |\n|---|---:|---:|\n| a | 1 | 0.5 |\n| b | 2 | 0.25 |\n"
    assert bench_common.markdown_table(["x"], [])== "| x |\n|---|\n"
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        bench_common.markdown_table(["a", "b"], [["only one"]])
    with pytest.raises(ValueError, match="one letter per column"):
        bench_common.markdown_table(["a", "b"], [], align="l")


def test_recorded_vocab_parallel_table_renders_unchanged():
    # bench_vocab_parallel.py writes its .md through markdown_table: the recorded JSON gives the recorded .md.
    import importlib

    vocab_parallel = importlib.import_module("bench_vocab_parallel")
    recorded = bench_common.read_json(str(BENCH / "results" / "vocab_parallel.json"))
    assert vocab_parallel._table(recorded["rows"], recorded["meta"]) == (BENCH / "results" / "vocab_parallel.md").read_text()


@pytest.mark.parametrize("script,stem", [("bench_linear_selective_log_softmax", "linear_selective_log_softmax"),
                                         ("bench_twinkle_fused", "twinkle_fused"),
                                         ("bench_twinkle_mcore_bridge", "twinkle_mcore_bridge"),
                                         ("bench_recipe", "recipe")])
def test_recorded_tables_render_unchanged(script, stem):
    # These benchmarks write their .md through markdown_table; --replot redraws it from the recorded JSON.
    import importlib

    module = importlib.import_module(script)
    recorded = bench_common.read_json(str(BENCH / "results" / f"{stem}.json"))
    if script in ("bench_twinkle_mcore_bridge", "bench_recipe"):
        table = module._table(recorded["meta"], recorded["results"])
    else:
        table = module._table(recorded["rows"], recorded["meta"])
    assert table == (BENCH / "results" / f"{stem}.md").read_text()


def test_steps_command_writes_the_device_checks_table(tmp_path):
    # gpu_check.sh / npu_check.sh pipe their "name|status|seconds|note" lines here.
    md, out = tmp_path / "check.md", tmp_path / "check.json"
    lines = "build|PASS|12|build.log\nbenchmark|FAIL|3|rc=3, a|b.log\n\n"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_common.py"), "steps", str(md), str(out), "dry_run=true",
                           "failed=1"], input=lines, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    table = ("| step | status | seconds | note |\n|---|---|---|---|\n| build | PASS | 12 | build.log |\n"
             "| benchmark | FAIL | 3 | rc=3, a|b.log |\n")
    assert md.read_text() == table and proc.stdout == table
    summary = json.loads(out.read_text())
    assert list(summary) == ["dry_run", "failed", "steps", "time"]
    assert summary["dry_run"] is True and summary["failed"] == 1
    assert summary["steps"] == [{"step": "build", "status": "PASS", "seconds": "12", "note": "build.log"},
                                {"step": "benchmark", "status": "FAIL", "seconds": "3", "note": "rc=3, a|b.log"}]
    bad = subprocess.run([sys.executable, str(BENCH / "bench_common.py"), "steps", str(md), str(out), "failed"],
                         input=lines, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "expected KEY=VALUE" in bad.stderr


def test_machine_load_is_recorded_and_a_loaded_run_warned():
    # Issue 27: ratios between peers moved from 5.1x to 1.4x under load; a run says how loaded it was.
    record = bench_common.MachineLoad().record()
    assert set(record) == {"cores", "load_average_start", "load_average_end", "other_processes_cpu_cores", "wall_s"}
    assert record["other_processes_cpu_cores"] is None or record["other_processes_cpu_cores"] >= 0
    quiet = {"cores": 2, "load_average_start": [0.2, 0.3, 0.3], "other_processes_cpu_cores": 0.1}
    assert bench_common.load_warning(quiet) is None
    for loaded in (dict(quiet, other_processes_cpu_cores=1.2), dict(quiet, load_average_start=[2.5, 2.0, 1.0])):
        assert bench_common.load_warning(loaded).startswith("WARNING: the machine was loaded")
    many_cores = {"cores": 16, "load_average_start": [2.0, 2.0, 2.0], "other_processes_cpu_cores": 2.0}
    assert bench_common.load_warning(many_cores) is None  # 2 busy cores of 16: below a quarter
