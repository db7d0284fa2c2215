"""Megatron-SWIFT's GRPO log-probs and entropy from the output layer's input (``megatron_fused_head``).

Megatron-SWIFT's GRPO calls its model for the vocab-parallel logits ``[b, s, V/TP]`` in two places:
``MegatronGRPOTrainer.forward_step`` (the loss's log-probs, and the entropy where it is logged or masks the loss)
and ``compute_per_token_logps_fn`` (the old and reference log-probs, without gradient). Each divides them by the
temperature in place and hands them to ``compute_logps_and_entropy_from_logits``, which takes the labels' log-probs
through Megatron's vocab-parallel cross entropy and the entropy from the shard's whole log-softmax.

Under install() each such call runs with the model's output layers deferred (:func:`deferred`): where a layer would
return this rank's vocab shard of the logits it keeps its input, mapped as the layer maps it (the sequence gathered
under sequence parallelism, the TP ranks' partial gradients summed in backward: twinkle's ``megatron_layer_input``),
and returns a zero-width placeholder. ``compute_logps_and_entropy_from_logits`` (``logits_path.py``) then takes the
labels' log-probs and the entropy from that input with ``twinkle_mem.linear_selective_log_softmax`` over the
layer's TP group (:meth:`MegatronCall.log_probs`), the temperature applied in fp32: the logits never exist. Labels
-100 (prompt, padding) cost no matmul and give logp 0, as ms-swift's mask does, and entropy 0 where ms-swift has a
value it never reads (its loss reads the entropy under the completion mask, the positions whose label is kept).

Which output layers may be deferred, and why not, are twinkle's Megatron checks (``megatron_output_layers``: a
plain bias-free ColumnParallelLinear of megatron-core's or mcore_bridge's GPTModel, nothing applied after it, no
multi-token prediction run with labels); a model whose layer cannot be deferred runs ms-swift's path, said once in
the log. A deferred input that ms-swift's log-prob function did not take, or an output layer run twice in one call,
raises.

GRPO never trains the entropy (Megatron-SWIFT logs it and masks the loss by its quantile): ``entropy_grad`` is left
to its default, so a frozen output layer (LoRA) sums only the log-probs' vectors in its forward.
"""
import contextlib
import functools
from contextvars import ContextVar
from types import MethodType
from typing import Optional

import torch

import twinkle_mem

from ..twinkle.fused_call import megatron_layer_input
from ..twinkle.fused_eligibility import megatron_output_layers
from . import output_layer
from .settings import FUSED_CHUNK_BYTES

IGNORE_INDEX = -100  # Megatron-SWIFT's labels of the positions without a loss
WHERE_STEP = "MegatronGRPOTrainer.forward_step"
WHERE_LOGPS = "compute_per_token_logps_fn"


class MegatronCall:
    """One model call with its output layers deferred: the deferred layer's input ``[s, b, H]``, weight and TP group,
    waiting for ms-swift's ``compute_logps_and_entropy_from_logits``, and the temperature its caller divides by."""

    def __init__(self, where: str, temperature: float, chunk_bytes: Optional[int]):
        self.where, self.temperature, self.chunk_bytes = where, float(temperature), chunk_bytes
        self.pending = None  # (hidden, weight, group, the grad mode)

    def defer(self, layer, input_, weight):
        """The deferred layer's forward: keep its input, return the placeholder ``[s, b, 0]`` for its logits."""
        if self.pending is not None:
            self.pending = None
            raise RuntimeError(f"twinkle-mem: {self.where}: the output layer ran twice before ms-swift's log-prob "
                               "function took its first input (multi-token prediction or a second head?)")
        hidden, group = megatron_layer_input(layer, input_)
        # (with the grad mode of the model call: ms-swift takes the old log-probs outside the no_grad of their forward)
        self.pending = (hidden, layer.weight if weight is None else weight, group, torch.is_grad_enabled())
        return hidden.new_empty((*hidden.shape[:2], 0))

    def takes(self, logits) -> bool:
        """Whether ``logits`` stand for the pending input: the placeholder as the model returns it, ``[b, s, 0]``."""
        if self.pending is None or logits.dim() != 3 or logits.shape[-1] != 0:
            return False
        hidden = self.pending[0]
        return tuple(logits.shape[:2]) == (hidden.shape[1], hidden.shape[0])

    def log_probs(self, labels, compute_entropy: bool):
        """ms-swift's (log-probs ``[b, s]``, entropy or None) for ``labels`` ``[b, s]``, from the pending input."""
        (hidden, weight, group, grad_mode), self.pending = self.pending, None
        with torch.set_grad_enabled(grad_mode):
            out = twinkle_mem.linear_selective_log_softmax(
                hidden, weight, labels.t(), compute_entropy, temperature=self.temperature, ignore_index=IGNORE_INDEX,
                chunk_bytes=self.chunk_bytes, process_group=group)
        logps, entropy = out if compute_entropy else (out, None)  # (in the hidden states' [s, b] order)
        return logps.t().contiguous(), None if entropy is None else entropy.t().contiguous()


_CALL: ContextVar[Optional[MegatronCall]] = ContextVar("twinkle_mem_swift_megatron_call", default=None)


def current_call(logits) -> Optional[MegatronCall]:
    """The deferred call ``logits`` stand for (None: they are logits, computed as ms-swift ships them)."""
    call = _CALL.get()
    return call if call is not None and call.takes(logits) else None


def _deferred_forward(call: MegatronCall):
    def forward(self, input_, weight=None, runtime_gather_output=None):
        if runtime_gather_output:  # (inference gathers the whole vocab: not a log-prob call)
            return type(self).forward(self, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return call.defer(self, input_, weight), None
    return forward


@contextlib.contextmanager
def deferred(model, where: str, temperature: float, chunk_bytes: Optional[int]):
    """The output layers of ``model`` (a model chunk; none off the last pipeline stage) deferred for the enclosed
    call, or left as they are where they cannot be (said once in the log)."""
    layers, why = megatron_output_layers(model)
    if why is not None:
        output_layer.refused(where, why)
    if why is not None or not layers:
        yield
        return
    call = MegatronCall(where, temperature, chunk_bytes)
    saved = [(layer, vars(layer).get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = MethodType(_deferred_forward(call), layer)
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)
        for layer, previous in saved:
            if previous is None:
                del layer.forward
            else:
                layer.forward = previous
    if call.pending is not None:
        raise RuntimeError(f"twinkle-mem: {where}: the output layer was deferred but ms-swift's "
                           "compute_logps_and_entropy_from_logits did not take its input (Megatron-SWIFT is not what "
                           "twinkle-mem expects)")


def forward_step(original, plan):
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def forward_step(self, data_iterator, model):
        with deferred(model, WHERE_STEP, self.temperature, chunk_bytes):
            return original(self, data_iterator, model)

    return forward_step


def per_token_logps(original, plan):
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def compute_per_token_logps_fn(model, args, data_iterator, temperature=1.0, no_grad=True,
                                   enable_routing_replay=False):
        with deferred(model, WHERE_LOGPS, temperature, chunk_bytes):
            return original(model, args, data_iterator, temperature, no_grad, enable_routing_replay)

    return compute_per_token_logps_fn
