"""Host cost of the pieces of a cached decode call, against bare launches (GPU machine).

    python -m benchmarks.launch_cost [--streams | --rounds]

Prints microseconds per call of: the whole call, reading torch tensor
attributes, CuPy's driver.launchKernel with our Params and with an empty
kernel, a ctypes cuLaunchKernel, and a trivial torch op, so the floor that
any Python-launched kernel pays on this host is measured next to ours.
"""
import ctypes
import sys
import threading
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


show("host speed: sum(range(100)) (pure Python)", per_call(lambda: sum(range(100))))


def stream_rows():
    """The same launches on the legacy default stream, the per-thread default
    stream and created streams: the driver's cost differs by stream kind."""
    from cupy.cuda import driver

    empty = cupy.RawKernel('extern "C" __global__ void nothing() {}', "nothing")
    empty.compile()
    no_args = (ctypes.c_void_p * 1)(0)
    addr = ctypes.addressof(no_args)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    kinds = [("legacy default (0)", None), ("per-thread default (2)", 2),
             ("torch.cuda.Stream()", torch.cuda.Stream()),
             ("cupy Stream(non_blocking=True)", cupy.cuda.Stream(non_blocking=True)),
             ("cupy Stream() (blocking)", cupy.cuda.Stream())]
    for name, s in kinds:
        handle = 0 if s is None else (s if isinstance(s, int) else
                                      getattr(s, "cuda_stream", None) or s.ptr)
        show(f"empty launch on {name}",
             per_call(lambda: driver.launchKernel(empty.kernel.ptr, 1, 1, 1, 32, 1, 1, 0,
                                                  handle, addr, 0)))
        ts = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
        with torch.cuda.stream(ts):
            show(f"qk_ (torch) on {name}", per_call(lambda: rope.qk_(q, k, pos)))


def rounds_rows():
    """qk_ against its parts in the benchmark's interleaved rounds
    (bench._time_host_rounds: 9 rounds, each one pass of 2000 calls of
    every row), torch and CuPy: qk_; the same call with the driver call
    stubbed (Python alone); the kernel launched bare with one block
    (bench._bare_launch) and with its full grid; then, per round, what qk_
    costs beyond its Python plus a bare full-grid launch."""
    from cupy.cuda import driver

    from benchmarks import bench

    for fw in ("torch", "cupy"):
        arrays = (q, k, cache, pos)
        if fw == "cupy":
            arrays = tuple(cupy.from_dlpack(t) for t in arrays)
        aq, ak, acache, apos = arrays
        rope = cupy_rope.RotaryEmbedding(cos_sin_cache=acache, layout="thd")
        # rope's launcher is generated first, with the real driver call;
        # stub's while driver.launchKernel is replaced, so it launches nothing.
        rope.qk_(aq, ak, apos)
        rope.qk_(aq, ak, apos)
        plan = next(iter(rope._fast.values())).plan
        args, stream = plan.own_buffer()[1], plan.stream(plan.device_id)
        stub = cupy_rope.RotaryEmbedding(cos_sin_cache=acache, layout="thd")
        real = driver.launchKernel
        driver.launchKernel = lambda *a: None
        try:
            stub.qk_(aq, ak, apos)
            stub.qk_(aq, ak, apos)
        finally:
            driver.launchKernel = real
        rows = [("qk_", lambda: rope.qk_(aq, ak, apos)),
                ("qk_ driver stubbed", lambda: stub.qk_(aq, ak, apos)),
                ("bare, 1 block", bench._bare_launch(rope)),
                ("bare, full grid", lambda: driver.launchKernel(plan.kernel, *plan.dims, 0, stream,
                                                               args, 0))]
        out = {}
        bench._time_host_rounds(out, [(n, f, f"{fw} {n}") for n, f in rows], 2000)
        a, b, _, c = (out[f"{n}_us_per_call_runs"] for n, _ in rows)
        print(fw, "per round: qk_ - (stubbed + full grid) =",
              " ".join(f"{x - y - z:+.2f}" for x, y, z in zip(a, b, c)), flush=True)


if "--streams" in sys.argv:
    stream_rows()
    sys.exit(0)
if "--rounds" in sys.argv:
    rounds_rows()
    sys.exit(0)
show("end to end apply_rope_qk (torch, in place)", per_call(call))
bound = getattr(cupy_rope, "RotaryEmbedding", None)
if bound is not None:
    rope = bound(cos_sin_cache=cache, layout="thd")
    show("end to end RotaryEmbedding.qk_ (torch)", per_call(lambda: rope.qk_(q, k, pos)))
    show("end to end RotaryEmbedding.qk (torch, in place)",
         per_call(lambda: rope.qk(q, k, pos, inplace=True)))
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

args = plan.own_buffer()[1]  # this thread's parameters
show("driver.launchKernel, our Params",
     per_call(lambda: driver.launchKernel(plan.kernel, *plan.dims, 0, stream, args, 0)))
empty = cupy.RawKernel('extern "C" __global__ void nothing() {}', "nothing")
empty.compile()
fn = empty.kernel.ptr
no_args = (ctypes.c_void_p * 1)(0)
show("driver.launchKernel, empty kernel, grid 1",
     per_call(lambda: driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream,
                                          ctypes.addressof(no_args), 0)))
show("driver.launchKernel, our kernel, grid 1",
     per_call(lambda: driver.launchKernel(plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream,
                                          args, 0)))
libcuda = ctypes.CDLL("libcuda.so.1")
launch = libcuda.cuLaunchKernel
launch.restype = ctypes.c_int
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
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

# Cheaper ways to read torch metadata: unbound TensorBase methods/descriptors.
TB = torch._C.TensorBase
ub = dict(data_ptr=TB.data_ptr, stride=TB.stride, get_device=TB.get_device)
shape_get, dtype_get = TB.shape.__get__, TB.dtype.__get__
show("TensorBase.data_ptr(q)", per_call(lambda: ub["data_ptr"](q)))
show("TensorBase.shape.__get__(q)", per_call(lambda: shape_get(q)))
show("TensorBase.stride(q)", per_call(lambda: ub["stride"](q)))
show("TensorBase.dtype.__get__(q)", per_call(lambda: dtype_get(q)))
show("TensorBase.get_device(q)", per_call(lambda: ub["get_device"](q)))
show("q.__dlpack_device__()", per_call(lambda: q.__dlpack_device__()))
show("key3 (torch, as shipped)", per_call(lambda: interop.key3(type(q))(q, k, pos)))
_dp, _st, _gd = TB.data_ptr, TB.stride, TB.get_device


def key3_unbound(a, b, c):
    da, db, dc = _gd(a), _gd(b), _gd(c)
    if da < 0 or db < 0 or dc < 0:
        return None
    pa, pb, pc = _dp(a), _dp(b), _dp(c)
    return ((dtype_get(a), shape_get(a), _st(a), da, pa & 15, dtype_get(b), shape_get(b), _st(b),
             db, pb & 15, dtype_get(c), shape_get(c), _st(c), dc, pc & 15), pa, pb, pc)


show("key3 (torch, unbound)", per_call(lambda: key3_unbound(q, k, pos)))
kk = interop.key3(type(q))(q, k, pos)[0]
dd = {kk: 1}
show("fast dict lookup of the key", per_call(lambda: dd.get(kk)))
lk = threading.Lock()


def locked():
    with lk:
        pass


show("with lock: pass", per_call(locked))
from cupy_backends.cuda.api.runtime import getDevice  # noqa: E402
show("runtime getDevice()", per_call(getDevice))

# The bound decode path piece by piece, for both frameworks.
from cupy_rope import launch as _launch  # noqa: E402

for fw, rp, args in (("torch", rope, (q, k, pos)), ("cupy", rope_c, (qc, kc, pc))):
    rp.qk_(*args)
    key3 = interop.key3(type(args[0]))
    got = key3(*args)
    go = rp._fast[got[0]]
    show(f"[{fw}] qk_ end to end", per_call(lambda: rp.qk_(*args)))
    show(f"[{fw}] key3", per_call(lambda: key3(*args)))
    show(f"[{fw}] fast.get(key)", per_call(lambda: rp._fast.get(got[0])))
    show(f"[{fw}] go(...) (apart, stream, lock, pack, launch)",
         per_call(lambda: go(*got[1])))
    show(f"[{fw}] stream getter", per_call(lambda: go.__globals__["stream_of"](0)))
    real = driver.launchKernel
    driver.launchKernel = lambda *a: None
    try:
        go_stub = _launch.bound_launcher(go.plan, [], {0: "q", 1: "k", 7: "p"}, {})
    finally:
        driver.launchKernel = real
    show(f"[{fw}] go without the driver call (no overlap test)",
         per_call(lambda: go_stub(*got[1])))
    # The whole call with only the driver call replaced: Python's share.
    driver.launchKernel = lambda *a: None
    try:
        stub = bound(cos_sin_cache=cache if fw == "torch" else cc, layout="thd")
        stub.qk_(*args)
        show(f"[{fw}] qk_ with the driver call stubbed (Python only)",
             per_call(lambda: stub.qk_(*args)))
    finally:
        driver.launchKernel = real
print("cupy get_current_stream().ptr", end=" ")
show("", per_call(lambda: cupy.cuda.get_current_stream().ptr))
