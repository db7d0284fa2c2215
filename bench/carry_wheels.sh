#!/usr/bin/env bash
# Fills .whl/ with the pure-Python wheels the device checks need and the device machines lack (they
# have no package registry): pytest and its dependencies, hypothesis and its, and Liger-Kernel (an
# optional GPU peer). Run it here, where pip reaches PyPI; then hand .whl to the device tool with
# carry=[".whl"] (it is git-ignored). bench/gpu_check.sh and bench/npu_check.sh unpack them.
#   bash bench/carry_wheels.sh            # PYTHON_VERSION=3.12 (the lent GPU machine's) by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
ONLY_PURE=(--only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation py --abi none --platform any)
# pytest and hypothesis with their dependencies (all pure Python); Liger-Kernel alone (its torch and
# triton are the machine's own).
"$PY" -m pip download --quiet --dest .whl "${ONLY_PURE[@]}" pytest hypothesis
"$PY" -m pip download --quiet --dest .whl "${ONLY_PURE[@]}" --no-deps liger-kernel
ls -l .whl
