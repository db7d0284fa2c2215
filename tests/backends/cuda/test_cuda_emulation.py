"""The CUDA kernels, run on the CPU (standins/cuda_emulation.py), on what the
numerics suite does not cover: layouts ([B, S, V] views, padded and misaligned
rows, vocab shards), the vector paths, batch invariance with N = 1, 7, 333 and
2048 rows, alignment invariance, device-side label checks, edge shapes.

Batch invariance at large N uses small segments (segment_bytes), so that rows
of a few thousand elements are split as V = 151936 is on the GPU, and the
emulation stays fast.
"""
import pytest
import torch

from numerics import NO_IGNORE, SUBNORMAL_STEP, Case, check_case, ulp
from standins import cuda_emulation as emu
from twinkle_mem.op.reference import selective_log_softmax_grad_ref, selective_log_softmax_ref

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no C++ compiler for the CUDA emulation")

IMPL = None


def _impl():
    global IMPL
    if IMPL is None:
        from numerics import Impl
        IMPL = Impl("cuda_emulated", emu.forward, emu.backward)
    return IMPL


def _run(logits, labels, inv_t=1.0, ignore=NO_IGNORE, vocab_start=0, vocab_size=None, with_entropy=True, seed=0,
         inplace=False, **kw):
    """(logp, entropy, shift, log_sum, grad) from the emulated kernels, with fixed upstream gradients."""
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    logp, entropy, shift, log_sum = emu.forward(logits, labels, inv_t, ignore, vocab_start, vocab_size, with_entropy,
                                                **kw)
    gen = torch.Generator().manual_seed(seed)
    g_logp = torch.randn(labels.shape, generator=gen, dtype=torch.float64).to(logp.dtype)
    g_entropy = torch.randn(logits.shape[:-1], generator=gen, dtype=torch.float64).to(logp.dtype)
    target = logits.clone() if inplace else logits
    grad = emu.backward(g_logp, g_entropy if with_entropy else None, target, labels, shift, log_sum,
                        entropy if with_entropy else None, inv_t, ignore, vocab_start, inplace, **kw)
    return logp, entropy, shift, log_sum, grad


def _assert_same(a, b, what):
    for x, y, name in zip(a, b, ("logp", "entropy", "shift", "log_sum", "grad")):
        assert torch.equal(x, y), f"{what}: {name} differs"


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliced_batch_views_bitwise_equal_to_contiguous(dtype):
    """logits[:, :-1] and logits[:, -r - 1:-1] of [B, S, V] (two leading strides), labels as views:
    the same results as the contiguous copy, bitwise, and the in-place gradient written through the view."""
    gen = torch.Generator().manual_seed(1)
    full = (torch.randn(3, 9, 1031, generator=gen) * 3).to(dtype)
    labels_full = torch.randint(0, 1031, (3, 9, 2), generator=gen)
    for view, y in ((full[:, :-1], labels_full[:, 1:, 0]), (full[:, -5:-1], labels_full[:, -4:]),
                    (full[:, 2:7].transpose(0, 1), labels_full[:, 2:7, 1].t())):
        assert not view.is_contiguous()
        got = _run(view, y, 1 / 0.7)
        want = _run(view.contiguous(), y.contiguous(), 1 / 0.7)
        _assert_same(got, want, "strided view")
        # in place, through the view: only the view's elements change
        buf = full.clone()
        v = buf[:, :-1]
        before_last = buf[:, -1].clone()
        grad = _run(full[:, :-1], labels_full[:, 1:, 0], 1 / 0.7)[4]
        logp, entropy, shift, log_sum = emu.forward(v, labels_full[:, 1:, 0], 1 / 0.7, NO_IGNORE, 0, 1031, True)
        gen2 = torch.Generator().manual_seed(0)
        g_logp = torch.randn(v.shape[:-1], generator=gen2, dtype=torch.float64).float()
        g_entropy = torch.randn(v.shape[:-1], generator=gen2, dtype=torch.float64).float()
        out = emu.backward(g_logp, g_entropy, v, labels_full[:, 1:, 0], shift, log_sum, entropy, 1 / 0.7, NO_IGNORE,
                           0, True)
        assert out.data_ptr() == v.data_ptr()
        assert torch.equal(buf[:, :-1], grad)
        assert torch.equal(buf[:, -1], before_last), "the in-place backward wrote outside the view"


def test_out_of_place_gradient_keeps_strides_of_padded_rows():
    x = torch.randn(4, 1024).bfloat16()[:, :1000]
    grad = _run(x, torch.randint(0, 1000, (4,)))[4]
    assert grad.stride() == x.stride(), "new_grad_like keeps a padded vocab's row stride"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_misaligned_rows_against_float64(dtype, offset):
    """Rows at every alignment (storage offset, odd row stride), odd V: the element-wise
    load path and the vector path, against float64."""
    gen = torch.Generator().manual_seed(offset)
    buf = (torch.randn(5 * 1043 + offset, generator=gen, dtype=torch.float64) * 3).to(dtype)
    x = buf[offset:].view(5, 1043)[:, :1037]
    case = Case("misaligned", x, torch.randint(0, 1037, (5, 2), generator=gen), temperature=1.3)
    check_case(_impl(), case)
    check_case(_impl(), case, inplace=True)


def test_backward_stays_vectorized_for_padded_rows():
    """x[:, :V] of a wider buffer, odd V: every full slot of the gradient is stored with a
    16-byte vector, and read with one; rows misaligned against each other use element moves."""
    n, v = 6, 1001
    x = torch.randn(n, 1024).bfloat16()[:, :v]
    y = torch.randint(0, v, (n,))
    logp, entropy, shift, log_sum = emu.forward(x, y, 1.0, NO_IGNORE, 0, v, True)
    emu.take_counters()
    emu.backward(torch.ones(n), torch.ones(n), x, y, shift, log_sum, entropy, 1.0, NO_IGNORE, 0, False)
    c = emu.take_counters()
    slots = n * (v // 8)
    assert c["vector_stores"] == slots and c["narrow_stores"] == 0, c
    assert c["vector_loads"] == slots and c["narrow_loads"] == 0, c
    # contiguous odd rows: 7 rows in 8 start off a 16-byte boundary; theirs go element by element
    x2 = torch.randn(8, v).bfloat16()
    y2 = torch.randint(0, v, (8,))
    logp, entropy, shift, log_sum = emu.forward(x2, y2, 1.0, NO_IGNORE, 0, v, True)
    emu.take_counters()
    emu.backward(torch.ones(8), torch.ones(8), x2, y2, shift, log_sum, entropy, 1.0, NO_IGNORE, 0, False)
    c = emu.take_counters()
    assert c["vector_stores"] == v // 8 and c["narrow_stores"] == 7 * (v // 8) * 8, c


def test_vocab_shard_and_ignored_labels():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1037, generator=gen).bfloat16()
    y = torch.tensor([[0, 499], [500, 1536], [1537, 2999], [-100, -100], [700, -100], [800, 800]])
    logp, entropy, shift, log_sum, grad = _run(x, y, 1.0, -100, 500, 3000)
    x64 = x.double()
    lse = torch.logsumexp(x64, -1)
    for r in range(6):
        for j in range(2):
            t = int(y[r, j]) - 500
            want = 0.0 if y[r, j] == -100 or not 0 <= t < 1037 else float(x64[r, t] - lse[r])
            assert abs(float(logp[r, j]) - want) < 1e-5
    assert float(shift[3]) == 0 and float(log_sum[3]) == 0 and float(entropy[3]) == 0
    assert torch.all(grad[3] == 0), "a row whose labels are all ignored has no gradient"


def test_against_reference_k_labels_repeated():
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(4, 777, generator=gen) * 5).float()
    y = torch.tensor([[3, 3, 5], [1, -100, 1], [776, 0, 776], [2, 2, 2]])
    logp, entropy, shift, log_sum, grad = _run(x, y, 1 / 0.9, -100)
    ref_logp, ref_entropy, _, _ = selective_log_softmax_ref(x, y, 0.9, -100)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    gen = torch.Generator().manual_seed(0)
    g_logp = torch.randn(y.shape, generator=gen, dtype=torch.float64).float()
    g_entropy = torch.randn(4, generator=gen, dtype=torch.float64).float()
    ref = selective_log_softmax_grad_ref(x, y, g_logp, g_entropy, 0.9, -100)
    assert torch.allclose(grad.double(), ref, atol=1e-6, rtol=1e-5)


def test_edge_shapes():
    # V = 1, N = 0, k = 0 (entropy only), a row of -inf, NaN propagates
    x = torch.randn(7, 1)
    logp, entropy, shift, log_sum, grad = _run(x, torch.zeros(7, dtype=torch.int64))
    assert torch.all(logp == 0) and torch.all(entropy == 0) and torch.all(grad == 0)
    out = emu.forward(torch.randn(0, 5), torch.zeros(0, dtype=torch.int64), 1.0, NO_IGNORE, 0, 5, True)
    assert [t.shape[0] for t in out] == [0, 0, 0, 0]
    x = torch.randn(3, 300)
    logp, entropy, *_ = emu.forward(x, torch.zeros(3, 0, dtype=torch.int32), 1.0, NO_IGNORE, 0, 300, True)
    assert logp.shape == (3, 0)
    assert torch.allclose(entropy.double(), -(x.double().log_softmax(-1).exp() * x.double().log_softmax(-1)).sum(-1),
                          atol=1e-5)
    x = torch.full((2, 300), float("-inf"))
    x[1, 17] = float("nan")
    logp, entropy, shift, log_sum = emu.forward(x, torch.tensor([3, 4]), 1.0, NO_IGNORE, 0, 300, True)
    assert float(shift[0]) == 0 and torch.isnan(logp[1]) and torch.isnan(log_sum[1]), (logp, log_sum)


def test_out_of_range_label_is_a_device_assert():
    x = torch.randn(4, 100)
    for bad in (100, -1, 10**12):
        y = torch.tensor([1, bad, 2, -100])
        with pytest.raises(RuntimeError, match="label out of range"):
            emu.forward(x, y, 1.0, -100, 0, 100, True)
    emu.forward(x, torch.tensor([1, 99, 2, -100]), 1.0, -100, 0, 100, True)  # in range: no assert
    # the backward never indexes with it: labels elsewhere are "another shard"
    y = torch.tensor([1, 10**12, 2, -100])
    grad = emu.backward(torch.ones(4), None, x, y, torch.zeros(4), torch.ones(4), None, 1.0, -100, 0, False)
    assert torch.isfinite(grad).all()


# ------------------------------------------------------------ subnormals
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_subnormal_gradients_kept(dtype):
    """No flush to zero (docs/cuda.md): row 0, every logit but the label 90 below it: the gradient off
    the label, -g e^-90 (g = 1), is subnormal in bf16 and fp32 (fp16 has no such values); row 1,
    96 below: at the label, g (1 - p) = g rest with rest = 1030 e^-96, a subnormal sum of subnormal terms
    in the forward. Off the label within 2 ulp + the subnormal step of float64; at the labels within 2 ulp +
    half an fp32 subnormal step per term of rest (each term is rounded to that grid before it is summed);
    not 0 where float64's value is not."""
    v = 1031
    x64 = torch.zeros(2, v, dtype=torch.float64)
    x64[0, 1:], x64[1, 1:] = -90.0, -96.0
    x = x64.to(dtype)
    y = torch.zeros(2, dtype=torch.int64)
    logp, entropy, shift, log_sum = emu.forward(x, y, 1.0, NO_IGNORE, 0, v, False)
    grad = emu.backward(torch.ones(2), None, x, y, shift, log_sum, None, 1.0, NO_IGNORE, 0, False).double()
    ref = selective_log_softmax_grad_ref(x, y, torch.ones(2, dtype=torch.float64), None, 1.0, NO_IGNORE)
    bound = 2 * ulp(ref, dtype) + SUBNORMAL_STEP[dtype]
    bound[:, 0] += (v - 1) / 2 * SUBNORMAL_STEP[torch.float32]
    assert torch.all((grad - ref).abs() <= bound), ((grad - ref).abs() / bound).max()
    kept = ref.abs() > SUBNORMAL_STEP[dtype]  # float64's value rounds to a nonzero one of the dtype
    assert bool(kept[0, 1:].all()) and bool(kept[1, 0]), "the case must hold subnormals"
    assert torch.all(grad[kept] != 0), "a subnormal gradient was flushed to 0"


# -------------------------------------------------------- batch invariance
SMALL_SEGMENT = 1024  # bytes: 512 bf16 per segment, so V = 2999 is cut in 6 as V = 151936 is in 5 on the GPU


def test_small_segments_split_rows():
    segments, seg_len, threads = emu.split(2999, torch.bfloat16, SMALL_SEGMENT)
    assert (segments, seg_len) == (6, 512)
    assert emu.split(151936, torch.bfloat16) == (5, 32768, 64)  # 64 threads: 512 logits each per task


@pytest.mark.parametrize("inplace", [False, pytest.param(True, marks=pytest.mark.e2e)])  # (True: the e2e tier)
def test_batch_invariance_n_1_7_333_2048(inplace):
    """A row's logp, entropy, statistics and gradient are bitwise the same in batches of 1, 7, 333
    and 2048 rows, at any position, whatever the other rows, out of place or in place."""
    v = 2999
    gen = torch.Generator().manual_seed(5)
    pool = (torch.randn(40, v, generator=gen) * 4).bfloat16()
    pool[3, : v // 2] = torch.finfo(torch.bfloat16).min
    pool[7, 5] += 60  # peaked
    labels = torch.randint(0, v, (40,), generator=gen)
    g_logp, g_entropy = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    watched = [3, 7, 0]

    def rows_of(n, seed):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 40, (n,), generator=g)
        where = torch.randperm(n, generator=g)[: len(watched)] if n >= len(watched) else torch.arange(n)
        idx[where] = torch.tensor(watched[: len(where)])
        x, y = pool[idx].clone(), labels[idx].clone()
        kw = dict(segment_bytes=SMALL_SEGMENT, max_grid=64)
        logp, entropy, shift, log_sum = emu.forward(x, y, 1 / 0.8, NO_IGNORE, 0, v, True, **kw)
        target = x.clone() if inplace else x
        grad = emu.backward(g_logp[idx], g_entropy[idx], target, y, shift, log_sum, entropy, 1 / 0.8, NO_IGNORE, 0,
                            inplace, **kw)
        return {int(idx[w]): (logp[w], entropy[w], shift[w], log_sum[w], grad[w]) for w in where.tolist()}

    base = {}
    for r in watched:  # each watched row alone (N = 1)
        x, y = pool[r:r + 1].clone(), labels[r:r + 1].clone()
        kw = dict(segment_bytes=SMALL_SEGMENT, max_grid=64)
        logp, entropy, shift, log_sum = emu.forward(x, y, 1 / 0.8, NO_IGNORE, 0, v, True, **kw)
        grad = emu.backward(g_logp[r:r + 1], g_entropy[r:r + 1], x.clone(), y, shift, log_sum, entropy, 1 / 0.8,
                            NO_IGNORE, 0, False, **kw)
        base[r] = (logp[0], entropy[0], shift[0], log_sum[0], grad[0])
    for n, seed in ((7, 1), (333, 2), (2048, 3)):
        for r, got in rows_of(n, seed).items():
            _assert_same(got, base[r], f"row {r} in a batch of {n}")


def test_alignment_invariance():
    """The same row at every 16-byte alignment gives bitwise the same results (elements go to
    threads by index, whatever the load width)."""
    v = 3001
    row = (torch.randn(v) * 3).bfloat16()
    y = torch.tensor([17])
    results = []
    for offset in range(8):
        buf = torch.zeros(v + 8, dtype=torch.bfloat16)
        buf[offset:offset + v] = row
        x = buf[offset:offset + v].view(1, v)
        results.append(_run(x, y, 1 / 0.7, segment_bytes=SMALL_SEGMENT))
    for r in results[1:]:
        _assert_same(r, results[0], "row at another alignment")
