"""How an integration recognizes the framework it meets: by what its code is, not by its version string.

Each integration declares, in its names module (twinkle's ``twinkle_names.py``, verl's ``verl_names.py``):
- :class:`Name`: each function, method, class or attribute it patches or reads, the parameters it calls a
  function with, whether it may be absent, and why it is used;
- :class:`Feature`: what the framework's code does where the integration depends on it, read from the source:
  each recognized form, or None (unrecognized);
- :class:`Part`: what install() patches, each with the names and features it needs and the setting that asks
  for it. A part whose names or features are not what is expected is refused by name: the framework runs that
  part as it ships it;
- :class:`Engine` (where a framework has several): the parts that serve each engine, and why.

:func:`recognize` reads a package's source (``source.py``) against those, importing nothing (each framework's
declaration, ``framework.py``, caches it per folder).
"""
import importlib.util
import os
import sys
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from . import source as src
from .settings import Setting


class Name(NamedTuple):  # (named tuples: cheaper to define than dataclasses, at `import twinkle`)
    module: str
    qualname: str  # "f", "Class.f", "Class" or "Class.attribute"
    kind: str  # "function", "staticmethod", "bound" (a name a module binds), "attribute"
    params: Optional[str] = None  # the parameters the integration calls it with (functions)
    optional: bool = False  # absent in some releases: the integration does without it there
    why: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    def __str__(self):
        return f"{self.module}.{self.qualname}"


def names_table(*entries: Name) -> Dict[str, Name]:
    return {e.key: e for e in entries}


class Feature(NamedTuple):
    key: str
    doc: str  # what the framework's code does there (the refusal's words)
    check: Callable[[src.PackageSource], object]  # the form found, None (or False) where not recognized


class Part(NamedTuple):
    key: str
    what: str
    asked: Optional[Setting]  # the setting that asks for it (true); None: always
    names: Tuple[Name, ...]
    features: Tuple[Tuple[Feature, tuple], ...] = ()  # (feature, the forms it works with)

    def is_asked(self, settings: Dict) -> bool:
        return self.asked is None or bool(self.asked.of(settings))


class Engine(NamedTuple):
    """One of a framework's engines (verl's fsdp, megatron, ...): the module that defines it and the parts that would
    serve it, each with the feature of the engine's code that sends it through that part's patched names (read for
    ``python -m twinkle_mem`` only: install() patches parts, whichever engine runs). An engine whose module is
    absent is not in that release."""
    key: str
    module: str
    served: Tuple[Tuple[Part, Feature], ...]


class Found(NamedTuple):
    """A framework as an integration sees it: each name's problem (None: as expected), each feature's form."""
    folder: str
    version: Optional[str]
    names: Dict[str, Optional[str]]  # Name.key -> why not as expected, or None
    features: Dict[str, object]  # Feature.key -> the form found

    def refusals(self, part: Part) -> Tuple[str, ...]:
        """Why ``part`` cannot be patched here, one reason per name or feature; () where it can."""
        why = [f"{name}: {self.names[name.key]}" for name in part.names if self.names[name.key] and not name.optional]
        why += [f"{feature.doc}: not recognized" for feature, accepted in part.features
                if self.features[feature.key] not in accepted]
        return tuple(why)


def check_name(source: src.PackageSource, name: Name) -> Optional[str]:
    """Why ``name`` is not what the integration expects, or None."""
    *owner, last = name.qualname.split(".")
    if not source.has_module(name.module):
        return "absent (no such module)"
    if name.kind == "bound":
        return None if source.binds(name.module, last) else "absent"
    if name.kind == "attribute":
        return None if source.declares(name.module, owner[0], last) else "absent"
    node = source.function(name.module, name.qualname, body=False)
    if node is None:
        return "absent"
    if (name.kind == "staticmethod") != src.decorated(node, "staticmethod") and owner:
        return "a staticmethod expected" if name.kind == "staticmethod" else "an unexpected staticmethod"
    return src.accepts(node, name.params) if name.params is not None else None


def recognize(folder: str, names: Dict[str, Name], features: Tuple[Feature, ...]) -> Found:
    """Read the package at ``folder`` (nothing imported) against ``names`` and ``features``."""
    source = src.PackageSource(folder)
    # The features first: they parse their functions whole, which the names' header checks then reuse.
    forms = {f.key: f.check(source) for f in features}
    return Found(folder, source.version(), {k: check_name(source, n) for k, n in names.items()}, forms)


def package_folder(package: str, framework: str) -> str:
    """The folder of the package ``package`` this process imports (found, not imported)."""
    module = sys.modules.get(package)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{framework} is not installed (no `{package}` package on the path)")
    return os.path.realpath(list(spec.submodule_search_locations)[0])
