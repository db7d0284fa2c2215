"""install(fused_lm_head=True): twinkle-kit 0.5.1 computes log-probs and entropy from the output
layer's input (python/twinkle_mem/integrations/twinkle/fused_call.py), on the CPU:

- twinkle's real MegatronModel around a real megatron-core GPTModel (TP = 1; TP = 2:
  tests/integrations/twinkle/test_integration_twinkle_fused_tp.py), and twinkle's real TransformersModel around a
  one-layer Qwen2 built from a config;
- the same training as the unfused run (install() without the fused head): loss, log-probs and
  entropy under the loss mask, every parameter gradient; fp32 and bf16 (Megatron: Float16Module),
  tied and untied head, T = 1.0 and 0.7, entropy on and off, GRPOLoss;
- no tensor whose last dim is the vocab (1018, no other dim of these models) is created, seen
  by a dispatch mode that also runs inside twinkle-mem's Python custom ops; the unfused run,
  and every ineligible call under install(fused_lm_head=True), do create the logits;
- a micro-batch that fails in twinkle's forward step under TWINKLE_FAIL_FAST=0 gives what it gives
  unfused (NaN rows, a FailedMicroBatchWarning, the same loss and gradients); the fused head's own
  refusals raise, under TWINKLE_FAIL_FAST=0 once megatron's schedule has returned.
"""
import importlib
import logging

import pytest
import torch

from standins import megatron as th
from helpers import (ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, SEQ, TOL, VOCAB, VocabTensors, assert_close,
                     blocks, grpo, scale_output, twinkle_has, twinkle_wrapped)
from twinkle_mem.integrations import twinkle as integration
from twinkle_mem.integrations.twinkle import fused_eligibility as eligibility
from twinkle_mem.integrations.twinkle import fused_call as lm_head
from twinkle_mem.integrations.twinkle import twinkle_names, twinkle_source

# conftest.py: megatron-core and twinkle on the CPU for the module; every test starts and ends uninstalled
pytestmark = pytest.mark.usefixtures("gpt_step_cpu", "uninstalled")


# --- runs ---------------------------------------------------------------------


def megatron_run(*, tied=False, temperature=1.0, entropy=False, dtype=torch.float32, forward_only=False, loss=None,
                 edit=None, **kwargs):
    """twinkle's MegatronModel.forward_backward (or forward_only) on a fresh GPTModel (same seed:
    same weights): output, parameter gradients, the recorded loss inputs, the labels."""
    chunk = th.gpt_model(VOCAB, tied=tied, dtype=dtype)
    if edit is not None:
        edit(chunk)
    loss = loss if loss is not None else grpo(entropy)
    model = th.twinkle_megatron_model(chunk, loss=loss)
    samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
    out = th.run_step(model, forward_only, ADVANTAGES, inputs=samples, micro_batch_size=2, temperature=temperature,
                      **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters() if p.grad is not None}
    return dict(out=out, grads=grads, seen=getattr(loss, "seen", []), labels=th.step_labels(model, forward_only))


def transformers_run(*, tied=False, temperature=1.0, entropy=False, dtype=torch.float32, forward_only=False,
                     loss=None, edit=None, config=None, mixed_precision="no", **kwargs):
    """twinkle's TransformersModel.forward_backward (forward, calculate_loss, backward) or forward_only."""
    loss = loss if loss is not None else grpo(entropy)
    if config == "gemma2":  # soft-capped logits
        import transformers
        config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=128, final_logit_softcapping=30.0)
    model = th.twinkle_transformers_model(VOCAB, tied=tied, dtype=dtype, loss=loss, config=config,
                                          mixed_precision=mixed_precision)
    if edit is not None:
        edit(model)
    samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
    out = th.run_step(model, forward_only, ADVANTAGES, inputs=samples, temperature=temperature, **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in model.model.named_parameters() if p.grad is not None}
    labels = th.step_status(model, forward_only).inputs["labels"]
    return dict(out=out, grads=grads, seen=getattr(loss, "seen", []), labels=labels)


RUNS = {"megatron": megatron_run, "transformers": transformers_run}


def run(path, fused, **kwargs):
    integration.install(mask_skip="never", fused_lm_head=fused, fused_chunk_bytes=CHUNK if fused else None)
    try:
        with blocks(*FUSED_BLOCKS):
            return RUNS[path](**kwargs)
    finally:
        integration.uninstall()


def assert_same_training(want, got, dtype, entropy):
    mask = want["labels"] != -100
    assert torch.equal(got["labels"], want["labels"])
    assert got["out"]["loss"] == pytest.approx(want["out"]["loss"], rel=TOL[dtype], abs=1e-6)
    logps, ref_logps = got["out"]["logps"], want["out"]["logps"]
    assert logps.shape == ref_logps.shape and logps.dtype == ref_logps.dtype == torch.float32
    assert_close(logps[mask], ref_logps[mask], dtype, "logps")
    assert torch.all(logps[~mask] == 0)  # ignored rows: no matmul, logp 0 (twinkle gave the value at token 0)
    assert len(got["seen"]) == len(want["seen"]) > 0
    for (logps, ent), (ref_logps, ref_ent), labels in zip(got["seen"], want["seen"], _per_call(want)):
        loss_mask = labels != -100  # what the loss reads
        assert_close(logps[loss_mask], ref_logps[loss_mask], dtype, "logps seen by the loss")
        assert (ent is None) == (ref_ent is None) == (not entropy)
        if entropy:
            assert_close(ent[loss_mask], ref_ent[loss_mask], dtype, "entropy")
            assert torch.all(ent[~loss_mask] == 0)
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for name, ref in want["grads"].items():
        assert_close(got["grads"][name], ref, dtype, f"grad of {name}")


# --- same training ------------------------------------------------------------


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(RUNS))
def test_same_training_as_unfused(path, dtype, tied, temperature, entropy, fused_calls):
    case = dict(tied=tied, temperature=temperature, entropy=entropy, dtype=dtype)
    want = run(path, False, **case)
    assert fused_calls == []
    got = run(path, True, **case)
    assert len(fused_calls) == (2 if path == "megatron" else 1)  # one per micro-batch
    assert_same_training(want, got, dtype, entropy)

    # forward_only (the reference model's pass): the same log-probs.
    fused_calls.clear()
    want = run(path, False, forward_only=True, **case)
    got = run(path, True, forward_only=True, **case)
    assert len(fused_calls) == (2 if path == "megatron" else 1)
    mask = want["labels"] != -100
    assert_close(got["out"]["logps"][mask], want["out"]["logps"][mask], dtype, "forward_only logps")
    assert got["grads"] == {} and want["grads"] == {}


def _count_frozen_heads(monkeypatch):
    """(one entry per fused call that summed grad_hidden's vectors in its forward, one per backward sweep that
    recomputed logits), filled as the calls run."""
    from twinkle_mem.heads import logprobs
    summed, backward_sweeps, frozen_grads = [], [], logprobs.FrozenGrads
    monkeypatch.setattr(logprobs, "FrozenGrads", type("Counted", (frozen_grads,), {
        "__init__": lambda self, *a, **k: summed.append(1) or frozen_grads.__init__(self, *a, **k)}))
    sweep = logprobs.backward_sweep
    monkeypatch.setattr(logprobs, "backward_sweep", lambda *a, **k: backward_sweeps.append(1) or sweep(*a, **k))
    return summed, backward_sweeps


def _freeze_output_layer(path):
    """The edit that freezes the output layer's weight, as LoRA leaves it (megatron: output_layer; transformers:
    lm_head)."""
    def edit(model):
        layer = getattr(model, "module", model).output_layer if path == "megatron" else model.model.lm_head
        layer.weight.requires_grad_(False)
    return edit


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(RUNS))
def test_frozen_output_layer_differentiated_in_the_forward(path, dtype, entropy, fused_calls, monkeypatch):
    # LoRA's case: the output layer needs no gradient, so the fused head sums grad_hidden's vectors in its forward
    # (heads/frozen.py) and its backward recomputes no logits; the same training as unfused. (bf16 with the
    # entropy's gradient on a CPU that multiplies bf16 natively recomputes instead: frozen.recompute_is_cheaper.)
    from twinkle_mem.heads import frozen
    summed, backward_sweeps = _count_frozen_heads(monkeypatch)
    case = dict(temperature=0.7, entropy=entropy, dtype=dtype, edit=_freeze_output_layer(path))
    want = run(path, False, **case)
    got = run(path, True, **case)
    calls = 2 if path == "megatron" else 1
    recompute = frozen.recompute_is_cheaper(dtype, torch.device("cpu"), entropy)
    assert len(fused_calls) == calls and len(summed) == (0 if recompute else calls)
    assert len(backward_sweeps) == (calls if recompute else 0)
    assert not any("output_layer" in name or "lm_head" in name for name in want["grads"])
    assert_same_training(want, got, dtype, entropy)


def _peft_lora_on_attention(model):
    """peft's LoRA as a recipe configures it: adapters on the attention projections, every base weight frozen
    (lm_head among them), the model wrapped in a PeftModel."""
    from peft import LoraConfig, get_peft_model
    model.model = get_peft_model(model.model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
def test_peft_lora_head_differentiated_in_the_forward(entropy, fused_calls, monkeypatch):
    # The transformers path under peft: lm_head frozen by get_peft_model, reached through the PeftModel wrapper; the
    # fused head sums grad_hidden's vectors in its forward, and the LoRA weights train as unfused.
    summed, backward_sweeps = _count_frozen_heads(monkeypatch)
    case = dict(temperature=0.7, entropy=entropy, dtype=torch.float32, edit=_peft_lora_on_attention)
    want = run("transformers", False, **case)
    got = run("transformers", True, **case)
    assert len(fused_calls) == 1 and len(summed) == 1 and backward_sweeps == []
    assert want["grads"] and all("lora_" in name for name in want["grads"])  # the adapters alone train
    assert_same_training(want, got, torch.float32, entropy)


def test_transformers_autocast_same_training(fused_calls):
    """twinkle's mixed_precision="bf16": fp32 weights, the forward under CPU autocast (lm_head in bf16)."""
    case = dict(temperature=0.7, entropy=True, mixed_precision="bf16")
    want = run("transformers", False, **case)
    got = run("transformers", True, **case)
    assert [dtype for _, dtype in fused_calls] == [torch.bfloat16]  # as autocast would run nn.Linear
    assert_same_training(want, got, torch.bfloat16, entropy=True)


def _per_call(result):
    """The labels of each loss call: one per micro-batch of 2 rows on Megatron, all rows on transformers."""
    labels = result["labels"]
    n = len(result["seen"])
    return labels.split(labels.shape[0] // n)


# --- no tensor with the vocab as its last dim -----------------------------------

def rows_per_call(path):
    return 2 * SEQ if path == "megatron" else len(LENGTHS) * SEQ


def spy(path):
    # Half of one model call's logits: more than any weight (V x 32) or attention score buffer here.
    return VocabTensors((VOCAB, ), rows_per_call(path) * VOCAB // 2)


@pytest.mark.parametrize("forward_only", [False, True], ids=["forward_backward", "forward_only"])
@pytest.mark.parametrize("path", list(RUNS))
def test_no_vocab_sized_tensor_exists(path, forward_only):
    with spy(path) as unfused:
        run(path, False, entropy=True, temperature=0.7, forward_only=forward_only)
    assert unfused.last_dim and unfused.large  # control: the check sees the logits where they exist
    with spy(path) as fused:
        got = run(path, True, entropy=True, temperature=0.7, forward_only=forward_only)
    assert fused.ops > 300  # the whole call ran under the mode
    assert fused.last_dim == [] and fused.large == []
    assert got["out"]["logps"].shape == got["labels"].shape


# --- where it does not apply, twinkle runs unchanged (with its logits) ---------


def _lora_head(model):
    from peft import LoraConfig, get_peft_model
    model.model = get_peft_model(model.model, LoraConfig(r=2, target_modules=["lm_head"]))


def _head_bias(model):
    head = model.model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(VOCAB, dtype=head.weight.dtype))


def _head_subclass(model):  # e.g. a wrapper that adds something to the projection
    head = model.model.get_output_embeddings()
    head.__class__ = type("LinearSubclass", (torch.nn.Linear, ), {})


def _megatron_head_bias(chunk):
    chunk.output_layer.bias = torch.nn.Parameter(torch.zeros(VOCAB))


def _megatron_wrapped_head(chunk):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    chunk.output_layer.__class__ = type("WrappedColumnParallelLinear", (ColumnParallelLinear, ), {})


def _scaled_forward(layer):
    """``layer.forward`` replaced on the instance by one that scales the output (a logit scaling)."""
    forward = layer.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5

    layer.forward = scaled


def _head_forward_replaced(model):
    _scaled_forward(model.model.get_output_embeddings())


def _megatron_forward_replaced(chunk):
    _scaled_forward(chunk.output_layer)


INELIGIBLE = {
    "return_logits": dict(return_logits=True),
    "loss needs logits": dict(loss_attrs=dict(require_logits=True)),
    "loss needs values": dict(loss_attrs=dict(require_values=True), paths=["transformers"]),
    "loss ignores another label": dict(loss_attrs=dict(ignore_index=-1)),
    "lora on lm_head": dict(edit=_lora_head, paths=["transformers"]),
    "lm_head with bias": dict(edit=_head_bias, paths=["transformers"]),
    "lm_head subclass": dict(edit=_head_subclass, paths=["transformers"]),
    "softcapping": dict(config="gemma2", paths=["transformers"]),
    "output layer with bias": dict(edit=_megatron_head_bias, paths=["megatron"]),
    "wrapped output layer": dict(edit=_megatron_wrapped_head, paths=["megatron"]),
    "lm_head forward replaced": dict(edit=_head_forward_replaced, paths=["transformers"]),
    "output layer forward replaced": dict(edit=_megatron_forward_replaced, paths=["megatron"]),
}


@pytest.mark.parametrize("path,name", [(p, n) for n, c in INELIGIBLE.items() for p in c.get("paths", RUNS)])
def test_ineligible_calls_run_unchanged_with_logits(path, name, fused_calls):
    if name == "loss needs values" and not twinkle_source.feature(
            twinkle_source.reads, twinkle_names.TRANSFORMERS, "TransformersModel.forward",
            word="require_values")(twinkle_source.TwinkleSource(integration.FRAMEWORK.folder())):
        pytest.skip("this twinkle-kit's TransformersModel.forward computes no values (0.5.1 on): a loss's "
                    "require_values changes nothing its forward does, fused or not")
    case = dict(INELIGIBLE[name])
    case.pop("paths", None)
    attrs = case.pop("loss_attrs", {})
    with spy(path) as unfused:
        want = run(path, False, loss=grpo(True, **attrs), **case)
    with spy(path) as fused:
        got = run(path, True, loss=grpo(True, **attrs), **case)
    assert fused_calls == []
    assert fused.last_dim and len(fused.last_dim) == len(unfused.last_dim)  # the logits, as before
    assert got["out"]["loss"] == want["out"]["loss"]
    torch.testing.assert_close(got["out"]["logps"], want["out"]["logps"], rtol=0, atol=0)
    for name_, ref in want["grads"].items():
        torch.testing.assert_close(got["grads"][name_], ref, rtol=0, atol=0)
    if case.get("return_logits"):
        assert got["out"]["logits"].shape[-1] == VOCAB
        torch.testing.assert_close(got["out"]["logits"], want["out"]["logits"], rtol=0, atol=0)


def test_megatron_eligibility_reasons():
    from megatron.core.tensor_parallel import ColumnParallelLinear
    chunk = th.gpt_model(VOCAB)
    assert eligibility.megatron_output_layers([chunk]) == ([chunk.output_layer], None)
    chunk.config.mtp_num_layers = 1
    assert eligibility.megatron_output_layers([chunk])[1] == "multi-token prediction"
    chunk.config.mtp_num_layers = None
    try:  # twinkle's embedding task (0.5.0 on)
        from twinkle.patch.megatron_emb import MegatronEmbeddingPatch
    except ImportError:
        MegatronEmbeddingPatch = None
    if MegatronEmbeddingPatch is not None:
        patch = MegatronEmbeddingPatch()
        patch(chunk)  # twinkle's embedding identity on the instance
        assert eligibility.megatron_output_layers([chunk])[1] == "the output layer's forward is replaced on the instance"
        patch.unpatch(chunk)  # leaves the class's forward bound on the instance: eligible again
        assert "forward" in vars(chunk.output_layer)
        assert eligibility.megatron_output_layers([chunk]) == ([chunk.output_layer], None)
    chunk.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in eligibility.megatron_output_layers([chunk])[1]
    del chunk.config.final_logit_softcapping

    class OwnPostprocess(type(chunk)):
        def _postprocess(self, *args, **kwargs):
            return super()._postprocess(*args, **kwargs)

    chunk.__class__ = OwnPostprocess
    assert "post-processes" in eligibility.megatron_output_layers([chunk])[1]
    assert isinstance(chunk.output_layer, ColumnParallelLinear)


def test_call_eligibility_reasons():
    from twinkle.loss import CrossEntropyLoss, GRPOLoss
    assert eligibility.call_ineligible({}, GRPOLoss()) is None
    assert eligibility.call_ineligible({}, CrossEntropyLoss()) is None  # SFT on log-probs
    assert eligibility.call_ineligible({}, twinkle_wrapped(GRPOLoss())) is None
    assert "task" in eligibility.call_ineligible({"task": "embedding"}, GRPOLoss())
    assert "return_logits" in eligibility.call_ineligible({"return_logits": True}, GRPOLoss())
    assert "ignores label -1" in eligibility.call_ineligible({}, twinkle_wrapped(GRPOLoss(ignore_index=-1)))
    # twinkle's own losses that need logits or values (0.5.1; stand-ins with their flag where a release has none)
    for module, name, flag in (("twinkle.loss.infonce", "InfonceLoss", "logits"),
                               ("twinkle.loss.value", "PPOValueLoss", "values")):
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError:
            cls = type(name, (), {f"require_{flag}": True})
        assert flag in eligibility.call_ineligible({}, cls.__new__(cls))


# --- failures after the switch are loud ----------------------------------------


def failed_run(monkeypatch, fused, failing, entropy, **kwargs):
    """A Megatron run under TWINKLE_FAIL_FAST=0 whose micro-batches in ``failing`` lose their log-probs in
    twinkle's forward step (after selective_log_softmax), with twinkle's SafeLossWrapper as twinkle's
    ``set_loss`` puts it: (the run, the FailedMicroBatchWarnings)."""
    from twinkle.processor.base import InputProcessor
    real_unpack = th.fail_unpacking(monkeypatch, InputProcessor, failing=failing)
    loss = grpo(entropy)
    try:
        with pytest.warns(integration.FailedMicroBatchWarning) as caught:
            got = run("megatron", fused, loss=twinkle_wrapped(loss), **kwargs)
    finally:
        monkeypatch.setattr(InputProcessor, "unpack_packed_sequences", real_unpack)
    got["seen"] = loss.seen
    return got, [w.message for w in caught if isinstance(w.message, integration.FailedMicroBatchWarning)]


@pytest.mark.parametrize("forward_only", [False, True], ids=["forward_backward", "forward_only"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
def test_megatron_failed_micro_batch_fused_as_unfused(monkeypatch, entropy, forward_only, fused_calls):
    """TWINKLE_FAIL_FAST=0, micro-batch 1 of 2 fails after its log-probs were computed: on the fused path
    as on the unfused one, NaN rows at its place, a warning naming it, the same loss and gradients (the
    loss computes its log-probs from "logits": the logits unfused, the placeholder's results fused; with
    an entropy bonus it raises, and SafeLossWrapper makes a zero loss of it on both). A twinkle-kit that catches
    no micro-batch's error (0.4.0) raises it, fused as unfused: nothing to report."""
    if not twinkle_has("megatron_catches_step_errors"):
        from twinkle.processor.base import InputProcessor
        for fused in (False, True):
            real_unpack = th.fail_unpacking(monkeypatch, InputProcessor, failing={1})
            with pytest.raises(ValueError, match="simulated data-processing error"):
                run("megatron", fused, loss=twinkle_wrapped(grpo(entropy)), forward_only=forward_only)
            monkeypatch.setattr(InputProcessor, "unpack_packed_sequences", real_unpack)
        return
    want, want_warnings = failed_run(monkeypatch, False, {1}, entropy, forward_only=forward_only)
    got, got_warnings = failed_run(monkeypatch, True, {1}, entropy, forward_only=forward_only)
    assert len(fused_calls) == 2
    assert [(w.micro_batches, w.rows) for w in got_warnings] == [(w.micro_batches, w.rows)
                                                                 for w in want_warnings] == [([1], [range(2, 4)])]
    logps, ref_logps = got["out"]["logps"], want["out"]["logps"]
    assert logps.shape == ref_logps.shape == (len(LENGTHS), SEQ)
    assert torch.isnan(logps[2:]).all() and torch.isnan(ref_logps[2:]).all()
    mask = want["labels"][:2] != -100
    assert_close(logps[:2][mask], ref_logps[:2][mask], torch.float32, "logps of the micro-batch that did not fail")
    assert got["out"]["loss"] == pytest.approx(want["out"]["loss"], rel=1e-4, abs=1e-6)
    assert (forward_only or want["out"]["loss"] != 0) and len(got["seen"]) == len(want["seen"]) == 2
    assert got["grads"].keys() == want["grads"].keys() and (forward_only or want["grads"])
    for name, ref in want["grads"].items():
        assert_close(got["grads"][name], ref, torch.float32, f"grad of {name}")


def test_megatron_refusal_raises_after_the_step(monkeypatch):
    """The fused head's own refusal (here: the output transformed after the layer), swallowed by twinkle's
    TWINKLE_FAIL_FAST=0 catch and SafeLossWrapper: raised once megatron's schedule has returned (a twinkle-kit
    without that catch, 0.4.0, lets the refusal itself through: the test below)."""
    if not twinkle_has("megatron_catches_step_errors"):
        with pytest.raises(RuntimeError, match="not the output layer's pending placeholder"):
            run("megatron", True, edit=scale_output, loss=twinkle_wrapped(grpo(False)))
        return
    monkeypatch.setenv("TWINKLE_FAIL_FAST", "0")
    monkeypatch.setattr(logging.getLogger("twinkle"), "disabled", True)
    returned = []
    from twinkle_mem.integrations.twinkle import megatron_steps
    real_get = megatron_steps.scheduler_with_step_hooks

    def watched(original, plan):
        hooked = real_get(original, plan)

        def get_forward_backward_func(*args, **kwargs):
            schedule = hooked(*args, **kwargs)

            def run_schedule(*a, **kw):
                out = schedule(*a, **kw)
                returned.append(True)
                return out

            return run_schedule

        return get_forward_backward_func

    monkeypatch.setattr(megatron_steps, "scheduler_with_step_hooks", watched)
    with pytest.raises(RuntimeError, match="micro-batch 0: .*not the output layer's pending placeholder"):
        run("megatron", True, edit=scale_output, loss=twinkle_wrapped(grpo(False)))
    assert returned == [True]  # the schedule ran to its end first
    assert run("megatron", True)["out"]["logps"].shape == (len(LENGTHS), SEQ)  # nothing left behind


@pytest.mark.parametrize("fail_fast", ["1", "0"])
def test_megatron_transformed_output_raises(fail_fast, monkeypatch):
    monkeypatch.setenv("TWINKLE_FAIL_FAST", fail_fast)
    monkeypatch.setattr(logging.getLogger("twinkle"), "disabled", True)
    # fail fast: the adapter's error itself; caught by twinkle: the forward step's check
    with pytest.raises(RuntimeError, match="not the output layer's pending placeholder|lost its log-probs"):
        run("megatron", True, edit=scale_output)


def test_transformers_softcapping_missed_by_the_static_check_raises(monkeypatch):
    monkeypatch.setattr(eligibility, "_LOGIT_TRANSFORMS", ())
    with pytest.raises(RuntimeError, match="not the output layer's pending placeholder"):
        run("transformers", True, config="gemma2")


def test_placeholder_never_reaches_a_loss_as_logits():
    import twinkle.loss.grpo as grpo_module
    integration.install(fused_lm_head=True)
    labels = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="logits do not exist on the fused path"):
        grpo_module.selective_log_softmax(torch.empty(1, 3, 0), labels)  # GRPOLoss's fallback on outputs['logits']
    integration.uninstall()
    integration.install()  # without the fused head, zero-width logits are the op's business, as before
    with pytest.raises((RuntimeError, ValueError)):
        grpo_module.selective_log_softmax(torch.empty(1, 3, 0), labels)


def test_take_checks_the_labels_and_the_entropy_request():
    call = lm_head.FusedCall(1.0, False, None)
    call.set_labels(torch.tensor([[-100, 3, 5]]))
    logp = torch.tensor([[0.0, -1.0, -2.0]])

    def pending():
        call.finish_micro_batch()  # drop what the previous case left
        return call.defer(logp, None, torch.zeros(1, 3, 4))

    token = lm_head._CALL.set(call)
    try:
        assert lm_head.take(pending(), torch.tensor([[0, 3, 5]]), False) is logp
        with pytest.raises(RuntimeError, match="not the micro-batch's labels"):
            lm_head.take(pending(), torch.tensor([[0, 3, 6]]), False)
        with pytest.raises(RuntimeError, match="entropy asked for"):
            lm_head.take(pending(), torch.tensor([[0, 3, 5]]), True)
        with pytest.raises(RuntimeError, match="ran twice"):
            pending()
            call.defer(logp, None, torch.zeros(1, 3, 4))
    finally:
        lm_head._CALL.reset(token)


def test_a_micro_batch_never_hands_over_the_previous_ones_result():
    # The hooks' sequence (megatron_steps.py) when micro-batch 0 loses its log-probs after twinkle took them
    # (its re-armed loss takes them again) and micro-batch 1 loses them before: micro-batch 1 hands over its
    # own result, never micro-batch 0's.
    call = lm_head.FusedCall(1.0, False, None)
    labels = torch.tensor([[-100, 3, 5]])
    token = lm_head._CALL.set(call)
    try:
        call.start_micro_batch()
        call.set_labels(labels)
        first = torch.tensor([[0.0, -1.0, -2.0]])
        lm_head.take(call.defer(first, None, torch.zeros(1, 3, 4)), torch.tensor([[0, 3, 5]]), False)
        _refused, _pending, taken = call.finish_micro_batch()
        loss = call.rearmed(lambda placeholder: lm_head.take(placeholder, torch.tensor([[0, 3, 5]]), False), taken)
        assert loss(taken.placeholder) is first
        call.start_micro_batch()
        call.set_labels(labels)
        second = torch.tensor([[0.0, -4.0, -8.0]])
        call.defer(second, None, torch.zeros(1, 3, 4))
        refused, pending, taken = call.finish_micro_batch()
        assert refused is None and taken is None and pending.logp is second
    finally:
        lm_head._CALL.reset(token)


def test_output_layer_restored_after_each_call(monkeypatch):
    from twinkle.processor.base import InputProcessor
    chunks = []

    def keep(chunk):
        chunks.append(chunk)

    run("megatron", True, edit=keep)
    assert "forward" not in vars(chunks[0].output_layer)
    monkeypatch.setattr(InputProcessor, "unpack_packed_sequences", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run("megatron", True, edit=keep)
    assert "forward" not in vars(chunks[1].output_layer) and lm_head.current() is None


# --- install / uninstall -------------------------------------------------------


def test_install_patches_and_uninstall_restores():
    import megatron.core.pipeline_parallel as pipeline_parallel
    from twinkle.model.transformers.transformers import TransformersModel
    points = [(TransformersModel, "forward"), (TransformersModel, "forward_only"),
              (pipeline_parallel, "get_forward_backward_func")]
    before = [vars(owner).get(name) for owner, name in points]
    integration.install(fused_lm_head=True)
    installed = [vars(owner).get(name) for owner, name in points]
    assert all(a is not b for a, b in zip(installed, before))
    integration.install(fused_lm_head=True)  # idempotent
    assert [vars(owner).get(name) for owner, name in points] == installed
    integration.install()  # other settings: reinstalled, forward / forward_only only noting return_logits
    plain = [vars(owner).get(name) for owner, name in points]
    assert all(p is not b and p is not i for p, b, i in zip(plain[:2], before, installed))
    integration.install(logits_guard=False)  # without the guard: no transformers patches
    assert [vars(owner).get(name) for owner, name in points][:2] == before[:2]
    integration.uninstall()
    assert [vars(owner).get(name) for owner, name in points] == before


def test_install_argument_errors():
    with pytest.raises(ValueError, match="needs log_softmax"):
        integration.install(fused_lm_head=True, log_softmax=False)
    with pytest.raises(ValueError, match="fused_chunk_bytes"):
        integration.install(fused_lm_head=True, fused_chunk_bytes=0)
    # issue 31: refused by install() as by TWINKLE_MEM_INSTALL's check, before anything is patched
    with pytest.raises(ValueError, match="fused_chunk_bytes sets the fused LM head's block memory: it needs "
                                         "fused_lm_head=True"):
        integration.install(fused_chunk_bytes=1 << 20)
    smallest = integration.SMALLEST_CHUNK_BYTES
    with pytest.raises(ValueError, match=f"fused_chunk_bytes={smallest - 1} is below one row tile of the narrowest "
                                         f"vocab block the fused LM head ever uses \\({smallest} bytes"):
        integration.install(fused_lm_head=True, fused_chunk_bytes=smallest - 1)
    assert not integration.is_installed()
    integration.install(fused_lm_head=True, fused_chunk_bytes=smallest)  # the smallest accepted
    assert integration.is_installed()
    integration.uninstall()


def test_smallest_chunk_bytes_is_one_row_tile_of_the_narrowest_block():
    # The number install() and the variable's check hold fused_chunk_bytes to (no torch at import twinkle): one
    # row tile of bf16 logits of a one-column block on the CPU's plan, below what any call of any plan needs (a
    # value above it may still not fit a model: judged at its first fused step).
    from twinkle_mem.heads import plans
    smallest = integration.SMALLEST_CHUNK_BYTES
    assert smallest == plans.PLANS["cpu"].row_tile * 1 * torch.bfloat16.itemsize
    for plan in plans.PLANS.values():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for sums in ("straight", "copies", "mixed", "rounded"):
                assert plans.block_need(1, 1, dtype, plan, sums, 1) >= smallest, (plan, dtype, sums)
    with pytest.raises(ValueError, match="below one step"):
        plans.fit_width(1, 1, torch.bfloat16, smallest - 1, plans.PLANS["cpu"], "copies")
