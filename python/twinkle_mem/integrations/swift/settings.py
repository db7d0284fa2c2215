"""install()'s settings for ms-swift, each declared once (``core/settings.py``): install()'s signature,
``TWINKLE_MEM_SWIFT``'s grammar and its accepted values, and the checks all come from here."""
from ..core.settings import BOOLEAN, FUSED_CHUNK_BYTES, Setting, Settings

FUSED_LM_HEAD = Setting("fused_lm_head", True, BOOLEAN,
                        "GRPO's log-probs and entropy (Megatron-SWIFT's too), and GKD's loss, from the LM head's "
                        "input (twinkle-mem's fused heads): the [tokens, V] logits never built")
LOGITS_PATH = Setting("logits_path", True, BOOLEAN,
                      "TRL's selective_log_softmax and entropy_from_logits where ms-swift binds them (DPO, GRPO under "
                      "sequence parallelism) on twinkle-mem's op")

SETTINGS = Settings(FUSED_LM_HEAD, LOGITS_PATH, FUSED_CHUNK_BYTES)
