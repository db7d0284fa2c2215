"""The implementations of the op contract that run here, for tests/numerics.py.

- cpu: the native CPU kernels (torch.ops.twinkle_mem on CPU tensors), on the widest path this CPU
  has (python -m twinkle_mem names it); cpu_avx2, cpu_portable: the same kernels on each narrower
  path this CPU can run, forced with TWINKLE_MEM_CPU_ISA (every path's suite runs on one machine);
- composite: python/twinkle_mem/op/composite.py called directly;
- each CPU emulation of a device kernel adds itself below (npu_emulated: the
  AscendC kernels compiled against the stand-in of the AscendC API, standins/npu_emulation.py).
"""
from __future__ import annotations

import os

import torch

from numerics import Impl
from standins import npu_emulation
from twinkle_mem.op import composite, native

ops = torch.ops.twinkle_mem


def _native_backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start,
                     inplace):
    if inplace:
        ops.selective_log_softmax_bwd_(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore,
                                       vocab_start)
        return logits
    return ops.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore,
                                         vocab_start)


def _composite_backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start,
                        inplace):
    if inplace:
        composite.selective_log_softmax_bwd_(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t,
                                             ignore, vocab_start, budget_bytes=16 << 10)
        return logits
    return composite.selective_log_softmax_bwd(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t,
                                               ignore, vocab_start, budget_bytes=16 << 10)


def _composite_forward(*args):
    return composite.selective_log_softmax_fwd(*args, budget_bytes=16 << 10)  # vocab blocks merged


def on_cpu_path(path, fn):
    """fn run with the CPU kernels capped at ``path`` (TWINKLE_MEM_CPU_ISA, read by each op call)."""
    def run(*args):
        old = os.environ.get(native.CPU_ISA_ENV)
        os.environ[native.CPU_ISA_ENV] = path
        try:
            return fn(*args)
        finally:
            if old is None:
                del os.environ[native.CPU_ISA_ENV]
            else:
                os.environ[native.CPU_ISA_ENV] = old
    return run


def narrower_cpu_paths() -> list[str]:
    """The CPU kernel paths below the widest, each one this CPU runs when capped at it."""
    widest = native.cpu_kernel_path("")
    if widest is None:  # no native CPU library (a source tree without a build: gpu_check.sh --dry-run)
        return []
    below = native.CPU_PATHS[native.CPU_PATHS.index(widest) + 1:]
    return [p for p in below if native.cpu_kernel_path(p) == p]


IMPLS = [
    Impl("cpu", ops.selective_log_softmax_fwd, _native_backward),
    *[Impl(f"cpu_{path}", on_cpu_path(path, ops.selective_log_softmax_fwd), on_cpu_path(path, _native_backward))
      for path in narrower_cpu_paths()],
    Impl("composite", _composite_forward, _composite_backward),
    Impl("npu_emulated", npu_emulation.forward, npu_emulation.backward, checks_arguments=False),
]


# The CUDA kernels run on the CPU (standins/cuda_emulation.py): the kernel source and
# its host plan, fibers for CUDA threads. Sized for the numerics suite's shapes.
from standins import cuda_emulation  # noqa: E402

if cuda_emulation.compiler() is not None:
    IMPLS.append(Impl("cuda_emulated", cuda_emulation.forward, cuda_emulation.backward, max_elements=1 << 20,
                      checks_arguments=False))


def same_layout_on(device, t):
    """t copied to device with its sizes, strides and overlaps as they are (t.to(device) makes an expanded,
    overlapping tensor contiguous, and the op's overlap check would never see one)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.numel() == 0:
        return t.to(device)
    span = 1 + sum((size - 1) * st for size, st in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset()).to(device, copy=True)
    return flat.as_strided(t.shape, t.stride(), 0)


# The CUDA kernels on a GPU, when there is one: CPU tensors in, CPU tensors out.
def _on_cuda(fn):
    def run(*args):
        moved = [same_layout_on("cuda", a) for a in args]
        out = fn(*moved)
        if isinstance(out, tuple):
            return tuple(t.cpu() for t in out)
        return out.cpu()
    return run


def _cuda_backward(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start, inplace):
    if not inplace:
        return _on_cuda(_native_backward)(g_logp, g_entropy, logits, labels, shift, log_sum, entropy, inv_t, ignore,
                                          vocab_start, False)
    on_gpu = same_layout_on("cuda", logits)  # written over in place, then copied back into the caller's logits
    grad = _native_backward(*[same_layout_on("cuda", a) for a in (g_logp, g_entropy)], on_gpu,
                            *[same_layout_on("cuda", a) for a in (labels, shift, log_sum, entropy)], inv_t, ignore,
                            vocab_start, True)
    logits.copy_(grad.cpu())
    return logits


if torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "twinkle_mem::selective_log_softmax_fwd", "CUDA"):
    IMPLS.append(Impl("cuda", _on_cuda(ops.selective_log_softmax_fwd), _cuda_backward))
