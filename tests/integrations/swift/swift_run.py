"""One ms-swift RLHF training run in this process, as ``swift rlhf`` runs it (``rlhf_main(RLHFArguments(...))``):
``python swift_run.py <arguments as JSON> <output folder>`` (or each rank under torchrun; rank 0 writes). Writes ``<output folder>/result.json`` (the logged
history, the step count, what twinkle-mem installed) and ``params.pt`` (every trained parameter after the run).

``python swift_run.py <arguments> <output folder> megatron``: Megatron-SWIFT's, as ``megatron rlhf`` runs it
(``megatron_rlhf_main(MegatronRLHFArguments(...))``), each rank under torchrun in a gloo world with the CPU stand-ins
of ``standins/swift_megatron.py`` (and ``mcore_bridge.py``'s for sequence parallelism and padding-free batches where
the arguments ask for them); the last rank (the last pipeline stage, which logs) writes: the logged history is
ms-swift's ``logging.jsonl``, the parameters its last checkpoint's safetensors (the whole model, or the adapter)."""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))  # (standins/)
from standins.swift_cpu import OFFLINE  # noqa: E402

os.environ.update(OFFLINE)


def main(arguments: dict, out: str) -> None:
    import torch
    from swift.arguments import RLHFArguments
    from swift.pipelines import rlhf_main
    from swift.rlhf_trainers import grpo_trainer, gkd_trainer, dpo_trainer  # noqa: F401 (the trainers' modules)
    torch.set_num_threads(1)
    trained = {}

    def keep_model(original):  # the trainer's model, for its parameters after training
        def train(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            trained["model"] = self.model
            return result
        return train

    from transformers import Trainer
    Trainer.train = keep_model(Trainer.train)
    calls = count_calls()
    result = rlhf_main(RLHFArguments(**arguments))
    import twinkle_mem.integrations.swift as integration
    if os.environ.get("RANK", "0") != "0":  # (torchrun: rank 0 writes the record)
        return
    params = {name: p.detach().clone() for name, p in trained["model"].named_parameters() if p.requires_grad}
    torch.save(params, os.path.join(out, "params.pt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"log_history": result["log_history"], "global_step": result["global_step"],
                   "installed": integration.installed_settings(), "refused": integration.refused(),
                   "calls": calls}, f)


def count_calls() -> dict:
    """Count the calls of twinkle-mem's public functions (its patches look them up on the package at each call) and
    of TRL's log-prob functions where ms-swift's trainers call them."""
    import twinkle_mem
    from swift.rlhf_trainers import grpo_trainer, rlhf_mixin
    calls = {}

    def counted(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[key] = calls.get(key, 0) + 1
            return original(*args, **kwargs)
        setattr(owner, name, wrapper)

    for name in ("linear_selective_log_softmax", "linear_gkd_full", "linear_gkd_topk", "selective_log_softmax",
                 "entropy_from_logits"):
        counted(twinkle_mem, name, "twinkle_mem." + name)
    # TRL's functions where ms-swift bound them by name (twinkle-mem's logits path replaces these)
    for module, name in ((grpo_trainer, "selective_log_softmax"), (grpo_trainer, "entropy_from_logits"),
                         (rlhf_mixin, "selective_log_softmax")):
        counted(module, name, f"{module.__name__.split('.')[-1]}.{name}")
    return calls


def main_megatron(arguments: dict, out: str) -> None:
    import contextlib
    import glob

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from standins import mcore_bridge, swift_megatron
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # (before ms-swift, which would pick a CUDA device for its own)
    calls = count_megatron_calls()
    with contextlib.ExitStack() as stand_ins:
        stand_ins.enter_context(swift_megatron.megatron_swift_on_cpu())
        if arguments.get("sequence_parallel"):
            stand_ins.enter_context(mcore_bridge.sequence_parallel_on_cpu())
        if arguments.get("padding_free", True):  # (Megatron-SWIFT's default)
            stand_ins.enter_context(mcore_bridge.packed_attention_on_cpu())
        from swift.megatron.arguments import MegatronRLHFArguments
        from swift.megatron.pipelines.train.rlhf import megatron_rlhf_main
        result = megatron_rlhf_main(MegatronRLHFArguments(**arguments))
    import twinkle_mem.integrations.swift as integration
    if int(os.environ["RANK"]) != int(os.environ["WORLD_SIZE"]) - 1:  # (ms-swift destroyed the process group)
        return
    checkpoint = result["last_model_checkpoint"]
    with open(os.path.join(os.path.dirname(checkpoint), "logging.jsonl")) as f:
        steps = [entry for entry in map(json.loads, f) if "iteration" in entry]
    params = {}
    for path in glob.glob(os.path.join(checkpoint, "*.safetensors")):
        params.update(load_file(path))
    torch.save(params, os.path.join(out, "params.pt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"log_history": steps, "global_step": int(steps[-1]["iteration"].split("/")[0]),
                   "installed": integration.installed_settings(), "refused": integration.refused(),
                   "calls": calls}, f)


def count_megatron_calls() -> dict:
    """Count the calls of twinkle-mem's fused head and of Megatron's vocab-parallel cross entropy (ms-swift's
    log-probs from the logits call it through its module, ``tensor_parallel.vocab_parallel_cross_entropy``)."""
    import twinkle_mem
    from megatron.core import tensor_parallel
    calls = {}
    for owner, name, key in ((twinkle_mem, "linear_selective_log_softmax", "twinkle_mem.linear_selective_log_softmax"),
                             (tensor_parallel, "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy")):
        def wrapper(*args, _original=getattr(owner, name), _key=key, **kwargs):
            calls[_key] = calls.get(_key, 0) + 1
            return _original(*args, **kwargs)
        setattr(owner, name, wrapper)
    return calls


if __name__ == "__main__":
    (main_megatron if sys.argv[3:] == ["megatron"] else main)(json.loads(sys.argv[1]), sys.argv[2])
