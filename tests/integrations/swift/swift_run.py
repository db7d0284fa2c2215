"""One ms-swift RLHF training run in this process, as ``swift rlhf`` runs it (``rlhf_main(RLHFArguments(...))``):
``python swift_run.py <arguments as JSON> <output folder>`` (or each rank under torchrun; rank 0 writes). Writes ``<output folder>/result.json`` (the logged
history, the step count, what twinkle-mem installed) and ``params.pt`` (every trained parameter after the run)."""
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


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
