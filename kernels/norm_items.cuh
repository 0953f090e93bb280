// The items of one head row that a group of LANES lanes holds, shared by the
// kernels that normalize whole heads: norm_rope_kernel (kernels/norm_rope.cu)
// and the norm variant of rope_cache_kernel (kernels/rope_cache.cu). Both
// read, reduce and rotate a head the same way, so that their results agree
// bit for bit.
#pragma once
#include "angles.cuh"

namespace rope {

enum WeightMode : int { WEIGHT_NONE = 0, WEIGHT_W = 1, WEIGHT_ONE_PLUS = 2 };

// The norm's part of one slab (q or k): NormParams (kernels/norm_rope.cu)
// and NormFlatParams (kernels/norm_flat.cu) end with one per slab.
struct NormSlab {
  const void* weight;     // [weight_len] (WEIGHT != WEIGHT_NONE)
  float* weight_partial;  // backward with weight gradients: [blocks, weight_len]
  const void* input_data;  // backward: the forward input x
  View input;              // its strides, as Params' views
  i64 blocks;             // blocks of this slab
  i64 units;              // token blocks x head groups (flat kernels: head rows)
  i64 weight_len;         // HEAD_DIM (SCOPE_HEAD) or heads * HEAD_DIM
};

// The channels of one head's items: ROT rotating items, then TAIL tail
// items; an item is W floats (a tail item uses its first TAIL_VEC).
template <int HEAD_DIM, int ROTARY_DIM, bool INTERLEAVED, int PAIRS, int TAIL_VEC>
struct ItemLayout {
  static constexpr int HALF = ROTARY_DIM / 2;
  static constexpr int ROT = HALF / PAIRS;
  static constexpr int TAIL = (HEAD_DIM - ROTARY_DIM) / TAIL_VEC;
  static constexpr int ITEMS = ROT + TAIL;
  static constexpr int W = 2 * PAIRS;
  // Channel of element e of item i, or -1 where the item has none.
  __device__ static __forceinline__ int channel(int i, int e) {
    if (i < ROT) {
      if (INTERLEAVED) return 2 * PAIRS * i + e;
      return e < PAIRS ? PAIRS * i + e : HALF + PAIRS * i + (e - PAIRS);
    }
    if (i < ITEMS && e < TAIL_VEC) return ROTARY_DIM + (i - ROT) * TAIL_VEC + e;
    return -1;
  }
};

// Item i of a head as raw storage (W values; zero past the item's
// channels). Kept raw until used, so that 16-bit data takes half the
// registers; converted with to_floats at each use.
template <typename T, class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC, bool STRIDED>
__device__ __forceinline__ Packet<T, L::W> load_item(const T* h, i64 xd, int i) {
  Packet<T, L::W> r;
  memset(&r, 0, sizeof(r));
  if (i < L::ROT) {
    if constexpr (INTERLEAVED) {
      r = load_raw<T, L::W, STRIDED>(h + static_cast<i64>(L::W * i) * xd, xd);
    } else {
      const Packet<T, PAIRS> a = load_raw<T, PAIRS, STRIDED>(h + static_cast<i64>(PAIRS * i) * xd, xd);
      const Packet<T, PAIRS> b =
          load_raw<T, PAIRS, STRIDED>(h + static_cast<i64>(L::HALF + PAIRS * i) * xd, xd);
      memcpy(r.v, a.v, sizeof(a.v));
      memcpy(r.v + PAIRS, b.v, sizeof(b.v));
    }
  } else if (L::TAIL > 0 && i < L::ITEMS) {
    const Packet<T, TAIL_VEC> t = load_raw<T, TAIL_VEC, STRIDED>(h + L::channel(i, 0) * xd, xd);
    memcpy(r.v, t.v, sizeof(t.v));
  }
  return r;
}

// Ask L2 for item i of a head (the packets load_item reads), without
// waiting and without registers: the next unit's rows arrive while this
// unit is reduced and stored.
template <typename T, class L, bool INTERLEAVED, int PAIRS>
__device__ __forceinline__ void prefetch_item(const T* h, i64 xd, int i) {
  if (i >= L::ITEMS) return;
  asm volatile("prefetch.global.L2 [%0];" ::"l"(h + L::channel(i, 0) * xd));
  if (!INTERLEAVED && i < L::ROT)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(h + L::channel(i, PAIRS) * xd));
}

template <typename T, class L, bool INTERLEAVED, int PAIRS, int TAIL_VEC, bool STRIDED>
__device__ __forceinline__ void store_item(T* h, i64 od, int i, const float (&v)[L::W]) {
  if (i < L::ROT) {
    if constexpr (INTERLEAVED) {
      store<T, L::W, STRIDED>(h + static_cast<i64>(L::W * i) * od, od, v);
    } else {
      float a[PAIRS], b[PAIRS];
#pragma unroll
      for (int e = 0; e < PAIRS; ++e) a[e] = v[e], b[e] = v[PAIRS + e];
      store<T, PAIRS, STRIDED>(h + static_cast<i64>(PAIRS * i) * od, od, a);
      store<T, PAIRS, STRIDED>(h + static_cast<i64>(L::HALF + PAIRS * i) * od, od, b);
    }
  } else if (L::TAIL > 0 && i < L::ITEMS) {
    float t[TAIL_VEC];
#pragma unroll
    for (int e = 0; e < TAIL_VEC; ++e) t[e] = v[e];
    store<T, TAIL_VEC, STRIDED>(h + L::channel(i, 0) * od, od, t);
  }
}

// Makes the compiler forget what it knows of a packet's value, so that
// values converted from it before a row reduction are converted again after
// it instead of being kept in registers across it (twice the registers for
// 16-bit data, and spills).
template <typename T, int N>
__device__ __forceinline__ void forget(Packet<T, N>& p) {
  static_assert(sizeof(p) % 4 == 0, "whole words");
  unsigned w[sizeof(p) / 4];
  memcpy(w, &p, sizeof(p));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(p) / 4); ++i) asm volatile("" : "+r"(w[i]));
  memcpy(&p, w, sizeof(p));
}

// w' of a weight item loaded raw (1 without a weight, and for a copied slab).
template <int WEIGHT, typename WT, int N>
__device__ __forceinline__ void weight_values(const Packet<WT, N>& raw, bool copy_only,
                                              float (&wv)[N]) {
  if (WEIGHT == WEIGHT_NONE || copy_only) {
#pragma unroll
    for (int e = 0; e < N; ++e) wv[e] = 1.f;
    return;
  }
  to_floats(raw, wv);
#pragma unroll
  for (int e = 0; e < N; ++e) wv[e] += WEIGHT == WEIGHT_ONE_PLUS ? 1.f : 0.f;
}

// Rotate item i's pairs (a rotating item only) by the angles (c, s).
template <class L, bool INTERLEAVED, int PAIRS>
__device__ __forceinline__ void rotate_item(int i, float (&v)[L::W], const float (&c)[PAIRS],
                                            const float (&s)[PAIRS]) {
  if (i >= L::ROT) return;
  if constexpr (INTERLEAVED) {
    rotate_interleaved(v, c, s);
  } else {
    float a[PAIRS], b[PAIRS];
#pragma unroll
    for (int e = 0; e < PAIRS; ++e) a[e] = v[e], b[e] = v[PAIRS + e];
    rotate_halves(a, b, c, s);
#pragma unroll
    for (int e = 0; e < PAIRS; ++e) v[e] = a[e], v[PAIRS + e] = b[e];
  }
}

// Sum over the LANES lanes of a head (a butterfly: every lane gets the same bits).
template <int LANES>
__device__ __forceinline__ float lane_sum(float v, unsigned mask) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

// The active lanes of this thread's warp (the last warp of a block may be partial).
__device__ __forceinline__ unsigned warp_mask() {
  const int n = blockDim.x * blockDim.y * blockDim.z;
  const int left = n - (block_thread_index() & ~31);
  return left >= 32 ? 0xffffffffu : (1u << left) - 1u;
}

}  // namespace rope
