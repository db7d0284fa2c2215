"""The fused LM head's former import path: ``twinkle_mem.integrations.twinkle_lm_head`` is the module
``twinkle_mem.integrations.twinkle.fused_head`` itself."""
import sys

from twinkle_mem.integrations.twinkle import fused_head

sys.modules[__name__] = fused_head
