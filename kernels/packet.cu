// Rotary position embedding with two 16-byte packets (or one) per thread:
// the kernel for full rotary (rotary_dim == head_dim) on 16-byte aligned
// views with a unit channel stride, which is what most calls are. Same
// Params, angles, positions and math as rope_kernel (kernels/rope.cu):
//   a' = a cos(theta_f) - b sin(theta_f)
//   b' = b cos(theta_f) + a sin(theta_f)
// for the pairs (a, b) = (f, f + HEAD_DIM/2) (NeoX) or (2f, 2f + 1) (GPT-J).
//
// Why a second kernel: a RoPE thread moves tens of bytes, and at the copy
// rate an SM has only a few hundred instruction slots per thread
// (docs/performance.md, "packet_kernel"). rope_kernel's per-thread setup (head lanes, head
// groups, token lanes, passes) pays off when a thread walks several heads;
// this kernel's thread rotates one unit and needs a few integer operations
// to find it:
//   unit  = (blockIdx.x - slab's first block) * blockDim.x + threadIdx.x
//   row   = unit / UNITS                 (compile time; a row is one head of one token)
//   token = row / n_heads                (multiply by a host-made reciprocal)
//   outer = token / n_inner              (the same; skipped for one batch entry)
// or, for heads stored outside the inner token axis (head_major), rows in
// (outer, head, inner) order: row / n_inner, then / n_heads.
// A unit is, for NeoX, the packets at channels c0 and c0 + HALF (rotation
// partners, VEC pairs); for GPT-J with 16-bit elements, two adjacent
// packets (VEC pairs); for GPT-J fp32, one packet (VEC / 2 pairs). (One output
// packet per thread with its rotate-half partner re-read, the layout of
// torch.compile's kernel, was slower than pairs.) Positions: implied or
// explicit; rope_kernel keeps cu_seqlens (its blocks of several tokens
// amortize the sequence search, which this kernel would repeat for every
// 256 threads) and per-axis positions.
#include "angles.cuh"

namespace rope {

constexpr int PACKET_THREADS = 256;  // most threads per block (cupy_rope/launch.py)

template <typename T, typename AngleT, int HEAD_DIM, bool INTERLEAVED, int SOURCE, int VEC,
          bool TABLE_STRIDED, int POS_MODE>
__global__ void __launch_bounds__(PACKET_THREADS) packet_kernel(const Params p) {
  static_assert(HEAD_DIM % 2 == 0, "even head_dim");
  constexpr int HALF = HEAD_DIM / 2;
  // Packets per thread: NeoX, the rotation partners at channels c0 and
  // c0 + HALF; GPT-J with 16-bit elements, two adjacent packets (a thread
  // moves as many bytes, and reads as many table bytes, as a NeoX one);
  // GPT-J fp32, one (docs/performance.md, "packet_kernel").
  constexpr int PACKETS = INTERLEAVED && sizeof(T) == 4 ? 1 : 2;
  static_assert(INTERLEAVED ? VEC % 2 == 0 : true, "GPT-J packets hold whole pairs");
  static_assert(INTERLEAVED ? HEAD_DIM % (PACKETS * VEC) == 0 : HALF % VEC == 0,
                "a head is a whole number of units");
  static_assert(POS_MODE == IMPLIED || POS_MODE == EXPLICIT, "implied or explicit positions");
  // Units (threads) per row, and frequencies per unit: NeoX, VEC (both
  // packets use the same ones); GPT-J, the unit's PACKETS * VEC / 2 pairs.
  constexpr int UNITS = INTERLEAVED ? HEAD_DIM / (PACKETS * VEC) : HALF / VEC;
  constexpr int UNIT_FREQS = INTERLEAVED ? PACKETS * VEC / 2 : VEC;

  const auto [sl, x_data, out_data] = block_slab(p);
  const View& xv = sl.x;
  const View& ov = sl.out;
  const i64 n_heads = sl.n_heads, per_group = sl.heads_per_group;
  // (The launcher keeps every slab below 2^31 units: 32-bit index math.)
  const unsigned block_unit = (blockIdx.x - static_cast<unsigned>(sl.block_begin)) * blockDim.x;
  const unsigned unit = block_unit + threadIdx.x;
  const unsigned row = unit / UNITS;
  const int u = static_cast<int>(unit - row * UNITS);
  const unsigned heads = static_cast<unsigned>(n_heads), n_inner = static_cast<unsigned>(p.n_inner);
  unsigned outer = 0, inner;
  int h;
  if (sl.head_major) {
    // Rows in (outer, head, inner) order: x stores heads outside the inner
    // token axis (a [b, h, s, d] tensor seen as bshd), so consecutive
    // threads read consecutive memory, and write it for an output of the
    // same order.
    const unsigned oh = divide(row, p.inner_mul, p.inner_shift);  // outer * heads + h
    if (oh >= static_cast<unsigned>(p.n_outer) * heads) return;   // the last block's spares
    inner = row - oh * n_inner;
    if (p.n_outer != 1) outer = divide(oh, sl.head_mul, sl.head_shift);  // block-uniform
    h = static_cast<int>(oh - outer * heads);
  } else {
    // Rows in (outer, inner, head) order: heads inside a token.
    const unsigned token = divide(row, sl.head_mul, sl.head_shift);
    h = static_cast<int>(row - token * heads);
    if (token >= static_cast<unsigned>(p.n_outer) * n_inner) return;  // the last block's spares
    inner = token;
    if (p.n_outer != 1) {  // block-uniform
      outer = divide(token, p.inner_mul, p.inner_shift);
      inner = token - outer * n_inner;
    }
  }
  const bool grouped = per_group < n_heads;
  const T* x = static_cast<const T*>(x_data) + outer * xv.stride_outer +
               inner * xv.stride_inner + head_offset(xv, h, grouped, static_cast<int>(per_group));
  T* out = static_cast<T*>(out_data) + outer * ov.stride_outer + inner * ov.stride_inner +
           head_offset(ov, h, grouped, static_cast<int>(per_group));

  // This unit's channels: c0 (and, with two packets, c1).
  const int c0 = u * (INTERLEAVED ? PACKETS * VEC : VEC);
  const int c1 = INTERLEAVED ? c0 + VEC : c0 + HALF;
  Packet<T, VEC> raw[PACKETS];
  // Out of place, x is read-only for the whole launch (the launcher rejects
  // outputs overlapping inputs): its packets go through the non-coherent
  // path, which is faster here.
  if (x_data != out_data) {
    raw[0] = load_read_only<T, VEC>(x + c0);
    if constexpr (PACKETS == 2) raw[1] = load_read_only<T, VEC>(x + c1);
  } else {
    raw[0] = load_raw<T, VEC>(x + c0, 1);
    if constexpr (PACKETS == 2) raw[1] = load_raw<T, VEC>(x + c1, 1);
  }
  if (sl.rotate == 0) {  // v of a fused QKV split: copied unchanged
#pragma unroll
    for (int q = 0; q < PACKETS; ++q)
      store_raw<T, VEC>(out + (q == 0 ? c0 : c1), 1, raw[q]);
    return;
  }

  i64 pos = 0;
  const bool valid = token_position<POS_MODE>(p, 0, outer, inner, 0, pos);  // (token: VARLEN only)
  if constexpr (INTERLEAVED) {
    // PACKETS adjacent packets of whole pairs: frequencies c0 / 2 on.
    float c[UNIT_FREQS], s[UNIT_FREQS], v[2 * UNIT_FREQS];
    angles<SOURCE, AngleT, UNIT_FREQS, TABLE_STRIDED>(p, pos, valid, c0 / 2, c, s);
#pragma unroll
    for (int q = 0; q < PACKETS; ++q) {
      float part[VEC];
      to_floats(raw[q], part);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[q * VEC + i] = part[i];
    }
    rotate_interleaved(v, c, s);
#pragma unroll
    for (int q = 0; q < PACKETS; ++q) {
      float part[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) part[i] = v[q * VEC + i];
      store<T, VEC>(out + (q == 0 ? c0 : c1), 1, part);
    }
  } else {
    float c[UNIT_FREQS], s[UNIT_FREQS], a[VEC], b[VEC];
    angles<SOURCE, AngleT, UNIT_FREQS, TABLE_STRIDED>(p, pos, valid, c0, c, s);
    to_floats(raw[0], a);
    to_floats(raw[1], b);
    rotate_halves(a, b, c, s);
    store<T, VEC>(out + c0, 1, a);
    store<T, VEC>(out + c1, 1, b);
  }
}

}  // namespace rope
