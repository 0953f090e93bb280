"""Probe: how close do minimal pointwise RoPE kernels (no Params, flat index)
get to a same-run copy on bf16 [tokens, heads, 128] with fp32 [P, 64] tables,
against cupy_rope.apply_rope on the same arrays? (GPU machine.)

    PYTHONPATH=. python3 scripts/lean_probe.py

Kernel A writes one 16-byte output group per thread and re-reads its
rotate-half partner; kernel C gets the partner by a warp shuffle; kernels B rotate (f, f + 64) pairs of groups for 1, 2
or 4 heads per thread. Results and what they mean: docs/perf-notes.md (v7).
Each kernel's output is compared with apply_rope's (max abs difference)."""
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
import cupy_rope  # noqa: E402
from scripts.quick_perf import bf16, copy_us, time_us  # noqa: E402

SRC = r"""
typedef unsigned short u16;
__device__ __forceinline__ float f(u16 b) { return __uint_as_float((unsigned)b << 16); }
__device__ __forceinline__ u16 h(float v) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v)); return r; }
__device__ __forceinline__ uint4 ldp(const void* p, unsigned long long pol) {
  uint4 v; asm("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol)); return v; }
__device__ __forceinline__ unsigned long long keep() {
  unsigned long long p; asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p)); return p; }
// 8 floats of a table row, evict-last.
__device__ __forceinline__ void row8(const float* r, float (&v)[8]) {
  const unsigned long long pol = keep();
  const uint4 a = ldp(r, pol), b = ldp(r + 4, pol);
  v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z);
  v[3] = __uint_as_float(a.w); v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y);
  v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
}

// A: one 16-byte output group per thread (Triton-like), partner loaded separately.
extern "C" __global__ void __launch_bounds__(128) lean_a(const u16* __restrict__ x, u16* __restrict__ o,
    const float* __restrict__ cs, const float* __restrict__ sn, unsigned heads, unsigned n_groups) {
  unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= n_groups) return;
  unsigned e = g * 8, c = e & 127, t = e / (heads * 128);
  unsigned pc = c < 64 ? e + 64 : e - 64, fi = c & 63;
  uint4 xv = *reinterpret_cast<const uint4*>(x + e);
  uint4 pv = *reinterpret_cast<const uint4*>(x + pc);
  float cc[8], ss[8];
  row8(cs + (size_t)t * 64 + fi, cc);
  row8(sn + (size_t)t * 64 + fi, ss);
  const u16* xa = reinterpret_cast<const u16*>(&xv); const u16* pa = reinterpret_cast<const u16*>(&pv);
  uint4 ov; u16* oa = reinterpret_cast<u16*>(&ov);
  const float sg = c < 64 ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) oa[i] = h(f(xa[i]) * cc[i] + sg * f(pa[i]) * ss[i]);
  *reinterpret_cast<uint4*>(o + e) = ov;
}

// B: one pair of 16-byte groups (f and f + 64) per thread, HPT heads per thread.
template <int HPT>
__device__ void lean_b_body(const u16* __restrict__ x, u16* __restrict__ o, const float* __restrict__ cs,
    const float* __restrict__ sn, unsigned heads, unsigned n_items) {
  unsigned it = blockIdx.x * blockDim.x + threadIdx.x;  // item = (token, head group, fi)
  if (it >= n_items) return;
  unsigned fi = (it & 7) * 8, hg = it >> 3;            // 8 items per head
  unsigned groups = heads / HPT, t = hg / groups, h0 = (hg - t * groups) * HPT;
  size_t base = ((size_t)t * heads + h0) * 128 + fi;
  uint4 a[HPT], b[HPT];
#pragma unroll
  for (int u = 0; u < HPT; ++u) {
    a[u] = *reinterpret_cast<const uint4*>(x + base + u * 128);
    b[u] = *reinterpret_cast<const uint4*>(x + base + u * 128 + 64);
  }
  float cc[8], ss[8];
  row8(cs + (size_t)t * 64 + fi, cc);
  row8(sn + (size_t)t * 64 + fi, ss);
#pragma unroll
  for (int u = 0; u < HPT; ++u) {
    const u16* xa = reinterpret_cast<const u16*>(&a[u]); const u16* xb = reinterpret_cast<const u16*>(&b[u]);
    uint4 oa4, ob4; u16* oa = reinterpret_cast<u16*>(&oa4); u16* ob = reinterpret_cast<u16*>(&ob4);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float p = f(xa[i]), q = f(xb[i]);
      oa[i] = h(p * cc[i] - q * ss[i]); ob[i] = h(q * cc[i] + p * ss[i]);
    }
    *reinterpret_cast<uint4*>(o + base + u * 128) = oa4;
    *reinterpret_cast<uint4*>(o + base + u * 128 + 64) = ob4;
  }
}
// The rotate-half partner of a d128 bf16 packet: the lane 8 away.
__device__ __forceinline__ uint4 partner8(uint4 v) {
  uint4 p;
  p.x = __shfl_xor_sync(0xffffffffu, v.x, 8); p.y = __shfl_xor_sync(0xffffffffu, v.y, 8);
  p.z = __shfl_xor_sync(0xffffffffu, v.z, 8); p.w = __shfl_xor_sync(0xffffffffu, v.w, 8);
  return p;
}
// C: one 16-byte group per thread like A, but the rotate-half partner comes
// from the lane 8 away (__shfl_xor_sync) instead of a second load: every
// load and store instruction of a warp covers 512 contiguous bytes.
__device__ __forceinline__ void lean_c_body(const u16* __restrict__ x, u16* __restrict__ o,
    const float* __restrict__ cs, const float* __restrict__ sn, unsigned heads, unsigned n_groups) {
  const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = g < n_groups;           // heads are whole: a live lane's partner is live
  const unsigned e = (live ? g : n_groups - 1) * 8, c = e & 127, t = e / (heads * 128);
  const unsigned fi = c & 63;
  const uint4 xv = *reinterpret_cast<const uint4*>(x + e);
  float cc[8], ss[8];
  row8(cs + (size_t)t * 64 + fi, cc);
  row8(sn + (size_t)t * 64 + fi, ss);
  const uint4 pv = partner8(xv);
  const u16* xa = reinterpret_cast<const u16*>(&xv); const u16* pa = reinterpret_cast<const u16*>(&pv);
  uint4 ov; u16* oa = reinterpret_cast<u16*>(&ov);
  const float sg = c < 64 ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) oa[i] = h(f(xa[i]) * cc[i] + sg * f(pa[i]) * ss[i]);
  if (live) *reinterpret_cast<uint4*>(o + e) = ov;
}
extern "C" __global__ void __launch_bounds__(128) lean_c(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_c_body(x, o, cs, sn, heads, n); }
extern "C" __global__ void __launch_bounds__(256) lean_c256(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_c_body(x, o, cs, sn, heads, n); }
extern "C" __global__ void __launch_bounds__(128) lean_b1(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_b_body<1>(x, o, cs, sn, heads, n); }
extern "C" __global__ void __launch_bounds__(128) lean_b2(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_b_body<2>(x, o, cs, sn, heads, n); }
extern "C" __global__ void __launch_bounds__(128) lean_b4(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_b_body<4>(x, o, cs, sn, heads, n); }
extern "C" __global__ void __launch_bounds__(256) lean_b4w(const u16* x, u16* o, const float* cs, const float* sn, unsigned heads, unsigned n) { lean_b_body<4>(x, o, cs, sn, heads, n); }
"""


def tables(d=128, rows=16384):
    """float32 cos and sin tables [rows, d / 2] (base 10000)."""
    inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    th = cupy.arange(rows, dtype=cupy.float32)[:, None] * inv
    return cupy.cos(th), cupy.sin(th)


def main():
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",))
    d = 128
    cos, sin = tables(d)
    for shape in ((4096, 128), (16384, 32), (16384, 24)):
        T, H = shape
        sets = [(cupy.random.standard_normal((T, H, d), dtype=cupy.float32).astype(bf16()),
                 cupy.empty((T, H, d), dtype=bf16())) for _ in range(3)]
        t_copy = copy_us(sets[0][0].nbytes)
        rows = [("cupy_rope", time_us(lambda x, o: cupy_rope.apply_rope(
            x[None], cos, sin, out=o[None]), sets))]
        ref = sets[0][1].astype(cupy.float32)
        n_groups = T * H * d // 8
        ka = mod.get_function("lean_a")
        rows.append(("A 1 group/thread, 128 thr", time_us(lambda x, o: ka(
            ((n_groups + 127) // 128,), (128,), (x, o, cos, sin, np.uint32(H), np.uint32(n_groups))),
            sets)))
        err = float(abs(sets[0][1].astype(cupy.float32) - ref).max())
        for name, thr in (("lean_c", 128), ("lean_c256", 256)):
            k = mod.get_function(name)
            rows.append((f"C shuffle partner, {thr} thr", time_us(lambda x, o: k(
                ((n_groups + thr - 1) // thr,), (thr,),
                (x, o, cos, sin, np.uint32(H), np.uint32(n_groups))), sets)))
            err = max(err, float(abs(sets[0][1].astype(cupy.float32) - ref).max()))
        for name, hpt, thr in (("lean_b1", 1, 128), ("lean_b2", 2, 128), ("lean_b4", 4, 128),
                               ("lean_b4w", 4, 256)):
            if H % hpt:
                continue
            k = mod.get_function(name)
            n = T * (H // hpt) * 8
            rows.append((f"B {hpt} heads/thread, {thr} thr", time_us(lambda x, o: k(
                ((n + thr - 1) // thr,), (thr,), (x, o, cos, sin, np.uint32(H), np.uint32(n))),
                sets)))
            err = max(err, float(abs(sets[0][1].astype(cupy.float32) - ref).max()))
        print(f"[{T}, {H}, 128] copy {t_copy:.1f} us; max |lean - ours| {err:.3g}")
        for name, t in rows:
            print(f"  {name:28s} {t:7.1f} us  {t_copy / t:.3f} of copy")
        for fn in ("lean_a", "lean_c", "lean_b1", "lean_b2", "lean_b4"):
            print(f"  {fn} regs", mod.get_function(fn).num_regs, end=";")
        print()


if __name__ == "__main__":
    main()
