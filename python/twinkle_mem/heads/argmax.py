"""The argmax over the vocab of an LM head's logits, one vocab block at a time: twinkle's ``Accuracy`` on the fused
path, where the logits never exist.

``linear_argmax(hidden, weight, rows)`` is ``torch.argmax((hidden @ weight.T) / temperature, -1)`` at the rows asked
for: each block of logits is computed as the layer computes its logits (``F.linear`` in the inputs' dtype, divided
by the temperature in that dtype as twinkle's forward divides them), the first maximal column kept, the blocks
folded in vocab order keeping the earlier block on equal values. So the index is the first among equal maxima,
as ``torch.argmax``'s. Memory: one step of the device plan's row tiles by plans.block_width columns of logits and O(rows) results. A head on
the engine (engine.py): its row tiles, vocab blocks and forward sweep; its per-block math is a max and a fold.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..op.vocab_parallel import VocabShard
from .engine import RowTiles, acc_dtype, forward_sweep, pad_rows
from .plans import BlockPlan, block_width, device_plan, step_tiles


def _fold(best: Tensor, index: Tensor, value: Tensor, column: Tensor) -> None:
    """Keep (value, column) where value is larger than best (or NaN where best is not: torch.argmax's NaN is largest),
    or where nothing is kept yet (index -1: a row of -inf logits has torch.argmax 0); equal values keep the earlier
    (best, index)."""
    better = (value > best) | (value.isnan() & ~best.isnan()) | (index < 0)
    best.copy_(torch.where(better, value, best))
    index.copy_(torch.where(better, column, index))


@torch.no_grad()
def linear_argmax(hidden: Tensor, weight: Tensor, rows: Optional[Tensor] = None, *, temperature: float = 1.0,
                  process_group=None) -> Tensor:
    """For each row of ``hidden`` [..., H]: the column of the largest of ``(hidden @ weight.T) / temperature``, the
    first among equal ones; -1 at rows where the bool mask ``rows`` (``hidden``'s leading shape) is False.

    ``weight`` [V, H] is the layer's weight, or this rank's vocab shard under ``process_group`` (rank r holding the
    columns [r V', (r + 1) V') of the logits, Megatron's ``ColumnParallelLinear`` split): each rank takes its shard's
    maxima, then every rank the largest over the ranks, the first global column among equal values."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    kept = None if rows is None else rows.reshape(-1).nonzero().squeeze(1)
    x = flat if kept is None else flat.index_select(0, kept)
    n = x.shape[0]
    dtype = acc_dtype(x.dtype)  # holds every block's maxima exactly (bf16/fp16 in fp32, float64 ones too)
    best = torch.full((n, ), float("-inf"), dtype=dtype, device=x.device)
    index = torch.full((n, ), -1, dtype=torch.long, device=x.device)
    if n:
        plan = device_plan(x.device)
        tiles = RowTiles(x, plan)
        best, index = pad_rows(best, tiles.padded, float("-inf")), pad_rows(index, tiles.padded, -1)

        def step(v0: int, v1: int, rows: slice, logits: Tensor) -> None:
            if temperature != 1.0:
                logits.div_(temperature)
            value, column = logits.max(-1)
            _fold(best[rows], index[rows], value.to(dtype), column + v0)

        forward_sweep(tiles, weight, None, BlockPlan(block_width(weight.shape[0], x.shape[1], plan), step_tiles(plan),
                                                     x.dtype, plan), step)
        best, index = best[:n], index[:n]
    shard = VocabShard.of(process_group, weight.shape[0], "weight")
    if shard.group_name:
        world = dist.get_world_size(process_group)
        values, columns = [torch.empty_like(best) for _ in range(world)], [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(values, best, group=process_group)
        dist.all_gather(columns, index + shard.vocab_start, group=process_group)
        best, index = values[0].clone(), columns[0].clone()
        for value, column in zip(values[1:], columns[1:]):  # in rank order: the vocab's order
            _fold(best, index, value, column)
    if kept is None:
        return index.view(lead)
    out = torch.full((flat.shape[0], ), -1, dtype=torch.long, device=x.device)
    out[kept] = index
    return out.view(lead)
