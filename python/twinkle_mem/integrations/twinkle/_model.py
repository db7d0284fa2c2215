"""Megatron's tensor-parallel group, shared by the Megatron path, the losses and the log-probs adapter."""
import sys


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
