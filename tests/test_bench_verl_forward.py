"""bench/bench_verl_forward.py and bench/verl_import.py (issue 51, point 4) without verl: a run missing a module
verl's import needs is refused with one sentence naming it, and Ray alone is stood in for. Its dry run with verl:
tests/integrations/verl/test_verl_bench_forward.py (the verl tier)."""
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("verl_import"), importlib.import_module("bench_verl_forward")


def test_a_missing_module_refuses_the_run_in_one_sentence(modules, monkeypatch, capsys):
    verl_import, bench = modules
    monkeypatch.setattr(verl_import, "NEEDED", verl_import.NEEDED + ("no_such_module_of_verl",))
    assert bench.main(["--dry-run", "--out", "/nonexistent/x"]) == 3
    line = capsys.readouterr().out.strip()
    assert line.startswith("bench_verl_forward: not run: ") and "no_such_module_of_verl" in line
    assert line.count("\n") == 0 and "bash bench/carry_wheels.sh" in line
    assert verl_import.refusal(["a", "b"]).startswith("not run: a, b are not installed here")


def test_ray_alone_is_stood_in_for(modules, monkeypatch, tmp_path):
    verl_import, _ = modules
    fake = tmp_path / "verl"
    fake.mkdir()
    (fake / "__init__.py").write_text("import ray\nOBJECT_REF = ray.ObjectRef\n")  # as verl.protocol uses it
    monkeypatch.syspath_prepend(str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a))
    saved = {name: sys.modules.pop(name) for name in ("ray", "verl") if name in sys.modules}
    try:
        assert verl_import.import_verl() == verl_import.RAY_NOTE
        assert sys.modules["verl"].OBJECT_REF is sys.modules["ray"].ObjectRef
        assert "never called" in verl_import.RAY_NOTE
    finally:
        for name in ("ray", "verl"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)
