#!/usr/bin/env bash
# The one script a lent GPU machine runs first (issue 11), from the repository root, within
# 10 minutes including the build:
#   1. build both native libraries in place (TORCH_CUDA_ARCH_LIST, default 9.0) and record the
#      ptxas register / stack / spill figures of every kernel (ptxas.json)
#   2. the test suite on the GPU: tests/backends/cuda/test_cuda.py, the numerics classes on the "cuda"
#      implementation (tests/op/test_numerics.py) and every device-parametrized test, with
#      TWINKLE_MEM_TEST_DEVICES=cpu,cuda (pytest.xml, pytest.log)
#   2b. the fused LM head's batch invariance: bench/check_linear_invariance.py, five rows alone and
#      inside batches of N = 1, 7, 333, 4096 at V = 151936, bf16, compared bit for bit (linear_invariance.log)
#   3. compute-sanitizer memcheck, racecheck and synccheck on the smoke pass (every kernel path
#      against float64: bench/bench_cuda.py --smoke)
#   4. bench/bench_cuda.py at N=16384, V=151936, bf16: the first and last rows against float64,
#      then forward and forward+backward (out of place, in place) of twinkle-mem, Liger-Kernel,
#      torch.compile and naive in one run, as a fraction of the measured copy bandwidth
# Everything goes to bench/results/gpu_check/: per-step logs, ptxas.json, bench_cuda.json/.png,
# and gpu_check.json + gpu_check.md (the step table). When the device tool provides $OUT (it brings
# back at most 8 files), bench/pack_results.py puts there gpu_check.json, gpu_check.md,
# bench_cuda.json, bench_cuda.png and ptxas.json as they are, and EVERY other file of the results
# folder (each step's log) in one gpu_check_logs.tar.gz: 6 files. A new step needs nothing more than
# run_step NAME LIMIT "$RESULTS/<name>.log" COMMAND...: its log lands in the archive and its status
# line in gpu_check.json/md; write nothing to $OUT directly.
# Exit status: the number of failed steps (0 = all passed).
#
#   bash bench/gpu_check.sh              # on the GPU machine (device tool: timeout_s=600, carry .whl)
#   bash bench/gpu_check.sh --dry-run    # here, without a GPU: the script's own logic on the CPU
#                                        # (results in $TMPDIR, not bench/results)
#
# The GPU machine has torch (CUDA), Python, nvcc and compute-sanitizer, and NO package registry.
# Steps 1, 3 and 4 need nothing else (setuptools comes with torch on Python >= 3.12; matplotlib
# is optional: without it bench_cuda.png is missing). Step 2 needs pytest and hypothesis, and
# Liger-Kernel is an optional peer: `bash bench/carry_wheels.sh` puts their pure-Python wheels in
# .whl/ (git-ignored: pass carry=[".whl"] to the device tool), which this script unpacks into
# /tmp/site (no pip needed). Without pytest the test step fails saying so; without Liger its rows
# are reported as skipped.
set -u -o pipefail

DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1

START=$(date +%s)
RESULTS=bench/results/gpu_check
[ $DRY_RUN -eq 1 ] && RESULTS=${TMPDIR:-/tmp}/twinkle_mem_gpu_check_dry_run  # never mistaken for GPU figures
rm -rf "$RESULTS"  # this run's files only: everything in it goes back through $OUT
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
ARCHS=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
# The GPU run builds the library in place (step 1) and imports it from python/. A dry run builds
# nothing: it imports the tree only where a library was built in it, else the installed package
# (a clean checkout installed the way CI installs it), whose kernels the benchmark step needs.
if [ $DRY_RUN -eq 0 ] || ls python/twinkle_mem/_C_cpu*.so >/dev/null 2>&1; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
FAILED=0
STEPS=()  # "name|status|seconds|note"

elapsed() { echo $(( $(date +%s) - START )); }
banner() { echo; echo "=== [$(elapsed) s] $*"; }
# record NAME STATUS SECONDS NOTE
record() {
  STEPS+=("$1|$2|$3|$4")
  if [ "$2" = "FAIL" ]; then FAILED=$((FAILED + 1)); echo "!!! FAILED: $1 ($4)"; fi
}
# run_step NAME TIMEOUT LOG COMMAND...: runs COMMAND under a time limit, output to LOG
run_step() {
  local name=$1 limit=$2 log=$3 t0 rc
  shift 3
  t0=$(date +%s)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  tail -5 "$log"
  if [ $rc -eq 0 ]; then
    record "$name" PASS $(( $(date +%s) - t0 )) "$(basename "$log")"
  else
    record "$name" FAIL $(( $(date +%s) - t0 )) "rc=$rc$([ $rc -eq 124 ] && echo ', timed out'), $(basename "$log")"
  fi
  return $rc
}

banner "environment"
if [ $DRY_RUN -eq 1 ]; then
  echo "dry run: no GPU steps; the Python parts run on the CPU"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
fi
# setuptools >= 77 reads pyproject.toml's SPDX license (torch requires it, so it comes with torch)
$PY -c "import torch, sys, setuptools; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| setuptools', setuptools.__version__)"
command -v nvcc >/dev/null && nvcc --version | tail -1
echo "C++ compiler: ${CXX:-g++} ($("${CXX:-g++}" --version 2>/dev/null | head -1))"

if ls .whl/*.whl >/dev/null 2>&1; then
  banner "carried wheels: $(ls .whl | tr '\n' ' ')"
  # Pure-Python wheels are zip files of importable packages: unpacked onto the path, no pip.
  # Where the machine has its own pytest and hypothesis (the H200 image, with pytest-xdist and plugins built
  # for them), only the peers are unpacked: a carried pytest ahead on the path would shadow it.
  wheels=(.whl/*.whl)
  if $PY -c 'import pytest, hypothesis' 2>/dev/null; then
    wheels=(); for whl in .whl/*.whl; do case $(basename "$whl") in liger_kernel-*) wheels+=("$whl");; esac; done
    echo "pytest and hypothesis are installed here: unpacking ${wheels[*]:-no peer wheel}"
  fi
  mkdir -p /tmp/site
  for whl in "${wheels[@]}"; do $PY -m zipfile -e "$whl" /tmp/site || echo "(could not unpack $whl)"; done
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi

banner "1. build in place (TORCH_CUDA_ARCH_LIST=$ARCHS) and ptxas figures"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
export CUDA_HOME
if [ $DRY_RUN -eq 1 ]; then
  # The ptxas parser on a log of nvcc's -Xptxas=-v (no build here: the CPU library is assumed built).
  if command -v nvcc >/dev/null; then
    run_step "ptxas figures (compiled here)" 300 "$RESULTS/ptxas.log" \
      env TORCH_CUDA_ARCH_LIST="$ARCHS" "$PY" .ci/check_cuda_build.py --skip-install-check --json "$RESULTS/ptxas.json"
  else
    record "ptxas figures" SKIP 0 "no nvcc"
  fi
elif run_step "build" 300 "$RESULTS/build.log" \
    env TORCH_CUDA_ARCH_LIST="$ARCHS" FORCE_CUDA=1 MAX_JOBS=16 "$PY" setup.py build_ext --inplace --build-temp /tmp/tm_build; then
  echo "built: $(ls python/twinkle_mem/*.so)"
  run_step "ptxas figures (0 stack/spills)" 60 "$RESULTS/ptxas.log" \
    env TORCH_CUDA_ARCH_LIST="$ARCHS" "$PY" .ci/check_cuda_build.py --ptxas-log "$RESULTS/build.log" \
    --skip-install-check --json "$RESULTS/ptxas.json"
  $PY -m twinkle_mem | tee "$RESULTS/backends.txt"
  grep -q "cuda  library loaded" "$RESULTS/backends.txt" || record "CUDA library loads" FAIL 0 "see backends.txt"
else
  tail -40 "$RESULTS/build.log"
fi

banner "2. tests on the GPU (TWINKLE_MEM_TEST_DEVICES=cpu,cuda)"
# A test module that cannot import (a missing package) is reported, and the others still run.
if ! missing=$($PY -c 'import importlib.util as u, sys; print(" ".join(m for m in ("pytest", "hypothesis") if u.find_spec(m) is None))') \
    || [ -n "$missing" ]; then
  record "pytest cuda" FAIL 0 "not run: ${missing:-python} not importable (bash bench/carry_wheels.sh, carry .whl)"
elif [ $DRY_RUN -eq 1 ]; then  # (-m '': both test tiers, pyproject.toml leaving out the marker e2e)
  run_step "pytest (dry run: collection only)" 120 "$RESULTS/pytest.log" \
    env TWINKLE_MEM_TEST_DEVICES=cpu,cuda "$PY" -m pytest -q -p no:cacheprovider -m '' tests --collect-only \
    -k "cuda and not emulat"
else
  # With pytest-xdist, a test that leaves a device-side assert behind ends its worker alone (tests/conftest.py).
  PYTEST_EXTRA=()
  $PY -c 'import xdist' 2>/dev/null && PYTEST_EXTRA=(-n 4)
  # The twinkle-kit integration tests import twinkle (CI installs it; the GPU machine has none).
  $PY -c 'import twinkle' 2>/dev/null || { PYTEST_EXTRA+=(--ignore=tests/integrations/twinkle/test_integration_twinkle.py)
    echo "twinkle-kit is not installed: tests/integrations/twinkle/test_integration_twinkle.py left out"; }
  run_step "pytest cuda" 240 "$RESULTS/pytest.log" \
    env TWINKLE_MEM_TEST_DEVICES=cpu,cuda "$PY" -m pytest -q -p no:cacheprovider -m '' tests -k "cuda and not emulat" \
    "${PYTEST_EXTRA[@]}" --continue-on-collection-errors --junitxml="$RESULTS/pytest.xml"
  grep -E "^(FAILED|ERROR)" "$RESULTS/pytest.log" | head -20
fi

banner "2b. fused LM head: rows bitwise the same at N = 1, 7, 333, 4096 (V = 151936, bf16)"
INVARIANCE_ARGS=(--device cuda)
[ $DRY_RUN -eq 1 ] && INVARIANCE_ARGS=(--device cpu --h 16 --vocab 8500 --n 1 7 600)
run_step "fused head batch invariance" 180 "$RESULTS/linear_invariance.log" "$PY" bench/check_linear_invariance.py "${INVARIANCE_ARGS[@]}"

banner "3. compute-sanitizer on the smoke pass"
if [ $DRY_RUN -eq 1 ]; then
  run_step "smoke pass (dry run, CPU kernels)" 120 "$RESULTS/smoke.log" "$PY" bench/bench_cuda.py --device cpu --smoke
fi
for tool in memcheck racecheck synccheck; do
  if [ $DRY_RUN -eq 1 ]; then
    echo "would run: compute-sanitizer --tool $tool --error-exitcode 9 $PY bench/bench_cuda.py --smoke"
    record "compute-sanitizer $tool" SKIP 0 "dry run"
  elif ! command -v compute-sanitizer >/dev/null; then
    record "compute-sanitizer $tool" SKIP 0 "compute-sanitizer not found"
  elif [ "$(elapsed)" -gt 330 ]; then
    record "compute-sanitizer $tool" SKIP 0 "skipped: $(elapsed) s used, the benchmark comes first"
  else
    dtypes=bf16,fp16,fp32,fp64
    [ "$tool" != memcheck ] && dtypes=bf16,fp32  # racecheck and synccheck are slower: two dtypes cover the paths
    run_step "compute-sanitizer $tool" 90 "$RESULTS/sanitizer_$tool.log" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" bench/bench_cuda.py --smoke --smoke-dtypes "$dtypes"
  fi
done

banner "4. benchmark (N=16384, V=151936, bf16) and first/last rows vs float64"
if [ $DRY_RUN -eq 1 ]; then
  run_step "benchmark (dry run, CPU, N=64 V=4099)" 300 "$RESULTS/bench.log" \
    "$PY" bench/bench_cuda.py --device cpu --n 64 --v 4099 --reps 2 --warmup 1 --out "$RESULTS"
else
  left=$(( 570 - $(elapsed) ))
  if [ "$left" -lt 60 ]; then
    record "benchmark" FAIL 0 "skipped: only ${left} s left"
  else
    run_step "benchmark" "$left" "$RESULTS/bench.log" "$PY" bench/bench_cuda.py --out "$RESULTS"
    grep -v "^W[0-9]" "$RESULTS/bench.log" | tail -30
  fi
fi

banner "summary"
printf '%s\n' "${STEPS[@]}" | $PY bench/bench_common.py steps "$RESULTS/gpu_check.md" "$RESULTS/gpu_check.json" \
  dry_run="$([ "$DRY_RUN" -eq 1 ] && echo true || echo false)" failed="$FAILED" seconds="$(elapsed)"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  echo "to \$OUT (what the device tool brings back):"
  $PY bench/pack_results.py "$RESULTS" "$OUT" --archive gpu_check_logs.tar.gz \
    --keep gpu_check.json,gpu_check.md,bench_cuda.json,bench_cuda.png,ptxas.json \
    || echo "!!! \$OUT holds more than the device tool brings back (see above)"
fi
echo "done in $(elapsed) s: $FAILED failed step(s); files in $RESULTS"
exit "$FAILED"
