"""The three GKD ops on the inputs real training produces, against twinkle's GKDLoss in float64 and in fp32.

tests/distill/test_distill*.py check each op against twinkle in float64 on random, peaked (gaps of 40), close,
masked and -inf inputs at T 0.7 and 1. This module adds the classes of tests/numerics.py that they lack,
for all three ops (linear_gkd_topk, gkd_from_logits, linear_gkd_full): temperatures 0.05 and 1e4, large
logits (offsets +1e4 and -2^18 on both sides), all-equal rows (student and teacher, and a student against a
random teacher), finfo.min masks with only 3 allowed tokens (at T 0.05 and 1), and peaked rows with gaps of
64 and 100 where student and teacher agree or disagree. LM heads of dyadic values whose logits are exact in
fp32 (also at the offsets: 2^18 + multiples of 2^-5 fit in 24 bits), so the comparison measures the ops.

Bounds (fp32, bf16 and fp64 inputs):
- the suite's (tests/distill/test_distill.py): loss within 1e-6 absolute + 1e-6 relative of float64 (1e-12 for
  fp64); gradients within 1 ulp + distill_helpers.gkd_grad_bounds ((m + 4) eps sum of the terms' sizes, eps 2^-24,
  1e-12 for fp64, each size the entry's |dL/dx| + the row's largest + a float64 floor / eps);
  gkd_from_logits's within 2 ulp + the floor (tests/distill/test_distill_logits.py). The floor, per row, is
  16 2^-53 (1 + Lam) / (T kept) (float64_floor): the suite's 16 2^-53 / (T kept) is the case of log-probs
  of size 1; at beta = 1, T = 0.05 and a peak of 100, dL/dx = p (ls - lt - L) cancels terms of 2000, whose
  float64 rounding it carries;
- derived here, because at T = 1e4 or on all-equal rows the loss is 1e-8 or 0 and 1e-6 absolute says
  nothing: the op computes each token's loss in float64 and rounds it once, so
  |error| <= u |L| (the rounding: u = 2^-24, 2^-53 for fp64) + 2^-53 (64 Lam + k S), where Lam is the
  row's largest |ls| + |lt| over the entries with mass (the float64 rounding of each log-prob, in the op
  and in the reference) and S = sum_j (p_j + q_j) (|ls_j| + |lt_j| + 1) bounds the k terms summed. The
  average (gkd_average: a sum over the kept tokens and one division) adds (kept + 1) u sum |L| / kept.
  The reference is twinkle's GKDLoss in float64 on each row shifted by its max first (exact for fp32
  values; GKD and the logits' gradient are the same for a shifted row): twinkle's own x / T, unshifted,
  rounds at 2^-53 |x| / T, 1e-10 at the offsets, which would hide an op dividing before it shifts;
- against twinkle's own fp32 path (GKDLoss on fp32 logits; fp32 inputs): each output's worst error beyond
  what no output avoids (the loss: the derived bounds; the gradients: 1 ulp + (m + 4) 2^-24 sum of the
  terms' own sizes + the floor, the suite's bound without the row-max term) is at most twinkle fp32's
  worst error (NaN from twinkle counts as an infinite error).
Batch invariance: each row's loss alone is bitwise the loss it has in the batch.
"""
import math

import pytest
import torch

import twinkle_mem
from distill_helpers import gkd_grad_bounds
from head_helpers import make_head
from numerics import ulp
from twinkle_mem.heads import gkd_full, gkd_topk

GKDLoss = pytest.importorskip("twinkle.loss.gkd").GKDLoss

BETAS = [0.0, 0.3, 0.5, 1.0]
OPS = ["topk", "logits", "full"]
# class -> temperatures
CLASSES = {
    "T=0.05": (0.05,),
    "T=1e4": (1e4,),
    "offset +1e4": (0.7, 1.0),
    "offset -2^18": (0.7, 1.0),
    "all-equal rows": (0.05, 1.0),
    "all-equal student, random teacher": (0.05, 1.0, 1e4),
    "finfo.min all but 3": (0.05, 1.0),
    "peaked 64/100, agree": (0.7, 1.0),
    "peaked 100, disagree": (0.05, 1.0),
}
N, H, V, K = 16, 32, 300, 8
FP32_MIN = torch.finfo(torch.float32).min


# ------------------------------------------------------------------ inputs
def make_inputs(cls, dtype, seed):
    """(hidden [N, H], weight [V, H], bias [V], teacher logits [N, V] fp32, labels [N]): the student's
    logits hidden @ weight.T + bias exact in fp32 (and in float64)."""
    hidden, weight, bias, _ = make_head(N, H, V, torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    teacher = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    if cls.startswith("offset"):
        off = 10240.0 if "+1e4" in cls else -2.0**18  # (bf16-representable, so the bias is exact in bf16)
        bias = bias + off if dtype != torch.bfloat16 else torch.full_like(bias, off)
        teacher = teacher + (1e4 if "+1e4" in cls else -2.0**18)
    if cls.startswith("all-equal"):
        weight = weight[:1].expand(V, H).clone()  # every logit of a row the same
        bias = torch.full_like(bias, 2.5)
        if cls == "all-equal rows":
            teacher = torch.full_like(teacher, -7.0)
    if cls == "finfo.min all but 3":
        allowed = torch.randperm(V, generator=gen)[:3]
        mask = torch.ones(V, dtype=torch.bool)
        mask[allowed] = False
        # (fp32's rounds to -inf in bf16; for fp64 fp32's, as the suite: float64's overflows in x / T)
        bias = bias.masked_fill(mask, torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min)
        teacher[:, mask] = FP32_MIN
    if cls.startswith("peaked"):  # a per-row peak: hidden columns H/2.. select the row, weight lifts its token
        gaps = (64.0, 100.0) if "64" in cls else (100.0,)
        s_top = torch.randint(0, V, (N,), generator=gen)
        t_top = s_top if "agree" in cls and "dis" not in cls else (s_top + 1 + torch.randint(0, V - 1, (N,),
                                                                                             generator=gen)) % V
        hidden[:, H // 2:] = 0
        weight[:, H // 2:] = 0
        for r in range(N):
            gap = gaps[r % len(gaps)]
            hidden[r, H // 2 + r % (H // 2)] = 1.0
            weight[s_top[r], H // 2 + r % (H // 2)] = gap
            teacher[r, t_top[r]] += gap
        assert N <= H // 2
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.25] = -100
    labels[0] = 1  # at least one row kept
    hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    exact = hidden.double() @ weight.double().t() + bias.double()
    assert torch.equal(exact.float().double(), exact) or cls == "finfo.min all but 3", "logits not exact in fp32"
    return hidden, weight, bias, teacher.float(), labels


def topk_teacher(teacher, cls):
    """(ids [N, K], log-probs [N, K] fp32) of the teacher's top-k: its log-probs, or at the offsets and masks
    its logits themselves (a local top-k teacher, which the renormalization over the k makes equivalent)."""
    values, ids = teacher.double().topk(K, dim=-1)
    if cls.startswith("offset") or cls.startswith("finfo") or cls.startswith("all-equal"):
        return ids, values.float()
    return ids, teacher.double().log_softmax(-1).gather(-1, ids).float()


def student_logits(op, inputs):
    """The student's logits, float64: exact; for gkd_from_logits, as its input in the inputs' dtype holds them."""
    hidden, weight, bias = inputs[:3]
    x = hidden.double() @ weight.double().t() + bias.double()
    return x.to(hidden.dtype).double() if op == "logits" else x


# ------------------------------------------------------------------ twinkle, in float64 or fp32
def twinkle_run(op, inputs, beta, temperature, dt):
    """twinkle's GKDLoss computed in ``dt`` (float64 or float32) on the student's logits: (average, per-token
    [N] float64, gradients of the average as the op returns them (hidden, weight, bias) or (student logits,)),
    and dL/dx of the average per entry (the logits' gradient, [N, k] for top-k, [N, V] else), float64."""
    hidden, weight, bias, teacher, labels = inputs
    loss_fn = GKDLoss(beta=beta, temperature=temperature)
    h, w, b = (t.detach().to(dt).requires_grad_() for t in (hidden, weight, bias))
    logits = h @ w.t() + b
    if op == "logits":  # the op's input: the logits in the inputs' dtype
        logits = student_logits(op, inputs).to(dt).requires_grad_()
    logits.retain_grad()
    ids, lp = TOPK
    lp, teacher = lp.to(dt), teacher.to(dt)
    x = logits
    if dt == torch.float64:  # each row shifted by its max first (exact: fp32 values, a float64 difference), so
        # that twinkle's x / T does not round at the offsets' magnitude; GKD is the same for a shifted row, and
        # the logits' gradient too (the rows of dL/dx sum to 0)
        shift = lambda t, dim=-1: t - t.amax(dim, keepdim=True).detach()  # noqa: E731
        x = shift(logits.gather(-1, ids) if op == "topk" else logits)
        lp, teacher = shift(lp), shift(teacher)
        if op == "topk":  # the gathered logits as a vocab of k columns
            ids = torch.arange(K).expand(N, K)
    if op == "topk":
        kw = dict(teacher_topk_logprobs=lp, teacher_topk_indices=ids)
    else:
        kw = dict(teacher_logits=teacher)
    kw = {key: t.view(1, N, -1) for key, t in kw.items()}  # twinkle's [B, S, ..] layout
    avg = loss_fn({"labels": labels.view(1, N)}, {"logits": x.view(1, N, -1)}, **kw)["loss"]
    avg.backward()
    grads = (logits.grad,) if op == "logits" else (h.grad, w.grad, b.grad)
    d = logits.grad.double()
    if op == "topk":
        d = d.gather(-1, TOPK[0])  # ids distinct per row (topk)
    per = torch.zeros(N, dtype=torch.float64)
    x = x.detach()
    for i in (labels != -100).nonzero().flatten().tolist():
        one = torch.full_like(labels, -100)
        one[i] = 0
        per[i] = loss_fn({"labels": one.view(1, N)}, {"logits": x.view(1, N, -1)}, **kw)["loss"].double()
    return avg.detach().double(), per, [g.double() for g in grads], d


TOPK = [None, None]  # the top-k teacher of the case being checked (set by check)


def run_op(op, inputs, beta, temperature, rows=None):
    hidden, weight, bias, teacher, labels = inputs
    if rows is not None:
        hidden, teacher, labels = hidden[rows], teacher[rows], labels[rows]
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    if op == "topk":
        ids, lp = (t if rows is None else t[rows] for t in TOPK)
        per = twinkle_mem.linear_gkd_topk(h, w, ids, lp, labels, bias=b, beta=beta, temperature=temperature)
        leaves = (h, w, b)
    elif op == "logits":
        x = student_logits(op, (hidden, weight, bias)).to(hidden.dtype).requires_grad_()
        per = twinkle_mem.gkd_from_logits(x, teacher, labels, beta=beta, temperature=temperature,
                                          chunk_bytes=3 * 20 * 8 * V)  # chunks of 3 rows
        leaves = (x,)
    else:
        per = twinkle_mem.linear_gkd_full(h, w, teacher, labels, bias=b, beta=beta, temperature=temperature)
        leaves = (h, w, b)
    avg = twinkle_mem.gkd_average(per, labels)
    return avg.detach(), per.detach(), torch.autograd.grad(avg, leaves)


# ------------------------------------------------------------------ bounds
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float64: 2.0**-53}  # the loss's rounding
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float64: 1e-12}  # the gradients' (test_distill.EPS)
LOSS_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float64: 1e-12}


def loss_bounds(op, inputs, per_ref, beta, temperature):
    """Per token: the derived bound 2^-24 |L| + 2^-53 (64 Lam + k S) (module docstring), float64 [N]."""
    hidden, weight, bias, teacher, labels = inputs
    x = student_logits(op, inputs)
    t = teacher.double()
    if op == "topk":
        x, t = x.gather(-1, TOPK[0]), TOPK[1].double()
    s, tt = x / temperature, t / temperature
    ls, lt = s.log_softmax(-1), tt.log_softmax(-1)
    live = (ls.exp() + lt.exp()) > 0
    zero = torch.zeros((), dtype=torch.float64)
    lam = torch.where(live, ls.abs() + lt.abs(), zero).amax(-1)
    size = torch.where(live, (ls.exp() + lt.exp()) * (ls.abs() + lt.abs() + 1), zero).sum(-1)
    floor = 2.0**-53 * (64 * lam + x.shape[-1] * size)
    return (UNIT[hidden.dtype] * per_ref.abs() + floor) * (labels != -100)


def float64_floor(op, inputs, beta, temperature):
    """Per row [N, 1]: what the float64 math (the op's and twinkle's float64 autograd) may leave on dL/dx of
    the average: 16 2^-53 (1 + Lam_D) / (T kept), Lam_D = the row's largest |ls| + |lt| over the entries the
    student gives mass, plus |L| (dL/dx is p (ls - lt - L) at beta = 1, p (ls - lm - K) else, p - q at 0:
    the log-probs' own float64 rounding, 2^-53 |ls|, is what the difference carries; the suite's floor,
    16 2^-53 / (T kept), is the beta = 0 case, log-probs of size 1)."""
    hidden, weight, bias, teacher, labels = inputs
    x, t = student_logits(op, inputs), teacher.double()
    if op == "topk":
        x, t = x.gather(-1, TOPK[0]), TOPK[1].double()
    ls, lt = (x / temperature).log_softmax(-1), (t / temperature).log_softmax(-1)
    lam = torch.where(ls.exp() > 0, ls.abs() + lt.abs(), torch.zeros((), dtype=torch.float64)).amax(-1, keepdim=True)
    lam = (lam + lam.clamp(max=1e300)).nan_to_num(0.0, 0.0, 0.0)  # (|L| <= the log-probs' spread)
    kept = labels != -100
    return 16 * 2.0**-53 * (1 + lam) / (temperature * int(kept.sum())) * kept.unsqueeze(1)


def grad_bounds(op, inputs, grads_ref, d, beta, temperature, dtype, unavoidable=False):
    """Per output: the suite's gradient bounds with the float64 floor per row (float64_floor). With
    ``unavoidable``: only what rounding exact dL/dx to fp32 and summing it in fp32 leaves (1 ulp of the
    output, (m + 4) 2^-24 sum |terms| with the terms' own sizes) and the float64 floor; no row-max term."""
    hidden, weight, bias, teacher, labels = inputs
    floor = float64_floor(op, inputs, beta, temperature)
    if op == "logits":  # one ulp for the rounding, one for gkd_average's 1 / kept in fp32
        return [(1 if unavoidable else 2) * ulp(grads_ref[0], dtype) + floor]
    eps = EPS[dtype]
    kept = (labels != -100).unsqueeze(1)
    sizes = (d.abs() + (0 if unavoidable else d.abs().amax(-1, keepdim=True)) + floor / eps) * kept
    ids = TOPK[0] if op == "topk" else torch.arange(V).expand(N, V)
    bh, bw, bb = gkd_grad_bounds(hidden, weight, ids, sizes, eps)
    return [ulp(r, dtype) + bd.view(r.shape) for r, bd in zip(grads_ref, (bh, bw, bb))]


def _err(got, ref):
    e = (got.double() - ref).abs()
    return torch.where(torch.isnan(e) | torch.isinf(e), math.inf, e)


def check(op, cls, dtype, beta, temperature, seed):
    inputs = make_inputs(cls, dtype, seed)
    TOPK[:] = topk_teacher(inputs[3], cls)
    what = f"{op} {cls} {dtype} beta={beta} T={temperature}"
    avg_ref, per_ref, grads_ref, d = twinkle_run(op, inputs, beta, temperature, torch.float64)
    assert torch.isfinite(per_ref).all() and all(torch.isfinite(g).all() for g in grads_ref), what
    avg, per, grads = run_op(op, inputs, beta, temperature)
    kept = int((inputs[4] != -100).sum())
    # the suite's loss bound, and the derived one
    tok = loss_bounds(op, inputs, per_ref, beta, temperature)
    avg_bound = tok.sum() / kept + (kept + 1) * UNIT[dtype] * per_ref.abs().sum() / kept
    for name, got, ref, derived in (("per-token loss", per, per_ref, tok), ("average", avg.view(1), avg_ref.view(1),
                                                                            avg_bound.view(1))):
        err = _err(got, ref)
        suite = ((err / (LOSS_TOL[dtype] * (1 + ref.abs()))).max().item())
        assert suite <= 1.0, f"{what}: {name} error {suite:.3g} x the suite's bound"
        tight = (err / derived.clamp(min=1e-300)).max().item()
        assert tight <= 1.0, f"{what}: {name} error {tight:.3g} x the derived bound (max error {err.max():.3g})"
    bounds = grad_bounds(op, inputs, grads_ref, d, beta, temperature, dtype)
    for i, (g, r, bd) in enumerate(zip(grads, grads_ref, bounds)):
        assert g.dtype == dtype, what
        ratio = (_err(g, r) / bd).max().item()
        assert ratio <= 1.0, f"{what}: gradient {i} error {ratio:.3g} x the bound"
    if dtype == torch.float32:  # at least as close to float64 as twinkle's own fp32 path, beyond the rounding
        # of exact values to fp32 and the float64 floor that no output avoids (the loss's derived bounds,
        # the gradients' fp32 sums: grad_bounds(unavoidable=True))
        avg32, per32, grads32, _ = twinkle_run(op, inputs, beta, temperature, torch.float32)
        rounding = [tok, avg_bound.view(1)]  # (the loss: its rounding and the float64 floor)
        rounding += grad_bounds(op, inputs, grads_ref, d, beta, temperature, dtype, unavoidable=True)
        pairs = [("per-token loss", per, per32, per_ref), ("average", avg.view(1), avg32.view(1), avg_ref.view(1))]
        pairs += [(f"gradient {i}", g, g32, r) for i, (g, g32, r) in enumerate(zip(grads, grads32, grads_ref))]
        for (name, got, tw, ref), unavoidable in zip(pairs, rounding):
            beyond = (_err(got, ref) - unavoidable).clamp(min=0).max().item()
            theirs = _err(tw, ref).max().item()
            assert beyond <= theirs, f"{what}: {name} error {beyond:.3g} beyond the rounding, twinkle fp32's {theirs:.3g}"
    # a row alone gives bitwise its loss in the batch
    for r in (0, N - 1):
        _a, one, _g = run_op(op, inputs, beta, temperature, rows=torch.tensor([r]))
        assert torch.equal(one, per[r:r + 1]), f"{what}: row {r} alone differs from the batch"


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(gkd_full, "FULL_BLOCK", 64)  # 300 columns: 4 blocks and a ragged one
    monkeypatch.setattr(gkd_full, "FULL_ROWS", 8)  # 16 rows: 2 tiles
    monkeypatch.setattr(gkd_topk, "MAX_TILE_ROWS", 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("cls", list(CLASSES))
@pytest.mark.parametrize("op", OPS)
def test_real_inputs_against_twinkle(op, cls, dtype, small_blocks):
    for beta in BETAS:
        for temperature in CLASSES[cls]:
            check(op, cls, dtype, beta, temperature, seed=list(CLASSES).index(cls))


def test_the_classes_are_what_they_say():
    # T = 1e4 makes the loss tiny (the suite's 1e-6 absolute says nothing there: the derived bound does);
    # all-equal rows give 0; twinkle's fp32 path is NaN on a finfo.min mask at T = 0.05 (x / T overflows) and
    # off by far more than the bound at the offsets with T != 1 (x / T rounded at 1e4).
    for cls, temperature, check_ref in (("T=1e4", 1e4, lambda p: (p[p > 0] < 1e-6).all()),
                                        ("all-equal rows", 1.0, lambda p: (p == 0).all())):
        inputs = make_inputs(cls, torch.float32, 0)
        TOPK[:] = topk_teacher(inputs[3], cls)
        _avg, per, _g, _d = twinkle_run("full", inputs, 0.5, temperature, torch.float64)
        assert check_ref(per), (cls, per)
    inputs = make_inputs("finfo.min all but 3", torch.float32, 0)
    TOPK[:] = topk_teacher(inputs[3], "finfo.min all but 3")
    assert torch.isnan(twinkle_run("full", inputs, 0.5, 0.05, torch.float32)[0])
    inputs = make_inputs("offset +1e4", torch.float32, 0)
    TOPK[:] = topk_teacher(inputs[3], "offset +1e4")
    per64 = twinkle_run("full", inputs, 0.5, 0.7, torch.float64)[1]
    per32 = twinkle_run("full", inputs, 0.5, 0.7, torch.float32)[1]
    assert ((per32 - per64).abs() > 1e-6 + 1e-6 * per64.abs()).any()
