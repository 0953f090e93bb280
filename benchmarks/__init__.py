"""Benchmark harness, outside the installed package.

``python -m benchmarks.bench`` is the benchmark; ``python -m benchmarks.compare``
sets two of its runs side by side; ``python -m benchmarks.launch_cost`` takes
the host cost of a decode call apart; ``python -m benchmarks.jax_bench`` times
``cupy_rope.jax`` under ``jax.jit`` against the jitted ``jnp`` formula;
``python -m benchmarks.norm_bench`` and ``python -m benchmarks.cache_bench``
time the fused ops (q/k RMSNorm + RoPE, RoPE + KV-cache write) against their
unfused chains; ``python -m benchmarks.record`` adds a run to results/.
``benchmarks/harness.py`` holds what they share: GPU timing, the copy
baseline, CUDA-graph replay, rows in results/runs.csv's columns, tables and
the command line.
"""
