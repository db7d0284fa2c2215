"""Every ms-swift name twinkle-mem touches, what it expects of each, and how it recognizes an ms-swift by what its
code is (not by its version string): the scheme of twinkle's and verl's (``core/recognition.py``). A new ms-swift
release is this module and its table.

- :data:`NAMES`: each method or bound function twinkle-mem replaces, with the parameters ms-swift calls it with.
- :data:`FEATURES`: what ms-swift's code does where install() depends on it, read from its source (nothing imported):
  that ``--external_plugins`` files are imported at argument parsing (how twinkle-mem's plugin reaches every
  process); that GRPO's local forward takes the model's logits, keeps the last ``logits_to_keep + 1`` positions
  but the last, divides them by the temperature in place and hands them to ``selective_log_softmax`` and
  ``entropy_from_logits``; that GKD's loss takes the student's ``outputs.logits`` from one model call, rolls the
  labels, and is ``gkd_loss``'s sum of ``jsd_loss`` over the active tokens divided by their number; that
  Megatron-SWIFT's GRPO takes the log-probs of its model's output from ``compute_logps_and_entropy_from_logits``.
- :data:`PARTS`: what install() patches; a part whose names or features are not recognized is refused by name.
"""
import ast
from typing import Tuple

from ..core import source as src
from ..core.recognition import Feature, Name, Part, names_table
from .settings import FUSED_LM_HEAD, LOGITS_PATH

BASE_ARGS = "swift.arguments.base_args.base_args"
GRPO = "swift.rlhf_trainers.grpo_trainer"
GKD = "swift.rlhf_trainers.gkd_trainer"
GKD_LOSS = "swift.rlhf_trainers.gkd_loss"
RLHF_MIXIN = "swift.rlhf_trainers.rlhf_mixin"
MEGATRON_VOCAB_PARALLEL = "swift.megatron.trainers.vocab_parallel_utils"
MEGATRON_GRPO = "swift.megatron.trainers.grpo_trainer"
MEGATRON_UTILS = "swift.megatron.trainers.utils"

GRPO_LOCAL_FORWARD = Name(GRPO, "GRPOTrainer._get_logps_via_local_forward", "function",
                          "(self, model, model_inputs, logits_to_keep, input_ids, compute_entropy=)",
                          why="wrapped: the log-probs and entropy from the LM head's input, the logits never built")
GRPO_SP_FORWARD = Name(GRPO, "GRPOTrainer._get_logps_via_sp", "function",
                       "(self, model, model_inputs, grpo_batch, logits_to_keep, input_ids, compute_entropy=)",
                       why="wrapped: under sequence parallelism the head deferred, its input taken where ms-swift calls "
                           "selective_log_softmax and entropy_from_logits")
GKD_COMPUTE_LOSS = Name(GKD, "GKDTrainer.compute_loss", "function",
                        "(self, model, inputs, return_outputs=, num_items_in_batch=)",
                        why="wrapped: the student's LM head deferred for its forward")
GKD_JSD_LOSS = Name(GKD, "GKDTrainer._compute_jsd_loss", "function", "(self, student_logits, teacher_output, labels)",
                    why="wrapped: the loss from the student's LM head input (twinkle-mem's distillation heads)")
DPO_SELECTIVE_LOG_SOFTMAX = Name(RLHF_MIXIN, "selective_log_softmax", "bound",
                                 why="replaced (with its copies bound by name): twinkle-mem's op")
GRPO_SELECTIVE_LOG_SOFTMAX = Name(GRPO, "selective_log_softmax", "bound",
                                  why="replaced (with its copies bound by name): twinkle-mem's op")
# (bound inside a try at the module's top level, TRL's or ms-swift's own: the source check reads the top level only)
GRPO_ENTROPY_FROM_LOGITS = Name(GRPO, "entropy_from_logits", "bound", optional=True,
                                why="replaced (with its copies bound by name): twinkle-mem's op")

MEGATRON_LOGPS = Name(MEGATRON_VOCAB_PARALLEL, "compute_logps_and_entropy_from_logits", "function",
                      "(logits, labels, compute_entropy=, entropy_chunk_size=)",
                      why="replaced (with its copies bound by name): twinkle-mem's op over the TP group")

# Megatron-SWIFT's two model calls for log-probs, each with the output layer deferred (megatron_fused_head)
MEGATRON_FORWARD_STEP = Name(MEGATRON_GRPO, "MegatronGRPOTrainer.forward_step", "function",
                             "(self, data_iterator, model)", why="wrapped: the loss's log-probs and entropy")
MEGATRON_PER_TOKEN_LOGPS = Name(MEGATRON_UTILS, "compute_per_token_logps_fn", "function",
                                "(model, args, data_iterator, temperature=, no_grad=, enable_routing_replay=)",
                                why="wrapped (with its copies bound by name): the old and reference log-probs")

NAMES = names_table(GRPO_LOCAL_FORWARD, GRPO_SP_FORWARD, GKD_COMPUTE_LOSS, GKD_JSD_LOSS, DPO_SELECTIVE_LOG_SOFTMAX,
                    GRPO_SELECTIVE_LOG_SOFTMAX, GRPO_ENTROPY_FROM_LOGITS, MEGATRON_LOGPS, MEGATRON_FORWARD_STEP,
                    MEGATRON_PER_TOKEN_LOGPS)


# --- features: what ms-swift's code does where install() depends on it, read from it -----------------------------

def _slices(node, lower: str, upper) -> bool:
    """The function slices something ``[lower:upper]`` (the bounds as ast.unparse writes them; None: open)."""
    def text(bound):
        return None if bound is None else ast.unparse(bound)
    return any(isinstance(n, ast.Slice) and text(n.lower) == lower and text(n.upper) == upper for n in ast.walk(node))


def _divided_logits(node) -> set:
    """The names of the logits the function divides in place (``logits.div_(...)``) and of their squeezed views
    (``logits_rmpad = logits.squeeze(0)``: the padding-free rows)."""
    divided = {c.func.value.id for c in src.calls(node, "div_") if isinstance(c.func.value, ast.Name)}
    squeezed = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "squeeze"
                and isinstance(n.value.func.value, ast.Name) and n.value.func.value.id in divided
                for t in n.targets if isinstance(t, ast.Name)}
    return divided | squeezed


def _local_forward_computes(node) -> bool:
    """GRPO's local forward: the model's logits at ``[-(logits_to_keep + 1):-1]`` (each predicting
    ``input_ids[:, -logits_to_keep:]``), divided by the temperature in place and handed (or their padding-free
    squeeze) to ``selective_log_softmax`` and ``entropy_from_logits``."""
    divided = _divided_logits(node)
    handed = [c for f in ("selective_log_softmax", "entropy_from_logits") for c in src.calls(node, f)]
    return (bool(handed) and all(c.args and isinstance(c.args[0], ast.Name) and c.args[0].id in divided
                                 for c in handed)
            and _slices(node, "-(logits_to_keep + 1)", "-1") and _slices(node, "-logits_to_keep", None))


def _sp_computes(node) -> bool:
    """GRPO's sequence-parallel forward: the model's logits divided by the temperature (``logits / self.temperature``)
    and that very tensor handed to ``selective_log_softmax`` and ``entropy_from_logits``, the log-probs gathered by
    ``GatherLoss``."""
    divided = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) and isinstance(n.value, ast.BinOp)
               and isinstance(n.value.op, ast.Div) and ast.unparse(n.value.right) == "self.temperature"
               for t in n.targets if isinstance(t, ast.Name)}
    handed = [c for f in ("selective_log_softmax", "entropy_from_logits") for c in src.calls(node, f)]
    return (bool(divided) and len(handed) == 2 and bool(src.calls(node, "apply"))
            and all(c.args and isinstance(c.args[0], ast.Name) and c.args[0].id in divided for c in handed))


def _imports_plugins(node) -> bool:
    """``--external_plugins``: each file imported (``import_external_file``) when the arguments are parsed."""
    return bool(src.calls(node, "import_external_file"))


def _student_logits_to_loss(node) -> bool:
    """GKD's compute_loss: the student's one model call (``outputs_student = model(**forward_inputs)``) and its
    ``.logits`` handed to ``_compute_jsd_loss``; ``sft_alpha`` read (its SFT term uses the model's own loss)."""
    calls_model = any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                      and n.value.func.id == "model" and any(isinstance(t, ast.Name) and t.id == "outputs_student"
                                                             for t in n.targets) for n in ast.walk(node))
    hands_logits = any(call.args and ast.unparse(call.args[0]) == "outputs_student.logits"
                       for call in src.calls(node, "_compute_jsd_loss"))
    return calls_model and hands_logits and "sft_alpha" in {n.attr for n in ast.walk(node)
                                                            if isinstance(n, ast.Attribute)}


def _jsd_from_gkd_loss(node) -> bool:
    """``_compute_jsd_loss``: the labels rolled by one, the teacher to top-k where asked (``to_topk``), ``gkd_loss``'s
    total divided by its count of active tokens."""
    return bool(src.calls(node, "roll")) and bool(src.calls(node, "to_topk")) and bool(src.calls(node, "gkd_loss"))


def _gkd_loss_math(source: src.PackageSource) -> bool:
    """``gkd_loss``: the active tokens (``extract_active``), a top-k teacher gathered from the student's logits, both
    sides divided by the temperature, ``jsd_loss`` summed; ``jsd_loss``: log-softmax of both, KL(teacher || student)
    at beta 0, KL(student || teacher) at 1, else the mixture's log-probs by ``logsumexp``."""
    loss, jsd = source.function(GKD_LOSS, "gkd_loss"), source.function(GKD_LOSS, "jsd_loss")
    if loss is None or jsd is None:
        return False
    return (all(src.calls(loss, f) for f in ("extract_active", "jsd_loss", "gather_fn", "_align_vocab"))
            and src.accepts(jsd, "(s_logits, t_logits, beta, log_softmax_fn=, kl_div_fn=, chunk_size=)") is None
            and bool(src.calls(jsd, "logsumexp")) and bool(src.calls(jsd, "kl_div_fn")))


def _megatron_logps(source: src.PackageSource) -> bool:
    """Megatron-SWIFT's log-probs: the labels' log-softmax from the vocab-parallel logits (``-100`` masked to 0, by
    Megatron's ``vocab_parallel_cross_entropy``), the entropy from the shard's ``vocab_parallel_log_softmax``; GRPO's
    ``forward_step`` hands it the model's output divided by the temperature in place."""
    compute = source.function(MEGATRON_VOCAB_PARALLEL, "compute_logps_and_entropy_from_logits")
    gather = source.function(MEGATRON_VOCAB_PARALLEL, "vocab_parallel_gather_logps")
    step = source.function(MEGATRON_GRPO, "MegatronGRPOTrainer.forward_step")
    return (None not in (compute, gather, step) and bool(src.calls(compute, "vocab_parallel_gather_logps"))
            and bool(src.calls(compute, "vocab_parallel_entropy"))
            and bool(src.calls(gather, "vocab_parallel_cross_entropy")) and bool(src.calls(gather, "masked_fill"))
            and bool(src.calls(step, "div_")) and bool(src.calls(step, "compute_logps_and_entropy_from_logits")))


def _megatron_calls_logps(source: src.PackageSource) -> bool:
    """Megatron-SWIFT's two model calls for log-probs: GRPO's ``forward_step`` calls the model
    (``output_tensor = model(**data)``), and ``compute_per_token_logps_fn`` calls ``forward_step_helper``; each
    divides the output by the temperature in place and hands it to ``compute_logps_and_entropy_from_logits``."""
    step = source.function(MEGATRON_GRPO, "MegatronGRPOTrainer.forward_step")
    logps = source.function(MEGATRON_UTILS, "compute_per_token_logps_fn")
    if step is None or logps is None:
        return False
    calls_model = any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                      and n.value.func.id == "model" for n in ast.walk(step))
    return (calls_model and bool(src.calls(logps, "forward_step_helper"))
            and all(src.calls(f, "div_") and src.calls(f, "compute_logps_and_entropy_from_logits") for f in (step, logps)))


IMPORTS_PLUGINS = Feature("imports_plugins", "BaseArguments._import_external_plugins imports each --external_plugins "
                          "file", src.feature(_imports_plugins, BASE_ARGS, "BaseArguments._import_external_plugins"))
LOCAL_FORWARD_COMPUTES = Feature("local_forward_computes", "GRPOTrainer._get_logps_via_local_forward takes the "
                                 "logits at [-(logits_to_keep + 1):-1], divides them in place and calls "
                                 "selective_log_softmax and entropy_from_logits",
                                 src.feature(_local_forward_computes, GRPO, "GRPOTrainer._get_logps_via_local_forward"))
SP_COMPUTES = Feature("sp_computes", "GRPOTrainer._get_logps_via_sp divides the logits by the temperature and "
                      "calls selective_log_softmax and entropy_from_logits on them",
                      src.feature(_sp_computes, GRPO, "GRPOTrainer._get_logps_via_sp"))
STUDENT_LOGITS_TO_LOSS = Feature("student_logits_to_loss", "GKDTrainer.compute_loss hands the student's one model "
                                 "call's logits to _compute_jsd_loss",
                                 src.feature(_student_logits_to_loss, GKD, "GKDTrainer.compute_loss"))
JSD_FROM_GKD_LOSS = Feature("jsd_from_gkd_loss", "GKDTrainer._compute_jsd_loss rolls the labels and calls gkd_loss",
                            src.feature(_jsd_from_gkd_loss, GKD, "GKDTrainer._compute_jsd_loss"))
GKD_LOSS_MATH = Feature("gkd_loss_math", "gkd_loss / jsd_loss: the generalized JSD over the active tokens",
                        _gkd_loss_math)

MEGATRON_LOGPS_FROM_SHARD = Feature("megatron_logps_from_shard", "compute_logps_and_entropy_from_logits: the "
                                    "labels' log-probs (-100 masked) and the entropy from the vocab-parallel logits",
                                    _megatron_logps)

MEGATRON_CALLS_LOGPS = Feature("megatron_calls_logps", "MegatronGRPOTrainer.forward_step and "
                               "compute_per_token_logps_fn call the model, divide its output by the temperature and "
                               "call compute_logps_and_entropy_from_logits", _megatron_calls_logps)

FEATURES: Tuple[Feature, ...] = (IMPORTS_PLUGINS, LOCAL_FORWARD_COMPUTES, SP_COMPUTES, STUDENT_LOGITS_TO_LOSS, JSD_FROM_GKD_LOSS,
                                 GKD_LOSS_MATH, MEGATRON_LOGPS_FROM_SHARD, MEGATRON_CALLS_LOGPS)


# --- parts: what install() patches, and what each needs ------------------------------------------------------------

# Every part needs ms-swift to import the plugin in every process that parses arguments (where it does not, the
# variable's start-up hook still reaches them, but the plugin file would not).
_EVERY_PROCESS = ((IMPORTS_PLUGINS, (True, )), )

GRPO_FUSED_HEAD = Part("grpo_fused_head", "GRPO's log-probs and entropy from the LM head's input "
                       "(linear_selective_log_softmax)", FUSED_LM_HEAD, (GRPO_LOCAL_FORWARD, ),
                       _EVERY_PROCESS + ((LOCAL_FORWARD_COMPUTES, (True, )), ))
GRPO_SP_FUSED_HEAD = Part("grpo_sp_fused_head", "GRPO under sequence parallelism: the same from each rank's part of "
                          "the sequence", FUSED_LM_HEAD, (GRPO_SP_FORWARD, GRPO_SELECTIVE_LOG_SOFTMAX,
                                                          GRPO_ENTROPY_FROM_LOGITS),
                          _EVERY_PROCESS + ((SP_COMPUTES, (True, )), ))
GKD_FUSED_HEAD = Part("gkd_fused_head", "GKD's loss from the student's LM head input (linear_gkd_full, "
                      "linear_gkd_topk)", FUSED_LM_HEAD, (GKD_COMPUTE_LOSS, GKD_JSD_LOSS),
                      _EVERY_PROCESS + ((STUDENT_LOGITS_TO_LOSS, (True, )), (JSD_FROM_GKD_LOSS, (True, )),
                                        (GKD_LOSS_MATH, (True, ))))
LOGITS_PATH_PART = Part("logits_path", "TRL's selective_log_softmax, entropy_from_logits where ms-swift binds them "
                        "(DPO, GRPO under sequence parallelism) -> twinkle-mem's op", LOGITS_PATH,
                        (DPO_SELECTIVE_LOG_SOFTMAX, GRPO_SELECTIVE_LOG_SOFTMAX, GRPO_ENTROPY_FROM_LOGITS),
                        _EVERY_PROCESS)

MEGATRON_LOGITS_PATH = Part("megatron_logits_path", "Megatron-SWIFT's compute_logps_and_entropy_from_logits (GRPO's "
                            "log-probs, old and reference too) -> twinkle-mem's op over the TP group", LOGITS_PATH,
                            (MEGATRON_LOGPS, ), _EVERY_PROCESS + ((MEGATRON_LOGPS_FROM_SHARD, (True, )), ))

MEGATRON_FUSED_HEAD = Part("megatron_fused_head", "Megatron-SWIFT's GRPO log-probs and entropy (old and reference "
                           "too) from the output layer's input (linear_selective_log_softmax over the TP group)",
                           FUSED_LM_HEAD, (MEGATRON_FORWARD_STEP, MEGATRON_PER_TOKEN_LOGPS, MEGATRON_LOGPS),
                           _EVERY_PROCESS + ((MEGATRON_LOGPS_FROM_SHARD, (True, )), (MEGATRON_CALLS_LOGPS, (True, ))))

PARTS: Tuple[Part, ...] = (GRPO_FUSED_HEAD, GRPO_SP_FUSED_HEAD, GKD_FUSED_HEAD, LOGITS_PATH_PART, MEGATRON_LOGITS_PATH,
                           MEGATRON_FUSED_HEAD)

