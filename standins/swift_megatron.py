"""Megatron-SWIFT (ms-swift 4.6's ``swift.megatron``) on a CPU: its GRPO trainer as shipped in a gloo world of CPU
processes (torchrun), on the tiny Qwen2 of ``swift_cpu.py``.

``megatron_swift_on_cpu()`` enters, for the duration, the stand-ins twinkle-kit's Megatron path needs
(``megatron_lora.training_on_cpu(twinkle=False)``: 1-8 of ``mcore_bridge.py`` for mcore_bridge's import and model
build, 13-19 for megatron-core's optimizer and mcore_bridge's export), and these, each for one thing ms-swift's
Megatron code asks of a GPU or of vLLM:

20. ``torch.cuda`` where ms-swift's Megatron modules and megatron-core's inference p2p helpers ask it: the current
    device is "cpu", ``synchronize`` and CUDA streams do nothing (``standins.megatron.torch_on_cpu``): the DDP
    wrapping (``wrap_model``: its streams), the metrics' buffers (``trainers/base.py``, ``trainer.py``,
    ``utils/parallel_utils.py``, ``callbacks/print.py``), ``forward_step_helper``'s pipeline buffers
    (``utils/utils.py``, ``megatron/core/inference/communication_utils.py``).
21. ``wrap_model`` moves each model chunk with ``Module.cuda()``: kept on the CPU (stand-in 17's tensor methods
    while it runs).
22. ``warmup_jit_function`` runs megatron's fused bias-activation kernels on CUDA tensors to compile them: nothing
    to warm on a CPU.
23. accelerate's process state (ms-swift gathers the rewards with accelerate's ``gather``): made for a CPU world
    (``PartialState(cpu=True)``: gloo); without it accelerate finds no GPU and sees one process.
24. vLLM (Megatron-SWIFT's GRPO asks for ``use_vllm`` with ``vllm_mode='colocate'``): :class:`TransformersRollout`,
    ms-swift's own ``TransformersEngine`` (its transformers generation) on the checkpoint's model, given the
    trained weights at every step through mcore_bridge's export as vLLM is (``export_weights`` under stand-in 17,
    ``inner_model.load_weights``); ``is_vllm_available`` answers True in the rollout mixin. The rollout model is
    built with transformers' own RoPE table (mcore_bridge's ``get_rope_inv_freq`` replaces its "default").

The layouts' own stand-ins come from ``mcore_bridge.py``: 10-11 for sequence parallelism, 12 for padding-free
(packed) batches. Used by ``tests/integrations/swift/`` (``swift_run.py``) and ``bench/bench_swift.py``.
"""
import contextlib
import copy
import os
import types

import torch

from . import megatron as th
from . import megatron_lora
from .swift_cpu import REWARD_PLUGIN, write_prompts

TRANSFORMERS_ROPE = {}  # transformers' own ROPE_INIT_FUNCTIONS, before mcore_bridge replaces "default"


class TransformersRollout:
    """Stands for ms-swift's ``GRPOVllmEngine`` in colocate mode (stand-in 24)."""

    def __init__(self, trainer):
        from swift.infer_engine import TransformersEngine
        from swift.model import get_model_processor
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        args = trainer.args
        bridge_rope = dict(ROPE_INIT_FUNCTIONS)
        ROPE_INIT_FUNCTIONS.clear()
        ROPE_INIT_FUNCTIONS.update(TRANSFORMERS_ROPE)
        try:
            self.model, _ = get_model_processor(args.model_info.model_dir, torch_dtype=args.torch_dtype,
                                                model_type=args.model_type, device_map="cpu")
        finally:
            ROPE_INIT_FUNCTIONS.clear()
            ROPE_INIT_FUNCTIONS.update(bridge_rope)
        template = copy.copy(trainer.template)  # (as ms-swift copies it for vLLM, and for its own HF rollout)
        template.padding_free, template.sequence_parallel_size, template.use_megatron = False, 1, False
        template.remove_unused_columns = True
        self.generation = TransformersEngine(self.model, template=template, max_batch_size=0)
        self.inner_model = types.SimpleNamespace(load_weights=self.load_weights)
        self.engine = types.SimpleNamespace(reset_prefix_cache=lambda: None, reset_mm_cache=lambda: None,
                                            model_config=None)

    def load_weights(self, weights):
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)

    def infer(self, infer_requests, request_config=None, metrics=None, *, use_tqdm=None, adapter_request=None):
        from swift.infer_engine.protocol import RolloutOutput
        responses = self.generation.infer(infer_requests, request_config, metrics, use_tqdm=use_tqdm)
        return [RolloutOutput(response=r) for r in responses]


def prepare_rollout(trainer) -> TransformersRollout:
    """``MegatronRolloutMixin._prepare_vllm_engine`` under stand-in 24."""
    return TransformersRollout(trainer)


@contextlib.contextmanager
def megatron_swift_on_cpu():
    """Stand-ins 1-8 and 13-24; undone on exit (a process that trains keeps it open)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    TRANSFORMERS_ROPE.update(ROPE_INIT_FUNCTIONS)
    from accelerate.state import PartialState
    PartialState(cpu=True)  # 23
    with megatron_lora.training_on_cpu(twinkle=False):
        from mcore_bridge.bridge.gpt_bridge import GPTBridge
        from megatron.core.inference import communication_utils
        from swift.megatron.callbacks import print as print_callback
        from swift.megatron.trainers import base, rollout_mixin, trainer
        from swift.megatron.utils import megatron_lm_utils, parallel_utils, utils
        wrap, export = megatron_lm_utils.wrap_model, GPTBridge.export_weights

        def wrap_model(*args, **kwargs):
            with megatron_lora.cuda_tensor_methods_on_cpu():
                return wrap(*args, **kwargs)

        def export_weights(*args, **kwargs):
            with megatron_lora.cuda_tensor_methods_on_cpu():
                yield from export(*args, **kwargs)

        changes = [(base, "wrap_model", wrap_model), (base, "warmup_jit_function", lambda config, args: None),
                   (GPTBridge, "export_weights", export_weights), (rollout_mixin, "is_vllm_available", lambda: True),
                   (rollout_mixin.MegatronRolloutMixin, "_prepare_vllm_engine", prepare_rollout)]
        saved = [(owner, name, vars(owner)[name]) for owner, name, _ in changes]
        for owner, name, value in changes:
            setattr(owner, name, value)
        try:
            with th.torch_on_cpu(megatron_lm_utils, parallel_utils, utils, base, trainer, print_callback,
                                 communication_utils):
                yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


def megatron_grpo_arguments(folder, model, **arguments):
    """Megatron-SWIFT's GRPO arguments for 3 steps on the CPU: TP = 2 by default, 2 prompts of 4 completions of 8
    tokens per step in micro-batches of 2, the reward of ``swift_cpu`` that varies, beta > 0 (the reference model's
    log-probs), SGD at a constant rate, fp32 (ms-swift's fp16 mixed precision off), megatron-core's local attention,
    CPU initialization, padded batches unless asked (padding-free needs stand-in 12)."""
    plugin = os.path.join(folder, "even_digits.py")
    with open(plugin, "w") as f:
        f.write(REWARD_PLUGIN)
    return {**dict(model=model, model_type="qwen2", template="qwen", rlhf_type="grpo", tensor_model_parallel_size=2,
                   micro_batch_size=2, global_batch_size=8, num_generations=4, max_completion_length=8, beta=0.04,
                   reward_funcs=["even_digits"], external_plugins=[plugin],
                   dataset=[write_prompts(os.path.join(folder, "prompts.jsonl"))], use_vllm=True,
                   vllm_mode="colocate", train_iters=3, logging_steps=1, optimizer="sgd", lr=0.05, sgd_momentum=0.0,
                   lr_decay_style="constant", weight_decay=0.0, torch_dtype="float32", fp16=False, bf16=False,
                   ddp_backend="gloo", use_distributed_optimizer=False, use_cpu_initialization=True,
                   attention_backend="local", recompute_granularity="none", padding_free=False,
                   dataloader_num_workers=0, check_model=False, split_dataset_ratio=0, seed=1, report_to=[],
                   no_save_optim=True, no_save_rng=True, save_steps=1000, output_dir=os.path.join(folder, "out")),
            **arguments}
