"""The numerics suite on a real Ascend NPU (skipped without torch_npu and a device).

The same classes, bounds and batch-invariance checks as tests/op/test_numerics.py,
through torch.ops.twinkle_mem on npu tensors: the AscendC kernels when _C_npu is
loaded, the composite otherwise (TWINKLE_MEM_NPU_COMPOSITE=1 forces it, to
compare). bench/npu_check.sh runs this file first on a CANN node: it is what the
CPU stand-in cannot prove (the hardware's exp / ln, DataCopyPad at row edges
shared by two cores, the task-queue ordering of the launches).
"""
import os

import pytest
import torch

from numerics import Case, Impl, check_case, make_cases, run_impl, upstream

try:
    import torch_npu  # noqa: F401

    HAVE_NPU = torch.npu.is_available()
except ImportError:
    HAVE_NPU = False

pytestmark = pytest.mark.skipif(not HAVE_NPU, reason="needs torch_npu and an Ascend NPU")
ops = torch.ops.twinkle_mem


def _to(t, dev):
    return t.to(dev) if isinstance(t, torch.Tensor) else t


def _forward(logits, labels, *args):
    out = ops.selective_log_softmax_fwd(_to(logits, "npu"), _to(labels, "npu"), *args)
    return tuple(t.cpu() for t in out)


def _backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start, inplace):
    dev = [_to(t, "npu") for t in (g_logp, g_entropy, logits, labels, shift, log_sum, entropy)]
    if inplace:
        ops.selective_log_softmax_bwd_(*dev[:2], dev[2], *dev[3:], inv_t, ignore, vocab_start)
        logits.copy_(dev[2].cpu())  # the contract: the gradient in the caller's tensor
        return logits
    return ops.selective_log_softmax_bwd(*dev, inv_t, ignore, vocab_start).cpu()


NPU = Impl("npu", _forward, _backward)


@pytest.fixture(autouse=True, scope="module")
def _composite_if_asked():
    if os.environ.get("TWINKLE_MEM_NPU_COMPOSITE"):
        from twinkle_mem.op import composite

        with composite.forced(("npu",)):
            yield
    else:
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(3, 4099), (17, 257), (41, 1031), (2, 151936)], ids=str)
def test_numerics_classes_on_npu(dtype, shape):
    for case in make_cases(*shape, dtype, seed=shape[0] * 1000 + shape[1]):
        check_case(NPU, case)


def test_inplace_backward_on_npu():
    for case in make_cases(5, 1031, torch.bfloat16, seed=9):
        check_case(NPU, case, inplace=True)


def test_views_and_k_labels_on_npu():
    base = (torch.randn(4, 9, 3001) * 3).bfloat16()
    y = torch.randint(0, 3001, (4, 8, 6))[:, :, ::2]
    check_case(NPU, Case("logits[:, :-1], k = 3 at stride 2", base[:, :-1], y, temperature=0.8))


def test_batch_invariance_on_npu():
    """A row's results are bitwise the same alone and among 2048 rows (more than the cores)."""
    gen = torch.Generator().manual_seed(5)
    pool = (torch.randn(2048, 151936 // 8, generator=gen) * 4).bfloat16()
    labels = torch.randint(0, pool.shape[1], (2048,), generator=gen)
    case = Case("batch", pool, labels, temperature=0.7)
    g = upstream(case, seed=2)
    full = run_impl(NPU, case, *g)
    for row in (0, 777, 2047):
        one = Case("one", pool[row:row + 1].clone(), labels[row:row + 1].clone(), temperature=0.7)
        alone = run_impl(NPU, one, g[0][row:row + 1], g[1][row:row + 1])
        for a, b in zip(full, alone):
            assert torch.equal(a[row:row + 1], b), "a row's result depends on the batch on the NPU"
