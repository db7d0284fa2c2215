"""twinkle_mem.processor: the skip decision and the one-allocation dense mask,
checked against twinkle-kit 0.5.1's own mask builder."""
import pytest
import torch

from twinkle_mem.processor import (MASK_SKIP_MODES, batch_attention_mask, dense_causal_mask, resolve_mask_type,
                                   skip_dense_mask)

from standins import memory


def twinkle_mask_builder():
    """twinkle-kit's own builder, as defined in its source (not whatever is patched in)."""
    import twinkle.processor.base as base
    return base.InputProcessor.__dict__["_create_4d_attention_mask"].__func__


def reference_mask(seq_lens, size):
    """The mask by definition: masked iff key after query, or key in the padding."""
    q = torch.arange(size).view(size, 1)
    k = torch.arange(size).view(1, size)
    return torch.stack([((k > q) | (k >= n)).unsqueeze(0) for n in seq_lens])


def test_resolve_mask_type():
    assert resolve_mask_type(None) == "causal"
    assert resolve_mask_type(None, "causal_lm") == "causal"
    assert resolve_mask_type(None, None) == "causal"
    assert resolve_mask_type(None, "embedding") is None
    assert resolve_mask_type("padding", "causal_lm") == "padding"  # a declared type wins


@pytest.mark.parametrize("mask_type,device_type,mode,expected", [
    ("causal", "npu", "npu", True),
    ("causal", "cuda", "npu", False),
    ("causal", "cpu", "npu", False),
    ("causal", "cuda", "always", True),
    ("causal", None, "always", True),
    ("causal", "npu", "never", False),
    ("padding", "npu", "npu", False),
    ("padding", "cpu", "always", False),
    (None, "npu", "npu", False),
])
def test_skip_dense_mask(mask_type, device_type, mode, expected):
    assert skip_dense_mask(mask_type, device_type, mode) is expected


def test_skip_dense_mask_rejects_unknown_mode():
    assert "npu" in MASK_SKIP_MODES
    with pytest.raises(ValueError, match="mode"):
        skip_dense_mask("causal", "npu", "sometimes")


@pytest.mark.parametrize("seq_lens", [[1], [2], [7], [7, 3], [4, 4, 1], [33, 1, 32], [64, 63]])
def test_dense_mask_equals_twinkles(seq_lens):
    samples = [torch.ones(n, dtype=torch.long) for n in seq_lens]
    theirs = twinkle_mask_builder()(samples)
    ours = dense_causal_mask(seq_lens)
    assert ours.dtype == theirs.dtype == torch.bool
    assert ours.shape == theirs.shape == (len(seq_lens), 1, max(seq_lens), max(seq_lens))
    assert ours.device == theirs.device
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, reference_mask(seq_lens, max(seq_lens)))


def test_dense_mask_pads_to_max_len():
    mask = dense_causal_mask([3, 5], max_len=8)
    assert mask.shape == (2, 1, 8, 8)
    assert torch.equal(mask, reference_mask([3, 5], 8))


@pytest.mark.parametrize("seq_lens,max_len,match", [
    ([], None, "at least one"),
    ([3, -1], None, ">= 0"),
    ([3, 5], 4, "shorter"),
])
def test_dense_mask_rejects_bad_lengths(seq_lens, max_len, match):
    with pytest.raises(ValueError, match=match):
        dense_causal_mask(seq_lens, max_len=max_len)


def test_batch_attention_mask_decides_before_building():
    assert batch_attention_mask([4, 2], device_type="npu") is None
    assert batch_attention_mask([4, 2], device="cpu", mode="always") is None
    dense = batch_attention_mask([4, 2], device="cpu")
    assert torch.equal(dense, reference_mask([4, 2], 4))
    assert torch.equal(batch_attention_mask([4, 2], device_type="npu", mode="never"), dense)
    with pytest.raises(ValueError, match="causal masks only"):
        batch_attention_mask([4, 2], attention_mask_type="padding")


def test_dense_mask_is_one_allocation():
    seq_lens = [384, 300]
    nbytes = len(seq_lens) * max(seq_lens)**2
    mask, ours = memory.large_allocations(lambda: dense_causal_mask(seq_lens), nbytes // 4)
    assert mask.untyped_storage().nbytes() == nbytes
    assert ours == [nbytes]
    # Control: the same accounting sees twinkle's ones/tril/~ as three mask-sized tensors.
    samples = [torch.ones(n) for n in seq_lens]
    _, theirs = memory.large_allocations(lambda: twinkle_mask_builder()(samples), nbytes // 4)
    assert theirs == [nbytes] * 3


def test_dense_mask_peak_memory():
    size = 8192  # a 64 MiB mask: far above glibc's mmap threshold, so RSS follows every allocation
    nbytes = size * size
    ours = memory.peak_rss_delta("from twinkle_mem.processor import dense_causal_mask",
                             f"return dense_causal_mask([{size}, ])")
    assert ours <= 1.1 * nbytes, f"peak {ours / nbytes:.2f}x the mask"
    # Control: the measurement sees twinkle's temporaries (2x on the CPU allocator).
    theirs = memory.peak_rss_delta(
        "import torch\nfrom twinkle.processor.base import InputProcessor",
        f"return InputProcessor._create_4d_attention_mask([torch.ones({size})])")
    assert theirs >= 1.8 * nbytes, f"twinkle's peak measured {theirs / nbytes:.2f}x the mask"
