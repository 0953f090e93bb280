"""One launch of each kernel shape worth profiling, for Nsight Compute:

    ncu --clock-control none -k regex:rope --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python scripts/ncu_probe.py thd

Workloads: thd (T=65536 h32 d128 bf16, cu_seqlens n=2401), bshd (the same
bytes as [1, 65536, 32, 128]), diffusion (q24/k24 d80 b2 s4096), bshd-bf16
and bshd-fp32 ([4, 4096, 32, 128] out of place).
"""
import sys

import cupy
import numpy as np

import cupy_rope
from quick_perf import bf16

what = sys.argv[1]
d = 128 if what != "diffusion" else 80
T = 65536
inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
th = cupy.arange(T + 8, dtype=cupy.float32)[:, None] * inv
cos, sin = cupy.cos(th), cupy.sin(th)


def rnd(shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bf16())


if what == "diffusion":
    q, k = rnd((2, 4096, 24, d)), rnd((2, 4096, 24, d))
    oq, ok = cupy.empty_like(q), cupy.empty_like(k)
    for _ in range(4):
        cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=oq, out_k=ok)
elif what in ("bshd-fp32", "bshd-bf16"):  # [4, 4096, 32, 128] out of place
    x = cupy.random.standard_normal((4, 4096, 32, d), dtype=cupy.float32)
    if what == "bshd-bf16":
        x = x.astype(bf16())
    o = cupy.empty_like(x)
    for _ in range(4):
        cupy_rope.apply_rope(x, cos, sin, out=o)
else:
    x = rnd((T, 32, d))
    o = cupy.empty_like(x)
    rng = np.random.default_rng(0)
    cu = cupy.asarray(np.concatenate([[0], np.sort(rng.choice(np.arange(1, T), 2400, replace=False)),
                                      [T]]).astype(np.int32))
    for _ in range(4):
        if what == "thd":
            cupy_rope.apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu, out=o)
        else:
            cupy_rope.apply_rope(x[None], cos, sin, out=o[None])
cupy.cuda.Device().synchronize()
