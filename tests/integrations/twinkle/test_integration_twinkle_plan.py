"""How install(fused_lm_head=True) plans a fused call
(python/twinkle_mem/integrations/twinkle/fused_call_plan.py) and the loss heads it serves (loss_heads.py), on the CPU:

- both twinkle paths (Megatron, transformers) plan their calls through the one function, fused_call_plan.plan_call;
- the loss head registry: a GKD training step is claimed by the GKD head, every other call by the log-probs head;
  a new head, registered, claims its calls before them, and the deferred output layers (Megatron's and
  transformers') hand it the layer's input and weight, or its refusal where they cannot defer;
- every refusal of the plan, with its message, in the plan's order: call, layout, model, loss head.
"""
import types

import pytest
import torch

from standins import megatron as th
from helpers import ADVANTAGES, LENGTHS, PROMPT, VOCAB, gkd_teacher, grpo, twinkle_has
from twinkle_mem.integrations import twinkle as integration
from twinkle_mem.integrations.twinkle import distill_loss, fused_call, fused_call_plan, loss_heads, patches

# conftest.py: megatron-core and twinkle on the CPU for the module; every test starts and ends uninstalled
pytestmark = pytest.mark.usefixtures("gpt_step_cpu", "uninstalled")


def test_both_paths_plan_through_one_function(monkeypatch):
    planned = []
    real = fused_call_plan.plan_call

    def spy(path, model, kwargs, loss, plan):
        result = real(path, model, kwargs, loss, plan)
        planned.append((path.name, type(result.call.head) if result.call is not None else None))
        return result

    monkeypatch.setattr(fused_call_plan, "plan_call", spy)
    integration.install(mask_skip="never", fused_lm_head=True)
    try:
        samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
        th.run_step(th.twinkle_megatron_model(th.gpt_model(VOCAB), loss=grpo(False)), False, ADVANTAGES,
                    inputs=samples, micro_batch_size=2)
        assert planned == [("megatron", loss_heads.LogProbs)]
        th.run_step(th.twinkle_transformers_model(VOCAB, loss=grpo(False)), False, ADVANTAGES, inputs=samples)
        assert planned[1:] == [("transformers", loss_heads.LogProbs)]
    finally:
        integration.uninstall()


# --- the registry -------------------------------------------------------------


def gkd_loss():
    from twinkle.loss.gkd import GKDLoss
    return GKDLoss(beta=0.5, temperature=1.0)


def test_registry_order():
    from twinkle.loss import GRPOLoss
    assert loss_heads.registered()[-2:] == [distill_loss.GKD, loss_heads.LogProbs]
    assert loss_heads.claiming(gkd_teacher(), gkd_loss()) is distill_loss.GKD
    assert loss_heads.claiming(dict(teacher_logits=torch.zeros(1, 2, 3)), gkd_loss()) is distill_loss.GKD
    assert loss_heads.claiming({}, GRPOLoss()) is loss_heads.LogProbs
    assert loss_heads.claiming({}, gkd_loss()) is loss_heads.LogProbs  # (no teacher)
    assert loss_heads.claiming({**gkd_teacher(), "forward_only": True}, gkd_loss()) is loss_heads.LogProbs


class Dummy(loss_heads.LossHead):
    """A loss head of calls with ``dummy=`` in their kwargs: records what the deferred layer hands it."""
    name = "dummy"
    cannot_defer = "the dummy head cannot run its layer unchanged"

    def __init__(self):
        self.seen = []

    @classmethod
    def claims(cls, kwargs, loss):
        return "dummy" in kwargs

    @classmethod
    def layout_ineligible(cls, plan, path, model, kwargs):
        return kwargs["dummy"]

    def output(self, call, hidden, weight, labels, process_group, seq_first):
        self.seen.append((hidden, weight, labels, process_group, seq_first))
        return fused_call.make_placeholder(hidden)


@pytest.fixture
def dummy_registered(monkeypatch):
    monkeypatch.setattr(loss_heads, "_HEADS", list(loss_heads._HEADS))
    assert loss_heads.register(Dummy) is Dummy


def test_a_registered_head_claims_its_calls(dummy_registered):
    from twinkle.loss import GRPOLoss
    assert loss_heads.registered()[0] is Dummy
    assert loss_heads.claiming({"dummy": None, **gkd_teacher()}, gkd_loss()) is Dummy
    assert loss_heads.claiming(gkd_teacher(), gkd_loss()) is distill_loss.GKD
    assert loss_heads.claiming({}, GRPOLoss()) is loss_heads.LogProbs
    path = fake_path(layers=[torch.nn.Linear(4, 12, bias=False)])
    assert plan({"dummy": "its own refusal"}, GRPOLoss(), path=path) == "its own refusal"
    call = fused_call_plan.plan_call(path, FakeModel(), {"dummy": None}, GRPOLoss(), the_plan()).call
    assert type(call.head) is Dummy and call.labels_from_processor


def run_deferred(layer, make_forward, call, *args):
    with fused_call.deferred([layer], make_forward, call):
        return layer(*args)


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_deferred_layers_dispatch_to_the_calls_head(path):
    b, s = 2, 5
    labels = torch.randint(0, VOCAB, (b, s))
    if path == "megatron":
        layer, make, seq_first = th.gpt_model(VOCAB).output_layer, fused_call.megatron_forward, True
        hidden = torch.randn(s, b, layer.weight.shape[1])
    else:
        layer, make, seq_first = torch.nn.Linear(32, VOCAB, bias=False), fused_call.transformers_forward, False
        hidden = torch.randn(b, s, 32)
    head = Dummy()
    call = fused_call.FusedCall(1.0, False, None, head=head)
    call.set_labels(labels)
    out = run_deferred(layer, make, call, hidden)
    out = out[0] if seq_first else out
    assert out.shape == (*hidden.shape[:2], 0) and call.pending is None  # the dummy's result, not the log-probs
    (got_hidden, weight, got_labels, group, got_seq_first), = head.seen
    assert got_hidden.shape == hidden.shape and torch.equal(got_hidden, hidden)
    assert weight is layer.weight and got_labels is labels and group is None and got_seq_first is seq_first
    # where the layer cannot defer (no labels for the micro-batch): the head's refusal, or the layer unchanged
    call.set_labels(None)
    with pytest.raises(RuntimeError, match="the dummy head cannot run its layer unchanged"):
        run_deferred(layer, make, call, hidden)
    assert call.refused == Dummy.cannot_defer
    logits = run_deferred(layer, make, fused_call.FusedCall(1.0, False, None), hidden)
    assert (logits[0] if seq_first else logits).shape == (*hidden.shape[:2], VOCAB)


# --- refusals -------------------------------------------------------------------


class FakeModel:
    """What the plan reads of a twinkle model: its default optimizer group's processor, sequence parallelism."""

    def __init__(self, processor=None, sequence_parallel=False):
        self._enable_sp = sequence_parallel
        self.optimizer_group = {"default": types.SimpleNamespace(processor=processor or types.SimpleNamespace())}
        self.wrapped = 0

    def _get_default_group(self):
        return "default"

    def _lazy_wrap_model(self):
        self.wrapped += 1


def fake_path(name="transformers", layers=None, reason=None, vocab=12, tensor_parallel=False, checked=None):
    def output_layers():
        if layers is None and reason is None:
            raise AssertionError("the model was read before the call's own refusals")
        return ([] if layers is None else layers), reason

    return fused_call_plan.FusedPath(name, output_layers, lambda layers: (vocab, tensor_parallel),
                                     fused_call.transformers_forward, labels_from_processor=name == "transformers",
                                     checked=checked or (lambda layers: None))


def the_plan(**features):
    features = {"megatron_skips_unused_log_probs": True, "transformers_skips_unused_log_probs": True,
                "megatron_logits": "when asked", **features}
    return patches.TwinkleInstallPlan({"fused_lm_head": True, "fused_chunk_bytes": None}, frozenset(), {}, features)


def plan(kwargs, loss, model=None, path=None, **features):
    return fused_call_plan.plan_call(path or fake_path(), model or FakeModel(), kwargs, loss,
                                     the_plan(**features)).reason


def losses():
    from twinkle.loss import GRPOLoss

    def stand_in(**flags):
        return type("StandIn", (), flags)()
    return dict(grpo=GRPOLoss(), ignores=GRPOLoss(ignore_index=-1), logits=stand_in(require_logits=True),
                values=stand_in(require_values=True), no_logps=stand_in(require_logps=False), gkd=gkd_loss())


CALL_REFUSALS = [
    ({"return_logits": True}, "grpo", "the caller asked for logits (return_logits=True)"),
    ({"task": "embedding"}, "grpo", "task='embedding' is not causal_lm"),
    ({}, None, "no loss instance"),
    ({}, "logits", "the loss StandIn needs logits (require_logits)"),
    ({}, "values", "the loss StandIn needs values (require_values)"),
    ({}, "no_logps", "the loss StandIn does not use log-probs (require_logps=False)"),
    ({}, "ignores", "the loss ignores label -1, twinkle's forward step ignores -100"),
    ({**gkd_teacher(), "forward_only": True}, "gkd", "the loss GKDLoss needs logits (require_logits)"),
]


@pytest.mark.parametrize("kwargs,loss,message", CALL_REFUSALS)
def test_call_refusals_come_first(kwargs, loss, message):
    model = FakeModel()
    assert plan(kwargs, losses().get(loss), model=model) == message
    assert model.wrapped == 0


def local_teacher(vocab=12, topk=None, grad=False):
    return dict(teacher_logits=torch.zeros(2, 3, vocab, requires_grad=grad), topk=topk)


LAYER = torch.nn.Linear(4, 12, bias=False)

# (kwargs, the model, the path, install()'s features, message)
GKD_REFUSALS = [
    (gkd_teacher(), {}, {}, dict(transformers_skips_unused_log_probs=False),
     "this twinkle-kit's forward step computes log-probs for every loss (no require_logps)"),
    (gkd_teacher(), {}, dict(name="megatron"), dict(megatron_logits="every micro-batch"),
     "a fused distillation call needs the logits guard (install(logits_guard=True))"),
    (gkd_teacher(), dict(processor=types.SimpleNamespace(padding_free=True)), {}, {},
     "a distillation call on packed (padding-free) batches"),
    (gkd_teacher(), dict(sequence_parallel=True), {}, {}, "a distillation call under sequence parallelism (Ulysses)"),
    (local_teacher(grad=True), {}, dict(layers=[LAYER]), {}, "teacher_logits that require grad"),
    (local_teacher(vocab=10), {}, dict(layers=[LAYER]), {}, "a teacher of vocab 10 for a student of vocab 12"),
    (local_teacher(), {}, dict(name="megatron", layers=[LAYER], tensor_parallel=True), {},
     "a whole-vocab teacher (teacher_logits=, no topk) under tensor parallelism"),
    (local_teacher(topk=0), {}, dict(layers=[LAYER]), {}, "topk=0 is not an int in [1, 12]"),
    # the order: the layout before the model, the model before the teacher
    (gkd_teacher(), dict(processor=types.SimpleNamespace(padding_free=True)), dict(reason="the model's"), {},
     "a distillation call on packed (padding-free) batches"),
    (local_teacher(vocab=10), {}, dict(reason="the output layer has a bias"), {}, "the output layer has a bias"),
]


@pytest.mark.parametrize("kwargs,model,path,features,message", GKD_REFUSALS)
def test_gkd_refusals_in_the_plans_order(kwargs, model, path, features, message):
    assert plan(kwargs, gkd_loss(), model=FakeModel(**model), path=fake_path(**path), **features) == message


def test_a_planned_call():
    checked = []
    gkd = fused_call_plan.plan_call(fake_path("megatron", layers=[LAYER], checked=checked.append), FakeModel(),
                               {**local_teacher(topk=3), "temperature": 0.7}, gkd_loss(), the_plan())
    assert gkd.reason is None and gkd.layers == [LAYER] and checked == [[LAYER]]
    assert type(gkd.call.head) is distill_loss.GKD and gkd.call.temperature == 0.7
    assert not gkd.call.labels_from_processor
    grpo_call = fused_call_plan.plan_call(fake_path(layers=[LAYER]), FakeModel(), {}, losses()["grpo"], the_plan())
    assert type(grpo_call.call.head) is loss_heads.LogProbs and grpo_call.call.labels_from_processor
    # no output layer (not the last pipeline stage): no call, no refusal, the chunk budget judged all the same
    none = fused_call_plan.plan_call(fake_path("megatron", layers=[], checked=checked.append), FakeModel(), {},
                                losses()["grpo"], the_plan())
    assert none == (None, [], None) and checked[-1] == []


def test_fused_gkd_on_a_tied_megatron_model(monkeypatch):
    """The teacher's vocab check reads a tied output layer's vocab from the word embeddings it shares (the layer
    holds no weight): the call is fused, with install()'s loss and gradients."""
    from twinkle.loss.gkd import GKDLoss
    planned = []
    real = fused_call_plan.plan_call
    monkeypatch.setattr(fused_call_plan, "plan_call", lambda *args: planned.append(real(*args)) or planned[-1])
    runs = []
    for fused in (False, True):
        integration.install(mask_skip="never", fused_lm_head=fused)
        try:
            net = th.gpt_model(VOCAB, tied=True)
            assert net.output_layer.weight is None
            model = th.twinkle_megatron_model(net, loss=GKDLoss(beta=0.5, temperature=1.0))
            out = model.forward_backward(inputs=th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT), temperature=0.7,
                                         micro_batch_size=2, **gkd_teacher())
            runs.append((float(out["loss"]), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
        finally:
            integration.uninstall()
    # (a twinkle-kit whose forward step computes log-probs for every loss, 0.4.0, leaves GKD to the unfused loss)
    if twinkle_has("megatron_skips_unused_log_probs"):
        assert [type(p.call.head) for p in planned] == [distill_loss.GKD]
    else:
        assert [(p.call, p.reason) for p in planned] == [
            (None, "this twinkle-kit's forward step computes log-probs for every loss (no require_logps)")]
    (want, want_grads), (got, got_grads) = runs
    assert got == pytest.approx(want, rel=1e-4) and got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
