"""Probe (deleted once answered): the flat backward kernels against
norm_rope_kernel on norm_bench's backward rows (autograd, weight grads)."""
import os
import statistics
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import norm_bench as nb  # noqa: E402
from cupy_rope import norm_launch  # noqa: E402

VARIANTS = {"rows-kernel": dict(kernels=("rows",)), "flat-u2-t1024": dict(),
            "flat-u1-t1024": dict(flat_backward_rows=1),
            "flat-u2-t512": dict(flat_backward_threads_per_sm=512),
            "flat-u2-t2048": dict(flat_backward_threads_per_sm=2048)}


def policy(name):
    norm_launch.POLICY = norm_launch.NormPolicy(**VARIANTS[name])
    norm_launch._plans.clear()


w = next(x for x in nb.WORKLOADS if x.name == os.environ.get("W", "wan-token"))
tables = nb.make_tables(w, torch)
sets = [nb.make_set(w, torch) for _ in range(3)]
copy = harness.copy_ms(w.copy_bytes("bwd"), 3, 30) * 1e3
fn = nb.Ours().forward(w, tables)
ref = nb.reference(w, sets[0], tables, torch)
for name in VARIANTS:
    policy(name)
    errs = nb.check(w, fn, sets[0], ref, torch)
    g1 = [c[0]() for c in nb._backward_calls(fn, sets[:1], torch)][0]
    g2 = [c[0]() for c in nb._backward_calls(fn, sets[:1], torch)][0]
    same = all(torch.equal(a, b) for a, b in zip(g1, g2))
    print(name, [(type(p.spec).__name__, getattr(p.spec, "rows", 0), p.shape.block[0], p.shape.grid[0]) for p in norm_launch._plans.values()], "err", errs,
          "repeat bits equal", same)
times = {n: [] for n in VARIANTS}
for _ in range(3):
    for name in VARIANTS:
        policy(name)
        calls = nb._backward_calls(fn, sets, torch)
        times[name].append(harness.time_call(lambda g: g(), calls, 20, 3).ms * 1e3)
        del calls
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{w.name} bwd {name}: {m:.1f} us ({copy / m:.3f} of copy), rounds "
          + " ".join(f"{t:.1f}" for t in ts))
