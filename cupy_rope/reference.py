"""The float64 NumPy reference: the oracle the kernels are tested against.

It implements exactly the conventions of :func:`cupy_rope.apply_rope`, with
plain NumPy and no shortcuts, and also serves NumPy inputs of the public API
(so the library runs, slowly, without a GPU).
"""

from __future__ import annotations

import numpy as np

from .validate import LAYOUTS, Call


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def positions_of(call: Call) -> np.ndarray:
    """int64 [batch, seqlen] positions of every token."""
    b, s = call.batch, call.seqlen
    if call.positions is not None:
        pos = np.broadcast_to(np.asarray(call.positions.obj).astype(np.int64), (b, s))
    else:
        pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
    if call.offsets is not None:
        pos = pos + np.asarray(call.offsets.obj).astype(np.int64)[:, None]
    return pos + call.offset


def cos_sin_of(call: Call, pos: np.ndarray):
    """float64 cos and sin [batch, seqlen, rotary_dim / 2] at ``pos``."""
    if call.source == "inv_freq":
        theta = pos[..., None].astype(np.float64) * _f64(call.tables[0].obj)
        return np.cos(theta), np.sin(theta)
    if call.source == "angle_table":
        theta = _f64(call.tables[0].obj)[pos]
        return np.cos(theta), np.sin(theta)
    return _f64(call.tables[0].obj)[pos], _f64(call.tables[1].obj)[pos]


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


def rope(call: Call) -> np.ndarray:
    """float64 result of ``call``, in x's layout."""
    b_axis, s_axis = LAYOUTS[call.layout]
    x = _f64(call.x.obj)
    if (b_axis, s_axis) != (0, 1):
        x = x.transpose(1, 0, 2, 3)  # sbhd -> bshd
    pos = positions_of(call)
    cos, sin = cos_sin_of(call, pos)
    y = rotate(x, cos, sin, call.rotary_dim, call.interleaved, call.backward)
    if (b_axis, s_axis) != (0, 1):
        y = y.transpose(1, 0, 2, 3)
    return y


def apply_numpy(call: Call):
    """The public API on NumPy arrays: result in x's dtype, honouring out/inplace."""
    y = rope(call)
    dtype = np.asarray(call.x.obj).dtype
    if call.inplace or call.out is not None:
        dst = call.x.obj if call.inplace else call.out.obj
        if call.inplace and call.rotary_dim < call.head_dim:
            # In place, channels past rotary_dim are not touched at all.
            dst[..., :call.rotary_dim] = y[..., :call.rotary_dim].astype(dtype)
        else:
            dst[...] = y.astype(dtype)
        return dst
    return y.astype(dtype)
