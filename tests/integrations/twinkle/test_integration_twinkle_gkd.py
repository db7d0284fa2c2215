"""twinkle's GKD (distillation) calls under install() and install(fused_lm_head=True) (issue 26), on the
CPU: twinkle's real MegatronModel (a megatron-core GPTModel, TP = 1) and TransformersModel (a one-layer
Qwen2); GKDLoss over a top-k teacher as the recipes feed it (``teacher_topk_logprobs`` fp32 and
``teacher_topk_indices`` int64, [B, L, k] with L beyond the student's length, padding rows of id 0 and
log-prob 0.0) and over a local teacher's logits (``teacher_logits=``, with and without ``topk=``);
forward_backward at temperature 0.7. ``run(install=None)``: twinkle-kit as shipped; False: install();
True: install(fused_lm_head=True).

- Both installs' loss and every parameter gradient equal twinkle's GKD computed exactly: the same twinkle
  step with GKDLoss's arithmetic in float64 (fp32 within the integration tests' 1e-4); twinkle-kit as
  shipped (the loss in fp32) is no closer.
- Fused: no tensor with the vocab (1018) as last dim during the step: neither the logits, nor twinkle's
  unused full-vocab log-softmax (the call's log-probs are those of a loss without them), nor a copy of a
  local teacher.
- install() alone, a local teacher's whole vocab: no full-vocab tensor saved for backward beyond the
  student's logits and the teacher (twinkle's chunk loop saves several).
- return_logits=True takes the logits path; calls neither covers (a teacher of another vocab, a GKDLoss
  subclass with its own divergence) run twinkle-kit unchanged.
"""
import contextlib

import pytest
import torch

from standins import megatron as th
from helpers import (CHUNK, FUSED_BLOCKS, GKD_K, GKD_TEACHERS, LENGTHS, PROMPT, TOL, VOCAB, VocabTensors,
                     assert_close, blocks, gkd_in_float64, gkd_local_teacher, gkd_teacher, twinkle_has)
from twinkle_mem.integrations import twinkle as integration


# conftest.py: megatron-core and twinkle on the CPU for the module; every test starts and ends uninstalled
pytestmark = pytest.mark.usefixtures("gpt_step_cpu", "uninstalled")


GKD_OPS = ("gkd_topk_from_logits", "gkd_from_logits", "linear_gkd_topk", "linear_gkd_full")


@pytest.fixture
def op_calls(monkeypatch):
    """The twinkle-mem GKD ops the integration called, by name, in order."""
    import twinkle_mem
    calls = []

    def counted(name, op):
        def call(*args, **kwargs):
            calls.append(name)
            return op(*args, **kwargs)
        return call

    for name in GKD_OPS:
        monkeypatch.setattr(twinkle_mem, name, counted(name, getattr(twinkle_mem, name)))
    return calls


@pytest.fixture
def exact_gkd():
    with gkd_in_float64():
        yield


def run(path, *, beta, loss_temperature, install=None, spy=None, teacher_data=None, steps=1, loss_class=None,
        dtype=torch.float32, **kwargs):
    from twinkle.loss.gkd import GKDLoss
    loss_class = loss_class or GKDLoss
    if install is not None:
        integration.install(mask_skip="never", fused_chunk_bytes=CHUNK if install else None, fused_lm_head=install)
    try:
        with blocks(*FUSED_BLOCKS):
            loss = loss_class(beta=beta, temperature=loss_temperature)
            samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
            if path == "megatron":
                net = th.gpt_model(VOCAB, dtype=dtype)
                model = th.twinkle_megatron_model(net, loss=loss)
                kwargs.setdefault("micro_batch_size", 2)
            else:
                model = th.twinkle_transformers_model(VOCAB, loss=loss, dtype=dtype)
                net = model.model
            teacher_kwargs = teacher_data if teacher_data is not None else gkd_teacher()
            with spy if spy is not None else contextlib.nullcontext():
                for _ in range(steps):  # (a second step reads the first one's outputs for twinkle's metrics)
                    out = model.forward_backward(inputs=samples, temperature=0.7, **teacher_kwargs, **kwargs)
            grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
            return dict(loss=float(out["loss"]), out=out, grads=grads)
    finally:
        integration.uninstall()


CASES = [("megatron", 0.5, 1.0), ("megatron", 0.0, 0.7), ("megatron", 1.0, 1.0), ("megatron", 0.3, 0.7),
         ("transformers", 0.5, 0.7), ("transformers", 1.0, 1.0)]
# a local teacher's logits (teacher_logits=): its top k, and the whole vocab
LOCAL_CASES = [("megatron", 0.5, 0.7, "local"), ("megatron", 0.0, 1.0, "local_topk"),
               ("transformers", 0.3, 1.0, "local"), ("transformers", 1.0, 0.7, "local_topk")]


def assert_exact(got, want):
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL[torch.float32], abs=1e-7)
    assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) > 3
    for name, grad in got["grads"].items():
        assert_close(grad, want["grads"][name], torch.float32, f"grad of {name}")


@pytest.mark.parametrize("path,beta,loss_temperature,teacher",
                         [(*case, "topk") for case in CASES] + LOCAL_CASES)
def test_fused_gkd_matches_twinkle_in_float64(path, beta, loss_temperature, teacher, exact_gkd, op_calls):
    teacher_data = GKD_TEACHERS[teacher]()
    spy = VocabTensors((VOCAB, ), 10 ** 9, exempt=[t for t in teacher_data.values() if torch.is_tensor(t)])
    got = run(path, beta=beta, loss_temperature=loss_temperature, install=True, spy=spy, teacher_data=teacher_data)
    # (a twinkle-kit whose forward steps compute log-probs for every loss, 0.4.0, keeps the logits of a GKD call:
    # install()'s GKD from the logits computes it there)
    fused = twinkle_has(f"{path}_skips_unused_log_probs")
    if fused:
        assert set(op_calls) == {"linear_gkd_full" if teacher == "local" else "linear_gkd_topk"}
    else:
        assert set(op_calls) == {"gkd_topk_from_logits" if teacher == "topk" else "gkd_from_logits"}
    want = run(path, beta=beta, loss_temperature=loss_temperature, teacher_data=teacher_data)  # GKD in float64
    assert_exact(got, want)
    # no logits, no full-vocab log-softmax, no copy of a local teacher
    assert spy.ops > 100 and (spy.last_dim == []) == fused, spy.last_dim[:5]
    logps = got["out"].get("logps")
    assert not fused or logps is None or all(x is None for x in logps)


def test_unfused_run_makes_the_logits(exact_gkd):
    spy = VocabTensors((VOCAB, ), 10 ** 9)
    run("megatron", beta=0.5, loss_temperature=1.0, install=False, spy=spy)
    assert spy.last_dim  # the control: the spy sees the logits where they exist


@pytest.mark.parametrize("path", ["megatron", "transformers"])
@pytest.mark.parametrize("install", [True, False])
def test_gkd_is_closer_to_exact_than_twinkle_in_fp32(path, install):
    # twinkle as shipped computes GKD in the logits' dtype; twinkle-mem's ops in float64 inside
    shipped = run(path, beta=0.5, loss_temperature=1.0)
    ours = run(path, beta=0.5, loss_temperature=1.0, install=install)
    with gkd_in_float64():
        exact = run(path, beta=0.5, loss_temperature=1.0)
    assert any(not torch.equal(grad, shipped["grads"][name]) for name, grad in ours["grads"].items())
    assert abs(ours["loss"] - exact["loss"]) <= abs(shipped["loss"] - exact["loss"]) + 1e-7 * abs(exact["loss"])


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_gkd_on_a_bf16_model(path, exact_gkd):
    """A bf16 model (Megatron's Float16Module; transformers under twinkle's bf16 autocast): twinkle-kit as
    shipped computes GKD in bf16; install() from the same bf16 logits in float64 gives twinkle's loss computed
    exactly (fp32 accuracy), install(fused_lm_head=True) from the hidden states (its fp32 logits differ from
    the bf16 ones by their rounding)."""
    want = run(path, beta=0.5, loss_temperature=1.0, dtype=torch.bfloat16)
    got = {install: run(path, beta=0.5, loss_temperature=1.0, install=install, dtype=torch.bfloat16)
           for install in (False, True)}
    assert got[False]["loss"] == pytest.approx(want["loss"], rel=TOL[torch.float32])
    assert got[True]["loss"] == pytest.approx(want["loss"], rel=TOL[torch.bfloat16])
    for install in (False, True):
        assert got[install]["grads"].keys() == want["grads"].keys() and len(want["grads"]) > 3
        for name, grad in got[install]["grads"].items():
            assert_close(grad, want["grads"][name], torch.bfloat16, f"grad of {name} (install {install})")


def test_twinkle_gkd_in_bf16_is_off():
    """The control of the test above: twinkle-kit's own GKD on transformers' bf16 logits misses its exact loss
    by more than fp32 accuracy. (Megatron's Float16Module hands the loss fp32 logits, a copy of the bf16 ones:
    twinkle's GKD is fp32 there.)"""
    path = "transformers"
    shipped = run(path, beta=0.5, loss_temperature=1.0, dtype=torch.bfloat16)
    with gkd_in_float64():
        exact = run(path, beta=0.5, loss_temperature=1.0, dtype=torch.bfloat16)
    assert abs(shipped["loss"] - exact["loss"]) > 10 * TOL[torch.float32] * abs(exact["loss"])


@pytest.mark.parametrize("path,teacher", [("megatron", "topk"), ("megatron", "local"), ("megatron", "local_topk"),
                                          ("transformers", "topk"), ("transformers", "local"),
                                          ("transformers", "local_topk")])
def test_install_gkd_from_logits_matches_twinkle_in_float64(path, teacher, exact_gkd, op_calls):
    """install() alone: the logits exist, the loss comes from them through twinkle-mem's ops (fp32 results,
    float64 math) and equals twinkle's GKD computed exactly."""
    teacher_data = GKD_TEACHERS[teacher]()
    got = run(path, beta=0.3, loss_temperature=0.7, install=False, teacher_data=teacher_data)
    assert set(op_calls) == {"gkd_topk_from_logits" if teacher == "topk" else "gkd_from_logits"}
    want = run(path, beta=0.3, loss_temperature=0.7, teacher_data=teacher_data)
    assert_exact(got, want)


class SavedVocabTensors(torch.autograd.graph.saved_tensors_hooks):
    """The storages of the tensors with the vocab as last dim that autograd saves for backward."""

    def __init__(self):
        self.storages = set()

        def pack(t):
            parameter = t.requires_grad and (t.is_leaf or t._base is not None and t._base.is_leaf)  # (head.weight.T)
            if t.dim() > 0 and t.shape[-1] == VOCAB and not parameter:
                self.storages.add(t.untyped_storage().data_ptr())
            return t

        super().__init__(pack, lambda t: t)


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_install_gkd_keeps_no_per_chunk_graph(path):
    """install() alone with a local teacher's whole vocab: twinkle's chunk loop saves full-vocab tensors of
    its own for backward (log-softmaxes, masked copies, per chunk); twinkle-mem's op saves references to the
    student's logits and to the teacher (twinkle's Megatron step hands each micro-batch a copy of its rows)."""
    teacher_data = gkd_local_teacher()
    teacher_storage = teacher_data["teacher_logits"].untyped_storage().data_ptr()
    saved = {}
    for install in (None, False):
        hooks = SavedVocabTensors()
        with hooks:
            run(path, beta=0.5, loss_temperature=1.0, install=install, teacher_data=teacher_data)
        saved[install] = hooks.storages - {teacher_storage}
    micro_batches = 2 if path == "megatron" else 1
    assert len(saved[False]) <= 2 * micro_batches  # the logits, and a micro-batch's rows of the teacher
    assert len(saved[None]) >= 3 * len(saved[False])


def test_half_a_teacher_gets_twinkles_assertion():
    from twinkle.loss.gkd import GKDLoss
    integration.install(mask_skip="never")
    try:
        with pytest.raises(AssertionError, match="Either logits or both"):
            GKDLoss()({"labels": torch.zeros(1, 3, dtype=torch.long)}, {"logits": torch.randn(1, 3, 10)},
                      teacher_topk_indices=torch.zeros(1, 3, 2, dtype=torch.long))
    finally:
        integration.uninstall()


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_return_logits_takes_the_logits_path(path):
    """return_logits=True keeps the logits: the fused path does not apply and the loss comes from them, as
    with install() alone (bitwise)."""
    fused = run(path, beta=0.5, loss_temperature=1.0, install=True, return_logits=True)
    from_logits = run(path, beta=0.5, loss_temperature=1.0, install=False, return_logits=True)
    assert fused["loss"] == from_logits["loss"]
    for name, grad in fused["grads"].items():
        assert torch.equal(grad, from_logits["grads"][name]), name


class SubclassedGKDLoss:
    """A GKDLoss subclass with a divergence of its own (made lazily: twinkle is imported by the fixture)."""

    def __new__(cls, **kwargs):
        from twinkle.loss.gkd import GKDLoss

        class OwnDivergence(GKDLoss):
            @staticmethod
            def _generalized_jsd_loss(student_logits, **kw):
                return GKDLoss._generalized_jsd_loss(student_logits * 1.5, **kw)

        return OwnDivergence(**kwargs)


@pytest.mark.parametrize("path", ["megatron", "transformers"])
@pytest.mark.parametrize("change", ["teacher_vocab", "subclass", "teacher_grad"])
@pytest.mark.parametrize("install", [True, False])
def test_calls_not_covered_run_twinkle_unchanged(path, change, install, op_calls):
    kwargs = {}
    if change == "teacher_vocab":  # a local teacher of another vocab: twinkle pads the smaller side
        kwargs["teacher_data"] = gkd_local_teacher(vocab=VOCAB + 6)
    elif change == "teacher_grad":  # twinkle's loss sends the teacher a gradient; the ops give it none
        kwargs["teacher_data"] = gkd_local_teacher(GKD_K)
        kwargs["teacher_data"]["teacher_logits"].requires_grad_()
    else:
        kwargs["loss_class"] = SubclassedGKDLoss
    shipped = run(path, beta=0.5, loss_temperature=1.0, **kwargs)
    ours = run(path, beta=0.5, loss_temperature=1.0, install=install, **kwargs)
    assert op_calls == []
    assert ours["loss"] == shipped["loss"]
    for name, grad in ours["grads"].items():
        assert torch.equal(grad, shipped["grads"][name]), name


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_fused_gkd_second_step_and_metrics(path, exact_gkd):
    """twinkle keeps a step's outputs for its metrics (Accuracy takes the argmax of outputs['logits'] at the
    next step): a second fused step runs, and both steps' gradients add up as twinkle's do."""
    got = run(path, beta=0.5, loss_temperature=1.0, install=True, steps=2)
    want = run(path, beta=0.5, loss_temperature=1.0, steps=2)
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL[torch.float32], abs=1e-7)
    for name, grad in got["grads"].items():
        assert_close(grad, want["grads"][name], torch.float32, f"grad of {name}")


@pytest.mark.parametrize("path", ["megatron", "transformers"])
@pytest.mark.parametrize("install", [True, False])
def test_gkd_through_safe_loss_wrapper_in_production_mode(path, install, monkeypatch, exact_gkd, op_calls):
    """twinkle wraps every loss in its SafeLossWrapper (twinkle.utils.nccl_safe); with TWINKLE_FAIL_FAST=0
    it catches the loss's errors and returns a zero loss instead. The GKD paths compute through it the same
    loss: a zero from a swallowed error would fail here."""
    monkeypatch.setenv("TWINKLE_FAIL_FAST", "0")
    got = run(path, beta=0.5, loss_temperature=1.0, install=install)
    want = run(path, beta=0.5, loss_temperature=1.0)
    assert want["loss"] > 0.01 and op_calls
    assert_exact(got, want)


@pytest.mark.parametrize("install", [None, False])
def test_megatron_micro_batch_logits_are_not_kept(install):
    """twinkle's Megatron step reports each micro-batch's logits where the loss sets require_logits (GKD), and
    the schedule keeps every report until it ends: micro-batch 1's logits are alive at micro-batch 2's forward,
    then concatenated and dropped (no return_logits). With install() the reports keep no logits (the loss has
    read them before the report), and the loss keeps none for backward (gkd_topk_from_logits)."""
    import gc

    from megatron.core.tensor_parallel import ColumnParallelLinear
    alive_at_forward = []

    def vocab_tensors():
        return {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.dim() > 1
                and t.shape[-1] == VOCAB and t.numel() >= 2 * PROMPT * VOCAB}

    before = vocab_tensors()  # (other tests' leftovers)

    def logits_alive(module, _args):
        if isinstance(module, ColumnParallelLinear) and module.weight.shape[0] == VOCAB:
            alive_at_forward.append(len(vocab_tensors() - before))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(logits_alive)
    try:
        run("megatron", beta=0.5, loss_temperature=1.0, install=install)
    finally:
        handle.remove()
    assert len(alive_at_forward) == 2  # two micro-batches
    assert alive_at_forward == ([0, 1] if install is None else [0, 0])
