"""install(fused_lm_head=True) on twinkle's GKD (distillation) calls (issue 26), on the CPU:
twinkle's real MegatronModel (a megatron-core GPTModel, TP = 1) and TransformersModel (a one-layer
Qwen2), GKDLoss over a top-k teacher as the recipes feed it (``teacher_topk_logprobs`` fp32 and
``teacher_topk_indices`` int64, [B, L, k] with L beyond the student's length, padding rows of id 0 and
log-prob 0.0), forward_backward at temperature 0.7.

- The fused call's loss and every parameter gradient equal twinkle's GKD computed exactly: the same
  twinkle step unfused with GKDLoss's arithmetic in float64 (fp32 within the integration tests' 1e-4);
  twinkle-kit as shipped (the loss in fp32) is no closer.
- No tensor with the vocab (1018) as last dim during the fused step: neither the logits nor
  twinkle's unused full-vocab log-softmax (the call's log-probs are those of a loss without them).
- Calls the fused path does not cover run twinkle-kit unchanged: return_logits=True, a full-vocab
  teacher (teacher_logits=).
"""
import contextlib

import pytest
import torch

from cpu_harness import megatron as th
from helpers import (CHUNK, FUSED_BLOCKS, GKD_K, LENGTHS, PROMPT, SEQ, TOL, VOCAB, VocabTensors, assert_close,
                     blocks, gkd_in_float64, gkd_teacher)
from twinkle_mem.integrations import twinkle as integration


# conftest.py: megatron-core and twinkle on the CPU for the module; every test starts and ends uninstalled
pytestmark = pytest.mark.usefixtures("gpt_step_cpu", "uninstalled")


@pytest.fixture
def exact_gkd():
    with gkd_in_float64():
        yield


def run(path, *, beta, loss_temperature, install=None, spy=None, teacher_data=None, steps=1, **kwargs):
    from twinkle.loss.gkd import GKDLoss
    if install is not None:
        integration.install(mask_skip="never", fused_chunk_bytes=CHUNK if install else None, fused_lm_head=install)
    try:
        with blocks(*FUSED_BLOCKS):
            loss = GKDLoss(beta=beta, temperature=loss_temperature)
            samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
            if path == "megatron":
                net = th.gpt_model(VOCAB)
                model = th.twinkle_megatron_model(net, loss=loss)
                kwargs.setdefault("micro_batch_size", 2)
            else:
                model = th.twinkle_transformers_model(VOCAB, loss=loss)
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


@pytest.mark.parametrize("path,beta,loss_temperature", CASES)
def test_fused_gkd_matches_twinkle_in_float64(path, beta, loss_temperature, exact_gkd):
    spy = VocabTensors((VOCAB, ), 10 ** 9)
    got = run(path, beta=beta, loss_temperature=loss_temperature, install=True, spy=spy)
    want = run(path, beta=beta, loss_temperature=loss_temperature)  # twinkle's step, GKD in float64
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL[torch.float32], abs=1e-7)
    assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) > 3
    for name, grad in got["grads"].items():
        assert_close(grad, want["grads"][name], torch.float32, f"grad of {name}")
    assert spy.ops > 100 and spy.last_dim == [], spy.last_dim[:5]  # no logits, no full-vocab log-softmax
    logps = got["out"].get("logps")
    assert logps is None or all(x is None for x in logps)


def test_unfused_run_makes_the_logits(exact_gkd):
    spy = VocabTensors((VOCAB, ), 10 ** 9)
    run("megatron", beta=0.5, loss_temperature=1.0, install=False, spy=spy)
    assert spy.last_dim  # the control: the spy sees the logits where they exist


@pytest.mark.parametrize("path", ["megatron", "transformers"])
def test_fused_gkd_is_closer_to_exact_than_twinkle_in_fp32(path):
    # twinkle as shipped computes GKD in the logits' dtype; the fused op in float64 inside
    shipped = run(path, beta=0.5, loss_temperature=1.0)
    fused = run(path, beta=0.5, loss_temperature=1.0, install=True)
    with gkd_in_float64():
        exact = run(path, beta=0.5, loss_temperature=1.0)
    assert abs(fused["loss"] - exact["loss"]) <= abs(shipped["loss"] - exact["loss"]) + 1e-7 * abs(exact["loss"])


@pytest.mark.parametrize("path", ["megatron", "transformers"])
@pytest.mark.parametrize("change", ["return_logits", "teacher_logits"])
def test_calls_not_covered_run_twinkle_unchanged(path, change):
    kwargs = {}
    if change == "return_logits":
        kwargs["return_logits"] = True
    else:  # a local full-vocab teacher, its top 8
        gen = torch.Generator().manual_seed(2)
        kwargs["teacher_data"] = dict(teacher_logits=torch.randn(len(LENGTHS), SEQ + 3, VOCAB, generator=gen), topk=GKD_K)
    shipped = run(path, beta=0.5, loss_temperature=1.0, **kwargs)
    fused = run(path, beta=0.5, loss_temperature=1.0, install=True, **kwargs)
    assert fused["loss"] == shipped["loss"]
    for name, grad in fused["grads"].items():
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
