"""What twinkle-mem's heads are told of the entropy in verl (issue 52, point 1): ``entropy_grad.entropy_trained``
from a batch as verl's engines get it and the loss function verl's workers give them. The engines' runs (the
heads given it in their training forwards, FSDP and Megatron with LoRA) are in test_verl_fsdp_engine.py and
test_verl_megatron_engine.py."""
from functools import partial

import pytest

from twinkle_mem.integrations.verl.entropy_grad import entropy_trained


def _batch(calculate_entropy):
    from verl.utils import tensordict_utils as tu

    from standins.verl_cpu import rollout_batch
    data = rollout_batch(0)
    tu.assign_non_tensor(data, calculate_entropy=calculate_entropy)
    return data


def _ppo_loss(entropy_coeff):
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                        entropy_coeff=entropy_coeff, rollout_n=1)
    return partial(ppo_loss, config=actor)


@pytest.mark.parametrize("entropy_coeff,trained", [(0.01, True), (-0.001, True), (0.0, False)])
def test_verl_ppo_loss_says_by_its_entropy_coeff(entropy_coeff, trained):
    assert entropy_trained(_batch(True), _ppo_loss(entropy_coeff), forward_only=False) is trained


def test_a_batch_that_drops_the_entropy_trains_none_whatever_the_loss():
    assert entropy_trained(_batch(False), _ppo_loss(0.01), forward_only=False) is False
    assert entropy_trained(_batch(False), lambda **kwargs: None, forward_only=False) is False


def test_unknown_losses_and_forwards_without_gradients_say_nothing():
    from verl.workers.utils.losses import ppo_loss
    assert entropy_trained(_batch(True), lambda **kwargs: None, forward_only=False) is None
    assert entropy_trained(_batch(True), partial(ppo_loss), forward_only=False) is None  # (no config)
    assert entropy_trained(_batch(True), None, forward_only=True) is None
    assert entropy_trained(_batch(True), _ppo_loss(0.01), forward_only=True) is None
