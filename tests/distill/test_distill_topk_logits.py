"""gkd_topk_from_logits: twinkle-kit's GKDLoss over a top-k teacher from the student's logits.

- Against twinkle's own GKDLoss (teacher_topk_logprobs / teacher_topk_indices) on the same logits in
  float64 and its autograd, with test_distill_logits.py's bounds (the float64 term scaled by the size of the
  scaled logits, 1 + 2 max|x| / T: at T = 0.05 they reach hundreds): random, peaked, close and finfo.min-masked
  logits, the recipe's padding rows (k ids 0, log-probs 0.0) and repeated ids, beta 0 / 0.3 / 0.5 / 1,
  T 0.05 / 0.7 / 1 / 1e4, k 1 / 8 / 64, fp32, bf16 and fp64 logits.
- The same per-token loss, bitwise, as linear_gkd_topk on a head whose logits are exact in fp32 (dyadic).
- Saved for backward: O(N k) and the ids, never the logits; rows bitwise the same whatever the batch.
- Tensor parallelism: tests/distill/test_distill_vocab_parallel.py (its gloo worlds).
"""
import pytest
import torch

import twinkle_mem
from distill_helpers import assert_gkd_loss_close, gkd_logits_case, gkd_topk_teacher
from head_helpers import make_head
from helpers import saved_for_backward
from numerics import ulp
from twinkle_mem.distill.reference import gkd_per_token_ref

GKDLoss = pytest.importorskip("twinkle.loss.gkd").GKDLoss

BETAS = [0.0, 0.3, 0.5, 1.0]
KINDS = ["random", "peaked", "close", "masked"]


def reference(student, ids, lp, labels, beta, temperature):
    s = student.detach().double().requires_grad_()
    loss_fn = GKDLoss(beta=beta, temperature=temperature)
    teacher = dict(teacher_topk_logprobs=lp.double(), teacher_topk_indices=ids)
    avg = loss_fn({"labels": labels}, {"logits": s}, **teacher)["loss"]
    (grad,) = torch.autograd.grad(avg, s)
    return avg.detach(), gkd_per_token_ref(loss_fn, labels, s, **teacher), grad


def run_op(student, ids, lp, labels, beta, temperature):
    s = student.detach().clone().requires_grad_()
    per = twinkle_mem.gkd_topk_from_logits(s, ids, lp, labels, beta=beta, temperature=temperature)
    avg = twinkle_mem.gkd_average(per, labels)
    (grad,) = torch.autograd.grad(avg, s)
    return avg.detach(), per.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_against_twinkle_float64(kind, k, dtype):
    for beta in BETAS:
        for temperature in (0.05, 0.7, 1.0, 1e4):
            student, teacher, labels = gkd_logits_case(kind, 24, 300, dtype, beta, seed=KINDS.index(kind) * 10 + k)
            ids, lp = gkd_topk_teacher(teacher, k)
            avg_ref, per_ref, grad_ref = reference(student, ids, lp, labels, beta, temperature)
            avg, per, grad = run_op(student, ids, lp, labels, beta, temperature)
            what = f"beta {beta}, T {temperature}"
            assert per.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            assert_gkd_loss_close(per, per_ref, dtype, f"per-token loss, {what}")
            assert_gkd_loss_close(avg.view(1), avg_ref.view(1), dtype, f"average, {what}")
            assert grad.dtype == dtype and torch.isfinite(grad).all()
            kept = int((labels != -100).sum())
            # float64 math on the scaled logits (x - max) / T, of size up to `scale`: an absolute error of a few
            # 2^-53 scale in ls and lt (the reference's and the op's), which dL/dx carries divided by T kept
            scale = 1 + 2 * student.double().abs().amax(-1, keepdim=True).clamp(max=1e6) / temperature
            allowed = 2 * ulp(grad_ref, dtype) + 16 * 2.0**-53 * scale / (temperature * kept)
            if dtype == torch.float64:
                allowed = allowed + 1e-12 * grad_ref.abs().amax(-1, keepdim=True)
            ratio = ((grad.double() - grad_ref).abs() / allowed).max().item()
            assert ratio <= 1.0, f"grad, {what}: error {ratio:.3g} x the bound"


def test_repeated_ids_are_rounded_once():
    # A row whose k ids are one id: its gradient there is the sum of k entries, summed in float64 and rounded once.
    student, teacher, labels = gkd_logits_case("random", 24, 300, torch.bfloat16, 0.5, seed=4)
    labels[:] = 1
    ids, lp = gkd_topk_teacher(teacher, 8, pad_rows=0)
    ids[:, :, 1:] = ids[:, :, :1]
    lp = torch.randn(lp.shape, generator=torch.Generator().manual_seed(5)).log_softmax(-1)
    _avg_ref, _per_ref, grad_ref = reference(student, ids, lp, labels, 0.5, 0.7)
    _avg, _per, grad = run_op(student, ids, lp, labels, 0.5, 0.7)
    at = (torch.arange(2).view(2, 1), torch.arange(12).view(1, 12), ids[:, :, 0])
    # The k entries' gradients cancel (their sum is exactly 0); rounded each to fp32 first, their sum is ~1e-10
    from twinkle_mem.distill.divergence import gkd_rows
    _loss, d = gkd_rows(student.double().gather(-1, ids), lp, 0.5, 0.7)
    scale = d.abs().amax() / int((labels != -100).sum())  # an entry's gradient
    assert scale > 1e-4 and grad[at].double().abs().max() <= 1e-12 * scale and grad_ref[at].abs().max() <= 1e-12 * scale


@pytest.mark.parametrize("beta", BETAS)
def test_the_same_loss_as_linear_gkd_topk(beta):
    hidden, weight, bias, labels = make_head(24, 32, 300, torch.float32, seed=7, lead=(2, 12))
    labels[:, ::5] = -100
    logits = torch.addmm(bias, hidden.reshape(24, 32), weight.t()).view(2, 12, 300)  # exact: dyadic operands
    assert torch.equal(logits.double(), hidden.double() @ weight.double().t() + bias.double())
    teacher = torch.randn(2, 12, 300, generator=torch.Generator().manual_seed(8)) * 3
    ids, lp = gkd_topk_teacher(teacher, 8)
    got = twinkle_mem.gkd_topk_from_logits(logits, ids, lp, labels, beta=beta, temperature=0.7)
    want = twinkle_mem.linear_gkd_topk(hidden, weight, ids, lp, labels, bias=bias, beta=beta, temperature=0.7)
    assert torch.equal(got, want)


def test_saves_no_logits():
    student, teacher, labels = gkd_logits_case("random", 24, 300, torch.float32, 0.5, seed=6)
    ids, lp = gkd_topk_teacher(teacher, 8)
    s = student.clone().requires_grad_()
    with saved_for_backward() as saved:
        per = twinkle_mem.gkd_topk_from_logits(s, ids, lp, labels)
    assert saved
    for t in saved:
        assert t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() and t.numel() <= 24 * 8
    (g,) = torch.autograd.grad(per.sum(), s)
    assert not g[labels == -100].any() and g[labels != -100].any()
    assert (per[labels == -100] == 0).all()


def test_rows_bitwise_the_same_whatever_the_batch():
    gen = torch.Generator().manual_seed(9)
    n, v = 40, 500
    student = (torch.randn(n, v, generator=gen) * torch.logspace(0, 3, n).unsqueeze(1)).to(torch.bfloat16)
    ids, lp = gkd_topk_teacher(torch.randn(1, n, v, generator=gen), 16)
    ids, lp = ids[0], lp[0]
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = -100
    g_out = torch.randn(n, generator=gen)

    def run(rows):
        s = student[rows].clone().requires_grad_()
        per = twinkle_mem.gkd_topk_from_logits(s, ids[rows], lp[rows], labels[rows], temperature=0.7)
        (g,) = torch.autograd.grad((per * g_out[rows]).sum(), s)
        return per.detach(), g

    full = run(torch.arange(n))
    for rows in (torch.arange(n).flip(0), torch.arange(5, 23), torch.tensor([7])):
        got = run(rows)
        assert torch.equal(got[0], full[0][rows]) and torch.equal(got[1], full[1][rows])


def test_bad_input():
    student = torch.randn(2, 5, 50)
    ids, lp, labels = torch.randint(0, 50, (2, 5, 4)), torch.randn(2, 5, 4), torch.randint(0, 50, (2, 5))
    with pytest.raises(ValueError, match="teacher_ids must be"):
        twinkle_mem.gkd_topk_from_logits(student, ids[:, :4], lp, labels)
    with pytest.raises(ValueError, match="teacher_logprobs shape"):
        twinkle_mem.gkd_topk_from_logits(student, ids, lp[..., :3], labels)
    with pytest.raises(ValueError, match="beta"):
        twinkle_mem.gkd_topk_from_logits(student, ids, lp, labels, beta=1.5)
    ids[1, 2, 3] = 50
    with pytest.raises(RuntimeError, match="teacher id out of range: 50"):
        twinkle_mem.gkd_topk_from_logits(student, ids, lp, labels)


def test_opcheck():
    from twinkle_mem.distill import topk_teacher
    student, teacher, labels = gkd_logits_case("random", 10, 200, torch.float32, 0.5, seed=13)
    ids, lp = gkd_topk_teacher(teacher, 4)
    s, i2, l2, y2 = student.reshape(10, 200).requires_grad_(), ids.reshape(10, 4), lp.reshape(10, 4), labels.reshape(10)
    torch.library.opcheck(topk_teacher.gkd_topk_logits_fwd, (s, i2, l2, y2, 0.5, 0.7, -100, 0, 200, ""))
    torch.library.opcheck(topk_teacher.gkd_topk_logits_fwd, (s, i2, l2, None, 0.0, 1.0, -100, 0, 200, ""))
    coef = torch.randn(10, 4, dtype=torch.float64)
    torch.library.opcheck(topk_teacher.gkd_topk_logits_bwd,
                          (torch.randn(10), coef, i2, y2, -100, 0, 200, torch.bfloat16))
