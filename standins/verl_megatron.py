"""verl's Megatron engine built as its users build it (``MegatronEngineWithLMHead`` through Megatron-Bridge, verl
0.9.1's default: ``use_mbridge=True``, ``vanilla_mbridge=False``) from a Qwen2 checkpoint, in a gloo world of CPU
processes. The fewest stand-ins a CPU needs, each named here and in README.md beside this file; on a GPU with
Transformer Engine (TE) none is needed:

1. TE and Triton at import: Megatron-Bridge imports ``transformer_engine.pytorch`` unconditionally
   (``megatron/bridge/peft/lora_layers.py``, ``lora.py``: ``ModuleNotFoundError: No module named
   'transformer_engine'`` without it) and subclasses ``te.Linear`` there; TE is CUDA only. While
   ``megatron.bridge`` is imported, a placeholder ``transformer_engine`` (each class it is asked for an empty class,
   each submodule another placeholder) and the placeholder of megatron-core's Triton kernel module
   (standins/mcore_bridge.py, stand-in 3) are in ``sys.modules``; afterwards neither is, and no TE class is ever
   built (the layer spec below is megatron-core's own).
2. The layer spec: Megatron-Bridge's ``GPTModelProvider`` always takes TE's layer spec (``default_layer_spec``);
   here the provider verl gets from ``AutoBridge.to_megatron_provider`` takes Megatron-Bridge's own
   ``local_layer_spec`` (megatron-core's torch layers, RMSNorm included).
3. Megatron's CUDA RNG: verl's ``set_random_seed`` calls ``tensor_parallel.model_parallel_cuda_manual_seed``
   (it reads ``torch.cuda.get_rng_state()``): a no-op here (the models have no dropout; standins.megatron's
   ``megatron_gpt_cpu`` makes the tracker's forks no-ops).
4. The model's place: Megatron-Bridge's ``get_model`` moves each chunk with ``.cuda()`` unless
   ``use_cpu_initialization``: set here (verl cannot pass it); Megatron's DDP is then built on a CUDA side stream
   and the TP broadcast of replicated weights (``param_mapping``) moves them to ``torch.cuda.current_device()``:
   in those modules the streams do nothing and the device is the CPU (standins.megatron's ``torch_on_cpu``).
5. CUDA allocations and type names: megatron-core's RoPE frequencies, DDP buffers and optimizer scalars
   (``torch_on_cpu``, as for twinkle's Megatron path, standins/mcore_bridge.py stand-in 6 and
   standins/megatron_lora.py stand-in 16); its bf16 optimizer sorts parameters by ``param.type()`` against
   ``'torch.cuda.BFloat16Tensor'`` (standins/megatron_lora.py stand-in 17).
6. What every CPU run of megatron-core needs (standins/megatron.py, standins/mcore_bridge.py 10-12): the
   scheduler's and pipeline p2p's CUDA buffers, the attention's scratch buffer, packed sequences through the
   local attention, sequence parallelism with the torch norm.
7. verl's platform on the CPU (standins/verl_cpu.py) with the Megatron engine registered for the device "cpu".
8. Row-parallel shards: Megatron-Bridge scatters a row-parallel weight (``linear_proj``, ``linear_fc2``) from TP rank
   0 as ``torch.chunk(weight, tp, dim=1)`` views, each moved with ``.to(device)``: on a GPU a contiguous copy; on
   the CPU the view itself, whose storage gloo's scatter sends from its start, so every rank loaded wrong values
   (the engine then trains a model that is not the checkpoint; tested: the engine's weights are the
   checkpoint's). The splits are made contiguous here.
9. Not a GPU, a release gap: verl 0.9.1 pins Megatron-Bridge 0.5.2 (its ``megatron`` extra); Megatron-Bridge 0.4 on
   needs Python 3.12, and this machine's CPU torch is built for 3.11, so 0.3.1 is the newest that installs here.
   verl's Megatron LoRA (``workers/config/megatron_peft.py``, ``utils/megatron_utils.py``) imports
   ``create_peft``, ``create_peft_hook`` and ``load_peft_adapter_checkpoint`` from ``megatron.bridge.peft.utils``,
   which 0.5 added (0.3.1: ``ImportError: cannot import name 'create_peft'``). Where they are missing, the first two
   are added, built on 0.3.1's own ``LoRA`` (verl's ``model.lora`` settings as its fields, ``rank`` as ``dim``) and
   its ``PEFT.__call__`` (freeze, then wrap each target linear in ``LoRALinear``); the loader raises (adapter
   checkpoints are not loaded here).
10. TE's classes in LoRA: without TE, megatron-core names TE's parallel linears as ``MagicMock`` instances, which
    Megatron-Bridge's ``safe_import_from`` counts as found (``peft.utils.HAVE_TE``), and ``isinstance`` against them
    raises ``TypeError``; ``HAVE_TE`` is False here (megatron-core's own linears take LoRA's branch for them).

Not stood in: the checkpoint conversion (Megatron-Bridge's ``Qwen2Bridge`` loads the HF weights, the local layer
names included), verl's engine, its forward, its PPO loss, Megatron's schedules, DDP and optimizer.
"""
import contextlib
import importlib
import importlib.machinery
import sys
import types

# megatron-core modules that check for TE at import: loaded before the placeholder exists, so that they see no TE
_TE_CHECKED_FIRST = ("peft", "transformers", "megatron.core.extensions.transformer_engine",
                     "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer",
                     "megatron.core.models.gpt.experimental_attention_variant_module_specs",
                     "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
                     "megatron.core.models.multimodal.llava_model", "megatron.core.ssm.mamba_context_parallel",
                     "megatron.core.transformer.heterogeneous.linear_replacements")
_TRITON_KERNEL = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


class _TransformerEnginePlaceholder(types.ModuleType):
    """Stands for ``transformer_engine`` while Megatron-Bridge is imported: a capitalized name is an empty class (it
    subclasses ``te.Linear``), any other a placeholder submodule (``te.pytorch``, ``te.pytorch.ops``)."""

    def __init__(self, name):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = (type(name, (), {"__module__": self.__name__}) if name[:1].isupper()
                 else _TransformerEnginePlaceholder(f"{self.__name__}.{name}"))
        setattr(self, name, value)
        return value


def import_megatron_bridge():
    """Import Megatron-Bridge without TE or Triton (stand-in 1); a no-op once imported."""
    if "megatron.bridge" in sys.modules:
        return
    from .mcore_bridge import _TritonKernelPlaceholder
    for name in _TE_CHECKED_FIRST:
        importlib.import_module(name)
    te = _TransformerEnginePlaceholder("transformer_engine")
    placeholders = {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
                    _TRITON_KERNEL: _TritonKernelPlaceholder(_TRITON_KERNEL)}
    sys.modules.update(placeholders)
    try:
        importlib.import_module("megatron.bridge")
    finally:
        for name in placeholders:
            del sys.modules[name]
        import peft.import_utils
        peft.import_utils.is_te_available.cache_clear()  # peft must not remember the placeholder


def _local_spec_provider(to_megatron_provider):
    def provider(self, *args, **kwargs):
        from megatron.bridge.models.gpt_provider import local_layer_spec
        built = to_megatron_provider(self, *args, **kwargs)
        built.transformer_layer_spec = local_layer_spec  # stand-in 2
        return built
    return provider


def _contiguous_splits(scatter_to_tp_ranks):
    def scatter(self, splits, *args, **kwargs):
        splits = None if splits is None else [split.contiguous() for split in splits]  # stand-in 8
        return scatter_to_tp_ranks(self, splits, *args, **kwargs)
    return scatter


def _create_peft(config, dtype=None):
    """Megatron-Bridge 0.5's ``create_peft`` (stand-in 9): the PEFT object of verl's ``model.lora`` config."""
    import dataclasses

    from megatron.bridge.peft.lora import LoRA
    settings = dict(config)
    assert settings.pop("type", "lora") == "lora", "stand-in 9 builds Megatron-Bridge's LoRA only"
    settings["dim"] = settings.pop("rank")
    settings["lora_dtype"] = settings.pop("dtype", None) or dtype
    accepted = {f.name for f in dataclasses.fields(LoRA) if f.init}
    return LoRA(**{name: value for name, value in settings.items() if name in accepted})


def _create_peft_hook(peft, training=True):
    """Megatron-Bridge 0.5's ``create_peft_hook`` (stand-in 9): a pre-wrap hook applying ``peft`` to the chunks."""
    return lambda model: peft(model, training=training)


def _load_peft_adapter_checkpoint(*args, **kwargs):
    """Megatron-Bridge 0.5's adapter loader, which verl imports with the hook and calls for ``lora.adapter_path``
    only (stand-in 9: not stood in)."""
    raise NotImplementedError("standins.verl_megatron: no adapter checkpoint loading (Megatron-Bridge 0.3.1)")


def _on_cpu(get_model):
    def on_cpu(*args, **kwargs):
        kwargs["use_cpu_initialization"] = True  # stand-in 4
        return get_model(*args, **kwargs)
    return on_cpu


@contextlib.contextmanager
def engine_for_cpu(engine_class):
    """``engine_class`` is what verl's ``EngineRegistry`` gives a language model with the backend "megatron" on the
    device "cpu" (stand-in 7); the previous one again on exit."""
    from verl.workers.engine import EngineRegistry
    megatron_engines = EngineRegistry._engines["language_model"]["megatron"]
    registered = megatron_engines.get("cpu")
    megatron_engines["cpu"] = engine_class
    try:
        yield
    finally:
        if registered is None:
            del megatron_engines["cpu"]
        else:
            megatron_engines["cpu"] = registered


@contextlib.contextmanager
def megatron_engine_on_cpu():
    """Stand-ins 2-7 (1 at import), verl's ``MegatronEngineWithLMHead`` for the device "cpu"; undone on exit."""
    from . import megatron as th
    from .mcore_bridge import packed_attention_on_cpu, sequence_parallel_on_cpu
    from .megatron_lora import _with_cuda_tensor_methods_on_cpu
    from .verl_cpu import cpu_verl
    import_megatron_bridge()
    from megatron.bridge.models import model_provider
    from megatron.bridge.models.conversion import param_mapping
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.core import tensor_parallel
    from megatron.core import utils as mc_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.optimizer import clip_grads, optimizer
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    changes = [(AutoBridge, "to_megatron_provider", _local_spec_provider(vars(AutoBridge)["to_megatron_provider"])),
               (tensor_parallel, "model_parallel_cuda_manual_seed", lambda *args, **kwargs: None),  # 3
               (model_provider, "get_model", _on_cpu(model_provider.get_model)),
               (param_mapping.MegatronParamMapping, "scatter_to_tp_ranks",
                _contiguous_splits(vars(param_mapping.MegatronParamMapping)["scatter_to_tp_ranks"]))]
    changes += [(owner, name, _with_cuda_tensor_methods_on_cpu(vars(owner)[name]))  # 5
                for owner, name in ((optimizer.Float16OptimizerWithFloat16Params, "__init__"),
                                    (optimizer, "clip_grad_by_total_norm_fp32"))]
    from megatron.bridge.peft import utils as peft_utils
    changes.append((peft_utils, "HAVE_TE", False))  # 10
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    added = {name: value for name, value in (("create_peft", _create_peft), ("create_peft_hook", _create_peft_hook),
                                             ("load_peft_adapter_checkpoint", _load_peft_adapter_checkpoint))
             if not hasattr(peft_utils, name)}  # 9
    vars(peft_utils).update(added)
    try:
        with (cpu_verl(), engine_for_cpu(MegatronEngineWithLMHead),
              th.torch_on_cpu(model_provider, param_mapping, rotary_pos_embedding, param_and_grad_buffer, optimizer,
                              clip_grads, mc_utils),
              th.cpu_schedules(), th.cpu_p2p(), th.megatron_gpt_cpu(), packed_attention_on_cpu(),
              sequence_parallel_on_cpu()):
            yield
    finally:
        for name in added:
            delattr(peft_utils, name)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
