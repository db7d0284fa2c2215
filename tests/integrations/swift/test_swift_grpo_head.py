"""GRPO's patched ``_get_logps_via_local_forward`` against ms-swift's own, on one model, in layouts and dtypes that
ms-swift's training cannot take on a CPU (padding-free needs flash attention) and with the refusals at run time.

- padded and padding-free (``[1, nnz]`` with position_ids), T = 1 and 0.7, full and LoRA (the frozen head): fp32
  log-probs, entropy and every trainable parameter's gradient within 1e-5 of ms-swift's;
- bf16: within 1e-5 of the exact softmax of the bf16 logits (float64, ``heads/reference.py``), where ms-swift's
  (TRL's bf16 log-softmax per row) is further off;
- refused by name, ms-swift's path run and its values returned: a config that transforms the logits (soft-capping),
  adapters on the LM head, a model that scales its output layer's result (caught after the call), FSDP2.
"""
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
import transformers

from swift.rlhf_trainers import grpo_trainer
from twinkle_mem.heads.reference import linear_selective_log_softmax_ref
from twinkle_mem.integrations import swift as integration
from twinkle_mem.integrations.swift import grpo_head, patches, swift_names

VOCAB, HIDDEN = 300, 32
LENGTHS = (9, 14, 6)
KEEP = 5  # logits_to_keep: the completion's length


def shipped_method():
    method = vars(grpo_trainer.GRPOTrainer)["_get_logps_via_local_forward"]
    return getattr(method, "__wrapped__", method)


def patched_method():
    plan = patches.SwiftInstallPlan.for_settings(
        swift_names.PARTS, {"fused_lm_head": True, "logits_path": False, "fused_chunk_bytes": None}, integration.FRAMEWORK.found())
    return grpo_head.local_forward(shipped_method(), plan)


def qwen2(dtype=torch.float32, model_class=transformers.Qwen2ForCausalLM, **config):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **config)
    model = model_class(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits that spread, as a trained model's
    return model


def trainer(model, temperature, padding_free=False):
    """What the method reads of ms-swift's GRPOTrainer."""
    return SimpleNamespace(temperature=temperature, model_kwarg_keys=inspect.signature(model.forward).parameters,
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m),
                           template=SimpleNamespace(padding_free=padding_free))


def inputs(padding_free, seed=0):
    g = torch.Generator().manual_seed(seed)
    if padding_free:  # three sequences packed ([1, nnz]); ms-swift keeps the last KEEP positions of the batch
        ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=g)
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        return dict(input_ids=ids, position_ids=positions)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(LENGTHS):  # left padding: the completions end every row
        mask[row, :max(LENGTHS) - n] = 0
    return dict(input_ids=ids, attention_mask=mask)


def run(method, model, temperature, padding_free, compute_entropy=True):
    """(log-probs, entropy, the trainable parameters' gradients of a fixed random combination of both)."""
    model.zero_grad()
    batch = inputs(padding_free)
    logps, entropy = method(trainer(model, temperature, padding_free), model, dict(batch), KEEP, batch["input_ids"],
                            compute_entropy)
    g = torch.Generator().manual_seed(1)
    (logps * torch.randn(logps.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), None if entropy is None else entropy.detach(), grads


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp32_equals_ms_swift(padding_free, temperature, lora):
    model = qwen2()
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    want = run(shipped_method(), model, temperature, padding_free)
    got = run(patched_method(), model, temperature, padding_free)
    rows = 1 if padding_free else len(LENGTHS)
    assert want[0].shape == got[0].shape == (rows, KEEP) and got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert set(got[2]) == set(want[2]) and len(got[2]) > 0
    assert any(name.endswith("lm_head.weight") for name in got[2]) is not lora  # (the frozen head under LoRA)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_bf16_is_within_the_exact_softmax_of_the_bf16_logits():
    model = qwen2(torch.bfloat16)
    batch = inputs(False)
    with torch.no_grad():
        hidden = model.model(**batch).last_hidden_state[:, -(KEEP + 1):-1]
        labels = batch["input_ids"][:, -KEEP:]
        exact = linear_selective_log_softmax_ref(hidden, model.lm_head.weight, None, labels, torch.zeros(labels.shape),
                                                 None, 0.7, None)
        got = patched_method()(trainer(model, 0.7), model, dict(batch), KEEP, batch["input_ids"], True)
        want = shipped_method()(trainer(model, 0.7), model, dict(batch), KEEP, batch["input_ids"], True)
    for value, key in zip(got, ("logp", "entropy")):
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), exact[key], atol=1e-5, rtol=1e-5)
    shipped_error = max((w.double() - exact[k]).abs().max().item() for w, k in zip(want, ("logp", "entropy")))
    assert shipped_error > 1e-4  # (ms-swift as shipped, bf16 log-softmax rows: not within that bound)


def fsdp2_qwen2():
    """A Qwen2 under FSDP2 (fully_shard) in a gloo world of one process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = qwen2()
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


class ScaledQwen2(transformers.Qwen2ForCausalLM):
    """A model that scales its output layer's result (as a cast, a soft-capping or a logit scale would)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


@pytest.mark.parametrize("model, why", [
    (lambda: qwen2(final_logit_softcapping=30.0), "the model's config sets final_logit_softcapping=30.0"),
    (lambda: __import__("peft").get_peft_model(qwen2(), __import__("peft").LoraConfig(
        r=4, target_modules=["q_proj", "lm_head"])), "not a plain torch.nn.Linear (adapters or quantization on lm_head)"),
    (lambda: qwen2(model_class=ScaledQwen2), "the model applies something to its output layer's result"),
    (fsdp2_qwen2, "sharded"),
], ids=["softcapping", "lora-on-lm_head", "scaled-after-the-head", "fsdp2"])
def test_a_head_that_is_not_the_logits_is_refused_by_name_and_ms_swift_runs(model, why, caplog):
    model = model()
    with caplog.at_level(logging.WARNING, logger="twinkle_mem.swift"):
        got = run(patched_method(), model, 0.7, False)
    want = run(shipped_method(), model, 0.7, False)
    assert any(why in record.getMessage() and "runs as ms-swift ships it" in record.getMessage()
               for record in caplog.records), [r.getMessage() for r in caplog.records]
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=0, rtol=0, msg=name)
