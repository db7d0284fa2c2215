"""ms-swift's log-probs from the logits, on twinkle-mem's op (``logits_path``).

- TRL's ``selective_log_softmax`` and ``entropy_from_logits`` where ms-swift binds them (GRPO's sequence-parallel
  call with its head deferred takes them from the head's input whatever ``logits_path`` says: ``grpo_head.py``): DPO's
  ``RLHFTrainerMixin.get_per_token_logps`` (with and without sequence parallelism) and GRPO under sequence
  parallelism (``_get_logps_via_sp``). The op returns fp32 whatever the logits' dtype (TRL's returns the logits'
  dtype), streams each row once and saves nothing full-vocab for backward beyond a reference to the logits (TRL's
  bf16 branch keeps a log-softmax per row).
- Megatron-SWIFT's ``compute_logps_and_entropy_from_logits`` (``megatron_logits_path``: GRPO's loss, old and
  reference log-probs; where ``megatron_fused_head`` deferred the output layer, from its input: ``megatron_head.py``):
  the op over Megatron's TP group on the rank's vocab shard, the labels' log-probs and the
  entropy in one pass, where ms-swift builds the shard's whole log-softmax for the entropy and runs Megatron's
  cross entropy for the log-probs. Labels ``-100`` give 0, as ms-swift's mask does; the entropy is every row's.
  The gradient is written over the logits in place (``inplace_backward``), as Megatron's cross entropy consumes
  them in place: ms-swift reads them no more.
"""
import functools

import twinkle_mem

from . import grpo_head, megatron_head, swift_names


def selective_log_softmax(original, plan):
    """Where GRPO's sequence-parallel call deferred its head (``grpo_head.py``), the log-probs from its input; else
    the op with ``logits_path``, TRL's function without."""
    on_op = plan.patches(swift_names.LOGITS_PATH_PART)

    @functools.wraps(original)
    def selective_log_softmax(logits, index):
        call = grpo_head.sequence_parallel_call(logits)
        if call is not None:
            return call.log_probs(index)
        return twinkle_mem.selective_log_softmax(logits, index) if on_op else original(logits, index)

    return selective_log_softmax


def entropy_from_logits(original, plan):
    on_op = plan.patches(swift_names.LOGITS_PATH_PART)

    @functools.wraps(original)
    def entropy_from_logits(logits, chunk_size=128):
        call = grpo_head.sequence_parallel_call(logits)
        if call is not None:
            return call.take_entropy()
        return twinkle_mem.entropy_from_logits(logits) if on_op else original(logits, chunk_size)

    return entropy_from_logits


def megatron_logps_and_entropy(original, plan):
    """Where Megatron-SWIFT's call deferred its output layer (``megatron_head.py``), the log-probs from its input;
    else the op over the TP group with ``logits_path``, ms-swift's function without."""
    on_op = plan.patches(swift_names.MEGATRON_LOGITS_PATH)

    @functools.wraps(original)
    def compute_logps_and_entropy_from_logits(logits, labels, compute_entropy=False, entropy_chunk_size=512):
        call = megatron_head.current_call(logits)
        if call is not None:
            return call.log_probs(labels, compute_entropy)
        if not on_op:
            return original(logits, labels, compute_entropy, entropy_chunk_size)
        from megatron.core import parallel_state
        group = (parallel_state.get_tensor_model_parallel_group()
                 if parallel_state.get_tensor_model_parallel_world_size() > 1 else None)
        kept = labels != -100
        out = twinkle_mem.selective_log_softmax(logits, labels.masked_fill(~kept, 0), compute_entropy,
                                                inplace_backward=True, process_group=group)
        logps, entropy = out if compute_entropy else (out, None)
        return logps * kept, entropy

    return compute_logps_and_entropy_from_logits
