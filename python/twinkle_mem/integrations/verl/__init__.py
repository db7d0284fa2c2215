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

This module declares verl (``FRAMEWORK``, ``core/framework.py``); it, ``verl_names``, ``patches``, ``settings``,
``startup`` and ``plugin`` import no torch at module level; the integrations' shared core (``integrations/core/``)
does the finding, recognizing, planning, patching, installing at start-up and describing.
"""
from ..core.framework import Framework
from . import patches, startup, verl_names
from .settings import IMPL_BACKEND

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "IMPL_BACKEND",
           "VerlPartsNotRecognized"]

FRAMEWORK = Framework("verl", package="verl", distribution="verl", version_file="version/version", module=__name__,
                      names=verl_names, patches=patches, startup=startup)
VerlPartsNotRecognized = FRAMEWORK.refused_warning  # install()'s warning: parts of verl left as shipped

install, uninstall, is_installed, installed_settings, refused, describe = FRAMEWORK.public_functions(
    """Make twinkle-mem a backend of the verl this process imports; idempotent, undone by :func:`uninstall`.

    Its keyword arguments are the settings of ``settings.py`` (the signature is built from them): ``logits_path``:
    verl's logits path on twinkle-mem's op too; ``fused_chunk_bytes``: the fused head's block working memory (256 MiB
    by default). The fused heads themselves act only for a model whose config says ``impl_backend=twinkle``. A part
    of verl not recognized is left as shipped, with a :class:`VerlPartsNotRecognized` warning.""")
