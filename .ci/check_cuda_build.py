#!/usr/bin/env python3
"""CI check of the CUDA backend, for a machine without a GPU (run after `pip install .`).

1. The installed package holds the CUDA library `_C_cuda*.so`, which depends on no
   libcudart soname (the runtime is linked statically); under a CUDA torch it
   loads and registers CUDA kernels for every op, under a CPU-only torch the
   package still imports (and leaves it unloaded).
2. `ptxas -v` on csrc/cuda/selective_log_softmax.cu (the glue, which includes the
   kernels of selective_log_softmax_kernels.cuh through the host plan), compiled with setup.py's
   nvcc flags and defines, for every real arch of TORCH_CUDA_ARCH_LIST (default
   setup.py's DEFAULT_CUDA_ARCHS, "8.0;9.0+PTX"): every hot kernel (the segment and backward
   kernels, all but the float64 instances) must report 0 bytes of stack frame and
   0 bytes of spill stores/loads; finish_rows_kernel (one thread per row, O(N)
   work) may keep the small frame of the accurate division / log1p subroutines
   but must not spill. Registers are reported (and written as JSON with --json).

The kernels themselves run on the CPU in the test suite (standins/cuda_emulation.py,
tests/backends/cuda/test_cuda_emulation.py, and the cuda_emulated implementation of
tests/op/test_numerics.py).

Usage: python .ci/check_cuda_build.py [--ptxas-log FILE] [--json FILE] [--skip-install-check]
Exit status 0 when all checks pass. Takes a minute or two on two cores.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_FILE = os.path.join(ROOT, "csrc", "cuda", "selective_log_softmax.cu")
OPS = ("selective_log_softmax_fwd", "selective_log_softmax_bwd", "selective_log_softmax_bwd_")
HOT_KERNELS = ("segment_state_kernel", "backward_kernel")  # per element: no stack, no spills
COLD_KERNELS = ("finish_rows_kernel",)  # per row: no spills
_SETUP: dict | None = None


def setup_ns() -> dict:
    """setup.py's module namespace (setup() is not run), read once: its nvcc flags,
    defines, DEFAULT_CUDA_ARCHS and gencode_flags are the build's own."""
    global _SETUP
    if _SETUP is None:
        _SETUP = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="twinkle_mem_setup")
    return _SETUP


def setup_flags() -> tuple[list[str], list[str]]:
    """(nvcc flags, defines) of the _C_cuda extension, read from setup.py."""
    ns = setup_ns()
    flags = [f for f in ns["NVCC_FLAGS"] if not f.startswith("-Xptxas")]
    defines = [f"-D{k}={v}" for k, v in ns["STABLE_DEFINES"]] + ["-DUSE_CUDA"]
    return flags, defines


def fail(msg: str) -> None:
    print(f"FAIL: {msg}")
    sys.exit(1)


def find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


# ------------------------------------------------------------ 1. installed library
def check_installed() -> None:
    spec = importlib.util.find_spec("twinkle_mem")  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        fail("twinkle_mem is not installed in this Python (run `pip install .` first)")
    pkg_dir = list(spec.submodule_search_locations)[0]
    libs = sorted(glob.glob(os.path.join(pkg_dir, "_C_cuda*.so")))
    if not libs:
        fail(f"no _C_cuda*.so in the installed package {pkg_dir}: the CUDA library was not built "
             "(is nvcc on PATH or CUDA_HOME set during `pip install .`?)")
    print(f"ok: CUDA library installed: {libs[0]} ({os.path.getsize(libs[0]) / 1e6:.1f} MB)")
    if shutil.which("readelf"):
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                            subprocess.run(["readelf", "-d", libs[0]], capture_output=True, text=True).stdout)
        if any(n.startswith("libcudart") for n in needed):
            fail(f"_C_cuda depends on a CUDA runtime soname ({needed}): it must link cudart_static")
        print(f"ok: no libcudart soname needed ({', '.join(needed)})")
    else:
        print("  note: no readelf: the libcudart dependency was not checked")
    if os.path.realpath(pkg_dir).startswith(os.path.realpath(os.path.join(ROOT, "python"))):
        print("  note: this is the source tree's package (an in-place build), not an installed copy")

    # Load in a fresh interpreter, outside the source tree.
    probe = (
        "import json, torch, twinkle_mem\n"
        "from twinkle_mem.op import native as _native\n"
        "has = {op: torch._C._dispatch_has_kernel_for_dispatch_key('twinkle_mem::' + op, 'CUDA') for op in %r}\n"
        "print(json.dumps({'cuda': torch.version.cuda, 'status': _native.status, 'has': has}))\n" % (OPS,)
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        fail(f"`import twinkle_mem` failed:\n{proc.stderr[-3000:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    state = info["status"].get("cuda", "")
    if info["cuda"]:
        if state != "loaded":
            fail(f"torch has CUDA {info['cuda']} but the CUDA library was not loaded: {state!r}")
        missing = [op for op, ok in info["has"].items() if not ok]
        if missing:
            fail(f"no CUDA kernel registered for {missing}")
        print(f"ok: loaded under torch CUDA {info['cuda']}; CUDA kernels registered for {', '.join(OPS)}")
    else:
        if not state.startswith("built, not loaded"):
            fail(f"CPU-only torch: expected the CUDA library to be left unloaded, status {state!r}")
        print("ok: CPU-only torch imports the package and leaves the CUDA library unloaded")


# ------------------------------------------------------------------- 2. ptxas -v
def gencode_flags(arch_list: str) -> tuple[list[str], list[str]]:
    """setup.py's gencode_flags: (nvcc -gencode flags, real archs)."""
    return setup_ns()["gencode_flags"](arch_list)


def compile_for_ptxas(cuda_home: str, arch_list: str) -> str:
    import torch.utils.cpp_extension as cpp_ext

    os.environ["CUDA_HOME"] = cuda_home
    cpp_ext.CUDA_HOME = cuda_home
    includes = [os.path.join(ROOT, "csrc")] + cpp_ext.include_paths(device_type="cuda")
    includes.append(os.path.join(cuda_home, "include"))
    gencode, _ = gencode_flags(arch_list)
    nvcc_flags, defines = setup_flags()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [os.path.join(cuda_home, "bin", "nvcc"), "-fatbin", CU_FILE, "-o", os.path.join(tmp, "k.fatbin"),
               *nvcc_flags, *cpp_ext.COMMON_NVCC_FLAGS, *defines, *[f"-I{i}" for i in includes], *gencode,
               "-Xptxas=-v", "--resource-usage", "--threads", "2"]
        print("compiling for ptxas -v:", " ".join(os.path.basename(c) if c == CU_FILE else c for c in cmd[:2]),
              "... " + " ".join(gencode))
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(f"  nvcc took {time.time() - start:.0f} s")
        if proc.returncode != 0:
            fail(f"nvcc failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return proc.stdout + proc.stderr


def parse_ptxas(log: str) -> dict[tuple[str, str], dict[str, int]]:
    """(mangled kernel, arch) -> {regs, stack, spill_stores, spill_loads}."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    arch_of: dict[str, str] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            arch_of[m.group(1)] = m.group(2)
            out.setdefault(current, {})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            current = (name, arch_of.get(name, "?")) if name in arch_of else None
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["regs"] = int(m[1])
    return out


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if not tool:
        return names
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    return lines if len(lines) == len(names) else names


def short(demangled: str) -> str:
    s = demangled.split("(")[0].replace("void ", "").replace("twinkle_mem::cuda::", "")
    return s.replace("__nv_bfloat16", "bf16").replace("__half", "fp16").replace("float", "fp32") \
            .replace("double", "fp64").replace("long", "int64").replace("int,", "int32,").replace("int>", "int32>")


def check_ptxas(log: str, expected_archs: list[str]) -> list[dict]:
    usage = parse_ptxas(log)
    if not usage:
        fail("no `ptxas info` lines found: was -Xptxas=-v passed?")
    keys = sorted(usage)
    names = demangle([k[0] for k in keys])
    bad, rows = [], []
    print(f"\n{'arch':6s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s}  kernel")
    for (mangled, arch), name in sorted(zip(keys, names), key=lambda kn: (kn[0][1], short(kn[1]))):
        u = usage[(mangled, arch)]
        if "stack" not in u:
            fail(f"no stack/spill line for {name} ({arch})")
        kernel = short(name)
        fp64 = "<fp64" in kernel  # the float64 path is the simple (cold) one
        hot = not fp64 and kernel.startswith(HOT_KERNELS)
        spills = u["spill_stores"] or u["spill_loads"]
        flag = ""
        if fp64 and (spills or u["stack"]):
            flag = "  (fp64, not checked)"
        elif hot and (spills or u["stack"]):
            flag = "  <-- SPILL/STACK"
            bad.append(f"{kernel} on {arch}")
        elif not hot and spills:
            flag = "  <-- SPILL"
            bad.append(f"{kernel} on {arch}")
        print(f"{arch:6s} {u.get('regs', -1):4d} {u['stack']:5d} {u['spill_stores']:5d}/{u['spill_loads']:<5d}  "
              f"{kernel}{flag}")
        rows.append({"arch": arch, "kernel": kernel, "registers": u.get("regs", -1), "stack_bytes": u["stack"],
                     "spill_store_bytes": u["spill_stores"], "spill_load_bytes": u["spill_loads"]})
    seen_archs = sorted({k[1] for k in keys})
    missing = [a for a in expected_archs if a not in seen_archs]
    if missing:
        fail(f"no ptxas report for {missing} (saw {seen_archs})")
    kernels = {short(n) for n in names}
    for required in HOT_KERNELS + COLD_KERNELS:
        if not any(k.startswith(required) for k in kernels):
            fail(f"no {required} in the ptxas report")
    if bad:
        fail("kernels spill registers or use a local-memory stack: " + ", ".join(bad))
    print(f"ok: {len(kernels)} kernels x {len(seen_archs)} archs ({', '.join(seen_archs)}): hot kernels 0 bytes "
          "stack and 0 spills, the others 0 spills (fp64 reported only)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas-log", help="parse this ptxas -v log instead of compiling")
    parser.add_argument("--json", help="write the per-kernel register/stack/spill figures here")
    parser.add_argument("--skip-install-check", action="store_true", help="skip the installed-library check")
    args = parser.parse_args()

    if not args.skip_install_check:
        check_installed()
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", setup_ns()["DEFAULT_CUDA_ARCHS"])
    _, real_archs = gencode_flags(arch_list)
    if args.ptxas_log:
        with open(args.ptxas_log) as f:
            log = f.read()
    else:
        cuda_home = find_cuda_home()
        if cuda_home is None:
            fail("nvcc not found (set CUDA_HOME): the CUDA build cannot be checked")
        log = compile_for_ptxas(cuda_home, arch_list)
    rows = check_ptxas(log, real_archs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"archs": real_archs, "kernels": rows}, f, indent=1)
    print("\nCUDA build checks passed")


if __name__ == "__main__":
    main()
