"""Probe: does a thread that holds several 16-byte packets (a block's
packets [j * 128, (j + 1) * 128) for j < PER_THREAD, torch.compile's layout
for fp32) move dense rows faster than one packet per thread (flat_kernel,
lean kernel C)? Stand-alone NeoX d128 kernels on [T, H, 128] with fp32 [P,
64] tables, position = token index, against cupy_rope.apply_rope and
torch.compile of the formula on the same x, and a same-run copy (GPU
machine):

    PYTHONPATH=. python3 scripts/packets_probe.py

VARIANTS is the list of the last committed run (results/h100-2026-11-24/
flat-per-thread.txt, run 4); the earlier runs there used other lists (late
tables, 3-4 packets, caps), named in their labels.

Variants: name = dtype / packets per thread / blocks per SM asked of the
compiler / tables read before (early) or after (late) the x loads return /
resident blocks per SM capped by dynamic shared memory, = the resident
blocks per SM the driver reports."""
import sys

import cupy
import numpy as np
from cupy.cuda import driver

sys.path.insert(0, ".")
import cupy_rope  # noqa: E402
from scripts.lean_probe import SRC as LEAN, tables  # noqa: E402
from scripts.quick_perf import bf16, copy_us, time_us  # noqa: E402

# lean_probe's source (u16, the evict-last policy `keep` and load `ldp`,
# its kernels) and this probe's kernels.
SRC = LEAN + r"""
template <int N> __device__ __forceinline__ void row(const float* r, float (&v)[N]) {
  const unsigned long long pol = keep();
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const uint4 a = ldp(r + i, pol);
    v[i] = __uint_as_float(a.x); v[i + 1] = __uint_as_float(a.y);
    v[i + 2] = __uint_as_float(a.z); v[i + 3] = __uint_as_float(a.w);
  }
}
template <typename T> struct Elem;
template <> struct Elem<u16> {  // bf16 bits
  static __device__ __forceinline__ void unpack(const uint4& w, float (&v)[8]) {
    const unsigned a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { v[2 * i] = __uint_as_float(a[i] << 16); v[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u); }
  }
  static __device__ __forceinline__ uint4 pack(const float (&v)[8]) {
    unsigned a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(a[i]) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
    return make_uint4(a[0], a[1], a[2], a[3]);
  }
};
template <> struct Elem<float> {
  static __device__ __forceinline__ void unpack(const uint4& w, float (&v)[4]) {
    v[0] = __uint_as_float(w.x); v[1] = __uint_as_float(w.y); v[2] = __uint_as_float(w.z); v[3] = __uint_as_float(w.w);
  }
  static __device__ __forceinline__ uint4 pack(const float (&v)[4]) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  }
};

template <typename T, int P, int MINB, bool LATE>
__global__ void __launch_bounds__(128, MINB) packets(const T* x, T* o, const float* cs,
    const float* sn, unsigned heads, unsigned n) {
  constexpr int VEC = 16 / sizeof(T), ROW = 128 / VEC, HALF = ROW / 2;
  const unsigned lane_base = blockIdx.x * (128u * P) + threadIdx.x;
  uint4 xv[P];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const unsigned g = lane_base + j * 128u;
    if (g < n) xv[j] = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(g) * VEC);
  }
  float cc[LATE ? 1 : P][VEC], ss[LATE ? 1 : P][VEC];
  if constexpr (!LATE) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const unsigned g = lane_base + j * 128u, gg = g < n ? g : n - 1;
      const unsigned t = gg / (heads * ROW), fi = (gg * VEC) & 63;
      row<VEC>(cs + static_cast<size_t>(t) * 64 + fi, cc[j]);
      row<VEC>(sn + static_cast<size_t>(t) * 64 + fi, ss[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const unsigned g = lane_base + j * 128u;  // whole warps live or not (rows tile warps)
    if (lane_base - threadIdx.x % 32 + j * 128u >= n) break;
    const unsigned gg = g < n ? g : n - 1;
    const unsigned t = gg / (heads * ROW), c = (gg % ROW) * VEC, fi = c & 63;
    float c_[VEC], s_[VEC];
    if constexpr (LATE) {
      row<VEC>(cs + static_cast<size_t>(t) * 64 + fi, c_);
      row<VEC>(sn + static_cast<size_t>(t) * 64 + fi, s_);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) { c_[i] = cc[j][i]; s_[i] = ss[j][i]; }
    }
    uint4 pv;
    pv.x = __shfl_xor_sync(0xffffffffu, xv[j].x, HALF); pv.y = __shfl_xor_sync(0xffffffffu, xv[j].y, HALF);
    pv.z = __shfl_xor_sync(0xffffffffu, xv[j].z, HALF); pv.w = __shfl_xor_sync(0xffffffffu, xv[j].w, HALF);
    float a[VEC], b[VEC];
    Elem<T>::unpack(xv[j], a);
    Elem<T>::unpack(pv, b);
    const float sg = c < 64 ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) a[i] = fmaf(a[i], c_[i], sg * (b[i] * s_[i]));
    if (g < n) *reinterpret_cast<uint4*>(o + static_cast<size_t>(g) * VEC) = Elem<T>::pack(a);
  }
}
"""

# (dtype, packets per thread, min blocks asked of the compiler, late tables,
# resident blocks per SM capped by dynamic shared memory: 0 = no cap)
CARVEOUTS = (-1, 0, 25, 50, 100)  # preferred shared memory carveout, % (-1: the driver's)
VARIANTS = ([("u16", 1, 16, False, 0, c) for c in CARVEOUTS]
            + [("u16", 2, 8, False, 0, c) for c in CARVEOUTS]
            + [("float", 1, 16, False, 0, c) for c in CARVEOUTS]
            + [("float", 2, 16, False, 0, c) for c in CARVEOUTS]
            + [("float", 2, 16, False, 12, -1)])
# dynamic shared memory for a cap of B blocks: B * (bytes + 1 KB reserved) <= 228 KB
SMEM = {cap: (228 // cap - 1) * 1024 if cap else 0 for cap in range(0, 17)}


def name(t, p, m, late, cap=0, carve=-1):
    return f"packets<{t}, {p}, {m}, {'true' if late else 'false'}>"


def label(t, p, m, late, cap, carve, resident):
    return (f"P{p}/M{m}{'/late' if late else ''}{f'/cap{cap}' if cap else ''}"
            f"{f'/c{carve}' if carve >= 0 else ''}={resident}")


def launch(k, v, n, args):
    # the function's preferred carveout (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
    driver.funcSetAttribute(k.kernel.ptr, 9, v[5])
    per = 128 * v[1]
    k(((n + per - 1) // per,), (128,), args, shared_mem=SMEM[v[4]])


def main():
    import torch
    from cupy_rope.peers import rope_formula
    names = [name(*v) for v in VARIANTS]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=sorted(set(names)))
    for nm in sorted(set(names)):
        f = mod.get_function(nm)
        print(f"{nm}: {f.num_regs} registers, {f.local_size_bytes} local bytes", flush=True)
    d = 128
    cos, sin = tables(d, rows=16384)
    compiled = torch.compile(rope_formula, dynamic=False)
    cos_t, sin_t = torch.from_dlpack(cos), torch.from_dlpack(sin)
    shapes = (("u16", 512, 768), ("u16", 4096, 128), ("u16", 16384, 32), ("u16", 16384, 24),
              ("float", 128, 8192))
    for t, T, H in shapes:
        tdt = torch.bfloat16 if t == "u16" else torch.float32
        cdt = bf16() if t == "u16" else cupy.float32
        xs = [torch.randn((T, H, d), device="cuda", dtype=tdt) for _ in range(3)]
        sets = [(cupy.from_dlpack(x), cupy.empty((T, H, d), dtype=cdt)) for x in xs]
        full_c = torch.cat((cos_t[:T], cos_t[:T]), -1).to(tdt)[:, None]
        full_s = torch.cat((sin_t[:T], sin_t[:T]), -1).to(tdt)[:, None]
        torch_sets = [(x, full_c, full_s) for x in xs]
        vec = 8 if t == "u16" else 4
        n = T * H * d // vec
        t_copy = copy_us(sets[0][0].nbytes)
        cupy_rope.apply_rope(sets[0][0][None], cos, sin, out=sets[0][1][None])
        ref = sets[0][1].astype(cupy.float32)
        res = {}
        for rep in range(2):
            res.setdefault("compile", []).append(time_us(compiled, torch_sets))
            res.setdefault("apply_rope", []).append(time_us(
                lambda x, o: cupy_rope.apply_rope(x[None], cos, sin, out=o[None]), sets))
            for v, nm in zip(VARIANTS, names):
                if v[0] != t:
                    continue
                k = mod.get_function(nm)
                driver.funcSetAttribute(k.kernel.ptr, 9, v[5])  # this variant's carveout first
                resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, 128, SMEM[v[4]])
                res.setdefault(label(*v, resident), []).append(time_us(
                    lambda x, o, k=k, v=v: launch(k, v, n, (x, o, cos, sin, np.uint32(H),
                                                            np.uint32(n))), sets))
        errs = []
        for v, nm in zip(VARIANTS, names):
            if v[0] != t:
                continue
            sets[0][1].fill(0)
            launch(mod.get_function(nm), v, n,
                   (sets[0][0], sets[0][1], cos, sin, np.uint32(H), np.uint32(n)))
            errs.append(float(abs(sets[0][1].astype(cupy.float32) - ref).max()))
        print(f"{t} [{T}, {H}, 128] copy {t_copy:.1f} us | " + " | ".join(
            f"{k} {' '.join(f'{x:.1f}' for x in v)} ({t_copy / min(v):.3f})"
            for k, v in res.items()) + f" | max |variant - apply_rope| {max(errs):.3g}", flush=True)


if __name__ == "__main__":
    main()
