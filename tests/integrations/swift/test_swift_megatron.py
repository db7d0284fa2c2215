"""Megatron-SWIFT's GRPO log-probs on twinkle-mem, in a gloo world of 2 (megatron-core's parallel state, its
GPTModel built on the CPU: standins/megatron.py):

- ``megatron_fused_head`` (``megatron_head.py``): a GPTModel's output layer deferred, ms-swift's step as it runs
  (the model's output divided by the temperature in place, ``compute_logps_and_entropy_from_logits`` on it). At
  TP = 2 the log-probs, entropy and every parameter's gradient (this rank's shard) equal those of one process
  (TP = 1, ms-swift's own function on the logits) within 1e-5 (fp32), and no tensor with the vocab or its shard as
  last dim exists; ms-swift's own function at TP = 2 beside it (its log-prob gradient there is what PR #9947
  fixed). Untied and tied, sequence parallelism (standins/mcore_bridge.py 10-11), a frozen output layer (LoRA's).
  A forward without gradient (the old and reference log-probs, which ms-swift takes outside that forward's
  ``no_grad``) builds no graph. Refused by name: an output layer that is not a plain ColumnParallelLinear (ms-swift's
  path runs); a deferred input nobody takes raises.
- ``megatron_logits_path`` (``logits_path.py``): the op over the TP group on each rank's vocab shard of the same
  logits, against a single process's float64 log-probs, entropy and gradient within 1e-5 (fp32).
"""
import contextlib
import logging

import pytest
import torch
import torch.distributed as dist

from helpers import CHUNK, FUSED_BLOCKS, Cases, VocabTensors, blocks

VOCAB, TOLERANCE = 96, 1e-5
GPT_VOCAB, SEQ, BATCH = 1018, 12, 2  # (no other dim of the GPTModel is 1018 or 509)
WORLD = 2


@contextlib.contextmanager
def megatron_on_cpu():
    from standins import megatron as th
    with th.megatron_gpt_cpu():
        yield


cases = Cases(__name__, timeout_s=300, setup=megatron_on_cpu)


@contextlib.contextmanager
def tensor_parallel(tp):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def shipped():
    from swift.megatron.trainers import vocab_parallel_utils
    function = vocab_parallel_utils.compute_logps_and_entropy_from_logits
    return getattr(function, "__wrapped__", function)


def plan(**settings):
    from twinkle_mem.integrations import swift as integration
    from twinkle_mem.integrations.swift import patches, swift_names
    settings = {"fused_lm_head": True, "logits_path": False, "fused_chunk_bytes": None, **settings}
    return patches.SwiftInstallPlan.for_settings(swift_names.PARTS, settings, integration.FRAMEWORK.found())


def patched(**settings):
    from twinkle_mem.integrations.swift.logits_path import megatron_logps_and_entropy
    return megatron_logps_and_entropy(shipped(), plan(**settings))


def assert_within(got, want, what):
    error = (got.double() - want.double()).abs().max().item()
    assert error <= TOLERANCE * max(1.0, want.abs().max().item()), (what, error)


# --- the fused head on a GPTModel -----------------------------------------------------------------------------------

def batch():
    """A micro-batch as Megatron-SWIFT hands its model (labels rolled, -100 on the prompt and the padding), the
    causal mask, and the upstream gradients of the log-probs and entropy."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, GPT_VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, :4], labels[1, -3:] = -100, -100
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    return ids, labels, mask, torch.randn(BATCH, SEQ, generator=g), torch.randn(BATCH, SEQ, generator=g)


def ms_swift_step(tp, fused, *, tied=False, sp=False, frozen=False, temperature=0.7, spy=None):
    """One GPTModel call and log-prob computation as Megatron-SWIFT's GRPO ``forward_step`` makes them (at TP = tp,
    the output layer deferred where ``fused``), then the backward of sum(g_logp logp + g_entropy entropy) over the
    kept positions. Returns (log-probs, entropy, {parameter: (gradient, sharded, partition dim)})."""
    from standins import megatron as th
    from standins import mcore_bridge as mb
    from twinkle_mem.integrations.swift import megatron_head
    ids, labels, mask, g_logp, g_entropy = batch()
    sp = sp and tp > 1  # (one process has no sequence to split: the same model without)
    with (tensor_parallel(tp), mb.sequence_parallel_on_cpu() if sp else contextlib.nullcontext(),
          blocks(*FUSED_BLOCKS)):  # (several vocab blocks and row tiles: the backward's too)
        model = th.gpt_model(GPT_VOCAB, tied=tied, sequence_parallel=sp)
        if frozen:
            model.output_layer.weight.requires_grad_(False)
        function = patched() if fused else shipped()
        with (megatron_head.deferred(model, "test", temperature, CHUNK) if fused else contextlib.nullcontext(),
              spy if spy is not None else contextlib.nullcontext()):
            output = model(input_ids=ids, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=mask)
            output.div_(temperature)
            logps, entropy = function(output, labels, compute_entropy=True)
        kept = labels != -100
        ((g_logp * logps).sum() + (g_entropy * entropy * kept).sum()).backward()
        if sp:  # the norms saw this rank's part of the sequence: summed over the ranks, as finalize_model_grads does
            from megatron.core import parallel_state
            for p in model.parameters():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    grads = {n: (p.grad.detach().clone(), getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", 0))
             for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), (entropy * kept).detach(), grads


def assert_as_one_process(rank, got, want):
    assert_within(got[0], want[0], "logps")
    assert_within(got[1], want[1], "entropy")
    assert got[2].keys() == want[2].keys()
    for name, (grad, sharded, dim) in got[2].items():
        full = want[2][name][0]
        assert_within(grad, full.chunk(WORLD, dim=dim)[rank] if sharded else full, f"grad of {name}")


def fused_tp2_as_one_process(rank, **layout):
    want = ms_swift_step(1, False, **layout)
    control = ms_swift_step(WORLD, False, **layout)  # ms-swift's own at TP = 2: the same weights
    spy = VocabTensors((GPT_VOCAB, GPT_VOCAB // WORLD), BATCH * SEQ * GPT_VOCAB // WORLD // 2)
    got = ms_swift_step(WORLD, True, spy=spy, **layout)
    assert_as_one_process(rank, control, want)
    assert_as_one_process(rank, got, want)
    assert spy.ops > 100 and spy.last_dim == [] and spy.large == []


@cases.register(WORLD)
def fused_untied_tp2(rank, world):
    fused_tp2_as_one_process(rank)


@cases.register(WORLD)
def fused_tied_tp2_temperature_1(rank, world):
    fused_tp2_as_one_process(rank, tied=True, temperature=1.0)


@cases.register(WORLD)
def fused_sequence_parallel_tp2(rank, world):
    fused_tp2_as_one_process(rank, sp=True)


@cases.register(WORLD)
def fused_frozen_output_layer_tp2(rank, world):
    fused_tp2_as_one_process(rank, frozen=True)


@cases.register(WORLD)
def fused_without_gradient_builds_no_graph(rank, world):
    """The old and reference log-probs: Megatron-SWIFT's ``compute_per_token_logps_fn`` runs the forward under
    no_grad and calls the log-prob function after it; the fused head computes in the forward's grad mode (a graph
    to the trained weight there would send the old log-probs' gradient against the new ones' into it)."""
    from standins import megatron as th
    from twinkle_mem.integrations.swift import megatron_head
    ids, labels, mask, _, _ = batch()
    with tensor_parallel(WORLD):
        model = th.gpt_model(GPT_VOCAB)
        results = []
        for fused in (False, True):
            context = megatron_head.deferred(model, "test", 0.7, None) if fused else contextlib.nullcontext()
            with context:
                with torch.no_grad():
                    output = model(input_ids=ids, position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                                   attention_mask=mask)
                output.div_(0.7)
                results.append((patched() if fused else shipped())(output, labels)[0])
    (want, got) = results
    assert not got.requires_grad and got.grad_fn is None
    assert_within(got, want, "old log-probs")


@cases.register(WORLD)
def refused_or_raises(rank, world):
    """An output layer that is not a plain ColumnParallelLinear (a LoRA wrapper's class) is refused by name and
    ms-swift's function computes from the logits; a deferred input that no log-prob function takes raises."""
    from standins import megatron as th
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from twinkle_mem.integrations.swift import megatron_head
    ids, labels, mask, _, _ = batch()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("twinkle_mem.swift").addHandler(handler)
    raised = None
    try:
        with tensor_parallel(WORLD):
            model = th.gpt_model(GPT_VOCAB)
            arguments = dict(input_ids=ids, position_ids=torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=mask)
            with torch.no_grad():
                want = shipped()(model(**arguments), labels)[0]
                model.output_layer.__class__ = type("LoraColumnParallelLinear", (ColumnParallelLinear, ), {})
                with megatron_head.deferred(model, "the refused call", 1.0, None):
                    got = patched()(model(**arguments), labels)[0]
                model.output_layer.__class__ = ColumnParallelLinear
                try:
                    with megatron_head.deferred(model, "the call not taken", 1.0, None):
                        model(**arguments)
                except RuntimeError as e:
                    raised = str(e)
    finally:
        logging.getLogger("twinkle_mem.swift").removeHandler(handler)
    assert_within(got, want, "refused: ms-swift's log-probs")
    assert any("the refused call runs as ms-swift ships it" in r.getMessage() and "LoraColumnParallelLinear" in
               r.getMessage() for r in records), [r.getMessage() for r in records]
    assert raised is not None and "the call not taken" in raised and "did not take its input" in raised


# --- the op on the logits (megatron_logits_path) ------------------------------------------------------------------

def inputs(temperature):
    """The whole logits [2, 7, V] (as the model's output divided by the temperature), labels with -100, and the
    upstream gradients of the log-probs and entropy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, generator=g, dtype=torch.float64) * 3 / temperature
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    labels[:, :2] = -100
    return logits, labels, torch.randn(2, 7, generator=g, dtype=torch.float64), torch.randn(
        2, 7, generator=g, dtype=torch.float64)


def single_process(logits, labels, g_logp, g_entropy):
    """float64 log-probs (0 where -100), entropy and the logits' gradient of sum(g_logp logp + g_entropy entropy)."""
    x = logits.clone().requires_grad_()
    log_p = x.log_softmax(-1)
    kept = labels != -100
    logp = log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * kept
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((g_logp * logp).sum() + (g_entropy * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), x.grad


def on_this_rank(compute, rank, world, temperature):
    logits, labels, g_logp, g_entropy = inputs(temperature)
    want = single_process(logits, labels, g_logp, g_entropy)
    shard = VOCAB // world
    leaf = logits[..., rank * shard:(rank + 1) * shard].float().requires_grad_()
    with tensor_parallel(world):
        logp, entropy = compute(leaf * 1.0, labels, compute_entropy=True)  # (a non-leaf: ms-swift's works in place)
        ((g_logp.float() * logp).sum() + (g_entropy.float() * entropy).sum()).backward()
    errors = {"logp": (logp.double() - want[0]).abs().max().item(),
              "entropy": (entropy.double() - want[1]).abs().max().item(),
              "grad": (leaf.grad.double() - want[2][..., rank * shard:(rank + 1) * shard]).abs().max().item()}
    assert all(e <= TOLERANCE for e in errors.values()), errors


@cases.register(WORLD)
def twinkle_mem_op_at_tp2(rank, world):
    for temperature in (1.0, 0.7):
        on_this_rank(patched(logits_path=True, fused_lm_head=False), rank, world, temperature)


@cases.register(WORLD)
def ms_swift_as_shipped_at_tp2(rank, world):
    on_this_rank(shipped(), rank, world, 1.0)


@pytest.mark.parametrize("world, name", cases.params())
def test_megatron_log_probs_at_tp2(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
