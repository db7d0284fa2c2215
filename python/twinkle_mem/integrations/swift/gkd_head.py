"""GKD's loss from the student's LM head input (``gkd_fused_head``), on twinkle-mem's distillation heads.

ms-swift's ``GKDTrainer.compute_loss`` calls the student for its logits ``[B, T, V]`` and hands them to
``_compute_jsd_loss``, which rolls the labels by one, turns the teacher to its top k where ``gkd_logits_topk`` asks,
and divides ``gkd_loss``'s total by its count of active tokens: the generalized JSD of ``jsd_loss`` over the
active tokens (``extract_active``), both sides divided by the temperature; in top-k mode the student's logits
gathered at the teacher's ids, both renormalized over the k. That is twinkle's GKDLoss, term for term
(docs/distillation.md), which twinkle-mem's heads compute from the LM head's input:

- :func:`compute_loss`: the student's output layer deferred for its one call (``output_layer.py``): it keeps its
  input, and the model returns a zero-width placeholder for the logits; the teacher's forward (another model, or
  the same one with its adapters disabled) gets its logits;
- :func:`jsd_loss`: for that placeholder, the active tokens' hidden states (ms-swift's own ``extract_active``,
  given the hidden states for the logits), then ``twinkle_mem.linear_gkd_full`` (a local teacher's full logits) or
  ``linear_gkd_topk`` (a top-k teacher), their sum divided by the count.

Left as ms-swift ships it, said once in the log: the SFT term (``sft_alpha > 0`` uses the model's own loss from its
logits), a caller that asks for the outputs (``return_outputs``), Liger's loss, a head that cannot be deferred, and
a full teacher whose vocabulary differs from the student's (ms-swift pads one to the other: its logits are then
computed from the kept input, as the layer would have).
"""
import functools
from contextvars import ContextVar
from typing import Optional

import torch

import twinkle_mem

from . import output_layer

WHERE = "GKDTrainer.compute_loss"

_CALL: ContextVar[Optional[output_layer.DeferredCall]] = ContextVar("twinkle_mem_swift_gkd_call", default=None)


def compute_loss(original, plan):

    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        why = _not_fused(self, return_outputs)
        head = None
        if not why:
            head, why = output_layer.fused_head(self.accelerator.unwrap_model(model))
        if head is None:
            output_layer.refused(WHERE, why)
            return original(self, model, inputs, return_outputs, num_items_in_batch)
        with output_layer.deferred(head, lambda hidden, layer: (hidden, layer)) as call:
            token = _CALL.set(call)
            try:
                loss = original(self, model, inputs, return_outputs, num_items_in_batch)
            finally:
                _CALL.reset(token)
        if call.result is not None:  # the student's head ran: its loss must have come from the kept input
            raise RuntimeError(f"twinkle-mem: {WHERE}: the student's output layer was deferred but no loss took its "
                               "input (ms-swift's GKD loss is not what twinkle-mem expects)")
        return loss

    return compute_loss


def _not_fused(trainer, return_outputs) -> str:
    if getattr(trainer, "use_liger_gkd_loss", False):
        return "Liger's GKD loss is in use"
    if getattr(trainer.args, "sft_alpha", 0) > 0:
        return f"sft_alpha={trainer.args.sft_alpha} adds the model's own loss from its logits"
    if return_outputs:
        return "the caller asks for the model's outputs"
    return ""


def jsd_loss(original, plan):

    @functools.wraps(original)
    def _compute_jsd_loss(self, student_logits, teacher_output, labels):
        call = _CALL.get()
        if call is None or not call.taken_by(student_logits):
            return original(self, student_logits, teacher_output, labels)
        (hidden, layer), call.result = call.result, None
        full = teacher_output.full_logits
        if not teacher_output.is_topk_mode and full is not None and full.shape[-1] != layer.weight.shape[0]:
            output_layer.refused(WHERE, f"the teacher's vocabulary ({full.shape[-1]}) is not the student's "
                                        f"({layer.weight.shape[0]})")
            return original(self, layer(hidden), teacher_output, labels)
        from swift.rlhf_trainers.gkd_loss import extract_active
        shifted = torch.roll(labels, shifts=-1, dims=1)
        teacher_output.labels = torch.roll(teacher_output.labels, shifts=-1, dims=1)
        if self.gkd_logits_topk is not None:
            teacher_output = teacher_output.to_topk(self.gkd_logits_topk)
        teacher_output.validate()
        rows, teacher, count = extract_active(hidden, teacher_output, shifted)  # the hidden states stand for the logits
        options = dict(bias=layer.bias, beta=self.beta, temperature=float(self.temperature))
        if teacher.is_topk_mode:
            per_token = twinkle_mem.linear_gkd_topk(rows, layer.weight, teacher.topk_indices, teacher.topk_logprobs,
                                                    **options)
        else:
            per_token = twinkle_mem.linear_gkd_full(rows, layer.weight, teacher.full_logits, **options)
        total = per_token.sum()
        return total * 0 if count == 0 else total / count

    return _compute_jsd_loss
