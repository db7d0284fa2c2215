"""verl's FSDP engine with twinkle-mem, in a gloo world of 2 CPU processes (issue 40).

verl's FSDPEngineWithLMHead (FSDP2: the only FSDP torch runs on a CPU-only machine; FSDP1 refuses one), built
as verl's TrainingWorker builds it (standins/verl_cpu.py: verl's platform and engine registration on the CPU),
runs 3 PPO steps as the trainer does: compute_log_prob (infer_batch, entropy on) and the update
(forward_backward_batch with verl's PPO loss, then an optimizer step), with the first pass's log-probs as the old
ones. fp32 throughout, T = 0.7. Against verl as shipped (its logits path, TWINKLE_MEM_VERL unset), equal within
1e-5 in every step (the log-probs and entropy of compute_log_prob, the losses, every metric):
- ``impl_backend=twinkle``, untied head (verl shards lm_head on its own: its weight is a DTensor shard, which
  verl's torch backend cannot take): FSDP unshards it around twinkle-mem's head, no ``full_tensor()`` copy;
- ``impl_backend=twinkle``, tied head (the embedding, the root's parameter);
- verl's logits path on twinkle-mem's op (``logits_path``, as TWINKLE_MEM_VERL=logits_path installs it), and
  verl's own torch fused backend (tied: it runs there), the peers.
"""
import contextlib

import pytest
import torch
from verl_helpers import (assert_steps_equal, build_engine, entropy_grads, ppo_steps, recorded_fused_head,
                          saved_tiny_qwen2, verl_world)

from standins.verl_cpu import cpu_verl

WORLD = 2


cases = verl_world(__name__, 900, cpu_verl)
case = cases.register(WORLD)


def _steps(tied, fused_backend=None, lora_rank=0, entropy_coeff=0.01):
    from transformers import Qwen2ForCausalLM
    forward = vars(Qwen2ForCausalLM)["forward"]
    try:
        with saved_tiny_qwen2(tied=tied) as folder:
            engine = build_engine(folder, fused_backend=fused_backend, lora_rank=lora_rank)
            return engine, ppo_steps(engine, entropy_coeff=entropy_coeff)
    finally:  # verl sets a fused forward on the model class, for every later model of that class: not the next run's
        Qwen2ForCausalLM.forward = forward


@contextlib.contextmanager
def _no_full_tensor():
    """DTensor.full_tensor() of a matrix raises while it holds: twinkle-mem's head makes no copy of a sharded
    weight (verl's optimizer step gathers its scalar gradient norm so, which stays allowed)."""
    from torch.distributed.tensor import DTensor
    real = DTensor.full_tensor

    def refused(self, *args, **kwargs):
        if self.dim() >= 2:
            raise AssertionError("a DTensor weight was gathered whole")
        return real(self, *args, **kwargs)

    DTensor.full_tensor = refused
    try:
        yield
    finally:
        DTensor.full_tensor = real


@case
def twinkle_equals_verl_as_shipped_untied(rank, world):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    _, shipped = _steps(tied=False)
    with _no_full_tensor():
        engine, twinkle = _steps(tied=False, fused_backend="twinkle")
    head = engine.module.lm_head
    assert isinstance(head, FSDPModule) and isinstance(head.weight, DTensor)  # verl sharded it on its own
    assert "twinkle_mem_log_probs" in vars(head)  # the head ran as an FSDP forward method of lm_head
    assert_steps_equal(twinkle, shipped, "impl_backend=twinkle, untied")
    assert twinkle[0]["log_probs"].dtype == torch.float32


@case
def twinkle_and_verl_torch_backend_equal_verl_as_shipped_tied(rank, world):
    _, shipped = _steps(tied=True)
    with recorded_fused_head() as calls:
        _, twinkle = _steps(tied=True, fused_backend="twinkle")
    assert entropy_grads(calls, training=True) == {True}  # (verl's PPO loss, entropy_coeff = 0.01)
    assert entropy_grads(calls, training=False) == {"default"}
    _, verl_torch = _steps(tied=True, fused_backend="torch")
    assert_steps_equal(twinkle, shipped, "impl_backend=twinkle, tied")
    assert_steps_equal(verl_torch, shipped, "impl_backend=torch, tied")


@case
def lora_frozen_head(rank, world):
    """verl's FSDP LoRA (peft on every linear of the layers: the LM head frozen, sharded by verl on its own):
    impl_backend=twinkle equals verl as shipped with entropy_coeff = 0 (the update does not keep the entropy: the
    head is told it is not trained) and 0.01 (trained)."""
    for entropy_coeff, trained in ((0.0, False), (0.01, True)):
        _, shipped = _steps(tied=False, lora_rank=4, entropy_coeff=entropy_coeff)
        with recorded_fused_head() as calls:
            engine, twinkle = _steps(tied=False, fused_backend="twinkle", lora_rank=4, entropy_coeff=entropy_coeff)
        head = engine.module.base_model.model.lm_head
        assert not head.weight.requires_grad and head.weight.grad is None
        assert any(p.requires_grad for name, p in engine.module.named_parameters() if "lora_" in name)
        assert entropy_grads(calls, training=True) == {trained}, entropy_coeff
        assert_steps_equal(twinkle, shipped, f"LoRA, entropy_coeff={entropy_coeff}")


@case
def logits_path_on_the_op_equals_verl_as_shipped(rank, world):
    from twinkle_mem.integrations import verl as integration
    _, shipped = _steps(tied=False)
    integration.install(logits_path=True)  # before the engine is built: it binds its entropy function then
    try:
        import verl.utils.torch_functional as verl_F
        engine, on_the_op = _steps(tied=False)
        assert engine.compute_entropy_from_logits is verl_F.entropy_from_logits
        assert hasattr(verl_F.entropy_from_logits, "__wrapped__")  # twinkle-mem's, around verl's
    finally:
        integration.install()  # back to the entry point's defaults
    assert_steps_equal(on_the_op, shipped, "logits_path")


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"world{v}" if isinstance(v, int) else v)
def test_fsdp_engine(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
