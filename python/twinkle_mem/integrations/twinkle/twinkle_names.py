"""Every twinkle-kit name twinkle-mem touches: what it expects of each, how it recognizes a twinkle-kit by
what its code is (not by its version string), and the accessors the rest of the integration reaches twinkle
through. A new twinkle-kit release is this module and its table.

- :data:`NAMES`: each function, method, class or attribute twinkle-mem patches or reads, the parameters it
  expects there (as ``twinkle_source.signature`` writes them: what it calls the function with), whether it
  may be absent, and why it is used.
- :data:`FEATURES`: what twinkle's code does where install() depends on it, read from its source: each
  recognized form, or None (unrecognized).
- :data:`PARTS`: what install() patches, each with the names and features it needs: a part whose names or
  features are not recognized is refused by name (twinkle runs that part as it ships it).
- Accessors: twinkle's objects (its classes, functions, metric classes) and its private attributes and helpers
  are reached only through the functions at the end; its public attributes (a loss's ``require_logps``, a
  status's ``outputs``) are read where they are used, each listed in the table.

All of this reads twinkle's source (``twinkle_source.py``) and imports nothing: install() decides at
``import twinkle`` time, before the process has imported twinkle's model modules, torch or megatron-core.
"""
import functools
import importlib
import importlib.util
import os
import sys
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from . import twinkle_source as src

MEGATRON = "twinkle.model.megatron.megatron"
STRATEGY = "twinkle.model.megatron.strategy.megatron"
TRANSFORMERS = "twinkle.model.transformers.transformers"
PROCESSOR = "twinkle.processor.base"
GKD = "twinkle.loss.gkd"
GROUPS = "twinkle.model.optimizer_group"


class Name(NamedTuple):  # (named tuples: cheaper to define than dataclasses, at `import twinkle`)
    module: str
    qualname: str  # "f", "Class.f", "Class" or "Class.attribute"
    kind: str  # "function", "staticmethod", "bound" (a name a package binds), "attribute"
    params: Optional[str] = None  # the parameters twinkle-mem calls it with (functions)
    optional: bool = False  # absent in some twinkle-kit: twinkle-mem does without it there
    why: str = ""

    def __str__(self):
        return f"{self.module}.{self.qualname}"


def _names(*entries: Name) -> Dict[str, Name]:
    return {f"{e.module}:{e.qualname}": e for e in entries}


_METRICS_WITHOUT_LOGITS = ("LossMetric", "TrainMetric", "CompletionRewardMetric", "DPOMetric", "GRPOMetric",
                           "PPOMetric", "GSPOMetric", "CISPOMetric", "PPOValueMetric")
_NEWER_METRICS = ("PPOMetric", "PPOValueMetric")  # twinkle-kit 0.5.1 on

NAMES: Dict[str, Name] = _names(
    Name("twinkle.utils.torch_utils", "selective_log_softmax", "function", "(logits, index, return_entropy=)",
         why="replaced by twinkle-mem's op, with the copies twinkle's modules bind by name"),
    Name("twinkle.utils", "Platform", "bound", why="Platform.device_prefix(): is the device an NPU (mask skip)"),
    Name("twinkle.utils.platforms.base", "Platform.device_prefix", "staticmethod", "()"),
    Name(PROCESSOR, "InputProcessor.__call__", "function", "(self, inputs, **kwargs)",
         why="wrapped: the mask type resolved and the dense-mask skip decided before collate"),
    Name(PROCESSOR, "InputProcessor._create_4d_attention_mask", "staticmethod", "(attention_mask)",
         why="replaced: nothing on the skipped path, one allocation otherwise"),
    Name(PROCESSOR, "InputProcessor.padding_free", "attribute", why="packed batches (fused distillation)"),
    Name(MEGATRON, "MegatronModel.forward_backward", "function", "(self, *, inputs, micro_batch_size=, **kwargs)",
         why="wrapped: the logits guard, the fused LM head, step hooks in megatron-core's schedule"),
    Name(MEGATRON, "MegatronModel._lazy_wrap_model", "function", "(self)",
         why="called before the fused head decides on the model as it will run"),
    Name(MEGATRON, "MegatronModel._get_default_group", "function", "(self)", why="the call's adapter"),
    Name(MEGATRON, "MegatronModel.variable_seq_lengths", "attribute", why="how twinkle returns logps"),
    Name(MEGATRON, "MegatronModel.model", "attribute", why="the model chunks: their output layers"),
    Name(STRATEGY, "MegatronStrategy.reduce_loss", "function", "(self, local_loss, local_count, logits, logps)",
         why="wrapped: the logits guard's micro-batch reports"),
    Name(STRATEGY, "MegatronStrategy.unwrap_model", "function", "(self, model)", why="the pipeline stage of a chunk"),
    Name(TRANSFORMERS, "TransformersModel.forward", "function", "(self, *, inputs, **kwargs)",
         why="wrapped: the fused LM head; return_logits noted for the logits drop"),
    Name(TRANSFORMERS, "TransformersModel.forward_only", "function", "(self, *, inputs, **kwargs)",
         why="as forward"),
    Name(TRANSFORMERS, "TransformersModel.calculate_loss", "function", "(self, **kwargs)",
         why="wrapped: the step's logits dropped once the loss has used them"),
    Name(TRANSFORMERS, "TransformersModel._lazy_wrap_model", "function", "(self)", why="as MegatronModel's"),
    Name(TRANSFORMERS, "TransformersModel._get_default_group", "function", "(self)", why="the call's adapter"),
    Name(TRANSFORMERS, "TransformersModel.model", "attribute", why="the model: its lm_head"),
    Name(TRANSFORMERS, "TransformersModel._enable_sp", "attribute", optional=True,
         why="Ulysses sequence parallelism (fused distillation)"),
    Name(GROUPS, "BaseOptimizerGroup.loss_instance", "attribute", why="the loss a call computes"),
    Name(GROUPS, "BaseOptimizerGroup.processor", "attribute", why="the call's InputProcessor"),
    Name(GROUPS, "BaseOptimizerGroup.train_status", "attribute", why="the step's inputs, outputs and metrics"),
    Name(GROUPS, "BaseOptimizerGroup.eval_status", "attribute", why="as train_status, for forward_only"),
    Name(GROUPS, "TrainStatus.inputs", "attribute"), Name(GROUPS, "TrainStatus.outputs", "attribute"),
    Name(GROUPS, "TrainStatus.metrics", "attribute"),
    *(Name("twinkle.loss.base", f"Loss.require_{flag}", "attribute", optional=True,
           why="what a loss needs (read with twinkle's defaults where a release lacks one)")
      for flag in ("logits", "logps", "entropy", "values")),
    Name("twinkle.utils.nccl_safe", "SafeLossWrapper._loss_instance", "attribute", optional=True,
         why="the loss inside twinkle's wrapper (0.5.0 on)"),
    Name(GKD, "GKDLoss.__call__", "function",
         "(self, inputs, outputs, *, teacher_logits=, teacher_topk_logprobs=, teacher_topk_indices=, topk=, **kwargs)",
         why="replaced: the distillation loss in fp32 from twinkle-mem's ops"),
    Name(GKD, "GKDLoss._generalized_jsd_loss", "staticmethod",
         "(student_logits, teacher_logits=, labels=, beta=, temperature=, chunk_size=, topk=, "
         "teacher_topk_logprobs=, teacher_topk_indices=)", why="twinkle's own divergence: calls it covers"),
    Name(GKD, "GKDLoss.beta", "attribute"), Name(GKD, "GKDLoss.temperature", "attribute"),
    Name(GKD, "GKDLoss.ignore_index", "attribute"),
    Name("twinkle.data_format", "LossOutput", "bound", why="what a loss returns"),
    Name("twinkle.metric", "Accuracy", "bound",
         why="counts the step when the logits are dropped, and a fused distillation step from linear_argmax"),
    Name("twinkle.metric.accuracy", "Accuracy.accumulate", "function", "(self, inputs, outputs, **kwargs)"),
    Name("twinkle.metric.accuracy", "Accuracy.total_correct", "attribute"),
    Name("twinkle.metric.accuracy", "Accuracy.total_count", "attribute"),
    *(Name("twinkle.metric", m, "bound", optional=m in _NEWER_METRICS, why="a metric that never reads the logits")
      for m in _METRICS_WITHOUT_LOGITS),
)


def _check_name(source: src.TwinkleSource, name: Name) -> Optional[str]:
    """Why ``name`` is not what twinkle-mem expects, or None."""
    *owner, last = name.qualname.split(".")
    if not source.has_module(name.module):
        return "absent (no such module)"
    if name.kind == "bound":
        return None if source.binds(name.module, last) else "absent"
    if name.kind == "attribute":
        return None if source.declares(name.module, owner[0], last) else "absent"
    node = source.function(name.module, name.qualname, body=False)
    if node is None:
        return "absent"
    if (name.kind == "staticmethod") != src.decorated(node, "staticmethod") and owner:
        return "a staticmethod expected" if name.kind == "staticmethod" else "an unexpected staticmethod"
    return src.accepts(node, name.params) if name.params is not None else None


# --- features: what twinkle's code does where install() depends on it, read from it ----------------------------

def _megatron_logits(source) -> Optional[str]:
    """How the Megatron forward step hands logits to ``reduce_loss``: ``"every micro-batch"`` (the output tensor
    itself: twinkle-kit 0.4.0 to 0.5.1, the logits guard applies), ``"when asked"`` (``logits if ... else None``:
    twinkle guards them itself, no second guard), or None (another form: unrecognized)."""
    fb = source.function(MEGATRON, "MegatronModel.forward_backward")
    forms = set()
    for call in src.calls(fb, "reduce_loss") if fb is not None else []:
        logits = call.args[2] if len(call.args) > 2 else None
        owner = src.enclosing_function(fb, call)
        output = owner.args.args[0].arg if owner is not None and owner.args.args else None
        if isinstance(logits, src.ast.Name) and logits.id == output:
            forms.add("every micro-batch")
        elif isinstance(logits, src.ast.IfExp) and isinstance(logits.orelse, src.ast.Constant) \
                and logits.orelse.value is None:
            forms.add("when asked")
        else:
            return None
    return forms.pop() if len(forms) == 1 else None


_FB_NAME, _FWD_NAMES = "MegatronModel.forward_backward", ("TransformersModel.forward", "TransformersModel.forward_only")

FEATURES: Dict[str, Tuple[str, Callable[[src.TwinkleSource], object]]] = {
    "megatron_logits": (f"{_FB_NAME}: which logits its forward step reports", _megatron_logits),
    "megatron_log_probs": (f"{_FB_NAME}: selective_log_softmax of the model's divided output",
                           src.feature(src.divides_then_computes, MEGATRON, _FB_NAME)),
    "transformers_log_probs": ("TransformersModel.forward / forward_only: selective_log_softmax of the model's "
                               "divided output", src.feature(src.divides_then_computes, TRANSFORMERS, *_FWD_NAMES)),
    # Forward steps that run no selective_log_softmax for a loss with require_logps = False (0.5.0 on): there the
    # fused head hands a distillation loss the output layer's input; elsewhere a GKD call keeps its logits.
    "megatron_skips_unused_log_probs": (f"{_FB_NAME} reads require_logps",
                                        src.feature(src.reads, MEGATRON, _FB_NAME, word="require_logps")),
    "transformers_skips_unused_log_probs": ("TransformersModel.forward reads require_logps",
                                            src.feature(src.reads, TRANSFORMERS, *_FWD_NAMES, word="require_logps")),
    "megatron_catches_step_errors": (f"{_FB_NAME}: TWINKLE_FAIL_FAST=0 catches a micro-batch's error",
                                     src.feature(src.calls_function, MEGATRON, _FB_NAME, function="_is_fail_fast")),
    "gkd_ignore_index": ("GKDLoss._generalized_jsd_loss masks the loss's ignore_index (0.4.0: always -100)",
                         src.feature(src.has_param, GKD, "GKDLoss._generalized_jsd_loss", param="ignore_index")),
}


# --- parts: what install() patches, and what each needs ------------------------------------------------------------

class Part(NamedTuple):
    key: str
    what: str
    asked: Callable[[dict], bool]  # whether install()'s settings ask for it
    names: Tuple[str, ...]  # keys of NAMES
    features: Tuple[Tuple[str, tuple], ...] = ()  # (feature, the values it works with)


_FB, _FWD = f"{MEGATRON}:MegatronModel.forward_backward", f"{TRANSFORMERS}:TransformersModel.forward"
_MODELS = (f"{MEGATRON}:MegatronModel.model", f"{TRANSFORMERS}:TransformersModel.model")
_STATUS = (f"{GROUPS}:BaseOptimizerGroup.train_status", f"{GROUPS}:BaseOptimizerGroup.eval_status",
           f"{GROUPS}:TrainStatus.inputs", f"{GROUPS}:TrainStatus.outputs")
_CALL = (f"{GROUPS}:BaseOptimizerGroup.loss_instance", f"{GROUPS}:BaseOptimizerGroup.processor")

PARTS: Tuple[Part, ...] = (
    Part("log_softmax", "selective_log_softmax -> twinkle-mem's op", lambda s: s["log_softmax"],
         ("twinkle.utils.torch_utils:selective_log_softmax", )),
    Part("gkd_loss", "GKDLoss in fp32 from twinkle-mem's ops", lambda s: s["log_softmax"],
         tuple(k for k in NAMES if k.startswith(GKD)) + ("twinkle.data_format:LossOutput", )),
    Part("mask_skip", "causal-mask skip at collate time", lambda s: True,
         (f"{PROCESSOR}:InputProcessor.__call__", f"{PROCESSOR}:InputProcessor._create_4d_attention_mask",
          "twinkle.utils:Platform", "twinkle.utils.platforms.base:Platform.device_prefix")),
    Part("megatron_logits_guard", "Megatron logits guard, failed micro-batches", lambda s: s["logits_guard"],
         (_FB, f"{STRATEGY}:MegatronStrategy.reduce_loss", f"{STRATEGY}:MegatronStrategy.unwrap_model",
          f"{MEGATRON}:MegatronModel._get_default_group", f"{MEGATRON}:MegatronModel.variable_seq_lengths") + _STATUS
         + _CALL, (("megatron_logits", ("every micro-batch", "when asked")), )),
    Part("megatron_fused_lm_head", "Megatron fused LM head", lambda s: s["fused_lm_head"],
         (_FB, f"{MEGATRON}:MegatronModel._lazy_wrap_model", f"{MEGATRON}:MegatronModel._get_default_group",
          f"{STRATEGY}:MegatronStrategy.unwrap_model", _MODELS[0]) + _CALL, (("megatron_log_probs", (True, )), )),
    Part("transformers_logits_drop", "transformers: the step's logits dropped after the loss",
         lambda s: s["logits_guard"],
         (_FWD, f"{TRANSFORMERS}:TransformersModel.forward_only", f"{TRANSFORMERS}:TransformersModel.calculate_loss",
          f"{TRANSFORMERS}:TransformersModel._get_default_group", f"{GROUPS}:TrainStatus.metrics") + _STATUS
         + tuple(k for k in NAMES if k.startswith("twinkle.metric"))),
    Part("transformers_fused_lm_head", "transformers fused LM head", lambda s: s["fused_lm_head"],
         (_FWD, f"{TRANSFORMERS}:TransformersModel.forward_only", f"{TRANSFORMERS}:TransformersModel._lazy_wrap_model",
          f"{TRANSFORMERS}:TransformersModel._get_default_group", f"{PROCESSOR}:InputProcessor.padding_free",
          _MODELS[1], f"{GROUPS}:BaseOptimizerGroup.train_status", f"{GROUPS}:TrainStatus.metrics",
          "twinkle.metric:Accuracy", "twinkle.metric.accuracy:Accuracy.accumulate") + _CALL,
         (("transformers_log_probs", (True, )), )),
)


class Found(NamedTuple):
    """A twinkle-kit as install() sees it: each name's problem (None: as expected), each feature's form."""
    folder: str
    version: Optional[str]
    names: Dict[str, Optional[str]]
    features: Dict[str, object]

    def refusals(self, part: Part) -> Tuple[str, ...]:
        """Why ``part`` cannot be patched here, one reason per name or feature; () where it can."""
        why = [f"{NAMES[k]}: {self.names[k]}" for k in part.names if self.names[k] and not NAMES[k].optional]
        why += [f"{FEATURES[f][0]}: not recognized" for f, accepted in part.features
                if self.features[f] not in accepted]
        return tuple(why)


@functools.lru_cache(maxsize=None)
def recognize(folder: str) -> Found:
    """Read the twinkle package at ``folder`` (nothing imported) against NAMES and FEATURES."""
    source = src.TwinkleSource(folder)
    # The features first: they parse their functions whole, which the names' header checks then reuse.
    features = {k: check(source) for k, (_, check) in FEATURES.items()}
    return Found(folder, source.version(), {k: _check_name(source, n) for k, n in NAMES.items()}, features)


def twinkle_folder() -> str:
    """The folder of the twinkle package this process imports (found, not imported)."""
    module = sys.modules.get("twinkle")
    spec = module.__spec__ if module is not None else importlib.util.find_spec("twinkle")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("twinkle-kit is not installed (no `twinkle` package on the path)")
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def found() -> Found:
    """The twinkle-kit of this process, as install() sees it."""
    return recognize(twinkle_folder())


# --- accessors: twinkle's objects and attributes, reached only here ---------------------------------------------

def twinkle_attribute(module: str, qualname: str):
    """A twinkle object (``"twinkle.loss.gkd"``, ``"GKDLoss"``) of an imported module."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def platform():
    return twinkle_attribute("twinkle", "Platform")


def version() -> str:
    return twinkle_attribute("twinkle.version", "__version__")


def optimizer_group(model, kwargs):
    """twinkle's optimizer group of the call's adapter (the default group without ``adapter_name``)."""
    name = kwargs["adapter_name"] if "adapter_name" in kwargs else model._get_default_group()
    return model.optimizer_group[name]


def loss_instance(model, kwargs):
    try:
        return optimizer_group(model, kwargs).loss_instance
    except (AttributeError, KeyError):
        return None  # forward_backward itself reports the bad adapter name


def call_processor(model, kwargs):
    return optimizer_group(model, kwargs).processor


def status(model, kwargs, forward_only: bool):
    """The train status (``forward_only``: the eval status) twinkle keeps the step's inputs and outputs in."""
    group = optimizer_group(model, kwargs)
    return group.eval_status if forward_only else group.train_status


def remote_handle(model) -> bool:
    """Whether ``model`` is twinkle's Ray driver-side handle (its methods ran in the workers, which hold the
    state; ``remote_class`` gives the handle no ``optimizer_group``)."""
    return "optimizer_group" not in vars(model) and not hasattr(type(model), "optimizer_group")


def unwrapped_loss(loss):
    """The loss inside twinkle's SafeLossWrapper (0.5.0 on, it wraps every loss it is given), or the loss."""
    return getattr(loss, "_loss_instance", loss)


def lazy_wrap_model(model) -> None:
    model._lazy_wrap_model()


def unwrap_model(model, chunks):
    return model.strategy.unwrap_model(chunks)


def variable_seq_lengths(model) -> bool:
    return getattr(model, "variable_seq_lengths", False)


def sequence_parallel(model) -> bool:
    return getattr(model, "_enable_sp", False)


def padding_free(processor) -> bool:
    return getattr(processor, "padding_free", False)


def forward_step_log_probs(loss_func):
    """(whether twinkle's forward step handed its loss function log-probs, which): the keyword of twinkle's
    ``partial(post_loss_function, logps=...)``."""
    keywords = getattr(loss_func, "keywords", {})
    return "logps" in keywords, keywords.get("logps")


def gkd_loss_class():
    return twinkle_attribute(GKD, "GKDLoss")


def gkd_divergence():
    """twinkle's own ``GKDLoss._generalized_jsd_loss`` (as defined, whatever is installed over the class)."""
    return vars(gkd_loss_class())["_generalized_jsd_loss"].__func__


def loss_output(loss):
    return twinkle_attribute("twinkle.data_format", "LossOutput")(loss=loss, num_tokens=0)


def accuracy_class():
    return twinkle_attribute("twinkle.metric", "Accuracy")


def metrics_without_logits() -> tuple:
    """twinkle's metric classes that never read ``outputs['logits']``, those this twinkle-kit has
    (EmbeddingMetric reads them: the sentence embeddings of the embedding task)."""
    metric = importlib.import_module("twinkle.metric")
    return tuple(getattr(metric, name) for name in _METRICS_WITHOUT_LOGITS if hasattr(metric, name))


def post_process_owner(chunk):
    """The module of a model chunk that owns the output layer (megatron-core's GPTModel or mcore_bridge's), or None
    on other pipeline stages: the module that registers ``output_layer`` as its own child (a wrapper reaching it
    through ``__getattr__`` does not), with ``post_process`` not False. The rule twinkle's embedding patch
    (``twinkle.patch.megatron_emb._find_post_process_owner``, 0.5.0 on) follows, written here so that 0.4.0,
    which has none, gets the same."""
    for module in chunk.modules():
        post_process = getattr(module, "post_process", None)
        if "output_layer" in module._modules and (post_process is None or post_process):
            return module
    return None
