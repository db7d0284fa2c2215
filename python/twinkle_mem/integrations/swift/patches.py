"""What install() replaces in ms-swift, point by point (:data:`POINTS`), on the integrations' shared machinery
(``core/patching.py``): each ms-swift module is patched when the process first imports it (at once where it already
has), every original saved and put back by uninstall()."""
import importlib
from typing import List, Tuple

from ..core.install_plan import InstallPlan
from ..core.patching import Patcher, Point
from . import swift_names as names


class SwiftInstallPlan(InstallPlan):
    """install()'s settings and what it patches on the ms-swift it found."""
    __slots__ = ()
    framework = "ms-swift"

    def notes(self) -> List[str]:
        notes = []
        if self.patches(names.GRPO_SP_FUSED_HEAD) and not self.patches(names.LOGITS_PATH_PART):
            notes.append(f"{'':28s} with logits_path off, DPO keeps TRL's selective_log_softmax (grpo_sp_fused_head's "
                         "replacement of it, bound by name, hands every other call to TRL's)")
        if self.patches(names.MEGATRON_FUSED_HEAD) and not self.patches(names.MEGATRON_LOGITS_PATH):
            notes.append(f"{'':28s} with logits_path off, Megatron-SWIFT's logits keep ms-swift's "
                         "compute_logps_and_entropy_from_logits (megatron_fused_head's replacement of it hands every "
                         "call it did not defer to ms-swift's)")
        return notes


def _maker(module: str, function: str):
    """The maker of a point: ``function`` of this folder's ``module``, imported when the point is patched (the
    modules that build the replacements import torch and twinkle-mem's ops)."""
    def make(original, plan):
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)(original, plan)
    return make


POINTS: Tuple[Point, ...] = (
    Point(names.GRPO_LOCAL_FORWARD, names.GRPO_FUSED_HEAD, _maker("grpo_head", "local_forward")),
    Point(names.GRPO_SP_FORWARD, names.GRPO_SP_FUSED_HEAD, _maker("grpo_head", "sequence_parallel_forward")),
    Point(names.GKD_COMPUTE_LOSS, names.GKD_FUSED_HEAD, _maker("gkd_head", "compute_loss")),
    Point(names.GKD_JSD_LOSS, names.GKD_FUSED_HEAD, _maker("gkd_head", "jsd_loss")),
    Point(names.DPO_SELECTIVE_LOG_SOFTMAX, names.LOGITS_PATH_PART, _maker("logits_path", "selective_log_softmax"),
          rebound_by_name=True),
    Point(names.GRPO_SELECTIVE_LOG_SOFTMAX, (names.LOGITS_PATH_PART, names.GRPO_SP_FUSED_HEAD),
          _maker("logits_path", "selective_log_softmax"), rebound_by_name=True),
    Point(names.GRPO_ENTROPY_FROM_LOGITS, (names.LOGITS_PATH_PART, names.GRPO_SP_FUSED_HEAD),
          _maker("logits_path", "entropy_from_logits"), rebound_by_name=True),
    Point(names.MEGATRON_LOGPS, (names.MEGATRON_LOGITS_PATH, names.MEGATRON_FUSED_HEAD),
          _maker("logits_path", "megatron_logps_and_entropy"), rebound_by_name=True),
    Point(names.MEGATRON_FORWARD_STEP, names.MEGATRON_FUSED_HEAD, _maker("megatron_head", "forward_step")),
    Point(names.MEGATRON_PER_TOKEN_LOGPS, names.MEGATRON_FUSED_HEAD, _maker("megatron_head", "per_token_logps"),
          rebound_by_name=True),
)

PATCHER = Patcher("swift", POINTS, SwiftInstallPlan)
