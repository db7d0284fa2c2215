"""install(fused_lm_head=True) under Megatron tensor parallelism: a gloo world of 2 CPU processes.

- twinkle's real MegatronModel around a real megatron-core GPTModel with TP = 2 (each rank its
  vocab shard of the output layer): log-probs, entropy, loss and every parameter gradient (this
  rank's shard) equal those of the unfused TP = 1 run of the same weights; forward_only too; no
  tensor with the vocab (1018) or its shard (509) as last dim exists on the fused run.
- Sequence parallelism: gloo does run its all-gather and reduce-scatter (torch 2.13), and
  megatron-core's SP mappings run on the CPU once their buffers are (``torch.cuda.current_device``
  answered with "cpu" in this test), but megatron-core 0.16.1 builds no GPTModel with
  sequence_parallel on the CPU (its torch LayerNorm fallback refuses it without Apex /
  Transformer Engine). The deferred output layer's SP input mapping is checked on a real
  ColumnParallelLinear with sequence_parallel=True instead: the values, the sequence shard's
  input gradient and the weight shard's gradient equal the layer's own SP forward and backward
  followed by the unfused vocab-parallel op.

The world is started once (spawn) and runs every case; a rank reports its tracebacks per case.
"""
import contextlib

import pytest
import torch
from helpers import (ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, SEQ, VOCAB, Cases, VocabTensors, assert_close,
                     blocks, grpo)

pytestmark = pytest.mark.e2e  # a distributed Megatron matrix (gloo worlds): the end-to-end tier

WORLD = 2


@contextlib.contextmanager
def _megatron_on_cpu():
    """What every rank needs for megatron-core's GPTModel and scheduler and twinkle's Platform on the CPU."""
    from standins import megatron as th
    with th.cpu_schedules(), th.megatron_gpt_cpu(), th.cpu_platform("cpu"):
        yield


cases = Cases(__name__, timeout_s=240, setup=_megatron_on_cpu)
case = cases.register(WORLD)


def _run_twinkle(tp, fused, *, tied, entropy, forward_only=False, spy=None):
    from standins import megatron as th
    from megatron.core import parallel_state as mpu

    from twinkle_mem.integrations import twinkle as integration
    stack = contextlib.ExitStack()
    stack.enter_context(blocks(*FUSED_BLOCKS))  # (undone in the finally below)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    integration.install(mask_skip="never", fused_lm_head=fused, fused_chunk_bytes=CHUNK if fused else None)
    try:
        chunk = th.gpt_model(VOCAB, tied=tied)
        loss = grpo(entropy)
        model = th.twinkle_megatron_model(chunk, loss=loss, tp_size=tp)
        samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
        kwargs = dict(inputs=samples, micro_batch_size=2, temperature=0.7)
        with spy if spy is not None else contextlib.nullcontext():
            out = th.run_step(model, forward_only, ADVANTAGES, **kwargs)
        labels = th.step_labels(model, forward_only)
        grads = {n: (p.grad.detach().clone(), getattr(p, "tensor_model_parallel", False),
                     getattr(p, "partition_dim", 0)) for n, p in chunk.named_parameters() if p.grad is not None}
        return dict(out=out, grads=grads, seen=loss.seen, labels=labels)
    finally:
        stack.close()
        integration.uninstall()
        mpu.destroy_model_parallel()


def _check_against_tp1(rank, got, want, entropy):
    mask = want["labels"] != -100
    assert torch.equal(got["labels"], want["labels"])
    assert abs(got["out"]["loss"] - want["out"]["loss"]) <= 1e-4 * max(1.0, abs(want["out"]["loss"]))
    assert_close(got["out"]["logps"][mask], want["out"]["logps"][mask], torch.float32, "logps")
    assert len(got["seen"]) == len(want["seen"]) > 0
    per_call = want["labels"].split(want["labels"].shape[0] // len(want["seen"]))
    for (logps, ent), (ref_logps, ref_ent), labels in zip(got["seen"], want["seen"], per_call):
        loss_mask = labels != -100
        assert_close(logps[loss_mask], ref_logps[loss_mask], torch.float32, "logps seen by the loss")
        assert (ent is None) == (ref_ent is None) == (not entropy)
        if entropy:
            assert_close(ent[loss_mask], ref_ent[loss_mask], torch.float32, "entropy")
    assert got["grads"].keys() == want["grads"].keys()
    for name, (grad, sharded, dim) in got["grads"].items():
        full = want["grads"][name][0]
        expected = full.chunk(WORLD, dim=dim)[rank] if sharded else full
        assert_close(grad, expected, torch.float32, f"grad of {name} (rank {rank}{', shard' if sharded else ''})")


def _tp2_matches_tp1(rank, tied, entropy):
    want = _run_twinkle(1, False, tied=tied, entropy=entropy)
    control = _run_twinkle(2, False, tied=tied, entropy=entropy)  # TP = 2 unfused: the same weights
    spy = VocabTensors((VOCAB, VOCAB // WORLD), 2 * SEQ * VOCAB // WORLD // 2)  # half a micro-batch's shard
    got = _run_twinkle(2, True, tied=tied, entropy=entropy, spy=spy)
    want_only = _run_twinkle(1, False, tied=tied, entropy=entropy, forward_only=True)
    got_only = _run_twinkle(2, True, tied=tied, entropy=entropy, forward_only=True)
    # all collectives done
    _check_against_tp1(rank, control, want, entropy)
    _check_against_tp1(rank, got, want, entropy)
    mask = want_only["labels"] != -100
    torch.testing.assert_close(got_only["out"]["logps"][mask], want_only["out"]["logps"][mask], rtol=1e-4, atol=1e-4)
    assert spy.ops > 300 and spy.last_dim == [] and spy.large == []


@case
def gpt_tp2_untied_entropy(rank, world):
    _tp2_matches_tp1(rank, tied=False, entropy=True)


@case
def gpt_tp2_tied_logp(rank, world):
    _tp2_matches_tp1(rank, tied=True, entropy=False)


@case
def sequence_parallel_output_layer(rank, world):
    """The deferred forward of a ColumnParallelLinear with sequence_parallel=True against the layer's own."""
    import twinkle_mem
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from twinkle_mem.integrations.twinkle import fused_call as lm_head
    mpu.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # megatron's SP gather/scatter buffers
    try:
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   tensor_model_parallel_size=WORLD, sequence_parallel=True)
        torch.manual_seed(0)
        layer = ColumnParallelLinear(32, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
                                     tp_group=mpu.get_tensor_model_parallel_group())
        assert layer.sequence_parallel
        s, b = 12, 2
        gen = torch.Generator().manual_seed(1)
        full_hidden = torch.randn(s, b, 32, generator=gen)
        labels = torch.randint(0, VOCAB, (b, s), generator=gen)
        labels[:, :3] = -100
        g_logp, g_ent = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)
        shard = slice(rank * s // WORLD, (rank + 1) * s // WORLD)  # this rank's sequence shard

        def backward(logp, ent, hidden):
            total = (logp * g_logp).sum() + (ent * g_ent).sum()
            return torch.autograd.grad(total, (hidden, layer.weight))

        h = full_hidden[shard].clone().requires_grad_()
        logits, _ = layer(h)  # [s, b, V/tp], the sequence gathered
        masked = labels.masked_fill(labels == -100, 0)
        logp, ent = twinkle_mem.selective_log_softmax(logits.transpose(0, 1), masked, True, temperature=0.7,
                                                      process_group=mpu.get_tensor_model_parallel_group())
        keep = labels != -100
        want = (logp * keep, ent * keep, *backward(logp * keep, ent * keep, h))

        call = lm_head.FusedCall(0.7, True, CHUNK)
        call.set_labels(labels)
        h = full_hidden[shard].clone().requires_grad_()
        with blocks(*FUSED_BLOCKS), lm_head.deferred([layer], lm_head.megatron_forward, call):
            placeholder, _ = layer(h)
            logp, ent = lm_head.take(placeholder.transpose(0, 1), masked, True)
            got = (logp, ent, *backward(logp, ent, h))
    finally:
        torch.cuda.current_device = current_device
        mpu.destroy_model_parallel()
    assert placeholder.shape == (s, b, 0)
    for name, g, w in zip(["logp", "entropy", "grad_hidden (sequence shard)", "grad_weight (vocab shard)"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")  # noqa: B023


# ----------------------------------------------------------------- the world


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_fused_lm_head_tp2(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
