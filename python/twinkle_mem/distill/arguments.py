"""What every GKD function takes: twinkle's GKDLoss's scalars as one value (``GkdOptions``), the checks of
the arguments they share (ValueError naming the argument: labels and options, a top-k teacher, a teacher's
logits), and a teacher's rows read where they lie."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..op.contract import check_float_tensor


class GkdOptions(NamedTuple):
    """twinkle's GKDLoss's scalars, one value for every GKD op (their schemas name them alike):
    ``teacher_temperature`` None is ``temperature`` (twinkle divides both sides by one)."""
    beta: float
    temperature: float
    teacher_temperature: Optional[float] = None
    ignore_index: int = -100

    def teacher_temp(self) -> float:
        """The teacher's temperature."""
        return self.temperature if self.teacher_temperature is None else self.teacher_temperature


def checked_gkd(labels, rows: Tensor, rows_name: str, gkd: GkdOptions) -> GkdOptions:
    """The checks every GKD function shares (ValueError naming the argument): labels None or of the rows'
    leading shape on their device, beta in [0, 1], temperature, ignore_index, teacher_temperature (None or
    finite > 0). Returns ``gkd`` as the ops take it: floats, the teacher's temperature given."""
    lead = tuple(rows.shape[:-1])
    if labels is not None and (not isinstance(labels, Tensor) or labels.dtype not in (torch.int64, torch.int32)
                               or tuple(labels.shape) != lead or labels.device != rows.device):
        raise ValueError(f"labels must be None or an int64/int32 tensor of shape {rows_name}.shape[:-1] = {lead} "
                         f"on {rows.device}, got {getattr(labels, 'dtype', type(labels))} "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    beta, temperature, teacher_temperature, ignore_index = gkd
    if isinstance(beta, Tensor) or not (0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be a Python number in [0, 1], got {beta!r}")
    if isinstance(temperature, Tensor) or not (0 < temperature < math.inf):
        raise ValueError(f"temperature must be a finite Python number > 0, got {temperature!r}")
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if teacher_temperature is not None and (isinstance(teacher_temperature, Tensor)
                                            or not (0 < teacher_temperature < math.inf)):
        raise ValueError(f"teacher_temperature must be None or a finite Python number > 0, got {teacher_temperature!r}")
    return GkdOptions(float(beta), float(temperature), float(gkd.teacher_temp()), int(ignore_index))


def check_topk_teacher(teacher_ids, teacher_logprobs, rows: Tensor, rows_name: str) -> None:
    """A top-k teacher's checks: int ids and float log-probs of one shape [..., k], [...] the rows' leading
    shape, on the rows' device."""
    lead = tuple(rows.shape[:-1])
    if not isinstance(teacher_ids, Tensor) or teacher_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"teacher_ids must be an int64 or int32 tensor, got {getattr(teacher_ids, 'dtype', None)}")
    if teacher_ids.dim() != rows.dim() or tuple(teacher_ids.shape[:-1]) != lead:
        raise ValueError(f"teacher_ids must be [..., k] with [...] = {rows_name}.shape[:-1] = {lead}, got "
                         f"{tuple(teacher_ids.shape)}")
    check_float_tensor("teacher_logprobs", teacher_logprobs)
    if teacher_logprobs.shape != teacher_ids.shape:
        raise ValueError(f"teacher_logprobs shape {tuple(teacher_logprobs.shape)} differs from teacher_ids shape "
                         f"{tuple(teacher_ids.shape)}")
    for name, t in (("teacher_ids", teacher_ids), ("teacher_logprobs", teacher_logprobs)):
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device} but {rows_name} is on {rows.device}")


def check_teacher_logits(teacher_logits: Tensor, shape: tuple, like: Tensor, like_name: str) -> None:
    """The full-vocab teacher's checks (gkd_from_logits, linear_gkd_full): float, ``shape``, no gradient, on
    ``like``'s device."""
    check_float_tensor("teacher_logits", teacher_logits)
    if tuple(teacher_logits.shape) != tuple(shape):
        raise ValueError(f"teacher_logits must be {tuple(shape)} (the student's rows and vocab), got "
                         f"{tuple(teacher_logits.shape)}")
    if teacher_logits.requires_grad:
        raise ValueError("teacher_logits must not require grad: no gradient flows to the teacher (detach it)")
    if teacher_logits.device != like.device:
        raise ValueError(f"teacher_logits is on {teacher_logits.device} but {like_name} is on {like.device}")


def teacher_rows(teacher: Tensor, rows: Tensor) -> Tensor:
    """Rows of a full-vocab teacher [N, V], or of any [..., V] of N rows: a teacher trimmed to the student's
    length (twinkle's ``teacher_logits[:, :L]``) is read where it lies, not copied whole to be flattened."""
    if teacher.dim() == 2:
        return teacher.index_select(0, rows)
    return teacher[torch.unravel_index(rows, teacher.shape[:-1])]


def flat_teacher(teacher: Tensor) -> Tensor:
    """[N, V] where that is a view, else the teacher as it is (for teacher_rows)."""
    return teacher.view(-1, teacher.shape[-1]) if teacher.is_contiguous() else teacher
