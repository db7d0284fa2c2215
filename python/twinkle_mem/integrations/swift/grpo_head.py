"""GRPO's log-probs and entropy from the LM head's input (``grpo_fused_head``).

ms-swift's ``GRPOTrainer._get_logps_via_local_forward`` (every GRPO log-prob outside sequence parallelism: old,
reference and the loss's own, padded and padding-free) calls the model for its logits ``[B, T, V]``, keeps the
positions ``[-(logits_to_keep + 1):-1]``, divides them by the temperature in place and calls TRL's
``selective_log_softmax`` on ``input_ids[:, -logits_to_keep:]`` (and ``entropy_from_logits``). Under install() the
same call runs with the model's output layer deferred (``output_layer.py``): from the layer's input at those
positions, ``twinkle_mem.linear_selective_log_softmax`` gives the fp32 log-probs (and entropy) of the same ids, the
temperature applied in fp32, the logits never built. A padding-free batch (``[1, nnz]``) is the same rows.

GRPO never trains the entropy (ms-swift logs it and masks by its quantile): it is computed with
``entropy_grad=False``, so a frozen head (LoRA) sums no vector for it. A model whose head cannot be deferred
(``output_layer.fused_head``) runs ms-swift's path, said once in the log.
"""
import functools

import twinkle_mem

from . import output_layer
from .settings import FUSED_CHUNK_BYTES

WHERE = "GRPOTrainer._get_logps_via_local_forward"


def local_forward(original, plan):
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def _get_logps_via_local_forward(self, model, model_inputs, logits_to_keep, input_ids, compute_entropy=False):
        head, why = output_layer.fused_head(self.accelerator.unwrap_model(model))
        if head is None:
            output_layer.refused(WHERE, why)
            return original(self, model, model_inputs, logits_to_keep, input_ids, compute_entropy)
        if "use_cache" in self.model_kwarg_keys:
            model_inputs["use_cache"] = False
        if "logits_to_keep" in self.model_kwarg_keys:
            model_inputs["logits_to_keep"] = logits_to_keep + 1
        labels = input_ids[:, -logits_to_keep:]

        def log_probs(hidden, layer):
            rows = hidden[:, -(logits_to_keep + 1):-1]  # the positions that predict `labels`
            out = twinkle_mem.linear_selective_log_softmax(
                rows, layer.weight, labels, compute_entropy, bias=layer.bias, temperature=float(self.temperature),
                chunk_bytes=chunk_bytes, entropy_grad=False)
            return out if compute_entropy else (out, None)

        with output_layer.deferred(head, log_probs) as call:
            logits = model(**model_inputs).logits
        if not call.taken_by(logits):
            output_layer.refused(WHERE, "the model applies something to its output layer's result")
            return original(self, model, model_inputs, logits_to_keep, input_ids, compute_entropy)
        return call.result

    return _get_logps_via_local_forward
