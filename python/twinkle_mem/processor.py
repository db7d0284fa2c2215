"""``twinkle_mem.processor``, the causal-mask skip's public import path (docs/twinkle_integration.md): the code is
twinkle's processor fix, ``integrations/twinkle/causal_mask.py``, beside the patch of twinkle's ``InputProcessor``
that uses it (``mask_skip.py``). It stays framework-agnostic: any collate function can call it."""
from .integrations.twinkle.causal_mask import (MASK_SKIP_MODES, batch_attention_mask, dense_causal_mask,
                                               resolve_mask_type, skip_dense_mask)

__all__ = ["MASK_SKIP_MODES", "resolve_mask_type", "skip_dense_mask", "dense_causal_mask", "batch_attention_mask"]
