"""What an integration replaces in a framework, point by point, and how: each framework module is patched when
the process first imports it (at once where it already has: ``twinkle_mem_startup.after_import``), so that
install() imports nothing a process does not import itself. Every replaced object is saved; :meth:`Patcher.restore`
puts them back.

A :class:`Point` is declared once, with real references: the :class:`~.recognition.Name` it replaces (from the
integration's names table), the part or parts that want it, and the function that makes the replacement.
"""
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Tuple, Type, Union

from .install_plan import InstallPlan
from .recognition import Name, Part


class Point(NamedTuple):
    target: Name  # the object replaced: a function, a method, a module attribute
    wanted: Union[Part, Tuple[Part, ...], Callable[[InstallPlan], bool]]  # a part patched (any of them), or a rule
    make: Callable[[Any, InstallPlan], Any]  # (the original, the plan) -> the replacement
    # The framework's modules that imported the original by name get the replacement too (put back by restore(),
    # and in the framework's modules imported since, which bound the replacement)
    rebound_by_name: bool = False
    # make() imports a module that imports torch (and twinkle-mem's ops): the package's API is loaded first
    loads_torch: bool = True

    def is_wanted(self, plan: InstallPlan) -> bool:
        if isinstance(self.wanted, Part):
            return plan.patches(self.wanted)
        if isinstance(self.wanted, tuple):
            return any(plan.patches(part) for part in self.wanted)
        return self.wanted(plan)

    def owner(self, module):
        *owner, _ = self.target.qualname.split(".")
        return getattr(module, owner[0]) if owner else module

    @property
    def attribute(self) -> str:
        return self.target.qualname.split(".")[-1]


_MISSING = object()


class Patcher:
    """The points of one integration, the install plan class its makers read (``plan``: the integration's subclass
    of InstallPlan), and what they replaced so far in this process."""

    def __init__(self, package: str, points: Tuple[Point, ...], plan: Type[InstallPlan] = InstallPlan):
        self.package, self.points = package, points  # package: the framework's top package ("twinkle", "verl")
        self.plan = plan
        self.saved: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original raw value or _MISSING)
        self.waiting: List[Callable] = []  # callbacks given to twinkle_mem_startup.after_import
        self.rebound: List[Tuple[str, Any, Any]] = []  # (a rebound point's attribute, the original, its replacement)

    def apply(self, plan: InstallPlan) -> None:
        """Patch every wanted point: at once in the modules already imported (all of them resolved before any is
        patched, so a failure leaves the framework as it was), the others when the process imports them."""
        by_module: Dict[str, List[Point]] = {}
        for point in self.points:
            if point.is_wanted(plan):
                by_module.setdefault(point.target.module, []).append(point)
        loaded = {m: ps for m, ps in by_module.items() if m in sys.modules}
        resolved = [(pt, pt.owner(sys.modules[m])) for m, ps in loaded.items() for pt in ps]
        try:
            for point, owner in resolved:
                self._patch(owner, point, plan)
        except BaseException:
            self.restore()
            raise
        import twinkle_mem_startup
        for module, points in by_module.items():
            if module not in loaded:
                callback = self._patch_on_import(points, plan)
                self.waiting.append(callback)
                twinkle_mem_startup.after_import(module, callback)

    def _patch(self, owner, point: Point, plan: InstallPlan) -> None:
        if point.loads_torch:
            import twinkle_mem
            twinkle_mem._load_api()  # (the package may have been imported without torch: the start-up hook)
        name = point.attribute
        original = getattr(owner, name)
        new = point.make(original, plan)
        if isinstance(vars(owner).get(name), staticmethod):
            new = staticmethod(new)
        self.saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)
        if point.rebound_by_name:  # ... and the modules that bound it by name
            self.rebound.append((name, original, new))
            for module in self._modules_binding(name, original):
                self.saved.append((module, name, original))
                setattr(module, name, new)

    def _patch_on_import(self, points: List[Point], plan: InstallPlan) -> Callable:
        def patch(module):
            self.waiting.remove(patch)
            owners = [point.owner(module) for point in points]
            for owner, point in zip(owners, points):
                self._patch(owner, point, plan)
        return patch

    def restore(self) -> None:
        """Put back every object replaced so far, and patch nothing more on import."""
        import twinkle_mem_startup
        while self.waiting:
            twinkle_mem_startup.forget(self.waiting.pop())
        while self.saved:
            owner, name, raw = self.saved.pop()
            if raw is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, raw)
        while self.rebound:  # modules imported since bound the replacement by name: give them the original
            attribute, original, replacement = self.rebound.pop()
            for module in self._modules_binding(attribute, replacement):
                setattr(module, attribute, original)

    def patched(self) -> List[Tuple[Any, str]]:
        """(owner, attribute) of every object replaced so far."""
        return [(owner, name) for owner, name, _ in self.saved]

    def _modules_binding(self, attribute: str, obj: Any) -> List[Any]:
        prefix = self.package + "."
        return [module for name, module in list(sys.modules.items())
                if (name == self.package or name.startswith(prefix))
                and getattr(module, "__dict__", {}).get(attribute) is obj]
