"""The recipes' first step in bf16 against float64, for tests/integrations/twinkle/ray_megatron_recipes.py's
``bf16:layout`` run.

``bf16_first_steps``: one ``MegatronModel(mixed_precision='bf16')`` (as short_math_grpo.py builds it) with the
recipes' LoRA adapter in 2 CPU workers; the first ``forward_backward`` of the GRPO, GKD and DPO recipes on it, on the
same data as their fp32 runs (standins/recipes.py), with no optimizer step between them (LoRA B is zero until the
first step: each loss is the base model's). Each loss comes with its float64 reference: transformers' Qwen3 of the
same checkpoint (its weights exact in bf16) in float64, each sequence alone, and twinkle's own loss classes on the
float64 log-probs / logits, micro-batch by micro-batch as twinkle's Megatron step averages them.
"""
import torch

from . import recipes
from . import twinkle_ray as tr


def _float64_rows(model, features):
    """Per sequence: its float64 logits [L, V] and labels [L] (each sequence alone: no padding)."""
    rows = []
    with torch.no_grad():
        for feature in features:
            ids = torch.as_tensor(feature["input_ids"])[None]
            rows.append((model(ids).logits[0].double(), torch.as_tensor(feature["labels"]).long()))
    return rows


def _padded(rows, width):
    """A micro-batch's logits [b, L, V] (zero past each sequence) and labels [b, L] (-100 there)."""
    length = max(len(labels) for _, labels in rows)
    logits = torch.zeros(len(rows), length, width, dtype=torch.float64)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for b, (row_logits, row_labels) in enumerate(rows):
        logits[b, :len(row_labels)], labels[b, :len(row_labels)] = row_logits, row_labels
    return logits, labels


def _logps(logits, labels):
    return logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(labels == -100, 0.0)


def _micro_batches(n, size):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def float64_losses(path, grpo, gkd, dpo):
    """The float64 reference of each first-step loss (``grpo``: (inputs, old_logps, advantages, micro_batch), ``gkd``:
    (inputs, teacher tensors), ``dpo``: inputs)."""
    from twinkle.loss import DPOLoss, GKDLoss, GRPOLoss
    model = recipes._causal_lm(path, torch.float64)
    out = {}
    inputs, old_logps, advantages, size = grpo
    rows, losses = _float64_rows(model, inputs), []
    for mb in _micro_batches(len(rows), size):
        logits, labels = _padded(rows[mb], model.config.vocab_size)
        losses.append(GRPOLoss(epsilon=0.2)(dict(labels=labels), dict(logps=_logps(logits, labels)),
                                            old_logps=old_logps[mb], advantages=advantages[mb])["loss"])
    out["grpo"] = float(sum(losses) / len(losses))
    inputs, teacher = gkd
    rows, losses = _float64_rows(model, inputs), []
    for mb in _micro_batches(len(rows), 2):  # (twinkle's default micro-batch: min(2, len(inputs)))
        logits, labels = _padded(rows[mb], model.config.vocab_size)
        length = labels.shape[1]
        losses.append(GKDLoss(beta=0.5, temperature=1.0)(
            dict(labels=labels), dict(logits=logits),
            **{k: v[mb, :length].to(torch.float64 if v.is_floating_point() else v.dtype) for k, v in teacher.items()}
        )["loss"])
    out["gkd"] = float(sum(losses) / len(losses))
    rows, losses = _float64_rows(model, dpo), []
    for mb in _micro_batches(len(rows), 2):
        logits, labels = _padded(rows[mb], model.config.vocab_size)
        logps = _logps(logits, labels)
        losses.append(DPOLoss(beta=0.1, loss_type="sigmoid", sft_weight=1.0)(
            dict(labels=labels), dict(logps=logps), ref_outputs=dict(logps=logps))["loss"])
    out["dpo"] = float(sum(losses) / len(losses))
    return out


@recipes._recipe
def bf16_first_steps(holder, path, layout, teacher_path, *, vocab=512):
    from peft import LoraConfig
    from twinkle.loss import DPOLoss, GKDLoss
    from twinkle.processor import InputProcessor
    from twinkle.template import Template
    model = recipes._model("MegatronModel", path, layout, "bf16", variable_seq_lengths=True)
    run = holder["run"] = recipes.Run("bf16_first_steps", layout, model)
    model.add_adapter_to_model(recipes.ADAPTER, LoraConfig(**recipes.LORA))
    run.prepare()
    model.set_template("Template", model_id=path)
    template = Template(model_id=path)
    grpo_inputs, old_logps, _, _, advantages = recipes.grpo_data(recipes.Sampler(path, template), 0, vocab)
    gkd_inputs, teacher = recipes.gkd_data(template, recipes.Teacher(teacher_path, 64), 0, vocab)
    dpo_inputs = recipes.dpo_data(template, 0, vocab)
    losses = {}
    model.set_loss("GRPOLoss", epsilon=0.2)
    model.set_processor(InputProcessor, padding_free=True)
    losses["grpo"] = recipes.loss_of(model.forward_backward(inputs=grpo_inputs, old_logps=old_logps,
                                                            advantages=advantages, micro_batch_size=2))
    model.set_loss(GKDLoss(beta=0.5, temperature=1.0))
    model.set_processor(InputProcessor)
    losses["gkd"] = recipes.loss_of(model.forward_backward(inputs=gkd_inputs, **teacher))
    model.set_loss(DPOLoss(beta=0.1, loss_type="sigmoid", reference_free=False, sft_weight=1.0))
    model.set_processor(InputProcessor, padding_free=True)
    ref_outputs = model.forward_only(inputs=dpo_inputs, disable_lora=True)
    losses["dpo"] = recipes.loss_of(model.forward_backward(inputs=dpo_inputs, ref_outputs=ref_outputs))
    run.result["losses"] = losses
    run.result["float64"] = float64_losses(path, (grpo_inputs, old_logps, advantages, 2), (gkd_inputs, teacher),
                                           dpo_inputs)
    run.result["workers"] = tr.on_workers(model, recipes._worker_report)
    return run.result
