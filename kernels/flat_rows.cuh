// What the flat kernels share (flat_kernel in kernels/flat.cu, the rotation;
// norm_flat_kernel in kernels/norm_flat.cu, the norm and the rotation): one
// 16-byte packet per thread over a slab's dense head rows in memory order,
// the block's slab, and a row's position from its index.
#pragma once
#include "angles.cuh"

namespace rope {

// Threads per block (cupy_rope/launch.py FLAT_THREADS), and the blocks per
// SM asked of the compiler: all the threads an SM holds, which caps a
// thread at 32 registers on sm_80 and newer.
constexpr int FLAT_THREADS = 128;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 750)
constexpr int SM_MAX_THREADS = 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || \
                                 __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
constexpr int SM_MAX_THREADS = 1536;
#else
constexpr int SM_MAX_THREADS = 2048;
#endif
constexpr int FLAT_MIN_BLOCKS = SM_MAX_THREADS / FLAT_THREADS;

// This block's slab (block-uniform), its index and its data pointers, picked
// with compile-time indices. SLABS is the call's slab count (x alone 1, q
// and k 2): with one slab nothing is picked, so the x address waits for no
// comparison of blockIdx against the slabs' first blocks.
struct FlatBlock {
  const void* x;
  void* out;
  FlatSlab s;
  int index;
};

template <int SLABS>
__device__ __forceinline__ FlatBlock flat_block(const FlatParams& p) {
  static_assert(SLABS >= 1 && SLABS <= MAX_SLABS, "the call's slab count");
  const int k = block_slab_index<SLABS>(p);
  FlatBlock f;
#pragma unroll
  for (int i = 0; i < SLABS; ++i)
    if (i == k) f = FlatBlock{p.x_data[i], p.out_data[i], p.slab[i], i};
  return f;
}

// A head row's position: its sequence index (or, EXPLICIT, the positions
// entry there) plus the scalar offset. `inside`: within the table; a row
// outside it, or a lane with no row, reads row 0 (pos 0) and writes NaN.
struct FlatPosition {
  i64 pos;
  bool inside;
};

// The sequence index of head row `row` is (row / rows_per_step) % seq_len
// (cupy_rope/launch.py flat_geometry); the host checks every position it
// can see against the table.
template <int POS_MODE>
__device__ __forceinline__ FlatPosition flat_position(const FlatParams& p, const FlatSlab& sl,
                                                      unsigned row, bool live) {
  static_assert(POS_MODE == IMPLIED || POS_MODE == EXPLICIT, "implied or explicit positions");
  const unsigned step = divide(row, sl.step_mul, sl.step_shift);
  const unsigned seq = static_cast<unsigned>(sl.seq_len);
  const unsigned index = seq ? step - divide(step, sl.seq_mul, sl.seq_shift) * seq : step;
  i64 wanted = p.offset;
  if constexpr (POS_MODE == EXPLICIT) {
    if (live) wanted += load_index(p.positions, static_cast<i64>(index) * p.pos_stride, p.pos_is_64);
  } else {
    wanted += static_cast<i64>(index);
  }
  const bool inside = wanted >= 0 && wanted < p.max_position;
  return FlatPosition{live && inside ? wanted : 0, inside};
}

}  // namespace rope
