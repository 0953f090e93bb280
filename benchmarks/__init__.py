"""Benchmark harness (outside the installed package): python -m benchmarks.bench."""
