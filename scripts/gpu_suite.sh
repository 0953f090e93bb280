#!/usr/bin/env bash
# The whole GPU test suite plus the benchmark, in one call on the GPU machine:
#   bash scripts/gpu_suite.sh            (logs under $OUT, or ./gpu-logs)
# Runs from the work tree against the preinstalled packages (no install).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-rope-kernel-cache}
PY=${PYTHON:-python3}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import cupy, torch, jax; print('cupy', cupy.__version__, 'torch', torch.__version__, 'jax', jax.__version__)" 2>&1 | tee "$OUT/versions.txt"

workers=${GPU_TEST_WORKERS:-8}
xdist=""
$PY -c "import xdist" 2>/dev/null && xdist="-n $workers"
status=0
$PY -m pytest tests $xdist -q -p no:cacheprovider -rfEs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
status=${PIPESTATUS[0]}

$PY -m cupy_rope.bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "gpu suite exit status: $status"
exit $status
