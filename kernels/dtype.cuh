// Storage types, conversions to and from float, and aligned vector access.
//
// The kernels never include CUDA's own headers (cuda_fp16.h, cuda_bf16.h):
// half and bfloat16 are plain 16-bit storage here, converted with single PTX
// instructions. NVRTC then needs no toolkit headers at all, which keeps the
// runtime dependency down to libnvrtc.
#pragma once

namespace rope {

typedef long long i64;

// 16-bit storage types. Arithmetic is always done in float.
struct alignas(2) bf16 { unsigned short bits; };
struct alignas(2) f16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(bf16 v) {
  // bfloat16 is the upper half of an IEEE float.
  return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}

__device__ __forceinline__ float to_float(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

template <typename T> __device__ __forceinline__ T from_float(float v);

template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

template <> __device__ __forceinline__ bf16 from_float<bf16>(float v) {
  bf16 r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#else
  // Round to nearest even by hand; NaN stays a quiet NaN.
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = static_cast<unsigned short>(u >> 16);
  }
#endif
  return r;
}

template <> __device__ __forceinline__ f16 from_float<f16>(float v) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}

// N values of T that the hardware moves as one access. Loads and stores of
// up to 16 bytes become a single LDG/STG when the address is aligned to the
// packet size; the launcher only picks widths whose alignment it has checked.
template <typename T, int N> struct alignas(sizeof(T) * N <= 16 ? sizeof(T) * N : 16) Packet {
  T v[N];
};

// Load N consecutive elements (STRIDED: elements `stride` apart) as raw
// storage, without converting; kernels issue all their loads first and
// convert afterwards, so that many loads are in flight at once.
template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ Packet<T, N> load_raw(const T* p, i64 stride) {
  if constexpr (STRIDED) {
    Packet<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = p[i * stride];
    return pk;
  } else {
    return *reinterpret_cast<const Packet<T, N>*>(p);
  }
}

// Load for data that other threads and blocks read again (cos/sin and
// inv_freq rows): contiguous packets go as 4/8/16-byte loads with an L2
// evict-last policy, so that the streamed q/k data passing through L2 does
// not push the reused rows out before their next reader. Other packets load
// as load_raw does.
template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ Packet<T, N> load_reused(const T* p, i64 stride) {
#if __CUDA_ARCH__ >= 800
  constexpr int BYTES = static_cast<int>(sizeof(Packet<T, N>));
  constexpr int CHUNK = BYTES >= 16 ? 16 : BYTES;  // packets are CHUNK-aligned
  if constexpr (!STRIDED && CHUNK >= 4) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    unsigned w[BYTES / 4];
    const char* b = reinterpret_cast<const char*>(p);
#pragma unroll
    for (int i = 0; i < BYTES / CHUNK; ++i) {
      unsigned* c = w + i * (CHUNK / 4);
      if constexpr (CHUNK == 16)
        asm("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
            : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3]) : "l"(b + i * CHUNK), "l"(policy));
      else if constexpr (CHUNK == 8)
        asm("ld.global.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
            : "=r"(c[0]), "=r"(c[1]) : "l"(b + i * CHUNK), "l"(policy));
      else
        asm("ld.global.L2::cache_hint.u32 %0, [%1], %2;"
            : "=r"(c[0]) : "l"(b + i * CHUNK), "l"(policy));
    }
    Packet<T, N> pk;
    memcpy(&pk, w, BYTES);
    return pk;
  }
#endif
  return load_raw<T, N, STRIDED>(p, stride);
}

// A contiguous 16-byte packet through the read-only (non-coherent) path:
// only for memory that no thread of the launch writes (out of place).
template <typename T, int N>
__device__ __forceinline__ Packet<T, N> load_read_only(const T* p) {
  static_assert(sizeof(Packet<T, N>) == 16, "16-byte packets");
  unsigned w[4];
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  Packet<T, N> pk;
  memcpy(&pk, w, 16);
  return pk;
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Packet<T, N>& pk, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
}

// bfloat16 pairs straight from 32-bit words: the first element is the word
// shifted up, the second the word with its low half cleared. (Element by
// element, the compiler extracts every 16-bit value into a register of its
// own first, and bf16 kernels then took more registers than fp16 ones and
// ran slower.)
template <int N>
__device__ __forceinline__ void to_floats(const Packet<bf16, N>& pk, float (&out)[N]) {
  if constexpr (N % 2 == 0) {
    unsigned w[N / 2];
    memcpy(w, &pk, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
  }
}

// Store BYTES (4, 8 or a multiple of 16) from 32-bit words as 16-, 8- or
// 4-byte vector stores. Written in PTX: a struct copy of 16-bit elements
// assembled from separate registers can be split by the compiler into
// 2-byte stores, and was (bf16 packets: 5x the L2 write sectors).
template <int BYTES>
__device__ __forceinline__ void store_words(void* p, const unsigned (&w)[BYTES / 4]) {
  char* b = static_cast<char*>(p);
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i)
      asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(b + 16 * i), "r"(w[4 * i]),
                   "r"(w[4 * i + 1]), "r"(w[4 * i + 2]), "r"(w[4 * i + 3]) : "memory");
  } else if constexpr (BYTES == 8) {
    asm volatile("st.global.v2.u32 [%0], {%1,%2};" ::"l"(b), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    static_assert(BYTES == 4, "4, 8 or 16k bytes");
    asm volatile("st.global.u32 [%0], %1;" ::"l"(b), "r"(w[0]) : "memory");
  }
}

template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ void store_raw(T* p, i64 stride, const Packet<T, N>& pk) {
  constexpr int BYTES = static_cast<int>(sizeof(Packet<T, N>));
  if constexpr (STRIDED) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i * stride] = pk.v[i];
  } else if constexpr (BYTES % 16 == 0 || BYTES == 8 || BYTES == 4) {
    unsigned w[BYTES / 4];
    memcpy(w, &pk, BYTES);
    store_words<BYTES>(p, w);
  } else {
    *reinterpret_cast<Packet<T, N>*>(p) = pk;
  }
}

// Two floats as one 32-bit word of two 16-bit values (lo first in memory):
// one cvt.rn.{bf16,f16}x2.f32 on sm_80+, else two conversions.
__device__ __forceinline__ unsigned cvt_x2(bf16*, float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned cvt_x2(f16*, float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  return cvt_x2(static_cast<T*>(nullptr), lo, hi);
#else
  return static_cast<unsigned>(from_float<T>(lo).bits) |
         (static_cast<unsigned>(from_float<T>(hi).bits) << 16);
#endif
}

template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ void store(T* p, i64 stride, const float (&in)[N]) {
  constexpr int BYTES = static_cast<int>(sizeof(T)) * N;
  if constexpr (!STRIDED && (BYTES % 16 == 0 || BYTES == 8 || BYTES == 4)) {
    unsigned w[BYTES / 4];
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int i = 0; i < N; ++i) w[i] = __float_as_uint(in[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) w[i] = pack2<T>(in[2 * i], in[2 * i + 1]);
    }
    store_words<BYTES>(p, w);
  } else {
    Packet<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
    store_raw<T, N, STRIDED>(p, stride, pk);
  }
}

}  // namespace rope
