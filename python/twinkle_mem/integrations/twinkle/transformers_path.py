"""twinkle's ``TransformersModel``: the step's logits dropped once its loss has used them, and the fused LM head.

- ``calculate_loss`` (also reached through ``forward_backward``): twinkle keeps the step's outputs in the
  train (eval) status for its metrics, which read them at the start of the next forward. With a loss that
  sets ``require_logits`` (GKD, MSE, InfoNCE, the chunked cross-entropy) that includes the full-vocab logits,
  alive through backward and the optimizer step until the next forward has built its own. Once the loss has
  been computed they are dropped from the status, unless the caller asked for them (``return_logits=True``,
  noted by the patched ``forward`` / ``forward_only``) or a metric of that status might read them. twinkle's
  ``Accuracy`` (the one default metric that reads them) takes its count of the step at the drop instead of
  at the next forward: the same count from the same tensors, and at the next forward it sees no logits and
  adds nothing, so every metric's result is twinkle-kit's.
- ``forward`` / ``forward_only`` with the fused LM head: for an eligible call the ``lm_head`` is deferred
  (fused_call.py) and its result must be taken by twinkle's ``selective_log_softmax``.
"""
import functools

import torch

from . import fused_call, fused_call_plan, fused_eligibility, twinkle_names


def forward(original, plan):
    """``TransformersModel.forward`` under install()."""
    return _forward(original, plan, "train_status")


def forward_only(original, plan):
    """``TransformersModel.forward_only`` under install()."""
    return _forward(original, plan, "eval_status")


def _forward(original, plan, status: str):
    if plan.patches(twinkle_names.TRANSFORMERS_FUSED_LM_HEAD):
        original = transformers_model_forward(original, plan)
    # outermost: notes return_logits once twinkle's forward has filled the status
    if plan.patches(twinkle_names.TRANSFORMERS_LOGITS_DROP):
        original = forward_noting_return_logits(original, status)
    return original


def transformers_model_forward(original, plan):

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if fused_call.current() is not None:  # forward called from within a fused call
            return original(self, *args, **kwargs)
        # forward_only computes no loss: a distillation call there would defer a head nothing reads
        train = original.__name__ == "forward"
        with _fused_transformers(self, {**kwargs, "forward_only": not train}, plan) as call:
            out = original(self, *args, **kwargs)
            if call is not None:
                call.check_taken(f"TransformersModel.{original.__name__}")
        return out

    return forward


def _fused_transformers(model, kwargs, plan):
    """The fused call for one TransformersModel.forward / forward_only (fused_call_plan.py), or None where it does not
    apply."""
    loss = twinkle_names.loss_instance(model, kwargs)
    return fused_call_plan.fused(transformers_fused_path(model, kwargs), model, kwargs, loss, plan)


def transformers_fused_path(model, kwargs) -> fused_call_plan.FusedPath:
    """What the transformers path knows for planning a fused call: the model's lm_head (no tensor parallelism),
    the labels from twinkle's processor, the Accuracy metrics of the train status (the model's default metric,
    which reads the step's logits: a logits-free loss head counts it from their argmax over vocab blocks)."""

    def output_layers():
        unwrapped = twinkle_names.unwrap_model(model, model.model)
        head, reason = fused_eligibility.transformers_lm_head(model.model, unwrapped)
        return ([head] if head is not None else []), reason

    def accuracy_metrics():
        accuracy = twinkle_names.accuracy_class()
        status = twinkle_names.status(model, kwargs, forward_only=False)
        return tuple(m for m in getattr(status, "metrics", ()) if type(m) is accuracy)

    return fused_call_plan.FusedPath("transformers", output_layers, lambda layers: (layers[0].weight.shape[0], False),
                                     fused_call.transformers_forward, labels_from_processor=True,
                                     accuracy_metrics=accuracy_metrics)


# --- the step's logits, dropped once its loss has used them --------------------------------------------------

# Set on twinkle's TrainStatus by the patched forward / forward_only: whether that call's caller asked for the
# logits. A status filled by a forward that did not go through the patch lacks it: its logits are kept.
RETURN_LOGITS = "_twinkle_mem_return_logits"


def forward_noting_return_logits(original, status_name: str):
    """``forward`` (status ``train_status``) or ``forward_only`` (``eval_status``): twinkle's, then the call's
    ``return_logits`` noted on the status it filled (twinkle pops it from the kwargs it keeps there)."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if twinkle_names.remote_handle(self):
            return out
        status = twinkle_names.status(self, kwargs, forward_only=status_name == "eval_status")
        setattr(status, RETURN_LOGITS, bool(kwargs.get("return_logits", False)))
        return out

    return forward


def calculate_loss_dropping_logits(original, plan):
    """``calculate_loss``: twinkle's, then the step's logits dropped from the status the loss read."""

    @functools.wraps(original)
    def calculate_loss(self, **kwargs):
        result = original(self, **kwargs)
        if twinkle_names.remote_handle(self):
            return result
        drop_step_logits(twinkle_names.status(self, kwargs, forward_only=not self.model.training))  # twinkle's choice
        return result

    return calculate_loss


def drop_step_logits(status) -> bool:
    """Drop ``status.outputs['logits']`` where nothing can tell: the caller did not ask for them and every
    metric of the status is twinkle's ``Accuracy`` (given its count of the step now) or a twinkle metric that
    never reads them. Returns whether they were dropped."""
    Accuracy = twinkle_names.accuracy_class()
    outputs = status.outputs
    if getattr(status, RETURN_LOGITS, True) or outputs is None or not isinstance(outputs.get("logits"),
                                                                                   torch.Tensor):
        return False
    # Exact classes: a subclass (or a user's metric) may read the logits at the next step.
    without_logits = twinkle_names.metrics_without_logits()
    if any(type(m) is not Accuracy and type(m) not in without_logits for m in status.metrics):
        return False
    accuracies = [m for m in status.metrics if type(m) is Accuracy]
    counts = [(m.total_correct, m.total_count) for m in accuracies]
    try:
        for metric in accuracies:
            metric.accumulate(status.inputs, outputs)  # reads only the labels, the mask and the logits
    except Exception:
        # Where Accuracy fails on this step (a list of inputs, ...) it is twinkle's to fail at the next step.
        for metric, (correct, total) in zip(accuracies, counts):
            metric.total_correct, metric.total_count = correct, total
        return False
    outputs["logits"] = None
    # A loss that does not use the log-probs (GKD) leaves twinkle's selective_log_softmax graph on them, which
    # holds the logits; the metrics read their values only.
    for key in ("logps", "entropies"):
        if isinstance(outputs.get(key), torch.Tensor):
            outputs[key] = outputs[key].detach()
    return True
