"""Batch invariance of linear_selective_log_softmax, bit for bit (docs/linear.md, "Batch invariance").

- A row's logp, entropy and grad_hidden row are bitwise the same alone (N = 1) and inside batches
  of N = 7, 333 and 4096, at positions around the row tiles, among other rows of any content, with
  other rows dropped as all-ignore_index, at every chunk_bytes from the smallest that holds one step of
  the widest blocks to 1 GiB; bf16, fp16 and fp32, with and without entropy, T = 1 and 0.7, [N] and [N, k]
  labels, with and without bias, a frozen head (differentiated in its forward) and a trainable one; and each
  batch's log-probs and entropy bitwise those of the same call under no_grad (old and new log-probs). The CPU's
  plan (a call's last tile its rows rounded up to 16, so N = 1, 7 and 333 each take another matmul shape) and a
  GPU's, forced on the CPU (TWINKLE_MEM_HEAD_PLAN=cuda: one batched product per step of 128-row tiles). The logic
  is bench/check_linear_invariance.py's (the GPU check runs the same at V = 151936); here H = 32, V = 33577 (the
  CPU's tiles: two vocab blocks of 32768 columns at this H, the second ragged).
- The same through the composite backend (torch.ops.twinkle_mem routed to composite.py).
- grad_weight and grad_bias (and the rows' values) bitwise the same whatever chunk_bytes is (from that smallest;
  below it, down to one tile of an unwidened block, the blocks narrow: the same values but for rounding).
- Every matmul of the head takes the same weight pieces whatever N and chunk_bytes are, and row tiles of 512 rows or
  a call's last rows rounded up to 16 (the blocks come from V and H alone; chunk_bytes changes no shape).
- The fold of the blocks' statistics by row tiles (row_stats.combine_shard_stats_in_tiles) gives
  the same bits as one call over the rows it covers.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import twinkle_mem
from twinkle_mem.op import composite
from twinkle_mem.heads import frozen as frozen_module, matmul
from helpers import blocks
from twinkle_mem.heads import plans
from twinkle_mem.heads.plans import block_need, block_width
from twinkle_mem.heads.matmul import product_sums

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "check_linear_invariance.py")
_spec = importlib.util.spec_from_file_location("check_linear_invariance", SCRIPT)
check_linear_invariance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_linear_invariance)

CPU_PLAN = plans.PLANS["cpu"]
ROW_TILE, VOCAB_BLOCK = CPU_PLAN.row_tile, CPU_PLAN.vocab_block
H = 32
V = block_width(1 << 20, H, CPU_PLAN) + 809  # two blocks, the second ragged
N_LIST = (1, 7, 333, 4096)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# fp32 in the default tier; bf16 and fp16 (the slowest parametrizations) in the end-to-end tier (pyproject.toml)
TIERED = [pytest.param(d, marks=pytest.mark.e2e) if d != torch.float32 else d for d in DTYPES]
CONFIGS = {
    "frozen head, entropy, T=1, [N] labels": dict(entropy=True, temperature=1.0, k=None, bias=False, frozen=True),
    "frozen head, no entropy, T=0.7, [N, 3] labels, bias": dict(entropy=False, temperature=0.7, k=3, bias=True,
                                                                  frozen=True),
    "trainable head, entropy, T=0.7, [N, 3] labels, bias": dict(entropy=True, temperature=0.7, k=3, bias=True,
                                                                  frozen=False),
}


@pytest.mark.parametrize("plan", ["cpu", "cuda"], ids=["CPU plan", "GPU plan"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", TIERED, ids=str)
def test_rows_bitwise_whatever_the_batch(dtype, name, plan):
    with blocks(plan=plan):
        bad = check_linear_invariance.check("cpu", dtype, H, V, N_LIST, seed=DTYPES.index(dtype), log=lambda s: None,
                                            **CONFIGS[name])
    assert not bad, f"{len(bad)} mismatches, e.g.: " + "; ".join(bad[:4])


@pytest.mark.e2e  # (the native path's rows: the default tier, above)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_bitwise_whatever_the_batch_composite(dtype):
    with composite.forced(("cpu",)):
        bad = check_linear_invariance.check("cpu", dtype, H, V, (1, 7, 333, 1024), entropy=True, temperature=0.7,
                                            k=2, bias=True, seed=7, log=lambda s: None)
    assert not bad, f"{len(bad)} mismatches, e.g.: " + "; ".join(bad[:4])


@pytest.mark.parametrize("h", [64, 1024])
def test_matmul_shapes_whatever_n_and_chunk_bytes(monkeypatch, h):
    # The (hidden rows, weight piece) shapes of every logits matmul, forward and backward: [512, H] row tiles and a
    # call's last rows rounded up to 16 (N = 1: [16, H]; N = 1500: [512, H] and [480, H]), against the vocab_block-
    # column pieces of the block_width(V, H) blocks or the ragged rest: the same pieces at N = 1 and 1500, and at the
    # smallest chunk_bytes and 1 GiB the same shapes (a width or a tile chosen from chunk_bytes would change them,
    # and with them a row's bits).
    v = block_width(1 << 20, h, CPU_PLAN) + 100
    seen, product_into = set(), matmul.product_into

    def spy(out, hidden_tile, w, b):
        seen.add((tuple(hidden_tile.shape), tuple(w.shape)))
        product_into(out, hidden_tile, w, b)
    monkeypatch.setattr(matmul, "product_into", spy)
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(v, h, generator=gen) * 0.05).requires_grad_()
    smallest = check_linear_invariance.smallest_chunk(v, h, torch.float32, torch.device("cpu"))
    shapes = []
    for n, chunk in ((1, smallest), (1500, smallest), (1500, 1 << 30)):
        hidden = torch.randn(n, h, generator=gen).requires_grad_()
        logp = twinkle_mem.linear_selective_log_softmax(hidden, weight, torch.randint(0, v, (n,), generator=gen),
                                                        chunk_bytes=chunk)
        logp.sum().backward()
        shapes.append(sorted(seen))
        seen.clear()
    cols = block_width(v, h, CPU_PLAN)
    pieces = {min(VOCAB_BLOCK, v1 - v0 - c0) for v0, v1 in ((0, cols), (cols, v)) for c0 in range(0, v1 - v0, VOCAB_BLOCK)}
    assert shapes[0] == sorted({((16, h), (c, h)) for c in pieces}), shapes[0]
    assert shapes[1] == sorted({((r, h), (c, h)) for c in pieces for r in (ROW_TILE, 480)}), shapes[1]
    assert shapes[2] == shapes[1], shapes


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("dtype", TIERED, ids=str)
def test_chunk_budget_invariance(dtype, frozen, monkeypatch):
    # One batch (a third of the rows dropped, k = 2 labels, bias, T = 0.7) at chunk_bytes from the smallest that
    # holds one step of the widest blocks to 1 GiB: every output and every gradient bitwise the same. Below it, down
    # to one step of an unwidened block, the blocks narrow (the same values to rounding); below that, ValueError.
    from twinkle_mem.heads.frozen import vectors_at_most
    n = 1000
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.25).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype)
    labels = torch.randint(0, V, (n, 2), generator=gen)
    labels[torch.rand(n, generator=gen) < 1 / 3] = -100
    g_logp, g_ent = torch.randn(n, 2, generator=gen), torch.randn(n, generator=gen)
    # A frozen head told the entropy is trained sums its two vectors in the forward (on a CPU that multiplies bf16
    # natively a bf16 one would recompute instead, as the trainable head here does: frozen.recompute_is_cheaper)
    monkeypatch.setattr(frozen_module, "native_reduced_products", lambda d, device: False)
    cpu = torch.device("cpu")
    sums, most = product_sums(dtype, cpu), vectors_at_most(dtype, cpu)
    smallest = block_need(block_width(V, H, CPU_PLAN), H, dtype, CPU_PLAN, sums, most)
    narrowest = block_need(VOCAB_BLOCK, H, dtype, CPU_PLAN, sums, most)
    assert block_width(V, H, CPU_PLAN) == 4 * VOCAB_BLOCK and narrowest < smallest  # (this H widens the blocks)

    def run(chunk):
        h, w, b = (t.clone().requires_grad_(t is hidden or not frozen) for t in (hidden, weight, bias))
        logp, ent = twinkle_mem.linear_selective_log_softmax(h, w, labels, True, bias=b, temperature=0.7,
                                                             ignore_index=-100, chunk_bytes=chunk, entropy_grad=True)
        params = (h,) if frozen else (h, w, b)
        return logp, ent, *torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), params)

    names = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    ref = run(smallest)
    for chunk in (smallest + 1, 2 * smallest + 777, 5 * smallest, 1 << 30):
        for what, a, r in zip(names, run(chunk), ref):
            assert torch.equal(a, r), (f"{what} at chunk_bytes={chunk} differs from chunk_bytes={smallest} by "
                                       f"{(a.double() - r.double()).abs().max().item():.3g}")
    for chunk in (narrowest, smallest - 1):  # narrower blocks: accepted, the same values but for rounding
        for what, a, r in zip(names, run(chunk), ref):
            tol = 2e-5 if dtype == torch.float32 else 2**-6
            assert torch.allclose(a.double(), r.double(), rtol=tol, atol=tol * r.double().abs().max().item()), what
    with pytest.raises(ValueError, match="below one step of a vocab block"):
        run(narrowest - 1)


@pytest.mark.parametrize("entropy_grad", [None, True], ids=["entropy a metric", "entropy declared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_old_and_new_logprobs_bitwise_at_every_budget(dtype, entropy_grad):
    # PPO's old log-probs (compute_log_prob: no_grad) and the training forward's (grad enabled), a frozen head and
    # a trainable one: bitwise the same at every accepted chunk_bytes, those that narrow the blocks included (issue
    # 52: at V = 32003, H = 64, fp32, 40 MiB and 96 MiB, a frozen forward summing vectors counted more working
    # memory, narrowed its blocks alone and differed by 3.8e-6; V = 50000, H = 256 by 7.6e-6).
    for v, h in ((32003, 64), (50000, 256)):
        gen = torch.Generator().manual_seed(v)
        n = 300
        hidden = torch.randn(n, h, generator=gen).to(dtype)
        weight = (torch.randn(v, h, generator=gen) * h**-0.5 * 3).to(dtype)
        labels = torch.randint(0, v, (n,), generator=gen)
        labels[::5] = -100
        sums = product_sums(dtype, torch.device("cpu"))
        from twinkle_mem.heads.frozen import vectors_at_most
        most = vectors_at_most(dtype, torch.device("cpu"))
        narrowest = block_need(VOCAB_BLOCK, h, dtype, CPU_PLAN, sums, most)
        widest = block_need(block_width(v, h, CPU_PLAN), h, dtype, CPU_PLAN, sums, most)
        for chunk in sorted({narrowest, (narrowest + widest) // 2, widest - 1, 40 << 20, 96 << 20, None} - {0},
                            key=lambda c: c or 0):
            if chunk is not None and chunk < narrowest:
                continue
            with torch.no_grad():
                old = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, ignore_index=-100,
                                                               chunk_bytes=chunk, entropy_grad=entropy_grad)
            for frozen in (True, False):
                new = twinkle_mem.linear_selective_log_softmax(
                    hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen), labels, True,
                    ignore_index=-100, chunk_bytes=chunk, entropy_grad=entropy_grad)
                for what, a, b in zip(("logp", "entropy"), old, new):
                    assert torch.equal(a, b.detach()), (f"V={v}, H={h}, chunk_bytes={chunk}, frozen={frozen}: {what} "
                                                        f"differs by {(a - b.detach()).abs().max().item():.3g}")


def test_fold_in_tiles_is_the_per_tile_combine():
    # combine_shard_stats_in_tiles = combine_shard_stats of each tile, concatenated (so a row's merged
    # statistics come from calls of a few shapes, whatever N); the last tile may be shorter.
    from twinkle_mem.op.row_stats import combine_shard_stats, combine_shard_stats_in_tiles
    gen = torch.Generator().manual_seed(5)
    r, n, k = 3, 3 * ROW_TILE + 48, 2
    shift = torch.randn(r, n, generator=gen, dtype=torch.float64) * 10
    log_sum = torch.rand(r, n, generator=gen, dtype=torch.float64) * 5
    logp = -torch.rand(r, n, k, generator=gen, dtype=torch.float64) * 3
    entropy = torch.rand(r, n, generator=gen, dtype=torch.float64) * 4
    owner = torch.randint(0, r, (n, k), generator=gen)
    ignored = torch.rand(n, k, generator=gen) < 0.2
    got = combine_shard_stats_in_tiles(ROW_TILE, shift, log_sum, logp, entropy, owner, ignored, 0.7)
    for t in range(0, n, ROW_TILE):
        s = slice(t, t + ROW_TILE)
        want = combine_shard_stats(shift[:, s], log_sum[:, s], logp[:, s], entropy[:, s], owner[s], ignored[s], 0.7)
        for a, b in zip(got, want):
            assert torch.equal(a[s], b)


def test_gpu_check_script_runs_on_the_cpu():
    # bench/gpu_check.sh runs this script on a GPU at V = 151936; here its own command line, small, on the CPU.
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--h", "16", "--vocab", "8500", "--n", "1", "7",
                          "600", "--dtype", "bf16", "--k", "2", "--bias"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 mismatch(es)" in out.stdout and "N=600, 1/4 of the others dropped" in out.stdout
