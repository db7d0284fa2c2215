"""twinkle-mem's start-up hook, imported at every interpreter start by ``twinkle_mem_startup.pth``.

When a process imports twinkle-kit (``import twinkle``, or any twinkle module first: Python runs
twinkle's package before its modules) and ``TWINKLE_MEM_INSTALL`` is set and not ``0``, twinkle-mem
is installed right after twinkle's package has run, before any twinkle model can exist
(``twinkle_mem.integrations.twinkle.startup``). That reaches the processes a script's own
``install()`` cannot: ``torchrun`` children and twinkle's Ray workers.

At start-up this module only puts a finder on ``sys.meta_path``: it imports nothing (neither torch
nor twinkle_mem), reads no variable and never raises. The finder answers ``None`` for every import
but ``twinkle``, and for that one too while the variable is unset or ``0``.
"""
import os
import sys

ENV_VAR = "TWINKLE_MEM_INSTALL"


def _off(value: str) -> bool:
    return value.strip() in ("", "0")


class _InstallAfterTwinkle:
    """twinkle's own loader, with twinkle-mem's install run right after twinkle's package executes."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        # twinkle's package replaces itself by a lazy module sharing this spec: give both the real loader back.
        module.__spec__.loader = module.__loader__ = self.loader
        try:
            from twinkle_mem.integrations.twinkle.startup import install_from_environment
        except Exception as error:
            raise ImportError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} asks to install twinkle-mem, which does not "
                              f"import here ({type(error).__name__}: {error}); reinstall twinkle-mem or unset "
                              f"{ENV_VAR}") from error
        install_from_environment()  # an error here fails `import twinkle`, and so the job, at its start

    def __getattr__(self, name):  # anything else a caller asks a loader for
        return getattr(self.loader, name)


class TwinkleImportHook:
    """A meta-path finder that wraps the loader of the top-level ``twinkle`` package when the variable asks."""

    def find_spec(self, name, path=None, target=None):
        if name != "twinkle" or _off(os.environ.get(ENV_VAR, "")):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if hasattr(spec.loader, "exec_module"):
            spec.loader = _InstallAfterTwinkle(spec.loader)
        return spec


def register() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(type(finder).__name__ == "TwinkleImportHook" for finder in sys.meta_path):
        sys.meta_path.insert(0, TwinkleImportHook())


register()
