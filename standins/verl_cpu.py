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
- :func:`ulysses_attention_on_cpu`: the flash-attention kernel under verl's Ulysses all-to-alls (``CPU_VARLEN``, an
  attention implementation for the model config);
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


CPU_VARLEN = "twinkle_mem_cpu_varlen"  # the attention implementation a model config names for Ulysses on the CPU


@contextlib.contextmanager
def ulysses_attention_on_cpu():
    """Ulysses sequence parallelism on the CPU. verl implements it in flash-attention's call
    (``_ulysses_flash_attention_forward``, which ``apply_monkey_patch`` sets as transformers'
    ``flash_attention._flash_attention_forward``: all-to-all to whole sequences and a share of the heads, the kernel,
    all-to-all back); flash-attention is CUDA only, and transformers' sdpa attention never reaches that call. Here:
    the attention implementation ``CPU_VARLEN`` (registered in transformers' attention and mask interfaces) is
    transformers' own flash-attention forward, so it reaches verl's call, and the kernel verl calls after its
    all-to-all (``monkey_patch._flash_attention_forward``) is :func:`_varlen_attention`; undone on exit."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from verl.models.transformers import monkey_patch
    AttentionInterface.register(CPU_VARLEN, flash_attention_forward)
    AttentionMaskInterface.register(CPU_VARLEN, flash_attention_mask)
    kernel = monkey_patch._flash_attention_forward
    monkey_patch._flash_attention_forward = _varlen_attention
    try:
        yield
    finally:
        monkey_patch._flash_attention_forward = kernel


def _varlen_attention(query, key, value, attention_mask, query_length, *args, is_causal=True, softmax_scale=None,
                      position_ids=None, **kwargs):
    """flash-attention's varlen call on the CPU: [1, tokens, heads, dim] packed sequences, each starting where
    ``position_ids`` is 0, causal within its sequence (what flash-attention's ``cu_seqlens`` computes)."""
    assert query.shape[0] == 1 and position_ids is not None and attention_mask is None and is_causal
    tokens = torch.arange(query.shape[1])
    sample = (position_ids[0] == 0).cumsum(0)
    allowed = (sample[:, None] == sample[None, :]) & (tokens[None, :] <= tokens[:, None])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [1, heads, tokens, dim]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # (grouped-query attention)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)
    return out.transpose(1, 2)


def tiny_qwen2(vocab: int = 1000, hidden: int = 64, tied: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32, layers: int = 1):
    """A Qwen2 causal LM of ``layers`` layers (one by default), built from a config (no download), with torch's sdpa
    attention (verl asks for flash-attention by default, which needs CUDA)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         max_position_embeddings=512, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def save_tiny_qwen2(path: str, checkpoint: bool = False, **kwargs) -> str:
    """:func:`tiny_qwen2` saved at ``path`` (config and weights; no tokenizer: verl's model config is told not to
    load one, and its ``override_config`` to use sdpa). ``checkpoint``: a checkpoint as a user's folder holds it, for
    an engine that converts it (Megatron-Bridge): with a word-level tokenizer (verl's Megatron engine reads its pad
    token), and norms and biases away from their initial 1 and 0, so that a weight the conversion missed shows."""
    model = tiny_qwen2(**kwargs)
    if checkpoint:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    p.add_(0.1 * torch.randn_like(p))
        _save_word_tokenizer(path, model.config.vocab_size)
    model.save_pretrained(path)
    return path


def _save_word_tokenizer(path: str, vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(vocab - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="w0").save_pretrained(path)


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
