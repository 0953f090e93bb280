// Rotary position embedding, forward and backward, for a strided
// [tokens, heads, head_dim] view (bshd, sbhd and permuted 4-D views map onto
// it through Params::View).
//
// Channel pairs (a, b) of the first ROTARY_DIM channels rotate by theta_f:
//   a' = a cos(theta_f) - b sin(theta_f)
//   b' = b cos(theta_f) + a sin(theta_f)
// NeoX style (rotate-half): pair f is (f, f + ROTARY_DIM/2).
// GPT-J style (interleaved): pair f is (2f, 2f + 1).
// The backward pass is the transpose of a rotation, i.e. rotation by
// -theta: the same code with sin negated (Params::sin_sign = -1).
// Channels [ROTARY_DIM, HEAD_DIM) are copied when out != x (COPY_TAIL) and
// never touched when rotating in place.
//
// Thread layout (cupy_rope/launch.py picks the sizes):
//   threadIdx.x: an item of one head. Items [0, ROT_ITEMS) each rotate PAIRS
//                pairs; items [ROT_ITEMS, ROT_ITEMS + TAIL_ITEMS) each copy
//                TAIL_VEC tail channels.
//   threadIdx.y: head lane; a thread walks the heads of its group with step
//                blockDim.y, UNROLL heads per pass (their loads all issued
//                before the first store), computing cos/sin once for all.
//   threadIdx.z: token lane; blockIdx.x * blockDim.z + threadIdx.z is the token.
//   blockIdx.y:  head group of Params::heads_per_group heads (several groups
//                when there are few tokens, so that small calls fill the GPU).
#include "angles.cuh"

namespace rope {

template <typename T, typename AngleT, typename PosT, typename OffT, int HEAD_DIM,
          int ROTARY_DIM, bool INTERLEAVED, int SOURCE, int PAIRS, int TAIL_VEC,
          bool STRIDED, bool TABLE_STRIDED, bool COPY_TAIL, int UNROLL>
__global__ void rope_kernel(const Params p) {
  static_assert(HEAD_DIM % 2 == 0 && ROTARY_DIM % 2 == 0, "even dims");
  static_assert(ROTARY_DIM <= HEAD_DIM, "rotary_dim <= head_dim");
  constexpr int HALF = ROTARY_DIM / 2;
  static_assert(HALF % PAIRS == 0, "PAIRS divides rotary_dim / 2");
  constexpr int ROT_ITEMS = HALF / PAIRS;
  constexpr int TAIL = HEAD_DIM - ROTARY_DIM;
  static_assert(!COPY_TAIL || TAIL % TAIL_VEC == 0, "TAIL_VEC divides the tail");
  // A NeoX item moves two packets of PAIRS channels (f and f + HALF); a
  // GPT-J item one packet of 2 * PAIRS adjacent channels.
  constexpr int PACKETS = INTERLEAVED ? 1 : 2;
  constexpr int WIDTH = INTERLEAVED ? 2 * PAIRS : PAIRS;

  const i64 token = static_cast<i64>(blockIdx.x) * blockDim.z + threadIdx.z;
  if (token >= p.n_outer * p.n_inner) return;
  const i64 outer = token / p.n_inner;
  const i64 inner = token - outer * p.n_inner;

  const int item = threadIdx.x;
  const i64 h_begin = static_cast<i64>(blockIdx.y) * p.heads_per_group;
  const i64 h_end = min(p.n_heads, h_begin + p.heads_per_group);
  const i64 h_step = blockDim.y;

  const T* x = static_cast<const T*>(p.x.data) + outer * p.x.stride_outer +
               inner * p.x.stride_inner;
  T* out = static_cast<T*>(p.out.data) + outer * p.out.stride_outer +
           inner * p.out.stride_inner;
  const i64 xd = p.x.stride_dim, od = p.out.stride_dim;
  const i64 xh = p.x.stride_head, oh = p.out.stride_head;

  if (item < ROT_ITEMS) {
    i64 pos = p.positions
                  ? static_cast<i64>(static_cast<const PosT*>(
                        p.positions)[outer * p.pos_stride_outer + inner * p.pos_stride_inner])
                  : outer * p.seq_stride_outer + inner * p.seq_stride_inner;
    if (p.offsets)
      pos += static_cast<i64>(static_cast<const OffT*>(
          p.offsets)[outer * p.off_stride_outer + inner * p.off_stride_inner]);
    pos += p.offset;

    const int f0 = item * PAIRS;
    float c[PAIRS], s[PAIRS];
    angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED>(p, pos, f0, c, s);

    // Offsets of this item's packets inside a head: channel STEP * f0, and
    // for NeoX also channel HALF + f0.
    constexpr int STEP = INTERLEAVED ? 2 : 1;
    const i64 xo[2] = {STEP * f0 * xd, (f0 + HALF) * xd};
    const i64 oo[2] = {STEP * f0 * od, (f0 + HALF) * od};

    // UNROLL heads per pass: all loads first, then rotate and store.
    for (i64 h0 = h_begin + threadIdx.y; h0 < h_end; h0 += h_step * UNROLL) {
      Packet<T, WIDTH> raw[UNROLL][PACKETS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 h = h0 + u * h_step;
        if (h < h_end) {
#pragma unroll
          for (int k = 0; k < PACKETS; ++k)
            raw[u][k] = load_raw<T, WIDTH, STRIDED>(x + h * xh + xo[k], xd);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 h = h0 + u * h_step;
        if (h < h_end) {
          if constexpr (INTERLEAVED) {
            float v[WIDTH];
            to_floats(raw[u][0], v);
#pragma unroll
            for (int i = 0; i < PAIRS; ++i) {
              const float a = v[2 * i], b = v[2 * i + 1];
              v[2 * i] = a * c[i] - b * s[i];
              v[2 * i + 1] = b * c[i] + a * s[i];
            }
            store<T, WIDTH, STRIDED>(out + h * oh + oo[0], od, v);
          } else {
            float a[PAIRS], b[PAIRS];
            to_floats(raw[u][0], a);
            to_floats(raw[u][1], b);
#pragma unroll
            for (int i = 0; i < PAIRS; ++i) {
              const float ai = a[i], bi = b[i];
              a[i] = ai * c[i] - bi * s[i];
              b[i] = bi * c[i] + ai * s[i];
            }
            store<T, PAIRS, STRIDED>(out + h * oh + oo[0], od, a);
            store<T, PAIRS, STRIDED>(out + h * oh + oo[1], od, b);
          }
        }
      }
    }
  } else if constexpr (COPY_TAIL && TAIL > 0) {
    const i64 ch = ROTARY_DIM + static_cast<i64>(item - ROT_ITEMS) * TAIL_VEC;
    for (i64 h0 = h_begin + threadIdx.y; h0 < h_end; h0 += h_step * UNROLL) {
      Packet<T, TAIL_VEC> raw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 h = h0 + u * h_step;
        if (h < h_end) raw[u] = load_raw<T, TAIL_VEC, STRIDED>(x + h * xh + ch * xd, xd);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const i64 h = h0 + u * h_step;
        if (h < h_end) store_raw<T, TAIL_VEC, STRIDED>(out + h * oh + ch * od, od, raw[u]);
      }
    }
  }
}

}  // namespace rope
