"""Random search for gradients outside the accuracy bound (docs/numerics.md, "Where the gradient's terms
cancel"): draws inputs, runs an implementation of tests/impls.py forward and backward, and reports the
draws whose worst row comes closest to (or past) what check_outputs allows. Not collected by pytest.

  PYTHONPATH=python python tests/search_grad_bound.py near 60 cpu     # the neighbourhood of issue 27's case
  PYTHONPATH=python python tests/search_grad_bound.py wide 60 composite  # the property test's ranges
  ... --former   # the bound without grad_conditioning, as before issue 27
"""
import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: impls needs standins/

from impls import IMPLS  # noqa: E402
from numerics import NO_IGNORE, SUBNORMAL_STEP, grad_conditioning, torch_fp32, ulp  # noqa: E402
from twinkle_mem.op.reference import selective_log_softmax_grad_ref  # noqa: E402


def excess(grad, ref, t_grad, dtype, cond):
    """Over the rows: max of (error / bound) / (what check_outputs allows), and where."""
    row_max = ref.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True)
    bound = 2 * ulp(ref, dtype) + 2.0**-22 * row_max + SUBNORMAL_STEP[dtype] + cond
    finite = torch.isfinite(ref)
    zero = torch.zeros((), dtype=torch.float64)
    ours = torch.where(finite, (grad.double() - ref).abs() / bound, zero).amax(-1)
    torch_ratio = torch.where(finite, (t_grad.double() - ref).abs() / bound, zero).nan_to_num(0, 0, 0).amax(-1)
    q = ours / torch.clamp(2 * torch_ratio, min=1.0)
    row = int(q.argmax())
    return float(q[row]), row


def draw(impl, rng, near, former):
    seed = rng.randrange(2**31)
    if near:  # issue 27's case: fp32, N = 27, V = 319, T = 2.68
        n, v, dtype, t = 27, rng.randint(300, 340), torch.float32, rng.uniform(2.5, 2.9)
    else:  # test_random_shapes_property's ranges
        n, v = rng.randint(1, 40), rng.randint(1, 9000)
        dtype, t = rng.choice([torch.float32, torch.bfloat16, torch.float16]), rng.uniform(0.3, 3.0)
    with_entropy, ignore, scale = rng.random() < 0.5, rng.random() < 0.5, rng.uniform(0.1, 20.0)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore:
        labels[torch.rand(n, generator=gen) < 0.3] = -100
    g_logp = torch.randn(n, generator=gen)
    g_entropy = torch.randn(n, generator=gen) if with_entropy else None
    ignore_index = -100 if ignore else None
    op_ignore = NO_IGNORE if ignore_index is None else ignore_index
    _logp, entropy, shift, log_sum = impl.forward(logits, labels, 1 / t, op_ignore, 0, v, with_entropy)
    grad = impl.backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy if with_entropy else None, 1 / t,
                         op_ignore, 0, False)
    ref = selective_log_softmax_grad_ref(logits, labels, g_logp, g_entropy, t, ignore_index)
    _, _, t_grad = torch_fp32(logits, labels, t, ignore_index, g_logp, g_entropy)
    cond = 0.0 if former else grad_conditioning(logits, labels, g_logp, g_entropy, t, ignore_index)
    q, row = excess(grad, ref, t_grad, dtype, cond)
    return q, dict(seed=seed, n=n, v=v, dtype=str(dtype), temperature=t, with_entropy=with_entropy,
                   ignore=ignore, scale=scale, row=row)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("where", choices=["near", "wide"])
    ap.add_argument("seconds", type=float)
    ap.add_argument("impl", choices=[i.name for i in IMPLS])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--former", action="store_true", help="the bound without grad_conditioning")
    args = ap.parse_args()
    torch.set_num_threads(1)
    impl = {i.name: i for i in IMPLS}[args.impl]
    rng = random.Random(args.seed)
    start, draws, worst = time.time(), 0, []
    while time.time() - start < args.seconds:
        worst.append(draw(impl, rng, args.where == "near", args.former))
        worst = sorted(worst, key=lambda w: -w[0])[:5]
        draws += 1
    print(json.dumps({"draws": draws, "misses_among_worst_5": sum(q > 1 for q, _ in worst), "worst": worst}, indent=1))


if __name__ == "__main__":
    main()
