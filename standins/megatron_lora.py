"""Training twinkle's ``MegatronModel`` with a LoRA adapter on the CPU: peft's Megatron LoRA as mcore_bridge
dispatches it, megatron-core's optimizer (twinkle's ``set_optimizer('default')``) and mcore_bridge's export
(twinkle's ``save``). ``training_on_cpu()`` adds, to ``mcore_bridge_on_cpu()``'s stand-ins 1-9 (standins/
mcore_bridge.py), the fewest more a CPU needs; none is needed on a GPU with Transformer Engine (TE):

13. TE's layer classes: without TE, megatron-core names ``TELinear``, ``TELayerNormColumnParallelLinear``,
    ``TEColumnParallelLinear``, ``TERowParallelLinear`` as ``MagicMock`` instances and the grouped ones as
    ``None``, and ``isinstance`` against them raises ``TypeError``. twinkle's ``get_target_modules('all-linear')``,
    mcore_bridge's LoRA dispatch (``tuners/patcher.py``), its ``LoraParallelLinear`` (``tuners/lora.py``) and
    twinkle's multi-LoRA forward all ask. Placeholder classes stand for them: ``TELinear`` (what TE's column and
    row parallel linears derive from) answers ``isinstance`` for megatron-core's own ``ColumnParallelLinear`` /
    ``RowParallelLinear``, the layers of the local layer spec (stand-in 4), so that ``'all-linear'`` finds
    ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` as it finds their TE versions on a GPU; the
    others match nothing. In megatron-core's TE module (read at call time) and in mcore_bridge's two LoRA modules
    (bound at import).
14. mcore_bridge's LoRA branch for megatron-core's own linears: ``LoraParallelLinear`` sizes its factors for TE's
    layers (local in / out features) unless ``is_torch_npu_available()``, where MindSpeed builds models of
    megatron-core's own linears (global ``input_size`` / ``output_size``, as peft reads them): that answer is
    True in ``mcore_bridge.tuners.lora`` only, so its factors are megatron-core's ``RowParallelLinear`` /
    ``ColumnParallelLinear`` and a plain ``nn.Linear`` for the replicated one (its ``TELinear(parallel_mode=
    'duplicated')`` on a GPU), and ``TEColumnParallelLinear`` there is megatron-core's ``ColumnParallelLinear``.
15. peft's ``dispatch_megatron``: mcore_bridge replaces it at import; stand-in 3b of standins/mcore_bridge.py
    puts peft's own back (which needs ``LoraConfig.megatron_config``, absent from twinkle's recipes).
    mcore_bridge's is in place here.
16. CUDA scalars and buffers: megatron-core's optimizer (``optimizer.py``, ``clip_grads.py``,
    ``distrib_optimizer.py``, the local multi-tensor L2 norm in ``core/utils.py``) and mcore_bridge's export
    (``bridge/gpt_bridge.py``) allocate with ``device='cuda'``: the CPU there (standins.megatron's
    ``torch_on_cpu``).
17. CUDA tensor types: megatron-core's optimizers sort parameters by ``param.type()`` against
    ``'torch.cuda.FloatTensor'`` / ``HalfTensor`` / ``BFloat16Tensor`` (``DistributedOptimizer`` and
    ``Float16OptimizerWithFloat16Params`` at construction, ``clip_grad_by_total_norm_fp32`` at each step), and
    mcore_bridge's export moves each tensor with ``.to('cuda')`` before its TP gather: while those run,
    ``Tensor.type()`` names a CPU tensor as its CUDA type, ``Tensor.to`` / ``.cuda`` keep it on the CPU.
18. ``persist_layer_norm``: mcore_bridge's config sets it (apex's persistent layer-norm kernel) and megatron-core's
    torch norm, the local spec's (stand-in 4), asserts it is off; TE's norm on a GPU does not read it. The tests
    of standins/mcore_bridge.py pass ``persist_layer_norm=False`` to ``MegatronModel``; a recipe's call has no
    such argument, so here the norm is built from a copy of the config with it off.
19. Tensor-parallel marks: mcore_bridge builds its models with ``perform_initialization=False`` (the weights come
    from the checkpoint), so megatron-core's own parallel layers (``ColumnParallelLinear``, ``RowParallelLinear``,
    ``VocabParallelEmbedding``: the local spec's, and LoRA's factors of 14) never call
    ``set_tensor_model_parallel_attributes``; TE's layers mark their weights themselves. Unmarked, a TP shard
    counts as a copy of the others: megatron's grad norm (``clip_grad_norm``) takes it from TP rank 0 only. Each
    such layer's weight (and bias) is marked after construction, as megatron marks it when it initializes it.

Also ``layout_independent_lora_init(model_chunks)``: peft draws each LoRA A from the rank's RNG stream, which
depends on the layout (which layers and shards a rank holds); this sets every A from a seed of its layer's
global number and name, the full matrix then the rank's shard, so that runs at TP = 2 and PP = 2 start from the
same adapter.
"""
import contextlib
import copy
import zlib

import torch

from . import mcore_bridge as mb
from . import megatron as th

_TE_CLASSES = ("TELinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
               "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


def _placeholder(name, matches=()):
    """A class standing for TE's ``name``: ``isinstance`` is True for instances of ``matches`` only."""
    meta = type(f"{name}Meta", (type, ), {"__instancecheck__": lambda cls, obj: isinstance(obj, matches)})
    return meta(f"{name}Placeholder", (), {})


def _cpu_device(device):
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


@contextlib.contextmanager
def cuda_tensor_methods_on_cpu():
    """Stand-in 17's view of tensors: CUDA type names, ``.to('cuda')`` / ``.cuda()`` staying on the CPU."""
    names = ("type", "to", "cuda")
    own = {name: vars(torch.Tensor).get(name) for name in names}  # (torch.Tensor inherits them from TensorBase)
    real = {name: getattr(torch.Tensor, name) for name in names}

    def type_(self, dtype=None, *args, **kwargs):
        name = real["type"](self, dtype, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if dtype is None and self.device.type == "cpu" else name

    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return real["to"](self, *[_cpu_device(a) for a in args], **kwargs)

    torch.Tensor.type, torch.Tensor.to, torch.Tensor.cuda = type_, to, lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        for name in names:
            if own[name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own[name])


def _norm_without_persist(original):
    def __new__(cls, config, *args, **kwargs):
        if getattr(config, "persist_layer_norm", False):
            config = copy.copy(config)
            config.persist_layer_norm = False
        return original(cls, config, *args, **kwargs)
    return __new__


def _marked(original, partition_dim):
    """A parallel layer's ``__init__`` that marks its weight (and bias) as megatron's initialization does."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name, dim in (("weight", partition_dim), ("bias", 0)):
            tensor = getattr(self, name, None)
            if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "tensor_model_parallel"):
                if name == "weight" or partition_dim == 0:  # (a row-parallel bias is whole on every rank)
                    set_tensor_model_parallel_attributes(tensor, True, dim, 1)
    return __init__


def _with_cuda_tensor_methods_on_cpu(fn):
    def call(*args, **kwargs):
        with cuda_tensor_methods_on_cpu():
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def training_on_cpu(fp32_params: bool = True, twinkle: bool = True):
    """``mcore_bridge_on_cpu()`` and stand-ins 13-19; undone on exit (a process that trains keeps it open)."""
    with mb.mcore_bridge_on_cpu(fp32_params=fp32_params, twinkle=twinkle):  # imports mcore_bridge (stand-ins 1-3)
        import megatron.core.extensions.transformer_engine as te_ext
        from mcore_bridge.bridge import gpt_bridge
        from mcore_bridge.tuners import lora as mb_lora
        from mcore_bridge.tuners import patcher as mb_patcher
        from megatron.core import utils as mc_utils
        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from peft.tuners.lora import model as peft_lora

        te = {name: _placeholder(name) for name in _TE_CLASSES}
        te["TELinear"] = _placeholder("TELinear", (ColumnParallelLinear, RowParallelLinear))  # 13
        changes = [(module, name, value) for module in (te_ext, mb_lora, mb_patcher) for name, value in te.items()
                   if hasattr(module, name)]
        changes += [(mb_lora, "TEColumnParallelLinear", ColumnParallelLinear),  # 14
                    (mb_lora, "is_torch_npu_available", lambda: True),
                    (peft_lora, "dispatch_megatron", mb_patcher.dispatch_megatron)]  # 15
        changes += [(owner, name, _with_cuda_tensor_methods_on_cpu(vars(owner)[name]))  # 17
                    for owner, name in ((distrib_optimizer.DistributedOptimizer, "__init__"),
                                        (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
                                        (optimizer, "clip_grad_by_total_norm_fp32"),
                                        (gpt_bridge.GPTBridge, "save_weights"))]
        changes.append((WrappedTorchNorm, "__new__", _norm_without_persist(WrappedTorchNorm.__new__)))  # 18
        changes += [(cls, "__init__", _marked(vars(cls)["__init__"], dim))  # 19
                    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1), (VocabParallelEmbedding, 0))]
        saved = [(owner, name, vars(owner)[name]) for owner, name, _ in changes]
        for owner, name, value in changes:
            setattr(owner, name, value)
        try:
            with th.torch_on_cpu(optimizer, clip_grads, distrib_optimizer, mc_utils, gpt_bridge):  # 16
                yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


def layout_independent_lora_init(model_chunks, seed: int = 0) -> int:
    """Set every LoRA A (each adapter of each ``LoraParallelLinear``) from a generator seeded by its layer's global
    number and its name, the whole matrix and then this rank's TP shard of it (a ``RowParallelLinear`` A holds
    columns, a ``ColumnParallelLinear`` one rows, an ``nn.Linear`` one all); returns how many were set."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from mcore_bridge.tuners.lora import LoraParallelLinear
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    count = 0
    for chunk in model_chunks:
        for layer in (m for m in chunk.modules() if isinstance(m, TransformerLayer)):
            for name, module in layer.named_modules():
                if not isinstance(module, LoraParallelLinear):
                    continue
                for adapter, lora_a in module.lora_A.items():
                    dim = 1 if isinstance(lora_a, RowParallelLinear) else 0 if isinstance(
                        lora_a, ColumnParallelLinear) else None
                    shape = list(lora_a.weight.shape)
                    if dim is not None:
                        shape[dim] *= tp
                    key = f"{layer.layer_number}.{name}.{adapter}".encode()
                    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key))
                    full = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) / shape[-1] ** 0.5
                    with torch.no_grad():
                        lora_a.weight.copy_(full if dim is None else full.chunk(tp, dim=dim)[rank])
                    count += 1
    return count
