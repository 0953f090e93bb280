// The launch parameters, passed by value as the kernel's single argument.
//
// cupy_rope/launch.py builds the same struct with ctypes; the two must list
// the same fields in the same order. Every field is 8 bytes wide (the float
// sits in an 8-byte slot) so that both sides agree on the layout.
#pragma once
#include "dtype.cuh"

namespace rope {

// A strided view of a [tokens, heads, head_dim] slab. Tokens are addressed
// by two indices (outer, inner) so that bshd, sbhd and any permuted or
// sliced 4-D view map onto one kernel; strides are in elements.
struct View {
  void* data;
  i64 stride_outer;
  i64 stride_inner;
  i64 stride_head;
  i64 stride_dim;
};

struct Params {
  View x;    // input
  View out;  // output; equal to x when rotating in place

  // Angle source. TABLE: cos and sin tables [max_position, rotary_dim / 2].
  // ANGLE_TABLE: angles [max_position, rotary_dim / 2] in `cos`.
  // INV_FREQ: inv_freq [rotary_dim / 2] in `cos`.
  const void* cos;
  const void* sin;
  i64 cos_stride_row;
  i64 sin_stride_row;
  i64 cos_stride_col;  // 1 on the vector path
  i64 sin_stride_col;
  i64 max_position;      // rows in the tables; larger positions give NaN

  // Position of token (outer, inner):
  //   pos = (positions ? positions[outer * pos_stride_outer + inner * pos_stride_inner]
  //                    : outer * seq_stride_outer + inner * seq_stride_inner)
  //       + (offsets ? offsets[outer * off_stride_outer + inner * off_stride_inner] : 0)
  //       + offset
  const void* positions;
  const void* offsets;
  i64 pos_stride_outer;
  i64 pos_stride_inner;
  i64 off_stride_outer;
  i64 off_stride_inner;
  i64 seq_stride_outer;
  i64 seq_stride_inner;
  i64 offset;

  i64 n_outer;
  i64 n_inner;
  i64 n_heads;
  i64 heads_per_group;  // heads covered by one blockIdx.y

  float sin_sign;  // +1 forward, -1 backward (rotation by -theta)
  float pad_;
};

}  // namespace rope
