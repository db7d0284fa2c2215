"""Cases and comparisons shared by the op tests.

The accuracy bound lives in tests/numerics.py (check_outputs): logp and
entropy within 1e-6 absolute + 1e-6 relative of float64, gradients within
2 ulp + 2^-22 of the row's largest + the subnormal step, or no worse than 2x
torch's own fp32 path on the same input.
"""
import contextlib

import torch

import twinkle_mem
from numerics import check_outputs


@contextlib.contextmanager
def saved_for_backward():
    """``with saved_for_backward() as saved: ...``: every tensor autograd saves inside the block, in order."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def assert_stats_close(got, ref, what):
    """fp32 statistics (logp, entropy) within 1e-6 absolute + 1e-6 relative of float64, same NaN / inf."""
    got = got.double().cpu()
    ref = ref.double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN pattern differs"
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf]), f"{what}: infinities differ"
    finite = torch.isfinite(ref)
    err = (got - ref).abs()
    bad = finite & (err > 1e-6 + 1e-6 * ref.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} values off, max err {err[finite].max().item():.3g}"


def make_case(n, v, dtype, device="cpu", scale=4.0, ignore_frac=0.0, ignore_index=-100, neg_inf_frac=0.0):
    logits = (torch.randn(n, v, dtype=torch.float64) * scale).to(dtype)
    if neg_inf_frac:
        logits[torch.rand(n, v) < neg_inf_frac] = float("-inf")
    labels = torch.randint(0, v, (n,))
    if ignore_frac:
        labels[torch.rand(n) < ignore_frac] = ignore_index
    return logits.to(device), labels.to(device)


def check_against_reference(logits, labels, temperature=1.0, ignore_index=None, with_entropy=True):
    """Forward and backward through the public API against float64 (tests/numerics.py's bound),
    with random upstream gradients."""
    x = logits.detach().requires_grad_(True)  # same storage and strides: a view stays a view
    out = twinkle_mem.selective_log_softmax(x, labels, with_entropy, temperature=temperature,
                                            ignore_index=ignore_index)
    logp, entropy = out if with_entropy else (out, None)
    want = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert logp.dtype == want and logp.shape == labels.shape
    g_logp = torch.randn(labels.shape, dtype=want, device=logits.device)
    g_entropy = torch.randn(logits.shape[:-1], dtype=want, device=logits.device) if with_entropy else None
    total = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if with_entropy else 0)
    (grad,) = torch.autograd.grad(total, x)
    check_outputs("api", logits, labels, temperature, ignore_index, g_logp, g_entropy, logp, entropy, grad)


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


def opcheck_op_schemas(dtype, device="cpu"):
    """torch.library.opcheck of the forward, backward and in-place backward, on [N, V] rows and on
    a padded [B, S, V] view with [.., k] labels (ignored positions included): the native ops (1/T a
    float) and their wrappers that the public function calls (1/T a 0-dim tensor, ops.fwd_t)."""
    ops = torch.ops.twinkle_mem
    logits = torch.randn(6, 300, device=device).to(dtype)
    labels = torch.tensor([1, 299, -100, 5, 0, 77], device=device)
    padded = torch.randn(2, 4, 310, device=device).to(dtype)[:, :3, :300]  # [B, S, V] view, padded rows
    multi = torch.tensor([[[1, 2], [3, -100], [-100, -100]], [[0, 0], [299, 5], [7, 8]]], device=device)
    op_sets = ((ops.selective_log_softmax_fwd.default, ops.selective_log_softmax_bwd.default,
                ops.selective_log_softmax_bwd_.default, 1.25),
               (ops.selective_log_softmax.default, ops.selective_log_softmax_backward.default,
                ops.selective_log_softmax_backward_.default, torch.tensor(1.25, dtype=torch.float64)))
    for fwd, bwd, bwd_, inv_t in op_sets:
        for x, y in ((logits, labels), (padded, multi)):
            for with_entropy in (False, True):
                torch.library.opcheck(fwd, (x.clone().requires_grad_(), y, inv_t, -100, 0, 300, with_entropy, False))
            _logp, entropy, shift, log_sum = fwd(x, y, inv_t, -100, 0, 300, True, False)
            g = torch.randn(y.shape, device=device)
            g_h = torch.randn(x.shape[:-1], device=device)
            torch.library.opcheck(bwd, (g, g_h, x, y, shift, log_sum, entropy, inv_t, -100, 0))
            torch.library.opcheck(bwd, (g, None, x, y, shift, log_sum, None, inv_t, -100, 0))
            torch.library.opcheck(bwd_, (g, g_h, x.clone(), y, shift, log_sum, entropy, inv_t, -100, 0))
