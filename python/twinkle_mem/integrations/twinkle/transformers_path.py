"""twinkle's ``TransformersModel.forward`` / ``forward_only`` with the fused LM head: for an eligible
call the ``lm_head`` is deferred (fused_head.py) and its result must be taken by twinkle's
``selective_log_softmax``."""
import contextlib
import functools
import logging
from typing import Optional

from . import distill_loss, fused_eligibility, fused_head
from ._model import loss_instance, optimizer_group

logger = logging.getLogger("twinkle_mem")


def transformers_model_forward(original, chunk_bytes: Optional[int]):

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if fused_head.current() is not None:  # forward called from within a fused call
            return original(self, *args, **kwargs)
        # forward_only computes no loss: a distillation call there would defer a head nothing reads
        train = original.__name__ == "forward"
        with _fused_transformers(self, {**kwargs, "forward_only": not train}, chunk_bytes) as call:
            out = original(self, *args, **kwargs)
            if call is not None:
                call.check_taken(f"TransformersModel.{original.__name__}")
        return out

    return forward


@contextlib.contextmanager
def _fused_transformers(model, kwargs, chunk_bytes):
    """The fused call for one TransformersModel.forward / forward_only, or None where it does not apply."""
    loss = loss_instance(model, kwargs)
    reason = fused_eligibility.call_ineligible(kwargs, loss)
    if reason is None:
        model._lazy_wrap_model()  # twinkle's first step anyway: decide on the model as it will run
        head, reason = fused_eligibility.transformers_lm_head(model.model, model.strategy.unwrap_model(model.model))
    distill = reason is None and distill_loss.is_gkd_call(kwargs, loss)
    if distill:
        reason = (distill_loss.layout_ineligible(model, optimizer_group(model, kwargs).processor)
                  or distill_loss.teacher_ineligible(kwargs, head.weight.shape[0], tensor_parallel=False))
    if reason is not None:
        logger.debug("twinkle-mem fused LM head not used: %s", reason)
        yield None
        return
    call = fused_head.FusedCall.for_call(kwargs, loss, chunk_bytes, labels_from_processor=True, distill=distill)
    with fused_head.deferred([head], fused_head.transformers_forward, call), \
            distill_loss.without_log_probs(loss) if distill else contextlib.nullcontext():
        yield call
