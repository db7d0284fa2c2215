"""Plug twinkle-mem into an installed twinkle-kit (``import twinkle``).

``install()`` patches, in the current process (in Ray mode: in every worker
that runs a model; call it before training starts):

- ``selective_log_softmax`` -> twinkle-mem's op, at its definition and in every
  loaded twinkle module that imported it by name (modules imported later pick
  the patched name up from ``twinkle.utils``);
- ``InputProcessor.__call__`` and ``InputProcessor._create_4d_attention_mask``
  -> the causal-mask skip, decided before collate allocates anything, and a
  one-allocation builder where the dense mask is still built;
- ``MegatronModel.forward_backward`` and megatron-core's
  ``get_forward_backward_func``, with the logits guard or the fused head (or
  both; covers ``forward_only``, which twinkle runs through ``forward_backward``
  and which then also runs without autograd, and ``MultiLoraMegatronModel``,
  whose ``forward_backward`` calls this one): inside a patched
  ``forward_backward`` the scheduler runs twinkle's forward step through hooks.
  With ``logits_guard=True`` the call runs under the logits guard, and the hooks
  report failed micro-batches (:class:`FailedMicroBatchWarning`, NaN rows in the
  returned log-probs) instead of letting the collected log-probs shift onto
  other samples; with ``fused_lm_head=True`` the output layer is deferred for
  the call where it applies (below);
- ``MegatronStrategy.reduce_loss`` -> the logits guard's reports (with
  ``logits_guard=True``);
- with ``fused_lm_head=True``: ``TransformersModel.forward`` / ``forward_only``
  too, and in every eligible call the output layer computes log-probs and
  entropy from its input without the logits (``twinkle_lm_head.py``).

``uninstall()`` puts every original object back.
"""
import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Dict, List, Optional, Tuple

from twinkle_mem.integrations import twinkle_lm_head as lm_head
from twinkle_mem.megatron import current_logits_reporting, guard_report
from twinkle_mem.megatron import logits_guard as _logits_guard  # install() has a flag of that name
from twinkle_mem.processor import MASK_SKIP_MODES, dense_causal_mask, resolve_mask_type, skip_dense_mask

logger = logging.getLogger("twinkle_mem")

SUPPORTED_TWINKLE_VERSIONS = ("0.5.1", )

_MISSING = object()
_saved: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original raw value or _MISSING)
_settings: Optional[Dict[str, Any]] = None
_log_softmax_pair: Optional[Tuple[Any, Any]] = None  # (twinkle's original, twinkle-mem adapter)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _settings is not None


def install(*, log_softmax: bool = True, mask_skip: str = "npu", logits_guard: bool = True,
            fused_lm_head: bool = False, fused_chunk_bytes: Optional[int] = None) -> None:
    """Register twinkle-mem into twinkle-kit; idempotent, undone by :func:`uninstall`.

    ``mask_skip`` is one of ``twinkle_mem.processor.MASK_SKIP_MODES``
    (``"npu"`` by default). ``fused_lm_head``: compute log-probs and entropy
    from the output layer's input where that is the same computation (see
    ``twinkle_lm_head.py`` and docs/twinkle_integration.md); needs
    ``log_softmax``. ``fused_chunk_bytes``: the fused op's ``chunk_bytes``
    (its block working memory, 256 MiB by default). Calling again with other
    settings reinstalls.
    """
    global _settings, _log_softmax_pair
    if mask_skip not in MASK_SKIP_MODES:
        raise ValueError(f"mask_skip must be one of {MASK_SKIP_MODES}, got {mask_skip!r}")
    if fused_lm_head and not log_softmax:
        raise ValueError("fused_lm_head=True needs log_softmax=True: twinkle's selective_log_softmax call sites are "
                         "where the fused results are handed over")
    if fused_chunk_bytes is not None and not (isinstance(fused_chunk_bytes, int) and fused_chunk_bytes > 0):
        raise ValueError(f"fused_chunk_bytes must be a positive int or None, got {fused_chunk_bytes!r}")
    settings = dict(log_softmax=log_softmax, mask_skip=mask_skip, logits_guard=logits_guard,
                    fused_lm_head=fused_lm_head, fused_chunk_bytes=fused_chunk_bytes)
    if _settings == settings:
        return
    if _settings is not None:
        uninstall()

    _check_version()
    # Resolve every patch point before touching any, so a failure leaves twinkle as it was.
    import twinkle.utils.torch_utils as torch_utils
    from twinkle import Platform
    from twinkle.processor.base import InputProcessor
    megatron_steps = logits_guard or fused_lm_head
    if megatron_steps:
        from twinkle.model.megatron.megatron import MegatronModel
        from twinkle.model.megatron.strategy.megatron import MegatronStrategy
        pipeline_parallel = _megatron_pipeline_parallel()  # None without megatron-core: no Megatron runs then
    if fused_lm_head:
        from twinkle.model.transformers.transformers import TransformersModel
    if log_softmax:
        from twinkle_mem import selective_log_softmax as op  # the native op, loaded only now
        original = torch_utils.selective_log_softmax
        adapter = _log_softmax_adapter(op, fused_lm_head)

    try:
        if log_softmax:
            for module in _twinkle_modules_binding(original):
                _patch(module, "selective_log_softmax", adapter)
            _log_softmax_pair = (original, adapter)
        _patch(InputProcessor, "__call__", _processor_call(InputProcessor.__call__, Platform, mask_skip))
        _patch(InputProcessor, "_create_4d_attention_mask", staticmethod(_create_4d_attention_mask))
        if megatron_steps:
            _patch(MegatronModel, "forward_backward",
                   _megatron_forward_backward(MegatronModel.forward_backward, logits_guard, fused_lm_head,
                                              fused_chunk_bytes))
            if pipeline_parallel is not None:
                _patch(pipeline_parallel, "get_forward_backward_func",
                       _scheduler_with_step_hooks(pipeline_parallel.get_forward_backward_func))
        if logits_guard:
            _patch(MegatronStrategy, "reduce_loss", _guarded_reduce_loss(MegatronStrategy.reduce_loss))
        if fused_lm_head:
            for name in ("forward", "forward_only"):
                _patch(TransformersModel, name, _transformers_forward(getattr(TransformersModel, name),
                                                                      fused_chunk_bytes))
    except BaseException:
        _restore()
        raise
    _settings = settings


def uninstall() -> None:
    """Restore everything :func:`install` replaced; a no-op when not installed."""
    global _settings
    _restore()
    _settings = None


def _restore() -> None:
    global _log_softmax_pair
    while _saved:
        owner, name, raw = _saved.pop()
        if raw is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)
    if _log_softmax_pair is not None:
        # Modules imported after install() bound the adapter by name; give them the original back.
        original, adapter = _log_softmax_pair
        for module in _twinkle_modules_binding(adapter):
            setattr(module, "selective_log_softmax", original)
        _log_softmax_pair = None


def _check_version() -> None:
    from twinkle.version import __version__
    if __version__ not in SUPPORTED_TWINKLE_VERSIONS:
        raise RuntimeError(f"twinkle_mem.integrations.twinkle supports twinkle-kit "
                           f"{', '.join(SUPPORTED_TWINKLE_VERSIONS)}; found twinkle-kit {__version__}. "
                           f"The functions it patches may differ in that version: install a supported "
                           f"twinkle-kit, or use twinkle_mem.processor / twinkle_mem.megatron directly.")


def _patch(owner: Any, name: str, new: Any) -> None:
    _saved.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, new)


def _twinkle_modules_binding(obj: Any) -> List[Any]:
    return [
        module for name, module in list(sys.modules.items())
        if (name == "twinkle" or name.startswith("twinkle."))
        and getattr(module, "__dict__", {}).get("selective_log_softmax") is obj
    ]


# --- selective_log_softmax ---------------------------------------------------


def _log_softmax_adapter(op, fused_lm_head=False):

    def selective_log_softmax(logits, index, return_entropy=False):
        """twinkle-kit's ``selective_log_softmax`` signature, computed by twinkle-mem's op."""
        if fused_lm_head and logits.shape[-1] == 0:
            # A fused output layer's placeholder: its log-probs were computed from the layer's input.
            return lm_head.take(logits, index, return_entropy)
        # Under vocab tensor parallelism (TP > 1) the logits are this rank's vocab
        # shard, as for twinkle's own function (Megatron's vocab-parallel CE there):
        # the op combines the shards over the TP group, entropy included.
        return op(logits, index, return_entropy, process_group=_tensor_parallel_group())

    selective_log_softmax.__wrapped__ = op
    return selective_log_softmax


def _tensor_parallel_group():
    if "megatron.core" not in sys.modules:  # Megatron not in use: no vocab sharding
        return None
    try:
        from megatron.core import parallel_state as mpu
        if mpu.model_parallel_is_initialized() and mpu.get_tensor_model_parallel_world_size() > 1:
            return mpu.get_tensor_model_parallel_group()
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None


# --- causal-mask skip ---------------------------------------------------------

_skip_mask: ContextVar[bool] = ContextVar("twinkle_mem_skip_mask", default=False)


class _SkippedMask:
    """Stands where a skipped mask would be, through twinkle's micro-batch
    slicing; swapped for ``None`` before the processor returns."""
    __slots__ = ()

    def __getitem__(self, _):
        return self

    def __repr__(self):
        return "<dense attention mask skipped by twinkle-mem>"


_SKIPPED = _SkippedMask()


def _create_4d_attention_mask(attention_mask):
    """Collate's dense-mask builder: nothing on the skipped path, one allocation otherwise."""
    if _skip_mask.get():
        return _SKIPPED
    # twinkle sizes each sample's padding by its mask's length, not by its values.
    return dense_causal_mask([m.shape[0] for m in attention_mask], device=attention_mask[0].device)


def _processor_call(original, platform, mode):

    @functools.wraps(original)
    def __call__(self, inputs, **kwargs):
        mask_type = resolve_mask_type(kwargs.get("attention_mask_type"), kwargs.get("task", "causal_lm"))
        # Ask the platform only when the answer matters: twinkle probes for npu-smi/nvidia-smi.
        device_type = platform.device_prefix() if mask_type == "causal" and mode == "npu" else None
        skip = skip_dense_mask(mask_type, device_type, mode)
        if mode != "never":
            # twinkle's post-collate drop hook keys on this too: it stays the fallback.
            kwargs["attention_mask_type"] = mask_type
        token = _skip_mask.set(skip)
        try:
            outputs = original(self, inputs, **kwargs)
        finally:
            _skip_mask.reset(token)
        call = lm_head.current()
        if call is not None and call.labels_from_processor and isinstance(outputs, Mapping):
            call.labels = outputs.get("labels")  # what TransformersModel pops before the model call
        return _drop_skipped(outputs)

    return __call__


def _drop_skipped(outputs):
    for feature in outputs if isinstance(outputs, list) else [outputs]:
        if isinstance(feature, dict):
            for key, value in feature.items():
                if value is _SKIPPED:
                    feature[key] = None
    return outputs


# --- Megatron: logits guard, fused LM head, failed micro-batches -----------------


class FailedMicroBatchWarning(UserWarning):
    """Micro-batches failed inside twinkle's Megatron forward step (``TWINKLE_FAIL_FAST=0``
    caught the error). ``micro_batches``: their indices in the call; ``rows``: their rows in
    the returned ``logps``, which hold NaN (or ``None`` where the log-probs could not be
    placed: then ``logps`` is ``None``)."""

    def __init__(self, message: str, micro_batches: List[int], rows: Optional[List[range]]):
        super().__init__(message)
        self.micro_batches = micro_batches
        self.rows = rows


# Every failure, not only the first; appended, so a user's filters (-W error, ignore) still win.
warnings.filterwarnings("always", category=FailedMicroBatchWarning, append=True)

_STEPS: ContextVar[Optional["_MegatronSteps"]] = ContextVar("twinkle_mem_megatron_steps", default=None)


def _megatron_pipeline_parallel():
    try:
        import megatron.core.pipeline_parallel as pipeline_parallel
    except ImportError:
        return None
    return pipeline_parallel


def _megatron_forward_backward(original, guard: bool, fused: bool, chunk_bytes: Optional[int]):

    @functools.wraps(original)
    def forward_backward(self, *args, **kwargs):
        if _STEPS.get() is not None:  # nested (a subclass's forward_backward through this one): hooked outside
            return original(self, *args, **kwargs)
        loss = _loss_instance(self, kwargs)
        forward_only = kwargs.get("forward_only", False)
        steps = _MegatronSteps(self, kwargs, loss)
        with contextlib.ExitStack() as stack:
            if guard:
                stack.enter_context(_logits_guard(return_logits=kwargs.get("return_logits", False), loss=loss,
                                                  forward_only=forward_only))
            if fused:
                steps.fused = stack.enter_context(_fused_megatron(self, kwargs, loss, chunk_bytes))
            token = _STEPS.set(steps)
            stack.callback(_STEPS.reset, token)
            out = original(self, *args, **kwargs)
        if steps.refused:
            _refusals_after_the_step(steps.refused)
        if guard and steps.failed:
            _report_failed_micro_batches(self, kwargs, out, steps.failed)
        return out

    return forward_backward


@contextlib.contextmanager
def _fused_megatron(model, kwargs, loss, chunk_bytes):
    """The fused call for one MegatronModel.forward_backward, or None where it does not apply."""
    reason = lm_head.call_ineligible(kwargs, loss)
    layers = []
    if reason is None:
        model._lazy_wrap_model()  # twinkle's first step anyway: decide on the model as it will run
        layers, reason = lm_head.megatron_output_layers(model.model)
    if reason is not None or not layers:  # (no output layer: not the last pipeline stage)
        if reason is not None:
            logger.debug("twinkle-mem fused LM head not used: %s", reason)
        yield None
        return
    call = lm_head.FusedCall.for_call(kwargs, loss, chunk_bytes)
    with lm_head.deferred(layers, lm_head.megatron_forward, call), \
            lm_head.mtp_called_without_labels(model.model, call):
        yield call


def _scheduler_with_step_hooks(original):
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
            self.steps.fused.labels = labels
        return batch


class _MegatronSteps:
    """Hooks around twinkle's forward step for one forward_backward call: the fused output
    layer's micro-batch labels and its checks, and the failed micro-batches."""

    def __init__(self, model, kwargs, loss):
        self.model = model
        self.expects_logps = (kwargs.get("task", "causal_lm") != "embedding" and loss is not None
                              and getattr(loss, "require_logps", True))
        self.fused: Optional[lm_head.FusedCall] = None
        self.labels = None
        self.loss_steps = 0  # micro-batches seen by the last pipeline stage
        self.failed: List[int] = []
        self.refused: List[Tuple[int, str]] = []  # (micro-batch, why) where the fused head refused

    def wrap(self, forward_step_func):

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model):
            call = self.fused
            deferred = call.deferred if call is not None else 0
            if call is not None:
                call.refused = None  # a refusal inside the previous micro-batch's loss is not this one's
            self.labels = None
            try:
                output, loss_func = forward_step_func(_LabelsOfNextBatch(data_iterator, self), model)
            finally:
                if call is not None:
                    call.labels = None
            if not self._last_stage(model):
                return output, loss_func
            index = self.loss_steps
            self.loss_steps += 1
            keywords = getattr(loss_func, "keywords", {})  # twinkle's partial(post_loss_function, ...)
            lost = self.expects_logps and self.labels is not None and "logps" in keywords and keywords["logps"] is None
            if call is not None and call.deferred != deferred:
                # This micro-batch went through the fused head. Never raise here: under pipeline parallelism
                # the other stages would wait in their p2p receives (see _refusals_after_the_step).
                refused, pending, taken = call.refused, call.pending, call.taken
                call.refused = call.pending = call.taken = None
                if refused is None and pending is not None and not lost:
                    refused = ("the output layer's log-probs were computed but twinkle did not ask for them; its "
                               "logits (a zero-width placeholder) must not reach a loss")
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
        unwrapped = self.model.strategy.unwrap_model([chunk])[0]
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


def _report_failed_micro_batches(model, kwargs, out, failed: List[int]) -> None:
    """Put NaN rows where the failed micro-batches' log-probs belong (in the returned output and in
    twinkle's train/eval status), and warn, naming them."""
    group = _optimizer_group(model, kwargs)
    status = group.eval_status if kwargs.get("forward_only", False) else group.train_status
    logps, rows = _align_failed(out.get("logps"), status.inputs, failed)
    out["logps"] = logps
    if isinstance(getattr(status, "outputs", None), Mapping):
        status.outputs["logps"] = logps
    n = len(status.inputs)
    where = ", ".join(f"{i} (rows {r.start}-{r.stop - 1})" for i, r in zip(failed, rows)) if rows else \
        ", ".join(map(str, failed))
    if rows:
        what = ("their rows of `logps` are NaN (`torch.isnan(logps).all(-1)` marks them); every other row stays with "
                "its sample")
    elif len(failed) == n:
        what = "no micro-batch has log-probs: `logps` is None"
    else:
        what = "the log-probs of the other micro-batches could not be placed: `logps` is None"
    warnings.warn(FailedMicroBatchWarning(
        f"twinkle-mem: {len(failed)} of {n} micro-batches failed in twinkle's forward step (TWINKLE_FAIL_FAST=0 "
        f"caught the error, see twinkle's '[nccl_safe]' warning): micro-batch {where}; {what}.", failed, rows),
        stacklevel=3)


def _align_failed(logps, inputs, failed: List[int]):
    """(log-probs with a NaN block for each failed micro-batch, the blocks' row ranges), or
    (None, None) where the rows cannot be placed. ``inputs``: twinkle's per-micro-batch inputs
    (unpacked, as returned); a micro-batch's log-probs have its labels' rows."""
    import torch
    shapes = [tuple(inp["labels"].shape) if isinstance(inp, Mapping) and inp.get("labels") is not None else None
              for inp in inputs]
    kept = [i for i in range(len(inputs)) if i not in failed]
    if logps is None or any(shapes[i] is None for i in range(len(inputs))):
        return None, None
    if isinstance(logps, torch.Tensor):  # micro-batches concatenated along the rows
        if logps.dim() < 1 or sum(shapes[i][0] for i in kept) != logps.shape[0]:
            return None, None
        mine = iter(logps.split([shapes[i][0] for i in kept]))
        blocks = [logps.new_full((shapes[i][0], *logps.shape[1:]), float("nan")) if i in failed else next(mine)
                  for i in range(len(inputs))]
        aligned = torch.cat(blocks)
    else:  # variable_seq_lengths: one tensor per micro-batch
        if len(logps) != len(kept):
            return None, None
        mine = iter(logps)
        aligned = [torch.full(shapes[i], float("nan"), dtype=logps[0].dtype, device=logps[0].device)
                   if i in failed else next(mine) for i in range(len(inputs))]
    starts = [sum(shapes[j][0] for j in range(i)) for i in failed]
    return aligned, [range(s, s + shapes[i][0]) for s, i in zip(starts, failed)]


def _optimizer_group(model, kwargs):
    """twinkle's optimizer group of the call's adapter (the default group without ``adapter_name``)."""
    name = kwargs["adapter_name"] if "adapter_name" in kwargs else model._get_default_group()
    return model.optimizer_group[name]


def _loss_instance(model, kwargs):
    try:
        return _optimizer_group(model, kwargs).loss_instance
    except (AttributeError, KeyError):
        return None  # forward_backward itself reports the bad adapter name


def _guarded_reduce_loss(original):

    @functools.wraps(original)
    def reduce_loss(self, local_loss, local_count, logits, logps):
        keep_logits = current_logits_reporting()
        if keep_logits is None:  # called outside forward_backward: twinkle's behaviour
            return original(self, local_loss, local_count, logits, logps)
        loss, count, report = original(self, local_loss, local_count, logits if keep_logits else None, logps)
        # Leaving out None entries makes twinkle's `'logps' in report` collection skip failed micro-batches.
        report = guard_report(report, keep_logits)
        steps = _STEPS.get()
        if logps is None and steps is not None and not steps.expects_logps \
                and getattr(steps.model, "variable_seq_lengths", False):
            # No log-probs wanted (a None here is no failure): twinkle's own `logps`, a list of None per
            # micro-batch. (With fixed lengths twinkle-kit 0.5.1 hands those None to torch.cat, which raises:
            # the guard's fix, `logps` None, stands there.)
            report["logps"] = None
        return loss, count, report

    return reduce_loss


# --- transformers: fused LM head ------------------------------------------------


def _transformers_forward(original, chunk_bytes: Optional[int]):

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if lm_head.current() is not None:  # forward called from within a fused call
            return original(self, *args, **kwargs)
        with _fused_transformers(self, kwargs, chunk_bytes) as call:
            out = original(self, *args, **kwargs)
            if call is not None:
                call.check_taken(f"TransformersModel.{original.__name__}")
        return out

    return forward


@contextlib.contextmanager
def _fused_transformers(model, kwargs, chunk_bytes):
    """The fused call for one TransformersModel.forward / forward_only, or None where it does not apply."""
    loss = _loss_instance(model, kwargs)
    reason = lm_head.call_ineligible(kwargs, loss)
    if reason is None:
        model._lazy_wrap_model()  # twinkle's first step anyway: decide on the model as it will run
        head, reason = lm_head.transformers_lm_head(model.model, model.strategy.unwrap_model(model.model))
    if reason is not None:
        logger.debug("twinkle-mem fused LM head not used: %s", reason)
        yield None
        return
    call = lm_head.FusedCall.for_call(kwargs, loss, chunk_bytes, labels_from_processor=True)
    with lm_head.deferred([head], lm_head.transformers_forward, call):
        yield call
