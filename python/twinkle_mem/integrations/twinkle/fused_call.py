"""One fused twinkle model call: the output layer deferred, the fused heads computed from its input.

This module owns the per-call state (:class:`FusedCall`: only its methods and this module's
functions change it) and the deferred output layers, which return what the call's loss head
(``loss_heads.py``; planned in ``fused_call_plan.py``) makes of the layer's input: below, the log-probs head.

For one eligible model call (``MegatronModel.forward_backward`` / ``forward_only``,
``TransformersModel.forward`` / ``forward_only``), the model's output layer
(Megatron's ``output_layer``, transformers' ``lm_head``) is given a deferred
``forward`` for that call only. Where it would return the logits ``[..., V]``
of a micro-batch, it computes the log-probs (and entropy) of that micro-batch's
labels with ``twinkle_mem.linear_selective_log_softmax`` from its own input and
weight, and returns a zero-width placeholder ``[..., 0]`` instead. twinkle then
calls ``selective_log_softmax(placeholder, masked_labels)``; the installed
adapter (``integrations/twinkle/patches.py``) calls :func:`take` there, which hands back
the results computed for that placeholder. The logits never exist.

What makes this the same computation as twinkle's:
- the layer is the plain bias-free linear (exact class), so its input and
  weight define the logits; the temperature is passed to the op, which divides
  the logits in-register, as twinkle's ``logits.div_(T)`` did;
- :func:`take` accepts only the placeholder itself or a view of it (so nothing
  was applied between the layer and twinkle's call: no soft-capping or scaling
  slipped through), and only with twinkle's masked labels of the very labels
  the op used;
- labels equal to -100 are ignored by the op: prompt rows cost no matmul and
  get logp 0 and entropy 0, where twinkle gave the values at token 0; GRPOLoss
  and its metrics read them only under the loss mask (labels != -100).

Failures are loud: a deferred result that twinkle does not take, a placeholder
reaching anything but :func:`take` (e.g. a loss that falls back to computing
from ``outputs['logits']``), or labels that do not match, raise RuntimeError.
Zero-width logits cannot yield a loss silently.
"""
import contextlib
import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass
from types import MethodType
from typing import Iterator, Optional, Tuple

import torch

from . import loss_heads

IGNORE_INDEX = -100  # twinkle's forward steps mask labels with this value, whatever the loss says


@dataclass
class _Deferred:
    placeholder: torch.Tensor
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    labels: torch.Tensor
    # Handed again to a loss that computes its log-probs from outputs['logits'] because twinkle lost
    # them (TWINKLE_FAIL_FAST=0): it may ask for the log-probs alone.
    loss_fallback: bool = False


NOT_TAKEN = ("the output layer's log-probs were computed but twinkle did not ask for them; its logits (a zero-width "
             "placeholder) must not reach a loss")


class FusedCall:
    """State of one eligible model call: what the deferred heads compute with, and the
    result waiting for twinkle's ``selective_log_softmax``."""

    def __init__(self, temperature: float, with_entropy: bool, chunk_bytes: Optional[int],
                 labels_from_processor: bool = False, head: Optional[loss_heads.LossHead] = None):
        self.temperature = temperature
        # What the deferred output layer computes for the call's loss (loss_heads.py): the log-probs by default
        self.head = loss_heads.LogProbs() if head is None else head
        self.with_entropy = with_entropy
        self.chunk_bytes = chunk_bytes
        self.labels_from_processor = labels_from_processor  # else set per micro-batch by the step hooks
        self.labels: Optional[torch.Tensor] = None  # the micro-batch's labels, IGNORE_INDEX where ignored
        self.pending: Optional[_Deferred] = None
        self.taken: Optional[_Deferred] = None  # the last result handed to twinkle
        self.refused: Optional[str] = None  # why take()/defer() last refused (twinkle may catch the error)
        self.model_has_labels = False  # an MTP model called with labels (mtp_called_without_labels)
        self.deferred = 0  # results computed by deferred heads

    # --- the step hooks' view of one micro-batch (megatron_steps.py, mask_skip.py) -------------------
    def set_labels(self, labels: Optional[torch.Tensor]) -> None:
        """The labels of the micro-batch the next deferred head computes for (None between micro-batches)."""
        self.labels = labels

    def start_micro_batch(self) -> int:
        """Before twinkle's forward step of a micro-batch: forget what the previous micro-batch's loss
        left (a refusal, or the result a re-armed loss took again); returns the count of deferred
        results so far."""
        self.refused = self.taken = None
        return self.deferred

    def finish_micro_batch(self) -> Tuple[Optional[str], Optional["_Deferred"], Optional["_Deferred"]]:
        """After the forward step of a micro-batch that went through a deferred head: hand over
        (why it was refused, the result twinkle did not take, the result it took), and clear them."""
        out = (self.refused, self.pending, self.taken)
        self.refused = self.pending = self.taken = None
        return out

    @classmethod
    def for_call(cls, kwargs, loss, chunk_bytes: Optional[int], labels_from_processor: bool = False,
                 head: Optional[loss_heads.LossHead] = None) -> "FusedCall":
        """The call state for a twinkle call's kwargs (its temperature) and loss (its require_entropy)."""
        return cls(float(kwargs.get("temperature", 1.0)), bool(getattr(loss, "require_entropy", False)), chunk_bytes,
                   labels_from_processor=labels_from_processor, head=head)

    def compute(self, hidden, weight, labels, process_group=None):
        from twinkle_mem import linear_selective_log_softmax
        # (twinkle asks for the entropy where its loss trains it: require_entropy = entropy_coef > 0; a frozen head
        # then sums its vector in the forward)
        out = linear_selective_log_softmax(hidden, weight, labels, self.with_entropy, temperature=self.temperature,
                                           ignore_index=IGNORE_INDEX, chunk_bytes=self.chunk_bytes,
                                           process_group=process_group, entropy_grad=self.with_entropy or None)
        return out if self.with_entropy else (out, None)

    def defer(self, logp, entropy, hidden) -> torch.Tensor:
        """Keep (logp, entropy) for twinkle's call; return the placeholder standing for the logits."""
        if self.pending is not None:
            self.pending = None
            raise self.refuse("the output layer ran twice before twinkle computed the log-probs of the first call "
                              "(multi-token prediction or a second head?); refusing to go on. "
                              "install(fused_lm_head=False) runs twinkle-kit unchanged.")
        placeholder = make_placeholder(hidden)
        self.pending = _Deferred(placeholder, logp, entropy, self.labels)
        self.deferred += 1
        return placeholder

    def refuse(self, message: str) -> RuntimeError:
        """The error for a refusal, remembered: twinkle's TWINKLE_FAIL_FAST=0 catch may swallow it."""
        self.refused = message
        return RuntimeError(f"twinkle-mem fused LM head: {message}")

    def rearmed(self, loss_func, result: "_Deferred"):
        """``loss_func`` with ``result`` pending while it runs: twinkle lost a micro-batch's log-probs
        after computing them (``TWINKLE_FAIL_FAST=0``), and its loss then computes them from
        ``outputs['logits']`` (the placeholder), as it would from the logits unfused."""

        def loss_func_with_result(*args, **kwargs):
            self.pending = dataclasses.replace(result, loss_fallback=True)
            try:
                return loss_func(*args, **kwargs)
            finally:
                self.pending = None

        return loss_func_with_result

    def check_taken(self, where: str) -> None:
        """Raise if a deferred result was not taken by twinkle's ``selective_log_softmax``."""
        if self.pending is not None:
            self.pending = None
            raise RuntimeError(f"twinkle-mem fused LM head: {where}: {NOT_TAKEN}. install(fused_lm_head=False) runs "
                               "twinkle-kit unchanged.")


def make_placeholder(hidden) -> torch.Tensor:
    """The zero-width tensor a deferred head returns for the logits. fp32, so that Float16Module's upcast and
    a model's own `.float()` return it unchanged; in the graph of the hidden states, so that a zero loss made
    from it (twinkle's SafeLossWrapper after an error) still sends a gradient back through the pipeline."""
    return hidden[..., :0].to(torch.float32) * 1.0


_CALL: ContextVar[Optional[FusedCall]] = ContextVar("twinkle_mem_fused_call", default=None)


def current() -> Optional[FusedCall]:
    """The fused model call in progress, if any."""
    return _CALL.get()


def take(logits: torch.Tensor, index: torch.Tensor, return_entropy: bool):
    """twinkle's ``selective_log_softmax(logits, index, return_entropy)`` on a deferred head's
    placeholder: the log-probs (and entropy) computed for it. Raises for anything else."""
    call = _CALL.get()
    pending = call.pending if call is not None else None
    if pending is None or not (logits is pending.placeholder or logits._base is pending.placeholder):
        message = (f"selective_log_softmax got logits of shape {tuple(logits.shape)} (zero width) that are not the "
                   "output layer's pending placeholder: something transformed the output layer's result, or a loss "
                   "is computing from outputs['logits'] after the log-probs were lost. The logits do not exist on "
                   "the fused path. install(fused_lm_head=False) runs twinkle-kit unchanged.")
        if call is None:
            raise RuntimeError(f"twinkle-mem fused LM head: {message}")
        raise call.refuse(message)
    masked = pending.labels.masked_fill(pending.labels == IGNORE_INDEX, 0)
    if index.shape != masked.shape or not torch.equal(index.to(masked.dtype), masked):
        call.pending = None
        raise call.refuse(f"twinkle asked for the log-probs of labels {tuple(index.shape)} that are not the "
                          f"micro-batch's labels {tuple(masked.shape)} with -100 masked to 0")
    if bool(return_entropy) != (pending.entropy is not None) and not (pending.loss_fallback and not return_entropy):
        call.pending = None
        raise call.refuse(f"entropy {'asked for' if return_entropy else 'not asked for'} but the loss's "
                          "require_entropy said otherwise")
    call.pending = None
    call.taken = pending
    return (pending.logp, pending.entropy) if return_entropy else pending.logp


# --- multi-token prediction models -----------------------------------------------


@contextlib.contextmanager
def mtp_called_without_labels(model_chunks, call: FusedCall) -> Iterator[None]:
    """Keep the fused head to model calls without labels on models with multi-token prediction.

    mcore_bridge's GPTModel runs its MTP head (and the output layer once more per MTP layer) only when
    called with labels; twinkle's forward step pops them, so there the output layer runs once per
    micro-batch. A call with labels (not twinkle's) runs unchanged: the deferred forward steps aside.
    """
    from .twinkle_names import post_process_owner
    handles = []

    def before(module, args, kwargs):
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        call.model_has_labels = labels is not None

    def after(module, args, kwargs, output):
        call.model_has_labels = False

    try:
        for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
            owner = post_process_owner(chunk)
            if owner is not None and getattr(owner.config, "mtp_num_layers", None):
                handles.append(owner.register_forward_pre_hook(before, with_kwargs=True))
                handles.append(owner.register_forward_hook(after, with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        call.model_has_labels = False


# --- deferred output layers -------------------------------------------------------


@contextlib.contextmanager
def deferred(layers, make_forward, call: FusedCall) -> Iterator[FusedCall]:
    """Give each layer the deferred forward for the enclosed call; restore them after."""
    saved = []
    try:
        for layer in layers:
            saved.append((layer, layer.__dict__.get("forward")))
            layer.forward = MethodType(make_forward(layer.forward), layer)
        token = _CALL.set(call)
        try:
            yield call
        finally:
            _CALL.reset(token)
    finally:
        for layer, previous in reversed(saved):
            if previous is None:
                del layer.forward
            else:
                layer.forward = previous


def megatron_forward(original):
    """ColumnParallelLinear.forward, deferred: (placeholder [s, b, 0], None) for a micro-batch with labels."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        call = _CALL.get()
        if call is None or call.labels is None or runtime_gather_output or call.model_has_labels:
            if call is not None and call.head.cannot_defer is not None:
                raise call.refuse(call.head.cannot_defer)
            return original(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        weight = self.weight if weight is None else weight
        hidden, group = megatron_layer_input(self, input_)
        labels = call.labels  # [b, s]; the hidden states are [s, b, H]
        if tuple(hidden.shape[:2]) != tuple(labels.shape[::-1]):
            raise RuntimeError(f"twinkle-mem fused LM head: output layer input {tuple(hidden.shape)} does not match "
                               f"the micro-batch's labels {tuple(labels.shape)}")
        return call.head.output(call, hidden, weight, labels, group, seq_first=True), None

    return forward


def megatron_layer_input(layer, input_):
    """(the input of a ColumnParallelLinear ``layer`` as its matmul sees it, its TP group or None at one rank): the
    layer's own input mapping, whose backward sums the ranks' partial grad_hidden (under sequence parallelism it
    gathers the sequence). Megatron-SWIFT's deferred output layer takes it too (integrations/swift/megatron_head.py)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=layer.tp_group)
    elif layer.disable_grad_reduce:
        hidden = input_
    else:
        hidden = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
    group = layer.tp_group if layer.tp_group is not None and layer.tp_group.size() > 1 else None
    return hidden, group


def transformers_forward(original):
    """nn.Linear.forward of a transformers lm_head, deferred: a placeholder [b, s, 0] for labelled inputs."""

    def forward(self, input):  # noqa: A002  (nn.Linear's name)
        call = _CALL.get()
        if call is None or call.labels is None or tuple(input.shape[:-1]) != tuple(call.labels.shape):
            if call is not None and call.head.cannot_defer is not None:
                raise call.refuse(call.head.cannot_defer)
            return original(input)
        weight = self.weight
        device_type = input.device.type
        with contextlib.ExitStack() as stack:
            if torch.is_autocast_enabled(device_type):  # as autocast runs nn.Linear: both in its dtype
                dtype = torch.get_autocast_dtype(device_type)
                input, weight = input.to(dtype), weight.to(dtype)
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return call.head.output(call, input, weight, call.labels, None, seq_first=False)

    return forward
