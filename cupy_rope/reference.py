"""The float64 NumPy reference: the oracle the kernels are tested against.

It implements the conventions of every public operation with plain NumPy
and no shortcuts, and also serves NumPy inputs of the public API (so the
library runs, slowly, without a GPU).
"""

from __future__ import annotations

import numpy as np

from .validate import Call, Slab, host_positions


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def strided_view(t, offset: int, strides5: tuple, batch: int, seqlen: int, heads: int,
                 heads_per_group: int, head_dim: int) -> np.ndarray:
    """A [b, s, groups, heads_per_group, d] view of host array ``t`` (a Tensor)
    at element ``offset`` with element strides (b, s, group, head, dim)."""
    base = np.asarray(t.obj)
    item = base.itemsize
    start = np.lib.stride_tricks.as_strided(base, shape=(offset + 1,), strides=(item,))[offset:]
    sb, ss, sg, sh, sd = strides5
    if not sg:
        sg = heads_per_group * sh
    groups = heads // heads_per_group if heads else 0
    return np.lib.stride_tricks.as_strided(
        start, shape=(batch, seqlen, groups, heads_per_group, head_dim),
        strides=tuple(v * item for v in (sb, ss, sg, sh, sd)))


def slab_input(call: Call, slab: Slab) -> np.ndarray:
    """float64 [b, s, h, d] input of one slab."""
    v = strided_view(slab.x, slab.x_offset, slab.x_strides, call.batch, call.seqlen,
                     slab.heads, slab.heads_per_group, call.head_dim)
    return _f64(v).reshape(call.batch, call.seqlen, slab.heads, call.head_dim)


def axis_of_frequency(sections, interleaved: bool) -> np.ndarray:
    """The position axis of every frequency (M-RoPE / axial RoPE).

    Contiguous sections: the first sections[0] frequencies use axis 0, the
    next sections[1] axis 1, the rest axis 2. Interleaved (Qwen3-VL): f with
    f % 3 == 1 and f < 3 * sections[1] use axis 1, f % 3 == 2 and
    f < 3 * sections[2] axis 2, every other f axis 0.
    """
    n = sum(sections)
    f = np.arange(n)
    if not interleaved:
        return np.repeat(np.arange(len(sections)), sections)
    axis = np.zeros(n, np.int64)
    axis[(f % 3 == 1) & (f < 3 * sections[1])] = 1
    axis[(f % 3 == 2) & (f < 3 * sections[2])] = 2
    return axis


def cos_sin_of(call: Call, pos: np.ndarray):
    """float64 cos and sin [batch, seqlen, rotary_dim / 2] at ``pos``
    ([batch, seqlen], or [axes, batch, seqlen] with sections; NaN for a
    position outside the table)."""
    half = call.rotary_dim // 2
    f = np.arange(half)
    if call.sections:  # each frequency at the position of its axis: [b, s, r/2]
        pos = np.moveaxis(pos[axis_of_frequency(call.sections, call.sections_interleaved)], 0, -1)
    else:
        pos = np.broadcast_to(pos[..., None], pos.shape + (half,))
    if call.source == "inv_freq":
        theta = pos.astype(np.float64) * _f64(call.tables[0].obj)
        c, s = np.cos(theta), np.sin(theta)
        bad = np.zeros(pos.shape, bool)
    else:
        bad = (pos < 0) | (pos >= call.max_position)
        idx = np.where(bad, 0, pos)
        if len(call.tables) == 2 and call.tables[0] is call.tables[1]:  # cos_sin_cache
            cache = _f64(call.tables[0].obj)
            c, s = cache[idx, f], cache[idx, half + f]
        elif call.source == "angle_table":
            theta = _f64(call.tables[0].obj)[idx, f]
            c, s = np.cos(theta), np.sin(theta)
        else:
            c, s = _f64(call.tables[0].obj)[idx, f], _f64(call.tables[1].obj)[idx, f]
    c, s = c.copy(), s.copy()
    c[bad], s[bad] = np.nan, np.nan
    return c, s


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int,
           interleaved: bool, backward: bool = False) -> np.ndarray:
    """Rotate channel pairs of x [b, s, h, d] (float64) by angles [b, s, r/2].

    NeoX pairs channel f with f + r/2; GPT-J (interleaved) pairs 2f with
    2f + 1. Backward rotates by -theta. Channels past rotary_dim pass through.
    """
    out = x.copy()
    c = cos[:, :, None, :]
    s = -sin[:, :, None, :] if backward else sin[:, :, None, :]
    if interleaved:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * c - b * s
        out[..., 1:rotary_dim:2] = b * c + a * s
    else:
        half = rotary_dim // 2
        a, b = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = a * c - b * s
        out[..., half:rotary_dim] = b * c + a * s
    return out


def rope_slabs(call: Call) -> list:
    """float64 results [b, s, h, d] of every slab of ``call`` (v is copied)."""
    pos = host_positions(call)
    if pos is None:
        raise ValueError("the NumPy reference needs host positions, offsets and cu_seqlens")
    cos, sin = cos_sin_of(call, pos)
    out = []
    for slab in call.slabs:
        x = slab_input(call, slab)
        out.append(rotate(x, cos, sin, call.rotary_dim, call.interleaved, call.backward)
                   if slab.rotate else x)
    return out


def rope(call: Call) -> np.ndarray:
    """float64 result of a single-tensor call, in x's own shape."""
    y = rope_slabs(call)[0]
    return to_layout(call, y, call.x.shape)


def to_layout(call: Call, y: np.ndarray, shape) -> np.ndarray:
    """[b, s, h, d] -> the caller's layout and shape (sbhd, thd, flattened heads)."""
    if call.layout == "sbhd":
        y = y.transpose(1, 0, 2, 3)
    elif call.layout == "thd":
        y = y[0]
    return y.reshape(shape)
