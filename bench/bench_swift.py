"""One GRPO step of ms-swift with and without twinkle-mem: per-process peak memory and step time, 2 CPU processes.

    python bench/bench_swift.py                      # writes bench/results/local/swift.*
    python bench/bench_swift.py --out bench/results/swift   # the recorded result
    python bench/bench_swift.py --out bench/results/swift --replot   # its PNG from its JSON

Needs ms-swift 4.6, megatron-core and mcore-bridge (``pip install ".[ms-swift,test-swift]"``; the Liger row also
liger-kernel). Each case is a fresh world of ``--workers`` processes (1 thread each), so that each one's peak is its
own. Both engines train a one-layer Qwen2 of hidden ``--hidden`` and 512 positions (standins/swift_cpu.py) on
micro-batches of ``--sequences`` padded sequences: ms-swift stops each completion at the model's 512 positions less its
prompt (about 70 tokens), so at the defaults a micro-batch is 8 x 512 = ``--tokens`` tokens (the table prints what
ran):

- transformers path (DP = 2, the processes as torchrun starts them, gloo): ms-swift's own GRPO through ``rlhf_main``
  (ms-swift's HF generation as the rollout, a reward that varies), one micro-batch per process, beta 0.04 (the
  reference model's log-probs too), T = 0.7; the second optimizer step measured (``GRPOTrainer.training_step``), the
  rollout in it (``_rollout_samples``) apart. Paths: ms-swift as shipped (TRL's ``selective_log_softmax`` on the
  completions' [tokens, V] logits), its Liger path (``use_liger_kernel``: Liger's chunked GRPO loss from the last
  hidden state; the reference log-probs stay on the logits path), and twinkle-mem's plugin (``--external_plugins``:
  every log-prob from the LM head's input).
- Megatron (TP = 2, the processes under torchrun's variables, gloo): Megatron-SWIFT's own GRPO through
  ``megatron_rlhf_main`` (the CPU stand-ins of standins/swift_megatron.py: the same Qwen2 built by mcore_bridge, vLLM's
  rollout by ms-swift's transformers generation given the trained weights at every step), 2 micro-batches per step
  (``--sequences`` prompts of 2 completions: Megatron-SWIFT wants the prompts per step a multiple of the micro-batch),
  beta 0.04, T = 0.7; the second step measured (``train_step``), the rollout in it (``_generate_completions``, with
  the weights' export to it) apart. Paths: Megatron-SWIFT as shipped (``compute_logps_and_entropy_from_logits`` on
  the output layer's [tokens, V / TP] logits shard), on twinkle-mem's op from that shard
  (``TWINKLE_MEM_SWIFT=fused_lm_head=0``: ``megatron_logits_path``), and twinkle-mem's plugin (``megatron_fused_head``:
  from the output layer's input, no logits shard); without the entropy (GRPO's default) and with it
  (``log_entropy``, ``top_entropy_quantile``).

Per process (``StepMeter``), fp32: the rollout's peak (the rise of the resident-set high-water mark over the RSS at
its start, twinkle_mem.measure) and time; the step's peak after the rollout (the old and reference log-probs, the loss,
its backward and the optimizer step: the mark reset when the rollout returns, its rise over the RSS then, read when the
step returns) and the whole step's time; the garbage dropped before each reset (a full collection and glibc's trim,
their time left out). The processes run with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, as
the memory tests' children), so that every tensor gets fresh pages and gives them back when freed: with glibc's
moving threshold the rollout's per-token logits stay in its heap, and the peaks depend on what it kept (measured: a
logits shard apart between the ranks of one case). The times include those page faults. The table shows the largest
process's peaks and the slowest one's times, the JSON every process's, with one process's fp32 logits of the step's
last micro-batch.
"""
import os
import subprocess
import sys
import tempfile
import time

from bench_common import (MachineLoad, Progress, check_twinkle_mem, chosen_cases, markdown_table, measured,
                          peak_and_time_figure, read_json, replot, twinkle_mem_ran, world_parser, write_json,
                          write_world_results)

CASES = {
    "shipped": "transformers, DP = 2: ms-swift 4.6 as shipped",
    "liger": "transformers, DP = 2: ms-swift's Liger path (use_liger_kernel)",
    "twinkle": "transformers, DP = 2: twinkle-mem's plugin",
    "megatron_shipped": "Megatron TP = 2: Megatron-SWIFT 4.6 as shipped",
    "megatron_op": "Megatron TP = 2: on twinkle-mem's op from the logits shard (fused_lm_head=0)",
    "megatron_twinkle": "Megatron TP = 2: twinkle-mem's plugin (the output layer's input)",
    "megatron_entropy_shipped": "Megatron TP = 2: with the entropy, as shipped",
    "megatron_entropy_twinkle": "Megatron TP = 2: with the entropy, twinkle-mem's plugin",
}
SHORT = {"shipped": "DP=2\nas shipped", "liger": "DP=2\nLiger", "twinkle": "DP=2\ntwinkle-mem",
         "megatron_shipped": "TP=2\nas shipped", "megatron_op": "TP=2\nop", "megatron_twinkle": "TP=2\ntwinkle-mem",
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
class StepMeter:
    """The measured steps of one process: each call of the step method (``step(original)`` wraps it) and of the
    rollout it calls (``rollout(original)``), apart. The rollout: its peak RSS rise over the RSS at its start, and its
    time. The step after the rollout (the old and reference log-probs, the loss, its backward and the optimizer step):
    the high-water mark reset when the rollout returns and read when the step returns, its rise over the RSS when the
    rollout returned (``after_rollout``: what the step adds to what the rollout left); and the step's whole time.

    Before each reset the process drops its garbage (``settle``: a full ``gc.collect()``, then glibc's
    ``malloc_trim``), so that memory left unreferenced or freed but resident before a part does not hide the part's
    own: Python frees a reference cycle whenever its collector runs, perhaps in the middle of the next part, whose new
    memory then takes its pages; glibc keeps freed blocks below its mmap threshold resident. ``garbage_mib``: the RSS
    each settle gave back; its time is left out of the step's. One record per step in ``records``; a step must call
    one rollout."""

    def __init__(self):
        self.records = []
        self._rollouts, self._after_rollout, self._settled = [], None, []

    def _settle(self):
        import ctypes
        import gc
        from twinkle_mem.measure import proc_status_bytes
        started, before = time.perf_counter(), proc_status_bytes("VmRSS")
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self._settled.append(((before - proc_status_bytes("VmRSS")) / 2**20, time.perf_counter() - started))

    def step(self, original):
        def wrapper(trainer, *a, **k):
            self._rollouts, self._after_rollout, self._settled = [], None, []
            started = time.perf_counter()
            result = original(trainer, *a, **k)
            seconds = time.perf_counter() - started - sum(t for _, t in self._settled)
            if len(self._rollouts) != 1:
                raise RuntimeError(f"the step called {len(self._rollouts)} rollouts: its measure expects 1")
            self._after_rollout.__exit__(None, None, None)
            self.records.append(dict(seconds=round(seconds, 2), rollout=self._rollouts[0],
                                     after_rollout=self._after_rollout.record(),
                                     garbage_mib=[round(mib, 1) for mib, _ in self._settled]))
            return result
        return wrapper

    def rollout(self, original):
        def wrapper(trainer, *a, **k):
            self._settle()
            with measured() as m:
                result = original(trainer, *a, **k)
            self._rollouts.append(m.record())
            self._settle()
            self._after_rollout = measured().__enter__()  # the mark reset: from here the step's part after it
            return result
        return wrapper


def recording(original, into, shape):
    """``original`` (a method given a micro-batch) recording into ``into`` what ``shape`` (given its arguments) says
    of that micro-batch: its sequences, tokens, and the rows of logits the model's forward builds for it."""
    def wrapper(trainer, *a, **k):
        into.update(shape(*a, **k))
        return original(trainer, *a, **k)
    return wrapper


def with_plugin(arguments, case):
    if case.endswith("twinkle") or case.endswith("op"):
        from twinkle_mem.integrations.swift import PLUGIN
        arguments["external_plugins"] = [*arguments["external_plugins"], PLUGIN]
    return arguments


def transformers_worker(args, case):
    """ms-swift's GRPO for 2 steps (the first a warm-up); the second's training_step and rollout measured."""
    from standins import swift_cpu
    from swift.arguments import RLHFArguments
    from swift.pipelines import rlhf_main
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
    os.environ.update(swift_cpu.OFFLINE)
    meter, shape = StepMeter(), {}
    GRPOTrainer.training_step = meter.step(GRPOTrainer.training_step)
    GRPOTrainer._rollout_samples = meter.rollout(GRPOTrainer._rollout_samples)
    GRPOTrainer._get_per_token_logps_and_entropies = recording(  # (the logits of the completions' tokens only)
        GRPOTrainer._get_per_token_logps_and_entropies, shape, lambda model, inputs, batch, *a, **k: dict(
            sequences=inputs["input_ids"].shape[0], tokens=inputs["input_ids"].numel(),
            logit_rows=inputs["input_ids"].shape[0] * (batch.logits_to_keep + 1)))
    model = os.path.join(args.folder, "model")
    # (the model's 512 positions stop the completions first at the defaults: see the module's docstring)
    completion = args.tokens // args.sequences - 30
    arguments = swift_cpu.grpo_arguments(args.folder, model, max_steps=2, num_generations=args.sequences,
                                         per_device_train_batch_size=args.sequences, max_completion_length=completion,
                                         temperature=TEMPERATURE, use_liger_kernel=case == "liger", logging_steps=1,
                                         output_dir=os.path.join(args.folder, f"out{args.rank}"))
    result = rlhf_main(RLHFArguments(**with_plugin(arguments, case)))
    logged = [e for e in result["log_history"] if "loss" in e]
    return dict(step=meter.records[-1], micro_batch=shape, loss=logged[-1]["loss"],
                completion_tokens=logged[-1]["completions/mean_length"])


def megatron_worker(args, case):
    """Megatron-SWIFT's GRPO for 2 steps at TP = ``--workers`` (the first a warm-up); the second's train_step and
    rollout measured. The entropy in the ``_entropy_`` cases (ms-swift computes it for ``log_entropy`` and
    ``top_entropy_quantile``)."""
    import json
    from standins import swift_cpu, swift_megatron
    os.environ.update(swift_cpu.OFFLINE)
    meter, shape = StepMeter(), {}
    sequences = args.sequences
    entropy = dict(log_entropy=True, top_entropy_quantile=0.5) if "_entropy_" in case else {}
    arguments = swift_megatron.megatron_grpo_arguments(
        args.folder, os.path.join(args.folder, "model"), tensor_model_parallel_size=args.workers, train_iters=2,
        micro_batch_size=sequences, global_batch_size=2 * sequences, num_generations=2,
        max_completion_length=args.tokens // sequences - 30, temperature=TEMPERATURE,
        output_dir=os.path.join(args.folder, f"megatron_{case}"), **entropy)
    with swift_megatron.megatron_swift_on_cpu():  # (before ms-swift's Megatron modules: they import mcore_bridge)
        from swift.megatron.arguments import MegatronRLHFArguments
        from swift.megatron.pipelines.train.rlhf import megatron_rlhf_main
        from swift.megatron.trainers.grpo_trainer import MegatronGRPOTrainer
        MegatronGRPOTrainer.train_step = meter.step(MegatronGRPOTrainer.train_step)
        MegatronGRPOTrainer._generate_completions = meter.rollout(MegatronGRPOTrainer._generate_completions)
        MegatronGRPOTrainer._maybe_compute_logps = recording(  # (the output layer's logits of every token)
            MegatronGRPOTrainer._maybe_compute_logps, shape, lambda batch, *a, **k: dict(
                sequences=batch["input_ids"].shape[0], tokens=batch["input_ids"].numel(),
                logit_rows=batch["input_ids"].numel()))
        result = megatron_rlhf_main(MegatronRLHFArguments(**with_plugin(arguments, case)))
    logging = os.path.join(os.path.dirname(result["last_model_checkpoint"]), "logging.jsonl")
    logged = []
    if os.path.exists(logging):  # (the last rank writes it)
        with open(logging) as f:
            logged = [e for e in map(json.loads, f) if "loss" in e]
    return dict(step=meter.records[-1], micro_batch=shape, loss=logged[-1]["loss"] if logged else None,
                completion_tokens=logged[-1]["completions/mean_length"] if logged else None)


def child(args) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if args.child.startswith("megatron"):
        dist.init_process_group("gloo", rank=args.rank, world_size=args.workers)  # (ms-swift destroys it)
        result = megatron_worker(args, args.child)
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
    if case == "megatron_op":  # the plugin's install() without the fused head
        env["TWINKLE_MEM_SWIFT"] = "fused_lm_head=0"
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", WORLD_SIZE=str(args.workers),
               LOCAL_WORLD_SIZE=str(args.workers), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MALLOC_MMAP_THRESHOLD_="65536")  # (every block of 64 KiB or more fresh pages, given back when freed)
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


def summarize(case, records, vocab) -> dict:
    """The case's row: the largest process peaks (the step's after the rollout, the rollout's) and the slowest process
    times; one process's fp32 logits of the measured step's last micro-batch (under TP its vocab shard)."""
    shards = len(records) if case.startswith("megatron") else 1
    row = {"case": case, "label": CASES[case], "workers": records,
           "peak_mib": max(r["step"]["after_rollout"]["peak_mib"] for r in records),
           "rollout_peak_mib": max(r["step"]["rollout"]["peak_mib"] for r in records),
           "seconds": max(r["step"]["seconds"] for r in records),
           "rollout_seconds": max(r["step"]["rollout"]["seconds"] for r in records),
           "logits_mib": max(r["micro_batch"]["logit_rows"] for r in records) * vocab // shards * 4 / 2**20}
    logged = next(r for r in records if r["loss"] is not None)  # (Megatron: the last rank logs)
    row.update(loss=logged["loss"], completion_tokens=logged["completion_tokens"])
    return row


def table(rows) -> str:
    def cells(row):
        loaded = "yes" if row["workers"][0]["twinkle_mem_installed"] else "no"
        tokens = row["workers"][0]["micro_batch"]
        return [row["label"].split(": ", 1)[1], f"{row['peak_mib']:,.0f} MiB", f"{row['rollout_peak_mib']:,.0f} MiB",
                f"{row['seconds']:.1f} s", f"{row['rollout_seconds']:.1f} s",
                f"{row['seconds'] - row['rollout_seconds']:.1f} s",
                f"{row['logits_mib']:,.0f} MiB ({tokens['sequences']} x {tokens['tokens'] // tokens['sequences']})",
                f"{row['loss']:.6g}", loaded]

    header = ["path", "step peak after the rollout", "rollout peak", "step time", "of which rollout",
              "step without rollout", "fp32 logits (sequences x tokens)", "loss", "twinkle-mem loaded"]
    out = []
    for engine, title in (("transformers", "transformers, 2 processes (DP = 2)"),
                          ("megatron", "Megatron, 2 processes (TP = 2)")):
        chosen = [r for r in rows if r["label"].startswith(engine) or r["case"].startswith(engine)]
        if chosen:
            out.append(f"{title}\n\n" + markdown_table(header, [cells(r) for r in chosen], "lrrrrrrrl"))
    return "\n\n".join(out) + (
        "\n\nPer process: the step's peak after the rollout (the old and reference log-probs, the loss, its backward, "
        "the optimizer step) over the RSS when the rollout returned; the rollout's over the RSS at its start; the "
        "largest process's shown. fp32 logits: one process's of the measured step's last micro-batch (its padded "
        "sequences; on the transformers path the completions' tokens only, under TP = 2 half the vocab).\n")


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
                rows.append(summarize(case, run_case(args, case, folder), args.vocab))
            except RuntimeError as error:
                if case != "liger":
                    raise
                skipped[case] = _last_error(str(error))  # Liger on a CPU: reported as such
                progress.done(f"not run: {skipped[case]}")
                continue
            progress.done(f"peak after the rollout {rows[-1]['peak_mib']:,.0f} MiB, the rollout's "
                          f"{rows[-1]['rollout_peak_mib']:,.0f} MiB, {rows[-1]['seconds']:.1f} s")
    import swift
    text = table(rows)
    text += "".join(f"\n{CASES[c]}: not run ({why})\n" for c, why in skipped.items())
    write_world_results(args, f"ms-swift {swift.__version__}", UNITS, rows, text, figure, sequences=args.sequences,
                        temperature=TEMPERATURE, ms_swift=swift.__version__, skipped=skipped, load=load.record())
    return 0


def figure(rows, meta, path) -> str:
    """Each row's peaks and times: the step after the rollout and the rollout, side by side; a line at each
    engine's fp32 logits of one micro-batch in one process."""
    series = {"step after the rollout": ([r["peak_mib"] for r in rows], [r["seconds"] - r["rollout_seconds"]
                                                                          for r in rows]),
              "rollout": ([r["rollout_peak_mib"] for r in rows], [r["rollout_seconds"] for r in rows])}
    lines = []
    for engine, what, style in (("transformers", "DP: one micro-batch's logits", "--"),
                                ("megatron", "TP: its logits shard", ":")):
        sizes = [r["logits_mib"] for r in rows if r["label"].startswith(engine) or r["case"].startswith(engine)]
        if sizes:
            lines.append((max(sizes), what, style))
    title = (f"ms-swift {meta['ms_swift']} GRPO step, V={meta['vocab']}, {meta['workers']} CPU {UNITS[1]} "
             f"({meta['twinkle_mem_cpu_path']})")
    return peak_and_time_figure([SHORT[r["case"]] for r in rows], series, None, title, path,
                                peak_label=f"largest {UNITS[0]}'s peak RSS rise (MiB)", time_label="time (s)",
                                lines=lines)

if __name__ == "__main__":
    sys.exit(main())
