"""The CPU kernel's paths (avx512_bf16, avx512, avx2, portable: csrc/cpu/isa.h), beyond the numerics suite
that tests/op/test_numerics.py runs on each of them (tests/impls.py: cpu, cpu_avx512, cpu_avx2, cpu_portable):

- TWINKLE_MEM_CPU_ISA caps the path, python -m twinkle_mem names the one in use, an unknown value raises;
- the paths really differ where they should (the forward's summation order) and agree bit for bit where
  they share their arithmetic: the backward of every x86 path, lane for lane, from the same statistics;
  the avx512 and avx512_bf16 forwards;
- no instruction of a wider set is compiled outside its own path (the library loads and runs on a CPU
  without AVX-512, or without AVX2).
"""
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import check_against_reference
from impls import on_cpu_path
from numerics import NO_IGNORE, Case, make_cases, upstream

import twinkle_mem
from twinkle_mem.op import native

ops = torch.ops.twinkle_mem
PATHS = [p for p in native.CPU_PATHS if native.cpu_kernel_path(p) == p]  # the paths this CPU runs
X86_PATHS = [p for p in PATHS if p != "portable"]


def _cli_cpu_line(env_value):
    env = dict(os.environ)
    env.pop(native.CPU_ISA_ENV, None)
    if env_value is not None:
        env[native.CPU_ISA_ENV] = env_value
    out = subprocess.run([sys.executable, "-m", "twinkle_mem"], capture_output=True, text=True, check=True,
                         env=env).stdout
    return next(line for line in out.splitlines() if line.strip().startswith("cpu "))


def test_cli_names_the_path_in_use_and_the_cap():
    widest = PATHS[0]
    assert f"cpu kernel path: {widest} (the widest this CPU has)" in _cli_cpu_line(None)
    for path in sorted({PATHS[0], PATHS[-1]}):  # the message is one f-string: the widest and the narrowest forced
        assert f"cpu kernel path: {path} ({native.CPU_ISA_ENV}={path}; this CPU has {widest})" in _cli_cpu_line(path)
    assert "cpu kernel path: none" in _cli_cpu_line("sse")


def test_unknown_cap_raises_naming_the_variable(monkeypatch):
    monkeypatch.setenv(native.CPU_ISA_ENV, "avx1024")
    with pytest.raises(RuntimeError, match="TWINKLE_MEM_CPU_ISA=avx1024 names no CPU kernel path"):
        twinkle_mem.selective_log_softmax(torch.randn(2, 8), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="avx1024"):
        native.cpu_kernel_path()


def test_a_cap_above_the_cpu_runs_the_widest_it_has():
    assert native.cpu_kernel_path("avx512_bf16") == PATHS[0]
    assert native.cpu_kernel_path("portable") == "portable"


def _statistics(path, x, labels, inv_t=1.0):
    logp, entropy, shift, log_sum = on_cpu_path(path, ops.selective_log_softmax_fwd)(x, labels, inv_t, NO_IGNORE, 0,
                                                                                   x.shape[-1], True)
    return torch.stack([logp, entropy, shift, log_sum])


def test_each_forced_path_runs_its_own_code():
    """Forcing a path changes which code runs, not only what is reported: the forward sums in another order on
    each (16, 8 and 1 lanes), so a row's statistics differ in their last bits; avx512_bf16 differs from avx512
    only in the bf16 gradient's store, so their forwards are the same bits."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(16, 40000, generator=gen) * 3).bfloat16()
    labels = torch.randint(0, 40000, (16,), generator=gen)
    stats = {path: _statistics(path, x, labels, 1 / 0.8) for path in PATHS}
    distinct = [p for p in PATHS if p != "avx512_bf16"]
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            assert not torch.equal(stats[a], stats[b]), f"{a} and {b} gave the same bits: is the cap obeyed?"
    if "avx512_bf16" in stats:
        assert torch.equal(stats["avx512_bf16"], stats["avx512"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_spike_is_the_max_wherever_it_is_in_a_block(path, dtype):
    """The first sweep takes a block's max sub-block by sub-block: the next block's whole sub-blocks beside this
    block's second sweep, a last partial one and the tail on their own (csrc/cpu/row_kernels.h). A logit 120 above
    the rest in any of those places must be found as its row's max: else its 2^y, y = 120 log2(e), overflows fp32.
    V's last block (713 elements) holds whole sub-blocks, a partial one and a tail on every path: AVX-512 (256
    per sub-block, pairs of 32) [512, 704) and 9, AVX2 (128, 16) [640, 704) and 9, portable (16, 2) [704, 712)
    and 1."""
    v = 2 * 2048 + 713
    places = [0, 2047, 2048, 4095, 4096 + 100, 4096 + 600, 4096 + 700, 4096 + 703, 4096 + 710, v - 1]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(len(places), v, generator=gen, dtype=torch.float64) * 2
    for row, col in enumerate(places):
        x[row, col] = 120.0
    x = x.to(dtype)
    labels = torch.tensor(places)
    labels[::2] = 7  # half the rows ask for a token 120 below the max
    on_cpu_path(path, check_against_reference)(x, labels)  # forward and backward against float64


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_same_bits(a, b, what):
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), f"{what}: NaN at other places"
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan]), f"{what}: {(_bits(a) != _bits(b)).sum().item()} values differ"


@pytest.mark.skipif(len(X86_PATHS) < 2, reason="one x86 path on this CPU: nothing to compare")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_x86_paths_backward_bit_for_bit(dtype):
    """Given the same statistics, the backward of every x86 path gives the same bits, lane for lane (the same exp
    in 8 or 16 lanes, the same formulas and roundings; bf16 stores by AVX-512 BF16 or by integer rounding): a
    wrong lane, store order, tail or rounding on one path shows up here. On every input class of the numerics
    suite (odd V: tails), out of place and in place; the peaked classes hold subnormal gradients."""
    subnormals = 0
    for case in make_cases(5, 1031, dtype, seed=9) + make_cases(3, 4099, dtype, seed=10):
        ignore = NO_IGNORE if case.ignore_index is None else case.ignore_index
        inv_t, x = 1.0 / case.temperature, case.logits
        _, entropy, shift, log_sum = ops.selective_log_softmax_fwd(x, case.labels, inv_t, ignore, 0, x.shape[-1],
                                                                   case.with_entropy)
        g_logp, g_entropy = upstream(case, seed=4)
        h = entropy if case.with_entropy else None
        grads = {}
        for path in X86_PATHS:
            for inplace in (False, True):
                target = x.clone() if inplace else x
                backward = on_cpu_path(path, ops.selective_log_softmax_bwd_ if inplace else ops.selective_log_softmax_bwd)
                out = backward(g_logp, g_entropy, target, case.labels, shift, log_sum, h, inv_t, ignore, 0)
                grads[path, inplace] = target if inplace else out
        first = grads[X86_PATHS[0], False]
        subnormals += int(((first != 0) & (first.abs() < torch.finfo(dtype).tiny)).sum())
        for key, grad in grads.items():
            _assert_same_bits(grad, first, f"{case.name}: {key} vs {X86_PATHS[0]}")
    if dtype != torch.float16:
        assert subnormals > 0, "no subnormal gradient among the cases: the test lost its bite"


@pytest.mark.skipif(len(X86_PATHS) < 2, reason="one x86 path on this CPU: nothing to compare")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "entropy"])
def test_x86_paths_exp2_bit_for_bit(dtype, with_entropy):
    """The x86 paths' exp2 terms are the same bits: rows of one term below the max (the rest -inf), so that no
    summation order is left to differ, with y = (x - max) log2(e) / T spread over (-1, 0], where 1 + y is not
    always an fp32 and a reduction rounded one way on one path and another on the other shows (AVX-512's
    VREDUCEPS rounds y - floor(y) down; AVX2 must too)."""
    n, v = 512, 64  # the whole row in vector pairs on both paths: no scalar tail
    gen = torch.Generator().manual_seed(11)
    x = torch.full((n, v), float("-inf"))
    x[:, 0] = 0.0
    x[torch.arange(n), torch.randint(1, v, (n,), generator=gen)] = -torch.rand(n, generator=gen) * 0.69
    x = x.to(dtype)
    labels = torch.zeros(n, dtype=torch.long)
    outs = {path: on_cpu_path(path, ops.selective_log_softmax_fwd)(x, labels, 1.0, NO_IGNORE, 0, v, with_entropy)
            for path in X86_PATHS}
    first = outs[X86_PATHS[0]]
    for path, out in outs.items():
        for name, a, b in zip(("logp", "entropy", "shift", "log_sum"), out, first):
            if name != "entropy" or with_entropy:
                _assert_same_bits(a, b, f"{name}: {path} vs {X86_PATHS[0]}")


# ------------------------------------------------------------------ what the library's code may run
# In 64-bit code an instruction whose first opcode byte (after segment or address-size prefixes) is
# 0x62 is EVEX-encoded (AVX-512); 0xC4 or 0xC5, VEX-encoded (AVX, AVX2, FMA, F16C).
_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}
_BF16 = re.compile(r"\bv(cvtne2ps2bf16|cvtneps2bf16|dpbf16ps)\b")


def _functions_using(library):
    """{function: {"evex", "vex", "bf16"}} for every function of the library whose code holds such instructions."""
    out = subprocess.run(["objdump", "-d", "-C", "--insn-width=16", library], capture_output=True, text=True,
                         check=True).stdout
    found, name = {}, None
    for line in out.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            name = header.group(1)
            continue
        parts = line.split("\t")
        if name is None or len(parts) < 3:
            continue
        code = [b for b in parts[1].split() if b not in _PREFIXES]
        kinds = set()
        if code and code[0] == "62":
            kinds.add("evex")
        elif code and code[0] in ("c4", "c5"):
            kinds.add("vex")
        if _BF16.search(parts[2]):
            kinds.add("bf16")
        if kinds:
            found.setdefault(name, set()).update(kinds)
    return found


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instruction sets")
def test_no_wider_instruction_outside_its_path():
    """AVX-512 code only in the avx512 namespaces (and the avx512_bf16 table's entry point), AVX code only there
    or in the avx2 ones, AVX-512 BF16 only in the avx512_bf16 path's store: every other function (host code,
    inline functions of the standard library or torch's headers that a wider translation unit might have
    emitted for the linker to pick) runs on any x86-64 CPU. Needs objdump (binutils, beside the compiler)."""
    assert shutil.which("objdump"), "objdump (binutils) is needed to read the library's code"
    library = native._find("_C_cpu")
    found = _functions_using(library)
    assert any("avx512" in f for f in found) and any("avx2" in f for f in found), "no path's code found: parser?"
    wrong = {f: k for f, k in found.items()
             if ("evex" in k and "avx512" not in f) or ("vex" in k and "avx512" not in f and "avx2" not in f)
             or ("bf16" in k and "bf16_native" not in f)}
    assert not wrong, wrong


def test_a_library_without_the_path_entry_still_imports(monkeypatch):
    # An older build of _C_cpu (before the paths) has no twinkle_mem_cpu_kernel_path: import goes on.
    import ctypes.util
    monkeypatch.setattr(native, "_cpu_library", None)
    native._open_cpu_library(ctypes.util.find_library("m"))
    assert native._cpu_library is None and native.cpu_kernel_path() is None
