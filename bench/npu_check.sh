#!/usr/bin/env bash
# For a CANN node with an Ascend NPU (910B / A2, A3): build the AscendC kernels,
# run the test suite on cpu and npu, and benchmark against torch_npu's fused
# cross-entropy. Needs: CANN sourced (ASCEND_HOME_PATH), torch + torch_npu of
# matching versions in the active Python. Writes bench/results/npu_<host>_<date>.json.
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   bash bench/npu_check.sh            # SOC_VERSION=Ascend910B2 bash ... to pin the SoC
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

: "${ASCEND_HOME_PATH:?source <CANN>/set_env.sh first (ASCEND_HOME_PATH is not set)}"
$PY -c "import torch, torch_npu; assert torch.npu.is_available(), 'no NPU visible'; print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, torch_npu.npu.get_device_name(0))"

echo "== build (setup.py drives CMake for _C_npu)"
TWINKLE_MEM_PYTHON=$(command -v "$PY") $PY setup.py build_ext --inplace 2>&1 | tail -20
ls python/twinkle_mem/_C_npu*.so

echo "== backends"
PYTHONPATH=python $PY -m twinkle_mem
PYTHONPATH=python $PY -c "import twinkle_mem; s = twinkle_mem.backends(); assert s.get('npu') == 'loaded', s"

echo "== unit tests (CPU-only parts: tiling, composite)"
PYTHONPATH=python $PY -m pytest -q tests/test_npu_tiling.py tests/test_composite.py

echo "== op tests on cpu and npu"
PYTHONPATH=python TWINKLE_MEM_TEST_DEVICES=cpu,npu $PY -m pytest -q tests/test_selective_log_softmax.py

echo "== the same op tests on npu through the composite fallback (kernel bypassed)"
PYTHONPATH=python TWINKLE_MEM_TEST_DEVICES=npu $PY - <<'PYEOF'
import sys, pytest
from twinkle_mem import composite
with composite.forced(("npu",)):
    sys.exit(pytest.main(["-q", "tests/test_selective_log_softmax.py", "-k", "not peak_memory and not cli"]))
PYEOF

echo "== benchmark vs torch_npu.npu_cross_entropy_loss"
mkdir -p bench/results
PYTHONPATH=python $PY bench/bench_npu.py --out "bench/results/npu_$(hostname)_$(date +%Y%m%d).json"
