"""When the fused LM head applies: the call (twinkle's arguments, its loss) and the model (its
output layer exactly the plain bias-free linear, nothing transforming the logits after it).
Each check returns why the fused path does not apply, or None."""
import sys
from typing import Any, List, Optional, Tuple

import torch

from . import loss_heads, twinkle_names
from .fused_call import IGNORE_INDEX

# Config attributes that mean the logits are transformed after the output layer.
# (Gemma 2/3/4 soft-capping, Cohere's logit_scale, Granite's logits_scaling, MuseGlimmer's output_multiplier)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier")


def call_ineligible(kwargs, loss) -> Optional[str]:
    """Why a twinkle call cannot take the fused path (its kwargs and loss), or None."""
    if kwargs.get("return_logits", False):
        return "the caller asked for logits (return_logits=True)"
    if kwargs.get("task", "causal_lm") not in (None, "causal_lm"):
        return f"task={kwargs.get('task')!r} is not causal_lm"
    if loss is None:
        return "no loss instance"
    # (a loss that needs logits, served by a head whose loss reads the placeholder in their place: GKD)
    if getattr(loss, "require_logits", False) and not loss_heads.claiming(kwargs, loss).replaces_logits:
        return f"the loss {type(loss).__name__} needs logits (require_logits)"
    if getattr(loss, "require_values", False):
        return f"the loss {type(loss).__name__} needs values (require_values)"
    if not getattr(loss, "require_logps", True):
        return f"the loss {type(loss).__name__} does not use log-probs (require_logps=False)"
    inner = twinkle_names.unwrapped_loss(loss)
    if getattr(inner, "ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
        return f"the loss ignores label {inner.ignore_index}, twinkle's forward step ignores {IGNORE_INDEX}"
    return None


def _logit_transform(*configs) -> Optional[str]:
    for config in configs:
        for cfg in (config, getattr(config, "text_config", None)):
            for name in _LOGIT_TRANSFORMS:
                if cfg is not None and getattr(cfg, name, None) is not None:
                    return f"the model transforms its logits ({name}={getattr(cfg, name)!r})"
    return None


_FORWARD_REPLACED = "the output layer's forward is replaced on the instance"


def _forward_replaced(layer) -> bool:
    """Whether ``layer.forward`` is an instance attribute other than its own class's forward:
    the deferred forward would skip whatever it does (a scaling, a soft-capping, twinkle's
    embedding identity). The class's forward bound to the layer, which twinkle's
    ``MegatronEmbeddingPatch.unpatch`` leaves on the instance, is not a replacement."""
    forward = vars(layer).get("forward")
    if forward is None:
        return False
    return not (getattr(forward, "__self__", None) is layer
                and getattr(forward, "__func__", None) is getattr(type(layer), "forward", None))


def megatron_output_layers(model_chunks) -> Tuple[List[Any], Optional[str]]:
    """The output layers of a MegatronModel's chunks (none on other pipeline stages), or a reason
    why the fused path cannot apply."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    known_postprocess = {GPTModel._postprocess}
    known_output_layer = set()
    labels_free_mtp = set()  # post-processings that run no MTP head when the model is called without labels
    bridge = sys.modules.get("mcore_bridge.model.gpt_model")  # twinkle builds real models with mcore_bridge
    if bridge is not None and hasattr(bridge, "GPTModel"):
        known_postprocess.add(bridge.GPTModel._postprocess)
        known_output_layer.add(getattr(bridge.GPTModel, "_forward_output_layer", None))
        labels_free_mtp.add(bridge.GPTModel._postprocess)
    layers = []
    for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
        owner = twinkle_names.post_process_owner(chunk)
        if owner is None:
            continue  # not the last pipeline stage
        layer, config, cls = owner.output_layer, owner.config, type(owner)
        if type(layer) is not ColumnParallelLinear:
            return [], f"the output layer is a {type(layer).__name__}, not a plain ColumnParallelLinear (LoRA?)"
        if _forward_replaced(layer):
            return [], _FORWARD_REPLACED
        if layer.bias is not None:
            return [], "the output layer has a bias"
        if layer.gather_output or layer.explicit_expert_comm:
            return [], "the output layer gathers its output"
        if getattr(config, "mtp_num_layers", None) and cls._postprocess not in labels_free_mtp:
            return [], "multi-token prediction"  # megatron-core's GPTModel runs its MTP head without labels too
        if getattr(config, "defer_embedding_wgrad_compute", False):
            return [], "defer_embedding_wgrad_compute"
        if getattr(config, "task_type", "causal_lm") != "causal_lm":
            return [], f"task_type={config.task_type!r}"
        if getattr(cls, "_postprocess", None) not in known_postprocess or \
                getattr(cls, "_forward_output_layer", None) not in known_output_layer | {None}:
            return [], f"{cls.__name__} post-processes the output layer its own way"
        reason = _logit_transform(config, getattr(config, "hf_config", None), owner)
        if reason:
            return [], reason
        layers.append(layer)
    return layers, None


def megatron_output_weights(model_chunks) -> List[torch.Tensor]:
    """The weights the output layers of a MegatronModel's chunks compute with: their own, or the word
    embeddings' where they share them and the layer holds none (the embedding on the same stage)."""
    weights = []
    for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
        owner = twinkle_names.post_process_owner(chunk)
        if owner is not None:
            weight = owner.output_layer.weight
            weights.append(owner.shared_embedding_or_output_weight() if weight is None else weight)
    return weights


def transformers_lm_head(wrapped_model, unwrapped) -> Tuple[Optional[torch.nn.Module], Optional[str]]:
    """The ``lm_head`` of a TransformersModel's model, or a reason why the fused path cannot apply."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    get = getattr(unwrapped, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None, "the model has no output embeddings (not a causal LM)"
    if type(head) is not torch.nn.Linear:
        return None, f"lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA or another wrapper?)"
    if _forward_replaced(head):
        return None, _FORWARD_REPLACED
    if head.bias is not None:
        return None, "lm_head has a bias"
    if any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in wrapped_model.modules()):
        return None, "FSDP shards the model (lm_head's weight lives only during its own forward)"
    reason = _logit_transform(getattr(unwrapped, "config", None))
    return (None, reason) if reason else (head, None)
