"""``TWINKLE_MEM_VERL`` and the ``verl.plugins`` entry point: install() in every process that imports verl.

verl 0.9.0 on loads the entry points of its ``verl.plugins`` group at ``import verl``, in the driver and in each
Ray worker; twinkle-mem's (``plugin.py``) runs ``FRAMEWORK.install_from_environment`` (``core/framework.py``).
The variable adjusts what it installs, with the grammar every twinkle-mem variable has (``core/startup.py``): unset or ``1``: install() with
its defaults (the fused heads, for models with ``impl_backend=twinkle``); ``0``: nothing; else install()'s
arguments, e.g. ``logits_path,fused_chunk_bytes=128M``. ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's own switch)
keeps verl from loading any plugin. This module imports no torch and does not install anything itself.
"""
import os

from ..core.framework import StartupHook
from ..core.startup import Variable
from .settings import SETTINGS

ENV_VAR = "TWINKLE_MEM_VERL"
ENTRY_POINT = "twinkle_mem"  # its name in the verl.plugins group (VERL_USE_EXTERNAL_PLUGINS lists plugins by name)

VARIABLE = Variable(ENV_VAR, SETTINGS, framework="verl", package="verl", logger="twinkle_mem.verl",
                    example="logits_path,fused_chunk_bytes=128M", unset_means_defaults=True,
                    invalid="`import verl` logs it as an error and runs verl without twinkle-mem")


def entry_point_status() -> str:
    """Whether verl loads twinkle-mem's entry point in a process started now (``python -m twinkle_mem``)."""
    from importlib.metadata import entry_points
    declared = [ep for ep in entry_points(group="verl.plugins") if ep.name == ENTRY_POINT]
    if not declared:
        return "not declared (no twinkle_mem entry point in the verl.plugins group): reinstall twinkle-mem with pip"
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    loaded = policy == "auto" or (policy != "none" and ENTRY_POINT in {n.strip() for n in policy.split(",")})
    return (f"declared ({declared[0].value}); VERL_USE_EXTERNAL_PLUGINS={policy}: "
            + ("loaded at `import verl`" if loaded else "not loaded"))


# A part of verl not recognized is left as shipped, with a warning in the log; a failure is logged as an error and
# raised (verl would log it at debug level only).
HOOK = StartupHook("verl.plugins entry point", entry_point_status, failure_logged="twinkle-mem's verl plugin failed; "
                   "verl runs without it", advice=f"To run verl without twinkle-mem, set {ENV_VAR}=0 or "
                                                  "VERL_USE_EXTERNAL_PLUGINS=none.")
