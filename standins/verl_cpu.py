"""verl's engines on a CPU, for the tests and the benchmark (never shipped: the wheel holds python/twinkle_mem only).

verl 0.9 has no CPU platform: its platform registry knows cuda, npu and rocm, falls back to "nvidia" where none
is found, and ``init_device_mesh("cuda")`` then raises; its FSDP engines are registered for the devices "cuda"
and "npu" only; its process-group helper builds the backend string "cpu:gloo,<device>:<backend>", which is
invalid when the device is the CPU. What replaces each (README.md beside this file says why):

- :class:`PlatformCPU`: a verl platform whose device is the CPU and whose collectives are gloo;
- :func:`cpu_verl`: that platform set as verl's, verl's FSDP engines registered for the device "cpu" too, and the
  memory-statistics calls verl makes of its device module answered by ``torch.cpu``; undone on exit;
- :func:`gloo_world`: the process group created first (gloo), so verl's helper finds it and builds none;
- :func:`megatron_tp_on_cpu`: megatron-core's sequence-parallel gathers allocating on the CPU (verl's Megatron
  fused forward calls one under sequence parallelism, Megatron's output layer another);
- :func:`save_tiny_qwen2`: a tiny Qwen2 checkpoint on disk (verl's engines load their model from a path);
- :func:`rollout_batch`: what verl's rollout (vLLM or SGLang, GPU only) hands the trainer, random tokens.
"""
import contextlib
import datetime
import os
import socket

import torch


def platform_cpu_class():
    """The class of verl's CPU platform stand-in (built on first use: verl is imported then)."""
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)  # (verl checks `get_torch_device() == torch.cpu`)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # (verl moves micro-batches to get_device_id(): a device index would mean cuda:N)

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self):
            return "CPU"

        def ray_resource_options(self, num_gpus):
            return {}

        def ray_noset_envvars(self):
            return []

        def get_device_capability(self, device_index=0):
            return None, None

        def is_ipc_supported(self):
            return False

        def rollout_env_vars(self):
            return {}

        def get_collective_module(self):
            return None

        def cudart(self):
            return None

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

    return PlatformCPU


# What verl asks of its device module (torch.cuda's calls) that torch.cpu lacks: its memory statistics (0 on the CPU:
# the benchmark measures resident memory itself) and cache calls (nothing to do). verl tests `device == torch.cpu`,
# so the module stays torch.cpu and gets these for the while.
_CPU_DEVICE_CALLS = {
    **{name: (lambda *args, **kwargs: 0) for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                                                       "max_memory_reserved")},
    **{name: (lambda *args, **kwargs: None) for name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect")},
    "mem_get_info": lambda *args, **kwargs: (0, 0),
    "manual_seed": lambda seed: torch.manual_seed(seed),
}


@contextlib.contextmanager
def cpu_verl():
    """verl's platform the CPU (gloo), its FSDP engines registered for the device "cpu" too, and torch.cpu answering
    verl's device-module calls; undone on exit."""
    from verl.plugin.platform import platform_manager
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    saved_platform = platform_manager._current_platform
    platform_manager._current_platform = platform_cpu_class()()
    language_models = EngineRegistry._engines["language_model"]
    added = [backend for backend in ("fsdp", "fsdp2") if "cpu" not in language_models[backend]]
    for backend in added:
        language_models[backend]["cpu"] = FSDPEngineWithLMHead
    calls = [name for name in _CPU_DEVICE_CALLS if not hasattr(torch.cpu, name)]
    for name in calls:
        setattr(torch.cpu, name, _CPU_DEVICE_CALLS[name])
    try:
        yield
    finally:
        for name in calls:
            delattr(torch.cpu, name)
        for backend in added:
            del language_models[backend]["cpu"]
        platform_manager._current_platform = saved_platform


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_world(rank: int = 0, world_size: int = 1, init_method: str = None):
    """The default process group, gloo, with the environment verl's workers read (RANK, WORLD_SIZE, LOCAL_RANK);
    destroyed on exit. ``init_method``: every rank's (a ``file://`` path); a free local port for a world of one."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    dist.init_process_group("gloo", init_method=init_method or f"tcp://127.0.0.1:{free_port()}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def megatron_tp_on_cpu():
    """megatron-core's tensor-parallel mappings and layers allocate their sequence-parallel all-gather buffers on
    ``torch.cuda.current_device()``: on the CPU here; undone on exit."""
    from megatron.core.tensor_parallel import layers, mappings

    from standins.megatron import torch_on_cpu
    with torch_on_cpu(mappings, layers):
        yield


def tiny_qwen2(vocab: int = 1000, hidden: int = 64, tied: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    """A one-layer Qwen2 causal LM, built from a config (no download), with torch's sdpa attention (verl asks for
    flash-attention by default, which needs CUDA)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         max_position_embeddings=512, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def save_tiny_qwen2(path: str, **kwargs) -> str:
    """:func:`tiny_qwen2` saved at ``path`` (config and weights; no tokenizer: verl's model config is told not to
    load one, and its ``override_config`` to use sdpa)."""
    tiny_qwen2(**kwargs).save_pretrained(path)
    return path


def rollout_batch(seed: int, batch: int = 4, prompt: int = 6, response: int = 5, vocab: int = 1000,
                  full: bool = False):
    """A batch as verl's trainer has it after rollout (left-padded prompts, right-padded responses, random tokens
    and advantages), converted to its engines' padding-free form as the trainer does (left_right_2_no_padding).
    ``full``: every prompt and response of its whole length (a known number of tokens)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding
    g = torch.Generator().manual_seed(seed)
    if full:
        prompts, responses = torch.full((batch, ), prompt), torch.full((batch, ), response)
    else:
        prompts, responses = torch.randint(2, prompt + 1, (batch, ), generator=g), torch.randint(1, response + 1,
                                                                                                 (batch, ), generator=g)
    ids = torch.zeros(batch, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(batch):
        start, end = prompt - int(prompts[row]), prompt + int(responses[row])
        ids[row, start:end] = torch.randint(0, vocab, (end - start, ), generator=g)
        mask[row, start:end] = 1
    response_mask = mask[:, prompt:].clone()
    data = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                       "prompts": ids[:, :prompt], "responses": ids[:, prompt:], "response_mask": response_mask,
                       "advantages": torch.randn(batch, response, generator=g) * response_mask},
                      batch_size=[batch])
    return left_right_2_no_padding(data)
