"""Sweep launch constants (UNROLL, THREADS_PER_BLOCK) on the bench workloads."""
import itertools

import cupy_rope.launch as L
from cupy_rope import bench

wl = [w for w in bench.WORKLOADS if "inv_freq" not in w[0]][:2]
for unroll, threads in itertools.product((1, 2, 4, 8), (128, 256, 512)):
    L.UNROLL, L.THREADS_PER_BLOCK = unroll, threads
    res = bench.run(reps=20, workloads=wl)
    fr = " ".join(f"{r['fraction_of_copy']:.3f}" for r in res["rows"])
    print(f"unroll={unroll} threads={threads}: {fr}", flush=True)
