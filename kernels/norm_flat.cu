// apply_qk_norm_rope and its backward over dense head rows, walked as
// flat_kernel walks them (kernels/flat.cu): one packet per thread and row,
// a row's packets on adjacent lanes of one warp, the NeoX partner from
// another lane. A thread holds U rows at one position (their angles
// read once); a row's sum of squares is taken across the lanes that hold
// it (scope "head") or across the warps that hold a token (scope "token").
// Nothing else is held, so an SM holds many threads, each with U packets in
// flight. cupy_rope/norm_launch.py picks these kernels where they apply
// (full rotary, rows of a power-of-two number of packets within a warp,
// flat_geometry's layouts, scope "token" with a token's heads innermost);
// norm_rope_kernel (kernels/norm_rope.cu) runs every other call.
//
// Scope "head" gives norm_rope_kernel's bits: its item of PAIRS = VEC pairs
// is this kernel's packet (GPT-J) or the packet and its NeoX partner's, and
// a row's sum of squares runs in the same order: the item's values (NeoX:
// the first half's, then the second half's), then the butterfly over the
// lanes of the row's items (lane_sum). Scope "token" sums in an order of
// its own (the same on every run).
#include "flat_rows.cuh"
#include "norm_items.cuh"

namespace rope {

// A slab whose tokens lie further apart than their head rows (the q and k
// of a packed projection): `elems` more elements after each token's `heads`
// rows; row / heads as divide(row, heads_mul, heads_shift). All 0 for a
// dense slab, and for every kernel but the scope-"head" forward.
struct FlatGap {
  i64 elems;
  i64 heads_mul;
  i64 heads_shift;
};

// FlatParams, then the norm's part (as NormParams ends), then the gaps.
struct NormFlatParams : FlatParams {
  NormSlab norm[MAX_SLABS];
  float eps;
  float pad2_;
  FlatGap gap[MAX_SLABS];
};

// Element offset of head row `row` of a slab (GAPPED: with its FlatGap).
template <bool GAPPED>
__device__ __forceinline__ i64 row_offset(unsigned row, int head_dim, const FlatGap& gap) {
  const i64 at = static_cast<i64>(row) * head_dim;
  if constexpr (!GAPPED) return at;
  return at + static_cast<i64>(divide(row, gap.heads_mul, gap.heads_shift)) * gap.elems;
}

// The layout of one head row's packets on a warp's lanes.
template <typename T, int HEAD_DIM, bool INTERLEAVED>
struct FlatRow {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per packet
  static constexpr int PACKETS = HEAD_DIM / VEC;               // a head row's packets
  static constexpr int HALF = PACKETS / 2;                     // NeoX: partner distance
  static constexpr int PASS_ROWS = 32 / PACKETS;               // rows of one warp pass
  // Lanes over a row's items: norm_rope_kernel's LANES for this layout.
  static constexpr int ITEM_LANES = INTERLEAVED ? PACKETS : HALF;
  static constexpr int FREQS = INTERLEAVED ? VEC / 2 : VEC;  // angles of a packet
  static_assert(HEAD_DIM % VEC == 0 && PACKETS >= 2 && PACKETS <= 32 &&
                    (PACKETS & (PACKETS - 1)) == 0,
                "a head row is a power-of-two number of packets within one warp");
};

constexpr unsigned FULL_WARP = 0xffffffffu;

// This lane's packet of its row and its NeoX partner (GPT-J needs none).
struct FlatLane {
  int pk;            // the packet's index in its row
  bool first_half;   // NeoX: a packet of the row's first half (GPT-J: true)
  int partner_lane;  // NeoX: the lane of the partner packet
};

template <class R, bool INTERLEAVED>
__device__ __forceinline__ FlatLane flat_lane(unsigned lane) {
  const int pk = static_cast<int>(lane % R::PACKETS);
  const bool first_half = INTERLEAVED || pk < R::HALF;
  return FlatLane{pk, first_half, static_cast<int>(lane) + (first_half ? R::HALF : -R::HALF)};
}

// A token's HEADS rows on WARPS warps (scope "token"): warp w holds heads
// (w * U + u) * PASS_ROWS + lane / PACKETS, u < U.
template <class R, int U, int HEADS, int MAX_THREADS>
struct TokenHeads {
  static constexpr int WARPS = HEADS / (R::PASS_ROWS * U);
  static_assert(HEADS % (R::PASS_ROWS * U) == 0, "a token fills whole warps");
  static_assert(WARPS * 32 <= MAX_THREADS, "a token within one block");
  __device__ static __forceinline__ unsigned head0(unsigned token_warp, unsigned lane) {
    return token_warp * (R::PASS_ROWS * U) + lane / R::PACKETS;
  }
};

// sum + the squares of v, in order (an item's chain of norm_rope_kernel).
template <int N>
__device__ __forceinline__ float squares(const float (&v)[N], float sum) {
#pragma unroll
  for (int e = 0; e < N; ++e) sum = fmaf(v[e], v[e], sum);
  return sum;
}

// The sum of squares of this lane's item: NeoX, the second-half lane
// continues its partner's chain over the first half, and both take it.
template <class R, bool INTERLEAVED, typename T>
__device__ __forceinline__ float item_squares(const Packet<T, R::VEC>& raw, bool first_half,
                                              int partner_lane) {
  float v[R::VEC];
  to_floats(raw, v);
  float sum = squares(v, 0.f);
  if constexpr (!INTERLEAVED) {
    const float chain = squares(v, __shfl_sync(FULL_WARP, sum, partner_lane));
    const float back = __shfl_sync(FULL_WARP, chain, partner_lane);
    sum = first_half ? back : chain;
  }
  return sum;
}

// v (this lane's packet `own` as floats) rotated by sign * theta, as
// norm_rope_kernel rotates (rotated_first / rotated_second of
// kernels/angles.cuh, this lane's value first; multiplying by sign = +-1 is
// exact); NaN outside the table. NeoX: the partner packet from its lane.
template <class R, bool INTERLEAVED, typename T>
__device__ __forceinline__ void rotate_packet(const Packet<T, R::VEC>& own, float (&v)[R::VEC],
                                              const float (&c)[R::FREQS],
                                              const float (&s)[R::FREQS], float sign,
                                              bool inside, bool first_half, int partner_lane) {
  if constexpr (INTERLEAVED) {
#pragma unroll
    for (int i = 0; i < R::FREQS; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = fmaf(a, c[i], -sign * (b * s[i]));
      v[2 * i + 1] = fmaf(b, c[i], sign * (a * s[i]));
    }
  } else {
    unsigned w[4], pw[4];
    memcpy(w, &own, 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) pw[i] = __shfl_sync(FULL_WARP, w[i], partner_lane);
    Packet<T, R::VEC> partner;
    memcpy(&partner, pw, 16);
    float b[R::VEC];
    to_floats(partner, b);
    const float signed_sin = first_half ? -sign : sign;
#pragma unroll
    for (int i = 0; i < R::VEC; ++i) v[i] = fmaf(v[i], c[i], signed_sin * (b[i] * s[i]));
  }
  if (!inside) {
#pragma unroll
    for (int i = 0; i < R::VEC; ++i) v[i] = __int_as_float(0x7fffffff);
  }
}

// y = round(round(x_hat) * w') or round(x_hat * w') in x's storage type,
// rotated, into out (a live row).
template <class R, bool INTERLEAVED, bool ROUND_BEFORE, typename T>
__device__ __forceinline__ void normalize_rotate_store(const Packet<T, R::VEC>& raw, float rstd,
                                                       const float (&wv)[R::VEC],
                                                       const float (&c)[R::FREQS],
                                                       const float (&s)[R::FREQS], bool inside,
                                                       bool first_half, int partner_lane,
                                                       T* out, bool live) {
  float v[R::VEC];
  to_floats(raw, v);
  Packet<T, R::VEC> y;
#pragma unroll
  for (int e = 0; e < R::VEC; ++e) {
    float x_hat = v[e] * rstd;
    if constexpr (ROUND_BEFORE) x_hat = to_float(from_float<T>(x_hat));
    y.v[e] = from_float<T>(x_hat * wv[e]);
  }
  to_floats(y, v);
  rotate_packet<R, INTERLEAVED>(y, v, c, s, 1.f, inside, first_half, partner_lane);
  if (live) store<T, R::VEC>(out, 1, v);
}

// The angles of this lane's packet at the rows' position.
template <class R, bool INTERLEAVED, typename AngleT>
__device__ __forceinline__ void packet_angles(const FlatParams& p, i64 pos, int pk,
                                              bool first_half, float (&c)[R::FREQS],
                                              float (&s)[R::FREQS]) {
  const int f0 = INTERLEAVED ? pk * R::FREQS : (first_half ? pk : pk - R::HALF) * R::VEC;
  load_row<AngleT, R::FREQS, false>(p.cos, pos * p.cos_stride_row + f0, 1, c);
  load_row<AngleT, R::FREQS, false>(p.sin, pos * p.sin_stride_row + f0, 1, s);
}

// The entry of this block's slab in a per-slab array of the parameters
// (compile-time indices, as flat_block).
template <int SLABS, typename S>
__device__ __forceinline__ S slab_entry(const S (&entries)[MAX_SLABS], int index) {
  S entry = entries[0];
#pragma unroll
  for (int i = 1; i < SLABS; ++i)
    if (i == index) entry = entries[i];
  return entry;
}

// This lane's part of a row's sum x^2 and sum dn * x (dn = g * w'), added
// to sq and dot.
template <int VEC>
__device__ __forceinline__ void backward_sums(const float (&xf)[VEC], const float (&g)[VEC],
                                              const float (&wv)[VEC], float& sq, float& dot) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    sq = fmaf(xf[e], xf[e], sq);
    dot = fmaf(g[e] * wv[e], xf[e], dot);
  }
}

// dx = rstd * (dn - x_hat * mdot), mdot = mean(dn * x_hat); with
// `accumulate`, the weight gradient's dw += g * x_hat.
template <int VEC>
__device__ __forceinline__ void input_gradient(const float (&xf)[VEC], const float (&g)[VEC],
                                               const float (&wv)[VEC], float rstd, float mdot,
                                               bool accumulate, float (&dx)[VEC],
                                               float (&dw)[VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float x_hat = xf[e] * rstd;
    dx[e] = rstd * fmaf(-x_hat, mdot, g[e] * wv[e]);
    if (accumulate) dw[e] = fmaf(g[e], x_hat, dw[e]);
  }
}

// The block's weight-gradient sums per channel into its partial row: the
// threads holding the same channels (equal lane % PACKETS) added in thread
// order by one thread each (scope "head"; FLAT_THREADS threads).
template <class R>
__device__ __forceinline__ void write_partial_row(const float (&dw)[R::VEC], float* partial) {
  __shared__ float sums[R::VEC][FLAT_THREADS];
#pragma unroll
  for (int e = 0; e < R::VEC; ++e) sums[e][threadIdx.x] = dw[e];
  __syncthreads();
  if (threadIdx.x < R::PACKETS) {
#pragma unroll
    for (int e = 0; e < R::VEC; ++e) {
      float t = 0.f;
      for (int j = threadIdx.x; j < FLAT_THREADS; j += R::PACKETS) t += sums[e][j];
      partial[threadIdx.x * R::VEC + e] = t;
    }
  }
}

// Blocks per SM asked of the compiler (scope "head"): flat_kernel's for one
// row a thread; a thread holding U rows needs more registers (as many as it
// uses unbounded, rounded to a whole number of blocks).
template <int U>
__host__ __device__ constexpr int norm_flat_min_blocks() {
  return U == 1 ? FLAT_MIN_BLOCKS : U == 2 ? FLAT_MIN_BLOCKS * 9 / 16 : FLAT_MIN_BLOCKS * 7 / 16;
}

// Scope "head". U: head rows per thread. A warp takes U passes of
// PASS_ROWS adjacent rows (each pass one contiguous run of memory); the
// launcher sets U > 1 only where all of them lie at one position (its
// rows_per_step is a multiple of the warp's rows), so their angles and
// weights are read once. GAPPED: a slab's tokens lie further apart than
// their head rows (p.gap: the q and k of a packed projection).
template <typename T, typename AngleT, typename WT, int HEAD_DIM, bool INTERLEAVED, int SLABS,
          int POS_MODE, int WEIGHT, bool ROUND_BEFORE, int U, bool GAPPED>
__global__ void __launch_bounds__(FLAT_THREADS, norm_flat_min_blocks<U>())
    norm_flat_kernel(const NormFlatParams p) {
  using R = FlatRow<T, HEAD_DIM, INTERLEAVED>;
  static_assert(U >= 1 && U <= 4, "rows per thread");
  const FlatBlock blk = flat_block<SLABS>(p);
  const FlatSlab& sl = blk.s;
  const WT* weight = static_cast<const WT*>(slab_entry<SLABS>(p.norm, blk.index).weight);
  const FlatGap gap = slab_entry<SLABS>(p.gap, blk.index);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned begin = SLABS == 1 ? 0u : static_cast<unsigned>(sl.block_begin);
  const unsigned warp = (blockIdx.x - begin) * (FLAT_THREADS / 32) + threadIdx.x / 32u;
  const unsigned rows = static_cast<unsigned>(sl.rows);
  if (warp * (R::PASS_ROWS * U) >= rows) return;  // the last block's spare warps (warp-uniform)
  const unsigned row0 = warp * (R::PASS_ROWS * U) + lane / R::PACKETS;
  const FlatLane fl = flat_lane<R, INTERLEAVED>(lane);
  const int pk = fl.pk;

  // Lanes past the last row load nothing but still take part in the shuffles.
  Packet<T, R::VEC> raw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const unsigned row = row0 + u * R::PASS_ROWS;
    memset(&raw[u], 0, sizeof(raw[u]));
    if (row < rows)
      raw[u] = load_raw<T, R::VEC>(
          static_cast<const T*>(blk.x) + row_offset<GAPPED>(row, HEAD_DIM, gap) + pk * R::VEC,
          1);
  }
  Packet<WT, R::VEC> wraw{};
  if (WEIGHT != WEIGHT_NONE) wraw = load_raw<WT, R::VEC>(weight + pk * R::VEC, 1);
  const FlatPosition fp = flat_position<POS_MODE>(p, sl, row0, row0 < rows);

  float rstd[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float own = item_squares<R, INTERLEAVED>(raw[u], fl.first_half, fl.partner_lane);
    const float sum = lane_sum<R::ITEM_LANES>(own, FULL_WARP);
    rstd[u] = 1.f / sqrtf(sum / static_cast<float>(HEAD_DIM) + p.eps);
    forget(raw[u]);  // converted again below rather than held as floats
  }
  // The angles, asked for once x is here (as flat_kernel's LATE_TABLES).
  float c[R::FREQS], s[R::FREQS], wv[R::VEC];
  packet_angles<R, INTERLEAVED, AngleT>(p, fp.pos, pk, fl.first_half, c, s);
  weight_values<WEIGHT>(wraw, false, wv);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const unsigned row = row0 + u * R::PASS_ROWS;
    normalize_rotate_store<R, INTERLEAVED, ROUND_BEFORE>(
        raw[u], rstd[u], wv, c, s, fp.inside, fl.first_half, fl.partner_lane,
        static_cast<T*>(blk.out) + row_offset<GAPPED>(row, HEAD_DIM, gap) + pk * R::VEC,
        row < rows);
  }
}

// Blocks per SM asked of the compiler for the backward (its thread holds
// dy, x and its channels' weight-gradient sums): as many as its registers
// allow unbounded.
template <int U>
__host__ __device__ constexpr int norm_flat_backward_min_blocks() {
  return U == 1 ? FLAT_MIN_BLOCKS * 6 / 16 : FLAT_MIN_BLOCKS * 5 / 16;
}

// Scope "head", backward: dx from the output gradient dy (the call's x)
// and the forward input x (NormSlab::input_data, with dy's strides), and
// with WGRAD the block's weight-gradient partial sums (one row of HEAD_DIM
// floats a block, reduced by weight_grad_reduce). Per row, as
// norm_rope_kernel: g = rotate(dy, -theta), dn = g * w', rstd from sum x^2,
// dx = rstd * (dn - x_hat * rstd * mean(dn * x)), dw += g * x_hat.
// NormSlab::blocks blocks walk a slab's groups of PASS_ROWS * U rows in a
// fixed order, each thread keeping its channels' sums, so the partial rows
// (and the weight gradients) are the same bits on every run.
template <typename T, typename AngleT, typename WT, int HEAD_DIM, bool INTERLEAVED, int SLABS,
          int POS_MODE, int WEIGHT, bool WGRAD, int U>
__global__ void __launch_bounds__(FLAT_THREADS, norm_flat_backward_min_blocks<U>())
    norm_flat_backward_kernel(const NormFlatParams p) {
  using R = FlatRow<T, HEAD_DIM, INTERLEAVED>;
  static_assert(U == 1 || U == 2, "rows per thread");
  constexpr int GROUP = R::PASS_ROWS * U;  // rows of a warp's group
  const FlatBlock blk = flat_block<SLABS>(p);
  const FlatSlab& sl = blk.s;
  // Picked here, not through slab_entry: as a helper's result the backward
  // compiles to a schedule with fewer loads in flight (docs/performance.md).
  NormSlab ns = p.norm[0];
#pragma unroll
  for (int i = 1; i < SLABS; ++i)
    if (i == blk.index) ns = p.norm[i];
  const WT* weight = static_cast<const WT*>(ns.weight);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned begin = SLABS == 1 ? 0u : static_cast<unsigned>(sl.block_begin);
  const unsigned warps = static_cast<unsigned>(ns.blocks) * (FLAT_THREADS / 32);
  const unsigned rows = static_cast<unsigned>(sl.rows);
  const FlatLane fl = flat_lane<R, INTERLEAVED>(lane);
  const int pk = fl.pk;
  Packet<WT, R::VEC> wraw{};
  if (WEIGHT != WEIGHT_NONE) wraw = load_raw<WT, R::VEC>(weight + pk * R::VEC, 1);
  float dw[R::VEC];
#pragma unroll
  for (int e = 0; e < R::VEC; ++e) dw[e] = 0.f;
  const float sign = p.sin_sign;  // -1: the rotation by -theta

  for (unsigned group = (blockIdx.x - begin) * (FLAT_THREADS / 32) + threadIdx.x / 32u;
       group * GROUP < rows; group += warps) {  // warp-uniform
    const unsigned row0 = group * GROUP + lane / R::PACKETS;
    Packet<T, R::VEC> dy[U], x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned row = row0 + u * R::PASS_ROWS;
      const i64 at = static_cast<i64>(row) * HEAD_DIM + pk * R::VEC;
      memset(&dy[u], 0, sizeof(dy[u]));
      memset(&x[u], 0, sizeof(x[u]));
      if (row < rows) {
        dy[u] = load_raw<T, R::VEC>(static_cast<const T*>(blk.x) + at, 1);
        x[u] = load_raw<T, R::VEC>(static_cast<const T*>(ns.input_data) + at, 1);
      }
    }
    const FlatPosition fp = flat_position<POS_MODE>(p, sl, row0, row0 < rows);
    float c[R::FREQS], s[R::FREQS], wv[R::VEC];
    packet_angles<R, INTERLEAVED, AngleT>(p, fp.pos, pk, fl.first_half, c, s);
    weight_values<WEIGHT>(wraw, false, wv);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned row = row0 + u * R::PASS_ROWS;
      // g = dy rotated by -theta (NaN outside the table, as the forward).
      float g[R::VEC], xf[R::VEC];
      to_floats(dy[u], g);
      rotate_packet<R, INTERLEAVED>(dy[u], g, c, s, sign, fp.inside, fl.first_half,
                                    fl.partner_lane);
      to_floats(x[u], xf);
      float sq = 0.f, dot = 0.f;
      backward_sums(xf, g, wv, sq, dot);
      sq = lane_sum<R::PACKETS>(sq, FULL_WARP);
      dot = lane_sum<R::PACKETS>(dot, FULL_WARP);
      const float rstd = 1.f / sqrtf(sq / static_cast<float>(HEAD_DIM) + p.eps);
      const float mdot = rstd * (dot / static_cast<float>(HEAD_DIM));
      const bool live = row < rows;
      float dx[R::VEC];
      input_gradient(xf, g, wv, rstd, mdot, WGRAD && live, dx, dw);
      if (live)
        store<T, R::VEC>(static_cast<T*>(blk.out) + static_cast<i64>(row) * HEAD_DIM +
                             pk * R::VEC,
                         1, dx);
    }
  }
  if constexpr (WGRAD)
    write_partial_row<R>(dw, ns.weight_partial + static_cast<i64>(blockIdx.x - begin) * HEAD_DIM);
}

// Most threads of a scope-"token" block (its launch bounds).
constexpr int NORM_FLAT_TOKEN_THREADS = 1024;

// Scope "token": a token's HEADS rows are adjacent in memory (heads
// innermost) and held by TOKEN_WARPS warps of the block (TokenHeads); a
// block holds blockDim.x / (32 * TOKEN_WARPS) tokens. A token's sum: each
// lane's item sums over its U rows, the butterfly over the warp, then the
// token's warp sums in warp order, through shared memory.
template <typename T, typename AngleT, typename WT, int HEAD_DIM, bool INTERLEAVED, int SLABS,
          int POS_MODE, int WEIGHT, bool ROUND_BEFORE, int U, int HEADS>
__global__ void __launch_bounds__(NORM_FLAT_TOKEN_THREADS)
    norm_flat_token_kernel(const NormFlatParams p) {
  using R = FlatRow<T, HEAD_DIM, INTERLEAVED>;
  using Token = TokenHeads<R, U, HEADS, NORM_FLAT_TOKEN_THREADS>;
  constexpr int TOKEN_WARPS = Token::WARPS;
  __shared__ float warp_sums[NORM_FLAT_TOKEN_THREADS / 32];
  const FlatBlock blk = flat_block<SLABS>(p);
  const FlatSlab& sl = blk.s;
  const WT* weight = static_cast<const WT*>(slab_entry<SLABS>(p.norm, blk.index).weight);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned begin = SLABS == 1 ? 0u : static_cast<unsigned>(sl.block_begin);
  const unsigned block_warp = threadIdx.x / 32u;
  const unsigned token_warp = block_warp % TOKEN_WARPS;
  const unsigned tokens_a_block = blockDim.x / (32 * TOKEN_WARPS);
  const unsigned token = (blockIdx.x - begin) * tokens_a_block + block_warp / TOKEN_WARPS;
  const unsigned rows = static_cast<unsigned>(sl.rows);
  const bool live = token * HEADS < rows;  // every thread reaches the barrier
  const FlatLane fl = flat_lane<R, INTERLEAVED>(lane);
  const int pk = fl.pk;
  const unsigned head0 = Token::head0(token_warp, lane);
  const unsigned row0 = token * HEADS + head0;

  Packet<T, R::VEC> raw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    memset(&raw[u], 0, sizeof(raw[u]));
    if (live)
      raw[u] = load_raw<T, R::VEC>(static_cast<const T*>(blk.x) +
                                       static_cast<i64>(row0 + u * R::PASS_ROWS) * HEAD_DIM +
                                       pk * R::VEC,
                                   1);
  }
  const FlatPosition fp = flat_position<POS_MODE>(p, sl, row0, live);
  float sum = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    sum += item_squares<R, INTERLEAVED>(raw[u], fl.first_half, fl.partner_lane);
    forget(raw[u]);
  }
  // Each item is counted by the lanes that share it (NeoX: both partners),
  // so the warp's butterfly runs over the lanes of distinct items only:
  // lane_sum over ITEM_LANES, then across the warp's PASS_ROWS rows.
  sum = lane_sum<R::ITEM_LANES>(sum, FULL_WARP);
#pragma unroll
  for (int o = R::PACKETS; o < 32; o <<= 1) sum += __shfl_xor_sync(FULL_WARP, sum, o);
  if (lane == 0) warp_sums[block_warp] = sum;
  __syncthreads();
  float token_sum = 0.f;
  const unsigned first_warp = block_warp - token_warp;
#pragma unroll
  for (int w = 0; w < TOKEN_WARPS; ++w) token_sum += warp_sums[first_warp + w];
  const float rstd = 1.f / sqrtf(token_sum / static_cast<float>(HEADS * HEAD_DIM) + p.eps);

  float c[R::FREQS], s[R::FREQS];
  packet_angles<R, INTERLEAVED, AngleT>(p, fp.pos, pk, fl.first_half, c, s);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const unsigned head = head0 + u * R::PASS_ROWS;
    Packet<WT, R::VEC> wraw{};
    if (WEIGHT != WEIGHT_NONE)
      wraw = load_raw<WT, R::VEC>(weight + static_cast<i64>(head) * HEAD_DIM + pk * R::VEC, 1);
    float wv[R::VEC];
    weight_values<WEIGHT>(wraw, false, wv);
    normalize_rotate_store<R, INTERLEAVED, ROUND_BEFORE>(
        raw[u], rstd, wv, c, s, fp.inside, fl.first_half, fl.partner_lane,
        static_cast<T*>(blk.out) + static_cast<i64>(row0 + u * R::PASS_ROWS) * HEAD_DIM +
            pk * R::VEC,
        live);
  }
}

// A token's two backward sums (x^2 and dn * x; a block is one token): the
// warp's butterfly, then the token's warp sums in warp order, the same on
// every thread.
template <int TOKEN_WARPS>
__device__ __forceinline__ void token_sums(float& sq, float& dot,
                                           float (&warp_sums)[2][TOKEN_WARPS],
                                           unsigned token_warp, unsigned lane) {
  sq = lane_sum<32>(sq, FULL_WARP);
  dot = lane_sum<32>(dot, FULL_WARP);
  if (lane == 0) warp_sums[0][token_warp] = sq, warp_sums[1][token_warp] = dot;
  __syncthreads();
  sq = 0.f, dot = 0.f;
#pragma unroll
  for (int w = 0; w < TOKEN_WARPS; ++w) sq += warp_sums[0][w], dot += warp_sums[1][w];
  __syncthreads();  // read before the next token's sums are written
}

// A block's weight-gradient partial row (scope "token"): every channel of
// the token belongs to one thread, which writes its U packets' sums.
template <class R, int U, int HEAD_DIM>
__device__ __forceinline__ void write_token_partial(const float (&dw)[U][R::VEC], float* partial,
                                                    unsigned head0, int pk) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < R::VEC; ++e)
      partial[static_cast<i64>(head0 + u * R::PASS_ROWS) * HEAD_DIM + pk * R::VEC + e] =
          dw[u][e];
}

// Most threads of a scope-"token" backward block (its launch bounds: a
// thread holds dy, x, g and its channels' weight-gradient sums).
constexpr int NORM_FLAT_TOKEN_BACKWARD_THREADS = 512;

// Scope "token", backward: as norm_flat_backward_kernel, with a token's
// HEADS rows held as norm_flat_token_kernel holds them (a block is one
// token's TOKEN_WARPS warps) and its two sums (x^2 and dn * x) taken over
// the warp, then the token's warp sums in warp order. NormSlab::blocks
// blocks walk the slab's tokens in a fixed order; a thread's channels are
// the same for every token, so it keeps their weight-gradient sums and
// writes them into the block's partial row at the end.
template <typename T, typename AngleT, typename WT, int HEAD_DIM, bool INTERLEAVED, int SLABS,
          int POS_MODE, int WEIGHT, bool WGRAD, int U, int HEADS>
__global__ void __launch_bounds__(NORM_FLAT_TOKEN_BACKWARD_THREADS)
    norm_flat_token_backward_kernel(const NormFlatParams p) {
  using R = FlatRow<T, HEAD_DIM, INTERLEAVED>;
  using Token = TokenHeads<R, U, HEADS, NORM_FLAT_TOKEN_BACKWARD_THREADS>;
  constexpr int TOKEN_WARPS = Token::WARPS;
  __shared__ float warp_sums[2][TOKEN_WARPS];
  const FlatBlock blk = flat_block<SLABS>(p);
  const FlatSlab& sl = blk.s;
  // Picked here, not through slab_entry: as a helper's result the backward
  // compiles to a schedule with fewer loads in flight (docs/performance.md).
  NormSlab ns = p.norm[0];
#pragma unroll
  for (int i = 1; i < SLABS; ++i)
    if (i == blk.index) ns = p.norm[i];
  const WT* weight = static_cast<const WT*>(ns.weight);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned begin = SLABS == 1 ? 0u : static_cast<unsigned>(sl.block_begin);
  const unsigned token_warp = threadIdx.x / 32u;
  const unsigned tokens = static_cast<unsigned>(sl.rows) / HEADS;
  const FlatLane fl = flat_lane<R, INTERLEAVED>(lane);
  const int pk = fl.pk;
  const unsigned head0 = Token::head0(token_warp, lane);
  const float sign = p.sin_sign;  // -1: the rotation by -theta
  float dw[U][R::VEC] = {};

  for (unsigned token = blockIdx.x - begin; token < tokens;
       token += static_cast<unsigned>(ns.blocks)) {  // block-uniform
    const unsigned row0 = token * HEADS + head0;
    Packet<T, R::VEC> dy[U], x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 at = static_cast<i64>(row0 + u * R::PASS_ROWS) * HEAD_DIM + pk * R::VEC;
      dy[u] = load_raw<T, R::VEC>(static_cast<const T*>(blk.x) + at, 1);
      x[u] = load_raw<T, R::VEC>(static_cast<const T*>(ns.input_data) + at, 1);
    }
    const FlatPosition fp = flat_position<POS_MODE>(p, sl, row0, true);
    float c[R::FREQS], s[R::FREQS];
    packet_angles<R, INTERLEAVED, AngleT>(p, fp.pos, pk, fl.first_half, c, s);
    float g[U][R::VEC], wv[U][R::VEC];
    float sq = 0.f, dot = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Packet<WT, R::VEC> wraw{};
      if (WEIGHT != WEIGHT_NONE)
        wraw = load_raw<WT, R::VEC>(
            weight + static_cast<i64>(head0 + u * R::PASS_ROWS) * HEAD_DIM + pk * R::VEC, 1);
      weight_values<WEIGHT>(wraw, false, wv[u]);
      to_floats(dy[u], g[u]);
      rotate_packet<R, INTERLEAVED>(dy[u], g[u], c, s, sign, fp.inside, fl.first_half,
                                    fl.partner_lane);
      float xf[R::VEC];
      to_floats(x[u], xf);
      backward_sums(xf, g[u], wv[u], sq, dot);
    }
    token_sums(sq, dot, warp_sums, token_warp, lane);
    constexpr float N_ROW = static_cast<float>(HEADS * HEAD_DIM);
    const float rstd = 1.f / sqrtf(sq / N_ROW + p.eps);
    const float mdot = rstd * (dot / N_ROW);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float xf[R::VEC], dx[R::VEC];
      to_floats(x[u], xf);
      input_gradient(xf, g[u], wv[u], rstd, mdot, WGRAD, dx, dw[u]);
      store<T, R::VEC>(static_cast<T*>(blk.out) +
                           static_cast<i64>(row0 + u * R::PASS_ROWS) * HEAD_DIM + pk * R::VEC,
                       1, dx);
    }
  }
  if constexpr (WGRAD)
    write_token_partial<R, U, HEAD_DIM>(
        dw, ns.weight_partial + static_cast<i64>(blockIdx.x - begin) * HEADS * HEAD_DIM, head0,
        pk);
}

}  // namespace rope
