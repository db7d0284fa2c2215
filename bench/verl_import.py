"""Importing verl for a benchmark on one device, without a Ray cluster.

``import verl`` runs verl/__init__.py, which imports ``verl.protocol``, which imports Ray (for ``ray.ObjectRef``
in its annotations) and tensordict; verl.utils imports omegaconf. A forward on one device calls none of Ray, and
Ray's wheel (about 70 MB) is more than the device tool carries. So where Ray is not installed, a stand-in module
of that one name takes its place before verl is imported, and the run says so. Every other missing module is a
refusal: :func:`missing` names them, and the benchmarks print one sentence saying what to carry
(``bash bench/carry_wheels.sh``).
"""
from __future__ import annotations

import importlib.util
import sys
import types

# What `import verl` and the modules the benchmarks use need beyond torch, transformers and numpy (verl 0.9.1,
# read from its imports; Ray stood in for).
NEEDED = ("verl", "tensordict", "omegaconf", "transformers", "packaging")
RAY_NOTE = ("Ray is not installed: a stand-in module named ray (ObjectRef alone, never called) let `import verl` "
            "run (verl.protocol imports Ray; a forward on one device uses none of it)")


def missing(extra: tuple[str, ...] = ()) -> list[str]:
    """The modules of NEEDED (and ``extra``) that do not import here."""
    return [name for name in NEEDED + tuple(extra) if importlib.util.find_spec(name) is None]


def refusal(names: list[str]) -> str:
    """The one sentence a run that cannot import verl prints."""
    return (f"not run: {', '.join(names)} {'is' if len(names) == 1 else 'are'} not installed here (verl's import "
            "needs them; on a device machine without a registry, `bash bench/carry_wheels.sh` puts their wheels in "
            ".whl/ and bench/gpu_check.sh unpacks them: carry .whl)")


def import_verl() -> str:
    """Import verl, standing in for Ray where it is not installed; returns RAY_NOTE then, else ""."""
    note = ""
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        ray = types.ModuleType("ray")
        ray.ObjectRef = type("ObjectRef", (), {})
        ray.__twinkle_mem_stand_in__ = True
        sys.modules["ray"] = ray
    if getattr(sys.modules.get("ray"), "__twinkle_mem_stand_in__", False):
        note = RAY_NOTE
    import verl  # noqa: F401
    return note
