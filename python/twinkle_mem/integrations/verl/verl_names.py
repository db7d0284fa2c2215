"""Every verl name twinkle-mem touches, what it expects of each, and how it recognizes a verl by what its code is
(not by its version string): the same scheme as twinkle's (``core/recognition.py``). A new verl release is this
module and its table.

- :data:`NAMES`: each function twinkle-mem replaces, with the parameters verl calls it with.
- :data:`FEATURES`: what verl's code does where install() depends on it, read from its source (nothing imported):
  that ``import verl`` loads the ``verl.plugins`` entry points (0.9.0 on; how twinkle-mem reaches every Ray
  worker), that ``patch_forward_with_backends`` allows the "torch" backend and sets the model class's forward,
  that the per-architecture fused forwards call ``FusedLinearForPPO.forward`` by keyword, that the Megatron fused
  forwards call ``linear_cross_entropy(hidden, weight, labels, temperature, "none", group)``, that the Megatron
  engine enables its fused forward in ``_maybe_enable_fused_kernels``.
- :data:`PARTS`: what install() patches: a part whose names or features are not recognized is refused by name.
"""
import ast
from typing import Dict, Tuple

from ..core import source as src
from ..core.recognition import Engine, Feature, Name, Part, names_table
from .settings import LOGITS_PATH

MONKEY_PATCH = "verl.models.transformers.monkey_patch"
EXPERIMENTAL = "verl.utils.experimental.torch_functional"
KERNEL = "verl.utils.kernel.linear_cross_entropy"
MCORE_FUSED = "verl.models.mcore.model_forward_fused"
MCORE_1F1B = "verl.models.mcore.model_forward_1f1b_overlap"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
MINDSPEED_ENGINE = "verl.workers.engine.mindspeed.transformer_impl"
TORCH_FUNCTIONAL = "verl.utils.torch_functional"
TENSOR_PARALLEL = "verl.utils.megatron.tensor_parallel"
# The per-architecture fused forwards (monkey_patch.patch_forward_with_backends picks one by model type)
ARCHITECTURES = tuple(f"verl.models.transformers.{m}" for m in ("dense_common", "qwen2_vl", "qwen3_vl", "glm4v",
                                                                 "qwen3_5"))

PATCH_FORWARD_WITH_BACKENDS = Name(MONKEY_PATCH, "patch_forward_with_backends", "function",
                                   "(model, use_fused_kernels=, fused_kernels_backend=)",
                                   why="wrapped: impl_backend=twinkle takes verl's fused forward for the model's "
                                       "architecture, its head on twinkle-mem")
FUSED_LINEAR_FORWARD = Name(EXPERIMENTAL, "FusedLinearForPPO.forward", "function",
                            "(self, hidden_states, vocab_weights, input_ids, temperature=)",
                            why="wrapped: log-probs and entropy from twinkle-mem's fused head in a twinkle model")
FUSED_LINEAR_INIT = Name(EXPERIMENTAL, "FusedLinearForPPO.__init__", "function", "(self, chunk_size=, impl_backend=)",
                         optional=True, why="wrapped: accepts impl_backend='twinkle', the backend a twinkle model "
                                            "records (0.9.1's forwards build it from that; 0.9.0's take none)")
FSDP_FORWARD_BACKWARD = Name(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", "function",
                             "(self, data, loss_function, forward_only=)", optional=True,
                             why="wrapped: tells twinkle-mem's head whether the batch trains the entropy")
MEGATRON_FORWARD_BACKWARD = Name(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch", "function",
                                 "(self, data, loss_function, forward_only=)", optional=True,
                                 why="wrapped: tells twinkle-mem's head whether the batch trains the entropy")
LINEAR_CROSS_ENTROPY = Name(KERNEL, "linear_cross_entropy", "bound",
                            why="replaced (and where the Megatron forwards bind it): twinkle-mem's fused head for "
                                "an output weight the engine marked")
ENABLE_FUSED_KERNELS = Name(MEGATRON_ENGINE, "MegatronEngine._maybe_enable_fused_kernels", "function", "(self)",
                            why="wrapped: marks the output weights of an engine with impl_backend=twinkle")
LOGPROBS_FROM_LOGITS = Name(TORCH_FUNCTIONAL, "logprobs_from_logits", "function", "(logits, labels, inplace_backward=)",
                            why="replaced (with its copies bound by name): twinkle-mem's op")
ENTROPY_FROM_LOGITS = Name(TORCH_FUNCTIONAL, "entropy_from_logits", "function", "(logits)",
                           why="replaced: twinkle-mem's op (the FSDP engine binds it when it is built)")
ENTROPY_WITH_CHUNKING = Name(TORCH_FUNCTIONAL, "entropy_from_logits_with_chunking", "function",
                             "(logits, chunk_size=)", why="as entropy_from_logits")
VOCAB_PARALLEL_LOG_PROBS = Name(TENSOR_PARALLEL, "vocab_parallel_log_probs_from_logits", "function",
                                "(logits, labels)", why="replaced (with its copies bound by name): twinkle-mem's op "
                                                        "over the TP group")
VOCAB_PARALLEL_ENTROPY = Name(TENSOR_PARALLEL, "vocab_parallel_entropy", "function", "(vocab_parallel_logits)",
                              why="as vocab_parallel_log_probs_from_logits")
VOCAB_PARALLEL_ENTROPY_WITH_CHUNKING = Name(TENSOR_PARALLEL, "vocab_parallel_entropy_with_chunking", "function",
                                            "(vocab_parallel_logits, chunk_size=)",
                                            why="as vocab_parallel_log_probs_from_logits")

NAMES: Dict[str, Name] = names_table(
    PATCH_FORWARD_WITH_BACKENDS, FUSED_LINEAR_FORWARD, FUSED_LINEAR_INIT, FSDP_FORWARD_BACKWARD, LINEAR_CROSS_ENTROPY,
    ENABLE_FUSED_KERNELS, MEGATRON_FORWARD_BACKWARD,
    LOGPROBS_FROM_LOGITS, ENTROPY_FROM_LOGITS, ENTROPY_WITH_CHUNKING, VOCAB_PARALLEL_LOG_PROBS,
    VOCAB_PARALLEL_ENTROPY, VOCAB_PARALLEL_ENTROPY_WITH_CHUNKING,
)


# --- features: what verl's code does where install() depends on it, read from it -------------------------------

def _loads_plugins(source: src.PackageSource) -> bool:
    """verl's package loads the entry points of the group ``verl.plugins`` (0.9.0 on)."""
    tree = source.module_node("verl")
    return tree is not None and "verl.plugins" in src.strings(tree)


def _allows_torch_backend(node) -> bool:
    """patch_forward_with_backends names the "torch" backend and sets the model class's forward."""
    sets_forward = any(isinstance(target, ast.Attribute) and target.attr == "forward"
                       and isinstance(target.value, ast.Attribute) and target.value.attr == "__class__"
                       for assign in ast.walk(node) if isinstance(assign, ast.Assign) for target in assign.targets)
    return sets_forward and "torch" in src.strings(node)


_FUSED_LINEAR_KEYWORDS = {"hidden_states", "vocab_weights", "input_ids", "temperature"}


def _calls_fused_linear(node) -> bool:
    """A fused forward builds a FusedLinearForPPO and calls its forward with the four keywords."""
    return bool(src.calls(node, "FusedLinearForPPO")) and any(
        _FUSED_LINEAR_KEYWORDS <= {k.arg for k in call.keywords} for call in src.calls(node, "forward"))


def _per_architecture_forwards(source: src.PackageSource) -> bool:
    """Every per-architecture fused forward of this verl (dense_common's at least) calls FusedLinearForPPO so."""
    nodes = [source.function(m, "forward_with_torch_backend") for m in ARCHITECTURES if source.has_module(m)]
    return bool(nodes) and source.has_module(ARCHITECTURES[0]) and all(
        node is not None and _calls_fused_linear(node) for node in nodes)


def _calls_kernel(node) -> bool:
    """Every linear_cross_entropy call passes (hidden, weight, labels, temperature, "none", group)."""
    found = src.calls(node, "linear_cross_entropy")
    return bool(found) and all(len(call.args) == 6 and isinstance(call.args[4], ast.Constant)
                               and call.args[4].value == "none" for call in found)


def _megatron_forwards(source: src.PackageSource) -> bool:
    """The Megatron fused forwards call linear_cross_entropy as :func:`_calls_kernel` says (the 1F1B-overlap forward
    where this verl has it)."""
    forwards = [source.function(MCORE_FUSED, "_fused_GPTModel_forward")]
    if source.has_module(MCORE_1F1B):
        forwards.append(source.function(MCORE_1F1B, "gptmodel_forward_1f1b_overlap"))
    return all(node is not None and _calls_kernel(node) for node in forwards)


def _mindspeed_inherits(source: src.PackageSource) -> bool:
    """The mindspeed (NPU) engine keeps the Megatron engine's _maybe_enable_fused_kernels (it does not define one)."""
    tree = source.module_node(MINDSPEED_ENGINE)
    return tree is not None and not any(isinstance(node, ast.FunctionDef) and node.name == "_maybe_enable_fused_kernels"
                                        for node in ast.walk(tree))


LOADS_PLUGINS = Feature("loads_plugins", "verl/__init__.py loads the verl.plugins entry points at `import verl`",
                        _loads_plugins)
ALLOWS_TORCH_BACKEND = Feature("allows_torch_backend", "patch_forward_with_backends sets the torch backend's forward",
                               src.feature(_allows_torch_backend, MONKEY_PATCH, "patch_forward_with_backends"))
FORWARDS_CALL_FUSED_LINEAR = Feature("forwards_call_fused_linear", "the per-architecture forward_with_torch_backend "
                                     "calls FusedLinearForPPO.forward(hidden_states=, vocab_weights=, input_ids=, "
                                     "temperature=)", _per_architecture_forwards)
MEGATRON_FORWARDS_CALL_KERNEL = Feature("megatron_forwards_call_kernel", "the Megatron fused forwards call "
                                        "linear_cross_entropy(hidden, weight, labels, temperature, 'none', tp_group)",
                                        _megatron_forwards)
ENGINE_ENABLES_FUSED_FORWARD = Feature(
    "engine_enables_fused_forward", "MegatronEngine._maybe_enable_fused_kernels patches the fused forward",
    src.feature(src.calls_function, MEGATRON_ENGINE, "MegatronEngine._maybe_enable_fused_kernels",
                function="patch_fused_forward"))
MINDSPEED_INHERITS = Feature("mindspeed_inherits", "the mindspeed engine keeps MegatronEngine's "
                             "_maybe_enable_fused_kernels", _mindspeed_inherits)

FEATURES: Tuple[Feature, ...] = (LOADS_PLUGINS, ALLOWS_TORCH_BACKEND, FORWARDS_CALL_FUSED_LINEAR,
                                 MEGATRON_FORWARDS_CALL_KERNEL, ENGINE_ENABLES_FUSED_FORWARD, MINDSPEED_INHERITS)


# --- parts: what install() patches, and what each needs ------------------------------------------------------------

# Every part needs verl to load the plugin in every process (the driver and each Ray worker): where it does not
# (verl 0.8 and before), impl_backend=twinkle would reach the workers without twinkle-mem in them.
_EVERY_PROCESS = ((LOADS_PLUGINS, (True, )), )

FSDP_FUSED_HEAD = Part("fsdp_fused_head", "FSDP impl_backend=twinkle: FusedLinearForPPO on twinkle-mem's fused head",
                       None,
                       (PATCH_FORWARD_WITH_BACKENDS, FUSED_LINEAR_FORWARD, FUSED_LINEAR_INIT, FSDP_FORWARD_BACKWARD),
                       _EVERY_PROCESS + ((ALLOWS_TORCH_BACKEND, (True, )), (FORWARDS_CALL_FUSED_LINEAR, (True, ))))
MEGATRON_FUSED_HEAD = Part("megatron_fused_head", "Megatron impl_backend=twinkle: linear_cross_entropy on "
                           "twinkle-mem's fused head", None,
                           (LINEAR_CROSS_ENTROPY, ENABLE_FUSED_KERNELS, MEGATRON_FORWARD_BACKWARD),
                           _EVERY_PROCESS + ((MEGATRON_FORWARDS_CALL_KERNEL, (True, )),
                                             (ENGINE_ENABLES_FUSED_FORWARD, (True, ))))
LOGITS_PATH_PART = Part("logits_path", "logprobs_from_logits, entropy_from_logits[_with_chunking] -> twinkle-mem's op",
                        LOGITS_PATH, (LOGPROBS_FROM_LOGITS, ENTROPY_FROM_LOGITS, ENTROPY_WITH_CHUNKING), _EVERY_PROCESS)
MEGATRON_LOGITS_PATH = Part("megatron_logits_path", "vocab_parallel_log_probs_from_logits, vocab_parallel_entropy"
                            "[_with_chunking] -> twinkle-mem's op", LOGITS_PATH,
                            (VOCAB_PARALLEL_LOG_PROBS, VOCAB_PARALLEL_ENTROPY, VOCAB_PARALLEL_ENTROPY_WITH_CHUNKING),
                            _EVERY_PROCESS)

PARTS: Tuple[Part, ...] = (FSDP_FUSED_HEAD, MEGATRON_FUSED_HEAD, LOGITS_PATH_PART, MEGATRON_LOGITS_PATH)


# --- engines: which parts serve each of verl's engines (verl/workers/engine/), read from its code -------------------
# (for `python -m twinkle_mem`: install() patches parts; an engine goes through a part's code or it does not)

def _engine(name: str) -> str:
    return f"verl.workers.engine.{name}.transformer_impl"


def _module_calls(module: str, function: str, doc: str) -> Feature:
    """``module`` calls ``function`` (the module read whole: only ``python -m twinkle_mem`` reads it)."""
    def holds(source: src.PackageSource) -> bool:
        tree = source.module_node(module)
        return tree is not None and bool(src.calls(tree, function))
    return Feature(f"{module}:{function}", doc, holds)


def _keeps(module: str, cls: str, method: str, doc: str) -> Feature:
    """``cls`` of ``module`` keeps its base engine's ``method``: it defines none, or one that calls the base's."""
    def holds(source: src.PackageSource) -> bool:
        tree = source.module_node(module)
        if tree is None or not any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body):
            return False
        node = source.function(module, f"{cls}.{method}")
        return node is None or src.calls_function(node, method)
    return Feature(f"{module}:{cls}.{method}", doc, holds)


def _fsdp_like(name: str, cls: str) -> Engine:
    """An engine built on transformers models: the FSDP fused head serves it where it builds its model through
    verl's apply_monkey_patch (where impl_backend picks verl's fused forward), the logits path where it computes
    log-probs with verl's logprobs_from_logits."""
    module = _engine(name)
    return Engine(name, module, (
        (FSDP_FUSED_HEAD, _module_calls(module, "apply_monkey_patch", f"{cls} builds its model through verl's "
                                        "apply_monkey_patch, where impl_backend picks verl's fused forward")),
        (LOGITS_PATH_PART, _module_calls(module, "logprobs_from_logits", f"the {name} engine computes log-probs "
                                         "with verl's logprobs_from_logits"))))


ENGINES: Tuple[Engine, ...] = (
    _fsdp_like("fsdp", "FSDPEngine"),
    Engine("megatron", MEGATRON_ENGINE, (
        (MEGATRON_FUSED_HEAD, ENGINE_ENABLES_FUSED_FORWARD),
        (MEGATRON_LOGITS_PATH, _module_calls(MEGATRON_ENGINE, "vocab_parallel_log_probs_from_logits", "the megatron "
                                             "engine computes log-probs with verl's vocab_parallel_log_probs_from_"
                                             "logits")))),
    Engine("mindspeed", MINDSPEED_ENGINE, (
        (MEGATRON_FUSED_HEAD, MINDSPEED_INHERITS),
        (MEGATRON_LOGITS_PATH, _keeps(MINDSPEED_ENGINE, "MindspeedEngineWithLMHead", "forward_step",
                                      "MindspeedEngineWithLMHead keeps MegatronEngineWithLMHead's forward step")))),
    _fsdp_like("automodel", "AutomodelEngine"),
    _fsdp_like("torchtitan", "TorchTitanEngine"),
    Engine("veomni", _engine("veomni"), (  # (a subclass of the FSDP engine, with a model build of its own)
        (FSDP_FUSED_HEAD, _keeps(_engine("veomni"), "VeOmniEngine", "_build_model_optimizer", "VeOmniEngine builds "
                                 "its model as FSDPEngine does, through verl's apply_monkey_patch")),
        (LOGITS_PATH_PART, _keeps(_engine("veomni"), "VeOmniEngineWithLMHead", "prepare_model_outputs",
                                  "VeOmniEngineWithLMHead keeps FSDPEngineWithLMHead's log-probs")))),
)


def impl_backend(model_config) -> object:
    """verl's ``fused_kernel_options.impl_backend`` of a model config (None where unset)."""
    options = getattr(model_config, "fused_kernel_options", None) or {}
    return options.get("impl_backend")
