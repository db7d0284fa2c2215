"""The op's contract on the Python side, in one place.

Owns what every Python caller and kernel of torch.ops.twinkle_mem.* must agree on: the dtypes,
the ignore-index sentinel, the statistics' dtype, the options past the schema boundary
(``OpOptions``), the public functions' argument checks (ValueError naming the argument) and the
kernel-level checks of the composite kernels (RuntimeError, the same messages as the native
kernels' csrc/common/op_checks.h, so that a device without a native kernel fails the same way).
Used by the op's modules and the heads built on it (heads/).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)

# A label value no int32/int64 label can take when the caller ignores nothing.
NO_IGNORE_INDEX = -(2**63)


def ignore_value(ignore_index: Optional[int]) -> int:
    """The op's ``ignore_index`` argument for a caller's ``ignore_index`` (None: ignore nothing)."""
    return NO_IGNORE_INDEX if ignore_index is None else int(ignore_index)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of ``dtype``: fp32, fp64 for fp64 (the one rule: the op's statistics and
    outputs, the fused heads' sums and outputs, linear_argmax's maxima)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stats_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype of every output and statistic: acc_dtype of the logits' dtype."""
    return acc_dtype(logits.dtype)


class OpOptions(NamedTuple):
    """The scalar arguments of one call, as the forward received them and the backward needs them
    (csrc/common/op_options.h is the C++ side's struct)."""
    inv_temperature: object  # a float, or a 0-dim tensor on the torch.compile path (ops.fwd_t)
    ignore_index: int
    vocab_start: int
    with_entropy: bool
    inplace_backward: bool = False

    @classmethod
    def of_forward(cls, inputs) -> "OpOptions":
        """From selective_log_softmax_fwd's inputs (the schema's order)."""
        _logits, _labels, inv_temperature, ignore_index, vocab_start, _vocab_size, with_entropy, *rest = inputs
        return cls(inv_temperature, ignore_index, vocab_start, bool(with_entropy), bool(rest[0]) if rest else False)


# ------------------------------------------------------------ public functions (ValueError)
def check_float_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a bf16/fp16/fp32/fp64 tensor, got {getattr(t, 'dtype', type(t))}")


def check_logits_args(logits, index, temperature, ignore_index) -> bool:
    """selective_log_softmax's checks; returns whether ``index`` is ``[..., k]``."""
    check_float_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocab dim of size >= 1, got shape {tuple(logits.shape)}")
    return check_index_and_options(index, logits, "logits", temperature, ignore_index)


def check_index_and_options(index, rows, rows_name, temperature, ignore_index) -> bool:
    """The checks shared by every public function whose rows are ``rows [..., X]`` (the logits, or the
    hidden states of linear_selective_log_softmax): index of the leading shape (+ [k]) on the same device,
    temperature, ignore_index. Returns whether ``index`` is ``[..., k]``."""
    if not isinstance(index, torch.Tensor) or index.dtype not in INDEX_DTYPES:
        raise ValueError(f"index must be an int64 or int32 tensor, got {getattr(index, 'dtype', type(index))}")
    lead = tuple(rows.shape[:-1])
    multi = index.dim() == rows.dim()
    if not (tuple(index.shape) == lead or (multi and tuple(index.shape[:-1]) == lead)):
        raise ValueError(f"index shape {tuple(index.shape)} must be {rows_name}.shape[:-1] = {lead}, or that plus a "
                         "trailing dim of k indices per row")
    if index.device != rows.device:
        raise ValueError(f"index is on {index.device} but {rows_name} are on {rows.device}")
    if isinstance(temperature, torch.Tensor):
        raise ValueError("temperature must be a Python number, not a tensor")
    # Comparisons, not math.isfinite: under torch.compile a temperature that changed between calls is a
    # SymFloat, which the comparisons keep symbolic (NaN fails both).
    if not (0 < temperature < math.inf):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if ignore_index is not None and not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")
    return multi


# ------------------------------------------------------------ kernels (RuntimeError, op_checks.h)
def fail(msg: str) -> None:
    raise RuntimeError("twinkle_mem: " + msg)


def check_op_logits(logits: torch.Tensor) -> None:
    if logits.dim() not in (2, 3):
        fail(f"logits must be [N, V] or [B, S, V] (the Python API flattens other leading dims), got "
             f"{logits.dim()}-D")
    if logits.dtype not in FLOAT_DTYPES:
        fail("logits must be bfloat16, float16, float32 or float64")
    v = logits.shape[-1]
    if v < 1 and logits.numel() == 0 and math.prod(logits.shape[:-1]) != 0:
        fail("logits must have a vocab dim of size >= 1")
    if v > 1 and logits.stride(-1) != 1:
        fail(f"logits must have unit stride on the vocab dim, got stride {logits.stride(-1)}")
    dims = sorted((d for d in range(logits.dim() - 1) if logits.shape[d] > 1), key=logits.stride)
    extent = v
    for d in dims:
        if logits.stride(d) < extent:
            fail(f"logits rows must not overlap (stride {logits.stride(d)} of dim {d} < {extent} elements inside it)")
        extent += (logits.shape[d] - 1) * logits.stride(d)


def check_op_labels(labels: torch.Tensor, logits: torch.Tensor) -> None:
    lead = logits.shape[:-1]
    if labels.dim() not in (len(lead), len(lead) + 1) or labels.shape[:len(lead)] != lead:
        fail("labels must have the logits' leading shape, optionally with a trailing dim of k labels per row "
             f"(labels {labels.dim()}-D, logits {logits.dim()}-D)")
    if labels.dtype not in INDEX_DTYPES:
        fail("labels must be int64 or int32")
    if labels.device != logits.device:
        fail("labels and logits must be on the same device")


def check_op_stats(t: torch.Tensor, name: str, shape, what: str, logits: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(shape):
        fail(f"{name} must have the shape of {what}")
    if t.dtype != stats_dtype(logits):
        fail(f"{name} must be float32 (float64 for float64 logits)")
    if t.device != logits.device:
        fail(f"{name} must be on the logits' device")


def check_op_inv_temperature(inv_temperature: float) -> None:
    if not (math.isfinite(inv_temperature) and inv_temperature > 0):
        fail(f"inv_temperature must be finite and > 0 (temperature > 0), got {inv_temperature}")


def check_op_vocab_shard(vocab_start: int, v: int, vocab_size: int) -> None:
    if vocab_start < 0 or vocab_start + v > vocab_size:
        fail(f"the logits' vocab shard [vocab_start, vocab_start + V) = [{vocab_start}, {vocab_start + v}) must "
             f"lie within [0, vocab_size = {vocab_size})")


# The out-of-range label message: csrc/common/label_message.h's text, word for word.
def label_rule(vocab_size: int, ignore_index: int) -> str:
    """What a label must be: 'neither a token id in [0, V) (vocab size V) nor the ignore_index (...)'."""
    ignore = "none given" if ignore_index == NO_IGNORE_INDEX else str(ignore_index)
    return f"neither a token id in [0, {vocab_size}) (vocab size {vocab_size}) nor the ignore_index ({ignore})"


IGNORE_HINT = "to ignore padding labels such as -100 (logp 0, no gradient), pass ignore_index=-100"


def label_out_of_range_message(index: int, label: int, vocab_size: int, ignore_index: int) -> str:
    if label < 0:  # padding, most likely: say how to ignore exactly this value
        todo = f"to ignore such positions (logp 0, no gradient), pass ignore_index={label}"
    else:
        todo = "check that the labels come from the logits' vocabulary"
    return (f"twinkle_mem: label out of range: labels.flatten()[{index}] = {label} is "
            f"{label_rule(vocab_size, ignore_index)}; {todo}")


def check_op_label_range(y: torch.Tensor, ignored: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """y: the labels in their flattened order (labels.flatten() of the caller's index)."""
    if y.numel() == 0:
        return
    bad = ~ignored & ((y < 0) | (y >= vocab_size))
    if y.device.type != "cpu":
        # No host synchronisation on an accelerator: a device-side assert, as nll_loss does; its message
        # cannot name the label.
        torch._assert_async(~bad.any(), f"twinkle_mem: label out of range: some label is "
                                        f"{label_rule(vocab_size, ignore_index)}; {IGNORE_HINT}")
        return
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        raise RuntimeError(label_out_of_range_message(i, int(y.flatten()[i]), vocab_size, ignore_index))


def check_op_backward(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                      vocab_start) -> None:
    check_op_logits(logits)
    check_op_labels(labels, logits)
    lead = logits.shape[:-1]
    check_op_stats(grad_logp, "grad_logp", labels.shape, "the labels", logits)
    check_op_stats(shift, "shift", lead, "the logits' leading dims", logits)
    check_op_stats(log_sum, "log_sum", lead, "the logits' leading dims", logits)
    if grad_entropy is not None:
        check_op_stats(grad_entropy, "grad_entropy", lead, "the logits' leading dims", logits)
        if entropy is None:
            fail("grad_entropy needs entropy (run the forward with_entropy)")
        check_op_stats(entropy, "entropy", lead, "the logits' leading dims", logits)
    check_op_inv_temperature(inv_temperature)
    if vocab_start < 0:
        fail(f"vocab_start must be >= 0 (the logits' shard starts at a token id), got {vocab_start}")


# ------------------------------------------------------------ the out-of-place gradient's layout
# The rule of csrc/common/layout.h (strided_grad_alloc), restated for the fake kernels and the
# composite, which must give the native layout without running native code; tests/op/test_contract.py
# holds the two to the same strides.
def strided_grad_alloc(sizes, strides):
    """csrc/common/layout.h strided_grad_alloc(): sizes to allocate for a gradient
    with the logits' strides, or None for a contiguous gradient."""
    ndim = len(sizes)
    if ndim not in (2, 3) or any(s < 1 for s in sizes):
        return None
    vocab = sizes[-1]
    if vocab > 1 and strides[-1] != 1:
        return None
    if strides[-2] < vocab:
        return None
    alloc = [0] * ndim
    alloc[-1] = strides[-2]
    for d in range(ndim - 2, 0, -1):
        if strides[d] <= 0 or strides[d - 1] % strides[d] != 0:
            return None
        alloc[d] = strides[d - 1] // strides[d]
        if alloc[d] < sizes[d]:
            return None
    alloc[0] = sizes[0]
    numel = 1
    span = 1
    for s, a in zip(sizes, alloc):
        numel *= s
        span *= a
    return alloc if numel < span and span - numel <= numel // 8 else None


def new_grad_like(logits: torch.Tensor) -> torch.Tensor:
    """The out-of-place gradient's layout, as the native backends allocate it."""
    sizes = list(logits.shape)
    alloc = strided_grad_alloc(sizes, list(logits.stride()))
    if alloc is None:
        return logits.new_empty(sizes)
    grad = logits.new_empty(alloc)
    for d, (s, a) in enumerate(zip(sizes, alloc)):
        if s != a:
            grad = grad.narrow(d, 0, s)
    return grad
