"""verl's logits path on twinkle-mem's op (``install(logits_path=True)``, ``TWINKLE_MEM_VERL=logits_path``).

Where verl builds the ``[tokens, V]`` logits (``use_fused_kernels=False``), it computes the entropy and the
log-probs from them with these functions, each replaced by ``twinkle_mem.selective_log_softmax``: fp32 results
whatever the logits' dtype, one streaming pass per row (the entropy's statistics in the same pass as the
log-sum-exp), nothing full-vocab saved for backward beyond a reference to the logits.

- FSDP (and the automodel / torchtitan engines): ``logprobs_from_logits``, ``entropy_from_logits``,
  ``entropy_from_logits_with_chunking`` (the op streams each row: no chunks needed, ``chunk_size`` ignored).
- Megatron (and mindspeed): ``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy`` and its chunked
  form, with Megatron's TP group as ``process_group`` (the logits are this rank's vocab shard).

The in-place backward verl asks of ``logprobs_from_logits`` (where it computes no entropy) writes the gradient
over the logits. It is safe only where nothing else saved them for its backward. verl's top-k distillation does
save them where they are fp32 (its fp32 upcast is then no copy), so the op's in-place backward would fail that
loss's backward (its version check). The op is given the in-place backward for bf16 / fp16 logits only, where
every verl consumer copies or saves none of them; fp32 logits take the out-of-place backward.
"""
import functools

import torch

import twinkle_mem

_INPLACE_DTYPES = (torch.bfloat16, torch.float16)


def logprobs_from_logits(original, plan):
    @functools.wraps(original)
    def logprobs_from_logits(logits, labels, inplace_backward=True):
        inplace = bool(inplace_backward) and logits.dtype in _INPLACE_DTYPES
        return twinkle_mem.selective_log_softmax(logits, labels, inplace_backward=inplace)

    return logprobs_from_logits


def entropy_from_logits(original, plan):
    """``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` alike."""

    @functools.wraps(original)
    def entropy(logits, chunk_size=None):
        return twinkle_mem.entropy_from_logits(logits)

    return entropy


def _tp_group():
    from megatron.core import parallel_state as mpu
    return mpu.get_tensor_model_parallel_group()


def vocab_parallel_log_probs_from_logits(original, plan):
    @functools.wraps(original)
    def vocab_parallel_log_probs_from_logits(logits, labels):
        return twinkle_mem.selective_log_softmax(logits, labels, process_group=_tp_group())

    return vocab_parallel_log_probs_from_logits


def vocab_parallel_entropy(original, plan):
    """``vocab_parallel_entropy`` and ``vocab_parallel_entropy_with_chunking`` alike."""

    @functools.wraps(original)
    def vocab_parallel_entropy(vocab_parallel_logits, chunk_size=None):
        logits = vocab_parallel_logits
        no_labels = torch.zeros((*logits.shape[:-1], 0), dtype=torch.int32, device=logits.device)
        _, entropy = twinkle_mem.selective_log_softmax(logits, no_labels, True, process_group=_tp_group())
        return entropy

    return vocab_parallel_entropy
