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

from . import contract
from . import ops  # noqa: F401  (loads the schemas)
from .contract import new_grad_like, stats_dtype
from .row_stats import label_matrix, output_shift

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


def _row_labels(labels: torch.Tensor, lead_dims: int, ignore_index: int, vocab_start: int, v: int):
    """[N, k] int64 labels, ignored mask, local target (or -1), and the skipped-row mask [N]."""
    y = label_matrix(labels, lead_dims)
    ignored = y == ignore_index
    local = y - vocab_start
    target = torch.where((local >= 0) & (local < v) & ~ignored, local, torch.full_like(local, -1))
    skipped = ignored.all(dim=1) if y.shape[1] > 0 else torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
    return y, ignored, target, skipped


def _row_views(t: torch.Tensor):
    """(first row, [rows, V] view) pieces of a [N, V] or [B, S, V] tensor, without copies."""
    if t.dim() == 2:
        yield 0, t
        return
    for b in range(t.shape[0]):
        yield b * t.shape[1], t[b]


# ------------------------------------------------------------- online state
def _merge(a, b, inv_t):
    """online_softmax.h merge(), on per-row tensors (max, rest, zsum); rest = -1 is the empty state."""
    a_max, a_rest, a_zsum = a
    b_max, b_rest, b_zsum = b
    a_top = ~(b_max > a_max)
    top_max, low_max = torch.where(a_top, a_max, b_max), torch.where(a_top, b_max, a_max)
    top_rest, low_rest = torch.where(a_top, a_rest, b_rest), torch.where(a_top, b_rest, a_rest)
    top_zsum, low_zsum = torch.where(a_top, a_zsum, b_zsum), torch.where(a_top, b_zsum, a_zsum)
    gap = ((low_max - top_max) * inv_t).clamp(min=-1e30)
    scale = torch.exp(gap)
    weight = low_rest * scale + scale
    m_rest = top_rest + weight
    m_zsum = top_zsum + (gap * weight + low_zsum * scale)
    b_empty, a_empty = b_rest == -1, a_rest == -1
    pick = lambda x_a, x_b, x_m: torch.where(b_empty, x_a, torch.where(a_empty, x_b, x_m))  # noqa: E731
    return pick(a_max, b_max, top_max), pick(a_rest, b_rest, m_rest), pick(a_zsum, b_zsum, m_zsum)


def _block_state(x_block: torch.Tensor, inv_t: float, acc: torch.dtype, with_entropy: bool):
    """State of one block of rows: (max x, sum of exp t but the first max's, sum t exp t), t = (x - shift) / T."""
    t = x_block.to(acc, copy=True)  # temporary 1
    row_max, at_max = t.max(dim=1)  # NaN propagates
    empty = row_max == -math.inf
    shift = torch.where(empty, torch.zeros_like(row_max), row_max)
    t.sub_(shift.unsqueeze(1))
    if inv_t != 1.0:
        t.mul_(inv_t)
    e = torch.exp(t)  # temporary 2
    e.scatter_(1, at_max.unsqueeze(1), 0.0)  # the max's exp(0) = 1 is the state's implicit 1
    rest = torch.where(empty, torch.full_like(row_max, -1.0), e.sum(dim=1))
    # entropy term: max(lowest, t) e, so -inf logits add 0, not NaN.
    zs = t.clamp_(min=torch.finfo(acc).min).mul_(e).sum(dim=1) if with_entropy else torch.zeros_like(rest)
    return row_max, rest, zs


# ------------------------------------------------------------------- the ops
# online_softmax.h exp_underflow(): below it p is 0 in the accumulator dtype.
_U_FLOOR = {torch.float32: -150.0, torch.float64: -1100.0}

@torch.no_grad()
def selective_log_softmax_fwd(logits, labels, inv_temperature, ignore_index, vocab_start, vocab_size,
                              with_entropy, inplace_backward=False, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_fwd (same arguments and results)."""
    contract.check_op_logits(logits)
    contract.check_op_labels(labels, logits)
    contract.check_op_inv_temperature(inv_temperature)
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    contract.check_op_vocab_shard(vocab_start, v, vocab_size)
    y, ignored, target, skipped = _row_labels(labels, len(lead), ignore_index, vocab_start, v)
    contract.check_op_label_range(y, ignored, vocab_size, ignore_index)

    acc = stats_dtype(logits)
    inv_t = float(inv_temperature)
    n, k = y.shape
    dev = logits.device
    logp = torch.zeros(n, k, dtype=acc, device=dev)
    shift = torch.zeros(n, dtype=acc, device=dev)
    log_sum = torch.zeros(n, dtype=acc, device=dev)
    entropy = torch.zeros(n if with_entropy else 0, dtype=acc, device=dev)
    zero = torch.zeros((), dtype=acc, device=dev)
    if n > 0:
        rows, cols = block_shape(logits.shape[-2], v, acc, resolve_budget(budget_bytes))
        for base, x2 in _row_views(logits):
            for r0 in range(0, x2.shape[0], rows):
                r1 = min(r0 + rows, x2.shape[0])
                rs = slice(base + r0, base + r1)
                empty = torch.full((r1 - r0,), -math.inf, dtype=acc, device=dev)
                state = (empty, torch.full_like(empty, -1.0), torch.zeros_like(empty))
                for c0 in range(0, v, cols):
                    state = _merge(state, _block_state(x2[r0:r1, c0:c0 + cols], inv_t, acc, with_entropy), inv_t)
                s_max, s_rest, s_zsum = state
                row_shift = torch.where(s_max == -math.inf, zero, s_max)
                row_log_sum = torch.log1p(s_rest)
                skip = skipped[rs]
                out_shift, out_log_sum = output_shift(row_shift, row_log_sum, inv_t, acc)
                shift[rs] = torch.where(skip, zero, out_shift)
                log_sum[rs] = torch.where(skip, zero, out_log_sum)
                if with_entropy:
                    entropy[rs] = torch.where(skip, zero, row_log_sum - s_zsum / (1 + s_rest))
                if k:
                    tgt = target[rs]
                    x_t = x2[r0:r1].gather(1, tgt.clamp(min=0)).double()
                    lp = (x_t - row_shift.double().unsqueeze(1)) * inv_t - row_log_sum.double().unsqueeze(1)
                    logp[rs] = torch.where(tgt >= 0, lp.to(acc), zero)
    return logp.view(labels.shape), entropy.view(lead if with_entropy else (0,)), shift.view(lead), log_sum.view(lead)


def _block_grad(out, x, shift, log_sum, entropy, a, b, target, g_here, g_other, skipped, inv_t, acc):
    """out = d x for one block of rows and vocab (online_softmax.h's gradient); `target` [rows, k] is
    block-local (outside [0, cols): elsewhere).

    A function, so that its block-sized temporaries are freed on return, before
    the next block allocates its own.
    """
    floor = _U_FLOOR[acc]
    col = lambda v: v.unsqueeze(1)  # noqa: E731  (a per-row value against the block's columns)
    # u = log p = (x - shift) / T - log_sum (temporary 1); p = exp(u) (temporary 2, with one
    # spare column where the labels of other blocks land)
    u = x.to(acc, copy=True).sub_(col(shift)).mul_(inv_t).sub_(col(log_sum))
    cols = x.shape[1]
    wide = torch.empty(x.shape[0], cols + 1, dtype=acc, device=x.device)
    d = torch.exp(u, out=wide[:, :cols])
    # off the labels: p (a + b (max(u_floor, u) + entropy))
    d.mul_(u.clamp_(min=floor).add_(col(entropy)).mul_(col(b)).add_(col(a)))
    if target.shape[1]:
        here = (target >= 0) & (target < cols)
        at = torch.where(here, target, torch.full_like(target, cols))
        u_t = (x.gather(1, at.clamp(max=cols - 1)).to(acc) - col(shift)) * inv_t - col(log_sum)
        val = (torch.exp(u_t) * (col(b) * (u_t.clamp(min=floor) + col(entropy)) - g_other * inv_t)
               - g_here * inv_t * torch.expm1(u_t))
        wide.scatter_(1, at, val)  # repeated labels write the same value
    d.masked_fill_(col(skipped), 0)
    out.copy_(d)


def _backward_into(out, grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                   ignore_index, vocab_start, budget):
    """out = d logits, block by block; out may be logits itself (each block is read before it is written)."""
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    acc = stats_dtype(logits)
    y, ignored, target, skipped = _row_labels(labels, len(lead), ignore_index, vocab_start, v)
    n, k = y.shape
    if n == 0:
        return
    inv_t = float(inv_temperature)
    g = torch.where(ignored, torch.zeros((), dtype=acc, device=y.device), grad_logp.reshape(n, k).to(acc))
    g_total = g.sum(dim=1)
    # Upstream gradient at each label's position (repeated labels summed), and the rest of the row's.
    same = (y.unsqueeze(2) == y.unsqueeze(1)) & ~ignored.unsqueeze(1)
    g_here = (same.to(acc) * g.unsqueeze(1)).sum(dim=2)
    g_other = g_total.unsqueeze(1) - g_here
    zeros = torch.zeros(n, dtype=acc, device=y.device)
    g_h = grad_entropy.reshape(n).to(acc) if grad_entropy is not None else zeros
    row_entropy = entropy.reshape(n) if grad_entropy is not None else zeros
    a, b = -g_total * inv_t, -g_h * inv_t
    row_shift, row_log_sum = shift.reshape(n), log_sum.reshape(n)
    rows, cols = block_shape(logits.shape[-2], v, acc, budget)
    for (base, x2), (_, o2) in zip(_row_views(logits), _row_views(out)):
        for r0, r1, c0, c1 in _blocks(x2.shape[0], v, rows, cols):
            rs = slice(base + r0, base + r1)
            _block_grad(o2[r0:r1, c0:c1], x2[r0:r1, c0:c1], row_shift[rs], row_log_sum[rs], row_entropy[rs], a[rs],
                        b[rs], torch.where(target[rs] >= 0, target[rs] - c0, -1), g_here[rs], g_other[rs],
                        skipped[rs], inv_t, acc)


@torch.no_grad()
def selective_log_softmax_bwd(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                              ignore_index, vocab_start, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_bwd: returns d logits (logits' dtype, layout as native)."""
    contract.check_op_backward(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                               vocab_start)
    grad = new_grad_like(logits)
    _backward_into(grad, grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                   ignore_index, vocab_start, resolve_budget(budget_bytes))
    return grad


@torch.no_grad()
def selective_log_softmax_bwd_(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                               ignore_index, vocab_start, *, budget_bytes: Optional[int] = None):
    """Composite twinkle_mem::selective_log_softmax_bwd_: writes d logits over the logits."""
    contract.check_op_backward(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                               vocab_start)
    _backward_into(logits, grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_temperature,
                   ignore_index, vocab_start, resolve_budget(budget_bytes))


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
