"""The composite PyTorch implementation (twinkle_mem.composite), forced on the CPU.

The composite is the ops' CompositeExplicitAutograd kernel: what an NPU
without built AscendC kernels (or MPS, XPU, ...) runs. Here `forced()` puts
it over the native CPU kernel, so the public API, autograd, opcheck and the
memory checks all go through the same dispatcher path a device without a
native kernel takes. Budgets are set small enough that rows are cut into
row blocks and, for long rows, vocab blocks merged with the online state.
"""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import twinkle_mem
from helpers import (assert_stats_close, check_against_reference, check_inplace_backward_matches, make_case,
                     opcheck_op_schemas, saved_for_backward)
from numerics import check_outputs
from twinkle_mem.op import composite
from twinkle_mem.op.reference import selective_log_softmax_grad_ref, selective_log_softmax_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ops = torch.ops.twinkle_mem
FWD = "twinkle_mem::selective_log_softmax_fwd"
SMALL_BUDGET = 64 << 10  # 8192 fp32 pairs per block: V = 5003 gives 1 row, V = 151936 19 vocab blocks


@pytest.fixture
def forced():
    with composite.forced(budget_bytes=SMALL_BUDGET):
        yield


def kernel_line(qualname, key):
    table = torch._C._dispatch_dump_table(qualname)
    return next(line for line in table.splitlines() if line.startswith(key + ":"))


# ----------------------------------------------------------------- registration
def test_registered_for_devices_without_a_native_kernel():
    for key in ("PrivateUse1", "XPU", "MPS"):
        assert "composite.py" in kernel_line(FWD, key), key
    for name in ("selective_log_softmax_bwd", "selective_log_softmax_bwd_"):
        assert "composite.py" in kernel_line("twinkle_mem::" + name, "PrivateUse1")
    # The native CPU kernel still serves the CPU; the fake still serves Meta.
    assert "selective_log_softmax.cpp" in kernel_line(FWD, "CPU")
    assert "composite.py" not in kernel_line(FWD, "Meta")


def test_forced_routes_the_cpu_and_restores_the_native_kernel():
    logits, labels = make_case(9, 777, torch.bfloat16)
    native = twinkle_mem.selective_log_softmax(logits, labels, True)
    with composite.forced():
        assert "composite.py" in kernel_line(FWD, "CPU")
        routed = twinkle_mem.selective_log_softmax(logits, labels, True)
    assert "selective_log_softmax.cpp" in kernel_line(FWD, "CPU")
    for a, b in zip(native, routed):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_budget_parsing_and_block_shapes(monkeypatch):
    assert composite.parse_budget("64M") == 64 << 20 == composite.parse_budget("64MiB")
    assert composite.parse_budget("4096") == 4096 and composite.parse_budget("1g") == 1 << 30
    with pytest.raises(ValueError):
        composite.parse_budget("lots")
    monkeypatch.setenv("TWINKLE_MEM_COMPOSITE_BUDGET", "16M")
    assert composite.resolve_budget() == 16 << 20
    assert composite.resolve_budget(1 << 20) == 1 << 20
    with composite.forced(budget_bytes=8 << 20):
        assert composite.resolve_budget() == 8 << 20
    monkeypatch.delenv("TWINKLE_MEM_COMPOSITE_BUDGET")
    assert composite.resolve_budget() == composite.DEFAULT_BUDGET_BYTES
    with pytest.raises(ValueError):
        composite.resolve_budget(100)
    # Two fp32 temporaries per element fit the budget; long rows are cut along the vocab.
    assert composite.block_shape(16384, 151936, torch.float32, 64 << 20) == (55, 151936)
    assert composite.block_shape(16384, 151936, torch.float32, 1 << 20) == (1, 131072)
    assert composite.block_shape(3, 10, torch.float32, 1 << 20) == (3, 10)
    assert composite.block_shape(8, 1000, torch.float64, 64 << 10) == (4, 1000)


# ----------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_reference(forced, dtype, with_entropy, temperature):
    logits, labels = make_case(37, 5003, dtype)
    check_against_reference(logits, labels, temperature, with_entropy=with_entropy)


@pytest.mark.parametrize("budget", [SMALL_BUDGET, 64 << 20])
def test_row_blocks_and_vocab_blocks(budget):
    # 64 KiB: each V = 151936 row is 19 vocab blocks merged; 64 MiB: all rows in one block.
    logits, labels = make_case(3, 151936, torch.bfloat16, scale=6.0)
    with composite.forced(budget_bytes=budget):
        check_against_reference(logits, labels, 1.0)


def test_float64_gradcheck(forced):
    logits = torch.randn(5, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 12, 7])

    def f(x):
        return twinkle_mem.selective_log_softmax(x, labels, True, temperature=0.8, ignore_index=-100)

    assert torch.autograd.gradcheck(f, (logits,))
    check_against_reference(logits.detach(), labels, 0.8, ignore_index=-100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_index(forced, dtype):
    logits, labels = make_case(64, 999, dtype, ignore_frac=0.4)
    check_against_reference(logits, labels, 0.9, ignore_index=-100)
    logits[labels == -100, 5] = float("nan")  # ignored rows: whatever they hold, 0 out and 0 grad
    x = logits.clone().requires_grad_()
    logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, ignore_index=-100)
    ignored = labels == -100
    assert ignored.any() and (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), x)
    assert (grad[ignored] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_infinity_logits(forced, dtype):
    logits, labels = make_case(16, 3000, dtype)
    logits[torch.rand(16, 3000) < 0.3] = float("-inf")
    logits[:, :2500] = float("-inf")  # whole vocab blocks of -inf before finite values
    labels = torch.randint(2500, 3000, (16,))
    logits[torch.arange(16), labels] = 1.0
    labels[0] = 0  # the label itself is masked: logp = -inf
    check_against_reference(logits, labels)
    logp = twinkle_mem.selective_log_softmax(logits, labels)
    assert logp[0] == -math.inf and torch.isfinite(logp[1:]).all()


def test_nan_propagates(forced):
    logits, labels = make_case(4, 5000, torch.float32)
    logits[1, 4321] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 17] = float("nan")
    x = logits.clone().requires_grad_()
    logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True)
    assert torch.isnan(logp[1]) and torch.isnan(entropy[1]) and torch.isnan(logp[2])
    assert torch.isfinite(logp[[0, 3]]).all() and torch.isfinite(entropy[[0, 3]]).all()
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), x)
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 3]]).all()


def test_empty_and_single_token_vocab(forced):
    logits = torch.randn(0, 128).requires_grad_()
    logp, entropy = twinkle_mem.selective_log_softmax(logits, torch.zeros(0, dtype=torch.long), True)
    assert logp.shape == (0,) and entropy.shape == (0,)
    logp.sum().backward()
    assert logits.grad.shape == (0, 128) and (logits.grad == 0).all()
    one, labels = make_case(5, 1, torch.float32)
    check_against_reference(one, labels)  # V = 1: logp = 0, entropy = 0


def test_non_contiguous_rows_int32_labels_leading_dims(forced):
    big, _ = make_case(18, 700, torch.bfloat16)
    logits = big.view(2, 9, 700)[:, :, :611]  # row stride 700 > V = 611
    labels = torch.randint(0, 611, (2, 9))
    a = twinkle_mem.selective_log_softmax(logits, labels, True)
    b = twinkle_mem.selective_log_softmax(logits, labels.int(), True)
    assert a[0].shape == (2, 9) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    check_against_reference(logits[1], labels[1])


def test_vocab_shard():
    # A shard [300, 700) of a 1000-token vocab: shard-local statistics, logp 0 off the shard; the
    # composite and the native kernel agree on the forward and on the backward given those statistics.
    logits, _ = make_case(12, 400, torch.float32)
    labels = torch.tensor([0, 299, 300, 301, 500, 699, 700, 999, -100, 450, 350, 650])
    native = ops.selective_log_softmax_fwd(logits, labels, 1 / 0.9, -100, 300, 1000, True)
    comp = composite.selective_log_softmax_fwd(logits, labels, 1 / 0.9, -100, 300, 1000, True,
                                               budget_bytes=SMALL_BUDGET)
    on_shard = (labels >= 300) & (labels < 700)
    keep = labels != -100
    ref = selective_log_softmax_ref(logits, torch.where(on_shard, labels - 300, 0), 0.9)
    for logp, entropy, shift, log_sum in (native, comp):
        assert_stats_close(logp[on_shard], ref[0][on_shard], "shard logp")
        assert (logp[~on_shard] == 0).all()
        assert_stats_close((shift / 0.9 + log_sum)[keep], ref[2][keep], "shard lse")
        assert_stats_close(entropy[keep], ref[1][keep], "shard entropy")
        assert shift[~keep].eq(0).all() and log_sum[~keep].eq(0).all()
    g = torch.randn(12)
    grads = [impl(g, g, logits, labels, out[2], out[3], out[1], 1 / 0.9, -100, 300)
             for impl, out in ((ops.selective_log_softmax_bwd, native), (composite.selective_log_softmax_bwd, comp))]
    # The shard's gradient of g logp + g H with shard-local statistics: logp = z_y - lse where the label
    # is on the shard, -lse where it is not (its z_y lives elsewhere).
    x64 = logits.double().requires_grad_()
    r_logp, r_entropy, r_lse, _ = selective_log_softmax_ref(x64, torch.where(on_shard, labels - 300, 0), 0.9)
    total = (torch.where(keep, g, 0) * (torch.where(on_shard, r_logp, -r_lse) + r_entropy)).sum()
    (ref_grad,) = torch.autograd.grad(total, x64)
    for grad in grads:
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


def test_matches_native_cpu_kernel():
    logits, labels = make_case(40, 3001, torch.float32, ignore_frac=0.2)
    g, g_h = torch.randn(40), torch.randn(40)
    native = ops.selective_log_softmax_fwd(logits, labels, 1.3, -100, 0, 3001, True)
    native_grad = ops.selective_log_softmax_bwd(g, g_h, logits, labels, native[2], native[3], native[1], 1.3, -100, 0)
    comp = composite.selective_log_softmax_fwd(logits, labels, 1.3, -100, 0, 3001, True, budget_bytes=SMALL_BUDGET)
    comp_grad = composite.selective_log_softmax_bwd(g, g_h, logits, labels, comp[2], comp[3], comp[1], 1.3, -100, 0,
                                                    budget_bytes=SMALL_BUDGET)
    # The shift is the row's log-normalizer rounded to the logits' dtype: two summation orders may round it to
    # neighbouring values (one ulp), log_sum then carries the difference; shift / T + log_sum is the same number.
    ulp = torch.finfo(torch.float32).eps * native[2].abs()
    assert ((native[2] - comp[2]).abs() <= ulp).all()
    lse = [out[2].double() / 1.3 + out[3].double() for out in (native, comp)]
    torch.testing.assert_close(lse[0], lse[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(native[:2], comp[:2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Two fp32 evaluations of the same gradient differ by their fp32 rounding: each is held to float64.
    for what, out, grad in (("native", native, native_grad), ("composite", comp, comp_grad)):
        check_outputs(what, logits, labels, 1 / 1.3, -100, g, g_h, out[0], out[1], grad)


# ----------------------------------------------------------------- autograd, opcheck, bad input
def test_inplace_backward(forced):
    check_inplace_backward_matches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(forced, dtype):
    opcheck_op_schemas(dtype)


# ----------------------------------------------------------------- memory
def test_saves_only_the_logits_reference_and_row_stats(forced):
    per_token = {}
    for n in (256, 2048):
        logits = torch.randn(n, 4096, dtype=torch.bfloat16).requires_grad_()
        labels = torch.randint(0, 4096, (n,))
        with saved_for_backward() as saved:
            twinkle_mem.selective_log_softmax(logits, labels, True)
        refs = [t for t in saved if t.data_ptr() == logits.data_ptr()]
        others = [t for t in saved if t.data_ptr() != logits.data_ptr()]
        assert len(refs) == 1 and refs[0].shape == logits.shape  # a reference, not a copy
        assert all(t.numel() <= n for t in others), [tuple(t.shape) for t in others]
        per_token[n] = (len(saved), sum(t.numel() * t.element_size() for t in others) / n)
    assert per_token[256] == per_token[2048] and per_token[2048][1] <= 20, per_token


# Measures the resident-set high-water mark (VmHWM) of a fresh process around
# each call, after resetting it (clear_refs 5), net of the call's own outputs.
PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, twinkle_mem
    from twinkle_mem.op import composite
    from twinkle_mem.measure import peak_rss
    torch.set_num_threads(1)
    n, v, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def transient(fn):
        with peak_rss() as peak:
            out = fn()
        return peak.bytes, out

    logits = (torch.randn(n, v) * 4).bfloat16()
    labels = torch.randint(0, v, (n,))
    res = {"logits": logits.numel() * 2, "grad": logits.numel() * 2}
    fwd = lambda: composite.selective_log_softmax_fwd(logits, labels, 1.1, -100, 0, v, True, budget_bytes=budget)
    fwd()  # warm up (allocator, lazy init)
    res["fwd"], (logp, entropy, shift, log_sum) = transient(fwd)
    g = torch.ones(n)
    res["bwd"], _ = transient(lambda: composite.selective_log_softmax_bwd(
        g, g, logits, labels, shift, log_sum, entropy, 1.1, -100, 0, budget_bytes=budget))
    x = logits.clone()
    res["bwd_"], _ = transient(lambda: composite.selective_log_softmax_bwd_(
        g, g, x, labels, shift, log_sum, entropy, 1.1, -100, 0, budget_bytes=budget))

    def autograd_step():  # the public API with autograd, as a device without a kernel runs it
        xr = logits.clone().requires_grad_()
        with composite.forced(budget_bytes=budget), peak_rss() as peak:
            lp, ent = twinkle_mem.selective_log_softmax(xr, labels, True, temperature=0.9)
            (lp.sum() + ent.sum()).backward()
        return peak.bytes
    autograd_step()
    res["autograd"] = autograd_step()
    # Sanity of the measurement: an unchunked fp32 log_softmax shows its [n, v] fp32 temporaries.
    res["eager"], _ = transient(lambda: torch.log_softmax(logits.float(), -1).gather(1, labels[:, None]))
    print(json.dumps(res))
""")


def test_transient_memory_bounded_by_budget(tmp_path):
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    n, v, budget = 256, 32768, 4 << 20  # logits 16 MiB bf16; unchunked fp32 work would be 32 MiB per temporary
    # glibc would serve block-sized buffers from freed heap that is already resident, hiding them from
    # the RSS; with a fixed mmap threshold each is its own mapping, so the RSS follows the live bytes.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, str(script), str(n), str(v), str(budget)], capture_output=True, text=True,
                         check=True, timeout=120, env=env).stdout
    res = json.loads(out.strip().splitlines()[-1])
    slack = 1 << 20  # O(N) stats, allocator rounding, page granularity
    assert res["fwd"] <= budget + slack, res
    assert res["bwd"] - res["grad"] <= budget + slack, res  # the gradient itself is an output
    assert res["bwd_"] <= budget + slack, res
    assert res["autograd"] - res["grad"] <= budget + slack, res
    assert res["eager"] >= 1.5 * n * v * 4, res  # the measurement sees unchunked temporaries
