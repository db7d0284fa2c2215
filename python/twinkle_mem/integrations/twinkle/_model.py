"""Accessors of a twinkle model's per-adapter state and of Megatron's TP group, shared by the Megatron and
transformers paths and the losses."""
import sys


def optimizer_group(model, kwargs):
    """twinkle's optimizer group of the call's adapter (the default group without ``adapter_name``)."""
    name = kwargs["adapter_name"] if "adapter_name" in kwargs else model._get_default_group()
    return model.optimizer_group[name]


def loss_instance(model, kwargs):
    try:
        return optimizer_group(model, kwargs).loss_instance
    except (AttributeError, KeyError):
        return None  # forward_backward itself reports the bad adapter name


def tensor_parallel_group():
    """Megatron's tensor-parallel group where TP > 1 (the logits are then vocab shards), else None."""
    if "megatron.core" not in sys.modules:  # Megatron not in use: no vocab sharding
        return None
    try:
        from megatron.core import parallel_state as mpu
        if mpu.model_parallel_is_initialized() and mpu.get_tensor_model_parallel_world_size() > 1:
            return mpu.get_tensor_model_parallel_group()
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None
