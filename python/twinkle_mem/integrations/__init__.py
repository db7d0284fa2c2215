"""Integrations of twinkle-mem into training frameworks (each imported on demand): twinkle-kit (``twinkle/``), verl
(``verl/``) and ms-swift (``swift/``), each one declaration (its ``FRAMEWORK``) on the shared core (``core/``)."""
# The frameworks, by their folder here: `python -m twinkle_mem` reports each (docs/architecture.md, "Adding a
# framework").
FRAMEWORKS = ("twinkle", "verl", "swift")


def declarations():
    """Each framework's declaration (``core/framework.py``), in FRAMEWORKS' order."""
    import importlib
    return [importlib.import_module(f"{__name__}.{name}").FRAMEWORK for name in FRAMEWORKS]


def __getattr__(name):
    # twinkle_mem.integrations.twinkle without an import of its own, as the README writes it.
    if name in FRAMEWORKS:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
