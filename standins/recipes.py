"""twinkle-kit's Megatron recipes, run in twinkle's Ray mode on the CPU as their cookbook files run them, for
tests/integrations/twinkle/ray_megatron_recipes.py and bench/bench_recipe.py. Written here from reading twinkle's
repository (github.com/modelscope/twinkle, ``cookbook/rl/``); no recipe code is copied. Each function names the file it
follows and does what it does: the model in Ray workers (``remote_group='model'``), a LoRA adapter from
``LoraConfig(target_modules='all-linear', ...)``, twinkle's Megatron optimizer and scheduler
(``set_optimizer('default')``, ``set_lr_scheduler('default')``, ``clip_grad_and_step``), its loss, processor,
template and metrics, ``calculate_metric``, ``save``. And one recipe on twinkle's transformers path
(``gkd_transformers``: gkd_on_policy.py's ``TransformersModel`` branch, one worker), where twinkle's ``Accuracy`` is
a default metric.

What a CPU changes (and nothing else):

- the model: a local tiny Qwen3 (standins/mcore_bridge.py's ``save_tiny_qwen3``), built in 2 CPU workers
  (standins/twinkle_ray.py) at TP = 2 or PP = 2, ``mixed_precision='no'`` (fp32) unless asked;
- :class:`Sampler` stands for the vLLM sampler of the GRPO recipes (completions of the prompts and their
  log-probs, as ``SampledSequence.new_input_feature`` / ``.logprobs``), :class:`Teacher` for the GKD recipes'
  vLLM teacher (``prompt_logprobs=k``): transformers' Qwen3 in the driver, seeded. The sampler samples from the
  checkpoint's weights (the recipes sync the LoRA into vLLM, which needs vLLM): every mode then trains on the
  same data;
- :func:`count_reward` stands for the GSM8K rewards (the completions are words of a random model), and small
  in-memory datasets stand for the recipes' hub datasets;
- ``lora_dropout=0`` (the recipes: 0.05): dropout draws each rank's masks from its own RNG stream, so a TP = 2
  and a PP = 2 run could not be compared; and every LoRA A is set from a seed of its layer
  (``megatron_lora.layout_independent_lora_init``), so that TP = 2 and PP = 2 start from one adapter;
- sizes: fewer steps (3 optimizer steps), prompts, generations and tokens; r = 8.

Each recipe returns what the tests compare: per optimizer step the loss (``forward_backward``'s) and the grad
norm (megatron's optimizer's, read in the workers), every ``calculate_metric``, the saved adapter
(``adapter_model.safetensors``), and per worker its pid and what its output layer returned (logits, or the
fused head's zero-width placeholders) and how often twinkle-mem's fused ops ran.
"""
import os
import tempfile
import time

import torch

from . import twinkle_ray as tr

ADAPTER = "default"
LORA = dict(target_modules="all-linear", r=8, lora_alpha=16, lora_dropout=0.0)
SYSTEM = "w1 w2 w3"


# --- what runs outside the model: data, sampler, teacher, reward ------------------------------------------------

def _words(gen, n, vocab):
    return " ".join(f"w{int(i)}" for i in torch.randint(10, vocab - 5, (n, ), generator=gen))


def prompts(n, vocab, seed=0, length=(4, 9)):
    """Conversations of a system and a user message (the recipes' dataset rows before the answer)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": _words(gen, int(torch.randint(*length, (1, ), generator=gen)),
                                                             vocab)}]} for _ in range(n)]


def with_answers(rows, vocab, seed=0, length=(3, 9)):
    """The rows with an assistant answer each (GKD off-policy's reference answers, DPO's chosen / rejected)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"messages": row["messages"] + [{"role": "assistant", "content": _words(
        gen, int(torch.randint(*length, (1, ), generator=gen)), vocab)}]} for row in rows]


def _causal_lm(path, dtype):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


class Sampler:
    """Stands for twinkle's ``vLLMSampler.sample(prompts, SamplingParams(max_tokens, temperature=1.0, logprobs=1))``:
    each prompt's completion sampled token by token from the checkpoint's model in bf16 (as vLLM serves it),
    returned as the recipe reads a ``SampledSequence``: ``new_input_feature`` (twinkle's
    ``Template.concat_input_feature`` of the encoded prompt and the tokens, as the vLLM sampler builds it),
    the tokens and their log-probs."""

    def __init__(self, path, template, max_tokens=8, seed=0):
        self.model = _causal_lm(path, torch.bfloat16)
        self.template, self.max_tokens = template, max_tokens
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def sample(self, rows):
        out = []
        for feature in self.template.batch_encode([dict(r) for r in rows], add_generation_prompt=True):
            ids = torch.as_tensor(feature["input_ids"]).tolist()
            tokens, logprobs = [], []
            for _ in range(self.max_tokens):
                logits = self.model(torch.tensor([ids + tokens])).logits[0, -1].float()
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=self.gen))
                tokens.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                if token == self.template.tokenizer.eos_token_id:
                    break
            out.append(dict(new_input_feature=self.template.concat_input_feature(feature, tokens), tokens=tokens,
                            logprobs=logprobs))
        return out


class Teacher:
    """Stands for the GKD recipes' vLLM teacher, ``sample(batch, SamplingParams(max_tokens=0, prompt_logprobs=k))``
    with ``logprobs_mode='raw_logprobs'``: per sequence, its top-k (token id, log-prob) at each position, None at
    the first, from another checkpoint of the student's vocab (fp32)."""

    def __init__(self, path, k):
        self.model, self.k = _causal_lm(path, torch.float32), k

    @torch.no_grad()
    def topk_prompt_logprobs(self, features):
        out = []
        for feature in features:
            ids = torch.as_tensor(feature["input_ids"])[None]
            logp = self.model(ids).logits[0].float().log_softmax(-1)  # position i predicts token i + 1
            values, index = logp[:-1].topk(self.k, dim=-1)
            out.append([None] + [list(zip(i.tolist(), v.tolist())) for i, v in zip(index, values)])
        return out


def teacher_tensors(topk_prompt_logprobs, k):
    """What the GKD recipes' ``convert_topk_prompt_logprobs`` makes of the teacher's answer: ``[B, L, k]`` log-probs
    (fp32) and ids (int64), the first position and the padding zeros, rolled by one position to the labels."""
    length = max(len(seq) for seq in topk_prompt_logprobs)
    logprobs = torch.zeros(len(topk_prompt_logprobs), length, k)
    ids = torch.zeros(len(topk_prompt_logprobs), length, k, dtype=torch.long)
    for b, seq in enumerate(topk_prompt_logprobs):
        for t, pairs in enumerate(seq):
            if pairs is not None:
                ids[b, t] = torch.tensor([i for i, _ in pairs])
                logprobs[b, t] = torch.tensor([v for _, v in pairs])
    return dict(teacher_topk_logprobs=logprobs.roll(-1, dims=1), teacher_topk_indices=ids.roll(-1, dims=1))


def count_reward(trajectories):
    """Stands for the GSM8K rewards: the share of the completion's words whose number is even."""
    rewards = []
    for trajectory in trajectories:
        words = next(m["content"] for m in reversed(trajectory["messages"]) if m["role"] == "assistant").split()
        rewards.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1))
    return rewards


# --- probes in the workers ---------------------------------------------------------------------------------------

FUSED_OPS = ("linear_selective_log_softmax", "linear_gkd_topk", "linear_gkd_full")


def _count_calls(actor):
    """In a worker: count what its output layers return (logits, or a fused head's zero-width placeholder) and
    twinkle-mem's fused ops' calls (where twinkle-mem is loaded); returns the worker's pid."""
    import sys
    counts = actor._recipe_counts = dict(logits=0, placeholders=0, **{op: 0 for op in FUSED_OPS})

    def output_hook(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        counts["placeholders" if logits.shape[-1] == 0 else "logits"] += 1

    for chunk in actor.model if isinstance(actor.model, (list, tuple)) else [actor.model]:
        for name, module in chunk.named_modules():
            if name.endswith("output_layer") or name.endswith("lm_head"):
                module.register_forward_hook(output_hook)
    if "twinkle_mem" in sys.modules and not getattr(actor, "_recipe_counted", False):
        actor._recipe_counted = True  # (once per worker: the ops are the module's)
        import twinkle_mem
        for op in FUSED_OPS:
            def counted(*args, _op=op, _fn=getattr(twinkle_mem, op), **kwargs):
                counts[_op] += 1
                return _fn(*args, **kwargs)
            setattr(twinkle_mem, op, counted)
    return os.getpid()


def _worker_report(actor):
    import sys
    settings = None
    if "twinkle_mem" in sys.modules:
        from twinkle_mem.integrations import twinkle as integration
        settings = integration.installed_settings()
    return dict(pid=os.getpid(), counts=dict(getattr(actor, "_recipe_counts", {})), twinkle_mem=settings)


def _lora_init(actor):
    from .megatron_lora import layout_independent_lora_init
    return layout_independent_lora_init(actor.strategy.unwrap_model(actor.model))


def _grad_norm(actor, adapter):
    return float(actor.optimizer_group[adapter]._last_grad_norm)


def loss_of(out) -> float:
    """The loss of a ``forward_backward`` / ``forward_only`` output collected from the workers (a list in Ray mode:
    the data-parallel ranks', one here)."""
    loss = out["loss"]
    return float(loss[0] if isinstance(loss, (list, tuple)) else loss)


class Run:
    """One recipe's model and what the tests compare of it."""

    def __init__(self, recipe, layout, model):
        self.model = model
        self.result = dict(recipe=recipe, layout=layout, steps=[], metrics=[], error=None, seconds={})
        self.start = time.perf_counter()

    def mark(self, what):
        """Seconds since the model was created, at ``what`` (where a recipe's time goes)."""
        self.result["seconds"][what] = round(time.perf_counter() - self.start, 2)

    def prepare(self, lora_init=True):
        """After ``add_adapter_to_model``: the layout-independent LoRA A, and the counters."""
        self.mark("adapter added")
        if lora_init:
            assert all(n > 0 for n in tr.on_workers(self.model, _lora_init))
        tr.on_workers(self.model, _count_calls)

    def step(self, out, adapter=ADAPTER, record=None):
        steps = (self.result if record is None else record)["steps"]
        steps.append(dict(loss=loss_of(out), grad_norm=tr.on_workers(self.model, _grad_norm, adapter)[0]))
        self.mark(f"step {len(steps)}")

    def finish(self, output_dir, adapter=None):
        from safetensors.torch import load_file
        kwargs = {} if adapter is None else dict(adapter_name=adapter)
        saved = self.model.save("final", output_dir=output_dir, **kwargs)
        self.result["adapter"] = load_file(os.path.join(saved, "adapter_model.safetensors"))
        self.result["workers"] = tr.on_workers(self.model, _worker_report)
        self.mark("saved")
        return self.result


def mesh(layout):
    """The 2 workers' ``DeviceMesh``: ``'tp2'`` (TP = 2) or ``'pp2'`` (PP = 2)."""
    from twinkle import DeviceMesh
    tp, pp = {"tp2": (2, 1), "pp2": (1, 2)}[layout]
    return DeviceMesh.from_sizes(world_size=2, dp_size=1, tp_size=tp, pp_size=pp)


def _model(cls_name, path, layout, mixed_precision, **kwargs):
    import twinkle.model as models
    tr.new_rendezvous()
    return getattr(models, cls_name)(model_id=path, device_mesh=mesh(layout), remote_group="model",
                                     mixed_precision=mixed_precision, **kwargs)


def _recipe(fn):
    """Run the recipe; a failure of twinkle's code is recorded (the tests say which are expected), and the
    model's workers end either way."""
    def run(path, layout, *args, **kwargs):
        holder = {}
        try:
            return fn(holder, path, layout, *args, **kwargs)
        except Exception as error:  # noqa: BLE001  (recorded; the tests judge it)
            result = holder["run"].result if "run" in holder else dict(recipe=fn.__name__, layout=layout)
            result["error"] = f"{type(error).__name__}: {error}"
            try:  # (the workers outlive a failed call; not a failed start)
                result["workers"] = tr.on_workers(holder["run"].model, _worker_report)
            except Exception:  # noqa: BLE001
                pass
            return result
        finally:
            if "run" in holder:
                tr.release(holder["run"].model)
    run.__name__ = fn.__name__
    return run


# --- the recipes --------------------------------------------------------------------------------------------------

def grpo_data(sampler, step, vocab=512, batch=2, generations=4):
    """short_math_grpo.py's inner loop before training, for the ``step``-th batch of prompts: each prompt
    ``generations`` times, sampled; the inputs, the sampler's log-probs (old_logps), the completion lengths, the
    rewards and GRPO's group advantages."""
    from twinkle.advantage import GRPOAdvantage
    expanded = [row for row in prompts(batch, vocab, seed=step) for _ in range(generations)]
    sequences = sampler.sample(expanded)
    inputs = [s["new_input_feature"] for s in sequences]
    rewards = count_reward(inputs)
    advantages = GRPOAdvantage()(rewards, num_generations=generations, scale="group").tolist()
    return inputs, [s["logprobs"] for s in sequences], [len(s["tokens"]) for s in sequences], rewards, advantages


@_recipe
def grpo(holder, path, layout, output_dir, *, steps=3, vocab=512, generations=4, batch=2, micro_batch=2,
         mixed_precision="no", lr=1e-3):
    """cookbook/rl/grpo/short_math_grpo.py, its MegatronModel branch."""
    from peft import LoraConfig
    from twinkle.metric import CompletionRewardMetric
    from twinkle.processor import InputProcessor
    from twinkle.template import Template
    model = _model("MegatronModel", path, layout, mixed_precision, variable_seq_lengths=True)
    run = holder["run"] = Run("grpo", layout, model)
    model.add_adapter_to_model(ADAPTER, LoraConfig(**LORA), gradient_accumulation_steps=1)
    run.prepare()
    model.set_optimizer("default", lr=lr)
    model.set_lr_scheduler("default", lr_decay_steps=steps, max_lr=lr)
    model.set_loss("GRPOLoss", epsilon=0.2)
    model.set_processor(InputProcessor, padding_free=True)
    model.set_template("Template", model_id=path)
    sampler = Sampler(path, Template(model_id=path))
    metrics = CompletionRewardMetric()
    for step in range(steps):
        metrics.reset()
        inputs, old_logps, lengths, rewards, advantages = grpo_data(sampler, step, vocab, batch, generations)
        metrics.accumulate(completion_lengths=lengths, rewards={"total": rewards})
        out = model.forward_backward(inputs=inputs, old_logps=old_logps, advantages=advantages,
                                     micro_batch_size=micro_batch)
        model.clip_grad_and_step()
        run.step(out)
        log = metrics.calculate()
        log.update(model.calculate_metric(is_training=True))
        run.result["metrics"].append(log)
    return run.finish(output_dir)


@_recipe
def grpo_multi_lora(holder, path, layout, output_dir, *, steps=3, vocab=512, generations=4, batch=2, micro_batch=1,
                    lr=1e-3, kl_beta=0.04):
    """cookbook/rl/grpo/short_math_grpo_multi_lora.py (MultiLoraMegatronModel), with two tenants: ``tenant_a`` as the
    recipe's adapter, ``tenant_b`` with a KL term to a reference pass (``forward_only(disable_lora=True)``, the
    base model, as the DPO LoRA recipe takes its reference)."""
    from peft import LoraConfig
    from twinkle.processor import InputProcessor
    from twinkle.template import Template
    model = _model("MultiLoraMegatronModel", path, layout, "no", max_loras=2, max_r=LORA["r"])
    run = holder["run"] = Run("grpo_multi_lora", layout, model)
    tenants = {"tenant_a": dict(epsilon=0.2), "tenant_b": dict(epsilon=0.2, beta=kl_beta)}
    for name, loss_kwargs in tenants.items():
        model.add_adapter_to_model(name, LoraConfig(**LORA), gradient_accumulation_steps=1)
        model.set_optimizer("default", lr=lr, adapter_name=name)
        model.set_lr_scheduler("default", lr_decay_steps=steps, max_lr=lr, adapter_name=name)
        model.set_loss("GRPOLoss", adapter_name=name, **loss_kwargs)
        model.set_processor(InputProcessor, adapter_name=name)
        model.set_template("Template", model_id=path, adapter_name=name)
    run.prepare(lora_init=False)  # (a multi-LoRA run is compared at its own layout only)
    sampler = Sampler(path, Template(model_id=path))
    run.result["tenants"] = {name: dict(steps=[], metrics=[]) for name in tenants}
    for step in range(steps):
        inputs, old_logps, _, _, advantages = grpo_data(sampler, step, vocab, batch, generations)
        for name in tenants:
            extra = {}
            if name == "tenant_b":
                ref = model.forward_only(inputs=inputs, micro_batch_size=micro_batch, adapter_name=name,
                                         disable_lora=True)
                extra["ref_logps"] = ref["logps"]
            out = model.forward_backward(inputs=inputs, old_logps=old_logps, advantages=advantages,
                                         micro_batch_size=micro_batch, adapter_name=name, **extra)
            model.clip_grad_and_step(adapter_name=name)
            record = run.result["tenants"][name]
            run.step(out, name, record)
            record["metrics"].append(model.calculate_metric(is_training=True, adapter_name=name))
    from safetensors.torch import load_file
    for name in tenants:
        saved = model.save(f"final-{name}", output_dir=output_dir, adapter_name=name)
        run.result["tenants"][name]["adapter"] = load_file(os.path.join(saved, "adapter_model.safetensors"))
    run.result["workers"] = tr.on_workers(model, _worker_report)
    return run.result


@_recipe
def gkd(holder, path, layout, output_dir, teacher_path, *, steps=3, vocab=512, batch=4, k=64,
        mixed_precision="no", lr=1e-3):
    """cookbook/rl/gkd/gkd_off_policy.py: the student (MegatronModel + LoRA) on full texts (prompt and reference
    answer), the teacher's top-k prompt log-probs, GKDLoss(beta=0.5, temperature=1.0). (gkd_on_policy.py's
    Megatron branch trains the same way, on the student sampler's completions: no other code path in the model.)"""
    from peft import LoraConfig
    from twinkle.loss import GKDLoss
    from twinkle.template import Template
    model = _model("MegatronModel", path, layout, mixed_precision)
    run = holder["run"] = Run("gkd", layout, model)
    model.add_adapter_to_model(ADAPTER, LoraConfig(**LORA))
    run.prepare()
    model.set_optimizer("default", lr=lr)
    model.set_lr_scheduler("default", lr_decay_steps=steps)
    model.set_loss(GKDLoss(beta=0.5, temperature=1.0))
    model.set_template("Template", model_id=path)
    template, teacher = Template(model_id=path), Teacher(teacher_path, k)
    for step in range(steps):
        inputs, teacher_output = gkd_data(template, teacher, step, vocab, batch)
        out = model.forward_backward(inputs=inputs, **teacher_output)
        model.clip_grad_and_step()
        run.step(out)
        run.result["metrics"].append(model.calculate_metric(is_training=True))
    return run.finish(output_dir)


def gkd_data(template, teacher, step, vocab=512, batch=4):
    """gkd_off_policy.py's batch ``step``: full texts encoded, and the teacher's top-k as the recipe converts it."""
    inputs = template.batch_encode(with_answers(prompts(batch, vocab, seed=100 + step), vocab, seed=step))
    return inputs, teacher_tensors(teacher.topk_prompt_logprobs(inputs), teacher.k)


def dpo_data(template, step, vocab=512, batch=2):
    """dpo_lora.py's batch ``step``: preference pairs (a chosen and a rejected answer to each prompt), interleaved."""
    rows = prompts(batch, vocab, seed=200 + step)
    chosen, rejected = (template.batch_encode(with_answers(rows, vocab, seed=s)) for s in (2 * step, 2 * step + 1))
    return dpo_batch([dict(positive=c, negative=r) for c, r in zip(chosen, rejected)])


@_recipe
def gkd_transformers(holder, path, layout, output_dir, teacher_path, *, steps=3, vocab=512, batch=2, k=64, lr=1e-3):
    """cookbook/rl/gkd/gkd_on_policy.py, its TransformersModel branch: the student sampler's completions (on-policy),
    the teacher's top-k prompt log-probs on them, GKDLoss(beta=0.5), AdamW and CosineAnnealingLR; twinkle's
    ``Accuracy`` is this model's default metric. ``layout``: ``'dp1'``, one worker."""
    from peft import LoraConfig
    from twinkle import DeviceMesh
    from twinkle.loss import GKDLoss
    from twinkle.model import TransformersModel
    from twinkle.template import Template
    tr.new_rendezvous()
    model = TransformersModel(model_id=path, device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="solo",
                              mixed_precision="no")
    run = holder["run"] = Run("gkd_transformers", layout, model)
    model.add_adapter_to_model(ADAPTER, LoraConfig(**LORA), gradient_accumulation_steps=1)
    tr.on_workers(model, _count_calls)
    model.set_optimizer("AdamW", lr=lr)
    model.set_lr_scheduler("CosineAnnealingLR", T_max=steps, eta_min=0)
    model.set_loss(GKDLoss(beta=0.5, temperature=1.0), adapter_name=ADAPTER)
    model.set_template("Template", model_id=path, adapter_name=ADAPTER)
    template = Template(model_id=path)
    sampler, teacher = Sampler(path, template, seed=1), Teacher(teacher_path, k)
    for step in range(steps):
        inputs = [s["new_input_feature"] for s in sampler.sample(prompts(batch, vocab, seed=300 + step))]
        teacher_output = teacher_tensors(teacher.topk_prompt_logprobs(inputs), k)
        out = model.forward_backward(inputs=inputs, adapter_name=ADAPTER, **teacher_output)
        model.clip_grad_and_step(adapter_name=ADAPTER)
        run.step(out)
        run.result["metrics"].append(model.calculate_metric(is_training=True, adapter_name=ADAPTER))
    return run.finish(output_dir, adapter=ADAPTER)


def dpo_batch(rows):
    """dpo_lora.py's ``prepare_dpo_batch``: each row's chosen then rejected sample, interleaved."""
    return [sample for row in rows for sample in (row["positive"], row["negative"])]


@_recipe
def dpo(holder, path, layout, output_dir, *, steps=3, vocab=512, batch=2, accumulation=2, mixed_precision="no",
        lr=1e-3, beta=0.1):
    """cookbook/rl/dpo/dpo_lora.py, its MegatronModel branch: the reference from ``forward_only(disable_lora=True)``,
    DPOLoss(sigmoid, sft_weight=1.0), DPOMetric, gradient accumulation 2. twinkle steps the optimizer at the calls
    where ``(cur_step - 1) % accumulation == 0`` past the first: ``steps * accumulation + 1`` calls make ``steps``
    optimizer steps. Every call is recorded (its loss, and the grad norm of the last optimizer step)."""
    from peft import LoraConfig
    from twinkle.loss import DPOLoss
    from twinkle.metric import DPOMetric
    from twinkle.processor import InputProcessor
    from twinkle.template import Template
    model = _model("MegatronModel", path, layout, mixed_precision, variable_seq_lengths=True)
    run = holder["run"] = Run("dpo", layout, model)
    model.add_adapter_to_model(ADAPTER, LoraConfig(**LORA), gradient_accumulation_steps=accumulation)
    run.prepare()
    model.set_optimizer("default", lr=lr, weight_decay=0.01, adapter_name=ADAPTER)
    model.set_lr_scheduler("default", lr_decay_steps=steps, adapter_name=ADAPTER)
    model.set_loss(DPOLoss(beta=beta, loss_type="sigmoid", reference_free=False, sft_weight=1.0))
    model.add_metric(DPOMetric, beta=beta)
    model.set_processor(InputProcessor, padding_free=True)
    model.set_template("Template", model_id=path)
    template = Template(model_id=path)
    for step in range(steps * accumulation + 1):
        inputs = dpo_data(template, step, vocab, batch)
        ref_outputs = model.forward_only(inputs=inputs, disable_lora=True)
        out = model.forward_backward(inputs=inputs, ref_outputs=ref_outputs)
        model.clip_grad_and_step()
        run.step(out)
        if (step + 1) % accumulation == 0:
            run.result["metrics"].append(model.calculate_metric(is_training=True))
    return run.finish(output_dir)


RECIPES = {fn.__name__: fn for fn in (grpo, grpo_multi_lora, gkd, gkd_transformers, dpo)}


def output_dir(parent):
    """A directory of its own under ``parent`` for a recipe's ``save`` (the caller removes ``parent``)."""
    return tempfile.mkdtemp(prefix="recipe-out-", dir=parent)
