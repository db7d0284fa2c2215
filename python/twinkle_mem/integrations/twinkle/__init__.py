"""Plug twinkle-mem into an installed twinkle-kit (``import twinkle``).

This module owns install() / uninstall() and their settings. What twinkle-kit is expected to be, how a
twinkle-kit is recognized (by its code, not its version string) and every twinkle name the integration
touches: ``twinkle_names.py``. What is replaced, and when (each twinkle module when the process imports it):
``patches.py``. Each patched concern lives in a module of its own: ``mask_skip`` (the causal-mask skip),
``megatron_steps`` (twinkle's Megatron forward_backward, the scheduler's step hooks, the guarded reduce_loss),
``failed_micro_batches``, ``transformers_path`` (twinkle's TransformersModel), ``fused_plan`` (a fused call
planned, for both paths), ``loss_heads`` (the loss heads a fused call serves), ``fused_head`` (the deferred
output layer) and ``distill_loss`` (GKDLoss).

``install()`` patches, in the current process (in Ray mode: in every worker that runs a model; call it
before training starts, or set ``TWINKLE_MEM_INSTALL``: ``startup.py``), the parts of twinkle_names.PARTS its
settings ask for and the twinkle-kit has as expected:

- ``selective_log_softmax`` -> twinkle-mem's op, at its definition and in every loaded twinkle module that
  imported it by name (modules imported later pick the patched name up from ``twinkle.utils``); and
  ``GKDLoss.__call__`` -> the distillation loss in fp32 from twinkle-mem's ops (``distill_loss.py``), with
  ``log_softmax=True``;
- ``InputProcessor.__call__`` and ``InputProcessor._create_4d_attention_mask`` -> the causal-mask skip,
  decided before collate allocates anything, and a one-allocation builder where the dense mask is still built;
- ``MegatronModel.forward_backward`` and megatron-core's ``get_forward_backward_func``: inside a patched
  ``forward_backward`` (``forward_only`` and ``MultiLoraMegatronModel`` go through it) the scheduler runs
  twinkle's forward step through hooks. With ``logits_guard=True`` the call runs under the logits guard
  (``MegatronStrategy.reduce_loss`` patched too; not where twinkle reports logits only when asked itself), and
  the hooks report failed micro-batches (:class:`FailedMicroBatchWarning`, NaN rows in the returned log-probs)
  instead of letting the collected log-probs shift onto other samples; with ``fused_lm_head=True`` the output
  layer is deferred for the call where it applies (``fused_head.py``);
- ``TransformersModel.calculate_loss``, ``forward`` and ``forward_only`` (with ``logits_guard=True``): once the
  loss has been computed the step's logits leave the train (eval) status unless the caller asked for them or a
  metric may read them (``transformers_path.py``); with ``fused_lm_head=True`` the output layer is deferred in
  every eligible call.

A part whose twinkle names or features are not what twinkle_names expects is refused by name: twinkle runs it as
it ships it, install() warns (:class:`TwinklePartsNotRecognized`) and :func:`refused` lists why; under
``TWINKLE_MEM_INSTALL`` the refusal makes ``import twinkle`` raise. ``uninstall()`` puts every original back.
"""
import logging
import warnings
from typing import Any, Dict, List, Optional, Tuple

from . import patches, twinkle_names
from .failed_micro_batches import FailedMicroBatchWarning

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "check_settings",
           "FailedMicroBatchWarning", "TwinklePartsNotRecognized", "MASK_SKIP_MODES"]

logger = logging.getLogger("twinkle_mem")

# twinkle_mem.processor.MASK_SKIP_MODES (a test holds them equal): that module imports torch, and this one is
# imported by TWINKLE_MEM_INSTALL's hook at `import twinkle`, where a process pays for no torch.
MASK_SKIP_MODES = ("npu", "always", "never")

_plan: Optional[patches.Plan] = None


class TwinklePartsNotRecognized(UserWarning):
    """install() left parts of twinkle-kit as shipped: their twinkle names or features are not what it expects.
    ``refused``: {part: (why, ...)}."""

    def __init__(self, message: str, refused: Dict[str, Tuple[str, ...]]):
        super().__init__(message)
        self.refused = refused


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process (by a call, or by ``TWINKLE_MEM_INSTALL``)."""
    return _plan is not None


def installed_settings() -> Optional[Dict[str, Any]]:
    """install()'s arguments in effect in this process (None: not installed)."""
    return dict(_plan.settings) if _plan is not None else None


def refused() -> Dict[str, Tuple[str, ...]]:
    """The parts install() was asked for and left as twinkle ships them: {part: (why, ...)} (empty: none)."""
    return dict(_plan.refused) if _plan is not None else {}


def install(*, log_softmax: bool = True, mask_skip: str = "npu", logits_guard: bool = True,
            fused_lm_head: bool = False, fused_chunk_bytes: Optional[int] = None) -> None:
    """Register twinkle-mem into twinkle-kit; idempotent, undone by :func:`uninstall`.

    ``mask_skip`` is one of :data:`MASK_SKIP_MODES` (``"npu"`` by default). ``fused_lm_head``: compute log-probs
    and entropy from the output layer's input where that is the same computation (see ``fused_head.py`` and
    docs/twinkle_integration.md); needs ``log_softmax``. ``fused_chunk_bytes``: the fused op's ``chunk_bytes``
    (its block working memory, 256 MiB by default); needs ``fused_lm_head``. Calling again with other settings
    reinstalls.
    """
    settings = dict(log_softmax=log_softmax, mask_skip=mask_skip, logits_guard=logits_guard,
                    fused_lm_head=fused_lm_head, fused_chunk_bytes=fused_chunk_bytes)
    plan = install_settings(settings)
    if plan.refused:
        warnings.warn(TwinklePartsNotRecognized(f"twinkle-mem: {refusal_message(plan.refused)}", plan.refused),
                      stacklevel=2)


def install_settings(settings: Dict[str, Any], strict: bool = False) -> patches.Plan:
    """install() itself; ``strict`` (TWINKLE_MEM_INSTALL): a part not recognized raises, nothing patched."""
    global _plan
    check_settings(settings)
    # First import twinkle: where TWINKLE_MEM_INSTALL is set, that runs the start-up hook's install() now, to
    # completion, so that this call then reinstalls with its own settings rather than patching over it.
    import twinkle  # noqa: F401
    if _plan is not None and _plan.settings == settings:
        return _plan
    plan = patches.Plan.for_settings(settings, twinkle_names.found())
    if strict and plan.refused:
        raise RuntimeError(refusal_message(plan.refused))
    uninstall()
    patches.apply(plan)
    _plan = plan
    return plan


def describe(**settings) -> List[str]:
    """The twinkle-kit this process would import (found, not imported) and what install(**settings) patches
    there, part by part; raises ImportError without twinkle-kit."""
    found = twinkle_names.found()
    plan = patches.Plan.for_settings({**install.__kwdefaults__, **settings}, found)
    return [f"twinkle-kit at {found.folder} (version.py says {found.version})", *plan.describe()]


def refusal_message(refused: Dict[str, Tuple[str, ...]]) -> str:
    found = twinkle_names.found()
    parts = "; ".join(f"{part} ({', '.join(why)})" for part, why in refused.items())
    return (f"the twinkle-kit at {found.folder} (version.py says {found.version}) is not what twinkle-mem "
            f"expects for: {parts}. Those parts run as twinkle-kit ships them")


def check_settings(settings: Dict[str, Any]) -> None:
    """Raise ValueError for install() arguments that do not go together (also TWINKLE_MEM_INSTALL's)."""
    mask_skip, chunk_bytes = settings.get("mask_skip", "npu"), settings.get("fused_chunk_bytes")
    if mask_skip not in MASK_SKIP_MODES:
        raise ValueError(f"mask_skip must be one of {MASK_SKIP_MODES}, got {mask_skip!r}")
    if settings.get("fused_lm_head", False) and not settings.get("log_softmax", True):
        raise ValueError("fused_lm_head=True needs log_softmax=True: twinkle's selective_log_softmax call sites are "
                         "where the fused results are handed over")
    if chunk_bytes is None:
        return
    if not (isinstance(chunk_bytes, int) and not isinstance(chunk_bytes, bool) and chunk_bytes > 0):
        raise ValueError(f"fused_chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
    if not settings.get("fused_lm_head", False):
        raise ValueError("fused_chunk_bytes sets the fused LM head's block memory: it needs fused_lm_head=True")
    if chunk_bytes < SMALLEST_CHUNK_BYTES:
        raise ValueError(f"fused_chunk_bytes={chunk_bytes} is below one row tile of the narrowest vocab block the "
                         f"fused LM head ever uses ({SMALLEST_CHUNK_BYTES} bytes: no model fits); whether a value "
                         "fits a model is judged at its first fused step; None is the default (256 MiB)")


# The fused head's smallest block working memory: one row tile (512 rows) of a one-column vocab block, bf16,
# forward (twinkle_mem.heads.engine.tile_bytes; a test holds the two equal). A number here, not computed: the variable's
# check runs at `import twinkle`, which must not import torch for it.
SMALLEST_CHUNK_BYTES = 1024


def uninstall() -> None:
    """Restore everything :func:`install` replaced; a no-op when not installed."""
    global _plan
    patches.restore()
    _plan = None
