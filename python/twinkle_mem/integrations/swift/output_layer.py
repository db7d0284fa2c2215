"""The LM head of one ms-swift model call, deferred: where it would return the logits ``[..., V]`` it hands its input
to twinkle-mem (``compute(hidden, head)``, kept as the call's result) and returns a zero-width placeholder
``[..., 0]``. The deferral holds for one call of the head: the next call (a teacher's forward through the same model
with its adapters disabled) gets its logits.

:func:`fused_head` decides whether a model's head may be deferred at all, and says why not: the output layer must be
a plain ``torch.nn.Linear`` (so its input and weight define the logits: not a LoRA-wrapped or quantized layer), its
weight whole in this process (not an FSDP DTensor shard nor a DeepSpeed ZeRO-3 partition, no FSDP unit in the
model: its parameters are whole only inside their modules' own forward and backward), the model's config must
apply nothing to the logits after the layer (logit soft-capping, logit scaling) and the model must have no value
head. A model that transforms the placeholder anyway (a cast, a scaling ms-swift's tables do not name) is caught
after the call: its output's ``logits`` are not the placeholder itself (:meth:`DeferredCall.taken_by`).
"""
import contextlib
import logging
from typing import Any, Callable, Optional, Tuple

import torch

logger = logging.getLogger("twinkle_mem.swift")

# Config attributes of models that apply something to the logits after the output layer (transformers' names)
LOGITS_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_head(model: torch.nn.Module) -> Tuple[Optional[torch.nn.Linear], str]:
    """(the output layer of ``model`` the fused heads may stand in for, None) or (None, why not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None, "the model has no output embeddings (get_output_embeddings)"
    if type(head) is not torch.nn.Linear:
        return None, (f"the output layer is a {type(head).__module__}.{type(head).__qualname__}, not a plain "
                      "torch.nn.Linear (adapters or quantization on lm_head)")
    if hasattr(model, "v_head") or hasattr(getattr(model, "pretrained_model", None), "v_head"):
        return None, "the model has a value head (its output is used beyond the log-probs)"
    config = getattr(model, "config", None)
    for name in LOGITS_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 0, 1, 1.0):
            return None, f"the model's config sets {name}={value!r}: its logits are not the output layer's"
    weight = head.weight
    if type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor" or hasattr(weight, "ds_id"):
        return None, "the output layer's weight is sharded (FSDP / DeepSpeed ZeRO-3)"
    if any(_fsdp(m) for m in model.modules()):
        return None, ("the model is sharded by FSDP: its parameters are whole only inside their modules' own forward "
                      "and backward, where the fused head would not read them")
    return head, ""


def _fsdp(module) -> bool:
    """A module FSDP wraps: FSDP1's FullyShardedDataParallel, or FSDP2's (fully_shard makes its class an FSDPModule)."""
    return any(cls.__name__ in ("FullyShardedDataParallel", "FSDPModule") for cls in type(module).__mro__)


class DeferredCall:
    """One deferred call of an output layer: its placeholder and what ``compute`` returned for it."""

    def __init__(self):
        self.placeholder: Optional[torch.Tensor] = None
        self.result: Any = None

    def taken_by(self, logits) -> bool:
        """Whether the model's output ``logits`` are the placeholder itself: nothing was applied after the layer."""
        return self.placeholder is not None and logits is self.placeholder


@contextlib.contextmanager
def deferred(head: torch.nn.Linear, compute: Callable[[torch.Tensor, torch.nn.Linear], Any]):
    """Defer the next call of ``head`` inside the block (an instance ``forward``: hooks still run around it)."""
    call = DeferredCall()

    def forward(hidden):
        del head.forward  # one call only
        call.result = compute(hidden, head)
        call.placeholder = hidden.new_empty((*hidden.shape[:-1], 0))
        return call.placeholder

    head.forward = forward
    try:
        yield call
    finally:
        vars(head).pop("forward", None)


_warned = set()


def refused(where: str, why: str) -> None:
    """Say once per process and reason that ``where`` runs as ms-swift ships it."""
    if (where, why) not in _warned:
        _warned.add((where, why))
        logger.warning("twinkle-mem: %s runs as ms-swift ships it (the logits built): %s", where, why)
