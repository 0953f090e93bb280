"""Host cost of the pieces of a cached decode call, against bare launches (GPU machine).

    python scripts/launch_cost.py

Prints microseconds per call of: the whole call, reading torch tensor
attributes, CuPy's driver.launchKernel with our Params and with an empty
kernel, a ctypes cuLaunchKernel, and a trivial torch op, so the floor that
any Python-launched kernel pays on this host is measured next to ours.
"""
import ctypes
import time

import cupy
import torch

import cupy_rope
from cupy_rope import api, interop

N = 20000


def per_call(fn, n=N):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)


def show(name, us):
    print(f"{name:44s} {us:6.2f} us", flush=True)


d = 128
q = torch.randn(64, 32, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(64, 8, d, device="cuda", dtype=torch.bfloat16)
cache = torch.randn(8192, d, device="cuda")
pos = torch.arange(64, device="cuda") + 100


def call():
    cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", inplace=True)


show("end to end apply_rope_qk (torch, in place)", per_call(call))
bound = getattr(cupy_rope, "RotaryEmbedding", None)
if bound is not None:
    rope = bound(cos_sin_cache=cache, layout="thd")
    show("end to end RotaryEmbedding.qk_ (torch)", per_call(lambda: rope.qk_(q, k, pos)))
    qc, kc, cc, pc = (cupy.from_dlpack(t) for t in (q, k, cache, pos))
    rope_c = bound(cos_sin_cache=cc, layout="thd")
    show("end to end RotaryEmbedding.qk_ (cupy)", per_call(lambda: rope_c.qk_(qc, kc, pc)))

show("q.data_ptr()", per_call(lambda: q.data_ptr()))
show("q.shape", per_call(lambda: q.shape))
show("q.stride()", per_call(lambda: q.stride()))
show("q.dtype", per_call(lambda: q.dtype))
show("q.get_device()", per_call(lambda: q.get_device()))
show("q.is_contiguous()", per_call(lambda: q.is_contiguous()))
show("torch signer", per_call(lambda: interop._torch_sign(q, [], [])))
show("torch raw stream", per_call(lambda: interop.torch_stream(0)))

key = [k_ for k_ in api._plans if k_[0] == "qk"][-1]
plan = api._plans[key].plan
stream = interop.torch_stream(0)
from cupy.cuda import driver  # noqa: E402

show("driver.launchKernel, our Params",
     per_call(lambda: driver.launchKernel(plan.kernel, *plan.dims, 0, stream, plan.args_addr, 0)))
empty = cupy.RawKernel('extern "C" __global__ void nothing() {}', "nothing")
empty.compile()
fn = empty.kernel.ptr
no_args = (ctypes.c_void_p * 1)(0)
show("driver.launchKernel, empty kernel, grid 1",
     per_call(lambda: driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream,
                                          ctypes.addressof(no_args), 0)))
show("driver.launchKernel, our kernel, grid 1",
     per_call(lambda: driver.launchKernel(plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream,
                                          plan.args_addr, 0)))
libcuda = ctypes.CDLL("libcuda.so.1")
launch = libcuda.cuLaunchKernel
launch.restype = ctypes.c_int
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
args = plan.args_addr
dims = plan.dims
show("ctypes cuLaunchKernel, our Params",
     per_call(lambda: launch(plan.kernel, *dims, 0, stream, args, None)))
x = torch.zeros(16, device="cuda")
show("torch x.add_(1) (16 floats)", per_call(lambda: x.add_(1)))
show("torch.cuda._sleep(0)", per_call(lambda: torch.cuda._sleep(0)))

# GPU time per launch, back to back, from a CUDA graph of 100 calls.
for name, f in (("ours", call),
                ("empty kernel", lambda: driver.launchKernel(
                    fn, 1, 1, 1, 32, 1, 1, 0, torch.cuda.current_stream().cuda_stream,
                    ctypes.addressof(no_args), 0))):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    show(f"graph replay per launch, {name}", a.elapsed_time(b) * 1e3 / 2000)
print(f"decode grid {plan.dims}")
