"""What install() replaces in verl, point by point (:data:`POINTS`), on the integrations' shared machinery
(``core/patching.py``): each verl module is patched when the process first imports it (at once where it already
has), every original saved and put back by uninstall().

- the FSDP fused head (``fsdp_head.py``): ``patch_forward_with_backends`` and ``FusedLinearForPPO.forward`` (and its
  ``__init__``, which takes the backend a twinkle model records);
- the Megatron fused head (``megatron_head.py``): ``MegatronEngine._maybe_enable_fused_kernels`` and
  ``linear_cross_entropy``, at its definition and where the Megatron forwards bound it;
- with either head, the engines' ``forward_backward_batch`` (``entropy_grad.py``): whether the batch trains the
  entropy;
- with ``logits_path=True`` (``logits_path.py``): verl's logits-path functions, at their definitions and where
  verl's engines bound them by name. The FSDP engine binds (and compiles) its entropy function when it is built:
  install() runs at ``import verl``, before any engine exists.
"""
from typing import Tuple

from ..core.install_plan import InstallPlan
from ..core.patching import Patcher, Point
from . import verl_names as names


class VerlInstallPlan(InstallPlan):
    """install()'s settings and what it patches on the verl it found."""
    __slots__ = ()
    framework = "verl"


# The makers: each imports the module that owns its concern (which imports torch and twinkle-mem's ops).

def _patch_forward_with_backends(original, plan):
    from .fsdp_head import patch_forward_with_backends
    return patch_forward_with_backends(original, plan)


def _fused_linear_forward(original, plan):
    from .fsdp_head import fused_linear_forward
    return fused_linear_forward(original, plan)


def _fused_linear_init(original, plan):
    from .fsdp_head import fused_linear_init
    return fused_linear_init(original, plan)


def _forward_backward_batch(original, plan):
    from .entropy_grad import forward_backward_batch
    return forward_backward_batch(original, plan)


def _maybe_enable_fused_kernels(original, plan):
    from .megatron_head import maybe_enable_fused_kernels
    return maybe_enable_fused_kernels(original, plan)


def _linear_cross_entropy(original, plan):
    from .megatron_head import linear_cross_entropy
    return linear_cross_entropy(original, plan)


def _logprobs_from_logits(original, plan):
    from .logits_path import logprobs_from_logits
    return logprobs_from_logits(original, plan)


def _entropy_from_logits(original, plan):
    from .logits_path import entropy_from_logits
    return entropy_from_logits(original, plan)


def _vocab_parallel_log_probs(original, plan):
    from .logits_path import vocab_parallel_log_probs_from_logits
    return vocab_parallel_log_probs_from_logits(original, plan)


def _vocab_parallel_entropy(original, plan):
    from .logits_path import vocab_parallel_entropy
    return vocab_parallel_entropy(original, plan)


POINTS: Tuple[Point, ...] = (
    Point(names.PATCH_FORWARD_WITH_BACKENDS, names.FSDP_FUSED_HEAD, _patch_forward_with_backends),
    Point(names.FUSED_LINEAR_FORWARD, names.FSDP_FUSED_HEAD, _fused_linear_forward),
    Point(names.FUSED_LINEAR_INIT, names.FSDP_FUSED_HEAD, _fused_linear_init),
    Point(names.FSDP_FORWARD_BACKWARD, names.FSDP_FUSED_HEAD, _forward_backward_batch),
    Point(names.MEGATRON_FORWARD_BACKWARD, names.MEGATRON_FUSED_HEAD, _forward_backward_batch),
    Point(names.ENABLE_FUSED_KERNELS, names.MEGATRON_FUSED_HEAD, _maybe_enable_fused_kernels),
    Point(names.LINEAR_CROSS_ENTROPY, names.MEGATRON_FUSED_HEAD, _linear_cross_entropy, rebound_by_name=True),
    Point(names.LOGPROBS_FROM_LOGITS, names.LOGITS_PATH_PART, _logprobs_from_logits, rebound_by_name=True),
    Point(names.ENTROPY_FROM_LOGITS, names.LOGITS_PATH_PART, _entropy_from_logits, rebound_by_name=True),
    Point(names.ENTROPY_WITH_CHUNKING, names.LOGITS_PATH_PART, _entropy_from_logits, rebound_by_name=True),
    Point(names.VOCAB_PARALLEL_LOG_PROBS, names.MEGATRON_LOGITS_PATH, _vocab_parallel_log_probs,
          rebound_by_name=True),
    Point(names.VOCAB_PARALLEL_ENTROPY, names.MEGATRON_LOGITS_PATH, _vocab_parallel_entropy, rebound_by_name=True),
    Point(names.VOCAB_PARALLEL_ENTROPY_WITH_CHUNKING, names.MEGATRON_LOGITS_PATH, _vocab_parallel_entropy,
          rebound_by_name=True),
)

PATCHER = Patcher("verl", POINTS, VerlInstallPlan)
