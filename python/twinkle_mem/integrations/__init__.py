"""Integrations of twinkle-mem into training frameworks (each imported on demand): twinkle-kit (``twinkle/``) and
verl (``verl/``), both on the shared core (``core/``)."""
_MODULES = ("twinkle", "verl")


def __getattr__(name):
    # twinkle_mem.integrations.twinkle without an import of its own, as the README writes it.
    if name in _MODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
