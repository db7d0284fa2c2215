"""TRL's ``selective_log_softmax`` and ``entropy_from_logits`` where ms-swift binds them, on twinkle-mem's op
(``logits_path``): DPO's ``RLHFTrainerMixin.get_per_token_logps`` (with and without sequence parallelism) and GRPO
under sequence parallelism (``_get_logps_via_sp``), where the logits are built. The op returns fp32 whatever the
logits' dtype (TRL's returns the logits' dtype), streams each row once and saves nothing full-vocab for backward
beyond a reference to the logits (TRL's bf16 branch keeps a log-softmax per row)."""
import functools

import twinkle_mem


def selective_log_softmax(original, plan):
    @functools.wraps(original)
    def selective_log_softmax(logits, index):
        return twinkle_mem.selective_log_softmax(logits, index)

    return selective_log_softmax


def entropy_from_logits(original, plan):
    @functools.wraps(original)
    def entropy_from_logits(logits, chunk_size=128):
        return twinkle_mem.entropy_from_logits(logits)

    return entropy_from_logits
