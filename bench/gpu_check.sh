#!/usr/bin/env bash
# The one script a lent GPU machine runs (issues 11 and 51), from the repository root, in at most two calls of
# the device tool (each under its 10-minute limit; a step list chooses what a call runs):
#   build       build both native libraries in place (TORCH_CUDA_ARCH_LIST, default 9.0), the ptxas register /
#               stack / spill figures of every kernel (ptxas.json); skipped where a library built by an earlier
#               call of this machine is newer than csrc/ and setup.py. Every other step needs it: it is added.
#   tests       the test suite on the GPU: tests/backends/cuda/test_cuda.py, the numerics classes on the "cuda"
#               implementation and every device-parametrized test, TWINKLE_MEM_TEST_DEVICES=cpu,cuda (pytest.xml, .log)
#   invariance  the fused LM head's batch invariance: bench/check_linear_invariance.py, five rows alone and inside
#               batches of N = 1, 7, 333, 4096, 16384 at V = 151936, bf16, bit for bit, and each batch's log-probs
#               against its no_grad forward, a frozen and a trainable head (linear_invariance*.log)
#   sanitizers  compute-sanitizer memcheck, racecheck and synccheck on the smoke pass (bench/bench_cuda.py --smoke)
#   op          bench/bench_cuda.py at N = 16384, V = 151936, bf16: the op against Liger-Kernel, torch.compile and
#               naive, first and last rows against float64, as a fraction of the copy bandwidth (bench_cuda.*)
#   heads       bench/bench_head_peers.py: the fused head and the op against every peer, the Qwen2.5-7B and 1.5B
#               heads, N = 16384, bf16 (head_peers.*)
#   verl        bench/bench_verl_forward.py: verl's own forward of a Qwen2.5-1.5B-shaped model, logits / torch /
#               triton / twinkle paths (verl_forward.*)
#   ncu         Nsight Compute on the fused head's forward (1.5B head) and the op's kernels (ncu_head.txt), by name
#               or in call 2 when time is left
#
# The budget, from the last H200 run's logs (bench/results/gpu_check_h200_2026-12-04/gpu_check.md: build 45 s +
# ptxas 4, tests 159, invariance 13 at N <= 4096, memcheck 17, racecheck 29, synccheck 9, op 46; 341 s in all) and,
# for the steps never run on a GPU, their own time budgets: ESTIMATE below, in seconds. A call stops starting steps
# that would not fit in CALL_LIMIT (570 s, under the tool's 600): such a step is recorded SKIP with the command that
# runs it.
#   --call 1   build,tests,invariance,sanitizers,op   about 390 s
#   --call 2   build,heads,verl,ncu                   about 55 (0 on a machine still warm from call 1) + 300 + 150 +
#                                                     60 s: ncu is skipped first where less is left
# A session's 15 minutes of device time hold both calls (about 12.5 minutes of commands) and one machine start only
# when call 2 follows call 1 at once (the machine stays warm 30 s: its build is then skipped); else run call 2 with
# --steps build,heads,verl.
#
# Results go to bench/results/gpu_check_<gpu>_<date>/ (gpu: the device's model, e.g. h200; date: YYYY-MM-DD, the
# folder to commit): per-step logs, gpu_check.json + gpu_check.md (the step table), and each step's own files.
# When the device tool provides $OUT (it brings back at most 8 files), bench/pack_results.py copies there
# gpu_check.json, gpu_check.md and the steps' main results (bench_cuda.json/.png, ptxas.json, head_peers.json/.png,
# verl_forward.json/.png; the first that fit beside the archive) and puts EVERY other file in one
# gpu_check_logs.tar.gz. Back here, `python bench/pack_results.py --record <files_at>` unpacks a call's files into
# that folder under bench/results/ (a second call's step table added to the first's). A new step needs a name in
# STEPS, an ESTIMATE, and run_step NAME LIMIT "$RESULTS/<name>.log" COMMAND... in its branch below.
# Exit status: the number of failed steps (0 = all passed).
#
#   bash bench/gpu_check.sh --call 1        # on the GPU machine (device tool: timeout_s=600, carry .whl)
#   bash bench/gpu_check.sh --call 2
#   bash bench/gpu_check.sh --steps heads   # any steps, in their order above
#   bash bench/gpu_check.sh --list [--call 2 | --steps ...]   # the steps a call would run and their estimates
#   bash bench/gpu_check.sh --dry-run       # here, without a GPU: every step's logic on the CPU
#                                           # (results in $TMPDIR, not bench/results)
#
# The GPU machine has torch (CUDA), Python, nvcc, ncu and compute-sanitizer, pytest and hypothesis, and NO package
# registry. `bash bench/carry_wheels.sh` puts in .whl/ (git-ignored: pass carry=[".whl"] to the device tool) the
# peers (Liger-Kernel, Cut Cross-Entropy, verl) and what verl's import needs beyond the machine's packages; this
# script unpacks them into /tmp/site (no pip). Without a peer its rows say so; without verl's needs the verl step
# fails with one sentence naming them.
set -u -o pipefail

STEPS_ALL=(build tests invariance sanitizers op heads verl ncu)
declare -A ESTIMATE=([build]=55 [tests]=165 [invariance]=60 [sanitizers]=60 [op]=50 [heads]=300 [verl]=150 [ncu]=60)
declare -A CALLS=([1]="build,tests,invariance,sanitizers,op" [2]="build,heads,verl,ncu")
CALL_LIMIT=${GPU_CHECK_CALL_LIMIT:-570}  # seconds a call may use (the device tool stops a command at 600)

usage() { sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//; /^set -u/d'; }
DRY_RUN=0
LIST=0
WANTED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --list) LIST=1 ;;
    --call) WANTED=${CALLS[${2:-}]:-}; [ -n "$WANTED" ] || { echo "gpu_check.sh: --call takes 1 or 2" >&2; exit 2; }; shift ;;
    --steps) WANTED=${2:-}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
# The steps to run, in STEPS_ALL's order; build added for the others (they need the library); all by default.
[ -z "$WANTED" ] && WANTED=$(IFS=,; echo "${STEPS_ALL[*]}")
declare -A ASKED=()
for step in ${WANTED//,/ }; do
  [ -n "${ESTIMATE[$step]:-}" ] || { echo "gpu_check.sh: unknown step '$step' (steps: ${STEPS_ALL[*]})" >&2; exit 2; }
  ASKED[$step]=1
done
[ ${#ASKED[@]} -gt 0 ] && ASKED[build]=1
SELECTED=()
TOTAL=0
for step in "${STEPS_ALL[@]}"; do
  [ -n "${ASKED[$step]:-}" ] && SELECTED+=("$step") && TOTAL=$((TOTAL + ESTIMATE[$step]))
done
if [ $LIST -eq 1 ]; then
  for step in "${SELECTED[@]}"; do echo "$step ${ESTIMATE[$step]}"; done
  echo "total $TOTAL (a call may use $CALL_LIMIT s)"
  exit 0
fi
selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

START=$(date +%s)
PY=${PYTHON:-python3}
ARCHS=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
if [ $DRY_RUN -eq 1 ]; then
  RESULTS=${TMPDIR:-/tmp}/twinkle_mem_gpu_check_dry_run  # never mistaken for GPU figures
else
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  GPU_SHORT=$(echo "$GPU" | tr 'A-Z' 'a-z' | grep -oE '\b[a-z]{1,2}[0-9]{2,4}\b' | head -1)
  RESULTS=${GPU_CHECK_RESULTS:-bench/results/gpu_check_${GPU_SHORT:-gpu}_$(date +%F)}
fi
rm -rf "$RESULTS"  # this call's files only: everything in it goes back through $OUT
mkdir -p "$RESULTS"
# The GPU run builds the library in place and imports it from python/. A dry run builds nothing: it imports the
# tree only where a library was built in it, else the installed package (a clean checkout installed the way CI
# installs it), whose kernels the benchmark steps need.
if [ $DRY_RUN -eq 0 ] || ls python/twinkle_mem/_C_cpu*.so >/dev/null 2>&1; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
FAILED=0
STEP_LINES=()  # "name|status|seconds|note"

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( CALL_LIMIT - $(elapsed) )); }
banner() { echo; echo "=== [$(elapsed) s] $*"; }
# record NAME STATUS SECONDS NOTE
record() {
  STEP_LINES+=("$1|$2|$3|$4")
  if [ "$2" = "FAIL" ]; then FAILED=$((FAILED + 1)); echo "!!! FAILED: $1 ($4)"; fi
}
# run_step NAME TIMEOUT LOG COMMAND...: runs COMMAND under a time limit (at most the call's time left), output to
# LOG; a failure's note carries the log's last line (a refusal says there what is missing)
run_step() {
  local name=$1 limit=$2 log=$3 t0 rc last
  shift 3
  # (a dry run on a slow shared CPU is not held to the device's call limit)
  [ $DRY_RUN -eq 0 ] && [ "$(left)" -lt "$limit" ] && limit=$(( $(left) > 1 ? $(left) : 1 ))
  t0=$(date +%s)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  tail -5 "$log"
  if [ $rc -eq 0 ]; then
    record "$name" PASS $(( $(date +%s) - t0 )) "$(basename "$log")"
  else
    last=$(grep -v '^\s*$' "$log" | tail -1 | tr '|' '/' | cut -c1-200)
    record "$name" FAIL $(( $(date +%s) - t0 )) "rc=$rc$([ $rc -eq 124 ] && echo ', timed out'), $(basename "$log"): $last"
  fi
  return $rc
}
# fits STEP [NEEDED]: whether the call has NEEDED seconds (default the step's ESTIMATE) left; else records a SKIP
fits() {
  local needed=${2:-${ESTIMATE[$1]}}
  [ $DRY_RUN -eq 1 ] && return 0
  [ "$(left)" -ge "$needed" ] && return 0
  record "$1" SKIP 0 "$(left) s of the call left, it needs about $needed s: run it in another call (--steps $1)"
  return 1
}

banner "environment: steps ${SELECTED[*]} (estimated $TOTAL s; this call may use $CALL_LIMIT s); results in $RESULTS"
if [ $DRY_RUN -eq 1 ]; then
  echo "dry run: no GPU; every step's Python runs on the CPU"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
fi
# setuptools >= 77 reads pyproject.toml's SPDX license (torch requires it, so it comes with torch)
$PY -c "import torch, sys, setuptools; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| setuptools', setuptools.__version__)"
command -v nvcc >/dev/null && nvcc --version | tail -1
echo "C++ compiler: ${CXX:-g++} ($("${CXX:-g++}" --version 2>/dev/null | head -1))"

if ls .whl/*.whl >/dev/null 2>&1; then
  banner "carried wheels: $(ls .whl | tr '\n' ' ')"
  # Wheels are zip files of importable packages: unpacked onto the path, no pip. Where the machine has its own
  # pytest and hypothesis (the H200 image, with pytest-xdist and plugins built for them), the carried test tools
  # are left out: a carried pytest ahead on the path would shadow it.
  # A wheel built for another CPython (tensordict's, carried for the device's 3.12) is left out too: it cannot load.
  wheels=()
  have_tests=0
  $PY -c 'import pytest, hypothesis' 2>/dev/null && have_tests=1
  py_tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  for whl in .whl/*.whl; do
    case $(basename "$whl") in
      pytest-*|hypothesis-*|iniconfig-*|pluggy-*|pygments-*|attrs-*|sortedcontainers-*|exceptiongroup-*|tomli-*|packaging-*)
        [ $have_tests -eq 1 ] && continue ;;
    esac
    if [[ $(basename "$whl") =~ -cp3[0-9]+- && $(basename "$whl") != *-$py_tag-* ]]; then
      echo "(left out $(basename "$whl"): built for another Python than this $py_tag)"
      continue
    fi
    wheels+=("$whl")
  done
  [ $have_tests -eq 1 ] && echo "pytest and hypothesis are installed here: the carried test tools are left out"
  SITE=/tmp/site
  [ $DRY_RUN -eq 1 ] && SITE=${TMPDIR:-/tmp}/twinkle_mem_gpu_check_dry_run_site  # (a shared machine's /tmp/site untouched)
  rm -rf "$SITE" && mkdir -p "$SITE"
  for whl in "${wheels[@]}"; do $PY -m zipfile -e "$whl" "$SITE" || echo "(could not unpack $whl)"; done
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
fi

if selected build; then
  banner "build in place (TORCH_CUDA_ARCH_LIST=$ARCHS) and ptxas figures"
  if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
  export CUDA_HOME
  built=$(ls python/twinkle_mem/_C_cuda*.so 2>/dev/null | head -1)
  if [ $DRY_RUN -eq 1 ]; then
    # The ptxas parser on a log of nvcc's -Xptxas=-v (no build here: the CPU library is assumed built).
    if command -v nvcc >/dev/null; then
      run_step "ptxas figures (compiled here)" 300 "$RESULTS/ptxas.log" \
        env TORCH_CUDA_ARCH_LIST="$ARCHS" "$PY" .ci/check_cuda_build.py --skip-install-check --json "$RESULTS/ptxas.json"
    else
      record "ptxas figures" SKIP 0 "no nvcc"
    fi
  elif [ -n "$built" ] && [ -z "$(find csrc setup.py -newer "$built" -type f | head -1)" ] \
      && $PY -c 'import sys, twinkle_mem; sys.exit(twinkle_mem.backends().get("cuda") != "loaded")' 2>/dev/null; then
    record "build" PASS 0 "up to date: $built (an earlier call on this machine) is newer than csrc/ and setup.py"
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
fi

if selected tests && fits tests; then
  banner "tests on the GPU (TWINKLE_MEM_TEST_DEVICES=cpu,cuda)"
  # A test module that cannot import (a missing package) is reported, and the others still run.
  if ! missing=$($PY -c 'import importlib.util as u, sys; print(" ".join(m for m in ("pytest", "hypothesis") if u.find_spec(m) is None))') \
      || [ -n "$missing" ]; then
    record "pytest cuda" FAIL 0 "not run: ${missing:-python} not importable (bash bench/carry_wheels.sh, carry .whl)"
  elif [ $DRY_RUN -eq 1 ]; then  # (-m '': both test tiers, pyproject.toml leaving out the marker e2e)
    run_step "pytest (dry run: collection only)" 120 "$RESULTS/pytest.log" \
      env TWINKLE_MEM_TEST_DEVICES=cpu,cuda "$PY" -m pytest -q -p no:cacheprovider -m '' tests --collect-only \
      -k "cuda and not emulat" --ignore=tests/integrations/verl
  else
    # With pytest-xdist, a test that leaves a device-side assert behind ends its worker alone (tests/conftest.py).
    # The verl tier (CPU tests, its own venv in CI) is left out: verl's carried wheel is the benchmarks', without Ray.
    PYTEST_EXTRA=(--ignore=tests/integrations/verl)
    $PY -c 'import xdist' 2>/dev/null && PYTEST_EXTRA+=(-n 4)
    # The twinkle-kit integration tests import twinkle (CI installs it; the GPU machine has none).
    $PY -c 'import twinkle' 2>/dev/null || { PYTEST_EXTRA+=(--ignore=tests/integrations/twinkle/test_integration_twinkle.py)
      echo "twinkle-kit is not installed: tests/integrations/twinkle/test_integration_twinkle.py left out"; }
    run_step "pytest cuda" 240 "$RESULTS/pytest.log" \
      env TWINKLE_MEM_TEST_DEVICES=cpu,cuda "$PY" -m pytest -q -p no:cacheprovider -m '' tests -k "cuda and not emulat" \
      "${PYTEST_EXTRA[@]}" --continue-on-collection-errors --junitxml="$RESULTS/pytest.xml"
    grep -E "^(FAILED|ERROR)" "$RESULTS/pytest.log" | head -20
  fi
fi

if selected invariance && fits invariance; then
  banner "fused LM head: rows bitwise the same at N = 1, 7, 333, 4096, 16384 (V = 151936, bf16)"
  INVARIANCE_ARGS=(--device cuda --n 1 7 333 4096 16384)
  [ $DRY_RUN -eq 1 ] && INVARIANCE_ARGS=(--device cpu --h 16 --vocab 8500 --n 1 7 600)
  run_step "fused head batch invariance" 180 "$RESULTS/linear_invariance.log" "$PY" bench/check_linear_invariance.py "${INVARIANCE_ARGS[@]}"
  # a trainable head too (its backward's products batched over a step, grad_weight's sums one product per step)
  run_step "fused head batch invariance, trainable" 120 "$RESULTS/linear_invariance_trainable.log" "$PY" \
    bench/check_linear_invariance.py "${INVARIANCE_ARGS[@]}" --trainable
fi

if selected sanitizers && fits sanitizers; then
  banner "compute-sanitizer on the smoke pass"
  if [ $DRY_RUN -eq 1 ]; then
    run_step "smoke pass (dry run, CPU kernels)" 120 "$RESULTS/smoke.log" "$PY" bench/bench_cuda.py --device cpu --smoke
  fi
  for tool in memcheck racecheck synccheck; do
    if [ $DRY_RUN -eq 1 ]; then
      echo "would run: compute-sanitizer --tool $tool --error-exitcode 9 $PY bench/bench_cuda.py --smoke"
      record "compute-sanitizer $tool" SKIP 0 "dry run"
    elif ! command -v compute-sanitizer >/dev/null; then
      record "compute-sanitizer $tool" SKIP 0 "compute-sanitizer not found"
    else
      dtypes=bf16,fp16,fp32,fp64
      [ "$tool" != memcheck ] && dtypes=bf16,fp32  # racecheck and synccheck are slower: two dtypes cover the paths
      run_step "compute-sanitizer $tool" 90 "$RESULTS/sanitizer_$tool.log" \
        compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" bench/bench_cuda.py --smoke --smoke-dtypes "$dtypes"
    fi
  done
fi

if selected op && fits op; then
  banner "the op (N=16384, V=151936, bf16) against its peers, first/last rows vs float64"
  if [ $DRY_RUN -eq 1 ]; then
    run_step "op benchmark (dry run, CPU, N=64 V=4099)" 300 "$RESULTS/bench.log" \
      "$PY" bench/bench_cuda.py --device cpu --n 64 --v 4099 --reps 2 --warmup 1 --out "$RESULTS"
  else
    run_step "op benchmark" 150 "$RESULTS/bench.log" "$PY" bench/bench_cuda.py --out "$RESULTS"
    grep -v "^W[0-9]" "$RESULTS/bench.log" | tail -30
  fi
fi

if selected heads && fits heads 120; then
  banner "the fused heads and the op against every peer (Qwen2.5-7B and 1.5B heads, N = 16384, bf16)"
  if [ $DRY_RUN -eq 1 ]; then
    run_step "heads vs peers (dry run, CPU, tiny shapes)" 300 "$RESULTS/head_peers.log" \
      "$PY" bench/bench_head_peers.py --dry-run --shapes 32x777 --outputs logp_grad forward --heads frozen \
      --count-ops --out "$RESULTS/head_peers"
  else
    # its own budget: the cells it cannot reach are reported "not run" (a minute kept for verl and the packing)
    budget=$(( $(left) - ESTIMATE[verl] - 30 ))
    [ "$budget" -gt "${ESTIMATE[heads]}" ] && budget=${ESTIMATE[heads]}
    run_step "heads vs peers" $((budget + 60)) "$RESULTS/head_peers.log" \
      "$PY" bench/bench_head_peers.py --reps 3 --count-ops --time-budget "$budget" --out "$RESULTS/head_peers"
  fi
  grep -E "^target|^note" "$RESULTS/head_peers.log"
fi

if selected verl && fits verl 90; then
  banner "verl's own forward, Qwen2.5-1.5B-shaped, paths logits / torch / triton / twinkle"
  if [ $DRY_RUN -eq 1 ] && ! $PY -c 'import sys; sys.path.insert(0, "bench"); import verl_import; sys.exit(bool(verl_import.missing()))' 2>/dev/null; then
    record "verl forward" SKIP 0 "dry run: $($PY -c 'import sys; sys.path.insert(0, "bench"); import verl_import; print(verl_import.refusal(verl_import.missing()))')"
  else
    DRY=()
    [ $DRY_RUN -eq 1 ] && DRY=(--dry-run)
    run_step "verl forward" 240 "$RESULTS/verl_forward.log" \
      "$PY" bench/bench_verl_forward.py "${DRY[@]}" --timeout 200 --out "$RESULTS/verl_forward"
  fi
fi

if selected ncu && fits ncu; then
  banner "Nsight Compute: the fused head's forward (1.5B head) and the op's kernels"
  NCU_ARGS=(--shapes 1536x151936 --outputs forward --peers twinkle_fused,unfused_op --reps 0 --warmup 0)
  if [ $DRY_RUN -eq 1 ] || ! command -v ncu >/dev/null; then
    echo "would run: ncu --section SpeedOfLight --launch-count 60 $PY bench/bench_head_peers.py ${NCU_ARGS[*]}"
    record "ncu" SKIP 0 "$([ $DRY_RUN -eq 1 ] && echo 'dry run' || echo 'ncu not found')"
  else
    run_step "ncu" 120 "$RESULTS/ncu_head.txt" ncu --section SpeedOfLight --section LaunchStats --section Occupancy \
      --launch-count 60 "$PY" bench/bench_head_peers.py "${NCU_ARGS[@]}" --out "$RESULTS/ncu_head_run"
  fi
fi

banner "summary"
printf '%s\n' "${STEP_LINES[@]}" | $PY bench/bench_common.py steps "$RESULTS/gpu_check.md" "$RESULTS/gpu_check.json" \
  dry_run="$([ "$DRY_RUN" -eq 1 ] && echo true || echo false)" failed="$FAILED" seconds="$(elapsed)" \
  folder="\"$(basename "$RESULTS")\"" steps="\"$(IFS=,; echo "${SELECTED[*]}")\""
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  echo "to \$OUT (what the device tool brings back):"
  $PY bench/pack_results.py "$RESULTS" "$OUT" --archive gpu_check_logs.tar.gz \
    --keep gpu_check.json,gpu_check.md,bench_cuda.json,head_peers.json,verl_forward.json,bench_cuda.png,head_peers.png,ptxas.json,verl_forward.png \
    || echo "!!! \$OUT holds more than the device tool brings back (see above)"
fi
echo "done in $(elapsed) s: $FAILED failed step(s); files in $RESULTS"
exit "$FAILED"
