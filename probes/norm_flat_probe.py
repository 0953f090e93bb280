"""Probe (deleted once answered): norm_flat_kernel (1, 2, 4 rows a thread)
against norm_rope_kernel on norm_bench's Qwen3 forward, alternating, same
inputs; bits compared."""
import statistics
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import norm_bench as nb  # noqa: E402
from cupy_rope import norm_launch  # noqa: E402

VARIANTS = {"rows-kernel": dict(kernels=("rows",)), "flat-u1": dict(flat_rows=1),
            "flat-u2": dict(flat_rows=2), "flat-u4": dict(flat_rows=4),
            "flat-u4-t256": dict(flat_token_threads=256), "flat-u4-t1024": dict(flat_token_threads=1024)}


def policy(name):
    norm_launch.POLICY = norm_launch.NormPolicy(**VARIANTS[name])
    norm_launch._plans.clear()


import os
w = next(x for x in nb.WORKLOADS if x.name == os.environ.get("W", "qwen3-8b-prefill"))
tables = nb.make_tables(w, torch)
sets = [nb.make_set(w, torch) for _ in range(3)]
args = [tuple(s[n] for n in nb._NAMES) for s in sets]
copy = harness.copy_ms(w.copy_bytes("fwd"), 3, 30) * 1e3
fn = nb.Ours().forward(w, tables)
out = {}
for name in VARIANTS:
    policy(name)
    out[name] = [o.clone() for o in fn(*args[0])]
    print(name, [p.spec.__class__.__name__ + str(getattr(p.spec, "rows", ""))
                 for p in norm_launch._plans.values()])
for name in VARIANTS:
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(out[name], out["rows-kernel"]))
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out[name], out["rows-kernel"]))
    print(name, "bits equal to the rows kernel:", same, "max diff", diff)
times = {n: [] for n in VARIANTS}
for _ in range(5):
    for name in VARIANTS:
        policy(name)
        times[name].append(harness.time_call(fn, args, 30, 5).ms * 1e3)
comp = nb.Compiled()
comp.available()
cf = comp.forward(w, tables)
tc = statistics.median(harness.time_call(cf, args, 30, 5).ms * 1e3 for _ in range(3))
copy2 = harness.copy_ms(w.copy_bytes("fwd"), 3, 30) * 1e3
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"{w.name} fwd {name}: {m:.1f} us ({copy / m:.3f} of copy), rounds "
          + " ".join(f"{t:.1f}" for t in ts))
print(f"{w.name} fwd torch.compile: {tc:.1f} us ({copy / tc:.3f}); copy {copy:.1f} / {copy2:.1f}")
