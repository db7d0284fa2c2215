"""TWINKLE_MEM_INSTALL (issue 25): the start-up hook installs twinkle-mem in every process that imports
twinkle, with no code change; unset, nothing happens; a bad value fails `import twinkle`.

Everything here runs fresh interpreters of the environment the package is installed in (the hook is
the .pth that `pip install` put in site-packages): with the hook removed, every test but the grammar's,
the logging's and the one of a process that never imports twinkle fails. The packaging of the hook (wheel, editable, uninstall) is in test_packaging.py; the Ray workers
in test_startup_hook_ray.py.
"""
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from standins import twinkle_copies
from twinkle_mem.integrations import twinkle as integration
from twinkle_mem.integrations.twinkle import startup

ROOT = Path(__file__).resolve().parents[3]
VAR = startup.ENV_VAR


def run_python(code: str, value=None, timeout=120, args=(), pythonpath=None):
    """A fresh interpreter of this environment, with the variable set to ``value`` (None: unset) and
    ``pythonpath`` first on the path."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if value is not None:
        env[VAR] = value
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# What a process did to twinkle, once every module install() patches is imported (those not imported before
# are patched as they are): twinkle-mem's settings, every (owner, attribute) it replaced, and the names
# twinkle's modules bind selective_log_softmax to.
STATE = """
    import json, sys
    import twinkle.loss.gkd, twinkle.model.megatron.megatron, twinkle.model.transformers.transformers  # noqa
    import twinkle.model.megatron.strategy.megatron, twinkle.processor.base, megatron.core.pipeline_parallel  # noqa
    from twinkle_mem.integrations import twinkle as integration
    from twinkle_mem.integrations.twinkle import patches
    import twinkle.utils.torch_utils as tu
    patched = sorted(f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', getattr(o, '__name__', o))}.{n}"
                     for o, n in patches.patched())
    # what uninstall() would put back: twinkle's own objects, never a twinkle-mem wrapper (patched twice)
    wrapped_twice = sorted(n for _, n, raw in patches._saved
                           if getattr(getattr(raw, "__func__", raw), "__module__", "").startswith("twinkle_mem"))
    print(json.dumps(dict(settings=integration.installed_settings(), patched=patched, wrapped_twice=wrapped_twice,
                          log_softmax=tu.selective_log_softmax.__module__ + "." + tu.selective_log_softmax.__qualname__)))
"""


def state_of(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the grammar

@pytest.mark.parametrize("value,options", [
    (None, None), ("", None), ("0", None), (" 0 ", None), ("1", {}),
    ("fused_lm_head", {"fused_lm_head": True}),
    ("fused_lm_head,mask_skip=always,fused_chunk_bytes=128M",
     {"fused_lm_head": True, "mask_skip": "always", "fused_chunk_bytes": 128 << 20}),
    (" logits_guard=off , log_softmax=no,", {"logits_guard": False, "log_softmax": False}),
    ("fused_lm_head,fused_chunk_bytes=65536", {"fused_lm_head": True, "fused_chunk_bytes": 65536}),
    ("fused_chunk_bytes=2GiB,fused_lm_head", {"fused_lm_head": True, "fused_chunk_bytes": 2 << 30}),
    ("fused_lm_head,fused_chunk_bytes=none", {"fused_lm_head": True, "fused_chunk_bytes": None}),
    ("fused_lm_head=TRUE", {"fused_lm_head": True}),
])
def test_parse(value, options):
    assert startup.parse(value) == options


@pytest.mark.parametrize("value,bad", [
    ("true", "'true' is not an argument"), ("fused_lm_heads", "'fused_lm_heads' is not an argument"),
    ("fused_lm_head=maybe", "fused_lm_head is not a boolean"), ("mask_skip", "mask_skip must be one of"),
    ("mask_skip=sometimes", "mask_skip must be one of"), ("fused_chunk_bytes=0", "positive size"),
    ("fused_lm_head,fused_chunk_bytes=12X", "positive size"), ("fused_lm_head,fused_chunk_bytes", "positive size"),
    ("fused_lm_head,fused_lm_head=0", "'fused_lm_head' is given twice"),
    (",", "no argument given"), (" , ", "no argument given"), ("false", "('0' alone is off)"),
    ("1,fused_lm_head", "('1' alone is install() with its defaults)"),
    ("fused_chunk_bytes=1M", "it needs fused_lm_head"),
    ("fused_lm_head,fused_chunk_bytes=12", "fused_chunk_bytes=12 is below one row tile of the narrowest vocab block"),
    ("fused_lm_head,fused_chunk_bytes=1023", "below one row tile of the narrowest vocab block the fused LM head ever "
                                             "uses (1024 bytes"),
    ("fused_lm_head,log_softmax=0", "fused_lm_head=True needs log_softmax=True"),  # install()'s own check
])
def test_parse_refuses_with_the_variable_the_bad_part_and_the_accepted_values(value, bad):
    with pytest.raises(ValueError) as error:
        startup.parse(value)
    message = str(error.value)
    assert message.startswith(f"{VAR}={value!r}: ") and bad in message and startup.ACCEPTED in message


def test_every_install_argument_has_a_parser():
    params = inspect.signature(integration.install).parameters
    assert set(startup.OPTIONS) == {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


# ------------------------------------------------------------------ fresh interpreters

def test_unset_imports_nothing_at_start_and_leaves_twinkle_as_shipped():
    proc = run_python("""
        import json, sys
        start = sorted({"torch", "twinkle_mem", "twinkle"} & set(sys.modules))
        hooked = any(type(f).__name__ == "TwinkleImportHook" for f in sys.meta_path)
        import twinkle.utils.torch_utils as tu
        from twinkle.model.megatron.megatron import MegatronModel
        print(json.dumps(dict(start=start, hooked=hooked, twinkle_mem="twinkle_mem" in sys.modules,
                              log_softmax=tu.selective_log_softmax.__module__)))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == dict(start=[], hooked=True, twinkle_mem=False, log_softmax="twinkle.utils.torch_utils")
    assert "twinkle_mem.startup" not in proc.stderr


@pytest.mark.e2e  # two fresh interpreters each: the end-to-end tier (the default tier imports twinkle under the variable
# in test_import_twinkle_under_the_variable_imports_nothing_more_than_twinkle)
@pytest.mark.parametrize("first_import,value", [
    ("import twinkle", "fused_lm_head"), ("from twinkle.model.megatron import MegatronModel", "fused_lm_head"),
    ("import twinkle.loss.grpo", "fused_lm_head"), ("import twinkle", "1"),
    ("import twinkle", "fused_lm_head,mask_skip=always,fused_chunk_bytes=128M"),
])
def test_variable_installs_what_install_gives(first_import, value):
    options = startup.parse(value)
    by_variable = run_python(first_import + "\n" + textwrap.dedent(STATE), value)
    by_call = run_python(textwrap.dedent(f"""
        import twinkle
        from twinkle_mem.integrations import twinkle as integration
        integration.install(**{options!r})
    """) + textwrap.dedent(STATE))
    got, want = state_of(by_variable), state_of(by_call)
    assert got == want
    assert got["settings"] == {**_defaults(), **options}
    assert got["log_softmax"] == ("twinkle_mem.integrations.twinkle.patches._log_softmax_adapter.<locals>."
                                  "selective_log_softmax")
    assert any(p.endswith("MegatronModel.forward_backward") for p in got["patched"])
    lines = [line for line in by_variable.stderr.splitlines() if "twinkle_mem.startup" in line]
    assert len(lines) == 1, by_variable.stderr[-3000:]
    assert startup.install_call(options) in lines[0] and f"{VAR}={value!r}" in lines[0] and "pid " in lines[0]


@pytest.mark.e2e  # (a twinkle step in a fresh interpreter: the end-to-end tier)
def test_megatron_model_imported_after_a_first_step_gets_what_install_gives():
    """Each twinkle module is patched when the process imports it: a process that trains a TransformersModel
    first, with no Megatron anywhere, and imports twinkle's Megatron model only afterwards gets exactly the
    patches a script's install() at the start gives, and its Megatron step runs through the fused head."""
    later = run_python(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT)!r}]
        import twinkle
        from standins import megatron as th
        import twinkle_mem
        from helpers import ADVANTAGES, LENGTHS, VOCAB, grpo
        import torch.distributed as dist
        # a world of one, as twinkle's transformers strategy (accelerate) needs one on some releases
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{th.free_port()}}", rank=0, world_size=1)
        with th.cpu_platform("cpu"):
            th.run_step(th.twinkle_transformers_model(VOCAB, loss=grpo(False)), False, ADVANTAGES,
                        inputs=th.lm_samples(LENGTHS, VOCAB, prompt=4))
        print("BEFORE", sorted(m for m in ("twinkle.model.megatron.megatron", "megatron.core") if m in sys.modules))
        calls = []
        real = twinkle_mem.linear_selective_log_softmax
        twinkle_mem.linear_selective_log_softmax = lambda *a, **k: calls.append(1) or real(*a, **k)
        with th.gpt_step_on_cpu():
            th.run_step(th.twinkle_megatron_model(th.gpt_model(VOCAB), loss=grpo(False)), False, ADVANTAGES,
                        inputs=th.lm_samples(LENGTHS, VOCAB, prompt=4), micro_batch_size=2)
        print("FUSED", len(calls))
    """) + textwrap.dedent(STATE), "fused_lm_head", timeout=300)
    at_start = run_python(textwrap.dedent("""
        from twinkle_mem.integrations import twinkle as integration
        integration.install(fused_lm_head=True)
    """) + textwrap.dedent(STATE))
    assert later.returncode == 0, later.stderr[-3000:]
    assert "BEFORE []" in later.stdout and "FUSED 2" in later.stdout, later.stdout  # 2 micro-batches
    assert state_of(later) == state_of(at_start)


@pytest.mark.e2e  # (two fresh interpreters: the end-to-end tier)
def test_install_in_a_script_before_twinkle_wins_over_the_variable():
    """A script whose install() comes before any twinkle import: the variable's install runs inside that
    call (it imports twinkle), and the call's own settings then replace it, nothing patched twice."""
    script = textwrap.dedent("""
        from twinkle_mem.integrations import twinkle as integration
        integration.install(logits_guard=False, mask_skip="never")
    """) + textwrap.dedent(STATE)
    got, want = state_of(run_python(script, "fused_lm_head")), state_of(run_python(script))
    assert got["settings"] == want["settings"] and got["settings"]["fused_lm_head"] is False
    assert got["wrapped_twice"] == want["wrapped_twice"] == []
    # the same patches; the variable's install had imported more of twinkle, whose bindings are patched too
    assert len(set(got["patched"])) == len(got["patched"]) and set(want["patched"]) <= set(got["patched"])
    assert not any("MegatronStrategy.reduce_loss" in p for p in got["patched"])  # logits_guard=False holds


def test_log_line_goes_where_the_application_logs(tmp_path):
    log = tmp_path / "app.log"
    configured = run_python(f"""
        import logging
        logging.basicConfig(filename={str(log)!r}, level=logging.WARNING)
        import twinkle
    """, "1")
    assert configured.returncode == 0, configured.stderr[-3000:]
    assert "twinkle_mem.startup" not in configured.stderr
    assert log.read_text().count("twinkle-mem installed into twinkle-kit") == 1
    silenced = run_python("""
        import logging
        logging.getLogger("twinkle_mem.startup").setLevel(logging.WARNING)
        import twinkle, twinkle_mem.integrations.twinkle as integration
        assert integration.is_installed()
    """, "1")
    assert silenced.returncode == 0 and "twinkle_mem.startup" not in silenced.stderr, silenced.stderr[-3000:]


def _defaults():
    return {n: p.default for n, p in inspect.signature(integration.install).parameters.items()}


@pytest.mark.parametrize("first_import", ["import twinkle", "from twinkle.model.megatron import MegatronModel"])
@pytest.mark.parametrize("value,bad", [("fused_lm_heads", "'fused_lm_heads' is not an argument"),
                                       ("mask_skip=sometimes", "mask_skip must be one of")])
def test_bad_value_fails_the_twinkle_import(first_import, value, bad):
    proc = run_python(f"""
        try:
            {first_import}
        except ValueError as error:
            print("RAISED", error)
        import twinkle_mem.integrations.twinkle as integration
        print("INSTALLED", integration.is_installed())
    """, value)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = [line for line in proc.stdout.splitlines() if line.startswith("RAISED")]
    assert raised and f"{VAR}={value!r}" in raised[0] and bad in raised[0] and "accepted:" in raised[0], proc.stdout
    assert "INSTALLED False" in proc.stdout


def test_bad_value_never_touches_a_process_without_twinkle():
    proc = run_python("import sys, torch; print(sorted({'twinkle', 'twinkle_mem'} & set(sys.modules)))", "bogus,=")
    assert proc.returncode == 0 and proc.stdout.strip() == "[]" and proc.stderr == "", proc.stderr


# A twinkle-kit whose MegatronStrategy.reduce_loss takes other parameters (as a release might change it).
CHANGED_REDUCE_LOSS = (("model/megatron/strategy/megatron.py", "def reduce_loss(self, local_loss, local_count, logits, "
                        "logps):", "def reduce_loss(self, local_loss, local_count, outputs):"), )


def test_a_twinkle_part_not_recognized_fails_the_import_naming_it(tmp_path):
    """Under the variable a part install() does not recognize makes `import twinkle` raise, before anything is
    patched or any of twinkle's model modules (or torch) is imported, naming the part, why, and how to run
    without the variable; a script's install() on the same twinkle-kit patches the rest and warns."""
    copy = twinkle_copies.twinkle_copy(str(tmp_path), CHANGED_REDUCE_LOSS)
    probe = """
        import sys
        try:
            import twinkle
        except RuntimeError as error:
            print("RAISED", error)
        print("IMPORTED", sorted({"torch", "megatron", "transformers", "twinkle.model"} & set(sys.modules)))
        import twinkle_mem.integrations.twinkle as integration
        print("INSTALLED", integration.is_installed())
    """
    proc = run_python(probe, "fused_lm_head", pythonpath=copy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = next(line for line in proc.stdout.splitlines() if line.startswith("RAISED"))
    assert f"{VAR}='fused_lm_head': install(fused_lm_head=True) failed when twinkle was imported" in raised
    assert f"the twinkle-kit at {os.path.realpath(copy)}/twinkle (version.py says " in raised
    assert ("megatron_logits_guard (twinkle.model.megatron.strategy.megatron.MegatronStrategy.reduce_loss: unexpected "
            "signature (self, local_loss, local_count, outputs), expected (self, local_loss, local_count, logits, "
            "logps))") in raised
    assert f"unset {VAR} (or set it to 0)" in raised
    assert "IMPORTED []" in proc.stdout and "INSTALLED False" in proc.stdout
    explicit = run_python("""
        import warnings
        from twinkle_mem.integrations import twinkle as integration
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            integration.install(fused_lm_head=True)
        import twinkle.model.megatron.megatron, twinkle.model.megatron.strategy.megatron  # noqa
        from twinkle_mem.integrations.twinkle import patches
        print(sorted(integration.refused()), [type(w.message).__name__ for w in caught],
              sorted(f"{o.__name__}.{n}" for o, n in patches.patched() if o.__name__.startswith("Megatron")))
    """, pythonpath=copy)
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    # the fused head is patched (forward_backward), the guard is not (reduce_loss as shipped)
    assert explicit.stdout.splitlines()[-1] == ("['megatron_logits_guard'] ['TwinklePartsNotRecognized'] "
                                               "['MegatronModel.forward_backward']")


def test_import_twinkle_under_the_variable_imports_nothing_more_than_twinkle():
    """Activation costs a process only what it uses: `import twinkle` with the variable set imports twinkle-mem's
    light modules and the standard library's, no torch, no twinkle model module, no megatron-core, transformers or
    peft (install() patches those modules when the process imports them); the bound on the time and memory this
    costs is measured by bench/bench_startup.py."""
    probe = "import json, sys, twinkle; print(json.dumps(sorted(sys.modules)))"
    unset = set(json.loads(run_python(probe).stdout.splitlines()[-1]))
    for value in ("1", "fused_lm_head", "fused_lm_head,fused_chunk_bytes=128M"):  # (the size's check: no torch)
        proc = run_python(probe, value)
        assert proc.returncode == 0, proc.stderr[-3000:]
        more = set(json.loads(proc.stdout.splitlines()[-1])) - unset
        outside_stdlib = {m.split(".")[0] for m in more} - set(sys.stdlib_module_names)
        assert outside_stdlib == {"twinkle_mem"}, sorted(more)  # (the log line's version: read, not imported)
        assert not {m for m in more if m.startswith("twinkle_mem.") and not m.startswith(
            "twinkle_mem.integrations")}, sorted(more)  # the package's torch modules stay out


def test_the_hooks_table_names_each_framework_as_its_declaration_does():
    """twinkle_mem_startup.py imports nothing at start-up, so it keeps its own table of the packages whose variable
    installs at import: each entry is its framework's declaration (package, variable), and twinkle-kit's is there."""
    import importlib
    import twinkle_mem_startup
    assert twinkle_mem_startup.BY_VARIABLE["twinkle"][1] == integration.__name__
    for package, (variable, module) in twinkle_mem_startup.BY_VARIABLE.items():
        framework = importlib.import_module(module).FRAMEWORK
        assert (framework.package, framework.variable.name) == (package, variable), module


def test_python_m_twinkle_mem_reports_the_hook_and_the_variable():
    for value, says in [(None, f"{VAR} unset: off"), ("0", "off"),
                        ("fused_lm_head", "install(fused_lm_head=True) in every process that imports twinkle"),
                        ("nope", "invalid, `import twinkle` raises")]:
        proc = run_python("import runpy; runpy.run_module('twinkle_mem', run_name='__main__')", value)
        assert proc.returncode == (2 if value == "nope" else 0), proc.stderr[-3000:]  # a script can gate on it
        assert "start-up hook: installed (" in proc.stdout and "active in this process" in proc.stdout
        assert says in proc.stdout, proc.stdout


# ------------------------------------------------------------------ torchrun children

def _torchrun(out_dir, mode, value):
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if value is not None:
        env[VAR] = value
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve().parent / "torchrun_twinkle_step.py"), str(out_dir), mode]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:  # the children too, whatever happened
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    return output, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.e2e  # (a torchrun world: the end-to-end tier)
def test_torchrun_children_installed_by_the_variable_alone(tmp_path):
    """twinkle's Megatron step at TP = 2 under torch.distributed.run, the script calling no install():
    both ranks install what the variable says, the fused head runs (no tensor with the vocab or its
    shard as last dim), and loss, log-probs and gradients equal the run whose script calls install()."""
    (tmp_path / "env").mkdir()
    (tmp_path / "explicit").mkdir()
    output, by_variable = _torchrun(tmp_path / "env", "env", "fused_lm_head,fused_chunk_bytes=64K")
    _, by_call = _torchrun(tmp_path / "explicit", "explicit", None)
    lines = [line for line in output.splitlines() if "twinkle_mem.startup" in line]
    assert len(lines) == 2, output[-4000:]
    for rank, (got, want) in enumerate(zip(by_variable, by_call)):
        assert got["settings"] == want["settings"] == {**_defaults(), "fused_lm_head": True,
                                                       "fused_chunk_bytes": 64 << 10}
        assert sum(f"pid {got['pid']}, rank {rank}," in line for line in lines) == 1
        assert got["ops"] > 300 and got["vocab_last_dim"] == [], got["vocab_last_dim"][:5]
        assert got["loss"] == want["loss"]
        assert torch.equal(got["labels"], want["labels"]) and torch.equal(got["logps"], want["logps"])
        assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) > 0
        for name, grad in got["grads"].items():
            assert torch.equal(grad, want["grads"][name]), name
