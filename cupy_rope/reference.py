"""The float64 NumPy reference: the oracle the kernels are tested against.

It implements the conventions of every public operation with plain NumPy
and no shortcuts, and also serves NumPy inputs of the public API (so the
library runs, slowly, without a GPU). The conventions themselves (layouts,
pairing styles, angle sources, positions) are defined in ``docs/api.md``.

The functions work on a checked :class:`~cupy_rope.validate.Call`; users
reach them through the public functions with NumPy arrays, e.g.
``cupy_rope.apply_rope(x, cos, sin)`` with ``x`` a NumPy [b, s, h, d] array.
"""

from __future__ import annotations

import numpy as np

from .validate import Call, Slab, host_positions


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def host_array(t) -> np.ndarray:
    """A NumPy array over a host array's memory (no copy).

    NumPy arrays come as they are and CPU torch tensors through ``.numpy()``;
    a bfloat16 torch tensor, for which NumPy has no dtype, comes as its
    uint16 bits (:func:`decoded` and :func:`encoded` convert them).

    Parameters
    ----------
    t : cupy_rope.interop.Tensor
        The description of a host array (``t.obj``).

    Returns
    -------
    numpy.ndarray
        A view of ``t.obj``'s memory with its shape and strides.

    Examples
    --------
    A CPU ``torch.bfloat16`` [2, 8] tensor gives a uint16 [2, 8] view.
    """
    if t.kind != "torch":
        return np.asarray(t.obj)
    x = t.obj.detach()
    if t.dtype == "bfloat16":
        import torch

        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def _is_bf16_bits(a: np.ndarray, dtype: str) -> bool:
    return dtype == "bfloat16" and a.dtype == np.uint16


def decoded(a: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of (a view of) a :func:`host_array`.

    Parameters
    ----------
    a : numpy.ndarray
        The host array, or a view of it.
    dtype : str
        The dtype name of the array it shows (``Tensor.dtype``).

    Returns
    -------
    numpy.ndarray
        A float64 copy.

    Examples
    --------
    >>> decoded(np.array([0x3F80], np.uint16), "bfloat16")
    array([1.])
    """
    if _is_bf16_bits(a, dtype):  # bfloat16 is the top half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return _f64(a)


def encoded(y: np.ndarray, like: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values as stored in a :func:`host_array`.

    Parameters
    ----------
    y : numpy.ndarray
        float64 values.
    like : numpy.ndarray
        The host array (or a view of it) they are for.
    dtype : str
        The dtype name of the array ``like`` shows (``Tensor.dtype``).

    Returns
    -------
    numpy.ndarray
        ``y`` in ``like``'s dtype; for bfloat16 bits, rounded to nearest
        even through float32, as torch rounds a float64 tensor.

    Examples
    --------
    >>> encoded(np.array([1.0]), np.zeros(1, np.uint16), "bfloat16")
    array([16256], dtype=uint16)
    """
    if not _is_bf16_bits(like, dtype):
        return y.astype(like.dtype)
    bits = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(y)] = 0x7FC0
    return out


def strided_view(t, offset: int, strides5: tuple, batch: int, seqlen: int, heads: int,
                 heads_per_group: int, head_dim: int) -> np.ndarray:
    """A strided [b, s, groups, heads_per_group, d] view of a host array.

    Parameters
    ----------
    t : cupy_rope.interop.Tensor
        The description of a NumPy array (``t.obj``).
    offset : int
        Element offset of the view's first element from ``t.obj``'s data.
    strides5 : tuple of int
        Element strides (batch, seq, group, head, dim); a group stride of 0
        means ``heads_per_group * head stride``.
    batch, seqlen, heads, heads_per_group, head_dim : int
        The view's geometry (groups = heads // heads_per_group).

    Returns
    -------
    numpy.ndarray
        A view (no copy) [batch, seqlen, groups, heads_per_group, head_dim]
        of ``t.obj``'s memory; writing to it writes the array.

    Examples
    --------
    A [2, 16, 8, 64] bshd array of 8 heads in 2 groups of 4 gives a
    [2, 16, 2, 4, 64] view.
    """
    base = host_array(t)
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
    """The float64 input of one slab.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        The checked call.
    slab : cupy_rope.validate.Slab
        One of ``call.slabs`` (q, k or v).

    Returns
    -------
    numpy.ndarray
        The float64 input [batch, seqlen, slab.heads, head_dim] (a copy).

    Examples
    --------
    For ``apply_rope(x, cos, sin)`` with an sbhd ``x`` [16, 2, 8, 64], the one
    slab's input is [2, 16, 8, 64].
    """
    v = strided_view(slab.x, slab.x_offset, slab.x_strides, call.batch, call.seqlen,
                     slab.heads, slab.heads_per_group, call.head_dim)
    return decoded(v, slab.x.dtype).reshape(call.batch, call.seqlen, slab.heads, call.head_dim)


def axis_of_frequency(sections, interleaved: bool) -> np.ndarray:
    """The position axis of every frequency (M-RoPE / axial RoPE).

    Contiguous sections: the first sections[0] frequencies use axis 0, the
    next sections[1] axis 1, the rest axis 2. Interleaved (Qwen3-VL): f with
    f % 3 == 1 and f < 3 * sections[1] use axis 1, f % 3 == 2 and
    f < 3 * sections[2] axis 2, every other f axis 0.

    Parameters
    ----------
    sections : sequence of int
        Frequencies per position axis (1 to 3 entries; 3 when interleaved).
    interleaved : bool
        Qwen3-VL's interleaved assignment instead of contiguous sections.

    Returns
    -------
    numpy.ndarray
        The axis of each frequency, int [sum(sections)].

    Examples
    --------
    >>> axis_of_frequency((2, 1, 1), False)
    array([0, 0, 1, 2])
    >>> axis_of_frequency((2, 1, 1), True)
    array([0, 1, 2, 0])
    """
    n = sum(sections)
    f = np.arange(n)
    if not interleaved:
        return np.repeat(np.arange(len(sections)), sections)
    axis = np.zeros(n, np.int64)
    axis[(f % 3 == 1) & (f < 3 * sections[1])] = 1
    axis[(f % 3 == 2) & (f < 3 * sections[2])] = 2
    return axis


def _table(t) -> np.ndarray:
    """The float64 values of an angle source array."""
    return decoded(host_array(t), t.dtype)


def cos_sin_of(call: Call, pos: np.ndarray):
    """The cos and sin of every token's angles, from the call's angle source.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        The checked call (its angle source, ``rotary_dim`` and sections).
    pos : numpy.ndarray
        The int positions [batch, seqlen], or [axes, batch, seqlen] with sections.

    Returns
    -------
    cos, sin : numpy.ndarray
        The float64 values [batch, seqlen, rotary_dim / 2]; NaN for a position outside
        the table (so a test sees it, where a kernel would read anything).

    Examples
    --------
    With a [4096, 32] cos table and positions [2, 16], cos and sin are
    [2, 16, 32].
    """
    half = call.rotary_dim // 2
    f = np.arange(half)
    if call.sections:  # each frequency at the position of its axis: [b, s, r/2]
        pos = np.moveaxis(pos[axis_of_frequency(call.sections, call.sections_interleaved)], 0, -1)
    else:
        pos = np.broadcast_to(pos[..., None], pos.shape + (half,))
    if call.source == "inv_freq":
        theta = pos.astype(np.float64) * _table(call.tables[0])
        c, s = np.cos(theta), np.sin(theta)
        bad = np.zeros(pos.shape, bool)
    else:
        bad = (pos < 0) | (pos >= call.max_position)
        idx = np.where(bad, 0, pos)
        if len(call.tables) == 2 and call.tables[0] is call.tables[1]:  # cos_sin_cache
            cache = _table(call.tables[0])
            c, s = cache[idx, f], cache[idx, half + f]
        elif call.source == "freqs":
            theta = _table(call.tables[0])[idx, f]
            c, s = np.cos(theta), np.sin(theta)
        else:
            c, s = _table(call.tables[0])[idx, f], _table(call.tables[1])[idx, f]
    c, s = c.copy(), s.copy()
    c[bad], s[bad] = np.nan, np.nan
    return c, s


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int,
           interleaved: bool, backward: bool = False) -> np.ndarray:
    """Rotate the channel pairs of x by the angles whose cos and sin are given.

    NeoX pairs channel f with f + r/2; GPT-J (interleaved) pairs 2f with
    2f + 1. Backward rotates by -theta. Channels past rotary_dim pass through.

    Parameters
    ----------
    x : numpy.ndarray
        The float64 input [b, s, h, d].
    cos, sin : numpy.ndarray
        The float64 cos and sin of the angles [b, s, r/2].
    rotary_dim : int
        The rotated channels r (even, <= d).
    interleaved : bool
        GPT-J pairs instead of NeoX pairs.
    backward : bool, default False
        Rotate by -theta (the gradient of the forward rotation).

    Returns
    -------
    numpy.ndarray
        A new float64 array [b, s, h, d].

    Examples
    --------
    >>> x = np.ones((1, 2, 1, 4))
    >>> theta = np.full((1, 2, 2), np.pi / 2)
    >>> rotate(x, np.cos(theta), np.sin(theta), 4, False).round(12)[0, 0, 0]
    array([-1., -1.,  1.,  1.])
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
    """The float64 result of every slab of a call (v is copied unrotated).

    Parameters
    ----------
    call : cupy_rope.validate.Call
        The checked call; positions, offsets and cu_seqlens must be host
        (NumPy) arrays or ints.

    Returns
    -------
    list of numpy.ndarray
        One float64 [batch, seqlen, heads, head_dim] array per slab.

    Raises
    ------
    ValueError
        Where positions, offsets or cu_seqlens are device arrays.

    Examples
    --------
    For ``apply_rope_qk(q, k, cos, sin)`` with q [2, 16, 8, 64] and k
    [2, 16, 2, 64]: a list of a [2, 16, 8, 64] and a [2, 16, 2, 64] array.
    """
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
    """The float64 result of a single-tensor call, in x's own shape.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        A checked one-slab call (``apply_rope``), host positions.

    Returns
    -------
    numpy.ndarray
        A float64 array of ``call.x.shape``.

    Examples
    --------
    For ``apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu)`` with x
    [100, 8, 64]: a float64 [100, 8, 64] array.
    """
    y = rope_slabs(call)[0]
    return to_layout(call, y, call.x.shape)


def to_layout(call: Call, y: np.ndarray, shape) -> np.ndarray:
    """A [b, s, h, d] result in the caller's layout and shape.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        The checked call (its ``layout``).
    y : numpy.ndarray
        [b, s, h, d].
    shape : tuple of int
        The caller's shape (e.g. heads flattened into [.., h * d]).

    Returns
    -------
    numpy.ndarray
        ``y`` transposed for sbhd, with the batch axis dropped for thd, and
        reshaped to ``shape``.

    Examples
    --------
    sbhd: a [2, 16, 8, 64] ``y`` comes back [16, 2, 8, 64].
    """
    if call.layout == "sbhd":
        y = y.transpose(1, 0, 2, 3)
    elif call.layout == "thd":
        y = y[0]
    return y.reshape(shape)


# ------------------------------------------------- q/k RMSNorm + RoPE --
def round_to(y: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to ``dtype`` and back: the kernel's ``round_T``.

    Parameters
    ----------
    y : numpy.ndarray
        float64 values.
    dtype : str
        ``"float64"`` (no rounding), ``"float32"``, ``"float16"`` or
        ``"bfloat16"``; the half types round through float32, as a value
        computed in fp32 is rounded.

    Returns
    -------
    numpy.ndarray
        float64 values that ``dtype`` holds exactly.

    Examples
    --------
    >>> round_to(np.array([1 + 2.0 ** -9]), "bfloat16")
    array([1.])
    """
    if dtype == "float64":
        return y
    f32 = np.asarray(y, np.float64).astype(np.float32)
    if dtype == "float32":
        return f32.astype(np.float64)
    if dtype == "float16":
        return f32.astype(np.float16).astype(np.float64)
    bits = encoded(f32.astype(np.float64), np.zeros(f32.shape, np.uint16), "bfloat16")
    return decoded(bits, "bfloat16")


def _weight_rows(weight, norm, heads: int, head_dim: int):
    """A weight's w' (w, 1 + w) as float64 broadcasting over [b, s, h, d]
    rows, or None for weight_mode "none"."""
    if norm.weight_mode == "none":
        return None
    w = _table(weight) if hasattr(weight, "obj") else _f64(weight)
    w = w.reshape((heads, head_dim) if norm.scope == "token" else (head_dim,))
    return 1.0 + w if norm.weight_mode == "1+w" else w


def _row_axes(norm) -> tuple:
    """The axes of a [b, s, h, d] slab that one norm row spans."""
    return (-1,) if norm.scope == "head" else (-2, -1)


def _normalized(x: np.ndarray, norm):
    """(x_hat, rstd) of float64 x [b, s, h, d], rstd keeping the row axes."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=_row_axes(norm), keepdims=True) + norm.eps)
    return x * rstd, rstd


def qk_norm_rope_slabs(call: Call, weights, norm) -> list:
    """The float64 forward of the q/k RMSNorm + RoPE of every slab.

    Per norm row (one head, or all heads of a token with scope "token"):
    x_hat = x / sqrt(mean(x^2) + eps), w' = w, 1 + w or 1; then
    y = round_T(round_T(x_hat) * w') (rounding "before_weight") or
    y = round_T(x_hat * w') ("after_weight"), T the input dtype (float64:
    no rounding); then y rotated as :func:`rope_slabs` rotates x (channels
    past rotary_dim normalized, not rotated). Slabs that do not rotate (v of
    a packed projection) are copied.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        A checked forward call (q and k slabs; v last if present); host
        positions, offsets and cu_seqlens.
    weights : tuple
        The weights of the rotating slabs in order (q_weight, k_weight):
        descriptions (:class:`~cupy_rope.interop.Tensor`) or arrays of
        [head_dim] (scope "head") or [heads * head_dim] (scope "token");
        None entries for weight_mode "none".
    norm : cupy_rope.validate.NormOptions
        The checked norm options.

    Returns
    -------
    list of numpy.ndarray
        One float64 [batch, seqlen, heads, head_dim] array per slab.

    Examples
    --------
    For q [2, 16, 8, 64] and k [2, 16, 2, 64] with per-head weights [64]:
    a list of a [2, 16, 8, 64] and a [2, 16, 2, 64] array.
    """
    pos = host_positions(call)
    if pos is None:
        raise ValueError("the NumPy reference needs host positions, offsets and cu_seqlens")
    cos, sin = cos_sin_of(call, pos)
    out = []
    for i, slab in enumerate(call.slabs):
        x = slab_input(call, slab)
        if not slab.rotate:
            out.append(x)
            continue
        x_hat, _ = _normalized(x, norm)
        w = _weight_rows(weights[i], norm, slab.heads, call.head_dim)
        if w is None:
            y = round_to(x_hat, call.dtype)
        elif norm.rounding == "before_weight":
            y = round_to(round_to(x_hat, call.dtype) * w, call.dtype)
        else:
            y = round_to(x_hat * w, call.dtype)
        out.append(rotate(y, cos, sin, call.rotary_dim, call.interleaved))
    return out


def qk_norm_rope_backward_slabs(call: Call, inputs, weights, norm) -> tuple:
    """The float64 gradients of :func:`qk_norm_rope_slabs` (no rounding).

    Per norm row, with dy the output gradient: g = dy rotated by -theta,
    dn = g * w', dx = rstd * (dn - x_hat * mean(dn * x_hat)), and the
    weight's gradient the sum over every row of g * x_hat (the same for
    weight_mode "1+w").

    Parameters
    ----------
    call : cupy_rope.validate.Call
        A checked backward call whose slabs read the output gradients
        (dy of q, then of k); host positions, offsets and cu_seqlens.
    inputs : tuple of cupy_rope.validate.Slab
        The forward inputs q and k, read as slabs on the call's geometry.
    weights : tuple
        As for :func:`qk_norm_rope_slabs`.
    norm : cupy_rope.validate.NormOptions
        The forward's norm options.

    Returns
    -------
    dx : list of numpy.ndarray
        float64 [batch, seqlen, heads, head_dim] per slab.
    dweight : list of numpy.ndarray or None
        float64 [head_dim] (scope "head") or [heads * head_dim] ("token")
        per slab; None for weight_mode "none".

    Examples
    --------
    For dq [2, 16, 8, 64], dk [2, 16, 2, 64] and per-head weights: dx is a
    [2, 16, 8, 64] and a [2, 16, 2, 64] array, dweight two [64] arrays.
    """
    pos = host_positions(call)
    if pos is None:
        raise ValueError("the NumPy reference needs host positions, offsets and cu_seqlens")
    cos, sin = cos_sin_of(call, pos)
    dxs, dws = [], []
    for slab, inp, weight in zip(call.slabs, inputs, weights):
        g = rotate(slab_input(call, slab), cos, sin, call.rotary_dim, call.interleaved,
                   backward=True)
        x_hat, rstd = _normalized(slab_input(call, inp), norm)
        w = _weight_rows(weight, norm, slab.heads, call.head_dim)
        dn = g if w is None else g * w
        axes = _row_axes(norm)
        dxs.append(rstd * (dn - x_hat * np.mean(dn * x_hat, axis=axes, keepdims=True)))
        if w is not None:
            dw = (g * x_hat).sum(axis=(0, 1) if norm.scope == "token" else (0, 1, 2))
            dws.append(dw.reshape(-1))
    return dxs, (dws if norm.weight_mode != "none" else None)
