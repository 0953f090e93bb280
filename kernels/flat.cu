// Rotary position embedding over dense tensors walked in memory order: one
// 16-byte packet per thread, the NeoX rotation partner taken from another
// lane of the warp. Same angles and rotation helpers as packet_kernel and
// rope_kernel (kernels/packet.cu, kernels/rope.cu), and a parameter block
// of its own (params.cuh FlatParams):
//   a' = a cos(theta_f) - b sin(theta_f)
//   b' = b cos(theta_f) + a sin(theta_f)
// for the pairs (a, b) = (f, f + ROTARY_DIM/2) (NeoX) or (2f, 2f + 1) (GPT-J)
// of the first ROTARY_DIM channels of each head.
//
// The launcher (cupy_rope/launch.py `flat_geometry`) picks this kernel when
// every slab's x, and its output, are dense arrays of head rows with the
// same strides (bshd, sbhd, thd, or any permutation of the token and head
// axes), full rotary (or partial rotary in place), a cos/sin table and
// implied positions, or explicit ones that follow the sequence index alone.
// Then head row r of a slab sits at r * HEAD_DIM elements from its first
// one, its sequence index is
//   i = (r / rows_per_step) % seq_len
// where rows_per_step is the number of head rows between consecutive
// sequence indices (the modulo is skipped when no axis is stored outside
// the sequence axis), and its position is i + offset (IMPLIED) or
// positions[i * pos_stride] + offset (EXPLICIT).
//
// Why a third kernel: at the copy rate an SM has only a few instruction
// slots per 16-byte packet, and packet_kernel's general prologue is most of
// them. Here a thread finds its packet with a few integer operations, in 32
// registers or fewer, and every warp access covers contiguous memory, as a
// plain copy does (docs/performance.md, "flat_kernel").
#include "flat_rows.cuh"

namespace rope {

// SPLIT_ANGLES (NeoX): the two lanes of a rotation pair, which need the same
// cos/sin, each read half of them and swap halves by shuffle. The launcher
// sets it when a block's rows lie at several positions, so that fewer table
// reads go to L2.
//
// LATE_TABLES (16-bit x; GPT-J, or NeoX rows that tile a warp without split
// angles): a thread asks for its cos/sin rows only once its x packet has
// arrived: the table addresses take the packet's first word ANDed with
// p.zero (0 at run time, unknown to the compiler), so the loads wait for it.
// Those rows mostly come from L1, and asked for alongside x they slowed the
// x stream; the other rows ask early (docs/performance.md, "late tables").
//
// EARLY_TABLES: those rows ask early after all; the launcher sets it for
// calls with implied positions that walk many bytes of x (LaunchPolicy
// flat_early_tables_bytes), where late rows lost.
//
// PARTNER_LOAD (NeoX, out of place only): a thread loads its rotation
// partner itself (the packet HALF away, which its own thread loads too: an
// L1 hit) instead of taking it from another lane, so rows need not tile a
// warp (d96 bf16: 12 packets; fp32 d80 / d96 / d256). In place the partner
// could already have been overwritten: the launcher never sets it there.
//
// X_EVICT_LAST (fp32 out of place, full rotary, rows whose positions never
// decrease through memory): x is loaded with an L2 evict-last policy, as
// torch.compile's kernel loads it; it lost where a batch axis lies outside
// the sequence and on 16-bit rows (docs/performance.md, "evict-last x").
//
// POS_MODE: IMPLIED, the row's sequence index; EXPLICIT, the entry of
// `positions` at that index (positions that depend on the sequence index
// alone: thd [t], or [s] / [1, s] for bshd and sbhd), read alongside x.
template <typename T, typename AngleT, int HEAD_DIM, int ROTARY_DIM, bool INTERLEAVED,
          bool SPLIT_ANGLES, bool PARTNER_LOAD, int SLABS, int POS_MODE, bool EARLY_TABLES,
          bool X_EVICT_LAST>
__global__ void __launch_bounds__(FLAT_THREADS, FLAT_MIN_BLOCKS) flat_kernel(const FlatParams p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per packet
  // Packets a thread walks per head row: the rotated channels. With
  // ROTARY_DIM < HEAD_DIM (in place only: the launcher copies no tail here)
  // the rest of the row is neither read nor written.
  constexpr int PACKETS = ROTARY_DIM / VEC;
  constexpr int HALF = PACKETS / 2;  // NeoX: partner distance, in packets
  static_assert(INTERLEAVED ? ROTARY_DIM % VEC == 0 : ROTARY_DIM % (2 * VEC) == 0,
                "the rotated channels are a whole number of packets (NeoX: of each half)");
  static_assert(ROTARY_DIM <= HEAD_DIM && HEAD_DIM % VEC == 0, "packet-aligned head rows");
  constexpr bool SHUFFLE = !INTERLEAVED && !PARTNER_LOAD;  // NeoX partner from another lane
  static_assert(!SHUFFLE || PACKETS <= 32, "NeoX by shuffle: a head row within one warp");
  static_assert(!(SPLIT_ANGLES && !SHUFFLE), "split angles: NeoX with the partner by shuffle");
  constexpr bool LATE_TABLES = sizeof(T) == 2 && !SPLIT_ANGLES && !PARTNER_LOAD &&
                               (INTERLEAVED || 32 % PACKETS == 0) && !EARLY_TABLES;
  // Lanes of a warp that hold packets: NeoX by shuffle, whole head rows (d80
  // bf16: 3 rows of 10 packets, 2 lanes idle); otherwise all 32.
  constexpr int LANES = SHUFFLE ? (32 / PACKETS) * PACKETS : 32;
  // Frequencies of a packet: NeoX, VEC (its partner uses the same ones);
  // GPT-J, the packet's VEC / 2 pairs.
  constexpr int PACKET_FREQS = INTERLEAVED ? VEC / 2 : VEC;

  const FlatBlock blk = flat_block<SLABS>(p);
  const FlatSlab& sl = blk.s;
  const unsigned lane = threadIdx.x & 31u;
  // (The first slab's blocks begin at 0.)
  const unsigned begin = SLABS == 1 ? 0u : static_cast<unsigned>(sl.block_begin);
  const unsigned warp = (blockIdx.x - begin) * (FLAT_THREADS / 32) + threadIdx.x / 32u;
  // (The launcher keeps a slab's rows x PACKETS below 2^31: 32-bit index math.)
  const unsigned rows = static_cast<unsigned>(sl.rows);
  if (warp * LANES / PACKETS >= rows) return;  // the last block's spare warps (warp-uniform)
  const unsigned unit = warp * LANES + lane;
  const unsigned row = unit / PACKETS;
  const int pk = static_cast<int>(unit - row * PACKETS);
  // A live lane's NeoX partner is in the same row, so it is live too.
  const bool live = (INTERLEAVED || lane < LANES) && row < rows;

  const i64 first = static_cast<i64>(row) * HEAD_DIM + pk * VEC;
  const T* x = static_cast<const T*>(blk.x) + first;
  T* out = static_cast<T*>(blk.out) + first;
  // A plain load, also out of place: the non-coherent path (which
  // packet_kernel takes) was slower here.
  Packet<T, VEC> raw{}, partner{};
  if (live) raw = X_EVICT_LAST ? load_reused<T, VEC>(x, 1) : load_raw<T, VEC>(x, 1);
  const bool first_half = INTERLEAVED || pk < HALF;
  if constexpr (PARTNER_LOAD) {
    if (live) partner = load_raw<T, VEC>(x + (first_half ? HALF * VEC : -HALF * VEC), 1);
  }

  // The position (a lane with no row, or outside the table, reads row 0).
  const FlatPosition fp = flat_position<POS_MODE>(p, sl, row, live);
  const i64 pos = fp.pos;
  const bool inside = fp.inside;

  // The table rows: requested once x is here (LATE_TABLES), or before the
  // partner exchange, which waits for x, so that both loads are in flight
  // together. NeoX: the partner is the lane HALF away, in the same row.
  const int partner_lane = static_cast<int>(lane) + (first_half ? HALF : -HALF);
  int f0 = INTERLEAVED ? pk * PACKET_FREQS : (first_half ? pk : pk - HALF) * VEC;
  if constexpr (LATE_TABLES) {
    unsigned first_word;
    memcpy(&first_word, &raw, 4);
    f0 += static_cast<int>(first_word & p.zero);
  }
  float c[PACKET_FREQS], s[PACKET_FREQS], v[VEC];
  if constexpr (!SPLIT_ANGLES) {
    load_row<AngleT, PACKET_FREQS, false>(p.cos, pos * p.cos_stride_row + f0, 1, c);
    load_row<AngleT, PACKET_FREQS, false>(p.sin, pos * p.sin_stride_row + f0, 1, s);
  } else {
    // Frequencies [f0, f0 + PACKET_FREQS / 2) read by the first-half lane, the rest
    // by its partner; each then takes the other's half.
    constexpr int H2 = PACKET_FREQS / 2;
    const int mine = f0 + (first_half ? 0 : H2);
    float mine_c[H2], mine_s[H2];
    load_row<AngleT, H2, false>(p.cos, pos * p.cos_stride_row + mine, 1, mine_c);
    load_row<AngleT, H2, false>(p.sin, pos * p.sin_stride_row + mine, 1, mine_s);
#pragma unroll
    for (int i = 0; i < H2; ++i) {
      const float other_c = __shfl_sync(0xffffffffu, mine_c[i], partner_lane);
      const float other_s = __shfl_sync(0xffffffffu, mine_s[i], partner_lane);
      c[i] = first_half ? mine_c[i] : other_c;
      c[H2 + i] = first_half ? other_c : mine_c[i];
      s[i] = first_half ? mine_s[i] : other_s;
      s[H2 + i] = first_half ? other_s : mine_s[i];
    }
  }
  // The rotation as rotated_first / rotated_second (kernels/angles.cuh)
  // spell it, with the direction (p.sin_sign, -1 backward) folded into the
  // sign of the product: multiplying by -1 is exact, so the bits are the
  // other kernels'.
  const float sign = p.sin_sign;
  to_floats(raw, v);
  if constexpr (INTERLEAVED) {
    // (a, b) -> (a c - b s, b c + a s) for each pair of the packet
#pragma unroll
    for (int i = 0; i < PACKET_FREQS; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = fmaf(a, c[i], -sign * (b * s[i]));
      v[2 * i + 1] = fmaf(b, c[i], sign * (a * s[i]));
    }
  } else {
    // The partner packet (channels HALF packets away, in the other half of
    // the row) comes from the lane that read it (each packet is read once,
    // by its own thread, so in place is safe as well), or was loaded above.
    if constexpr (SHUFFLE) {
      unsigned w[4], pw[4];
      memcpy(w, &raw, 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) pw[i] = __shfl_sync(0xffffffffu, w[i], partner_lane);
      memcpy(&partner, pw, 16);
    }
    float b[VEC];
    to_floats(partner, b);
    // First half: a' = a c - b s; second half: b' = b c + a s (the partner
    // is a): both fmaf(mine, c, +-(partner s)).
    const float signed_sin = first_half ? -sign : sign;
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = fmaf(v[i], c[i], signed_sin * (b[i] * s[i]));
  }
  if (!inside) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __int_as_float(0x7fffffff);
  }
  if (live) store<T, VEC>(out, 1, v);
}

}  // namespace rope
