"""bench/bench_common.py, the benchmarks' shared helper: the metadata record every results file
carries, JSON written and read back, the fresh-process measurement, progress lines, Markdown tables;
and a recorded results file re-rendered through it unchanged. Issue 42: every benchmark names what
twinkle-mem ran (backend, CPU kernel path, in each process it starts), refuses to measure the composite
fallback unless --allow-composite, and writes to bench/results/local/ unless --out says otherwise."""
import importlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:  # where `python bench/<script>.py` finds it
    sys.path.insert(0, str(BENCH))

import bench_common  # noqa: E402

METADATA_KEYS = {"torch", "twinkle_mem", "python", "machine", "cpu", "cores", "threads", "git_commit", "date",
                 "twinkle_mem_backend", "twinkle_mem_cpu_path", "twinkle_mem_ran"}


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
    assert meta["twinkle_mem_backend"] == "None" and "does not import" in meta["twinkle_mem_ran"][0]["library"]
    bench_common.refuse_composite(meta["twinkle_mem_ran"], allowed=False)  # nothing ran: nothing to refuse


def test_write_json_creates_the_folder_and_reads_back(tmp_path):
    data = {"meta": {"torch": "x"}, "rows": [{"n": 1, "s": 0.5}]}
    path = bench_common.write_json(str(tmp_path / "new" / "r.json"), data, indent=1)
    assert bench_common.read_json(path) == data
    assert (tmp_path / "new" / "r.json").read_text() == json.dumps(data, indent=1)


def test_write_results_writes_the_table_the_rows_and_the_figure(tmp_path, capsys):
    # bench_head_peers and bench_verl_forward call it without a figure; bench_verl and bench_swift with one.
    meta, rows, table = {"vocab": 8}, [{"case": "a", "s": 0.5}], "| case |\n|---|\n| a |\n"
    bench_common.write_results(str(tmp_path / "r"), meta, rows, table)
    assert bench_common.read_json(str(tmp_path / "r.json")) == {"meta": meta, "rows": rows}
    assert (tmp_path / "r.md").read_text() == table and not (tmp_path / "r.png").exists()
    bench_common.write_results(str(tmp_path / "f"), meta, rows, table,
                               lambda r, m, path: Path(path).write_text(f"{len(r)} rows, V = {m['vocab']}"))
    assert (tmp_path / "f.png").read_text() == "1 rows, V = 8" and (tmp_path / "f.md").read_text() == table
    assert capsys.readouterr().out == table + "\n" + table + f"\nwrote {tmp_path / 'f'}.json, .md, .png\n"


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


def test_a_script_measures_in_children_of_itself(tmp_path):
    # run_config starts the script with --child CONFIG; parse_or_answer_child answers there and exits.
    script = tmp_path / "bench_x.py"
    script.write_text(f"import argparse, sys\nsys.path.insert(0, {str(BENCH)!r})\nimport bench_common\n"
                      "twice = lambda config: {'twice': 2 * config['n']}\n"
                      "args = bench_common.parse_or_answer_child(argparse.ArgumentParser(), twice)\n"
                      "print('{\"parent\": true}')\n")
    assert bench_common.run_config(str(script), {"n": 21}) == {"twice": 42}
    assert bench_common.run_child([sys.executable, str(script)]) == {"parent": True}

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
                                         *(("bench_linear_selective_log_softmax", f"linear_{case}")
                                           for case in ("frozen_fp32_logp_grad_vs_base",
                                                        "frozen_fp32_entropy_grad_vs_base", "trainable_fp32_vs_base",
                                                        "frozen_bf16_logp_grad_vs_base", "frozen_bf16_logp_grad",
                                                        "frozen_bf16_entropy_grad_vs_base")),
                                         ("bench_twinkle_fused", "twinkle_fused"),
                                         ("bench_twinkle_mcore_bridge", "twinkle_mcore_bridge"),
                                         ("bench_recipe", "recipe"), ("bench_recipe", "recipe_fused_vs_base"),
                                         ("bench_recipe", "recipe_fused_vs_base_xeon")])
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


# ------------------------------------------------------------------ issue 42: what a benchmark ran
SCRIPTS = sorted(p.stem for p in BENCH.glob("bench_*.py") if p.stem != "bench_common")
ARGV = {"bench_heads": ["--base-python", "unused"], "bench_cuda": ["--device", "cpu"]}  # past their own checks
TABLES = {  # script -> (recorded stem, its table from the recorded JSON)
    "bench_vocab_parallel": ("vocab_parallel", lambda m, d: m._table(d["rows"], d["meta"])),
    "bench_linear_selective_log_softmax": ("linear_selective_log_softmax", lambda m, d: m._table(d["rows"], d["meta"])),
    "bench_twinkle_fused": ("twinkle_fused", lambda m, d: m._table(d["rows"], d["meta"])),
    "bench_twinkle_mcore_bridge": ("twinkle_mcore_bridge", lambda m, d: m._table(d["meta"], d["results"])),
    "bench_recipe": ("recipe", lambda m, d: m._table(d["meta"], d["results"])),
}


def test_every_benchmark_is_covered():
    # A benchmark added to bench/ gets these checks: it is listed here (bench_npu with a stand-in torch_npu).
    assert len(SCRIPTS) >= 15 and {"bench_selective_log_softmax", "bench_recipe", "bench_twinkle_fused", "bench_verl",
                                   "bench_heads", "bench_npu", "bench_cuda"} <= set(SCRIPTS)


def test_twinkle_mem_ran_names_the_backend_and_the_cpu_path(monkeypatch):
    import twinkle_mem
    from twinkle_mem.op import native

    ran = bench_common.twinkle_mem_ran()
    assert ran["backend"] == "cpu" and ran["library"] == "loaded" and ran["device"] == "cpu"
    assert ran["cpu_path"] == native.cpu_kernel_path() and ran["cpu_path"] in native.CPU_PATHS
    assert ran["package"] == os.path.dirname(os.path.abspath(twinkle_mem.__file__)) and ran["where"] == "this process"
    monkeypatch.setenv(native.CPU_ISA_ENV, "portable")  # the path an op call takes now, the cap applied
    assert bench_common.twinkle_mem_ran(where="w")["cpu_path"] == "portable"
    cuda = bench_common.twinkle_mem_ran("cuda")  # this CPU torch: the cuda device would run the composite
    assert cuda["backend"] == "composite" and cuda["library"] == twinkle_mem.backends()["cuda"]
    assert cuda["cpu_path"] == "portable"  # (the CPU library is loaded: its path is named on any device)
    monkeypatch.setattr(twinkle_mem, "backends", lambda: {"cpu": "not built (...); the composite runs on this device"})
    ran = bench_common.twinkle_mem_ran()
    assert ran["backend"] == "composite" and ran["cpu_path"] is None and ran["library"].startswith("not built")


def test_the_record_merges_the_processes_and_names_them_in_a_line():
    ran = bench_common.twinkle_mem_ran()
    records = [dict(ran, where="driver"), dict(ran, where="worker 0"), dict(ran, where="worker 0"),
               dict(ran, cpu_path="portable", where="worker 1"),
               dict(ran, backend="composite", cpu_path=None, library="not built (x)", where="base")]
    merged = bench_common.merge_ran(records)
    assert [r["where"] for r in merged] == ["driver, worker 0", "worker 1", "base"]
    meta = bench_common.run_metadata(records)
    assert meta["twinkle_mem_ran"] == merged and meta["twinkle_mem_backend"] == "cpu, composite"
    assert meta["twinkle_mem_cpu_path"] == f"{ran['cpu_path']}, portable, None"
    assert bench_common.ran_line(meta) == (
        f"twinkle-mem ran: cpu backend, CPU path {ran['cpu_path']} (driver, worker 0); cpu backend, CPU path portable "
        "(worker 1); composite (the native library: not built (x)), no CPU kernel path (base)")
    assert bench_common.run_metadata()["twinkle_mem_ran"] == [ran]  # by default: this process
    assert bench_common.ran_line({"vocab": 8}) == ""  # a run recorded before issue 42


@pytest.mark.parametrize("script", sorted(TABLES))
def test_tables_name_what_ran_and_recorded_ones_render_as_they_were(script):
    module = importlib.import_module(script)
    stem, table = TABLES[script]
    recorded = bench_common.read_json(str(BENCH / "results" / f"{stem}.json"))
    for key in bench_common.ran_fields([bench_common.twinkle_mem_ran()]):
        recorded["meta"].pop(key, None)  # as a run recorded before issue 42 (test_recorded_tables_render_unchanged)
    before = table(module, recorded)
    assert "twinkle-mem ran" not in before
    ran = [dict(bench_common.twinkle_mem_ran(), where="rank 0"), dict(bench_common.twinkle_mem_ran(), where="rank 1")]
    recorded["meta"].update(bench_common.ran_fields(ran))
    line = bench_common.ran_line(recorded["meta"])
    assert line.startswith("twinkle-mem ran: cpu backend, CPU path ") and line.endswith("(rank 0, rank 1)")
    assert table(module, recorded) == before + f"\n{line}\n"


def test_the_refusal_says_why_and_how_to_fix_it():
    source = dict(bench_common.twinkle_mem_ran(), backend="composite", cpu_path=None,
                  package=str(BENCH.parent / "python" / "twinkle_mem"),
                  library="not built (install with `pip install .`, which compiles the kernels); the composite runs")
    with pytest.raises(SystemExit) as refused:
        bench_common.refuse_composite([bench_common.twinkle_mem_ran(), source], allowed=False, script="bench_x.py")
    message = str(refused.value.code)
    assert message.startswith("bench_x.py: not run: twinkle-mem's native cpu library is not loaded")
    assert "composite fallback" in message and "this process: not built" in message
    assert "(this source tree, e.g. through PYTHONPATH=python: no library is built in it)" in message
    assert "`pip install .`" in message and "without PYTHONPATH=python" in message
    assert "`python setup.py build_ext --inplace`" in message and message.endswith("pass --allow-composite.")
    bench_common.refuse_composite(source, allowed=True)  # asked for by name: runs
    bench_common.refuse_composite(bench_common.twinkle_mem_ran(), allowed=False)  # the native library: runs


class _PastTheCheck(Exception):
    """Raised where a benchmark's check of twinkle-mem let it go on (instead of measuring)."""


@pytest.fixture
def bench_main(monkeypatch):
    """Run a benchmark's main() up to its check of twinkle-mem, where twinkle-mem would run ``ran``
    ("composite" or "native"); returns (SystemExit or None where it went past the check, its parsed args)."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # bench_npu imports it
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # (bench_vocab_parallel sets it: restored)
    real_ran, real_refuse, real_popen = bench_common.twinkle_mem_ran, bench_common.refuse_composite, subprocess.Popen
    parsed = []

    def run(script, ran, *argv):
        parsed.clear()

        def twinkle_mem_ran(device="cpu", where="this process"):
            record = real_ran("cpu", where)
            if ran == "composite":
                record.update(backend="composite", cpu_path=None, library="not built (a test's)")
            return dict(record, device=device, backend=device if ran == "native" else "composite")

        def refuse_composite(records, allowed, script=None):
            real_refuse(records, allowed, script)
            raise _PastTheCheck(allowed)

        def parse_args(self, args=None, namespace=None):
            parsed.append(real_parse(self, args, namespace))
            return parsed[-1]

        import argparse
        real_parse = argparse.ArgumentParser.parse_args
        monkeypatch.setattr(bench_common, "twinkle_mem_ran", twinkle_mem_ran)
        monkeypatch.setattr(bench_common, "refuse_composite", refuse_composite)
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *ARGV.get(script, []), *argv])

        def no_process(*args, **kwargs):  # a benchmark that skipped the check fails here, not after measuring
            raise AssertionError(f"{script} went on without checking what twinkle-mem runs (it starts {args[:1]})")
        module = importlib.import_module(script)
        monkeypatch.setattr(subprocess, "Popen", no_process)
        try:
            module.main()
        except _PastTheCheck:
            return None, parsed[0]
        except SystemExit as refused:
            return refused, parsed[0]
        finally:
            monkeypatch.setattr(subprocess, "Popen", real_popen)
        raise AssertionError(f"{script} went on without checking what twinkle-mem runs")

    return run


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_refuses_the_composite_unless_asked_by_name(bench_main, script):
    refused, args = bench_main(script, "composite")
    assert refused is not None and "not run: twinkle-mem's native" in str(refused.code), refused
    assert f"{script}.py: " in str(refused.code) and "--allow-composite" in str(refused.code)
    assert args.allow_composite is False
    refused, args = bench_main(script, "composite", "--allow-composite")
    assert refused is None and args.allow_composite is True  # went on, to measure the composite
    refused, args = bench_main(script, "native")
    assert refused is None  # the native library: no flag needed


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_benchmark_writes_over_a_committed_result_by_default(bench_main, script):
    _, args = bench_main(script, "native")
    out, local = Path(args.out).resolve(), Path(bench_common.LOCAL_RESULTS).resolve()
    assert local == (BENCH / "results" / "local").resolve()
    assert out == local or local in out.parents, f"{script} writes to {out} by default"
    probe = out / "x.json" if out == local else Path(str(out) + ".json")
    ignored = subprocess.run(["git", "-C", str(BENCH), "check-ignore", "-q", str(probe)])
    assert ignored.returncode in (0, 128), f"{probe} would show as a change in a fresh clone"  # (128: not a clone)


def test_a_source_tree_without_a_library_is_refused_and_the_composite_runs_by_name(tmp_path):
    # Issue 42's case: PYTHONPATH=python over a tree with no built library. Its run says so, or measures the
    # composite and says that.
    tree = tmp_path / "python"
    shutil.copytree(BENCH.parent / "python" / "twinkle_mem", tree / "twinkle_mem",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tree))
    probe = bench_common.probe_twinkle_mem(env, where="a tree")  # what a benchmark's children there would run
    assert probe["backend"] == "composite" and probe["package"] == str(tree / "twinkle_mem")
    cmd = [sys.executable, str(BENCH / "bench_selective_log_softmax.py"), "--sizes", "8", "--vocab", "64", "--reps",
           "1", "--op-reps", "1", "--peers", "twinkle_mem", "--out", str(tmp_path / "run")]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "not run: twinkle-mem's native cpu library is not loaded" in refused.stderr
    assert f"twinkle_mem imported from {tree / 'twinkle_mem'}" in refused.stderr
    assert not (tmp_path / "run.json").exists()
    ran = subprocess.run(cmd + ["--allow-composite"], env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "twinkle-mem ran: composite (the native library: not built" in ran.stdout
    meta = json.loads((tmp_path / "run.json").read_text())["meta"]
    assert meta["twinkle_mem_backend"] == "composite" and meta["twinkle_mem_ran"][0]["where"] == "twinkle_mem"


def test_recipe_table_compares_twinkles_metrics():
    # Issue 41: bench_recipe.py shows each mode's first-step metrics against the first mode's (the step's numeric
    # metrics; twinkle's text ones are its wall time and speed).
    import importlib

    recipe = importlib.import_module("bench_recipe")
    recorded = bench_common.read_json(str(BENCH / "results" / "recipe_fused_vs_base.json"))
    meta, results = recorded["meta"], recorded["results"]
    first, second = list(results)[:2]
    for mode, grad_norm in ((first, 0.5), (second, 0.25)):
        for res in results[mode].values():
            res["metrics"] = [{"loss": 0.01, "grad_norm": grad_norm, "speed": f"{grad_norm} iters/s"}]
    rows = [line for line in recipe._table(meta, results).splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| twinkle's metrics (first step) vs first row |")
    assert [row.rsplit("|", 2)[1].strip() for row in rows[1:]] == ["-", "grad_norm -2.5e-01"] * 2
    for res in results[second].values():
        res["metrics"][0]["grad_norm"] = 0.5
    assert [row.rsplit("|", 2)[1].strip() for row in recipe._table(meta, results).splitlines()
            if row.startswith("| ")][1:] == ["-", "same"] * 2


@pytest.mark.parametrize("script", ["bench_verl", "bench_swift"])
def test_world_benchmarks_fix_the_workers_mmap_threshold(script, monkeypatch, tmp_path):
    # Each worker's peak is its own only where glibc hands freed blocks back at once: without the fixed threshold its
    # heap keeps the pages of the phase before (bench_verl's logits path read 9,359 MiB, 7,153 MiB with it).
    module = importlib.import_module(script)
    launched = []

    class Worker:
        def __init__(self, cmd, env, **_):
            launched.append(env)
            self.pid, self.returncode = os.getpid(), 0
            if "--out" in cmd:  # (bench_swift's worker writes its record to a file)
                Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"rank": env["RANK"]}))

        def communicate(self, timeout=None):
            return json.dumps({"rank": launched[-1]["RANK"]}) + "\n", ""

        def poll(self):
            return 0

    monkeypatch.setattr(module.subprocess, "Popen", Worker)
    args = types.SimpleNamespace(workers=2, vocab=64, tokens=8, hidden=4, sequences=1, timeout=5)
    case = next(iter(module.CASES))
    records = module.run_case(args, case, str(tmp_path)) if script == "bench_swift" else module.run_case(args, case)
    assert len(records) == len(launched) == 2
    assert all(env["MALLOC_MMAP_THRESHOLD_"] == "65536" and env["OMP_NUM_THREADS"] == "1" for env in launched)
