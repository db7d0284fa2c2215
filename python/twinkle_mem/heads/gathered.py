"""The engine's other block shape (heads/engine.py): each row's own k weight rows, for a top-k teacher
(heads/gkd_topk.py): the logits at those ids, and the gradients from dL/dx there."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..op.contract import acc_dtype
from .engine import Needs, Rows, RowTiles, pad_rows
from .plans import block_width, device_plan, vocab_blocks


def _gathered(weight: Tensor, ids: Tensor, tile: int, acc: torch.dtype) -> Tensor:
    """weight[ids] of a row tile padded to ``tile`` rows (id 0 on the padding): [tile, k, H] in acc."""
    ids = pad_rows(ids, tile)
    return weight.index_select(0, ids.reshape(-1)).view(tile, ids.shape[1], -1).to(acc)


def gathered_tiles(tiles: RowTiles, weight: Tensor, bias: Optional[Tensor], ids: Tensor):
    """Per row tile of the tiles' m rows: (r0, r1, its k weight rows [tile, k, H] in the accumulation dtype (the block
    of this shape, gathered), x [r1 - r0, k] = row . weight[ids[row, j]] + bias[ids[row, j]] by one batched
    matmul)."""
    acc = acc_dtype(tiles.rows.dtype)
    for j in range(tiles.count):
        r0, r1 = j * tiles.tile, min((j + 1) * tiles.tile, ids.shape[0])
        w = _gathered(weight, ids[r0:r1], tiles.tile, acc)
        xt = torch.bmm(w, tiles[j].to(acc).unsqueeze(2)).squeeze(2)[: r1 - r0]
        yield r0, r1, w, (xt if bias is None else xt + bias[ids[r0:r1]].to(acc))


def gathered_logits(tiles: RowTiles, weight: Tensor, bias: Optional[Tensor], ids: Tensor) -> Tensor:
    """x [m, k] = row . weight[ids[row, j]] + bias[ids[row, j]] for the tiles' m rows, in the accumulation dtype
    (gathered_tiles)."""
    x = tiles.rows.new_empty(ids.shape, dtype=acc_dtype(tiles.rows.dtype))
    for r0, r1, _w, xt in gathered_tiles(tiles, weight, bias, ids):
        x[r0:r1] = xt
    return x


def gathered_backward(rows: Rows, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, own: Tensor,
                      g: Tensor, needs: Needs, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden [N, H], grad_weight, grad_bias) from g [m, k], the gradient of the loss w.r.t. the kept rows'
    gathered_logits (0 where ``own`` is False: ids another shard holds); an empty [0] for one not needed.
    grad_hidden per row tile (a batched matmul with the tile's gathered weight rows, summed in fp32, rounded
    once); grad_weight[v] += g[n, j] hidden[n] (grad_bias: g[n, j]) over the entries with id v, vocab block
    by vocab block (one fp32 accumulator of a block for bf16/fp16, rounded once), ``budget`` bytes of
    gathered rows at a time."""
    n, h_size = hidden.shape
    acc = acc_dtype(hidden.dtype)
    grad_hidden = hidden.new_zeros((n, h_size)) if needs.hidden else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight) if needs.weight else hidden.new_empty(0)
    grad_bias = torch.zeros_like(bias) if needs.bias else hidden.new_empty(0)
    if rows.m == 0:
        return grad_hidden, grad_weight, grad_bias
    tiles = rows.tiles
    for j in range(tiles.count) if needs.hidden else ():
        r0, r1 = j * tiles.tile, min((j + 1) * tiles.tile, rows.m)
        w = _gathered(weight, ids[r0:r1], tiles.tile, acc)
        part = torch.bmm(pad_rows(g[r0:r1], tiles.tile).unsqueeze(1), w).squeeze(1)[: r1 - r0]
        rows.put(grad_hidden, r0, part.to(hidden.dtype))
    targets = (grad_weight if needs.weight else None, grad_bias if needs.bias else None)
    if targets == (None, None):
        return grad_hidden, grad_weight, grad_bias
    k = ids.shape[1]
    chunk = max(1, budget // (4 * h_size))  # entries per index_add
    for v0, v1 in vocab_blocks(weight.shape[0], block_width(weight.shape[0], h_size, device_plan(weight.device))):
        entries = (own & (ids >= v0) & (ids < v1)).flatten().nonzero().squeeze(1)
        if entries.numel() == 0:
            continue
        blocks = [None if t is None else (t[v0:v1] if t.dtype == acc else t[v0:v1].to(acc)) for t in targets]
        for e0 in range(0, entries.numel(), chunk):  # entries in row-major order
            e = entries[e0:e0 + chunk]
            at = ids.flatten()[e] - v0
            ge = g.flatten()[e]
            if blocks[0] is not None:
                blocks[0].index_add_(0, at, tiles.rows.index_select(0, e // k).to(acc) * ge.unsqueeze(1))
            if blocks[1] is not None:
                blocks[1].index_add_(0, at, ge)
        for t, b in zip(targets, blocks):
            if t is not None and t.dtype != acc:
                t[v0:v1] = b
    return grad_hidden, grad_weight, grad_bias
