// RMSNorm of q and k fused with the rotation (apply_qk_norm_rope), forward
// and backward, and the deterministic reduction of the weight gradients.
//
// A row is what one RMSNorm normalizes: one head of one token (SCOPE_HEAD,
// n = HEAD_DIM channels) or all heads of one token (SCOPE_TOKEN, n = heads *
// HEAD_DIM). In fp32, for each row:
//   rstd = 1 / sqrt(mean(x^2) + eps),  x_hat = x * rstd,
//   w' = w, 1 + w, or 1 (WEIGHT),
//   y = round(round(x_hat) * w') (ROUND_BEFORE) or round(x_hat * w'),
// with round() to x's storage type; then y is rotated exactly as rope_kernel
// rotates (kernels/rope.cu: the first ROTARY_DIM channels in NeoX or GPT-J
// pairs; the tail channels are written unrotated, in place too).
// Backward, from the output gradient dy, the input x and the weights:
//   g = rotate(dy, -theta),  dn = g * w',
//   dx = rstd * (dn - x_hat * mean(dn * x_hat))   (over the row),
//   dw += g * x_hat  (over every row; per channel, or per head and channel).
// mean(dn * x_hat) = rstd * mean(dn * x): both row sums come from one
// reduction.
//
// Thread layout (cupy_rope/norm_launch.py picks the sizes), as rope_kernel's
// with whole rows per thread group:
//   threadIdx.x: LANES lanes over one head's items (a rotating item holds
//                PAIRS pairs, a tail item TAIL_VEC channels); a lane holds K
//                items, so that a row is reduced by the threads that hold it
//                (a shuffle over the LANES lanes, a power of two <= 32).
//   threadIdx.y: head lane (of the slab's head_lanes, which divide
//                blockDim.y; the lanes beyond take further tokens); U heads
//                per pass. SCOPE_TOKEN: one pass covers every head of the
//                token, and the head lanes' sums meet in shared memory.
//   threadIdx.z: token lane.
//   blockIdx.x:  slab and unit (token block x head group). NormSlab::blocks
//                blocks walk a slab's units in a fixed order (a block per
//                unit for small calls), each asking L2 for its next unit's
//                rows while it works on one. Backward: each block's weight
//                gradient partial sums, and their reduction
//                (weight_grad_reduce), are then the same bits on every run.
#include "norm_items.cuh"

namespace rope {

constexpr int NORM_THREADS = 256;  // threads per block (cupy_rope/norm_launch.py NORM_THREADS)
// Backward: the most weight gradient sums per thread kept in shared memory
// (a row of NORM_THREADS floats each; static shared memory stays < 48 KB).
constexpr int MAX_SHARED_SUMS = 32;
enum NormScope : int { SCOPE_HEAD = 0, SCOPE_TOKEN = 1 };

// norm_rope_kernel's parameters: the rope Params (the slabs of x and out,
// the angle source and positions), then the norm's.
struct NormParams : Params {
  NormSlab norm[MAX_SLABS];
  float eps;
  float pad2_;
};

// SCOPE_TOKEN: the N sums of each token's head lanes (lane sums already
// taken), in head-lane order. Called by every thread of the block.
template <int N>
__device__ __forceinline__ void token_sum(float (&s)[N], float (&red)[N][NORM_THREADS], int slot,
                                          int head_lane, int lanes) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) red[n][slot + head_lane] = s[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float t = 0.f;
    for (int j = 0; j < lanes; ++j) t += red[n][slot + j];
    s[n] = t;
  }
  __syncthreads();
}

// Where this thread works in one unit of its slab.
struct UnitPlace {
  i64 first;  // the block's first token
  i64 token;  // this thread's token (live) or `first` (a lane past the end)
  bool live;
  i64 outer, inner;
  int h_begin, h_end;  // the unit's heads
};

__device__ __forceinline__ UnitPlace unit_place(const Params& p, const Slab& sl, i64 unit,
                                                int token_lane, int block_tokens) {
  UnitPlace u;
  const i64 group = unit / sl.token_blocks;
  u.first = (unit - group * sl.token_blocks) * block_tokens;
  const i64 n_tokens = p.n_outer * p.n_inner;
  const i64 token = u.first + token_lane;
  u.live = token < n_tokens;
  u.token = u.live ? token : u.first;
  u.outer = p.n_outer == 1 ? 0 : u.token / p.n_inner;
  u.inner = u.token - u.outer * p.n_inner;
  u.h_begin = static_cast<int>(group * sl.heads_per_block);
  u.h_end = min(static_cast<int>(sl.n_heads), u.h_begin + static_cast<int>(sl.heads_per_block));
  return u;
}

// cos and sin of the pairs of this lane's rotating items at the token's position.
template <int SOURCE, typename AngleT, int PAIRS, bool TABLE_STRIDED, int POS_MODE, int K,
          int LANES, int ROT>
__device__ __forceinline__ void item_angles(const Params& p, const UnitPlace& u, i64 seq,
                                            float (&c)[K][PAIRS], float (&s)[K][PAIRS]) {
  if constexpr (POS_MODE == AXES) {
    i64 pos[3];
    token_axis_positions(p, u.outer, u.inner, pos);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * LANES;
      if (i < ROT) axis_angles<SOURCE, AngleT, PAIRS>(p, pos, i * PAIRS, c[k], s[k]);
    }
  } else {
    i64 pos = 0;
    const bool valid = token_position<POS_MODE>(p, u.token, u.outer, u.inner, seq, pos);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * LANES;
      if (i < ROT) angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED>(p, pos, valid, i * PAIRS, c[k], s[k]);
    }
  }
}

// The slab of this block and its norm part, selected with compile-time indices.
struct NormBlockSlab {
  BlockSlab b;
  NormSlab n;
};

__device__ __forceinline__ NormBlockSlab norm_block_slab(const NormParams& p) {
  const int k = block_slab_index(p);
  NormBlockSlab r{BlockSlab{p.slab[0], p.x_data[0], p.out_data[0]}, p.norm[0]};
#pragma unroll
  for (int i = 1; i < MAX_SLABS; ++i)
    if (k == i) r = NormBlockSlab{BlockSlab{p.slab[i], p.x_data[i], p.out_data[i]}, p.norm[i]};
  return r;
}

// Backward: the block's weight gradient sums, one row per sum a thread
// holds (element tid of a row is thread tid's), reduced over the threads
// that hold the same channels (tid equal modulo `owners`) in a fixed tree,
// then written by the owners into the block's row of weight_partial. Every
// element of that row is written (0 where no thread had work), so the
// workspace needs no clearing.
template <class L, int LANES, int K, int HEAD_DIM, int SCOPE, int ROWS>
__device__ __forceinline__ void reduce_rows(float (&rows)[ROWS][NORM_THREADS], int e0, int n_acc,
                                            float* partial, int owners, int head_lane, int lanes,
                                            int n_heads) {
  constexpr int W = L::W;
  const int tid = block_thread_index();
  // Threads tid, tid + owners, tid + 2 owners, ... hold the same channels:
  // a tree over those groups (the block is a whole number of them).
  const int groups = blockDim.x * blockDim.y * blockDim.z / owners;
  const int group = tid / owners;
  int top = 1;
  while (top < groups) top <<= 1;
  __syncthreads();
  for (int st = top / 2; st >= 1; st >>= 1) {
    if (group < st && group + st < groups) {
#pragma unroll
      for (int j = 0; j < ROWS; ++j)
        if (e0 + j < n_acc) rows[j][tid] += rows[j][tid + st * owners];
    }
    __syncthreads();
  }
  if (tid < owners) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int idx = e0 + j;
      if (idx >= n_acc) continue;
      const int a = idx / (K * W), k = (idx / W) % K, e = idx % W;
      const int c = L::channel(threadIdx.x + k * LANES, e);
      const int h = head_lane + a * lanes;
      if (c >= 0 && (SCOPE == SCOPE_HEAD || h < n_heads))
        partial[(SCOPE == SCOPE_TOKEN ? h * HEAD_DIM : 0) + c] = rows[j][tid];
    }
  }
  __syncthreads();
}

// write_partial for sums held in registers: through shared memory CHUNK at a time.
template <class L, int LANES, int K, int HEAD_DIM, int SCOPE, int N>
__device__ __forceinline__ void write_partial(const float (&acc)[N], float* partial, int owners,
                                              int head_lane, int lanes, int n_heads) {
  constexpr int CHUNK = 8;
  __shared__ float buf[CHUNK][NORM_THREADS];
  const int tid = block_thread_index();
#pragma unroll
  for (int e0 = 0; e0 < N; e0 += CHUNK) {
#pragma unroll
    for (int j = 0; j < CHUNK; ++j)
      if (e0 + j < N) buf[j][tid] = acc[e0 + j];
    reduce_rows<L, LANES, K, HEAD_DIM, SCOPE>(buf, e0, N, partial, owners, head_lane, lanes,
                                              n_heads);
  }
}

template <typename T, typename AngleT, typename WT, int HEAD_DIM, int ROTARY_DIM, bool INTERLEAVED,
          int SOURCE, int PAIRS, int TAIL_VEC, bool STRIDED, bool TABLE_STRIDED, int POS_MODE,
          int SCOPE, int WEIGHT, bool WEIGHT_VEC, bool ROUND_BEFORE, int LANES, int K, int U,
          bool BACKWARD, bool WGRAD, int MIN_BLOCKS>
__global__ void __launch_bounds__(NORM_THREADS, MIN_BLOCKS) norm_rope_kernel(const NormParams p) {
  using L = ItemLayout<HEAD_DIM, ROTARY_DIM, INTERLEAVED, PAIRS, TAIL_VEC>;
  constexpr int W = L::W;
  static_assert(HEAD_DIM % 2 == 0 && ROTARY_DIM % 2 == 0 && ROTARY_DIM <= HEAD_DIM, "dims");
  static_assert(L::HALF % PAIRS == 0, "PAIRS divides rotary_dim / 2");
  static_assert((HEAD_DIM - ROTARY_DIM) % TAIL_VEC == 0 && TAIL_VEC <= W, "TAIL_VEC");
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: 2^k <= 32");
  static_assert(LANES * K >= L::ITEMS, "the lanes hold every item");
  static_assert(!WGRAD || (BACKWARD && WEIGHT != WEIGHT_NONE), "weight gradients");
  constexpr int ACC_U = SCOPE == SCOPE_TOKEN ? U : 1;
  constexpr int ACC_N = ACC_U * K * W;  // weight gradient sums per thread
  // Where they fit, the sums live in shared memory (a row per sum, a column
  // per thread) rather than in registers, which the data of a pass needs.
  constexpr bool ACC_SHARED = WGRAD && ACC_N <= MAX_SHARED_SUMS;

  const auto [bs, ns] = norm_block_slab(p);
  const Slab& sl = bs.sl;
  const int lanes = static_cast<int>(sl.head_lanes);  // divides blockDim.y
  const int mult = blockDim.y / lanes;  // tokens per z lane
  const int head_lane = threadIdx.y % lanes;
  const int token_lane = threadIdx.z * mult + threadIdx.y / lanes;
  const int block_tokens = blockDim.z * mult;
  const bool grouped = sl.heads_per_group < sl.n_heads;
  const int per_group = static_cast<int>(sl.heads_per_group);
  const i64 xd = STRIDED ? sl.x.stride_dim : 1, od = STRIDED ? sl.out.stride_dim : 1;
  const i64 id = STRIDED ? ns.input.stride_dim : 1;
  const unsigned mask = warp_mask();
  const WT* weight = static_cast<const WT*>(ns.weight);
  const float n_row = static_cast<float>(SCOPE == SCOPE_TOKEN ? sl.n_heads * HEAD_DIM : HEAD_DIM);

  // A slab that does not rotate (v of a packed projection) is copied as it is.
  const bool copy_only = sl.rotate == 0;
  // A weight item: its channels as x's (one packet per run of channels
  // where WEIGHT_VEC, else element by element). 0 items for a copied slab.
  const bool weighted = WEIGHT != WEIGHT_NONE && !copy_only;
  auto weight_item = [&](const WT* w, int k) {
    return load_item<WT, L, INTERLEAVED, PAIRS, TAIL_VEC, !WEIGHT_VEC>(
        w, 1, weighted ? static_cast<int>(threadIdx.x) + k * LANES : L::ITEMS);
  };
  // SCOPE_HEAD: every head of this thread uses the same channels' weights.
  Packet<WT, W> wh[K];
  if constexpr (SCOPE == SCOPE_HEAD) {
#pragma unroll
    for (int k = 0; k < K; ++k) wh[k] = weight_item(weight, k);
  }
  __shared__ float acc_shared[ACC_SHARED ? ACC_N : 1][NORM_THREADS];
  float acc[WGRAD && !ACC_SHARED ? ACC_N : 1];
#pragma unroll
  for (int a = 0; a < ACC_N; ++a) {
    if constexpr (ACC_SHARED)
      acc_shared[a][block_thread_index()] = 0.f;
    else if constexpr (WGRAD)
      acc[a] = 0.f;
  }

  __shared__ int seq_of_lane[NORM_THREADS];
  __shared__ float red[2][NORM_THREADS];
  const i64 n_tokens = p.n_outer * p.n_inner;
  for (i64 unit = blockIdx.x - sl.block_begin; unit < ns.units; unit += ns.blocks) {
    const UnitPlace up = unit_place(p, sl, unit, token_lane, block_tokens);
    if constexpr (POS_MODE == VARLEN) {
      __syncthreads();  // the previous unit's readers are done
      find_block_sequences(p, up.first, min(up.first + block_tokens, n_tokens) - 1, block_tokens,
                           seq_of_lane);
      __syncthreads();
    }
    const T* x = static_cast<const T*>(bs.x_data) + up.outer * sl.x.stride_outer +
                 up.inner * sl.x.stride_inner;
    T* out = static_cast<T*>(bs.out_data) + up.outer * sl.out.stride_outer +
             up.inner * sl.out.stride_inner;
    const T* in = BACKWARD ? static_cast<const T*>(ns.input_data) + up.outer * ns.input.stride_outer +
                                 up.inner * ns.input.stride_inner
                           : nullptr;
    float c[K][PAIRS], s[K][PAIRS];
    bool have_angles = false;
    for (int h0 = up.h_begin; h0 < up.h_end; h0 += lanes * U) {
      // Loads of the pass's heads (x, or dy and x), then the angles, so that
      // the position and table reads overlap them.
      Packet<T, W> raw[U][K], raw_x[BACKWARD ? U : 1][K];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int h = h0 + head_lane + u * lanes;
        ok[u] = h < up.h_end;
        const int hh = ok[u] ? h : up.h_begin;  // a real head; its values are not used
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int i = ok[u] ? static_cast<int>(threadIdx.x) + k * LANES : L::ITEMS;  // zeros
          raw[u][k] = load_item<T, L, INTERLEAVED, PAIRS, TAIL_VEC, STRIDED>(
              x + head_offset(sl.x, hh, grouped, per_group), xd, i);
          if constexpr (BACKWARD)
            raw_x[u][k] = load_item<T, L, INTERLEAVED, PAIRS, TAIL_VEC, STRIDED>(
                in + head_offset(ns.input, hh, grouped, per_group), id, i);
        }
      }
      // The next unit's first pass, as this thread will load it.
      if (h0 == up.h_begin && unit + ns.blocks < ns.units) {
        const UnitPlace next = unit_place(p, sl, unit + ns.blocks, token_lane, block_tokens);
        const T* nx = static_cast<const T*>(bs.x_data) + next.outer * sl.x.stride_outer +
                      next.inner * sl.x.stride_inner;
        const T* ni = BACKWARD ? static_cast<const T*>(ns.input_data) +
                                     next.outer * ns.input.stride_outer +
                                     next.inner * ns.input.stride_inner
                               : nullptr;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int h = next.h_begin + head_lane + u * lanes;
          if (h >= next.h_end || !next.live) continue;
#pragma unroll
          for (int k = 0; k < K; ++k) {
            const int i = threadIdx.x + k * LANES;
            prefetch_item<T, L, INTERLEAVED, PAIRS>(nx + head_offset(sl.x, h, grouped, per_group),
                                                    xd, i);
            if constexpr (BACKWARD)
              prefetch_item<T, L, INTERLEAVED, PAIRS>(
                  ni + head_offset(ns.input, h, grouped, per_group), id, i);
          }
        }
      }
      if (!have_angles) {
        const i64 seq = POS_MODE == VARLEN ? seq_of_lane[token_lane] : 0;
        item_angles<SOURCE, AngleT, PAIRS, TABLE_STRIDED, POS_MODE, K, LANES, L::ROT>(
            p, up, seq, c, s);
        have_angles = true;
      }
      // The values of item k of head u: x (forward), or g = dy rotated by
      // -theta (Params::sin_sign is -1) and x (backward).
      auto values = [&](int u, int k, float (&v)[W], float (&xf)[W]) {
        to_floats(raw[u][k], v);
        if constexpr (BACKWARD) {
          rotate_item<L, INTERLEAVED, PAIRS>(threadIdx.x + k * LANES, v, c[k], s[k]);
          to_floats(raw_x[u][k], xf);
        }
      };
      // The weights of the pass's heads (SCOPE_TOKEN; SCOPE_HEAD: the
      // thread's own channels, loaded once), and w' of item k of head u.
      constexpr int WU = SCOPE == SCOPE_TOKEN ? U : 1;
      Packet<WT, W> wp[WU][K];
#pragma unroll
      for (int u = 0; u < WU; ++u) {
        const int h = min(h0 + head_lane + u * lanes, up.h_end - 1);
#pragma unroll
        for (int k = 0; k < K; ++k)
          wp[u][k] = SCOPE == SCOPE_TOKEN ? weight_item(weight + h * HEAD_DIM, k) : wh[k];
      }
      auto weights = [&](int u, int k, float (&wv)[W]) {
        weight_values<WEIGHT>(wp[SCOPE == SCOPE_TOKEN ? u : 0][k], copy_only, wv);
      };
      // Row sums: sum x^2, and (backward) sum g * w' * x.
      float sums[U][2];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        sums[u][0] = sums[u][1] = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          float v[W], xf[W], wv[W];
          values(u, k, v, xf);
          if constexpr (BACKWARD) weights(u, k, wv);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            if constexpr (BACKWARD) {
              sums[u][0] = fmaf(xf[e], xf[e], sums[u][0]);
              sums[u][1] = fmaf(v[e] * wv[e], xf[e], sums[u][1]);
            } else {
              sums[u][0] = fmaf(v[e], v[e], sums[u][0]);
            }
          }
        }
      }
      if constexpr (SCOPE == SCOPE_TOKEN) {
        float t[2] = {0.f, 0.f};
#pragma unroll
        for (int u = 0; u < U; ++u) t[0] += sums[u][0], t[1] += sums[u][1];
        t[0] = lane_sum<LANES>(t[0], mask);
        if constexpr (BACKWARD) t[1] = lane_sum<LANES>(t[1], mask);
        token_sum<2>(t, red, token_lane * lanes, head_lane, lanes);
#pragma unroll
        for (int u = 0; u < U; ++u) sums[u][0] = t[0], sums[u][1] = t[1];
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          sums[u][0] = lane_sum<LANES>(sums[u][0], mask);
          if constexpr (BACKWARD) sums[u][1] = lane_sum<LANES>(sums[u][1], mask);
        }
      }
      // Normalize, weight, rotate (forward) or take the gradients (backward); store.
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          forget(raw[u][k]);
          if constexpr (BACKWARD) forget(raw_x[u][k]);
          if constexpr (SCOPE == SCOPE_TOKEN) forget(wp[u][k]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int h = h0 + head_lane + u * lanes;
        const float rstd = 1.f / sqrtf(sums[u][0] / n_row + p.eps);
        const float mdot = rstd * (sums[u][1] / n_row);  // mean(dn * x_hat)
        const bool write = ok[u] && up.live;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int i = threadIdx.x + k * LANES;
          float v[W], xf[W], wv[W], y[W];
          values(u, k, v, xf);
          weights(u, k, wv);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            if constexpr (BACKWARD) {
              const float x_hat = xf[e] * rstd;
              y[e] = rstd * fmaf(-x_hat, mdot, v[e] * wv[e]);
              if constexpr (WGRAD) {
                const int idx = ((SCOPE == SCOPE_TOKEN ? u : 0) * K + k) * W + e;
                float& a = ACC_SHARED ? acc_shared[idx][block_thread_index()] : acc[idx];
                if (write) a = fmaf(v[e], x_hat, a);
              }
            } else {
              float x_hat = v[e] * rstd;
              if constexpr (ROUND_BEFORE) x_hat = to_float(from_float<T>(x_hat));
              y[e] = copy_only ? v[e] : to_float(from_float<T>(x_hat * wv[e]));
            }
          }
          if (!BACKWARD && !copy_only) rotate_item<L, INTERLEAVED, PAIRS>(i, y, c[k], s[k]);
          if (write)
            store_item<T, L, INTERLEAVED, PAIRS, TAIL_VEC, STRIDED>(
                out + head_offset(sl.out, h, grouped, per_group), od, i, y);
        }
      }
    }
  }
  if constexpr (WGRAD) {
    const int owners = LANES * (SCOPE == SCOPE_TOKEN ? lanes : 1);
    float* partial = ns.weight_partial + (blockIdx.x - sl.block_begin) * ns.weight_len;
    if constexpr (ACC_SHARED)
      reduce_rows<L, LANES, K, HEAD_DIM, SCOPE>(acc_shared, 0, ACC_N, partial, owners, head_lane,
                                                lanes, static_cast<int>(sl.n_heads));
    else
      write_partial<L, LANES, K, HEAD_DIM, SCOPE>(acc, partial, owners, head_lane, lanes,
                                                  static_cast<int>(sl.n_heads));
  }
}

// The weight gradients from norm_rope_kernel's per-block partial sums:
// grad[slab][c] = sum over b of partial[slab][b][c], summed in a fixed
// order (REDUCE_ROWS strided partial sums, then those in order), so that
// the result is the same bits on every run. blockIdx.y: the slab;
// threadIdx.x: REDUCE_COLS channels of blockIdx.x's run.
constexpr int REDUCE_COLS = 32;
constexpr int REDUCE_ROWS = 32;

struct ReduceParams {
  const float* partial[MAX_SLABS];  // [blocks, len]
  void* grad[MAX_SLABS];            // [len], WT
  i64 blocks[MAX_SLABS];
  i64 len[MAX_SLABS];
};

template <typename WT>
__global__ void __launch_bounds__(REDUCE_COLS * REDUCE_ROWS) weight_grad_reduce(const ReduceParams p) {
  __shared__ float rows[REDUCE_ROWS][REDUCE_COLS];
  const float* partial = p.partial[0];
  WT* grad = static_cast<WT*>(p.grad[0]);
  i64 blocks = p.blocks[0], len = p.len[0];
#pragma unroll
  for (int i = 1; i < MAX_SLABS; ++i) {
    if (blockIdx.y == i) {
      partial = p.partial[i], grad = static_cast<WT*>(p.grad[i]);
      blocks = p.blocks[i], len = p.len[i];
    }
  }
  const i64 col = static_cast<i64>(blockIdx.x) * REDUCE_COLS + threadIdx.x;
  if (static_cast<i64>(blockIdx.x) * REDUCE_COLS >= len) return;  // block-uniform
  float t = 0.f;
  if (col < len)
    for (i64 b = threadIdx.y; b < blocks; b += REDUCE_ROWS) t += partial[b * len + col];
  rows[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y == 0 && col < len) {
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < REDUCE_ROWS; ++r) sum += rows[r][threadIdx.x];
    grad[col] = from_float<WT>(sum);
  }
}

}  // namespace rope
