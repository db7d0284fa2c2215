"""One sha256 over the outputs and gradients of every implementation that runs here
(tests/impls.py) on every input class of tests/numerics.py, and one per implementation.

A refactoring that claims "behaviour unchanged" runs this on the tree before and after
and compares the hashes: equal hashes mean bitwise-equal logp, entropy, shift, log_sum
and gradients (out of place and in place) on every case. Besides the contiguous [N, V]
cases of test_numerics.py, each case of one shape also runs as views (a padded vocab,
a [B, S, V] sequence slice) with int32 labels, so that the row and label indexing and
the strided gradient allocation are covered too.

    python tests/hash_numerics.py            # prints one line per implementation, then the total
"""
from __future__ import annotations

import hashlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # tests/ (impls, numerics) and the root (standins/)

from impls import IMPLS  # noqa: E402
from numerics import NO_IGNORE, Case, make_cases, upstream  # noqa: E402

SHAPES = [(3, 4099), (17, 257)]  # test_numerics.py's
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VIEW_SHAPE = (5, 1031)


def _views(case: Case) -> list[Case]:
    """The case's logits as a padded-vocab view and as a [1, N, V] slice of a longer sequence."""
    x, y = case.logits, case.labels
    n, v = x.shape
    padded = torch.zeros(n, v + 13, dtype=x.dtype)
    padded[:, :v] = x
    longer = torch.zeros(1, n + 1, v, dtype=x.dtype)
    longer[0, :n] = x
    y_longer = torch.zeros((1, n + 1) + tuple(y.shape[1:]), dtype=torch.int32)
    y_longer[0, :n] = y.to(torch.int32)
    return [Case(case.name + " [padded vocab]", padded[:, :v], y.to(torch.int32), case.temperature,
                 case.ignore_index, case.with_entropy),
            Case(case.name + " [sequence slice]", longer[:, :-1], y_longer[:, :-1], case.temperature,
                 case.ignore_index, case.with_entropy)]


def _bytes(t: torch.Tensor | None) -> bytes:
    if t is None:
        return b"none"
    t = t.detach().contiguous()
    head = f"{tuple(t.shape)} {t.dtype}".encode()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return head + t.numpy().tobytes()


def _run(impl, case: Case, h) -> None:
    ignore = NO_IGNORE if case.ignore_index is None else case.ignore_index
    inv_t = 1.0 / case.temperature
    x = case.logits
    logp, entropy, shift, log_sum = impl.forward(x, case.labels, inv_t, ignore, 0, x.shape[-1], case.with_entropy)
    g_logp, g_entropy = upstream(case)
    g_logp = g_logp.view(case.labels.shape)
    if g_entropy is not None:
        g_entropy = g_entropy.view(x.shape[:-1])
    entropy_in = entropy if case.with_entropy else None
    grad = impl.backward(g_logp, g_entropy, x, case.labels, shift, log_sum, entropy_in, inv_t, ignore, 0, False)
    target = x.clone()
    grad_inplace = impl.backward(g_logp, g_entropy, target, case.labels, shift, log_sum, entropy_in, inv_t, ignore,
                                 0, True)
    for t in (logp, entropy, shift, log_sum, grad, grad_inplace):
        h.update(_bytes(t))
    h.update(str(grad.stride()).encode())  # the out-of-place gradient's layout is part of the contract


def impl_hash(impl) -> tuple[str, int]:
    h = hashlib.sha256()
    count = 0
    for shape in SHAPES:
        for dtype in DTYPES:
            for case in make_cases(*shape, dtype, seed=shape[0] * 1000 + shape[1]):
                if case.logits.numel() <= impl.max_elements:
                    h.update(case.name.encode())
                    _run(impl, case, h)
                    count += 1
    if impl.strided:
        for case in make_cases(*VIEW_SHAPE, torch.bfloat16, seed=5):
            for view in _views(case):
                if view.logits.numel() <= impl.max_elements:
                    h.update(view.name.encode())
                    _run(impl, view, h)
                    count += 1
    return h.hexdigest(), count


def main() -> None:
    total = hashlib.sha256()
    for impl in IMPLS:
        digest, count = impl_hash(impl)
        print(f"{impl.name:14s} {digest}  ({count} cases)", flush=True)
        total.update(f"{impl.name} {digest}".encode())
    print(f"{'all':14s} {total.hexdigest()}")


if __name__ == "__main__":
    main()
