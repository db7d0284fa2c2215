"""Host-side work of one fused-head call: the ATen ops it dispatches that would each launch a kernel on a device.

    python bench/count_launches.py                       # the GPU's plan forced on this CPU, N = 16384, V = 151936
    python bench/count_launches.py --plan cpu --n 2048 --dtype bf16 --head frozen --chunk-mib 256

Every ATen op dispatched by ``twinkle_mem.linear_selective_log_softmax`` (forward, then backward from the log-probs
and, with --entropy-grad, the entropy) is counted under a TorchDispatchMode, inside the custom ops too; views and
metadata ops (which launch nothing) are left out, and twinkle-mem's native op counts as one. On a GPU each counted
op is one launch or more (the native op's forward is two kernels), so the count is what the host pays per call
whatever the matmuls cost. The GPU's plan runs here on the CPU (TWINKLE_MEM_HEAD_PLAN), with fp32 inputs at twice
the plan's default budget by default: the blocks and steps a bf16 call gets at the default (a GPU sums bf16 products
in fp32 inside cuBLAS, with no copies, as fp32 takes none here; bf16 on a GPU adds two copies per vocab block, its
grad_weight summed apart). H does not change the count where the budget holds the widest blocks, so a small H keeps
the run short.
"""
import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that only make a view, read metadata or allocate: no kernel (``to`` copies through ``_to_copy``, counted,
# and returns its input where the dtype is the same)
NO_KERNEL = {"to", "view", "_unsafe_view", "t", "transpose", "permute", "slice", "select", "expand", "unsqueeze", "squeeze",
             "as_strided", "detach", "alias", "reshape", "unflatten", "flatten", "split", "split_with_sizes",
             "chunk", "unbind", "narrow", "view_as", "expand_as", "lift_fresh", "_reshape_alias", "numpy_T",
             "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
             "is_nonzero", "_local_scalar_dense", "empty", "empty_like", "new_empty", "empty_strided",
             "new_empty_strided"}


class CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched while active (by name), views, metadata and allocations apart; inside
    twinkle-mem's Python custom ops (the fused heads' forward and backward) their own ops, the native op as one."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func._schema.name.split("::")
        opdef = torch._library.custom_ops._maybe_get_opdef(func) if namespace == "twinkle_mem" else None
        if opdef is not None:  # a Python custom op: count what its function runs
            with self:
                return opdef._init_fn(*args, **(kwargs or {}))
        if namespace == "aten" and name in NO_KERNEL:
            self.views += 1
        else:
            self.ops[f"{namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(self.ops.values())


def count(n: int, h: int, vocab: int, dtype: torch.dtype, head: str, entropy_grad: bool, chunk_bytes=None,
          seed: int = 0):
    """(launches of the forward, of the backward, the ops by name) of one call at these sizes, its per-row math
    over all rows at once where the plan batches its steps, as on a GPU (on the CPU a row tile per call:
    engine.fold_in_tiles)."""
    import twinkle_mem
    from twinkle_mem.heads import engine
    engine.fold_in_tiles = lambda device: False
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) * h**-0.5).to(dtype).requires_grad_(head == "trainable")
    labels = torch.randint(0, vocab, (n,), generator=gen)
    with CountOps() as forward:
        logp, ent = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, chunk_bytes=chunk_bytes,
                                                             entropy_grad=True if entropy_grad else None)
    loss = logp.sum() + (ent.sum() if entropy_grad else 0)
    with CountOps() as backward:
        loss.backward()
    return forward.launches, backward.launches, forward.ops + backward.ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", choices=["cpu", "cuda", "npu"], default="cuda")
    p.add_argument("--n", type=int, nargs="+", default=[16384])
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--head", choices=["trainable", "frozen"], nargs="+", default=["trainable", "frozen"])
    p.add_argument("--entropy-grad", action="store_true", help="the entropy trained too (declared)")
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="chunk_bytes in MiB (default: twice the plan's default, the blocks of bf16 at its default)")
    p.add_argument("--top", type=int, default=12, help="the most frequent ops to list")
    args = p.parse_args(argv)
    os.environ["TWINKLE_MEM_HEAD_PLAN"] = args.plan
    from twinkle_mem.heads.plans import PLANS
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    chunk = 2 * PLANS[args.plan].chunk_bytes if args.chunk_mib is None else args.chunk_mib << 20
    print(f"plan {args.plan} (forced on {torch.device('cpu')}), {args.dtype}, H={args.h}, V={args.vocab}, "
          f"chunk_bytes {chunk >> 20} MiB, entropy {'trained' if args.entropy_grad else 'a metric'}")
    for head in args.head:
        for n in args.n:
            fwd, bwd, ops = count(n, args.h, args.vocab, dtype, head, args.entropy_grad, chunk)
            print(f"{head:9s} N={n:6d}: {fwd + bwd:5d} launches (forward {fwd}, backward {bwd}); most: "
                  + ", ".join(f"{k.split('::')[-1]} {v}" for k, v in ops.most_common(args.top)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
