"""Plug twinkle-mem into an installed twinkle-kit (``import twinkle``).

This module owns install() / uninstall(), the patch registry, the version gate and the
``selective_log_softmax`` adapter; each patched concern lives in a module of its own:
``mask_skip`` (the causal-mask skip), ``megatron_steps`` (twinkle's Megatron forward_backward,
the scheduler's step hooks, the guarded reduce_loss), ``failed_micro_batches``,
``transformers_path`` (twinkle's TransformersModel) and ``fused_head`` (the deferred output layer).

``install()`` patches, in the current process (in Ray mode: in every worker
that runs a model; call it before training starts):

- ``selective_log_softmax`` -> twinkle-mem's op, at its definition and in every
  loaded twinkle module that imported it by name (modules imported later pick
  the patched name up from ``twinkle.utils``); and ``GKDLoss.__call__`` -> the
  distillation loss in fp32 from twinkle-mem's ops (``distill_loss.py``), with
  ``log_softmax=True``;
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
- ``TransformersModel.calculate_loss`` (also run by ``forward_backward``), and
  ``forward`` / ``forward_only`` to note the call's ``return_logits`` (with
  ``logits_guard=True``): once the loss has been computed, the step's logits,
  which twinkle keeps for its metrics until the next forward where the loss sets
  ``require_logits`` (GKD), leave the train (eval) status, unless the caller
  asked for them or one of its metrics may read them; twinkle's ``Accuracy``
  counts the step at that moment, so every metric gives twinkle-kit's result
  (``transformers_path.py``);
- with ``fused_lm_head=True``: ``TransformersModel.forward`` / ``forward_only``
  too (inside the note above), and in every eligible call the output layer computes log-probs and
  entropy from its input without the logits (``fused_head.py``), a
  distillation call's loss from that input too (``distill_loss.py``).

``uninstall()`` puts every original object back.
"""
import logging
import sys
from typing import Any, Dict, List, Optional, Tuple

from twinkle_mem.processor import MASK_SKIP_MODES

from . import distill_loss, fused_head, megatron_steps, transformers_path
from ._model import tensor_parallel_group
from . import mask_skip as mask_skip_patch  # (install() has an argument mask_skip)
from .failed_micro_batches import FailedMicroBatchWarning

__all__ = ["install", "uninstall", "is_installed", "FailedMicroBatchWarning", "SUPPORTED_TWINKLE_VERSIONS"]

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
    ``fused_head.py`` and docs/twinkle_integration.md); needs
    ``log_softmax``. ``fused_chunk_bytes``: the fused op's ``chunk_bytes``
    (its block working memory, 256 MiB by default). Calling again with other
    settings reinstalls.
    """
    global _settings, _log_softmax_pair
    settings = dict(log_softmax=log_softmax, mask_skip=mask_skip, logits_guard=logits_guard,
                    fused_lm_head=fused_lm_head, fused_chunk_bytes=fused_chunk_bytes)
    check_settings(settings)
    # First import twinkle: where TWINKLE_MEM_INSTALL is set, that runs the start-up hook's install() now, to
    # completion, so that this call then reinstalls with its own settings rather than patching over it.
    _check_version()
    if _settings == settings:
        return
    if _settings is not None:
        uninstall()

    # Resolve every patch point before touching any, so a failure leaves twinkle as it was.
    import twinkle.utils.torch_utils as torch_utils
    from twinkle import Platform
    from twinkle.processor.base import InputProcessor
    hook_megatron = logits_guard or fused_lm_head
    if hook_megatron:
        from twinkle.model.megatron.megatron import MegatronModel
        from twinkle.model.megatron.strategy.megatron import MegatronStrategy
        # None without megatron-core: no Megatron runs then
        pipeline_parallel = megatron_steps.megatron_pipeline_parallel()
    if logits_guard or fused_lm_head:
        from twinkle.model.transformers.transformers import TransformersModel
    if log_softmax:
        from twinkle.loss.gkd import GKDLoss
        from twinkle_mem import selective_log_softmax as op  # the native op, loaded only now
        original = torch_utils.selective_log_softmax
        adapter = _log_softmax_adapter(op, fused_lm_head)

    try:
        if log_softmax:
            for module in _twinkle_modules_binding(original):
                _patch(module, "selective_log_softmax", adapter)
            _log_softmax_pair = (original, adapter)
            _patch(GKDLoss, "__call__", distill_loss.gkd_call(GKDLoss.__call__, fused_lm_head))
        _patch(InputProcessor, "__call__", mask_skip_patch.processor_call(InputProcessor.__call__, Platform, mask_skip))
        _patch(InputProcessor, "_create_4d_attention_mask", staticmethod(mask_skip_patch.create_4d_attention_mask))
        if hook_megatron:
            _patch(MegatronModel, "forward_backward",
                   megatron_steps.megatron_forward_backward(MegatronModel.forward_backward, logits_guard,
                                                            fused_lm_head, fused_chunk_bytes))
            if pipeline_parallel is not None:
                _patch(pipeline_parallel, "get_forward_backward_func",
                       megatron_steps.scheduler_with_step_hooks(pipeline_parallel.get_forward_backward_func))
        if logits_guard:
            _patch(MegatronStrategy, "reduce_loss", megatron_steps.guarded_reduce_loss(MegatronStrategy.reduce_loss))
        if logits_guard or fused_lm_head:
            for name, status in (("forward", "train_status"), ("forward_only", "eval_status")):
                forward = getattr(TransformersModel, name)
                if fused_lm_head:
                    forward = transformers_path.transformers_model_forward(forward, fused_chunk_bytes)
                if logits_guard:  # outermost: notes return_logits once twinkle's forward has filled the status
                    forward = transformers_path.forward_noting_return_logits(forward, status)
                _patch(TransformersModel, name, forward)
        if logits_guard:
            _patch(TransformersModel, "calculate_loss",
                   transformers_path.calculate_loss_dropping_logits(TransformersModel.calculate_loss))
    except BaseException:
        _restore()
        raise
    _settings = settings


def check_settings(settings: Dict[str, Any]) -> None:
    """Raise ValueError for install() arguments that do not go together (also TWINKLE_MEM_INSTALL's)."""
    mask_skip, chunk_bytes = settings.get("mask_skip", "npu"), settings.get("fused_chunk_bytes")
    if mask_skip not in MASK_SKIP_MODES:
        raise ValueError(f"mask_skip must be one of {MASK_SKIP_MODES}, got {mask_skip!r}")
    if settings.get("fused_lm_head", False) and not settings.get("log_softmax", True):
        raise ValueError("fused_lm_head=True needs log_softmax=True: twinkle's selective_log_softmax call sites are "
                         "where the fused results are handed over")
    if chunk_bytes is not None and not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
        raise ValueError(f"fused_chunk_bytes must be a positive int or None, got {chunk_bytes!r}")


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
            return fused_head.take(logits, index, return_entropy)
        # Under vocab tensor parallelism (TP > 1) the logits are this rank's vocab
        # shard, as for twinkle's own function (Megatron's vocab-parallel CE there):
        # the op combines the shards over the TP group, entropy included.
        return op(logits, index, return_entropy, process_group=tensor_parallel_group())

    selective_log_softmax.__wrapped__ = op
    return selective_log_softmax
