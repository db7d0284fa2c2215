"""Memory of every fused head at every dtype (issue 33): linear_selective_log_softmax, linear_gkd_topk and
linear_gkd_full, bf16, fp16 and fp32, forward + backward, measured as the peak RSS rise in a fresh process.

The bound, beyond the inputs, the outputs and the gradients: the head's block working memory (its chunk
budget: ``chunk_bytes`` of logits; the gathered weight rows and the k-wide float64 math of a top-k teacher;
the float64 math of one [FULL_ROWS, FULL_BLOCK] block of a whole-vocab teacher), at most one fp32 weight block
and one fp32 hidden tile, the fp32 accumulators of the gradients (one vocab block of grad_weight and
grad_bias, grad_hidden of the kept rows and its cast), the kept rows' copy of hidden, O(N). A head holding
an fp32 copy of the whole LM head (V H 4 bytes: linear_gkd_full before issue 33, in bf16 and fp16) is far
above it: at these sizes the copy alone is 32 MiB against a bound of about 16 MiB.

Second, a gradient autograd does not ask for is not built: with only hidden (only weight) requiring grad,
no tensor of the weight's (hidden's) size is made, seen by a dispatch mode inside the heads' custom ops.

Run as a script, this file measures one configuration and prints JSON (the report's table came from it):
    python tests/heads/test_head_memory.py '{"head": "gkd_full", "dtype": "bfloat16"}'
"""
import json
import sys

import pytest

import torch
from torch.utils._pytree import tree_leaves

from helpers import OpsInside, json_child

HEADS = ("logprobs", "gkd_topk", "gkd_full")
DTYPES = ("bfloat16", "float16", "float32")
# Small tiles and blocks, so that one of each is small against the LM head: row tiles of 128 rows, vocab blocks
# of 512 columns, which at H = 256 the engine widens to 2048 (the CPU plan's max_widen: the bound counts the widened
# block), 512 for the whole-vocab teacher's float64 math, gathers of 2 MiB.
SIZES = dict(n=512, h=256, v=32768, k=16, row_tile=128, vocab_block=512, full_block=512, gather_bytes=2 << 20,
             chunk_bytes=8 << 20)
SLACK = 3 << 20  # allocator and interpreter noise in one call (measured: < 1 MiB)
PER_ROW = 256  # O(N): labels, kept-row indices, statistics, upstream gradients (bytes per row, generous)
FULL_TEMPORARIES = 16  # float64 [FULL_ROWS, FULL_BLOCK] tensors the whole-vocab teacher's math holds at once
TOPK_TEMPORARIES = 16  # float64 [N, k] tensors of the k-wide math (docs/distillation.md)


def _small_blocks(row_tile, vocab_block, full_block, gather_bytes):
    from twinkle_mem.heads import gkd_full, gkd_topk, plans
    plans.PLANS["cpu"] = plans.PLANS["cpu"]._replace(row_tile=row_tile, vocab_block=vocab_block)
    gkd_full.FULL_ROWS, gkd_full.FULL_BLOCK, gkd_topk.GATHER_BYTES = row_tile, full_block, gather_bytes


def _inputs(head, dtype, n, h, v, k, requires=("hidden", "weight"), ignore_every=4):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_("hidden" in requires)
    weight = (torch.randn(v, h, generator=gen) * 0.05).to(dtype).requires_grad_("weight" in requires)
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = -100  # the prompt: dropped rows
    teacher = {"logprobs": {},
               "gkd_topk": dict(ids=torch.randint(0, v, (n, k), generator=gen),
                                logprobs=torch.randn(n, k, generator=gen).log_softmax(-1)),
               "gkd_full": dict(logits=(torch.randn(n, v, generator=gen) * 2).to(dtype))}[head]
    return hidden, weight, labels, teacher


def _run(head, hidden, weight, labels, teacher, chunk_bytes):
    """One forward + backward of ``head``; its outputs and the gradients autograd asked for."""
    import twinkle_mem
    if head == "logprobs":
        outs = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, ignore_index=-100,
                                                        chunk_bytes=chunk_bytes)
    elif head == "gkd_topk":
        outs = (twinkle_mem.linear_gkd_topk(hidden, weight, teacher["ids"], teacher["logprobs"], labels),)
    else:
        outs = (twinkle_mem.linear_gkd_full(hidden, weight, teacher["logits"], labels),)
    leaves = [t for t in (hidden, weight) if t.requires_grad]
    return (*outs, *torch.autograd.grad(sum(o.sum() for o in outs), leaves))


def measure(head, dtype, n=SIZES["n"], h=SIZES["h"], v=SIZES["v"], k=SIZES["k"], row_tile=SIZES["row_tile"],
            vocab_block=SIZES["vocab_block"], full_block=SIZES["full_block"], gather_bytes=SIZES["gather_bytes"],
            chunk_bytes=SIZES["chunk_bytes"]):
    """Runs in this process: the peak RSS rise of one forward + backward (after a warm-up call), what the call
    holds at its end (outputs and gradients) and the bound on the rest."""
    import twinkle_mem
    from twinkle_mem.measure import peak_rss
    assert twinkle_mem.backends()["cpu"] == "loaded", twinkle_mem.backends()
    _small_blocks(row_tile, vocab_block, full_block, gather_bytes)
    dt = getattr(torch, dtype)
    hidden, weight, labels, teacher = _inputs(head, dt, n, h, v, k)
    _run(head, hidden, weight, labels, teacher, chunk_bytes)  # warm-up
    with peak_rss() as m:
        held = sum(t.nbytes for t in _run(head, hidden, weight, labels, teacher, chunk_bytes))
    item, kept = dt.itemsize, int((labels != -100).sum())
    reduced = dt != torch.float32
    from twinkle_mem.heads.plans import PLANS, block_width
    width = full_block if head == "gkd_full" else block_width(v, h, PLANS["cpu"])
    budget = {"logprobs": chunk_bytes,
              "gkd_topk": 3 * gather_bytes + TOPK_TEMPORARIES * 8 * n * k,
              "gkd_full": FULL_TEMPORARIES * 8 * row_tile * full_block + 4 * row_tile * full_block}[head]
    one_block_and_tile = (4 * width * h if reduced else 0) + 4 * row_tile * h
    gradient_accumulators = 4 * (width * h + width) + kept * h * (4 + item)
    bound = budget + one_block_and_tile + gradient_accumulators + kept * h * item + PER_ROW * n + SLACK
    return {"head": head, "dtype": dtype, "n": n, "h": h, "v": v, "peak_rise": m.bytes, "held": held,
            "beyond": m.bytes - held, "bound": bound, "fp32_weight_bytes": 4 * v * h}


# fp32 in the default tier; bf16 and fp16 (a child process each) in the end-to-end tier (pyproject.toml)
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=pytest.mark.e2e) if d != "float32" else d for d in DTYPES])
@pytest.mark.parametrize("head", HEADS)
def test_peak_beyond_outputs_and_gradients_is_one_block(head, dtype):
    r = json_child(__file__, dict(head=head, dtype=dtype))
    mib = {key: round(r[key] / 2**20, 1) for key in ("peak_rise", "held", "beyond", "bound", "fp32_weight_bytes")}
    assert r["beyond"] <= r["bound"], mib
    assert r["bound"] < r["fp32_weight_bytes"] - SLACK, mib  # the bound sees an fp32 copy of the LM head


class NewTensors(OpsInside):
    """The shapes of the tensors ops allocate while active (outputs that share storage with no input), also
    inside twinkle-mem's Python custom ops ``python_ops`` (run under the mode)."""

    def __init__(self, python_ops):
        super().__init__(python_ops)
        self.shapes = []

    def seen(self, func, args, kwargs, out) -> None:
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.shapes += [tuple(t.shape) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]


@pytest.mark.parametrize("requires", ["hidden", "weight"])
@pytest.mark.parametrize("head", HEADS)
def test_gradients_not_asked_for_are_not_built(head, requires):
    from twinkle_mem.heads import gkd_full, gkd_topk, logprobs, plans
    # n not a multiple of the row tile, no row ignored (no kept-row copy of hidden), V above one vocab block (the
    # default blocks at this H: 32768 columns)
    n, h, k = 300, 32, 8
    v = plans.block_width(1 << 20, h, plans.PLANS["cpu"]) + 3232
    hidden, weight, labels, teacher = _inputs(head, torch.bfloat16, n, h, v, k, requires=(requires,), ignore_every=0)
    other = weight if requires == "hidden" else hidden
    ops = (logprobs.linear_fwd, logprobs.linear_bwd, gkd_topk.gkd_fwd, gkd_topk.gkd_bwd, gkd_full.gkd_full_fwd,
           gkd_full.gkd_full_bwd)
    with NewTensors(ops) as mode:
        _run(head, hidden, weight, labels, teacher, None)
    assert (n, 1) in mode.shapes or (n,) in mode.shapes, "the mode saw no output of the head"
    assert tuple(other.shape) not in mode.shapes, f"{requires} alone requires grad, yet one of the other's size was made"


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
