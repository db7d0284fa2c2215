"""The fused LM head's former import path. Its public names now live in
``twinkle_mem.integrations.twinkle.fused_head`` (the deferred output layer and the per-call state) and
``fused_eligibility`` (when the fused head applies); they stay importable from here."""
from twinkle_mem.integrations.twinkle.fused_eligibility import (
    call_ineligible, megatron_output_layers, transformers_lm_head)
from twinkle_mem.integrations.twinkle.fused_head import (
    IGNORE_INDEX, FusedCall, current, deferred, megatron_forward, take, transformers_forward)

__all__ = ["IGNORE_INDEX", "FusedCall", "current", "take", "deferred", "megatron_forward", "transformers_forward",
           "call_ineligible", "megatron_output_layers", "transformers_lm_head"]
