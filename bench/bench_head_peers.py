"""The LM head's log-probs on one device: twinkle-mem's fused head and op against every peer, side by side in one run.

    python bench/bench_head_peers.py                       # a GPU: the Qwen2.5-7B and 1.5B heads, N = 16384, bf16
    python bench/bench_head_peers.py --shapes 1536x151936 --outputs forward --peers twinkle_fused,unfused_op
    python bench/bench_head_peers.py --dry-run             # here, on the CPU: tiny shapes, the script's logic
    python bench/bench_head_peers.py --dry-run --count-ops --peers twinkle_fused   # ATen ops per call (profiler)

Issue 51, point 2. Per cell (head shape x output x head kind x peer), in one process on --device:

- shapes ``HxV``: the Qwen2.5-7B head (3584 x 152064) and the Qwen2.5-1.5B head (1536 x 151936); N = --n rows
  (16384), --dtype inputs (bf16), random hidden states, weight ~ N(0, 4/H) (logits of about unit variance x 2);
- outputs: ``logp_grad`` (log-probs with a gradient, the entropy a metric: computed, not differentiated),
  ``both_grad`` (log-probs and entropy both with a gradient) and ``forward`` (both under no_grad, verl's
  compute_log_prob); the gradients from random per-token upstream gradients (``torch.autograd.grad``);
- head kinds: ``trainable`` (gradients to hidden and weight) and ``frozen`` (LoRA's: hidden alone); the forward
  needs no gradient, so it runs once per shape;
- peers (PEERS below): twinkle-mem's fused head; the unfused paths (cuBLAS logits + twinkle-mem's op, and
  logits + log_softmax/gather); torch.compile of the unfused; Liger-Kernel's fused linear cross entropy
  (reduction="none"), its fused linear scaled cross entropy (verl's "liger" backend; log-probs and entropy) and its
  fused linear GRPO loss; verl's Triton kernel and its torch backend (FusedLinearForPPO); Cut Cross-Entropy
  (reduction="none"), each with its own defaults (CCE's gradient filtering included). A peer that is not installed, cannot run on the device, or cannot give an output is
  reported as such, in its row, not left out: one without entropy is timed for what it gives ("logp only", "a
  GRPO loss"), marked so, and never counted among the peers that give the cell's outputs.

Each cell: a first call (compilation, autotuning: its time recorded apart), --warmup calls, --reps timed calls
(CUDA events on a GPU; the median and quartiles), then one call between a reset of the allocator's peak: the peak
beyond what was allocated before it (the inputs) minus what the call returns (outputs and gradients), the peer's
working memory. Log-probs (and entropy) of the first and last 4 rows against float64: of the exact logits, and of
the logits rounded once to --dtype (what a peer that makes bf16 logits computes); within 1e-5 of either passes
(the JSON keeps both). ``--count-ops`` profiles one more call (torch.profiler): the ATen ops it dispatched at the
top level (those not called from inside another ATen op), the matmuls among them and, on a GPU, the kernels it
launched. ``--time-budget`` seconds: cells after it are reported "not run: time budget" (the device check's limit).

Prints a table and the targets (issue 51: forward <= 1.05x unfused, frozen <= 1.05x, trainable <= 1.40x, faster
than every peer giving the same outputs), writes OUT.json, OUT.md and OUT.png (--out, default
bench/results/local/head_peers); progress on stderr.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

from bench_common import (Progress, add_allow_composite, check_twinkle_mem, local_out, markdown_table, new_figure,
                          ran_line, run_metadata, save_png, split_names, time_calls_ms, write_json,
                          write_results)

SHAPES = {"3584x152064": "Qwen2.5-7B head", "1536x151936": "Qwen2.5-1.5B head"}
DRY_SHAPES = {"64x1000": "tiny head", "32x777": "tiny head, odd V"}
OUTPUTS = {
    "logp_grad": "log-probs with gradient, entropy a metric",
    "both_grad": "log-probs and entropy with gradient",
    "forward": "forward only (no_grad): log-probs and entropy",
}
HEADS = ("trainable", "frozen")
# Issue 51's targets: the fused head's time over the unfused path's (cuBLAS logits + twinkle-mem's op).
TARGETS = {"forward": 1.05, "frozen": 1.05, "trainable": 1.40}
UNFUSED = "unfused_op"
FUSED = "twinkle_fused"
IGNORE = -100
EDGE_ROWS = 4  # the first and last rows checked against float64
TOLERANCE = 1e-5
MATMULS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::_scaled_mm",
           "aten::addmm_", "aten::addbmm"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class NotGiven(Exception):
    """A peer that cannot run here or cannot give what the cell asks: the reason, reported in its row."""


# ------------------------------------------------------------------ the peers
# Each peer is make(ctx) -> (fn, gives): fn(hidden, weight, labels, entropy_grad) returns (logp, entropy or None) on
# the autograd graph (the entropy detached when entropy_grad is False), or ("loss", scalar) for a peer that only gives
# a loss; gives: "logp+entropy", "logp only" or "a GRPO loss". ImportError / NotGiven: reported, not timed.
def _twinkle_fused(ctx):
    import twinkle_mem

    def fn(hidden, weight, labels, entropy_grad):
        return twinkle_mem.linear_selective_log_softmax(hidden, weight, labels, True, ignore_index=IGNORE,
                                                        entropy_grad=entropy_grad)
    return fn, "logp+entropy"


def _unfused_op(ctx):
    import twinkle_mem

    def fn(hidden, weight, labels, entropy_grad):  # the logits an intermediate: the op writes its gradient over them
        logp, entropy = twinkle_mem.selective_log_softmax(hidden @ weight.t(), labels, True, ignore_index=IGNORE,
                                                          inplace_backward=True)
        return logp, entropy if entropy_grad else entropy.detach()
    return fn, "logp+entropy"


def unfused_torch(hidden, weight, labels, entropy_grad):
    """logits, then log_softmax in fp32 and gather; the entropy from the same log-softmax (detached: a metric)."""
    import torch
    logp_all = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    source = logp_all if entropy_grad else logp_all.detach()
    entropy = -(source.exp() * source).sum(-1)
    return logp, entropy


def _unfused_torch(ctx):
    return unfused_torch, "logp+entropy"


def _compiled(ctx):
    import torch
    compiled = torch.compile(unfused_torch, dynamic=False)
    return compiled, "logp+entropy"


def _liger_flce(ctx):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def fn(hidden, weight, labels, entropy_grad):
        return -liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE, reduction="none"), None
    return fn, "logp only"


def _liger_scaled_ce(ctx):
    # verl's "liger" backend of FusedLinearForPPO calls it this way; on sm90 it dispatches to a CuTe DSL kernel
    # (nvidia-cutlass-dsl): the first call says what is missing.
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as scaled_ce

    def fn(hidden, weight, labels, entropy_grad):
        nll, entropy = scaled_ce.apply(hidden, weight, labels, 1.0, IGNORE, 1, True)
        return -nll, entropy if entropy_grad else entropy.detach()
    return fn, "logp+entropy"


def _liger_grpo(ctx):
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # One prompt group's worth of sequences of 1024 tokens (or all rows in one where N is smaller): a token-level
    # GRPO loss without a reference model (beta 0), its gradient through the log-probs, as a trainer runs it.
    loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")
    seq = min(1024, ctx["n"])
    if ctx["n"] % seq:
        raise NotGiven(f"N = {ctx['n']} is not a whole number of sequences of {seq}")
    batch = ctx["n"] // seq
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(batch, generator=gen).to(ctx["device"])
    mask = torch.ones(batch, seq, dtype=torch.long, device=ctx["device"])

    def fn(hidden, weight, labels, entropy_grad):
        out = loss(hidden.view(batch, seq, -1), weight, labels.view(batch, seq), mask, advantages)
        return "loss", out[0] if isinstance(out, tuple) else out
    return fn, "a GRPO loss"


def _verl_module(name):
    """verl's module ``name`` (verl.utils.kernel.linear_cross_entropy, ...): importing verl needs Ray, which a
    forward on one device never calls; bench/verl_import.py stands in for it where it is missing (said in the run)."""
    import importlib

    from verl_import import import_verl
    ctx_note = import_verl()
    return importlib.import_module(name), ctx_note


def _verl_triton(ctx):
    if ctx["device"] != "cuda":
        raise NotGiven("verl's Triton kernel runs on CUDA only")
    module, note = _verl_module("verl.utils.kernel.linear_cross_entropy")
    ctx["notes"].add(note)

    def fn(hidden, weight, labels, entropy_grad):
        logp, entropy = module.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
        return logp, entropy if entropy_grad else entropy.detach()
    return fn, "logp+entropy"


def _verl_torch(ctx):
    module, note = _verl_module("verl.utils.experimental.torch_functional")
    ctx["notes"].add(note)
    head = module.FusedLinearForPPO(chunk_size=512, impl_backend="torch")

    def fn(hidden, weight, labels, entropy_grad):
        logp, entropy = head(hidden, weight, labels.clamp(min=0), 1.0)
        return logp, entropy if entropy_grad else entropy.detach()
    return fn, "logp+entropy"


def _cce(ctx):
    from cut_cross_entropy import linear_cross_entropy
    impl = "cce" if ctx["device"] == "cuda" else "torch_compile"  # its Triton kernels need CUDA

    def fn(hidden, weight, labels, entropy_grad):
        return -linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE, reduction="none", impl=impl), None
    return fn, "logp only"


PEERS = {  # name -> (what it is, its maker)
    FUSED: ("twinkle-mem fused head (linear_selective_log_softmax)", _twinkle_fused),
    UNFUSED: ("unfused: cuBLAS logits + twinkle-mem's op", _unfused_op),
    "unfused_torch": ("unfused: logits + log_softmax/gather", _unfused_torch),
    "compiled": ("torch.compile of the unfused logits + log_softmax/gather", _compiled),
    "liger_flce": ("Liger-Kernel fused linear cross entropy (reduction='none')", _liger_flce),
    "liger_scaled_ce": ("Liger-Kernel fused linear scaled cross entropy (verl's liger backend)", _liger_scaled_ce),
    "liger_grpo": ("Liger-Kernel fused linear GRPO loss (chunked_loss)", _liger_grpo),
    "verl_triton": ("verl's Triton kernel (verl.utils.kernel.linear_cross_entropy)", _verl_triton),
    "verl_torch": ("verl's torch backend (FusedLinearForPPO)", _verl_torch),
    "cce": ("Cut Cross-Entropy (reduction='none')", _cce),
}


# ------------------------------------------------------------------ the device
class Device:
    """Synchronization, timing and the allocator's figures of one device (cuda, npu, or cpu for dry runs: there
    memory is not measured)."""

    def __init__(self, name):
        import torch
        self.name = name
        self.accel = getattr(torch, name) if name in ("cuda", "npu") else None

    def sync(self):
        if self.accel is not None:
            self.accel.synchronize()

    def time_ms(self, fn, reps):
        """Milliseconds of each of ``reps`` calls of ``fn`` (device events where there are some)."""
        return time_calls_ms(fn, reps, self.accel)

    def peak_beyond(self, fn):
        """(peak bytes above what was allocated before ``fn``, bytes of what it returned), None on the CPU."""
        if self.accel is None:
            return None, None
        self.sync()
        self.accel.reset_peak_memory_stats()
        base = self.accel.memory_allocated()
        out = fn()
        self.sync()
        peak = self.accel.max_memory_allocated() - base
        held = sum(t.numel() * t.element_size() for t in _tensors(out))
        del out
        return peak, held

    def free(self):
        if self.accel is not None:
            self.accel.empty_cache()


def _tensors(out):
    import torch
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


# ------------------------------------------------------------------ one cell
def inputs(h, v, n, dtype, device, seed=0):
    """hidden [n, h], weight [v, h], labels [n], upstream gradients of logp and entropy, made on the CPU with one
    seed (the same values on every device) and moved."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=gen) * h ** -0.5 * 2).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    g_logp = torch.randn(n, generator=gen).to(device)
    g_entropy = torch.randn(n, generator=gen).to(device)
    return hidden, weight, labels, g_logp, g_entropy


def reference(hidden, weight, labels, rows, dtype):
    """float64 log-probs and entropy of ``rows``: of the exact logits, and of the logits rounded once to ``dtype``."""
    import torch
    h, w = hidden[rows].detach().double().cpu(), weight.detach().double().cpu()
    exact = h @ w.t()
    out = {}
    for name, logits in (("exact", exact), ("rounded", exact.to(dtype).double())):
        logp_all = torch.log_softmax(logits, -1)
        out[name] = (logp_all.gather(-1, labels[rows].cpu().unsqueeze(-1)).squeeze(-1),
                     -(logp_all.exp() * logp_all).sum(-1))
    return out


def make_call(fn, output, head, hidden, weight, labels, g_logp, g_entropy):
    """The timed call of a cell: its outputs (and gradients), leaves made fresh each call."""
    import torch

    def call():
        if output == "forward":
            with torch.no_grad():
                return fn(hidden, weight, labels, False)
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_(head == "trainable")
        leaves = (h, w) if head == "trainable" else (h,)
        out = fn(h, w, labels, output == "both_grad")
        if out[0] == "loss":
            return (out[1].detach(), *torch.autograd.grad(out[1], leaves))
        logp, entropy = out
        loss = (logp * g_logp).sum()
        if entropy is not None and output == "both_grad":
            loss = loss + (entropy * g_entropy).sum()
        grads = torch.autograd.grad(loss, leaves)
        return (logp.detach(), None if entropy is None else entropy.detach(), *grads)
    return call


def count_ops(call, device):
    """One call under torch.profiler: top-level ATen ops (those with no ATen op above them: what Python and the
    autograd engine dispatched), the matmuls among them, and the device kernels launched (None on the CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.name == "cuda" else [])
    device.sync()
    with profile(activities=activities) as prof:
        call()
        device.sync()
    top, matmuls, kernels = 0, 0, 0
    for event in prof.events():
        if getattr(event, "device_type", None) is not None and event.device_type.name == "CUDA":
            kernels += 1
            continue
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            top += 1
            matmuls += event.name in MATMULS
    return {"aten_ops": top, "matmuls": matmuls, "kernels": kernels if device.name == "cuda" else None}


def run_cell(peer, output, head, data, ctx, args, device):
    """One row of the table: the peer's outputs, times, memory and errors, or why it has none."""
    import torch
    row = {"peer": peer, "output": output, "head": head}
    try:
        fn, gives = PEERS[peer][1](ctx)
    except ImportError as error:
        return dict(row, status=f"not installed: {error}")
    except NotGiven as why:
        return dict(row, status=f"cannot run: {why}")
    row["gives"] = gives
    hidden, weight, labels, g_logp, g_entropy = data
    call = make_call(fn, output, head, hidden, weight, labels, g_logp, g_entropy)
    try:
        t0 = time.perf_counter()
        out = call()
        device.sync()
        row["first_call_s"] = time.perf_counter() - t0
        if gives != "a GRPO loss":
            row.update(errors(out[0], out[1], ctx["reference"], ctx["rows"]))
        del out
        times = device.time_ms(call, args.warmup)  # (warm-up: not kept)
        times = device.time_ms(call, args.reps)
        if times:
            q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
            row.update(ms=statistics.median(times), ms_q1=q[0], ms_q3=q[2], reps=len(times))
        peak, held = device.peak_beyond(call)
        if peak is not None:
            row.update(peak_bytes=peak, held_bytes=held, beyond_bytes=peak - held)
        if args.count_ops:
            row["ops"] = count_ops(call, device)
    except NotGiven as why:
        return dict(row, status=f"cannot run: {why}")
    except ImportError as error:  # (a module its first call loads: Liger's CuTe DSL kernel needs nvidia-cutlass-dsl)
        device.free()
        return dict(row, status=f"not installed: {error}")
    except Exception as error:  # noqa: BLE001  (a peer's failure is its row's: OOM, a kernel that cannot compile)
        row["status"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        row["traceback"] = traceback.format_exc()[-2000:]
        if isinstance(error, torch.OutOfMemoryError):
            row["status"] = "out of memory"
        device.free()
        return row
    row["status"] = {"logp+entropy": "ok", "logp only": "logp only (no entropy)"}.get(gives, gives)
    device.free()
    return row


def errors(logp, entropy, ref, rows):
    """Max |error| of the edge rows' log-probs (and entropy) against both float64 references."""
    import torch
    idx = torch.tensor(rows, device=logp.device)
    got = logp.detach().index_select(0, idx).double().cpu()
    out = {f"logp_err_{name}": (got - r[0]).abs().max().item() for name, r in ref.items()}
    if entropy is not None:
        got_h = entropy.detach().index_select(0, idx).double().cpu()
        out.update({f"entropy_err_{name}": (got_h - r[1]).abs().max().item() for name, r in ref.items()})
    out["logp_ok"] = min(out["logp_err_exact"], out["logp_err_rounded"]) <= TOLERANCE
    return out


# ------------------------------------------------------------------ the run
def cells(args):
    """(shape, output, head) in the order they run: the forward once per shape (no gradient: no head kind)."""
    for shape in args.shapes:
        for output in args.outputs:
            for head in (["-"] if output == "forward" else args.heads):
                yield shape, output, head


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=None, help=f"HxV head shapes (default {' '.join(SHAPES)})")
    p.add_argument("--n", type=int, default=None, help="rows (tokens); default 16384 (64 with --dry-run)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--outputs", nargs="+", choices=list(OUTPUTS), default=list(OUTPUTS))
    p.add_argument("--heads", nargs="+", choices=list(HEADS), default=list(HEADS))
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS))
    p.add_argument("--reps", type=int, default=5, help="timed calls per cell (0: none, with --count-ops)")
    p.add_argument("--warmup", type=int, default=1, help="calls after the first, before the timed ones")
    p.add_argument("--device", default=None, help="cuda (default), npu, or cpu (a dry run's)")
    p.add_argument("--dry-run", action="store_true", help="the script's logic on the CPU: tiny shapes, 2 reps")
    p.add_argument("--count-ops", action="store_true", help="ATen ops, matmuls and kernels of one call per cell")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cells after it are reported, not run")
    p.add_argument("--out", default=local_out("head_peers"), help="results file stem (OUT.json, OUT.md, OUT.png)")
    add_allow_composite(p)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.shapes = args.shapes or list(DRY_SHAPES)
        args.n = args.n or 64
        args.reps = min(args.reps, 2)
    args.device = args.device or "cuda"
    args.shapes = args.shapes or list(SHAPES)
    args.n = args.n or 16384
    args.peers = split_names(p, args.peers, PEERS, "peers")
    return args


def main(argv=None):
    args = parse_args(argv)
    ran = check_twinkle_mem(args.allow_composite, args.device)
    import torch
    if args.device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        print(f"bench_head_peers: no {args.device} device (--dry-run runs the script's logic on the CPU)")
        return 2
    device = Device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    todo = list(cells(args))
    progress = Progress(len(todo) * len(args.peers), stream=sys.stderr)
    rows, notes = [], set()
    for shape in args.shapes:
        h, v = (int(x) for x in shape.split("x"))
        data = inputs(h, v, args.n, dtype, args.device)
        edge = sorted(set(range(min(EDGE_ROWS, args.n))) | set(range(max(0, args.n - EDGE_ROWS), args.n)))
        ctx = {"device": args.device, "n": args.n, "notes": notes, "rows": edge,
               "reference": reference(data[0], data[1], data[2], edge, dtype)}
        for _, output, head in (c for c in todo if c[0] == shape):
            for peer in args.peers:
                progress.step(f"{shape} {output:9s} {head:9s} {peer:15s}")
                if args.time_budget is not None and progress.elapsed() > args.time_budget:
                    row = {"peer": peer, "output": output, "head": head,
                           "status": f"not run: the time budget ({args.time_budget:.0f} s) was spent"}
                else:
                    row = run_cell(peer, output, head, data, ctx, args, device)
                row.update(shape=shape, h=h, vocab=v)
                rows.append(row)
                progress.done(_progress_line(row))
                # the rows so far, should the run be stopped (a device call's limit): replaced at the end
                write_json(args.out + ".json", {"meta": {"partial": True, "n": args.n, "dtype": args.dtype,
                                                         "device": args.device}, "rows": rows}, indent=1)
        del data
        device.free()
    add_ratios(rows)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    meta = run_metadata(ran, device=args.device, gpu=gpu, n=args.n, dtype=args.dtype, shapes=args.shapes,
                        reps=args.reps, warmup=args.warmup, dry_run=args.dry_run, notes=sorted(n for n in notes if n),
                        total_s=progress.elapsed(), command=" ".join(["python"] + sys.argv))
    write_results(args.out, meta, rows, render(rows, meta))
    plot(rows, meta, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png", file=sys.stderr)
    ours = [r for r in rows if r["peer"] in (FUSED, UNFUSED) and not r["status"].startswith("not run")]
    broken = [r for r in ours if r["status"] != "ok" or not r.get("logp_ok", True)]
    for r in broken:  # (a peer's failure is its row's; twinkle-mem's fails the run)
        print(f"FAILED: {r['peer']} {r['shape']} {r['output']} {r['head']}: {r['status']}"
              f"{'' if r.get('logp_ok', True) else ', log-probs beyond 1e-5 of float64'}")
    return 1 if broken else 0


def _progress_line(row):
    if "ms" not in row:
        return row["status"]
    mib = f", {row['beyond_bytes'] / 2**20:,.0f} MiB beyond" if row.get("beyond_bytes") is not None else ""
    return f"{row['ms']:.2f} ms{mib} ({row['status']})"


def add_ratios(rows):
    """Each timed row's time over the unfused path's (``vs_unfused``) and over the fastest other peer giving the
    cell's outputs (``vs_best_peer``, for twinkle-mem's fused head)."""
    for row in rows:
        same = [r for r in rows if (r["shape"], r["output"], r["head"]) == (row["shape"], row["output"], row["head"])
                and r.get("ms")]
        unfused = next((r for r in same if r["peer"] == UNFUSED), None)
        if row.get("ms") and unfused:
            row["vs_unfused"] = row["ms"] / unfused["ms"]
        peers = [r for r in same if r["peer"] not in (FUSED, UNFUSED) and r["status"] == "ok"]
        if row["peer"] == FUSED and row.get("ms") and peers:
            best = min(peers, key=lambda r: r["ms"])
            row["vs_best_peer"], row["best_peer"] = row["ms"] / best["ms"], best["peer"]


def target_of(row):
    return TARGETS["forward" if row["output"] == "forward" else row["head"]]


def render(rows, meta) -> str:
    title = (f"LM head log-probs, N = {meta['n']}, {meta['dtype']}, {meta['device']}"
             f"{' (' + meta['gpu'] + ')' if meta.get('gpu') else ''}; median of {meta['reps']} calls after "
             f"{meta['warmup']} warm-up; torch {meta['torch']}{'; DRY RUN (CPU, tiny shapes)' if meta['dry_run'] else ''}")
    cells_ = []
    for r in rows:
        err = ""
        if "logp_err_rounded" in r:
            err = f"{r['logp_err_rounded']:.1e} / {r['logp_err_exact']:.1e}{'' if r['logp_ok'] else ' FAIL'}"
        ops = r.get("ops")
        cells_.append([f"{r['shape']}", r["output"], r["head"], r["peer"], r["status"],
                       f"{r['ms']:.2f}" if r.get("ms") else "", f"{r['vs_unfused']:.2f}x" if r.get("vs_unfused") else "",
                       f"{r['beyond_bytes'] / 2**20:,.0f}" if r.get("beyond_bytes") is not None else "", err,
                       "" if not ops else f"{ops['aten_ops']} / {ops['matmuls']}"
                       + ("" if ops.get("kernels") is None else f" / {ops['kernels']}")])
    header = ["HxV", "output", "head", "peer", "gives", "ms", "vs unfused", "MiB beyond in/out/grads",
              "logp err vs fp64 (rounded / exact logits)", "ATen ops / matmuls / kernels"]
    lines = [title, "", markdown_table(header, cells_, "lllllrrrrr")]
    for r in rows:
        if r["peer"] == FUSED and r.get("vs_unfused"):
            limit = target_of(r)
            best = (f"; {r['vs_best_peer']:.2f}x the fastest peer giving the same outputs ({r['best_peer']}): "
                    f"{'PASS' if r['vs_best_peer'] < 1 else 'FAIL'}") if r.get("vs_best_peer") else \
                "; no peer gave the same outputs"
            lines.append(f"target {r['shape']} {r['output']} {r['head']}: {r['vs_unfused']:.2f}x unfused "
                         f"(<= {limit}: {'PASS' if r['vs_unfused'] <= limit else 'FAIL'}){best}")
    for note in meta.get("notes") or []:
        lines.append(f"note: {note}")
    line = ran_line(meta)
    return "\n".join(lines + ([line] if line else [])) + "\n"


def plot(rows, meta, path):
    try:
        fig = new_figure((14, 1.0 + 2.4 * max(1, len({(r["shape"], r["output"], r["head"]) for r in rows}))))
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    keys = list(dict.fromkeys((r["shape"], r["output"], r["head"]) for r in rows))
    axes = fig.subplots(len(keys), 2, squeeze=False)
    for (ax_time, ax_mem), key in zip(axes, keys):
        done = [r for r in rows if (r["shape"], r["output"], r["head"]) == key and r.get("ms")]
        labels = [r["peer"] + ("" if r["status"] == "ok" else " *") for r in done]
        colors = ["tab:green" if r["peer"] == FUSED else "tab:gray" if r["peer"] == UNFUSED else "tab:red" for r in done]
        ax_time.barh(labels, [r["ms"] for r in done], color=colors)
        ax_time.set_xlabel(f"{key[0]} {key[1]} {key[2]}: ms (median)", fontsize=8)
        ax_mem.barh(labels, [max(r.get("beyond_bytes") or 0, 0) / 2**20 for r in done], color=colors)
        ax_mem.set_xlabel("MiB beyond inputs, outputs and gradients (peak)", fontsize=8)
        ax_mem.set_yticklabels([])
        for ax in (ax_time, ax_mem):
            ax.tick_params(labelsize=7)
    fig.suptitle(f"LM head log-probs: N = {meta['n']}, {meta['dtype']}, {meta.get('gpu') or meta['device']}"
                 " (* gives less than the cell's outputs)", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
