"""Ulysses sequence parallelism on verl's FSDP2 engine with twinkle-mem (issue 52, point 4): a gloo world of 2 CPU
processes.

verl's FSDP2 engine with ``ulysses_sequence_parallel_size=2`` (both processes one data-parallel rank, each holding
half of every packed sequence; the attention through verl's all-to-alls, standins/verl_cpu.py's
``ulysses_attention_on_cpu``) against the same engine without it (2 data-parallel ranks given the same batch), on
the same batch: ``compute_log_prob``'s log-probs and entropy (``infer_batch``), and every parameter's gradient of
verl's PPO loss with an entropy bonus (``forward_backward_batch``, gathered whole), fp32, T = 0.7:

- ``impl_backend=twinkle`` with Ulysses, untied (verl's sharded ``lm_head``) and tied: within 1e-5 of the same
  batch without it, packed (rmpad) and padded (``use_remove_padding=False``). verl refuses Ulysses on padded
  batches ("When using sequence parallelism (ulysses_sequence_parallel_size > 1), you must enable
  `use_remove_padding`"), so the padded run is without Ulysses only.
- verl's own torch backend (tied: it cannot take the sharded head) with Ulysses against itself without: the
  difference measured here is recorded (verl #3723: wrong log-probs of vision-language models under Ulysses with
  its fused kernels; #3512: an abnormal KL) and asserted as that bound: on this text model none shows.
"""
import contextlib
from functools import partial

import pytest
from verl_helpers import FP32_TOL, build_engine, max_error, saved_tiny_qwen2, verl_world

from standins.verl_cpu import cpu_verl, ulysses_attention_on_cpu

WORLD = 2
# verl's torch backend, Ulysses against none, on this text model and batch: measured log-probs and entropy bitwise
# equal, gradients 6.0e-8 of the largest (AMD EPYC, 1 thread per process). Its errors of verl #3723 (vision-language
# models' position ids and input slicing under Ulysses) and #3512 (an abnormal KL) do not show here; asserted so.
VERL_TORCH_ULYSSES_TOL = 1e-6


cases = verl_world(__name__, 900, cpu_verl, ulysses_attention_on_cpu)
case = cases.register(WORLD)


@contextlib.contextmanager
def _attention_lengths():
    """The sequence length each attention kernel call saw (Ulysses: the whole packed batch, from a half per rank)."""
    from verl.models.transformers import monkey_patch
    kernel, lengths = monkey_patch._flash_attention_forward, []

    def recorded(query, *args, **kwargs):
        lengths.append(query.shape[1])
        return kernel(query, *args, **kwargs)

    monkey_patch._flash_attention_forward = recorded
    try:
        yield lengths
    finally:
        monkey_patch._flash_attention_forward = kernel


def _run(tied, backend, ulysses=1, remove_padding=True):
    """One batch through a fresh engine: its log-probs and entropy (compute_log_prob), then every parameter's
    gradient (whole) of verl's PPO loss, and the attention lengths seen."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2ForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from standins.verl_cpu import CPU_VARLEN, rollout_batch
    forward = vars(Qwen2ForCausalLM)["forward"]
    attention = CPU_VARLEN if remove_padding else "sdpa"  # (flash-attention's call takes packed batches only)
    try:
        with saved_tiny_qwen2(tied=tied) as folder, _attention_lengths() as lengths:
            engine = build_engine(folder, fused_backend=backend, ulysses=ulysses, remove_padding=remove_padding,
                                  attention=attention)
            local = []  # the tokens each forward of the model body got on this rank
            engine.module.model.register_forward_pre_hook(
                lambda module, args, kwargs: local.append(kwargs["input_ids"].shape[-1]), with_kwargs=True)
            common = dict(temperature=0.7, use_remove_padding=remove_padding, use_fused_kernels=True,
                          micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
            data = rollout_batch(7)  # (every rank the same batch)
            tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **common)
            with engine.eval_mode():
                inferred = engine.infer_batch(data, loss_function=None)["model_output"]
            log_probs, entropy = (no_padding_2_padding(inferred[k], data).float() for k in ("log_probs", "entropy"))
            data = rollout_batch(7)
            data["old_log_probs"] = log_probs
            tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=True,
                                 global_batch_size=4 * engine.get_data_parallel_size(), **common)
            actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                                use_dynamic_bsz=False, entropy_coeff=0.01, rollout_n=1)
            with engine.train_mode():  # (its exit frees the gradients)
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(data, partial(ppo_loss, config=actor), forward_only=False)
                grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                         for name, p in engine.module.named_parameters() if p.grad is not None}
            return dict(log_probs=log_probs, entropy=entropy, grads=grads, attention=lengths, local=local)
    finally:  # verl sets a fused forward on the model class, for every later model of that class: not the next run's
        Qwen2ForCausalLM.forward = forward


def _errors(got, want):
    assert got["grads"].keys() == want["grads"].keys() and len(want["grads"]) >= 10
    return dict(log_probs=max_error(got["log_probs"], want["log_probs"]),
                entropy=max_error(got["entropy"], want["entropy"]),
                gradients=max(max_error(g, want["grads"][name], relative_to_max=True)
                              for name, g in got["grads"].items()))


@case
def twinkle_ulysses_equals_none(rank, world):
    for tied in (False, True):
        _ulysses_equals_none(tied)


def _ulysses_equals_none(tied):
    ulysses = _run(tied, "twinkle", ulysses=2)
    packed = _run(tied, "twinkle")
    padded = _run(tied, "twinkle", remove_padding=False)
    # Ulysses ran: each rank's model body got half of each packed micro-batch (verl pads it to a multiple of 2) and
    # its attention the whole, gathered; without it, the body and the attention got the whole
    assert set(packed["attention"]) == set(packed["local"])
    assert ulysses["local"] == [(n + 1) // 2 for n in packed["local"]]
    assert set(ulysses["attention"]) == {2 * n for n in ulysses["local"]}
    for what, reference in (("packed", packed), ("padded", padded)):
        errors = _errors(ulysses, reference)
        print(f"impl_backend=twinkle, {'tied' if tied else 'untied'}, Ulysses vs none ({what}): {errors}")
        assert max(errors.values()) <= FP32_TOL, f"Ulysses vs no Ulysses, {what}: {errors}"


@case
def verl_torch_backend_ulysses(rank, world):
    errors = _errors(_run(True, "torch", ulysses=2), _run(True, "torch"))
    print(f"verl's torch backend, Ulysses vs none: {errors}")
    assert max(errors.values()) <= VERL_TORCH_ULYSSES_TOL, errors


@case
def verl_refuses_ulysses_on_padded_batches(rank, world):
    with saved_tiny_qwen2() as folder, pytest.raises(Exception, match="you must enable `use_remove_padding`"):
        build_engine(folder, fused_backend="twinkle", ulysses=2, remove_padding=False)


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"world{v}" if isinstance(v, int) else v)
def test_ulysses(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
