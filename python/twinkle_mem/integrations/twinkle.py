"""Plug twinkle-mem into an installed twinkle-kit (``import twinkle``).

``install()`` patches, in the current process (in Ray mode: in every worker
that runs a model; call it before training starts):

- ``selective_log_softmax`` -> twinkle-mem's op, at its definition and in every
  loaded twinkle module that imported it by name (modules imported later pick
  the patched name up from ``twinkle.utils``);
- ``InputProcessor.__call__`` and ``InputProcessor._create_4d_attention_mask``
  -> the causal-mask skip, decided before collate allocates anything, and a
  one-allocation builder where the dense mask is still built;
- ``MegatronModel.forward_backward`` and ``MegatronStrategy.reduce_loss`` ->
  the logits guard (covers ``forward_only``, which twinkle runs through
  ``forward_backward`` and which then also runs without autograd, and
  ``MultiLoraMegatronModel``, whose ``forward_backward`` calls this one).

``uninstall()`` puts every original object back.
"""
import functools
import sys
from contextvars import ContextVar
from typing import Any, Dict, List, Optional, Tuple

from twinkle_mem.megatron import current_logits_reporting, guard_report
from twinkle_mem.megatron import logits_guard as _logits_guard  # install() has a flag of that name
from twinkle_mem.processor import MASK_SKIP_MODES, dense_causal_mask, resolve_mask_type, skip_dense_mask

SUPPORTED_TWINKLE_VERSIONS = ("0.5.1", )

_MISSING = object()
_saved: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original raw value or _MISSING)
_settings: Optional[Dict[str, Any]] = None
_log_softmax_pair: Optional[Tuple[Any, Any]] = None  # (twinkle's original, twinkle-mem adapter)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _settings is not None


def install(*, log_softmax: bool = True, mask_skip: str = "npu", logits_guard: bool = True) -> None:
    """Register twinkle-mem into twinkle-kit; idempotent, undone by :func:`uninstall`.

    ``mask_skip`` is one of ``twinkle_mem.processor.MASK_SKIP_MODES``
    (``"npu"`` by default). Calling again with other settings reinstalls.
    """
    global _settings, _log_softmax_pair
    if mask_skip not in MASK_SKIP_MODES:
        raise ValueError(f"mask_skip must be one of {MASK_SKIP_MODES}, got {mask_skip!r}")
    settings = dict(log_softmax=log_softmax, mask_skip=mask_skip, logits_guard=logits_guard)
    if _settings == settings:
        return
    if _settings is not None:
        uninstall()

    _check_version()
    # Resolve every patch point before touching any, so a failure leaves twinkle as it was.
    import twinkle.utils.torch_utils as torch_utils
    from twinkle import Platform
    from twinkle.processor.base import InputProcessor
    if logits_guard:
        from twinkle.model.megatron.megatron import MegatronModel
        from twinkle.model.megatron.strategy.megatron import MegatronStrategy
    if log_softmax:
        from twinkle_mem import selective_log_softmax as op  # the native op, loaded only now
        original = torch_utils.selective_log_softmax
        adapter = _log_softmax_adapter(op)

    try:
        if log_softmax:
            for module in _twinkle_modules_binding(original):
                _patch(module, "selective_log_softmax", adapter)
            _log_softmax_pair = (original, adapter)
        _patch(InputProcessor, "__call__", _processor_call(InputProcessor.__call__, Platform, mask_skip))
        _patch(InputProcessor, "_create_4d_attention_mask", staticmethod(_create_4d_attention_mask))
        if logits_guard:
            _patch(MegatronModel, "forward_backward", _guarded_forward_backward(MegatronModel.forward_backward))
            _patch(MegatronStrategy, "reduce_loss", _guarded_reduce_loss(MegatronStrategy.reduce_loss))
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


def _log_softmax_adapter(op):

    def selective_log_softmax(logits, index, return_entropy=False):
        """twinkle-kit's ``selective_log_softmax`` signature, computed by twinkle-mem's op."""
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
        return _drop_skipped(outputs)

    return __call__


def _drop_skipped(outputs):
    for feature in outputs if isinstance(outputs, list) else [outputs]:
        if isinstance(feature, dict):
            for key, value in feature.items():
                if value is _SKIPPED:
                    feature[key] = None
    return outputs


# --- logits guard -------------------------------------------------------------


def _guarded_forward_backward(original):

    @functools.wraps(original)
    def forward_backward(self, *args, **kwargs):
        with _logits_guard(return_logits=kwargs.get("return_logits", False), loss=_loss_instance(self, kwargs),
                           forward_only=kwargs.get("forward_only", False)):
            return original(self, *args, **kwargs)

    return forward_backward


def _loss_instance(model, kwargs):
    try:
        name = kwargs["adapter_name"] if "adapter_name" in kwargs else model._get_default_group()
        return model.optimizer_group[name].loss_instance
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
        return loss, count, guard_report(report, keep_logits)

    return reduce_loss
