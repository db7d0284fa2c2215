"""One GRPO step of ms-swift with and without twinkle-mem: per-process peak memory and step time, 2 CPU processes.

    python bench/bench_swift.py                      # writes bench/results/local/swift.*
    python bench/bench_swift.py --out bench/results/swift   # the recorded result
    python bench/bench_swift.py --out bench/results/swift --replot   # its PNG from its JSON

Needs ms-swift 4.6 and megatron-core (``pip install ".[ms-swift,test-swift]"``; the Liger row also liger-kernel).
Each case is a fresh world of ``--workers`` processes (1 thread each), so that each one's peak is its own:

- transformers path (DP = 2, the processes as torchrun starts them, gloo): ms-swift's own GRPO through
  ``rlhf_main`` (the CPU stand-ins of standins/swift_cpu.py: a one-layer Qwen2 of hidden ``--hidden``, ms-swift's HF
  generation as the rollout, a reward that varies), one micro-batch of ``--tokens`` tokens per process
  (``--sequences`` sequences, their completions as long as that leaves), beta 0.04 (the reference model's log-probs
  too), T = 0.7; the second optimizer step measured (``GRPOTrainer.training_step``: the rollout, the reference's
  log-probs, the loss, its backward and the step), the rollout's own time (``_rollout_samples``) shown apart. Paths:
  ms-swift as shipped (TRL's ``selective_log_softmax`` on the [tokens, V] logits), its Liger path
  (``use_liger_kernel``: Liger's chunked GRPO loss from the last hidden state; the reference log-probs stay on the
  logits path), and twinkle-mem's plugin (``--external_plugins``: every log-prob from the LM head's input).
- Megatron (TP = 2): Megatron-SWIFT's trainer needs Transformer Engine (through mcore-bridge), so its log-prob
  function is measured alone, as its GRPO ``forward_step`` calls it: the output layer's logits shard (a matmul of
  the hidden states with this rank's vocab shard of the weight, divided by T), then
  ``compute_logps_and_entropy_from_logits`` as ms-swift ships it or on twinkle-mem's op (``megatron_logits_path``,
  installed), its backward to the hidden states and the weight; without the entropy (GRPO's default) and with it
  (``log_entropy``, ``top_entropy_quantile``).

Per process: the rise of the resident-set high-water mark over the measured step (twinkle_mem.measure.peak_rss) and
its time; the table shows the larger peak and the slower time, the JSON every process's. fp32.
"""
import os
import subprocess
import sys
import tempfile

from bench_common import (MachineLoad, Progress, check_twinkle_mem, chosen_cases, logits_mib, markdown_table, measured,
                          read_json, replot, step_figure, twinkle_mem_ran, world_parser, write_json,
                          write_world_results)

CASES = {
    "shipped": "transformers, DP = 2: ms-swift 4.6 as shipped",
    "liger": "transformers, DP = 2: ms-swift's Liger path (use_liger_kernel)",
    "twinkle": "transformers, DP = 2: twinkle-mem's plugin",
    "megatron_shipped": "Megatron TP = 2: Megatron-SWIFT's log-probs as shipped",
    "megatron_twinkle": "Megatron TP = 2: on twinkle-mem's op (megatron_logits_path)",
    "megatron_entropy_shipped": "Megatron TP = 2: log-probs and entropy as shipped",
    "megatron_entropy_twinkle": "Megatron TP = 2: log-probs and entropy on twinkle-mem's op",
}
SHORT = {"shipped": "DP=2\nas shipped", "liger": "DP=2\nLiger", "twinkle": "DP=2\ntwinkle-mem",
         "megatron_shipped": "TP=2\nas shipped", "megatron_twinkle": "TP=2\ntwinkle-mem",
         "megatron_entropy_shipped": "TP=2+H\nas shipped", "megatron_entropy_twinkle": "TP=2+H\ntwinkle-mem"}
TEMPERATURE = 0.7
UNITS = ("process", "processes")  # of a case's world


def parse_args(argv=None):
    import argparse
    parser = world_parser(__doc__, "swift", UNITS, CASES)
    parser.add_argument("--sequences", type=int, default=8, help="sequences per micro-batch (transformers path)")
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # a process's: the case's folder (the model, records)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ a process of a case
def transformers_worker(args, case):
    """ms-swift's GRPO for 2 steps (the first a warm-up); the second's training_step and rollout measured."""
    from standins import swift_cpu
    from swift.arguments import RLHFArguments
    from swift.pipelines import rlhf_main
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
    os.environ.update(swift_cpu.OFFLINE)
    steps, rollouts = [], []

    def timed(original, into):
        def wrapper(self, *a, **k):
            with measured() as m:
                result = original(self, *a, **k)
            into.append(m.record())
            return result
        return wrapper

    GRPOTrainer.training_step = timed(GRPOTrainer.training_step, steps)
    GRPOTrainer._rollout_samples = timed(GRPOTrainer._rollout_samples, rollouts)
    model = os.path.join(args.folder, "model")
    # a prompt of 4 words is about 30 tokens with ms-swift's qwen template: the completions fill the rest
    completion = args.tokens // args.sequences - 30
    arguments = swift_cpu.grpo_arguments(args.folder, model, max_steps=2, num_generations=args.sequences,
                                         per_device_train_batch_size=args.sequences, max_completion_length=completion,
                                         temperature=TEMPERATURE, use_liger_kernel=case == "liger", logging_steps=1,
                                         output_dir=os.path.join(args.folder, f"out{args.rank}"))
    if case == "twinkle":
        from twinkle_mem.integrations.swift import PLUGIN
        arguments["external_plugins"] = [*arguments["external_plugins"], PLUGIN]
    result = rlhf_main(RLHFArguments(**arguments))
    logged = [e for e in result["log_history"] if "loss" in e]
    return dict(step=steps[-1], rollout=rollouts[-1], loss=logged[-1]["loss"],
                completion_tokens=logged[-1]["completions/mean_length"])


def megatron_worker(args, case):
    """Megatron-SWIFT's log-probs (and entropy, in the ``_entropy_`` cases: ms-swift computes it for ``log_entropy``
    and ``top_entropy_quantile``) of one micro-batch from the output layer's logits shard, forward and backward."""
    import torch
    from megatron.core import parallel_state
    from swift.megatron.trainers import vocab_parallel_utils
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.workers)
    if case.endswith("twinkle"):
        from twinkle_mem.integrations import swift as integration
        integration.install(fused_lm_head=False)  # (megatron_logits_path: the function below is the op's)
    entropy = "_entropy_" in case
    g = torch.Generator().manual_seed(0)
    shard = args.vocab // args.workers
    hidden = torch.randn(1, args.tokens, args.hidden, generator=g, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5)[
        args.rank * shard:(args.rank + 1) * shard].clone().requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=g)

    def step():
        logits = hidden @ weight.t()  # the output layer's logits shard, [1, tokens, V / TP]
        logits.div_(TEMPERATURE)
        logps, per_token_entropy = vocab_parallel_utils.compute_logps_and_entropy_from_logits(
            logits, labels, compute_entropy=entropy)
        (logps.sum() + (per_token_entropy.sum() if entropy else 0)).backward()
        return logps.detach().sum().item()

    step()  # warm-up
    hidden.grad = weight.grad = None
    with measured() as m:
        total = step()
    parallel_state.destroy_model_parallel()
    return dict(step=m.record(), logp_sum=total)


def child(args) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if args.child.startswith("megatron"):
        dist.init_process_group("gloo", rank=args.rank, world_size=args.workers)
        result = megatron_worker(args, args.child)
        dist.destroy_process_group()
    else:
        result = transformers_worker(args, args.child)  # (ms-swift makes the process group from the environment)
    from twinkle_mem.integrations import swift as integration
    return {**result, "rank": args.rank, "twinkle_mem_installed": integration.is_installed(),
            "ran": twinkle_mem_ran(where=f"{args.child} rank {args.rank}")}


# ------------------------------------------------------------------ the parent: one world per case
def run_case(args, case, folder) -> list:
    """Run ``case`` in a fresh world of ``--workers`` processes (each its own process group, ended whatever
    happens); returns every process's record."""
    env = {k: v for k, v in os.environ.items() if k != "TWINKLE_MEM_SWIFT"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", WORLD_SIZE=str(args.workers),
               LOCAL_WORLD_SIZE=str(args.workers), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    procs = []
    for rank in range(args.workers):
        cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", case, "--rank", str(rank),
               "--folder", folder, "--vocab", str(args.vocab), "--tokens", str(args.tokens), "--sequences",
               str(args.sequences), "--hidden", str(args.hidden), "--workers", str(args.workers)]
        record = os.path.join(folder, f"{case}.rank{rank}.json")
        procs.append((subprocess.Popen(cmd + ["--out", record], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True), record))
    try:
        errors = [p.communicate(timeout=args.timeout)[1] for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.communicate()
    for (p, _), err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"{case}: a process exited with {p.returncode}:\n{err[-4000:]}")
    return [read_json(record) for _, record in procs]


def _last_error(text: str) -> str:
    """The last line of a traceback that names an exception."""
    lines = [line for line in text.splitlines() if "Error" in line or "Exception" in line]
    return lines[-1].strip() if lines else text.splitlines()[-1]


def summarize(case, records) -> dict:
    """The case's row: the largest process peak and the slowest process time (the rollout's apart)."""
    row = {"case": case, "label": CASES[case], "workers": records,
           "peak_mib": max(r["step"]["peak_mib"] for r in records),
           "seconds": max(r["step"]["seconds"] for r in records)}
    if "rollout" in records[0]:
        row["rollout_seconds"] = max(r["rollout"]["seconds"] for r in records)
        row["loss"] = records[0]["loss"]
        row["completion_tokens"] = records[0]["completion_tokens"]
    return row


def table(rows, logits_mib) -> str:
    def cells(row):
        loaded = "yes" if row["workers"][0]["twinkle_mem_installed"] else "no"
        if row["case"].startswith("megatron"):
            extra = ["", "", f"{row['workers'][0]['logp_sum']:.4f}"]
        else:
            extra = [f"{row['rollout_seconds']:.1f} s", f"{row['seconds'] - row['rollout_seconds']:.1f} s",
                     f"{row['loss']:.6g}"]
        return [row["label"].split(": ", 1)[1], f"{row['peak_mib']:,.0f} MiB", f"{row['seconds']:.1f} s", *extra,
                loaded]

    header = ["path", "step peak", "step time", "of which rollout", "step without rollout", "loss (rank 0's log-prob "
              "sum at TP = 2)", "twinkle-mem loaded"]
    out = []
    for engine, title in (("transformers", "transformers, 2 processes (DP = 2)"),
                          ("megatron", "Megatron, 2 processes (TP = 2)")):
        chosen = [r for r in rows if r["label"].startswith(engine) or r["case"].startswith(engine)]
        if chosen:
            out.append(f"{title}\n\n" + markdown_table(header, [cells(r) for r in chosen], "lrrrrrl"))
    return "\n\n".join(out) + (f"\n\nOne process's fp32 logits of one micro-batch: {logits_mib:,.0f} MiB (under TP = 2 "
                               "each process holds half of them).\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        write_json(args.out, child(args))
        return 0
    if replot(args, figure):
        return 0
    check_twinkle_mem(args.allow_composite)  # the processes import the same twinkle_mem
    cases = chosen_cases(args.cases, CASES)
    from standins import swift_cpu
    load, progress, rows, skipped = MachineLoad(), Progress(len(cases)), [], {}
    with tempfile.TemporaryDirectory() as folder:
        swift_cpu.save_tiny_qwen2(os.path.join(folder, "model"), vocab=args.vocab, hidden=args.hidden, layers=1)
        for case in cases:
            progress.step(CASES[case])
            try:
                rows.append(summarize(case, run_case(args, case, folder)))
            except RuntimeError as error:
                if case != "liger":
                    raise
                skipped[case] = _last_error(str(error))  # Liger on a CPU: reported as such
                progress.done(f"not run: {skipped[case]}")
                continue
            progress.done(f"peak {rows[-1]['peak_mib']:,.0f} MiB, {rows[-1]['seconds']:.1f} s")
    import swift
    text = table(rows, logits_mib(args))
    text += "".join(f"\n{CASES[c]}: not run ({why})\n" for c, why in skipped.items())
    write_world_results(args, f"ms-swift {swift.__version__}", UNITS, rows, text, figure, sequences=args.sequences,
                        temperature=TEMPERATURE, ms_swift=swift.__version__, skipped=skipped, load=load.record())
    return 0


def figure(rows, meta, path) -> str:
    return step_figure(rows, meta, SHORT, f"ms-swift {meta['ms_swift']} GRPO step", UNITS, path)


if __name__ == "__main__":
    sys.exit(main())
