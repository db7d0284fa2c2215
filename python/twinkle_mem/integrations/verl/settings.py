"""install()'s settings for verl, each declared once (``core/settings.py``): install()'s signature,
``TWINKLE_MEM_VERL``'s grammar and its accepted values, and the checks all come from here. A new option is one
more :class:`Setting` below. The switch of the fused heads is verl's own config, not a setting:
``actor_rollout_ref.model.fused_kernel_options.impl_backend=twinkle`` (:data:`IMPL_BACKEND`)."""
from ..core.settings import BOOLEAN, FUSED_CHUNK_BYTES, Setting, Settings

IMPL_BACKEND = "twinkle"  # the value of verl's fused_kernel_options.impl_backend that selects twinkle-mem

LOGITS_PATH = Setting("logits_path", False, BOOLEAN,
                      "verl's logits path (logprobs_from_logits, entropy_from_logits and its chunked form, the "
                      "Megatron vocab-parallel log-probs and entropy) on twinkle-mem's op")

SETTINGS = Settings(LOGITS_PATH, FUSED_CHUNK_BYTES)
