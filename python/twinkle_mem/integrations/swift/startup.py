"""``TWINKLE_MEM_SWIFT``: :func:`install` in every process of an ms-swift job, from one variable or ms-swift's own
``--external_plugins`` hook.

Two ways in, one grammar (every twinkle-mem variable's: ``core/startup.py``):

- the start-up hook (``twinkle_mem_startup.py``, put in site-packages by pip) runs :func:`install_from_environment`
  right after ``import swift`` in every process where ``TWINKLE_MEM_SWIFT`` is set and not ``0``: the launcher's
  torchrun children, deepspeed's, ms-swift's Ray workers inherit the variable;
- the plugin file (``plugin.py``, given to ``--external_plugins``) runs :func:`install_from_plugin` in every process
  that parses ms-swift's arguments: an unset variable is install() with its defaults there, ``0`` turns it off.

Values: ``1``: install() with its defaults; else a comma-separated list of install()'s keyword arguments, a bare name
meaning true (``logits_path=0,fused_chunk_bytes=128M``). A bad value, or a part of ms-swift install() does not
recognize (``swift_names.py``), raises: the job fails at its start instead of training as shipped. No torch here.
"""
from typing import Any, Dict, Optional

from ..core.startup import Variable
from .settings import SETTINGS

ENV_VAR = "TWINKLE_MEM_SWIFT"
_EXAMPLE = "logits_path=0,fused_chunk_bytes=128M"

VARIABLE = Variable(ENV_VAR, SETTINGS, framework="ms-swift", package="swift", logger="twinkle_mem.swift",
                    example=_EXAMPLE)
# The same variable as the plugin file reads it: listing the plugin asks for install() with its defaults.
PLUGIN_VARIABLE = Variable(ENV_VAR, SETTINGS, framework="ms-swift", package="swift", logger="twinkle_mem.swift",
                           example=_EXAMPLE, unset_means_defaults=True,
                           invalid="ms-swift's argument parsing raises where the plugin is listed")

_ADVICE = (f"To run ms-swift as shipped, set {ENV_VAR}=0 (or leave twinkle-mem's plugin out of --external_plugins "
           f"and {ENV_VAR} unset).")


def _install(variable: Variable) -> Optional[Dict[str, Any]]:
    from . import install_settings, swift_names
    return variable.install_from_environment(lambda settings: install_settings(settings, strict=True),
                                             swift_names.version, advice=_ADVICE)


def install_from_environment() -> Optional[Dict[str, Any]]:
    """Run by the start-up hook right after ``import swift``: install() as the variable asks (None: off)."""
    return _install(VARIABLE)


def install_from_plugin() -> Optional[Dict[str, Any]]:
    """Run by the plugin file: install() with its defaults, or as the variable asks (None: ``0``)."""
    return _install(PLUGIN_VARIABLE)


def describe(value: Optional[str]) -> str:
    """What the variable would do, at ``import swift`` and where the plugin is listed (``python -m twinkle_mem``)."""
    return (f"at `import swift`: {VARIABLE.describe(value)}; where --external_plugins lists the plugin: "
            f"{PLUGIN_VARIABLE.describe(value)}")
