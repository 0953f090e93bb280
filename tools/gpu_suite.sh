#!/usr/bin/env bash
# The GPU suite in one call on the GPU machine: the tests, compute-sanitizer
# over tools/sanitize.py, and the benchmark (python -m benchmarks.bench).
#   bash tools/gpu_suite.sh            (logs under $OUT, or ./gpu-logs)
# Runs from the work tree against the preinstalled packages (no install of
# cupy-rope itself). Wheels carried in .whl/ (e.g. Liger, a benchmark peer)
# are installed to /tmp/site first.
#
# Environment knobs:
#   GPU_TEST_WORKERS, PYTEST_ARGS        pytest-xdist workers, extra pytest arguments
#   BENCH_ARGS                           benchmark flags (python -m benchmarks.bench --help)
#   EXTRA_BENCHES                        the other benchmarks run after it, each writing
#                                        NAME.rows.json for benchmarks.record (default:
#                                        jax_bench norm_bench cache_bench, those present)
#   TEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT   seconds per part (the benchmark's
#                                        limit holds for each of its runs)
#   SANITIZE_TOOLS                       compute-sanitizer tools to run
#   SKIP_TESTS, SKIP_SANITIZE, SKIP_BENCH   run one part per call when all do not fit
#                                        one call's limit
#   BASELINE=/path/to/old/tree           (absolute or from the repository root) after the
#                                        benchmark, benchmark that tree too
#                                        (same BENCH_ARGS, same GPU) and print
#                                        benchmarks/compare.py's table of the two
#   BASELINE_ARGS                        the old tree's benchmark flags (default BENCH_ARGS)
#   COMPARE_ARGS                         flags of benchmarks/compare.py (--strict makes
#                                        a flagged row fail the suite)
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu_suite.sh: no NVIDIA GPU here (nvidia-smi failed); the CPU tests run with: pytest"
  exit 2
fi
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the baseline benchmark runs from its own tree
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-rope-kernel-cache}
PY=${PYTHON:-python3}
site=""

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && site=/tmp/site && export PYTHONPATH=$PYTHONPATH:$site
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import cupy, torch, jax; print('cupy', cupy.__version__, 'torch', torch.__version__, 'jax', jax.__version__)" 2>&1 | tee "$OUT/versions.txt"

workers=${GPU_TEST_WORKERS:-16}
xdist=""
$PY -c "import xdist" 2>/dev/null && xdist="-n $workers"
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-420}" $PY -m pytest tests $xdist -q -p no:cacheprovider \
    -p no:benchmark -rfEs ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
  status=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30
fi
if [ -z "${SKIP_SANITIZE:-}" ]; then
  # Every kernel path (tools/sanitize.py, checked against float64 as it
  # runs) under compute-sanitizer; a tool's summary must say 0 errors.
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    timeout "${SANITIZE_TIMEOUT:-300}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      $PY tools/sanitize.py > "$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    [ $rc = 0 ] || status=1
    echo "compute-sanitizer $tool: exit $rc"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize.py:" "$OUT/sanitize-$tool.log" | tail -3
  done
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-240}" $PY -m benchmarks.bench --json "$OUT/bench.json" \
    --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  [ $? = 0 ] || status=1
  tail -60 "$OUT/bench.log"
  for name in ${EXTRA_BENCHES:-jax_bench norm_bench cache_bench}; do
    [ -f "benchmarks/$name.py" ] || continue
    timeout "${BENCH_TIMEOUT:-240}" $PY -m "benchmarks.$name" \
      --json "$OUT/${name%_bench}.rows.json" > "$OUT/$name.log" 2>&1
    [ $? = 0 ] || status=1
    grep -E "^[|#]" "$OUT/$name.log" | tail -30
  done
fi
if [ -z "${SKIP_BENCH:-}" ] && [ -n "${BASELINE:-}" ]; then
  # The old tree runs from its own root with only itself (and the carried
  # wheels) on the path, so that none of this tree's modules shadow its own.
  # Trees from before the package split keep the harness in cupy_rope/.
  BASELINE=$(cd "$BASELINE" && pwd) || exit 2
  module=benchmarks.bench
  [ -f "$BASELINE/benchmarks/bench.py" ] || module=cupy_rope.bench
  (cd "$BASELINE" && PYTHONPATH=$BASELINE${site:+:$site} timeout "${BENCH_TIMEOUT:-240}" \
    $PY -m $module --json "$OUT/bench-baseline.json" ${BASELINE_ARGS:-${BENCH_ARGS:-}}) \
    > "$OUT/bench-baseline.log" 2>&1
  [ $? = 0 ] || status=1
  echo "baseline benchmark ($BASELINE, $module): log in $OUT/bench-baseline.log"
  $PY -m benchmarks.compare "$OUT/bench-baseline.json" "$OUT/bench.json" ${COMPARE_ARGS:-} \
    | tee "$OUT/compare.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
echo "gpu suite exit status: $status"
exit $status
