"""The decode step's host cost against its parts, in interleaved rounds (GPU machine):

    PYTHONPATH=$PWD python scripts/host_rounds.py

For torch tensors and CuPy arrays (q32/k8 d128, 64 tokens, bf16, in place,
positions into an fp32 cos|sin cache), each of 9 rounds times one pass of
2000 calls of: RotaryEmbedding.qk_; the same call with the driver call
stubbed (Python alone); the planned kernel launched bare with one block and
with its full grid. Prints each median and range (bench._time_host_rounds)
and, per round, what qk_ costs beyond its Python plus a bare full-grid
launch.
"""
import cupy
import torch
from cupy.cuda import driver

import cupy_rope
from cupy_rope import bench

N, R = 2000, 9
d = 128
for fw in ("torch", "cupy"):
    q = torch.randn(64, 32, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(8192, d, device="cuda")
    pos = torch.arange(64, device="cuda") + 100
    if fw == "cupy":
        q, k, cache, pos = (cupy.from_dlpack(t) for t in (q, k, cache, pos))
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    # rope's launcher is generated first, with the real driver call: the
    # stub below is generated while driver.launchKernel is replaced.
    rope.qk_(q, k, pos); rope.qk_(q, k, pos)
    go = next(iter(rope._fast.values()))
    plan = go.plan
    args = plan.own_buffer()[1]
    stream = plan.stream(plan.device_id)
    stub = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    real = driver.launchKernel
    driver.launchKernel = lambda *a: None
    try:
        stub.qk_(q, k, pos); stub.qk_(q, k, pos)
    finally:
        driver.launchKernel = real
    # The stub's launcher was generated with the driver call stubbed; make sure.
    next(iter(stub._fast.values())).__globals__["launch_kernel"] = lambda *a: None
    entries = [
        ("qk_", lambda: rope.qk_(q, k, pos)),
        ("qk_ driver stubbed", lambda: stub.qk_(q, k, pos)),
        ("bare, 1 block", lambda: driver.launchKernel(plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream, args, 0)),
        ("bare, full grid", lambda: driver.launchKernel(plan.kernel, *plan.dims, 0, stream, args, 0)),
    ]
    out = {}
    bench._time_host_rounds(out, [(n, f, f"{fw} {n}") for n, f in entries], N, R)
    a, b, c, dd = (out[f"{n}_us_per_call_runs"] for n, _ in entries)
    print(fw, "per round: qk_ - (stubbed + full grid) =",
          " ".join(f"{x - y - z:+.2f}" for x, y, z in zip(a, b, dd)), flush=True)
