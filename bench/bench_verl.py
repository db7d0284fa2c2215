"""verl's actor step with and without twinkle-mem: per-worker peak memory and step time, 2 CPU workers.

    python bench/bench_verl.py                     # writes bench/results/local/verl.*
    python bench/bench_verl.py --out bench/results/verl   # the recorded result
    python bench/bench_verl.py --out bench/results/verl --replot   # its PNG from its JSON

Needs verl 0.9.x and megatron-core (``pip install ".[verl,test-verl]"``); runs on the CPU through the stand-ins
of standins/verl_cpu.py (verl's platform and engine registration, gloo). Each case is a fresh world of
``--workers`` processes (gloo, 1 thread each), so that each worker's peak is its own:

- FSDP (verl's FSDP2 engine, DP = 2, built as verl's TrainingWorker builds it): one actor step as verl's
  trainer runs it, ``compute_log_prob`` (TrainingWorker.infer_batch, entropy on) then ``update_actor``
  (TrainingWorker.train_mini_batch: verl's PPO loss with an entropy bonus, an optimizer step), one micro-batch of
  ``--tokens`` tokens per worker, after one warm-up step of the same shapes (verl compiles its entropy function
  there). Paths: verl's default logits path (the [tokens, V] logits), verl's torch fused backend
  (``impl_backend=torch``) and ``impl_backend=twinkle``. verl's own cases run with its plugins off
  (VERL_USE_EXTERNAL_PLUGINS=none). The head is tied: verl's torch backend cannot take the sharded lm_head of an
  untied model under FSDP2 (it fails on "mixed torch.Tensor and DTensor").
- FSDP with LoRA (verl's ``lora_rank``: peft on every linear of the layers, the LM head frozen), the same three
  paths with the actor's ``entropy_coeff`` 0 and 0.01: as verl's trainer runs the update, it keeps the entropy
  (``calculate_entropy``) only where ``entropy_coeff != 0``, and twinkle-mem's head is told so (a frozen head then
  sums no entropy vector in its forward).
- Megatron (TP = 2): a megatron-core GPTModel (hand-built: verl's engine through Megatron-Bridge runs in
  tests/integrations/verl/test_verl_megatron_engine.py, with the stand-ins of standins/verl_megatron.py) through verl's
  own paths, forward and backward of one micro-batch: the logits path (the output layer's logits shard, then
  verl's vocab-parallel entropy and log-probs, as its engine runs them) and the fused forward with
  ``impl_backend=twinkle`` (the engine's own _maybe_enable_fused_kernels marks the output weight).

Per worker: the rise of the resident-set high-water mark over the measured step (twinkle_mem.measure.peak_rss)
and its time, the workers run with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, as
bench/bench_swift.py's do), so that a freed block goes back at once and each worker's peak is its own, not where
glibc's heap happened to keep pages of the step before; the table shows the larger of the workers' peaks and the slower time, the JSON every worker's.
fp32 (bf16 matmuls are ~10x slower than fp32 on an AVX2 CPU), a one-layer Qwen2 / GPT of hidden ``--hidden``.
The table and the JSON name twinkle-mem's backend and CPU kernel path in every worker; the run refuses the composite
fallback (no native library) unless ``--allow-composite``.
"""
import json
import os
import subprocess
import sys
import time

from bench_common import (MachineLoad, Progress, check_twinkle_mem, chosen_cases, logits_mib, markdown_table, measured,
                          replot, step_figure, twinkle_mem_ran, world_parser, write_world_results)

FSDP_PATHS = {"logits": (None, "verl's logits path (default)"), "torch": ("torch", "verl's torch fused backend"),
              "twinkle": ("twinkle", "impl_backend=twinkle")}
LORA_RANK = 8
ENTROPY_COEFFS = {"e0": 0.0, "e001": 0.01}  # the LoRA cases' actor entropy_coeff, by the case's suffix
CASES = {
    "fsdp_logits": "FSDP: verl's logits path (default)",
    "fsdp_torch": "FSDP: verl's torch fused backend",
    "fsdp_twinkle": "FSDP: impl_backend=twinkle",
    **{f"lora_{path}_{suffix}": f"FSDP LoRA: {label}, entropy_coeff = {coeff:g}"
       for path, (_, label) in FSDP_PATHS.items() for suffix, coeff in ENTROPY_COEFFS.items()},
    "megatron_logits": "Megatron TP=2: verl's logits path",
    "megatron_twinkle": "Megatron TP=2: impl_backend=twinkle",
}
SHORT = {"fsdp_logits": "FSDP\nlogits path", "fsdp_torch": "FSDP\ntorch fused", "fsdp_twinkle": "FSDP\ntwinkle",
         "megatron_logits": "Megatron TP=2\nlogits path", "megatron_twinkle": "Megatron TP=2\ntwinkle",
         **{f"lora_{path}_{suffix}": f"LoRA {path}\nentropy {coeff:g}" for path in FSDP_PATHS
            for suffix, coeff in ENTROPY_COEFFS.items()}}
# verl as shipped: its plugins off
VERL_ONLY = ("fsdp_logits", "fsdp_torch", "megatron_logits",
             *(f"lora_{path}_{suffix}" for path in ("logits", "torch") for suffix in ENTROPY_COEFFS))
UNITS = ("worker", "workers")  # a process of a case's world


def parse_args(argv=None):
    import argparse
    parser = world_parser(__doc__, "verl", UNITS, CASES)
    parser.add_argument("--init", help=argparse.SUPPRESS)  # a worker's: its process group's init_method
    return parser.parse_args(argv)


# ------------------------------------------------------------------ a worker (one process of a case's world)
def fsdp_case(case):
    """(verl's impl_backend or None, the LoRA rank, the actor's entropy_coeff) of an FSDP case."""
    if case.startswith("lora_"):
        _, path, suffix = case.split("_")
        return FSDP_PATHS[path][0], LORA_RANK, ENTROPY_COEFFS[suffix]
    return FSDP_PATHS[case[len("fsdp_"):]][0], 0, 0.01


def fsdp_worker(args, case, folder):
    """The FSDP cases: TrainingWorker's infer_batch (compute_log_prob) then train_mini_batch (update_actor)."""
    from functools import partial

    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import (ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig,
                                     TrainingWorkerConfig)
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from standins.verl_cpu import rollout_batch
    backend, lora_rank, entropy_coeff = fsdp_case(case)
    fused = backend is not None
    model_config = HFModelConfig(path=folder, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                                 use_remove_padding=True, use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": backend} if fused else {},
                                 lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    sequences = 2  # per worker: two sequences of tokens / 2, one micro-batch
    engine_config = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_dynamic_bsz=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"},
                                     micro_batch_size_per_gpu=sequences, infer_micro_batch_size_per_gpu=sequences)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                                 engine_config=engine_config,
                                                 optimizer_config=FSDPOptimizerConfig(lr=1e-5),
                                                 checkpoint_config=CheckpointConfig()))
    worker.reset()
    actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=sequences * args.workers,
                        ppo_micro_batch_size_per_gpu=sequences, use_dynamic_bsz=False, entropy_coeff=entropy_coeff,
                        rollout_n=1)
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    half = args.tokens // sequences // 2

    def step(seed):
        data = rollout_batch(seed, batch=sequences, prompt=half, response=half, vocab=args.vocab, full=True)
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, temperature=0.7)
        with measured() as log_prob:
            out = worker.infer_batch(data)
        old = no_padding_2_padding(tu.get(out, "log_probs"), data).float()
        data = rollout_batch(seed, batch=sequences, prompt=half, response=half, vocab=args.vocab, full=True)
        data["old_log_probs"] = old
        # (verl's trainer keeps the entropy in the update where entropy_coeff != 0: ray_trainer._update_actor)
        tu.assign_non_tensor(data, calculate_entropy=entropy_coeff != 0, compute_loss=True, temperature=0.7,
                             global_batch_size=sequences * args.workers, mini_batch_size=sequences * args.workers,
                             epochs=1, seed=seed, dataloader_kwargs={"shuffle": False})
        with measured() as update:
            metrics = tu.get(worker.train_mini_batch(data), "metrics")
        return log_prob, update, {k: float(v[-1] if isinstance(v, list) else v) for k, v in metrics.items()
                                  if k in ("actor/pg_loss", "actor/entropy_loss", "grad_norm")}

    step(0)  # warm-up: the same shapes (verl compiles its entropy function in the logits path)
    log_prob, update, metrics = step(1)
    return dict(compute_log_prob=log_prob, update_actor=update, metrics=metrics)


def megatron_worker(args, case):
    """The Megatron cases, TP = 2: forward and backward of one micro-batch through verl's paths."""
    import types

    import torch
    from megatron.core import parallel_state as mpu

    from standins.megatron import gpt_model, megatron_gpt_cpu
    from standins.verl_cpu import megatron_tp_on_cpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.workers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    labels, positions = torch.roll(ids, -1, -1), torch.arange(args.tokens)[None]
    mask = torch.triu(torch.ones(args.tokens, args.tokens, dtype=torch.bool), 1)[None, None]
    with megatron_gpt_cpu(), megatron_tp_on_cpu():
        model = gpt_model(args.vocab, hidden=args.hidden, heads=2, max_seq=args.tokens, tied=True)
        if case == "megatron_twinkle":
            from verl.workers.engine.megatron.transformer_impl import MegatronEngine
            engine = types.SimpleNamespace(
                engine_config=types.SimpleNamespace(use_fused_kernels=True, use_remove_padding=True),
                is_value_model=False, module=[model],
                model_config=types.SimpleNamespace(fused_kernel_options={"impl_backend": "twinkle"},
                                                   mtp=types.SimpleNamespace(enable=False)))
            MegatronEngine._maybe_enable_fused_kernels(engine)

        def step():
            for p in model.parameters():
                p.grad = None
            if case == "megatron_twinkle":
                out = model(ids, positions, mask, labels=labels, temperature=0.7)
                logp, entropy = out.log_probs, out.entropy
            else:  # verl's Megatron engine on the logits (_lm_head_logits_processor)
                from verl.utils.megatron.tensor_parallel import (vocab_parallel_entropy,
                                                                 vocab_parallel_log_probs_from_logits)
                logits = model(ids, positions, mask)
                logits.div_(0.7)
                logits_copy = logits.clone()
                entropy = vocab_parallel_entropy(logits)
                logp = vocab_parallel_log_probs_from_logits(logits_copy, labels)
            (logp.sum() - 0.01 * entropy.sum()).backward()
            return float(logp.float().sum())

        step()  # warm-up
        with measured() as forward_backward:
            logp_sum = step()
    return dict(forward_backward=forward_backward, metrics={"log_prob_sum": logp_sum})


def child(args) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.workers)
    import verl  # noqa: F401  (with its plugins: twinkle-mem's entry point, unless VERL_USE_EXTERNAL_PLUGINS=none)

    from standins.verl_cpu import cpu_verl, save_tiny_qwen2
    with cpu_verl():
        if not args.child.startswith("megatron"):
            folder = os.path.join(os.path.dirname(args.init[len("file://"):]), "model")  # (the case's temp folder)
            if args.rank == 0:
                save_tiny_qwen2(folder, vocab=args.vocab, hidden=args.hidden, tied=True)
            dist.barrier()
            result = fsdp_worker(args, args.child, folder)
        else:
            result = megatron_worker(args, args.child)
    from twinkle_mem.integrations import verl as integration
    result = {k: (v.record() if isinstance(v, measured) else v) for k, v in result.items()}
    dist.destroy_process_group()
    return {**result, "rank": args.rank, "twinkle_mem_installed": integration.is_installed(),
            "ran": twinkle_mem_ran(where=f"{args.child} rank {args.rank}")}


# ------------------------------------------------------------------ the parent: one world per case
def run_case(args, case) -> list:
    """Run ``case`` in a fresh world of ``--workers`` processes (its own process group each, ended whatever
    happens); returns every worker's record."""
    import tempfile
    env = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_MEM_VERL", "VERL_USE_EXTERNAL_PLUGINS")}
    if case in VERL_ONLY:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(args.workers), OMP_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_="65536")  # (every block of 64 KiB or more fresh pages, given back when freed)
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'store')}"
        procs = []
        for rank in range(args.workers):
            cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", case, "--rank", str(rank),
                   "--init", init, "--vocab", str(args.vocab), "--tokens", str(args.tokens), "--hidden",
                   str(args.hidden), "--workers", str(args.workers)]
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK="0", MASTER_PORT=str(29600 + rank))
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        try:
            outputs = [p.communicate(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.communicate()
    records = []
    for p, (out, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{case}: a worker exited with {p.returncode}:\n{err[-4000:]}")
        records.append(json.loads(out.strip().splitlines()[-1]))
    return records


def phases(case):
    return ("forward_backward", ) if case.startswith("megatron") else ("compute_log_prob", "update_actor")


def summarize(case, records) -> dict:
    """The case's row: per phase, the largest worker peak and the slowest worker time."""
    row = {"case": case, "label": CASES[case], "workers": records}
    for phase in phases(case):
        row[f"{phase}_peak_mib"] = max(r[phase]["peak_mib"] for r in records)
        row[f"{phase}_seconds"] = max(r[phase]["seconds"] for r in records)
    row["peak_mib"] = max(row[f"{p}_peak_mib"] for p in phases(case))
    row["seconds"] = sum(row[f"{p}_seconds"] for p in phases(case))
    return row


def table(rows, logits_mib) -> str:
    """One Markdown table per engine: each phase's peak / time, the step's, and whether twinkle-mem was loaded."""
    def cells(row, phase_names):
        loaded = "yes" if row["workers"][0]["twinkle_mem_installed"] else "no (plugins off)"
        return [row["label"].split(": ", 1)[1],
                *(f"{row[f'{p}_peak_mib']:,.0f} MiB / {row[f'{p}_seconds']:.1f} s" for p in phase_names),
                f"{row['peak_mib']:,.0f} MiB", f"{row['seconds']:.1f} s", loaded]

    out = []
    fsdp_phases = ("compute_log_prob", "update_actor")
    for engine, title, phase_names in (("fsdp", "FSDP2, 2 workers (DP = 2)", fsdp_phases),
                                       ("lora", f"FSDP2 LoRA (rank {LORA_RANK}), 2 workers (DP = 2)", fsdp_phases),
                                       ("megatron", "Megatron, 2 workers (TP = 2)", ("forward_backward", ))):
        chosen = [r for r in rows if r["case"].startswith(engine)]
        if chosen:
            header = [title, *(f"{p}: peak / time" for p in phase_names), "peak", "time", "twinkle-mem loaded"]
            out.append(markdown_table(header, [cells(r, phase_names) for r in chosen],
                                      "l" + "r" * (len(phase_names) + 2) + "l"))
    return "\n".join(out) + (f"\nOne worker's fp32 logits of one micro-batch: {logits_mib:,.0f} MiB "
                             "(under TP = 2 each worker holds half of them).\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if replot(args, figure):
        return 0
    check_twinkle_mem(args.allow_composite)  # the workers import the same twinkle_mem
    cases = chosen_cases(args.cases, CASES)
    load, progress, rows = MachineLoad(), Progress(len(cases)), []
    for case in cases:
        progress.step(CASES[case])
        rows.append(summarize(case, run_case(args, case)))
        progress.done(f"peak {rows[-1]['peak_mib']:,.0f} MiB, {rows[-1]['seconds']:.1f} s")
    rows.sort(key=lambda row: list(CASES).index(row["case"]))  # the tables' order, whatever order they ran in
    import verl
    write_world_results(args, f"verl {verl.__version__}", UNITS, rows, table(rows, logits_mib(args)), figure,
                        temperature=0.7, verl=verl.__version__, load=load.record())
    return 0


def figure(rows, meta, path) -> str:
    return step_figure(rows, meta, SHORT, f"verl {meta['verl']} actor step", UNITS, path)


if __name__ == "__main__":
    sys.exit(main())
