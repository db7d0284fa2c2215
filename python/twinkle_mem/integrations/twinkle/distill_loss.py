"""twinkle's GKD (distillation) loss, ``GKDLoss.__call__`` as install() patches it: the loss in fp32 with its
math in float64, from the logits (``install()``) or from the output layer's input (``fused_lm_head=True``).

twinkle-kit computes GKDLoss's generalized JSD in the logits' dtype (bf16 in training: the divergence of a
student close to its teacher drowns in rounding), gathers global teacher ids from vocab shards under tensor
parallelism (wrong values), and for a local teacher's full logits keeps one autograd graph per 512-token
chunk (about 7 [N, V] at beta = 0.5). Here, for twinkle's GKDLoss itself (a subclass may compute otherwise):

- ``install()``, the student's logits at hand (``outputs['logits']``): a top-k teacher
  (``teacher_topk_logprobs`` / ``teacher_topk_indices``) goes to ``twinkle_mem.gkd_topk_from_logits`` (the
  logits read at the k ids only, O(N k) saved, the TP shards combined over twinkle's TP group); a local
  teacher's logits (``teacher_logits=``, with or without ``topk=``) to ``twinkle_mem.gkd_from_logits`` (no
  per-chunk graph; recomputed in backward), where student and teacher have one vocab; under TP a local
  teacher's ``topk=`` goes to ``gkd_topk_from_logits`` (its k largest logits, global ids).
- ``install(fused_lm_head=True)``, a distillation call: the deferred output layer (fused_call.py) returns a
  zero-width placeholder carrying its input and weight; twinkle's forward step hands it to the loss as
  ``outputs['logits']`` and the loss is computed from the hidden states: ``linear_gkd_topk`` for a top-k
  teacher (also a local teacher's ``topk=``: its k largest logits, the ids global under TP) and
  ``linear_gkd_full`` for a local teacher's whole vocab (TP = 1). The logits never exist, and twinkle's
  full-vocab ``selective_log_softmax``, whose result GKD does not use, is not run: the loss reads
  ``require_logps = False`` during the call, so the call's ``logps`` are those of a loss without log-probs
  (None).

Every other call (another loss, a teacher of another vocab or whose logits require grad, a whole-vocab
teacher under TP, no labels) runs twinkle's own code.
"""
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import fused_call, loss_heads, twinkle_names
from .settings import FUSED_LM_HEAD


def _is_gkd(loss) -> bool:
    return type(twinkle_names.unwrapped_loss(loss)) is twinkle_names.gkd_loss_class()


def _has_topk_teacher(kwargs) -> bool:
    # (GKDLoss uses these two over teacher_logits when both are given)
    return kwargs.get("teacher_topk_logprobs") is not None and kwargs.get("teacher_topk_indices") is not None


def is_gkd_call(kwargs, loss) -> bool:
    """Whether a twinkle call is a GKD training step: twinkle's GKDLoss itself with a teacher (top-k, or a
    local teacher's logits) and a loss to compute (not forward_only)."""
    return (_is_gkd(loss) and (_has_topk_teacher(kwargs) or kwargs.get("teacher_logits") is not None)
            and not kwargs.get("forward_only", False))


def teacher_ineligible(kwargs, vocab: int, tensor_parallel: bool) -> Optional[str]:
    """Why a distillation call's teacher cannot take the fused path (``vocab``: the student's whole vocab),
    or None."""
    if _has_topk_teacher(kwargs):
        return None
    return local_teacher_ineligible(kwargs["teacher_logits"], kwargs.get("topk"), vocab, tensor_parallel)


def local_teacher_ineligible(teacher, topk, vocab: int, tensor_parallel: bool) -> Optional[str]:
    """Why a local teacher's logits (``teacher_logits=``, ``topk=``) are left to twinkle's own code, or None."""
    if teacher.requires_grad:  # twinkle's loss would send it a gradient; the ops give the teacher none
        return "teacher_logits that require grad"
    if teacher.shape[-1] != vocab:  # twinkle pads the smaller side with the other's logits
        return f"a teacher of vocab {teacher.shape[-1]} for a student of vocab {vocab}"
    if topk is None and tensor_parallel:
        return "a whole-vocab teacher (teacher_logits=, no topk) under tensor parallelism"
    if topk is not None and not (isinstance(topk, int) and 1 <= topk <= vocab):
        return f"topk={topk!r} is not an int in [1, {vocab}]"
    return None


def layout_ineligible(model, processor) -> Optional[str]:
    """Why a distillation call's sequence layout cannot take the fused path, or None: the placeholder stands
    for the logits of the hidden states' own rows, which packed (padding-free) batches, Ulysses sequence
    parallelism (transformers) and context parallelism (Megatron) re-split or re-order after the head."""
    if twinkle_names.padding_free(processor):
        return "a distillation call on packed (padding-free) batches"
    if twinkle_names.sequence_parallel(model):
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


# A distillation call runs without twinkle's division of the logits by its temperature (it reads
# require_logps = False): the head must defer, never hand real logits to twinkle's GKD.
_CANNOT_DEFER = ("a distillation call's output layer was called where it cannot defer (no labels for the micro-batch, "
                 "its input not matching them, a gathered output or a model called with labels); refusing rather "
                 "than handing twinkle's GKD logits it would not divide by the call's temperature. "
                 "install(fused_lm_head=False) runs twinkle-kit unchanged.")


@loss_heads.register
class GKD(loss_heads.LossHead):
    """The loss head of a GKD training step (:func:`is_gkd_call`): the deferred output layer returns a placeholder
    carrying its input and weight (:class:`DeferredHead`), from which the patched ``GKDLoss.__call__`` computes
    the loss; twinkle's forward step computes no log-probs for the call (:func:`without_log_probs`)."""
    name = "GKD"
    hands_log_probs = False
    replaces_logits = True
    cannot_defer = _CANNOT_DEFER

    def __init__(self, accuracy: tuple = ()):
        self.accuracy = accuracy  # twinkle's Accuracy metrics of the step, counted by the loss (_count_accuracy)

    @classmethod
    def claims(cls, kwargs, loss) -> bool:
        return is_gkd_call(kwargs, loss)

    @classmethod
    def layout_ineligible(cls, plan, path: str, model, kwargs) -> Optional[str]:
        return plan.fused_distillation(path) or layout_ineligible(model, twinkle_names.call_processor(model, kwargs))

    @classmethod
    def head_ineligible(cls, kwargs, vocab: int, tensor_parallel: bool) -> Optional[str]:
        return teacher_ineligible(kwargs, vocab, tensor_parallel)

    @classmethod
    def for_call(cls, path) -> "GKD":
        return cls(path.accuracy_metrics())

    def output(self, call, hidden, weight, labels, process_group, seq_first: bool):
        placeholder = fused_call.make_placeholder(hidden)
        placeholder._twinkle_mem_head = DeferredHead(hidden, weight, process_group, seq_first, call.temperature,
                                                     self.accuracy)
        return placeholder

    def loss_context(self, loss):
        return without_log_probs(loss)


@dataclass
class DeferredHead:
    """What a distillation call's deferred output layer leaves on its placeholder: the logits are
    ``(hidden @ weight.T) / temperature`` (the layer has no bias; ``temperature`` is twinkle's call's,
    which its forward step would have divided the logits by), ``hidden`` [s, b, H] when ``seq_first``
    (Megatron) else [b, s, H]; ``weight`` this rank's vocab shard under ``process_group``. ``accuracy``: twinkle's
    ``Accuracy`` metrics of the step's status, which would have read the argmax of these logits."""
    hidden: torch.Tensor
    weight: torch.Tensor
    process_group: Optional[object]
    seq_first: bool
    temperature: float
    accuracy: tuple = ()


def deferred_head(logits) -> Optional[DeferredHead]:
    """The DeferredHead behind a distillation call's placeholder (or a view of it), else None."""
    for tensor in (logits, getattr(logits, "_base", None)):
        head = getattr(tensor, "_twinkle_mem_head", None)
        if head is not None:
            return head
    return None


@dataclass
class _Teacher:
    """A GKD call's teacher, trimmed to the student's ``length`` as twinkle trims it."""
    ids: Optional[torch.Tensor] = None  # top-k: [B, L, k] global ids and their log-probs
    logprobs: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None  # a local teacher: [B, L, V], and its topk (None: the whole vocab)
    topk: Optional[int] = None

    @classmethod
    def of_call(cls, teacher_logits, teacher_topk_logprobs, teacher_topk_indices, topk, length: int, device):
        if teacher_topk_logprobs is not None and teacher_topk_indices is not None:
            return cls(ids=teacher_topk_indices[:, :length].to(device),
                       logprobs=teacher_topk_logprobs[:, :length].to(device))
        return cls(logits=teacher_logits[:, :length].to(device), topk=topk)

    def top_k(self):
        """(ids, log-probs) of a top-k teacher; a local teacher's k largest logits stand for its log-probs (the
        renormalization over the k makes them the same)."""
        if self.ids is not None:
            return self.ids, self.logprobs
        values, ids = self.logits.topk(self.topk, dim=-1)  # twinkle's own selection (its ties, its order)
        return ids, values


def gkd_call(original, plan):
    """``GKDLoss.__call__``: from the placeholder on the fused path, from the logits where covered, else
    twinkle's own."""
    fused = plan.value(FUSED_LM_HEAD)
    twinkles_divergence = twinkle_names.gkd_divergence()  # (as installed over)
    # twinkle-kit 0.4.0 masks label -100 whatever the loss's ignore_index: calls with another are left to it
    masks_ignore_index = plan.feature(twinkle_names.GKD_IGNORE_INDEX)

    def __call__(self, inputs, outputs, *, teacher_logits=None, teacher_topk_logprobs=None, teacher_topk_indices=None,
                 topk=None, **kwargs):
        logits, labels = outputs.get("logits"), inputs.get("labels")
        teacher = dict(teacher_logits=teacher_logits, teacher_topk_logprobs=teacher_topk_logprobs,
                       teacher_topk_indices=teacher_topk_indices, topk=topk)
        head: Optional[DeferredHead] = deferred_head(logits) if fused else None
        if head is not None:
            result = _fused_gkd(self, labels, head, teacher)
            # The placeholder has served: twinkle keeps the step's outputs for its metrics, which must see no logits,
            # not a zero-width tensor. Its Accuracy, which takes the argmax of outputs['logits'] at the next step,
            # counts the step now from their argmax over vocab blocks (install()'s logits drop also counts it then).
            _count_accuracy(head, inputs, labels)
            outputs["logits"] = None
            return result
        if fused and logits is not None and logits.shape[-1] == 0:  # a placeholder twinkle copied on its way
            raise RuntimeError("twinkle-mem fused LM head: GKDLoss got zero-width logits that are not the output "
                               "layer's placeholder (packed sequences unpacked after the head?); the logits do "
                               "not exist on the fused path. install(fused_lm_head=False) runs twinkle-kit "
                               "unchanged.")
        # (a class whose divergence is not twinkle-kit's own, a subclass's or one replaced since, computes its own)
        if logits is not None and labels is not None and type(self)._generalized_jsd_loss is twinkles_divergence \
                and (masks_ignore_index or self.ignore_index == fused_call.IGNORE_INDEX):
            result = _gkd_from_logits(self, labels, logits, teacher)
            if result is not None:
                return result
        return original(self, inputs, outputs, **teacher, **kwargs)

    __call__.__wrapped__ = original
    return __call__


class _ArgmaxOnly:
    """A step's logits as twinkle's ``Accuracy`` reads them, ``logits.argmax(dim=-1)``, where the fused head never
    made them: their argmax at the rows Accuracy counts (-1 elsewhere)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def argmax(self, dim=-1):
        if dim != -1:
            raise RuntimeError("twinkle-mem fused LM head: only the argmax over the vocab of the step's logits exists")
        return self.ids


def _count_accuracy(head: DeferredHead, inputs, labels) -> None:
    """Give each of the step's Accuracy metrics its count, from ``linear_argmax`` at the rows it counts (its
    ``completion_mask``, else the labelled rows): no logits-sized memory."""
    if not head.accuracy:
        return
    from twinkle_mem.heads.argmax import linear_argmax
    rows = labels != -100
    mask = inputs.get("completion_mask")
    if mask is not None and torch.as_tensor(mask).shape == rows.shape:
        rows = rows | torch.as_tensor(mask, device=rows.device).bool()
    hidden = head.hidden.transpose(0, 1) if head.seq_first else head.hidden
    ids = linear_argmax(hidden.detach(), head.weight.detach(), rows, temperature=head.temperature,
                        process_group=head.process_group)
    for metric in head.accuracy:
        metric.accumulate(inputs, dict(logits=_ArgmaxOnly(ids)))


def _gkd_from_logits(loss, labels, logits, teacher_kwargs):
    """GKDLoss from the student's logits (the call covered), or None (twinkle's own code runs)."""
    from twinkle_mem import gkd_average, gkd_from_logits, gkd_topk_from_logits
    group = twinkle_names.tensor_parallel_group()  # the logits are this rank's vocab shard under Megatron's TP
    if not _has_topk_teacher(teacher_kwargs) and (
            teacher_kwargs["teacher_logits"] is None  # (half a top-k teacher: twinkle's own assertion)
            or local_teacher_ineligible(teacher_kwargs["teacher_logits"], teacher_kwargs["topk"],
                                        logits.shape[-1] * (1 if group is None else dist.get_world_size(group)),
                                        group is not None)):
        return None
    if logits.shape[1] != labels.shape[1]:  # twinkle: "some MLLMs return extra prefix logits"
        logits = logits[:, -labels.shape[1]:]
    teacher = _Teacher.of_call(**teacher_kwargs, length=logits.shape[1], device=logits.device)
    options = dict(beta=loss.beta, temperature=loss.temperature, ignore_index=loss.ignore_index)
    if teacher.logits is not None and teacher.logits.shape[:-1] != logits.shape[:-1]:
        return None  # (a teacher shorter than the student)
    if teacher.ids is not None or group is not None:  # (under TP: a local teacher's top k, its ids global)
        ids, logprobs = teacher.top_k()
        per_token = gkd_topk_from_logits(logits, ids, logprobs, labels, process_group=group, **options)
    else:
        per_token = gkd_from_logits(logits, teacher.logits, labels, topk=teacher.topk, **options)
    return twinkle_names.loss_output(gkd_average(per_token, labels, loss.ignore_index))


def _fused_gkd(loss, labels, head: DeferredHead, teacher_kwargs):
    from twinkle_mem import gkd_average, linear_gkd_full, linear_gkd_topk
    if teacher_kwargs["teacher_logits"] is None and not _has_topk_teacher(teacher_kwargs):
        raise RuntimeError("twinkle-mem fused LM head: GKDLoss got the output layer's placeholder without a teacher "
                           "(teacher_topk_logprobs and teacher_topk_indices, or teacher_logits); the logits do not "
                           "exist on the fused path. install(fused_lm_head=False) runs twinkle-kit unchanged.")
    hidden = head.hidden  # [s, b, H] (Megatron) or [b, s, H]
    teacher = _Teacher.of_call(**teacher_kwargs, length=labels.shape[1], device=hidden.device)
    whole_vocab = teacher.logits is not None and teacher.topk is None
    if head.seq_first and whole_vocab:
        # (the hidden states to the teacher's [b, s] order: a copy of [N, H] rather than of the teacher's [N, V];
        # TP = 1 here, where Megatron's copy_to_tensor_model_parallel_region does nothing in backward)
        hidden = hidden.transpose(0, 1)
    elif head.seq_first:
        # The teacher and the labels go to the hidden states' [s, b] order, not the hidden states to theirs: the
        # gradient reaching Megatron's copy_to_tensor_model_parallel_region must be contiguous, as its backward
        # all-reduces `grad.contiguous()` and returns `grad` (a transposed gradient would stay this rank's part).
        labels = labels.t()
    if tuple(hidden.shape[:2]) != tuple(labels.shape):
        raise RuntimeError(f"twinkle-mem fused LM head: the output layer's input {tuple(hidden.shape)} does not match "
                           f"the labels GKDLoss got (packed sequences?). install(fused_lm_head=False) runs twinkle-kit "
                           "unchanged.")
    # twinkle's forward step divides the student's logits by the call's temperature Tc before the loss, which
    # divides student and teacher by its own Tl: x / (Tc Tl) and t / Tl; nothing is done to the hidden states.
    # (the loss GKDLoss returns is trained: a frozen head sums dL/dhidden in the forward)
    options = dict(beta=loss.beta, temperature=loss.temperature * head.temperature,
                   teacher_temperature=loss.temperature, ignore_index=loss.ignore_index, loss_grad=True)
    if whole_vocab:
        per_token = linear_gkd_full(hidden, head.weight, teacher.logits, labels, **options)
    else:
        ids, logprobs = teacher.top_k()
        if head.seq_first:
            ids, logprobs = ids.transpose(0, 1), logprobs.transpose(0, 1)
        per_token = linear_gkd_topk(hidden, head.weight, ids, logprobs, labels, process_group=head.process_group,
                                    **options)
    return twinkle_names.loss_output(gkd_average(per_token, labels, loss.ignore_index))
