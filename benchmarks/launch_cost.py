"""Host cost of the pieces of a cached decode call, against bare launches (GPU machine).

    python -m benchmarks.launch_cost              # the call taken apart
    python -m benchmarks.launch_cost --streams    # the same launch on each kind of stream
    python -m benchmarks.launch_cost --rounds     # qk_ against its parts, interleaved rounds

Prints microseconds per call of: the whole call, reading torch tensor
attributes, CuPy's driver.launchKernel with our parameters and with an empty
kernel, a ctypes cuLaunchKernel, and a trivial torch op, so that the floor
any Python-launched kernel pays on this host is measured next to ours.

Some rows reach into cupy-rope's internals (the cached launcher of
``RotaryEmbedding.qk_`` and its ``plan``, ``cupy_rope.interop``); a row whose
internals have changed prints ``n/a`` with the reason instead of stopping
the script. Without a CUDA device it says so in one line and exits with
status 2.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
from typing import Any, Callable

from benchmarks import harness

N = 20000


def per_call(fn, n=N):
    """Microseconds per call of ``fn``: the best of three passes of ``n`` calls."""
    import torch

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
    print(f"{name:52s} {us:6.2f} us", flush=True)


def row(name, make: Callable[[], Callable[[], Any]]):
    """Time the callable that ``make()`` returns; n/a when building or calling it fails."""
    try:
        show(name, per_call(make()))
    except Exception as exc:  # noqa: BLE001
        print(f"{name:52s} n/a ({exc.__class__.__name__}: {exc})", flush=True)


@contextlib.contextmanager
def driver_stubbed():
    """CuPy's driver.launchKernel replaced by a no-op: launchers generated
    meanwhile keep the no-op, so they do everything but the driver call."""
    from cupy.cuda import driver

    real = driver.launchKernel
    driver.launchKernel = lambda *a: None
    try:
        yield
    finally:
        driver.launchKernel = real


_EMPTY: list = []  # the empty kernel and its argument array, kept alive


def empty_kernel():
    """(an empty kernel's function pointer, the address of an argument array for it)."""
    import cupy

    if not _EMPTY:
        kernel = cupy.RawKernel('extern "C" __global__ void nothing() {}', "nothing")
        kernel.compile()
        _EMPTY.extend((kernel, (ctypes.c_void_p * 1)(0)))
    kernel, no_args = _EMPTY
    return kernel.kernel.ptr, ctypes.addressof(no_args)


def cached_launcher(rope, args):
    """The launcher that ``rope.qk_`` caches for ``args`` (q, k, positions)."""
    rope.qk_(*args)
    rope.qk_(*args)  # the second call finds the cached launcher
    return next(iter(rope._fast.values()))


@dataclasses.dataclass
class Decode:
    """A decode step's arrays (64 tokens, q32/k8 d128, bf16) in torch and CuPy."""

    torch: tuple   # q, k, cos|sin cache, positions
    cupy: tuple

    @classmethod
    def make(cls):
        import cupy
        import torch

        d = 128
        t = (torch.randn(64, 32, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(64, 8, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(8192, d, device="cuda"), torch.arange(64, device="cuda") + 100)
        return cls(t, tuple(cupy.from_dlpack(a) for a in t))

    def rope(self, fw, **kw):
        import cupy_rope

        return cupy_rope.RotaryEmbedding(cos_sin_cache=getattr(self, fw)[2], layout="thd", **kw)

    def qk_args(self, fw):
        q, k, _, pos = getattr(self, fw)
        return (q, k, pos)


def end_to_end_rows(s: Decode):
    import cupy_rope

    q, k, cache, pos = s.torch
    row("end to end apply_rope_qk (torch, in place)", lambda: lambda: cupy_rope.apply_rope_qk(
        q, k, cos_sin_cache=cache, positions=pos, layout="thd", inplace=True))
    rope, rope_c = s.rope("torch"), s.rope("cupy")
    row("end to end RotaryEmbedding.qk_ (torch)", lambda: lambda: rope.qk_(q, k, pos))
    row("end to end RotaryEmbedding.qk (torch, in place)",
        lambda: lambda: rope.qk(q, k, pos, inplace=True))
    args_c = s.qk_args("cupy")
    row("end to end RotaryEmbedding.qk_ (cupy)", lambda: lambda: rope_c.qk_(*args_c))


def attribute_rows(s: Decode):
    import torch

    from cupy_rope import interop

    q, k, _, pos = s.torch
    for name, fn in (("q.data_ptr()", q.data_ptr), ("q.shape", lambda: q.shape),
                     ("q.stride()", q.stride), ("q.dtype", lambda: q.dtype),
                     ("q.get_device()", q.get_device), ("q.is_contiguous()", q.is_contiguous),
                     ("q.__dlpack_device__()", q.__dlpack_device__)):
        row(name, lambda fn=fn: fn)
    # Cheaper ways to read torch metadata: unbound TensorBase methods and descriptors.
    tb = torch._C.TensorBase
    shape_get, dtype_get = tb.shape.__get__, tb.dtype.__get__
    for name, fn in (("TensorBase.data_ptr(q)", tb.data_ptr), ("TensorBase.stride(q)", tb.stride),
                     ("TensorBase.get_device(q)", tb.get_device),
                     ("TensorBase.shape.__get__(q)", shape_get),
                     ("TensorBase.dtype.__get__(q)", dtype_get)):
        row(name, lambda fn=fn: lambda: fn(q))
    row("torch signer (interop._torch_sign)", lambda: lambda: interop._torch_sign(q, [], []))
    row("torch raw stream (interop.torch_stream)", lambda: lambda: interop.torch_stream(0))
    row("key3 (torch, as shipped)", lambda: (lambda key3: lambda: key3(q, k, pos))(
        interop.key3(type(q))))


def launch_rows(s: Decode):
    """Our kernel and an empty one through the driver, and through ctypes."""
    import torch
    from cupy.cuda import driver

    plan = cached_launcher(s.rope("torch"), s.qk_args("torch")).plan
    stream = torch.cuda.current_stream().cuda_stream
    args = plan.own_buffer()[1]  # this thread's parameters
    row("driver.launchKernel, our parameters", lambda: lambda: driver.launchKernel(
        plan.kernel, *plan.dims, 0, stream, args, 0))
    empty, no_args = empty_kernel()
    row("driver.launchKernel, empty kernel, grid 1", lambda: lambda: driver.launchKernel(
        empty, 1, 1, 1, 32, 1, 1, 0, stream, no_args, 0))
    row("driver.launchKernel, our kernel, grid 1", lambda: lambda: driver.launchKernel(
        plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream, args, 0))
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    row("ctypes cuLaunchKernel, our parameters", lambda: lambda: launch(
        plan.kernel, *plan.dims, 0, stream, args, None))
    x = torch.zeros(16, device="cuda")
    row("torch x.add_(1) (16 floats)", lambda: lambda: x.add_(1))
    row("torch.cuda._sleep(0)", lambda: lambda: torch.cuda._sleep(0))
    print(f"decode grid {plan.dims}")


def graph_rows(s: Decode):
    """GPU time per launch, back to back, from a CUDA graph of 100 calls."""
    import torch
    from cupy.cuda import driver

    import cupy_rope

    q, k, cache, pos = s.torch
    empty, no_args = empty_kernel()
    calls = (("ours", lambda: cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos,
                                                      layout="thd", inplace=True)),
             ("empty kernel", lambda: driver.launchKernel(
                 empty, 1, 1, 1, 32, 1, 1, 0, torch.cuda.current_stream().cuda_stream,
                 no_args, 0)))
    for name, f in calls:
        g = harness.capture_graph(f, (), 100, torch)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        show(f"graph replay per launch, {name}", a.elapsed_time(b) * 1e3 / 2000)


def host_floor_rows(s: Decode):
    """What any Python call pays on this host."""
    import cupy
    from cupy_backends.cuda.api.runtime import getDevice

    row("host speed: sum(range(100)) (pure Python)", lambda: lambda: sum(range(100)))
    lock = threading.Lock()

    def locked():
        with lock:
            pass

    row("with lock: pass", lambda: locked)
    row("runtime getDevice()", lambda: getDevice)
    row("cupy get_current_stream().ptr", lambda: lambda: cupy.cuda.get_current_stream().ptr)


def bound_path_rows(s: Decode):
    """The bound decode path piece by piece, for both frameworks."""
    from cupy_rope import interop

    for fw in ("torch", "cupy"):
        args = s.qk_args(fw)
        rope = s.rope(fw)
        go = cached_launcher(rope, args)
        key3 = interop.key3(type(args[0]))
        key, ptrs = key3(*args)
        row(f"[{fw}] qk_ end to end", lambda: lambda: rope.qk_(*args))
        row(f"[{fw}] key3", lambda: lambda: key3(*args))
        row(f"[{fw}] fast.get(key)", lambda: lambda: rope._fast.get(key))
        row(f"[{fw}] go(...) (overlap test, stream, pack, launch)", lambda: lambda: go(*ptrs))
        row(f"[{fw}] stream getter", lambda: lambda: go.plan.stream(go.plan.device_id))
        with driver_stubbed():
            stub = s.rope(fw)
            go_stub = cached_launcher(stub, args)
        row(f"[{fw}] go(...) with the driver call stubbed", lambda: lambda: go_stub(*ptrs))
        # The whole call with only the driver call replaced: Python's share.
        row(f"[{fw}] qk_ with the driver call stubbed (Python only)",
            lambda: lambda: stub.qk_(*args))


def stream_rows(s: Decode):
    """The same launches on the legacy default stream, the per-thread default
    stream and created streams: the driver's cost differs by stream kind."""
    import cupy
    import torch
    from cupy.cuda import driver

    empty, no_args = empty_kernel()
    rope, args = s.rope("torch"), s.qk_args("torch")
    # The stream objects stay referenced here: their handles die with them.
    kinds = [("legacy default (0)", 0), ("per-thread default (2)", 2),
             ("torch.cuda.Stream()", torch.cuda.Stream()),
             ("cupy Stream(non_blocking=True)", cupy.cuda.Stream(non_blocking=True)),
             ("cupy Stream() (blocking)", cupy.cuda.Stream())]
    for name, stream in kinds:
        handle = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
        handle = stream.ptr if handle is None else handle
        row(f"empty launch on {name}", lambda: lambda: driver.launchKernel(
            empty, 1, 1, 1, 32, 1, 1, 0, handle, no_args, 0))
        ts = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
        with torch.cuda.stream(ts):
            row(f"qk_ (torch) on {name}", lambda: lambda: rope.qk_(*args))


def rounds_rows(s: Decode):
    """qk_ against its parts in the benchmark's interleaved rounds
    (bench._time_host_rounds), torch and CuPy: qk_; the same call with the
    driver call stubbed (Python alone); the kernel launched bare with one
    block (bench._bare_launch) and with its full grid; then, per round, what
    qk_ costs beyond its Python plus a bare full-grid launch."""
    from cupy.cuda import driver

    from benchmarks import bench

    for fw in ("torch", "cupy"):
        args = s.qk_args(fw)
        rope = s.rope(fw)
        plan = cached_launcher(rope, args).plan
        params, stream = plan.own_buffer()[1], plan.stream(plan.device_id)
        with driver_stubbed():
            stub = s.rope(fw)
            cached_launcher(stub, args)
        rows = [("qk_", lambda: rope.qk_(*args)),
                ("qk_ driver stubbed", lambda: stub.qk_(*args)),
                ("bare, 1 block", bench._bare_launch(rope)),
                ("bare, full grid", lambda: driver.launchKernel(
                    plan.kernel, *plan.dims, 0, stream, params, 0))]
        out = {}
        bench._time_host_rounds(out, [(n, f, f"{fw} {n}") for n, f in rows], 2000)
        a, b, _, c = (out[f"{n}_us_per_call_runs"] for n, _ in rows)
        print(fw, "per round: qk_ - (stubbed + full grid) =",
              " ".join(f"{x - y - z:+.2f}" for x, y, z in zip(a, b, c)), flush=True)


def main(argv=None) -> int:
    ap = harness.parser("launch_cost", __doc__)
    ap.add_argument("--streams", action="store_true", help="only the per-stream-kind rows")
    ap.add_argument("--rounds", action="store_true", help="only the interleaved-rounds rows")
    args = ap.parse_args(argv)
    status = harness.no_gpu("launch_cost")
    if status is not None:
        return status
    s = Decode.make()
    if args.streams:
        stream_rows(s)
        return 0
    if args.rounds:
        rounds_rows(s)
        return 0
    for part in (host_floor_rows, end_to_end_rows, attribute_rows, launch_rows, graph_rows,
                 bound_path_rows):
        try:
            part(s)
        except Exception as exc:  # noqa: BLE001 - a changed internal ends its part only
            print(f"{part.__name__}: n/a ({exc.__class__.__name__}: {exc})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
