#!/usr/bin/env bash
# One prepared GPU check for a lent device machine (NVIDIA H200; its image: torch
# 2.11.0+cu130, Python 3.12, nvcc 13.0), run from the repository root:
#   1. build both native libraries in place for sm_90 and print the ptxas figures
#   2. a small correctness pass over every CUDA kernel path, under compute-sanitizer
#      memcheck when the machine supports it (Firecracker does, gVisor does not)
#   3. the whole pytest suite with TWINKLE_MEM_TEST_DEVICES=cpu,cuda
#   4. bench/bench_cuda.py at N=16384, V=151936, bf16 (naive, torch.compile,
#      twinkle-mem, Liger-Kernel when its wheel was carried)
# Logs and results go to $OUT (the device tool's folder that comes back), else
# bench/results/gpu_check. Each step has its own time limit; the whole script is
# sized to end within ~8 minutes (call it with timeout_s=600). Exit status: the
# number of failed steps (0 = all passed).
#
# Device tool call (with Liger: first, here, `echo /.whl/ >> .git/info/exclude` and
# download its wheel into .whl/ as /work/.library/device/README.md says, e.g.
# `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#  --implementation cp --platform manylinux_2_17_x86_64 -d .whl liger-kernel`; it
# is pure Python and finds Triton on the machine):
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
set -u -o pipefail

START=$(date +%s)
OUT_DIR=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
FAILED=0

elapsed() { echo $(( $(date +%s) - START )); }
step() { echo; echo "=== [$(elapsed) s] $*"; }
fail() { echo "!!! FAILED: $*"; FAILED=$((FAILED + 1)); }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
$PY -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
command -v nvcc >/dev/null && nvcc --version | tail -1

if ls .whl/*.whl >/dev/null 2>&1; then
  step "carried wheels: $(ls .whl | tr '\n' ' ')"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "(wheel install failed: Liger will be skipped)"
fi

step "1. build in place (TORCH_CUDA_ARCH_LIST=9.0)"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
export CUDA_HOME
if TORCH_CUDA_ARCH_LIST=9.0 FORCE_CUDA=1 MAX_JOBS=16 timeout 300 \
     $PY setup.py build_ext --inplace --build-temp /tmp/tm_build >"$OUT_DIR/build.log" 2>&1; then
  echo "built: $(ls python/twinkle_mem/*.so | tr '\n' ' ')"
  # The ptxas -v lines of the real build, through the CI parser.
  TORCH_CUDA_ARCH_LIST=9.0 $PY .ci/check_cuda_build.py --ptxas-log "$OUT_DIR/build.log" \
      --skip-install-check --skip-emulation || fail "ptxas check"
  $PY -m twinkle_mem || fail "python -m twinkle_mem"
else
  tail -40 "$OUT_DIR/build.log"
  fail "build"
  echo "FAILED steps: $FAILED"
  exit "$FAILED"
fi

step "2. kernel smoke pass (every CUDA path vs float64)"
if command -v compute-sanitizer >/dev/null && [ "$(elapsed)" -lt 200 ]; then
  # memcheck is slow: small shapes only. On gVisor it refuses the device; then run plainly.
  if timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $PY bench/bench_cuda.py --smoke \
       >"$OUT_DIR/smoke_memcheck.log" 2>&1; then
    tail -3 "$OUT_DIR/smoke_memcheck.log"; echo "compute-sanitizer memcheck: clean"
  else
    rc=$?
    tail -15 "$OUT_DIR/smoke_memcheck.log"
    if [ $rc -eq 9 ]; then fail "memcheck found errors"; else
      echo "(compute-sanitizer did not complete, rc=$rc: running the smoke pass without it)"
      timeout 60 $PY bench/bench_cuda.py --smoke || fail "smoke pass"
    fi
  fi
else
  timeout 60 $PY bench/bench_cuda.py --smoke || fail "smoke pass"
fi

step "3. pytest, TWINKLE_MEM_TEST_DEVICES=cpu,cuda"
TWINKLE_MEM_TEST_DEVICES=cpu,cuda timeout 200 $PY -m pytest -q -p no:cacheprovider tests \
    --junitxml="$OUT_DIR/pytest.xml" >"$OUT_DIR/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest.log" | head -40
tail -3 "$OUT_DIR/pytest.log"
[ $rc -eq 0 ] || fail "pytest (rc=$rc$([ $rc -eq 124 ] && echo ', timed out'))"

step "4. benchmark (N=16384, V=151936, bf16)"
left=$(( 540 - $(elapsed) ))
if [ "$left" -lt 90 ]; then
  fail "benchmark skipped: only ${left} s left of the script's budget"
else
  timeout "$left" $PY bench/bench_cuda.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench.log" | grep -v "^W[0-9]"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "benchmark"
fi

step "done: $FAILED failed step(s); files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit "$FAILED"
