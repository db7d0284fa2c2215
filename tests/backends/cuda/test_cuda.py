"""The CUDA kernels on a GPU (skipped without one; bench/gpu_check.sh runs them).

The numerics classes run on the GPU through tests/impls.py's "cuda" implementation
(tests/op/test_numerics.py); this file holds what only a GPU can show: no host
synchronization (sync debug mode "error"), the device-side label assert, and batch
invariance, strided views and the gradient's layout at real sizes.
"""
import os
import subprocess
import sys

import pytest
import torch

import twinkle_mem

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or twinkle_mem.backends().get("cuda") != "loaded",
    reason="needs a GPU and the CUDA library loaded")


def _upstream(logp, ent):
    """The loss the tests differentiate: seeded upstream gradients for logp, 1 for the entropy."""
    gen = torch.Generator(device=logp.device).manual_seed(0)
    g = torch.randn(logp.shape, device=logp.device, generator=gen)
    return (logp * g).sum() + (ent.sum() if ent is not None else 0)


def _fwd_bwd(x, y, inplace=False, entropy=True, temperature=1.0, ignore_index=None):
    x = x.detach().clone().requires_grad_(True)
    out = twinkle_mem.selective_log_softmax(x, y, entropy, temperature=temperature, ignore_index=ignore_index,
                                            inplace_backward=inplace)
    logp, ent = out if entropy else (out, None)
    (grad,) = torch.autograd.grad(_upstream(logp, ent), x)
    return logp.detach(), None if ent is None else ent.detach(), grad


def _fwd_bwd_through_view(base, make_view, y):
    """As _fwd_bwd, differentiated with respect to a view of a copy of base: the gradient as the op lays it out
    for that view (clone() would have made the view contiguous first)."""
    view = make_view(base.detach().clone().requires_grad_(True))
    logp, ent = twinkle_mem.selective_log_softmax(view, y, True)
    (grad,) = torch.autograd.grad(_upstream(logp, ent), view)
    return view, (logp.detach(), ent.detach(), grad)


def test_no_host_sync_under_sync_debug_mode():
    """Forward and backward (out of place and in place), k labels, [B, S, V] views, ignored rows:
    not one synchronizing call (torch raises on any under sync debug mode "error")."""
    x = torch.randn(2, 9, 5003, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, 5003, (2, 9), device="cuda")
    y[0, :3] = -100
    yk = torch.randint(0, 5003, (2, 8, 3), device="cuda")
    y_5000 = torch.where(y[:, 1:] < 0, y[:, 1:], y[:, 1:] % 5000)  # the [:5000] view's labels, -100 kept
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inplace in (False, True):
            _fwd_bwd(x, y, inplace, ignore_index=-100)
            _fwd_bwd(x[:, :-1], yk, inplace)
            _fwd_bwd(x[:, :-1, :5000], y_5000, inplace, entropy=False, temperature=0.7, ignore_index=-100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_sync_debug_mode_catches_a_sync():
    """The check above can fail: an explicit synchronizing call raises under the same mode."""
    x = torch.randn(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# The message is the host checks' (label_message.h): the entry, the value, the vocab and what to do.
RANGE = "is neither a token id in [0, 100) (vocab size 100) nor the ignore_index (none given)"


@pytest.mark.parametrize("labels,message", [
    ("[1, 100, 2, 3]", f"labels.flatten()[1] = 100 {RANGE}; check that the labels come from the logits' vocabulary"),
    ("[[1, 2], [3, -100]]", f"labels.flatten()[3] = -100 {RANGE}; to ignore such positions (logp 0, no gradient), "
                            "pass ignore_index=-100"),
])
def test_out_of_range_label_is_a_device_side_assert(labels, message):
    """Run in a child: a device-side assert leaves the CUDA context unusable."""
    code = (
        "import torch, twinkle_mem\n"
        f"y = torch.tensor({labels}, device='cuda')\n"
        "x = torch.randn(*y.shape, 100, device='cuda')\n"
        "twinkle_mem.selective_log_softmax(x, y)\n"
        "torch.cuda.synchronize()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode != 0
    assert "device-side assert" in proc.stderr and "twinkle_mem: label out of range: " + message in proc.stderr, \
        proc.stderr[-2000:]


def test_batch_invariance_on_gpu():
    """The same rows alone and among 2047 others, at V = 151936 (5 segments in bf16):
    logp, entropy and gradient bitwise equal, out of place and in place."""
    v = 151936
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = (torch.randn(2048, v, device="cuda", generator=gen) * 4).bfloat16()
    batch[5, : v // 2] = torch.finfo(torch.bfloat16).min
    y = torch.randint(0, v, (2048,), device="cuda", generator=gen)
    with torch.no_grad():
        logp, ent = twinkle_mem.selective_log_softmax(batch, y, True)
        for r in (0, 5, 1000, 2047):
            logp1, ent1 = twinkle_mem.selective_log_softmax(batch[r:r + 1], y[r:r + 1], True)
            assert torch.equal(logp1[0], logp[r]) and torch.equal(ent1[0], ent[r]), f"row {r} depends on the batch"
    # the gradient of row 5 for the same upstream gradients, alone and in the batch
    g = torch.zeros(2048, device="cuda")
    g[5] = 0.75
    x1 = batch[5:6].clone().requires_grad_(True)
    logp1, ent1 = twinkle_mem.selective_log_softmax(x1, y[5:6], True)
    (g1,) = torch.autograd.grad(logp1.sum() * 0.75 + ent1.sum(), x1)
    for inplace in (False, True):
        xb = batch.clone().requires_grad_(True)
        logp, ent = twinkle_mem.selective_log_softmax(xb, y, True, inplace_backward=inplace)
        (gb,) = torch.autograd.grad((logp * g).sum() + ent[5], xb)
        assert torch.equal(gb[5], g1[0]), f"gradient depends on the batch (inplace={inplace})"
        del xb, gb


def test_strided_views_bitwise_and_grad_layout():
    """[B, S, V] views are read in place, bitwise as their contiguous copies; the out-of-place gradient takes
    layout.h's layout (contract.new_grad_like): the view's own strides where the rows it skips are few."""
    from twinkle_mem.op.contract import new_grad_like
    x = torch.randn(4, 257, 4099, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, 4099, (4, 257), device="cuda")
    padded = torch.randn(64, 4160, device="cuda", dtype=torch.bfloat16)
    cases = [(x, lambda t: t[:, :-1], y[:, 1:], True),  # one row in 257 skipped: the view's strides
             (x, lambda t: t[:, -65:-1], y[:, -64:], False),  # most rows skipped: a dense gradient
             (padded, lambda t: t[:, :4099], y[0, :64], True)]  # a padded vocab: the view's row stride
    for base, make_view, labels, keeps_strides in cases:
        view, got = _fwd_bwd_through_view(base, make_view, labels)
        want = _fwd_bwd(view.contiguous(), labels.contiguous())
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert got[2].stride() == new_grad_like(view).stride()
        assert (got[2].stride() == view.stride()) == keeps_strides, (view.stride(), got[2].stride())


def test_first_and_last_rows_beyond_2_pow_31_elements():
    """N * V > 2^31: offsets are 64-bit (the last rows against float64)."""
    n, v = 16384, 151936
    x = torch.empty(n, v, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    y = torch.randint(0, v, (n,), device="cuda")
    logp, ent = twinkle_mem.selective_log_softmax(x, y, True)
    for r in (0, 1, n - 2, n - 1):
        ref = x[r].double().log_softmax(-1)
        assert abs(float(logp[r]) - float(ref[y[r]])) < 1e-5
        assert abs(float(ent[r]) + float((ref.exp() * ref).sum())) < 1e-5
