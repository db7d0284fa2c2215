"""What install() replaces in ms-swift, point by point (:data:`POINTS`), on the integrations' shared machinery
(``core/patching.py``): each ms-swift module is patched when the process first imports it (at once where it already
has), every original saved and put back by uninstall()."""
from typing import List, Tuple

from ..core.install_plan import InstallPlan
from ..core.patching import Patcher, Point
from . import swift_names as names


class SwiftInstallPlan(InstallPlan):
    """install()'s settings and what it patches on the ms-swift it found."""
    __slots__ = ()
    framework = "ms-swift"

    def notes(self) -> List[str]:
        if not self.patches(names.GRPO_FUSED_HEAD):
            return []
        return [f"{'':28s} GRPO under sequence parallelism (_get_logps_via_sp) builds the logits: on the op where "
                "logits_path is patched"]


# The makers: each imports the module that owns its concern (which imports torch and twinkle-mem's ops).

def _local_forward(original, plan):
    from .grpo_head import local_forward
    return local_forward(original, plan)


def _gkd_compute_loss(original, plan):
    from .gkd_head import compute_loss
    return compute_loss(original, plan)


def _gkd_jsd_loss(original, plan):
    from .gkd_head import jsd_loss
    return jsd_loss(original, plan)


def _selective_log_softmax(original, plan):
    from .logits_path import selective_log_softmax
    return selective_log_softmax(original, plan)


def _entropy_from_logits(original, plan):
    from .logits_path import entropy_from_logits
    return entropy_from_logits(original, plan)


POINTS: Tuple[Point, ...] = (
    Point(names.GRPO_LOCAL_FORWARD, names.GRPO_FUSED_HEAD, _local_forward),
    Point(names.GKD_COMPUTE_LOSS, names.GKD_FUSED_HEAD, _gkd_compute_loss),
    Point(names.GKD_JSD_LOSS, names.GKD_FUSED_HEAD, _gkd_jsd_loss),
    Point(names.DPO_SELECTIVE_LOG_SOFTMAX, names.LOGITS_PATH_PART, _selective_log_softmax, rebound_by_name=True),
    Point(names.GRPO_SELECTIVE_LOG_SOFTMAX, names.LOGITS_PATH_PART, _selective_log_softmax, rebound_by_name=True),
    Point(names.GRPO_ENTROPY_FROM_LOGITS, names.LOGITS_PATH_PART, _entropy_from_logits, rebound_by_name=True),
)

PATCHER = Patcher("swift", POINTS)
