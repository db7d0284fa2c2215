"""impl_backend=twinkle on verl's Megatron fused path, and the logits path's vocab-parallel functions on the op: a
gloo world of 2 CPU processes, Megatron TP = 2 (issue 40).

Here a megatron-core GPTModel (standins/megatron.py; verl's whole engine, built through Megatron-Bridge, is
test_verl_megatron_engine.py's) is given to the engine's own ``_maybe_enable_fused_kernels`` (called on a stand-in engine holding that model, its config saying
impl_backend=twinkle), which marks the output weights and lets verl patch the model's fused forward. Against verl's
logits path on the same weights (the output layer's logits shard, divided by T, then verl's own
vocab_parallel_entropy and vocab_parallel_log_probs_from_logits, as its engine runs them), fp32, T = 0.7:
- verl's fused GPTModel forward (no sequence parallelism), tied and untied: log-probs and entropy within 1e-5,
  and every parameter's gradient (this rank's shard) within 1e-5 of the largest. verl's own kernel would leave the
  hidden states' gradient a partial sum without sequence parallelism (it is CUDA-only: not run here);
- with sequence parallelism (megatron-core 0.16.1 builds no GPTModel with it on a CPU: its torch LayerNorm
  fallback refuses it), verl's output-processor hook (``fused_output_processor``: the sequence gather, then
  linear_cross_entropy) on a ColumnParallelLinear with sequence_parallel=True, against the layer's own forward
  (its gather) and verl's logits path: values, the sequence shard's and the weight shard's gradients;
- the logits path on the op (logits_path): vocab_parallel_log_probs_from_logits and vocab_parallel_entropy within
  1e-5 of verl's, gradients too; the mindspeed engine inherits the marking.
"""
import contextlib
import types

import pytest
import torch
from helpers import Cases
from verl_helpers import FP32_TOL, VOCAB, max_error

WORLD = 2
TEMPERATURE = 0.7
SEQ, HIDDEN = 16, 32


@contextlib.contextmanager
def _megatron_on_cpu():
    import verl  # noqa: F401  (the entry point: twinkle-mem installed)
    from megatron.core import parallel_state as mpu

    from standins.megatron import megatron_gpt_cpu
    from standins.verl_cpu import megatron_tp_on_cpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    try:
        with megatron_gpt_cpu(), megatron_tp_on_cpu():
            yield
    finally:
        mpu.destroy_model_parallel()


cases = Cases(__name__, timeout_s=600, setup=_megatron_on_cpu)
case = cases.register(WORLD)


def _engine_with(module):
    """What MegatronEngine._maybe_enable_fused_kernels reads of its engine, for one model chunk."""
    return types.SimpleNamespace(
        engine_config=types.SimpleNamespace(use_fused_kernels=True, use_remove_padding=True), is_value_model=False,
        model_config=types.SimpleNamespace(fused_kernel_options={"impl_backend": "twinkle"},
                                           mtp=types.SimpleNamespace(enable=False)), module=[module])


def _inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # (True: masked)
    weights = torch.randn(2, SEQ, generator=g)
    return ids, torch.arange(SEQ)[None], mask, torch.roll(ids, -1, -1), weights


def verl_logits_path(logits, labels):
    """verl's Megatron engine on logits (its _lm_head_logits_processor): divided in place, entropy on them, log-probs
    on a copy; verl's own functions (not twinkle-mem's, whatever is installed)."""
    from verl.utils.megatron import tensor_parallel as verl_tp
    entropy_of = getattr(verl_tp.vocab_parallel_entropy, "__wrapped__", verl_tp.vocab_parallel_entropy)
    log_probs_of = getattr(verl_tp.vocab_parallel_log_probs_from_logits, "__wrapped__",
                           verl_tp.vocab_parallel_log_probs_from_logits)
    logits = logits / TEMPERATURE
    logits_copy = logits.clone()
    return log_probs_of(logits_copy, labels), entropy_of(logits)


def _combined(logp, entropy, weights):
    return (logp.reshape(-1) * weights[0]).sum() + (entropy.reshape(-1) * weights[1]).sum()


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _gpt_fused_equals_logits_path(tied):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from standins.megatron import gpt_model
    ids, positions, mask, labels, weights = _inputs()
    reference = gpt_model(VOCAB, hidden=HIDDEN, tied=tied)
    logits = reference(ids, positions, mask)  # [b, s, V/tp]
    logp, entropy = verl_logits_path(logits, labels)
    _combined(logp, entropy, weights).backward()

    fused = gpt_model(VOCAB, hidden=HIDDEN, tied=tied)  # the same weights (same seed)
    MegatronEngine._maybe_enable_fused_kernels(_engine_with(fused))
    assert hasattr(fused, "forward_backup")  # verl patched the model's forward with its fused one
    out = fused(ids, positions, mask, labels=labels, temperature=TEMPERATURE)
    _combined(out.log_probs, out.entropy, weights).backward()
    assert out.log_probs.dtype == out.entropy.dtype == torch.float32
    assert max_error(out.log_probs, logp.reshape(-1)) <= FP32_TOL
    assert max_error(out.entropy, entropy.reshape(-1)) <= FP32_TOL
    want, got = _grads(reference), _grads(fused)
    assert want.keys() == got.keys() and len(want) >= 8
    for name, grad in want.items():
        assert max_error(got[name], grad, relative_to_max=True) <= FP32_TOL, name


@case
def gpt_fused_untied(rank, world):
    _gpt_fused_equals_logits_path(tied=False)


@case
def gpt_fused_tied(rank, world):
    _gpt_fused_equals_logits_path(tied=True)


@case
def sequence_parallel_output_processor(rank, world):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from verl.models.mcore.model_forward_fused import FusedOutputProcessorContext, fused_output_processor
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=WORLD, sequence_parallel=True)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
                                 tp_group=mpu.get_tensor_model_parallel_group())
    owner = torch.nn.Module()  # (what the engine's marking looks for: a module with an output_layer and a config)
    owner.output_layer, owner.config = layer, config
    _, _, _, labels, weights = _inputs()
    full_hidden = torch.randn(SEQ, 1, HIDDEN, generator=torch.Generator().manual_seed(4))
    shard = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)  # this rank's sequence shard

    hidden = full_hidden[shard].clone().requires_grad_()
    logits, _ = layer(hidden)  # [s, b, V/tp]: the layer gathers the sequence itself
    logp, entropy = verl_logits_path(logits.transpose(0, 1), labels)
    want = (logp.reshape(-1), entropy.reshape(-1),
            *torch.autograd.grad(_combined(logp, entropy, weights), (hidden, layer.weight)))

    MegatronEngine._maybe_enable_fused_kernels(_engine_with(owner))
    hidden = full_hidden[shard].clone().requires_grad_()
    out = fused_output_processor(hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels,
                                 context=FusedOutputProcessorContext(temperature=TEMPERATURE), config=config)
    got = (out.log_probs, out.entropy,
           *torch.autograd.grad(_combined(out.log_probs, out.entropy, weights), (hidden, layer.weight)))
    for name, g, w in zip(["log-probs", "entropy", "hidden (sequence shard)", "weight (vocab shard)"], got, want):
        assert max_error(g, w, relative_to_max=True) <= FP32_TOL, name


@case
def logits_path_vocab_parallel_functions(rank, world):
    from verl.utils.megatron import tensor_parallel as verl_tp
    from verl.workers.engine.mindspeed.transformer_impl import MindspeedEngineWithLMHead

    from twinkle_mem.integrations import verl as integration
    assert hasattr(MindspeedEngineWithLMHead._maybe_enable_fused_kernels, "__wrapped__")  # the NPU engine: marked too
    g = torch.Generator().manual_seed(5 + rank)
    shard = (4 * torch.randn(1, SEQ, VOCAB // WORLD, generator=g)).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(6))  # global ids, every rank
    weights = torch.randn(2, SEQ, generator=torch.Generator().manual_seed(7))
    logp, entropy = verl_logits_path(shard, labels)
    want = (logp, entropy, *torch.autograd.grad(_combined(logp, entropy, weights), shard))
    integration.install(logits_path=True)
    try:
        logits = shard / TEMPERATURE
        logp = verl_tp.vocab_parallel_log_probs_from_logits(logits.clone(), labels)
        entropy = verl_tp.vocab_parallel_entropy_with_chunking(logits, chunk_size=4)
        got = (logp, entropy, *torch.autograd.grad(_combined(logp, entropy, weights), shard))
    finally:
        integration.install()
    assert got[0].dtype == got[1].dtype == torch.float32
    for name, g, w in zip(["log-probs", "entropy", "logits"], got, want):
        assert max_error(g, w, relative_to_max=True) <= FP32_TOL, name


@pytest.mark.parametrize("world,name", cases.params(), ids=lambda v: f"tp{v}" if isinstance(v, int) else v)
def test_megatron_tp2(world, name):
    failures = cases.failures(world, name)
    assert not failures, "\n".join(failures)
