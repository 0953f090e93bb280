#!/usr/bin/env bash
# Qwen3 backward and decode rows of the fused norm under kernel variants, interleaved.
set -u
cp -r kernels /tmp/k_new
export PYTHONPATH=.
for round in 1 2; do
for v in k_old k_new k_glob k_oldglob; do
  rm -rf kernels; if [ $v = k_new ]; then cp -r /tmp/k_new kernels; else cp -r probes/$v kernels; fi
  echo "== $v round $round"
  python -m benchmarks.norm_bench --peers none --workloads qwen3-8b-prefill,decode-qkv-t64 --no-check 2>&1 | grep -E "^\| .*cupy-rope" | cut -c1-70
done
done
rm -rf kernels; cp -r /tmp/k_new kernels
