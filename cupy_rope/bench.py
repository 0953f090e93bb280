"""Benchmark: cupy-rope against a plain device copy of the same bytes.

``python -m cupy_rope.bench [--json FILE] [--reps N]``

Each row times one workload with CUDA events (warm-up first, then the
median over repetitions, rotating among several input sets so that the L2
cache does not flatter), and reports the effective bandwidth (bytes that
must move: x read once and the output written once, plus the angle table
rows) and the fraction of a device-to-device copy of the same x bytes
measured in the same run (the memory roofline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import cupy_rope


def _bf16():
    import cupy
    import ml_dtypes

    return cupy.dtype(ml_dtypes.bfloat16)


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""


def _hold_stream(ms: float = 20.0) -> None:
    """Queue a kernel that keeps the GPU busy for ``ms`` (at ~2 GHz), so that
    the host can enqueue the timed calls behind it: the events then time the
    GPU work alone, not the Python overhead of each call."""
    import cupy

    kernel = cupy.RawKernel(_SPIN, "spin")
    kernel((1,), (1,), (np.int64(ms * 2e6),))


def time_ms(fn, sets, reps=30, warmup=5):
    """Median milliseconds of ``fn(*set)`` over ``reps``, rotating through ``sets``.

    Each call sits between its own pair of CUDA events; all calls are queued
    behind a spinning kernel and synchronized once at the end.
    """
    import cupy

    for i in range(warmup):
        fn(*sets[i % len(sets)])
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    _hold_stream()
    for i, (start, stop) in enumerate(events):
        args = sets[i % len(sets)]
        start.record()
        fn(*args)
        stop.record()
    events[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in events)


def copy_ms(nbytes, n_sets=3, reps=30):
    """Median time of a device-to-device copy of ``nbytes`` (read + write)."""
    import cupy

    bufs = [(cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8))
            for _ in range(n_sets)]

    def run(src, dst):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    return time_ms(run, bufs, reps)


WORKLOADS = [
    # name, layout, shape, angle source, mode
    ("bshd [1,4096,128,128] bf16 table", "bshd", (1, 4096, 128, 128), "table", "new"),
    ("bshd [32,512,24,128] bf16 table", "bshd", (32, 512, 24, 128), "table", "new"),
    ("bshd [1,4096,128,128] bf16 inv_freq", "bshd", (1, 4096, 128, 128), "inv_freq", "new"),
    ("bshd [32,512,24,128] bf16 inplace", "bshd", (32, 512, 24, 128), "table", "inplace"),
    ("sbhd [4096,1,128,128] bf16 table", "sbhd", (4096, 1, 128, 128), "table", "new"),
]


def run(reps=30, n_sets=3, workloads=WORKLOADS):
    import cupy

    rows = []
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    for wname, layout, shape, source, mode in workloads:
        d = shape[-1]
        s = shape[1] if layout == "bshd" else shape[0]
        inv_freq = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
        theta = cupy.arange(s, dtype=cupy.float32)[:, None] * inv_freq
        cos, sin = cupy.cos(theta), cupy.sin(theta)
        sets = []
        for _ in range(n_sets):
            x = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(_bf16())
            out = cupy.empty_like(x)
            sets.append((x, out))
        nbytes = sets[0][0].nbytes
        kw = {"cos": cos, "sin": sin} if source == "table" else {"inv_freq": inv_freq}
        table_bytes = 2 * theta.nbytes if source == "table" else inv_freq.nbytes
        t_copy = copy_ms(nbytes, n_sets, reps)
        for direction in ("fwd", "bwd"):
            backward = direction == "bwd"
            if mode == "inplace":
                def fn(x, out):
                    cupy_rope.apply_rope(x, layout=layout, inplace=True, backward=backward, **kw)
            else:
                def fn(x, out):
                    cupy_rope.apply_rope(x, layout=layout, out=out, backward=backward, **kw)
            t = time_ms(fn, sets, reps)
            moved = 2 * nbytes + table_bytes
            rows.append({
                "workload": wname, "direction": direction, "mode": mode,
                "time_us": t * 1e3, "bandwidth_GBps": moved / (t * 1e-3) / 1e9,
                "copy_time_us": t_copy * 1e3,
                "copy_bandwidth_GBps": 2 * nbytes / (t_copy * 1e-3) / 1e9,
                "fraction_of_copy": t_copy / t,
            })
        del sets
    return {"device": name, "rows": rows}


def host_overhead_us(calls=2000):
    """End-to-end microseconds per call (Python included) for a small decode
    step, bf16 [64, 1, 32, 128] with device offsets, kernels cached: the
    loop is timed on the host and synchronized once at the end."""
    import time

    import cupy

    d = 128
    x = cupy.random.standard_normal((64, 1, 32, d), dtype=cupy.float32).astype(_bf16())
    inv_freq = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    offsets = cupy.arange(64, dtype=cupy.int32)
    out = cupy.empty_like(x)
    for _ in range(20):
        cupy_rope.apply_rope(x, inv_freq=inv_freq, offsets=offsets, out=out)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        cupy_rope.apply_rope(x, inv_freq=inv_freq, offsets=offsets, out=out)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def format_table(result) -> str:
    lines = [f"device: {result['device']}",
             f"{'workload':40s} {'dir':4s} {'time us':>9s} {'GB/s':>7s} {'copy us':>8s} "
             f"{'of copy':>7s}"]
    for r in result["rows"]:
        lines.append(f"{r['workload']:40s} {r['direction']:4s} {r['time_us']:9.1f} "
                     f"{r['bandwidth_GBps']:7.0f} {r['copy_time_us']:8.1f} "
                     f"{r['fraction_of_copy']:7.3f}")
    if "host_us_per_call" in result:
        lines.append(f"decode bf16 [64,1,32,128] out=, end to end per call (Python included): "
                     f"{result['host_us_per_call']:.1f} us")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    result = run(reps=args.reps)
    result["host_us_per_call"] = host_overhead_us()
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
