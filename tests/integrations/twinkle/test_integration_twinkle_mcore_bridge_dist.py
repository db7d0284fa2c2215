"""twinkle's ``MegatronModel(model_id=...)`` built through mcore_bridge (standins/mcore_bridge.py) across
ranks: gloo worlds of 2 CPU processes, each against the same layout of twinkle-kit as shipped.

- TP = 2 (twinkle wraps the model in Megatron's DDP): no tensor with the vocab (1018) or its shard (509)
  as last dim on the fused run, where shipped's has them; loss and log-probs equal shipped TP = 2; every
  rank's gradient shard of the fused run equals install()'s (exact in fp32); shipped TP = 2 rounds the
  logits' gradient to bf16 in megatron-core's fused vocab-parallel cross entropy, so its gradients are
  compared at that level (against TP = 1: tests/integrations/twinkle/test_integration_twinkle_fused_tp.py, hand-built
  GPTModel); entropy (which shipped refuses under TP > 1) against install();
- TP = 2 with sequence parallelism, run for real with two more stand-ins (megatron-core's torch norm
  refuses SP; its SP buffers ask for a CUDA device): log-probs as shipped SP, gradients and entropy as
  install() without SP.
- PP = 2 (1F1B) and PP = 2 x VPP = 2 (interleaved): loss, log-probs and entropy on the last stage and
  every stage's gradients equal shipped; bf16 with Float16Module at PP = 2 and TP = 2 (a user gets it by
  passing ``bf16=True`` to ``MegatronModel``, which
  twinkle hands to the model config; twinkle's ``wrap_model`` then wraps each chunk in Float16Module
  before DDP): against an exact fp32 run of the same layout and bf16 weights, twinkle-mem no less accurate
  than shipped.

Rank 0 saves the checkpoint to a temporary directory that every rank reads.
"""
import contextlib
import tempfile

import pytest
import torch
from helpers import (ADVANTAGES, CHUNK, FUSED_BLOCKS, LENGTHS, PROMPT, SEQ, VOCAB, Cases, VocabTensors, assert_close,
                     blocks, grpo)

pytestmark = pytest.mark.e2e  # a distributed Megatron matrix (gloo worlds): the end-to-end tier

WORLD = 2
MODES = ("shipped", "install", "fused")


@contextlib.contextmanager
def _on_cpu():
    from standins import mcore_bridge as mb
    with mb.mcore_bridge_on_cpu():
        yield


cases = Cases(__name__, timeout_s=420, setup=_on_cpu)
case = cases.register(WORLD)
_CHECKPOINTS = {}


def _checkpoint(tied=False, layers=2):
    """The tiny Qwen3 (weights exact in bf16), saved once per world by rank 0."""
    import torch.distributed as dist

    from standins import mcore_bridge as mb
    if (tied, layers) not in _CHECKPOINTS:
        path = [tempfile.mkdtemp(prefix="tiny-qwen3-") if dist.get_rank() == 0 else None]
        if dist.get_rank() == 0:
            model = mb.save_tiny_qwen3(path[0], vocab=VOCAB, tied=tied, layers=layers, seed=1)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            model.save_pretrained(path[0])
        dist.broadcast_object_list(path, src=0)
        _CHECKPOINTS[tied, layers] = path[0]
    return _CHECKPOINTS[tied, layers]


def _steps(modes, *, tp=1, pp=1, entropy=False, tied=False, layers=2, mixed_precision="no", forward_only=False,
           spies=None, **kwargs):
    """One model (twinkle's strategy sets up megatron's parallel state for it) and one GRPO step per mode."""
    import copy

    from standins import mcore_bridge as mb
    from standins import megatron as th
    from megatron.core import parallel_state as mpu

    from twinkle_mem.integrations import twinkle as integration
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    model = mb.megatron_model(_checkpoint(tied, layers), tp=tp, pp=pp, mixed_precision=mixed_precision,
                              variable_seq_lengths=False, **kwargs)
    samples = th.lm_samples(LENGTHS, VOCAB, prompt=PROMPT)
    runs = {}
    for mode in modes:
        loss = grpo(entropy)
        model.set_loss(loss)
        for p in (p for chunk in model.model for p in chunk.parameters()):
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        if mode != "shipped":
            integration.install(mask_skip="never", fused_lm_head=mode == "fused",
                                fused_chunk_bytes=CHUNK if mode == "fused" else None)
        try:
            call = dict(inputs=copy.deepcopy(samples), micro_batch_size=2, temperature=0.7)
            with (spies or {}).get(mode, contextlib.nullcontext()), blocks(*FUSED_BLOCKS):
                out = th.run_step(model, forward_only, ADVANTAGES, **call)
        finally:
            integration.uninstall()
        chunks = model.strategy.unwrap_model(model.model)  # more than one with virtual pipeline stages
        grads = {}
        for name, p in ((f"{i}.{n}", p) for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()):
            g = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
            if g is not None:
                grads[name] = (g.detach().float().clone(), getattr(p, "tensor_model_parallel", False),
                               getattr(p, "partition_dim", 0))
        runs[mode] = dict(loss=out["loss"], logps=out["logps"], seen=loss.seen, grads=grads,
                          labels=th.step_labels(model, forward_only))
    runs["model"] = model
    return runs


def _assert_logps(got, want, what, tol=1e-4):
    mask = want["labels"] != -100
    assert torch.equal(got["labels"], want["labels"])
    assert got["loss"] == pytest.approx(want["loss"], rel=tol, abs=1e-6), what
    assert_close(got["logps"][mask], want["logps"][mask], torch.float32, f"{what} logps")


def _assert_entropy(got, want, what):
    mask = want["labels"] != -100
    ent = torch.cat([e for _, e in got["seen"]])
    ref = torch.cat([e for _, e in want["seen"]])
    assert_close(ent[mask], ref[mask], torch.float32, f"{what} entropy")


def _norm_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@case
def tp2_same_as_shipped(rank, world):
    # the vocab or its shard as last dim, or half a micro-batch's logits shard
    spies = {mode: VocabTensors((VOCAB, VOCAB // WORLD), 2 * SEQ * VOCAB // WORLD // 2) for mode in ("shipped", "fused")}
    tp2 = _steps(MODES, tp=2, spies=spies)
    tp2_entropy = _steps(["install", "fused"], tp=2, entropy=True)
    tp2_only = _steps(MODES, tp=2, forward_only=True)
    # collectives done
    from megatron.core.distributed import DistributedDataParallel
    assert isinstance(tp2["model"].model[0], DistributedDataParallel)  # twinkle's wrap at world size 2
    for mode in ("install", "fused"):
        _assert_logps(tp2[mode], tp2["shipped"], f"TP=2 {mode}")
        _assert_logps(tp2_only[mode], tp2_only["shipped"], f"TP=2 forward_only {mode}")
    # install()'s vocab-parallel op is exact in fp32 (tests/op/test_vocab_parallel.py): the fused head's
    # gradient shards equal it; shipped's, rounded to bf16 in megatron-core's fused cross entropy, are
    # within that rounding
    assert tp2["shipped"]["grads"].keys() == tp2["fused"]["grads"].keys() == tp2["install"]["grads"].keys()
    assert len(tp2["fused"]["grads"]) > 10
    for name, (grad, sharded, _) in tp2["install"]["grads"].items():
        assert_close(tp2["fused"]["grads"][name][0], grad, torch.float32, f"TP=2 fused grad of {name} (rank {rank})")
        assert _norm_err(tp2["shipped"]["grads"][name][0], grad) < 2**-7, name
    # Megatron DDP's flat gradient buffer (1-D, all of a rank's parameters) is larger than a logits shard
    # here: only tensors of two or more dims count as large
    large = {mode: [t for t in spy.large if len(t[1]) > 1] for mode, spy in spies.items()}
    assert spies["shipped"].last_dim and large["shipped"]  # control: the logits shards are seen
    assert spies["fused"].ops > 300 and spies["fused"].last_dim == [] and large["fused"] == [], (
        spies["fused"].last_dim[:5], large["fused"][:5])
    _assert_logps(tp2_entropy["fused"], tp2_entropy["install"], "TP=2 fused, entropy")
    _assert_entropy(tp2_entropy["fused"], tp2_entropy["install"], "TP=2 fused")
    for name, (grad, _, _) in tp2_entropy["install"]["grads"].items():
        assert_close(tp2_entropy["fused"]["grads"][name][0], grad, torch.float32, f"TP=2 entropy grad of {name}")


@case
def tp2_sequence_parallel(rank, world):
    """TP = 2 with sequence parallelism, run for real (stand-ins 10-11 of standins/mcore_bridge.py):
    the same log-probs as shipped with SP, and every gradient shard as install() without SP."""
    from standins import mcore_bridge as mb
    with mb.sequence_parallel_on_cpu():
        sp = _steps(MODES, tp=2, sequence_parallel=True)
        sp_entropy = _steps(["install", "fused"], tp=2, sequence_parallel=True, entropy=True)
    plain = _steps(["install"], tp=2)
    plain_entropy = _steps(["install"], tp=2, entropy=True)
    # collectives done
    assert sp["model"].strategy.config.sequence_parallel
    chunk = sp["model"].strategy.unwrap_model(sp["model"].model)[0]
    assert chunk.output_layer.sequence_parallel
    for mode in ("install", "fused"):
        _assert_logps(sp[mode], sp["shipped"], f"SP {mode}")
        _assert_logps(sp[mode], plain["install"], f"SP {mode} vs no SP")
        for name, (grad, _, _) in plain["install"]["grads"].items():
            assert_close(sp[mode]["grads"][name][0], grad, torch.float32, f"SP {mode} grad of {name} (rank {rank})")
    _assert_entropy(sp_entropy["fused"], plain_entropy["install"], "SP fused")
    for name, (grad, _, _) in plain_entropy["install"]["grads"].items():
        assert_close(sp_entropy["fused"]["grads"][name][0], grad, torch.float32, f"SP entropy grad of {name}")


def _pp2_checks(rank, want, got, what, entropy):
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), what
    assert got["grads"].keys() == want["grads"].keys() and want["grads"]
    for name, (grad, _, _) in want["grads"].items():
        assert_close(got["grads"][name][0], grad, torch.float32, f"{what} grad of {name} (stage {rank})")
    if rank == WORLD - 1:
        _assert_logps(got, want, what)
        if entropy:
            _assert_entropy(got, want, what)
    else:  # nothing on the first stage (twinkle-kit 0.4.0: an empty list, later ones None)
        assert got["logps"] in (None, []) and want["logps"] in (None, []), (got["logps"], want["logps"])


@case
def pp2_same_as_shipped(rank, world):
    # untied: a tied head at PP = 2 needs CUDA on the CPU (megatron-core's
    # LanguageModule.setup_embeddings_and_output_layer moves the last stage's embedding copy with .cuda())
    runs = _steps(MODES, pp=2, entropy=True)
    only = _steps(MODES, pp=2, entropy=True, forward_only=True)
    for mode in ("install", "fused"):
        _pp2_checks(rank, runs["shipped"], runs[mode], f"PP=2 {mode}", True)
        if rank == WORLD - 1:
            _assert_logps(only[mode], only["shipped"], f"PP=2 forward_only {mode}")


@case
def pp2_vpp2_same_as_shipped(rank, world):
    """Interleaved pipeline, PP = 2 x VPP = 2 (4 layers, a model chunk per virtual stage): the last
    virtual stage's output layer is fused."""
    runs = _steps(MODES, pp=2, vpp=2, layers=4, entropy=True)
    assert len(runs["model"].model) == 2
    for mode in ("install", "fused"):
        _pp2_checks(rank, runs["shipped"], runs[mode], f"PP=2 x VPP=2 {mode}", True)


def _bf16_no_less_accurate(rank, exact, runs, last_stage):
    """Each mode's error against the exact fp32 run; twinkle-mem's no larger than shipped's."""
    errors = {}
    for mode in MODES:
        run = runs[mode]
        names = sorted(exact["grads"])
        err = {"grads": _norm_err(torch.cat([run["grads"][n][0].flatten() for n in names]),
                                  torch.cat([exact["grads"][n][0].flatten() for n in names])),
               "loss": abs(run["loss"] - exact["loss"]) / abs(exact["loss"])}
        if last_stage:
            mask = exact["labels"] != -100
            err["logps"] = _norm_err(run["logps"][mask], exact["logps"][mask])
        errors[mode] = err
    assert errors["shipped"]["grads"] > 1e-3  # the bf16 rounding is visible
    # Float16Module hands the last stage fp32 logits (bf16 values): all three log-softmaxes see the same
    # numbers, and their errors agree up to summation order (1e-3 of the error); the gradients' error is
    # the backbone's bf16 rounding, the same in all three runs
    for mode in ("install", "fused"):
        for what, e in errors[mode].items():
            # + one fp32 rounding (2^-23 relative): the loss is one fp32 scalar, and an error of 0 for shipped
            # (its bf16 logits give the exact run's loss to the last bit) leaves no room for a last-bit difference
            # of the fused head's tile and block order.
            bound = errors["shipped"][what] * (1.1 if what == "grads" else 1.001) + 2.0**-23
            assert e <= bound, (rank, mode, what, errors)


@case
def pp2_bf16_float16module(rank, world):
    from megatron.core.transformer.module import Float16Module
    exact = _steps(["shipped"], pp=2, entropy=True)["shipped"]
    runs = _steps(MODES, pp=2, entropy=True, mixed_precision="bf16", bf16=True)
    assert isinstance(runs["model"].model[0].module, Float16Module)  # DDP(Float16Module(GPTModel))
    _bf16_no_less_accurate(rank, exact, runs, last_stage=rank == WORLD - 1)


@case
def tp2_bf16_float16module(rank, world):
    from megatron.core.transformer.module import Float16Module
    exact = _steps(["install"], tp=2)["install"]  # exact in fp32 (shipped's TP gradients are bf16-rounded)
    runs = _steps(MODES, tp=2, mixed_precision="bf16", bf16=True)
    assert isinstance(runs["model"].model[0].module, Float16Module)
    _bf16_no_less_accurate(rank, exact, runs, last_stage=True)


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"w{v}" if isinstance(v, int) else v)
def test_mcore_bridge_across_ranks(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
