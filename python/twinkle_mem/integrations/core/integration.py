"""What every integration does alike: install() with checked settings (recognize the framework by its code, plan
the parts its settings ask for, refuse by name what is not recognized, patch the rest), uninstall(), and the
describe() lines and refusal message of ``python -m twinkle_mem``.

An integration is one :class:`Integration` (its framework's name, settings, parts, patch points, plan class
and how it finds the framework), and thin public functions around it (``integrations/twinkle/__init__.py``,
``integrations/verl/__init__.py``). No torch here.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from .patching import Patcher
from .install_plan import InstallPlan
from .recognition import Found, Part
from .settings import Settings


class PartsNotRecognized(UserWarning):
    """install() left parts of the framework as shipped: their names or features are not what it expects.
    ``refused``: {part: (why, ...)}. Each integration has its own subclass (TwinklePartsNotRecognized, ...)."""

    def __init__(self, message: str, refused: Dict[str, Tuple[str, ...]]):
        super().__init__(message)
        self.refused = refused


class Integration:
    def __init__(self, framework: str, settings: Settings, parts: Tuple[Part, ...], patcher: Patcher,
                 plan_class: Type[InstallPlan], found: Callable[[], Found], version_file: str,
                 before_install: Callable[[], None] = lambda: None):
        self.framework, self.settings, self.parts, self.patcher = framework, settings, parts, patcher
        self.plan_class, self.found, self.before_install = plan_class, found, before_install
        self.version_file = version_file  # where the framework says its version (messages quote it)
        self.plan: Optional[InstallPlan] = None  # the plan in effect in this process (None: not installed)

    def install_settings(self, values: Dict[str, Any], strict: bool = False) -> InstallPlan:
        """install() itself, with every setting given (``values``); ``strict`` (a variable's install): a part not
        recognized raises, nothing patched. The same settings again are a no-op; others reinstall."""
        self.settings.check(values)
        self.before_install()
        if self.plan is not None and self.plan.settings == values:
            return self.plan
        plan = self.plan_class.for_settings(self.parts, values, self.found())
        if strict and plan.refused:
            raise RuntimeError(self.refusal_message(plan.refused))
        self.uninstall()
        self.patcher.apply(plan)
        self.plan = plan
        return plan

    def uninstall(self) -> None:
        """Restore everything install() replaced; a no-op when not installed."""
        self.patcher.restore()
        self.plan = None

    def is_installed(self) -> bool:
        return self.plan is not None

    def installed_settings(self) -> Optional[Dict[str, Any]]:
        return dict(self.plan.settings) if self.plan is not None else None

    def refused(self) -> Dict[str, Tuple[str, ...]]:
        return dict(self.plan.refused) if self.plan is not None else {}

    def describe(self, given: Dict[str, Any]) -> List[str]:
        """The framework this process would import (found, not imported) and what install(**given) patches there,
        part by part; raises ImportError without the framework."""
        found = self.found()
        plan = self.plan_class.for_settings(self.parts, self.settings.bind("install", given), found)
        return [f"{self.framework} at {found.folder} ({self.version_file} says {found.version})",
                *plan.describe(self.parts)]

    def refusal_message(self, refused: Dict[str, Tuple[str, ...]]) -> str:
        found = self.found()
        parts = "; ".join(f"{part} ({', '.join(why)})" for part, why in refused.items())
        return (f"the {self.framework} at {found.folder} ({self.version_file} says {found.version}) is not what "
                f"twinkle-mem expects for: {parts}. Those parts run as {self.framework} ships them")
