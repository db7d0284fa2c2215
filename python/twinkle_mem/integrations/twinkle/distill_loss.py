"""twinkle's GKD (distillation) loss on the fused LM head: the loss from the output layer's input.

This module owns when a twinkle call is a fused distillation call, and ``GKDLoss.__call__`` as
``install(fused_lm_head=True)`` patches it. For such a call (twinkle's ``GKDLoss`` itself, a top-k
teacher: ``teacher_topk_logprobs`` and ``teacher_topk_indices``, no ``teacher_logits``), the deferred
output layer (fused_head.py) returns a zero-width placeholder carrying its input and weight; twinkle's
forward step hands it to the loss as ``outputs['logits']``, and the patched ``GKDLoss.__call__`` computes
twinkle's generalized JSD with ``twinkle_mem.linear_gkd_topk`` (fp32; only the k teacher columns of the
student's logits, per row tile; under TP the vocab shards combined over the group). The logits never
exist, and twinkle's full-vocab ``selective_log_softmax``, whose result GKD does not use, is not run: the
loss reads ``require_logps = False`` during the call, so the call's ``logps`` are those of a loss without
log-probs (None). Every other call of ``GKDLoss`` runs twinkle's own code.
"""
import contextlib
from typing import Optional

from . import fused_head

def gkd_loss_class():
    from twinkle.loss.gkd import GKDLoss
    return GKDLoss


def is_topk_gkd_call(kwargs, loss) -> bool:
    """Whether a twinkle call is a GKD training step over a top-k teacher: twinkle's GKDLoss itself (not a
    subclass that may compute otherwise) with teacher_topk_logprobs and teacher_topk_indices, no
    teacher_logits, and a loss to compute (not forward_only)."""
    inner = getattr(loss, "_loss_instance", loss)  # twinkle's SafeLossWrapper
    return (type(inner) is gkd_loss_class() and kwargs.get("teacher_topk_logprobs") is not None
            and kwargs.get("teacher_topk_indices") is not None and kwargs.get("teacher_logits") is None
            and not kwargs.get("forward_only", False))


def layout_ineligible(model, processor) -> Optional[str]:
    """Why a distillation call's sequence layout cannot take the fused path, or None: the placeholder stands
    for the logits of the hidden states' own rows, which packed (padding-free) batches, Ulysses sequence
    parallelism (transformers) and context parallelism (Megatron) re-split or re-order after the head."""
    if getattr(processor, "padding_free", False):
        return "a distillation call on packed (padding-free) batches"
    if getattr(model, "_enable_sp", False):
        return "a distillation call under sequence parallelism (Ulysses)"
    try:
        from megatron.core import parallel_state as mpu
        if mpu.model_parallel_is_initialized() and mpu.get_context_parallel_world_size() > 1:
            return "a distillation call under context parallelism"
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None


@contextlib.contextmanager
def without_log_probs(loss):
    """``loss.require_logps`` False for the call: twinkle's forward step then runs no selective_log_softmax
    (and no in-place division of the placeholder); restored after."""
    had = "require_logps" in vars(loss)
    saved = vars(loss).get("require_logps")
    loss.require_logps = False
    try:
        yield
    finally:
        if had:
            loss.require_logps = saved
        else:
            del loss.require_logps


def gkd_call(original):
    """``GKDLoss.__call__``: twinkle's own unless ``outputs['logits']`` is a fused distillation placeholder."""

    def __call__(self, inputs, outputs, *, teacher_logits=None, teacher_topk_logprobs=None, teacher_topk_indices=None,
                 topk=None, **kwargs):
        logits = outputs.get("logits")
        head: Optional[fused_head.DeferredHead] = fused_head.deferred_head(logits)
        if head is None:
            if logits is not None and logits.shape[-1] == 0:  # a placeholder twinkle copied (unpacked) on its way
                raise RuntimeError("twinkle-mem fused LM head: GKDLoss got zero-width logits that are not the output "
                                   "layer's placeholder (packed sequences unpacked after the head?); the logits do "
                                   "not exist on the fused path. install(fused_lm_head=False) runs twinkle-kit "
                                   "unchanged.")
            return original(self, inputs, outputs, teacher_logits=teacher_logits,
                            teacher_topk_logprobs=teacher_topk_logprobs, teacher_topk_indices=teacher_topk_indices,
                            topk=topk, **kwargs)
        if teacher_logits is not None or teacher_topk_logprobs is None or teacher_topk_indices is None:
            raise RuntimeError("twinkle-mem fused LM head: GKDLoss got the output layer's placeholder without a top-k "
                               "teacher (teacher_topk_logprobs and teacher_topk_indices); the logits do not exist on "
                               "the fused path. install(fused_lm_head=False) runs twinkle-kit unchanged.")
        result = _fused_gkd(self, inputs["labels"], head, teacher_topk_indices, teacher_topk_logprobs)
        # The placeholder has served: twinkle keeps the step's outputs for its metrics (Accuracy takes the argmax
        # of outputs['logits'] at the next step), which must see no logits rather than a zero-width tensor.
        outputs["logits"] = None
        return result

    __call__.__wrapped__ = original
    return __call__


def _fused_gkd(loss, labels, head: fused_head.DeferredHead, teacher_ids, teacher_logprobs):
    from twinkle.data_format import LossOutput

    from twinkle_mem import gkd_average, linear_gkd_topk
    hidden = head.hidden  # [s, b, H] (Megatron) or [b, s, H]
    length = labels.shape[1]  # twinkle trims the teacher's sequence to the student's
    ids, logprobs = teacher_ids[:, :length].to(hidden.device), teacher_logprobs[:, :length].to(hidden.device)
    if head.seq_first:
        # The teacher and the labels go to the hidden states' [s, b] order, not the hidden states to theirs: the
        # gradient reaching Megatron's copy_to_tensor_model_parallel_region must be contiguous, as its backward
        # all-reduces `grad.contiguous()` and returns `grad` (a transposed gradient would stay this rank's part).
        labels, ids, logprobs = labels.t(), ids.transpose(0, 1), logprobs.transpose(0, 1)
    if tuple(hidden.shape[:2]) != tuple(labels.shape):
        raise RuntimeError(f"twinkle-mem fused LM head: the output layer's input {tuple(hidden.shape)} does not match "
                           f"the labels GKDLoss got (packed sequences?). install(fused_lm_head=False) runs twinkle-kit "
                           "unchanged.")
    # twinkle's forward step divides the student's logits by the call's temperature Tc before the loss, which
    # divides student and teacher by its own Tl: x / (Tc Tl) and lp / Tl = (lp Tc) / (Tc Tl), the teacher's
    # log-probs scaled in float64 and nothing done to the hidden states.
    if head.temperature != 1.0:
        logprobs = logprobs.double() * head.temperature
    per_token = linear_gkd_topk(hidden, head.weight, ids, logprobs, labels, beta=loss.beta,
                                temperature=loss.temperature * head.temperature, ignore_index=loss.ignore_index,
                                process_group=head.process_group)
    return LossOutput(loss=gkd_average(per_token, labels, loss.ignore_index), num_tokens=0)
