"""Failed micro-batches of twinkle's Megatron forward step (``TWINKLE_FAIL_FAST=0`` caught an
error): NaN rows where their log-probs belong, and a :class:`FailedMicroBatchWarning` naming them,
instead of the other micro-batches' log-probs shifting onto the wrong samples."""
import warnings
from collections.abc import Mapping
from typing import List, Optional

from . import twinkle_names


class FailedMicroBatchWarning(UserWarning):
    """Micro-batches failed inside twinkle's Megatron forward step (``TWINKLE_FAIL_FAST=0``
    caught the error). ``micro_batches``: their indices in the call; ``rows``: their rows in
    the returned ``logps``, which hold NaN (or ``None`` where the log-probs could not be
    placed: then ``logps`` is ``None``)."""

    def __init__(self, message: str, micro_batches: List[int], rows: Optional[List[range]]):
        super().__init__(message)
        self.micro_batches = micro_batches
        self.rows = rows


# Every failure, not only the first; appended, so a user's filters (-W error, ignore) still win.
warnings.filterwarnings("always", category=FailedMicroBatchWarning, append=True)


def report_failed_micro_batches(model, kwargs, out, failed: List[int]) -> None:
    """Put NaN rows where the failed micro-batches' log-probs belong (in the returned output and in
    twinkle's train/eval status), and warn, naming them."""
    status = twinkle_names.status(model, kwargs, kwargs.get("forward_only", False))
    logps, rows = align_failed(out.get("logps"), status.inputs, failed)
    out["logps"] = logps
    if isinstance(getattr(status, "outputs", None), Mapping):
        status.outputs["logps"] = logps
    n = len(status.inputs)
    where = ", ".join(f"{i} (rows {r.start}-{r.stop - 1})" for i, r in zip(failed, rows)) if rows else \
        ", ".join(map(str, failed))
    if rows:
        what = ("their rows of `logps` are NaN (`torch.isnan(logps).all(-1)` marks them); every other row stays with "
                "its sample")
    elif len(failed) == n:
        what = "no micro-batch has log-probs: `logps` is None"
    else:
        what = "the log-probs of the other micro-batches could not be placed: `logps` is None"
    warnings.warn(FailedMicroBatchWarning(
        f"twinkle-mem: {len(failed)} of {n} micro-batches failed in twinkle's forward step (TWINKLE_FAIL_FAST=0 "
        f"caught the error, see twinkle's '[nccl_safe]' warning): micro-batch {where}; {what}.", failed, rows),
        stacklevel=3)


def align_failed(logps, inputs, failed: List[int]):
    """(log-probs with a NaN block for each failed micro-batch, the blocks' row ranges), or
    (None, None) where the rows cannot be placed. ``inputs``: twinkle's per-micro-batch inputs
    (unpacked, as returned); a micro-batch's log-probs have its labels' rows."""
    import torch
    shapes = [tuple(inp["labels"].shape) if isinstance(inp, Mapping) and inp.get("labels") is not None else None
              for inp in inputs]
    kept = [i for i in range(len(inputs)) if i not in failed]
    if logps is None or any(shapes[i] is None for i in range(len(inputs))):
        return None, None
    if isinstance(logps, torch.Tensor):  # micro-batches concatenated along the rows
        if logps.dim() < 1 or sum(shapes[i][0] for i in kept) != logps.shape[0]:
            return None, None
        mine = iter(logps.split([shapes[i][0] for i in kept]))
        blocks = [logps.new_full((shapes[i][0], *logps.shape[1:]), float("nan")) if i in failed else next(mine)
                  for i in range(len(inputs))]
        aligned = torch.cat(blocks)
    else:  # variable_seq_lengths: one tensor per micro-batch
        if len(logps) != len(kept):
            return None, None
        mine = iter(logps)
        aligned = [torch.full(shapes[i], float("nan"), dtype=logps[0].dtype, device=logps[0].device)
                   if i in failed else next(mine) for i in range(len(inputs))]
    starts = [sum(shapes[j][0] for j in range(i)) for i in failed]
    return aligned, [range(s, s + shapes[i][0]) for s, i in zip(starts, failed)]
