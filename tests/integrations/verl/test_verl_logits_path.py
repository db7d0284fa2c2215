"""verl's logits path on twinkle-mem's op (install(logits_path=True), as TWINKLE_MEM_VERL=logits_path has it).

- The functions are replaced where verl defines them and where its engines bound them by name.
- fp32: log-probs, entropy and the logits' gradient within 1e-5 of verl's own functions and of float64; bf16:
  within 1e-5 of the exact softmax of the bf16 logits, fp32 results.
- The in-place backward verl asks of logprobs_from_logits: given for bf16 logits (the gradient written over them,
  equal to the out-of-place one); for fp32 logits that verl's top-k distillation loss also saved (its fp32 upcast
  is no copy), the call still works, with the out-of-place backward, and the gradients are those of verl's own
  functions.
- The FSDP engine compiles its entropy function (torch.compile, dynamic shapes): the op compiles, same values.
The Megatron vocab-parallel functions run at TP = 2 in test_verl_megatron.py.
"""
import pytest
import torch
from verl_helpers import FP32_TOL, VOCAB, max_error

import verl  # noqa: F401
import verl.utils.torch_functional as verl_F
from twinkle_mem.integrations import verl as integration


@pytest.fixture(scope="module", autouse=True)
def logits_path():
    integration.install(logits_path=True)
    yield
    integration.install()  # the entry point's defaults again


def _exact(logits, labels):
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _case(dtype, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, VOCAB, generator=g)).to(dtype)
    return logits, torch.randint(0, VOCAB, (n, ), generator=g)


def test_replaced_where_verl_defines_and_binds_them():
    import verl.utils.megatron.tensor_parallel as verl_tp
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
    import verl.workers.engine.megatron.transformer_impl as megatron_engine
    for module, name in [(verl_F, "logprobs_from_logits"), (verl_F, "entropy_from_logits"),
                         (verl_F, "entropy_from_logits_with_chunking"), (fsdp_engine, "logprobs_from_logits"),
                         (verl_tp, "vocab_parallel_log_probs_from_logits"), (verl_tp, "vocab_parallel_entropy"),
                         (megatron_engine, "vocab_parallel_log_probs_from_logits"),
                         (megatron_engine, "vocab_parallel_entropy"),
                         (megatron_engine, "vocab_parallel_entropy_with_chunking")]:
        assert hasattr(getattr(module, name), "__wrapped__"), f"{module.__name__}.{name}"
    integration.install()  # without logits_path: verl's own functions everywhere again
    try:
        assert not hasattr(fsdp_engine.logprobs_from_logits, "__wrapped__")
        assert not hasattr(megatron_engine.vocab_parallel_entropy, "__wrapped__")
    finally:
        integration.install(logits_path=True)


def test_fp32_equals_verl_and_float64():
    logits, labels = _case(torch.float32)
    ours, theirs = (logits.clone().requires_grad_() for _ in range(2))
    logp = verl_F.logprobs_from_logits(ours, labels, inplace_backward=False)
    entropy = verl_F.entropy_from_logits(ours)
    chunked = verl_F.entropy_from_logits_with_chunking(ours, chunk_size=8)
    verl_logp = verl_F.logprobs_from_logits.__wrapped__(theirs, labels)
    verl_entropy = verl_F.entropy_from_logits.__wrapped__(theirs)
    want_logp, want_entropy = _exact(logits, labels)
    assert max_error(logp, verl_logp) <= FP32_TOL and max_error(logp, want_logp) <= FP32_TOL
    assert max_error(entropy, verl_entropy) <= FP32_TOL and max_error(entropy, want_entropy) <= FP32_TOL
    assert torch.equal(chunked, entropy)
    w = torch.randn(2, len(labels), generator=torch.Generator().manual_seed(1))
    ((logp * w[0]).sum() + (entropy * w[1]).sum()).backward()
    ((verl_logp * w[0]).sum() + (verl_entropy * w[1]).sum()).backward()
    assert max_error(ours.grad, theirs.grad, relative_to_max=True) <= FP32_TOL


def test_bf16_gives_fp32_exact_results():
    logits, labels = _case(torch.bfloat16)
    logp = verl_F.logprobs_from_logits(logits, labels)
    entropy = verl_F.entropy_from_logits(logits)
    want_logp, want_entropy = _exact(logits, labels)
    assert logp.dtype == entropy.dtype == torch.float32
    assert max_error(logp, want_logp) <= FP32_TOL and max_error(entropy, want_entropy) <= FP32_TOL
    print("verl's own, bf16:", max_error(verl_F.logprobs_from_logits.__wrapped__(logits, labels), want_logp),
          max_error(verl_F.entropy_from_logits.__wrapped__(logits), want_entropy))


def test_inplace_backward_for_bf16_logits():
    logits, labels = _case(torch.bfloat16)
    grads = {}
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_()
        view = leaf * 1  # (verl's logits are no leaf: the in-place backward writes over this tensor)
        verl_F.logprobs_from_logits(view, labels, inplace_backward=inplace).sum().backward()
        grads[inplace] = (leaf.grad, view._version)
    assert torch.equal(grads[True][0], grads[False][0])
    assert grads[True][1] > grads[False][1]  # the gradient was written over the logits


def test_inplace_request_with_fp32_topk_distillation_still_works():
    """verl's top-k distillation loss (its chunked form) saves views of fp32 logits for its backward; the log-probs'
    in-place backward would change them under it (the op bumps their version: the distillation's backward would
    raise). The call still works, and the gradients are those of verl's own functions."""
    from verl.trainer.distillation.fsdp.losses import _chunked_topk_log_probs
    logits, labels = _case(torch.float32)
    topk = torch.randint(0, VOCAB, (1, len(labels), 4), generator=torch.Generator().manual_seed(2))
    grads = []
    for logprobs_from_logits in (verl_F.logprobs_from_logits, verl_F.logprobs_from_logits.__wrapped__):
        leaf = logits.clone().requires_grad_()
        student = leaf * 1  # (verl's logits: the lm_head's output)
        distilled = _chunked_topk_log_probs(student[None], topk, chunk_size=16)
        logp = logprobs_from_logits(student, labels, inplace_backward=True)
        (distilled.sum() + logp.sum()).backward()
        grads.append(leaf.grad)
    assert max_error(grads[0], grads[1], relative_to_max=True) <= FP32_TOL


def test_compiled_entropy_as_the_fsdp_engine_builds_it():
    compiled = torch.compile(verl_F.entropy_from_logits, dynamic=True)
    for n in (37, 53):
        logits, _ = _case(torch.float32, n=n)
        assert max_error(compiled(logits), verl_F.entropy_from_logits(logits)) <= 1e-6
