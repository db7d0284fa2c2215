"""Every twinkle-kit name twinkle-mem touches: what it expects of each, how it recognizes a twinkle-kit by
what its code is (not by its version string), and the accessors the rest of the integration reaches twinkle
through. A new twinkle-kit release is this module and its table.

- :data:`NAMES`: each function, method, class or attribute twinkle-mem patches or reads, the parameters it
  expects there (as ``core/source.signature`` writes them: what it calls the function with), whether it
  may be absent, and why it is used. Those a part or a patch point refers to are constants of their own.
- :data:`FEATURES`: what twinkle's code does where install() depends on it, read from its source: each
  recognized form, or None (unrecognized).
- :data:`PARTS`: what install() patches, each with the names and features it needs and the setting that asks
  for it: a part whose names or features are not recognized is refused by name (twinkle runs that part as it
  ships it).
- Accessors: twinkle's objects (its classes, functions, metric classes) and its private attributes and helpers
  are reached only through the functions at the end; its public attributes (a loss's ``require_logps``, a
  status's ``outputs``) are read where they are used, each listed in the table.

All of this reads twinkle's source (``core/source.py``) and imports nothing: install() decides at
``import twinkle`` time, before the process has imported twinkle's model modules, torch or megatron-core. The
types (Name, Feature, Part, Found) and the reading are the integrations' shared core (``core/recognition.py``).
"""
import importlib
import sys
from typing import Dict, Optional, Tuple

from ..core import source as src
from ..core.recognition import Feature, Name, Part, names_table
from .settings import FUSED_LM_HEAD, LOG_SOFTMAX, LOGITS_GUARD

MEGATRON = "twinkle.model.megatron.megatron"
STRATEGY = "twinkle.model.megatron.strategy.megatron"
TRANSFORMERS = "twinkle.model.transformers.transformers"
PROCESSOR = "twinkle.processor.base"
GKD = "twinkle.loss.gkd"
GROUPS = "twinkle.model.optimizer_group"
METRIC = "twinkle.metric"

# --- the names a part or a patch point refers to ------------------------------------------------------------------

SELECTIVE_LOG_SOFTMAX = Name("twinkle.utils.torch_utils", "selective_log_softmax", "function",
                             "(logits, index, return_entropy=)",
                             why="replaced by twinkle-mem's op, with the copies twinkle's modules bind by name")
PLATFORM = Name("twinkle.utils", "Platform", "bound", why="Platform.device_prefix(): is the device an NPU (mask skip)")
DEVICE_PREFIX = Name("twinkle.utils.platforms.base", "Platform.device_prefix", "staticmethod", "()")
PROCESSOR_CALL = Name(PROCESSOR, "InputProcessor.__call__", "function", "(self, inputs, **kwargs)",
                      why="wrapped: the mask type resolved and the dense-mask skip decided before collate")
CREATE_MASK = Name(PROCESSOR, "InputProcessor._create_4d_attention_mask", "staticmethod", "(attention_mask)",
                   why="replaced: nothing on the skipped path, one allocation otherwise")
PADDING_FREE = Name(PROCESSOR, "InputProcessor.padding_free", "attribute", why="packed batches (fused distillation)")
FORWARD_BACKWARD = Name(MEGATRON, "MegatronModel.forward_backward", "function",
                        "(self, *, inputs, micro_batch_size=, **kwargs)",
                        why="wrapped: the logits guard, the fused LM head, step hooks in megatron-core's schedule")
MEGATRON_LAZY_WRAP = Name(MEGATRON, "MegatronModel._lazy_wrap_model", "function", "(self)",
                          why="called before the fused head decides on the model as it will run")
MEGATRON_GROUP = Name(MEGATRON, "MegatronModel._get_default_group", "function", "(self)", why="the call's adapter")
VARIABLE_SEQ_LENGTHS = Name(MEGATRON, "MegatronModel.variable_seq_lengths", "attribute",
                            why="how twinkle returns logps")
MEGATRON_CHUNKS = Name(MEGATRON, "MegatronModel.model", "attribute", why="the model chunks: their output layers")
REDUCE_LOSS = Name(STRATEGY, "MegatronStrategy.reduce_loss", "function",
                   "(self, local_loss, local_count, logits, logps)",
                   why="wrapped: the logits guard's micro-batch reports")
UNWRAP_MODEL = Name(STRATEGY, "MegatronStrategy.unwrap_model", "function", "(self, model)",
                    why="the pipeline stage of a chunk")
TRANSFORMERS_FORWARD = Name(TRANSFORMERS, "TransformersModel.forward", "function", "(self, *, inputs, **kwargs)",
                            why="wrapped: the fused LM head; return_logits noted for the logits drop")
TRANSFORMERS_FORWARD_ONLY = Name(TRANSFORMERS, "TransformersModel.forward_only", "function",
                                 "(self, *, inputs, **kwargs)", why="as forward")
CALCULATE_LOSS = Name(TRANSFORMERS, "TransformersModel.calculate_loss", "function", "(self, **kwargs)",
                      why="wrapped: the step's logits dropped once the loss has used them")
TRANSFORMERS_LAZY_WRAP = Name(TRANSFORMERS, "TransformersModel._lazy_wrap_model", "function", "(self)",
                              why="as MegatronModel's")
TRANSFORMERS_GROUP = Name(TRANSFORMERS, "TransformersModel._get_default_group", "function", "(self)",
                          why="the call's adapter")
TRANSFORMERS_MODEL = Name(TRANSFORMERS, "TransformersModel.model", "attribute", why="the model: its lm_head")
LOSS_INSTANCE = Name(GROUPS, "BaseOptimizerGroup.loss_instance", "attribute", why="the loss a call computes")
CALL_PROCESSOR = Name(GROUPS, "BaseOptimizerGroup.processor", "attribute", why="the call's InputProcessor")
TRAIN_STATUS = Name(GROUPS, "BaseOptimizerGroup.train_status", "attribute",
                    why="the step's inputs, outputs and metrics")
EVAL_STATUS = Name(GROUPS, "BaseOptimizerGroup.eval_status", "attribute", why="as train_status, for forward_only")
STATUS_INPUTS = Name(GROUPS, "TrainStatus.inputs", "attribute")
STATUS_OUTPUTS = Name(GROUPS, "TrainStatus.outputs", "attribute")
STATUS_METRICS = Name(GROUPS, "TrainStatus.metrics", "attribute")
GKD_CALL = Name(GKD, "GKDLoss.__call__", "function",
                "(self, inputs, outputs, *, teacher_logits=, teacher_topk_logprobs=, teacher_topk_indices=, topk=, "
                "**kwargs)", why="replaced: the distillation loss in fp32 from twinkle-mem's ops")
GKD_NAMES = (
    GKD_CALL,
    Name(GKD, "GKDLoss._generalized_jsd_loss", "staticmethod",
         "(student_logits, teacher_logits=, labels=, beta=, temperature=, chunk_size=, topk=, "
         "teacher_topk_logprobs=, teacher_topk_indices=)", why="twinkle's own divergence: calls it covers"),
    Name(GKD, "GKDLoss.beta", "attribute"), Name(GKD, "GKDLoss.temperature", "attribute"),
    Name(GKD, "GKDLoss.ignore_index", "attribute"),
)
LOSS_OUTPUT = Name("twinkle.data_format", "LossOutput", "bound", why="what a loss returns")
ACCURACY = Name(METRIC, "Accuracy", "bound",
                why="counts the step when the logits are dropped, and a fused distillation step from linear_argmax")
ACCURACY_ACCUMULATE = Name("twinkle.metric.accuracy", "Accuracy.accumulate", "function",
                           "(self, inputs, outputs, **kwargs)")

_METRICS_WITHOUT_LOGITS = ("LossMetric", "TrainMetric", "CompletionRewardMetric", "DPOMetric", "GRPOMetric",
                           "PPOMetric", "GSPOMetric", "CISPOMetric", "PPOValueMetric")
_NEWER_METRICS = ("PPOMetric", "PPOValueMetric")  # twinkle-kit 0.5.1 on
METRIC_NAMES = (
    ACCURACY, ACCURACY_ACCUMULATE,
    Name("twinkle.metric.accuracy", "Accuracy.total_correct", "attribute"),
    Name("twinkle.metric.accuracy", "Accuracy.total_count", "attribute"),
    *(Name(METRIC, m, "bound", optional=m in _NEWER_METRICS, why="a metric that never reads the logits")
      for m in _METRICS_WITHOUT_LOGITS),
)

# megatron-core's, not twinkle's: patched inside twinkle's forward_backward only (no recognition: not a twinkle name)
GET_FORWARD_BACKWARD_FUNC = Name("megatron.core.pipeline_parallel", "get_forward_backward_func", "function")

NAMES: Dict[str, Name] = names_table(
    SELECTIVE_LOG_SOFTMAX, PLATFORM, DEVICE_PREFIX, PROCESSOR_CALL, CREATE_MASK, PADDING_FREE, FORWARD_BACKWARD,
    MEGATRON_LAZY_WRAP, MEGATRON_GROUP, VARIABLE_SEQ_LENGTHS, MEGATRON_CHUNKS, REDUCE_LOSS, UNWRAP_MODEL,
    TRANSFORMERS_FORWARD, TRANSFORMERS_FORWARD_ONLY, CALCULATE_LOSS, TRANSFORMERS_LAZY_WRAP, TRANSFORMERS_GROUP,
    TRANSFORMERS_MODEL,
    Name(TRANSFORMERS, "TransformersModel._enable_sp", "attribute", optional=True,
         why="Ulysses sequence parallelism (fused distillation)"),
    LOSS_INSTANCE, CALL_PROCESSOR, TRAIN_STATUS, EVAL_STATUS, STATUS_INPUTS, STATUS_OUTPUTS, STATUS_METRICS,
    *(Name("twinkle.loss.base", f"Loss.require_{flag}", "attribute", optional=True,
           why="what a loss needs (read with twinkle's defaults where a release lacks one)")
      for flag in ("logits", "logps", "entropy", "values")),
    Name("twinkle.utils.nccl_safe", "SafeLossWrapper._loss_instance", "attribute", optional=True,
         why="the loss inside twinkle's wrapper (0.5.0 on)"),
    *GKD_NAMES, LOSS_OUTPUT, *METRIC_NAMES,
)


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

MEGATRON_LOGITS = Feature("megatron_logits", f"{_FB_NAME}: which logits its forward step reports", _megatron_logits)
MEGATRON_LOG_PROBS = Feature("megatron_log_probs", f"{_FB_NAME}: selective_log_softmax of the model's divided output",
                             src.feature(src.divides_then_computes, MEGATRON, _FB_NAME))
TRANSFORMERS_LOG_PROBS = Feature("transformers_log_probs", "TransformersModel.forward / forward_only: "
                                 "selective_log_softmax of the model's divided output",
                                 src.feature(src.divides_then_computes, TRANSFORMERS, *_FWD_NAMES))
# Forward steps that run no selective_log_softmax for a loss with require_logps = False (0.5.0 on): there the
# fused head hands a distillation loss the output layer's input; elsewhere a GKD call keeps its logits.
MEGATRON_SKIPS_UNUSED_LOG_PROBS = Feature("megatron_skips_unused_log_probs", f"{_FB_NAME} reads require_logps",
                                          src.feature(src.reads, MEGATRON, _FB_NAME, word="require_logps"))
TRANSFORMERS_SKIPS_UNUSED_LOG_PROBS = Feature(
    "transformers_skips_unused_log_probs", "TransformersModel.forward reads require_logps",
    src.feature(src.reads, TRANSFORMERS, *_FWD_NAMES, word="require_logps"))
MEGATRON_CATCHES_STEP_ERRORS = Feature(
    "megatron_catches_step_errors", f"{_FB_NAME}: TWINKLE_FAIL_FAST=0 catches a micro-batch's error",
    src.feature(src.calls_function, MEGATRON, _FB_NAME, function="_is_fail_fast"))
GKD_IGNORE_INDEX = Feature("gkd_ignore_index", "GKDLoss._generalized_jsd_loss masks the loss's ignore_index "
                           "(0.4.0: always -100)",
                           src.feature(src.has_param, GKD, "GKDLoss._generalized_jsd_loss", param="ignore_index"))

FEATURES: Tuple[Feature, ...] = (MEGATRON_LOGITS, MEGATRON_LOG_PROBS, TRANSFORMERS_LOG_PROBS,
                                 MEGATRON_SKIPS_UNUSED_LOG_PROBS, TRANSFORMERS_SKIPS_UNUSED_LOG_PROBS,
                                 MEGATRON_CATCHES_STEP_ERRORS, GKD_IGNORE_INDEX)


# --- parts: what install() patches, and what each needs ------------------------------------------------------------

_STATUS = (TRAIN_STATUS, EVAL_STATUS, STATUS_INPUTS, STATUS_OUTPUTS)
_CALL = (LOSS_INSTANCE, CALL_PROCESSOR)

LOG_SOFTMAX_PART = Part("log_softmax", "selective_log_softmax -> twinkle-mem's op", LOG_SOFTMAX,
                        (SELECTIVE_LOG_SOFTMAX, ))
GKD_LOSS = Part("gkd_loss", "GKDLoss in fp32 from twinkle-mem's ops", LOG_SOFTMAX, GKD_NAMES + (LOSS_OUTPUT, ))
MASK_SKIP_PART = Part("mask_skip", "causal-mask skip at collate time", None,
                      (PROCESSOR_CALL, CREATE_MASK, PLATFORM, DEVICE_PREFIX))
MEGATRON_LOGITS_GUARD = Part("megatron_logits_guard", "Megatron logits guard, failed micro-batches", LOGITS_GUARD,
                             (FORWARD_BACKWARD, REDUCE_LOSS, UNWRAP_MODEL, MEGATRON_GROUP, VARIABLE_SEQ_LENGTHS)
                             + _STATUS + _CALL, ((MEGATRON_LOGITS, ("every micro-batch", "when asked")), ))
MEGATRON_FUSED_LM_HEAD = Part("megatron_fused_lm_head", "Megatron fused LM head", FUSED_LM_HEAD,
                              (FORWARD_BACKWARD, MEGATRON_LAZY_WRAP, MEGATRON_GROUP, UNWRAP_MODEL, MEGATRON_CHUNKS)
                              + _CALL, ((MEGATRON_LOG_PROBS, (True, )), ))
TRANSFORMERS_LOGITS_DROP = Part("transformers_logits_drop", "transformers: the step's logits dropped after the loss",
                                LOGITS_GUARD, (TRANSFORMERS_FORWARD, TRANSFORMERS_FORWARD_ONLY, CALCULATE_LOSS,
                                               TRANSFORMERS_GROUP, STATUS_METRICS) + _STATUS + METRIC_NAMES)
TRANSFORMERS_FUSED_LM_HEAD = Part("transformers_fused_lm_head", "transformers fused LM head", FUSED_LM_HEAD,
                                  (TRANSFORMERS_FORWARD, TRANSFORMERS_FORWARD_ONLY, TRANSFORMERS_LAZY_WRAP,
                                   TRANSFORMERS_GROUP, PADDING_FREE, TRANSFORMERS_MODEL, TRAIN_STATUS, STATUS_METRICS,
                                   ACCURACY, ACCURACY_ACCUMULATE) + _CALL, ((TRANSFORMERS_LOG_PROBS, (True, )), ))

PARTS: Tuple[Part, ...] = (LOG_SOFTMAX_PART, GKD_LOSS, MASK_SKIP_PART, MEGATRON_LOGITS_GUARD, MEGATRON_FUSED_LM_HEAD,
                           TRANSFORMERS_LOGITS_DROP, TRANSFORMERS_FUSED_LM_HEAD)

# The two fused paths (fused_call_plan.FusedPath.name): the part that patches each, and the feature that lets a
# distillation call on it hand its loss the output layer's input.
FUSED_PATHS: Dict[str, Tuple[Part, Feature]] = {
    "megatron": (MEGATRON_FUSED_LM_HEAD, MEGATRON_SKIPS_UNUSED_LOG_PROBS),
    "transformers": (TRANSFORMERS_FUSED_LM_HEAD, TRANSFORMERS_SKIPS_UNUSED_LOG_PROBS),
}


# --- accessors: twinkle's objects and attributes, reached only here ---------------------------------------------

def twinkle_attribute(module: str, qualname: str):
    """A twinkle object (``"twinkle.loss.gkd"``, ``"GKDLoss"``) of an imported module."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def platform():
    return twinkle_attribute("twinkle", "Platform")


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


def tensor_parallel_group():
    """Megatron's tensor-parallel group where TP > 1 (the logits are then vocab shards), else None: twinkle's
    Megatron path sets it up (megatron-core's ``parallel_state``)."""
    if "megatron.core" not in sys.modules:  # Megatron not in use: no vocab sharding
        return None
    try:
        from megatron.core import parallel_state as mpu
        if mpu.model_parallel_is_initialized() and mpu.get_tensor_model_parallel_world_size() > 1:
            return mpu.get_tensor_model_parallel_group()
    except (ImportError, AssertionError, RuntimeError):
        pass
    return None


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
