#!/usr/bin/env bash
# The one script to run first on a CANN node with an Ascend NPU (A2 / A3:
# 910B, 910_93): builds the AscendC kernels, runs the CPU-side NPU tests and the
# numerics suite on the NPU (the kernel, then the composite on the same
# device), the op tests on cpu and npu, benchmarks the op against the composite,
# eager PyTorch and torch_npu's own fused cross-entropy, and times the fused LM
# head against the unfused paths with bench/bench_head_peers.py (issue 51: the
# same script as on a GPU; host launches matter even more on Ascend).
# Needs: CANN sourced (ASCEND_HOME_PATH), torch + the matching torch_npu in the
# active Python, cmake and a C++ compiler; nothing from a package registry: the
# test steps need pytest and hypothesis, which `bash bench/carry_wheels.sh` puts in
# .whl/ (wheels, unpacked here into /tmp/site without pip) where the
# node has none. The same plan as bench/gpu_check.sh: a step list chooses what a
# call runs (--steps build,heads; build and loaded are added for the others;
# default all), every chosen step runs, its output in
# bench/results/npu_check_<soc>_<date>/<n>.log (soc: the NPU's name, e.g. ascend910b2; NPU_CHECK_RESULTS
# overrides the folder); the script exits non-zero if any failed and lists them. The step table goes to
# npu_check.json + npu_check.md, the benchmarks to bench_npu.json and head_peers.*; with $OUT set (a
# device tool that brings back at most 8 files), bench/pack_results.py puts those
# there and every log in one npu_check_logs.tar.gz (`python bench/pack_results.py --record FILES_AT` files
# them under bench/results/ here). No NPU figure was ever measured, so no step has a time estimate yet: the
# step table records each step's seconds for the next plan.
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   bash bench/npu_check.sh            # SOC_VERSION=Ascend910B2 bash ... to pin the SoC
#   bash bench/npu_check.sh --steps heads
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
STEPS_ALL=(build loaded cpu_tests numerics composite op_tests label op heads)
WANTED=$(IFS=,; echo "${STEPS_ALL[*]}")
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) WANTED=${2:-}; shift ;;
    *) echo "npu_check.sh: unknown argument $1 (--steps LIST, of: ${STEPS_ALL[*]})" >&2; exit 2 ;;
  esac
  shift
done
SELECTED=" build loaded "  # (every other step needs the library built and loaded)
for name in ${WANTED//,/ }; do
  [[ " ${STEPS_ALL[*]} " == *" $name "* ]] || { echo "npu_check.sh: unknown step '$name' (steps: ${STEPS_ALL[*]})" >&2; exit 2; }
  SELECTED+="$name "
done
selected() { [[ "$SELECTED" == *" $1 "* ]]; }
FAILED=()
STEPS=()  # "name|status|seconds|log"
NUM=0
step() {  # step "name" command...: runs it (output to the console and to its log), records the result, goes on
  local name=$1 log t0 rc
  shift
  NUM=$((NUM + 1))
  log="$RESULTS/step$NUM.log"
  echo
  echo "== $name"
  t0=$(date +%s)
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    STEPS+=("$name|PASS|$(( $(date +%s) - t0 ))|$(basename "$log")")
  else
    echo "!! $name failed"
    FAILED+=("$name")
    STEPS+=("$name|FAIL|$(( $(date +%s) - t0 ))|rc=$rc, $(basename "$log")")
  fi
}
summary() {  # the step table (npu_check.md, npu_check.json) and, with $OUT, what comes back
  printf '%s\n' "${STEPS[@]}" | "$PY" bench/bench_common.py steps "$RESULTS/npu_check.md" "$RESULTS/npu_check.json" \
    failed="${#FAILED[@]}" folder="\"$(basename "$RESULTS")\"" steps="\"$(echo $SELECTED | tr ' ' ',')\""
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    "$PY" bench/pack_results.py "$RESULTS" "$OUT" --archive npu_check_logs.tar.gz \
      --keep npu_check.json,npu_check.md,bench_npu.json,head_peers.json,head_peers.md,head_peers.png \
      || echo "!! \$OUT holds more than comes back"
  fi
}

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "carried wheels: $(ls .whl | tr '\n' ' ')"
  mkdir -p /tmp/site
  for whl in .whl/*.whl; do "$PY" -m zipfile -e "$whl" /tmp/site || echo "(could not unpack $whl)"; done
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  echo "!! pytest or hypothesis not importable: the test steps will fail (bash bench/carry_wheels.sh, carry .whl)"
fi

: "${ASCEND_HOME_PATH:?source <CANN>/set_env.sh first (ASCEND_HOME_PATH is not set)}"
DEVICE_LINE=$("$PY" - <<'PYEOF'
import torch, torch_npu
assert torch.npu.is_available(), "no NPU visible to torch_npu"
print("torch", torch.__version__, "torch_npu", torch_npu.__version__, "device", torch_npu.npu.get_device_name(0),
      "count", torch.npu.device_count())
PYEOF
) || { echo "$DEVICE_LINE"; exit 1; }
echo "$DEVICE_LINE"
SOC=$(echo "$DEVICE_LINE" | grep -oiE 'ascend[0-9a-z_]+' | head -1 | tr 'A-Z' 'a-z')
RESULTS=${NPU_CHECK_RESULTS:-bench/results/npu_check_${SOC:-npu}_$(date +%F)}
rm -rf "$RESULTS"  # this run's files only
mkdir -p "$RESULTS"
echo "steps:$SELECTED; results in $RESULTS"

selected build && step "build (setup.py drives CMake for _C_npu)" \
  env TWINKLE_MEM_PYTHON="$(command -v "$PY")" "$PY" setup.py build_ext --inplace
selected loaded && step "_C_npu built and loaded" "$PY" - <<'PYEOF'
import glob, sys
import twinkle_mem
print(glob.glob("python/twinkle_mem/_C_npu*.so"), twinkle_mem.backends())
sys.exit(0 if twinkle_mem.backends().get("npu") == "loaded" else 1)
PYEOF

# (-m '': both test tiers of these files, the CMake build included: pyproject.toml leaves out the marker e2e)
selected cpu_tests && step "CPU-side NPU tests (plan, stand-in of the kernel, CMake check) and numerics on the CPU" \
  "$PY" -m pytest -q -p no:cacheprovider -m '' tests/backends/npu/test_npu_tiling.py \
  tests/backends/npu/test_npu_emulation.py tests/backends/npu/test_npu_cmake.py tests/op/test_numerics.py
selected numerics && step "numerics suite on the NPU: the AscendC kernels" \
  "$PY" -m pytest -q -p no:cacheprovider tests/backends/npu/test_npu_device.py
selected composite && step "numerics suite on the NPU: the composite (kernel bypassed)" \
  env TWINKLE_MEM_NPU_COMPOSITE=1 "$PY" -m pytest -q -p no:cacheprovider tests/backends/npu/test_npu_device.py
selected op_tests && step "op tests on cpu and npu" \
  env TWINKLE_MEM_TEST_DEVICES=cpu,npu "$PY" -m pytest -q -p no:cacheprovider tests/op/test_selective_log_softmax.py
selected label && step "label check without a host sync: an out-of-range label raises at a later call" "$PY" - <<'PYEOF'
import torch, torch_npu  # noqa: F401
import twinkle_mem
x = torch.randn(4, 1000, device="npu").bfloat16()
y = torch.tensor([1, 2, 5000, 3], device="npu")
logp = twinkle_mem.selective_log_softmax(x, y)
assert torch.isnan(logp.cpu()[2]) and torch.isfinite(logp.cpu()[[0, 1, 3]]).all(), logp
torch.npu.synchronize()
try:
    twinkle_mem.selective_log_softmax(x, y.clamp(max=999))
except RuntimeError as e:
    assert "label out of range" in str(e), e
    print("raised:", str(e)[:120])
else:
    raise SystemExit("no error for an out-of-range label")
PYEOF

selected op && step "benchmark vs the composite, eager and torch_npu.npu_cross_entropy_loss" \
  "$PY" bench/bench_npu.py --out "$RESULTS/bench_npu.json"
# The fused head against the unfused paths (the GPU peers need CUDA; torch.compile where torch_npu takes it)
selected heads && step "fused heads vs unfused (bench_head_peers.py, 1.5B and 7B heads, N = 16384, bf16)" \
  "$PY" bench/bench_head_peers.py --device npu --peers twinkle_fused,unfused_op,unfused_torch,compiled --count-ops \
  --out "$RESULTS/head_peers"

echo
summary
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "npu_check: every step passed"
