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
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)  # the very calls add_matmul makes
            torch.baddbmm(acc[None], a[None], a[None], out_dtype=torch.float32, out=acc[None])
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


def product_sums(dtype: torch.dtype, device: torch.device, logits_dtype: Optional[torch.dtype] = None) -> str:
    """How a head sums products of ``dtype`` operands on ``device`` (logits in ``logits_dtype``): "straight" (fp32,
    fp64: in their dtype), "mixed" (bf16/fp16 products summed into fp32 by the device's BLAS: mixed_addmm),
    "rounded" (bf16 on a CPU that multiplies it natively: one bf16 product per row tile and block, summed in fp32:
    RoundedSums), else "copies" (from fp32 copies of a weight block and a product's rows: Operands)."""
    if not reduced(dtype):
        return "straight"
    if logits_dtype is not None and logits_dtype != dtype:
        return "copies"
    if mixed_addmm(device):
        return "mixed"
    return "rounded" if native_reduced_products(dtype, device) else "copies"


def matmul_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out = a @ b (2-D, or 3-D batched), the products summed in out's dtype (add_matmul's rule)."""
    if out.dtype == a.dtype:
        (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out=out)
    else:
        add_matmul(out.zero_(), a, b)


def add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b (2-D, or 3-D batched), the products summed in acc's dtype (for bf16/fp16 a and b: only where
    mixed_addmm said so; the caller passes fp32 copies elsewhere)."""
    if acc.dtype == a.dtype:
        (acc.baddbmm_ if a.dim() == 3 else acc.addmm_)(a, b)
    else:
        (torch.baddbmm if a.dim() == 3 else torch.addmm)(acc, a, b, out_dtype=acc.dtype, out=acc)


def batched_logits_into(out: Tensor, hidden: Tensor, w: Tensor, b: Optional[Tensor]) -> None:
    """out [tiles, rows, cols] = hidden [tiles, rows, H] @ w.T (+ b), w [cols, H] a weight block, all of one dtype:
    one batched product whose every matrix has one shape (the bias, where given, added inside it, as addmm
    does)."""
    wt = w.t().unsqueeze(0).expand(hidden.shape[0], *w.t().shape)
    if b is None:
        torch.bmm(hidden, wt, out=out)
    else:
        torch.baddbmm(b.view(1, 1, -1).expand(out.shape), hidden, wt, out=out)


class RoundedSums:
    """acc (fp32) += a @ b for bf16 a and b on a CPU that multiplies bf16 natively (native_reduced_products): one
    bf16 product (summed in fp32 inside the BLAS, rounded to bf16 once), added into acc in fp32 through a scratch
    of ``piece`` rows (an add of the bf16 product itself would make its fp32 copy anew on every call). The
    rounding stays within the op's bound on a bf16 gradient (2 ulp): each product's error is at most half an ulp
    of the sum of its terms' magnitudes (docs/linear.md)."""

    def __init__(self, like: Tensor, rows: int, piece: int):
        self.product = like.new_empty((rows, like.shape[1]))
        self.piece = like.new_empty((min(rows, piece), like.shape[1]), dtype=torch.float32)

    def add(self, acc: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
        p = torch.mm(a, b, out=self.product[:a.shape[0]])
        if not accumulate:
            acc.copy_(p)
            return
        step = self.piece.shape[0]
        for r0 in range(0, p.shape[0], step):
            part = p[r0:r0 + step]
            acc[r0:r0 + step].add_(self.piece[:part.shape[0]].copy_(part))


class Operands:
    """The operands of a sweep's fp32 (fp64) sums: the inputs as they are where the device sums bf16/fp16
    products in fp32 (matmul.mixed_addmm) and the other operand has their dtype, else fp32 copies, made one
    weight block and one row tile at a time."""

    def __init__(self, dtype: torch.dtype, device: torch.device, logits_dtype: torch.dtype):
        self.acc = acc_dtype(dtype)
        self.copies = reduced(dtype) and (logits_dtype != dtype or not mixed_addmm(device))

    def __call__(self, t: Tensor) -> Tensor:
        return t.to(self.acc) if self.copies else t
