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
// not push the reused rows out before their next reader (bshd [4, 4096, 32,
// 128] bf16 with fp32 tables on the H100: 0.954 -> 0.977 of copy;
// docs/perf-notes.md). Other packets load as load_raw does.
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

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Packet<T, N>& pk, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
}

template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ void store_raw(T* p, i64 stride, const Packet<T, N>& pk) {
  if constexpr (STRIDED) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i * stride] = pk.v[i];
  } else {
    *reinterpret_cast<Packet<T, N>*>(p) = pk;
  }
}

template <typename T, int N, bool STRIDED = false>
__device__ __forceinline__ void store(T* p, i64 stride, const float (&in)[N]) {
  Packet<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
  store_raw<T, N, STRIDED>(p, stride, pk);
}

}  // namespace rope
