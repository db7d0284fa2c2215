"""twinkle-mem's ``verl.plugins`` entry point: loaded by ``import verl`` in every process, the driver and each
Ray worker (verl 0.9.0 on), it runs install() there before any engine is built.

``TWINKLE_MEM_VERL`` adjusts it, with the grammar every twinkle-mem variable has (``core/startup.py``): unset or
``1``: install() with its defaults (the fused heads, for models with ``impl_backend=twinkle``); ``0``: nothing;
else install()'s arguments, e.g. ``logits_path,fused_chunk_bytes=128M``. ``VERL_USE_EXTERNAL_PLUGINS=none``
(verl's own switch) keeps verl from loading any plugin.

verl logs a plugin that raises at DEBUG level and goes on: this one logs its own failure as an error, and a part of
verl it does not recognize as a warning, so that neither goes unseen (in a Ray worker: in that worker's log).
"""
import logging

from ..core.startup import Variable
from . import install_settings, refusal_message, verl_names
from .settings import SETTINGS

ENV_VAR = "TWINKLE_MEM_VERL"

VARIABLE = Variable(ENV_VAR, SETTINGS, framework="verl", package="verl", logger="twinkle_mem.verl",
                    example="logits_path,fused_chunk_bytes=128M", unset_means_defaults=True)

logger = logging.getLogger("twinkle_mem.verl")


def _install(settings):
    plan = install_settings(settings)
    if plan.refused:
        logger.warning("twinkle-mem: %s", refusal_message(plan.refused))
    return plan


def load():
    """install() as ``TWINKLE_MEM_VERL`` asks; returns the options installed (None: off)."""
    try:
        return VARIABLE.install_from_environment(
            _install, verl_names.version,
            advice=f"To run verl without twinkle-mem, set {ENV_VAR}=0 or VERL_USE_EXTERNAL_PLUGINS=none.")
    except Exception:
        logger.exception("twinkle-mem's verl plugin failed; verl runs without it")
        raise


load()
