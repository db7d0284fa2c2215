"""Logits guard for Megatron's ``forward_backward`` schedules. Framework-agnostic, its public import path
``twinkle_mem.megatron``; twinkle's Megatron path runs under it through ``megatron_steps.py``.

A Megatron loss function returns ``(loss, num_tokens, report)``, and the
scheduler keeps every micro-batch's ``report`` until the whole schedule ends.
A report holding ``logits.detach()`` therefore keeps each micro-batch's
full-vocab logits alive through every later forward and backward (2 micro-batches
of ``[1, 16384, 151936]`` bf16 is 9.3 GiB), even when nobody asked for them.

The guard: report logits only when the caller asked (``return_logits``) or the
loss declares it needs them (``require_logits``); leave ``None`` entries out of
a report; collect entries with ``.get(key) is not None``. Usage::

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(**batch)

        def loss_func(logits):
            loss, logps, n = my_loss(logits, batch)
            return loss, n, micro_batch_report(loss=loss, logps=logps, logits=logits)

        return logits, loss_func

    with logits_guard(return_logits=return_logits, loss=my_loss, forward_only=forward_only):
        reports = get_forward_backward_func()(forward_step_func=forward_step, ...,
                                              forward_only=forward_only)
    logps = collect_reports(reports, ["logps"])["logps"]

In ``forward_only`` mode the guard also turns autograd off: Megatron's scheduler
does not, and each micro-batch's graph (which holds its logits when the loss
saved them, as log-sum-exp does) stays alive through the next micro-batch's forward.
"""
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional

import torch

_REPORT_LOGITS: ContextVar[Optional[bool]] = ContextVar("twinkle_mem_report_logits", default=None)


def logits_wanted(return_logits: bool = False, loss: Any = None) -> bool:
    """Whether micro-batch logits must be reported: the caller asked for them, or
    the loss sets ``require_logits``."""
    return bool(return_logits) or bool(getattr(loss, "require_logits", False))


@contextmanager
def reporting_logits(enabled: bool) -> Iterator[None]:
    """Set, for the enclosed ``forward_backward`` call, whether reports keep logits."""
    token = _REPORT_LOGITS.set(bool(enabled))
    try:
        yield
    finally:
        _REPORT_LOGITS.reset(token)


@contextmanager
def logits_guard(*, return_logits: bool = False, loss: Any = None, forward_only: bool = False) -> Iterator[None]:
    """Guard one ``forward_backward`` call: reports keep logits only if
    :func:`logits_wanted`, and a ``forward_only`` call builds no autograd graph."""
    with ExitStack() as stack:
        stack.enter_context(reporting_logits(logits_wanted(return_logits, loss)))
        if forward_only:
            stack.enter_context(torch.no_grad())
        yield


def current_logits_reporting() -> Optional[bool]:
    """The enclosing :func:`reporting_logits` setting; ``None`` outside any."""
    return _REPORT_LOGITS.get()


def guard_report(report: Mapping[str, Any], keep_logits: bool) -> Dict[str, Any]:
    """A copy of ``report`` without ``None`` entries, and without ``logits``
    unless ``keep_logits``. For wrapping a reduce step that builds its own report."""
    return {k: v for k, v in report.items() if v is not None and (keep_logits or k != "logits")}


def micro_batch_report(*, logits: Optional[torch.Tensor] = None, keep_logits: Optional[bool] = None,
                       **entries: Any) -> Dict[str, Any]:
    """The report of one micro-batch (the third value a Megatron loss function returns).

    Tensors are detached; ``None`` entries are left out, so a micro-batch whose
    processing failed contributes nothing. ``logits`` are kept only when
    ``keep_logits`` (default: the enclosing :func:`reporting_logits`, off outside one).
    """
    if keep_logits is None:
        keep_logits = bool(_REPORT_LOGITS.get())
    if keep_logits:
        entries["logits"] = logits
    return {k: v.detach() if torch.is_tensor(v) else v for k, v in guard_report(entries, keep_logits).items()}


def collect_reports(reports: Optional[Iterable[Any]], keys: Iterable[str]) -> Dict[str, List[Any]]:
    """Gather the reports' entries by key, skipping reports that lack a key or hold ``None``."""
    keys = list(keys)
    collected: Dict[str, List[Any]] = {k: [] for k in keys}
    for report in reports or ():
        if not isinstance(report, Mapping):
            continue
        for k in keys:
            value = report.get(k)
            if value is not None:
                collected[k].append(value)
    return collected
