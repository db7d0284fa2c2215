"""What torch's matmul guarantees for one row, measured on this machine (docs/linear.md, "Batch invariance").

    python bench/probe_matmul_rows.py [--device cpu] [--h 1024] [--cols 8192] [--tile 512] [--quantum 16]

Five fixed rows go through the three matmul forms of the fused LM head (logits = rows @ W.T,
logits with a bias = addmm, grad_hidden = d @ W) inside calls of M rows, for bf16, fp16 and
fp32, with 1 and 2 threads (CPU). Reported: the largest difference of those rows' results from
the same rows in a call of M = 5 (does a row's result depend on M?); then, for the CPU plan's
shapes (heads/engine.py: row tiles of --tile rows, a call's last tile its rows rounded up to
--quantum), every M that is a multiple of the quantum up to the tile against M = --tile (do the
plan's shapes agree?); and inside calls of the fixed M = --tile, at other positions and among
other rows of other content (does it depend on position and neighbours, for one shape?), and
between 1 and 2 threads at M = --tile.
"""
import argparse

import torch


def _forms(dtype, h, cols, gen, dev):
    w = (torch.randn(cols, h, generator=gen) * 0.05).to(dtype).to(dev)
    bias = torch.ones(cols, dtype=dtype, device=dev)
    return {
        "rows @ W.T": (h, lambda a: a @ w.t()),
        "addmm(bias, rows, W.T)": (h, lambda a: torch.addmm(bias, a, w.t())),
        "d @ W (grad_hidden)": (cols, lambda a: a @ w),
    }


def _rows_in_call(fn, rows, m, pos, fill, gen):
    a = torch.randn(m, rows.shape[1], generator=gen).to(rows.dtype).to(rows.device) if fill == "random" else \
        torch.zeros(m, rows.shape[1], dtype=rows.dtype, device=rows.device)
    a[pos:pos + rows.shape[0]] = rows
    return fn(a)[pos:pos + rows.shape[0]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--tile", type=int, default=512)
    p.add_argument("--quantum", type=int, default=16)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    threads = (1, 2) if dev.type == "cpu" else (None,)
    t = args.tile
    print(f"torch {torch.__version__}, {dev}, H={args.h}, cols={args.cols}, tile M={t}; "
          f"max |difference| of 5 rows' results (0 = bitwise)")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name in _forms(dtype, args.h, args.cols, torch.Generator().manual_seed(0), dev):
            at_tile = {}
            for th in threads:
                if th:
                    torch.set_num_threads(th)
                gen = torch.Generator().manual_seed(1)
                k, fn = _forms(dtype, args.h, args.cols, gen, dev)[name]
                rows = torch.randn(5, k, generator=gen).to(dtype).to(dev)
                ref = _rows_in_call(fn, rows, 5, 0, "random", gen)
                by_m = {m: (_rows_in_call(fn, rows, m, 0, "random", gen) - ref).abs().max().item()
                        for m in (7, 16, 64, 256, 333, 1024)}
                at_tile[th] = _rows_in_call(fn, rows, t, 0, "random", gen)
                plan = [m for m in range(args.quantum, t, args.quantum)
                        if (_rows_in_call(fn, rows, m, 0, "random", gen) - at_tile[th]).abs().max().item()]
                by_pos = max((_rows_in_call(fn, rows, t, pos, fill, gen) - at_tile[th]).abs().max().item()
                             for pos, fill in ((0, "zeros"), (1, "random"), (100, "random"), (t - 5, "random"),
                                               (t - 6, "zeros")))
                m_txt = " ".join(f"{m}:{d:.1e}" for m, d in by_m.items())
                print(f"{str(dtype):15s} {name:24s} threads={th}: vs M=5 at M= {m_txt} | "
                      f"M={t}, other positions and rows: {by_pos:.1e} | M = {args.quantum}, {2 * args.quantum}, ..., "
                      f"{t} against {t}: {'bitwise' if not plan else 'DIFFERS at M = ' + str(plan)}")
            if len(threads) == 2:
                d = (at_tile[1].double() - at_tile[2].double()).abs().max().item()
                print(f"{str(dtype):15s} {name:24s} M={t}: 1 vs 2 threads {d:.1e}")


if __name__ == "__main__":
    main()
