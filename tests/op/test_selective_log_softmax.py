"""selective_log_softmax / entropy_from_logits: numerics against the float64
reference, gradients, opcheck, torch.compile, memory, in-place backward,
determinism and bad input. Every test runs on each device in
TWINKLE_MEM_TEST_DEVICES (default: cpu)."""
import contextlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinkle_mem
from twinkle_mem.op import composite
from numerics import quiet_nan
from helpers import (assert_stats_close, check_against_reference, check_inplace_backward_matches, make_case,
                     opcheck_op_schemas, saved_for_backward)
from twinkle_mem.op.reference import selective_log_softmax_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ops = torch.ops.twinkle_mem


# ----------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_reference(device, dtype, with_entropy, temperature):
    logits, labels = make_case(37, 5003, dtype, device)  # odd V: SIMD tails
    check_against_reference(logits, labels, temperature, with_entropy=with_entropy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen_vocab_few_rows(device, dtype):
    # V = 151936 with N < threads: rows are split into vocab segments and merged.
    logits, labels = make_case(3, 151936, dtype, device, scale=6.0)
    check_against_reference(logits, labels, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_index(device, dtype):
    logits, labels = make_case(64, 999, dtype, device, ignore_frac=0.4, ignore_index=-100)
    check_against_reference(logits, labels, 0.9, ignore_index=-100)
    logp, entropy = twinkle_mem.selective_log_softmax(logits, labels, True, ignore_index=-100)
    ignored = labels == -100
    assert ignored.any() and (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_infinity_logits(device, dtype):
    # Masked vocab entries (-inf) have probability 0 and gradient 0; not NaN.
    logits, labels = make_case(16, 3000, dtype, device, neg_inf_frac=0.3)
    logits[:, :2500] = float("-inf")  # whole blocks of -inf before finite values
    labels = torch.randint(2500, 3000, (16,), device=device)
    logits[torch.arange(16, device=device), labels] = 1.0  # labels on unmasked entries...
    labels[0] = 0  # ...but one: the label itself is masked, logp = -inf
    check_against_reference(logits, labels)
    logp = twinkle_mem.selective_log_softmax(logits, labels)
    assert logp[0] == float("-inf") and torch.isfinite(logp[1:]).all()


def test_nan_propagates(device):
    logits, labels = make_case(4, 5000, torch.float32, device)
    logits[1, 4321] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 17] = float("nan")
    logp, entropy = twinkle_mem.selective_log_softmax(logits, labels, True)
    assert torch.isnan(logp[1]) and torch.isnan(entropy[1]) and torch.isnan(logp[2])
    assert torch.isfinite(logp[[0, 3]]).all() and torch.isfinite(entropy[[0, 3]]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_nan_among_neg_inf_through_autograd(device, dtype, inplace):
    # Issue 41: a NaN of either sign in a block that is otherwise -inf, the rest of the row finite. torch gives
    # NaN log-prob, entropy and gradient for the row; so must the public function, through autograd.
    base, labels = make_case(3, 20000, dtype, device)
    base[:, 8192:16384] = float("-inf")
    base[0, 9000] = quiet_nan(dtype, negative=False).to(device)
    base[1, 9000] = quiet_nan(dtype, negative=True).to(device)
    leaf = base.clone().requires_grad_()
    logits = leaf * 1  # an intermediate, as an LM head's output is
    logp, entropy = twinkle_mem.selective_log_softmax(logits, labels, True, inplace_backward=inplace)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    want_logp, want_entropy = (base.float().log_softmax(-1).gather(-1, labels[:, None])[:, 0],
                               -(base.float().softmax(-1) * base.float().log_softmax(-1)).sum(-1))
    assert want_logp[:2].isnan().all() and want_entropy[:2].isnan().all()  # torch's answer
    assert logp[:2].isnan().all() and entropy[:2].isnan().all() and grad[:2].isnan().all()
    assert logp[2].isfinite() and entropy[2].isfinite() and grad[2].isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_rows_and_leading_dims(device, dtype):
    big, _ = make_case(2 * 9, 700, dtype, device)
    logits = big.view(2, 9, 700)[:, :, :611]  # row stride 700 > V = 611, no copy needed
    labels = torch.randint(0, 611, (2, 9), device=device)
    assert not logits.is_contiguous()
    check_against_reference(logits, labels)
    check_against_reference(logits[0], labels[0])  # 2-D, row stride 700


def _no_warning(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def _views_bullet():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "op.md").read_text()
    start = text.index("- **Views, no copies:**")
    return " ".join(text[start:text.index("\n- ", start + 1)].split())


def test_views_accepted_and_rejected_as_the_docs_say(device):
    # docs/op.md: unit vocab stride + non-overlapping rows are read in place (no copy, no warning, the
    # in-place gradient lands in the view's own storage); overlapping rows raise the quoted error.
    bullet = _views_bullet()
    quoted = "twinkle_mem: logits rows must not overlap"
    assert quoted in bullet and "expanded (stride-0)" in bullet
    v = 40
    base = torch.randn(6, 8, v + 3, device=device)
    accepted = {"transposed [S, B, V]": lambda b: b[..., :v].transpose(0, 1),
                "stepped and padded rows": lambda b: b[::2, 1::3, :v],
                "as_strided, gaps between rows": lambda b: b.view(-1).as_strided((5, 7, v), (9 * (v + 3), v + 3, 1))}
    for name, make in accepted.items():
        storage = base.clone()
        x = make(storage)
        y = torch.randint(0, v, x.shape[:-1], device=device)
        dense = x.contiguous().requires_grad_()
        want = twinkle_mem.selective_log_softmax(dense, y.contiguous(), True)
        want = (*want, *torch.autograd.grad(want[0].sum() + want[1].sum(), dense))
        x.requires_grad_()
        got = _no_warning(lambda: twinkle_mem.selective_log_softmax(x, y, True, inplace_backward=True))
        got = (*got, *torch.autograd.grad(got[0].sum() + got[1].sum(), x))
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
        assert torch.equal(x.detach(), want[2]), name  # the gradient was written through the view
    rejected = {"expanded (stride-0) rows": torch.randn(1, v, device=device).expand(4, v),
                "expanded sequence dim": torch.randn(2, 1, v, device=device).expand(2, 3, v),
                "overlapping as_strided windows": torch.randn(200, device=device).as_strided((4, v), (10, 1))}
    for name, x in rejected.items():
        with pytest.raises(RuntimeError, match=quoted):
            twinkle_mem.selective_log_softmax(x, torch.zeros(x.shape[:-1], dtype=torch.long, device=device))
    # Labels may be expanded views.
    x = torch.randn(4, v, device=device)
    y = torch.tensor([3], device=device).expand(4)
    assert torch.equal(twinkle_mem.selective_log_softmax(x, y), twinkle_mem.selective_log_softmax(x, y.contiguous()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliced_sequences_are_views_bitwise_equal_to_contiguous(device, dtype):
    # TRL's logits[:, :-1] and verl's logits[:, -r - 1:-1] of a [B, S, V] batch: separate batch and
    # sequence strides, no copy, no warning; the same bits as the contiguous copy, in place too.
    b, s, v, r = 4, 9, 1001, 5
    full, _ = make_case(b * s, v, dtype, device)
    full = full.view(b, s, v)
    ids = torch.randint(0, v, (b, s + 1), device=device)
    for sl, lab in ((slice(None, -1), ids[:, 1:-1]), (slice(-r - 1, -1), ids[:, -r - 1:-1])):
        view = full[:, sl]
        assert not view.is_contiguous() and not lab.is_contiguous()
        dense = view.contiguous()
        for inplace in (False, True):
            outs = []
            for x0, y in ((view, lab), (dense, lab.contiguous())):
                if inplace:  # keep the view's layout: write into a strided copy of the batch
                    x = (full.clone()[:, sl] if x0 is view else x0.clone()).requires_grad_()
                else:
                    x = x0.detach().requires_grad_()
                logp, ent = _no_warning(lambda: twinkle_mem.selective_log_softmax(
                    x, y, True, temperature=0.9, inplace_backward=inplace))
                (g,) = torch.autograd.grad(logp.sum() + 0.3 * ent.sum(), x)
                outs.append((logp, ent, g))
            for a, c in zip(*outs):
                assert torch.equal(a, c)
        check_against_reference(view, lab, 0.9)


def test_multi_index_labels(device):
    # index [..., k]: k log-probs per row (TRL's top-k form), entropy once per row; k = 1 with a trailing
    # dim, repeated labels and ignored entries; the backward sums repeated labels' gradients.
    logits, _ = make_case(2 * 7, 3001, torch.bfloat16, device)
    logits = logits.view(2, 7, 3001)
    for k in (1, 3, 6):
        idx = torch.randint(0, 3001, (2, 7, k), device=device)
        if k > 1:
            idx[:, :, -1] = idx[:, :, 0]  # repeated
            idx[0, ::2, 1] = -100  # ignored entries
            idx[1, 3, :] = -100  # a row with every entry ignored: entropy 0, no gradient
        logp = twinkle_mem.selective_log_softmax(logits, idx, ignore_index=-100)
        assert logp.shape == idx.shape and logp.dtype == torch.float32
        check_against_reference(logits, idx, 1.3, ignore_index=-100)
    # k = 1 with a trailing dim gives the same values as no trailing dim
    y = torch.randint(0, 3001, (2, 7), device=device)
    a = twinkle_mem.selective_log_softmax(logits, y.unsqueeze(-1), True)
    b = twinkle_mem.selective_log_softmax(logits, y, True)
    assert torch.equal(a[0].squeeze(-1), b[0]) and torch.equal(a[1], b[1])


def test_more_leading_dims(device):
    # Leading dims that group into [B, S] are views; ones that cannot are copied, said out loud.
    logits, _ = make_case(2 * 3 * 4, 257, torch.float32, device)
    x = logits.view(2, 3, 4, 257)
    y = torch.randint(0, 257, (2, 3, 4), device=device)
    check_against_reference(x, y)
    odd = x[:, :, :3]  # [2, 3, 3, V] of [2, 3, 4, V]: dims 1 and 2 merge (stride 4V, V) but 0 and 1 do not
    assert torch.equal(_no_warning(lambda: twinkle_mem.selective_log_softmax(odd, y[:, :, :3])),
                       twinkle_mem.selective_log_softmax(odd.contiguous(), y[:, :, :3]))
    worse = x[:, :2, :3]  # no two leading dims merge
    with pytest.warns(UserWarning, match="contiguous copy"):
        check_against_reference(worse, y[:, :2, :3])


def test_int32_labels_equal_int64(device):
    logits, labels = make_case(33, 4097, torch.bfloat16, device)
    a = twinkle_mem.selective_log_softmax(logits, labels, True)
    b = twinkle_mem.selective_log_softmax(logits, labels.int(), True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_and_single_token_vocab(device):
    logits = torch.randn(0, 128, device=device).requires_grad_()
    logp, entropy = twinkle_mem.selective_log_softmax(logits, torch.zeros(0, dtype=torch.long, device=device), True)
    assert logp.shape == (0,) and entropy.shape == (0,)
    logp.sum().backward()
    assert logits.grad.shape == (0, 128)
    one, labels = make_case(5, 1, torch.float32, device)
    check_against_reference(one, labels)  # V = 1: logp = 0, entropy = 0


def test_large_negative_logp_not_bf16_quantized(device):
    # bf16 logits, a target 40 below the max: logp ~ -40 must come back in fp32,
    # where bf16 rounding would be off by up to 0.125.
    logits = torch.randn(8, 32000, dtype=torch.float64)
    labels = torch.randint(0, 32000, (8,))
    logits[torch.arange(8), labels] = -40.0 - torch.rand(8, dtype=torch.float64)
    logits = logits.bfloat16().to(device)
    logp = twinkle_mem.selective_log_softmax(logits, labels.to(device))
    ref = selective_log_softmax_ref(logits, labels.to(device))[0]
    assert logp.dtype == torch.float32
    rel = ((logp.double() - ref.double()) / ref.double()).abs().max().item()
    assert rel < 1e-5, rel
    assert not torch.equal(logp, logp.bfloat16().float())


def test_entropy_from_logits(device):
    logits, _ = make_case(6, 4, torch.float32, device)
    logits3 = make_case(2 * 5, 3001, torch.bfloat16, device)[0].view(2, 5, 3001)
    for x, t in ((logits, 1.0), (logits3, 1.3)):
        entropy = twinkle_mem.entropy_from_logits(x, temperature=t)
        ref = selective_log_softmax_ref(x, torch.zeros(x.shape[:-1], dtype=torch.long, device=device), t)
        assert entropy.shape == x.shape[:-1]
        assert_stats_close(entropy, ref[1], "entropy")


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 40), v=st.integers(1, 9000), dtype=st.sampled_from(DTYPES),
       temperature=st.floats(0.3, 3.0), with_entropy=st.booleans(), ignore=st.booleans(),
       scale=st.floats(0.1, 20.0), seed=st.integers(0, 2**31 - 1))
def test_random_shapes_property(n, v, dtype, temperature, with_entropy, ignore, scale, seed):
    torch.manual_seed(seed)
    for device in __import__("conftest").DEVICES:
        logits, labels = make_case(n, v, dtype, device, scale=scale, ignore_frac=0.3 if ignore else 0.0)
        check_against_reference(logits, labels, temperature, ignore_index=-100 if ignore else None,
                                with_entropy=with_entropy)


# ----------------------------------------------------------------- autograd and registration
def test_gradcheck_float64(device):
    logits = torch.randn(5, 13, dtype=torch.float64, device=device, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 12, 7], device=device)

    def f(x):
        logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, temperature=0.8, ignore_index=-100)
        return logp, entropy

    assert torch.autograd.gradcheck(f, (logits,))
    assert torch.autograd.gradcheck(lambda x: twinkle_mem.selective_log_softmax(x, labels.clamp(min=0)), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    opcheck_op_schemas(dtype, device)


def test_torch_compile_fullgraph(device):
    logits, labels = make_case(24, 1000, torch.bfloat16, device)

    def loss_fn(x, y):
        logp, entropy = twinkle_mem.selective_log_softmax(x, y, True, temperature=0.9, ignore_index=-100)
        return (logp * 2.0).sum() - 0.01 * entropy.sum()

    compiled = torch.compile(loss_fn, fullgraph=True)
    x1 = logits.clone().requires_grad_()
    x2 = logits.clone().requires_grad_()
    eager = loss_fn(x1, labels)
    eager.backward()
    out = compiled(x2, labels)
    out.backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x2.grad, x1.grad)


DOUBLE_BACKWARD = "twinkle_mem.selective_log_softmax does not support double backward"


@pytest.mark.parametrize("variant", ["out_of_place", "inplace_backward", "entropy_from_logits", "composite"])
def test_double_backward_raises_naming_the_op(device, variant):
    # The first-order gradient under create_graph=True is the usual one; differentiating it again raises
    # (it used to give zeros), also when the grad outputs require grad and another term joins the graph.
    logits = torch.randn(6, 50, dtype=torch.float64, device=device)
    labels = torch.tensor([0, 3, -100, 49, 7, 7], device=device)

    def loss(x):
        if variant == "entropy_from_logits":
            return twinkle_mem.entropy_from_logits(x, temperature=0.8).pow(2).sum()
        logp, entropy = twinkle_mem.selective_log_softmax(x, labels, True, temperature=0.8, ignore_index=-100,
                                                          inplace_backward=variant == "inplace_backward")
        return logp.pow(2).sum() + entropy.sum()  # pow: the grad outputs depend on x too

    with composite.forced([device]) if variant == "composite" else contextlib.nullcontext():
        x0 = (logits * 1.0).requires_grad_()
        (want,) = torch.autograd.grad(loss(x0 * 1.0), x0)
        x = logits.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss(x * 1.0), x, create_graph=True)
        assert torch.equal(grad, want)
        with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
            torch.autograd.grad(grad.pow(2).sum() + x.sum(), x)


def test_double_backward_with_constant_grad_outputs_raises(device):
    # Only the saved logits require grad in the backward (loss = logp.sum()): still an error, not a zero.
    x = torch.randn(4, 30, dtype=torch.float64, device=device, requires_grad=True)
    labels = torch.tensor([1, 2, 3, 29], device=device)
    (grad,) = torch.autograd.grad(twinkle_mem.selective_log_softmax(x, labels).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(grad.pow(2).sum(), x, allow_unused=True)


def _linear_head(n, h, v, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=gen, dtype=dtype).to(device) / h ** 0.5
    hidden = torch.randn(n, h, generator=gen, dtype=dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    labels[::5] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("function", ["selective_log_softmax", "linear_selective_log_softmax"])
def test_torch_compile_temperature_and_rows_change_without_recompiles(device, function):
    # An RL temperature schedule under torch.compile (default dynamo settings): N and T change between
    # calls. One recompile when T first changes, one when N first does, none after; outputs and gradients
    # bitwise those of eager.
    from torch._dynamo.testing import CompileCounterWithBackend
    v, h = 300, 16
    weight = _linear_head(1, h, v, torch.float32, device, seed=0)[1].requires_grad_()

    def step(x, y, t):
        if function == "selective_log_softmax":
            return twinkle_mem.selective_log_softmax(x, y, True, temperature=t, ignore_index=-100)
        return twinkle_mem.linear_selective_log_softmax(x, weight, y, True, temperature=t, ignore_index=-100)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    frames = []
    for n, t in [(8, 0.7), (8, 1.0), (16, 1.0), (24, 0.5), (40, 1.3), (64, 0.9)]:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, v if function == "selective_log_softmax" else h, generator=gen).to(device)
        y = torch.randint(0, v, (n,), generator=gen).to(device)
        y[::3] = -100
        results = []
        for fn in (compiled, step):
            xr = x.clone().requires_grad_()
            logp, entropy = fn(xr, y, t)
            inputs = (xr,) if function == "selective_log_softmax" else (xr, weight)
            grads = torch.autograd.grad((logp * 2.0).sum() - 0.1 * entropy.sum(), inputs)
            results.append((logp, entropy, *grads))
        for got, want in zip(*results):
            assert torch.equal(got, want)
        frames.append(counter.frame_count)
    assert frames[0] == 1
    assert frames[1] <= 2, frames  # T changed: at most one recompile
    assert frames[2] <= frames[1] + 1, frames  # N changed: at most one more
    assert frames[3:] == [frames[2]] * 3, frames  # both changing again: none


# ----------------------------------------------------------------- memory
def saved_tensors_during_forward(n, v, with_entropy=True):
    logits = torch.randn(n, v, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,))
    with saved_for_backward() as saved:
        twinkle_mem.selective_log_softmax(logits, labels, with_entropy)
    return logits, saved


def test_saves_nothing_vocab_sized_and_constant_count():
    per_token = {}
    for n in (512, 4096):
        logits, saved = saved_tensors_during_forward(n, 8192)
        others = [t for t in saved if t.data_ptr() != logits.data_ptr()]
        refs = [t for t in saved if t.data_ptr() == logits.data_ptr()]
        assert len(refs) == 1 and refs[0].shape == logits.shape  # a reference, not a copy
        assert all(t.numel() <= n for t in others), [tuple(t.shape) for t in others]
        per_token[n] = (len(saved), sum(t.numel() * t.element_size() for t in others) / n)
    assert per_token[512] == per_token[4096], per_token  # same count, same bytes per token
    assert per_token[4096][1] <= 20  # labels (8) + shift (4) + log_sum (4) + entropy (4)


PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch, twinkle_mem
    from twinkle_mem.measure import peak_rss
    n, v, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(2)
    logits = torch.randn(n, v).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,))
    twinkle_mem.selective_log_softmax(logits[:2], labels[:2], True)[0].sum().backward()  # warm up
    logits.grad = None
    with peak_rss() as peak:
        logp, entropy = twinkle_mem.selective_log_softmax(logits, labels, True,
                                                          inplace_backward=mode.startswith("inplace"))
        if mode == "inplace_into_dot_grad":  # .backward(): autograd keeps the gradient in logits.grad
            (logp.sum() + entropy.sum()).backward()
            grad = logits.grad
        else:
            (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    same = grad.data_ptr() == logits.data_ptr()
    print(peak.bytes, n * v * 2, int(same))
""")


def _run_peak_script(tmp_path, source, *args):
    """``source`` run as a script in a fresh interpreter (its peak RSS its own) with ``args``: the ints it prints."""
    script = tmp_path / "peak.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("mode", ["out_of_place", "inplace", "inplace_into_dot_grad"])
def test_peak_memory_beyond_logits(mode, tmp_path):
    # inplace_into_dot_grad: a leaf's .grad takes the in-place gradient as it is (issue 41: autograd copied it,
    # a whole fresh [N, V] buffer, while the gradient it was handed was the logits tensor itself).
    extra, logits_bytes, same_storage = _run_peak_script(tmp_path, PEAK_SCRIPT, 1024, 65536, mode)
    grad_bytes = 0 if mode.startswith("inplace") else logits_bytes
    assert same_storage == mode.startswith("inplace")
    assert extra - grad_bytes <= 0.01 * logits_bytes, (extra, grad_bytes, logits_bytes)


VIEW_PEAK_SCRIPT = textwrap.dedent("""
    import sys, warnings, torch, twinkle_mem
    from twinkle_mem.measure import peak_rss
    warnings.simplefilter("error")  # a copy would warn
    b, s, v, layout = 4, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(2)
    full = torch.randn(b, s, v).bfloat16()
    ids = torch.randint(0, v, (b, s + 1))
    r = s // 4
    view, labels = {"contiguous": (full, ids[:, 1:]), "trl": (full[:, :-1], ids[:, 1:-1]),
                    "verl": (full[:, -r - 1:-1], ids[:, -r - 1:-1])}[layout]
    view = view.detach().requires_grad_()
    twinkle_mem.selective_log_softmax(view[:1, :2], labels[:1, :2], True)[0].sum().backward()  # warm up
    view.grad = None
    with peak_rss() as peak:
        logp, entropy = twinkle_mem.selective_log_softmax(view, labels, True)
        (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), view)
    print(peak.bytes, view.numel() * 2, grad.untyped_storage().nbytes())
""")


@pytest.mark.parametrize("layout", ["trl", "verl"])
def test_sliced_views_are_not_copied(layout, tmp_path):
    # logits[:, :-1] (TRL) and logits[:, -r - 1:-1] (verl) at B = 4: the peak beyond the gradient's own
    # storage stays within 1% of the view's logits plus the 2 MiB huge-page rounding at either end of the
    # gradient (a copy would add 100%).
    extra, logits_bytes, grad_storage = _run_peak_script(tmp_path, VIEW_PEAK_SCRIPT, 513, 32768, layout)
    assert grad_storage <= 1.125 * logits_bytes + 4096, (grad_storage, logits_bytes)
    assert extra - grad_storage <= 0.01 * logits_bytes + (4 << 20), (extra, grad_storage, logits_bytes)


def test_inplace_backward_same_gradient_and_logits_overwritten(device):
    check_inplace_backward_matches(device)


def test_inplace_backward_is_caught_when_logits_are_needed_again(device):
    logits, labels = make_case(8, 500, torch.float32, device)
    w = torch.randn(500, device=device, requires_grad=True)
    x = logits.clone().requires_grad_()
    other_use = (x * w).sum()  # saves x for w's gradient; its backward runs after ours
    logp = twinkle_mem.selective_log_softmax(x, labels, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + other_use).backward()
    # Control: without inplace_backward the same graph is fine.
    x = logits.clone().requires_grad_()
    other_use = (x * w).sum()
    (twinkle_mem.selective_log_softmax(x, labels).sum() + other_use).backward()


# ----------------------------------------------------------------- determinism
def test_bitwise_deterministic_across_runs_and_threads(device):
    logits, labels = make_case(3, 151936, torch.bfloat16, device)  # split rows
    logits2, labels2 = make_case(300, 7001, torch.bfloat16, device)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 2, 1):
            torch.set_num_threads(threads)
            run = []
            for x0, y in ((logits, labels), (logits2, labels2)):
                x = x0.clone().requires_grad_()
                logp, entropy = twinkle_mem.selective_log_softmax(x, y, True)
                (grad,) = torch.autograd.grad(logp.sum() + 0.5 * entropy.sum(), x)
                run += [logp, entropy, grad]
            results.append(run)
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


# ----------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors(device):
    logits, labels = make_case(4, 10, torch.float32, device)
    cases = [
        (dict(logits=logits.long(), index=labels), "logits must be a bf16/fp16/fp32/fp64 tensor"),
        (dict(logits=logits.to(torch.float8_e4m3fn), index=labels), "logits must be a bf16/fp16/fp32/fp64 tensor"),
        (dict(logits=logits.tolist(), index=labels), "logits must be"),
        (dict(logits=logits, index=labels.float()), "index"),
        (dict(logits=logits, index=labels[:3]), "index shape"),
        (dict(logits=logits, index=labels, temperature=0.0), "temperature"),
        (dict(logits=logits, index=labels, temperature=float("nan")), "temperature"),
        (dict(logits=logits, index=labels, ignore_index=1.5), "ignore_index"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            twinkle_mem.selective_log_softmax(**kwargs)
    if device != "cpu":
        with pytest.raises(ValueError, match="index is on"):
            twinkle_mem.selective_log_softmax(logits, labels.cpu())
    for bad_label in (10, -1, 2**40) if _label_errors_raise_here(device) else ():
        bad = labels.clone()
        bad[2] = bad_label
        with pytest.raises((ValueError, RuntimeError), match="labels"):
            twinkle_mem.selective_log_softmax(logits, bad)
    # ignore_index is exempt from the range check
    bad = labels.clone()
    bad[2] = -100
    twinkle_mem.selective_log_softmax(logits, bad, ignore_index=-100)


def _label_errors_raise_here(device):
    """Whether an out-of-range label raises in this process. On CUDA it is a device-side assert (docs/cuda.md), as
    in PyTorch's nll_loss: no host synchronization, and the process's CUDA context is unusable after it.
    tests/backends/cuda/test_cuda.py checks it and its message in a child process."""
    return device != "cuda"


def test_out_of_range_label_message(device):
    # Leads with what is wrong, names the entry and the range, and no source path of the build machine.
    if not _label_errors_raise_here(device):
        pytest.skip("a device-side assert on CUDA: test_cuda.py::test_out_of_range_label_is_a_device_side_assert")
    logits, labels = make_case(4, 10, torch.float32, device)
    labels[2] = 12
    with pytest.raises(RuntimeError) as err:
        twinkle_mem.selective_log_softmax(logits, labels)
    msg = str(err.value)
    assert msg.startswith("twinkle_mem: label out of range: labels.flatten()[2] = 12"), msg
    assert "[0, 10)" in msg and ".h:" not in msg and ".cpp" not in msg and "/" not in msg.split("[0, 10)")[0], msg


def test_padding_label_without_ignore_index_says_what_to_do(device):
    # Issue 27: twinkle's / transformers' -100 labels without ignore_index: the message names the value, the
    # entry of the caller's index, the vocab size and the fix, not the op's placeholder for "none".
    if not _label_errors_raise_here(device):
        pytest.skip("a device-side assert on CUDA: test_cuda.py::test_out_of_range_label_is_a_device_side_assert")
    logits, labels = make_case(6, 10, torch.float32, device)
    labels = labels.view(3, 2).clone()
    labels[1, 1] = -100
    with pytest.raises(RuntimeError) as err:
        twinkle_mem.selective_log_softmax(logits.view(3, 2, 10), labels)
    msg = str(err.value)
    assert msg.startswith("twinkle_mem: label out of range: labels.flatten()[3] = -100 is neither a token id in "
                          "[0, 10) (vocab size 10) nor the ignore_index (none given)"), msg
    assert msg.endswith("pass ignore_index=-100") and str(-(2**63)) not in msg, msg
    twinkle_mem.selective_log_softmax(logits.view(3, 2, 10), labels, ignore_index=-100)  # the advice works


def test_cli_reports_backends():
    out = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, check=True).stdout
    assert "twinkle-mem" in out and "cpu   loaded" in out
    assert twinkle_mem.backends()["cpu"] == "loaded"


@pytest.mark.parametrize("gpus", [0, 2])
def test_cli_tells_the_cuda_library_from_a_visible_gpu(monkeypatch, capsys, gpus):
    # Issue 27: a CUDA build of torch loads _C_cuda on a machine without a GPU; "cuda loaded" alone read as
    # "the GPU kernels run here".
    from twinkle_mem import __main__ as cli

    monkeypatch.setattr(twinkle_mem, "backends", lambda: {"cpu": "loaded", "cuda": "loaded", "npu": "not built"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    cli.main()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("cuda"))
    gpu = "GPU: 2 visible (NVIDIA H200)" if gpus else "GPU: none visible"
    assert line.split() == ["cuda", "library", "loaded;", *gpu.split()], line
