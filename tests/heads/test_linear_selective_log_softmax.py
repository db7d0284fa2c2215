"""twinkle_mem.linear_selective_log_softmax: the fused LM-head path (python/twinkle_mem/heads/logprobs.py).

- The op's own accuracy suite (tests/numerics.py) run through the fused path:
  with hidden = I and weight = X.T the logits hidden @ weight.T are X exactly,
  and grad_weight is the logits' gradient transposed (one nonzero term per dot
  product), so every case the op is held to holds the fused path to the same
  bound, across several vocab blocks.
- Random LM heads with inputs whose logits are exact in fp32 (dyadic values):
  values and the gradients of hidden, weight and bias against float64, with a
  bound derived from the op's per-element gradient bound through the matmuls;
  for bf16, in addition, no larger error than the unfused path (matmul, then
  the op).
- gradcheck in float64; ignored rows (no matmul rows, zero outputs and
  gradients, seen by the profiler); what autograd saves; argument errors;
  torch.compile(fullgraph=True); opcheck; the composite backend.
Memory (peak RSS): tests/heads/test_linear_memory.py. Tensor parallel: tests/heads/test_linear_vocab_parallel.py.
"""
import math

import pytest
import torch

import twinkle_mem
from head_helpers import make_head, op_bound, through_matmul
from helpers import assert_stats_close, blocks
from numerics import Impl, check_case, make_cases, ulp
from twinkle_mem.heads import engine, plans
from twinkle_mem.heads.plans import block_need, block_width, fit_width, step_bytes, tiles_in_flight
from twinkle_mem.heads.matmul import product_sums
from twinkle_mem.heads.frozen import frozen_grad
from twinkle_mem.heads.logprobs import linear_bwd, linear_fwd
from twinkle_mem.heads.reference import linear_selective_log_softmax_ref
from twinkle_mem.op import composite

lsls = twinkle_mem.linear_selective_log_softmax
NO_IGNORE = -(2**63)


# ------------------------------------------------------------------ the op's numerics, through the fused path
def _as_linear(x):
    """hidden, weight, bias with hidden @ weight.T + bias == x exactly (x [N, V]).

    Columns that are -inf on every row go to the bias (0 * -inf would be NaN in the matmul)."""
    n, v = x.shape
    hidden = torch.eye(n, dtype=x.dtype)
    dead = torch.isneginf(x).all(dim=0)
    assert not (torch.isinf(x) & ~dead).any(), "only whole -inf columns can be expressed"
    weight = torch.where(dead.unsqueeze(0), torch.zeros((), dtype=x.dtype), x).t().contiguous()
    bias = torch.where(dead, torch.full((), float("-inf"), dtype=x.dtype), torch.zeros((), dtype=x.dtype))
    return hidden, weight, (bias if dead.any() else None)


def _as_frozen_linear(x):
    """hidden, weight, bias with hidden @ weight.T + bias == x exactly and weight = I (a frozen head: grad_hidden is
    the logits' gradient); whole -inf columns go to the bias, as in _as_linear."""
    dead = torch.isneginf(x).all(dim=0)
    assert not (torch.isinf(x) & ~dead).any(), "only whole -inf columns can be expressed"
    hidden = torch.where(dead.unsqueeze(0), torch.zeros((), dtype=x.dtype), x)
    bias = torch.where(dead, torch.full((), float("-inf"), dtype=x.dtype), torch.zeros((), dtype=x.dtype))
    return hidden, torch.eye(x.shape[1], dtype=x.dtype), (bias if dead.any() else None)


class _Fused:
    """The op contract's forward/backward (tests/numerics.Impl) computed by the fused path: a trainable head
    (the logits' gradient is grad_weight.T) or a frozen one (differentiated in its forward: grad_hidden)."""

    def __init__(self, cols, rows=None, frozen=False):
        self.cols, self.rows = cols, rows  # vocab blocks of `cols` (the last one ragged), row tiles of `rows`
        self.frozen = frozen

    def forward(self, x, labels, inv_t, ignore, vocab_start, vocab_size, with_entropy):
        assert vocab_start == 0 and vocab_size == x.shape[-1]
        hidden, weight, bias = (_as_frozen_linear if self.frozen else _as_linear)(x)
        self.leaf = (hidden if self.frozen else weight).requires_grad_()
        with blocks(self.cols, self.rows):
            out = lsls(hidden, weight, labels, True, bias=bias, temperature=1.0 / inv_t,
                       ignore_index=None if ignore == NO_IGNORE else ignore)
        self.out = out
        logp, entropy = out
        return logp.detach(), entropy.detach(), None, None

    def backward(self, g_logp, g_entropy, x, labels, shift, log_sum, entropy, inv_t, ignore, vocab_start, inplace):
        logp, ent = self.out
        total = (logp * g_logp).sum() + ((ent * g_entropy).sum() if g_entropy is not None else 0)
        with blocks(self.cols, self.rows):
            (grad,) = torch.autograd.grad(total, self.leaf)
        return grad if self.frozen else grad.t()


CPU = torch.device("cpu")


def smallest_chunk(vocab, hidden_size, dtype):
    """The smallest chunk_bytes that holds the widest blocks: one step of a block in the larger pass (plans.block_need)."""
    from twinkle_mem.heads.frozen import vectors_at_most
    plan = plans.device_plan(CPU)
    return block_need(block_width(vocab, hidden_size, plan), hidden_size, dtype, plan, product_sums(dtype, CPU),
                      vectors_at_most(dtype, CPU))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_op_numerics_through_the_fused_path(dtype, frozen):
    fused = _Fused(cols=64, rows=16, frozen=frozen)  # V = 257: blocks 64, 64, 64, 64, 1
    for case in make_cases(6, 257, dtype, seed=21):
        check_case(Impl("fused", fused.forward, fused.backward), case)


@pytest.mark.e2e  # (rows of the real vocab through the fused path: the end-to-end tier)
def test_op_numerics_long_rows():
    fused = _Fused(cols=20000)  # a Qwen-sized vocab in 8 blocks
    for case in make_cases(2, 151936, torch.bfloat16, seed=7):
        if case.name.startswith(("randn", "finfo.min first half", "peaked 60", "offset 1e4", "T=0.05", "k=4")):
            check_case(Impl("fused", fused.forward, fused.backward), case)


# ------------------------------------------------------------------ random LM heads against float64
def check_against_float64(hidden, weight, bias, labels, *, temperature=1.0, ignore_index=None, entropy=True,
                          chunk_bytes=None, seed=0, cols=None, rows=None, frozen=False, entropy_grad=None):
    """cols, rows: vocab blocks and row tiles of that size (blocks()); chunk_bytes as given. frozen: weight and
    bias need no gradient (the head differentiated in its forward), grad_hidden checked alone; entropy_grad as
    given (the entropy gets a gradient either way)."""
    with blocks(cols, rows):
        return _check_against_float64(hidden, weight, bias, labels, temperature=temperature,
                                      ignore_index=ignore_index, entropy=entropy, chunk_bytes=chunk_bytes, seed=seed,
                                      frozen=frozen, entropy_grad=entropy_grad)


def _check_against_float64(hidden, weight, bias, labels, *, temperature, ignore_index, entropy, chunk_bytes, seed,
                           frozen, entropy_grad):
    dtype = hidden.dtype
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_(not frozen)
    b = None if bias is None else bias.detach().clone().requires_grad_(not frozen)
    out = lsls(h, w, labels, entropy, bias=b, temperature=temperature, ignore_index=ignore_index,
               chunk_bytes=chunk_bytes, entropy_grad=entropy_grad)
    logp, ent = out if entropy else (out, None)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.dtype == want and logp.shape == labels.shape
    gen = torch.Generator().manual_seed(seed + 1)
    g_logp = torch.randn(labels.shape, generator=gen, dtype=torch.float64).to(want)
    g_ent = torch.randn(hidden.shape[:-1], generator=gen, dtype=torch.float64).to(want) if entropy else None
    total = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
    grads = torch.autograd.grad(total, [t for t in (h, w, b) if t is not None and t.requires_grad])
    ref = linear_selective_log_softmax_ref(hidden, weight, bias, labels, g_logp, g_ent, temperature, ignore_index)

    assert_stats_close(logp, ref["logp"].view(logp.shape), "logp")
    if entropy:
        assert_stats_close(ent, ref["entropy"].view(ent.shape), "entropy")

    d = ref["d"]
    e = op_bound(d, dtype)
    h2 = hidden.reshape(-1, hidden.shape[-1]).double()
    got = dict(zip(("hidden", "weight", "bias"), grads))
    want_grads = {"hidden": (d @ weight.double(), through_matmul(e, d, weight.double().abs())),
                  "weight": (d.t() @ h2, through_matmul(e.t(), d.t(), h2.abs()))}
    if bias is not None:
        ones = torch.ones(d.shape[0], 1, dtype=torch.float64)
        want_grads["bias"] = (d.sum(0), through_matmul(e.t(), d.t(), ones)[:, 0])
    if frozen:
        want_grads = {"hidden": want_grads["hidden"]}
    for name, (ref_g, bound) in want_grads.items():
        g = got[name].reshape(ref_g.shape)
        assert g.dtype == dtype
        tol = ulp(ref_g, dtype) + bound  # rounded once to the dtype, plus what the op's gradient carries
        e = (g.double() - ref_g).abs()
        bad = e > tol
        assert not bad.any(), (f"grad_{name} ({dtype}): {int(bad.sum())} of {e.numel()} off; worst err "
                               f"{e.max().item():.3g} at ref {ref_g.flatten()[e.argmax()].item():.3g}, "
                               f"tol there {tol.flatten()[e.argmax()].item():.3g}")
    return logp, ent, got, ref


CONFIGS = {
    "one block": dict(),
    "ragged blocks": dict(chunk_cols=96),
    "blocks, T=0.7, ignored rows": dict(chunk_cols=128, temperature=0.7, ignore_frac=0.4),
    "no bias, no entropy": dict(chunk_cols=200, bias=False, entropy=False),
    "k=3 labels, some ignored": dict(chunk_cols=77, k=3, ignore_frac=0.3),
    "[B, S, H], int32 labels": dict(chunk_cols=300, lead=(3, 8), int32=True),
    "temperature 3, one column per block": dict(chunk_cols=1, v=40, temperature=3.0),
}


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_against_float64(dtype, name, frozen, monkeypatch):
    cfg = dict(CONFIGS[name])
    n, h, v = 24, 32, cfg.pop("v", 1000)
    cols = cfg.pop("chunk_cols", None)
    temperature = cfg.pop("temperature", 1.0)
    entropy = cfg.pop("entropy", True)
    int32 = cfg.pop("int32", False)
    hidden, weight, bias, labels = make_head(n, h, v, dtype, seed=list(CONFIGS).index(name), **cfg)
    if int32:
        labels = labels.int()
    ignore = -100 if cfg.get("ignore_frac") else None
    # row tiles of 16: the 24 rows (fewer when ignored) in a full and a zero-padded tile. A frozen bf16 head both
    # ways whatever this CPU is: fp32 copies, and a CPU that multiplies bf16 natively (bf16 products for the
    # log-prob vector; with the entropy's gradient, the recompute: heads/frozen.py)
    for native in (False, True) if frozen and dtype == torch.bfloat16 else (None,):
        if native is not None:
            from twinkle_mem.heads import frozen as frozen_module
            for module in (engine, frozen_module):
                monkeypatch.setattr(module, "native_reduced_products", lambda d, device, n=native: n)
        check_against_float64(hidden, weight, bias, labels, temperature=temperature, ignore_index=ignore,
                              entropy=entropy, cols=cols, rows=16, frozen=frozen)


@pytest.mark.parametrize("declared", [True, None], ids=["entropy_grad=True", "default"])
@pytest.mark.parametrize("native", [False, True], ids=["fp32 copies", "native bf16"])
def test_frozen_bf16_entropy_gradient(monkeypatch, native, declared):
    """bf16, a frozen head, the entropy's gradient too. Declared (entropy_grad=True): summed in the forward from fp32
    copies (an fp32 [N, H] vector saved per output), or, on a CPU that multiplies bf16 natively, recomputed in the
    backward as a trainable head's (frozen.recompute_is_cheaper: no vector saved). Not declared (the default): the
    log-probs' vector alone in the forward, and the gradient that reaches the entropy after all honoured by the
    recompute. Every way within the op's bound of float64."""
    from twinkle_mem.heads import frozen
    monkeypatch.setattr(frozen, "native_reduced_products", lambda dtype, device: native)
    monkeypatch.setattr(engine, "native_reduced_products", lambda dtype, device: native)
    for name in ("blocks, T=0.7, ignored rows", "k=3 labels, some ignored"):
        cfg = dict(CONFIGS[name])
        cols, temperature = cfg.pop("chunk_cols"), cfg.pop("temperature", 1.0)
        hidden, weight, bias, labels = make_head(24, 32, 1000, torch.bfloat16, seed=list(CONFIGS).index(name), **cfg)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            check_against_float64(hidden, weight, bias, labels, temperature=temperature,
                                  ignore_index=-100 if cfg.get("ignore_frac") else None, cols=cols, rows=16,
                                  frozen=True, entropy_grad=declared)
        vectors = [t for t in saved if t.dtype == torch.float32 and t.shape == (24, 32)]
        assert len(vectors) == (1 if not declared else 0 if native else 2), name


def test_native_bf16_products_only_where_the_cpu_has_them(monkeypatch):
    """bf16 products replace fp32 copies on the CPU path avx512_bf16 alone (elsewhere torch's bf16 product is far
    slower than fp32, docs/cpu.md); TWINKLE_MEM_CPU_ISA caps it; never for fp16 or off the CPU."""
    from twinkle_mem.heads.matmul import native_reduced_products
    from twinkle_mem.op.native import cpu_kernel_path
    cpu = torch.device("cpu")
    assert not native_reduced_products(torch.float16, cpu)
    assert not native_reduced_products(torch.float32, cpu)
    assert not native_reduced_products(torch.bfloat16, torch.device("cuda"))
    monkeypatch.setenv("TWINKLE_MEM_CPU_ISA", "avx2")
    assert not native_reduced_products(torch.bfloat16, cpu)
    monkeypatch.setenv("TWINKLE_MEM_CPU_ISA", "no_such_path")  # the op refuses it; no claim here
    assert not native_reduced_products(torch.bfloat16, cpu)
    monkeypatch.setenv("TWINKLE_MEM_CPU_ISA", "avx512_bf16")
    assert native_reduced_products(torch.bfloat16, cpu) == (cpu_kernel_path() == "avx512_bf16")


def test_recompute_only_where_it_is_cheaper(monkeypatch):
    """A frozen head recomputes in the backward only for bf16 with the entropy's vector on a CPU that multiplies
    bf16 natively (its two fp32 products cost more there than one bf16 and one fp32); else it sums in the forward."""
    from twinkle_mem.heads import frozen
    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(frozen, "native_reduced_products", lambda dtype, device, n=native: n)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for entropy_vector in (False, True):
                want = native and entropy_vector and dtype == torch.bfloat16
                assert frozen.recompute_is_cheaper(dtype, cpu, entropy_vector) == want, (native, dtype, entropy_vector)


def _unfused(hidden, weight, bias, labels, g_logp, g_ent, temperature):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = h @ w.t() + (0 if bias is None else bias)
    logp, ent = twinkle_mem.selective_log_softmax(logits, labels, True, temperature=temperature)
    return torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w))


@pytest.mark.parametrize("dtype,rounded,within", [(torch.bfloat16, False, 1.1), (torch.bfloat16, True, 1.3),
                                                  (torch.float16, False, 1.1)],
                         ids=["bf16, fp32 copies", "bf16 products", "fp16"])
def test_reduced_precision_gradients_no_worse_than_unfused(monkeypatch, dtype, rounded, within):
    # grad_hidden is summed over vocab blocks and grad_weight over row tiles: in fp32, then rounded once. From fp32
    # copies of the operands that is as close to float64 as the unfused path's one matmul over the whole vocab
    # (RMS within 1.1x). With bf16 products (a CPU that multiplies bf16 natively: matmul.RoundedSums) each block's
    # product is rounded to bf16 once before the fp32 sum: 1.23x the unfused path's RMS error at 32 blocks here
    # and at V = 151936's 19 (docs/linear.md); summing those products in bf16 instead would grow with the blocks.
    monkeypatch.setattr(plans, "product_sums", lambda d, device, logits_dtype=None: (
        "straight" if d not in (torch.bfloat16, torch.float16) else "rounded" if rounded else "copies"))
    n, h, v = 64, 64, 8192
    hidden, weight, bias, labels = make_head(n, h, v, dtype, bias=False, seed=5)
    gen = torch.Generator().manual_seed(9)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ref = linear_selective_log_softmax_ref(hidden, weight, None, labels, g_logp, g_ent, 1.0, None)
    ref_h, ref_w = ref["d"] @ weight.double(), ref["d"].t() @ hidden.double()
    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with blocks(256, 16):  # 32 vocab blocks, 4 row tiles: grad_hidden and grad_weight summed in fp32
        logp, ent = lsls(hf, wf, labels, True)
        fused = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (hf, wf))
    unfused = _unfused(hidden, weight, None, labels, g_logp, g_ent, 1.0)
    rms = lambda g, r: ((g.double() - r) ** 2).mean().sqrt().item()  # noqa: E731
    for name, f, u, r in (("hidden", fused[0], unfused[0], ref_h), ("weight", fused[1], unfused[1], ref_w)):
        assert rms(f, r) <= within * rms(u, r), f"grad_{name}: RMS error {rms(f, r):.3g} vs unfused {rms(u, r):.3g}"


@pytest.mark.parametrize("rounded", [False, True], ids=["fp32 copies", "bf16 products"])
def test_frozen_bf16_no_worse_than_unfused(monkeypatch, rounded):
    # A frozen head's log-prob vector, summed over 32 vocab blocks: bf16 products rounded once per row tile and
    # block (a CPU that multiplies bf16 natively) must stay as close to float64 as the unfused path's one bf16
    # product over the whole vocab, on randn rows and peaked ones (hidden x40).
    monkeypatch.setattr(engine, "native_reduced_products", lambda dtype, device: rounded)
    taken, made = [], engine.BlockProducts.__init__

    def spy(self, *args, **kwargs):
        made(self, *args, **kwargs)
        taken.append(self.rounded)

    monkeypatch.setattr(engine.BlockProducts, "__init__", spy)
    n, h, v = 64, 64, 8192
    for scale in (1.0, 40.0):
        hidden, weight, _, labels = make_head(n, h, v, torch.bfloat16, bias=False, seed=5)
        hidden = hidden * scale
        g = torch.randn(n, generator=torch.Generator().manual_seed(9))
        ref = linear_selective_log_softmax_ref(hidden, weight, None, labels, g, None, 1.0, None)["d"] @ weight.double()
        hf = hidden.clone().requires_grad_()
        with blocks(256, 16):
            fused, = torch.autograd.grad((lsls(hf, weight, labels, False, entropy_grad=False) * g).sum(), hf)
        hu = hidden.clone().requires_grad_()
        unfused, = torch.autograd.grad((twinkle_mem.selective_log_softmax(hu @ weight.t(), labels) * g).sum(), hu)
        rms = lambda t: ((t.double() - ref) ** 2).mean().sqrt().item()  # noqa: E731
        assert rms(fused) <= 1.1 * rms(unfused), f"x{scale}: RMS error {rms(fused):.3g} vs unfused {rms(unfused):.3g}"
    assert taken == [rounded, rounded]  # the path asked for is the one taken


def test_float64_tight_and_gradcheck():
    hidden, weight, bias, labels = make_head(7, 5, 50, torch.float64, k=2, ignore_frac=0.3, seed=3)
    hidden = hidden + torch.randn_like(hidden) * 0.1  # not dyadic: float64 is exact enough
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))

    def f(h, w, b):
        return lsls(h, w, labels, True, bias=b, temperature=0.8, ignore_index=-100)
    with blocks(13, 16):
        assert torch.autograd.gradcheck(f, (h, w, b))
        logp, ent = f(h, w, b)
    ref = linear_selective_log_softmax_ref(hidden, weight, bias, labels, torch.zeros(7, 2), None, 0.8, -100)
    torch.testing.assert_close(logp, ref["logp"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref["entropy"], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ ignored rows
def _mm_shapes(fn):
    """Input shapes of every aten matmul run inside fn (the profiler sees inside the custom ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]


def test_ignored_rows_cost_no_matmul_and_give_zeros():
    n, h, v = 40, 16, 900
    hidden, weight, bias, labels = make_head(n, h, v, torch.float32, seed=4)
    labels[::4] = -100
    labels[1::4] = -100
    labels[2::4] = -100  # 3/4 of the rows ignored
    kept = int((labels != -100).sum())
    hf, wf, bf = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = {}
    tile, cols = 32, 256  # 10 kept rows: one row tile, of 16 rows (the CPU plan's quantum); all 40 would take two
    held = 16

    def run():
        logp, ent = lsls(hf, wf, labels, True, bias=bf, ignore_index=-100)
        out["logp"], out["ent"] = logp, ent
        out["grads"] = torch.autograd.grad(logp.sum() + ent.sum(), (hf, wf, bf))
    with blocks(cols, tile):
        shapes = _mm_shapes(run)
    assert shapes, "no matmul seen by the profiler"
    for name, inputs in shapes:
        assert any(len(s) == 2 and held in s for s in inputs), f"{name} not on the kept rows' tile: {inputs}"
        assert not any(len(s) == 2 and n in s for s in inputs), f"{name} saw all {n} rows: {inputs}"
    n_blocks = -(-v // cols)
    logits_tiles = [i for name, i in shapes if name in ("aten::mm", "aten::addmm") and [held, h] in i]
    # the forward's logits and the backward's recomputed ones: one tile per block each (the kept rows' only one)
    assert len(logits_tiles) == 2 * n_blocks * -(-kept // tile), (len(logits_tiles), n_blocks)
    dropped = labels == -100
    assert (out["logp"][dropped] == 0).all() and (out["ent"][dropped] == 0).all()
    assert (out["grads"][0][dropped] == 0).all()
    check_against_float64(hidden, weight, bias, labels, ignore_index=-100, cols=cols, rows=tile)


def test_all_rows_ignored_and_empty():
    hidden, weight, bias, labels = make_head(6, 8, 50, torch.float32, seed=6)
    labels[:] = -100
    hf, wf, bf = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, ent = lsls(hf, wf, labels, True, bias=bf, ignore_index=-100)
    assert (logp == 0).all() and (ent == 0).all()
    grads = torch.autograd.grad(logp.sum() + ent.sum(), (hf, wf, bf))
    assert all((g == 0).all() for g in grads)
    logp, ent = lsls(hf[:0], wf, labels[:0], True)
    assert logp.shape == (0,) and ent.shape == (0,)


def test_entropy_only_k0_labels():
    hidden, weight, bias, _ = make_head(5, 8, 70, torch.float32, seed=8)
    no_labels = torch.zeros(5, 0, dtype=torch.long)
    with blocks(16, 16):
        logp, ent = lsls(hidden, weight, no_labels, True, bias=bias)
    ref = linear_selective_log_softmax_ref(hidden, weight, bias, no_labels, torch.zeros(5, 0), None, 1.0, None)
    assert logp.shape == (5, 0)
    torch.testing.assert_close(ent.double(), ref["entropy"], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ what is saved, what is allocated
def test_saves_only_the_inputs_and_row_statistics():
    n, h, v = 30, 16, 2000
    hidden, weight, bias, labels = make_head(n, h, v, torch.float32, ignore_frac=0.3, seed=10)
    hf, wf, bf = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with blocks(300, 16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = lsls(hf, wf, labels, True, bias=bf, ignore_index=-100)
        (logp.sum() + ent.sum()).backward()
    inputs = {t.untyped_storage().data_ptr() for t in (hf, wf, bf, labels)}
    assert saved
    for t in saved:
        if t.untyped_storage().data_ptr() in inputs:
            continue  # a reference to an input (a view of it, not a copy)
        assert t.numel() <= n, f"saved {tuple(t.shape)} {t.dtype}: neither an input nor O(N)"


def test_no_tensor_of_the_logits_size_goes_through_any_op():
    # Every aten op run inside the fused path (the profiler sees inside the custom ops), with the shapes of
    # its inputs: none is [N, V]-sized, and the logits blocks [rows, c] fit in chunk_bytes.
    n, h, v = 32, 8, 4096
    hidden, weight, bias, labels = make_head(n, h, v, torch.bfloat16, seed=11)
    hf, wf, bf = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    cols, tile = 512, 16
    with blocks(cols, tile):
        chunk = smallest_chunk(v, h, torch.bfloat16)  # the backward: the fewest row tiles in flight

        def run():
            logp, ent = lsls(hf, wf, labels, True, bias=bf, chunk_bytes=chunk)
            torch.autograd.grad(logp.sum() + ent.sum(), (hf, wf, bf))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            run()
    shapes = [s for e in prof.events() for s in e.input_shapes if s]
    biggest = max(math.prod(s) for s in shapes)
    assert biggest < n * v, f"a tensor of {biggest} elements went through an op (N V = {n * v})"
    logits = [s for s in shapes if len(s) == 2 and s[1] == cols and s[0] % tile == 0]
    assert logits, "no logits block seen"
    assert max(b[0] for b in logits) * cols * 2 <= chunk, f"logits blocks larger than chunk_bytes allows: {logits[:3]}"
    assert [tile, cols] in logits, "no block of one row tile (a product's) seen"


def test_block_plan():
    # Block widths from the vocab, H and the device's plan alone (the CPU's: wider below H = 1024, cols x H no more
    # than at 1024, at most 4 x 8192; a GPU's: 4 x 8192 at any H); chunk_bytes only sets how many row tiles share a
    # step (the CPU's; a GPU's steps are fixed), and narrows the blocks where one step of them would not fit.
    cpu, gpu = plans.PLANS["cpu"], plans.PLANS["cuda"]
    assert block_width(1000, 1024, cpu) == 1000 and block_width(151936, 1024, cpu) == cpu.vocab_block == 8192
    assert [block_width(151936, h, cpu) for h in (4096, 1025, 1024, 768, 512, 300, 256, 64, 1)] == [
        8192, 8192, 8192, 8192, 16384, 24576, 32768, 32768, 32768]
    assert [block_width(151936, h, gpu) for h in (8192, 3584, 1536, 64)] == [32768] * 4
    assert block_width(20000, 256, cpu) == 20000
    tile = cpu.row_tile * 4096 * 4  # one fp32 tile of logits
    assert tiles_in_flight(4096, 64, torch.float32, 3 * tile + 5, cpu, "straight", False) == 3
    assert tiles_in_flight(4096, 64, torch.float32, 3 * tile + 5, cpu, "straight", True) == 3  # fp32: nothing else
    # bf16 backward from fp32 copies: + fp32 weight block and grad_weight accumulator (2 x 4 B x cols x H), grad_bias
    # accumulator, fp32 copies of one gradient tile and one hidden tile
    fixed = 4 * (2 * 4096 * 64 + 4096 + cpu.row_tile * (4096 + 64))
    assert step_bytes(4096, 64, torch.bfloat16, cpu, "copies", True) == (tile // 2, fixed)
    assert tiles_in_flight(4096, 64, torch.bfloat16, fixed + 2 * (tile // 2), cpu, "copies", True) == 2
    # bf16 products (a CPU that multiplies bf16): the fp32 sums, the bf16 products and the fp32 piece they go through
    rounded = 4 * (4096 * 64 + 4096) + 2 * 4096 * 64 + 4 * 1024 * 64 + 6 * cpu.row_tile * 64
    assert step_bytes(4096, 64, torch.bfloat16, cpu, "rounded", True) == (tile // 2, rounded)
    # A widened block holds as many rows at once as vocab_block-wide ones would (its buffer no larger), >= 1 tile
    wide = cpu.row_tile * 32768 * 4
    assert tiles_in_flight(32768, 256, torch.float32, 4 * wide, cpu, "straight", False) == 1
    assert tiles_in_flight(16384, 512, torch.float32, 8 * (wide // 2), cpu, "straight", False) == 4
    assert tiles_in_flight(32768, 256, torch.float32, wide, cpu, "straight", False) == 1
    # A GPU's step is its fixed rows whatever the budget
    assert tiles_in_flight(8192, 1024, torch.bfloat16, 1 << 40, gpu, "mixed", True) == gpu.step_rows // gpu.row_tile
    # A budget narrows the blocks by whole vocab_blocks to the widest whose step fits every pass (the same whether
    # autograd is on), down to one unwidened block
    for sums in ("copies", "rounded"):
        need = lambda cols: block_need(cols, 64, torch.bfloat16, cpu, sums)  # noqa: E731
        assert need(32768) == max(sum(step_bytes(32768, 64, torch.bfloat16, cpu, sums, True)),
                                  sum(step_bytes(32768, 64, torch.bfloat16, cpu, sums, False, 2)))
        assert fit_width(151936, 64, torch.bfloat16, need(32768), cpu, sums) == 32768
        assert fit_width(151936, 64, torch.bfloat16, need(32768) - 1, cpu, sums) == 24576
        assert fit_width(151936, 64, torch.bfloat16, need(8192), cpu, sums) == 8192
        with pytest.raises(ValueError, match="below one step of a vocab block"):
            fit_width(151936, 64, torch.bfloat16, need(8192) - 1, cpu, sums)
        assert fit_width(5000, 64, torch.bfloat16, need(5000), cpu, sums) == 5000  # (the shard: narrower)
    # the Qwen2.5-7B head's widest blocks fit a GPU's default budget (a frozen bf16 head there sums the log-probs'
    # vector alone: the entropy's is recomputed, frozen.recompute_is_cheaper)
    assert block_need(32768, 3584, torch.bfloat16, gpu, "mixed", 1) <= gpu.chunk_bytes
    assert fit_width(152064, 3584, torch.bfloat16, gpu.chunk_bytes, gpu, "mixed", 1) == 32768


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_buffers_hold_the_rows_present(monkeypatch, frozen):
    # The logits buffer of a call holds its rows (rounded up to the plan's row quantum, 16 on the CPU), not the
    # budget's: a 22-row micro-batch at V = 1019 gets 32 x 1019 logits, not the 2048 x 1019 the budget would hold;
    # N = 600 a tile of 512 and one of 96.
    sizes = []  # (the plan's group of tiles, its width, the buffer's elements) of each sweep's buffer
    logits_buffer = engine.logits_buffer

    def recorded(tiles, plan):
        buf = logits_buffer(tiles, plan)
        sizes.append((plan.group, plan.width, buf.numel()))
        return buf

    monkeypatch.setattr(engine, "logits_buffer", recorded)
    for n in (22, 600):
        hidden, weight, bias, labels = make_head(n, 32, 1019, torch.bfloat16, seed=n)
        h, w = hidden.requires_grad_(), weight.requires_grad_(not frozen)
        logp, ent = lsls(h, w, labels, True, chunk_bytes=2048 * 1019 * 2 + (8 << 20))
        (logp.sum() + ent.sum()).backward()
        rows_held = -(-n // 16) * 16  # the rows present, rounded up to the CPU plan's row quantum
        assert sizes and {numel for *_, numel in sizes} == {rows_held * 1019}, sizes
        assert all(group >= 4 for group, *_ in sizes)  # the budget would have held 4 tiles
        sizes.clear()
    # A budget that holds one tile of an unwidened block, but not of the widest, is accepted (issue 41's example:
    # 96 MiB at H = 64 and V = 32003 where the widest bf16 block's backward took fp32 copies), the blocks narrowed
    hidden, weight, bias, labels = make_head(40, 64, 32003, torch.bfloat16, seed=3)
    chunk = smallest_chunk(32003, 64, torch.bfloat16) - 1
    lsls(hidden.requires_grad_(), weight.requires_grad_(not frozen), labels, chunk_bytes=chunk).sum().backward()
    assert sizes and all(width < 32003 for _group, width, _numel in sizes), sizes


def test_default_chunk_bytes_holds_one_tile():
    # A call without chunk_bytes runs where the plan's default is below one step of a vocab block (bf16 at H = 4096
    # and 8192 columns needs more than 256 MiB): here, small blocks and a default made smaller than one.
    hidden, weight, bias, labels = make_head(40, 16, 300, torch.bfloat16, seed=5)
    hidden.requires_grad_(), weight.requires_grad_()  # a trainable head: the backward's tile is the larger
    with blocks(64, 16):
        smallest = smallest_chunk(300, 16, torch.bfloat16)
        # (blocks() puts every plan back at its end: a monkeypatch undone after it would restore blocks()'s plan)
        plans.PLANS["cpu"] = plans.PLANS["cpu"]._replace(chunk_bytes=smallest - 1)
        got = lsls(hidden, weight, labels, True, bias=bias)
        (grad,) = torch.autograd.grad(got[0].sum() + got[1].sum(), hidden)
        want = lsls(hidden, weight, labels, True, bias=bias, chunk_bytes=smallest)
        (want_grad,) = torch.autograd.grad(want[0].sum() + want[1].sum(), hidden)
        with pytest.raises(ValueError, match="below one step"):
            lsls(hidden, weight, labels, True, bias=bias, chunk_bytes=smallest - 1)
    assert all(torch.equal(a, b) for a, b in zip((*got, grad), (*want, want_grad)))
    for name, plan in plans.PLANS.items():
        for sums in ("copies", "rounded", "mixed"):
            for h in (256, 512, 2560, 4096, 5120, 8192):  # small heads (wide blocks); Qwen3 4B, 8B, 14B, 32B+
                default = plans.default_chunk_bytes(151936, h, torch.bfloat16, plan, sums)
                fit_width(151936, h, torch.bfloat16, default, plan, sums)  # raises where it does not fit
        # (a GPU sums bf16 products in fp32 itself, and recomputes a frozen head's entropy rather than sum its vector)
        sums, vectors = ("mixed", 1) if plan.step_rows else ("copies", 2)
        for h in (64, 256, 512, 1024):  # below H = 2048 the plan's default holds the widest blocks
            assert plans.default_chunk_bytes(151936, h, torch.bfloat16, plan, sums, vectors) == plan.chunk_bytes, name
            assert fit_width(151936, h, torch.bfloat16, plan.chunk_bytes, plan, sums, vectors) == block_width(
                151936, h, plan), (name, h)


# ------------------------------------------------------------------ errors
def test_bad_arguments():
    hidden, weight, bias, labels = make_head(4, 8, 30, torch.float32, seed=12)
    cases = [
        (dict(hidden=hidden[:, :7]), "weight must be"),
        (dict(weight=weight.double()), "dtype"),
        (dict(weight=weight[None]), "weight must be"),
        (dict(hidden=hidden.int()), "hidden must be"),
        (dict(bias=bias[:-1]), "bias must be"),
        (dict(bias=bias.double()), "bias must have"),
        (dict(index=labels.float()), "index must be"),
        (dict(index=labels[:3]), "index shape"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=torch.tensor(1.0)), "temperature"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(chunk_bytes=0), "chunk_bytes"),
        (dict(chunk_bytes=smallest_chunk(30, 8, torch.float32) - 1), "chunk_bytes"),  # below one row tile
    ]
    for change, match in cases:
        args = dict(hidden=hidden, weight=weight, index=labels, bias=bias)
        args.update(change)
        kw = {k: args.pop(k) for k in list(args) if k not in ("hidden", "weight", "index")}
        with pytest.raises(ValueError, match=match):
            lsls(args["hidden"], args["weight"], args["index"], True, **kw)
    if torch.device("meta") != hidden.device:
        with pytest.raises(ValueError, match="on meta"):
            lsls(hidden, weight.to("meta"), labels)
    bad = labels.clone()
    bad[2] = 30
    with pytest.raises(RuntimeError, match="out of range"):
        lsls(hidden, weight, bad)
    bad[2] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        lsls(hidden, weight, bad, ignore_index=-100)


def test_padding_label_without_ignore_index_says_what_to_do():
    # Issue 27: the fused head gives the op's message, naming the entry of the caller's index (not of a row
    # tile: the ignored rows before it are dropped before any tile is formed).
    hidden, weight, _, labels = make_head(12, 16, 30, torch.float32, ignore_frac=0.0, seed=3)
    labels[:5] = 7
    labels[5] = -100
    with pytest.raises(RuntimeError) as err:
        lsls(hidden, weight, labels, ignore_index=7)
    assert str(err.value) == ("twinkle_mem: label out of range: labels.flatten()[5] = -100 is neither a token id in "
                              "[0, 30) (vocab size 30) nor the ignore_index (7); to ignore such positions (logp 0, "
                              "no gradient), pass ignore_index=-100")


# ------------------------------------------------------------------ compile, opcheck, composite
def test_torch_compile_fullgraph():
    hidden, weight, bias, labels = make_head(12, 16, 300, torch.float32, ignore_frac=0.4, seed=13)
    chunk = smallest_chunk(300, 16, torch.float32)

    def step(h, w, b):
        logp, ent = lsls(h, w, labels, True, bias=b, temperature=0.9, ignore_index=-100, chunk_bytes=chunk)
        loss = -(logp * 2.0).sum() + 0.1 * ent.sum()
        return loss, torch.autograd.grad(loss, (h, w, b))

    def fwd_bwd(fn):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        logp, ent = fn(h, w, b)
        loss = -(logp * 2.0).sum() + 0.1 * ent.sum()
        return [loss.detach(), *torch.autograd.grad(loss, (h, w, b))]

    def model(h, w, b):
        return lsls(h, w, labels, True, bias=b, temperature=0.9, ignore_index=-100, chunk_bytes=chunk)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with blocks(64, 16):
        for got, want in zip(fwd_bwd(compiled), fwd_bwd(model)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("entropy_grad,trained", [(True, True), (None, True), (None, False)],
                         ids=["entropy declared", "entropy trained, undeclared", "entropy a metric"])
def test_torch_compile_fullgraph_frozen_bf16(entropy_grad, trained):
    # A frozen bf16 head asks which CPU path runs (a ctypes call) to choose its products and whether to recompute
    # (frozen.recompute_is_cheaper): torch.compile takes that answer at trace time, with no graph break. The same
    # bits as eagerly, but where the entropy is undeclared and untrained: a compiled graph gives the entropy a
    # gradient of zeros, so the head recomputes (the eager head sums the log-prob's vector), within the bound.
    hidden, _, _, labels = make_head(24, 16, 300, torch.bfloat16, ignore_frac=0.3, seed=15)
    weight = make_head(24, 16, 300, torch.bfloat16, seed=16)[1]

    def model(h):
        return lsls(h, weight, labels, True, temperature=0.9, ignore_index=-100, entropy_grad=entropy_grad)

    def fwd_bwd(fn):
        h = hidden.clone().requires_grad_()
        logp, ent = fn(h)
        loss = -(logp * 2.0).sum() + (0.1 * ent.sum() if trained else 0)
        return [loss.detach(), *torch.autograd.grad(loss, h)]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with blocks(64, 16):
        got, want = fwd_bwd(compiled), fwd_bwd(model)
    assert torch.equal(got[0], want[0])
    if trained or entropy_grad:
        assert torch.equal(got[1], want[1])
    else:
        scale = want[1].abs().amax(dim=1, keepdim=True).float()  # bf16: within 2 ulp of each row's largest entry
        assert ((got[1].float() - want[1].float()).abs() <= 2**-7 * scale).all()


def test_opcheck():
    hidden, weight, bias, labels = make_head(9, 8, 200, torch.float32, ignore_frac=0.3, seed=14)
    one, two = torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)  # 1/T
    with blocks(64, 16):
        chunk = smallest_chunk(200, 8, torch.float32)
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        y = labels.view(9, 1)
        torch.library.opcheck(linear_fwd, (h, w, b, y, one, -100, True, chunk, 0, 200, "", False, True))
        torch.library.opcheck(linear_fwd, (h, w, None, y, two, -100, False, chunk, 0, 200, "", False, True))
        _logp, ent, shift, log_sum, _, _ = linear_fwd(hidden, weight, bias, y, one, -100, True, chunk, 0, 200, "",
                                                      False, True)
        torch.library.opcheck(linear_bwd, (torch.randn(9, 1), torch.randn(9), hidden, weight, bias, y, shift,
                                           log_sum, ent, one, -100, chunk, 0, True, True, True))
        # a frozen head: the forward's gradient vectors, the backward from them (and where the entropy's vector was
        # not summed, autograd's checks differentiate the entropy all the same: the recompute)
        frozen_chunk = smallest_chunk(200, 8, torch.float32)
        torch.library.opcheck(linear_fwd, (h, weight, None, y, two, -100, True, frozen_chunk, 0, 200, "", True, True))
        torch.library.opcheck(linear_fwd, (h, weight, None, y, two, -100, True, frozen_chunk, 0, 200, "", True, False))
        *_, vec_logp, vec_entropy = linear_fwd(hidden, weight, None, y, two, -100, True, frozen_chunk, 0, 200, "",
                                               True, True)
        assert vec_logp.shape == vec_entropy.shape == (9, 8)
        torch.library.opcheck(frozen_grad, (torch.randn(9, 1), torch.randn(9), vec_logp, vec_entropy, hidden,
                                            weight, y, two, -100, 0, 200))
        torch.library.opcheck(frozen_grad, (torch.randn(9, 1), None, vec_logp, vec_entropy[:0], hidden, weight, y,
                                            two, -100, 0, 200))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_entropy_as_a_metric(frozen):
    # The entropy a metric (the default, or entropy_grad=False): its value as with entropy_grad=True, the log-probs'
    # gradient bitwise as with entropy_grad=True where the loss leaves the entropy out; a frozen head then saves one
    # [N, H] vector, not two. A gradient that reaches the entropy after all is honoured, eagerly and compiled (never
    # raises): a frozen head recomputes it (the trainable head's backward, grad_hidden alone), within the float64
    # bound of the summed vectors' result.
    hidden, weight, bias, labels = make_head(40, 16, 300, torch.float32, seed=8)

    def run(entropy_grad, use_entropy, compiled=False):
        h = hidden.clone().requires_grad_()
        w, b = (t.clone().requires_grad_(not frozen) for t in (weight, bias))
        saved = []

        def fn(h, w, b):
            return lsls(h, w, labels, True, bias=b, temperature=0.7, entropy_grad=entropy_grad)
        with blocks(64, 16), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            logp, ent = (torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn)(h, w, b)
        loss = logp.sum() + ent.sum() * use_entropy
        with blocks(64, 16):
            grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t.requires_grad])
        return logp, ent, grads, [t for t in saved if t.shape == hidden.shape and t.dtype == torch.float32]

    torch._dynamo.reset()
    logp, ent, grads, saved = run(True, 0)
    _, _, trained, _ = run(True, 1)
    for declared in (None, False):
        for compiled in (False, True):
            m_logp, m_ent, m_grads, m_saved = run(declared, 0, compiled)
            assert torch.equal(m_logp, logp) and torch.equal(m_ent, ent)
            if frozen and compiled:  # (compiled, the entropy's gradient of zeros takes the recompute: not bitwise)
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(m_grads, grads))
            else:
                assert all(torch.equal(a, b) for a, b in zip(m_grads, grads))
            if frozen and not compiled:
                assert len(saved) == 3 and len(m_saved) == 2  # hidden and S (and E where the entropy may get one)
            _, _, got, _ = run(declared, 1, compiled)  # the entropy trained after all: honoured
            for a, b in zip(got, trained):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                assert not (frozen and torch.equal(a, b))  # (a frozen head: the recompute, not the vectors)


def test_composite_backend():
    # The same path where no native kernel exists: torch.ops.twinkle_mem routed to the composite.
    hidden, weight, bias, labels = make_head(16, 16, 700, torch.bfloat16, ignore_frac=0.25, seed=15)
    with composite.forced(("cpu",), budget_bytes=64 << 10):
        check_against_float64(hidden, weight, bias, labels, ignore_index=-100, cols=200, rows=16)
