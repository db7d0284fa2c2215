"""The causal-mask skip in twinkle's ``InputProcessor``: whether collate builds the dense
``[B, 1, S, S]`` mask is decided before it allocates anything (causal_mask.py decides), and
where the mask is still needed it is built with one allocation. Also notes, for a fused
transformers call, the labels the processor returns (what the model call will not see)."""
import functools
from collections.abc import Mapping
from contextvars import ContextVar

from . import fused_call, twinkle_names
from .causal_mask import dense_causal_mask, resolve_mask_type, skip_dense_mask
from .settings import MASK_SKIP


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


def create_4d_attention_mask(original, plan):
    """``InputProcessor._create_4d_attention_mask`` under install(): :func:`dense_mask`."""
    return dense_mask


def dense_mask(attention_mask):
    """Collate's dense-mask builder: nothing on the skipped path, one allocation otherwise."""
    if _skip_mask.get():
        return _SKIPPED
    # twinkle sizes each sample's padding by its mask's length, not by its values.
    return dense_causal_mask([m.shape[0] for m in attention_mask], device=attention_mask[0].device)


def processor_call(original, plan):
    """``InputProcessor.__call__`` under install(), with its ``mask_skip`` mode."""
    platform, mode = twinkle_names.platform(), plan.value(MASK_SKIP)

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
        call = fused_call.current()
        if call is not None and call.labels_from_processor and isinstance(outputs, Mapping):
            call.set_labels(outputs.get("labels"))  # what TransformersModel pops before the model call
        return _drop_skipped(outputs)

    return __call__


def _drop_skipped(outputs):
    for feature in outputs if isinstance(outputs, list) else [outputs]:
        if isinstance(feature, dict):
            for key, value in feature.items():
                if _skipped(value):
                    feature[key] = None
    return outputs


def _skipped(value) -> bool:
    """The marker, also as twinkle-kit 0.4.0's ``to_transformers_dict`` hands it on: ``np.array(marker)``."""
    if value is _SKIPPED:
        return True
    import numpy as np
    return isinstance(value, np.ndarray) and value.dtype == object and value.size == 1 and value.flat[0] is _SKIPPED
