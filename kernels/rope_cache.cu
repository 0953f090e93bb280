// Rotary position embedding fused with the KV-cache write: one launch
// rotates q (into its output, or in place) and k, and stores the rotated k
// and v at their cache slots (cupy_rope/kv_cache.py). k and v themselves
// are only read.
//
// The rotation is rope_kernel's (kernels/rope.cu): the same angle sources,
// position rules and rotation helpers, so that q and the cached k agree bit
// for bit with apply_rope_qk. What differs is where results go:
//   q -> out (Params.out_data[0], strides of Params.slab[0].out), in q's
//        dtype or FP8 (Q_FORMAT);
//   k, v -> k_cache / v_cache at slot = slot_mapping[token]:
//        block = slot / block_size, offset = slot % block_size, element
//        block * stride_block + offset * stride_offset + head * stride_head
//        + channel * stride_dim (NHD and HND caches are two stride orders),
//        in k's dtype or FP8 (CACHE_FORMAT).
// A token whose slot is negative (padding) or not below num_blocks *
// block_size writes nothing to either cache; its q is rotated all the same.
// FP8 values are the element rounded to its own dtype first, then divided
// by the scale in fp32 and converted with round to nearest even, saturated
// to the format's finite range: what torch gives for
// (x.float() / scale).clamp(-max, max).to(float8) with the scale a float32
// tensor (torch divides a CUDA tensor by a Python float as a product with
// its reciprocal, which can round differently). The quotient comes from the
// scale's reciprocal and one correction (fp8_quotients), not a division;
// scales lie in [FP8_SCALE_MIN, FP8_SCALE_MAX] (the host refuses others; a
// device scale outside stores NaN codes).
//
// Thread layout (cupy_rope/kv_cache.py picks the sizes):
//   threadIdx.x: an item of a head row: items [0, ROT_ITEMS) each handle
//                PAIRS pairs (for v: the same channels, copied), the rest
//                TAIL_VEC channels of the tail [ROTARY_DIM, HEAD_DIM).
//   threadIdx.y: head lane; heads are numbered q [0, hq), k [hq, hq + hk),
//                v [hq + hk, hq + 2 hk). Lane l of head group g (blockIdx.y)
//                takes head g * blockDim.y + l, then every gridDim.y *
//                blockDim.y heads further, UNROLL heads' loads per pass.
//   threadIdx.z: token lane; blockIdx.x: token block; blockIdx.y: head group
//                (few tokens: the heads split over several blocks).
//
// With the per-head q/k RMSNorm (NORM, cupy_rope/kv_cache.py), q and k heads
// are first normalized as norm_rope_kernel normalizes them (kernels/
// norm_rope.cu, norm_scope "head"), then rotated and stored; v is copied
// as it is. A head row is then held by threadIdx.x's LANES lanes, K items a
// lane in the ItemLayout of kernels/norm_items.cuh, so that the row's sum of
// squares is taken in the norm kernel's order: q and the cached k equal the
// norm op's results bit for bit where both read with the same vector widths.
// q's tail channels are written normalized (in place too).
//
// Decode calls of dense head rows (kv_cache.flat_decode_shape: few tokens
// with one outer index, full rotary, float32 cos/sin tables, explicit
// positions, q in its dtype, no norm) take rope_cache_flat_kernel at the end
// of this file instead: the same stores, one packet a thread.
#include "norm_items.cuh"

namespace rope {

// Where a cache element lives (cupy_rope/kv_cache.py packs the same struct).
struct CacheView {
  i64 stride_block;
  i64 stride_offset;
  i64 stride_head;
  i64 stride_dim;
};

// Storage formats of an output: the input's dtype, or an FP8 format.
enum StoreFormat : int { SAME = 0, E4M3 = 1, E5M2 = 2 };

constexpr int CACHE_THREADS = 256;     // threads per block (cupy_rope/kv_cache.py THREADS)

// The kernel's parameters: rope_kernel's (slab 0 q with its output, slab 1
// k, slab 2 v; only their x views, q's out view and the angle and position
// fields are read), then the per-call pointers of the cache write, then
// what is fixed per call signature.
struct CacheParams : Params {
  const void* slot_mapping;
  void* cache_data[2];       // k_cache, v_cache
  const float* scale_ptr[3];  // q out, k cache, v cache: a device scale, or null
  const void* weight[2];      // NORM: q's and k's norm weights [HEAD_DIM] (WT), or null
  CacheView cache[2];
  i64 n_slots;      // num_blocks * block_size
  i64 block_size;
  i64 slot_stride_outer;
  i64 slot_stride_inner;
  i64 slot_is_64;
  i64 heads_q;
  i64 heads_kv;
  float scale[3];       // used where scale_ptr is null
  float eps;            // NORM: added to the mean square
};

// The quotients x / scale of an FP8 store. IEEE division is a branchy
// sequence per element, the whole cost of FP8 over bf16 in a decode step;
// instead a thread takes r = rn(1 / scale) once, and per element q0 = rn(x r)
// is corrected once by its residual (Markstein): fma(fma(-q0, scale, x), r,
// q0). With the scale in [FP8_SCALE_MIN, FP8_SCALE_MAX] and |q0| in
// [FP8_QUOTIENT_MIN, FP8_QUOTIENT_MAX], x and q0 are normal floats (a
// residual may be subnormal, and flushed, only where q0 is already the
// quotient) and the result is the IEEE quotient (every pair of mantissas
// checked; tests/test_fp8_quotient.py reads the bounds and this code). A
// smaller |q0| stores a zero of q0's sign and a larger one (inf, NaN)
// saturates or stays NaN, as the IEEE quotient would. There is no division
// for other scales: straight-line code lets ptxas interleave the stores of
// a thread's packets (docs/performance.md, "Cache-op decode").
constexpr float FP8_SCALE_MIN = 0x1p-32f;
constexpr float FP8_SCALE_MAX = 0x1p+32f;
constexpr float FP8_QUOTIENT_MIN = 0x1p-64f;
constexpr float FP8_QUOTIENT_MAX = 0x1p+64f;
static_assert(FP8_QUOTIENT_MIN * 0x1p-23f * FP8_SCALE_MIN >= 0x1p-126f &&
                  FP8_QUOTIENT_MAX * FP8_SCALE_MAX <= 0x1p+127f,
              "within the bounds, x and q0 stay normal floats");

// An FP8 output's rn(1 / scale); NaN where the scale is outside the bounds
// (a device scale holding it: the store is then NaN, never a quiet
// misrounding). Plain floats, not a struct: a thread keeps one per output,
// and an array of structs selected at run time went to local memory.
__device__ __forceinline__ float fp8_recip(float scale) {
  return scale >= FP8_SCALE_MIN && scale <= FP8_SCALE_MAX ? __frcp_rn(scale)
                                                          : __int_as_float(0x7fffffff);
}

// x[i] / scale in place, as described above.
template <int N>
__device__ __forceinline__ void fp8_quotients(float (&x)[N], float scale, float recip) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float q0 = __fmul_rn(x[i], recip);  // never contracted into an fma
    const float q = fmaf(fmaf(-q0, scale, x[i]), recip, q0);
    x[i] = fabsf(q0) <= FP8_QUOTIENT_MAX ? copysignf(q, q0) : q0;
  }
}

// FP8 without the sm_89 conversion instructions: round to nearest even,
// saturated to the largest finite value; NaN stays NaN.
template <int FORMAT>
__device__ __forceinline__ unsigned fp8_bits_soft(float x) {
  constexpr int MAN = FORMAT == E4M3 ? 3 : 2;
  constexpr int BIAS = FORMAT == E4M3 ? 7 : 15;
  constexpr unsigned MAX_CODE = FORMAT == E4M3 ? 0x7eu : 0x7bu;
  constexpr unsigned NAN_CODE = 0x7fu;
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | NAN_CODE;
  const int e = static_cast<int>(a >> 23) - 127;
  unsigned code;
  if (e < 1 - BIAS) {  // below the smallest normal: a multiple of the subnormal step
    code = static_cast<unsigned>(rintf(__uint_as_float(a) * exp2f(MAN - (1 - BIAS))));
  } else if (e > 15) {  // far beyond every finite FP8 value (and inf)
    code = MAX_CODE;
  } else {
    constexpr int SHIFT = 23 - MAN;
    const unsigned r = a + ((1u << (SHIFT - 1)) - 1u) + ((a >> SHIFT) & 1u);
    code = (r >> SHIFT) - (static_cast<unsigned>(127 - BIAS) << MAN);
  }
  return sign | min(code, MAX_CODE);
}

// Two floats as two FP8 bytes, lo first in memory.
template <int FORMAT>
__device__ __forceinline__ unsigned fp8x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  if constexpr (FORMAT == E4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return fp8_bits_soft<FORMAT>(lo) | (fp8_bits_soft<FORMAT>(hi) << 8);
#endif
}

// The element type an output of FORMAT stores for inputs of type T (FP8:
// one byte). No <type_traits>: NVRTC compiles without toolkit headers.
template <typename T, int FORMAT> struct StoredType { typedef unsigned char type; };
template <typename T> struct StoredType<T, SAME> { typedef T type; };
template <typename T, int FORMAT>
using Stored = typename StoredType<T, FORMAT>::type;

// Store N floats (results for an output of x's type T) at p in FORMAT: T
// rounds once; FP8 rounds to T, divides by the scale, then converts.
template <typename T, int FORMAT, int N, bool STRIDED>
__device__ __forceinline__ void put(Stored<T, FORMAT>* p, i64 stride, const float (&v)[N],
                                   float scale, float recip) {
  if constexpr (FORMAT == SAME) {
    store<T, N, STRIDED>(p, stride, v);
  } else {
    float x[N];
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = to_float(from_float<T>(v[i]));
    fp8_quotients(x, scale, recip);
    Packet<unsigned char, N> pk;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const unsigned b = fp8x2<FORMAT>(x[i], i + 1 < N ? x[i + 1] : 0.0f);
      pk.v[i] = static_cast<unsigned char>(b & 0xffu);
      if (i + 1 < N) pk.v[i + 1] = static_cast<unsigned char>(b >> 8);
    }
    store_raw<unsigned char, N, STRIDED>(p, stride, pk);
  }
}

// Store N elements of T as they were loaded (v, tails) in FORMAT.
template <typename T, int FORMAT, int N, bool STRIDED>
__device__ __forceinline__ void put_raw(Stored<T, FORMAT>* p, i64 stride, const Packet<T, N>& pk,
                                        float scale, float recip) {
  if constexpr (FORMAT == SAME) {
    store_raw<T, N, STRIDED>(p, stride, pk);
  } else {
    float v[N];
    to_floats(pk, v);
    put<T, FORMAT, N, STRIDED>(p, stride, v, scale, recip);
  }
}

// Select among three values with a run-time index, without indexing the
// parameter struct at run time (which would copy it to local memory).
template <typename V>
__device__ __forceinline__ V pick3(int i, V a, V b, V c) {
  return i == 0 ? a : i == 1 ? b : c;
}

// The slab of head h (0 q, 1 k, 2 v: heads q [0, hq), k [hq, n_rot), v
// [n_rot, n_rot + hk)) and the head's index there.
__device__ __forceinline__ int head_slab(int h, int hq, int n_rot) {
  return h < hq ? 0 : h < n_rot ? 1 : 2;
}
__device__ __forceinline__ int head_in_slab(int h, int s, int hq, int n_rot) {
  return h - (s == 0 ? 0 : s == 1 ? hq : n_rot);
}

// The cache block of `slot` (in [0, n_slots)); 32-bit division where the
// slots allow.
__device__ __forceinline__ i64 slot_block(const CacheParams& p, i64 slot) {
  return p.n_slots <= 0xffffffffll
             ? static_cast<unsigned>(slot) / static_cast<unsigned>(p.block_size)
             : slot / p.block_size;
}

// One token's head rows: where head h (q [0, hq), k [hq, hq + hk), v
// [hq + hk, hq + 2 hk)) is read, and where its results go (q's output, or
// the k / v cache row of the token's slot), with the scales of FP8 outputs.
template <typename T, int Q_FORMAT, int CACHE_FORMAT, bool STRIDED>
struct TokenRows {
  const T* src[3];
  i64 src_head[3], src_dim[3];
  Stored<T, Q_FORMAT>* q_dst;
  i64 q_head, q_dim;
  Stored<T, CACHE_FORMAT>* kv_dst[2];
  i64 kv_head[2], kv_dim[2];
  float scale[3], recip[3];  // FP8 outputs: the scale and fp8_recip of it (place)
  int hq, n_rot;
  i64 slot;       // the token's cache slot (its load in flight until place)
  bool write_kv;  // the slot is valid: k and v are stored (set by place)

  // The k and v cache rows of the token's slot, and the reciprocals of the
  // scales. Called once the thread's first head loads are issued: code that
  // waits for the slot or a device scale would hold them back (ptxas does
  // not hoist loads above its branches).
  __device__ __forceinline__ void place(const CacheParams& p) {
#pragma unroll
    for (int s = 0; s < 3; ++s) recip[s] = fp8_recip(scale[s]);
    write_kv = slot >= 0 && slot < p.n_slots;
    i64 blk = 0, off = 0;
    if (write_kv) {
      blk = slot_block(p, slot);
      off = slot - blk * p.block_size;
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      kv_dst[c] = static_cast<Stored<T, CACHE_FORMAT>*>(p.cache_data[c]) +
                  blk * p.cache[c].stride_block + off * p.cache[c].stride_offset;
  }

  // The slab of head h (0 q, 1 k, 2 v) and its index there.
  __device__ __forceinline__ int slab_of(int h) const { return head_slab(h, hq, n_rot); }
  __device__ __forceinline__ int local(int h, int s) const { return head_in_slab(h, s, hq, n_rot); }
  // A padding token's k and v are dropped at the store.
  __device__ __forceinline__ bool skipped(int s) const { return s != 0 && !write_kv; }

  // Channel ch of head h (slab s) in the input; its channel stride in `stride`.
  __device__ __forceinline__ const T* source(int h, int s, i64 ch, i64& stride) const {
    stride = pick3(s, src_dim[0], src_dim[1], src_dim[2]);
    return pick3(s, src[0], src[1], src[2]) +
           local(h, s) * pick3(s, src_head[0], src_head[1], src_head[2]) + ch * stride;
  }

  // Results (floats) of channels [ch, ch + N) of head h to their destination.
  template <int N>
  __device__ __forceinline__ void put_floats(int h, int s, i64 ch, const float (&v)[N]) const {
    const int j = local(h, s);
    if (s == 0) {
      put<T, Q_FORMAT, N, STRIDED>(q_dst + j * q_head + ch * q_dim, q_dim, v, scale[0], recip[0]);
    } else {
      const int c = s - 1;
      const i64 d = c ? kv_dim[1] : kv_dim[0];
      put<T, CACHE_FORMAT, N, STRIDED>((c ? kv_dst[1] : kv_dst[0]) +
                                           j * (c ? kv_head[1] : kv_head[0]) + ch * d,
                                       d, v, c ? scale[2] : scale[1], c ? recip[2] : recip[1]);
    }
  }

  // Channels [ch, ch + N) of head h copied (v, tails) to their destination.
  template <int N>
  __device__ __forceinline__ void put_packet(int h, int s, i64 ch, const Packet<T, N>& pk) const {
    const int j = local(h, s);
    if (s == 0) {
      put_raw<T, Q_FORMAT, N, STRIDED>(q_dst + j * q_head + ch * q_dim, q_dim, pk, scale[0],
                                       recip[0]);
    } else {
      const int c = s - 1;
      const i64 d = c ? kv_dim[1] : kv_dim[0];
      put_raw<T, CACHE_FORMAT, N, STRIDED>((c ? kv_dst[1] : kv_dst[0]) +
                                               j * (c ? kv_head[1] : kv_head[0]) + ch * d,
                                           d, pk, c ? scale[2] : scale[1],
                                           c ? recip[2] : recip[1]);
    }
  }
};

// The head rows of token (outer, inner), whose cache slot is `slot`; the
// cache rows are found later (place).
template <typename T, int Q_FORMAT, int CACHE_FORMAT, bool STRIDED>
__device__ __forceinline__ TokenRows<T, Q_FORMAT, CACHE_FORMAT, STRIDED> token_rows(
    const CacheParams& p, i64 outer, i64 inner, i64 slot) {
  TokenRows<T, Q_FORMAT, CACHE_FORMAT, STRIDED> r;
  r.hq = static_cast<int>(p.heads_q);
  r.n_rot = r.hq + static_cast<int>(p.heads_kv);
  r.slot = slot;
  r.write_kv = false;
#pragma unroll
  for (int s = 0; s < 3; ++s) {
    const View& v = p.slab[s].x;
    r.src[s] = static_cast<const T*>(p.x_data[s]) + outer * v.stride_outer +
               inner * v.stride_inner;
    r.src_head[s] = v.stride_head;
    r.src_dim[s] = STRIDED ? v.stride_dim : 1;
    r.scale[s] = p.scale_ptr[s] ? *p.scale_ptr[s] : p.scale[s];
  }
  const View& o = p.slab[0].out;
  r.q_dst = static_cast<Stored<T, Q_FORMAT>*>(p.out_data[0]) + outer * o.stride_outer +
            inner * o.stride_inner;
  r.q_head = o.stride_head;
  r.q_dim = STRIDED ? o.stride_dim : 1;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    r.kv_dst[c] = nullptr;
    r.kv_head[c] = p.cache[c].stride_head;
    r.kv_dim[c] = STRIDED ? p.cache[c].stride_dim : 1;
  }
  return r;
}

// A rotating item: PAIRS pairs of each of the thread's heads [h_first,
// h_end) in steps of `step`, UNROLL heads' loads per pass; q and k rotate,
// v is copied. `find_angles(c, s)` gives the token's angles; it is called
// once, after the first pass's loads are issued (as rope_kernel does), and
// the cache rows are placed after it.
template <typename T, int HALF, bool INTERLEAVED, int PAIRS, bool STRIDED, int UNROLL,
          typename Rows, typename FindAngles>
__device__ __forceinline__ void rotate_rows(const CacheParams& p, Rows& rows, int item,
                                            int h_first, int h_end, int step,
                                            FindAngles find_angles) {
  constexpr int PACKETS = INTERLEAVED ? 1 : 2;
  constexpr int WIDTH = INTERLEAVED ? 2 * PAIRS : PAIRS;
  const int f0 = item * PAIRS;
  const int ch[2] = {(INTERLEAVED ? 2 : 1) * f0, f0 + HALF};
  float c[PAIRS], sn[PAIRS];
  bool have_angles = false;
  for (int h0 = h_first; h0 < h_end; h0 += step * UNROLL) {
    Packet<T, WIDTH> raw[UNROLL][PACKETS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      if (h < h_end) {
        const int s = rows.slab_of(h);
#pragma unroll
        for (int q = 0; q < PACKETS; ++q) {
          i64 xd;
          const T* x = rows.source(h, s, ch[q], xd);
          raw[u][q] = load_raw<T, WIDTH, STRIDED>(x, xd);
        }
      }
    }
    if (!have_angles && h0 < rows.n_rot) {  // v needs none (and follows q and k)
      find_angles(f0, c, sn);
      have_angles = true;
    }
    if (h0 == h_first) rows.place(p);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      if (h >= h_end) continue;
      const int s = rows.slab_of(h);
      if (rows.skipped(s)) continue;
      if (s == 2) {
#pragma unroll
        for (int q = 0; q < PACKETS; ++q) rows.put_packet(h, s, ch[q], raw[u][q]);
        continue;
      }
      float a[WIDTH], b[WIDTH];
      to_floats(raw[u][0], a);
      if constexpr (INTERLEAVED) {
        rotate_interleaved(a, c, sn);
      } else {
        to_floats(raw[u][1], b);
        rotate_halves(a, b, c, sn);
        rows.put_floats(h, s, ch[1], b);
      }
      rows.put_floats(h, s, ch[0], a);
    }
  }
}

// A tail item: TAIL_VEC channels from `ch` of each of the thread's heads
// (the same walk), copied unrotated (q's only when COPY_Q_TAIL: in place
// they stay as they are).
template <typename T, int TAIL_VEC, bool STRIDED, int UNROLL, bool COPY_Q_TAIL, typename Rows>
__device__ __forceinline__ void copy_tails(const CacheParams& p, Rows& rows, i64 ch, int h_first,
                                           int h_end, int step) {
  int h_start = h_first;
  if (!COPY_Q_TAIL && h_first < rows.hq)  // the thread's first k or v head
    h_start += (rows.hq - h_first + step - 1) / step * step;
  for (int h0 = h_start; h0 < h_end; h0 += step * UNROLL) {
    Packet<T, TAIL_VEC> raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      if (h < h_end) {
        i64 xd;
        const T* x = rows.source(h, rows.slab_of(h), ch, xd);
        raw[u] = load_raw<T, TAIL_VEC, STRIDED>(x, xd);
      }
    }
    if (h0 == h_start) rows.place(p);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      if (h >= h_end) continue;
      const int s = rows.slab_of(h);
      if (!rows.skipped(s)) rows.put_packet(h, s, ch, raw[u]);
    }
  }
}

// NORM: the lanes of this thread's head row, which lie in one warp (blockDim.x
// == LANES, a power of two <= 32): the row's shuffles name only them, so
// that rows of one warp may walk different heads and tokens.
template <int LANES>
__device__ __forceinline__ unsigned row_mask() {
  if constexpr (LANES == 32) {
    return 0xffffffffu;
  } else {
    const int lane = block_thread_index() & 31;
    return ((1u << LANES) - 1u) << (lane & ~(LANES - 1));
  }
}

// Item i's results (floats) to head h's destination, channel run by run.
template <class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC, typename Rows>
__device__ __forceinline__ void put_item(const Rows& rows, int h, int s, int i,
                                         const float (&y)[L::W]) {
  if (i < L::ROT) {
    if constexpr (INTERLEAVED) {
      rows.put_floats(h, s, L::channel(i, 0), y);
    } else {
      float a[PAIRS], b[PAIRS];
#pragma unroll
      for (int e = 0; e < PAIRS; ++e) a[e] = y[e], b[e] = y[PAIRS + e];
      rows.put_floats(h, s, L::channel(i, 0), a);
      rows.put_floats(h, s, L::channel(i, PAIRS), b);
    }
  } else if (L::TAIL > 0 && i < L::ITEMS) {
    float t[TAIL_VEC];
#pragma unroll
    for (int e = 0; e < TAIL_VEC; ++e) t[e] = y[e];
    rows.put_floats(h, s, L::channel(i, 0), t);
  }
}

// Item i of head h copied as it was loaded (v), bit for bit where stored in T.
template <typename T, class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC, typename Rows>
__device__ __forceinline__ void put_item_raw(const Rows& rows, int h, int s, int i,
                                             const Packet<T, L::W>& raw) {
  if (i < L::ROT) {
    if constexpr (INTERLEAVED) {
      rows.put_packet(h, s, L::channel(i, 0), raw);
    } else {
      Packet<T, PAIRS> a, b;
      memcpy(a.v, raw.v, sizeof(a.v));
      memcpy(b.v, raw.v + PAIRS, sizeof(b.v));
      rows.put_packet(h, s, L::channel(i, 0), a);
      rows.put_packet(h, s, L::channel(i, PAIRS), b);
    }
  } else if (L::TAIL > 0 && i < L::ITEMS) {
    Packet<T, TAIL_VEC> t;
    memcpy(t.v, raw.v, sizeof(t.v));
    rows.put_packet(h, s, L::channel(i, 0), t);
  }
}

// NORM: one q or k head row (this lane's K items, raw): the row's sum of
// squares (each lane's items in order with fmaf, then the lanes'
// butterfly), then x_hat = x * rstd rounded and weighted as
// norm_rope_kernel's forward does, rotated and stored. Every lane of the row
// calls it (lanes past the items hold zeros), since the sum is a shuffle.
template <typename T, typename WT, class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC,
          int WEIGHT, bool ROUND_BEFORE, int LANES, int K, typename Rows>
__device__ __forceinline__ void norm_row(const Rows& rows, int h, int s,
                                         const Packet<T, L::W> (&raw)[K],
                                         const Packet<WT, L::W> (&w)[K], float eps,
                                         const float (&c)[K][PAIRS], const float (&sn)[K][PAIRS]) {
  constexpr int W = L::W;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float v[W];
    to_floats(raw[k], v);
#pragma unroll
    for (int e = 0; e < W; ++e) sum = fmaf(v[e], v[e], sum);
  }
  sum = lane_sum<LANES>(sum, row_mask<LANES>());
  constexpr float n_row = static_cast<float>(2 * L::HALF + L::TAIL * TAIL_VEC);  // head_dim
  const float rstd = 1.f / sqrtf(sum / n_row + eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * LANES;
    float v[W], wv[W], y[W];
    to_floats(raw[k], v);
    weight_values<WEIGHT>(w[k], false, wv);
#pragma unroll
    for (int e = 0; e < W; ++e) {
      float x_hat = v[e] * rstd;
      if constexpr (ROUND_BEFORE) x_hat = to_float(from_float<T>(x_hat));
      y[e] = to_float(from_float<T>(x_hat * wv[e]));
    }
    rotate_item<L, INTERLEAVED, PAIRS>(i, y, c[k], sn[k]);
    put_item<L, INTERLEAVED, PAIRS, TAIL_VEC>(rows, h, s, i, y);
  }
}

// NORM: every head row of the thread's heads [h_first, h_end) in steps of
// `step`, UNROLL rows' loads per pass: q and k normalized, rotated and
// stored, v copied (a padding token's k and v rows are read all the same:
// skipping them would wait for the slot). `find_angles(c, sn)` gives the
// angles of the lane's rotating items; the cache rows are placed after it.
template <typename T, typename WT, class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC,
          bool STRIDED, int UNROLL, int WEIGHT, bool ROUND_BEFORE, int LANES, int K,
          typename Rows, typename FindAngles>
__device__ __forceinline__ void norm_rows(const CacheParams& p, Rows& rows, int h_first,
                                          int h_end, int step, FindAngles find_angles) {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: 2^k <= 32");
  static_assert(LANES * K >= L::ITEMS, "the lanes hold every item");
  static_assert(TAIL_VEC <= L::W, "a tail item fits an item's packet");
  constexpr int W = L::W;
  // w' of q's and k's items of this lane: the same channels in every row.
  Packet<WT, W> wr[2][K];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = WEIGHT != WEIGHT_NONE ? static_cast<int>(threadIdx.x) + k * LANES : L::ITEMS;
      wr[j][k] = load_item<WT, L, INTERLEAVED, PAIRS, TAIL_VEC, true>(
          static_cast<const WT*>(p.weight[j]), 1, i);
    }
  }
  float c[K][PAIRS], sn[K][PAIRS];
  bool have_angles = false;
  for (int h0 = h_first; h0 < h_end; h0 += step * UNROLL) {
    Packet<T, W> raw[UNROLL][K];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      const int s = h < h_end ? rows.slab_of(h) : 2;
      const bool read = h < h_end;
      i64 xd = 1;
      const T* x = read ? rows.source(h, s, 0, xd) : nullptr;
#pragma unroll
      for (int k = 0; k < K; ++k)
        raw[u][k] = load_item<T, L, INTERLEAVED, PAIRS, TAIL_VEC, STRIDED>(
            x, xd, read ? static_cast<int>(threadIdx.x) + k * LANES : L::ITEMS);
    }
    if (!have_angles && h0 < rows.n_rot) {  // v needs none (and follows q and k)
      find_angles(c, sn);
      have_angles = true;
    }
    if (h0 == h_first) rows.place(p);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * step;
      if (h >= h_end) continue;
      const int s = rows.slab_of(h);
      if (rows.skipped(s)) continue;
      if (s == 2) {
#pragma unroll
        for (int k = 0; k < K; ++k)
          put_item_raw<T, L, INTERLEAVED, PAIRS, TAIL_VEC>(
              rows, h, s, static_cast<int>(threadIdx.x) + k * LANES, raw[u][k]);
        continue;
      }
      // The slab's weights, selected element by element: indexing wr with
      // the run-time slab would move both weight arrays to local memory.
      Packet<WT, W> w[K];
#pragma unroll
      for (int k = 0; k < K; ++k) w[k] = s == 0 ? wr[0][k] : wr[1][k];
      norm_row<T, WT, L, INTERLEAVED, PAIRS, TAIL_VEC, WEIGHT, ROUND_BEFORE, LANES, K>(
          rows, h, s, raw[u], w, p.eps, c, sn);
    }
  }
}

template <typename T, typename AngleT, int HEAD_DIM, int ROTARY_DIM, bool INTERLEAVED,
          int SOURCE, int PAIRS, int TAIL_VEC, bool STRIDED, bool TABLE_STRIDED, int UNROLL,
          int POS_MODE, int Q_FORMAT, int CACHE_FORMAT, bool COPY_Q_TAIL, bool NORM, typename WT,
          int WEIGHT, bool ROUND_BEFORE, int LANES, int K>
__global__ void __launch_bounds__(CACHE_THREADS) rope_cache_kernel(const CacheParams p) {
  static_assert(HEAD_DIM % 2 == 0 && ROTARY_DIM % 2 == 0 && ROTARY_DIM <= HEAD_DIM, "dims");
  constexpr int HALF = ROTARY_DIM / 2;
  static_assert(HALF % PAIRS == 0, "PAIRS divides rotary_dim / 2");
  constexpr int ROT_ITEMS = HALF / PAIRS;
  constexpr int TAIL = HEAD_DIM - ROTARY_DIM;
  static_assert(TAIL % TAIL_VEC == 0, "TAIL_VEC divides the tail");

  const int token_lane = threadIdx.z;
  const i64 first = static_cast<i64>(blockIdx.x) * blockDim.z;
  const i64 n_tokens = p.n_outer * p.n_inner;
  const i64 token = first + token_lane;
  const bool live = token < n_tokens;
  const i64 tk = live ? token : first;
  const i64 outer = p.n_outer == 1 ? 0 : tk / p.n_inner;
  const i64 inner = tk - outer * p.n_inner;

  // VARLEN: the block's sequences, found by its first warp (kernels/positions.cuh).
  constexpr int BLOCK_TOKENS = 64;  // token lanes of a block (blockDim.z, CUDA's limit)
  __shared__ int seq_of_lane[BLOCK_TOKENS];
  __shared__ SequenceSignal seq_ready;
  if constexpr (POS_MODE == VARLEN) {
    signal_init(seq_ready);
    find_block_sequences(p, first, min(first + static_cast<i64>(blockDim.z), n_tokens) - 1,
                         blockDim.z, seq_of_lane);
    signal_fire(seq_ready);
  }
  if (!live) return;

  // The position is asked for first: its table rows are the longest wait.
  // With cu_seqlens, once the block's sequences are known (find_position).
  i64 pos = 0;
  bool valid = true;
  if constexpr (POS_MODE != VARLEN)
    valid = token_position<POS_MODE>(p, token, outer, inner, 0, pos);
  auto find_position = [&] {
    if constexpr (POS_MODE == VARLEN) {
      signal_wait(seq_ready);
      valid = token_position<POS_MODE>(p, token, outer, inner, seq_of_lane[token_lane], pos);
    }
  };
  // Head loads do not wait for the slot (place): a padding token's k and v
  // are read and dropped at the store.
  const i64 slot = load_index(p.slot_mapping,
                              outer * p.slot_stride_outer + inner * p.slot_stride_inner,
                              p.slot_is_64);
  auto rows = token_rows<T, Q_FORMAT, CACHE_FORMAT, STRIDED>(p, outer, inner, slot);
  // The thread's heads: its lane of its block's head group, then every
  // head lane of every group further.
  const int h_end = rows.n_rot + static_cast<int>(p.heads_kv);
  const int h_first = blockIdx.y * blockDim.y + threadIdx.y;
  const int step = gridDim.y * blockDim.y;
  if constexpr (NORM) {
    using L = ItemLayout<HEAD_DIM, ROTARY_DIM, INTERLEAVED, PAIRS, TAIL_VEC>;
    auto find_angles = [&](float (&c)[K][PAIRS], float (&sn)[K][PAIRS]) {
      find_position();
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * LANES;
        if (i < L::ROT) angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED>(p, pos, valid, i * PAIRS,
                                                                    c[k], sn[k]);
      }
    };
    norm_rows<T, WT, L, INTERLEAVED, PAIRS, TAIL_VEC, STRIDED, UNROLL, WEIGHT, ROUND_BEFORE,
              LANES, K>(p, rows, h_first, h_end, step, find_angles);
    return;
  }
  const int item = threadIdx.x;
  if (item < ROT_ITEMS) {
    auto find_angles = [&](int f0, float (&c)[PAIRS], float (&sn)[PAIRS]) {
      find_position();
      angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED>(p, pos, valid, f0, c, sn);
    };
    rotate_rows<T, HALF, INTERLEAVED, PAIRS, STRIDED, UNROLL>(p, rows, item, h_first, h_end,
                                                              step, find_angles);
  } else if constexpr (TAIL > 0) {
    copy_tails<T, TAIL_VEC, STRIDED, UNROLL, COPY_Q_TAIL>(
        p, rows, ROTARY_DIM + static_cast<i64>(item - ROT_ITEMS) * TAIL_VEC, h_first, h_end,
        step);
  }
}

// Decode form (cupy_rope/kv_cache.py flat_decode_shape picks it): one
// 16-byte packet of one head row a thread, rows token-major, a token's heads
// q, k, v in turn; the NeoX partner packet from the lane that loaded it, as
// flat_kernel does (kernels/flat.cu). Its 32-bit index math gets the loads
// out after a few instructions; rope_cache_kernel's general prologue is
// most of a decode step. The rotation, the angles and the stores are
// rope_cache_kernel's, so both give the same bits.
constexpr int CACHE_FLAT_THREADS = 128;  // kv_cache.py FLAT_DECODE_THREADS (a test ties them)

template <typename T, int HEAD_DIM, bool INTERLEAVED, int CACHE_FORMAT>
__global__ void __launch_bounds__(CACHE_FLAT_THREADS) rope_cache_flat_kernel(const CacheParams p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int PACKETS = HEAD_DIM / VEC;  // a head row
  constexpr int HALF = PACKETS / 2;
  constexpr int FREQS = INTERLEAVED ? VEC / 2 : VEC;
  static_assert(HEAD_DIM % VEC == 0 && 32 % PACKETS == 0 && (INTERLEAVED || PACKETS % 2 == 0),
                "whole head rows of whole packets in a warp (NeoX: an even count)");
  const int hq = static_cast<int>(p.heads_q), hk = static_cast<int>(p.heads_kv);
  const unsigned heads = hq + 2 * hk;
  const unsigned rows = static_cast<unsigned>(p.n_inner) * heads;  // the host keeps it < 2^31
  const unsigned u = blockIdx.x * CACHE_FLAT_THREADS + threadIdx.x;
  if ((u & ~31u) / PACKETS >= rows) return;  // a spare warp (warp-uniform)
  const bool live = u / PACKETS < rows;
  const unsigned row = live ? u / PACKETS : 0;
  const int pk = static_cast<int>(u % PACKETS);
  const unsigned token = row / heads;
  const int h = static_cast<int>(row - token * heads);

  // The position and the slot first: the table row waits for one.
  i64 pos = 0;
  const bool valid = token_position<EXPLICIT>(p, token, 0, token, 0, pos);
  const i64 slot = load_index(p.slot_mapping, token * p.slot_stride_inner, p.slot_is_64);
  const int s = head_slab(h, hq, hq + hk);
  const int j = head_in_slab(h, s, hq, hq + hk);
  const i64 within = static_cast<i64>(j) * HEAD_DIM + pk * VEC;
  const T* x = static_cast<const T*>(pick3(s, p.x_data[0], p.x_data[1], p.x_data[2])) +
               token * pick3(s, p.slab[0].x.stride_inner, p.slab[1].x.stride_inner,
                             p.slab[2].x.stride_inner) + within;
  Packet<T, VEC> raw{};
  if (live) raw = load_raw<T, VEC>(x, 1);

  const bool first_half = INTERLEAVED || pk < HALF;
  const int f0 = INTERLEAVED ? pk * FREQS : (first_half ? pk : pk - HALF) * VEC;
  float c[FREQS], sn[FREQS], y[VEC];
  angles<TABLE, float, FREQS, false>(p, pos, valid, f0, c, sn);
  to_floats(raw, y);
  if constexpr (INTERLEAVED) {
    rotate_interleaved(y, c, sn);
  } else {  // the partner packet: HALF lanes away, in the same row
    const int lane = static_cast<int>(threadIdx.x & 31u);
    unsigned w[4], pw[4];
    memcpy(w, &raw, 16);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      pw[i] = __shfl_sync(0xffffffffu, w[i], lane + (first_half ? HALF : -HALF));
    Packet<T, VEC> partner;
    memcpy(&partner, pw, 16);
    float b[VEC];
    to_floats(partner, b);
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      y[i] = first_half ? rotated_first(y[i], b[i], c[i], sn[i])
                        : rotated_second(b[i], y[i], c[i], sn[i]);
  }
  if (!live) return;
  if (s == 0) {
    store<T, VEC>(static_cast<T*>(p.out_data[0]) + token * p.slab[0].out.stride_inner + within, 1,
                  y);
    return;
  }
  if (slot < 0 || slot >= p.n_slots) return;  // padding: nothing of it is cached
  const i64 blk = slot_block(p, slot);
  const i64 off = slot - blk * p.block_size;
  const int which = s - 1;  // 0: k_cache, 1: v_cache
  const CacheView& cv = which ? p.cache[1] : p.cache[0];
  auto* dst = static_cast<Stored<T, CACHE_FORMAT>*>(which ? p.cache_data[1] : p.cache_data[0]) +
              blk * cv.stride_block + off * cv.stride_offset + j * cv.stride_head + pk * VEC;
  float scale = 1.0f, recip = 1.0f;
  if constexpr (CACHE_FORMAT != SAME) {
    const float* sp = which ? p.scale_ptr[2] : p.scale_ptr[1];
    scale = sp ? *sp : (which ? p.scale[2] : p.scale[1]);
    recip = fp8_recip(scale);
  }
  if (s == 1)
    put<T, CACHE_FORMAT, VEC, false>(dst, 1, y, scale, recip);
  else
    put_raw<T, CACHE_FORMAT, VEC, false>(dst, 1, raw, scale, recip);
}

}  // namespace rope
