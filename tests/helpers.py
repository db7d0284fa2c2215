"""Tolerances and comparisons shared by the op tests.

Log-probs and entropy are computed in fp32 whatever the logits' dtype, so
they are compared with the float64 reference to fp32 rounding: a few fp32
epsilons relative to the magnitudes involved (lse, mean). Gradients are
compared with the float64 reference gradient rounded to the logits' dtype:
within 1 unit in the last place for bf16/fp16. For fp32 logits 1 ulp is
below what any fp32 computation reaches: the saved fp32 lse and mean carry
an absolute rounding error ~eps * (|lse| + |mean|), which moves every
p = exp(z - lse) and every (z - mean) by as much. So fp32 gradients are held
to 16 eps * (1 + S) * (|g_logp| + |g_entropy| (1 + S)) / T per row, with
S = |lse| + |mean| (the caller passes that row bound). bf16/fp16 gradients
get the same fp32 allowance on top of their 1 ulp: it matters only where
fp32 itself cannot resolve the value, e.g. 1 - p for a label with p ~ 1.
"""
import torch

import twinkle_mem
from twinkle_mem.reference import selective_log_softmax_grad_ref, selective_log_softmax_ref

FP32_EPS = torch.finfo(torch.float32).eps
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MIN_ULP = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of `dtype` at each value (given in float64)."""
    _mant, exp = torch.frexp(values.abs())
    u = torch.ldexp(torch.ones_like(values), (exp - 1 - MANTISSA_BITS[dtype]).to(torch.int64))
    return torch.clamp(u, min=MIN_ULP[dtype])


def assert_stats_close(got, ref, scale, what):
    """|got - ref| <= 16 fp32 eps * (1 + scale), elementwise (scale ~ |lse| + |mean|)."""
    got = got.double().cpu()
    ref = ref.double().cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN pattern differs"
    assert torch.equal(got[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]), f"{what}: inf differs"
    tol = 16 * FP32_EPS * (1 + scale.double().cpu().abs())
    err = (got - ref).abs()
    bad = finite & (err > tol)
    assert not bad.any(), f"{what}: max err {err[finite].max().item():.3g}, tol {tol[bad][0].item():.3g}"


def assert_grad_close(got, ref, dtype, fp32_row_bound=None, what="grad"):
    """Gradient in `dtype` against the float64 reference gradient."""
    got = got.double().cpu()
    ref = ref.double().cpu()
    if dtype == torch.float64:
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        return
    rounded = ref.to(dtype).double()
    err = (got - rounded).abs()
    if dtype == torch.float32:
        tol = (16 * FP32_EPS * fp32_row_bound.double().cpu()).unsqueeze(-1).expand_as(ref)
    else:
        tol = ulp(rounded, dtype) + (16 * FP32_EPS * fp32_row_bound.double().cpu()).unsqueeze(-1)
    bad = err > tol
    assert not bad.any(), (
        f"{what} ({dtype}): {int(bad.sum())} elements off by more than the tolerance; worst err "
        f"{err.max().item():.3g} at ref {ref.flatten()[err.argmax()].item():.3g}")


def make_case(n, v, dtype, device="cpu", scale=4.0, ignore_frac=0.0, ignore_index=-100, neg_inf_frac=0.0):
    logits = (torch.randn(n, v, dtype=torch.float64) * scale).to(dtype)
    if neg_inf_frac:
        logits[torch.rand(n, v) < neg_inf_frac] = float("-inf")
    labels = torch.randint(0, v, (n,))
    if ignore_frac:
        labels[torch.rand(n) < ignore_frac] = ignore_index
    return logits.to(device), labels.to(device)


def check_against_reference(logits, labels, temperature=1.0, ignore_index=None, with_entropy=True):
    """Forward and backward against float64, with random upstream gradients."""
    x = logits.detach().clone().requires_grad_(True)
    out = twinkle_mem.selective_log_softmax(x, labels, with_entropy, temperature=temperature,
                                            ignore_index=ignore_index)
    logp, entropy = out if with_entropy else (out, None)
    ref_logp, ref_entropy, ref_lse, ref_mean = selective_log_softmax_ref(logits, labels, temperature, ignore_index)
    want = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert logp.dtype == want and logp.shape == labels.shape
    scale = ref_lse.abs() + ref_mean.abs()
    assert_stats_close(logp, ref_logp, scale, "logp")
    if with_entropy:
        assert_stats_close(entropy, ref_entropy, scale, "entropy")

    g_logp = torch.randn(labels.shape, dtype=want, device=logits.device)
    g_entropy = torch.randn(labels.shape, dtype=want, device=logits.device) if with_entropy else None
    total = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if with_entropy else 0)
    (grad,) = torch.autograd.grad(total, x)
    ref_grad = selective_log_softmax_grad_ref(logits, labels, g_logp, g_entropy, temperature, ignore_index)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    if not torch.isfinite(logits).all():
        # -inf logits have p = 0: their gradient is exactly 0 in the reference too.
        nan_got, nan_ref = torch.isnan(grad), torch.isnan(ref_grad.to(grad.device))
        assert torch.equal(nan_got, nan_ref), (nan_got.nonzero()[:4], nan_ref.nonzero()[:4])
    s = (ref_lse.abs() + ref_mean.abs()).to(grad.device)
    g_sum = g_logp.abs() + ((g_entropy.abs() * (1 + s)) if with_entropy else 0)
    assert_grad_close(grad, ref_grad, logits.dtype, fp32_row_bound=(1 + s) * g_sum / temperature)


def check_inplace_backward_matches(device="cpu"):
    """inplace_backward gives the out-of-place gradient bitwise, in the logits' own storage,
    and bumps their version counter."""
    logits, labels = make_case(40, 3001, torch.bfloat16, device, ignore_frac=0.2)
    g = [torch.randn(40, device=device) for _ in range(2)]
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_()
        logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, ignore_index=-100,
                                                          inplace_backward=inplace)
        version = x._version
        (grad,) = torch.autograd.grad((logp * g[0]).sum() + (entropy * g[1]).sum(), x)
        grads.append(grad)
        if inplace:
            assert grad.data_ptr() == x.data_ptr() and x._version > version
    assert torch.equal(grads[0], grads[1])
