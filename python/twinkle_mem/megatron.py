"""``twinkle_mem.megatron``, the logits guard's public import path (docs/twinkle_integration.md): the code is the
Megatron fix, ``integrations/twinkle/logits_guard.py``, beside twinkle's Megatron ``forward_backward`` that runs
under it (``megatron_steps.py``). It stays framework-agnostic: any Megatron schedule can use it."""
from .integrations.twinkle.logits_guard import (collect_reports, current_logits_reporting, guard_report,
                                                logits_guard, logits_wanted, micro_batch_report, reporting_logits)

__all__ = ["logits_wanted", "reporting_logits", "logits_guard", "current_logits_reporting", "guard_report",
           "micro_batch_report", "collect_reports"]
