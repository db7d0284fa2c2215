"""Selective log-softmax on an Ascend NPU: twinkle-mem's AscendC kernel against
its composite fallback on the same device, the eager PyTorch formula, and
torch_npu's fused cross-entropy (torch_npu.npu_cross_entropy_loss, which returns
the loss and the full log_prob; its gradient flows through the loss only).

For each shape and dtype, with and without entropy: time of forward and
forward+backward (median, p20, p80 over --iters runs; the in-place backward
for twinkle-mem as its own row) and the peak NPU memory above the inputs;
without entropy only, the agreement with a float64 reference (max |logp error|
on the first 256 rows). Rows go to a JSON file tagged with the device, SoC and
versions, and what twinkle-mem ran (its backend on the NPU, the CPU kernel path); where the
AscendC library is not loaded, the run refuses to start unless --allow-composite (the
twinkle_mem_composite row measures the composite on purpose, either way). Writes
bench/results/local/bench_npu.json unless --out names another file.

Run on a CANN node (bench/npu_check.sh does): python bench/bench_npu.py --out results.json
"""
import argparse
import contextlib
import json
import platform
import time

import torch
import torch_npu  # noqa: F401

import twinkle_mem
from bench_common import add_allow_composite, check_twinkle_mem, local_out, ran_line, run_metadata, write_json
from twinkle_mem.op import composite
from twinkle_mem.op.reference import selective_log_softmax_ref

SHAPES = [(4096, 151936), (16384, 151936), (8192, 32000)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def peers(with_entropy):
    def native(x, y, inplace=False):
        out = twinkle_mem.selective_log_softmax(x, y, with_entropy, inplace_backward=inplace)
        return out[0] + out[1] if with_entropy else out  # one tensor to reduce; entropy's gradient included

    def eager(x, y):
        logp = torch.log_softmax(x.float(), -1)
        sel = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return sel - (logp.exp() * logp).sum(-1) if with_entropy else sel

    def npu_cross_entropy(x, y):
        loss, _log_prob, _zloss, _lse = torch_npu.npu_cross_entropy_loss(x, y, reduction="none")
        return -loss.float()

    none = contextlib.nullcontext
    out = {"twinkle_mem": (native, none), "twinkle_mem_inplace_bwd": (lambda x, y: native(x, y, True), none),
           "twinkle_mem_composite": (native, lambda: composite.forced(("npu",))), "eager_log_softmax": (eager, none)}
    if not with_entropy:  # no entropy from the fused cross-entropy
        out["npu_cross_entropy_loss"] = (npu_cross_entropy, none)
    return out


def timed(fn, iters):
    times = []
    for _ in range(iters):
        torch.npu.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.npu.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"p20_ms": q(0.2), "median_ms": q(0.5), "p80_ms": q(0.8)}


def run(args):
    rows = []
    dev = torch.device("npu", 0)
    for n, v in SHAPES:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            x0 = (torch.randn(n, v, device=dev) * 4).to(dtype)
            y = torch.randint(0, v, (n,), device=dev)
            ref = selective_log_softmax_ref(x0[:256].cpu(), y[:256].cpu())[0]
            for with_entropy in (False, True):
                for name, (fn, context) in peers(with_entropy).items():
                    row = {"peer": name, "n": n, "v": v, "dtype": dname, "entropy": with_entropy}
                    ctx = context()
                    ctx.__enter__()
                    try:
                        if not with_entropy:
                            logp = fn(x0[:256], y[:256])
                            row["max_abs_err"] = (logp.double().cpu() - ref).abs().max().item()
                        with torch.no_grad():
                            row["forward"] = timed(lambda: fn(x0, y), args.iters)
                        x = x0.clone().requires_grad_()

                        # The in-place peer (twinkle_mem_inplace_bwd) overwrites the leaf x with its
                        # gradient at each step, so later steps run on gradient values, not logits:
                        # fine for timing and memory (same shapes, same work), not for values.
                        def step():
                            x.grad = None
                            fn(x, y).sum().backward()

                        step()
                        torch.npu.synchronize()
                        torch.npu.reset_peak_memory_stats()
                        base = torch.npu.memory_allocated()
                        row["forward_backward"] = timed(step, args.iters)
                        row["peak_extra_gib"] = (torch.npu.max_memory_allocated() - base) / 2**30
                        del x
                    except Exception as exc:  # a peer that cannot run this case is reported, not fatal
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    finally:
                        ctx.__exit__(None, None, None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del x0
            torch.npu.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--out", default=local_out("bench_npu.json"),
                        help="results file (default bench/results/local/bench_npu.json, not tracked)")
    add_allow_composite(parser)
    args = parser.parse_args()
    ran = check_twinkle_mem(args.allow_composite, "npu")
    rows = run(args)
    meta = run_metadata(ran, device=torch.npu.get_device_name(0), torch_npu=torch_npu.__version__,
                        backends=twinkle_mem.backends(), host=platform.node())
    print(ran_line(meta))
    write_json(args.out, {"meta": meta, "rows": rows}, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
