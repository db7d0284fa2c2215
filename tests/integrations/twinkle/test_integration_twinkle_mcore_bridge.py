"""twinkle's ``MegatronModel(model_id=...)`` built through mcore_bridge from a local tiny Qwen3 (random
weights, tied and untied; its tokenizer with a chat template; no download), as a user builds it, with the
CPU stand-ins of standins/mcore_bridge.py (each named and justified there and in
docs/twinkle_integration.md). World size 1 here (also: MTP, packed batches, full recompute); TP = 2,
sequence parallelism, PP = 2, VPP, Float16Module:
tests/integrations/twinkle/test_integration_twinkle_mcore_bridge_dist.py.

GRPO ``forward_backward`` and ``forward_only`` (entropy bonus, T = 0.7), twinkle-kit as shipped vs
``install()`` vs ``install(fused_lm_head=True)`` on the same model:
- fp32: loss, log-probs at the label positions, entropy, every parameter gradient within 1e-4 relative;
- bf16 (twinkle's ``mixed_precision='bf16'``: bf16 parameters, the whole model in bf16 at world size 1):
  each judged against an exact fp32 run of the same bf16 weights; twinkle-mem's errors are no larger
  than shipped twinkle-kit's (the fused head's log-probs come from bf16 hidden states and weights with
  fp32 accumulation, shipped twinkle's from bf16 logits);
- the fused runs make no tensor with the vocab as a dim, the shipped run does (the control).
"""
import contextlib
import copy

import pytest
import torch

from standins import mcore_bridge as mb
from standins import megatron as th
from helpers import (ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, SEQ, VOCAB, VocabTensors, assert_close, blocks,
                     grpo)
from twinkle_mem.integrations import twinkle as integration

MODES = {"shipped": None, "install": dict(), "fused": dict(fused_lm_head=True, fused_chunk_bytes=CHUNK)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Local tiny Qwen3 checkpoints: fp32 weights that are exact in bf16 (so that an fp32 run of the bf16
    weights is exact), untied and tied."""
    paths = {}
    for tied in (False, True):
        path = str(tmp_path_factory.mktemp("tied" if tied else "untied"))
        model = mb.save_tiny_qwen3(path, vocab=VOCAB, tied=tied, seed=1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        model.save_pretrained(path)
        paths[tied] = path
    return paths


@pytest.fixture(scope="module", autouse=True)
def cpu():
    import torch.distributed as dist
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{th.free_port()}", rank=0, world_size=1)
    try:
        with mb.mcore_bridge_on_cpu():
            yield
    finally:
        from megatron.core import parallel_state as mpu
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()  # twinkle's strategy set it up; later tests set up their own
        if own:
            dist.destroy_process_group()


pytestmark = pytest.mark.usefixtures("uninstalled")  # conftest.py: every test starts and ends uninstalled


@pytest.fixture(autouse=True)
def small_fused_blocks():
    """The fused op's small test blocks (helpers.FUSED_BLOCKS): several per micro-batch."""
    with blocks(*FUSED_BLOCKS):
        yield


def build(path, mixed_precision="no", **kwargs):
    from megatron.core import parallel_state as mpu
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()  # twinkle's strategy initialises it for each model
    return mb.megatron_model(path, mixed_precision=mixed_precision, variable_seq_lengths=False, **kwargs)


def step(model, mode, *, forward_only=False, spy=None, samples=None):
    """One GRPO step of ``model`` in ``mode``: loss, log-probs, the loss's (log-probs, entropies),
    labels and every parameter gradient (fp32)."""
    loss = grpo(True)
    model.set_loss(loss)
    for p in model.model[0].parameters():
        p.grad = None
    if MODES[mode] is not None:
        integration.install(mask_skip="never", **MODES[mode])
    samples = samples or th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
    kwargs = dict(inputs=copy.deepcopy(samples), micro_batch_size=2, temperature=0.7)
    try:
        with spy if spy is not None else contextlib.nullcontext():
            out = th.run_step(model, forward_only, ADVANTAGES, **kwargs)
    finally:
        integration.uninstall()
    labels = _rows([inp["labels"] for inp in th.step_status(model, forward_only).inputs], -100)
    logps = _rows(out["logps"], 0) if isinstance(out["logps"], list) else out["logps"]
    grads = {n: p.grad.detach().float().clone() for n, p in model.model[0].named_parameters() if p.grad is not None}
    return dict(loss=out["loss"], logps=logps, seen=loss.seen, labels=labels, grads=grads)


def _rows(tensors, fill):
    """Micro-batches' [rows, width] tensors (widths differ with variable_seq_lengths) as one [rows, max width]."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors])


def _entropies(result):
    return _rows([ent for _, ent in result["seen"]], 0)


def assert_same(got, want, tol=1e-4, what=""):
    mask = want["labels"] != -100
    assert torch.equal(got["labels"], want["labels"])
    assert got["loss"] == pytest.approx(want["loss"], rel=tol, abs=1e-6), what
    assert_close(got["logps"][mask], want["logps"][mask], torch.float32, f"{what} logps")
    assert len(got["seen"]) == len(want["seen"]) == 2
    assert_close(_entropies(got)[mask], _entropies(want)[mask], torch.float32, f"{what} entropy")
    assert got["grads"].keys() == want["grads"].keys()
    for name, ref in want["grads"].items():
        assert_close(got["grads"][name], ref, torch.float32, f"{what} grad of {name}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp32_same_as_shipped(checkpoints, tied, fused_calls):
    model = build(checkpoints[tied])
    from mcore_bridge.model.gpt_model import GPTModel
    chunk = model.model[0]
    assert type(chunk) is GPTModel and chunk.share_embeddings_and_output_weights == tied
    assert {p.dtype for p in chunk.parameters()} == {torch.float32}
    runs = {mode: step(model, mode) for mode in MODES}
    assert len(fused_calls) == 2  # the fused run: once per micro-batch
    assert len(runs["shipped"]["grads"]) == len(list(chunk.parameters())) > 10  # every parameter has a gradient
    for mode in ("install", "fused"):
        assert_same(runs[mode], runs["shipped"], what=mode)
    only = {mode: step(model, mode, forward_only=True) for mode in MODES}
    for mode in ("install", "fused"):
        mask = only["shipped"]["labels"] != -100
        assert_close(only[mode]["logps"][mask], only["shipped"]["logps"][mask], torch.float32, f"{mode} forward_only")
        assert only[mode]["grads"] == {}


def _errors(run, exact):
    """The error of each quantity against the exact run: the norm of the difference relative to the
    norm of the exact values (the gradients: all parameters' together)."""
    mask = exact["labels"] != -100

    def err(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    errors = {"loss": abs(run["loss"] - exact["loss"]) / abs(exact["loss"]),
              "logps": err(run["logps"][mask], exact["logps"][mask]),
              "entropy": err(_entropies(run)[mask], _entropies(exact)[mask])}
    names = sorted(exact["grads"])
    errors["grads"] = err(torch.cat([run["grads"][n].flatten() for n in names]),
                          torch.cat([exact["grads"][n].flatten() for n in names]))
    return errors


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_at_least_as_accurate_as_shipped(checkpoints, tied):
    exact = step(build(checkpoints[tied]), "shipped")  # fp32 parameters, the same values
    model = build(checkpoints[tied], mixed_precision="bf16")
    # bf16 everywhere but in the local spec's torch norms (stand-in 4), which keep fp32 weights
    assert {p.dtype for n, p in model.model[0].named_parameters() if "layernorm" not in n} == {torch.bfloat16}
    runs = {mode: step(model, mode) for mode in MODES}
    errors = {mode: _errors(run, exact) for mode, run in runs.items()}
    assert errors["shipped"]["logps"] > 1e-3  # bf16 rounding is visible: the comparison can tell
    for mode in ("install", "fused"):
        for what in ("loss", "logps", "entropy"):
            assert errors[mode][what] <= errors["shipped"][what], (mode, what, errors)
        # shipped's log-softmax rounds in bf16, twinkle-mem's in fp32: several times more accurate
        assert errors[mode]["logps"] < 0.25 * errors["shipped"]["logps"], errors
        # the gradients' error is the backbone's bf16 rounding, the same in all three runs (~6e-3):
        # no worse than shipped's, up to a tenth of it
        assert errors[mode]["grads"] <= 1.1 * errors["shipped"]["grads"], (mode, errors)


@pytest.mark.parametrize("forward_only", [False, True], ids=["forward_backward", "forward_only"])
def test_no_vocab_sized_tensor_in_fused_runs(checkpoints, forward_only):
    model = build(checkpoints[False])
    rows = 2 * SEQ  # one micro-batch
    shipped = VocabTensors((VOCAB, ), rows * VOCAB // 2)
    step(model, "shipped", forward_only=forward_only, spy=shipped)
    assert shipped.last_dim and shipped.large  # control: the logits are seen where they exist
    fused = VocabTensors((VOCAB, ), rows * VOCAB // 2)
    got = step(model, "fused", forward_only=forward_only, spy=fused)
    assert fused.ops > 300 and fused.last_dim == [] and fused.large == []
    assert got["logps"].shape == got["labels"].shape


# --- multi-token prediction ------------------------------------------------------


@pytest.fixture
def output_layer_calls():
    """Count the output layer's calls of a model (its module hooks fire whatever forward it has)."""
    counts, handles = [], []

    def watch(model):
        layer = model.model[0].output_layer
        handles.append(layer.register_forward_hook(lambda *_: counts.append(1)))
        return counts

    yield watch
    for handle in handles:
        handle.remove()


def test_mtp_eligible_when_called_without_labels(checkpoints, fused_calls, output_layer_calls):
    """mcore_bridge's GPTModel runs its MTP head only with labels; twinkle's forward step pops them: the
    output layer runs once per micro-batch and the fused head applies, with the shipped results."""
    model = build(checkpoints[False], mtp_num_layers=1)
    assert model.model[0].mtp_process and model.model[0].config.mtp_num_layers == 1
    calls = output_layer_calls(model)
    want = step(model, "shipped")
    assert len(calls) == 2  # two micro-batches, once each
    got = step(model, "fused")
    assert len(calls) == 4 and len(fused_calls) == 2
    assert any("mtp" in name for name in got["grads"]) is False  # the MTP head did not run
    assert_same(got, want, what="fused MTP")


def test_mtp_model_called_with_labels_runs_unchanged(checkpoints, fused_calls, output_layer_calls):
    """The same model called with labels inside a fused call (not twinkle's forward step): the MTP head
    runs, the output layer runs once more for it, and the deferred head steps aside (the model's own loss)."""
    from twinkle_mem.integrations.twinkle import fused_eligibility as eligibility
    from twinkle_mem.integrations.twinkle import fused_call as lm_head
    model = build(checkpoints[False], mtp_num_layers=1)
    chunk = model.model[0].eval()  # in training mode MTP's loss logging asks for a CUDA device
    calls = output_layer_calls(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    causal = torch.ones(24, 24, dtype=torch.bool).triu(1).expand(2, 1, 24, 24)  # True: masked
    kwargs = dict(input_ids=ids, position_ids=torch.arange(24).expand(2, 24), attention_mask=causal, labels=labels)
    want = chunk(**kwargs)
    assert len(calls) == 2  # main head + one MTP layer
    call = lm_head.FusedCall(1.0, False, CHUNK)
    call.set_labels(labels)
    with lm_head.deferred([chunk.output_layer], lm_head.megatron_forward, call), \
            lm_head.mtp_called_without_labels([chunk], call):
        got = chunk(**kwargs)
        assert call.model_has_labels is False and call.pending is None
    assert len(calls) == 4 and fused_calls == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert eligibility.megatron_output_layers([chunk]) == ([chunk.output_layer], None)


# --- packed (padding-free) batches ----------------------------------------------


def test_packed_batches_same_as_padded(checkpoints, fused_calls):
    """twinkle's ``InputProcessor(padding_free=True)`` packs each micro-batch into one [1, tokens] row with
    ``packed_seq_params``; twinkle unpacks the log-probs per sample after the loss's selective_log_softmax.
    With the packed attention run by stand-in 12 (standins/mcore_bridge.py): shipped, install() and the
    fused head on packed micro-batches give the padded run's loss, log-probs under the loss mask, entropy
    and gradients."""
    from megatron.core import parallel_state as mpu
    from twinkle.processor import InputProcessor
    mpu.destroy_model_parallel()
    model = mb.megatron_model(checkpoints[False], mixed_precision="no", variable_seq_lengths=True)  # packing needs it
    padded = step(model, "shipped")
    model.set_processor(InputProcessor, padding_free=True)
    with mb.packed_attention_on_cpu():
        runs = {mode: step(model, mode) for mode in MODES}
    # the fused op saw one packed row per micro-batch: hidden [tokens, 1, H]
    assert [shape[:2] for shape, _ in fused_calls] == [(2 * SEQ - 7, 1), (2 * SEQ - 14, 1)], fused_calls
    for mode, run in runs.items():
        assert run["labels"].shape == padded["labels"].shape, mode  # unpacked by twinkle, one row per sample
        assert_same(run, padded, what=f"packed {mode}")


def test_full_recompute_same_as_shipped(checkpoints, fused_calls):
    """twinkle's default activation checkpointing (recompute_granularity='full', uniform, 1 layer): each
    layer's forward runs again in the backward; the fused head gives shipped's results."""
    model = build(checkpoints[False], recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    assert model.strategy.config.recompute_granularity == "full"
    layer_calls = []
    model.model[0].decoder.layers[0].register_forward_hook(lambda *_: layer_calls.append(1))
    runs = {mode: step(model, mode) for mode in MODES}
    assert len(layer_calls) == 3 * 2 * 2  # 3 runs x 2 micro-batches x (forward + recompute)
    assert len(fused_calls) == 2
    for mode in ("install", "fused"):
        assert_same(runs[mode], runs["shipped"], what=f"recompute {mode}")
