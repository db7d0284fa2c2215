"""What install() replaces in twinkle-kit, point by point, and how: each twinkle module is patched when the
process first imports it (at once where it already has), so that install() imports nothing a process does not
import itself. Every replaced object is saved; :func:`restore` puts them back.

Nothing here imports torch, twinkle or twinkle_mem's ops at module level: a patch is made by the module that owns
its concern (``mask_skip``, ``megatron_steps``, ``transformers_path``, ``distill_loss``), imported when its
twinkle module has been, so torch is there then. ``selective_log_softmax`` is the exception: twinkle's
``import twinkle`` already imports its module (not torch), so its replacement is made here and imports
twinkle-mem's op at its first call.
"""
import importlib
import sys
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

from . import twinkle_names as names


class Plan(NamedTuple):
    """install()'s settings and what it patches on the twinkle-kit it found."""
    settings: Dict[str, Any]
    accepted: FrozenSet[str]  # the parts of twinkle_names.PARTS patched
    refused: Dict[str, Tuple[str, ...]]  # the parts asked for but not recognized: why, one reason per name
    features: Dict[str, Any]

    @classmethod
    def for_settings(cls, settings: Dict[str, Any], found: names.Found) -> "Plan":
        asked = [p for p in names.PARTS if p.asked(settings)]
        refused = {p.key: found.refusals(p) for p in asked if found.refusals(p)}
        return cls(dict(settings), frozenset(p.key for p in asked if p.key not in refused), refused,
                   dict(found.features))

    @property
    def fused(self) -> bool:
        return self.settings["fused_lm_head"]

    @property
    def chunk_bytes(self) -> Optional[int]:
        return self.settings["fused_chunk_bytes"]

    @property
    def megatron_guard(self) -> bool:
        """twinkle-mem's logits guard on the Megatron path (not where twinkle guards its logits itself)."""
        return "megatron_logits_guard" in self.accepted and self.features["megatron_logits"] == "every micro-batch"

    # Whether a part is patched. megatron_failures: failed micro-batches reported (NaN rows, a warning) with
    # logits_guard, whoever guards the logits.
    megatron_failures = property(lambda self: "megatron_logits_guard" in self.accepted)
    megatron_fused = property(lambda self: "megatron_fused_lm_head" in self.accepted)
    transformers_drop = property(lambda self: "transformers_logits_drop" in self.accepted)
    transformers_fused = property(lambda self: "transformers_fused_lm_head" in self.accepted)

    def fused_distillation(self, path: str) -> Optional[str]:
        """Why a fused GKD call on ``path`` ("megatron" / "transformers") is left to the unfused loss, or None."""
        if not self.features[f"{path}_skips_unused_log_probs"]:
            return "this twinkle-kit's forward step computes log-probs for every loss (no require_logps)"
        if path == "megatron" and not self.megatron_guard and self.features["megatron_logits"] != "when asked":
            # its log-probs are None, which twinkle-kit up to 0.5.1 passes to torch.cat
            return "a fused distillation call needs the logits guard (install(logits_guard=True))"
        return None


    def describe(self) -> List[str]:
        """What install() patches with these settings, part by part (``python -m twinkle_mem``, the README)."""
        lines = []
        for part in names.PARTS:
            if not part.asked(self.settings):
                status = "not asked for"
            elif part.key in self.refused:
                status = "refused, runs as twinkle-kit ships it: " + "; ".join(self.refused[part.key])
            elif part.key == "megatron_logits_guard" and not self.megatron_guard:
                status = "twinkle-kit's own (its forward step reports logits only when asked); failed micro-batches"
            else:
                status = "patched"
            lines.append(f"{part.key:28s} {part.what}: {status}")
        for path in ("megatron", "transformers"):
            if self.fused and f"{path}_fused_lm_head" in self.accepted:
                why = self.fused_distillation(path)
                lines.append(f"{'':28s} {path} fused distillation (GKD): " + ("yes" if why is None else f"no: {why}"))
        return lines


class Point(NamedTuple):
    module: str
    owner: Optional[str]  # a class of the module, or None: a module attribute
    attribute: str
    wanted: Callable[[Plan], bool]
    make: Callable[[Any, Plan], Any]  # (the original, the plan) -> the replacement
    # The twinkle modules that imported the original by name get the replacement too (put back by restore(), and
    # in the twinkle modules imported since, which bound the replacement)
    rebound_by_name: bool = False


def _maker(module: str, function: str) -> Callable[[Any, Plan], Any]:
    def make(original, plan):
        import twinkle_mem
        twinkle_mem._load_api()  # (the package may have been imported without torch: the start-up hook)
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)(original, plan)
    return make


def _log_softmax_adapter(original, plan):
    fused = plan.fused

    def selective_log_softmax(logits, index, return_entropy=False):
        """twinkle-kit's ``selective_log_softmax`` signature, computed by twinkle-mem's op."""
        import twinkle_mem
        if fused and logits.shape[-1] == 0:
            # A fused output layer's placeholder: its log-probs were computed from the layer's input.
            from .fused_head import take
            return take(logits, index, return_entropy)
        # Under vocab tensor parallelism (TP > 1) the logits are this rank's vocab shard, as for twinkle's own
        # function (Megatron's vocab-parallel CE there): the op combines the shards over the TP group, entropy too.
        from ._model import tensor_parallel_group
        return twinkle_mem.selective_log_softmax(logits, index, return_entropy, process_group=tensor_parallel_group())

    selective_log_softmax.twinkle_original = original
    return selective_log_softmax


def _megatron_hooked(plan):
    return plan.megatron_failures or plan.megatron_fused


def _transformers_forward(plan):
    return plan.transformers_drop or plan.transformers_fused


POINTS: Tuple[Point, ...] = (
    Point("twinkle.utils.torch_utils", None, "selective_log_softmax", lambda p: "log_softmax" in p.accepted,
          _log_softmax_adapter, rebound_by_name=True),
    Point(names.GKD, "GKDLoss", "__call__", lambda p: "gkd_loss" in p.accepted, _maker("distill_loss", "gkd_call")),
    Point(names.PROCESSOR, "InputProcessor", "__call__", lambda p: "mask_skip" in p.accepted,
          _maker("mask_skip", "processor_call")),
    Point(names.PROCESSOR, "InputProcessor", "_create_4d_attention_mask", lambda p: "mask_skip" in p.accepted,
          _maker("mask_skip", "create_4d_attention_mask")),
    Point(names.MEGATRON, "MegatronModel", "forward_backward", _megatron_hooked,
          _maker("megatron_steps", "megatron_forward_backward")),
    Point("megatron.core.pipeline_parallel", None, "get_forward_backward_func", _megatron_hooked,
          _maker("megatron_steps", "scheduler_with_step_hooks")),
    Point(names.STRATEGY, "MegatronStrategy", "reduce_loss", lambda p: p.megatron_guard,
          _maker("megatron_steps", "guarded_reduce_loss")),
    Point(names.TRANSFORMERS, "TransformersModel", "forward", _transformers_forward,
          _maker("transformers_path", "forward")),
    Point(names.TRANSFORMERS, "TransformersModel", "forward_only", _transformers_forward,
          _maker("transformers_path", "forward_only")),
    Point(names.TRANSFORMERS, "TransformersModel", "calculate_loss", lambda p: p.transformers_drop,
          _maker("transformers_path", "calculate_loss_dropping_logits")),
)

_MISSING = object()
_saved: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original raw value or _MISSING)
_waiting: List[Callable] = []  # callbacks given to twinkle_mem_startup.after_import
_rebound: List[Tuple[str, Any, Any]] = []  # (a Point rebound_by_name's attribute, the original, its replacement)


def apply(plan: Plan) -> None:
    """Patch every wanted point: at once in the modules already imported (all of them resolved before any is
    patched, so a failure leaves twinkle as it was), the others when the process imports them."""
    by_module: Dict[str, List[Point]] = {}
    for point in POINTS:
        if point.wanted(plan):
            by_module.setdefault(point.module, []).append(point)
    loaded = {m: ps for m, ps in by_module.items() if m in sys.modules}
    resolved = [(pt, _owner(sys.modules[m], pt)) for m, ps in loaded.items() for pt in ps]
    try:
        for point, owner in resolved:
            _patch(owner, point, plan)
    except BaseException:
        restore()
        raise
    import twinkle_mem_startup
    for module, points in by_module.items():
        if module not in loaded:
            callback = _patch_on_import(points, plan)
            _waiting.append(callback)
            twinkle_mem_startup.after_import(module, callback)


def _owner(module, point: Point):
    return module if point.owner is None else getattr(module, point.owner)


def _patch(owner, point: Point, plan: Plan) -> None:
    original = getattr(owner, point.attribute)
    new = point.make(original, plan)
    if isinstance(vars(owner).get(point.attribute), staticmethod):
        new = staticmethod(new)
    _saved.append((owner, point.attribute, vars(owner).get(point.attribute, _MISSING)))
    setattr(owner, point.attribute, new)
    if point.rebound_by_name:  # ... and the modules that bound it by name
        _rebound.append((point.attribute, original, new))
        for module in _twinkle_modules_binding(point.attribute, original):
            _saved.append((module, point.attribute, original))
            setattr(module, point.attribute, new)


def _patch_on_import(points: List[Point], plan: Plan) -> Callable:
    def patch(module):
        _waiting.remove(patch)
        owners = [_owner(module, point) for point in points]
        for owner, point in zip(owners, points):
            _patch(owner, point, plan)
    return patch


def restore() -> None:
    """Put back every object replaced so far, and patch nothing more on import."""
    import twinkle_mem_startup
    while _waiting:
        twinkle_mem_startup.forget(_waiting.pop())
    while _saved:
        owner, name, raw = _saved.pop()
        if raw is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)
    while _rebound:  # twinkle modules imported since bound the replacement by name: give them the original
        attribute, original, replacement = _rebound.pop()
        for module in _twinkle_modules_binding(attribute, replacement):
            setattr(module, attribute, original)


def patched() -> List[Tuple[Any, str]]:
    """(owner, attribute) of every object replaced so far."""
    return [(owner, name) for owner, name, _ in _saved]


def _twinkle_modules_binding(attribute: str, obj: Any) -> List[Any]:
    return [module for name, module in list(sys.modules.items())
            if (name == "twinkle" or name.startswith("twinkle.")) and getattr(module, "__dict__", {}).get(
                attribute) is obj]
