"""install()'s settings for twinkle-kit, each declared once (``core/settings.py``): install()'s signature, the
settings dict, ``TWINKLE_MEM_INSTALL``'s grammar and its accepted values, and the checks all come from here.
A new option is one more :class:`Setting` below. No torch: the variable is read at ``import twinkle``."""
from ..core.settings import BOOLEAN, FUSED_CHUNK_BYTES, Needs, Setting, Settings, choice, one_of

# npu: skip where the kernel builds its own mask (default); always: skip on every backend (the caller's attention
# must be causal on its own); never: always build the dense mask. (causal_mask.py and twinkle_mem.processor's too)
MASK_SKIP_MODES = ("npu", "always", "never")

LOG_SOFTMAX = Setting("log_softmax", True, BOOLEAN,
                      "twinkle's selective_log_softmax -> twinkle-mem's op; GKDLoss from twinkle-mem's ops")
MASK_SKIP = Setting("mask_skip", "npu", choice(MASK_SKIP_MODES),
                    "where collate skips the dense causal mask: npu (default), always, never", one_of(MASK_SKIP_MODES))
LOGITS_GUARD = Setting("logits_guard", True, BOOLEAN,
                       "Megatron's micro-batch reports keep no logits; failed micro-batches reported; transformers' "
                       "step logits dropped after the loss")
FUSED_LM_HEAD = Setting("fused_lm_head", False, BOOLEAN,
                        "log-probs and entropy from the output layer's input where that is the same computation")

SETTINGS = Settings(
    LOG_SOFTMAX, MASK_SKIP, LOGITS_GUARD, FUSED_LM_HEAD, FUSED_CHUNK_BYTES,
    rules=(Needs(FUSED_LM_HEAD, LOG_SOFTMAX, "fused_lm_head=True needs log_softmax=True: twinkle's "
                 "selective_log_softmax call sites are where the fused results are handed over"),
           Needs(FUSED_CHUNK_BYTES, FUSED_LM_HEAD, "fused_chunk_bytes sets the fused LM head's block memory: it "
                 "needs fused_lm_head=True")),
)
