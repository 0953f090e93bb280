"""Where the host time of a cached decode call goes (GPU machine)."""
import time

import cupy
import numpy as np
import torch

import cupy_rope
from cupy_rope import api, interop, launch

N = 20000


def per_call(fn):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e6


d = 128
q = torch.randn(64, 32, d, device="cuda", dtype=torch.float16)
k = torch.randn(64, 8, d, device="cuda", dtype=torch.float16)
cache = torch.randn(8192, d, device="cuda")
pos = torch.arange(64, device="cuda") + 100


def call():
    cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", inplace=True)


print(f"end to end                 {per_call(call):6.2f} us")
key = [k_ for k_ in api._plans if k_[0] == "qk"][-1]
prep = api._plans[key]
plan = prep.plan
arrays = (q, k, None, None, None, None, cache, pos, None, None, None)


def sign():
    kk, ptrs = ["qk", key[1]], []
    for a in arrays:
        if a is None:
            kk.append(None)
            ptrs.append(0)
        else:
            interop.SIGNERS[type(a)](a, kk, ptrs)
    return tuple(kk), ptrs


print(f"signatures of 4 tensors    {per_call(sign):6.2f} us")
kk, ptrs = sign()
print(f"dict lookup (hash)         {per_call(lambda: api._plans.get(kk)):6.2f} us")
print(f"disjoint checks ({len(prep.disjoint)} pairs)  "
      f"{per_call(lambda: launch.check_disjoint(prep.disjoint, ptrs)):6.2f} us")
print(f"plan.launch                {per_call(lambda: plan.launch(list(ptrs), 0)):6.2f} us")
print(f"torch stream               {per_call(lambda: interop.torch_stream(0)):6.2f} us")
from cupy_backends.cuda.api.runtime import getDevice  # noqa: E402
from cupy.cuda import driver  # noqa: E402
print(f"getDevice                  {per_call(getDevice):6.2f} us")
stream = interop.torch_stream(0)
print(f"bare launchKernel          "
      f"{per_call(lambda: driver.launchKernel(plan.kernel, *plan.dims, 0, stream, plan.args_addr, 0)):6.2f} us")
print(f"5 attrs of a tensor        "
      f"{per_call(lambda: (q.data_ptr(), q.shape, q.stride(), q.dtype, q.get_device())):6.2f} us")
qc, kc, cc, pc = (cupy.from_dlpack(t) for t in (q, k, cache, pos))
print(f"end to end, CuPy arrays    "
      f"{per_call(lambda: cupy_rope.apply_rope_qk(qc, kc, cos_sin_cache=cc, positions=pc, layout='thd', inplace=True)):6.2f} us")
# GPU time of the decode kernel alone (graph-free): events around 1000 launches
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(100):
        call()
g.replay()
torch.cuda.synchronize()
s.record()
for _ in range(10):
    g.replay()
e.record()
torch.cuda.synchronize()
print(f"CUDA graph replay per call {s.elapsed_time(e) * 1e3 / 1000:6.2f} us")
