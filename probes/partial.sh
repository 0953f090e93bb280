#!/usr/bin/env bash
# partial-0.25 in place: this tree against c395a14's (library and harness), interleaved.
set -u
for round in 1 2; do
  echo "== HEAD round $round"
  PYTHONPATH=. python -m benchmarks.bench --workloads inplace-full,partial-0.5,partial-0.25 --peers liger --no-host 2>&1 | grep -E "^\[bench\] (inplace|partial).*(cupy-rope|liger)"
  echo "== c395a14 round $round"
  (cd probes/c395 && PYTHONPATH=. python -m benchmarks.bench --workloads inplace-full,partial-0.5,partial-0.25 --peers liger --no-host 2>&1 | grep -E "^\[bench\] (inplace|partial).*(cupy-rope|liger)")
  echo "== c395a14 library, HEAD harness, round $round"
  mkdir -p /tmp/mix && rm -rf /tmp/mix/* && cp -r probes/c395/cupy_rope probes/c395/kernels /tmp/mix/ && cp -r benchmarks /tmp/mix/
  (cd /tmp/mix && PYTHONPATH=. python -m benchmarks.bench --workloads inplace-full,partial-0.5,partial-0.25 --peers liger --no-host 2>&1 | grep -E "^\[bench\] (inplace|partial).*(cupy-rope|liger)")
done
