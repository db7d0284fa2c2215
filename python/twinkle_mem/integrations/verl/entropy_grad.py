"""Whether the entropy twinkle-mem's fused head returns to verl is trained: what verl knows, handed to the head.

verl's fused forwards always ask for the entropy. Its engines keep it only where the batch says
``calculate_entropy`` (the trainer's update sets it when the actor's ``entropy_coeff != 0``, or for the metric with
``actor.calculate_entropy=True``), and verl's PPO loss (``verl.workers.utils.losses.ppo_loss``, given the actor's
config) subtracts ``entropy_coeff * entropy_loss``. A frozen LM head (LoRA) sums the entropy's gradient vector in its
forward only where the caller says the entropy is trained (``entropy_grad=True``); an entropy that gets a gradient
anyway is still honoured, at the cost of a recompute.

:func:`forward_backward_batch` wraps verl's engines' ``forward_backward_batch`` (FSDP and Megatron) and tells the
heads, for the batch's training forward:

- ``entropy_grad=False``: the batch does not keep the entropy (no gradient can reach it);
- ``entropy_grad=True`` / ``False``: verl's PPO loss with ``entropy_coeff != 0`` / ``== 0``;
- nothing (the op's default) for any other loss, and for a forward without gradients (``compute_log_prob``).
"""
import functools
from contextvars import ContextVar
from typing import Any, Dict, Optional

PPO_LOSS_MODULE = "verl.workers.utils.losses"
_ENTROPY_GRAD: ContextVar[Optional[bool]] = ContextVar("twinkle_mem_verl_entropy_grad", default=None)


def head_options() -> Dict[str, Any]:
    """The keyword arguments of ``linear_selective_log_softmax`` that say whether the entropy is trained: empty
    where verl's call says nothing of it."""
    entropy_grad = _ENTROPY_GRAD.get()
    return {} if entropy_grad is None else {"entropy_grad": entropy_grad}


def entropy_trained(data, loss_function, forward_only: bool) -> Optional[bool]:
    """Whether a batch's training forward trains the entropy, where verl's call says so; None where it does not."""
    if forward_only:
        return None
    from verl.utils import tensordict_utils as tu
    if not tu.get_non_tensor_data(data, key="calculate_entropy", default=False):
        return False
    loss = getattr(loss_function, "func", None)  # (the workers give functools.partial(ppo_loss, config=actor))
    config = getattr(loss_function, "keywords", {}).get("config")
    is_ppo_loss = (getattr(loss, "__module__", None), getattr(loss, "__name__", None)) == (PPO_LOSS_MODULE, "ppo_loss")
    if not is_ppo_loss or not hasattr(config, "entropy_coeff"):
        return None
    return config.entropy_coeff != 0


def forward_backward_batch(original, plan):
    """An engine's ``forward_backward_batch``: the batch's forwards (and Megatron's backward, in its schedule) run
    knowing :func:`entropy_trained`."""

    @functools.wraps(original)
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        token = _ENTROPY_GRAD.set(entropy_trained(data, loss_function, forward_only))
        try:
            return original(self, data, loss_function, forward_only)
        finally:
            _ENTROPY_GRAD.reset(token)

    return forward_backward_batch
