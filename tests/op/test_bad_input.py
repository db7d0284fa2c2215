"""Bad arguments to the ops raise RuntimeError naming them, on every implementation of the contract
(tests/impls.py: the native CPU kernels, the composite, the CUDA and AscendC kernels' emulations), before
any kernel touches memory. The public functions' own checks (ValueError) are in test_selective_log_softmax.py
and test_linear_selective_log_softmax.py."""
import pytest
import torch

from helpers import make_case
from impls import IMPLS, same_layout_on

N, V, IGNORE = 4, 10, -100


def _forward_cases(logits, labels, label_range=True):
    yield "labels must have the logits' leading shape", (logits, labels[:2], 1.0, IGNORE, 0, V, False)
    yield "vocab_size", (logits, labels, 1.0, IGNORE, 5, V, False)  # the shard runs past vocab_size
    yield "unit stride", (logits.t(), labels.repeat(3)[:V], 1.0, IGNORE, 0, V, False)
    yield "overlap", (logits[:1].expand(N, V), labels, 1.0, IGNORE, 0, V, False)
    yield r"\[N, V\] or \[B, S, V\]", (logits.view(1, 2, 2, V), labels.view(1, 2, 2), 1.0, IGNORE, 0, V, False)
    yield "inv_temperature", (logits, labels, -1.0, IGNORE, 0, V, False)
    yield "int64 or int32", (logits, labels.float(), 1.0, IGNORE, 0, V, False)
    # On CUDA an out-of-range label is a device-side assert (no host sync), which leaves the context
    # unusable: tests/backends/cuda/test_cuda.py checks it in a child process.
    for bad_label in (V, -1, 2**40) if label_range else ():
        bad = labels.clone()
        bad[2] = bad_label
        yield r"label out of range: labels.flatten\(\)\[2\]", (logits, bad, 1.0, IGNORE, 0, V, False)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i.checks_arguments], ids=lambda i: i.name)
def test_bad_op_arguments_raise(impl):
    logits, labels = make_case(N, V, torch.float32)
    for match, args in _forward_cases(logits, labels, label_range=impl.name != "cuda"):
        with pytest.raises(RuntimeError, match=match):
            impl.forward(*args)
    ignored = labels.clone()
    ignored[2] = IGNORE
    impl.forward(logits, ignored, 1.0, IGNORE, 0, V, False)  # ignore_index is exempt from the range check

    _, entropy, shift, log_sum = impl.forward(logits, labels, 1.0, IGNORE, 0, V, True)
    for match, args in [
        ("shift", (shift, None, logits, labels, shift[:3], log_sum, None)),
        ("entropy", (shift, shift, logits, labels, shift, log_sum, None)),  # grad_entropy without entropy
        ("grad_logp", (shift.double(), None, logits, labels, shift, log_sum, None)),
    ]:
        for inplace in (False, True):
            with pytest.raises(RuntimeError, match=match):
                impl.backward(*args, 1.0, IGNORE, 0, inplace)
    for inplace in (False, True):  # a negative shard start would shift the labels onto other columns
        with pytest.raises(RuntimeError, match="vocab_start must be >= 0"):
            impl.backward(shift, None, logits, labels, shift, log_sum, None, 1.0, IGNORE, -1, inplace)


# Issue 27: twinkle's and transformers' -100 padding passed without ignore_index. Every implementation that
# checks the labels gives one message naming the value, the entry, the vocab size and what to do, never the
# op's placeholder for "no ignore_index" (-2**63). The CUDA kernel's emulation gives it as its device assert.
NO_IGNORE = -(2**63)
RANGE = "neither a token id in [0, 10) (vocab size 10) nor the ignore_index"
LABEL_MESSAGES = [
    (-100, NO_IGNORE, f"labels.flatten()[2] = -100 is {RANGE} (none given); to ignore such positions (logp 0, no "
                      "gradient), pass ignore_index=-100"),
    (-100, -1, f"labels.flatten()[2] = -100 is {RANGE} (-1); to ignore such positions (logp 0, no gradient), pass "
               "ignore_index=-100"),
    (V, NO_IGNORE, f"labels.flatten()[2] = 10 is {RANGE} (none given); check that the labels come from the logits' "
                   "vocabulary"),
]


@pytest.mark.parametrize("impl", [i for i in IMPLS if i.name in ("cpu", "composite", "cuda_emulated")],
                         ids=lambda i: i.name)
def test_out_of_range_label_message_is_one_on_every_backend(impl):
    logits, labels = make_case(N, V, torch.float32)
    for bad_label, ignore, want in LABEL_MESSAGES:
        bad = labels.clone()
        bad[2] = bad_label
        with pytest.raises(RuntimeError) as err:
            impl.forward(logits, bad, 1.0, ignore, 0, V, False)
        got = str(err.value).removeprefix("device-side assert (emulated): ")
        assert got == "twinkle_mem: label out of range: " + want


def test_harness_moves_views_with_their_layout():
    """The CUDA rows above get their tensors through same_layout_on: a move that made an expanded tensor dense
    would hide the overlap case from the op (it did, on the H200's second run)."""
    x = torch.randn(N, V)
    for view in (x, x.t(), x[:1].expand(N, V), x[1:3, 2:7], x.view(2, 2, V)[:, 1]):
        moved = same_layout_on("cpu", view)
        assert moved.stride() == view.stride() and torch.equal(moved, view)
        assert moved.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
