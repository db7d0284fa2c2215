"""Peak memory of linear_selective_log_softmax (forward + backward), measured as peak RSS in a subprocess.

The rise of the resident-set high-water mark over one call (twinkle_mem.measure.peak_rss),
minus the bytes of the outputs and of the gradients of hidden and weight, must be at most
chunk_bytes plus O(N): nothing [N, V], no weight-sized fp32 buffer. The O(N H) working tensors
that heads/logprobs.py and heads/engine.py document (the kept-row copy of hidden when rows are dropped; the fp32
grad_hidden accumulator for bf16/fp16 or dropped rows) are allowed on top, by their size.
Controls: the same measurement sees the [N, V] logits of the unfused path, and of the fused path
given a chunk_bytes that holds all of them.

Run as a script, this file measures one configuration and prints JSON (docs/linear.md's memory table
came from it, at N = 4096 and 16384, H = 1024, V = 151936):
    python tests/heads/test_linear_memory.py '{"n": 4096, "h": 1024, "v": 151936}'
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLACK = 3 << 20  # allocator and interpreter noise in one call (measured: < 1 MiB)
PER_ROW = 256  # O(N): row statistics, labels, kept-row indices, upstream gradients (bytes per row, generous)


def measure(n, h, v, dtype="float32", chunk_bytes=64 << 20, ignore_frac=0.0, path="fused", entropy=True,
            threads=None, vocab_block=None, row_tile=None, frozen=False):
    """Runs in this process: one forward + backward; returns the peak RSS rise and what it may hold.
    vocab_block, row_tile: the CPU plan's vocab blocks / row tiles instead of its own (small sizes). frozen: the
    weight needs no gradient (LoRA's head): grad_hidden alone, from the [N, H] vectors summed in the forward."""
    import torch

    import twinkle_mem
    from twinkle_mem.heads import plans
    from twinkle_mem.measure import peak_rss
    if vocab_block:
        plans.PLANS["cpu"] = plans.PLANS["cpu"]._replace(vocab_block=vocab_block, max_widen=1)
    if row_tile:
        plans.PLANS["cpu"] = plans.PLANS["cpu"]._replace(row_tile=row_tile)
    assert twinkle_mem.backends()["cpu"] == "loaded", f"native CPU kernels not loaded: {twinkle_mem.backends()}"
    if threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dt).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.05).to(dt).requires_grad_(not frozen)
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore_frac:
        labels[torch.rand(n, generator=gen) < ignore_frac] = -100
    kept = int((labels != -100).sum())

    def call(hd, w, y, cb):
        if path == "fused":
            out = twinkle_mem.linear_selective_log_softmax(hd, w, y, entropy, ignore_index=-100, chunk_bytes=cb)
        else:  # the unfused path: logits, then the op
            out = twinkle_mem.selective_log_softmax(hd @ w.t(), y, entropy, ignore_index=-100)
        logp, ent = out if entropy else (out, None)
        loss = logp.sum() + (ent.sum() if entropy else 0)
        grads = torch.autograd.grad(loss, (hd,) if frozen else (hd, w))
        return (logp, ent, *grads)

    # Warm-up: the same call once, so that code pages, thread pools and BLAS state are in place. The
    # child runs with a fixed glibc mmap threshold (run_child), so every freed buffer goes back to the
    # OS and the measured call's peak is its own.
    call(hidden, weight, labels, chunk_bytes)
    with peak_rss() as m:
        results = call(hidden, weight, labels, chunk_bytes)
    held = sum(t.nbytes for t in results if t is not None)  # outputs + grad_hidden + grad_weight
    reduced = dt in (torch.bfloat16, torch.float16)
    acc_size = 8 if dt == torch.float64 else 4
    if kept < n:  # kept rows of hidden, the grad_hidden accumulator of the kept rows (and its cast)
        allowed_nh = kept * h * (dt.itemsize + acc_size + (dt.itemsize if reduced else 0))
    else:  # bf16/fp16: the fp32 accumulator; fp32/fp64: none (grad_hidden itself accumulates)
        allowed_nh = n * h * 4 if reduced else 0
    if frozen:  # the vectors summed in the forward, one per differentiated output, in the accumulation dtype
        allowed_nh += (2 if entropy else 1) * kept * h * acc_size
    return {"n": n, "h": h, "v": v, "dtype": dtype, "path": path, "chunk_bytes": chunk_bytes, "kept": kept,
            "peak_rise": m.bytes, "held": held, "beyond": m.bytes - held, "allowed_nh": allowed_nh,
            "bound": chunk_bytes + allowed_nh + PER_ROW * n + SLACK, "logits_bytes": n * v * dt.itemsize}


def run_child(**cfg):
    # The environment as it is (the installed package, or PYTHONPATH of a source build): a source
    # tree without built libraries would fall back to the composite and measure that instead.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(cfg)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cfg", [
    dict(n=1024, h=128, v=32768, dtype="float32", chunk_bytes=4 << 20, vocab_block=2048, row_tile=128),
    # (the ignored rows and the default tiles: the end-to-end tier)
    pytest.param(dict(n=1024, h=128, v=32768, dtype="float32", chunk_bytes=4 << 20, ignore_frac=0.75,
                      vocab_block=2048, row_tile=128), marks=pytest.mark.e2e),
    # the default tiles and blocks (at H = 128 4 x 8192 columns wide: one 64 MiB tile, the logits 128 MiB)
    pytest.param(dict(n=1024, h=128, v=32768, dtype="float32", chunk_bytes=64 << 20), marks=pytest.mark.e2e),
    # a weight-sized fp32 buffer would be +32 MiB
    dict(n=512, h=256, v=32768, dtype="bfloat16", chunk_bytes=8 << 20, vocab_block=2048, row_tile=128),
    # LoRA's frozen head: the two summed vectors (logp's and the entropy's) on top, nothing [N, V]
    dict(n=1024, h=128, v=32768, dtype="float32", chunk_bytes=4 << 20, vocab_block=2048, row_tile=128, frozen=True),
], ids=["fp32", "fp32 3/4 ignored", "fp32 default tiles", "bf16", "fp32 frozen"])
def test_peak_beyond_outputs_and_gradients_is_chunk_plus_o_n(cfg):
    r = run_child(**cfg)
    assert r["beyond"] <= r["bound"], (
        f"peak RSS rise {r['peak_rise'] / 2**20:.1f} MiB = outputs and gradients {r['held'] / 2**20:.1f} MiB + "
        f"{r['beyond'] / 2**20:.1f} MiB, above chunk_bytes {r['chunk_bytes'] / 2**20:.1f} MiB + O(N) (+ the O(N H) "
        f"working tensors {r['allowed_nh'] / 2**20:.1f} MiB); the logits would be {r['logits_bytes'] / 2**20:.0f} MiB")


def test_the_measurement_sees_the_logits():
    # Controls: the unfused path, and the fused path with one block holding all logits (a vocab block of
    # the whole vocab, a row tile of all rows, a chunk that holds them), exceed the bound.
    cfg = dict(n=1024, h=128, v=32768, dtype="float32", chunk_bytes=4 << 20, vocab_block=2048, row_tile=128)
    unfused = run_child(**cfg, path="unfused")
    assert unfused["beyond"] > unfused["bound"] and unfused["beyond"] >= unfused["logits_bytes"]
    whole = run_child(**dict(cfg, chunk_bytes=256 << 20, vocab_block=32768, row_tile=1024))
    assert whole["beyond"] >= whole["logits_bytes"] - SLACK


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
