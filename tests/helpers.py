"""What the test modules share (fixtures are in conftest.py); the CPU stand-ins for twinkle-kit,
megatron-core and mcore_bridge, shared with bench/, are in standins/ at the repository root.

- The op: saved tensors, float64 comparisons, cases, opcheck of the schemas. The accuracy bound
  lives in tests/numerics.py (check_outputs): logp and entropy within 1e-6 absolute + 1e-6 relative
  of float64, gradients within 2 ulp + 2^-22 of the row's largest + the subnormal step, or no worse
  than 2x torch's own fp32 path on the same input.
- The fused LM heads: small vocab blocks and row tiles (``blocks``); their exact LM heads and bounds
  are in head_helpers.py, the distillation's in distill_helpers.py; the float64 references in the
  package, one ``reference`` module per layer (twinkle_mem.op/heads/distill.reference).
- The fused head in twinkle-kit: the shared model sizes, a recording GRPOLoss, the tolerance, a
  dispatch mode that sees every tensor an op returns (``VocabTensors``).
- gloo worlds (``Cases``): CPU processes that run a test module's registered cases.
  A module registers cases with ``cases = Cases(__name__, timeout_s[, setup])``
  and ``@cases.register()`` (``@cases.register(2)`` for one world size), then has
  one pytest item per (world, case) check ``cases.failures(world, name)``. ``setup``: a context manager
  factory the workers enter around all cases (process-wide patches a module needs,
  e.g. megatron-core on the CPU). Each world is started once
  (torch.multiprocessing, spawn), imports the module by name and runs every case in
  turn; each case does its collectives first and asserts after, so a failing rank
  cannot leave the others waiting. Per-rank tracebacks come back to the parent. A
  world that does not finish within its timeout is killed and its items fail.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import twinkle_mem
from numerics import check_outputs
from twinkle_mem.heads import plans
from twinkle_mem.heads.logprobs import linear_bwd, linear_fwd


# ------------------------------------------------------------------ the op
@contextlib.contextmanager
def saved_for_backward():
    """``with saved_for_backward() as saved: ...``: every tensor autograd saves inside the block, in order."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def assert_stats_close(got, ref, what):
    """fp32 statistics (logp, entropy) within 1e-6 absolute + 1e-6 relative of float64, same NaN / inf."""
    got = got.double().cpu()
    ref = ref.double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN pattern differs"
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf]), f"{what}: infinities differ"
    finite = torch.isfinite(ref)
    err = (got - ref).abs()
    bad = finite & (err > 1e-6 + 1e-6 * ref.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} values off, max err {err[finite].max().item():.3g}"


def make_case(n, v, dtype, device="cpu", scale=4.0, ignore_frac=0.0, ignore_index=-100, neg_inf_frac=0.0):
    logits = (torch.randn(n, v, dtype=torch.float64) * scale).to(dtype)
    if neg_inf_frac:
        logits[torch.rand(n, v) < neg_inf_frac] = float("-inf")
    labels = torch.randint(0, v, (n,))
    if ignore_frac:
        labels[torch.rand(n) < ignore_frac] = ignore_index
    return logits.to(device), labels.to(device)


def check_against_reference(logits, labels, temperature=1.0, ignore_index=None, with_entropy=True):
    """Forward and backward through the public API against float64 (tests/numerics.py's bound),
    with random upstream gradients."""
    x = logits.detach().requires_grad_(True)  # same storage and strides: a view stays a view
    out = twinkle_mem.selective_log_softmax(x, labels, with_entropy, temperature=temperature,
                                            ignore_index=ignore_index)
    logp, entropy = out if with_entropy else (out, None)
    want = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert logp.dtype == want and logp.shape == labels.shape
    g_logp = torch.randn(labels.shape, dtype=want, device=logits.device)
    g_entropy = torch.randn(logits.shape[:-1], dtype=want, device=logits.device) if with_entropy else None
    total = (logp * g_logp).sum() + ((entropy * g_entropy).sum() if with_entropy else 0)
    (grad,) = torch.autograd.grad(total, x)
    check_outputs("api", logits, labels, temperature, ignore_index, g_logp, g_entropy, logp, entropy, grad)


def check_inplace_backward_matches(device="cpu"):
    """inplace_backward gives the out-of-place gradient bitwise, in the logits' own storage,
    and bumps their version counter."""
    logits, labels = make_case(40, 3001, torch.bfloat16, device, ignore_frac=0.2)
    g = [torch.randn(40, device=device) for _ in range(2)]
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_()
        logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, ignore_index=-100,
                                                          inplace_backward=inplace)
        version = x._version
        (grad,) = torch.autograd.grad((logp * g[0]).sum() + (entropy * g[1]).sum(), x)
        grads.append(grad)
        if inplace:
            assert grad.data_ptr() == x.data_ptr() and x._version > version
    assert torch.equal(grads[0], grads[1])


def opcheck_op_schemas(dtype, device="cpu"):
    """torch.library.opcheck of the forward, backward and in-place backward, on [N, V] rows and on
    a padded [B, S, V] view with [.., k] labels (ignored positions included): the native ops (1/T a
    float) and their wrappers that the public function calls (1/T a 0-dim tensor, ops.fwd_t)."""
    ops = torch.ops.twinkle_mem
    logits = torch.randn(6, 300, device=device).to(dtype)
    labels = torch.tensor([1, 299, -100, 5, 0, 77], device=device)
    padded = torch.randn(2, 4, 310, device=device).to(dtype)[:, :3, :300]  # [B, S, V] view, padded rows
    multi = torch.tensor([[[1, 2], [3, -100], [-100, -100]], [[0, 0], [299, 5], [7, 8]]], device=device)
    op_sets = ((ops.selective_log_softmax_fwd.default, ops.selective_log_softmax_bwd.default,
                ops.selective_log_softmax_bwd_.default, 1.25),
               (ops.selective_log_softmax.default, ops.selective_log_softmax_backward.default,
                ops.selective_log_softmax_backward_.default, torch.tensor(1.25, dtype=torch.float64)))
    for fwd, bwd, bwd_, inv_t in op_sets:
        for x, y in ((logits, labels), (padded, multi)):
            for with_entropy in (False, True):
                torch.library.opcheck(fwd, (x.clone().requires_grad_(), y, inv_t, -100, 0, 300, with_entropy, False))
            _logp, entropy, shift, log_sum = fwd(x, y, inv_t, -100, 0, 300, True, False)
            g = torch.randn(y.shape, device=device)
            g_h = torch.randn(x.shape[:-1], device=device)
            torch.library.opcheck(bwd, (g, g_h, x, y, shift, log_sum, entropy, inv_t, -100, 0))
            torch.library.opcheck(bwd, (g, None, x, y, shift, log_sum, None, inv_t, -100, 0))
            torch.library.opcheck(bwd_, (g, g_h, x.clone(), y, shift, log_sum, entropy, inv_t, -100, 0))


# ------------------------------------------------------------------ the fused LM head
@contextlib.contextmanager
def blocks(cols=None, rows=None, quantum=None, plan=None):
    """The device plans (plans.PLANS) with vocab blocks of `cols` columns at every H, row tiles of `rows` rows and a
    last tile rounded up to `quantum` rows (at most `rows`), for the duration, so that small test sizes see several
    blocks and tiles (None: the plan's own). `plan`: the plan's name every device takes (TWINKLE_MEM_HEAD_PLAN: the
    GPU's plan runs on the CPU)."""
    saved = dict(plans.PLANS)
    forced = os.environ.get("TWINKLE_MEM_HEAD_PLAN")
    for name, p in saved.items():
        changes = {}
        if cols is not None:
            changes.update(vocab_block=cols, max_widen=1)
        if rows is not None:
            changes.update(row_tile=rows, row_quantum=rows if p.step_rows else min(p.row_quantum, rows),
                           step_rows=p.step_rows and max(rows, p.step_rows // p.row_tile * rows))
        if quantum is not None and not p.step_rows:
            changes.update(row_quantum=quantum)
        plans.PLANS[name] = p._replace(**changes)
    if plan is not None:
        os.environ["TWINKLE_MEM_HEAD_PLAN"] = plan
    try:
        yield
    finally:
        plans.PLANS.clear()
        plans.PLANS.update(saved)
        if plan is not None:
            if forced is None:
                os.environ.pop("TWINKLE_MEM_HEAD_PLAN", None)
            else:
                os.environ["TWINKLE_MEM_HEAD_PLAN"] = forced


def json_child(script, cfg: dict) -> dict:
    """``python script '<cfg as JSON>'`` in a fresh process whose freed buffers go back to the OS (a fixed
    glibc mmap threshold, as tests/heads/test_linear_memory.py runs its children); the JSON of its last line.
    tests/ first on its path: a script in a folder below imports these helpers as pytest's run does."""
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=path)
    out = subprocess.run([sys.executable, os.path.abspath(script), json.dumps(cfg)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the fused head in twinkle-kit
VOCAB = 1018  # hidden 32, ffn 64/128, 4 heads, sequences <= 40, 128 positions: no other dim is 1018
SEQ, PROMPT = 40, 12
LENGTHS = [SEQ, SEQ - 7, SEQ - 3, SEQ - 11]  # micro-batches of 2 on Megatron: 80 rows each
CHUNK = 64 << 10  # the fused op's block memory
# Vocab blocks of 128 columns and row tiles of 16 rows (blocks(): the CPU plan's own exceed
# this model's vocab and micro-batches): several blocks and tiles per micro-batch.
FUSED_BLOCKS = (128, 16)
ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0])
TOL = {torch.float32: 1e-4, torch.bfloat16: 2**-6}  # fp32: 1e-4 relative; bf16: 2 eps of the tensor's scale


def grpo(entropy: bool, **attrs):
    """A GRPOLoss that records the log-probs and entropies twinkle hands it."""
    from twinkle.loss import GRPOLoss

    class Recording(GRPOLoss):
        seen = []

        def __call__(self, inputs, outputs, **kwargs):
            self.seen.append((outputs.get("logps"), outputs.get("entropies")))
            return super().__call__(inputs, outputs, **kwargs)

    loss = Recording(entropy_coef=0.1 if entropy else 0.0)
    loss.seen = []
    for name, value in attrs.items():
        setattr(loss, name, value)
    return loss


def twinkle_wrapped(loss):
    """``loss`` as twinkle-kit hands it to its forward steps: in its SafeLossWrapper (0.5.0 on), else itself."""
    try:
        from twinkle.utils.nccl_safe import SafeLossWrapper
    except ImportError:  # twinkle-kit 0.4.0: no wrapper
        return loss
    return SafeLossWrapper(loss)


def twinkle_has(feature: str):
    """Whether this process's twinkle-kit has a feature install() reads from its code (twinkle_names.FEATURES)."""
    from twinkle_mem.integrations.twinkle import FRAMEWORK
    return FRAMEWORK.found().features[feature]


def assert_close(got, want, dtype, what):
    tol = TOL[dtype]
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def scale_output(chunk):  # a post-processing the static checks do not know about
    chunk.register_forward_hook(lambda module, args, output: output * 1.0)


class OpsInside(TorchDispatchMode):
    """A dispatch mode that also sees the ops inside twinkle-mem's Python custom ops ``python_ops`` (run with the
    mode on); ``seen(func, args, kwargs, out)`` looks at each op's results."""

    def __init__(self, python_ops=()):
        super().__init__()
        self.python_ops = {op._opoverload: op._init_fn for op in python_ops}

    def seen(self, func, args, kwargs, out) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.python_ops:
            with self:
                out = self.python_ops[func](*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.seen(func, args, kwargs, out)
        return out


class VocabTensors(OpsInside):
    """Every tensor any op returns while active, also inside twinkle-mem's Python custom ops
    (the fused head's; others added to ``python_ops``): those with a last dim in ``vocab_dims``, and those
    of at least ``numel`` elements."""

    def __init__(self, vocab_dims, numel, exempt=()):
        super().__init__((linear_fwd, linear_bwd))
        self.vocab_dims, self.numel = tuple(vocab_dims), numel
        # views of these (a local teacher's logits: an input of the step) are not counted
        self.exempt = {t.untyped_storage().data_ptr() for t in exempt}
        self.last_dim, self.large, self.ops = [], [], 0

    def seen(self, func, args, kwargs, out) -> None:
        self.ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().data_ptr() not in self.exempt:
                if t.shape[-1] in self.vocab_dims:
                    self.last_dim.append((str(func), tuple(t.shape)))
                if t.numel() >= self.numel:
                    self.large.append((str(func), tuple(t.shape)))


# ------------------------------------------------------------------ twinkle's GKD (distillation) calls
GKD_K = 8  # the teacher's top-k in the integration tests


def gkd_teacher(seed=1):
    """Top-k teacher log-probs and ids as twinkle's GKD recipe builds them: [len(LENGTHS), SEQ + 3, GKD_K]
    (longer than the student's sequence: GKDLoss trims it), log-probs sorted, and the recipe's padding (ids 0,
    log-probs 0.0) past each sample's last label."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), SEQ + 3, GKD_K)
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:GKD_K] for _ in range(shape[0] * shape[1])]).view(shape)
    logprobs = torch.log_softmax(3 * torch.randn(shape, generator=gen), dim=-1).sort(dim=-1, descending=True).values
    for b, n in enumerate(LENGTHS):
        ids[b, n - 1:] = 0
        logprobs[b, n - 1:] = 0.0
    return dict(teacher_topk_logprobs=logprobs, teacher_topk_indices=ids)


def gkd_local_teacher(topk=None, seed=2, vocab=VOCAB):
    """A local teacher's logits as GKDLoss takes them (``teacher_logits=``, [len(LENGTHS), SEQ + 3, vocab]),
    with ``topk`` or over the whole vocab."""
    gen = torch.Generator().manual_seed(seed)
    return dict(teacher_logits=3 * torch.randn(len(LENGTHS), SEQ + 3, vocab, generator=gen), topk=topk)


GKD_TEACHERS = {"topk": gkd_teacher, "local_topk": lambda: gkd_local_teacher(GKD_K), "local": gkd_local_teacher}


@contextlib.contextmanager
def gkd_in_float64():
    """twinkle's own GKD arithmetic in float64 (the loss rounded once, to fp32 or the logits' wider dtype): the
    exact reference of a twinkle step."""
    from twinkle.loss.gkd import GKDLoss
    original = GKDLoss.__dict__["_generalized_jsd_loss"]

    def exact(student_logits, teacher_logits=None, teacher_topk_logprobs=None, **kwargs):
        as64 = (lambda t: t.double() if t is not None else None)  # noqa: E731
        loss = original.__func__(as64(student_logits), teacher_logits=as64(teacher_logits),
                                 teacher_topk_logprobs=as64(teacher_topk_logprobs), **kwargs)
        return loss.to(torch.promote_types(student_logits.dtype, torch.float32))  # (bf16 logits: fp32)

    GKDLoss._generalized_jsd_loss = staticmethod(exact)
    try:
        yield
    finally:
        GKDLoss._generalized_jsd_loss = original


# ------------------------------------------------------------------ gloo worlds
class Cases:
    def __init__(self, module_name: str, timeout_s: float, setup=contextlib.nullcontext):
        self.module_name = module_name
        self.timeout_s = timeout_s
        self.setup = setup
        self.cases = {}  # name -> (fn, world sizes)
        self._worlds = {}

    def register(self, *worlds):
        def add(fn):
            self.cases[fn.__name__] = (fn, worlds or (2, 4))
            return fn
        return add

    def params(self):
        """(world, name) pairs for pytest.mark.parametrize; a world of more than 2 processes (more than this 2-core
        machine's cores) in the end-to-end tier (the marker e2e, pyproject.toml)."""
        return [pytest.param(w, n, marks=pytest.mark.e2e) if w > 2 else (w, n)
                for n, (_fn, ws) in self.cases.items() for w in ws]

    def failures(self, world: int, name: str) -> list[str]:
        if world not in self._worlds:
            try:
                self._worlds[world] = _run_world(self.module_name, world, self.timeout_s)
            except Exception as e:  # noqa: BLE001  (every item of this world reports it)
                self._worlds[world] = e
        per_rank = self._worlds[world]
        if isinstance(per_rank, Exception):
            raise per_rank
        return [f"rank {r}:\n{res[name]}" for r, res in enumerate(per_rank) if res.get(name, "missing")]


def _worker(rank, world, init_file, out_dir, module_name):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cases = importlib.import_module(module_name).cases
    results = {}
    try:
        with cases.setup():
            for name, (fn, worlds) in cases.cases.items():
                if world not in worlds:
                    continue
                try:
                    fn(rank, world)
                    results[name] = None
                except Exception:  # noqa: BLE001  (reported to the parent, per case)
                    results[name] = traceback.format_exc()
                dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _run_world(module_name, world, timeout_s):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, module_name), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo world of {world} did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank
