"""Causal-mask skip: decide before collating whether a dense attention mask is needed. Framework-agnostic, its
public import path ``twinkle_mem.processor``; twinkle's ``InputProcessor`` gets it through ``mask_skip.py``.

A padded causal-LM batch for Megatron is commonly given a dense boolean
``[B, 1, S, S]`` mask (256 MiB at B=1, S=16384). Attention kernels that build
their own compressed causal mask (Ascend NPU FlashAttention) never read it, so
the decision to skip it is taken here, from the mask type and the device,
before anything of that size is allocated. Where a dense mask is still needed,
:func:`dense_causal_mask` builds it with a single allocation.

Mask convention (Megatron's): ``True`` means *masked out*. Query ``q`` of
sample ``b`` may attend key ``k`` iff ``k <= q`` and ``k < len_b``.
"""
from typing import Iterable, Optional, Sequence, Union

import torch

from .settings import MASK_SKIP_MODES  # (declared with install()'s mask_skip setting, which imports no torch)


def resolve_mask_type(attention_mask_type: Optional[str] = None, task: Optional[str] = "causal_lm") -> Optional[str]:
    """The mask type to act on: a declared type wins; an undeclared one is
    ``"causal"`` for a causal LM (Megatron model configs never declare one)."""
    if attention_mask_type is not None:
        return attention_mask_type
    return "causal" if task in (None, "causal_lm") else None


def skip_dense_mask(attention_mask_type: Optional[str], device_type: Optional[str], mode: str = "npu") -> bool:
    """Whether a dense mask for this batch must not be built at all."""
    if mode not in MASK_SKIP_MODES:
        raise ValueError(f"mode must be one of {MASK_SKIP_MODES}, got {mode!r}")
    if attention_mask_type != "causal" or mode == "never":
        return False
    return mode == "always" or device_type == "npu"


def dense_causal_mask(seq_lens: Iterable[int],
                      *,
                      max_len: Optional[int] = None,
                      device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` causal + right-padding mask, ``True`` = masked.

    The output is the only allocation of its size: each sample's triangle is
    written by a broadcast comparison straight into the output, and the padded
    keys by an in-place fill, so no ``ones``/``tril``/``~`` temporaries exist.
    """
    seq_lens = [int(n) for n in seq_lens]
    if not seq_lens:
        raise ValueError("seq_lens must hold at least one sequence length")
    if min(seq_lens) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens}")
    longest = max(seq_lens)
    size = longest if max_len is None else int(max_len)
    if size < longest:
        raise ValueError(f"max_len={size} is shorter than the longest sequence ({longest})")

    mask = torch.empty((len(seq_lens), 1, size, size), dtype=torch.bool, device=device)
    pos = torch.arange(size, device=mask.device)  # O(S), negligible next to S x S
    for b, n in enumerate(seq_lens):
        torch.gt(pos.unsqueeze(0), pos.unsqueeze(1), out=mask[b, 0])  # key after query
        mask[b, 0, :, n:] = True  # keys in the padding
    return mask


def batch_attention_mask(seq_lens: Sequence[int],
                         *,
                         attention_mask_type: Optional[str] = None,
                         task: Optional[str] = "causal_lm",
                         device: Union[str, torch.device, None] = None,
                         device_type: Optional[str] = None,
                         mode: str = "npu",
                         max_len: Optional[int] = None) -> Optional[torch.Tensor]:
    """The dense mask a collate function should attach, or ``None`` when it is skipped.

    ``device_type`` is the backend the attention runs on (default: the type of
    ``device``). Only causal masks are handled here; for other types the caller
    builds its own mask, and ``ValueError`` says so rather than guessing.
    """
    mask_type = resolve_mask_type(attention_mask_type, task)
    if device_type is None:
        device_type = torch.device(device).type if device is not None else "cpu"
    if skip_dense_mask(mask_type, device_type, mode):
        return None
    if mask_type != "causal":
        raise ValueError(f"batch_attention_mask builds causal masks only, got attention_mask_type={mask_type!r}")
    return dense_causal_mask(seq_lens, max_len=max_len, device=device)
