"""twinkle-kit's Megatron step at TP = 2 x PP = 2 on the CPU with an mcore_bridge-built model: peak RSS
per rank and time, for twinkle-kit as shipped, ``install()`` and ``install(fused_lm_head=True)``.

    python bench/bench_twinkle_mcore_bridge.py [--vocab 151936] [--seq 4096] [--hidden 64]
        [--layers 2] [--cases shipped,install,fused]

A tiny Qwen3 (``--layers`` layers, hidden ``--hidden``, vocab ``--vocab``, untied, random weights) saved
locally, built by twinkle's ``MegatronModel(model_id=...)`` through mcore_bridge as a user builds it
(the CPU stand-ins of standins/mcore_bridge.py), fp32 (``mixed_precision='no'``; bf16 matmuls are
~10x slower on this CPU), in a gloo world of 4 processes (TP = 2, PP = 2: ranks 0-1 the first stage,
2-3 the last, each TP rank its vocab shard). One ``forward_backward`` of GRPOLoss without an entropy
bonus (shipped twinkle-kit refuses entropy under TP > 1), T = 0.7, 2 micro-batches of one ``--seq`` sample each (``--prompt`` tokens with label -100).
Each case in a fresh world; per rank: the rise of the resident-set high-water mark over the step (model
built and wrapped before, after one warm-up step) and the step's time; the loss and the sum of the returned log-probs under
the loss mask (the cases must agree), and what twinkle-mem ran in each rank (backend, CPU kernel path: the table
and the JSON name them; where it would run the composite fallback, the run refuses to start unless
--allow-composite). Writes bench/results/local/twinkle_mcore_bridge.{json,md,png} (the recorded results: --out
bench/results/twinkle_mcore_bridge); ``--replot`` redraws the table and the PNG from the JSON.
"""
import copy
import datetime
import json
import os
import subprocess
import tempfile
import time

from bench_common import (Progress, bench_parser, check_twinkle_mem, local_out, markdown_table, peak_and_time_figure,
                          ran_line, read_json, run_metadata, twinkle_mem_ran, write_json)

CASES = {"shipped": ("twinkle-kit 0.5.1", None), "install": ("install()", dict()),
         "fused": ("install(fused_lm_head=True)", dict(fused_lm_head=True))}
WORLD, TP, PP = 4, 2, 2


def _worker(rank, init_file, out_dir, ckpt, case, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=1800))
    import warnings
    warnings.simplefilter("ignore")
    from standins import mcore_bridge as mb
    from standins import megatron as th
    from twinkle.loss import GRPOLoss

    from twinkle_mem.integrations import twinkle as integration
    from twinkle_mem.measure import peak_rss
    result = {}
    with mb.mcore_bridge_on_cpu():
        model = mb.megatron_model(ckpt, tp=TP, pp=PP, mixed_precision="no", variable_seq_lengths=False,
                                  loss=GRPOLoss())  # no entropy bonus: shipped refuses it under TP > 1
        model._lazy_wrap_model()
        if CASES[case][1] is not None:
            integration.install(mask_skip="never", **CASES[case][1])
        samples = th.lm_samples([args.seq, args.seq], args.vocab, prompt=args.prompt)

        def step():
            for p in model.model[0].parameters():
                p.grad = None
            return model.forward_backward(inputs=copy.deepcopy(samples), micro_batch_size=1, temperature=0.7,
                                          advantages=torch.tensor([1.0, -0.5]))

        step()  # warm-up: megatron-core's fused vocab-parallel cross entropy (shipped, TP > 1) compiles first
        dist.barrier()
        with peak_rss() as peak:
            start = time.perf_counter()
            out = step()
            result["time_s"] = time.perf_counter() - start
        result["peak_bytes"] = peak.bytes
        result["loss"] = out["loss"]
        if out["logps"] is not None:
            labels = torch.stack([s["labels"].reshape(-1) for s in samples])
            result["logps_sum"] = float(out["logps"][labels != -100].double().sum())
        from megatron.core import parallel_state as mpu
        result.update(tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank())
    result["ran"] = twinkle_mem_ran(where=f"{case}: rank {rank}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_case(ckpt, case, args):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), tmp, ckpt, case, args), nprocs=WORLD,
                           start_method="spawn")
        per_rank = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank


def main():
    parser = bench_parser(__doc__, vocab=151936, seq=4096, hidden=64, layers=2, prompt=0)
    parser.add_argument("--cases", default="shipped,install,fused")
    parser.add_argument("--out", default=local_out("twinkle_mcore_bridge"),
                        help="results stem (default bench/results/local/twinkle_mcore_bridge, not tracked)")
    parser.add_argument("--replot", action="store_true", help="redraw the table and the PNG from the JSON only")
    args = parser.parse_args()
    if args.replot:
        saved = read_json(args.out + ".json")
        _write(saved["meta"], saved["results"], args.out)
        return
    check_twinkle_mem(args.allow_composite)  # the ranks import the same twinkle_mem
    from standins import mcore_bridge as mb
    ckpt = tempfile.mkdtemp(prefix="bench-qwen3-")
    mb.save_tiny_qwen3(ckpt, vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2)
    cases = args.cases.split(",")
    progress = Progress(len(cases))
    results = {}
    for case in cases:
        free = subprocess.run(["free", "-m"], capture_output=True, text=True).stdout.strip()
        progress.step(f"{CASES[case][0]}: a fresh world of {WORLD} processes")
        start = time.perf_counter()
        results[case] = dict(ranks=run_case(ckpt, case, args), wall_s=time.perf_counter() - start, free_before=free)
        peaks = ", ".join(f"{r['peak_bytes'] / 2**20:,.0f}" for r in results[case]["ranks"])
        progress.done(f"peak RSS rise per rank {peaks} MiB")
    ran = [rr["ran"] for res in results.values() for rr in res["ranks"]]
    meta = run_metadata(ran, vocab=args.vocab, seq=args.seq, hidden=args.hidden, layers=args.layers, prompt=args.prompt,
                        world=WORLD, tp=TP, pp=PP, dtype="float32", threads_per_rank=1, threads=1,
                        one_micro_batch_logits_shard_mib=args.seq * (args.vocab // TP) * 4 / 2**20)
    write_json(args.out + ".json", dict(meta=meta, results=results), indent=1)
    _write(meta, results, args.out)


def _table(meta, results):
    rows = []
    for case, res in results.items():
        for r, rr in enumerate(res["ranks"]):
            logps = f"{rr['logps_sum']:.4f}" if "logps_sum" in rr else "-"
            rows.append([CASES[case][0], f"{r} ({rr['pp_rank']}, {rr['tp_rank']})", f"{rr['peak_bytes'] / 2**20:,.0f} MiB",
                         f"{rr['time_s']:.1f} s", f"{rr['loss']:.6f}", logps])
    title = (f"twinkle-kit 0.5.1 `MegatronModel.forward_backward`, mcore_bridge Qwen3 (V = {meta['vocab']}, "
             f"H = {meta['hidden']}, {meta['layers']} layers, fp32), TP = 2 x PP = 2 (gloo, 4 CPU processes, 1 thread "
             f"each), 2 micro-batches of [1, {meta['seq']}]; one micro-batch's logits shard: "
             f"{meta['one_micro_batch_logits_shard_mib']:,.0f} MiB")
    line = ran_line(meta)  # (none in a run recorded before it: its table re-renders as it was)
    return title + "\n\n" + markdown_table(["case", "rank (pp, tp)", "peak RSS rise", "step time", "loss",
                                             "sum of log-probs"], rows) + (f"\n{line}\n" if line else "")


def _write(meta, results, stem):
    """The table (printed, and to stem.md) and the figure (stem.png): peak RSS rise and step time per rank."""
    table = _table(meta, results)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table, end="")
    first = next(iter(results.values()))["ranks"]  # every case ran the same world
    labels = [f"rank {r}\n(pp {rr['pp_rank']}, tp {rr['tp_rank']})" for r, rr in enumerate(first)]
    series = {CASES[case][0]: ([rr["peak_bytes"] / 2**20 for rr in res["ranks"]], [rr["time_s"] for rr in res["ranks"]])
              for case, res in results.items()}
    peak_and_time_figure(labels, series, meta["one_micro_batch_logits_shard_mib"],
                         f"twinkle-kit Megatron step, mcore_bridge Qwen3, TP = 2 x PP = 2, V = {meta['vocab']}, "
                         f"S = {meta['seq']}, fp32, CPU", stem + ".png")


if __name__ == "__main__":
    main()
