"""twinkle-mem's ms-swift switch, recognition and refusal (issue 53).

- The plugin file in ``--external_plugins`` installs at argument parsing (test_swift_grpo.py and
  test_swift_gkd_dpo.py train through it); here: ``TWINKLE_MEM_SWIFT`` installs at ``import swift`` in a fresh
  interpreter, changes nothing unset, ``0`` turns the plugin off too, a bad value raises naming the variable.
- ms-swift is recognized by its code: this one (4.6.0) whole, 4.5.3 from its wheel (read, not imported) whole; a
  changed part alone is refused by name, and install() then leaves it as shipped with a warning.
- install() / uninstall(): idempotent, every original put back; ``python -m twinkle_mem`` names the ms-swift, its
  parts and the plugin's path.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from twinkle_mem.integrations import swift as integration
from twinkle_mem.integrations.swift import patches, startup, swift_names
from twinkle_mem.integrations.swift.settings import LOGITS_PATH

ROOT = Path(__file__).resolve().parents[3]
STATE = """
    import json, sys
    {before}
    import torch
    import swift.rlhf_trainers.grpo_trainer as grpo_trainer
    import swift.rlhf_trainers.rlhf_mixin as rlhf_mixin
    from twinkle_mem.integrations import swift as integration
    # DPO's log-probs on the op: fp32 from bf16 logits (TRL's are bf16)
    dpo = rlhf_mixin.selective_log_softmax(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long))
    print(json.dumps(dict(installed=integration.installed_settings(),
                          fused=hasattr(grpo_trainer.GRPOTrainer._get_logps_via_local_forward, "__wrapped__"),
                          op=dpo.dtype == torch.float32)))
"""
PLUGIN_IMPORT = f"from swift.utils import import_external_file; import_external_file({integration.PLUGIN!r})"
DEFAULTS = {"fused_lm_head": True, "logits_path": True, "fused_chunk_bytes": None}


def run_python(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != startup.ENV_VAR}
    environ.update(env)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def state(before="", **env):
    proc = run_python(STATE.format(before=before), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_nothing_changes_unless_asked():
    assert state() == ({"installed": None, "fused": False, "op": False}, state()[1])


def test_the_variable_installs_at_import_swift_with_one_log_line():
    found, log = state(**{startup.ENV_VAR: "logits_path=0,fused_chunk_bytes=64M"})
    assert found == {"installed": {**DEFAULTS, "logits_path": False, "fused_chunk_bytes": 64 << 20},
                     "fused": True, "op": False}
    assert log.count("twinkle-mem installed into ms-swift 4.") == 1


def test_the_plugin_installs_the_defaults_and_the_variable_turns_it_off():
    assert state(PLUGIN_IMPORT)[0] == {"installed": DEFAULTS, "fused": True, "op": True}
    assert state(PLUGIN_IMPORT, **{startup.ENV_VAR: "0"})[0] == {"installed": None, "fused": False, "op": False}


@pytest.mark.parametrize("value", ["fused_head", "fused_chunk_bytes=12"])
def test_a_bad_value_fails_the_import_naming_the_variable(value):
    proc = run_python("import swift.rlhf_trainers", **{startup.ENV_VAR: value})
    assert proc.returncode != 0 and f"{startup.ENV_VAR}={value!r}" in proc.stderr


# --- recognition ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def previous_release(tmp_path_factory):
    """ms-swift 4.5.3 (the release before 4.6.0) as its wheel holds it (downloaded, unpacked, never imported)."""
    where = tmp_path_factory.mktemp("ms-swift-4.5.3")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(where), "ms-swift==4.5.3"],
                   check=True, capture_output=True, timeout=300)
    wheel, = where.glob("ms_swift-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(where / "unpacked", [n for n in archive.namelist() if n.startswith("swift/")])
    return str(where / "unpacked" / "swift")


def _plan(folder):
    return patches.SwiftInstallPlan.for_settings(swift_names.PARTS, DEFAULTS, integration.FRAMEWORK.recognize(folder))


def test_this_ms_swift_and_the_release_before_are_recognized_whole(previous_release):
    for folder, version in ((integration.FRAMEWORK.folder(), "4.6.0"), (previous_release, "4.5.3")):
        plan = _plan(folder)
        assert integration.FRAMEWORK.recognize(folder).version == version
        assert plan.refused == {} and plan.accepted == {p.key for p in swift_names.PARTS}, folder
        assert all(plan.features.values()), plan.features


GRPO_CHANGE = ("rlhf_trainers/grpo_trainer.py", "logits.div_(self.temperature)", "logits = logits / self.temperature")
GRPO_REFUSED = ("GRPOTrainer._get_logps_via_local_forward takes the logits at [-(logits_to_keep + 1):-1], divides them "
                "in place and calls selective_log_softmax and entropy_from_logits: not recognized")


def changed_copy(folder: Path, file: str, old: str, new: str) -> str:
    """A copy of this ms-swift with one edit (``old`` -> ``new`` in ``file``)."""
    copy = folder / "swift"
    shutil.copytree(integration.FRAMEWORK.folder(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / file).read_text()
    assert old in text
    (copy / file).write_text(text.replace(old, new))
    return str(copy)


@pytest.mark.parametrize("change, part, why", [
    (GRPO_CHANGE, "grpo_fused_head", GRPO_REFUSED),
    (("rlhf_trainers/gkd_loss.py", "m_log = torch.logsumexp(", "m_log = torch.log_mix("),
     "gkd_fused_head", "gkd_loss / jsd_loss: the generalized JSD over the active tokens: not recognized"),
    (("megatron/trainers/utils.py", "output_tensor.div_(temperature)", "output_tensor = output_tensor / temperature"),
     "megatron_fused_head", "MegatronGRPOTrainer.forward_step and compute_per_token_logps_fn call the model, divide "
                            "its output by the temperature and call compute_logps_and_entropy_from_logits: not recognized"),
])
def test_a_changed_part_alone_is_refused_by_name(tmp_path, change, part, why):
    plan = _plan(changed_copy(tmp_path, *change))
    assert plan.refused == {part: (why, )}
    assert plan.accepted == {p.key for p in swift_names.PARTS} - {part}


def test_install_leaves_a_refused_part_as_shipped_and_warns(tmp_path, monkeypatch):
    """install() in a script: the part ms-swift's code no longer supports is left as shipped, named in a warning;
    the others are patched."""
    import swift.rlhf_trainers.grpo_trainer as grpo_trainer
    copy = changed_copy(tmp_path, *GRPO_CHANGE)
    monkeypatch.setattr(integration.FRAMEWORK, "folder", lambda: copy)
    try:
        with pytest.warns(integration.SwiftPartsNotRecognized, match=re.escape(f"grpo_fused_head ({GRPO_REFUSED})")):
            integration.install()
        assert list(integration.refused()) == ["grpo_fused_head"]
        assert not hasattr(vars(grpo_trainer.GRPOTrainer)["_get_logps_via_local_forward"], "__wrapped__")
        assert hasattr(grpo_trainer.selective_log_softmax, "__wrapped__")
    finally:
        integration.uninstall()


def test_install_is_idempotent_and_uninstall_restores_everything():
    import swift.rlhf_trainers.gkd_trainer as gkd_trainer
    import swift.rlhf_trainers.grpo_trainer as grpo_trainer
    import swift.rlhf_trainers.rlhf_mixin as rlhf_mixin

    def now():
        return (vars(grpo_trainer.GRPOTrainer)["_get_logps_via_local_forward"], vars(gkd_trainer.GKDTrainer)[
            "compute_loss"], vars(gkd_trainer.GKDTrainer)["_compute_jsd_loss"], grpo_trainer.selective_log_softmax,
            rlhf_mixin.selective_log_softmax, grpo_trainer.entropy_from_logits)

    shipped = now()
    try:
        integration.install()
        installed = now()
        assert all(a is not b for a, b in zip(installed, shipped))
        assert installed[3] is installed[4]  # (one replacement where ms-swift's modules bound TRL's function)
        integration.install()
        assert now() == installed
    finally:
        integration.uninstall()
    assert now() == shipped and not integration.is_installed() and patches.PATCHER.patched() == []


def python_m_twinkle_mem(value):
    """``python -m twinkle_mem``'s exit status and its lines about ms-swift, with TWINKLE_MEM_SWIFT=``value``."""
    proc = run_python("import runpy; runpy.run_module('twinkle_mem', run_name='__main__')", **{startup.ENV_VAR: value})
    found = f"ms-swift at {integration.FRAMEWORK.folder()} (swift/version.py says 4.6.0)\n"
    return proc.returncode, proc.stdout[proc.stdout.index(found):] if found in proc.stdout else proc.stdout


def test_python_m_twinkle_mem_names_the_ms_swift_its_parts_and_the_plugin():
    status, said = python_m_twinkle_mem("logits_path=0")
    assert status == 0 and said.startswith("ms-swift at "), said
    assert "  install() in this process: no, nothing patched here" in said
    assert "  what install(logits_path=False) (as TWINKLE_MEM_SWIFT asks) would patch" in said
    for part in swift_names.PARTS:
        would = ("not asked for (logits_path=False), recognized" if part.asked is LOGITS_PATH else
                 "would be patched (recognized)")
        assert f"{part.key:28s} {part.what}: {would}; not patched in this process" in said
    assert (f"the plugin file: --external_plugins {integration.PLUGIN} (where it is listed, "
            f"{startup.ENV_VAR}='logits_path=0': install(logits_path=False))") in said
    status, said = python_m_twinkle_mem("logit_path")
    assert status == 2 and "invalid, `import swift` raises" in said
