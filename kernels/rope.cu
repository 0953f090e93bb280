// Rotary position embedding, forward and backward, for up to three strided
// [tokens, heads, head_dim] tensors in one launch (q and k with any head
// counts, and v of a fused QKV split, which is copied). bshd, sbhd, thd and
// permuted or packed views map onto it through Params (kernels/params.cuh).
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
//   threadIdx.y: head lane (of the slab's head_lanes; the lanes beyond take
//                further tokens); a thread walks the heads of its block with
//                step head_lanes, UNROLL heads per pass (their loads all
//                issued before the first store), computing cos/sin once.
//   threadIdx.z: token lane.
//   blockIdx.x:  slab (q, k, v), head group and token block. Every block
//                sees one slab only, so the per-head work is the same as for
//                one tensor; several head groups split the heads when there
//                are few tokens (decode), so that small calls fill the GPU.
#include "angles.cuh"

namespace rope {

// Register budget: this many full blocks resident per SM (twice as many for
// the one-head kernels, UNROLL 1).
constexpr int MIN_BLOCKS_PER_SM = 2;
constexpr int MAX_THREADS = 256;  // threads per block (cupy_rope/launch.py THREADS_PER_BLOCK)
constexpr int MAX_BLOCK_TOKENS = MAX_THREADS;  // tokens one block can cover

template <typename T, typename AngleT, int HEAD_DIM, int ROTARY_DIM, bool INTERLEAVED,
          int SOURCE, int PAIRS, int TAIL_VEC, bool STRIDED, bool TABLE_STRIDED, bool COPY_TAIL,
          int UNROLL, int POS_MODE>
__global__ void __launch_bounds__(MAX_THREADS, UNROLL == 1 ? 2 * MIN_BLOCKS_PER_SM : MIN_BLOCKS_PER_SM)
    rope_kernel(const Params p) {
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

  const auto [sl, x_data, out_data] = block_slab(p);
  // This block: head group `group`, token block `tb` of its slab. Lanes
  // beyond the slab's head_lanes take further tokens.
  // (32-bit index math: block and lane counts are far below 2^31.)
  const unsigned b = blockIdx.x - static_cast<unsigned>(sl.block_begin);
  const unsigned token_blocks = static_cast<unsigned>(sl.token_blocks);
  // The prologue is paid per thread: no division for a slab's first head
  // group (block-uniform), shifts for the power-of-two head lanes.
  const unsigned group_u = b < token_blocks ? 0u : b / token_blocks;
  const i64 tb = b - group_u * token_blocks;
  const unsigned lanes = static_cast<unsigned>(sl.head_lanes);  // a power of two
  const unsigned lane_shift = __ffs(lanes) - 1;
  const unsigned mult = blockDim.y >> lane_shift;
  const int head_lane = threadIdx.y & (lanes - 1);
  const int token_lane = threadIdx.z * mult + (threadIdx.y >> lane_shift);
  const int block_tokens = blockDim.z * mult;

  const i64 n_tokens = p.n_outer * p.n_inner;
  const i64 first = tb * block_tokens;  // < n_tokens: blocks exist for tokens only
  const i64 token = first + token_lane;
  const bool live = token < n_tokens;
  const i64 tk = live ? token : first;  // lanes past the end address a real token
  i64 outer;
  if (p.n_outer == 1)  // block-uniform (as both tests below): one batch entry, or thd
    outer = 0;
  else if (n_tokens <= 0xffffffffll)  // 32-bit division is several times cheaper
    outer = static_cast<unsigned>(tk) / static_cast<unsigned>(p.n_inner);
  else
    outer = tk / p.n_inner;
  const i64 inner = tk - outer * p.n_inner;

  const int item = threadIdx.x;
  const int h_begin = group_u * static_cast<int>(sl.heads_per_block);
  const int h_end = min(static_cast<int>(sl.n_heads), h_begin + static_cast<int>(sl.heads_per_block));
  const int h_step = lanes;
  const int h_first = h_begin + head_lane;
  const bool grouped = sl.heads_per_group < sl.n_heads;
  const int per_group = static_cast<int>(sl.heads_per_group);

  const T* x = static_cast<const T*>(x_data) + outer * sl.x.stride_outer +
               inner * sl.x.stride_inner;
  T* out = static_cast<T*>(out_data) + outer * sl.out.stride_outer + inner * sl.out.stride_inner;
  // Channel strides: 1 on the vector path (the launcher checked it).
  const i64 xd = STRIDED ? sl.x.stride_dim : 1, od = STRIDED ? sl.out.stride_dim : 1;

  // A rotating item's packets inside a head: channel STEP * f0, and for
  // NeoX also channel HALF + f0.
  const int f0 = item * PAIRS;
  constexpr int STEP = INTERLEAVED ? 2 : 1;
  const int ch[2] = {STEP * f0, f0 + HALF};

  // VARLEN: the first warp finds the sequences of the block's tokens; on
  // sm_80 and newer the other warps go on to issue their first pass's loads
  // meanwhile, and a thread waits for the search (positions.cuh,
  // SequenceSignal) only when it needs its position, so the search's
  // dependent cu_seqlens reads overlap the block's x reads instead of
  // preceding them (before sm_80: a block barrier after the search).
  __shared__ int seq_of_lane[MAX_BLOCK_TOKENS];
  __shared__ SequenceSignal seq_ready;
  if constexpr (POS_MODE == VARLEN) {
    signal_init(seq_ready);
    // The searching warp's own loads wait for the search. With many
    // sequences (a search of three steps, whose later reads miss L1) it first
    // asks for its first pass's packets, into L1, so that those loads do not
    // then wait for DRAM as well. Only with tables: it did not pay with few
    // sequences nor with angles computed in the kernel (docs/performance.md,
    // "varlen").
    if constexpr (SOURCE == TABLE) {
      // Above this many sequences: a search of three steps (also
      // cupy_rope/launch.py LaunchPolicy.varlen_few_seqs).
      constexpr int SEARCH_PREFETCH_MIN_SEQS = 1024;
      if (p.n_seqs > SEARCH_PREFETCH_MIN_SEQS && is_search_lane() && live && item < ROT_ITEMS) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // the heads and packets of the first pass
          const int h = h_first + u * h_step;
          if (h >= h_end) continue;
          const T* xh = x + head_offset(sl.x, h, grouped, per_group);
#pragma unroll
          for (int q = 0; q < PACKETS; ++q)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(xh + ch[q] * xd));
        }
      }
    }
    find_block_sequences(p, first, min(first + block_tokens, n_tokens) - 1, block_tokens,
                         seq_of_lane);  // the first search_lanes() threads
    signal_fire(seq_ready);
  }
  auto token_sequence = [&]() -> i64 {
    if constexpr (POS_MODE == VARLEN) {
      signal_wait(seq_ready);
      return seq_of_lane[token_lane];
    } else {
      return 0;
    }
  };
  if (!live) return;

  if (item < ROT_ITEMS) {
    float c[PAIRS], s[PAIRS];
    auto find_angles = [&]() {
      if constexpr (POS_MODE == AXES) {
        i64 pos[3];
        token_axis_positions(p, outer, inner, pos);
        axis_angles<SOURCE, AngleT, PAIRS>(p, pos, f0, c, s);
      } else {
        i64 pos = 0;
        const bool valid =
            token_position<POS_MODE>(p, token, outer, inner, token_sequence(), pos);
        angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED>(p, pos, valid, f0, c, s);
      }
    };
    const bool rotate = sl.rotate != 0;

    // UNROLL heads per pass: all loads first, then rotate and store. The
    // angles are found after the first pass's loads are issued, so that
    // the position and table reads (and, VARLEN, the wait for the block's
    // sequence search) overlap them. (Keep the pass's array local to the
    // loop: carried across passes, or filled before the loop, its loads
    // were issued one at a time.)
    bool have_angles = false;
    for (int h0 = h_first; h0 < h_end; h0 += h_step * UNROLL) {
      Packet<T, WIDTH> raw[UNROLL][PACKETS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int h = h0 + u * h_step;
        if (h < h_end) {
          const T* xh = x + head_offset(sl.x, h, grouped, per_group);
#pragma unroll
          for (int q = 0; q < PACKETS; ++q)
            raw[u][q] = load_raw<T, WIDTH, STRIDED>(xh + ch[q] * xd, xd);
        }
      }
      if (!have_angles && rotate) {
        find_angles();
        have_angles = true;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int h = h0 + u * h_step;
        if (h >= h_end) continue;
        T* o = out + head_offset(sl.out, h, grouped, per_group);
        if (!rotate) {  // v of a fused QKV split
#pragma unroll
          for (int q = 0; q < PACKETS; ++q)
            store_raw<T, WIDTH, STRIDED>(o + ch[q] * od, od, raw[u][q]);
        } else if constexpr (INTERLEAVED) {
          float v[WIDTH];
          to_floats(raw[u][0], v);
          rotate_interleaved(v, c, s);
          store<T, WIDTH, STRIDED>(o + ch[0] * od, od, v);
        } else {
          float a[PAIRS], b[PAIRS];
          to_floats(raw[u][0], a);
          to_floats(raw[u][1], b);
          rotate_halves(a, b, c, s);
          store<T, PAIRS, STRIDED>(o + ch[0] * od, od, a);
          store<T, PAIRS, STRIDED>(o + ch[1] * od, od, b);
        }
      }
    }
  } else if constexpr (COPY_TAIL && TAIL > 0) {
    const i64 ch = ROTARY_DIM + static_cast<i64>(item - ROT_ITEMS) * TAIL_VEC;
    for (int h0 = h_first; h0 < h_end; h0 += h_step * UNROLL) {
      Packet<T, TAIL_VEC> raw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int h = h0 + u * h_step;
        if (h < h_end)
          raw[u] = load_raw<T, TAIL_VEC, STRIDED>(
              x + head_offset(sl.x, h, grouped, per_group) + ch * xd, xd);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int h = h0 + u * h_step;
        if (h < h_end)
          store_raw<T, TAIL_VEC, STRIDED>(out + head_offset(sl.out, h, grouped, per_group) + ch * od,
                                          od, raw[u]);
      }
    }
  }
}

}  // namespace rope
