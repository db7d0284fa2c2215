"""How one twinkle model call is planned for the fused LM head, the same way on both twinkle paths
(``megatron_steps.py``, ``transformers_path.py``): the call, the layout, the model, the loss head.

1. the call (fused_eligibility.call_ineligible): twinkle's arguments and its loss;
2. its loss head (loss_heads.claiming: GKD, else the log-probs) and the head's layout checks (GKD: install()'s
   fused distillation on this path, packed batches, sequence / context parallelism);
3. the model: its output layers as the path finds them (Megatron's output layers, none off the last pipeline
   stage; transformers' lm_head);
4. the loss head's own inputs against the output layer's vocab (GKD: the teacher).

The first reason found is the call's refusal (logged at debug level: twinkle's own code runs). What differs
between the paths is only what they know, given as a :class:`FusedPath`.
"""
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, NamedTuple, Optional, Tuple

from . import distill_loss  # noqa: F401  (registers its loss head, GKD)
from . import fused_call, fused_eligibility, loss_heads, twinkle_names
from .settings import FUSED_CHUNK_BYTES

logger = logging.getLogger("twinkle_mem")


@dataclass
class FusedPath:
    """What a twinkle path knows about one call's model."""
    name: str  # "megatron" / "transformers" (install()'s plan.fused_distillation(name))
    output_layers: Callable[[], Tuple[List[Any], Optional[str]]]  # the layers to defer, or why not
    vocab: Callable[[List[Any]], Tuple[int, bool]]  # (the layers' whole vocab, under tensor parallelism)
    forward: Callable  # the deferred forward's maker (fused_call.megatron_forward / transformers_forward)
    labels_from_processor: bool = False  # FusedCall.labels_from_processor
    # After the model's layers were read, whether or not they can serve (Megatron: the chunk budget, judged on
    # every pipeline stage)
    checked: Callable[[List[Any]], None] = lambda layers: None
    accuracy_metrics: Callable[[], tuple] = tuple  # twinkle's Accuracy metrics a logits-free loss head counts
    around: Callable[[fused_call.FusedCall], ContextManager] = lambda call: contextlib.nullcontext()


class Planned(NamedTuple):
    call: Optional[fused_call.FusedCall]  # None: the call runs twinkle's own code
    layers: List[Any]
    reason: Optional[str]  # why not fused (None with no call: no output layer on this pipeline stage)


def plan_call(path: FusedPath, model, kwargs, loss, plan) -> Planned:
    """The fused call for one twinkle model call (its kwargs and loss, install()'s ``plan``), or why not."""
    reason = fused_eligibility.call_ineligible(kwargs, loss)
    head = loss_heads.claiming(kwargs, loss) if reason is None else None
    reason = reason or head.layout_ineligible(plan, path.name, model, kwargs)
    layers = []
    if reason is None:
        twinkle_names.lazy_wrap_model(model)  # twinkle's first step anyway: decide on the model as it will run
        layers, reason = path.output_layers()
        if reason is None and layers:
            reason = head.head_ineligible(kwargs, *path.vocab(layers))
        path.checked(layers)
    if reason is not None or not layers:
        if reason is not None:
            logger.debug("twinkle-mem fused LM head not used: %s", reason)
        return Planned(None, [], reason)
    call = fused_call.FusedCall.for_call(kwargs, loss, plan.value(FUSED_CHUNK_BYTES), head=head.for_call(path),
                                         labels_from_processor=path.labels_from_processor)
    return Planned(call, layers, None)


@contextlib.contextmanager
def fused(path: FusedPath, model, kwargs, loss, plan):
    """The planned fused call, its output layers deferred and its loss under its head's context for the
    enclosed call; None where the call runs twinkle's own code."""
    call, layers, _ = plan_call(path, model, kwargs, loss, plan)
    if call is None:
        yield None
        return
    with fused_call.deferred(layers, path.forward, call), path.around(call), call.head.loss_context(loss):
        yield call
