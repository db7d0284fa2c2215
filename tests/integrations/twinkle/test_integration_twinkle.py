"""twinkle_mem.integrations.twinkle against the real twinkle-kit (0.5.1 in the main environment; CI runs
these modules against 0.4.0 and 0.5.0 too) and megatron-core 0.16.1 for the model path, on the CPU with
twinkle's ``Platform`` simulated."""
import dataclasses
import importlib
import inspect
import sys
import types
import warnings

import pytest
import torch

import twinkle_mem
from twinkle_mem.integrations import twinkle as integration

from standins import megatron as th
from standins import memory

VOCAB, SEQ = 256, 24
BY_NAME = ["twinkle.utils", "twinkle.utils.torch_utils", "twinkle.loss.grpo", "twinkle.loss.dpo",
           "twinkle.model.megatron.megatron"]


@pytest.fixture(scope="module", autouse=True)
def twinkle_modules():
    import twinkle.loss.dpo  # noqa: F401  (modules that import selective_log_softmax by name)
    import twinkle.loss.grpo  # noqa: F401
    import twinkle.model.megatron.megatron  # noqa: F401
    from twinkle.model.megatron.megatron import MegatronModel
    from twinkle.model.megatron.strategy.megatron import MegatronStrategy
    from twinkle.processor.base import InputProcessor
    return types.SimpleNamespace(InputProcessor=InputProcessor, MegatronModel=MegatronModel,
                                 MegatronStrategy=MegatronStrategy)


pytestmark = pytest.mark.usefixtures("uninstalled")  # conftest.py: every test starts and ends uninstalled


def patch_points(tw):
    """Every object install() may replace, by identity."""
    points = {(name, "selective_log_softmax"): vars(sys.modules[name]).get("selective_log_softmax") for name in BY_NAME}
    for cls, attr in [(tw.InputProcessor, "__call__"), (tw.InputProcessor, "_create_4d_attention_mask"),
                      (tw.MegatronModel, "forward_backward"), (tw.MegatronStrategy, "reduce_loss")]:
        points[(cls.__name__, attr)] = vars(cls).get(attr)
    return points


def assert_same_objects(before, after):
    assert before.keys() == after.keys()
    for key in before:
        assert after[key] is before[key], key


# --- install / uninstall ------------------------------------------------------


def test_a_part_not_recognized_is_refused_by_name_and_runs_as_shipped(twinkle_modules, monkeypatch):
    """install() patches what it recognizes; a part whose twinkle name is not what it expects (here: reduce_loss
    with another signature, as a twinkle-kit might change it) is refused by name, warned about, and left as
    twinkle ships it; the version string plays no part (a twinkle saying 0.0.1 is patched all the same)."""
    import twinkle.version
    from twinkle_mem.integrations.twinkle import twinkle_names
    monkeypatch.setattr(twinkle.version, "__version__", "0.0.1")
    real = integration.FRAMEWORK.recognize
    reduce_loss = f"{twinkle_names.STRATEGY}:MegatronStrategy.reduce_loss"

    def changed_reduce_loss(folder):
        found = real(folder)
        return found._replace(names={**found.names, reduce_loss: "unexpected signature (self, x)"})

    monkeypatch.setattr(integration.FRAMEWORK, "recognize", changed_reduce_loss)
    before = patch_points(twinkle_modules)
    with pytest.warns(integration.TwinklePartsNotRecognized, match=r"megatron_logits_guard \(twinkle\.model\.megatron"
                      r"\.strategy\.megatron\.MegatronStrategy\.reduce_loss: unexpected signature \(self, x\)\)"):
        integration.install()
    assert list(integration.refused()) == ["megatron_logits_guard"]
    after = patch_points(twinkle_modules)
    shipped = {("MegatronStrategy", "reduce_loss"), ("MegatronModel", "forward_backward")}  # the guard's points
    for key in before:  # those as shipped, everything else replaced
        assert (after[key] is before[key]) == (key in shipped), key


def test_report_says_what_install_would_patch_and_what_is_patched_here(monkeypatch):
    """`python -m twinkle_mem`'s lines (issue 52): each part says what install() would do (patch it, recognized; or
    refuse it, and why) apart from what is patched in this process, which says "patched" only once install() ran."""
    from twinkle_mem.integrations.twinkle import twinkle_names
    framework = integration.FRAMEWORK
    guard, log_softmax = twinkle_names.MEGATRON_LOGITS_GUARD, twinkle_names.LOG_SOFTMAX_PART

    def line(part):
        return next(x for x in framework.report(None) if x.split()[:1] == [part.key])

    assert line(log_softmax).endswith(": would be patched (recognized); not patched in this process")
    integration.install()
    assert line(log_softmax).endswith(": would be patched (recognized); patched in this process")
    assert "install() in this process: yes" in framework.report(None)[1]
    real, reduce_loss = framework.recognize, f"{twinkle_names.STRATEGY}:MegatronStrategy.reduce_loss"
    monkeypatch.setattr(framework, "recognize", lambda folder: real(folder)._replace(
        names={**real(folder).names, reduce_loss: "unexpected signature (self, x)"}))
    with pytest.warns(integration.TwinklePartsNotRecognized):
        integration.install(logits_guard=True, mask_skip="always")  # (other settings: a reinstall)
    assert line(guard).endswith(": refused, would run as twinkle-kit ships it (twinkle.model.megatron.strategy."
                                "megatron.MegatronStrategy.reduce_loss: unexpected signature (self, x)); left as "
                                "shipped in this process (refused)"), line(guard)
    assert line(log_softmax).endswith("; patched in this process")


def test_this_twinkle_kit_is_recognized_whole():
    """In every release CI runs these tests against (0.4.0, 0.5.0, 0.5.1), install() recognizes every part."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", integration.TwinklePartsNotRecognized)
        integration.install(fused_lm_head=True)
    assert integration.refused() == {}


def _signature_text(signature) -> str:
    """An inspect.Signature written as twinkle_source.signature writes a definition's parameters."""
    parts, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name + ("=" if p.default is not p.empty else ""))
    return "(" + ", ".join(parts) + ")"


def test_what_the_source_says_is_what_python_has(twinkle_modules):
    """The table's functions as read from twinkle's source (what install() decides by, nothing imported) have
    the parameters Python gives the imported objects (undecorated), also when read up to their parameters only,
    and its bound names are there."""
    from twinkle_mem.integrations.twinkle import twinkle_names, twinkle_source
    found, source = integration.FRAMEWORK.found(), twinkle_source.TwinkleSource(integration.FRAMEWORK.folder())
    checked = 0
    for key, name in twinkle_names.NAMES.items():
        if found.names[key] is not None:
            assert name.optional, (key, found.names[key])
            continue
        module = importlib.import_module(name.module)
        if name.kind == "bound":
            assert hasattr(module, name.qualname), key
        elif name.kind in ("function", "staticmethod"):
            obj = twinkle_names.twinkle_attribute(name.module, name.qualname)
            whole = source.function(name.module, name.qualname)
            read = twinkle_source.signature(whole)
            assert _signature_text(inspect.signature(inspect.unwrap(obj))) == read, key
            header = twinkle_source.TwinkleSource(source.folder).function(name.module, name.qualname, body=False)
            assert twinkle_source.signature(header) == read, key  # (what the table is read from)
            assert len(header.decorator_list) == len(whole.decorator_list), key
            checked += 1
    assert checked >= 15


def test_install_is_idempotent_and_uninstall_restores_everything(twinkle_modules):
    before = patch_points(twinkle_modules)
    integration.install()
    installed = patch_points(twinkle_modules)
    adapter = installed[("twinkle.utils.torch_utils", "selective_log_softmax")]
    assert adapter.twinkle_original is before[("twinkle.utils.torch_utils", "selective_log_softmax")]
    for name in BY_NAME:  # the definition and every module that imported it by name
        assert installed[(name, "selective_log_softmax")] is adapter
    for key in before:
        assert installed[key] is not before[key], key

    integration.install()  # again: nothing changes
    assert_same_objects(installed, patch_points(twinkle_modules))

    # A twinkle module imported after install() binds the patched function ...
    late = types.ModuleType("twinkle._twinkle_mem_late_import")
    sys.modules[late.__name__] = late
    try:
        exec("from twinkle.utils import selective_log_softmax", late.__dict__)
        assert late.selective_log_softmax is adapter
        integration.install(mask_skip="always")  # other settings: reinstalled
        assert integration.is_installed()
        integration.uninstall()
        # ... and gets the original back.
        assert late.selective_log_softmax is before[("twinkle.utils", "selective_log_softmax")]
    finally:
        del sys.modules[late.__name__]
    assert not integration.is_installed()
    assert_same_objects(before, patch_points(twinkle_modules))
    integration.uninstall()  # again: a no-op


def test_install_rejects_unknown_mask_mode():
    with pytest.raises(ValueError, match="mask_skip"):
        integration.install(mask_skip="sometimes")
    assert not integration.is_installed()


# --- selective_log_softmax ------------------------------------------------------


def test_twinkle_call_sites_compute_with_twinkle_mem():
    import twinkle.loss.grpo as grpo
    logits = torch.randn(2, 5, 97, dtype=torch.bfloat16)
    labels = torch.randint(0, 97, (2, 5))
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    theirs = grpo.selective_log_softmax(logits, labels)
    assert theirs.dtype == torch.bfloat16  # control: twinkle-kit's own bf16 branch

    integration.install()
    ours = grpo.selective_log_softmax(logits, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), exact, rtol=0, atol=1e-5)
    logp, entropy = grpo.selective_log_softmax(logits, labels, return_entropy=True)
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(logp, ours, rtol=0, atol=0)


def test_tensor_parallel_passes_the_tp_group_to_the_op(monkeypatch):
    # Under TP > 1 the adapter hands the TP group to twinkle-mem's op (vocab-parallel
    # path, entropy included) instead of twinkle's function; without TP, no group.
    # The op itself under a real TP group: tests/op/test_vocab_parallel.py.
    import twinkle.loss.grpo as grpo
    from twinkle_mem.integrations.twinkle import twinkle_names
    calls = []
    real_op = twinkle_mem.selective_log_softmax

    def recording_op(*args, **kwargs):
        calls.append(kwargs.get("process_group"))
        return real_op(*args, **{**kwargs, "process_group": None})

    monkeypatch.setattr(twinkle_mem, "selective_log_softmax", recording_op)
    logits = torch.randn(2, 5, 97, dtype=torch.bfloat16)
    labels = torch.randint(0, 97, (2, 5))
    integration.install()
    try:
        monkeypatch.setattr(twinkle_names, "tensor_parallel_group", lambda: "tp-group")
        logp, entropy = grpo.selective_log_softmax(logits, labels, return_entropy=True)
        assert logp.dtype == entropy.dtype == torch.float32 and calls == ["tp-group"]
        monkeypatch.setattr(twinkle_names, "tensor_parallel_group", lambda: None)
        assert grpo.selective_log_softmax(logits, labels).dtype == torch.float32 and calls == ["tp-group", None]
    finally:
        integration.uninstall()


def test_twinkle_megatron_model_uses_twinkle_mem(monkeypatch):
    calls = []
    real_op = twinkle_mem.selective_log_softmax

    def counting_op(*args, **kwargs):
        calls.append(1)
        return real_op(*args, **kwargs)

    monkeypatch.setattr(twinkle_mem, "selective_log_softmax", counting_op)
    with th.megatron_cpu(), th.cpu_platform("cpu"):
        reference = th.twinkle_megatron_model(th.ToyLM(VOCAB)).forward_backward(
            inputs=th.lm_samples([SEQ, SEQ - 5], VOCAB), micro_batch_size=1)
        integration.install()
        out = th.twinkle_megatron_model(th.ToyLM(VOCAB)).forward_backward(
            inputs=th.lm_samples([SEQ, SEQ - 5], VOCAB), micro_batch_size=1)
    assert len(calls) == 2  # one per micro-batch, from twinkle's forward step
    assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    torch.testing.assert_close(out["logps"], reference["logps"], rtol=1e-5, atol=1e-5)


# --- causal-mask skip -----------------------------------------------------------


@pytest.fixture
def mask_spy(twinkle_modules, monkeypatch):
    """Counts calls of twinkle's own dense-mask builder (installed under install())."""
    cls = twinkle_modules.InputProcessor
    builder = vars(cls)["_create_4d_attention_mask"].__func__
    calls = []

    def spy(attention_mask):
        calls.append(len(attention_mask))
        return builder(attention_mask)

    monkeypatch.setattr(cls, "_create_4d_attention_mask", staticmethod(spy))
    return calls


def collate(twinkle_modules, lengths=(SEQ, SEQ - 7), attention_mask_type=None, processor_cls=None, **kwargs):
    """twinkle's InputProcessor as MegatronModel.forward_backward calls it; the largest
    allocations it made are returned with its output."""
    cls = processor_cls or twinkle_modules.InputProcessor
    processor = cls(framework="megatron")
    samples = th.lm_samples(lengths, VOCAB)
    mask_bytes = len(lengths) * max(lengths)**2
    call_kwargs = dict(micro_batch_size=len(lengths), variable_seq_lengths=False,
                       attention_mask_type=attention_mask_type)
    call_kwargs.update(kwargs)
    return memory.large_allocations(lambda: processor(samples, **call_kwargs), mask_bytes)


def same(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):  # e.g. twinkle's PackedSeqParams
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def assert_features_equal(got, want, except_mask=False):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            if not (except_mask and key == "attention_mask"):
                assert same(g[key], w[key]), key


@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_npu_causal_collate_builds_no_mask(twinkle_modules, mask_spy, micro_batch_size):
    with th.cpu_platform("npu"):
        want, _ = collate(twinkle_modules, micro_batch_size=micro_batch_size)
        assert mask_spy and want[0]["attention_mask"].dim() == 4  # control: twinkle-kit as shipped keeps it
        mask_spy.clear()
        integration.install()
        got, big = collate(twinkle_modules, micro_batch_size=micro_batch_size)
    assert mask_spy == [] and big == []  # twinkle's builder not called, nothing mask-sized allocated
    assert [f["attention_mask"] for f in got] == [None] * len(want)
    assert_features_equal(got, want, except_mask=True)


def test_npu_drop_hook_stays_the_fallback(twinkle_modules):
    """A mask built where the skip cannot reach is still dropped after collate on NPU,
    because the resolved mask type now reaches twinkle's own drop hook."""
    builder = vars(twinkle_modules.InputProcessor)["_create_4d_attention_mask"].__func__

    class OwnMaskProcessor(twinkle_modules.InputProcessor):
        _create_4d_attention_mask = staticmethod(builder)

    with th.cpu_platform("npu"):
        want, _ = collate(twinkle_modules, processor_cls=OwnMaskProcessor)
        assert want[0]["attention_mask"].dim() == 4  # control
        integration.install()
        got, _ = collate(twinkle_modules, processor_cls=OwnMaskProcessor)
    assert got[0]["attention_mask"] is None
    assert_features_equal(got, want, except_mask=True)


@pytest.mark.parametrize("platform,attention_mask_type,mode", [
    ("cuda", None, "npu"),  # another backend: the kernel needs the dense mask
    ("npu", "padding", "npu"),  # not a causal mask
    ("npu", None, "never"),
])
def test_dense_mask_kept_and_identical_where_needed(twinkle_modules, mask_spy, platform, attention_mask_type, mode):
    lengths = (SEQ, SEQ - 7)
    with th.cpu_platform(platform):
        want, _ = collate(twinkle_modules, lengths, attention_mask_type)
        mask_spy.clear()
        integration.install(mask_skip=mode)
        got, big = collate(twinkle_modules, lengths, attention_mask_type)
    assert mask_spy == []  # built by twinkle-mem's builder ...
    assert big == [len(lengths) * SEQ * SEQ]  # ... with one allocation
    assert got[0]["attention_mask"].dim() == 4
    assert_features_equal(got, want)  # mask included


def test_always_mode_skips_on_any_backend(twinkle_modules, mask_spy):
    with th.cpu_platform("cuda"):
        integration.install(mask_skip="always")
        got, big = collate(twinkle_modules)
    assert mask_spy == [] and big == [] and got[0]["attention_mask"] is None


def test_padding_free_collate_unchanged(twinkle_modules):
    """Packed batches never had a dense mask; install() adds no key there."""
    with th.cpu_platform("npu"):
        processor = twinkle_modules.InputProcessor(framework="megatron", padding_free=True)
        want = processor(th.lm_samples([SEQ, 9], VOCAB), micro_batch_size=2)
        integration.install()
        got = processor(th.lm_samples([SEQ, 9], VOCAB), micro_batch_size=2)
    assert "attention_mask" not in want[0]
    assert_features_equal(got, want)


def test_uninstall_brings_twinkles_mask_back(twinkle_modules, mask_spy):
    with th.cpu_platform("npu"):
        integration.install()
        collate(twinkle_modules)
        assert mask_spy == []
        integration.uninstall()
        got, _ = collate(twinkle_modules)
    assert len(mask_spy) == 1 and got[0]["attention_mask"].dim() == 4
