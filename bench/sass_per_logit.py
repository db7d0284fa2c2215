"""SASS instructions per logit of the CUDA kernels' inner loops, read from the compiled code (no GPU).

Compiles csrc/cuda/selective_log_softmax.cu to a cubin for one architecture with setup.py's nvcc
flags (as .ci/check_cuda_build.py does for ptxas -v), disassembles it with cuobjdump -sass, and for
segment_state_kernel (the forward's pass over the logits, with and without entropy) and backward_kernel
of each dtype finds the inner loop of the 16-byte path: the shortest loop holding 16-byte global
loads. Its instructions over the logits those loads carry is the static count per logit of a chunk
(the rare branches inside it included; the per-task work outside it, merges and label handling, not).
docs/cuda.md records the figures before and after a change.

  CUDA_HOME=/usr/local/cuda python bench/sass_per_logit.py                 # this tree, sm_90
  CUDA_HOME=/usr/local/cuda python bench/sass_per_logit.py --root OLD_TREE # another checkout's kernels
  ... --arch sm_80 --json FILE

cuobjdump comes from $CUOBJDUMP, PATH, $CUDA_HOME/bin or the nvidia-cuda-cuobjdump wheel (a CUDA
toolkit installed from pip has nvcc but not cuobjdump: `pip install nvidia-cuda-cuobjdump`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), ".ci"))

import check_cuda_build  # noqa: E402  (setup.py's nvcc flags and the CUDA_HOME lookup)

ELEMS_PER_16_BYTES = {"bf16": 8, "fp16": 8, "fp32": 4}
MANGLED_DTYPE = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32"}
KERNEL = re.compile(r"_ZN11twinkle_mem4cuda\d+(segment_state_kernel|backward_kernel)I(13__nv_bfloat16|6__half|f)l"
                    r"(Lb[01])?E")


def find_cuobjdump(cuda_home: str) -> str:
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), os.path.join(cuda_home, "bin", "cuobjdump")]
    for site in sys.path:
        candidates += glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("no cuobjdump (set CUOBJDUMP, or `pip install nvidia-cuda-cuobjdump`)")


def compile_cubin(root: str, cuda_home: str, arch: str, out: str) -> None:
    import torch.utils.cpp_extension as cpp_ext

    cpp_ext.CUDA_HOME = cuda_home
    os.environ["CUDA_HOME"] = cuda_home
    flags, defines = check_cuda_build.setup_flags()
    includes = [os.path.join(root, "csrc")] + cpp_ext.include_paths(device_type="cuda") + [
        os.path.join(cuda_home, "include")]
    cmd = [os.path.join(cuda_home, "bin", "nvcc"), "-cubin", f"-arch={arch}", *flags, *cpp_ext.COMMON_NVCC_FLAGS,
           *defines, *[f"-I{i}" for i in includes], os.path.join(root, "csrc", "cuda", "selective_log_softmax.cu"),
           "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"nvcc failed:\n{proc.stderr[-4000:]}")


def functions(sass: str):
    """(mangled name, [(address, instruction)]) of each function in a cuobjdump -sass listing."""
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        code = [(int(m.group(1), 16), m.group(2).strip())
                for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", block)]
        yield name, code


def vector_loop(code):
    """(instructions, 16-byte loads) of the shortest loop (a backward branch's span) with 16-byte loads."""
    at = {address: i for i, (address, _) in enumerate(code)}
    best = None
    for i, (address, text) in enumerate(code):
        m = re.search(r"\bBRA (?:\S+ )?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= address:
            continue
        body = [t for _, t in code[at[int(m.group(1), 16)]:i + 1]]
        loads = sum(bool(re.search(r"\bLDG\S*\.128\b", t)) for t in body)
        if loads and (best is None or len(body) < len(best[0])):
            best = (body, loads)
    return best


def count(sass: str) -> list[dict]:
    rows = []
    for name, code in functions(sass):
        m = KERNEL.match(name)
        if not m:
            continue  # int32-label instances compile to the same loops
        kernel, dtype = m.group(1), MANGLED_DTYPE[m.group(2)]
        found = vector_loop(code)
        if found is None:
            sys.exit(f"no loop with 16-byte loads in {name}")
        body, loads = found
        logits = loads * ELEMS_PER_16_BYTES[dtype]
        rows.append({"kernel": kernel, "dtype": dtype, "entropy": m.group(3) == "Lb1", "instructions": len(body),
                     "logits": logits, "per_logit": round(len(body) / logits, 2),
                     "mufu_per_logit": round(sum("MUFU" in t for t in body) / logits, 2)})
    order = {"segment_state_kernel": 0, "backward_kernel": 1}
    return sorted(rows, key=lambda r: (order[r["kernel"]], r["dtype"], r["entropy"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(HERE), help="the tree whose csrc/ is compiled")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    cuda_home = check_cuda_build.find_cuda_home()
    if cuda_home is None:
        sys.exit("nvcc not found (set CUDA_HOME)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        compile_cubin(os.path.abspath(args.root), cuda_home, args.arch, cubin)
        sass = subprocess.run([find_cuobjdump(cuda_home), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    rows = count(sass)
    print(f"{args.root} ({args.arch}): the 16-byte path's inner loop")
    print(f"{'kernel':22s} {'dtype':5s} {'entropy':7s} {'instr':>5s} {'logits':>6s} {'per logit':>9s} {'MUFU':>5s}")
    for r in rows:
        print(f"{r['kernel']:22s} {r['dtype']:5s} {'yes' if r['entropy'] else '':7s} {r['instructions']:5d} "
              f"{r['logits']:6d} {r['per_logit']:9.2f} {r['mufu_per_logit']:5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"root": args.root, "arch": args.arch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
