"""``TWINKLE_MEM_INSTALL``: :func:`install` in every process that imports twinkle, from one variable.

This module owns the variable: its grammar (:func:`parse`), what it would do (:func:`describe`, for
``python -m twinkle_mem``), and the install run by the start-up hook (``twinkle_mem_startup.py``, put
in site-packages by ``pip install``) right after twinkle's package has been imported
(:func:`install_from_environment`), with its one log line.

Values: unset, empty or ``0``: off. ``1``: ``install()`` with its defaults. Otherwise a comma-separated
list of ``install()``'s keyword arguments, a bare name meaning ``True``:
``fused_lm_head,mask_skip=always,fused_chunk_bytes=128M``. A value that is none of these, or a part of
twinkle-kit that ``install()`` does not recognize (twinkle_names.py), makes ``import twinkle`` raise, so the
job fails at its start instead of training with twinkle-kit as shipped. ``import twinkle`` itself imports no
more than it did: install() patches each twinkle module when the process imports it (patches.py), and this
module and those it imports need no torch.
"""
import logging
import os
import re
from typing import Any, Callable, Dict, Optional

from . import MASK_SKIP_MODES

ENV_VAR = "TWINKLE_MEM_INSTALL"
HOOK_PTH = "twinkle_mem_startup.pth"  # imports twinkle_mem_startup, the hook itself

logger = logging.getLogger("twinkle_mem.startup")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SIZE = re.compile(r"(\d+)\s*(?:([kmg])(?:i?b)?|b)?", re.IGNORECASE)
_UNITS = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

ACCEPTED = ("accepted: '1' (install() with its defaults), '0' or empty (off), or a comma-separated list of "
            "install()'s arguments: log_softmax, logits_guard, fused_lm_head (a bare name is true; or "
            "=true/false, =1/0, =yes/no, =on/off), mask_skip=" + "|".join(MASK_SKIP_MODES) +
            ", fused_chunk_bytes=<bytes, with K/M/G for KiB/MiB/GiB>|none; "
            "e.g. 'fused_lm_head,mask_skip=always,fused_chunk_bytes=128M'")


def _bool(text: Optional[str]) -> bool:
    if text is None or text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("is not a boolean")


def _bytes(text: Optional[str]) -> Optional[int]:
    if text is not None and text.lower() == "none":
        return None
    match = _SIZE.fullmatch(text or "")
    if match is None or int(match.group(1)) == 0:
        raise ValueError("must be a positive size in bytes (K/M/G suffixes for KiB/MiB/GiB) or none")
    return int(match.group(1)) * _UNITS[match.group(2) and match.group(2).lower()]


def _as_given(text: Optional[str]) -> Optional[str]:
    return text  # (install()'s own check_settings judges it, below)


# One parser per install() keyword argument (a test holds this to install()'s signature).
OPTIONS: Dict[str, Callable[[Optional[str]], Any]] = {
    "log_softmax": _bool, "mask_skip": _as_given, "logits_guard": _bool, "fused_lm_head": _bool,
    "fused_chunk_bytes": _bytes,
}


def parse(value: Optional[str]) -> Optional[Dict[str, Any]]:
    """``install()``'s keyword arguments the variable's value asks for; ``None`` when it is off.

    Raises ``ValueError`` naming the variable, the bad part and the accepted values."""
    text = (value or "").strip()
    if text in ("", "0"):
        return None
    if text == "1":
        return {}
    options: Dict[str, Any] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, arg = part.partition("=")
        name, arg = name.strip(), (arg.strip() if sep else None)
        if name not in OPTIONS:
            hint = _HINTS.get(name.lower(), "")
            raise _error(value, f"{part!r} is not an argument of install(){hint}")
        if name in options:
            raise _error(value, f"{name!r} is given twice")
        try:
            options[name] = OPTIONS[name](arg)
        except ValueError as why:
            raise _error(value, f"{part!r}: {name} {why}") from None
    if not options:
        raise _error(value, "no argument given")
    from . import check_settings
    try:
        check_settings(options)
    except ValueError as why:
        raise _error(value, str(why)) from None
    return options


# Words meaning on or off, written where the variable wants '1' or '0'.
_HINTS = {**{word: " ('0' alone is off)" for word in ("false", "off", "no", "none")},
          **{word: " ('1' alone is install() with its defaults)" for word in ("1", "true", "on", "yes")}}


def _error(value: Optional[str], problem: str) -> ValueError:
    return ValueError(f"{ENV_VAR}={value!r}: {problem}; {ACCEPTED}")


def install_call(options: Dict[str, Any]) -> str:
    """``install(...)`` as the variable's options spell it."""
    return "install(" + ", ".join(f"{name}={arg!r}" for name, arg in options.items()) + ")"


def describe(value: Optional[str]) -> str:
    """What a process importing twinkle would do with this value (``python -m twinkle_mem``)."""
    if value is None:
        return f"{ENV_VAR} unset: off (twinkle-kit runs as shipped)"
    try:
        options = parse(value)
    except ValueError as error:
        return f"invalid, `import twinkle` raises: {error}"
    if options is None:
        return f"{ENV_VAR}={value!r}: off (twinkle-kit runs as shipped)"
    return f"{ENV_VAR}={value!r}: {install_call(options)} in every process that imports twinkle"


def hook_status() -> str:
    """Whether the start-up hook is installed (its .pth in a site-packages folder) and active here."""
    import importlib.util
    import site
    import sys
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    found = [os.path.join(f, HOOK_PTH) for f in folders if os.path.exists(os.path.join(f, HOOK_PTH))]
    active = any(type(finder).__name__ == "TwinkleImportHook" for finder in sys.meta_path)
    if not found:
        return (f"not installed (no {HOOK_PTH} in {', '.join(folders)}): {ENV_VAR} does nothing; "
                f"reinstall with pip" + ("; a hook is active in this process all the same" if active else ""))
    if active:
        return f"installed ({found[0]}), active in this process"
    if importlib.util.find_spec("twinkle_mem_startup") is None:
        return (f"broken: {found[0]} is there but its module twinkle_mem_startup is not: {ENV_VAR} does nothing; "
                "reinstall twinkle-mem with pip")
    return f"installed ({found[0]}), not active in this process (Python started with -S?)"


def install_from_environment() -> Optional[Dict[str, Any]]:
    """Run by the start-up hook right after twinkle's package is imported: install() as the variable asks.

    Returns the options installed (``None`` when off). Any failure raises, naming the variable; so does a part
    of twinkle-kit install() does not recognize (an explicit install() would leave it as shipped)."""
    from . import install, install_settings
    value = os.environ.get(ENV_VAR)
    options = parse(value)
    if options is None:
        return None
    try:
        install_settings({**install.__kwdefaults__, **options}, strict=True)
    except Exception as error:
        raise RuntimeError(f"{ENV_VAR}={value!r}: {install_call(options)} failed when twinkle was imported: "
                           f"{error}. To run twinkle-kit as shipped, unset {ENV_VAR} (or set it to 0); "
                           "install() called in the script patches the parts it recognizes and leaves the others "
                           "as shipped.") from error
    _announce(value, options)
    return options


_announced = False


def _announce(value: str, options: Dict[str, Any]) -> None:
    """One line per process, at INFO (unless the application set the logger's level). Where no logging is set
    up (no handler on the logger or above it) it gets a stderr handler of its own, so that the line shows in a
    Ray worker's log and a torchrun child's output; otherwise it goes where the application's handlers send it."""
    global _announced
    if _announced:
        return
    _announced = True
    if logger.level == logging.NOTSET:  # a level the application set stays
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():  # no logging set up (a Ray worker, a torchrun child): stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    from .twinkle_names import version
    rank = os.environ.get("RANK")
    where = f"pid {os.getpid()}" + (f", rank {rank}" if rank is not None else "")
    if os.environ.get("LOCAL_RANK") is not None:
        where += f", local rank {os.environ['LOCAL_RANK']}"
    logger.info("twinkle-mem installed into twinkle-kit %s by %s=%r: %s (%s)", version(), ENV_VAR, value,
                install_call(options), where)
