"""What the verl tests share: inputs as verl's engines hand them to a model, verl's fused forward run with a
backend, the exact (float64) log-probs and entropy, the tolerances, and verl's FSDP engine run for a few PPO steps.
The CPU stand-ins themselves (verl's platform, its engine registration, gloo) are in standins/verl_cpu.py."""
import contextlib
import tempfile
from functools import partial

import torch

VOCAB = 1000
LENGTHS = (7, 12, 5)  # three sequences, packed or padded
FP32_TOL = 1e-5  # the bound: fp32 within 1e-5 of verl's torch backend and of float64; bf16 of the exact bf16


def packed(lengths=LENGTHS, vocab=VOCAB, seed=0):
    """Padding-free inputs as verl's FSDP engine hands them to the model: input_ids / position_ids [1, nnz]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=positions)


def padded(lengths=LENGTHS, vocab=VOCAB, seed=0):
    """A right-padded batch: input_ids, attention_mask, position_ids [B, S]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, vocab, (n, ), generator=g)
        mask[row, :n] = 1
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def fused_forward(model, backend, inputs, temperature, shift_labels=None, seed=1):
    """verl's fused forward for ``model``'s architecture with ``backend`` ("torch", "twinkle"), as its FSDP engine
    calls it, then a backward of a fixed random combination of log-probs and entropy. Returns the log-probs,
    entropy, the hidden states the head saw (detached), the labels it used, and the gradients of the hidden
    states and of every parameter."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    seen = {}

    def keep_hidden(module, args, output):
        seen["hidden"] = output[0]
        output[0].retain_grad()

    hook = model.model.register_forward_hook(keep_hidden)
    model.zero_grad(set_to_none=True)
    try:
        extra = {} if shift_labels is None else dict(shift_labels=shift_labels)
        out = model(**inputs, temperature=temperature, return_dict=True, **extra)
    finally:
        hook.remove()
    g = torch.Generator().manual_seed(seed)
    w_logp, w_entropy = (torch.randn(out.log_probs.shape, generator=g) for _ in range(2))
    ((out.log_probs.float() * w_logp).sum() + (out.entropy.float() * w_entropy).sum()).backward()
    labels = shift_labels if shift_labels is not None else torch.roll(inputs["input_ids"], -1, -1)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return dict(logp=out.log_probs.detach(), entropy=out.entropy.detach(), hidden=seen["hidden"].detach(),
                hidden_grad=seen["hidden"].grad.detach().clone(), grads=grads, labels=labels,
                weights=(w_logp, w_entropy))


def exact(hidden, weight, labels, temperature):
    """The log-probs and entropy of softmax(logits / T) computed in float64. fp32 inputs: the logits in float64 too;
    bf16 inputs: the bf16 logits, as the head's bf16 matmul gives them (the exact softmax of the bf16 logits)."""
    if hidden.dtype == torch.float32:
        logits = hidden.double() @ weight.double().T
    else:
        logits = (hidden.detach() @ weight.detach().T).double()
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, labels[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def exact_grads(hidden, weight, labels, temperature, weights):
    """The float64 gradients (hidden, weight) of the combination :func:`fused_forward` takes, from the given inputs
    (the logits in float64)."""
    h, w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logits = (h @ w.T) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp, entropy = logp_all.gather(-1, labels[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    ((logp * weights[0].double()).sum() + (entropy * weights[1].double()).sum()).backward()
    return h.grad, w.grad


def max_error(got, want, relative_to_max=False) -> float:
    error = (got.double() - want.double()).abs().max().item()
    return error / max(1.0, want.double().abs().max().item()) if relative_to_max else error


# --- verl's FSDP engine for a few PPO steps (in a gloo world: tests/helpers.Cases) ------------------------------

def verl_world(module_name, timeout_s, *stand_ins):
    """The gloo worlds of a test module (tests/helpers.Cases), each process with verl imported (its plugins:
    twinkle-mem's install() with its defaults) and the context managers ``stand_ins`` entered."""
    from helpers import Cases

    @contextlib.contextmanager
    def setup():
        import verl  # noqa: F401
        with contextlib.ExitStack() as stack:
            for stand_in in stand_ins:
                stack.enter_context(stand_in())
            yield

    return Cases(module_name, timeout_s=timeout_s, setup=setup)


ENGINE_FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
# SGD: an update linear in the gradient, so that two runs whose gradients agree to float rounding stay that close.
# (AdamW's first steps divide each gradient element by its own magnitude: a near-zero element whose rounding
# differs between two runs becomes a full-size step of either sign.)
OPTIMIZER = dict(optimizer="SGD", lr=1.0, weight_decay=0.0)


def build_engine(model_dir, *, strategy="fsdp2", fused_backend=None, mixed_precision=ENGINE_FP32, lora_rank=0,
                 ulysses=1, remove_padding=True, attention="sdpa"):
    """verl's FSDP engine for the language model at ``model_dir`` (built as TrainingWorker builds it), with
    verl's logits path or its fused path on ``fused_backend``; ``lora_rank``: verl's FSDP LoRA (peft, every linear
    of the layers: the LM head frozen); ``ulysses``: verl's ``ulysses_sequence_parallel_size`` (its attention:
    standins.verl_cpu.CPU_VARLEN); ``remove_padding``: False for padded batches."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    fused = fused_backend is not None
    model_config = HFModelConfig(path=model_dir, load_tokenizer=False,
                                 override_config={"attn_implementation": attention},
                                 use_remove_padding=remove_padding, use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": fused_backend} if fused else {},
                                 lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    engine_config = FSDPEngineConfig(strategy=strategy, use_torch_compile=False, model_dtype="fp32",
                                     mixed_precision=mixed_precision, use_dynamic_bsz=False,
                                     micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2,
                                     use_fused_kernels=fused, use_remove_padding=remove_padding,
                                     ulysses_sequence_parallel_size=ulysses)
    engine = EngineRegistry.new(model_type="language_model", backend=strategy, model_config=model_config,
                                engine_config=engine_config, optimizer_config=FSDPOptimizerConfig(**OPTIMIZER),
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


# Megatron's SGD (its distributed optimizer takes Adam only: use_distributed_optimizer=False), verl's gradient clip.
MEGATRON_OPTIMIZER = dict(optimizer="sgd", lr=1.0, weight_decay=0.0, total_training_steps=10)


def build_megatron_engine(model_dir, *, tp=1, pp=1, sequence_parallel=False, fused_backend=None, dtype="float32",
                          lora=None):
    """verl's Megatron engine as TrainingWorker builds it (EngineRegistry, Megatron-Bridge: verl's default bridge),
    for the Qwen2 checkpoint at ``model_dir``, with verl's logits path or its fused path on ``fused_backend``.
    ``dtype``: verl's config accepts bfloat16 and float16 only (``McoreEngineConfig.__post_init__``); "float32" is
    set after that check, and the engine then builds its model, Megatron's DDP and its optimizer in fp32.
    ``lora``: verl's Megatron LoRA config (``actor_rollout_ref.model.lora``)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry
    fused = fused_backend is not None
    model_config = HFModelConfig(path=model_dir, use_remove_padding=True, use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": fused_backend} if fused else {},
                                 lora=lora or {})
    engine_config = McoreEngineConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      sequence_parallel=sequence_parallel, use_distributed_optimizer=False,
                                      use_remove_padding=True, use_fused_kernels=fused, micro_batch_size_per_gpu=2,
                                      infer_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                                      dtype="bfloat16" if dtype == "float32" else dtype)
    if dtype == "float32":
        object.__setattr__(engine_config, "dtype", dtype)
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=model_config,
                                engine_config=engine_config,
                                optimizer_config=McoreOptimizerConfig(**MEGATRON_OPTIMIZER),
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def ppo_steps(engine, steps=3, temperature=0.7, seed=0, entropy_coeff=0.01):
    """``steps`` PPO steps as the trainer runs them: compute_log_prob (infer_batch, entropy on), then the update
    (train_batch: forward_backward_batch with verl's PPO loss and an optimizer step) with those log-probs as the
    old ones. Each data-parallel rank gets its own batch (the ranks of a model-parallel group the same one).
    Returns, per step, the log-probs and entropy of the first pass, the loss and the metrics, where this rank has
    the engine's outputs (Megatron: the last pipeline stage; elsewhere None)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from standins.verl_cpu import rollout_batch
    actor = ActorConfig(strategy=engine.engine_config.strategy, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                        use_dynamic_bsz=False, entropy_coeff=entropy_coeff, rollout_n=1)
    fused = engine.engine_config.use_fused_kernels
    common = dict(temperature=temperature, use_remove_padding=engine.engine_config.use_remove_padding,
                  use_fused_kernels=fused, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    results = []
    for step in range(steps):
        data = rollout_batch(seed + 100 * step + dp_rank)
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, **common)
        with engine.eval_mode():
            inferred = engine.infer_batch(data, loss_function=None).get("model_output")
        log_probs = entropy = None
        if inferred is not None:
            log_probs = no_padding_2_padding(inferred["log_probs"], data).float()
            entropy = no_padding_2_padding(inferred["entropy"], data).float()
        data = rollout_batch(seed + 100 * step + dp_rank)
        data["old_log_probs"] = _from_last_stage(log_probs, data["responses"].shape).detach()
        # (the trainer's update keeps the entropy where the actor's entropy_coeff != 0: ray_trainer._update_actor)
        tu.assign_non_tensor(data, calculate_entropy=entropy_coeff != 0, compute_loss=True,
                             global_batch_size=4 * dp_size, **common)
        with engine.train_mode():
            trained = engine.train_batch(data, loss_function=partial(ppo_loss, config=actor))
        result = dict(log_probs=log_probs, entropy=entropy, loss=None, metrics=None)
        if "metrics" in trained:
            result["loss"] = torch.tensor(trained["loss"], dtype=torch.float64)
            result["metrics"] = {k: torch.tensor(v.values if hasattr(v, "values") else v, dtype=torch.float64)
                                 .flatten() for k, v in trained["metrics"].items()}
        results.append(result)
    return results


def _from_last_stage(log_probs, shape):
    """The old log-probs as the trainer hands them to every rank: under Megatron's pipeline parallelism only the
    last stage computed them."""
    from megatron.core import parallel_state as mpu
    if log_probs is not None and not (mpu.model_parallel_is_initialized()
                                      and mpu.get_pipeline_model_parallel_world_size() > 1):
        return log_probs
    import torch.distributed as dist
    shared = log_probs if log_probs is not None else torch.zeros(shape)
    group = mpu.get_pipeline_model_parallel_group()
    dist.broadcast(shared, src=dist.get_process_group_ranks(group)[-1], group=group)
    return shared


def assert_steps_equal(got, want, what, tol=FP32_TOL):
    """Every step's log-probs, entropy, loss and metrics (relative to max(1, |value|)) within ``tol``, where this
    rank has outputs."""
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        for key in ("log_probs", "entropy", "loss"):
            assert (g[key] is None) == (w[key] is None), f"{what}, step {step}: {key}"
            if w[key] is not None:
                error = (g[key].double() - w[key].double()).abs().max().item()
                assert error <= tol, f"{what}, step {step}: {key} off by {error}"
        if w["metrics"] is not None:
            assert g["metrics"].keys() == w["metrics"].keys(), what
            for key, value in w["metrics"].items():
                error = ((g["metrics"][key] - value).abs() / value.abs().clamp(min=1.0)).max().item()
                assert error <= tol, f"{what}, step {step}: metric {key} off by {error}"


@contextlib.contextmanager
def recorded_fused_head():
    """Records each call of twinkle-mem's fused head (verl's heads call it through the module): whether autograd
    was on and the ``entropy_grad`` it was given ("default": none)."""
    import twinkle_mem
    real = twinkle_mem.linear_selective_log_softmax
    calls = []

    def recorded(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), kwargs.get("entropy_grad", "default")))
        return real(*args, **kwargs)

    twinkle_mem.linear_selective_log_softmax = recorded
    try:
        yield calls
    finally:
        twinkle_mem.linear_selective_log_softmax = real


def entropy_grads(calls, training: bool) -> set:
    """The ``entropy_grad`` values the recorded calls with (``training``) or without autograd were given."""
    return {entropy_grad for grad, entropy_grad in calls if grad == training}


@contextlib.contextmanager
def saved_tiny_qwen2(tied=False):
    """A tiny Qwen2 checkpoint in a temporary folder (the same weights in every rank: the same seed)."""
    from standins.verl_cpu import save_tiny_qwen2
    with tempfile.TemporaryDirectory() as folder:
        yield save_tiny_qwen2(folder, tied=tied)
