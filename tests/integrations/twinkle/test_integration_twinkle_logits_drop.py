"""install() on twinkle's TransformersModel (issue 26): a step's logits leave the train (eval) status once
its loss has been computed, on the CPU with twinkle's real TransformersModel (a one-layer Qwen2) and a loss
that sets ``require_logits`` (GKDLoss over a top-k teacher as the recipes feed it).

- twinkle-kit as shipped keeps them there until the next forward; under install() the status holds none
  after the step and, once the step's returned outputs are released, no logits are alive when the next
  step's lm_head runs;
- return_logits=True keeps them, in forward_backward and in forward_only;
- calculate_metric gives twinkle-kit's results (Accuracy's counts, the loss) over several steps, with
  gradient accumulation, with calculate_metric called between steps, in training and in evaluation;
- a metric that may read the logits (a user's, a subclass of Accuracy) keeps them, and gets them;
- uninstall() restores twinkle's methods.
"""
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from standins import megatron as th
from helpers import LENGTHS, PROMPT, VOCAB, gkd_teacher
from twinkle_mem.integrations import twinkle as integration
from twinkle_mem.integrations.twinkle import transformers_path

# conftest.py: megatron-core and twinkle on the CPU for the module; every test starts and ends uninstalled
pytestmark = pytest.mark.usefixtures("gpt_step_cpu", "uninstalled")

TIMING = ("total time elapse", "speed")  # TrainMetric's clock readings: not a result of the step


def gkd_model(dtype=torch.float32):
    """twinkle's TransformersModel with GKDLoss, and samples whose labels at even positions are the model's
    own argmax, so that Accuracy counts correct tokens as well as wrong ones."""
    from twinkle.loss.gkd import GKDLoss
    model = th.twinkle_transformers_model(VOCAB, loss=GKDLoss(beta=0.5), dtype=dtype)
    samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
    with torch.no_grad():
        for sample in samples:
            predicted = model.model(input_ids=sample["input_ids"][None]).logits[0].argmax(-1)
            even = torch.arange(len(predicted)) % 2 == 0
            keep = sample["labels"] != -100
            sample["labels"][even & keep] = predicted[even & keep]
    return model, samples


def logits_made(model):
    """Weak references to the storage of every output of the model's lm_head, from now on."""
    made = []
    model.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: made.append(StorageWeakRef(out.untyped_storage())))
    return made


def alive(refs):
    gc.collect()
    return sum(not ref.expired() for ref in refs)


@pytest.mark.parametrize("installed", [False, True])
def test_gkd_step_logits_leave_the_status_and_are_freed(installed):
    if installed:
        integration.install(mask_skip="never")
    model, samples = gkd_model()
    made = logits_made(model)
    alive_at_head = []
    model.model.get_output_embeddings().register_forward_pre_hook(lambda *_: alive_at_head.append(alive(made)))
    status = model.optimizer_group[""].train_status
    for _ in range(3):
        out = model.forward_backward(inputs=samples, temperature=0.7, **gkd_teacher())
        assert out["logits"] is None
        kept = status.outputs["logits"]
        # The caller's outputs carry twinkle's log-probs, whose graph (GKD does not use them) holds the logits.
        out = None
        if installed:
            assert kept is None and alive(made) == 0
        else:
            assert kept is not None and kept.shape[-1] == VOCAB and alive(made) == 1
        kept = None
    assert alive_at_head == ([0, 0, 0] if installed else [0, 1, 1])


@pytest.mark.parametrize("forward_only", [False, True])
def test_return_logits_keeps_them(forward_only):
    integration.install(mask_skip="never")
    model, samples = gkd_model()
    status = th.step_status(model, forward_only)
    for return_logits in (True, False, True):
        if forward_only:
            out = model.forward_only(inputs=samples, return_logits=return_logits)
            model.calculate_loss(**gkd_teacher())
        else:
            out = model.forward_backward(inputs=samples, return_logits=return_logits, **gkd_teacher())
        if return_logits:
            assert out["logits"] is not None and status.outputs["logits"] is out["logits"]
        else:
            assert status.outputs["logits"] is None


def metric_run(schedule, *, installed, gradient_accumulation_steps=1, fused_lm_head=False, dtype=torch.float32):
    """calculate_metric's results over a schedule of "step" (forward_backward, or forward_only and
    calculate_loss for "eval"), "metric" (calculate_metric) and "eval_metric"."""
    if installed:
        integration.install(mask_skip="never", fused_lm_head=fused_lm_head)
    try:
        model, samples = gkd_model(dtype)
        results = []
        for i, what in enumerate(schedule):
            teacher = gkd_teacher(seed=1 + i)
            if what == "step":
                gas = {} if gradient_accumulation_steps == 1 else {"gradient_accumulation_steps": gradient_accumulation_steps}
                model.forward_backward(inputs=samples, temperature=0.7, **teacher, **gas)
            elif what == "eval":
                model.forward_only(inputs=samples)
                model.calculate_loss(**teacher)
            else:
                got = model.calculate_metric(is_training=what == "metric")
                results.append({k: v for k, v in got.items() if k not in TIMING})
        return results
    finally:
        integration.uninstall()


SCHEDULE = ["step", "step", "metric", "step", "metric", "metric", "step", "step", "step", "metric",
            "eval", "eval", "eval_metric", "eval", "eval_metric", "step", "eval", "metric", "eval_metric"]


def shipped_metric_run(schedule, **options):
    """metric_run without install(); skips where twinkle-kit as shipped fails the schedule itself (0.4.0 hands a
    step's gradient_accumulation_steps to its metrics twice: TypeError)."""
    try:
        return metric_run(schedule, installed=False, **options)
    except TypeError as error:
        if "gradient_accumulation_steps" not in str(error):
            raise
        pytest.skip(f"twinkle-kit as shipped fails this schedule itself: {error}")


@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_metrics_as_twinkle_gives_them(gradient_accumulation_steps):
    want = shipped_metric_run(SCHEDULE, gradient_accumulation_steps=gradient_accumulation_steps)
    got = metric_run(SCHEDULE, installed=True, gradient_accumulation_steps=gradient_accumulation_steps)
    assert got == want
    counted = [r for r in want if "accuracy" in r]
    assert len(counted) == 7 and all(0 < r["correct_tokens"] < r["total_tokens"] for r in counted)
    assert all("loss" in r for r in want)


@pytest.mark.parametrize("gradient_accumulation_steps,dtype", [(1, torch.float32), (2, torch.float32),
                                                               (1, torch.bfloat16)])
def test_metrics_as_twinkle_gives_them_on_the_fused_head(gradient_accumulation_steps, dtype):
    # install(fused_lm_head=True): the GKD steps run from the hidden states (no logits), and Accuracy (twinkle's
    # default metric of this model) still counts them, from the argmax over vocab blocks (issue 32); in bf16 too,
    # where rounding makes equal logits (the first index wins, as twinkle's argmax).
    want = shipped_metric_run(SCHEDULE, gradient_accumulation_steps=gradient_accumulation_steps, dtype=dtype)
    got = metric_run(SCHEDULE, installed=True, gradient_accumulation_steps=gradient_accumulation_steps,
                     fused_lm_head=True, dtype=dtype)
    if dtype == torch.bfloat16:  # (the loss: twinkle's GKD in bf16, the fused one in float64, docs/distillation.md)
        got, want = ([{k: v for k, v in r.items() if k != "loss"} for r in rs] for rs in (got, want))
    assert got == want
    assert sum("accuracy" in r for r in got) == 7


def test_metrics_with_the_fused_head_not_covering_the_call():
    # install(fused_lm_head=True) runs a call with return_logits=False that it does not fuse (a local teacher
    # of another vocab) as twinkle does, logits included: the drop then applies as under install().
    def run(installed):
        if installed:
            integration.install(mask_skip="never", fused_lm_head=True)
        try:
            model, samples = gkd_model()
            teacher = torch.randn(len(LENGTHS), 43, VOCAB + 6, generator=torch.Generator().manual_seed(2))
            status, results = model.optimizer_group[""].train_status, []
            for _ in range(2):
                model.forward_backward(inputs=samples, teacher_logits=teacher)
                results.append(status.outputs["logits"] is None)
            got = model.calculate_metric(is_training=True)
            return results, {k: v for k, v in got.items() if k not in TIMING}
        finally:
            integration.uninstall()

    dropped, got = run(True)
    kept, want = run(False)
    assert dropped == [True, True] and kept == [False, False]
    assert got == want and got["correct_tokens"] > 0


class LogitsSeen:
    """A user's metric: the argmax of the logits it was given at each accumulate."""

    def __init__(self):
        from twinkle.metric import Metric

        class Seen(Metric):

            def accumulate(self, inputs, outputs, **kwargs):
                logits = outputs.get("logits")
                self.seen.append(None if logits is None else logits.argmax(-1))

            def calculate(self):
                return {"seen": len(self.seen)}

        self.metric = Seen(None, None)
        self.metric.seen = []


def accuracy_subclass():
    from twinkle.metric import Accuracy

    class MyAccuracy(Accuracy):  # may read the logits otherwise
        pass

    return MyAccuracy(None, None)


@pytest.mark.parametrize("metric", ["user", "accuracy_subclass"])
def test_a_metric_that_may_read_logits_keeps_them(metric):
    def run(installed):
        if installed:
            integration.install(mask_skip="never")
        try:
            model, samples = gkd_model()
            status = model.optimizer_group[""].train_status
            user = LogitsSeen().metric if metric == "user" else accuracy_subclass()
            status.metrics.append(user)
            kept = []
            for _ in range(3):
                model.forward_backward(inputs=samples, **gkd_teacher())
                kept.append(status.outputs["logits"] is not None)
            got = model.calculate_metric(is_training=True)
            return kept, {k: v for k, v in got.items() if k not in TIMING}, getattr(user, "seen", None)
        finally:
            integration.uninstall()

    kept, got, seen = run(True)
    assert kept == [True, True, True]
    want_kept, want, want_seen = run(False)
    assert got == want
    if metric == "user":
        assert len(seen) == len(want_seen) == 3 and all(s is not None for s in seen)
        assert all(torch.equal(a, b) for a, b in zip(seen, want_seen))


def test_accuracy_failing_on_the_step_is_left_to_twinkle():
    # Accuracy refuses a list of inputs (packed sequences unpacked): its count is twinkle's to fail at the
    # next step, so the logits stay and no count is taken at the drop.
    from twinkle.metric import Accuracy, LossMetric
    from twinkle.model.optimizer_group import TrainStatus
    accuracy = Accuracy(None, None)
    labels = torch.tensor([[1, 2, -100]])
    status = TrainStatus(inputs=[{"labels": labels}], outputs={"logits": torch.randn(1, 3, 5)},
                         metrics=[LossMetric(None, None), accuracy])
    setattr(status, transformers_path.RETURN_LOGITS, False)
    assert not transformers_path.drop_step_logits(status)
    assert status.outputs["logits"] is not None and (accuracy.total_correct, accuracy.total_count) == (0, 0)
    status.inputs = {"labels": labels}
    assert transformers_path.drop_step_logits(status)
    assert status.outputs["logits"] is None and accuracy.total_count == 2


def test_install_patches_and_uninstall_restores():
    from twinkle.model.transformers.transformers import TransformersModel
    names = ("forward", "forward_only", "calculate_loss")
    before = [vars(TransformersModel)[name] for name in names]
    integration.install()
    assert all(vars(TransformersModel)[name] is not b for name, b in zip(names, before))
    integration.install(logits_guard=False)
    assert [vars(TransformersModel)[name] for name in names] == before
    integration.install()
    integration.uninstall()
    assert [vars(TransformersModel)[name] for name in names] == before
    model, samples = gkd_model()  # twinkle as shipped again: the step's logits stay in the status
    model.forward_backward(inputs=samples, **gkd_teacher())
    assert model.optimizer_group[""].train_status.outputs["logits"] is not None
