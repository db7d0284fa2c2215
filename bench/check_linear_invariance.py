"""Batch invariance of the fused LM head, checked bit for bit on one device.

    python bench/check_linear_invariance.py                      # a GPU: N = 1, 7, 333, 4096, 16384, V = 151936, bf16
    python bench/check_linear_invariance.py --device cpu --h 64 --vocab 5003   # the same logic, small, on the CPU

Five probe rows (hidden state, labels, upstream gradients) go through
``twinkle_mem.linear_selective_log_softmax`` alone (N = 1, one call per probe) and then inside
batches of every --n, at positions that straddle the row tiles, among other rows of random content,
with and without a quarter of the other rows dropped as all-ignore_index, at every --chunk-bytes
(default: the smallest accepted, one in between, 1 GiB). Their logp, entropy and grad_hidden rows
must be bitwise the probes' own. For one batch, grad_weight and grad_bias must be bitwise the same
at every chunk_bytes. Prints one line per layout and exits with the number of mismatches (0: all
bitwise). ``check()`` is what tests/heads/test_linear_batch_invariance.py runs on the CPU.
"""
import argparse
import sys
import time

import torch

IGNORE = -100


def smallest_chunk(vocab, h, dtype, device):
    """The smallest chunk_bytes that holds one step of the widest blocks in every pass of a call (a smaller one
    narrows the blocks: other bits), on ``device``'s plan."""
    from twinkle_mem.heads import plans
    from twinkle_mem.heads.frozen import vectors_at_most
    from twinkle_mem.heads.matmul import product_sums
    plan = plans.device_plan(device)
    return plans.block_need(plans.block_width(vocab, h, plan), h, dtype, plan, product_sums(dtype, device),
                             vectors_at_most(dtype, device))


def _chunks(vocab, h, dtype, device):
    """The smallest chunk_bytes that holds the widest blocks, one in between, 1 GiB."""
    smallest = smallest_chunk(vocab, h, dtype, device)
    return [smallest, 3 * smallest + 12345, max(1 << 30, smallest)]


def _call(hidden, weight, bias, labels, g_logp, g_ent, *, entropy, temperature, chunk_bytes, frozen,
          want_params=False):
    """One forward + backward; returns (logp, entropy or None, grad_hidden[, grad_weight, grad_bias]). ``frozen``:
    weight and bias need no gradient (the head differentiated in its forward), unless ``want_params``. The entropy
    is declared trained (entropy_grad=True): a frozen head sums its vector too."""
    import twinkle_mem
    h = hidden.detach().clone().requires_grad_()
    params = [h]
    w = weight.detach().clone().requires_grad_(want_params or not frozen)
    b = None if bias is None else bias.detach().clone().requires_grad_(want_params or not frozen)
    if want_params:
        params += [w] + ([b] if b is not None else [])
    out = twinkle_mem.linear_selective_log_softmax(h, w, labels, entropy, bias=b, temperature=temperature,
                                                   ignore_index=IGNORE, chunk_bytes=chunk_bytes, entropy_grad=True)
    logp, ent = out if entropy else (out, None)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
    grads = torch.autograd.grad(loss, params)
    return (logp.detach(), None if ent is None else ent.detach(), *grads)


def _no_grad_call(hidden, weight, bias, labels, *, entropy, temperature, chunk_bytes, **_):
    """The same forward under no_grad (the old log-probs of PPO / GRPO: verl's compute_log_prob)."""
    import twinkle_mem
    with torch.no_grad():
        out = twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, entropy, bias=bias,
                                                       temperature=temperature, ignore_index=IGNORE,
                                                       chunk_bytes=chunk_bytes)
    return out if entropy else (out, None)


def _layouts(n_list, probes, seed, tile):
    """(name, N, probe positions, drop others?) for every N: positions at both ends and around tile edges."""
    gen = torch.Generator().manual_seed(seed)
    for n in n_list:
        if n < probes:
            continue
        edges = [0, n - 1, tile - 1, tile, 2 * tile + 3, n // 2]
        pos = sorted({p for p in edges if 0 <= p < n})
        while len(pos) < probes:
            pos = sorted(set(pos) | {int(torch.randint(0, n, (1,), generator=gen))})
        pos = pos[:probes]
        yield f"N={n}", n, pos, False
        if n > probes:
            yield f"N={n}, 1/4 of the others dropped", n, pos, True


def check(device="cpu", dtype=torch.bfloat16, h=1024, vocab=151936, n_list=(1, 7, 333, 4096), chunk_list=None,
          entropy=True, temperature=1.0, k=None, bias=False, seed=0, log=print, frozen=True):
    """Returns a list of mismatch descriptions (empty: bitwise invariant). ``frozen``: the rows' checks with a
    frozen head (LoRA's; its forward sums the gradient vectors), else a trainable one. Each batch's log-probs and
    entropy are also held to the same call under no_grad (old and new log-probs)."""
    from twinkle_mem.heads.plans import device_plan
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    probes = 5
    weight = (torch.randn(vocab, h, generator=gen) * h**-0.5 * 2).to(dtype).to(dev)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype).to(dev) if bias else None
    lab_shape = (probes,) if k is None else (probes, k)
    p_hidden = torch.randn(probes, h, generator=gen).to(dtype).to(dev)
    p_labels = torch.randint(0, vocab, lab_shape, generator=gen).to(dev)
    if k is not None:
        p_labels[0, -1] = IGNORE  # an ignored label inside a kept row
    p_g_logp = torch.randn(lab_shape, generator=gen).to(dev)
    p_g_ent = torch.randn(probes, generator=gen).to(dev)
    given, chunk_list = chunk_list, chunk_list or _chunks(vocab, h, dtype, dev)
    kw = dict(entropy=entropy, temperature=temperature, frozen=frozen)

    alone = [_call(p_hidden[i:i + 1], weight, b, p_labels[i:i + 1], p_g_logp[i:i + 1], p_g_ent[i:i + 1],
                   chunk_bytes=chunk_list[0], **kw) for i in range(probes)]
    bad = []
    for name, n, pos, drop in _layouts(n_list, probes, seed, device_plan(dev).row_tile):
        hidden = torch.randn(n, h, generator=gen).to(dtype).to(dev)
        labels = torch.randint(0, vocab, (n,) if k is None else (n, k), generator=gen).to(dev)
        g_logp = torch.randn(labels.shape, generator=gen).to(dev)
        g_ent = torch.randn(n, generator=gen).to(dev)
        if drop:
            labels[torch.rand(n, generator=gen).to(dev) < 0.25] = IGNORE
        idx = torch.tensor(pos, device=dev)
        hidden[idx], labels[idx], g_logp[idx], g_ent[idx] = p_hidden, p_labels, p_g_logp, p_g_ent
        for chunk in chunk_list:
            t0 = time.perf_counter()
            got = _call(hidden, weight, b, labels, g_logp, g_ent, chunk_bytes=chunk, **kw)
            worst = 0.0
            for i, p in enumerate(pos):
                for what, a, r in zip(("logp", "entropy", "grad_hidden"), got, alone[i]):
                    if a is None:
                        continue
                    a, r = a[p:p + 1], r
                    if not torch.equal(a, r):
                        diff = (a.double() - r.double()).abs().max().item()
                        worst = max(worst, diff)
                        bad.append(f"{name}, chunk_bytes={chunk}: row {p} {what} differs from the row alone by {diff:.3g}")
            old = _no_grad_call(hidden, weight, b, labels, chunk_bytes=chunk, **kw)
            for what, a, r in zip(("logp", "entropy"), old, got):
                if a is not None and not torch.equal(a, r):
                    diff = (a.double() - r.double()).abs().max().item()
                    worst = max(worst, diff)
                    bad.append(f"{name}, chunk_bytes={chunk}: {what} under no_grad differs by {diff:.3g}")
            log(f"{name:34s} chunk_bytes={chunk:>11d}: {'bitwise' if worst == 0 else f'DIFFERS by {worst:.3g}'}"
                f" ({time.perf_counter() - t0:.2f} s)")

    # grad_weight and grad_bias of one batch, whatever chunk_bytes is
    n = max(x for x in n_list)
    hidden = torch.randn(n, h, generator=gen).to(dtype).to(dev)
    labels = torch.randint(0, vocab, (n,) if k is None else (n, k), generator=gen).to(dev)
    labels[torch.rand(n, generator=gen).to(dev) < 0.25] = IGNORE
    g_logp, g_ent = torch.randn(labels.shape, generator=gen).to(dev), torch.randn(n, generator=gen).to(dev)
    chunk_list = given or _chunks(vocab, h, dtype, dev)
    runs = [_call(hidden, weight, b, labels, g_logp, g_ent, chunk_bytes=c, want_params=True, **kw)[3:]
            for c in chunk_list]
    for c, r in zip(chunk_list[1:], runs[1:]):
        for what, a, ref in zip(("grad_weight", "grad_bias"), r, runs[0]):
            if not torch.equal(a, ref):
                bad.append(f"N={n}: {what} at chunk_bytes={c} differs from chunk_bytes={chunk_list[0]} by "
                           f"{(a.double() - ref.double()).abs().max().item():.3g}")
    log(f"N={n}: grad_weight{' and grad_bias' if bias else ''} at chunk_bytes {chunk_list}: "
        f"{'bitwise' if not any('grad_weight' in x or 'grad_bias' in x for x in bad) else 'DIFFER'}")
    return bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--n", type=int, nargs="+", default=[1, 7, 333, 4096, 16384])
    p.add_argument("--plan", choices=["cpu", "cuda", "npu"], default=None,
                   help="the engine's plan of that device kind (TWINKLE_MEM_HEAD_PLAN; default: the device's own)")
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk-bytes", type=int, nargs="*", default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--k", type=int, default=None, help="labels per row ([..., k]); default: one")
    p.add_argument("--no-entropy", action="store_true")
    p.add_argument("--bias", action="store_true")
    p.add_argument("--trainable", action="store_true", help="the rows' checks with a trainable head (default: frozen)")
    args = p.parse_args(argv)
    if args.plan:
        import os
        os.environ["TWINKLE_MEM_HEAD_PLAN"] = args.plan
    if args.device.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the npu device)
    import twinkle_mem
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device(args.device)
    print(f"torch {torch.__version__}, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}, backends "
          f"{twinkle_mem.backends()}; {args.dtype}, H={args.h}, V={args.vocab}, T={args.temperature}, "
          f"k={args.k}, entropy={not args.no_entropy}, bias={args.bias}, "
          f"{'trainable' if args.trainable else 'frozen'} head", flush=True)
    bad = check(args.device, dtype, args.h, args.vocab, args.n, args.chunk_bytes, not args.no_entropy,
                args.temperature, args.k, args.bias, log=lambda s: print(s, flush=True), frozen=not args.trainable)
    for line in bad[:20]:
        print("MISMATCH:", line)
    print(f"{len(bad)} mismatch(es)")
    return min(len(bad), 100)


if __name__ == "__main__":
    sys.exit(main())
