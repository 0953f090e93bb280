"""Computed angles (inv_freq=) before and after the fp64 reduction for
positions of 2^24 and beyond (kernels/angles.cuh reduced_angle_wide), the
variants alternating in one process (GPU machine):

    PYTHONPATH=.:scripts python scripts/wide_positions_probe.py [ROUNDS]

The variants are macros of the experimental angles.cuh
(results/h100-2026-11-24q/wide-positions-experiment.patch, applied to the
kernels before the change): PROBE_FP32_POSITIONS_ONLY is the kernel before,
PROBE_HOISTED branches between the fp32 and fp64 paths, PROBE_PATCHUP (the
shipped form) redoes the angles in fp64 after the fp32 path where needed,
PROBE_WIDE_NOINLINE keeps the fp64 function out of line (shipped). With the
shipped angles.cuh every variant compiles the shipped kernel. Cases cover
the specializations whose code grew (rope_kernel: fp32 NeoX implied
positions, GPT-J partial rotary with explicit positions, varlen thd) and
the common ones. Prints each case's medians (us) per round and the ratio of
the best rounds to the first variant's; first, each variant's largest
error against float64 at positions past 2^24, where only the fp64
reduction is right. Outputs: results/h100-2026-11-24q/wide-positions-probes.txt."""
import sys

import numpy as np

import cupy
import cupy_rope
from cupy_rope import bench
from quick_perf import use_macros

VARIANTS = (("fp32 only", ("PROBE_FP32_POSITIONS_ONLY",)),
            ("patch-up noinline", ("PROBE_PATCHUP", "PROBE_WIDE_NOINLINE")))


def inv_freq(r):
    return cupy.asarray((1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32))


def cases():
    rng = np.random.default_rng(0)

    def arr(shape, dtype):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    out = []
    for dtype in (cupy.float32, cupy.float16):
        b, s, h, d = 4, 4096, 32, 128
        xs = [arr((b, s, h, d), dtype) for _ in range(3)]
        inv, inv_half = inv_freq(d), inv_freq(d // 2)
        pos = cupy.asarray(rng.integers(0, 65536, (b, s)).astype(np.int64))
        name = np.dtype(dtype).name
        out.append((f"{name} bshd NeoX implied", lambda x, inv=inv: cupy_rope.apply_rope(x, inv_freq=inv),
                    [(x,) for x in xs]))
        out.append((f"{name} bshd NeoX explicit", lambda x, inv=inv, pos=pos: cupy_rope.apply_rope(
            x, inv_freq=inv, positions=pos), [(x,) for x in xs]))
        out.append((f"{name} bshd GPT-J r64 explicit", lambda x, inv=inv_half, pos=pos: cupy_rope.apply_rope(
            x, inv_freq=inv, positions=pos, interleaved=True, rotary_dim=d // 2), [(x,) for x in xs]))
        out.append((f"{name} bshd[:, :, :, :96] NeoX", lambda x, inv=inv_freq(96): cupy_rope.apply_rope(
            x[..., :96], inv_freq=inv), [(x,) for x in xs]))
        out.append((f"{name} bshd GPT-J explicit", lambda x, inv=inv, pos=pos: cupy_rope.apply_rope(
            x, inv_freq=inv, positions=pos, interleaved=True), [(x,) for x in xs]))
        out.append((f"{name} strided GPT-J r64 out", lambda x, inv=inv_freq(128)[::2]: cupy_rope.apply_rope(
            x[:, :, ::2], inv_freq=inv, interleaved=True, rotary_dim=64), [(x,) for x in xs]))
        cu = cupy.asarray(np.linspace(0, b * s, 129).astype(np.int32))
        out.append((f"{name} thd n128 varlen", lambda x, inv=inv, cu=cu: cupy_rope.apply_rope(
            x, inv_freq=inv, layout="thd", cu_seqlens=cu), [(x.reshape(b * s, h, d),) for x in xs]))
    return out


def accuracy(variant):
    x = cupy.asarray(np.random.default_rng(1).standard_normal((1, 3, 1, 64)).astype(np.float32))
    inv = inv_freq(64)
    p = np.array([[2**24 + 1, 2**30 + 7, 2**40 + 3]], np.int64)
    got = cupy.asnumpy(cupy_rope.apply_rope(x, inv_freq=inv, positions=cupy.asarray(p)))
    theta = p[0][:, None].astype(np.float64) * cupy.asnumpy(inv).astype(np.float64)
    xh = cupy.asnumpy(x)[0, :, 0].astype(np.float64)
    a, bb = xh[:, :32], xh[:, 32:]
    want = np.concatenate([a * np.cos(theta) - bb * np.sin(theta),
                           bb * np.cos(theta) + a * np.sin(theta)], axis=1)
    return float(np.abs(got[0, :, 0] - want).max())


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    work = cases()
    times = {(c, v): [] for c, _, _ in work for v, _ in VARIANTS}
    for name, macros in VARIANTS:
        use_macros(macros)
        print(f"{name}: max |error| at positions 2^24+1, 2^30+7, 2^40+3: {accuracy(name):.3g}")
    for _ in range(rounds):
        for name, macros in VARIANTS:
            use_macros(macros)
            for c, fn, sets in work:
                times[(c, name)].append(bench.time_call(fn, sets, 30, 5)[0] * 1e3)
    for c, _, _ in work:
        best = {v: min(times[(c, v)]) for v, _ in VARIANTS}
        row = "  ".join(f"{v}: " + " ".join(f"{t:.1f}" for t in times[(c, v)]) for v, _ in VARIANTS)
        ratios = " ".join(f"{v} {best[v] / best['fp32 only']:.4f}" for v, _ in VARIANTS[1:])
        print(f"{c:32s} {row}\n    ratios: {ratios}")


if __name__ == "__main__":
    main()
