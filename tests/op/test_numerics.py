"""Numerics on the inputs real training produces (tests/numerics.py), on every
implementation that runs here (tests/impls.py), and batch invariance."""
import pytest
import torch

from impls import IMPLS
from numerics import Case, check_case, check_outputs, make_cases, quiet_nan, run_impl, upstream

from twinkle_mem.op.reference import log_probs_ref, selective_log_softmax_grad_ref

SHAPES = [(3, 4099), (17, 257)]  # odd V: SIMD tails; N below and above the thread count
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _cases(n, v, dtype):
    return make_cases(n, v, dtype, seed=n * 1000 + v)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numerics_classes(impl, dtype, shape):
    for case in _cases(*shape, dtype):
        if case.logits.numel() <= impl.max_elements:
            check_case(impl, case)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_numerics_classes_inplace_backward(impl):
    for case in _cases(5, 1031, torch.bfloat16):
        if case.logits.numel() <= impl.max_elements:
            check_case(impl, case, inplace=True)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_numerics_long_rows(impl):
    # V = 151936: rows cut into segments (CPU) or vocab blocks (composite), merged.
    n, v = 2, 151936
    if n * v > impl.max_elements:
        pytest.skip(f"{impl.name} is an emulation limited to {impl.max_elements} elements")
    for case in make_cases(n, v, torch.bfloat16, seed=7):
        if case.name.startswith(("randn", "finfo.min first half", "finfo.min all but 3", "peaked 60", "offset 1e4",
                                 "T=0.05", "k=4", "NaN of either sign")):
            check_case(impl, case)


def _grads_of(impl, case, inplace=False):
    g_logp, g_entropy = upstream(case, seed=3)
    logp, entropy, shift, log_sum, grad = run_impl(impl, case, g_logp, g_entropy, inplace)
    return [logp, entropy, shift, log_sum, grad]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_batch_invariance(impl):
    """A row's logp, entropy, statistics and gradient are bitwise the same whatever N, the other rows,
    the thread count and the backward variant."""
    v = 40000 if impl.name != "composite" else 5003  # several CPU segments per row
    gen = torch.Generator().manual_seed(11)
    pool = (torch.randn(64, v, generator=gen) * 4).bfloat16()
    pool[5, : v // 2] = torch.finfo(torch.bfloat16).min
    labels = torch.randint(0, v, (64,), generator=gen)
    rows = [5, 0, 63]

    def results(n, order_seed, threads, inplace):
        # the watched rows among n - 3 others, at shuffled positions
        g = torch.Generator().manual_seed(order_seed)
        others = [r for r in torch.randperm(64, generator=g).tolist() if r not in rows][: n - len(rows)]
        batch = others + rows
        perm = torch.randperm(n, generator=g).tolist()
        batch = [batch[i] for i in perm]
        case = Case("batch", pool[batch].clone(), labels[batch].clone(), temperature=0.8)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = _grads_of(impl, case, inplace)
        finally:
            torch.set_num_threads(old)
        where = [batch.index(r) for r in rows]
        # upstream gradients differ with the batch: compare the per-row quantities and the gradient of a
        # fixed upstream by re-running with that row's own g below
        return [t[where] for t in out[:4]], case, where

    base, _, _ = results(len(rows), 0, 1, False)
    for n, seed, threads, inplace in ((7, 1, 2, False), (33, 2, 1, True), (64, 3, 2, True)):
        got, _, _ = results(n, seed, threads, inplace)
        for a, b, what in zip(base, got, ("logp", "entropy", "shift", "log_sum")):
            assert torch.equal(a, b), f"{impl.name}: {what} of a row depends on the batch (N={n})"


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_gradient_batch_invariance(impl):
    """The gradient of a row, for the same upstream gradients, is bitwise the same in any batch and either variant."""
    v = 40000 if impl.name != "composite" else 5003
    gen = torch.Generator().manual_seed(12)
    pool = (torch.randn(48, v, generator=gen) * 4).bfloat16()
    labels = torch.randint(0, v, (48,), generator=gen)
    g_pool = torch.randn(48, generator=gen), torch.randn(48, generator=gen)

    def grad_rows(idx, threads, inplace):
        case = Case("batch", pool[idx].clone(), labels[idx].clone(), temperature=1.3)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ignore = -(2**63)
            logp, entropy, shift, log_sum = impl.forward(case.logits, case.labels, 1 / 1.3, ignore, 0, v, True)
            target = case.logits.clone() if inplace else case.logits
            grad = impl.backward(g_pool[0][idx], g_pool[1][idx], target, case.labels, shift, log_sum, entropy,
                                 1 / 1.3, ignore, 0, inplace)
        finally:
            torch.set_num_threads(old)
        return grad

    alone = grad_rows([9], 1, False)
    for idx, threads, inplace in (([3, 9, 4], 2, False), (list(range(48)), 2, True), ([9, 1], 1, True)):
        got = grad_rows(idx, threads, inplace)
        assert torch.equal(got[idx.index(9)], alone[0]), f"{impl.name}: gradient depends on the batch"


# ------------------------------------------------------------------ issue 27: where the gradient's terms cancel
def _cancelling_case():
    """The search's worst draw of the property test's fp32 range (docs/numerics.md): at row 26 the label's two
    gradient parts cancel 9-fold, and every fp32 implementation's error there exceeds 2 ulp + 2^-22 of the row."""
    torch.manual_seed(538896515)
    logits = (torch.randn(27, 310, dtype=torch.float64) * 4.404613324425813).to(torch.float32)
    labels = torch.randint(0, 310, (27,))
    g_logp, g_entropy = torch.randn(27), torch.randn(27)
    return Case("cancelling label gradient (issue 27)", logits, labels, 2.7244757280725), g_logp, g_entropy


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_cancelling_gradient_within_the_bound(impl):
    case, g_logp, g_entropy = _cancelling_case()
    logp, entropy, _shift, _log_sum, grad = run_impl(impl, case, g_logp, g_entropy)
    check_outputs(f"{impl.name} {case.name}", case.logits, case.labels, case.temperature, None, g_logp, g_entropy,
                  logp, entropy, grad)


def test_conditioning_temperature_term_is_the_derivative():
    # grad_conditioning's first term, eps |b dd/db|, against a finite difference of the float64 gradient.
    case, g_logp, g_entropy = _cancelling_case()
    x, y, t = case.logits, case.labels, case.temperature
    step = 1e-7
    d0 = selective_log_softmax_grad_ref(x, y, g_logp, g_entropy, t)
    d1 = selective_log_softmax_grad_ref(x, y, g_logp, g_entropy, t / (1 + step))  # b -> b (1 + step)
    numeric = (d1 - d0) / step
    log_p, entropy, _ = log_probs_ref(x, t)
    p, w, b = log_p.exp(), log_p + entropy[:, None], 1 / t
    var = (p * w * w).sum(-1, keepdim=True)
    here = torch.zeros_like(p).scatter_add(-1, y[:, None], g_logp.double()[:, None])
    g, g_h = g_logp.double()[:, None], g_entropy.double()[:, None]
    analytic = b * (here - g * p - g_h * p * w) - b * p * (g * w + g_h * (w * w + w - var))
    assert (analytic - numeric).abs().max() < 1e-5 * numeric.abs().max()


def test_the_bound_still_catches_a_temperature_off_by_16_roundings():
    # The conditioning term covers fp32's rounding of 1/T, not a kernel that gets the temperature wrong.
    case, g_logp, g_entropy = _cancelling_case()
    wrong = Case(case.name, case.logits, case.labels, case.temperature * (1 + 2.0**-20))
    logp, entropy, *_ = run_impl(IMPLS[0], case, g_logp, g_entropy)  # (the outputs right: the gradient checked)
    *_, grad = run_impl(IMPLS[0], wrong, g_logp, g_entropy)
    with pytest.raises(AssertionError, match="grad"):
        check_outputs("temperature off", case.logits, case.labels, case.temperature, None, g_logp, g_entropy, logp,
                      entropy, grad)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_among_neg_inf_is_not_lost(impl, dtype):
    """Issue 41's rows: 20000 logits, columns 8192-16383 at -inf and one NaN at 9000, of either sign (rows 0, 1);
    and a -inf tail after 64 finite logits with a NaN near the end (rows 2, 3: whatever the tiling, the last
    tile holds only -inf and the NaN, e.g. the AscendC kernel's). A max that passes over the NaN leaves that
    block's max at -inf; the block must count as NaN, not as empty: logp, entropy and the whole row's
    gradient NaN, as torch gives. Row 4 (the -inf block, no NaN) stays finite."""
    v = 20000
    x = (torch.randn(5, v, generator=torch.Generator().manual_seed(41)) * 2).to(dtype)
    x[[0, 1, 4], 8192:16384] = float("-inf")
    x[[2, 3], 64:] = float("-inf")
    for row, col in ((0, 9000), (1, 9000), (2, v - 7), (3, v - 7)):
        x[row, col] = quiet_nan(dtype, negative=row % 2 == 1)
    labels = torch.tensor([5, 17000, 9001, 3, 17])
    for with_entropy in (True, False):
        case = Case("NaN among -inf", x, labels, with_entropy=with_entropy)
        for inplace in (False, True):
            g_logp, g_entropy = upstream(case)
            logp, entropy, _shift, _log_sum, grad = run_impl(impl, case, g_logp, g_entropy, inplace)
            assert logp[:4].isnan().all() and grad[:4].isnan().all(), (impl.name, with_entropy, inplace)
            assert not with_entropy or entropy[:4].isnan().all(), (impl.name, inplace)
            assert logp[4].isfinite() and grad[4].isfinite().all(), (impl.name, with_entropy, inplace)
            check_outputs(f"{impl.name} {case.name}", x, labels, 1.0, None, g_logp, g_entropy, logp,
                          entropy if with_entropy else None, grad)
