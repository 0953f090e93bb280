// The launch parameters, passed by value as the kernel's single argument.
//
// cupy_rope/launch.py builds the same struct with the struct module; the two
// must list the same fields in the same order (a CPU test checks it). Every
// field is 8 bytes wide (the float sits in an 8-byte slot) so that both
// sides agree on the layout.
//
// The structs start with the values that change from call to call (data
// pointers and the scalar position offset, CallData): the launcher keeps
// one packed copy per call signature and rewrites only that leading block
// per call.
#pragma once
#include "dtype.cuh"

namespace rope {

constexpr int MAX_SLABS = 3;  // q, k, v

// Strides (in elements) of one [tokens, heads, head_dim] slab. Tokens are
// addressed by two indices (outer, inner) so that bshd, sbhd, thd and any
// permuted or sliced view map onto one kernel. Heads are addressed in groups
// so that packed QKV layouts with several q heads per kv group work without
// copies: head j sits at (j / heads_per_group) * stride_group +
// (j % heads_per_group) * stride_head.
struct View {
  i64 stride_outer;
  i64 stride_inner;
  i64 stride_group;
  i64 stride_head;
  i64 stride_dim;
};

// One tensor of the launch (q, k or v) and the blocks that handle it:
// blockIdx.x in [block_begin, block_begin + token_blocks * head groups). A
// block of this slab uses head_lanes of the blockDim.y lanes for heads and
// the rest for more tokens, so that a slab with few heads (k under GQA)
// still gives every thread several heads to load at once.
struct Slab {
  View x;
  View out;
  i64 block_begin;
  i64 token_blocks;     // blocks along the tokens
  i64 head_lanes;       // divides blockDim.y
  i64 heads_per_block;  // heads of one head group (a multiple of head_lanes)
  i64 n_heads;
  i64 heads_per_group;  // >= n_heads for a plain (ungrouped) head axis
  i64 rotate;           // 0: copy the heads unchanged (v of a fused QKV split)
  // packet_kernel: row / n_heads as (row * head_mul) >> head_shift
  // (divide() below).
  i64 head_mul;
  i64 head_shift;
  // packet_kernel: 1 walks rows (outer, head, inner) instead of (outer,
  // inner, head): x stores heads outside the inner token axis.
  i64 head_major;
};

// The leading block of every kernel's parameters: what changes from call to
// call (data pointers and the scalar offset). Params and FlatParams both
// start with it, so the launcher packs it the same way for every kernel.
struct CallData {
  const void* x_data[MAX_SLABS];
  void* out_data[MAX_SLABS];  // equal to x_data when rotating in place
  // Angle source. TABLE: cos and sin tables [max_position, rotary_dim / 2].
  // FREQS: angles [max_position, rotary_dim / 2] in `cos`.
  // INV_FREQ: inv_freq [rotary_dim / 2] in `cos`.
  const void* cos;
  const void* sin;
  const void* positions;  // explicit positions (POS_MODE == EXPLICIT)
  const void* offsets;    // per batch entry (or per sequence for VARLEN); may be null
  const int* cu_seqlens;  // [n_seqs + 1] (POS_MODE == VARLEN)
  i64 offset;             // added to every position
};

// rope_kernel's and packet_kernel's parameters: the per-call block, then
// what is fixed for a call signature.
struct Params : CallData {
  Slab slab[MAX_SLABS];
  i64 n_slabs;

  i64 cos_stride_row;
  i64 sin_stride_row;
  i64 cos_stride_col;  // 1 on the vector path
  i64 sin_stride_col;
  i64 max_position;  // rows in the tables; positions outside give NaN

  // Position of token (outer, inner), see kernels/positions.cuh.
  i64 pos_stride_outer;
  i64 pos_stride_inner;
  i64 pos_is_64;  // positions are int64 (else int32)
  i64 off_stride_outer;
  i64 off_stride_inner;
  i64 off_is_64;
  i64 seq_stride_outer;  // sequence index = outer * seq_stride_outer
  i64 seq_stride_inner;  //                + inner * seq_stride_inner
  i64 pos_stride_axis;   // AXES: positions[axis, ...] (M-RoPE, axial)
  i64 n_axes;            // AXES: 1..3 position axes
  i64 section[3];        // AXES: frequencies per axis (contiguous sections)
  i64 sections_interleaved;  // AXES: Qwen3-VL's interleaved assignment (3 axes)
  i64 n_seqs;            // VARLEN: sequences in cu_seqlens
  i64 cp_size;           // context parallel: 1 = off
  i64 cp_rank;
  i64 cp_chunk;  // IMPLIED with cp_size > 1: local sequence length / 2

  i64 n_outer;
  i64 n_inner;
  i64 inner_mul;  // packet_kernel: token / n_inner, as head_mul above
  i64 inner_shift;

  float sin_sign;  // +1 forward, -1 backward (rotation by -theta)
  float pad_;
};

// flat_kernel's parameters (kernels/flat.cu): the per-call block, then
// only what flat_kernel reads (it takes no offsets array or cu_seqlens,
// which stay null; positions only for EXPLICIT). A launch carries its whole
// parameter block, so a smaller block launches faster (docs/performance.md,
// "parameter block").
struct FlatSlab {
  i64 block_begin;
  // Head rows of this slab, and a row's sequence index as
  // (row / rows_per_step) % seq_len with both divisions by host-made
  // reciprocals (seq_len 0: no modulo).
  i64 rows;
  i64 step_mul;
  i64 step_shift;
  i64 seq_len;
  i64 seq_mul;
  i64 seq_shift;
};

struct FlatParams : CallData {
  FlatSlab slab[MAX_SLABS];
  i64 n_slabs;
  i64 cos_stride_row;
  i64 sin_stride_row;
  i64 max_position;
  // EXPLICIT (kernels/flat.cu POS_MODE): positions[index * pos_stride],
  // int64 if pos_is_64 else int32.
  i64 pos_stride;
  i64 pos_is_64;
  float sin_sign;
  // 0 on every call (the launcher writes it): flat_kernel ANDs it with the
  // data it loaded to make its table addresses wait for that data
  // (LATE_TABLES, kernels/flat.cu). A runtime value, so the compiler cannot
  // drop the dependency.
  unsigned zero;
};

// floor(n / d) for n < 2^31, with (mul, shift) from cupy_rope/launch.py
// `reciprocal(d)` (packet_kernel, flat_kernel): mul = floor(2^shift / d) + 1, shift = 31 + ceil(log2 d).
// The error of mul is below d / 2^shift, so n * mul / 2^shift stays below
// the next integer for every n < 2^31. (0, 0) gives 0.
__device__ __forceinline__ unsigned divide(unsigned n, i64 mul, i64 shift) {
  return static_cast<unsigned>((static_cast<unsigned long long>(n) *
                                static_cast<unsigned long long>(mul)) >> shift);
}

// Element offset of head j in a view: heads_per_group >= n_heads (grouped
// false) for a plain head axis, else packed QKV groups of heads_per_group
// heads. (Head counts are below 2^30: cupy_rope/launch.py checks.)
__device__ __forceinline__ i64 head_offset(const View& v, int j, bool grouped, int per_group) {
  if (!grouped) return static_cast<i64>(j) * v.stride_head;
  const int g = static_cast<unsigned>(j) / static_cast<unsigned>(per_group);
  return static_cast<i64>(g) * v.stride_group + static_cast<i64>(j - g * per_group) * v.stride_head;
}

// The slab of this block (block-uniform) and its data pointers: slab k
// covers blockIdx.x from slab[k].block_begin on. Selected with compile-time
// indices only, so the parameter struct is never copied to local memory
// (and only the fields a kernel reads are kept).
struct BlockSlab {
  Slab sl;
  const void* x_data;
  void* out_data;
};

// Slabs a kernel compiled for SLABS may see: SLABS, the call's count when
// the kernel is compiled for it (flat_kernel), else (0: rope_kernel and
// packet_kernel) any count up to MAX_SLABS.
__host__ __device__ constexpr int slab_bound(int slabs) { return slabs ? slabs : MAX_SLABS; }

// The slab of this block (block-uniform): Params or FlatParams. With SLABS 0,
// p.n_slabs says how many there are; with one slab, 0 at compile time.
template <int SLABS = 0, typename P>
__device__ __forceinline__ int block_slab_index(const P& p) {
  int k = 0;
#pragma unroll
  for (int i = 1; i < slab_bound(SLABS); ++i)
    if ((SLABS || i < p.n_slabs) && blockIdx.x >= p.slab[i].block_begin) k = i;
  return k;
}

__device__ __forceinline__ BlockSlab block_slab(const Params& p) {
  const int k = block_slab_index(p);
  BlockSlab b{p.slab[0], p.x_data[0], p.out_data[0]};
#pragma unroll
  for (int i = 1; i < MAX_SLABS; ++i)
    if (k == i) b = BlockSlab{p.slab[i], p.x_data[i], p.out_data[i]};
  return b;
}

}  // namespace rope
