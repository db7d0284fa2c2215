"""Fake (meta) kernels and autograd for the native ops torch.ops.twinkle_mem.*.

The schemas live in schemas.def (registered by csrc/ops.cpp). The forward saves only the logits
reference, the labels and O(N) statistics (shift, log_sum, and entropy when
computed); the backward is one native call, out of place or written over the
logits (inplace_backward), and is not differentiable again (a double backward raises).
The public functions call the ops through thin wrappers that take 1/T as a tensor
(fwd_t, bwd_t, bwd_t_ at the end: no recompile per temperature under torch.compile).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import native
from .contract import OpOptions, new_grad_like, stats_dtype
from .op_args import register_autograd

native.load()

fwd = torch.ops.twinkle_mem.selective_log_softmax_fwd.default
bwd = torch.ops.twinkle_mem.selective_log_softmax_bwd.default
bwd_inplace = torch.ops.twinkle_mem.selective_log_softmax_bwd_.default


@torch.library.register_fake("twinkle_mem::selective_log_softmax_fwd")
def _fwd_fake(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size, with_entropy,
              inplace_backward=False):
    torch._check(logits.dim() in (2, 3), lambda: "twinkle_mem: logits must be [N, V] or [B, S, V]")
    lead = logits.shape[:-1]
    torch._check(labels.dim() in (len(lead), len(lead) + 1) and labels.shape[:len(lead)] == lead,
                 lambda: "twinkle_mem: labels must have the logits' leading shape (+ [k])")
    dtype = stats_dtype(logits)
    return (logits.new_empty(labels.shape, dtype=dtype), logits.new_empty(lead if with_entropy else (0,), dtype=dtype),
            logits.new_empty(lead, dtype=dtype), logits.new_empty(lead, dtype=dtype))


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd")
def _bwd_fake(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature, ignore_index,
              vocab_start):
    return new_grad_like(logits)


@torch.library.register_fake("twinkle_mem::selective_log_softmax_bwd_")
def _bwd_inplace_fake(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                      ignore_index, vocab_start):
    return None


def _setup_context(ctx, inputs, output):
    logits, labels, *_ = inputs
    _logp, entropy, shift, log_sum = output
    ctx.options = OpOptions.of_forward(inputs)
    ctx.save_for_backward(logits, labels, shift, log_sum, entropy if ctx.options.with_entropy else None)
    ctx.mark_non_differentiable(shift, log_sum)


class _NotTwiceDifferentiable(torch.autograd.Function):
    """The first-order gradient, attached to the backward's inputs (``depends_on``) through a node whose own
    backward raises: the native backward has no derivative."""

    @staticmethod
    def forward(ctx, grad, *depends_on):
        return grad.detach()

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError("twinkle_mem.selective_log_softmax does not support double backward (a gradient of its "
                           "gradient, e.g. torch.autograd.grad(..., create_graph=True) differentiated again): its "
                           "backward is one native op without a derivative of its own")


def backward_into_logits(logits, labels, shift, log_sum, entropy, grad_logp, grad_entropy, options: OpOptions):
    """One native backward call; returns the gradient (with ``options.inplace_backward``, an alias of the
    logits' storage, which holds it; ``grad_entropy`` is used only with ``options.with_entropy``).

    Under ``create_graph=True`` the gradient is computed without a graph and returned through an alias
    whose backward raises, so that a second backward fails loudly instead of seeing a zero derivative."""
    grad_entropy = grad_entropy if options.with_entropy else None
    depends_on = [t for t in (logits, grad_logp, grad_entropy) if t is not None and t.requires_grad]
    double_backward_wanted = torch.is_grad_enabled() and depends_on
    with torch.no_grad():
        grad = _native_backward(logits, labels, shift, log_sum, entropy, grad_logp, grad_entropy, options)
    if double_backward_wanted:
        grad = _NotTwiceDifferentiable.apply(grad, *depends_on)
    return grad


def _native_backward(logits, labels, shift, log_sum, entropy, grad_logp, grad_entropy, options: OpOptions):
    if grad_logp is None:
        grad_logp = shift.new_zeros(labels.shape)
    use_entropy = entropy is not None and grad_entropy is not None
    args = (grad_logp, grad_entropy if use_entropy else None)
    rest = (labels, shift, log_sum, entropy if use_entropy else None, options.inv_temperature, options.ignore_index,
            options.vocab_start)
    tensor_temperature = isinstance(options.inv_temperature, Tensor)  # the fwd_t path
    if options.inplace_backward:
        (bwd_t_ if tensor_temperature else bwd_inplace)(*args, logits, *rest)
        # The dispatcher does not bump the version of a tensor a native op
        # mutates: do it, so that any other saved use of the logits raises
        # (bwd_t_, a Python custom op, bumps it itself; once more is harmless).
        torch.autograd.graph.increment_version(logits)
        # A new tensor over the same storage, not the logits tensor itself: where the gradient lands in a
        # .grad (leaf logits, retain_grad), autograd takes a tensor no one else holds as it is, but copies
        # one still referenced (by the caller, by the graph), a whole fresh [N, V] buffer (issue 41).
        return logits.detach()
    return (bwd_t if tensor_temperature else bwd)(*args, logits, *rest)


def _backward(ctx, grad_logp, grad_entropy, _grad_shift, _grad_log_sum):
    logits, labels, shift, log_sum, entropy = ctx.saved_tensors
    return {"logits": backward_into_logits(logits, labels, shift, log_sum, entropy, grad_logp, grad_entropy,
                                           ctx.options)}


register_autograd("twinkle_mem::selective_log_softmax_fwd", _backward, _setup_context)


# ------------------------------------------------------------------ 1/T as a tensor, for torch.compile
# torch.compile turns a temperature that changes between calls into a SymFloat, and specializes any SymFloat
# that reaches a `float` op argument (one recompile per temperature). The public functions therefore hand
# 1/T to the wrappers below as a 0-dim float64 CPU tensor (tensor arithmetic on a SymFloat stays symbolic);
# each wrapper reads its value (a CPU tensor: no device sync) and calls the native op.
def inv_temperature_tensor(temperature) -> Tensor:
    """1/temperature as a 0-dim float64 CPU tensor; the same double as ``1.0 / temperature``."""
    return torch.ones((), dtype=torch.float64, device="cpu").div(temperature)


@torch.library.custom_op("twinkle_mem::selective_log_softmax", mutates_args=())
def fwd_t(logits: Tensor, labels: Tensor, inv_temperature: Tensor, ignore_index: int, vocab_start: int,
          vocab_size: int, with_entropy: bool, inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """selective_log_softmax_fwd with 1/T as a tensor."""
    return fwd(logits, labels, inv_temperature.item(), ignore_index, vocab_start, vocab_size, with_entropy,
               inplace_backward)


@torch.library.custom_op("twinkle_mem::selective_log_softmax_backward", mutates_args=())
def bwd_t(grad_logp: Tensor, grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor, shift: Tensor,
          log_sum: Tensor, entropy: Optional[Tensor], inv_temperature: Tensor, ignore_index: int,
          vocab_start: int) -> Tensor:
    """selective_log_softmax_bwd with 1/T as a tensor."""
    return bwd(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature.item(),
               ignore_index, vocab_start)


@torch.library.custom_op("twinkle_mem::selective_log_softmax_backward_", mutates_args=("logits",))
def bwd_t_(grad_logp: Tensor, grad_entropy: Optional[Tensor], logits: Tensor, labels: Tensor, shift: Tensor,
           log_sum: Tensor, entropy: Optional[Tensor], inv_temperature: Tensor, ignore_index: int,
           vocab_start: int) -> None:
    """selective_log_softmax_bwd_ (the gradient written over the logits) with 1/T as a tensor."""
    bwd_inplace(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature.item(),
                ignore_index, vocab_start)


fwd_t.register_fake(_fwd_fake)
bwd_t.register_fake(_bwd_fake)
bwd_t_.register_fake(_bwd_inplace_fake)
register_autograd(fwd_t, _backward, _setup_context)
