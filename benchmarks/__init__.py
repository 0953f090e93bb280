"""Benchmark harness, outside the installed package.

``python -m benchmarks.bench`` is the benchmark; ``python -m benchmarks.compare``
sets two of its runs side by side; ``python -m benchmarks.launch_cost`` takes
the host cost of a decode call apart; ``python -m benchmarks.jax_bench`` times
``cupy_rope.jax`` under ``jax.jit`` against the jitted ``jnp`` formula.
"""
