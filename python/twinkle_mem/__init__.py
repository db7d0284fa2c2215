"""twinkle-mem: memory-lean selective log-softmax / entropy kernels (CPU, CUDA,
Ascend NPU) and memory fixes for RL training of large-vocabulary LMs."""
from .op import ops  # noqa: F401  (loads the native libraries, registers fake + autograd)
from .op import composite  # noqa: F401  (the composite kernel for devices without a native one)
from .op.functional import entropy_from_logits, selective_log_softmax
from .op.native import status as _backend_status
from .distill.divergence import gkd_average
from .distill.local_teacher import gkd_from_logits
from .distill.topk_teacher import gkd_topk_from_logits
from .heads.gkd_full import linear_gkd_full
from .heads.gkd_topk import linear_gkd_topk
from .heads.logprobs import linear_selective_log_softmax

__version__ = "0.1.0"


def backends() -> dict[str, str]:
    """Which native backends were built and loaded, and why not: {'cpu': 'loaded', 'cuda': ..., 'npu': ...}.

    A library that failed to load reads "failed to load (<file>: <error>); the composite runs on this
    device": the op still works there, through the composite PyTorch implementation."""
    return dict(_backend_status)


# Reached as attributes after a plain `import twinkle_mem` (twinkle_mem.integrations.twinkle.install(),
# twinkle_mem.processor, ...), imported on first use: integrations.twinkle loads twinkle-kit's glue only then.
# Each name -> its module (reference and vocab_parallel are the op's: op/).
_SUBMODULES = {"integrations": "integrations", "processor": "processor", "megatron": "megatron",
               "reference": "op.reference", "vocab_parallel": "op.vocab_parallel"}


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{_SUBMODULES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["selective_log_softmax", "linear_selective_log_softmax", "linear_gkd_topk", "linear_gkd_full",
           "gkd_from_logits", "gkd_topk_from_logits", "gkd_average", "entropy_from_logits", "backends", "__version__"]
