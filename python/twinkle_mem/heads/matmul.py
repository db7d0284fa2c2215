"""The fused heads' matmuls (engine.py): the logits of one row tile of a vocab block, and products summed
into an fp32 accumulator for bf16/fp16 operands."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def logits_into(out: Tensor, hidden_tile: Tensor, w: Tensor, b: Optional[Tensor]) -> None:
    """out [rows, cols] = hidden_tile @ w.T (+ b), w [cols, H] a weight block, all of one dtype."""
    if b is None:
        torch.mm(hidden_tile, w.t(), out=out)
    else:
        torch.addmm(b, hidden_tile, w.t(), out=out)


_mixed_addmm_ok: dict = {}  # device type -> whether torch.addmm(bf16, bf16, out_dtype=fp32) runs there


def mixed_addmm(device: torch.device) -> bool:
    """Whether bf16/fp16 products can be summed straight into an fp32 tensor on this device (cuBLAS
    can; asked once with a tiny call). Elsewhere the operands are copied to fp32 (counted in chunk_bytes)."""
    if device.type != "cuda":
        return False  # the CPU path is the measured one: fp32 copies
    if device.type not in _mixed_addmm_ok:
        try:
            a = torch.zeros((2, 2), dtype=torch.bfloat16, device=device)
            acc = a.float()
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)  # the very call add_matmul makes
            _mixed_addmm_ok[device.type] = True
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):
            _mixed_addmm_ok[device.type] = False
    return _mixed_addmm_ok[device.type]


def add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, the products summed in acc's dtype (for bf16/fp16 a and b: only where
    mixed_addmm said so; the caller passes fp32 copies elsewhere)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
