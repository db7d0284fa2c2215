"""gkd_from_logits against twinkle-kit's own GKDLoss (teacher_logits=, with and without topk=) in float64.

The reference is twinkle's GKDLoss on the same logits in float64 and its autograd. Inputs: random
logits, peaked rows, a teacher close to the student, finfo.min masks in both (a padded vocab), -inf
teacher logits, ignored rows; beta 0, 0.3, 0.5, 1; T 0.7, 1; the whole vocab and topk 1, 8, 64; fp32,
bf16 and fp64 student logits (the teacher fp32, bf16 with a bf16 student).

Bounds: the per-token loss and the average within 1e-6 absolute + 1e-6 relative (1e-12 for fp64), as
tests/distill/test_distill.py. The student's gradient is dL/dx computed in float64 and rounded once: within 2 ulp
of its dtype (the rounding, and the upstream gradient 1 / kept, which gkd_average computes in fp32) + what
the float64 math (the reference's and this function's) leaves on a difference of
probabilities: 16 2^-53 / (T kept) (d(average)/d(token) = 1 / kept), for a peaked row's p - q ~ 1e-13.
Where twinkle's code gives NaN from 0 x inf (a -inf teacher logit), the reference is twinkle's code with
that logit at -1e300, the limit 0 log 0 = 0 this function computes.
"""
import json
import math
import sys

import pytest
import torch

import twinkle_mem
from distill_helpers import assert_gkd_loss_close, gkd_logits_case
from helpers import json_child, saved_for_backward
from numerics import ulp
from twinkle_mem.distill import local_teacher
from twinkle_mem.distill.reference import gkd_per_token_ref

GKDLoss = pytest.importorskip("twinkle.loss.gkd").GKDLoss

BETAS = [0.0, 0.3, 0.5, 1.0]
KINDS = ["random", "peaked", "close", "masked", "teacher_neg_inf"]


def twinkle_reference(student, teacher, labels, beta, temperature, topk):
    t = teacher.double().masked_fill(teacher == float("-inf"), -1e300)
    s = student.detach().double().requires_grad_()
    loss_fn = GKDLoss(beta=beta, temperature=temperature)
    avg = loss_fn({"labels": labels}, {"logits": s}, teacher_logits=t, topk=topk)["loss"]
    (grad,) = torch.autograd.grad(avg, s)
    per_token = gkd_per_token_ref(loss_fn, labels, s, teacher_logits=t, topk=topk)
    return avg.detach(), per_token, grad


def run_op(student, teacher, labels, beta, temperature, topk, chunk_bytes=None):
    s = student.detach().clone().requires_grad_()
    per = twinkle_mem.gkd_from_logits(s, teacher, labels, topk=topk, beta=beta, temperature=temperature,
                                      chunk_bytes=chunk_bytes)
    avg = twinkle_mem.gkd_average(per, labels)
    (grad,) = torch.autograd.grad(avg, s)
    return avg.detach(), per.detach(), grad


def check_case(kind, topk, dtype, beta, temperature, seed, n=24, v=300, chunk_bytes=None):
    student, teacher, labels = gkd_logits_case(kind, n, v, dtype, beta, seed)
    avg_ref, per_ref, grad_ref = twinkle_reference(student, teacher, labels, beta, temperature, topk)
    avg, per, grad = run_op(student, teacher, labels, beta, temperature, topk, chunk_bytes)
    assert per.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_gkd_loss_close(per, per_ref, dtype, "per-token loss")
    assert_gkd_loss_close(avg.view(1), avg_ref.view(1), dtype, "average")
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    kept = int((labels != -100).sum())
    allowed = 2 * ulp(grad_ref, dtype) + 16 * 2.0**-53 / (temperature * kept)
    if dtype == torch.float64:  # the float64 reference's own rounding (test_distill.EPS): 1e-12 of the row's scale
        allowed = allowed + 1e-12 * grad_ref.abs().amax(-1, keepdim=True)
    ratio = ((grad.double() - grad_ref).abs() / allowed).max().item()
    assert ratio <= 1.0, f"grad: error {ratio:.3g} x the bound"
    return avg_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("topk", [None, 1, 8, 64], ids=lambda k: f"topk{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_against_twinkle_float64(kind, topk, dtype):
    for beta in BETAS:
        for temperature in (0.7, 1.0):
            # chunks of 2 rows (several chunks, the last partial), or the default (one chunk)
            check_case(kind, topk, dtype, beta, temperature, seed=KINDS.index(kind) * 10 + (topk or 0),
                       chunk_bytes=2 * local_teacher.TEMPORARIES * 8 * 300 if beta in (0.3, 1.0) else None)


def test_local_topk_teacher_from_hidden_states():
    # twinkle's teacher_logits= with topk=k is its remote top-k mode with the teacher's k largest logits as the
    # log-probs (the renormalization over the k removes the difference): linear_gkd_topk takes them as they are.
    from head_helpers import make_head
    hidden, weight, bias, labels = make_head(24, 32, 300, torch.float32, seed=11, lead=(2, 12))
    teacher = torch.randn(2, 12, 300, generator=torch.Generator().manual_seed(12)) * 3
    labels[:, ::5] = -100
    for beta in BETAS:
        values, ids = teacher.topk(8, dim=-1)
        per = twinkle_mem.linear_gkd_topk(hidden, weight, ids, values, labels, bias=bias, beta=beta, temperature=0.7)
        logits = hidden.double() @ weight.double().t() + bias.double()
        ref = GKDLoss(beta=beta, temperature=0.7)({"labels": labels}, {"logits": logits},
                                                  teacher_logits=teacher.double(), topk=8)["loss"]
        assert_gkd_loss_close(twinkle_mem.gkd_average(per, labels).view(1), ref.view(1), torch.float32, f"beta {beta}")


def test_close_teacher_is_a_small_divergence():
    for beta in BETAS:
        ref = check_case("close", None, torch.bfloat16, beta, 1.0, seed=3)
        assert 0 < ref < 1e-4, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_rows_bitwise_the_same_whatever_the_batch_and_chunk(dtype):
    # (fp64 too: a bf16 or fp32 result is rounded from float64 and hides the float64 math's last bits)
    gen = torch.Generator().manual_seed(5)
    n, v = 40, 500
    student = (torch.randn(n, v, generator=gen) * torch.logspace(0, 3, n).unsqueeze(1)).to(dtype)
    teacher = torch.randn(n, v, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = -100
    g_out = torch.randn(n, generator=gen)
    for topk in (None, 16):
        def run(rows, chunk):
            s = student[rows].clone().requires_grad_()
            per = twinkle_mem.gkd_from_logits(s, teacher[rows], labels[rows], topk=topk, temperature=0.7,
                                              chunk_bytes=chunk)
            (g,) = torch.autograd.grad((per * g_out[rows]).sum(), s)
            return per.detach(), g
        full = run(torch.arange(n), None)
        chunk_3 = 3 * local_teacher.TEMPORARIES * 8 * v  # chunks of 3 rows
        for rows, chunk in ((torch.arange(n).flip(0), 1), (torch.arange(5, 23), chunk_3), (torch.tensor([7]), 1)):
            got = run(rows, chunk)
            assert torch.equal(got[0], full[0][rows]) and torch.equal(got[1], full[1][rows]), (topk, rows)


def test_saves_the_inputs_and_o_nk():
    student, teacher, labels = gkd_logits_case("random", 24, 300, torch.float32, 0.5, 6)
    for topk in (None, 8):
        s = student.clone().requires_grad_()
        with saved_for_backward() as saved:
            twinkle_mem.gkd_from_logits(s, teacher, labels, topk=topk).sum().backward()
        inputs = {t.untyped_storage().data_ptr() for t in (s, teacher, labels)}
        assert saved
        for t in saved:
            assert t.untyped_storage().data_ptr() in inputs or t.numel() <= 24 * 8, f"saved {tuple(t.shape)}"


def test_chunks_bound_the_working_tensors():
    # The profiler's view of every op: no float64 tensor beyond one chunk of rows (the whole vocab's math).
    n, v = 64, 1000
    student, teacher, labels = gkd_logits_case("random", n, v, torch.float32, 0.5, 7)
    chunk = 4 * local_teacher.TEMPORARIES * 8 * v  # 4 rows
    s = student.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        per = twinkle_mem.gkd_from_logits(s, teacher, labels, chunk_bytes=chunk)
        torch.autograd.grad(per.sum(), s)
    shapes = [s for e in prof.events() if e.name in ("aten::_log_softmax", "aten::exp", "aten::logaddexp")
              for s in e.input_shapes if s]
    assert shapes and max(math.prod(s) for s in shapes) <= 4 * v, max(shapes, key=math.prod)


def test_ignored_rows_give_zero_and_no_gradient():
    student, teacher, labels = gkd_logits_case("random", 24, 300, torch.float32, 0.5, 8)
    for topk in (None, 8):
        s = student.clone().requires_grad_()
        per = twinkle_mem.gkd_from_logits(s, teacher, labels, topk=topk)
        (g,) = torch.autograd.grad(per.sum(), s)
        assert (per[labels == -100] == 0).all() and (per[labels != -100] > 0).all()
        assert not g[labels == -100].any() and g[labels != -100].any()


def test_bad_arguments():
    student, teacher, labels = gkd_logits_case("random", 8, 50, torch.float32, 0.5, 9)
    call = twinkle_mem.gkd_from_logits
    with pytest.raises(ValueError, match="teacher_logits must be"):
        call(student, teacher[..., :10], labels)
    with pytest.raises(ValueError, match="must not require grad"):
        call(student, teacher.clone().requires_grad_(), labels)
    with pytest.raises(ValueError, match="labels"):
        call(student, teacher, labels[:, :1])
    with pytest.raises(ValueError, match="topk"):
        call(student, teacher, labels, topk=51)
    with pytest.raises(ValueError, match="beta"):
        call(student, teacher, labels, beta=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        call(student, teacher, labels, temperature=float("inf"))
    with pytest.raises(ValueError, match="chunk_bytes"):
        call(student, teacher, labels, chunk_bytes=0)


def test_opcheck_and_compile():
    student, teacher, labels = gkd_logits_case("random", 10, 40, torch.float32, 0.5, 10)
    s2, t2, y2 = student.reshape(10, 40), teacher.reshape(10, 40), labels.reshape(10)
    s = s2.clone().requires_grad_()
    for topk in (0, 8):
        torch.library.opcheck(local_teacher.gkd_logits_fwd, (s, t2, y2, 0.3, 0.7, -100, topk, 1))
    torch.library.opcheck(local_teacher.gkd_logits_fwd, (s, t2, None, 1.0, 1.0, -100, 0, 1 << 20))

    def model(x):
        return twinkle_mem.gkd_from_logits(x, teacher, labels, topk=8, beta=0.3, temperature=0.9, chunk_bytes=1)

    def fwd_bwd(fn):
        x = student.clone().requires_grad_()
        loss = (fn(x) * 2.0).sum()
        return [loss.detach(), *torch.autograd.grad(loss, x)]
    torch._dynamo.reset()
    for got, want in zip(fwd_bwd(torch.compile(model, fullgraph=True, backend="aot_eager")), fwd_bwd(model)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ peak memory
def measure(n, v, path="op", beta=0.5, chunk_bytes=16 << 20, topk=None):
    """In this process: one forward + backward of the per-token loss; the peak RSS rise beyond the student's
    logits' gradient (the inputs exist before)."""
    from twinkle_mem.measure import peak_rss
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(1, n, v, generator=gen)
    teacher = torch.randn(1, n, v, generator=gen)
    labels = torch.randint(0, v, (1, n), generator=gen)

    def call():
        s = student.clone().requires_grad_()
        if path == "op":
            loss = twinkle_mem.gkd_average(twinkle_mem.gkd_from_logits(s, teacher, labels, topk=topk, beta=beta,
                                                                       chunk_bytes=chunk_bytes), labels)
        else:  # twinkle-kit's GKDLoss as shipped: the control
            loss = GKDLoss(beta=beta)({"labels": labels}, {"logits": s}, teacher_logits=teacher, topk=topk)["loss"]
        return torch.autograd.grad(loss, s)[0]
    call()
    with peak_rss() as m:
        grad = call()
    student_bytes = student.nbytes
    # beyond: the clone of the student (an input here) and its gradient
    return {"n": n, "v": v, "path": path, "peak_rise": m.bytes, "beyond": m.bytes - student_bytes - grad.nbytes,
            "chunk_bytes": chunk_bytes, "logits_bytes": student_bytes}


def run_child(**cfg):
    return json_child(__file__, cfg)


@pytest.mark.e2e  # (fresh processes: the end-to-end tier)
@pytest.mark.parametrize("topk", [None, 64],
                         ids=["whole vocab", "topk 64"])
def test_peak_memory_is_one_chunk(topk):
    r = run_child(n=1024, v=32768, topk=topk)  # the logits: 128 MiB each
    slack = 3 << 20
    o_n = 1024 * 64 * 8 * 4  # O(N k): the top-k ids, values, dL/dx
    assert r["beyond"] <= r["chunk_bytes"] + o_n + slack, r
    if topk is None:  # the control: twinkle's chunk loop keeps each chunk's graph (measured: 11x the logits)
        control = run_child(n=1024, v=32768, path="twinkle")
        assert control["beyond"] >= 2 * control["logits_bytes"] > 4 * (r["chunk_bytes"] + o_n + slack), control
    # (twinkle's top-k mode from full logits keeps only the gather's input, the student's logits, which are an
    # input here: its peak beyond them and their gradient is small too, no control there)


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
