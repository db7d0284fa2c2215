"""impl_backend=twinkle on verl's FSDP fused path, against verl's own torch backend and float64 (issue 40).

verl's per-architecture fused forward (here dense_common's, chosen for a Qwen2 by verl's patch_forward_with_backends)
is run twice on the same model: with verl's "torch" backend and with "twinkle" (the verl.plugins entry point
installed twinkle-mem at `import verl`). Padding-free (rmpad) and padded batches, T = 1 and 0.7, tied and untied
head, labels rolled by verl or given as shift_labels:
- fp32: log-probs and entropy within 1e-5 of verl's torch backend and of float64 on the same hidden states and
  head; the gradients of the hidden states and of every parameter within 1e-5 (of the largest) of verl's, and
  the hidden states' and the head's within 1e-5 of float64;
- bf16: log-probs and entropy within 1e-5 of the exact softmax of the bf16 logits (verl divides the bf16 logits
  by T in bf16: its error is shown beside), gradients within a bf16 step of float64's.
The FSDP2-sharded lm_head (a DTensor) runs in the engine test (test_verl_fsdp_engine.py).
"""
import pytest
import torch
from verl_helpers import FP32_TOL, VOCAB, exact, exact_grads, fused_forward, max_error, packed, padded

import verl  # noqa: F401  (loads the verl.plugins entry point: twinkle-mem's install())
from standins.verl_cpu import tiny_qwen2
from twinkle_mem.integrations import verl as integration


def test_the_entry_point_installed_the_backend():
    assert integration.is_installed() and integration.refused() == {}


def _both(tied, dtype, inputs, temperature, shift_labels=None):
    model = tiny_qwen2(tied=tied, dtype=dtype)
    twinkle = fused_forward(model, "twinkle", inputs, temperature, shift_labels)
    torch_backend = fused_forward(model, "torch", inputs, temperature, shift_labels)
    return model, twinkle, torch_backend


LAYOUTS = {"packed": packed, "padded": padded}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp32_equals_verl_torch_backend_and_float64(tied, temperature, layout):
    model, twinkle, verl_torch = _both(tied, torch.float32, LAYOUTS[layout](), temperature)
    assert twinkle["logp"].dtype == twinkle["entropy"].dtype == torch.float32
    assert torch.equal(twinkle["hidden"], verl_torch["hidden"])  # the same body: only the head differs
    logp, entropy = exact(twinkle["hidden"], model.lm_head.weight, twinkle["labels"], temperature)
    for what in ("logp", "entropy"):
        assert max_error(twinkle[what], verl_torch[what]) <= FP32_TOL, what
    assert max_error(twinkle["logp"], logp) <= FP32_TOL and max_error(twinkle["entropy"], entropy) <= FP32_TOL
    assert max_error(twinkle["hidden_grad"], verl_torch["hidden_grad"], relative_to_max=True) <= FP32_TOL
    assert twinkle["grads"].keys() == verl_torch["grads"].keys() and len(twinkle["grads"]) >= 10
    for name, grad in twinkle["grads"].items():
        assert max_error(grad, verl_torch["grads"][name], relative_to_max=True) <= FP32_TOL, name
    hidden_grad, weight_grad = exact_grads(twinkle["hidden"], model.lm_head.weight, twinkle["labels"], temperature,
                                           twinkle["weights"])
    assert max_error(twinkle["hidden_grad"], hidden_grad, relative_to_max=True) <= FP32_TOL
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if not tied:  # (tied: the embedding's gradient also has the input embedding's part)
        assert max_error(twinkle["grads"][head], weight_grad, relative_to_max=True) <= FP32_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_is_the_exact_softmax_of_the_bf16_logits(tied, temperature):
    model, twinkle, verl_torch = _both(tied, torch.bfloat16, packed(), temperature)
    weight = model.lm_head.weight
    logp, entropy = exact(twinkle["hidden"], weight, twinkle["labels"], temperature)
    errors = {what: max_error(twinkle[what], want) for what, want in (("logp", logp), ("entropy", entropy))}
    verl_errors = {what: max_error(verl_torch[what], want) for what, want in (("logp", logp), ("entropy", entropy))}
    print(f"bf16 T={temperature} {'tied' if tied else 'untied'}: twinkle {errors}, verl's torch backend {verl_errors}")
    assert twinkle["logp"].dtype == twinkle["entropy"].dtype == torch.float32
    assert errors["logp"] <= FP32_TOL and errors["entropy"] <= FP32_TOL
    hidden_grad, weight_grad = exact_grads(twinkle["hidden"], weight, twinkle["labels"], temperature,
                                           twinkle["weights"])
    bf16_step = 2.0 ** -7  # (the gradients are bf16: one step of their dtype, of the largest)
    assert max_error(twinkle["hidden_grad"], hidden_grad, relative_to_max=True) <= bf16_step
    if not tied:
        assert max_error(twinkle["grads"]["lm_head.weight"], weight_grad, relative_to_max=True) <= bf16_step


def test_shift_labels_are_the_labels():
    """verl's engine passes globally rolled labels as shift_labels (Ulysses): those are the ones computed."""
    inputs = packed()
    shift_labels = torch.randint(0, VOCAB, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    model, twinkle, verl_torch = _both(False, torch.float32, inputs, 0.7, shift_labels=shift_labels)
    logp, _ = exact(twinkle["hidden"], model.lm_head.weight, shift_labels, 0.7)
    assert max_error(twinkle["logp"], logp) <= FP32_TOL and max_error(twinkle["logp"], verl_torch["logp"]) <= FP32_TOL
    rolled, _ = exact(twinkle["hidden"], model.lm_head.weight, torch.roll(inputs["input_ids"], -1, -1), 0.7)
    assert max_error(twinkle["logp"], rolled) > 1e-2


def test_only_a_twinkle_model_changes():
    """Other backends and FusedLinearForPPO outside a twinkle model's forward are verl's own, bitwise."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    model = tiny_qwen2()
    inputs = packed()
    verl_torch = fused_forward(model, "torch", inputs, 0.7)
    assert not hasattr(type(model).forward, "__wrapped__")  # verl's forward, not twinkle-mem's wrapper
    head = FusedLinearForPPO()
    hidden, labels = verl_torch["hidden"], verl_torch["labels"]
    ours = head.forward(hidden, model.lm_head.weight, labels, 0.7)
    verls = FusedLinearForPPO.forward.__wrapped__(head, hidden, model.lm_head.weight, labels, 0.7)
    assert all(torch.equal(a, b) for a, b in zip(ours, verls))
    assert ours[1].dtype == hidden.dtype  # (verl's torch backend: the entropy in the input dtype; twinkle's is fp32)
    fused_forward(model, "twinkle", inputs, 0.7)
    assert hasattr(type(model).forward, "__wrapped__")


def test_what_verl_records_and_prints_of_the_backend_names_twinkle(capsys):
    """verl records the backend on the model (0.9.1's forwards build their FusedLinearForPPO from it) and prints its
    choice: both name twinkle, not verl's torch backend whose forward twinkle-mem runs in."""
    import inspect

    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    model = tiny_qwen2()
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="twinkle")
    printed = capsys.readouterr().out
    assert printed == "Using twinkle backend for fused kernels in Qwen2ForCausalLM\n"
    assert model._verl_fused_kernels_backend == "twinkle"
    built = []
    init = FusedLinearForPPO.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(getattr(self, "impl_backend", None))

    FusedLinearForPPO.__init__ = recorded
    try:
        model(**packed(), temperature=0.7, return_dict=True)
    finally:
        FusedLinearForPPO.__init__ = init
    takes_backend = "impl_backend" in inspect.signature(init.__wrapped__).parameters  # (0.9.1; 0.9.0's takes none)
    assert built == ["twinkle" if takes_backend else None]
