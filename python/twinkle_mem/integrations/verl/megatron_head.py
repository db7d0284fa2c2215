"""verl's Megatron fused path on twinkle-mem: ``use_fused_kernels=True`` with ``impl_backend=twinkle``.

verl's Megatron engine (and the mindspeed engine, its subclass) enables its fused forward in
``_maybe_enable_fused_kernels``; the fused forwards (``model_forward_fused``: the legacy ``_fused_GPTModel_forward``
and, with megatron-core 0.18, the output-processor hook; ``model_forward_1f1b_overlap``) run the decoder, gather
the hidden states under sequence parallelism, and call ``linear_cross_entropy(hidden [s, b, H], weight [V/tp, H],
labels [b, s], temperature, "none", tp_group)``, verl's Triton kernel (CUDA only).

- :func:`maybe_enable_fused_kernels`: after verl's, an engine whose model config says ``impl_backend=twinkle``
  marks its models' output weights (the output layer's, the shared embedding's where tied) with a
  :class:`MarkedHead`;
- :func:`linear_cross_entropy`: for a marked weight, ``twinkle_mem.linear_selective_log_softmax`` with the TP
  group as ``process_group`` (the vocab shards combined over it, fp32 log-probs and entropy); for any other
  weight, verl's kernel.

The hidden-state gradient: the op returns this rank's partial sum (its vocab shard's part), as verl's kernel
does. Under sequence parallelism verl's gather (reduce-scatter in backward) sums it over the TP ranks. Without
sequence parallelism at TP > 1 nothing in verl's fused forward sums it (Megatron's output layer would, in its
input gradient's all-reduce); here the hidden states go through ``copy_to_tensor_model_parallel_region`` first,
so every rank's model body gets the whole gradient, as on verl's logits path.

Each process logs one line at its first marked call (logger ``twinkle_mem.verl``, INFO), and the head is told
whether the batch trains the entropy (``entropy_grad.py``).
"""
import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import twinkle_mem

from . import verl_names
from .entropy_grad import head_options
from .settings import FUSED_CHUNK_BYTES, IMPL_BACKEND

logger = logging.getLogger("twinkle_mem.verl")

_MARK = "_twinkle_mem_head"  # the attribute a marked output weight carries (Megatron marks parameters likewise)
_logged = False  # this process's first marked call logged its line


@dataclass(frozen=True)
class MarkedHead:
    """What the fused head needs to know of the model that owns a marked output weight."""
    sequence_parallel: bool
    chunk_bytes: Optional[int]

    def log_probs(self, hidden, weight, labels, temperature, group):
        tp_group = group if group is not None and dist.get_world_size(group) > 1 else None
        _log_first_call(tp_group, self.sequence_parallel)
        if tp_group is not None and not self.sequence_parallel:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        rows = hidden.reshape(-1, hidden.shape[-1])  # [s, b, H] -> [s * b, H]: verl's thd layout has b = 1
        return twinkle_mem.linear_selective_log_softmax(rows, weight, labels.reshape(-1), True,
                                                        temperature=float(temperature), chunk_bytes=self.chunk_bytes,
                                                        process_group=tp_group, **head_options())


def _log_first_call(tp_group, sequence_parallel: bool) -> None:
    global _logged
    if not _logged:
        _logged = True
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        logger.info("twinkle-mem: verl's Megatron fused forward computes log-probs and entropy with twinkle-mem's "
                    "fused head (impl_backend=%s, TP %d, sequence parallel %s)", IMPL_BACKEND, tp,
                    "on" if sequence_parallel else "off")


def output_weights(chunk: torch.nn.Module):
    """(the GPTModel's config, its output weight parameters) for each GPTModel in a model chunk: the output
    layer's weight, and the shared embedding weight where the head is tied (verl passes that one then)."""
    for module in chunk.modules():
        layer = module._modules.get("output_layer")
        if layer is None or not hasattr(module, "config"):
            continue
        weights = [layer.weight] if getattr(layer, "weight", None) is not None else []
        embedding = getattr(getattr(module, "embedding", None), "word_embeddings", None)
        if getattr(module, "share_embeddings_and_output_weights", False) and embedding is not None:
            weights.append(embedding.weight)
        yield module.config, weights


def mark_heads(chunks, chunk_bytes: Optional[int]) -> int:
    """Mark the output weights of a Megatron engine's model chunks; returns how many were marked."""
    marked = 0
    for chunk in chunks:
        for config, weights in output_weights(chunk):
            for weight in weights:
                setattr(weight, _MARK, MarkedHead(bool(getattr(config, "sequence_parallel", False)), chunk_bytes))
                marked += 1
    return marked


def maybe_enable_fused_kernels(original, plan):
    """``MegatronEngine._maybe_enable_fused_kernels``: verl's, then the output weights of an engine whose model
    config asks for ``impl_backend=twinkle`` marked (where verl kept its fused kernels on)."""
    chunk_bytes = plan.value(FUSED_CHUNK_BYTES)

    @functools.wraps(original)
    def _maybe_enable_fused_kernels(self):
        original(self)
        if self.engine_config.use_fused_kernels and verl_names.impl_backend(self.model_config) == IMPL_BACKEND:
            mark_heads(self.module, chunk_bytes)

    return _maybe_enable_fused_kernels


def linear_cross_entropy(original, plan):
    """verl's ``linear_cross_entropy``: twinkle-mem's fused head for a marked output weight, verl's kernel otherwise
    (and for a reduction other than "none", which verl's forwards never ask for)."""

    @functools.wraps(original)
    def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        head = getattr(weight, _MARK, None)
        if head is None or reduction != "none":
            return original(hidden, weight, labels, temperature, reduction, dist_process_group)
        return head.log_probs(hidden, weight, labels, temperature, dist_process_group)

    return linear_cross_entropy
