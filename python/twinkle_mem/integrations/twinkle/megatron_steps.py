"""twinkle's Megatron ``forward_backward`` (``forward_only`` included) with twinkle-mem: the logits
guard around the call, the fused output layer for an eligible call, and hooks around twinkle's forward
step inside megatron-core's schedule (each micro-batch's labels for the fused head, its refusals, the
failed micro-batches); the guarded ``MegatronStrategy.reduce_loss``."""
import contextlib
import functools
from collections.abc import Mapping
from contextvars import ContextVar
from typing import List, Optional, Tuple

import torch

from . import fused_call, fused_call_plan, fused_eligibility, twinkle_names
from .failed_micro_batches import report_failed_micro_batches
from .logits_guard import current_logits_reporting, guard_report
from .logits_guard import logits_guard as _logits_guard
from .settings import FUSED_CHUNK_BYTES


_STEPS: ContextVar[Optional["_MegatronSteps"]] = ContextVar("twinkle_mem_megatron_steps", default=None)


def megatron_forward_backward(original, plan):
    """``MegatronModel.forward_backward`` under install(): twinkle-mem's logits guard where ``plan.megatron_guard``,
    failed micro-batches reported with the guard's part, the fused head with its part."""
    guard, fused = plan.megatron_guard, plan.patches(twinkle_names.MEGATRON_FUSED_LM_HEAD)
    failures = plan.patches(twinkle_names.MEGATRON_LOGITS_GUARD)  # whoever guards the logits

    @functools.wraps(original)
    def forward_backward(self, *args, **kwargs):
        if _STEPS.get() is not None:  # nested (a subclass's forward_backward through this one): hooked outside
            return original(self, *args, **kwargs)
        loss = twinkle_names.loss_instance(self, kwargs)
        forward_only = kwargs.get("forward_only", False)
        steps = _MegatronSteps(self, kwargs, loss)
        with contextlib.ExitStack() as stack:
            if guard:
                # Reports keep logits only for return_logits: twinkle's loss reads them inside the schedule (its
                # post_loss_function), before the report, and its collection keeps them for return_logits only; a
                # loss's require_logits (GKD) would otherwise pin every micro-batch's logits until the schedule ends.
                stack.enter_context(_logits_guard(return_logits=kwargs.get("return_logits", False),
                                                  forward_only=forward_only))
            if fused:
                steps.fused = stack.enter_context(_fused_megatron(self, kwargs, loss, plan))
                if steps.fused is not None and not steps.fused.head.hands_log_probs:  # a loss without log-probs
                    steps.expects_logps = False
                    steps.reports_none_logps = twinkle_names.variable_seq_lengths(self)
            token = _STEPS.set(steps)
            stack.callback(_STEPS.reset, token)
            out = original(self, *args, **kwargs)
        if steps.refused:
            _refusals_after_the_step(steps.refused)
        if failures and steps.failed:
            report_failed_micro_batches(self, kwargs, out, steps.failed)
        return out

    return forward_backward


def _fused_megatron(model, kwargs, loss, plan):
    """The fused call for one MegatronModel.forward_backward (fused_call_plan.py), or None where it does not apply."""
    return fused_call_plan.fused(megatron_fused_path(model, plan.value(FUSED_CHUNK_BYTES)), model, kwargs, loss, plan)


def megatron_fused_path(model, chunk_bytes: Optional[int]) -> fused_call_plan.FusedPath:
    """What the Megatron path knows for planning a fused call: the output layers of the model's chunks (none off
    the last pipeline stage), vocab shards under tensor parallelism, the chunk budget judged on every stage."""

    def vocab(layers):
        group = twinkle_names.tensor_parallel_group()
        world = 1 if group is None else torch.distributed.get_world_size(group)
        # (the layer's own weight, or the word embeddings' where it shares them: a tied model's layer holds none)
        return fused_eligibility.megatron_output_weights(model.model)[0].shape[0] * world, group is not None

    def checked(layers):
        if chunk_bytes is not None:  # (on every stage: the call's eligibility is the same on all of them)
            _check_chunk_bytes(model, layers, chunk_bytes)

    return fused_call_plan.FusedPath("megatron", lambda: fused_eligibility.megatron_output_layers(model.model), vocab,
                                     fused_call.megatron_forward, checked=checked,
                                     around=lambda call: fused_call.mtp_called_without_labels(model.model, call))


def _check_chunk_bytes(model, layers, chunk_bytes: int) -> None:
    """install(fused_chunk_bytes=...) judged against the output layers, before megatron's schedule starts,
    the verdict shared by every pipeline stage: only the last stage holds the layers, and an error raised
    there inside the schedule would leave the other stages waiting in their p2p receive. Once per model
    and value (one small collective)."""
    if getattr(model, "_twinkle_mem_chunk_bytes_fit", None) == chunk_bytes:
        return
    from twinkle_mem.heads.frozen import vectors_at_most
    from twinkle_mem.heads.plans import plan_blocks
    error = None
    for weight in fused_eligibility.megatron_output_weights(model.model) if layers else []:
        try:  # (the blocks' need is the largest of every pass a call may run: trainable, frozen, either entropy)
            plan_blocks(weight, weight.shape[0], chunk_bytes, backward=True,
                        most=vectors_at_most(weight.dtype, weight.device))
        except ValueError as e:
            error = str(e)
    group = _pipeline_group()
    if group is not None:
        errors = [None] * group.size()
        torch.distributed.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise ValueError(f"twinkle-mem fused LM head: install(fused_chunk_bytes={chunk_bytes}) does not fit this "
                         f"model: {error}; pass a larger fused_chunk_bytes, or None for the default")
    model._twinkle_mem_chunk_bytes_fit = chunk_bytes


def _pipeline_group():
    """megatron-core's pipeline-parallel group of this rank when there are several stages, else None."""
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:
        return None
    if not mpu.model_parallel_is_initialized() or mpu.get_pipeline_model_parallel_world_size() < 2:
        return None
    return mpu.get_pipeline_model_parallel_group()


def scheduler_with_step_hooks(original, plan):
    """megatron-core's get_forward_backward_func; inside a hooked forward_backward, its schedule
    runs twinkle's forward step through _MegatronSteps."""

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)
        steps = _STEPS.get()
        if steps is None:
            return schedule

        @functools.wraps(schedule)
        def run(*a, forward_step_func, **kw):
            return schedule(*a, forward_step_func=steps.wrap(forward_step_func), **kw)

        return run

    return get_forward_backward_func


class _LabelsOfNextBatch:
    """The data iterator twinkle's forward step draws its micro-batch from; notes the batch's labels."""

    def __init__(self, iterator, steps):
        self.iterator, self.steps = iterator, steps

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        self.steps.labels = labels
        if self.steps.fused is not None:
            self.steps.fused.set_labels(labels)
        return batch


class _MegatronSteps:
    """Hooks around twinkle's forward step for one forward_backward call: the fused output
    layer's micro-batch labels and its checks, and the failed micro-batches."""

    def __init__(self, model, kwargs, loss):
        self.model = model
        self.expects_logps = (kwargs.get("task", "causal_lm") != "embedding" and loss is not None
                              and getattr(loss, "require_logps", True))
        # No log-probs wanted, variable lengths: twinkle's own `logps` is a list of None per micro-batch, so a
        # None from a micro-batch is no failure and stays in the report (with fixed lengths twinkle-kit 0.5.1
        # hands those None to torch.cat, which raises: the guard's fix, `logps` None, stands there).
        self.reports_none_logps = not self.expects_logps and twinkle_names.variable_seq_lengths(model)
        self.fused: Optional[fused_call.FusedCall] = None
        self.labels = None
        self.loss_steps = 0  # micro-batches seen by the last pipeline stage
        self.failed: List[int] = []
        self.refused: List[Tuple[int, str]] = []  # (micro-batch, why) where the fused head refused

    def wrap(self, forward_step_func):

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model):
            call = self.fused
            deferred = call.start_micro_batch() if call is not None else 0
            self.labels = None
            try:
                output, loss_func = forward_step_func(_LabelsOfNextBatch(data_iterator, self), model)
            finally:
                if call is not None:
                    call.set_labels(None)
            if not self._last_stage(model):
                return output, loss_func
            index = self.loss_steps
            self.loss_steps += 1
            handed, logps = twinkle_names.forward_step_log_probs(loss_func)
            lost = self.expects_logps and self.labels is not None and handed and logps is None
            if call is not None and call.deferred != deferred:
                # This micro-batch went through the fused head. Never raise here: under pipeline parallelism
                # the other stages would wait in their p2p receives (see _refusals_after_the_step).
                refused, pending, taken = call.finish_micro_batch()
                if refused is None and pending is not None and not lost:
                    refused = fused_call.NOT_TAKEN
                if refused is not None:
                    self.refused.append((index, refused))
                elif lost:
                    # twinkle's TWINKLE_FAIL_FAST=0 catch dropped the log-probs it had been handed (a data-processing
                    # error after selective_log_softmax): its loss computes them from "logits" as it does unfused,
                    # and gets the same results from the placeholder.
                    loss_func = call.rearmed(loss_func, taken if taken is not None else pending)
            if lost:
                self.failed.append(index)
            return output, loss_func
        return forward_step

    def _last_stage(self, chunk) -> bool:
        from megatron.core import parallel_state as mpu
        unwrapped = twinkle_names.unwrap_model(self.model, [chunk])[0]
        return mpu.is_pipeline_last_stage(False, getattr(unwrapped, "vp_stage", None))


def _refusals_after_the_step(refused: List[Tuple[int, str]]) -> None:
    """Raise for the micro-batches whose fused head refused (twinkle's TWINKLE_FAIL_FAST=0 catch had
    swallowed the error). Raised after megatron's schedule has returned, so that every pipeline stage
    finished the step; the refused micro-batches' log-probs reached no loss (twinkle's SafeLossWrapper
    made a zero loss of them, or the loss raised)."""
    where = "; ".join(f"micro-batch {i}: {why}" for i, why in refused)
    raise RuntimeError(f"twinkle-mem fused LM head: {len(refused)} micro-batch(es) lost their log-probs in twinkle's "
                       f"forward step (see twinkle's '[nccl_safe]' warning), where the fused head refused: {where}. "
                       "No result of this step can be trusted; install(fused_lm_head=False) runs twinkle-kit "
                       "unchanged.")


def guarded_reduce_loss(original, plan):
    """``MegatronStrategy.reduce_loss`` under the logits guard: the report keeps logits only when wanted."""

    @functools.wraps(original)
    def reduce_loss(self, local_loss, local_count, logits, logps):
        keep_logits = current_logits_reporting()
        if keep_logits is None:  # called outside forward_backward: twinkle's behaviour
            return original(self, local_loss, local_count, logits, logps)
        # (twinkle's own detaches the logits: a view, dropped from the report just below; 0.4.0's detaches None too)
        loss, count, report = original(self, local_loss, local_count, logits, logps)
        # Leaving out None entries makes twinkle's `'logps' in report` collection skip failed micro-batches.
        report = guard_report(report, keep_logits)
        steps = _STEPS.get()
        if logps is None and steps is not None and steps.reports_none_logps:
            report["logps"] = None
        return loss, count, report

    return reduce_loss
