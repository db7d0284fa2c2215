"""install()'s plan: its settings and what it patches on the framework it found, part by part."""
from typing import Any, Dict, FrozenSet, List, NamedTuple, Tuple

from .recognition import Feature, Found, Part
from .settings import Setting


class InstallPlan(NamedTuple):
    """install()'s settings and what it patches on the framework it found. An integration subclasses it for
    what its patches ask of the plan beyond :meth:`patches`, :meth:`value` and :meth:`feature`."""
    settings: Dict[str, Any]
    accepted: FrozenSet[str]  # the keys of the parts patched
    refused: Dict[str, Tuple[str, ...]]  # the parts asked for but not recognized: why, one reason per name
    features: Dict[str, Any]

    framework = "the framework"  # (a class attribute: the name the describe() lines give it)

    @classmethod
    def for_settings(cls, parts: Tuple[Part, ...], settings: Dict[str, Any], found: Found) -> "InstallPlan":
        asked = [p for p in parts if p.is_asked(settings)]
        refused = {p.key: found.refusals(p) for p in asked if found.refusals(p)}
        return cls(dict(settings), frozenset(p.key for p in asked if p.key not in refused), refused,
                   dict(found.features))

    def patches(self, part: Part) -> bool:
        """Whether ``part`` is patched."""
        return part.key in self.accepted

    def value(self, setting: Setting) -> Any:
        return setting.of(self.settings)

    def feature(self, feature: Feature) -> Any:
        """The form of ``feature`` the framework's code has."""
        return self.features[feature.key]

    def status(self, part: Part) -> str:
        """What install() with these settings would do to ``part`` (describe()'s words): patch it (recognized),
        refuse it (not recognized: why), or leave it (not asked for)."""
        if not part.is_asked(self.settings):
            return f"not asked for ({part.asked.name}={part.asked.of(self.settings)!r})"
        if part.key in self.refused:
            return f"refused, would run as {self.framework} ships it ({'; '.join(self.refused[part.key])})"
        return "would be patched (recognized)"

    def notes(self) -> List[str]:
        """describe()'s lines after the parts' (an integration's own)."""
        return []

    def describe(self, parts: Tuple[Part, ...]) -> List[str]:
        """What install() would patch with these settings, part by part (``describe()``)."""
        return [f"{part.key:28s} {part.what}: {self.status(part)}" for part in parts] + self.notes()
