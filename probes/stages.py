"""Probe (deleted once answered): staged passes, 0..4 stages."""
import dataclasses
from cupy_rope import norm_launch as nl
from probes.sweep import setup, timeit

base = nl.POLICY
for name in ("qwen", "wan"):
    fwd, bwd, c2, c3 = setup(name)
    cp2, cp3 = timeit(c2), timeit(c3)
    print(f"== {name}: copy2 {cp2:.1f} copy3 {cp3:.1f}", flush=True)
    for st in (0, 2, 3, 4):
        for mb in (2, 3):
            nl.POLICY = dataclasses.replace(base, stages=(st, st), min_blocks=(mb, mb))
            nl._plans.clear()
            tf, tb = timeit(fwd), timeit(bwd)
            print(f"{name} stages{st} mb{mb}: fwd {tf:.1f} ({cp2 / tf:.3f}) bwd {tb:.1f} ({cp3 / tb:.3f})", flush=True)
