"""twinkle-mem in ms-swift: its GRPO log-probs and GKD loss from the LM head's input, its other log-probs on the op.

A user switches it on with ms-swift's own hook, nothing in their code: ``--external_plugins`` with twinkle-mem's
plugin file (:data:`PLUGIN`; ``python -m twinkle_mem`` prints its path), which ms-swift imports in every process that
parses arguments; or ``TWINKLE_MEM_SWIFT=1`` (or install()'s arguments), which twinkle-mem's start-up hook acts on
at ``import swift`` in every process. Either runs :func:`install` before any trainer exists.

What it patches (``patches.py``), each part recognized by ms-swift's code (``swift_names.py``) and refused by name
where it is not what twinkle-mem expects:

- ``grpo_fused_head``: GRPO's log-probs and entropy from the LM head's input (``grpo_head.py``);
- ``gkd_fused_head``: GKD's loss from the student's LM head input, full and top-k teacher (``gkd_head.py``);
- ``logits_path``: TRL's ``selective_log_softmax`` / ``entropy_from_logits`` where ms-swift binds them (DPO, GRPO under
  sequence parallelism) on twinkle-mem's op (``logits_path.py``).

This module, ``swift_names``, ``patches``, ``settings``, ``startup`` and ``plugin`` import no torch at module level.
"""
import os
import warnings
from typing import Any, Dict, List

from ..core.integration import Integration, PartsNotRecognized
from . import patches, swift_names
from .settings import SETTINGS

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "PLUGIN",
           "SwiftPartsNotRecognized"]

PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin.py")  # the --external_plugins file

INTEGRATION = Integration("ms-swift", SETTINGS, swift_names.PARTS, patches.PATCHER, patches.SwiftInstallPlan,
                          swift_names.found, "swift/version.py")


class SwiftPartsNotRecognized(PartsNotRecognized):
    """install() left parts of ms-swift as shipped: their names or features are not what it expects.
    ``refused``: {part: (why, ...)}."""


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process (by a call, the plugin file or the variable)."""
    return INTEGRATION.is_installed()


installed_settings = INTEGRATION.installed_settings  # install()'s arguments in effect here (None: not installed)
refused = INTEGRATION.refused  # the parts asked for and left as ms-swift ships them: {part: (why, ...)}
refusal_message = INTEGRATION.refusal_message
uninstall = INTEGRATION.uninstall  # restore everything install() replaced; a no-op when not installed


def install(**settings) -> None:
    """Put twinkle-mem into the ms-swift this process imports; idempotent, undone by :func:`uninstall`.

    Its keyword arguments are the settings of ``settings.py`` (the signature below is built from them):
    ``fused_lm_head``: GRPO's log-probs and GKD's loss from the LM head's input; ``logits_path``: TRL's
    log-prob functions where ms-swift binds them on twinkle-mem's op; ``fused_chunk_bytes``: the fused heads' block
    working memory (256 MiB by default). A part of ms-swift not recognized is left as shipped, with a
    :class:`SwiftPartsNotRecognized` warning."""
    plan = INTEGRATION.install_settings(SETTINGS.bind("install", settings))
    if plan.refused:
        warnings.warn(SwiftPartsNotRecognized(f"twinkle-mem: {refusal_message(plan.refused)}", plan.refused),
                      stacklevel=2)


install.__signature__ = SETTINGS.signature()


def describe(**settings) -> List[str]:
    """The ms-swift this process would import (found, not imported) and what install(**settings) patches there, part
    by part; raises ImportError without ms-swift."""
    return INTEGRATION.describe(settings)


def install_settings(settings: Dict[str, Any], strict: bool = False):
    """install() itself, every setting given (the plugin's and the variable's)."""
    return INTEGRATION.install_settings(settings, strict=strict)
