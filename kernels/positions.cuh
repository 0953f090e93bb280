// Which position each token rotates by.
//
// POS_MODE (compile time):
//   IMPLIED:  the token's sequence index i (bshd/sbhd: the s axis),
//   EXPLICIT: positions[outer * pos_stride_outer + inner * pos_stride_inner],
//   VARLEN:   packed sequences (thd): token t belongs to sequence s with
//             start(s) <= t < start(s + 1) where start(s) = cu_seqlens[s] / cp_size,
//             and i = t - start(s).
//   AXES:     one position per axis (M-RoPE's temporal/height/width, axial
//             RoPE's 2 or 3 axes): positions[a * pos_stride_axis + ...];
//             frequency f rotates by the position of its axis (axis_of).
// Then, for IMPLIED and VARLEN with context parallelism (cp_size > 1), i is
// a local index and is remapped to the global one (below), and finally
//   pos = i + offsets[b or s] + offset.
#pragma once
#include "params.cuh"

namespace rope {

enum PosMode : int { IMPLIED = 0, EXPLICIT = 1, VARLEN = 2, AXES = 3 };

// Context parallelism with load balancing (dual chunks): a sequence of
// global length L is cut into 2 * cp_size chunks of c = L / (2 * cp_size)
// tokens, and rank r holds chunks r and 2 * cp_size - 1 - r, in that order,
// as a local sequence of 2c tokens. Local index i < c lies in chunk r
// (global r * c + i); i >= c lies in chunk 2 * cp_size - 1 - r (global
// (2 * cp_size - 1 - r) * c + (i - c)).
__device__ __forceinline__ i64 cp_global_index(i64 i, i64 c, i64 cp_size, i64 cp_rank) {
  return i < c ? cp_rank * c + i : (2 * cp_size - 1 - cp_rank) * c + (i - c);
}

__device__ __forceinline__ i64 load_index(const void* base, i64 idx, bool is64) {
  return is64 ? static_cast<const i64*>(base)[idx]
              : static_cast<i64>(static_cast<const int*>(base)[idx]);
}

__device__ __forceinline__ i64 seq_start(const Params& p, i64 s) {
  return static_cast<i64>(p.cu_seqlens[s]) / p.cp_size;
}

// The largest s in [lo, hi) with seq_start(s) <= t, found by the first
// `lanes` threads of the block (one warp, or all of a block smaller than a
// warp) with a lanes-way search (each step narrows the range lanes-fold: 3
// steps for 32768 sequences with 32 lanes), or lo - 1 if seq_start(lo) > t.
// Every lane returns the same value. With non-monotonic cu_seqlens the
// answer is some s in range: wrong positions but never an out-of-bounds
// access.
__device__ __forceinline__ i64 warp_find_sequence(const Params& p, i64 lo, i64 hi, i64 t,
                                                  int lane, int lanes, unsigned mask) {
  if (lanes < 2) {  // a one-thread block: plain binary search
    if (seq_start(p, lo) > t) return lo - 1;
    while (hi - lo > 1) {
      const i64 mid = (lo + hi) / 2;
      if (seq_start(p, mid) <= t) lo = mid; else hi = mid;
    }
    return lo;
  }
  // The first step also tests seq_start(lo) (lane 0), so no load waits for
  // a separate check.
  i64 step = (hi - lo + lanes - 1) / lanes;
  bool first_step = true;
  do {
    const i64 idx = lo + lane * step;
    const bool ok = idx < hi && seq_start(p, idx) <= t;
    const unsigned votes = __ballot_sync(mask, ok);
    if (first_step && votes == 0) return lo - 1;  // seq_start(lo) > t
    first_step = false;
    const int last = 31 - __clz(votes);  // votes != 0 (monotonic cu_seqlens: lane 0 is set)
    const i64 new_lo = lo + last * step;
    hi = min(hi, new_lo + step);
    lo = new_lo;
    step = (hi - lo + lanes - 1) / lanes;
  } while (hi - lo > 1);
  return lo;
}

// The lanes that search for a VARLEN block's sequences: the first warp, or
// every thread of a block smaller than a warp. (find_block_sequences and
// the SequenceSignal's arrival count both use this.)
__device__ __forceinline__ int search_lanes() {
  return min(32, static_cast<int>(blockDim.x * blockDim.y * blockDim.z));
}

__device__ __forceinline__ int block_thread_index() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Is this thread one of the search_lanes()?
__device__ __forceinline__ bool is_search_lane() {
  return block_thread_index() < search_lanes();
}

// VARLEN: the block's token sequences (find_block_sequences, below) are
// published by the lanes that search and read by every thread once it needs
// its position. On sm_80 and newer the signal is an mbarrier in shared
// memory whose first phase completes when every searching lane has arrived
// (an arrive releases that lane's writes, a completed wait acquires them),
// so the other warps issue their first loads while the search runs; older
// GPUs wait at a block barrier after the search. (Only the sm_90 path has
// been timed.)
struct SequenceSignal {
  unsigned long long barrier;  // the mbarrier object (8-byte aligned)
};

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Called by every thread of the block before the search: the
// search_lanes() lanes will fire the signal.
__device__ __forceinline__ void signal_init(SequenceSignal& sig) {
#if __CUDA_ARCH__ >= 800
  if (block_thread_index() == 0)
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(shared_address(&sig.barrier)),
                 "r"(search_lanes())
                 : "memory");
  __syncthreads();  // before any memory read: costs no memory latency
#endif
}

// Called by every thread of the block after the search: each searching
// lane arrives (after its own writes).
__device__ __forceinline__ void signal_fire(SequenceSignal& sig) {
#if __CUDA_ARCH__ >= 800
  if (is_search_lane())
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}" ::"r"(
                     shared_address(&sig.barrier))
                 : "memory");
#else
  __syncthreads();
#endif
}

// Returns once the search's results are visible to this thread: polls the
// first phase's completion (try_wait from sm_90, which may suspend the
// thread for a while; test_wait on sm_80-89).
__device__ __forceinline__ void signal_wait(SequenceSignal& sig) {
#if __CUDA_ARCH__ >= 800
#if __CUDA_ARCH__ >= 900
#define ROPE_MBARRIER_WAIT "mbarrier.try_wait.parity.shared.b64"
#else
#define ROPE_MBARRIER_WAIT "mbarrier.test_wait.parity.shared.b64"
#endif
  unsigned done;
  do {
    asm volatile("{\n .reg .pred p;\n " ROPE_MBARRIER_WAIT " p, [%1], 0;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(shared_address(&sig.barrier))
                 : "memory");
  } while (!done);
#undef ROPE_MBARRIER_WAIT
#endif
}

// VARLEN: the sequence of each token of this block, written to
// seq_of_lane[z] for token first + z, z < count (-1 for a token no sequence
// covers). The block's tokens are [first, last]. The first warp finds the
// sequence s0 of `first`, then reads the starts of the next `lanes`
// sequences at once (one per lane). When those reach past `last` (a block
// spans fewer than `lanes` sequence starts: the usual case), the sequence of
// token t is s0 plus the number of those starts <= t, which each lane finds
// for its tokens by a binary search over the lanes' starts (shuffles): two
// dependent loads after s0's search. Otherwise each lane searches the range
// [s0, s_last] of cu_seqlens for its tokens. Called by every thread of the
// block (threads past search_lanes() return at once); the searching lanes
// then fire the block's SequenceSignal.
__device__ __forceinline__ void find_block_sequences(const Params& p, i64 first, i64 last,
                                                     int count, int* seq_of_lane) {
  const int tid = block_thread_index();
  const int lanes = search_lanes();
  if (tid >= lanes) return;
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const i64 n = p.n_seqs;
  const i64 end = seq_start(p, n);  // one past the last covered token
  const i64 s_first = warp_find_sequence(p, 0, n, first, tid, lanes, mask);
  // Starts of sequences s_first + 1 .. s_first + lanes (only those < n can
  // hold a token, so a counted s stays <= n - 1 even for bad cu_seqlens).
  const i64 idx = s_first + 1 + tid;
  const bool probed = idx < n;
  const i64 start = probed ? seq_start(p, idx) : 0;
  const bool beyond = !probed || start > last;
  if (__ballot_sync(mask, beyond) != 0) {
    // The sequence of token t is s_first plus the number of probed starts
    // <= t: each lane finds that count for its tokens with a binary search
    // over the lanes' starts (6 shuffle steps cover 0..32). Only probes of
    // sequences < n can count, so s <= n - 1 even for bad cu_seqlens.
    const i64 n_valid = min(max(n - 1 - s_first, i64(0)), static_cast<i64>(lanes));
    const i64 probe = probed ? start : 0x7fffffffffffffffll;
    for (int z0 = 0; z0 < count; z0 += lanes) {  // the same trips on every lane
      const int z = z0 + tid;
      const i64 t = first + z;
      int lo = 0, hi = lanes;
#pragma unroll
      for (int it = 0; it < 6; ++it) {
        const int mid = (lo + hi) >> 1;
        const i64 v = __shfl_sync(mask, probe, min(mid, lanes - 1));
        if (lo < hi) {
          if (v <= t) lo = mid + 1; else hi = mid;
        }
      }
      if (z < count)
        seq_of_lane[z] = t <= last && t < end
                             ? static_cast<int>(s_first + min(static_cast<i64>(lo), n_valid))
                             : -1;
    }
    return;
  }
  // More than `lanes` sequences start in this block (runs of empty
  // sequences): search [max(s_first, 0), s_last] per token. (s_first is -1
  // when the block starts before seq_start(0), possible only for device
  // cu_seqlens with cu_seqlens[0] > 0.)
  const i64 s_lo = max(s_first, i64(0));
  const i64 s_last = warp_find_sequence(p, s_lo, n, last, tid, lanes, mask);
  for (int z = tid; z < count; z += lanes) {
    const i64 t = first + z;
    i64 s = -1;
    if (t <= last && t < end && seq_start(p, s_lo) <= t) {
      i64 lo = s_lo, hi = s_last + 1;  // seq_start(lo) <= t
      while (hi - lo > 1) {
        const i64 mid = (lo + hi) / 2;
        if (seq_start(p, mid) <= t) lo = mid; else hi = mid;
      }
      s = lo;
    }
    seq_of_lane[z] = static_cast<int>(s);
  }
}

// The position of token (outer, inner) (token = outer * n_inner + inner);
// false if it has none (a token outside every sequence).
template <int POS_MODE>
__device__ __forceinline__ bool token_position(const Params& p, i64 token, i64 outer, i64 inner,
                                               i64 seq, i64& pos) {
  i64 off_idx = outer * p.off_stride_outer + inner * p.off_stride_inner;
  if constexpr (POS_MODE == EXPLICIT) {
    pos = load_index(p.positions, outer * p.pos_stride_outer + inner * p.pos_stride_inner,
                     p.pos_is_64);
  } else if constexpr (POS_MODE == IMPLIED) {
    pos = outer * p.seq_stride_outer + inner * p.seq_stride_inner;
    if (p.cp_size > 1) pos = cp_global_index(pos, p.cp_chunk, p.cp_size, p.cp_rank);
  } else {
    if (seq < 0) return false;
    const i64 begin = static_cast<i64>(p.cu_seqlens[seq]);
    pos = token - (p.cp_size > 1 ? begin / p.cp_size : begin);
    if (p.cp_size > 1) {
      // A sequence that does not split into 2 * cp_size equal chunks (device
      // cu_seqlens are not checked on the host) has no positions: NaN.
      const i64 len = static_cast<i64>(p.cu_seqlens[seq + 1]) - begin;
      if (len % (2 * p.cp_size) != 0 || begin % (2 * p.cp_size) != 0) return false;
      pos = cp_global_index(pos, len / (2 * p.cp_size), p.cp_size, p.cp_rank);
    }
    off_idx = seq;
  }
  if (p.offsets) pos += load_index(p.offsets, off_idx, p.off_is_64);
  pos += p.offset;
  return true;
}

// AXES: the axis whose position frequency f uses. Contiguous sections
// (Qwen2-VL M-RoPE, axial RoPE): f < section[0] -> 0, then 1, then 2.
// Interleaved (Qwen3-VL): f % 3 == 1 with f < 3 * section[1] -> 1,
// f % 3 == 2 with f < 3 * section[2] -> 2, every other f -> 0.
__device__ __forceinline__ int axis_of(const Params& p, i64 f) {
  if (p.sections_interleaved) {
    const i64 m = f % 3;
    if (m == 1 && f < 3 * p.section[1]) return 1;
    if (m == 2 && f < 3 * p.section[2]) return 2;
    return 0;
  }
  return f < p.section[0] ? 0 : f < p.section[0] + p.section[1] ? 1 : 2;
}

// AXES: the positions of token (outer, inner) along every axis.
__device__ __forceinline__ void token_axis_positions(const Params& p, i64 outer, i64 inner,
                                                     i64 (&pos)[3]) {
  const i64 idx = outer * p.pos_stride_outer + inner * p.pos_stride_inner;
  i64 add = p.offset;
  if (p.offsets)
    add += load_index(p.offsets, outer * p.off_stride_outer + inner * p.off_stride_inner,
                      p.off_is_64);
#pragma unroll
  for (int a = 0; a < 3; ++a)
    pos[a] = a < p.n_axes ? load_index(p.positions, idx + a * p.pos_stride_axis, p.pos_is_64) + add
                          : 0;
}

}  // namespace rope
