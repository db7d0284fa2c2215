"""linear_gkd_full against twinkle-kit's own GKDLoss (teacher_logits=, the whole vocab) in float64.

The reference is twinkle's GKDLoss on the full float64 logits ``hidden @ weight.T + bias`` and its
autograd. LM heads with dyadic values (head_helpers.make_head: the logits exact in fp32), small blocks and
row tiles (several of each, the last partial). Inputs: random teacher logits, peaked rows, a teacher
close to the student, finfo.min masks in both (a padded vocab), -inf teacher logits, ignored rows;
beta 0, 0.3, 0.5, 1; T 0.7, 1; fp32, bf16, fp64.

Bounds: tests/distill/test_distill.py's. Loss within 1e-6 absolute + 1e-6 relative (1e-12 fp64); gradients
within 1 ulp + distill_helpers.gkd_grad_bounds, the terms being every vocab entry (twinkle's logits gradient is
dL/dx itself here) with the row's largest and the float64 floor 16 2^-53 / (T kept) added to their sizes.
Where twinkle's code gives NaN from 0 x inf (a -inf teacher logit), its reference has that logit at -1e300.
"""
import math

import pytest
import torch

import twinkle_mem
from distill_helpers import gkd_grad_bounds
from head_helpers import make_head
from helpers import VocabTensors, saved_for_backward
from numerics import ulp
from twinkle_mem.distill.reference import gkd_per_token_ref
from twinkle_mem.heads import gkd_full

GKDLoss = pytest.importorskip("twinkle.loss.gkd").GKDLoss

BETAS = [0.0, 0.3, 0.5, 1.0]
KINDS = ["random", "peaked", "close", "masked", "teacher_neg_inf"]
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float64: 1e-12}  # as test_distill.EPS
LOSS_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float64: 1e-12}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(gkd_full, "FULL_BLOCK", 64)  # 300 columns: 4 blocks and a ragged one
    monkeypatch.setattr(gkd_full, "FULL_ROWS", 8)  # 24 rows, some ignored: tiles of 8, the last partial


def make_case(kind, n, h, v, dtype, beta, seed):
    hidden, weight, bias, _ = make_head(n, h, v, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    t = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    x = hidden.double() @ weight.double().t() + bias.double()
    if kind == "peaked":
        top = torch.randint(0, v, (n,), generator=gen)
        b = bias.double()
        b[top] += 40.0
        bias = b.to(dtype)
        t[torch.arange(n), top] += 40.0
    if kind == "close":
        t = x + 1e-3 * torch.randn(n, v, generator=gen, dtype=torch.float64)
    t = t.float()
    mask = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min
    if kind == "masked":  # the first third masked in both (the first blocks' max is finfo.min: the fold's shift)
        b = bias.clone()
        b[: v // 3] = mask
        bias = b
        t[:, : v // 3] = torch.finfo(torch.float32).min
    if kind == "teacher_neg_inf":  # some teacher logits -inf (at beta = 1 only where the student is masked)
        cols = torch.rand(v, generator=gen) < 0.2
        cols[0] = False
        t[:, cols] = float("-inf")
        if beta == 1.0:
            b = bias.clone()
            b[cols] = mask
            bias = b
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    lead = (2, n // 2)
    return hidden.view(*lead, h), weight, bias, t.view(*lead, v), labels.view(lead)


def twinkle_reference(hidden, weight, bias, teacher, labels, beta, temperature, call_temperature=1.0):
    """twinkle's GKDLoss in float64; ``call_temperature``: twinkle's forward step's division of the student's
    logits before the loss (the teacher's are not divided)."""
    t = teacher.double().masked_fill(teacher == float("-inf"), -1e300)
    h, w, b = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    logits = (h @ w.t() + b).requires_grad_()
    logits.retain_grad()
    loss_fn = GKDLoss(beta=beta, temperature=temperature)
    avg = loss_fn({"labels": labels}, {"logits": logits / call_temperature}, teacher_logits=t)["loss"]
    avg.backward()
    per_token = gkd_per_token_ref(loss_fn, labels, logits / call_temperature, teacher_logits=t)
    return avg.detach(), per_token, (h.grad, w.grad, b.grad), logits.grad


def check_case(kind, dtype, beta, temperature, seed, n=24, h=32, v=300, call_temperature=1.0, teacher_view=False,
               frozen=False):
    """frozen: weight and bias need no gradient (the head differentiated in its forward: loss_grad=True),
    grad_hidden alone."""
    hidden, weight, bias, teacher, labels = make_case(kind, n, h, v, dtype, beta, seed)
    avg_ref, per_ref, grads_ref, d_logits = twinkle_reference(hidden, weight, bias, teacher, labels, beta,
                                                              temperature, call_temperature)
    hd = hidden.detach().clone().requires_grad_()
    w, b = (x.detach().clone().requires_grad_(not frozen) for x in (weight, bias))
    if teacher_view:  # twinkle's teacher_logits[:, :L] of a longer teacher: not contiguous
        longer = torch.full((2, n // 2 + 3, v), float("nan"))
        longer[:, : n // 2] = teacher
        teacher = longer[:, : n // 2]
    per = twinkle_mem.linear_gkd_full(hd, w, teacher, labels, bias=b, beta=beta, loss_grad=frozen or None,
                                      temperature=temperature * call_temperature, teacher_temperature=temperature)
    temperature = temperature * call_temperature  # the student's (the gradient's floor below)
    avg = twinkle_mem.gkd_average(per, labels)
    grads = torch.autograd.grad(avg, (hd,) if frozen else (hd, w, b))
    tol = LOSS_TOL[dtype]
    for what, got, ref in (("per-token loss", per, per_ref), ("average", avg.view(1), avg_ref.view(1))):
        got = got.detach().double()
        assert torch.isfinite(got).all() and torch.isfinite(ref).all(), f"{what}: {got} vs {ref}"
        ratio = ((got - ref).abs() / (tol + tol * ref.abs())).max().item()
        assert ratio <= 1.0, f"{what}: error {ratio:.3g} x the bound"
    eps = EPS[dtype]
    kept = (labels != -100).reshape(-1, 1)
    d = d_logits.abs().reshape(kept.shape[0], v)
    d = (d + d.amax(-1, keepdim=True) + 16 * 2.0**-53 / (temperature * int(kept.sum())) / eps) * kept
    ids = torch.arange(v).expand(kept.shape[0], v)
    bounds = gkd_grad_bounds(hidden, weight, ids, d, eps)
    for name, g, r, bd in zip(("hidden", "weight", "bias"), grads, grads_ref, bounds):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"grad_{name}"
        ratio = ((g.double() - r).abs() / (ulp(r, dtype) + bd.view(r.shape))).max().item()
        assert ratio <= 1.0, f"grad_{name}: error {ratio:.3g} x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_against_twinkle_float64(kind, dtype, small_blocks):
    for beta in BETAS:
        for temperature in (0.7, 1.0):
            check_case(kind, dtype, beta, temperature, seed=KINDS.index(kind))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_head_against_twinkle_float64(kind, dtype, small_blocks):
    # LoRA's frozen head: dL/dhidden summed in a third forward sweep, once the rows' L and K are known (heads/gkd_full.py)
    for beta in BETAS:
        check_case(kind, dtype, beta, 0.7, seed=KINDS.index(kind) + 40, frozen=True)


@pytest.mark.parametrize("kind", ["random", "peaked", "close"])
def test_teacher_temperature_and_a_teacher_view(kind, small_blocks):
    # twinkle's forward step divides the student's logits by the call's temperature Tc, its GKDLoss both sides
    # by Tl: the op at temperature Tc Tl with teacher_temperature Tl; the teacher a view of a longer one.
    for beta in BETAS:
        check_case(kind, torch.float32, beta, 0.7, seed=KINDS.index(kind) + 20, call_temperature=0.6,
                   teacher_view=True)


def test_default_blocks():
    check_case("random", torch.float32, 0.5, 0.7, seed=9, n=24, v=5000)  # 3 blocks of 2048, one row tile


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_bitwise_the_same_whatever_the_batch(dtype, frozen, small_blocks):
    gen = torch.Generator().manual_seed(11)
    n, h, v = 37, 24, 300
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    teacher = torch.randn(n, v, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = -100
    g_out = torch.randn(n, generator=gen)

    def run(rows):
        x = hidden[rows].clone().requires_grad_()
        per = twinkle_mem.linear_gkd_full(x, weight.clone().requires_grad_(not frozen), teacher[rows], labels[rows],
                                          temperature=0.7, loss_grad=frozen or None)
        (g,) = torch.autograd.grad((per * g_out[rows]).sum(), x)
        return per.detach(), g
    full = run(torch.arange(n))
    for rows in (torch.arange(n).flip(0), torch.arange(5, 19), torch.tensor([6])):
        got = run(rows)
        assert torch.equal(got[0], full[0][rows]) and torch.equal(got[1], full[1][rows]), rows


def test_saves_the_inputs_and_o_n(small_blocks):
    hidden, weight, bias, teacher, labels = make_case("random", 24, 16, 300, torch.float32, 0.5, 3)
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    with saved_for_backward() as saved:
        twinkle_mem.linear_gkd_full(h, w, teacher, labels, bias=b).sum().backward()
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, b, teacher, labels)}
    assert saved
    for t in saved:
        assert t.untyped_storage().data_ptr() in inputs or t.numel() <= 24 * 6, f"saved {tuple(t.shape)}"


def test_no_tensor_of_the_logits_size_beyond_the_teacher(small_blocks):
    # Every tensor any op returns, also inside the two custom ops (helpers.VocabTensors): none of N V elements
    # but views of the teacher's logits; the float64 blocks within one tile x block.
    n, h, v = 64, 16, 2000
    hidden, weight, bias, teacher, labels = make_case("random", n, h, v, torch.bfloat16, 0.5, 4)
    hw, ww, bw = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    mode = VocabTensors((), n * v)
    ops = (gkd_full.gkd_full_fwd, gkd_full.gkd_full_bwd)
    mode.python_ops.update({op._opoverload: op._init_fn for op in ops})
    with mode:
        per = twinkle_mem.linear_gkd_full(hw, ww, teacher, labels, bias=bw)
        torch.autograd.grad(per.sum(), (hw, ww, bw))
    big = [(f, s) for f, s in mode.large if "view" not in f]
    assert mode.ops and not big, big[:4]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        per = twinkle_mem.linear_gkd_full(hw, ww, teacher, labels, bias=bw)
        torch.autograd.grad(per.sum(), (hw, ww, bw))
    blocks = [s for e in prof.events() if e.name == "aten::exp" for s in e.input_shapes if s]
    assert blocks and max(math.prod(s) for s in blocks) <= gkd_full.FULL_ROWS * gkd_full.FULL_BLOCK, blocks[:4]


def test_ignored_rows_and_bad_arguments():
    hidden, weight, bias, teacher, labels = make_case("random", 24, 16, 100, torch.float32, 0.5, 5)
    h = hidden.clone().requires_grad_()
    per = twinkle_mem.linear_gkd_full(h, weight, teacher, labels, bias=bias)
    (g,) = torch.autograd.grad(per.sum(), h)
    assert (per[labels == -100] == 0).all() and (per[labels != -100] > 0).all() and not g[labels == -100].any()
    call = twinkle_mem.linear_gkd_full
    with pytest.raises(ValueError, match="teacher_logits"):
        call(hidden, weight, teacher[..., :50], labels)
    with pytest.raises(ValueError, match="must not require grad"):
        call(hidden, weight, teacher.clone().requires_grad_(), labels)
    with pytest.raises(ValueError, match="labels"):
        call(hidden, weight, teacher, labels[:, :2])
    with pytest.raises(ValueError, match="beta"):
        call(hidden, weight, teacher, labels, beta=2.0)
    with pytest.raises(ValueError, match="temperature"):
        call(hidden, weight, teacher, labels, temperature=-1.0)


def test_opcheck_and_gradcheck(small_blocks):
    hidden, weight, bias, teacher, labels = make_case("random", 10, 8, 100, torch.float64, 0.5, 6)
    h2, t2, y2 = hidden.reshape(10, 8), teacher.reshape(10, 100).double(), labels.reshape(10)
    h, w, b = (x.clone().requires_grad_() for x in (h2, weight, bias))
    torch.library.opcheck(gkd_full.gkd_full_fwd, (h, w, b, t2, y2, 0.3, 0.7, 0.9, -100, False))
    torch.library.opcheck(gkd_full.gkd_full_fwd, (h, w, None, t2, None, 1.0, 1.0, 1.0, -100, False))
    torch.library.opcheck(gkd_full.gkd_full_fwd, (h, weight, None, t2, y2, 0.3, 0.7, 0.9, -100, True))  # frozen
    for beta in BETAS:
        assert torch.autograd.gradcheck(
            lambda h, w, b: twinkle_mem.linear_gkd_full(h, w, t2, y2, bias=b, beta=beta, temperature=0.7), (h, w, b))
        assert torch.autograd.gradcheck(  # a frozen head: differentiated in the forward
            lambda h: twinkle_mem.linear_gkd_full(h, weight, t2, y2, bias=bias, beta=beta, temperature=0.7), (h,))


@pytest.mark.parametrize("head", ["gkd_full", "gkd_topk"])
def test_frozen_head_pays_for_its_vectors_only_when_told(head, small_blocks):
    # A frozen head (LoRA's) sums dL/dhidden in its forward only where loss_grad=True says the loss will be trained
    # (an [N, H] vector saved); by default it saves none and its backward recomputes, as a trainable head's does.
    # Old and new losses (no_grad and grad enabled) bitwise the same either way; the gradients agree.
    gen = torch.Generator().manual_seed(5)
    n, h, v, k = 24, 16, 300, 8
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) * 0.3
    teacher = torch.randn(n, v, generator=gen)
    ids, lp = torch.randint(0, v, (n, k), generator=gen), torch.randn(n, k, generator=gen).log_softmax(-1)
    labels = torch.randint(0, v, (n,), generator=gen)

    def call(x, loss_grad):
        if head == "gkd_full":
            return twinkle_mem.linear_gkd_full(x, weight, teacher, labels, temperature=0.7, loss_grad=loss_grad)
        return twinkle_mem.linear_gkd_topk(x, weight, ids, lp, labels, temperature=0.7, loss_grad=loss_grad)

    with torch.no_grad():
        old = call(hidden, None)
    results = {}
    for loss_grad in (None, True):
        x = hidden.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            per = call(x, loss_grad)
        vectors = [t for t in saved if t.shape == (n, h) and t.data_ptr() != x.data_ptr()]
        assert len(vectors) == (1 if loss_grad else 0), (loss_grad, [tuple(t.shape) for t in saved])
        assert torch.equal(per.detach(), old)
        results[loss_grad] = torch.autograd.grad(per.sum(), x)[0]
    torch.testing.assert_close(results[None], results[True], rtol=1e-5, atol=1e-6)

