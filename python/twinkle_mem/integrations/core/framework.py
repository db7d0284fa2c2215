"""A framework twinkle-mem integrates into, declared once (:class:`Framework`), and all that every integration does
alike with its declaration: find the framework's package (found, not imported) and recognize it by its code,
install() with checked settings (plan the parts they ask for, refuse by name what is not recognized, patch the
rest), uninstall(), the install its variable asks for at start-up, and what ``python -m twinkle_mem`` says of it.

A framework's folder under ``integrations/`` writes its names table, its settings, its patches, its variable and
start-up hook, and one ``Framework(...)`` (``FRAMEWORK`` in its ``__init__.py``) that names the framework and reads
those modules; its public functions and its warning are the declaration's (:meth:`Framework.public_functions`,
``refused_warning``). Nothing here is per framework, and nothing here imports torch (the start-up hooks run at
``import twinkle`` / ``import verl``).
"""
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Type

from .install_plan import InstallPlan
from .patching import Patcher
from .recognition import Engine, Feature, Found, Name, Part, package_folder, recognize
from .settings import Settings
from .source import PackageSource
from .startup import Variable


class PartsNotRecognized(UserWarning):
    """install() left parts of the framework as shipped: their names or features are not what it expects.
    ``refused``: {part: (why, ...)}. Each framework has its own subclass (TwinklePartsNotRecognized, ...: its
    declaration's ``refused_warning``)."""

    def __init__(self, message: str, refused: Dict[str, Tuple[str, ...]]):
        super().__init__(message)
        self.refused = refused


class StartupHook(NamedTuple):
    """How a framework's processes run install() with no code change: the variable's words, how the hook is
    named (``python -m twinkle_mem``'s line), whether it is in place here, and what a failure or a refused part
    does at start-up."""
    title: str  # "start-up hook", "verl.plugins entry point"
    status: Callable[[], str]  # whether it is installed and active (a line of ``python -m twinkle_mem``)
    advice: str  # how to run the framework as shipped (the end of a failure's message)
    strict: bool = False  # a part not recognized raises (nothing patched); else it is left as shipped, logged
    failure_logged: str = ""  # where the framework would hide a failure: logged at ERROR with these words first


class Framework:
    """One framework, declared once.

    ``name``: how messages name it ("twinkle-kit"); ``package``: its import package ("twinkle");
    ``distribution``: what pip installs ("twinkle-kit"); ``version_file``: where it says its version (messages quote
    it); ``module``: the integration's module (``__name__`` of ``integrations/<folder>/__init__.py``), where the public
    functions are; ``before_install``: run first by every install() (twinkle imports twinkle, whose start-up hook may
    install first).

    The integration's modules, each read by the names it declares:

    - ``names`` (``<folder>_names.py``, ``core/recognition.py``): ``NAMES``, ``FEATURES``, ``PARTS``, and where the
      framework has several engines ``ENGINES``, the parts that serve each (``python -m twinkle_mem`` names them);
    - ``patches`` (``core/patching.py``): ``PATCHER``, the patch points and the install plan class they read;
    - ``startup`` (``core/startup.py``): ``VARIABLE``, how every process of a job installs (its settings are
      install()'s, ``core/settings.py``), and ``HOOK``, the start-up hook.

    ``refused_warning``, the warning install() gives for parts not recognized, is made here: a subclass of
    :class:`PartsNotRecognized` in ``module``, named after its folder (``VerlPartsNotRecognized`` for ``verl/``)."""

    def __init__(self, name: str, *, package: str, distribution: str, version_file: str, module: str,
                 names: ModuleType, patches: ModuleType, startup: ModuleType,
                 before_install: Callable[[], None] = lambda: None):
        self.name, self.package, self.distribution, self.version_file = name, package, distribution, version_file
        self.names: Dict[str, Name] = names.NAMES
        self.features: Tuple[Feature, ...] = names.FEATURES
        self.parts: Tuple[Part, ...] = names.PARTS
        self.engines: Tuple[Engine, ...] = getattr(names, "ENGINES", ())
        self.patcher: Patcher = patches.PATCHER
        self.plan_class: Type[InstallPlan] = self.patcher.plan
        self.variable: Variable = startup.VARIABLE
        self.settings: Settings = self.variable.settings
        self.hook: StartupHook = startup.HOOK
        self.module, self.before_install = module, before_install
        self.refused_warning: Type[PartsNotRecognized] = type(
            f"{module.rsplit('.', 1)[-1].capitalize()}PartsNotRecognized", (PartsNotRecognized, ),
            {"__module__": module, "__doc__": f"install() left parts of {name} as shipped: their names or features "
                                              "are not what it expects. ``refused``: {part: (why, ...)}."})
        self.plan: Optional[InstallPlan] = None  # the plan in effect in this process (None: not installed)
        self._recognized: Dict[str, Found] = {}

    # --- the framework found -----------------------------------------------------------------------------------

    def folder(self) -> str:
        """The folder of the package this process imports (found, not imported); ImportError without it."""
        return package_folder(self.package, self.distribution)

    def recognize(self, folder: str) -> Found:
        """Read the package at ``folder`` (nothing imported) against the names and features (once a folder)."""
        if folder not in self._recognized:
            self._recognized[folder] = recognize(folder, self.names, self.features)
        return self._recognized[folder]

    def found(self) -> Found:
        """The framework of this process, as install() sees it."""
        return self.recognize(self.folder())

    def version(self) -> str:
        return self.found().version or "(no version)"

    def where(self, found: Found) -> str:
        return f"{self.name} at {found.folder} ({self.version_file} says {found.version})"

    # --- install / uninstall -------------------------------------------------------------------------------------

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
        """Whether install() is in effect in this process (by a call, or by the variable or start-up hook)."""
        return self.plan is not None

    def installed_settings(self) -> Optional[Dict[str, Any]]:
        """install()'s arguments in effect here (None: not installed)."""
        return dict(self.plan.settings) if self.plan is not None else None

    def refused(self) -> Dict[str, Tuple[str, ...]]:
        """The parts asked for and left as the framework ships them: {part: (why, ...)}."""
        return dict(self.plan.refused) if self.plan is not None else {}

    def refusal_message(self, refused: Dict[str, Tuple[str, ...]]) -> str:
        parts = "; ".join(f"{part} ({', '.join(why)})" for part, why in refused.items())
        return (f"the {self.where(self.found())} is not what twinkle-mem expects for: {parts}. Those parts run as "
                f"{self.name} ships them")

    def describe(self, given: Dict[str, Any]) -> List[str]:
        """The framework this process would import (found, not imported) and what install(**given) patches there,
        part by part; raises ImportError without the framework."""
        found = self.found()
        plan = self.plan_class.for_settings(self.parts, self.settings.bind("install", given), found)
        return [self.where(found), *plan.describe(self.parts)]

    # --- what `python -m twinkle_mem` says ---------------------------------------------------------------------

    def every_part(self) -> Dict[str, Any]:
        """install()'s arguments that ask for every part (those whose default does not)."""
        return {p.asked.name: True for p in self.parts if p.asked is not None and p.asked.default is not True}

    def report(self, value: Optional[str]) -> List[str]:
        """What ``python -m twinkle_mem`` says of this framework, its variable set to ``value``: the framework found,
        whether install() ran in this process, the start-up hook, what the variable would do; then part by part
        what install() would patch (as the variable asks, or every part where it asks for none): recognized by the
        framework's code, or refused and why; and what is patched in this process; the engines, where declared."""
        try:
            options = self.variable.parse(value)
        except ValueError:
            options = None
        shown = self.every_part() if options is None else options
        installed = "yes" if self.plan is not None else "no, nothing patched here"
        lines = [f"  install() in this process: {installed} ({self.module}.is_installed() tells, in any process)",
                 f"  {self.hook.title}: {self.hook.status()}", f"  {self.variable.describe(value)}"]
        try:
            found = self.found()
        except ImportError as error:
            return [f"{self.name}: {error}", *lines]
        plan = self.plan_class.for_settings(self.parts, self.settings.bind("install", shown), found)
        asked = f"as {self.variable.name} asks" if options is not None else "every part"
        lines.append(f"  what {self.variable.install_call(shown)} ({asked}) would patch, each part recognized by "
                     f"{self.name}'s code or refused; and what is patched in this process:")
        for part in self.parts:
            lines.append(f"    {part.key:28s} {part.what}: {self._would(plan, found, part)}; {self._now(part)}")
        lines += [f"    {note}" for note in plan.notes()]
        if self.engines:
            lines.append(f"  {self.name}'s engines, each read from its code: the parts that would serve it")
            source = PackageSource(found.folder)
            lines += [f"    {engine.key:12s} {self._engine(plan, found, source, engine)}" for engine in self.engines]
        return [self.where(found), *lines]

    def _would(self, plan: InstallPlan, found: Found, part: Part) -> str:
        if part.is_asked(plan.settings):
            return plan.status(part)
        why = found.refusals(part)  # (a part not asked for: whether it would be recognized)
        return plan.status(part) + (f", and refused if asked ({'; '.join(why)})" if why else ", recognized")

    def _now(self, part: Part) -> str:
        if self.plan is None or not part.is_asked(self.plan.settings):
            return "not patched in this process"
        if part.key in self.plan.refused:
            return "left as shipped in this process (refused)"
        return "patched in this process"

    def _engine(self, plan: InstallPlan, found: Found, source: PackageSource, engine: Engine) -> str:
        if not source.has_module(engine.module):
            return f"not in this {self.name} (no {engine.module})"
        said = []
        for part, feature in engine.served:
            if feature.check(source):
                said.append(f"{part.key} {self._would(plan, found, part)}")
            else:
                said.append(f"{part.key} refused for it, it runs as {self.name} ships it ({feature.doc}: not "
                            "recognized)")
        return "; ".join(said)

    def install_from_environment(self) -> Optional[Dict[str, Any]]:
        """install() as the variable asks, run by the framework's start-up hook: the options installed (None: off).
        A part not recognized raises where the hook is strict, else it is left as shipped with a warning in the
        log; any failure raises, naming the variable (logged first where the framework would hide it)."""
        def install(values):
            plan = self.install_settings(values, strict=self.hook.strict)
            if plan.refused:
                self.variable.logger.warning("twinkle-mem: %s", self.refusal_message(plan.refused))
            return plan

        try:
            return self.variable.install_from_environment(install, self.version, self.hook.advice)
        except Exception:
            if self.hook.failure_logged:
                self.variable.logger.exception(self.hook.failure_logged)
            raise

    def public_functions(self, install_doc: str) -> Tuple[Callable, ...]:
        """The framework's public functions, in this order: install (its signature the settings', its docstring
        ``install_doc``; parts not recognized: a ``refused_warning``), uninstall, is_installed, installed_settings,
        refused, describe (keyword arguments: install()'s)."""
        def install(**settings) -> None:
            plan = self.install_settings(self.settings.bind("install", settings))
            if plan.refused:
                warnings.warn(self.refused_warning(f"twinkle-mem: {self.refusal_message(plan.refused)}", plan.refused),
                              stacklevel=2)

        def describe(**settings) -> List[str]:
            return self.describe(settings)

        install.__signature__, install.__doc__ = self.settings.signature(), install_doc
        describe.__doc__ = Framework.describe.__doc__.replace("install(**given)", "install(**settings)")
        return install, self.uninstall, self.is_installed, self.installed_settings, self.refused, describe

