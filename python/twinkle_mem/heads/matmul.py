"""The fused heads' matmuls (engine.py): the logits of one row tile of a vocab block, and products summed
into an fp32 accumulator for bf16/fp16 operands."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..op.contract import acc_dtype


def reduced(dtype: torch.dtype) -> bool:
    """bf16 / fp16: their products are summed in fp32."""
    return dtype in (torch.bfloat16, torch.float16)


def product_into(out: Tensor, hidden_tile: Tensor, w: Tensor, b: Optional[Tensor]) -> None:
    """out [rows, cols] = hidden_tile @ w.T (+ b), w [cols, H], all of one dtype: one product."""
    if b is None:
        torch.mm(hidden_tile, w.t(), out=out)
    else:
        torch.addmm(b, hidden_tile, w.t(), out=out)


def logits_into(out: Tensor, hidden_tile: Tensor, w: Tensor, b: Optional[Tensor], piece: int) -> None:
    """out [rows, cols] = hidden_tile @ w.T (+ b), w [cols, H] a weight block: one product per ``piece`` columns,
    into column slices of out. The BLAS packs a product's weight operand whole: at H = 256, fp32, one of 32768
    columns held 11 MiB more scratch than one of 8192 (measured, docs/cpu.md)."""
    for c0 in range(0, w.shape[0], piece):
        c = slice(c0, c0 + piece)
        product_into(out[:, c], hidden_tile, w[c], None if b is None else b[c])


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


def native_reduced_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this CPU multiplies bf16 natively: twinkle-mem's CPU path is avx512_bf16 (AVX-512 BF16 dot
    products; TWINKLE_MEM_CPU_ISA caps it). torch's bf16 product then runs at about twice its fp32 rate (Zen 4:
    [512, 8192] @ [8192, 1024] 23 ms against 48 ms); without those instructions it is far slower than fp32
    (docs/cpu.md), so elsewhere bf16 operands are copied to fp32."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _cpu_path_multiplies_bf16()


@torch.compiler.assume_constant_result  # (a ctypes call: torch.compile takes its answer at trace time)
def _cpu_path_multiplies_bf16() -> bool:
    from ..op.native import cpu_kernel_path
    try:
        return cpu_kernel_path() == "avx512_bf16"
    except ValueError:  # a cap that names no path: the op raises it; here, no claim
        return False


def matmul_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out = a @ b, the products summed in out's dtype (add_matmul's rule)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        add_matmul(out.zero_(), a, b)


def add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, the products summed in acc's dtype (for bf16/fp16 a and b: only where
    mixed_addmm said so; the caller passes fp32 copies elsewhere)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)


class Operands:
    """The operands of a sweep's fp32 (fp64) sums: the inputs as they are where the device sums bf16/fp16
    products in fp32 (matmul.mixed_addmm) and the other operand has their dtype, else fp32 copies, made one
    weight block and one row tile at a time."""

    def __init__(self, dtype: torch.dtype, device: torch.device, logits_dtype: torch.dtype):
        self.acc = acc_dtype(dtype)
        self.copies = reduced(dtype) and (logits_dtype != dtype or not mixed_addmm(device))

    def __call__(self, t: Tensor) -> Tensor:
        return t.to(self.acc) if self.copies else t
