"""Composite PyTorch implementation of the twinkle_mem op contract.

The same three ops as the native kernels (csrc/ops.cpp), written with
ordinary torch operators, so that any device without a native kernel (an NPU
whose AscendC kernels were not built, MPS, XPU, ...) runs the op through the
same ``torch.ops.twinkle_mem`` entry points. The functions are registered as
the ops' ``CompositeExplicitAutograd`` kernels; a kernel registered for a
backend key (CPU, CUDA, PrivateUse1 from the native libraries) wins over them
on its device. Autograd is the one registered on the forward op in ops.py:
its backward calls the backward ops, which land here too.

The math is the shared math of csrc/common/online_softmax.h, applied to
blocks of rows instead of vectors: each block of logits is cast to fp32
(fp64 for fp64 logits), scaled by 1/T, reduced to an online state
(max, sum exp, sum (z - max) exp) and merged into the row's state; the
backward recomputes p = exp(z - lse) block by block. Blocks are sized so that
the fp32 temporaries alive at once stay within a byte budget (default
64 MiB; env ``TWINKLE_MEM_COMPOSITE_BUDGET``, e.g. ``16M``, or the
``budget_bytes`` argument). Rows longer than the budget are cut along the
vocab and merged. Nothing full-vocab is kept: autograd saves the logits
reference, the labels and the O(N) lse / mean.

``forced()`` routes the ops to these functions on devices that do have a
native kernel (the CPU by default), for tests and for comparison.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from typing import Iterator, Optional, Sequence

import torch

from . import ops as _ops  # noqa: F401  (loads the schemas)

DEFAULT_BUDGET_BYTES = 64 << 20
MIN_BUDGET_BYTES = 4096
# fp32 (fp64) block-sized temporaries alive at once in the forward and the backward.
_TEMPS_PER_ELEMENT = 2

_budget_override: Optional[int] = None


def parse_budget(text: str) -> int:
    """'67108864', '64M', '64MiB', '1G', '512k' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"twinkle_mem: cannot parse a byte budget from {text!r} (e.g. 67108864, 64M, 1G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * scale


def resolve_budget(override: Optional[int] = None) -> int:
    """The byte budget in force: argument, then forced(budget_bytes=...), then env, then 64 MiB."""
    if override is None:
        override = _budget_override
    if override is None:
        env = os.environ.get("TWINKLE_MEM_COMPOSITE_BUDGET")
        override = parse_budget(env) if env else DEFAULT_BUDGET_BYTES
    if override < MIN_BUDGET_BYTES:
        raise ValueError(f"twinkle_mem: the composite budget must be >= {MIN_BUDGET_BYTES} bytes, got {override}")
    return int(override)


def block_shape(n: int, v: int, acc_dtype: torch.dtype, budget: int) -> tuple[int, int]:
    """(rows, cols) of a block whose fp32/fp64 temporaries fit in `budget` bytes."""
    elem = torch.empty((), dtype=acc_dtype).element_size()
    max_elems = max(1, budget // (_TEMPS_PER_ELEMENT * elem))
    if v <= max_elems:
        return max(1, min(n, max_elems // max(v, 1))), v
    return 1, max_elems


def _blocks(n: int, v: int, rows: int, cols: int) -> Iterator[tuple[int, int, int, int]]:
    for r0 in range(0, n, rows):
        for c0 in range(0, v, cols):
            yield r0, min(r0 + rows, n), c0, min(c0 + cols, v)


# ------------------------------------------------------------ argument checks
# The checks of csrc/common/op_checks.h, with the same messages (RuntimeError).
def _fail(msg: str) -> None:
    raise RuntimeError("twinkle_mem: " + msg)


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _stats_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        _fail(f"logits must be 2-D [N, V] (flatten leading dims), got {logits.dim()}-D")
    if logits.dtype not in _FLOAT_DTYPES:
        _fail("logits must be bfloat16, float16, float32 or float64")
    n, v = logits.shape
    if v < 1 and n != 0:
        _fail("logits must have a vocab dim of size >= 1")
    if v > 1 and logits.stride(1) != 1:
        _fail(f"logits must have unit stride on the vocab dim, got stride {logits.stride(1)}")
    if n > 1 and logits.stride(0) < v:
        _fail(f"logits rows must not overlap (row stride {logits.stride(0)} < vocab size {v})")


def _check_labels(labels: torch.Tensor, logits: torch.Tensor) -> None:
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        _fail(f"labels must be 1-D of length N = {logits.shape[0]}")
    if labels.dtype not in (torch.int64, torch.int32):
        _fail("labels must be int64 or int32")
    if labels.device != logits.device:
        _fail("labels and logits must be on the same device")


def _check_row_vector(t: torch.Tensor, name: str, logits: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != logits.shape[0]:
        _fail(f"{name} must be 1-D of length N = {logits.shape[0]}")
    if t.dtype != _stats_dtype(logits):
        _fail(f"{name} must be float32 (float64 for float64 logits)")
    if t.device != logits.device:
        _fail(f"{name} must be on the logits' device")


def _check_inv_temperature(inv_temperature: float) -> None:
    if not (math.isfinite(inv_temperature) and inv_temperature > 0):
        _fail(f"inv_temperature must be finite and > 0 (temperature > 0), got {inv_temperature}")


def _check_label_range(labels64: torch.Tensor, ignored: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    bad = ~ignored & ((labels64 < 0) | (labels64 >= vocab_size))
    if labels64.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        _fail(f"labels[{i}] = {int(labels64[i])} is out of range [0, {vocab_size}) and is not "
              f"ignore_index ({ignore_index})")


def _row_labels(labels: torch.Tensor, ignore_index: int, vocab_start: int, v: int):
    """(ignored, local target or -1) per row, as in online_softmax.h's is_ignored / local_target."""
    labels64 = labels.to(torch.int64)
    ignored = labels64 == ignore_index
    local = labels64 - vocab_start
    target = torch.where((local >= 0) & (local < v) & ~ignored, local, torch.full_like(local, -1))
    return labels64, ignored, target


# ------------------------------------------------------------- online state
def _merge(a, b):
    """online_softmax.h merge(), on per-row tensors (max, sum, zsum)."""
    a_max, a_sum, a_zsum = a
    b_max, b_sum, b_zsum = b
    new_max = torch.where(a_max > b_max, a_max, b_max)
    da, db = a_max - new_max, b_max - new_max
    ea, eb = torch.exp(da), torch.exp(db)
    m_sum = a_sum * ea + b_sum * eb
    m_zsum = (a_zsum + da * a_sum) * ea + (b_zsum + db * b_sum) * eb
    b_empty, a_empty = b_sum == 0, a_sum == 0
    pick = lambda x_a, x_b, x_m: torch.where(b_empty, x_a, torch.where(a_empty, x_b, x_m))  # noqa: E731
    return pick(a_max, b_max, new_max), pick(a_sum, b_sum, m_sum), pick(a_zsum, b_zsum, m_zsum)


def _block_state(x_block: torch.Tensor, inv_t: float, acc: torch.dtype, with_entropy: bool):
    """State of z = x_block * inv_t per row; shift = finite_shift(max)."""
    z = x_block.to(acc, copy=True)  # temporary 1
    if inv_t != 1.0:
        z.mul_(inv_t)
    row_max = z.amax(dim=1)  # NaN propagates
    shift = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)
    if with_entropy:
        # entropy_term: (max(lowest, z) - shift) * e, so -inf logits add 0, not NaN.
        z.clamp_(min=torch.finfo(acc).min)
    z.sub_(shift.unsqueeze(1))
    e = torch.exp(z)  # temporary 2
    s = e.sum(dim=1)
    zs = z.mul_(e).sum(dim=1) if with_entropy else torch.zeros_like(s)
    return shift, s, zs


# ------------------------------------------------------------------- the ops
@torch.no_grad()
def selective_log_softmax_fwd(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size,
                              with_entropy, inplace_backward=False, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_fwd (same arguments and results)."""
    _check_logits(logits)
    _check_labels(labels, logits)
    _check_inv_temperature(inv_temperature)
    n, v = logits.shape
    if vocab_start < 0 or vocab_start + v > vocab_size:
        _fail(f"the logits' vocab shard [vocab_start, vocab_start + V) = [{vocab_start}, {vocab_start + v}) must "
              f"lie within [0, vocab_size = {vocab_size})")
    labels64, ignored, target = _row_labels(labels, ignore_index, vocab_start, v)
    _check_label_range(labels64, ignored, vocab_size, ignore_index)

    acc = _stats_dtype(logits)
    inv_t = float(inv_temperature)
    n_stats = n if with_entropy else 0
    logp = torch.empty(n, dtype=acc, device=logits.device)
    lse = torch.empty(n, dtype=acc, device=logits.device)
    entropy = torch.empty(n_stats, dtype=acc, device=logits.device)
    mean = torch.empty(n_stats, dtype=acc, device=logits.device)
    if n == 0:
        return logp, entropy, lse, mean

    rows, cols = block_shape(n, v, acc, resolve_budget(budget_bytes))
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        empty = torch.full((r1 - r0,), -math.inf, dtype=acc, device=logits.device)
        state = (empty, torch.zeros_like(empty), torch.zeros_like(empty))
        for c0 in range(0, v, cols):
            block = _block_state(logits[r0:r1, c0:c0 + cols], inv_t, acc, with_entropy)
            state = _merge(state, block)
        s_max, s_sum, s_zsum = state
        log_sum = torch.log(s_sum)
        rel_mean = s_zsum / s_sum  # E_p[z] - max
        row_lse = s_max + log_sum
        zero = torch.zeros((), dtype=acc, device=logits.device)
        ign = ignored[r0:r1]
        lse[r0:r1] = torch.where(ign, zero, row_lse)
        tgt = target[r0:r1]
        x_t = logits[r0:r1].gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1).to(acc)
        logp[r0:r1] = torch.where(tgt >= 0, x_t * inv_t - row_lse, zero)
        if with_entropy:
            entropy[r0:r1] = torch.where(ign, zero, log_sum - rel_mean)
            mean[r0:r1] = torch.where(ign, zero, s_max + rel_mean)
    return logp, entropy, lse, mean


def _check_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature):
    _check_logits(logits)
    _check_labels(labels, logits)
    _check_row_vector(grad_logp, "grad_logp", logits)
    _check_row_vector(lse, "lse", logits)
    if grad_entropy is not None:
        _check_row_vector(grad_entropy, "grad_entropy", logits)
        if mean is None:
            _fail("grad_entropy needs mean (run the forward with_entropy)")
        _check_row_vector(mean, "mean", logits)
    _check_inv_temperature(inv_temperature)


def _block_grad(out, x, lse, mean, g_logp, g_entropy, target, ignored, inv_t, acc):
    """out = d x for one block of rows and vocab; `target` is block-local (outside [0, cols): elsewhere).

    A function, so that its two block-sized temporaries are freed on return,
    before the next block allocates its own.
    """
    # z = x / T (temporary 1); p = exp(z - lse) (temporary 2)
    z = x.to(acc, copy=True)
    if inv_t != 1.0:
        z.mul_(inv_t)
    p = torch.sub(z, lse.unsqueeze(1)).exp_()
    # grad_logit with onehot = 0: -(g_logp p + g_H p (max(lowest, z) - mean)) / T,
    # p (z - mean) first so that p = 0 at z = -inf gives 0, not 0 * inf.
    if g_entropy is not None:
        z.clamp_(min=torch.finfo(acc).min).sub_(mean.unsqueeze(1)).mul_(p).mul_(g_entropy.unsqueeze(1))
        d = p.mul_(g_logp.unsqueeze(1)).add_(z)
    else:
        d = p.mul_(g_logp.unsqueeze(1))
    d.mul_(-inv_t)
    # onehot term: + g_logp / T at the label, when it lies in this block.
    cols = x.shape[1]
    here = (target >= 0) & (target < cols)
    add = torch.where(here, g_logp * inv_t, torch.zeros_like(g_logp))
    d.scatter_add_(1, target.clamp(0, cols - 1).unsqueeze(1), add.unsqueeze(1))
    d.masked_fill_(ignored.unsqueeze(1), 0)
    out.copy_(d)


def _backward_into(out, grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                   vocab_start, budget):
    """out = d logits, block by block; out may be logits itself (each block is read before it is written)."""
    n, v = logits.shape
    if n == 0:
        return
    acc = _stats_dtype(logits)
    _labels64, ignored, target = _row_labels(labels, ignore_index, vocab_start, v)
    rows, cols = block_shape(n, v, acc, budget)
    for r0, r1, c0, c1 in _blocks(n, v, rows, cols):
        rs = slice(r0, r1)
        _block_grad(out[rs, c0:c1], logits[rs, c0:c1], lse[rs], None if mean is None else mean[rs],
                    grad_logp[rs], None if grad_entropy is None else grad_entropy[rs],
                    torch.where(target[rs] >= 0, target[rs] - c0, -1), ignored[rs], float(inv_temperature), acc)


@torch.no_grad()
def selective_log_softmax_bwd(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                              vocab_start, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_bwd: returns d logits (contiguous, logits' dtype)."""
    _check_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _backward_into(grad, grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                   vocab_start, resolve_budget(budget_bytes))
    return grad


@torch.no_grad()
def selective_log_softmax_bwd_(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                               vocab_start, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_bwd_: writes d logits over the logits."""
    _check_backward(grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature)
    _backward_into(logits, grad_logp, grad_entropy, logits, labels, lse, mean, inv_temperature, ignore_index,
                   vocab_start, resolve_budget(budget_bytes))


# ----------------------------------------------------------------- registration
_OPS = {
    "selective_log_softmax_fwd": selective_log_softmax_fwd,
    "selective_log_softmax_bwd": selective_log_softmax_bwd,
    "selective_log_softmax_bwd_": selective_log_softmax_bwd_,
}

# CompositeExplicitAutograd ("default" in torch.library.impl): every backend key
# without its own kernel. The library object keeps the registrations alive.
_lib = torch.library.Library("twinkle_mem", "IMPL")
for _name, _fn in _OPS.items():
    torch.library.impl(f"twinkle_mem::{_name}", "default", _fn, lib=_lib)


@contextlib.contextmanager
def forced(device_types: Sequence[str] = ("cpu",), budget_bytes: Optional[int] = None):
    """Route torch.ops.twinkle_mem.* on `device_types` to the composite functions.

    Registers the composite functions for those devices' dispatch keys over the
    native kernels, and removes them on exit (the native kernels are back).
    With `budget_bytes`, the composite uses that budget meanwhile.
    """
    global _budget_override
    if budget_bytes is not None:
        resolve_budget(budget_bytes)  # validate
    lib = torch.library.Library("twinkle_mem", "IMPL")
    saved = _budget_override
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for device_type in device_types:
                for name, fn in _OPS.items():
                    torch.library.impl(f"twinkle_mem::{name}", device_type, fn, lib=lib)
        _budget_override = budget_bytes if budget_bytes is not None else saved
        yield
    finally:
        _budget_override = saved
        lib._destroy()
