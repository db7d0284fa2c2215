"""ms-swift (4.6) on a CPU, offline: what its trainers load from a hub and what its GRPO samples with, made here.

- :func:`save_tiny_qwen2`: a Qwen2 with random weights and a small byte-level BPE tokenizer with Qwen's chat
  specials, saved locally (in place of a downloaded checkpoint; ms-swift's ``qwen`` template on it);
- :func:`write_prompts`, :func:`write_conversations`: small data sets (in place of hub data sets);
- :data:`REWARD_PLUGIN`: a reward that varies between completions, registered in ``swift.rewards.orms`` (a constant
  reward gives zero advantages: GRPO's loss and gradients 0);
- :func:`grpo_arguments`, :func:`gkd_arguments`, :func:`dpo_arguments`: ms-swift's own arguments for a few steps on
  the CPU: ``use_vllm=False`` (GRPO's rollout is ms-swift's HF generation in place of vLLM), ``check_model=False``
  and :data:`OFFLINE` (no hub), ``model_type`` / ``template`` named, accumulation 1 (GKD with its default 8 and a
  small data set trains 0 steps), SGD at a constant rate.

Used by ``tests/integrations/swift/`` and ``bench/bench_swift.py``."""
import json
import os

import torch

VOCAB = 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
OFFLINE = dict(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               MODELSCOPE_OFFLINE="1")


def save_tiny_qwen2(path, *, vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, tied=False, seed=0, **config):
    """A Qwen2 causal LM with random weights and a small byte-level BPE tokenizer with the Qwen chat specials."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=512, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                                   bos_token_id=None, eos_token_id=2, pad_token_id=0, **config)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises the norms to 1 and the weights small: make the logits spread
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    # A byte-level BPE (Qwen2's own kind: transformers' Qwen2Tokenizer reads its vocab and merges) trained on the
    # words "w0" .. "w199" of the data sets
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(200))] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "pad_token_id": 0, "do_sample": True}, f)
    return model


def write_prompts(path, n=8, seed=0):
    """A GRPO data set: ``n`` user prompts of a few words."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(f"w{int(i)}" for i in torch.randint(3, 200, (4, ), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": words}]}) + "\n")
    return path


REWARD_PLUGIN = '''
import re
from swift.rewards import orms
from swift.rewards.orm import ORM


class EvenDigits(ORM):
    """A reward that varies between completions: the share of even digits in its text, and its length / 40."""

    def __call__(self, completions, **kwargs):
        rewards = []
        for completion in completions:
            digits = [int(c) for c in completion if c.isdigit()]
            rewards.append(sum(d % 2 == 0 for d in digits) / max(len(digits), 1) + len(completion) / 40)
        return rewards


orms["even_digits"] = EvenDigits
'''


def common_arguments(folder, model, **arguments):
    """ms-swift's arguments for a few optimizer steps on the CPU (shared/notes/ms-swift.md), with SGD and a constant
    learning rate: AdamW's first steps divide each gradient element by its own magnitude, so rounding-level
    differences of near-zero gradients would become full-size steps."""
    return {**dict(model=model, model_type="qwen2", template="qwen", use_vllm=False, torch_dtype="float32",
                   split_dataset_ratio=0, save_strategy="no", report_to=["none"], check_model=False,
                   gradient_accumulation_steps=1, max_steps=3, logging_steps=1, output_dir=os.path.join(folder, "out"),
                   optim="sgd", learning_rate=0.05, lr_scheduler_type="constant", warmup_ratio=0.0, seed=0,
                   dataloader_num_workers=0, tuner_type="full"), **arguments}


def grpo_arguments(folder, model, **arguments):
    """GRPO with a reward that varies (``even_digits``), 4 completions of 8 tokens per prompt, beta > 0 (the reference
    model's log-probs too)."""
    plugin = os.path.join(folder, "even_digits.py")
    with open(plugin, "w") as f:
        f.write(REWARD_PLUGIN)
    arguments = {**dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=8, beta=0.04,
                        external_plugins=[plugin], reward_funcs=["even_digits"],
                        dataset=[write_prompts(os.path.join(folder, "prompts.jsonl"))]), **arguments}
    return common_arguments(folder, model, rlhf_type="grpo", **arguments)


def write_conversations(path, n=8, seed=0, rejected=False):
    """A GKD / DPO data set: ``n`` user prompts with an assistant answer (and a rejected one for DPO)."""
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(3, 200, (k, ), generator=g))

    with open(path, "w") as f:
        for _ in range(n):
            row = {"messages": [{"role": "user", "content": words(4)}, {"role": "assistant", "content": words(6)}]}
            if rejected:
                row["rejected_response"] = words(6)
            f.write(json.dumps(row) + "\n")
    return path


def gkd_arguments(folder, model, teacher, **arguments):
    """GKD with a local teacher (another model: teacher = student gives 0), beta 0.5, on the data set's answers
    (``seq_kd`` and on-policy sampling off: ``lmbda=0``)."""
    arguments = {**dict(teacher_model=teacher, teacher_model_type="qwen2", per_device_train_batch_size=4, beta=0.5, lmbda=0.0,
                        dataset=[write_conversations(os.path.join(folder, "answers.jsonl"))]), **arguments}
    return common_arguments(folder, model, rlhf_type="gkd", **arguments)


def dpo_arguments(folder, model, **arguments):
    arguments = {**dict(per_device_train_batch_size=2, beta=0.1,
                        dataset=[write_conversations(os.path.join(folder, "pairs.jsonl"), rejected=True)]),
                 **arguments}
    return common_arguments(folder, model, rlhf_type="dpo", **arguments)
