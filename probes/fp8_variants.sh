#!/usr/bin/env bash
set -u
export PYTHONPATH=.
for round in 1 2; do
  for v in base k_mul k_dbl k_mark; do
    [ $v = base ] && kdir=kernels || kdir=probes/$v
    echo "== $v round $round"
    KDIR=$kdir python probes/fp8_variants.py --cache float8_e4m3fn 2>&1 | grep -E "^\| cache-decode.*cupy-rope fused" | cut -c1-110
  done
done
