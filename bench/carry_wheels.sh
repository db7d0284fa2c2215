#!/usr/bin/env bash
# Fills .whl/ with the wheels the device checks need and the device machines lack (they have no package registry):
# pytest and hypothesis with their dependencies (pure Python); the GPU peers of bench/bench_head_peers.py
# (Liger-Kernel, Cut Cross-Entropy: pure Python, their torch and triton are the machine's own); verl (its wheel alone:
# bench/bench_head_peers.py and bench/bench_verl_forward.py use its kernels and its model patches, not its trainer)
# and what `import verl` needs beyond the GPU image's packages: tensordict and orjson (built for CPython 3.12,
# x86-64, the lent machines'), cloudpickle, importlib_metadata, pyvers, omegaconf. Ray (about 70 MB) is not carried:
# bench/verl_import.py stands in for it (a forward on one device calls none of it). Run it here, where pip reaches
# PyPI; then hand .whl to the device tool with carry=[".whl"] (it is git-ignored). bench/gpu_check.sh and
# bench/npu_check.sh unpack them (without pip).
#   bash bench/carry_wheels.sh            # PYTHON_VERSION=3.12 (the lent GPU machine's) by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYV=${PYTHON_VERSION:-3.12}
mkdir -p .whl
ONLY_PURE=(--only-binary=:all: --python-version "$PYV" --implementation py --abi none --platform any)
BUILT=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download --quiet --dest .whl "${ONLY_PURE[@]}" pytest hypothesis
"$PY" -m pip download --quiet --dest .whl "${ONLY_PURE[@]}" --no-deps liger-kernel cut-cross-entropy verl==0.9.1 \
  omegaconf cloudpickle importlib_metadata zipp "pyvers<0.2"
"$PY" -m pip download --quiet --dest .whl "${BUILT[@]}" --no-deps "tensordict==0.10.0" orjson
ls -l .whl
du -sh .whl  # (the device tool carries 64 MiB in all, the working tree included)
