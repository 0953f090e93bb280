"""Probe: lean kernel C (scripts/lean_probe.py: one 16-byte packet per
thread, NeoX partner by shuffle, 40 bytes of arguments) made more like
flat_kernel one step at a time, against cupy_rope.apply_rope (flat_kernel)
on the same bf16 [T, H, 128] arrays with fp32 [P, 64] tables, and
torch.compile of the formula on the same x (bf16 [T, 1, 128] tables):

    PYTHONPATH=. python scripts/lean_steps_probe.py

STEP 0: lean C. 1: its arguments in a 304-byte struct (FlatParams' size),
the slab picked from three by block_begin as flat_kernel does. 2: + the
position offset and the table-bounds test (64-bit) with NaN outside. 3: +
the store written as PTX (st.global.v4, memory clobber). 4: + x read
through a plain (not __restrict__) pointer."""
import cupy
import numpy as np

from lean_probe import SRC as LEAN, bf16, copy_us, tables, time_us

SRC = LEAN + r"""
struct Slab3 { long long block_begin, rows, a, b, c, d, e; };
struct Args {
  const void* x[3]; void* o[3]; const float* cs; const float* sn; const void* pad[3];
  long long offset; Slab3 slab[3]; long long n_slabs, heads, n, max_position; float sign, pad_;
};
template <int STEP>
__global__ void __launch_bounds__(128) steps(const Args a) {
  int k = 0;
#pragma unroll
  for (int i = 1; i < 3; ++i)
    if (i < a.n_slabs && blockIdx.x >= a.slab[i].block_begin) k = i;
  const void* xv = a.x[0]; void* ov = a.o[0]; long long begin = a.slab[0].block_begin;
#pragma unroll
  for (int i = 1; i < 3; ++i)
    if (i == k) { xv = a.x[i]; ov = a.o[i]; begin = a.slab[i].block_begin; }
  const unsigned heads = (unsigned)a.heads, n_groups = (unsigned)a.n;
  const unsigned g = (blockIdx.x - (unsigned)begin) * blockDim.x + threadIdx.x;
  const bool live = g < n_groups;
  const unsigned e = (live ? g : n_groups - 1) * 8, c = e & 127, t = e / (heads * 128);
  const unsigned fi = c & 63;
  uint4 xr;
  if constexpr (STEP >= 4) xr = *reinterpret_cast<const uint4*>(static_cast<const u16*>(xv) + e);
  else xr = *reinterpret_cast<const uint4* __restrict__>(static_cast<const u16* __restrict__>(xv) + e);
  long long pos = t;
  bool inside = true;
  if constexpr (STEP >= 2) {
    const long long wanted = (long long)t + a.offset;
    inside = wanted >= 0 && wanted < a.max_position;
    pos = live && inside ? wanted : 0;
  }
  float cc[8], ss[8];
  row8(a.cs + pos * 64 + fi, cc);
  row8(a.sn + pos * 64 + fi, ss);
  const uint4 pv = partner8(xr);
  const u16* xa = reinterpret_cast<const u16*>(&xr); const u16* pa = reinterpret_cast<const u16*>(&pv);
  uint4 r; u16* ra = reinterpret_cast<u16*>(&r);
  const float sg = c < 64 ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v = f(xa[i]) * cc[i] + sg * f(pa[i]) * ss[i];
    if (STEP >= 2 && !inside) v = __int_as_float(0x7fffffff);
    ra[i] = h(v);
  }
  u16* op = static_cast<u16*>(ov) + e;
  if (live) {
    if constexpr (STEP >= 3)
      asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(op), "r"(r.x), "r"(r.y),
                   "r"(r.z), "r"(r.w) : "memory");
    else *reinterpret_cast<uint4*>(op) = r;
  }
}
template __global__ void steps<1>(const Args);
template __global__ void steps<2>(const Args);
template __global__ void steps<3>(const Args);
template __global__ void steps<4>(const Args);
"""
ARGS = np.dtype([("x", "<u8", 3), ("o", "<u8", 3), ("cs", "<u8"), ("sn", "<u8"), ("pad", "<u8", 3),
                 ("offset", "<i8"), ("slab", "<i8", (3, 7)), ("n_slabs", "<i8"), ("heads", "<i8"),
                 ("n", "<i8"), ("max_position", "<i8"), ("sign", "<f4"), ("pad_", "<f4")])


def main():
    import cupy_rope
    assert ARGS.itemsize == 304
    names = [f"steps<{i}>" for i in range(1, 5)]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    d = 128
    cos, sin = tables(d)
    import torch
    from cupy_rope.peers import rope_formula
    compiled = torch.compile(rope_formula, dynamic=False)
    cos_t, sin_t = torch.from_dlpack(cos), torch.from_dlpack(sin)
    for T, H in ((16384, 24), (16384, 32), (4096, 128)):
        xs = [torch.randn((T, H, d), device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        sets = [(cupy.from_dlpack(x), cupy.empty((T, H, d), dtype=bf16())) for x in xs]
        # torch.compile of the formula on the same x, with HF-style [T, 1, d]
        # bf16 tables (as the benchmark gives it)
        full_c = torch.cat((cos_t[:T], cos_t[:T]), -1).to(torch.bfloat16)[:, None]
        full_s = torch.cat((sin_t[:T], sin_t[:T]), -1).to(torch.bfloat16)[:, None]
        torch_sets = [(x, full_c, full_s) for x in xs]
        t_copy = copy_us(sets[0][0].nbytes)
        n = T * H * d // 8
        grid = ((n + 127) // 128,)
        lean = mod.get_function("lean_c")
        res = {}
        for rep in range(2):
            res.setdefault("compile", []).append(time_us(compiled, torch_sets))
            res.setdefault("flat_kernel", []).append(time_us(
                lambda x, o: cupy_rope.apply_rope(x[None], cos, sin, out=o[None]), sets))
            res.setdefault("0", []).append(time_us(lambda x, o: lean(
                grid, (128,), (x, o, cos, sin, np.uint32(H), np.uint32(n))), sets))
            for i, name in enumerate(names, 1):
                k = mod.get_function(name)

                def run(x, o, k=k):
                    a = np.zeros((), ARGS)
                    a["x"][0], a["o"][0] = x.data.ptr, o.data.ptr
                    a["cs"], a["sn"] = cos.data.ptr, sin.data.ptr
                    a["n_slabs"], a["heads"], a["n"], a["max_position"] = 1, H, n, cos.shape[0]
                    a["sign"] = 1.0
                    k(grid, (128,), (np.void(a.tobytes()),))
                res.setdefault(str(i), []).append(time_us(run, sets))
        ref = sets[0][1].astype(cupy.float32)
        print(f"[{T}, {H}, 128] copy {t_copy:.1f} us | " + " | ".join(
            f"{k} {' '.join(f'{t:.1f}' for t in v)} ({t_copy / min(v):.3f})"
            for k, v in res.items()), flush=True)
        cupy_rope.apply_rope(sets[0][0][None], cos, sin, out=sets[0][1][None])
        err = float(abs(sets[0][1].astype(cupy.float32) - ref).max())
        print(f"  max |step 4 - apply_rope| {err:.3g}")


if __name__ == "__main__":
    main()
