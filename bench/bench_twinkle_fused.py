"""twinkle-kit's Megatron forward_backward / forward_only with and without the fused LM head, each
case in a fresh process: peak RSS rise and time.

    python bench/bench_twinkle_fused.py [--vocab 151936] [--seq 4096] [--hidden 64] [--reps 1] [--out STEM]
    python bench/bench_twinkle_fused.py --loss gkd     # twinkle's GKD step (issue 26)

twinkle-kit 0.5.1's real ``MegatronModel.forward_backward`` on megatron-core 0.16.1's real
no-pipelining scheduler (gloo, world size 1, CPU, 1 thread) around a one-layer megatron-core
``GPTModel`` (``standins.megatron.gpt_model``: local spec, learned positions), fp32 (bf16
matmuls are ~10x slower than fp32 on this CPU), GRPOLoss with an entropy bonus, 2 micro-batches
of one ``--seq`` sample each (``--prompt`` tokens of each with label -100), ``return_logits=False``.
Cases: twinkle-kit as shipped, ``install()`` (logits guard + twinkle-mem's op on the logits) and
``install(fused_lm_head=True)``. Per case: the rise of the resident-set high-water mark over one
call after a warm-up call, the median time of ``--reps`` calls, the loss, and the sum of the
returned log-probs under the loss mask (the cases must agree), and what twinkle-mem ran in its process (backend,
CPU kernel path: the table and the JSON name them; where it would run the composite fallback, the run refuses to
start unless --allow-composite).
Writes bench/results/local/twinkle_fused.json, .md and .png (the recorded results: --out bench/results/twinkle_fused).

``--loss gkd``: twinkle's distillation step instead, GKDLoss(beta=0.5) over a top-k teacher as its recipes
feed it (k = ``--topk``, 64: ``teacher_topk_logprobs`` fp32 and ``teacher_topk_indices`` int64, [2, S, k]),
forward_backward only, one more case: twinkle-kit with GKDLoss's arithmetic in float64 on the same fp32
logits (the gather is exact; only the k-wide math changes), whose loss is the exact one the others are held
against. Writes bench/results/local/twinkle_gkd.*. ``--teacher local``: a local teacher's whole-vocab logits
(``teacher_logits=``, [2, S, V] fp32) instead; writes bench/results/local/twinkle_gkd_local.*.
"""
import os
import statistics

from bench_common import (RAN_SETUP, Progress, bench_parser, check_twinkle_mem, finish_figure, grouped_bars, local_out,
                          logits_line, markdown_table, new_figure, ran_line, read_json, run_metadata, write_json)
from standins import memory  # importable once bench_common has put the repository root on sys.path

CASES = [
    ("twinkle-kit 0.5.1", None),
    ("install()", "integration.install(mask_skip='never')"),
    ("install(fused_lm_head=True)", "integration.install(mask_skip='never', fused_lm_head=True)"),
]
# GKD: twinkle-kit's own step with its GKD arithmetic in float64, on the k gathered fp32 logits: the exact loss.
EXACT_GKD = ("twinkle-kit 0.5.1, GKD in float64 (exact)", """
from twinkle.loss.gkd import GKDLoss
_jsd = GKDLoss._generalized_jsd_loss
def _exact(student_logits, teacher_logits=None, teacher_topk_logprobs=None, teacher_topk_indices=None, **kw):
    if teacher_logits is not None:  # a local teacher: both logits in float64
        return _jsd(student_logits.double(), teacher_logits=teacher_logits.double(), **kw).float()
    gathered = torch.gather(student_logits, -1, teacher_topk_indices).double()  # a gather rounds nothing
    identity = torch.arange(gathered.shape[-1]).expand_as(teacher_topk_indices)
    return _jsd(gathered, teacher_topk_logprobs=teacher_topk_logprobs.double(), teacher_topk_indices=identity,
                **kw).float()
GKDLoss._generalized_jsd_loss = staticmethod(_exact)
""")
LOSSES = {"grpo": "GRPOLoss(entropy_coef=0.01)", "gkd": "GKDLoss(beta=0.5)"}

SETUP = """
import torch
from standins import megatron as th
from twinkle.loss import GKDLoss, GRPOLoss
from twinkle_mem.integrations import twinkle as integration
contexts = [th.megatron_cpu(), th.megatron_gpt_cpu(), th.cpu_platform("cpu")]  # kept referenced
for context in contexts:
    context.__enter__()  # left when the process ends
{install}
chunk = th.gpt_model({vocab}, hidden={hidden}, heads=2, max_seq={seq})
model = th.twinkle_megatron_model(chunk, loss={loss})
samples = th.lm_samples([{seq}, {seq}], {vocab}, prompt={prompt})  # a [1, 1, S, S] bool mask each: S^2 bytes
gen = torch.Generator().manual_seed(1)  # a top-k teacher as twinkle's GKD recipe feeds it (used by GKD only)
if {local_teacher}:  # a local teacher's logits over the whole vocab (teacher_logits=)
    teacher = dict(teacher_logits=3 * torch.randn(2, {seq}, {vocab}, generator=gen))
else:
    teacher = dict(teacher_topk_indices=torch.randint(0, {vocab}, (2, {seq}, {topk}), generator=gen),
                   teacher_topk_logprobs=torch.log_softmax(3 * torch.randn(2, {seq}, {topk}, generator=gen), -1))
"""

STMT = """
for p in chunk.parameters():
    p.grad = None
if {forward_only}:
    out = model.forward_only(inputs=samples, micro_batch_size=1, temperature=0.7)
elif {gkd}:
    out = model.forward_backward(inputs=samples, micro_batch_size=1, temperature=0.7, **teacher)
else:
    out = model.forward_backward(inputs=samples, micro_batch_size=1, temperature=0.7,
                                 advantages=torch.tensor([1.0, -0.5]))
labels = torch.stack([s["labels"].reshape(-1) for s in samples])
logps = out.get("logps")  # GKD on the fused head: a loss without log-probs, None
EXTRA.update(loss=out["loss"], logps_sum=None if logps is None else float(logps[labels != -100].double().sum()))
return out
"""


def main():
    parser = bench_parser(__doc__, vocab=151936, seq=4096, hidden=64, prompt=0)
    parser.add_argument("--loss", choices=sorted(LOSSES), default="grpo")
    parser.add_argument("--topk", type=int, default=64, help="the GKD teacher's k")
    parser.add_argument("--teacher", choices=["topk", "local"], default="topk",
                        help="GKD: the recipes' top-k teacher, or a local teacher's whole-vocab logits "
                             "(teacher_logits=; results twinkle_gkd_local)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--cases", type=int, nargs="+", default=None,
                        help="indices into CASES (+ EXACT_GKD last with --loss gkd; the shipped case needs ~6x a "
                             "micro-batch's logits)")
    parser.add_argument("--out", default=None, help="results file stem (default bench/results/local/twinkle_fused, "
                                                    "twinkle_gkd with --loss gkd, twinkle_gkd_local with "
                                                    "--teacher local; not tracked)")
    parser.add_argument("--replot", action="store_true", help="redraw the table and PNG from the JSON only")
    args = parser.parse_args()
    gkd = args.loss == "gkd"
    cases = CASES + [EXACT_GKD] if gkd else CASES
    local = gkd and args.teacher == "local"
    args.out = stem = args.out or local_out("twinkle_fused" if not gkd else "twinkle_gkd_local" if local else
                                            "twinkle_gkd")
    if args.replot:
        saved = read_json(stem + ".json")
        _write(saved["rows"], saved["meta"], stem)
        return

    check_twinkle_mem(args.allow_composite)  # the measuring processes import the same twinkle_mem
    import megatron.core
    import twinkle.version
    logits_bytes = args.seq * args.vocab * 4  # one micro-batch's fp32 logits
    rows = []
    picked = args.cases if args.cases is not None else range(len(cases))
    runs = [(forward_only, cases[i]) for forward_only in ((False, ) if gkd else (False, True)) for i in picked]
    progress = Progress(len(runs))
    for forward_only, (name, install) in runs:
        mode = "forward_only" if forward_only else "forward_backward"
        progress.step(f"{mode} {name}")
        got = memory.measure_in_subprocess(
            SETUP.format(install=install or "", vocab=args.vocab, hidden=args.hidden, seq=args.seq, prompt=args.prompt,
                         loss=LOSSES[args.loss], topk=args.topk, local_teacher=local) + RAN_SETUP,
            STMT.format(forward_only=forward_only, gkd=gkd), reps=args.reps)
        rows.append(dict(mode=mode, case=name, peak_rss_bytes=got["peak"], s_median=statistics.median(got["times"]),
                         times=got["times"], loss=got["extra"]["loss"], logps_sum=got["extra"]["logps_sum"],
                         ran=dict(got["extra"]["ran"], where=f"{mode} {name}")))
        r = rows[-1]
        progress.done(f"peak RSS rise {r['peak_rss_bytes'] / 2**20:,.1f} MiB, {r['s_median']:.2f} s, "
                      f"loss {r['loss']:.6f}, sum(logps) {r['logps_sum']}")

    ran = [r["ran"] for r in rows]
    meta = run_metadata(ran, vocab=args.vocab, seq=args.seq, hidden=args.hidden, layers=1, heads=2, prompt=args.prompt,
                        micro_batches=2, micro_batch_size=1, dtype="float32", temperature=0.7,
                        loss=LOSSES[args.loss], topk=args.topk if gkd and not local else None,
                        teacher=args.teacher if gkd else None,
                        logits_bytes_per_micro_batch=logits_bytes, reps=args.reps,
                        threads=1, wall_s=round(progress.elapsed(), 1), load_average=os.getloadavg(),
                        twinkle_kit=twinkle.version.__version__, megatron_core=megatron.core.__version__)
    write_json(stem + ".json", dict(meta=meta, rows=rows))
    _write(rows, meta, stem)


def _write(rows, meta, stem):
    table = _table(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)
    _plot(rows, meta, stem + ".png")


def _table(rows, meta):
    title = (f"twinkle-kit Megatron, 2 micro-batches of [1, {meta['seq']}], V = {meta['vocab']}, H = {meta['hidden']}, "
             f"fp32, one micro-batch's logits = {meta['logits_bytes_per_micro_batch'] / 2**20:.0f} MiB, 1 thread, "
             f"load average at the end {meta['load_average'][0]:.2f}")
    exact = next((r["loss"] for r in rows if r["case"] == EXACT_GKD[0]), None)
    cells = []

    def vs(a, b):  # (a tiny run's peak rise can be 0)
        return f"{a / b:.2f}x" if b else "-"
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"])  # the first case run
        cells.append([r["mode"], r["case"], f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB",
                      vs(r["peak_rss_bytes"], base["peak_rss_bytes"]), f"{r['s_median']:.2f} s",
                      vs(r["s_median"], base["s_median"]), f"{r['loss']:.6f}"])
        if exact is None:
            cells[-1].append(f"{r['logps_sum']:.4f}")
        else:  # GKD: each loss against the exact one
            cells[-1].append(f"{(r['loss'] - exact) / abs(exact):+.1e}")
    last = "sum of logps under the mask" if exact is None else "loss vs exact (relative)"
    line = ran_line(meta)  # (none in a run recorded before it: its table re-renders as it was)
    return title + "\n\n" + markdown_table(["mode", "case", "peak RSS rise", "vs first", "time", "vs first", "loss",
                                             last], cells) + (f"\n{line}\n" if line else "")


def _plot(rows, meta, path):
    fig = new_figure((12, 4.5))
    axes = fig.subplots(1, 2)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = list(dict.fromkeys(r["case"] for r in rows))
    for ax, key, unit, scale in ((axes[0], "peak_rss_bytes", "peak RSS rise (MiB)", 2**20),
                                 (axes[1], "s_median", "time (s)", 1)):
        grouped_bars(ax, modes, {name: [next(r[key] for r in rows if r["mode"] == m and r["case"] == name) / scale
                                        for m in modes] for name in names}, width=0.27)
        ax.set_ylabel(unit)
    logits_line(axes[0], meta["logits_bytes_per_micro_batch"] / 2**20)
    axes[0].legend(fontsize=8)
    finish_figure(fig, f"twinkle-kit Megatron {' / '.join(modes)}, {meta.get('loss', 'GRPOLoss')}, 2 micro-batches of "
                       f"[1, {meta['seq']}], V = {meta['vocab']}, H = {meta['hidden']}, fp32, CPU, 1 thread", path)


if __name__ == "__main__":
    main()
