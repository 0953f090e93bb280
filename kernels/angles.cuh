// Where the rotation angles come from.
//
// For frequency index f (0 <= f < rotary_dim / 2) and position p the angle
// is theta = p * inv_freq[f]; a thread needs cos(theta) and sin(theta) for
// PAIRS consecutive frequencies and reuses them for every head it rotates.
#pragma once
#include "positions.cuh"

namespace rope {

enum AngleSource : int {
  TABLE = 0,        // cos/sin looked up in [max_position, rotary_dim/2] tables
  INV_FREQ = 1,     // theta = p * inv_freq[f] reduced (fp32; fp64 past 2^24), then sincosf
  FREQS = 2,        // theta looked up in a freqs table [max_position, rotary_dim/2], then sincosf
};

// The rotation of a channel pair (a, b) by an angle with cosine c and sine
// s: a' = a c - b s, b' = b c + a s. Spelled with explicit fmaf so that
// every kernel and thread mapping rounds alike (in place and out of place
// give the same bits).
__device__ __forceinline__ float rotated_first(float a, float b, float c, float s) {
  return fmaf(a, c, -(b * s));
}
__device__ __forceinline__ float rotated_second(float a, float b, float c, float s) {
  return fmaf(b, c, a * s);
}

// GPT-J: PAIRS adjacent pairs (v[2i], v[2i + 1]) rotated in place.
template <int PAIRS>
__device__ __forceinline__ void rotate_interleaved(float (&v)[2 * PAIRS], const float (&c)[PAIRS],
                                                   const float (&s)[PAIRS]) {
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = rotated_first(a, b, c[i], s[i]);
    v[2 * i + 1] = rotated_second(a, b, c[i], s[i]);
  }
}

// NeoX: PAIRS pairs (a[i], b[i]) from the two halves, rotated in place.
template <int PAIRS>
__device__ __forceinline__ void rotate_halves(float (&a)[PAIRS], float (&b)[PAIRS],
                                              const float (&c)[PAIRS], const float (&s)[PAIRS]) {
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float ai = a[i], bi = b[i];
    a[i] = rotated_first(ai, bi, c[i], s[i]);
    b[i] = rotated_second(ai, bi, c[i], s[i]);
  }
}

// theta = pos * inv_freq reduced to about [-pi, pi] without losing the
// bits a plain fp32 product drops at large positions.
//
// pos is exact in fp32 below 2^24. The product is split exactly into
// hi + lo (hi = fl(pos * f), lo = fma(pos, f, -hi)). With k = rint(hi / 2pi)
// and 2pi = C1 + C2 + C3 (C1 = fl(2pi)), hi - k * C1 is exact in one fma
// (its value is a multiple of ulp(C1) = 2^-21 below 8 in magnitude), so the
// only errors left are a few roundings of numbers below 8: the angle is
// within ~1e-6 rad of the exact pos * f for every pos < 2^24 (the
// float64 error bound is documented and tested), where a plain
// sincosf(pos * f) is off by up to pos * f * 2^-24 (0.06 rad at 2^20).
__device__ __forceinline__ float reduced_angle(float pos, float f) {
  constexpr float C1 = 6.28318548202514648438f;      // fl(2 pi)
  constexpr float C2 = -1.74845553146951715e-07f;     // fl(2 pi - C1)
  constexpr float C3 = -6.86049804002352753e-15f;     // fl(2 pi - C1 - C2)
  constexpr float INV_2PI = 0.15915494309189533577f;
  const float hi = pos * f;
  const float lo = fmaf(pos, f, -hi);
  const float k = rintf(hi * INV_2PI);
  float r = fmaf(-k, C1, hi);
  r = fmaf(-k, C2, r);
  r = fmaf(-k, C3, r);
  return r + lo;
}

// |pos| < 2^24: the position is exact in fp32 and reduced_angle applies.
__device__ __forceinline__ bool fp32_exact(i64 pos) {
  return pos > -(i64{1} << 24) && pos < (i64{1} << 24);
}

// The reduction for positions beyond that (a context of 16M tokens and
// more, or a packed thd call that long): in fp64 from the int64 position,
// exact for |pos| < 2^53; positions from 2^53 on (not exact in fp64) give
// NaN, as positions outside a table do (the host refuses those it sees,
// validate.MAX_COMPUTED_POSITION). hi + lo = pos * f exactly (f has 24
// bits); hi - k * D1 rounds once, below 8 in magnitude; 2pi - D1 - D2 is
// below 1e-32, so k * that stays below 1e-16 for |k| < 2^53: the result is
// within a few fp64 ulps of the reduced angle before its rounding to fp32.
// Out of line and behind a branch the common path skips, so that the fp32
// path keeps its registers and schedule.
__device__ __noinline__ float reduced_angle_wide(i64 pos, float f) {
  constexpr double D1 = 6.283185307179586232;      // fl64(2 pi)
  constexpr double D2 = 2.4492935982947064e-16;    // fl64(2 pi - D1)
  constexpr double INV_2PI = 0.15915494309189535;  // fl64(1 / (2 pi))
  if (pos >= (i64{1} << 53) || pos <= -(i64{1} << 53)) return __int_as_float(0x7fffffff);
  const double p = static_cast<double>(pos);
  const double hi = p * static_cast<double>(f);
  const double lo = fma(p, static_cast<double>(f), -hi);
  const double k = rint(hi * INV_2PI);
  double r = fma(-k, D1, hi);
  r = fma(-k, D2, r);
  return static_cast<float>(r + lo);
}

// theta = pos * f reduced, for any int64 position.
__device__ __forceinline__ float position_angle(i64 pos, float f) {
  return fp32_exact(pos) ? reduced_angle(static_cast<float>(pos), f) : reduced_angle_wide(pos, f);
}

template <typename AngleT, int PAIRS, bool TABLE_STRIDED>
__device__ __forceinline__ void load_row(const void* base, i64 offset, i64 col_stride,
                                         float (&v)[PAIRS]) {
  const AngleT* p = static_cast<const AngleT*>(base) + offset;
  to_floats(load_reused<AngleT, PAIRS, TABLE_STRIDED>(p, col_stride), v);
}

// cos and sin of the angles of frequencies [f0, f0 + PAIRS) at position pos.
// A position outside the table, or a token without one (valid == false),
// yields NaN instead of an out-of-bounds read.
template <int SOURCE, typename AngleT, int PAIRS, bool TABLE_STRIDED>
__device__ __forceinline__ void angles(const Params& p, i64 pos, bool valid, int f0,
                                       float (&c)[PAIRS], float (&s)[PAIRS]) {
  const i64 cos_col = static_cast<i64>(f0) * p.cos_stride_col;
  const bool inside = valid && (SOURCE == INV_FREQ || (pos >= 0 && pos < p.max_position));
  if (!inside) {
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) c[i] = s[i] = __int_as_float(0x7fffffff);
    return;
  }
  if constexpr (SOURCE == INV_FREQ) {
    float inv_freq[PAIRS];
    load_row<AngleT, PAIRS, TABLE_STRIDED>(p.cos, cos_col, p.cos_stride_col, inv_freq);
    // The fp32 reduction for every position, redone in fp64 in the rare
    // thread whose position is not exact in fp32: written as a patch-up
    // after the common path, rope_kernel keeps its speed (a branch between
    // the two paths cost varlen calls).
    float r[PAIRS];
    const float fpos = static_cast<float>(pos);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) r[i] = reduced_angle(fpos, inv_freq[i]);
    if (__builtin_expect(!fp32_exact(pos), 0)) {
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) r[i] = reduced_angle_wide(pos, inv_freq[i]);
    }
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) sincosf(r[i], &s[i], &c[i]);
  } else {
    if constexpr (SOURCE == TABLE) {
      load_row<AngleT, PAIRS, TABLE_STRIDED>(p.cos, pos * p.cos_stride_row + cos_col,
                                             p.cos_stride_col, c);
      load_row<AngleT, PAIRS, TABLE_STRIDED>(
          p.sin, pos * p.sin_stride_row + static_cast<i64>(f0) * p.sin_stride_col,
          p.sin_stride_col, s);
    } else {
      float theta[PAIRS];
      load_row<AngleT, PAIRS, TABLE_STRIDED>(p.cos, pos * p.cos_stride_row + cos_col,
                                             p.cos_stride_col, theta);
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) sincosf(theta[i], &s[i], &c[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) s[i] *= p.sin_sign;
}

// AXES: cos and sin of frequencies [f0, f0 + PAIRS), each at the position
// of its own axis (pos[axis_of(f)]); tables are read element by element.
// A position outside the table yields NaN for that pair.
template <int SOURCE, typename AngleT, int PAIRS>
__device__ __forceinline__ void axis_angles(const Params& p, const i64 (&pos)[3], int f0,
                                            float (&c)[PAIRS], float (&s)[PAIRS]) {
  const AngleT* cos_t = static_cast<const AngleT*>(p.cos);
  const AngleT* sin_t = static_cast<const AngleT*>(p.sin);
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const i64 f = f0 + i;
    const int a = axis_of(p, f);
    const i64 q = a == 0 ? pos[0] : a == 1 ? pos[1] : pos[2];
    if constexpr (SOURCE == INV_FREQ) {
      const float r = position_angle(q, to_float(cos_t[f * p.cos_stride_col]));
      sincosf(r, &s[i], &c[i]);
    } else if (q < 0 || q >= p.max_position) {
      c[i] = s[i] = __int_as_float(0x7fffffff);
    } else if constexpr (SOURCE == TABLE) {
      c[i] = to_float(cos_t[q * p.cos_stride_row + f * p.cos_stride_col]);
      s[i] = to_float(sin_t[q * p.sin_stride_row + f * p.sin_stride_col]);
    } else {
      sincosf(to_float(cos_t[q * p.cos_stride_row + f * p.cos_stride_col]), &s[i], &c[i]);
    }
    s[i] *= p.sin_sign;
  }
}

}  // namespace rope
