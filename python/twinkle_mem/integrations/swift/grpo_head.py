"""GRPO's log-probs and entropy from the LM head's input (``grpo_fused_head``).

ms-swift's ``GRPOTrainer._get_logps_via_local_forward`` (every GRPO log-prob outside sequence parallelism: old,
reference and the loss's own, padded and padding-free) calls the model for its logits ``[B, T, V]``, keeps the
positions ``[-(logits_to_keep + 1):-1]``, divides them by the temperature in place and calls TRL's
``selective_log_softmax`` on ``input_ids[:, -logits_to_keep:]`` (and ``entropy_from_logits``). Under install() the
same call runs with the model's output layer deferred (``output_layer.py``): from the layer's input at those
positions, ``twinkle_mem.linear_selective_log_softmax`` gives the fp32 log-probs (and entropy) of the same ids, the
temperature applied in fp32, the logits never built. A padding-free batch (``[1, nnz]``) is the same rows.

Under sequence parallelism ``_get_logps_via_sp`` calls the model on this rank's part of the sequence, divides its
logits by the temperature (a new tensor) and calls ``selective_log_softmax`` (and ``entropy_from_logits``) on every
position of that part, then gathers the log-probs across the ranks (``GatherLoss``) and keeps the completion's. Under
install() that call runs with the head deferred: the divided placeholder, zero-width, reaches the functions ms-swift
bound in its module (``logits_path.py``), which take the log-probs (and entropy) of those labels from the kept
input (:class:`SequenceParallelCall`); ms-swift's gather and slicing run as shipped.

GRPO never trains the entropy (ms-swift logs it and masks by its quantile): it is computed with
``entropy_grad=False``, so a frozen head (LoRA) sums no vector for it. A model whose head cannot be deferred
(``output_layer.fused_head``) runs ms-swift's path, said once in the log.
"""
import functools
from contextvars import ContextVar
from typing import Optional

import twinkle_mem

from . import output_layer
from .settings import FUSED_CHUNK_BYTES

WHERE = "GRPOTrainer._get_logps_via_local_forward"
WHERE_SP = "GRPOTrainer._get_logps_via_sp"


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


class SequenceParallelCall:
    """One ``_get_logps_via_sp`` call with the head deferred: the head's kept input, and the entropy computed with the
    log-probs for ``entropy_from_logits`` to hand back."""

    def __init__(self, call: output_layer.DeferredCall, temperature: float, with_entropy: bool, chunk_bytes):
        self.call, self.temperature, self.with_entropy, self.chunk_bytes = call, temperature, with_entropy, chunk_bytes
        self.entropy = None

    def takes(self, logits) -> bool:
        """Whether ``logits`` stand for the deferred head's result: the zero-width placeholder divided by T."""
        placeholder = self.call.placeholder
        return placeholder is not None and logits.shape == placeholder.shape

    def log_probs(self, labels):
        hidden, layer = self.call.result
        out = twinkle_mem.linear_selective_log_softmax(
            hidden, layer.weight, labels, self.with_entropy, bias=layer.bias, temperature=self.temperature,
            chunk_bytes=self.chunk_bytes, entropy_grad=False)
        logps, self.entropy = out if self.with_entropy else (out, None)
        return logps

    def take_entropy(self):
        if self.entropy is None:
            raise RuntimeError(f"twinkle-mem: {WHERE_SP} asked for the entropy of a deferred head before its "
                               "log-probs (ms-swift's sequence-parallel path is not what twinkle-mem expects)")
        return self.entropy


_SP_CALL: ContextVar[Optional[SequenceParallelCall]] = ContextVar("twinkle_mem_swift_sp_call", default=None)


def sequence_parallel_call(logits) -> Optional[SequenceParallelCall]:
    """The sequence-parallel call ``logits`` belong to (None: they are logits, computed as shipped or on the op)."""
    call = _SP_CALL.get()
    return call if call is not None and call.takes(logits) else None


def sequence_parallel_forward(original, plan):
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def _get_logps_via_sp(self, model, model_inputs, grpo_batch, logits_to_keep, input_ids, compute_entropy=False):
        head, why = output_layer.fused_head(self.accelerator.unwrap_model(model))
        if head is None:
            output_layer.refused(WHERE_SP, why)
            return original(self, model, model_inputs, grpo_batch, logits_to_keep, input_ids, compute_entropy)
        with output_layer.deferred(head, lambda hidden, layer: (hidden, layer)) as call:
            token = _SP_CALL.set(SequenceParallelCall(call, float(self.temperature), compute_entropy, chunk_bytes))
            try:
                return original(self, model, model_inputs, grpo_batch, logits_to_keep, input_ids, compute_entropy)
            finally:
                _SP_CALL.reset(token)

    return _get_logps_via_sp
