"""twinkle-mem: memory-lean selective log-softmax / entropy kernels (CPU, CUDA,
Ascend NPU) and memory fixes for RL training of large-vocabulary LMs."""
import sys

__version__ = "0.1.0"

# The public functions and the modules that define them: the op (op/), the distillation math (distill/), the fused
# heads built on the op (heads/).
_API = {"selective_log_softmax": "op.functional", "entropy_from_logits": "op.functional",
        "linear_selective_log_softmax": "heads.logprobs", "linear_gkd_topk": "heads.gkd_topk",
        "linear_gkd_full": "heads.gkd_full", "gkd_average": "distill.divergence",
        "gkd_from_logits": "distill.local_teacher", "gkd_topk_from_logits": "distill.topk_teacher"}


_loaded = False


def _load_api() -> None:
    """Load the native libraries, register the ops (fake + autograd, the composite) and bind the public functions."""
    global _loaded
    if _loaded:
        return
    import importlib
    from .op import ops  # noqa: F401  (loads the native libraries, registers fake + autograd)
    from .op import composite  # noqa: F401  (the composite kernel for devices without a native one)
    globals().update(ops=ops, composite=composite)
    for name, module in _API.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    _loaded = True


def backends() -> dict[str, str]:
    """Which native backends were built and loaded, and why not: {'cpu': 'loaded', 'cuda': ..., 'npu': ...}.

    A library that failed to load reads "failed to load (<file>: <error>); the composite runs on this
    device": the op still works there, through the composite PyTorch implementation."""
    _load_api()
    from .op.native import status
    return dict(status)


# Reached as attributes after a plain `import twinkle_mem` (twinkle_mem.integrations.twinkle.install(),
# twinkle_mem.processor, ...), imported on first use: integrations.twinkle loads twinkle-kit's glue only then.
# Each name -> its module (reference and vocab_parallel are the op's: op/).
_SUBMODULES = {"integrations": "integrations", "processor": "processor", "megatron": "megatron",
               "reference": "op.reference", "vocab_parallel": "op.vocab_parallel"}


def __getattr__(name):
    if name in _API or name in ("ops", "composite"):
        _load_api()
        return globals()[name]
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{_SUBMODULES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `import twinkle_mem` loads everything, except where TWINKLE_MEM_INSTALL's start-up hook imports the package to
# reach twinkle_mem.integrations.twinkle at `import twinkle`, before the process has imported torch: that costs the
# process no torch (docs/cluster_jobs.md), and the functions load on first use (the hook's patches load them as
# soon as a twinkle module that computes is imported).
if not (getattr(sys.modules.get("twinkle_mem_startup"), "importing_without_torch", False)
        and "torch" not in sys.modules):
    _load_api()

__all__ = ["selective_log_softmax", "linear_selective_log_softmax", "linear_gkd_topk", "linear_gkd_full",
           "gkd_from_logits", "gkd_topk_from_logits", "gkd_average", "entropy_from_logits", "backends", "__version__"]
