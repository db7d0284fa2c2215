"""What one training step of twinkle-kit's Megatron recipes costs with TWINKLE_MEM_INSTALL unset (twinkle-kit as shipped),
``1`` and ``fused_lm_head``: each worker's peak memory, the step time, the loss and twinkle's metrics.

    python bench/bench_recipe.py [--vocab 151936] [--seq 4096] [--prompt 512] [--hidden 64]
        [--layers 2] [--k 64] [--recipes grpo,gkd] [--modes unset,1,fused_lm_head] [--base-tree DIR]
        [--allow-composite]

``--base-tree DIR`` (another twinkle-mem checkout, built in place) adds the mode ``base:fused_lm_head``: the variable
``fused_lm_head`` with DIR/python first on the driver's and the workers' path, so that the step of another version of
the fused head is measured beside this tree's (LoRA leaves the output layer frozen: this tree's fused head sums its
gradient vectors in the forward, heads/frozen.py).

The step as the recipes take it (standins/recipes.py: short_math_grpo.py's Megatron branch, gkd_off_policy.py):
twinkle's ``MegatronModel`` with a LoRA adapter (``target_modules='all-linear'``, r = 8) in twinkle's Ray mode, 2 CPU
workers at TP = 2 (standins/twinkle_ray.py), its Megatron optimizer and scheduler; ``forward_backward`` of 2
micro-batches of one ``--seq``-token sequence (``--prompt`` prompt tokens, label -100) and ``clip_grad_and_step``.
GRPO: GRPOLoss(epsilon=0.2), packed batches (``padding_free=True``), the sampler's log-probs a uniform sampler's
(-log V) and advantages +-1; GKD: GKDLoss(beta=0.5) over a teacher's top-k (``--k``, global ids over the whole
vocab, as the recipe's vLLM teacher gives them). A local Qwen3 (V = ``--vocab``, H = ``--hidden``, random weights),
fp32. Each mode in a fresh driver process (the variable set before Ray starts), each recipe a model of its own, one
warm-up step, then the measured step: the rise of each worker's resident-set high-water mark over the step, read in
the worker (``/proc/self/clear_refs`` before, ``VmHWM`` after), and the step's wall time in the driver. The loss of
both steps (the first from the same weights in every mode), and twinkle's metrics after each
(``calculate_metric(is_training=True)``: the first step's compared with the first mode's). What twinkle-mem ran (backend, CPU kernel path) is read
in each driver and each worker, and named in the table and the JSON; a run whose twinkle-mem (this one's or
--base-tree's) would take the composite fallback refuses to start unless --allow-composite. Writes
bench/results/local/recipe.{json,md,png} (--out); ``--replot`` redraws the table and the PNG from the JSON. Progress on
stderr.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import bench_common
from bench_common import (Progress, bench_parser, check_twinkle_mem, local_out, markdown_table, peak_and_time_figure,
                          probe_twinkle_mem, ran_line, read_json, refuse_composite, run_metadata, twinkle_mem_ran,
                          write_json)

MODES = {"unset": "twinkle-kit 0.5.1 as shipped (unset)", "1": "`TWINKLE_MEM_INSTALL=1`",
         "fused_lm_head": "`TWINKLE_MEM_INSTALL=fused_lm_head`",
         "base:fused_lm_head": "`TWINKLE_MEM_INSTALL=fused_lm_head`, --base-tree's twinkle-mem"}
VAR = "TWINKLE_MEM_INSTALL"


# --- in the workers ------------------------------------------------------------------------------------------------
def _reset_peak(actor=None):
    """The worker's resident-set high-water mark set to its current RSS; returns that RSS (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key, actor=None):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _peak(actor=None):
    return _status("VmHWM")


def _ran(actor=None):
    """What twinkle-mem runs in this worker (bench_common, which the driver sends by value: workers cannot import
    bench/)."""
    return twinkle_mem_ran(where="worker")


# --- in a driver (one per mode) ------------------------------------------------------------------------------------
def _samples(args, seed):
    import torch
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(2):
        ids = torch.randint(10, args.vocab, (args.seq, ), generator=gen)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        labels[:args.prompt] = -100
        samples.append(dict(input_ids=ids.tolist(), labels=labels.tolist(), attention_mask=[1] * args.seq,
                            position_ids=list(range(args.seq))))
    return samples


def _grpo_call(args, seed):
    import math
    samples = _samples(args, seed)
    completion = args.seq - args.prompt - 1
    return dict(inputs=samples, old_logps=[[-math.log(args.vocab)] * completion] * 2, advantages=[1.0, -1.0],
                micro_batch_size=1)


def _gkd_call(args, seed):
    import torch
    samples = _samples(args, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(args.vocab, generator=gen)[:args.k] for _ in range(args.seq)])
    ids = ids.expand(2, -1, -1).contiguous()
    logprobs = torch.randn(2, args.seq, args.k, generator=gen).sort(-1, descending=True).values.log_softmax(-1)
    return dict(inputs=samples, teacher_topk_logprobs=logprobs, teacher_topk_indices=ids, micro_batch_size=1)


def _measure(ckpt, recipe, args):
    """One recipe's model: a warm-up step, then the measured one."""
    from standins import recipes
    from standins import twinkle_ray as tr
    from peft import LoraConfig
    from twinkle.loss import GKDLoss
    from twinkle.processor import InputProcessor
    model = recipes._model("MegatronModel", ckpt, "tp2", "no", variable_seq_lengths=True)
    result = dict(recipe=recipe)
    try:
        model.add_adapter_to_model(recipes.ADAPTER, LoraConfig(**recipes.LORA))
        model.set_optimizer("default", lr=1e-4)
        model.set_lr_scheduler("default", lr_decay_steps=10, max_lr=1e-4)
        if recipe == "grpo":
            model.set_loss("GRPOLoss", epsilon=0.2)
            model.set_processor(InputProcessor, padding_free=True)
        else:
            model.set_loss(GKDLoss(beta=0.5, temperature=1.0))
        call = _grpo_call if recipe == "grpo" else _gkd_call
        losses, seconds, metrics = [], [], []
        for step in range(2):
            kwargs = call(args, seed=step)
            base = tr.on_workers(model, _reset_peak)
            start = time.perf_counter()
            out = model.forward_backward(**kwargs)
            model.clip_grad_and_step()
            seconds.append(time.perf_counter() - start)
            peaks = [p - b for p, b in zip(tr.on_workers(model, _peak), base)]
            losses.append(recipes.loss_of(out))
            metrics.append(_plain(model.calculate_metric(is_training=True)))
        result.update(losses=losses, metrics=metrics, step_s=seconds[-1], warmup_s=seconds[0], peak_bytes=peaks)
        result["ran"] = [twinkle_mem_ran(where="driver")] + [dict(r, where=f"worker {rank}") for rank, r in
                                                             enumerate(tr.on_workers(model, _ran))]
    except Exception as error:  # noqa: BLE001  (shipped's GKD at TP = 2: recorded, shown in the table)
        result["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
        print(f"  {recipe} failed: {error}", file=sys.stderr, flush=True)
    finally:
        tr.release(model)
    return result


def _plain(value):
    """twinkle's metrics (per worker in Ray mode) as JSON: numbers as floats, anything else as its text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _metrics_against(metrics, first):
    """The first step's numeric metrics against the first row's: "same", or each that differs with its difference.
    (twinkle's text metrics are the step's wall time and speed: not compared.)"""
    def flat(value, key=""):
        if isinstance(value, dict):
            return {k: v for name, item in value.items() for k, v in flat(item, f"{key}.{name}" if key else name).items()}
        if isinstance(value, list):
            return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{key}[{i}]").items()}
        return {key: value}
    mine, theirs = flat(metrics), flat(first)
    differ = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, str) or isinstance(b, str) or a == b:
            continue
        differ.append(f"{key} {a - b:+.1e}" if isinstance(a, float) and isinstance(b, float) else f"{key}: {a} / {b}")
    return "same" if not differ else "; ".join(differ)


def child(mode, ckpt, args):
    import ray.cloudpickle
    from standins import twinkle_ray as tr
    ray.cloudpickle.register_pickle_by_value(bench_common)  # _ran's twinkle_mem_ran, to the workers
    results = {}
    with tr.ray_session():
        for recipe in args.recipes.split(","):
            print(f"  {mode}: {recipe}", file=sys.stderr, flush=True)
            results[recipe] = _measure(ckpt, recipe, args)
    print(json.dumps(results))


# --- the parent -----------------------------------------------------------------------------------------------------
def main():
    parser = bench_parser(__doc__, vocab=151936, seq=4096, prompt=512, hidden=64, layers=2, k=64)
    parser.add_argument("--recipes", default="grpo,gkd")
    parser.add_argument("--modes", default="unset,1,fused_lm_head")
    parser.add_argument("--base-tree", help="another checkout: adds the mode base:fused_lm_head")
    parser.add_argument("--out", default=local_out("recipe"),
                        help="results stem (default bench/results/local/recipe, not tracked)")
    parser.add_argument("--replot", action="store_true", help="redraw the table and the PNG from the JSON only")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args)
        return
    if args.replot:
        saved = read_json(args.out + ".json")
        _write(saved["meta"], saved["results"], args.out)
        return
    check_twinkle_mem(args.allow_composite)  # the drivers and their workers import the same twinkle_mem
    if args.base_tree:
        refuse_composite(probe_twinkle_mem(_base_env(args.base_tree, dict(os.environ)), where="--base-tree"),
                         args.allow_composite)
    from standins import mcore_bridge as mb
    from standins.twinkle_ray import run_driver
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-recipe-qwen3-") as ckpt:  # (removed whatever happens)
        mb.save_tiny_qwen3(ckpt, vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2)
        modes = args.modes.split(",") + (["base:fused_lm_head"] if args.base_tree else [])
        progress = Progress(len(modes), stream=sys.stderr)
        results = {}
        for mode in modes:
            progress.step(f"{MODES[mode]}: a fresh driver, Ray, 2 workers per recipe")
            env = {k: v for k, v in os.environ.items() if k != VAR}
            if mode != "unset":
                env[VAR] = mode.split(":")[-1]
            if mode.startswith("base:"):
                env = _base_env(args.base_tree, env)
            cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", mode, ckpt] + [
                f"--{name}={getattr(args, name)}" for name in ("vocab", "seq", "prompt", "hidden", "layers", "k", "recipes")]
            log = args.out + f".{mode.replace(':', '_')}.log"  # the driver's and its workers' messages
            with open(log, "w") as err:
                returncode, output = run_driver(cmd, env, 3600, stderr=err)
            if returncode != 0:
                raise RuntimeError(f"the {mode} driver failed (exit {returncode}); see {log}")
            os.remove(log)
            results[mode] = json.loads(output.strip().splitlines()[-1])
            progress.done(", ".join(f"{r}: " + (res.get("error") or " / ".join(
                f"{p / 2**20:,.0f}" for p in res["peak_bytes"]) + " MiB") for r, res in results[mode].items()))
    ran = [dict(r, where=f"{mode}: {r['where']}") for mode, per_recipe in results.items()
           for res in per_recipe.values() for r in res.get("ran", [])]
    meta = run_metadata(ran, base_tree=args.base_tree, vocab=args.vocab, seq=args.seq, prompt=args.prompt,
                        hidden=args.hidden, layers=args.layers,
                        k=args.k, world=2, tp=2, dtype="float32", threads=1, threads_per_worker=1, lora_r=8,
                        one_micro_batch_logits_shard_mib=args.seq * (args.vocab // 2) * 4 / 2**20)
    write_json(args.out + ".json", dict(meta=meta, results=results), indent=1)
    _write(meta, results, args.out)


def _base_env(base_tree, env):
    """``env`` with --base-tree's python/ first on PYTHONPATH."""
    return dict(env, PYTHONPATH=os.pathsep.join([os.path.join(os.path.abspath(base_tree), "python"),
                                                 *filter(None, [env.get("PYTHONPATH")])]))


def _table(meta, results):
    rows = []
    with_metrics = all("metrics" in res for per_recipe in results.values() for res in per_recipe.values()
                       if "error" not in res)  # (a run recorded before they were: its table re-renders as it was)
    for recipe in next(iter(results.values())):
        ran = [mode for mode, per_recipe in results.items() if "error" not in per_recipe[recipe]]
        for mode, per_recipe in results.items():
            res = per_recipe[recipe]
            if "error" in res:
                rows.append([recipe.upper(), MODES[mode], "fails: " + res["error"].split(": ", 1)[-1], "-", "-", "-"]
                            + ["-"] * with_metrics)
                continue
            first = results[ran[0]][recipe]["losses"][0]
            vs = "-" if mode == ran[0] else f"{res['losses'][0] - first:+.1e}"
            peak = " / ".join(f"{p / 2**20:,.0f}" for p in res["peak_bytes"])
            rows.append([recipe.upper(), MODES[mode], f"{peak} MiB", f"{res['step_s']:.1f} s", f"{res['losses'][0]:.6f}",
                         vs])
            if with_metrics:
                rows[-1].append("-" if mode == ran[0] else
                                _metrics_against(res["metrics"][0], results[ran[0]][recipe]["metrics"][0]))
    title = (f"twinkle-kit 0.5.1's Megatron recipes, one training step (`forward_backward` + `clip_grad_and_step`), "
             f"LoRA r = 8, twinkle's Ray mode, TP = 2 in 2 CPU workers (1 thread each), a Qwen3 of V = {meta['vocab']}, "
             f"H = {meta['hidden']}, {meta['layers']} layers, fp32; 2 micro-batches of one {meta['seq']}-token sequence "
             f"({meta['prompt']} prompt tokens); GKD: top-{meta['k']} teacher. One micro-batch's logits shard: "
             f"{meta['one_micro_batch_logits_shard_mib']:,.0f} MiB per worker. The loss of the first step (the same "
             f"weights in every row) against the recipe's first row that ran")
    header = ["recipe", "TWINKLE_MEM_INSTALL", "peak RSS rise per worker (TP rank 0 / 1)", "step time",
              "loss (first step)", "vs first row"] + ["twinkle's metrics (first step) vs first row"] * with_metrics
    line = ran_line(meta)  # (none in a run recorded before it: its table re-renders as it was)
    return title + "\n\n" + markdown_table(header, rows, "llrrrr" + "l" * with_metrics) + (f"\n{line}\n" if line else "")


def _write(meta, results, stem):
    """The table (printed, and to stem.md) and the figure (stem.png): peak memory per worker and step time."""
    table = _table(meta, results)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table, end="")
    recipes = list(next(iter(results.values())))
    series = {MODES[mode].strip("`"): ([max(per_recipe[r].get("peak_bytes", [0])) / 2**20 for r in recipes],
                                       [per_recipe[r].get("step_s", 0) for r in recipes])
              for mode, per_recipe in results.items()}
    peak_and_time_figure([r.upper() for r in recipes], series, meta["one_micro_batch_logits_shard_mib"],
                         f"twinkle-kit Megatron recipes, one LoRA step, TP = 2 in 2 Ray workers, V = {meta['vocab']}, "
                         f"S = {meta['seq']} x 2, fp32, CPU (no bar: the step fails)", stem + ".png",
                         peak_label="peak RSS rise, larger worker (MiB)")


if __name__ == "__main__":
    main()
