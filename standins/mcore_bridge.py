"""twinkle's ``MegatronModel(model_id=...)`` built through mcore_bridge from a local tiny Qwen3, on the CPU.

``save_tiny_qwen3(path, ...)`` saves what a user's checkpoint directory holds: a Qwen3 causal LM with
random weights (transformers' ``save_pretrained``) and a small tokenizer with a chat template (twinkle's
``Template`` loads it and calls ``apply_chat_template``); nothing is downloaded.
``megatron_model(path, ...)`` builds twinkle's ``MegatronModel`` from it as a user does, inside
``mcore_bridge_on_cpu()``: the fewest stand-ins a CPU needs, each named here and in
docs/twinkle_integration.md ("mcore_bridge on the CPU"):

1. ``transformer_engine``: mcore_bridge's ``patcher.py`` and several of its model modules
   (``model/gpts/deepseek_v4.py``: ``import transformer_engine.pytorch``, ``model/modules/mtp_layer.py``, ...)
   import it unconditionally at import time (the patcher's TE patches then fail softly). Empty
   ``transformer_engine`` and ``transformer_engine.pytorch`` modules are in ``sys.modules`` only while
   mcore_bridge is imported, after the megatron-core modules that check for TE are loaded.
2. ``TEGroupedLinear``: megatron-core sets it to ``None`` without TE; mcore_bridge's patcher assigns an
   attribute on it. A placeholder class while mcore_bridge is imported.
3. Triton: mcore_bridge's model registry imports every model family, and two of those imports reach a
   Triton kernel module that imports ``triton`` without a guard: mcore_bridge's
   ``model/modules/kernels/qsa_block_sparse_attn.py`` (QSA sparse attention; ``qsa_kernels.py`` guards
   ``import triton`` but imports that module first) and megatron-core's
   ``inference/contexts/attention_context/triton/tensor_ops.py`` (through ``ssm/mamba_mixer.py``, for
   Nemotron-H). Neither runs for Qwen3: placeholders of those modules, whose functions raise, while
   mcore_bridge is imported.
3b. peft's LoRA: mcore_bridge's ``tuners/patcher.py`` replaces peft's ``dispatch_megatron`` with one
   that calls ``isinstance`` with megatron-core's TE classes, which are ``MagicMock`` instances without
   TE: any LoRA in the process (a transformers model's too) then raises ``TypeError``. peft's own is
   put back after the import (no Megatron LoRA runs in these tests).
4. The layer spec: mcore_bridge's ``register.py`` passes ``use_transformer_engine=True`` to
   megatron-core's ``get_gpt_decoder_block_spec`` (and the MTP block spec), which then asks for
   ``TENorm``. Here it gets ``use_transformer_engine=False``: megatron-core's local spec (its torch
   norms, ``WrappedTorchNorm``, RMSNorm included).
5. Two weight names: mcore_bridge's ``GPTBridge`` maps the HF norms only onto TE's fused names
   (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); the local
   spec calls them ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``.
6. RoPE's frequencies: megatron-core's ``RotaryEmbedding.get_emb`` moves them to
   ``torch.cuda.current_device()``, answered with "cpu" in that module; likewise for the gradient
   buffers of Megatron's DDP (``param_and_grad_buffer``), which twinkle wraps the model in at world
   size > 1.
7. CUDA RNG states: twinkle's ``MegatronStrategy`` calls megatron-core's
   ``model_parallel_cuda_manual_seed``, which reads ``torch.cuda.get_rng_state()``: a no-op here (the
   models have no dropout and the RNG tracker's ``fork`` is a no-op on the CPU, standins.megatron); full
   recompute (twinkle's default, ``recompute_granularity='full'``) saves and restores the CUDA RNG state
   around each recomputed layer (``tensor_parallel/random.py`` ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state``): nothing to save here, the CPU state megatron saves itself.
8. Not a stand-in but a clean-up: mcore_bridge's ``get_rope_inv_freq`` writes its own ``"default"`` into
   transformers' process-wide ``ROPE_INIT_FUNCTIONS``, after which transformers' own Qwen3 no longer
   builds; ``megatron_model`` puts the table back after each build.
9. twinkle-kit defect (not a CPU matter): ``MegatronStrategy.params_type`` looks a ``torch.dtype`` up in
   a dict keyed by strings and so returns bf16 for ``mixed_precision='no'``; with ``fp32_params=True``
   (the default of ``megatron_model``) it returns the dtype twinkle chose (fp32 for 'no').

Only for the layouts that need them, as their own context managers: 10-11 ``sequence_parallel_on_cpu()``
(megatron-core's torch norm refuses sequence parallelism; its SP buffers ask for a CUDA device), 12
``packed_attention_on_cpu()`` (megatron-core's local attention refuses packed sequences).

Plus what every CPU run of twinkle's Megatron path needs (standins/megatron.py): megatron's
scheduler's one CUDA allocation, its p2p buffers, its attention scratch buffer and RNG-tracker forks,
twinkle's ``Platform`` on the CPU.
"""
import contextlib
import importlib
import importlib.machinery
import json
import os
import sys
import types

import torch

_MEGATRON_FIRST = ("peft", "transformers", "megatron.core.distributed", "megatron.core.fp8_utils",
                   "megatron.core.extensions.transformer_engine", "megatron.core.models.gpt.gpt_model",
                   "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.multi_token_prediction",
                   "megatron.core.transformer.moe.router")

# Triton kernel modules imported without a guard on the way to mcore_bridge's model registry.
_TRITON_KERNELS = ("mcore_bridge.model.modules.kernels.qsa_block_sparse_attn",
                   "megatron.core.inference.contexts.attention_context.triton.tensor_ops")


class _TritonKernelPlaceholder(types.ModuleType):
    """Stands for a Triton kernel module: any name imported from it is a function that raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} needs Triton (a placeholder in this test)")

        return kernel

CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _import_mcore_bridge():
    """Import mcore_bridge without Transformer Engine or Triton (stand-ins 1-3)."""
    if "mcore_bridge.model.register" in sys.modules:
        return
    for name in _MEGATRON_FIRST:
        importlib.import_module(name)  # their TE checks must see no TE
    te_ext = sys.modules["megatron.core.extensions.transformer_engine"]
    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    placeholder = te_ext.TEGroupedLinear is None
    if placeholder:
        te_ext.TEGroupedLinear = type("TEGroupedLinearPlaceholder", (), {})
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
    sys.modules.update({name: _TritonKernelPlaceholder(name) for name in _TRITON_KERNELS})
    from peft.tuners.lora import model as peft_lora
    peft_dispatch = peft_lora.dispatch_megatron
    try:
        import mcore_bridge
        for name in ("mcore_bridge.model.register", "mcore_bridge.model.gpt_model", "mcore_bridge.bridge.gpt_bridge"):
            importlib.import_module(name)
        mcore_bridge.get_mcore_model  # noqa: B018  (resolves its lazy attributes now)
    finally:
        for name in ("transformer_engine", "transformer_engine.pytorch", *_TRITON_KERNELS):
            del sys.modules[name]
        if placeholder:
            te_ext.TEGroupedLinear = None
        import peft.import_utils
        peft.import_utils.is_te_available.cache_clear()  # peft must not remember the stand-in
        peft_lora.dispatch_megatron = peft_dispatch  # 3b


_LOCAL_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


@contextlib.contextmanager
def packed_attention_on_cpu():
    """Stand-in 12, for packed (padding-free) batches only: megatron-core's local ``DotProductAttention``
    asserts ``packed_seq_params is None`` ("Packed sequence is not supported by DotProductAttention.
    Please use TEDotProductAttention instead."); TE's is the attention that runs packed batches. Here a
    packed micro-batch (``qkv_format='thd'``: [tokens, heads, dim]) goes through the same attention as one
    sequence with a block-diagonal causal mask built from ``cu_seqlens_q``: each token sees the earlier
    tokens of its own sample only, as TE's varlen attention computes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    original = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias)
        assert packed_seq_params.qkv_format == "thd" and query.dim() == 3
        cu_seqlens = packed_seq_params.cu_seqlens_q.long()
        tokens = torch.arange(query.shape[0])
        sample = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
        masked = (sample[:, None] != sample[None, :]) | (tokens[None, :] > tokens[:, None])  # True: masked
        return original(self, query[:, None], key[:, None], value[:, None], masked[None, None],
                        attn_mask_type=attn_mask_type, attention_bias=attention_bias)

    DotProductAttention.forward = forward
    try:
        yield
    finally:
        DotProductAttention.forward = original


@contextlib.contextmanager
def sequence_parallel_on_cpu():
    """Stand-ins 10 and 11, for sequence parallelism only. 10: megatron-core's ``WrappedTorchNorm`` (the
    local spec's norm without Apex / TE) asserts ``not config.sequence_parallel``; here it builds the same
    torch norm and marks its weights ``sequence_parallel``, as megatron's TE and Apex norms do, so that
    ``finalize_model_grads`` sums their gradients over the TP ranks (each rank saw its sequence shard).
    11: megatron-core's SP gather / scatter (``tensor_parallel/mappings.py``, and the linear layers'
    backward in ``tensor_parallel/layers.py``) allocate their buffers on ``torch.cuda.current_device()``,
    answered with "cpu" in those modules."""
    import copy

    from . import megatron as th
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    original = WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__
    try:
        with th.torch_on_cpu(mappings, layers):
            yield
    finally:
        WrappedTorchNorm.__new__ = original


@contextlib.contextmanager
def mcore_bridge_on_cpu(fp32_params: bool = True, twinkle: bool = True):
    """Stand-ins 4-8 (1-3 are done once, at import), and the CPU pieces of standins.megatron; with ``twinkle``
    (twinkle-kit's models: its ``Platform`` on the CPU) also 9; undone on exit. ``twinkle=False``: mcore_bridge's
    models built by another framework (Megatron-SWIFT, standins/swift_megatron.py), no twinkle-kit imported."""
    from . import megatron as th
    _import_mcore_bridge()
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random
    from mcore_bridge.bridge.gpt_bridge import GPTBridge
    from mcore_bridge.model import register

    def local_spec(original):
        def spec(*args, **kwargs):
            kwargs["use_transformer_engine"] = False  # register.py passes it by keyword
            return original(*args, **kwargs)
        return spec

    set_state_dict = GPTBridge._set_state_dict

    def local_names(self, mg_module, mg_key, *args, **kwargs):
        return set_state_dict(self, mg_module, _LOCAL_NAMES.get(mg_key, mg_key), *args, **kwargs)

    saved = [(register, "get_gpt_decoder_block_spec"), (register, "get_gpt_mtp_block_spec"),
             (GPTBridge, "_set_state_dict"), (tp_random, "model_parallel_cuda_manual_seed"), (tp_random, "_get_cuda_rng_state"),
             (tp_random, "_set_cuda_rng_state")]
    fp32_params = fp32_params and twinkle
    if fp32_params:
        from twinkle.model.megatron.strategy.megatron import MegatronStrategy
        saved.append((MegatronStrategy, "params_type"))
    saved = [(owner, name, vars(owner)[name]) for owner, name in saved]
    register.get_gpt_decoder_block_spec = local_spec(register.get_gpt_decoder_block_spec)
    register.get_gpt_mtp_block_spec = local_spec(register.get_gpt_mtp_block_spec)
    GPTBridge._set_state_dict = local_names
    tp_random.model_parallel_cuda_manual_seed = lambda seed, *args, **kwargs: None
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    if fp32_params:
        MegatronStrategy.params_type = property(lambda self: self._params_dtype)
    try:
        with (th.torch_on_cpu(rotary_pos_embedding, param_and_grad_buffer), th.cpu_schedules(), th.cpu_p2p(),
              th.megatron_gpt_cpu(), th.cpu_platform("cpu") if twinkle else contextlib.nullcontext()):
            yield
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)


def save_tiny_qwen3(path, *, vocab=512, hidden=32, layers=2, heads=4, kv_heads=2, tied=False, seed=0,
                    dtype=torch.float32, **config):
    """A Qwen3 causal LM with random weights and a word-level tokenizer with a chat template, saved in ``path``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=hidden // heads, max_position_embeddings=256, tie_word_embeddings=tied,
                                   rms_norm_eps=1e-6, **config)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # transformers initialises the norms to 1: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = specials + [f"w{i}" for i in range(vocab - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                                unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 1, "pad_token_id": 0}, f)
    return model


def megatron_model(path, *, tp=1, pp=1, vpp=None, sequence_parallel=False, mixed_precision="no", loss=None,
                   **kwargs):
    """twinkle's ``MegatronModel(model_id=path, ...)`` as a user builds it (``twinkle.initialize`` with a
    ``DeviceMesh``), without recompute unless asked (``recompute_granularity``)."""
    import twinkle
    from twinkle import DeviceMesh
    from twinkle.model.megatron.megatron import MegatronModel
    import torch.distributed as dist
    world = tp * pp
    if dist.is_initialized():  # what torchrun sets for each rank; twinkle's Platform reads it
        os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()),
                          LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    mesh = DeviceMesh.from_sizes(world_size=world, dp_size=1, tp_size=tp, pp_size=pp, vpp_size=vpp,
                                 sequence_parallel=sequence_parallel)
    twinkle.initialize(mode="local", global_device_mesh=mesh)
    kwargs.setdefault("recompute_granularity", None)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_inits = dict(ROPE_INIT_FUNCTIONS)
    try:
        model = MegatronModel(model_id=path, device_mesh=mesh, mixed_precision=mixed_precision,
                              persist_layer_norm=False, **kwargs)
    finally:  # mcore_bridge's get_rope_inv_freq puts its own "default" there, which transformers' models then fail on
        ROPE_INIT_FUNCTIONS.clear()
        ROPE_INIT_FUNCTIONS.update(rope_inits)
    if loss is not None:
        model.set_loss(loss)
    return model
