"""What install() replaces in twinkle-kit, point by point (:data:`POINTS`), and the plan the replacements read
(:class:`TwinkleInstallPlan`). The machinery (each twinkle module patched when the process first imports it,
every original saved and put back) is the integrations' shared core (``core/patching.py``).

Nothing here imports torch, twinkle or twinkle_mem's ops at module level: a patch is made by the module that owns
its concern (``mask_skip``, ``megatron_steps``, ``transformers_path``, ``distill_loss``), imported by its maker
below when its twinkle module has been, so torch is there then. ``selective_log_softmax`` is the exception:
twinkle's ``import twinkle`` already imports its module (not torch), so its replacement is made here and imports
twinkle-mem's op at its first call.
"""
from typing import List, Optional, Tuple

from ..core.install_plan import InstallPlan
from ..core.patching import Patcher, Point
from . import twinkle_names as names
from .settings import FUSED_LM_HEAD


class TwinkleInstallPlan(InstallPlan):
    """install()'s settings and what it patches on the twinkle-kit it found."""
    __slots__ = ()
    framework = "twinkle-kit"

    @property
    def megatron_guard(self) -> bool:
        """twinkle-mem's logits guard on the Megatron path (not where twinkle guards its logits itself)."""
        return (self.patches(names.MEGATRON_LOGITS_GUARD)
                and self.feature(names.MEGATRON_LOGITS) == "every micro-batch")

    def fused_distillation(self, path: str) -> Optional[str]:
        """Why a fused GKD call on ``path`` ("megatron" / "transformers") is left to the unfused loss, or None."""
        if not self.feature(names.FUSED_PATHS[path][1]):
            return "this twinkle-kit's forward step computes log-probs for every loss (no require_logps)"
        if path == "megatron" and not self.megatron_guard and self.feature(names.MEGATRON_LOGITS) != "when asked":
            # its log-probs are None, which twinkle-kit up to 0.5.1 passes to torch.cat
            return "a fused distillation call needs the logits guard (install(logits_guard=True))"
        return None

    def status(self, part) -> str:
        if part is names.MEGATRON_LOGITS_GUARD and self.patches(part) and not self.megatron_guard:
            return ("would be patched (recognized) for failed micro-batches only: the logits guard is twinkle-kit's own "
                    "(its forward step reports logits only when asked)")
        return super().status(part)

    def notes(self) -> List[str]:
        return [f"{'':28s} {path} fused distillation (GKD): " + ("would run" if why is None else f"would not: {why}")
                for path, (part, _) in names.FUSED_PATHS.items() if self.patches(part)
                for why in [self.fused_distillation(path)]]


def _log_softmax_adapter(original, plan):
    fused = plan.value(FUSED_LM_HEAD)

    def selective_log_softmax(logits, index, return_entropy=False):
        """twinkle-kit's ``selective_log_softmax`` signature, computed by twinkle-mem's op."""
        import twinkle_mem
        if fused and logits.shape[-1] == 0:
            # A fused output layer's placeholder: its log-probs were computed from the layer's input.
            from .fused_call import take
            return take(logits, index, return_entropy)
        # Under vocab tensor parallelism (TP > 1) the logits are this rank's vocab shard, as for twinkle's own
        # function (Megatron's vocab-parallel CE there): the op combines the shards over the TP group, entropy too.
        return twinkle_mem.selective_log_softmax(logits, index, return_entropy,
                                                 process_group=names.tensor_parallel_group())

    selective_log_softmax.twinkle_original = original
    return selective_log_softmax


# The makers of the other replacements: each imports the module that owns its concern (which imports torch).

def _gkd_call(original, plan):
    from .distill_loss import gkd_call
    return gkd_call(original, plan)


def _processor_call(original, plan):
    from .mask_skip import processor_call
    return processor_call(original, plan)


def _create_4d_attention_mask(original, plan):
    from .mask_skip import create_4d_attention_mask
    return create_4d_attention_mask(original, plan)


def _megatron_forward_backward(original, plan):
    from .megatron_steps import megatron_forward_backward
    return megatron_forward_backward(original, plan)


def _scheduler_with_step_hooks(original, plan):
    from .megatron_steps import scheduler_with_step_hooks
    return scheduler_with_step_hooks(original, plan)


def _guarded_reduce_loss(original, plan):
    from .megatron_steps import guarded_reduce_loss
    return guarded_reduce_loss(original, plan)


def _transformers_forward(original, plan):
    from .transformers_path import forward
    return forward(original, plan)


def _transformers_forward_only(original, plan):
    from .transformers_path import forward_only
    return forward_only(original, plan)


def _calculate_loss(original, plan):
    from .transformers_path import calculate_loss_dropping_logits
    return calculate_loss_dropping_logits(original, plan)


_MEGATRON_HOOKED = (names.MEGATRON_LOGITS_GUARD, names.MEGATRON_FUSED_LM_HEAD)
_TRANSFORMERS_FORWARD = (names.TRANSFORMERS_LOGITS_DROP, names.TRANSFORMERS_FUSED_LM_HEAD)

POINTS: Tuple[Point, ...] = (
    Point(names.SELECTIVE_LOG_SOFTMAX, names.LOG_SOFTMAX_PART, _log_softmax_adapter, rebound_by_name=True,
          loads_torch=False),
    Point(names.GKD_CALL, names.GKD_LOSS, _gkd_call),
    Point(names.PROCESSOR_CALL, names.MASK_SKIP_PART, _processor_call),
    Point(names.CREATE_MASK, names.MASK_SKIP_PART, _create_4d_attention_mask),
    Point(names.FORWARD_BACKWARD, _MEGATRON_HOOKED, _megatron_forward_backward),
    Point(names.GET_FORWARD_BACKWARD_FUNC, _MEGATRON_HOOKED, _scheduler_with_step_hooks),
    Point(names.REDUCE_LOSS, lambda plan: plan.megatron_guard, _guarded_reduce_loss),
    Point(names.TRANSFORMERS_FORWARD, _TRANSFORMERS_FORWARD, _transformers_forward),
    Point(names.TRANSFORMERS_FORWARD_ONLY, _TRANSFORMERS_FORWARD, _transformers_forward_only),
    Point(names.CALCULATE_LOSS, names.TRANSFORMERS_LOGITS_DROP, _calculate_loss),
)

PATCHER = Patcher("twinkle", POINTS, TwinkleInstallPlan)
_saved = PATCHER.saved  # (what uninstall() puts back; the start-up hook's tests read it)
apply, restore, patched = PATCHER.apply, PATCHER.restore, PATCHER.patched
