"""The inputs real training produces, and the accuracy every implementation must reach on them.

Cases (``CASES``): finfo.min masks (contiguous, interior blocks, strided, a few
allowed tokens, whole rows), -1e9 masks, -inf masks, peaked rows (gaps of 30 to
100, label at the argmax and elsewhere), logit offsets (1e4 in bf16/fp32, fp16
near its maximum), temperatures 0.05 and 1e4, all-equal rows, ignored labels,
several labels per row (repeated ones included).

Bound (``check_outputs``), each value against the float64 reference
(twinkle_mem.reference):
- logp and entropy: 1e-6 absolute + 1e-6 relative;
- gradient: 2 ulp of its dtype at the reference value + 2^-22 of the row's
  largest reference gradient + the dtype's subnormal step + twice the error that fp32
  arithmetic from the contract's fp32 statistics cannot avoid where the gradient's terms
  cancel (``grad_conditioning``);
or, where a value misses that, an error at most 2x that of torch's own fp32
path, ``(x.float() / T).log_softmax(-1)`` and its autograd, on the same input
(per row for the gradient: the row's worst ratio against torch's worst there).
Where the float64 answer is finite the result must be finite; NaN inputs give
NaN outputs.

Implementations (``Impl``): anything that runs the op contract of csrc/ops.cpp
on CPU tensors: the native CPU kernels, the composite, and the CUDA and NPU
kernels run through their CPU emulations (tests/impls.py lists them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from twinkle_mem.op.reference import selective_log_softmax_grad_ref, selective_log_softmax_ref

NO_IGNORE = -(2**63)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
SUBNORMAL_STEP = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149,
                  torch.float64: 2.0**-1074}


@dataclass
class Impl:
    """One implementation of the op contract on CPU tensors.

    forward(logits, labels, inv_T, ignore_index, vocab_start, vocab_size, with_entropy)
        -> (logp, entropy, shift, log_sum)
    backward(grad_logp, grad_entropy, logits, labels, shift, log_sum, entropy, inv_T, ignore_index,
             vocab_start, inplace) -> grad (the logits themselves when inplace)
    """
    name: str
    forward: Callable
    backward: Callable
    max_elements: int = 1 << 62  # emulations are slow: cases above this size are skipped for them
    strided: bool = True  # accepts [B, S, V] logits and strided rows
    # Runs the op's argument checks (tests/op/test_bad_input.py). The device kernels' emulations enter below
    # csrc/common/op_entry.h, whose checks every native backend shares and the "cpu" implementation runs.
    checks_arguments: bool = True


@dataclass
class Case:
    name: str
    logits: torch.Tensor  # [N, V] or [B, S, V]
    labels: torch.Tensor  # leading shape, or + [k]
    temperature: float = 1.0
    ignore_index: Optional[int] = None
    with_entropy: bool = True
    tags: tuple = field(default_factory=tuple)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of `dtype` at each value (given in float64)."""
    _mant, exp = torch.frexp(values.abs())
    u = torch.ldexp(torch.ones_like(values), (exp - 1 - MANTISSA_BITS[dtype]).to(torch.int64))
    return torch.clamp(u, min=SUBNORMAL_STEP[dtype])


# ------------------------------------------------------------------ torch's own fp32 path
def torch_fp32(logits, labels, temperature, ignore_index, g_logp, g_entropy):
    """(logp, entropy, grad) from (x.float() / T).log_softmax(-1) and autograd, the path users would call."""
    x = logits.detach().clone().requires_grad_(True)
    log_p = (x.float() / temperature).log_softmax(-1)
    multi = labels.dim() == logits.dim()
    idx = labels if multi else labels.unsqueeze(-1)
    ignored = torch.zeros_like(idx, dtype=torch.bool) if ignore_index is None else idx == ignore_index
    safe = torch.where(ignored, torch.zeros_like(idx), idx).long()
    logp = torch.where(ignored, 0.0, log_p.gather(-1, safe))
    skipped = ignored.all(-1) if idx.shape[-1] else torch.zeros(idx.shape[:-1], dtype=torch.bool)
    entropy = torch.where(skipped, 0.0, -(log_p.exp() * log_p.clamp(min=-1e30)).sum(-1))
    logp = logp if multi else logp.squeeze(-1)
    total = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if g_entropy is not None else 0.0)
    (grad,) = torch.autograd.grad(total, x)
    return logp.detach(), entropy.detach(), grad


# ------------------------------------------------------------------ the gradient's conditioning
EPS32 = 2.0**-24  # the unit roundoff of fp32, the precision every kernel computes in (fp64 logits aside)


def grad_conditioning(logits, labels, g_logp, g_entropy, temperature, ignore_index):
    """Per logit, in float64: the error that computing in fp32 from the contract's fp32 statistics
    cannot avoid, to first order (docs/numerics.md, "Where the gradient's terms cancel"). With
    b = 1/T, u = log p, H the entropy, w = u + H, V = sum p w^2, G the row's total upstream logp
    gradient, h the upstream gradient at this logit's labels and g_H the entropy's:
      d = b (h (1 - p) - (G - h) p - g_H p w)
      1/T rounded to fp32 (as torch's fp32 path rounds T)  eps |d - b p (G w + g_H (w^2 + w - V))|
      H saved as fp32                                      eps b |g_H| p |H|
      u formed in fp32 from x - shift                      2 eps |u| b p |G + g_H (w + 1)|
      each part rounded                                    2 eps b (|h (1 - p)| + p |G - h| + p |g_H w|)
    summed (each a worst case; ``check_outputs`` adds the sum to the bound)."""
    from twinkle_mem.op.reference import _label_layout, log_probs_ref
    log_p, entropy, _ = log_probs_ref(logits.detach(), temperature)
    multi, ignored, safe, skipped = _label_layout(logits, labels, ignore_index)
    g = g_logp.double()
    g = (g if multi else g.unsqueeze(-1)).masked_fill(ignored, 0.0)
    here = torch.zeros_like(log_p).scatter_add(-1, safe, g)
    total = g.sum(-1, keepdim=True)
    g_h = (torch.zeros_like(entropy) if g_entropy is None else g_entropy.double()).unsqueeze(-1)
    b = 1.0 / temperature
    p = torch.exp(log_p)
    live = p > 0  # p = 0 (a -inf logit, or below fp64's range): no term
    u = torch.where(live, log_p, torch.zeros_like(log_p))
    h_row = entropy.unsqueeze(-1)
    w = u + h_row
    var = torch.where(live, p * w * w, torch.zeros_like(p)).sum(-1, keepdim=True)
    d = b * (-here * torch.expm1(u) - (total - here) * p - g_h * p * w)  # (no cancellation at a confident label)
    temperature_term = (d - b * p * (total * w + g_h * (w * w + w - var))).abs()
    entropy_term = b * g_h.abs() * p * h_row.abs()
    u_term = 2 * u.abs() * b * p * (total + g_h * (w + 1)).abs()
    # the label's part as the kernels form it, h (1 - p) = -h expm1(u): no cancellation of h against G p
    eval_term = 2 * b * ((here * torch.expm1(u)).abs() + p * (total - here).abs() + p * (g_h * w).abs())
    cond = EPS32 * (temperature_term + entropy_term + u_term + eval_term)
    cond = torch.where(live, cond, torch.zeros_like(cond)).nan_to_num(0.0, 0.0, 0.0)
    return cond.masked_fill(skipped.unsqueeze(-1), 0.0)


# ------------------------------------------------------------------ the check
def _compare(what, got, ref, bound, err_torch, case, per_row):
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert got.shape == ref.shape, f"{case.name} {what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(got) & ~nan_ref, torch.zeros_like(nan_ref)), (
        f"{case.name} {what}: NaN where the float64 answer is {ref[torch.isnan(got) & ~nan_ref][:4]}")
    assert torch.isnan(got[nan_ref]).all(), f"{case.name} {what}: NaN inputs must give NaN"
    inf_ref = torch.isinf(ref)
    assert torch.equal(got[inf_ref], ref[inf_ref]), f"{case.name} {what}: infinities differ"
    finite = torch.isfinite(ref)
    assert torch.isfinite(got[finite]).all(), f"{case.name} {what}: inf where the answer is finite"
    if got.numel() == 0:
        return
    zero = torch.zeros((), dtype=torch.float64)
    ratio = torch.where(finite, (got - ref).abs() / bound, zero)
    ratio_torch = torch.where(finite, err_torch.double().cpu() / bound, zero).nan_to_num(0.0, 0.0, 0.0)
    if per_row:  # one ratio per row: the worst; torch's typical row too
        ratio, ratio_torch = ratio.flatten(0, -2).amax(-1), ratio_torch.flatten(0, -2).amax(-1)
    else:  # one value per row: the worst over the case
        ratio, ratio_torch = ratio.amax().view(1), ratio_torch.amax().view(1)
    allowed = torch.clamp(2 * ratio_torch, min=1.0)
    bad = ratio > allowed
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        err = torch.where(finite, (got - ref).abs(), zero)
        flat_err = err.flatten(0, -2)[i] if per_row else err.flatten()
        j = int(flat_err.argmax())
        pick = (lambda t: t.flatten(0, -2)[i][j]) if per_row else (lambda t: t.flatten()[j])  # noqa: E731
        raise AssertionError(
            f"{case.name} {what}: {int(bad.sum())} {'rows' if per_row else 'case'} off; "
            f"{'row ' + str(i) if per_row else 'worst'}: error/bound {ratio[i].item():.3g} vs torch fp32 "
            f"{ratio_torch[i].item():.3g}; worst value got {pick(got).item():.9g}, float64 {pick(ref).item():.9g}, "
            f"bound {pick(bound).item():.3g}")


def run_impl(impl: Impl, case: Case, g_logp, g_entropy, inplace=False):
    """(logp, entropy, shift, log_sum, grad) from an implementation."""
    x = case.logits
    ignore = NO_IGNORE if case.ignore_index is None else case.ignore_index
    inv_t = 1.0 / case.temperature
    logp, entropy, shift, log_sum = impl.forward(x, case.labels, inv_t, ignore, 0, x.shape[-1], case.with_entropy)
    target = x.clone() if inplace else x
    grad = impl.backward(g_logp, g_entropy if case.with_entropy else None, target, case.labels, shift, log_sum,
                         entropy if case.with_entropy else None, inv_t, ignore, 0, inplace)
    if inplace:
        assert grad.data_ptr() == target.data_ptr()
    return logp, entropy, shift, log_sum, grad


def upstream(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    acc = torch.float64 if case.logits.dtype == torch.float64 else torch.float32
    g_logp = torch.randn(case.labels.shape, generator=gen, dtype=torch.float64).to(acc)
    g_entropy = torch.randn(case.logits.shape[:-1], generator=gen, dtype=torch.float64).to(acc)
    return g_logp, (g_entropy if case.with_entropy else None)


def check_outputs(what, logits, labels, temperature, ignore_index, g_logp, g_entropy, logp, entropy, grad,
                  vocab_slice=slice(None)):
    """logp, entropy (or None) and the gradient of sum(g_logp logp + g_entropy entropy) against float64,
    within the bound or 2x torch's fp32 path (see the module docstring). With ``vocab_slice``, ``grad``
    is that slice of the vocab only (a tensor-parallel shard's gradient)."""
    x = logits.detach().cpu()
    labels = labels.cpu()
    g_logp = g_logp.cpu()
    g_entropy = None if g_entropy is None else g_entropy.cpu()
    case = Case(what, x, labels, temperature, ignore_index, entropy is not None)
    ref_logp, ref_entropy, _lse, _mean = selective_log_softmax_ref(x, labels, temperature, ignore_index)
    t_logp, t_entropy, t_grad = torch_fp32(x, labels, temperature, ignore_index, g_logp, g_entropy)
    stat_bound = lambda ref: 1e-6 + 1e-6 * ref.abs()  # noqa: E731
    _compare("logp", logp, ref_logp, stat_bound(ref_logp), (t_logp.double() - ref_logp).abs(), case, False)
    if entropy is not None:
        _compare("entropy", entropy, ref_entropy, stat_bound(ref_entropy), (t_entropy.double() - ref_entropy).abs(),
                 case, False)
    ref_grad = selective_log_softmax_grad_ref(x, labels, g_logp, g_entropy, temperature, ignore_index)
    dtype = x.dtype
    if dtype == torch.float64:  # computed in float64: only the kernel's own rounding
        torch.testing.assert_close(grad.detach().cpu(), ref_grad[..., vocab_slice], rtol=1e-12, atol=1e-12)
        return
    row_max = (ref_grad.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) if ref_grad.numel()
               else ref_grad.new_zeros(*ref_grad.shape[:-1], 1))
    ref_grad, t_grad = ref_grad[..., vocab_slice], t_grad[..., vocab_slice]
    cond = grad_conditioning(x, labels, g_logp, g_entropy, temperature, ignore_index)[..., vocab_slice]
    grad_bound = 2 * ulp(ref_grad, dtype) + 2.0**-22 * row_max + SUBNORMAL_STEP[dtype] + cond
    assert grad.dtype == dtype and grad.shape == ref_grad.shape, (grad.dtype, tuple(grad.shape))
    _compare("grad", grad, ref_grad, grad_bound, (t_grad.double() - ref_grad).abs(), case, True)


def check_case(impl: Impl, case: Case, inplace=False):
    """Forward and backward of `impl` on `case` against float64, within the bound or 2x torch fp32."""
    g_logp, g_entropy = upstream(case)
    logp, entropy, _shift, _log_sum, grad = run_impl(impl, case, g_logp, g_entropy, inplace)
    check_outputs(f"{impl.name} {case.name}", case.logits, case.labels, case.temperature, case.ignore_index, g_logp,
                  g_entropy, logp, entropy if case.with_entropy else None, grad)


# ------------------------------------------------------------------ the cases
def quiet_nan(dtype: torch.dtype, negative: bool) -> torch.Tensor:
    """A quiet NaN of ``dtype`` with its sign bit set or clear (a cast of float("nan") does not keep the sign)."""
    bits = {torch.bfloat16: (0x7FC0, torch.int16), torch.float16: (0x7E00, torch.int16),
            torch.float32: (0x7FC00000, torch.int32), torch.float64: (0x7FF8000000000000, torch.int64)}
    magnitude, int_type = bits[dtype]
    sign_bit = 1 << (torch.iinfo(int_type).bits - 1)
    return torch.tensor(magnitude - sign_bit if negative else magnitude, dtype=int_type).view(dtype)  # as signed


def _labels(gen, shape, v, low=0):
    return torch.randint(low, v, shape, generator=gen)


def make_cases(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> list[Case]:
    """Every class of input, N rows of V logits in `dtype` (V >= 64)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda: torch.randn(n, v, generator=gen, dtype=torch.float64) * 3  # noqa: E731
    cast = lambda t: t.to(dtype)  # noqa: E731
    lowest = torch.finfo(dtype).min
    cases = []
    y = _labels(gen, (n,), v)

    cases.append(Case("randn", cast(randn()), y))
    # finfo.min masks: the first half; interior blocks; every third column; all but 3 tokens; whole rows
    masks = {
        "finfo.min first half": [slice(0, v // 2)],
        "finfo.min interior blocks": [slice(v // 8, v // 4), slice(v // 2, 3 * v // 4)],
        "finfo.min strided": [slice(0, v, 3)],
    }
    for name, spans in masks.items():
        x = randn()
        m = torch.zeros(n, v, dtype=torch.bool)
        for span in spans:
            m[:, span] = True
        allowed = (~m).nonzero()
        yy = torch.stack([allowed[allowed[:, 0] == r][:, 1][torch.randint(0, int((~m[r]).sum()), (1,),
                                                                            generator=gen)] for r in range(n)]).view(n)
        x[m] = lowest
        for t in (1.0, 0.7):
            cases.append(Case(f"{name}, T={t}", cast(x), yy, temperature=t))
    x = torch.full((n, v), lowest, dtype=torch.float64)
    few = torch.stack([torch.randperm(v, generator=gen)[:3] for _ in range(n)])
    x.scatter_(1, few, torch.randn(n, 3, generator=gen, dtype=torch.float64))
    cases.append(Case("finfo.min all but 3 tokens, label allowed", cast(x), few[:, 0]))
    cases.append(Case("finfo.min all but 3 tokens, T=0.05", cast(x), few[:, 1], temperature=0.05))
    x = torch.full((n, v), lowest, dtype=torch.float64)
    cases.append(Case("finfo.min whole rows", cast(x), y))
    cases.append(Case("finfo.min whole rows, T=0.05", cast(x), y, temperature=0.05))
    # -1e9 and -inf masks
    x = randn()
    x[:, v // 3:] = -1e9
    cases.append(Case("-1e9 mask", cast(x), _labels(gen, (n,), v // 3)))
    x = randn()
    x[:, : v - 5] = float("-inf")
    cases.append(Case("-inf all but 5", cast(x), _labels(gen, (n,), v, v - 5)))
    # A NaN of either sign among -inf (issue 41): in a whole -inf block, or in a -inf tail after a few finite
    # logits (the last tile of any tiling holds only -inf and it). A max that misses the NaN must not make
    # the block empty: the row's outputs and gradient are NaN, as torch's.
    x = cast(randn())
    for r in range(n):
        lo = 2048 * max(1, v // 8192)  # a whole CPU block, or more, inside the row
        lo, hi = (lo, min(v, 2 * lo)) if r % 4 < 2 and 2 * lo <= v else (64, v)
        x[r, lo:hi] = float("-inf")
        x[r, lo + (hi - lo) // 3 if hi < v else v - 7] = quiet_nan(dtype, negative=r % 2 == 1)
    cases.append(Case("NaN of either sign among -inf", x, y))
    cases.append(Case("NaN of either sign among -inf, no entropy", x, y, with_entropy=False))
    # peaked rows: the label at the argmax, and elsewhere
    for gap in (30.0, 60.0, 100.0):
        x = randn()
        x[torch.arange(n), y] += gap
        cases.append(Case(f"peaked {gap:g}, label at argmax", cast(x), y))
        x = randn()
        top = (y + 1) % v
        x[torch.arange(n), top] += gap
        cases.append(Case(f"peaked {gap:g}, label elsewhere", cast(x), y))
    # offsets and large magnitudes
    if dtype == torch.float16:
        x = randn() * 20 + 65000
        cases.append(Case("fp16 near its max", cast(x.clamp(max=65504)), y))
        cases.append(Case("fp16 near its lowest", cast((-randn() * 20 - 65000).clamp(min=-65504)), y))
    else:
        cases.append(Case("offset 1e4", cast(randn() + 1e4), y))
        cases.append(Case("offset -1e4, scale 30", cast(randn() * 10 - 1e4), y))
    cases.append(Case("offset 150", cast(randn() + 150), y))
    # temperatures
    cases.append(Case("T=0.05", cast(randn()), y, temperature=0.05))
    cases.append(Case("T=1e4", cast(randn()), y, temperature=1e4))
    cases.append(Case("all-equal rows", cast(torch.full((n, v), 2.5, dtype=torch.float64)), y))
    cases.append(Case("all-equal rows, T=0.05", cast(torch.full((n, v), -7.0, dtype=torch.float64)), y,
                      temperature=0.05))
    # ignore_index, no entropy, several labels per row
    yi = y.clone()
    yi[::2] = -100
    cases.append(Case("ignore_index", cast(randn()), yi, ignore_index=-100))
    cases.append(Case("no entropy, T=0.7", cast(randn()), y, temperature=0.7, with_entropy=False))
    yk = _labels(gen, (n, 4), v)
    yk[:, 3] = yk[:, 0]  # a repeated label
    yk[::3, 1] = -100
    if n > 1:
        yk[1, :] = -100  # a row with every label ignored
    xk = randn()
    xk[torch.arange(n), yk[:, 2]] += 40  # one label confident
    cases.append(Case("k=4 labels, repeated and ignored", cast(xk), yk, temperature=0.9, ignore_index=-100))
    cases.append(Case("k=1 trailing dim", cast(randn()), y.unsqueeze(-1)))
    cases.append(Case("k=0 labels (entropy only)", cast(randn()), y[:, :0] if y.dim() == 2 else y.unsqueeze(-1)[:, :0],
                      temperature=0.8))
    return cases
