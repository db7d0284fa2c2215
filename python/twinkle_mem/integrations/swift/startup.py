"""``TWINKLE_MEM_SWIFT``: :func:`install` in every process of an ms-swift job, from one variable or ms-swift's own
``--external_plugins`` hook.

Two ways in, one grammar (every twinkle-mem variable's: ``core/startup.py``):

- the start-up hook (``twinkle_mem_startup.py``, put in site-packages by pip; this package's line in its
  ``BY_VARIABLE``) runs ``FRAMEWORK.install_from_environment`` right after ``import swift`` in every process where
  ``TWINKLE_MEM_SWIFT`` is set and not ``0``: the launcher's torchrun children, deepspeed's, ms-swift's Ray workers
  inherit the variable;
- the plugin file (:data:`PLUGIN`, given to ``--external_plugins``) runs :func:`install_from_plugin` in every process
  that parses ms-swift's arguments: an unset variable is install() with its defaults there, ``0`` turns it off.

Values: ``1``: install() with its defaults; else a comma-separated list of install()'s keyword arguments, a bare name
meaning true (``logits_path=0,fused_chunk_bytes=128M``). A bad value, or a part of ms-swift install() does not
recognize (``swift_names.py``), raises: the job fails at its start instead of training as shipped. No torch here.
"""
import os
from typing import Any, Dict, Optional

from ..core.framework import StartupHook
from ..core.startup import Variable, import_hook_status
from .settings import SETTINGS

ENV_VAR = "TWINKLE_MEM_SWIFT"
PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin.py")  # the --external_plugins file
_EXAMPLE = "logits_path=0,fused_chunk_bytes=128M"

VARIABLE = Variable(ENV_VAR, SETTINGS, framework="ms-swift", package="swift", logger="twinkle_mem.swift",
                    example=_EXAMPLE)
# The same variable as the plugin file reads it: listing the plugin asks for install() with its defaults.
PLUGIN_VARIABLE = Variable(ENV_VAR, SETTINGS, framework="ms-swift", package="swift", logger="twinkle_mem.swift",
                           example=_EXAMPLE, unset_means_defaults=True,
                           invalid="ms-swift's argument parsing raises where the plugin is listed")


def hook_status() -> str:
    """The .pth hook at ``import swift``, and the plugin file with what it does where it is listed (as the variable
    is set now)."""
    where_listed = PLUGIN_VARIABLE.describe(os.environ.get(ENV_VAR)).replace(" in every process that imports swift",
                                                                               "")
    return (f"{import_hook_status(ENV_VAR)}; the plugin file: --external_plugins {PLUGIN} (where it is listed, "
            f"{where_listed})")


# A part of ms-swift not recognized makes the variable's (and the plugin's) install raise: the job fails at its start
# instead of training with ms-swift as shipped.
HOOK = StartupHook("start-up hook", hook_status, strict=True,
                   advice=f"To run ms-swift as shipped, set {ENV_VAR}=0 (or leave twinkle-mem's plugin out of "
                          f"--external_plugins and {ENV_VAR} unset).")


def install_from_plugin() -> Optional[Dict[str, Any]]:
    """Run by the plugin file: install() with its defaults, or as the variable asks (None: ``0``)."""
    from . import FRAMEWORK
    return PLUGIN_VARIABLE.install_from_environment(lambda settings: FRAMEWORK.install_settings(settings, strict=True),
                                                    FRAMEWORK.version, advice=HOOK.advice)
