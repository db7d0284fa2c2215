"""Plug twinkle-mem into an installed twinkle-kit (``import twinkle``).

This module declares twinkle-kit (``FRAMEWORK``, ``core/framework.py``: its package, distribution, names table,
settings, patches, variable and start-up hook); install() / uninstall() and the rest are the declaration's, written
once in the core for every framework. What twinkle-kit is expected to be, how a
twinkle-kit is recognized (by its code, not its version string) and every twinkle name the integration
touches: ``twinkle_names.py``. What is replaced, and when (each twinkle module when the process imports it):
``patches.py``. Each patched concern lives in a module of its own: ``mask_skip`` (the causal-mask skip in
twinkle's InputProcessor, decided by ``causal_mask``), ``megatron_steps`` (twinkle's Megatron forward_backward
under ``logits_guard``, the scheduler's step hooks, the guarded reduce_loss), ``failed_micro_batches``,
``transformers_path`` (twinkle's TransformersModel), ``fused_call_plan`` (a fused call planned, for both paths),
``loss_heads`` (the loss heads a fused call serves), ``fused_call`` (one fused call: its state, the deferred
output layer) and ``distill_loss`` (GKDLoss). ``causal_mask`` and ``logits_guard`` are framework-agnostic, public
as ``twinkle_mem.processor`` and ``twinkle_mem.megatron``.

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
  layer is deferred for the call where it applies (``fused_call.py``);
- ``TransformersModel.calculate_loss``, ``forward`` and ``forward_only`` (with ``logits_guard=True``): once the
  loss has been computed the step's logits leave the train (eval) status unless the caller asked for them or a
  metric may read them (``transformers_path.py``); with ``fused_lm_head=True`` the output layer is deferred in
  every eligible call.

A part whose twinkle names or features are not what twinkle_names expects is refused by name: twinkle runs it as
it ships it, install() warns (:class:`TwinklePartsNotRecognized`) and :func:`refused` lists why; under
``TWINKLE_MEM_INSTALL`` the refusal makes ``import twinkle`` raise. ``uninstall()`` puts every original back.
"""
from ..core.framework import Framework
from ..core.settings import SMALLEST_CHUNK_BYTES
from . import patches, startup, twinkle_names
from .failed_micro_batches import FailedMicroBatchWarning
from .settings import MASK_SKIP_MODES, SETTINGS

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "check_settings",
           "FailedMicroBatchWarning", "TwinklePartsNotRecognized", "MASK_SKIP_MODES", "SMALLEST_CHUNK_BYTES"]


def _import_twinkle() -> None:
    # First import twinkle: where TWINKLE_MEM_INSTALL is set, that runs the start-up hook's install() now, to
    # completion, so that this call then reinstalls with its own settings rather than patching over it.
    import twinkle  # noqa: F401


FRAMEWORK = Framework("twinkle-kit", package="twinkle", distribution="twinkle-kit", version_file="version.py",
                      module=__name__, names=twinkle_names, patches=patches, startup=startup,
                      before_install=_import_twinkle)
TwinklePartsNotRecognized = FRAMEWORK.refused_warning  # install()'s warning: parts of twinkle-kit left as shipped

install, uninstall, is_installed, installed_settings, refused, describe = FRAMEWORK.public_functions(
    """Register twinkle-mem into twinkle-kit; idempotent, undone by :func:`uninstall`.

    Its keyword arguments are the settings of ``settings.py`` (the signature is built from them): ``mask_skip`` is
    one of :data:`MASK_SKIP_MODES` (``"npu"`` by default). ``fused_lm_head``: compute log-probs and entropy from the
    output layer's input where that is the same computation (see ``fused_call.py`` and
    docs/twinkle_integration.md); needs ``log_softmax``. ``fused_chunk_bytes``: the fused op's ``chunk_bytes`` (its
    block working memory, 256 MiB by default); needs ``fused_lm_head``. Calling again with other settings
    reinstalls. A part of twinkle-kit not recognized is left as shipped, with a :class:`TwinklePartsNotRecognized`
    warning.""")
check_settings = SETTINGS.check  # ValueError for install() arguments that do not go together (the variable's too)
