"""verl's own forward of a Qwen2.5-1.5B-shaped model on one device, per head path: peak memory and time.

    python bench/bench_verl_forward.py                 # a GPU: Qwen2.5-1.5B's config, random weights, 16384 tokens
    python bench/bench_verl_forward.py --paths logits,twinkle --batch 8 --seq 2048
    python bench/bench_verl_forward.py --dry-run       # here, on the CPU: a tiny config, the script's logic

Issue 51, point 4. The model is built from Qwen2.5-1.5B's config (28 layers, H 1536, V 151936, tied embeddings;
--dtype bf16, random weights from one seed: the same in every path) with torch's sdpa attention, then goes through
verl's ``apply_monkey_patch`` as verl's FSDP engine applies it (``use_remove_padding``, ``use_fused_kernels``), on one
device, no Ray cluster, no FSDP. Paths:

- ``logits``: verl's logits path (``use_fused_kernels=False``): the model's [tokens, V] logits, then the engine's
  entropy (``torch.compile(verl.utils.torch_functional.entropy_from_logits, dynamic=True)``) and
  ``logprobs_from_logits``;
- ``torch``, ``triton``: verl's fused forward with its ``impl_backend`` (FusedLinearForPPO; its Triton kernel);
- ``twinkle``: ``impl_backend=twinkle`` (twinkle-mem's verl integration, installed in that process as the
  ``verl.plugins`` entry point would; verl's own paths run with verl's plugins off, as shipped).

Each path in a fresh process (its own peak): --batch sequences of --seq tokens (16 x 1024 = 16384), a forward and
a backward of the log-probs with a random per-token upstream gradient (the entropy computed as a metric, verl's
default entropy_coeff = 0; --entropy-grad adds its gradient), then a forward under no_grad (compute_log_prob).
After one warm-up of each (compilation, autotuning), --reps timed calls of each (median); the peak of the device
allocator over one call of each, beyond what was allocated before it (the model and the inputs). The log-probs of
the first and last tokens are compared with the logits path's. A path that cannot run (the Triton kernel off CUDA, a
module missing) says why in its row. Where verl or a module its import needs is missing, the run is refused with one
sentence naming them (bench/verl_import.py: Ray alone is stood in for). Writes OUT.json, OUT.md, OUT.png (--out,
default bench/results/local/verl_forward); progress on stderr.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_common import (ChildFailed, Progress, add_allow_composite, check_twinkle_mem, local_out, markdown_table,
                          parse_or_answer_child, peak_and_time_figure, ran_line, run_config, run_metadata, split_names,
                          write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = {
    "logits": "verl's logits path (use_fused_kernels=False)",
    "torch": "verl's fused forward, impl_backend=torch",
    "triton": "verl's fused forward, impl_backend=triton",
    "twinkle": "verl's fused forward, impl_backend=twinkle",
}
# Qwen2.5-1.5B's config.json (the architecture alone; the weights are random)
QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
EDGE = 4  # tokens compared with the logits path at each end
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


# ------------------------------------------------------------------ one path (a child process)
def child(cfg: dict) -> dict:
    import torch

    from verl_import import import_verl
    note = import_verl()
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    path, device = cfg["path"], torch.device(cfg["device"])
    if path == "triton" and device.type != "cuda":
        return {"status": "cannot run: verl's Triton kernel runs on CUDA only", "note": note}
    if path == "twinkle":
        from twinkle_mem.integrations import verl as integration
        if not integration.is_installed():  # (the entry point installs it where twinkle-mem is pip-installed)
            integration.install()
        if integration.refused():
            return {"status": f"cannot run: twinkle-mem's integration refused {integration.refused()}", "note": note}
    accel = getattr(torch, device.type) if device.type in ("cuda", "npu") else None
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    config = Qwen2Config(**cfg["model"], attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config).to(dtype)
    fused = path != "logits"
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=fused,
                       fused_kernels_backend=path if fused else None)
    if fused and not (path == "twinkle") == hasattr(type(model).forward, "__wrapped__"):
        return {"status": f"cannot run: apply_monkey_patch did not give the {path} forward", "note": note}

    gen = torch.Generator().manual_seed(1)
    batch, seq = cfg["batch"], cfg["seq"]
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    position_ids = torch.arange(seq, device=device).expand(batch, seq)
    attention_mask = torch.ones_like(input_ids)
    g_logp = torch.randn(batch, seq, generator=gen).to(device)
    g_entropy = torch.randn(batch, seq, generator=gen).to(device)
    entropy_of_logits = None
    if not fused:
        import verl.utils.torch_functional as verl_F
        entropy_of_logits = torch.compile(verl_F.entropy_from_logits, dynamic=True)  # the engine's default

    def log_probs():
        if fused:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        temperature=1.0, return_dict=True)
            return out.log_probs, out.entropy
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits
        labels = torch.roll(input_ids, shifts=-1, dims=-1)
        entropy = entropy_of_logits(logits)
        logp = verl_F.logprobs_from_logits(logits, labels, inplace_backward=False)  # (entropy computed: not in place)
        return logp, entropy

    def train_call():
        model.zero_grad(set_to_none=True)
        logp, entropy = log_probs()
        loss = (logp.float() * g_logp).sum()
        if cfg["entropy_grad"]:
            loss = loss + (entropy.float() * g_entropy).sum()
        loss.backward()
        return logp.detach(), entropy.detach()

    def infer_call():
        with torch.no_grad():
            return log_probs()

    def sync():
        if accel is not None:
            accel.synchronize()

    result = {"status": "ok", "note": note, "params": sum(p.numel() for p in model.parameters())}
    for name, call in (("fwd_bwd", train_call), ("no_grad", infer_call)):
        t0 = time.perf_counter()
        logp, entropy = call()  # warm-up: compilation, autotuning
        sync()
        result[f"{name}_first_s"] = time.perf_counter() - t0
        if name == "no_grad":
            flat = logp.float().flatten()
            result["edge_logp"] = torch.cat([flat[:EDGE], flat[-EDGE:]]).tolist()
            result["logp_dtype"], result["entropy_dtype"] = str(logp.dtype), str(entropy.dtype)
        del logp, entropy
        times = []
        for _ in range(cfg["reps"]):
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        result[f"{name}_ms"] = statistics.median(times) if times else None
        result[f"{name}_times_ms"] = times
        if accel is not None:
            model.zero_grad(set_to_none=True)
            sync()
            accel.reset_peak_memory_stats()
            base = accel.memory_allocated()
            out = call()
            sync()
            result[f"{name}_peak_bytes"] = accel.max_memory_allocated() - base
            result[f"{name}_base_bytes"] = base
            del out
    from bench_common import twinkle_mem_ran
    if path == "twinkle":
        result["ran"] = twinkle_mem_ran(device.type, where="twinkle path")
    return result


# ------------------------------------------------------------------ the parent
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    p.add_argument("--batch", type=int, default=None, help="sequences (default 16; 2 with --dry-run)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; 64 with --dry-run)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--entropy-grad", action="store_true", help="the entropy in the loss too (an entropy bonus)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (a dry run's)")
    p.add_argument("--dry-run", action="store_true", help="the script's logic on the CPU with a tiny config")
    p.add_argument("--timeout", type=int, default=400, help="seconds per path")
    p.add_argument("--out", default=local_out("verl_forward"), help="results file stem (OUT.json, OUT.md, OUT.png)")
    add_allow_composite(p)
    args = parse_or_answer_child(p, child, argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.batch, args.seq = args.batch or 2, args.seq or 64
        args.reps = min(args.reps, 2)
    args.device = args.device or "cuda"
    args.batch, args.seq = args.batch or 16, args.seq or 1024
    args.paths = split_names(p, args.paths, PATHS, "paths")
    return args


def main(argv=None):
    args = parse_args(argv)
    ran = check_twinkle_mem(args.allow_composite, args.device)
    import verl_import
    missing = verl_import.missing()
    if missing:
        print(f"bench_verl_forward: {verl_import.refusal(missing)}")
        return 3
    import torch
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        print(f"bench_verl_forward: no {args.device} device (--dry-run runs the script's logic on the CPU)")
        return 2
    model = TINY if args.dry_run else QWEN25_15B
    progress = Progress(len(args.paths), stream=sys.stderr)
    rows = []
    for path in args.paths:
        progress.step(f"{path:8s} {args.batch} x {args.seq} tokens")
        cfg = dict(path=path, device=args.device, dtype=args.dtype, model=model, batch=args.batch, seq=args.seq,
                   reps=args.reps, entropy_grad=args.entropy_grad)
        # verl as shipped on its own paths (no plugin: a pip-installed twinkle-mem's entry point stays out)
        env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none" if path != "twinkle" else "auto",
                   PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
        try:
            row = run_config(__file__, cfg, env, args.timeout)
        except ChildFailed as error:
            row = {"status": f"failed: {error.last_line[:300]}"}
        except Exception as error:  # noqa: BLE001  (a timeout: the row says so, the other paths still run)
            row = {"status": f"failed: {type(error).__name__}: {error}"[:300]}
        row["path"] = path
        rows.append(row)
        progress.done(row["status"] if row["status"] != "ok" else
                      f"fwd+bwd {row['fwd_bwd_ms']:.1f} ms, no_grad {row['no_grad_ms']:.1f} ms")
    compare(rows)
    records = [ran] + [r["ran"] for r in rows if r.get("ran")]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    notes = sorted({r["note"] for r in rows if r.get("note")})
    meta = run_metadata(records, device=args.device, gpu=gpu, dtype=args.dtype, batch=args.batch, seq=args.seq,
                        tokens=args.batch * args.seq, model=model, reps=args.reps, entropy_grad=args.entropy_grad,
                        dry_run=args.dry_run, notes=notes, verl=_version("verl"), transformers=_version("transformers"),
                        total_s=progress.elapsed(), command=" ".join(["python"] + sys.argv))
    write_results(args.out, meta, rows, render(rows, meta))
    plot(rows, meta, args.out + ".png")
    return 1 if any(r["status"].startswith("failed") for r in rows) else 0  # (a path that cannot run here: 0)


def _version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def compare(rows):
    """Each path's edge log-probs against the logits path's (max |difference|)."""
    base = next((r for r in rows if r["path"] == "logits" and r.get("edge_logp")), None)
    for row in rows:
        if base and row.get("edge_logp"):
            row["max_dlogp_vs_logits"] = max(abs(a - b) for a, b in zip(row["edge_logp"], base["edge_logp"]))


def _gib(x):
    return "" if x is None else f"{x / 2**30:.2f}"


def render(rows, meta) -> str:
    title = (f"verl's forward, {'tiny config' if meta['dry_run'] else 'Qwen2.5-1.5B config'} (random weights), "
             f"{meta['batch']} x {meta['seq']} = {meta['tokens']} tokens, {meta['dtype']}, "
             f"{meta.get('gpu') or meta['device']}, verl {meta['verl']}, transformers {meta['transformers']}, torch "
             f"{meta['torch']}; median of {meta['reps']}; fwd+bwd: log-probs' gradient"
             f"{' and the entropy' if meta['entropy_grad'] else ' (entropy a metric)'}"
             f"{'; DRY RUN (CPU)' if meta['dry_run'] else ''}")
    cells = []
    for r in rows:
        ok = r["status"] == "ok"
        cells.append([r["path"], PATHS[r["path"]], r["status"] if not ok else "ok",
                      f"{r['fwd_bwd_ms']:.1f}" if ok and r.get("fwd_bwd_ms") else "",
                      _gib(r.get("fwd_bwd_peak_bytes")), f"{r['no_grad_ms']:.1f}" if ok and r.get("no_grad_ms") else "",
                      _gib(r.get("no_grad_peak_bytes")),
                      f"{r['max_dlogp_vs_logits']:.1e}" if r.get("max_dlogp_vs_logits") is not None else ""])
    header = ["path", "what", "status", "fwd+bwd ms", "fwd+bwd peak GiB (beyond model + inputs)", "no_grad fwd ms",
              "no_grad peak GiB", "max dlogp vs logits path (edge tokens)"]
    lines = [title, "", markdown_table(header, cells, "lllrrrrr")]
    lines += [f"note: {note}" for note in meta.get("notes") or []]
    line = ran_line(meta)
    return "\n".join(lines + ([line] if line else [])) + "\n"


def plot(rows, meta, path):
    done = [r for r in rows if r["status"] == "ok"]
    if not done:
        return
    try:
        series = {"fwd+bwd": ([(r.get("fwd_bwd_peak_bytes") or 0) / 2**20 for r in done],
                              [(r.get("fwd_bwd_ms") or 0) / 1e3 for r in done]),
                  "no_grad forward": ([(r.get("no_grad_peak_bytes") or 0) / 2**20 for r in done],
                                      [(r.get("no_grad_ms") or 0) / 1e3 for r in done])}
        logits_mib = meta["tokens"] * meta["model"]["vocab_size"] * 2 / 2**20
        peak_and_time_figure([r["path"] for r in done], series, logits_mib,
                             f"verl's forward, {meta['tokens']} tokens, {meta.get('gpu') or meta['device']}", path,
                             peak_label="peak beyond model + inputs (MiB)")
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
