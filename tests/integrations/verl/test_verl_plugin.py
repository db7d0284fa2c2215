"""twinkle-mem's verl.plugins entry point, TWINKLE_MEM_VERL, recognition and refusal (issue 40).

- The entry point loads at `import verl` in a fresh interpreter and in a Ray worker whose driver never imported
  verl (the driver's process group, Ray's processes included, is ended whatever happens); it changes nothing unless
  asked (defaults: verl's logits functions untouched); VERL_USE_EXTERNAL_PLUGINS=none and TWINKLE_MEM_VERL=0 turn
  it off; an invalid variable is logged as an error, and verl still imports.
- verl is recognized by its code, part by part: this verl whole (0.9.1; .ci/run again with 0.9.0 first on the
  path); 0.9.0 and 0.8.0 from their wheels (read, not imported): 0.9.0 whole, 0.8.0 refused, every part, for its
  missing plugin group; a verl whose patch_forward_with_backends no longer sets the torch backend's forward loses
  that part alone, by name.
- install() / uninstall(): idempotent, every original put back, the shared settings' checks;
  `python -m twinkle_mem` names the verl, what install() would patch there part by part apart from what is patched
  in the process, and verl's engines, each served or refused part by part, recognized by their code.
"""
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import verl  # noqa: F401
from standins.twinkle_ray import run_driver
from twinkle_mem.integrations import verl as integration
from twinkle_mem.integrations.verl import patches, startup, verl_names

ROOT = Path(__file__).resolve().parents[3]
STATE = """
    import json, sys
    import verl
    import verl.utils.torch_functional as verl_F
    import verl.models.transformers.monkey_patch as monkey_patch
    from twinkle_mem.integrations import verl as integration
    print(json.dumps(dict(installed=integration.is_installed(), settings=integration.installed_settings(),
                          logits_path=hasattr(verl_F.logprobs_from_logits, "__wrapped__"),
                          fused_head=hasattr(monkey_patch.patch_forward_with_backends, "__wrapped__"))))
"""


def run_python(code, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_MEM_VERL", "VERL_USE_EXTERNAL_PLUGINS")}
    environ.update(env)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc


def state(**env):
    proc = run_python(STATE, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


DEFAULTS = {"logits_path": False, "fused_chunk_bytes": None}
VERSION = integration.FRAMEWORK.found().version  # (0.9.1 from the test extras; .ci/run also runs this file against 0.9.0)


def test_import_verl_installs_the_defaults_and_changes_nothing_unless_asked():
    got, stderr = state()
    assert got == dict(installed=True, settings=DEFAULTS, logits_path=False, fused_head=True)
    assert "twinkle_mem" not in stderr  # (the defaults say nothing)


@pytest.mark.parametrize("env,installed", [
    ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, False), ({"VERL_USE_EXTERNAL_PLUGINS": "another_plugin"}, False),
    ({"VERL_USE_EXTERNAL_PLUGINS": "another_plugin,twinkle_mem"}, True), ({"TWINKLE_MEM_VERL": "0"}, False),
    ({"TWINKLE_MEM_VERL": "1"}, True),
])
def test_verl_and_the_variable_turn_it_off(env, installed):
    got, _ = state(**env)
    assert got["installed"] is installed and got["fused_head"] is installed and got["logits_path"] is False


def test_variable_asks_for_the_logits_path_with_one_log_line():
    got, stderr = state(TWINKLE_MEM_VERL="logits_path,fused_chunk_bytes=64M")
    assert got == dict(installed=True, settings={"logits_path": True, "fused_chunk_bytes": 64 << 20},
                       logits_path=True, fused_head=True)
    lines = [line for line in stderr.splitlines() if f"twinkle-mem installed into verl {VERSION}" in line]
    assert len(lines) == 1 and "install(logits_path=True, fused_chunk_bytes=67108864)" in lines[0], stderr[-3000:]


@pytest.mark.parametrize("value,bad", [("logit_path", "'logit_path' is not an argument of install()"),
                                       ("fused_chunk_bytes=12", "below one row tile")])
def test_invalid_variable_is_logged_loudly_and_verl_still_imports(value, bad):
    got, stderr = state(TWINKLE_MEM_VERL=value)
    assert got["installed"] is False
    assert "twinkle-mem's verl plugin failed; verl runs without it" in stderr and bad in stderr, stderr[-3000:]


def test_entry_point_loads_in_a_ray_worker_whose_driver_never_imported_verl(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import json, os, sys
        import ray

        @ray.remote(num_cpus=1)
        def in_worker():
            import verl
            import verl.utils.torch_functional as verl_F
            from twinkle_mem.integrations import verl as integration
            return dict(pid=os.getpid(), installed=integration.is_installed(),
                        settings=integration.installed_settings(),
                        logits_path=hasattr(verl_F.logprobs_from_logits, "__wrapped__"))

        os.environ["TWINKLE_MEM_VERL"] = "logits_path"  # the driver's environment reaches Ray's workers
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            worker = ray.get(in_worker.remote(), timeout=240)
        finally:
            ray.shutdown()
        print(json.dumps(dict(worker=worker, driver_pid=os.getpid(), driver_imported_verl="verl" in sys.modules)))
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_MEM_VERL", "VERL_USE_EXTERNAL_PLUGINS")}
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    returncode, output = run_driver([sys.executable, "-W", "ignore", str(driver)], env, timeout=400,
                                    stderr=subprocess.DEVNULL)  # (its process group is ended: Ray with it)
    assert returncode == 0, output[-4000:]
    got = json.loads(output.strip().splitlines()[-1])
    assert got["driver_imported_verl"] is False and got["worker"]["pid"] != got["driver_pid"]
    assert got["worker"] == dict(pid=got["worker"]["pid"], installed=True, logits_path=True,
                                 settings={"logits_path": True, "fused_chunk_bytes": None})


# --- recognition ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """verl 0.9.0 and 0.8.0 as their wheels hold them (downloaded, unpacked, never imported)."""
    folders = {}
    for version in ("0.9.0", "0.8.0"):
        where = tmp_path_factory.mktemp(f"verl-{version}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(where),
                        f"verl=={version}"], check=True, capture_output=True, timeout=300)
        wheel, = where.glob("verl-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(where / "unpacked", [n for n in archive.namelist() if n.startswith("verl/")])
        folders[version] = str(where / "unpacked" / "verl")
    return folders


def _plan(folder, logits_path=True):
    return patches.VerlInstallPlan.for_settings(verl_names.PARTS,
                                                {"logits_path": logits_path, "fused_chunk_bytes": None},
                                                integration.FRAMEWORK.recognize(folder))


def test_this_verl_and_0_9_0_are_recognized_whole(released):
    assert VERSION in ("0.9.1", "0.9.0")
    for folder in (integration.FRAMEWORK.folder(), released["0.9.0"]):
        plan = _plan(folder)
        assert plan.refused == {} and plan.accepted == {p.key for p in verl_names.PARTS}, folder
        assert all(plan.features.values()), plan.features
    assert integration.FRAMEWORK.recognize(released["0.9.0"]).version == "0.9.0"


def test_0_8_0_is_refused_part_by_part_for_its_missing_plugin_group(released):
    plan = _plan(released["0.8.0"])
    assert integration.FRAMEWORK.recognize(released["0.8.0"]).version == "0.8.0"
    assert set(plan.refused) == {p.key for p in verl_names.PARTS} and plan.accepted == frozenset()
    for why in plan.refused.values():
        assert "verl/__init__.py loads the verl.plugins entry points at `import verl`: not recognized" in why


def test_a_changed_part_alone_is_refused_by_name(tmp_path):
    copy = tmp_path / "verl"
    shutil.copytree(integration.FRAMEWORK.folder(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkey_patch = copy / "models" / "transformers" / "monkey_patch.py"
    monkey_patch.write_text(monkey_patch.read_text().replace("model.__class__.forward =", "model.forward ="))
    plan = _plan(str(copy))
    assert list(plan.refused) == ["fsdp_fused_head"]
    assert plan.refused["fsdp_fused_head"] == ("patch_forward_with_backends sets the torch backend's forward: not "
                                               "recognized", )


def test_install_leaves_a_refused_part_as_shipped_and_warns(monkeypatch):
    import verl.models.transformers.monkey_patch as monkey_patch
    real = integration.FRAMEWORK.recognize
    key = verl_names.PATCH_FORWARD_WITH_BACKENDS.key

    def changed(folder):
        found = real(folder)
        return found._replace(names={**found.names, key: "unexpected signature (model)"})

    monkeypatch.setattr(integration.FRAMEWORK, "recognize", changed)
    try:
        integration.uninstall()
        with pytest.warns(integration.VerlPartsNotRecognized, match=r"fsdp_fused_head \(verl\.models\.transformers"
                          r"\.monkey_patch\.patch_forward_with_backends: unexpected signature \(model\)\)"):
            integration.install()
        assert list(integration.refused()) == ["fsdp_fused_head"]
        assert not hasattr(monkey_patch.patch_forward_with_backends, "__wrapped__")
    finally:
        monkeypatch.undo()
        integration.install()


# --- install / uninstall ----------------------------------------------------------------------------------------

def test_install_is_idempotent_and_uninstall_restores_everything():
    import verl.models.mcore.model_forward_1f1b_overlap as overlap_forward
    import verl.models.mcore.model_forward_fused as fused_forwards
    import verl.utils.kernel.linear_cross_entropy as kernel
    import verl.utils.torch_functional as verl_F

    def now():
        return (verl_F.logprobs_from_logits, kernel.linear_cross_entropy, fused_forwards.linear_cross_entropy,
                overlap_forward.linear_cross_entropy)

    integration.uninstall()
    shipped = now()
    try:
        integration.install(logits_path=True)
        installed = now()
        assert all(a is not b for a, b in zip(installed, shipped))
        assert installed[1] is installed[2] is installed[3]  # (the Megatron forwards' copies, bound by name)
        integration.install(logits_path=True)
        assert now() == installed
        integration.uninstall()
        assert now() == shipped and not integration.is_installed() and patches.PATCHER.patched() == []
    finally:
        integration.install()


def test_settings_are_checked_as_twinkle_checks_them():
    with pytest.raises(ValueError, match="fused_chunk_bytes=12 is below one row tile"):
        integration.install(fused_chunk_bytes=12)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fused_lm_head'"):
        integration.install(fused_lm_head=True)
    assert str(__import__("inspect").signature(integration.install)) == "(*, logits_path=False, fused_chunk_bytes=None)"
    assert startup.VARIABLE.parse(None) == {} and startup.VARIABLE.parse("0") is None


ENGINE_WOULD = "{} would be patched (recognized)"
ENGINE_REFUSED = ("fsdp_fused_head refused for it, it runs as verl ships it ({} builds its model {}through verl's "
                  "apply_monkey_patch{}: not recognized)")


def engines_said(lines):
    """{engine: what `python -m twinkle_mem` says of it} from the report's engine lines."""
    start = next(i for i, line in enumerate(lines) if line.startswith("  verl's engines, each read from its code"))
    return dict(line.strip().split(maxsplit=1) for line in lines[start + 1:])


def test_python_m_twinkle_mem_names_the_verl_its_parts_and_its_engines():
    """Issue 52: each part says what install() would do, apart from what is patched in this process (nothing: the
    command imports no verl); each of verl's engines (fsdp, megatron, mindspeed, automodel, torchtitan, veomni: all
    in 0.9.0 and 0.9.1) is served or refused part by part, by name."""
    proc = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TWINKLE_MEM_VERL": "logits_path"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    found = f"verl at {integration.FRAMEWORK.folder()} (version/version says {VERSION})"
    assert f"{found}\n" in out and "  install() in this process: no, nothing patched here" in out
    assert "  what install(logits_path=True) (as TWINKLE_MEM_VERL asks) would patch" in out
    for part in verl_names.PARTS:
        assert f"{part.key:28s} {part.what}: would be patched (recognized); not patched in this process" in out
    assert "verl.plugins entry point: declared (twinkle_mem.integrations.verl.plugin)" in out
    fsdp_like = ENGINE_WOULD.format("logits_path")
    megatron = "; ".join(ENGINE_WOULD.format(p) for p in ("megatron_fused_head", "megatron_logits_path"))
    verl_section = out[out.index(found):].splitlines()
    verl_section = verl_section[:1] + list(itertools.takewhile(lambda line: line.startswith(" "), verl_section[1:]))
    assert engines_said(verl_section) == {
        "fsdp": ENGINE_WOULD.format("fsdp_fused_head") + "; " + fsdp_like, "megatron": megatron,
        "mindspeed": megatron,
        "automodel": ENGINE_REFUSED.format("AutomodelEngine", "", ", where impl_backend picks verl's fused forward")
        + "; " + fsdp_like,
        "torchtitan": ENGINE_REFUSED.format("TorchTitanEngine", "", ", where impl_backend picks verl's fused forward")
        + "; " + fsdp_like,
        "veomni": ENGINE_REFUSED.format("VeOmniEngine", "as FSDPEngine does, ", "") + "; " + fsdp_like}
    bad = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TWINKLE_MEM_VERL": "logit_path"})
    assert bad.returncode == 2 and "invalid, `import verl` logs it as an error" in bad.stdout


def test_engines_are_recognized_by_their_code(tmp_path, monkeypatch):
    """An engine is judged by its code, not its name: an automodel engine that built its model through verl's
    apply_monkey_patch would get the FSDP fused head; a verl without the veomni engine says so."""
    copy = tmp_path / "verl"
    shutil.copytree(integration.FRAMEWORK.folder(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    automodel = copy / "workers" / "engine" / "automodel" / "transformer_impl.py"
    automodel.write_text(automodel.read_text() + "\n\ndef _built(model):\n    apply_monkey_patch(model=model)\n")
    shutil.rmtree(copy / "workers" / "engine" / "veomni")
    monkeypatch.setattr(integration.FRAMEWORK, "folder", lambda: str(copy))
    said = engines_said(integration.FRAMEWORK.report(None))
    assert said["automodel"].startswith(ENGINE_WOULD.format("fsdp_fused_head") + "; logits_path not asked for")
    assert said["veomni"] == "not in this verl (no verl.workers.engine.veomni.transformer_impl)"
    assert said["torchtitan"].startswith(ENGINE_REFUSED.format("TorchTitanEngine", "", ", where impl_backend "
                                                               "picks verl's fused forward"))
