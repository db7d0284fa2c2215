"""What the fused heads' test modules share (tests/heads/test_linear_*.py, tests/distill/test_distill*.py): LM heads
with exact logits (``make_head``), the op's gradient bound and its carry through the matmuls, and a vocab-parallel head
on one rank. Their float64 reference is twinkle_mem.heads.reference; the small blocks and tiles (``blocks``) are in
helpers.py."""
from __future__ import annotations

import torch

from numerics import SUBNORMAL_STEP, ulp


def _dyadic(shape, scale, gen):
    """Values k * scale, |k| <= 8: products and their sums over H <= 64 are exact in fp32."""
    return torch.randint(-8, 9, shape, generator=gen).double() * scale


def make_head(n, h, v, dtype, *, bias=True, ignore_frac=0.0, k=None, seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = _dyadic((n, h), 0.25, gen)
    weight = _dyadic((v, h), 0.125, gen)
    b = _dyadic((v,), 0.5, gen) if bias else None
    labels = torch.randint(0, v, (n,) if k is None else (n, k), generator=gen)
    if ignore_frac:
        drop = torch.rand(n, generator=gen) < ignore_frac
        labels[drop] = -100
        if k is not None:
            labels[~drop, 0] = torch.where(torch.rand(int((~drop).sum()), generator=gen) < 0.3, -100,
                                           labels[~drop, 0])
    cast = (lambda t: None if t is None else t.to(dtype))  # noqa: E731
    hidden, weight, b = cast(hidden), cast(weight), cast(b)
    if lead is not None:
        hidden, labels = hidden.view(*lead, h), labels.view(*lead, *labels.shape[1:])
    return hidden, weight, b, labels


def op_bound(d, dtype):
    """The op's per-element bound on the logits' gradient d [N, V] (tests/numerics.py): 2 ulp of the
    dtype + 2^-22 of the row's largest gradient + the dtype's subnormal step."""
    return 2 * ulp(d, dtype) + 2.0**-22 * d.abs().amax(-1, keepdim=True) + SUBNORMAL_STEP[dtype]


def through_matmul(bound, d, operand_abs):
    """|error| allowed in d @ operand: the per-element bound carried through the sum, plus fp32
    accumulation over the summed dim."""
    return bound @ operand_abs + d.shape[-1] * 2.0**-24 * (d.abs() @ operand_abs)


def vocab_shard(t, rank, world):
    """This rank's rows of a [V, ...] tensor under Megatron's vocab split (``None`` stays ``None``)."""
    if t is None:
        return None
    s = t.shape[0] // world
    return t[rank * s:(rank + 1) * s]


def tp_head_leaves(hidden, weight, bias, rank, world, through_megatron, frozen=False):
    """Leaves for one rank's vocab-parallel head: (hidden, weight shard, bias shard or None, the op's input).
    ``through_megatron``: the op's input goes through Megatron's copy_to_tensor_model_parallel_region
    (identity; its backward all-reduces grad_hidden over the TP group), as a ColumnParallelLinear's does.
    ``frozen``: the shards need no gradient (LoRA's head)."""
    hp = hidden.clone().requires_grad_()
    w = vocab_shard(weight, rank, world).clone().requires_grad_(not frozen)
    bb = vocab_shard(bias, rank, world).clone().requires_grad_(not frozen) if bias is not None else None
    x = hp
    if through_megatron:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        x = copy_to_tensor_model_parallel_region(hp)
    return hp, w, bb, x
