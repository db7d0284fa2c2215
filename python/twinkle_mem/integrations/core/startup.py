"""An integration's variable: install() in every process of a job, from the environment, with no code change.

One grammar for every integration (``TWINKLE_MEM_INSTALL`` for twinkle-kit, ``TWINKLE_MEM_VERL`` for verl):
``0`` or empty is off, ``1`` is install() with its defaults, else a comma-separated list of install()'s
keyword arguments, a bare name meaning ``True`` (``fused_lm_head,mask_skip=always,fused_chunk_bytes=128M``).
Each argument's parser and check are its setting's (``settings.py``): a bad value raises ``ValueError`` naming
the variable, the bad part and the accepted values. :class:`Variable` also says what a value would do
(``python -m twinkle_mem``) and runs the install a framework's start-up hook asks for, with one log line per
process; :func:`import_hook_status` says whether the hook that installs at a framework's import (the .pth of
``twinkle_mem_startup.py``) is in place. No torch here.
"""
import logging
import os
from typing import Any, Callable, Dict, Optional

from .settings import Settings

HOOK_PTH = "twinkle_mem_startup.pth"  # imports twinkle_mem_startup, the hook of every variable read at import

# Words meaning on or off, written where the variable wants '1' or '0'.
_HINTS = {**{word: " ('0' alone is off)" for word in ("false", "off", "no", "none")},
          **{word: " ('1' alone is {function}() with its defaults)" for word in ("1", "true", "on", "yes")}}


class Variable:
    """The environment variable of one integration.

    ``framework``: how messages name the framework ("twinkle-kit"); ``package``: the package whose import the
    variable acts on ("twinkle"); ``unset_means_defaults``: an unset variable is install() with its defaults
    (verl: the entry point installs, the variable adjusts) rather than off (twinkle: the variable opts in)."""

    def __init__(self, name: str, settings: Settings, *, framework: str, package: str, example: str,
                 logger: str, unset_means_defaults: bool = False, function: str = "install", invalid: str = ""):
        self.name, self.settings, self.function = name, settings, function
        # what a process importing the package does with an invalid value
        self.invalid = invalid or f"`import {package}` raises"
        self.framework, self.package, self.unset_means_defaults = framework, package, unset_means_defaults
        self.accepted = settings.accepted(function) + f"; e.g. {example!r}"
        self.logger = logging.getLogger(logger)
        self._announced = False

    def parse(self, value: Optional[str]) -> Optional[Dict[str, Any]]:
        """install()'s keyword arguments the value asks for; ``None`` when it is off (and, unless
        ``unset_means_defaults``, when it is unset). Raises ``ValueError`` naming the variable, the bad part and the
        accepted values."""
        if value is None and self.unset_means_defaults:
            return {}
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
            if name not in self.settings.by_name:
                hint = _HINTS.get(name.lower(), "").format(function=self.function)
                raise self.error(value, f"{part!r} is not an argument of {self.function}(){hint}")
            if name in options:
                raise self.error(value, f"{name!r} is given twice")
            try:
                options[name] = self.settings.by_name[name].parser.parse(arg)
            except ValueError as why:
                raise self.error(value, f"{part!r}: {name} {why}") from None
        if not options:
            raise self.error(value, "no argument given")
        try:
            self.settings.check(options)
        except ValueError as why:
            raise self.error(value, str(why)) from None
        return options

    def error(self, value: Optional[str], problem: str) -> ValueError:
        return ValueError(f"{self.name}={value!r}: {problem}; {self.accepted}")

    def install_call(self, options: Dict[str, Any]) -> str:
        """``install(...)`` as the variable's options spell it."""
        return f"{self.function}(" + ", ".join(f"{name}={arg!r}" for name, arg in options.items()) + ")"

    def describe(self, value: Optional[str]) -> str:
        """What a process importing the package would do with this value (``python -m twinkle_mem``)."""
        shown = f"{self.name} unset" if value is None else f"{self.name}={value!r}"
        try:
            options = self.parse(value)
        except ValueError as error:
            return f"invalid, {self.invalid}: {error}"
        if options is None:
            return f"{shown}: off ({self.framework} runs as shipped)"
        return f"{shown}: {self.install_call(options)} in every process that imports {self.package}"

    def install_from_environment(self, install_settings: Callable[[Dict[str, Any]], Any], version: Callable[[], str],
                                 advice: str) -> Optional[Dict[str, Any]]:
        """install() as the variable asks, run by the framework's start-up hook: returns the options installed
        (``None`` when off). A failure raises, naming the variable, what was called and ``advice`` (how to run
        the framework as shipped)."""
        value = os.environ.get(self.name)
        options = self.parse(value)
        if options is None:
            return None
        try:
            install_settings({**self.settings.defaults(), **options})
        except Exception as error:
            raise RuntimeError(f"{self.name}={value!r}: {self.install_call(options)} failed when {self.package} "
                               f"was imported: {error}. {advice}") from error
        if value is not None:  # (the variable asked: one line; an entry point's defaults say nothing)
            self._announce(value, options, version)
        return options

    def _announce(self, value: str, options: Dict[str, Any], version: Callable[[], str]) -> None:
        """One line per process, at INFO (unless the application set the logger's level). Where no logging is set
        up (no handler on the logger or above it) it gets a stderr handler of its own, so that the line shows in a
        Ray worker's log and a torchrun child's output; otherwise it goes where the application's handlers send
        it."""
        if self._announced:
            return
        self._announced = True
        logger = self.logger
        if logger.level == logging.NOTSET:  # a level the application set stays
            logger.setLevel(logging.INFO)
        if not logger.hasHandlers():  # no logging set up (a Ray worker, a torchrun child): stderr
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
            logger.addHandler(handler)
        rank = os.environ.get("RANK")
        where = f"pid {os.getpid()}" + (f", rank {rank}" if rank is not None else "")
        if os.environ.get("LOCAL_RANK") is not None:
            where += f", local rank {os.environ['LOCAL_RANK']}"
        logger.info("twinkle-mem installed into %s %s by %s=%r: %s (%s)", self.framework, version(), self.name, value,
                    self.install_call(options), where)


def import_hook_status(variable: str) -> str:
    """Whether the start-up hook that installs at a framework's import (``twinkle_mem_startup.py``, its .pth in a
    site-packages folder) is installed and active here: without it ``variable`` does nothing."""
    import importlib.util
    import site
    import sys
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    found = [os.path.join(f, HOOK_PTH) for f in folders if os.path.exists(os.path.join(f, HOOK_PTH))]
    active = any(type(finder).__name__ == "TwinkleImportHook" for finder in sys.meta_path)
    if not found:
        return (f"not installed (no {HOOK_PTH} in {', '.join(folders)}): {variable} does nothing; "
                f"reinstall with pip" + ("; a hook is active in this process all the same" if active else ""))
    if active:
        return f"installed ({found[0]}), active in this process"
    if importlib.util.find_spec("twinkle_mem_startup") is None:
        return (f"broken: {found[0]} is there but its module twinkle_mem_startup is not: {variable} does nothing; "
                "reinstall twinkle-mem with pip")
    return f"installed ({found[0]}), not active in this process (Python started with -S?)"
