"""verl's Megatron engine built as its users build it, with twinkle-mem (issue 52, point 3): a gloo world of 2 CPU
processes.

``MegatronEngineWithLMHead`` from ``EngineRegistry`` through Megatron-Bridge (verl 0.9.1's default bridge:
``use_mbridge=True``, ``vanilla_mbridge=False``), from a 2-layer Qwen2 checkpoint on disk (norms and biases away
from their initial values), with the CPU stand-ins of standins/verl_megatron.py. 3 PPO steps as the trainer runs
them (``infer_batch`` with entropy, then ``train_batch``: verl's PPO loss, Megatron's SGD step after verl's gradient
clip), in each layout: TP 2, PP 2, TP 2 with sequence parallelism; in bf16 (verl's config accepts bf16 and fp16
only) and in fp32 (set after that check: verl_helpers.build_megatron_engine).

- With twinkle-mem installed and ``impl_backend`` unset (verl's logits path), every step is bitwise equal to verl
  with twinkle-mem uninstalled, and twinkle-mem's head never runs.
- With ``impl_backend=twinkle``, every step within 1e-5 of those (log-probs, entropy, loss, metrics), and
  twinkle-mem's head ran. verl's own fused kernel (``use_fused_kernels=True``, ``impl_backend`` unset) is Triton,
  CUDA only: not run here.
- The engine's weights are the checkpoint's (Megatron-Bridge's export of the engine's model, every tensor).
- mindspeed's engine (``MindspeedEngineWithLMHead``) imports without an NPU: ``mindspeed`` itself is not installed
  (not on PyPI; it needs torch_npu), and verl's engine then skips its repatch. It runs the same path, TP 2.
"""
import contextlib

import pytest
import torch
from verl_helpers import (assert_steps_equal, build_megatron_engine, entropy_grads, ppo_steps, recorded_fused_head,
                          verl_world)

from standins.verl_megatron import megatron_engine_on_cpu

WORLD = 2
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_sp": dict(tp=2, sequence_parallel=True)}
DTYPES = ("bfloat16", "float32")


cases = verl_world(__name__, 1500, megatron_engine_on_cpu)
case = cases.register(WORLD)


@contextlib.contextmanager
def _log_records():
    """The records of twinkle-mem's verl logger, INFO and above, from a fresh "first call" of the Megatron head."""
    import logging

    from twinkle_mem.integrations.verl import megatron_head
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("twinkle_mem.verl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    megatron_head._logged = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _steps(folder, layout, fused_backend=None, dtype="float32", lora=None, entropy_coeff=0.01, keep_engine=False):
    """3 PPO steps of a fresh engine (its own model-parallel state, destroyed after), and the calls of twinkle-mem's
    fused head."""
    from megatron.core import parallel_state as mpu
    try:
        with recorded_fused_head() as calls:
            engine = build_megatron_engine(folder, fused_backend=fused_backend, dtype=dtype, lora=lora, **layout)
            steps = ppo_steps(engine, entropy_coeff=entropy_coeff)
        return (engine if keep_engine else None), steps, calls
    finally:
        mpu.destroy_model_parallel()


@contextlib.contextmanager
def _checkpoint():
    """A 2-layer Qwen2 checkpoint in a temporary folder of this rank (the same weights in every rank)."""
    import tempfile

    from standins.verl_cpu import save_tiny_qwen2
    with tempfile.TemporaryDirectory() as folder:
        yield save_tiny_qwen2(folder, checkpoint=True, layers=2)


def _twinkle_and_unset_equal_shipped(layout, dtypes=DTYPES, **options):
    """For each dtype: verl with twinkle-mem uninstalled, installed with impl_backend unset, and impl_backend=twinkle;
    returns twinkle-mem's head calls in the last twinkle run and its engine."""
    from twinkle_mem.integrations import verl as integration
    for dtype in dtypes:
        with _checkpoint() as folder:
            integration.uninstall()
            try:
                _, shipped, calls = _steps(folder, layout, dtype=dtype, **options)
            finally:
                integration.install()  # the entry point's defaults again
            _, unset, unset_calls = _steps(folder, layout, dtype=dtype, **options)
            with _log_records() as records:
                engine, twinkle, twinkle_calls = _steps(folder, layout, fused_backend="twinkle", dtype=dtype,
                                                        keep_engine=True, **options)
        assert calls == unset_calls == [], dtype
        assert_steps_equal(unset, shipped, f"{dtype}, impl_backend unset", tol=0.0)
        assert_steps_equal(twinkle, shipped, f"{dtype}, impl_backend=twinkle")
        has_head = shipped[0]["log_probs"] is not None  # (a first pipeline stage has none)
        assert bool(twinkle_calls) == has_head, dtype
        lines = [r.getMessage() for r in records if "Megatron fused forward" in r.getMessage()]
        assert len(lines) == has_head, lines  # one line per process, at its first call
    return twinkle_calls, engine


@case
def tp2(rank, world):
    calls, _ = _twinkle_and_unset_equal_shipped(LAYOUTS["tp2"])
    # verl's PPO loss with entropy_coeff = 0.01: the training forwards say the entropy is trained; compute_log_prob's
    # (no gradient) say nothing
    assert entropy_grads(calls, training=True) == {True}
    assert entropy_grads(calls, training=False) == {"default"}


@case
def pp2(rank, world):
    _twinkle_and_unset_equal_shipped(LAYOUTS["pp2"])


@case
def tp2_sequence_parallel(rank, world):
    _twinkle_and_unset_equal_shipped(LAYOUTS["tp2_sp"])


@case
def tp2_lora_frozen_head(rank, world):
    """verl's Megatron LoRA (model.lora, Megatron-Bridge's LoRA on every linear of the layers): the LM head is frozen;
    with entropy_coeff = 0 the trainer does not keep the entropy in the update (the head is told it is not trained),
    with 0.01 it does (trained)."""
    lora = dict(rank=4, alpha=8, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    for entropy_coeff, trained in ((0.0, False), (0.01, True)):
        calls, engine = _twinkle_and_unset_equal_shipped(LAYOUTS["tp2"], dtypes=("float32", ), lora=lora,
                                                         entropy_coeff=entropy_coeff)
        model = engine.module[0].module
        assert not model.output_layer.weight.requires_grad and model.output_layer.weight.grad is None
        adapters = {name: p for name, p in model.named_parameters() if ".adapter." in name}
        assert adapters and all(p.requires_grad for p in adapters.values())
        assert all(p.abs().sum() > 0 for name, p in adapters.items() if "linear_out" in name)  # (trained from 0)
        assert entropy_grads(calls, training=True) == {trained}, entropy_coeff


@case
def weights_are_the_checkpoints(rank, world):
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file
    with _checkpoint() as folder:
        engine = build_megatron_engine(folder, **LAYOUTS["tp2"])
        try:
            # (Megatron-Bridge's export, as verl's get_per_tensor_param calls it; verl's own first moves its
            # distributed optimizer's parameter buffers, which the SGD here has none of)
            exported = {name: tensor.clone() for name, tensor in engine.bridge.export_hf_weights(engine.module)}
        finally:
            mpu.destroy_model_parallel()
        saved = load_file(f"{folder}/model.safetensors")
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name].float(), tensor.float()), name


@case
def mindspeed_engine_on_the_same_path(rank, world):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.engine.mindspeed.transformer_impl import MindspeedEngineWithLMHead

    from standins.verl_megatron import engine_for_cpu
    with _checkpoint() as folder:
        _, shipped, _ = _steps(folder, LAYOUTS["tp2"])
        with engine_for_cpu(MindspeedEngineWithLMHead):
            engine, twinkle, calls = _steps(folder, LAYOUTS["tp2"], fused_backend="twinkle", keep_engine=True)
    assert type(engine) is MindspeedEngineWithLMHead and isinstance(engine, MegatronEngineWithLMHead)
    assert calls
    assert_steps_equal(twinkle, shipped, "mindspeed engine, impl_backend=twinkle")


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"world{v}" if isinstance(v, int) else v)
def test_megatron_engine(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
