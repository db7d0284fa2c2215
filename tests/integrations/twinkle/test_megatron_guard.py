"""The logits guard, under megatron-core 0.16.1's real no-pipelining scheduler on the
CPU: on its own (a hand-written forward step) and inside twinkle-kit 0.5.1's
``MegatronModel.forward_backward``.

Liveness is measured on storages (``standins.megatron.LogitsTracker``): a logits
tensor counts as alive while anything, Python or autograd, still holds its memory.
"""

import pytest
import torch

from twinkle_mem.megatron import (collect_reports, current_logits_reporting, guard_report, logits_guard,
                                  logits_wanted, micro_batch_report, reporting_logits)

from standins import megatron as th

VOCAB, SEQ = 512, 32
LOGITS_BYTES = SEQ * VOCAB * 4  # one micro-batch of [1, SEQ, VOCAB] fp32 logits


@pytest.fixture(scope="module", autouse=True)
def megatron():
    with th.megatron_cpu():
        yield


# --- the helpers on their own -------------------------------------------------


def test_logits_wanted():

    class NeedsLogits:
        require_logits = True

    assert not logits_wanted()
    assert not logits_wanted(False, object())
    assert logits_wanted(True)
    assert logits_wanted(False, NeedsLogits())


def test_reporting_logits_nests_and_resets():
    assert current_logits_reporting() is None
    with reporting_logits(True):
        with reporting_logits(False):
            assert current_logits_reporting() is False
        assert current_logits_reporting() is True
    assert current_logits_reporting() is None


def test_micro_batch_report():
    logits = torch.randn(1, 3, 5, requires_grad=True) * 2
    logps = logits.sum(-1)
    report = micro_batch_report(loss=logps.sum(), logps=logps, logits=logits, values=None, step=3)
    assert set(report) == {"loss", "logps", "step"}  # no logits asked for, None left out
    assert not report["logps"].requires_grad and report["step"] == 3
    with reporting_logits(True):
        kept = micro_batch_report(logps=logps, logits=logits)
    assert kept["logits"].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert not kept["logits"].requires_grad
    assert "logits" not in micro_batch_report(logits=logits, keep_logits=False)
    assert "logits" not in micro_batch_report(logits=None, keep_logits=True)


def test_guard_report_and_collect():
    report = {"loss": 1.0, "logits": torch.zeros(1), "logps": None}
    assert guard_report(report, keep_logits=False) == {"loss": 1.0}
    assert set(guard_report(report, keep_logits=True)) == {"loss", "logits"}
    a, b = torch.zeros(1), torch.ones(1)
    got = collect_reports([{"logps": a}, {"logps": None}, {}, None, {"logps": b, "logits": a}], ["logps", "logits"])
    assert got["logps"] == [a, b] and got["logits"] == [a]
    assert collect_reports(None, ["logps"]) == {"logps": []}


def run_schedule(toy, batches, forward_only, report):
    """Megatron's real scheduler over ``batches`` with a GRPO-like forward step;
    returns its reports and the logits bytes alive when it returned."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        input_ids = next(data_iterator)
        logits = model(input_ids)

        def loss_func(logits):
            # gather - logsumexp: autograd saves the logits, as twinkle's log-softmax does
            logps = logits.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
            loss = -logps.sum()
            return loss, torch.tensor(logps.numel()), report(loss=loss, logps=logps, logits=logits)

        return logits, loss_func

    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[toy],
                                          num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1,
                                          forward_only=forward_only)
    return reports, toy.tracker.sample()


def naive_report(loss, logps, logits):
    return {"loss": loss.detach(), "logps": logps.detach(), "logits": logits.detach()}


@pytest.mark.parametrize("forward_only", [False, True])
def test_scheduler_keeps_no_logits_under_the_guard(forward_only):
    batches = [torch.randint(0, VOCAB, (1, SEQ)) for _ in range(2)]
    toy = th.ToyLM(VOCAB)
    _, live = run_schedule(toy, batches, forward_only, naive_report)
    assert live == 2 * LOGITS_BYTES  # control: the naive report pins every micro-batch's logits
    assert toy.tracker.peak == 2 * LOGITS_BYTES

    toy = th.ToyLM(VOCAB)
    with logits_guard(return_logits=False, forward_only=forward_only):
        reports, live = run_schedule(toy, batches, forward_only, micro_batch_report)
    assert live == 0
    assert toy.tracker.peak == LOGITS_BYTES  # only the micro-batch in flight, ever
    assert len(collect_reports(reports, ["logps"])["logps"]) == 2


def test_forward_only_guard_builds_no_graph():
    """Control for the forward-only case above: the report alone is not enough,
    the graph of one micro-batch holds its logits through the next forward."""
    batches = [torch.randint(0, VOCAB, (1, SEQ)) for _ in range(2)]
    toy = th.ToyLM(VOCAB)
    with reporting_logits(False):
        _, live = run_schedule(toy, batches, True, micro_batch_report)
    assert live == 0 and toy.tracker.peak == 2 * LOGITS_BYTES


def test_scheduler_returns_logits_when_asked():
    batches = [torch.randint(0, VOCAB, (1, SEQ)) for _ in range(2)]
    toy = th.ToyLM(VOCAB)
    with logits_guard(return_logits=True, forward_only=True):
        reports, _ = run_schedule(toy, batches, True, micro_batch_report)
    logits = collect_reports(reports, ["logits"])["logits"]
    assert len(logits) == 2
    with torch.no_grad():
        for got, input_ids in zip(logits, batches):
            assert torch.equal(got, toy(input_ids))


# --- twinkle-kit's MegatronModel.forward_backward ----------------------------


@pytest.fixture
def guard():
    from twinkle_mem.integrations import twinkle as integration
    integration.install(log_softmax=False, mask_skip="never", logits_guard=True)
    try:
        yield
    finally:
        integration.uninstall()


@pytest.fixture
def cpu():
    with th.cpu_platform("cpu"):
        yield


def run_twinkle(model, forward_only=False, **kwargs):
    toy = model.model[0]
    live = []
    with th.sample_after_scheduler(toy.tracker, live):
        samples = th.lm_samples([SEQ, SEQ - 3], VOCAB)
        if forward_only:
            out = model.forward_only(inputs=samples, micro_batch_size=1, **kwargs)
        else:
            out = model.forward_backward(inputs=samples, micro_batch_size=1, **kwargs)
    return out, live[0]


@pytest.mark.parametrize("forward_only", [False, True])
def test_twinkle_unguarded_pins_every_micro_batch(cpu, forward_only):
    """Control for the test below: twinkle-kit 0.5.1 as shipped."""
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB))
    out, live = run_twinkle(model, forward_only)
    assert out["logits"] is None
    assert live == 2 * LOGITS_BYTES


@pytest.mark.parametrize("forward_only", [False, True])
def test_twinkle_guarded_keeps_no_logits(cpu, guard, forward_only):
    toy = th.ToyLM(VOCAB)
    model = th.twinkle_megatron_model(toy)
    out, live = run_twinkle(model, forward_only)
    assert live == 0
    assert toy.tracker.peak == LOGITS_BYTES
    assert toy.tracker.live_bytes() == 0
    assert out["logits"] is None
    assert out["logps"].shape == (2, SEQ)
    assert out["loss"] > 0


@pytest.mark.parametrize("forward_only", [False, True])
def test_twinkle_guarded_returns_logits_when_asked(cpu, guard, forward_only):
    toy = th.ToyLM(VOCAB)
    model = th.twinkle_megatron_model(toy)
    out, _ = run_twinkle(model, forward_only, return_logits=True)
    samples = th.lm_samples([SEQ, SEQ - 3], VOCAB)
    assert out["logits"].shape == (2, SEQ, VOCAB)
    with torch.no_grad():
        for i, sample in enumerate(samples):
            input_ids = torch.zeros(1, SEQ, dtype=torch.long)  # twinkle pads input_ids with 0
            input_ids[0, :len(sample["input_ids"])] = sample["input_ids"]
            assert torch.equal(out["logits"][i], toy(input_ids)[0])


def test_twinkle_guarded_reports_no_logits_for_a_loss_that_requires_them(cpu, guard):
    # twinkle's loss reads the logits inside the schedule, before the report, and twinkle keeps the reported
    # ones for return_logits only: the integration's guard reports none for require_logits
    # (twinkle_mem.megatron.logits_wanted, for a caller's own schedule, still does).
    from twinkle.loss import CrossEntropyLoss

    class LogitsLoss(CrossEntropyLoss):
        require_logits = True

    model = th.twinkle_megatron_model(th.ToyLM(VOCAB), loss=LogitsLoss(reduction="sum"))
    _, live = run_twinkle(model)
    assert live == 0


@pytest.fixture
def fail_micro_batch(monkeypatch):
    """TWINKLE_FAIL_FAST=0, and twinkle's per-micro-batch unpacking failing on the given
    micro-batches: twinkle's forward step catches the error and reports no log-probs for them."""

    def arm(model, failing):
        th.fail_unpacking(monkeypatch, model.optimizer_group[""].processor, failing)

    return arm


LENGTHS3 = [SEQ, SEQ - 3, SEQ - 5]


def run_three(model, forward_only):
    samples = th.lm_samples(LENGTHS3, VOCAB)
    if forward_only:
        return model.forward_only(inputs=samples, micro_batch_size=1)
    return model.forward_backward(inputs=samples, micro_batch_size=1)


@pytest.mark.parametrize("forward_only", [False, True])
def test_twinkle_guarded_failed_micro_batch_keeps_rows_aligned(cpu, guard, fail_micro_batch, forward_only):
    """A failed micro-batch gets NaN rows where its log-probs belong, and a warning naming it;
    the other rows stay with their samples (unguarded, twinkle hands None to torch.cat)."""
    from twinkle_mem.integrations.twinkle import FailedMicroBatchWarning
    want = run_three(th.twinkle_megatron_model(th.ToyLM(VOCAB)), forward_only)["logps"]
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB))
    fail_micro_batch(model, failing={1})
    with pytest.warns(FailedMicroBatchWarning, match=r"1 of 3 micro-batches failed.*micro-batch 1 \(rows 1-1\)") as w:
        out = run_three(model, forward_only)
    assert w[0].message.micro_batches == [1] and w[0].message.rows == [range(1, 2)]
    logps = out["logps"]
    assert logps.shape == want.shape == (3, SEQ)
    assert torch.isnan(logps).all(-1).tolist() == [False, True, False]
    torch.testing.assert_close(logps[[0, 2]], want[[0, 2]], rtol=0, atol=0)
    status = th.step_status(model, forward_only)
    assert status.outputs["logps"] is logps  # what twinkle keeps for the loss/metrics, aligned too
    assert [inp["labels"].shape[0] for inp in status.inputs] == [1, 1, 1]


def test_twinkle_guarded_failed_micro_batches_variable_lengths(cpu, guard, fail_micro_batch):
    from twinkle_mem.integrations.twinkle import FailedMicroBatchWarning
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB), variable_seq_lengths=True)
    fail_micro_batch(model, failing={0, 2})
    with pytest.warns(FailedMicroBatchWarning, match="2 of 3 micro-batches failed") as w:
        out = run_three(model, False)
    assert w[0].message.micro_batches == [0, 2]
    logps = out["logps"]
    assert isinstance(logps, list) and [tuple(t.shape) for t in logps] == [(1, n) for n in LENGTHS3]
    assert [bool(torch.isnan(t).all()) for t in logps] == [True, False, True]


def test_twinkle_guarded_every_micro_batch_failed(cpu, guard, fail_micro_batch):
    from twinkle_mem.integrations.twinkle import FailedMicroBatchWarning
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB))
    fail_micro_batch(model, failing={0, 1, 2})
    with pytest.warns(FailedMicroBatchWarning, match="3 of 3 micro-batches failed"):
        out = run_three(model, False)
    assert out["logps"] is None


def test_align_failed_refuses_what_it_cannot_place():
    from twinkle_mem.integrations.twinkle.failed_micro_batches import align_failed as _align_failed
    inputs = [{"labels": torch.zeros(2, 5)}, {"labels": torch.zeros(1, 5)}, {"labels": torch.zeros(2, 5)}]
    aligned, rows = _align_failed(torch.ones(4, 5), inputs, [1])
    assert torch.isnan(aligned).all(-1).tolist() == [False, False, True, False, False] and rows == [range(2, 3)]
    assert _align_failed(torch.ones(3, 5), inputs, [1]) == (None, None)  # rows do not add up
    assert _align_failed([torch.ones(2, 5)], inputs, [1]) == (None, None)  # one tensor per micro-batch missing


def test_reduce_loss_outside_forward_backward_is_twinkles(guard):
    from twinkle.model.megatron.strategy.megatron import MegatronStrategy
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB))
    logits = torch.randn(1, 2, 3)
    _, _, report = model.strategy.reduce_loss(torch.tensor(1.0), torch.tensor(2), logits, None)
    assert report["logps"] is None and torch.equal(report["logits"], logits)
    assert isinstance(model.strategy, MegatronStrategy)


# --- calls the guard does not concern: what twinkle-kit returns, structure and values --------------


def _same(got, want, where="out"):
    """Recursively equal: the same types, keys, lengths, None-ness; tensors bitwise (NaN equal)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(
            got.nan_to_num(7.0), want.nan_to_num(7.0)), where
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            _same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _twinkle_call(install_kwargs, loss_cls, variable_seq_lengths, forward_only, return_logits):
    """One MegatronModel call, shipped (install_kwargs None) or installed: (returned output, twinkle's status
    outputs) as plain dicts, or the exception type it raised."""
    from twinkle.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss
    from twinkle_mem.integrations import twinkle as integration
    loss = ChunkedCrossEntropyLoss(chunk_size=8, reduction="sum") if loss_cls == "chunked_ce" else \
        CrossEntropyLoss(reduction="sum")
    model = th.twinkle_megatron_model(th.ToyLM(VOCAB), loss=loss, variable_seq_lengths=variable_seq_lengths)
    if install_kwargs is not None:
        integration.install(**install_kwargs)
    try:
        samples = th.lm_samples([SEQ, SEQ - 3], VOCAB)
        call = model.forward_only if forward_only else model.forward_backward
        try:
            out = call(inputs=samples, micro_batch_size=1, return_logits=return_logits)
        except Exception as e:  # noqa: BLE001 (twinkle-kit's own failure, compared below)
            return type(e)
    finally:
        if install_kwargs is not None:
            integration.uninstall()
    return dict(out), dict(th.step_status(model, forward_only).outputs)


GUARD_ONLY = dict(log_softmax=False, mask_skip="never", logits_guard=True)


@pytest.mark.parametrize("variable_seq_lengths", [False, True])
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("return_logits", [False, True])
def test_twinkle_guarded_returns_what_twinkle_returns(cpu, variable_seq_lengths, forward_only, return_logits):
    # A loss that needs log-probs: the same log-probs, logits (when asked), loss, and status outputs.
    want = _twinkle_call(None, "ce", variable_seq_lengths, forward_only, return_logits)
    _same(_twinkle_call(GUARD_ONLY, "ce", variable_seq_lengths, forward_only, return_logits), want)


@pytest.mark.parametrize("install_kwargs", [GUARD_ONLY, {}], ids=["guard", "install()"])
@pytest.mark.parametrize("forward_only", [False, True])
def test_twinkle_guarded_loss_without_logps_returns_twinkles_structure(cpu, install_kwargs, forward_only):
    # ChunkedCrossEntropyLoss needs logits, not log-probs: twinkle-kit returns logps=[None, None] (variable
    # sequence lengths) and so must the installed call (it returned None).
    want = _twinkle_call(None, "chunked_ce", True, forward_only, False)
    assert want[0]["logps"] == [None, None]
    _same(_twinkle_call(install_kwargs, "chunked_ce", True, forward_only, False), want)
    # With fixed lengths twinkle-kit 0.5.1 itself raises (torch.cat of those None: the defect the guard
    # fixes); the installed call returns logps=None and the same loss.
    assert _twinkle_call(None, "chunked_ce", False, forward_only, False) is TypeError
    out, _status = _twinkle_call(install_kwargs, "chunked_ce", False, forward_only, False)
    assert out["logps"] is None and out["logits"] is None and out["loss"] == want[0]["loss"]
