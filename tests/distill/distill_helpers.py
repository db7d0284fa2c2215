"""What the distillation test modules share (tests/distill/test_distill*.py): the gradient bound of the GKD heads,
and the cases, tolerance and top-k teacher of the GKD ops from logits. twinkle's GKDLoss per token, their reference:
twinkle_mem.distill.reference.gkd_per_token_ref."""
from __future__ import annotations

import torch


def gkd_grad_bounds(hidden, weight, ids, sizes, eps):
    """linear_gkd_topk's gradients (tests/distill/test_distill*.py): per element of (grad_hidden [N, H],
    grad_weight [V, H], grad_bias [V]), (m + 4) eps sum of the sizes of its m terms, from the sizes
    [N, k] of the per-entry gradients dL/dx (float64, 0 on ignored rows) and the entries' ids [N, k]:
    each entry's dL/dx rounded once, then summed in fp32 (head_helpers.through_matmul's bound, per entry)."""
    k = ids.shape[1]
    hf = hidden.double().reshape(-1, hidden.shape[-1])
    bh = (k + 4) * eps * torch.einsum("nk,nkh->nh", sizes, weight.double().abs()[ids])
    dense = torch.zeros(hf.shape[0], weight.shape[0], dtype=torch.float64).scatter_add_(1, ids, sizes)
    count = torch.zeros(weight.shape[0], dtype=torch.float64).index_add_(0, ids.flatten(),
                                                                         (sizes > 0).double().flatten())
    return bh, (count + 4).unsqueeze(1) * eps * (dense.t() @ hf.abs()), (count + 4) * eps * dense.sum(0)


GKD_LOSS_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float64: 1e-12}


def gkd_logits_case(kind, n, v, dtype, beta, seed):
    """(student [2, n/2, V] of dtype, teacher (fp32; bf16 for a bf16 student), labels [2, n/2])."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    t = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    if kind == "peaked":  # both peaked on the same token, gaps of about 40
        top = torch.randint(0, v, (n,), generator=gen)
        s[torch.arange(n), top] += 40.0
        t[torch.arange(n), top] += 40.0
    if kind == "close":  # the teacher is the student plus noise of 1e-3
        s = s.to(dtype).double()
        t = s + 1e-3 * torch.randn(n, v, generator=gen, dtype=torch.float64)
    t_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    s, t = s.to(dtype), t.to(t_dtype)
    if kind == "masked":  # a padded vocab: the last third masked in both, at the dtypes' finfo.min
        s[:, -v // 3:] = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min
        t[:, -v // 3:] = torch.finfo(t_dtype).min
    if kind == "teacher_neg_inf":  # a fifth of the teacher's logits -inf (at beta = 1: where the student's are
        cols = torch.rand(n, v, generator=gen) < 0.2  # finfo.min too, else KL(S || T) is +inf)
        cols[:, 0] = False
        t[cols] = float("-inf")
        if beta == 1.0:
            s[cols] = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    lead = (2, n // 2)
    return s.view(*lead, v), t.view(*lead, v), labels.view(lead)


def assert_gkd_loss_close(got, ref, dtype, what):
    tol = GKD_LOSS_TOL[dtype]
    got = got.double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and not torch.isnan(got).any(), f"{what}: {got} vs {ref}"
    fin = torch.isfinite(ref)
    ratio = ((got[fin] - ref[fin]).abs() / (tol + tol * ref[fin].abs())).max().item()
    assert ratio <= 1.0, f"{what}: error {ratio:.3g} x the bound"


def gkd_topk_teacher(teacher, k, pad_rows=2):
    """A vLLM-style top-k teacher from full logits [B, L, V]: the k largest ids and their log-probs (fp32), the
    first ``pad_rows`` rows of each sequence padded as the recipe does, and a repeated id in every other row."""
    t = teacher.double()
    ids = t.topk(k, dim=-1).indices
    lp = t.log_softmax(-1).gather(-1, ids).float()
    ids[:, :pad_rows], lp[:, :pad_rows] = 0, 0.0
    if k > 1:
        ids[:, pad_rows::2, 1] = ids[:, pad_rows::2, 0]
    return ids, lp
