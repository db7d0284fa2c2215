"""twinkle-mem as a verl backend: verl's fused heads and, on request, its logits path on twinkle-mem.

A verl user switches it on with verl's own config, nothing in their code: ``actor_rollout_ref.model.
use_fused_kernels=True`` and ``actor_rollout_ref.model.fused_kernel_options.impl_backend=twinkle`` (the
reference model shares that config). twinkle-mem's ``verl.plugins`` entry point (``plugin.py``) runs
:func:`install` in every process that imports verl, the driver and each Ray worker, before any engine exists;
it changes nothing unless a model asks for ``impl_backend=twinkle`` or ``TWINKLE_MEM_VERL`` asks for more;
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's switch) or ``TWINKLE_MEM_VERL=0`` turns it off.

What it patches (``patches.py``), each part recognized by verl's code (``verl_names.py``) and refused by name
where it is not what twinkle-mem expects:

- ``fsdp_fused_head``: the FSDP engines' per-architecture fused forwards compute log-probs and entropy with
  ``twinkle_mem.linear_selective_log_softmax`` (``fsdp_head.py``);
- ``megatron_fused_head``: the Megatron (and mindspeed) fused forwards' ``linear_cross_entropy`` runs on it, the
  TP group as ``process_group`` (``megatron_head.py``);
- with ``logits_path=True``: verl's logits-path functions on ``twinkle_mem.selective_log_softmax``
  (``logits_path.py``).

This module, ``verl_names``, ``patches``, ``settings`` and ``plugin`` import no torch at module level; the
integrations' shared core (``integrations/core/``) does the recognizing, planning, patching and describing.
"""
import logging
import warnings
from typing import Any, Dict, List

from ..core.integration import Integration, PartsNotRecognized
from . import patches, verl_names
from .settings import IMPL_BACKEND, SETTINGS

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "IMPL_BACKEND",
           "VerlPartsNotRecognized"]

logger = logging.getLogger("twinkle_mem.verl")

INTEGRATION = Integration("verl", SETTINGS, verl_names.PARTS, patches.PATCHER, patches.VerlInstallPlan,
                          verl_names.found, "version/version")


class VerlPartsNotRecognized(PartsNotRecognized):
    """install() left parts of verl as shipped: their names or features are not what it expects.
    ``refused``: {part: (why, ...)}."""


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process (by a call, or by the ``verl.plugins`` entry point)."""
    return INTEGRATION.is_installed()


installed_settings = INTEGRATION.installed_settings  # install()'s arguments in effect here (None: not installed)
refused = INTEGRATION.refused  # the parts asked for and left as verl ships them: {part: (why, ...)}
refusal_message = INTEGRATION.refusal_message
uninstall = INTEGRATION.uninstall  # restore everything install() replaced; a no-op when not installed


def install(**settings) -> None:
    """Make twinkle-mem a backend of the verl this process imports; idempotent, undone by :func:`uninstall`.

    Its keyword arguments are the settings of ``settings.py`` (the signature below is built from them):
    ``logits_path``: verl's logits path on twinkle-mem's op too; ``fused_chunk_bytes``: the fused head's block
    working memory (256 MiB by default). The fused heads themselves act only for a model whose config says
    ``impl_backend=twinkle``. A part of verl not recognized is left as shipped, with a
    :class:`VerlPartsNotRecognized` warning."""
    plan = INTEGRATION.install_settings(SETTINGS.bind("install", settings))
    if plan.refused:
        warnings.warn(VerlPartsNotRecognized(f"twinkle-mem: {refusal_message(plan.refused)}", plan.refused),
                      stacklevel=2)


install.__signature__ = SETTINGS.signature()


def describe(**settings) -> List[str]:
    """The verl this process would import (found, not imported) and what install(**settings) patches there, part
    by part; raises ImportError without verl."""
    return INTEGRATION.describe(settings)


def install_settings(settings: Dict[str, Any]):
    """install() itself, every setting given (the entry point's)."""
    return INTEGRATION.install_settings(settings)
