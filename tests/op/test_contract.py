"""The Python side of the op contract (python/twinkle_mem/op/contract.py) against the native kernels."""
import pytest
import torch

from twinkle_mem.op import contract


def _views():
    v = 37
    yield "contiguous", torch.randn(6, v)
    yield "padded vocab", torch.randn(6, v + 3)[:, :v]
    yield "sequence slice", torch.randn(2, 5, v)[:, :-1]
    yield "padded vocab and slice", torch.randn(2, 5, v + 2)[:, 1:, :v]
    yield "far-apart rows", torch.randn(6, 4 * v)[:, :v]
    yield "batch stride not a multiple", torch.randn(2 * 5 * v + 7)[:2 * 5 * v].view(2, 5, v)[:, :4]
    yield "one row", torch.randn(1, v)
    yield "transposed leading dims", torch.randn(5, 2, v).transpose(0, 1)


@pytest.mark.parametrize("name,logits", list(_views()), ids=[n for n, _ in _views()])
def test_gradient_layout_mirror_matches_the_native_backward(name, logits):
    """new_grad_like (the fake kernels' and the composite's copy of layout.h's rule) gives the native
    CPU backward's strides for every view the op reads in place."""
    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1])
    logp, entropy, shift, log_sum = torch.ops.twinkle_mem.selective_log_softmax_fwd(
        logits, labels, 1.0, contract.NO_IGNORE_INDEX, 0, logits.shape[-1], True, False)
    grad = torch.ops.twinkle_mem.selective_log_softmax_bwd(torch.ones_like(logp), torch.ones_like(entropy), logits,
                                                           labels, shift, log_sum, entropy, 1.0,
                                                           contract.NO_IGNORE_INDEX, 0)
    mirror = contract.new_grad_like(logits)
    assert (mirror.shape, mirror.stride()) == (grad.shape, grad.stride()), name


def test_options_of_forward_inputs():
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)
    assert contract.OpOptions.of_forward((x, y, 0.5, -100, 7, 10, True)) == (0.5, -100, 7, True, False)
    assert contract.OpOptions.of_forward((x, y, 2.0, -1, 0, 3, False, True)) == (2.0, -1, 0, False, True)


def test_ignore_value():
    assert contract.ignore_value(None) == contract.NO_IGNORE_INDEX
    assert contract.ignore_value(-100) == -100


def test_public_names_stay_where_the_docs_import_them_from():
    import twinkle_mem
    from twinkle_mem.integrations import twinkle as integration
    for name in ("install", "uninstall", "is_installed", "refused", "FailedMicroBatchWarning",
                 "TwinklePartsNotRecognized"):
        assert hasattr(integration, name), name
    for name in ("selective_log_softmax", "linear_selective_log_softmax", "entropy_from_logits", "backends"):
        assert callable(getattr(twinkle_mem, name)), name
