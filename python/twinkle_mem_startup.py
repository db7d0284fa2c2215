"""twinkle-mem's start-up hook, imported at every interpreter start by ``twinkle_mem_startup.pth``.

When a process imports twinkle-kit (``import twinkle``, or any twinkle module first: Python runs
twinkle's package before its modules) and ``TWINKLE_MEM_INSTALL`` is set and not ``0``, twinkle-mem's
``install(...)`` runs right after twinkle's package has run, before any twinkle model can exist
(``twinkle_mem.integrations.twinkle.startup``). That reaches the processes a script's own
``install()`` cannot: ``torchrun`` children and twinkle's Ray workers. ``install()`` patches each
twinkle module when the process first imports it (:func:`after_import`), so a process pays only for
the twinkle it uses. The same holds for every framework of :data:`BY_VARIABLE`, each with its variable.

At start-up this module only puts a finder on ``sys.meta_path``: it imports nothing (neither torch
nor twinkle_mem), reads no variable and never raises. The finder answers ``None`` for every import
but ``twinkle`` (and that one too while its variable is unset or ``0``), the other packages of
:data:`BY_VARIABLE` alike, and the modules
:func:`after_import` was given.
"""
import os
import sys

# The frameworks whose variable installs twinkle-mem right after their package has run: package -> (variable,
# the integration whose FRAMEWORK installs). A framework with a hook of this kind adds its line here (a test holds
# the table to the frameworks' declarations).
BY_VARIABLE = {"twinkle": ("TWINKLE_MEM_INSTALL", "twinkle_mem.integrations.twinkle"),
               "swift": ("TWINKLE_MEM_SWIFT", "twinkle_mem.integrations.swift")}

# Set while the hook imports twinkle_mem.integrations.twinkle, so that twinkle_mem's package leaves torch alone.
importing_without_torch = False

_after = {}  # module name -> callbacks run, once, right after that module has executed


def after_import(name, callback):
    """Run ``callback(module)`` right after the module ``name`` executes, the next time it is imported (once).
    For a module not yet in ``sys.modules``; install() patches the others at once."""
    register()
    _after.setdefault(name, []).append(callback)


def forget(callback):
    """Drop a callback :func:`after_import` was given, wherever it waits."""
    for name in list(_after):
        _after[name] = [c for c in _after[name] if c is not callback]
        if not _after[name]:
            del _after[name]


def _off(value: str) -> bool:
    return value.strip() in ("", "0")


def _asked(package):
    """Whether the variable of ``package`` (a key of BY_VARIABLE) asks for an install now."""
    return package in BY_VARIABLE and not _off(os.environ.get(BY_VARIABLE[package][0], ""))


def _install_from_variable(package="twinkle"):
    global importing_without_torch
    variable, integration = BY_VARIABLE[package]
    importing_without_torch = True
    try:
        import importlib
        framework = importlib.import_module(integration).FRAMEWORK
    except Exception as error:
        raise ImportError(f"{variable}={os.environ.get(variable)!r} asks to install twinkle-mem, which does not "
                          f"import here ({type(error).__name__}: {error}); reinstall twinkle-mem or unset "
                          f"{variable}") from error
    finally:
        importing_without_torch = False
    framework.install_from_environment()  # an error here fails `import <package>`, and so the job, at its start


class _RunAfter:
    """A module's own loader, with what twinkle-mem waits for run right after the module executes."""

    def __init__(self, loader, name, install_from_variable):
        self.loader, self.name, self.install_from_variable = loader, name, install_from_variable

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        # twinkle's packages replace themselves by a lazy module sharing this spec: give both the real loader back.
        module.__spec__.loader = module.__loader__ = self.loader
        if self.install_from_variable:
            _install_from_variable(self.name)
        for callback in _after.pop(self.name, []):
            callback(sys.modules.get(self.name, module))

    def __getattr__(self, name):  # anything else a caller asks a loader for
        return getattr(self.loader, name)


class TwinkleImportHook:
    """A meta-path finder that wraps the loaders of the modules twinkle-mem waits for (a spec found but never
    executed, as importlib.util.find_spec returns, runs nothing)."""

    def find_spec(self, name, path=None, target=None):
        by_variable = _asked(name)
        if not (by_variable or name in _after):
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
            spec.loader = _RunAfter(spec.loader, name, by_variable)
        return spec


def register() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(type(finder).__name__ == "TwinkleImportHook" for finder in sys.meta_path):
        sys.meta_path.insert(0, TwinkleImportHook())


register()
