"""verl's FSDP fused path on twinkle-mem: ``use_fused_kernels=True`` with ``impl_backend=twinkle``.

verl's ``patch_forward_with_backends`` gives the model class the fused forward of its architecture
(``dense_common``, ``qwen2_vl``, ``qwen3_vl``, ``glm4v``, ``qwen3_5``): it runs the model body, rolls the labels
(or takes ``shift_labels``) and calls ``FusedLinearForPPO.forward(hidden_states, vocab_weights=lm_head.weight,
input_ids, temperature)`` for the log-probs and entropy. Under ``impl_backend=twinkle``:

- :func:`patch_forward_with_backends` lets verl choose that forward as for its "torch" backend, and wraps it so
  that the model's calls run as a :class:`TwinkleModelCall` (a context variable). What verl records and prints of
  the backend names twinkle: the model's ``_verl_fused_kernels_backend`` (from which verl 0.9.1's forwards build
  their ``FusedLinearForPPO``, whose ``__init__`` then takes "twinkle": :func:`fused_linear_init`) and the line
  "Using twinkle backend for fused kernels in <model class>";
- :func:`fused_linear_forward`: inside such a call, ``FusedLinearForPPO.forward`` computes with
  ``twinkle_mem.linear_selective_log_softmax`` (fp32 log-probs and entropy in one pass over vocab blocks, the
  temperature applied in fp32, the logits never whole, told whether the entropy is trained:
  ``entropy_grad.py``); anywhere else it is verl's own.

The LM head's weight: under FSDP1, and under FSDP2 where it is the root's (tied), the model's forward sees it
unsharded. Under FSDP2 with untied embeddings verl shards ``lm_head`` on its own, so ``lm_head.weight`` is a
DTensor shard there (verl's torch backend then fails on "mixed torch.Tensor and DTensor"): the head's
computation is registered with FSDP as a forward method of ``lm_head`` (``register_fsdp_forward_method``), so
FSDP unshards the weight around it and again for its backward, and reduce-scatters its gradient, as it does for
``lm_head``'s own forward: no copy of the weight beyond FSDP's unshard. A DTensor weight of a module that is not
FSDP's (tensor parallelism) is gathered with ``full_tensor()`` for the call.
"""
import contextlib
import functools
import io
import logging
from contextvars import ContextVar
from types import MethodType
from typing import Optional

import torch

import twinkle_mem

from .entropy_grad import head_options
from .settings import FUSED_CHUNK_BYTES, IMPL_BACKEND

logger = logging.getLogger("twinkle_mem.verl")

_FSDP_METHOD = "twinkle_mem_log_probs"  # the lm_head method FSDP2 runs with its weight unsharded


class TwinkleModelCall:
    """One forward of a model verl gave the twinkle backend: the model and install()'s chunk budget."""

    def __init__(self, model: torch.nn.Module, chunk_bytes: Optional[int]):
        self.model, self.chunk_bytes = model, chunk_bytes

    def log_probs(self, hidden, weight, labels, temperature):
        """(log-probs, entropy) of ``labels`` under softmax((hidden @ weight.T) / temperature), both fp32."""
        from torch.distributed.tensor import DTensor
        if isinstance(weight, DTensor):
            head = _fsdp_module_of(self.model, weight)
            if head is not None:
                return getattr(head, _FSDP_METHOD)(hidden, labels, temperature, self.chunk_bytes)
            weight = weight.full_tensor()  # (not FSDP's: tensor parallelism)
        return head_log_probs(hidden, weight, labels, temperature, self.chunk_bytes)


_CALL: ContextVar[Optional[TwinkleModelCall]] = ContextVar("twinkle_mem_verl_model_call", default=None)


def head_log_probs(hidden, weight, labels, temperature, chunk_bytes):
    """verl's FusedLinearForPPO contract on twinkle-mem: hidden [..., H], labels [...] -> fp32 (log-probs,
    entropy) [...], every row computed (verl ignores none)."""
    return twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, temperature=float(temperature),
                                                    chunk_bytes=chunk_bytes, **head_options())


def _fsdp_module_of(model: torch.nn.Module, weight) -> Optional[torch.nn.Module]:
    """The FSDP2 module whose own parameter ``weight`` is (``lm_head``), with the head's method registered on it
    once; None where no FSDP2 module owns it."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    candidates = [output] if output is not None else []
    candidates += [m for m in model.modules() if m is not output]
    owner = next((m for m in candidates if getattr(m, "weight", None) is weight), None)
    if not isinstance(owner, FSDPModule):
        return None
    if _FSDP_METHOD not in vars(owner):
        def log_probs(module, hidden, labels, temperature, chunk_bytes):
            return head_log_probs(hidden, module.weight, labels, temperature, chunk_bytes)  # (unsharded here)
        setattr(owner, _FSDP_METHOD, MethodType(log_probs, owner))
        register_fsdp_forward_method(owner, _FSDP_METHOD)
    return owner


def patch_forward_with_backends(original, plan):
    """verl's ``patch_forward_with_backends`` with ``fused_kernels_backend="twinkle"`` accepted: verl picks the
    fused forward of the model's architecture as for its torch backend; the class's forward then runs each call
    as a :class:`TwinkleModelCall`. Any other backend: verl's own."""
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def patched(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not (use_fused_kernels and fused_kernels_backend == IMPL_BACKEND):
            return original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)
        with contextlib.redirect_stdout(io.StringIO()):  # ("Using Torch backend ...": printed below as it holds)
            original(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model._verl_fused_kernels_backend = IMPL_BACKEND
        cls = type(model)
        cls.forward = _on_twinkle(cls.forward, chunk_bytes)
        print(f"Using {IMPL_BACKEND} backend for fused kernels in {cls.__name__}")
        logger.info("twinkle-mem: %s.forward computes log-probs and entropy with twinkle-mem's fused head "
                    "(impl_backend=%s)", cls.__name__, IMPL_BACKEND)

    return patched


def _on_twinkle(forward, chunk_bytes):
    @functools.wraps(forward)
    def forward_on_twinkle(self, *args, **kwargs):
        token = _CALL.set(TwinkleModelCall(self, chunk_bytes))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return forward_on_twinkle


def fused_linear_init(original, plan):
    """``FusedLinearForPPO.__init__``: ``impl_backend="twinkle"`` accepted (verl's own check knows torch and liger);
    the forward is twinkle-mem's inside a twinkle model's call (:func:`fused_linear_forward`)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if kwargs.get("impl_backend") != IMPL_BACKEND:
            return original(self, *args, **kwargs)
        original(self, *args, **{**kwargs, "impl_backend": "torch"})
        self.impl_backend = IMPL_BACKEND

    return __init__


def fused_linear_forward(original, plan):
    """``FusedLinearForPPO.forward``: twinkle-mem's fused head inside a twinkle model's forward, verl's elsewhere."""

    @functools.wraps(original)
    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        call = _CALL.get()
        if call is None:
            return original(self, hidden_states, vocab_weights, input_ids, temperature)
        return call.log_probs(hidden_states, vocab_weights, input_ids, temperature)

    return forward
