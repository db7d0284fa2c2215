"""How each device kind cuts a fused head's work, and the chunk budget (docs/linear.md, "Plans").

A device kind's plan (``DevicePlan``, one per kind in ``PLANS``, chosen by measurement on that device) sets the row
tiles, the steps of tiles one sweep step takes, the vocab blocks' widths and the default budget; ``plan_blocks`` turns
it, V, H, the dtype and a call's ``chunk_bytes`` into the ``BlockPlan`` the engine's sweeps run (heads/engine.py):
the widest blocks whose step fits every pass a call of these inputs may run, so that a call's blocks never depend
on whether autograd is on, and how many tiles one step of this pass holds.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .matmul import product_sums, reduced


# ------------------------------------------------------------------ the plans: how each device kind cuts the work
class DevicePlan(NamedTuple):
    """How a device kind cuts a fused head's work, chosen by measurement on that device (docs/linear.md, "Plans").
    Every matmul shape and order of summation comes from these numbers, V and H, never from N: a row's results
    depend on its hidden state and the weight alone."""
    row_tile: int  # rows per matmul: a call's rows are tiles of this many
    row_quantum: int  # the last tile holds the rest of the rows rounded up to this (zero rows), not a whole tile
    vocab_block: int  # the narrowest vocab block, and the step by which blocks widen and narrow
    max_widen: int  # blocks widen by whole vocab_blocks up to this many ...
    widen_bytes: int  # ... while cols x H <= widen_bytes (a block's weight rows hold no more than that)
    step_rows: int  # 0: a step holds as many row tiles as chunk_bytes does, one matmul per tile; else this many
    #               rows, fixed, one batched matmul over their tiles (few launches; the sums over rows see one K)
    chunk_bytes: int  # the budget of a call that gives none


PLANS = {
    # The CPU: tiles of 512 rows and blocks of 8192 columns ran as fast as whole matmuls (EPYC and Xeon, H 1024);
    # below H = 1024 that is too little work per matmul for the Xeon's BLAS, so blocks widen (docs/cpu.md). A row in
    # a matmul of M >= 16 rows gets the same bits whatever M (probe_matmul_rows.py: MKL and oneDNN, fp32 / bf16 /
    # fp16, 1 and 2 threads; M < 16 differs), and 16 rows are whole vectors of torch's float64 loops: a call pays
    # for its rows rounded up to 16, not 512.
    "cpu": DevicePlan(512, 16, 8192, 4, 8192 * 1024, 0, 256 << 20),
    # A GPU: one batched matmul per step of up to 16384 rows, over tiles of 128 rows of one shape (cuBLAS picks its
    # kernel by shape: a row's bits then follow the tile's shape, not the call's), blocks up to 32768 columns at
    # any H, 2 GiB of them by default (16384 x 32768 bf16 logits and the block's fp32 grad_weight at H 3584): a
    # 16k-token call over V = 151936 is 5 steps of a few launches each, not 32 x 19 matmuls of 512 rows (the
    # launches: bench/count_launches.py; docs/linear.md, "Plans"). Not yet run on a GPU.
    "cuda": DevicePlan(128, 128, 8192, 4, 1 << 62, 16384, 2 << 30),
}
PLANS["npu"] = PLANS["cuda"]  # host launches cost more still on Ascend: the GPU's plan (not run: no NPU here)


def device_plan(device: torch.device) -> DevicePlan:
    """The plan of ``device``'s kind (the CPU's for a kind without one); TWINKLE_MEM_HEAD_PLAN=cpu|cuda|npu
    forces one (tests and launch counts run the GPU's plan on the CPU)."""
    forced = os.environ.get("TWINKLE_MEM_HEAD_PLAN")
    if forced:
        if forced not in PLANS:
            raise ValueError(f"TWINKLE_MEM_HEAD_PLAN={forced!r} names no plan; one of {sorted(PLANS)}")
        return PLANS[forced]
    return PLANS.get(device.type, PLANS["cpu"])


def fold_in_tiles(device: torch.device) -> bool:
    """Whether per-row math runs a row tile per call on ``device``: the CPU's loops give an element vector or scalar
    code by where it sits in the tensor (row_stats.combine_shard_stats_in_tiles); a GPU's kernels do not."""
    return device.type == "cpu"


def block_width(shard: int, hidden_size: int, plan: DevicePlan) -> int:
    """Columns of the widest vocab blocks from the (shard of the) vocab, H and the plan alone; the whole shard
    when smaller."""
    widen = max(1, min(plan.max_widen, plan.widen_bytes // (plan.vocab_block * max(1, hidden_size))))
    return min(plan.vocab_block * widen, shard)


def vocab_blocks(shard: int, width: int):
    """[v0, v1) of each vocab block of ``width`` columns, in order (the last one ragged)."""
    for v0 in range(0, shard, width):
        yield v0, min(v0 + width, shard)


class BlockPlan(NamedTuple):
    """How a head's sweep cuts the work: vocab blocks of ``width`` columns, ``group`` row tiles per step (the
    chunk budget, or the device's fixed step), logits in ``logits_dtype`` (the input dtype, as the model's layer
    would give them; or the accumulation dtype, for math in fp32 / fp64), the device's plan, and how bf16/fp16
    products are summed in fp32 (``sums``: matmul.product_sums)."""
    width: int
    group: int
    logits_dtype: torch.dtype
    device: DevicePlan = PLANS["cpu"]
    sums: str = "copies"


# ------------------------------------------------------------------ the chunk budget
PIECE_ROWS = 1024  # rows of the fp32 scratch through which a bf16 product is added into an fp32 sum (matmul.RoundedSums)


def step_bytes(cols: int, hidden_size: int, dtype: torch.dtype, plan: DevicePlan, sums: str, backward: bool,
               vectors: int = 0) -> tuple[int, int]:
    """(bytes per row tile of a block, fixed bytes per block) of the block working memory, logits in ``dtype``.

    Per tile: its logits [row_tile, cols]. Fixed, with ``rows`` the rows of one product (a row tile; a GPU plan's
    step): in the backward, what bf16/fp16's fp32 sums (matmul.product_sums) hold: ``copies``, the fp32 copies of
    the weight block, of a product's gradient and hidden rows and the fp32 grad_weight / grad_bias of the block;
    ``mixed``, those sums alone; ``rounded``, those sums, the bf16 products and the fp32 piece they are added
    through. A frozen head's forward summing ``vectors`` (heads/frozen.FrozenGrads; ``backward`` then ignored): the
    logits' gradients (where exact, bf16/fp16 with the entropy's vector or fp16: fp32 copies, one per vector, and
    the fp32 weight block; bf16's log-prob vector alone: what its products hold; fp32: a copy for the second
    vector)."""
    rows = plan.step_rows or plan.row_tile
    per_tile = plan.row_tile * cols * dtype.itemsize
    if vectors:
        if not reduced(dtype):
            return per_tile, rows * cols * dtype.itemsize * (vectors - 1)
        if vectors == 2 or dtype == torch.float16 or sums == "copies":
            return per_tile, 4 * cols * (rows * vectors + hidden_size)
        return per_tile, 6 * rows * hidden_size if sums == "rounded" else 0
    if not backward or sums == "straight":
        return per_tile, 0
    fixed = 4 * (cols * hidden_size + cols)  # the block's grad_weight and grad_bias in fp32
    if sums == "copies":
        fixed += 4 * (cols * hidden_size + rows * (cols + hidden_size))
    elif sums == "rounded":
        fixed += 2 * cols * hidden_size + 4 * min(cols, PIECE_ROWS) * hidden_size + 6 * rows * hidden_size
    return per_tile, fixed


def step_tiles(plan: DevicePlan) -> int:
    """The row tiles of one step at the least: one (the CPU's), or a GPU plan's fixed step."""
    return max(1, plan.step_rows // plan.row_tile)


def block_need(cols: int, hidden_size: int, dtype: torch.dtype, plan: DevicePlan, sums: str, vectors: int = 2) -> int:
    """The smallest chunk_bytes that holds one step of a block of ``cols`` columns in the larger of the passes any
    call of these inputs may run: a trainable head's backward, a frozen head's forward summing the most ``vectors``
    the device sums (frozen.vectors_at_most). One number whether autograd is on or not: the blocks of a call never
    depend on it (old and new log-probs)."""
    passes = (step_bytes(cols, hidden_size, dtype, plan, sums, True), step_bytes(cols, hidden_size, dtype, plan, sums,
                                                                             False, vectors))
    return max(per_tile * step_tiles(plan) + fixed for per_tile, fixed in passes)


def fit_width(shard: int, hidden_size: int, dtype: torch.dtype, chunk_bytes: int, plan: DevicePlan, sums: str,
              vectors: int = 2) -> int:
    """The vocab blocks' columns for a call of this budget: block_width(shard, H, plan), narrowed by whole
    vocab_blocks where one step of the wider block would not fit chunk_bytes (block_need); ValueError below one step
    of the narrowest (vocab_block columns, or the shard).

    Every budget that holds the widest block's step gets the same blocks, so the same bits; a smaller one gets
    narrower blocks: the same math, another order of summation (docs/linear.md, Batch invariance)."""
    widest = block_width(shard, hidden_size, plan)
    narrowest = min(plan.vocab_block, shard)
    # the widest block (a multiple of vocab_block, or the whole shard), then each multiple of vocab_block below it
    narrower = range((widest - 1) // plan.vocab_block * plan.vocab_block, narrowest - 1, -plan.vocab_block)
    for width in (widest, *narrower):
        if block_need(width, hidden_size, dtype, plan, sums, vectors) <= chunk_bytes:
            return width
    need = block_need(narrowest, hidden_size, dtype, plan, sums, vectors)
    raise ValueError(f"chunk_bytes = {chunk_bytes} is below one step of a vocab block ({step_tiles(plan) * plan.row_tile}"
                     f" rows x {narrowest} columns, H = {hidden_size}, {dtype}: {need} bytes)")


def tiles_in_flight(cols: int, hidden_size: int, dtype: torch.dtype, chunk_bytes: int, plan: DevicePlan, sums: str,
                    backward: bool, vectors: int = 0) -> int:
    """How many row tiles of a block one step holds: a GPU plan's fixed step; on the CPU as many as chunk_bytes
    holds beside the pass's fixed bytes (>= 1), a block widened past vocab_block that many fewer: its buffer no
    larger than vocab_block-wide blocks' at the same rows.

    With fit_width, this is all that chunk_bytes decides: how many tiles go through one step, never a matmul's
    shape nor an order of summation (but where a budget narrows the blocks: fit_width)."""
    if plan.step_rows:
        return step_tiles(plan)
    per_tile, fixed = step_bytes(cols, hidden_size, dtype, plan, sums, backward, vectors)
    return max(1, (chunk_bytes - fixed) // per_tile // max(1, cols // plan.vocab_block))


def default_chunk_bytes(shard: int, hidden_size: int, dtype: torch.dtype, plan: DevicePlan, sums: str,
                        vectors: int = 2) -> int:
    """The chunk_bytes of a call that gives none: the plan's, or one step of the narrowest vocab block where that
    needs more (bf16/fp16's fp32 sums at a large H)."""
    return max(plan.chunk_bytes, block_need(min(plan.vocab_block, shard), hidden_size, dtype, plan, sums, vectors))


def plan_blocks(hidden: Tensor, shard: int, chunk_bytes: Optional[int], backward: bool, vectors: int = 0,
                logits_dtype: Optional[torch.dtype] = None, most: int = 2) -> BlockPlan:
    """How a call of a head cuts its work (the same blocks in its forward and backward, with autograd on or off):
    its device's plan, the vocab blocks' width for the budget (fit_width, with a frozen head summing at most
    ``most`` vectors there: frozen.vectors_at_most; the plan's default budget for None), the row tiles per step of
    this pass, logits in ``logits_dtype`` (default: the input dtype, as the layer gives them)."""
    plan = device_plan(hidden.device)
    h_size, dtype = hidden.shape[-1], hidden.dtype
    logits_dtype = dtype if logits_dtype is None else logits_dtype
    sums = product_sums(dtype, hidden.device, logits_dtype)
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(shard, h_size, dtype, plan, sums, most)
    cols = fit_width(shard, h_size, dtype, chunk_bytes, plan, sums, most)
    return BlockPlan(cols, tiles_in_flight(cols, h_size, dtype, chunk_bytes, plan, sums, backward, vectors),
                     logits_dtype, plan, sums)
