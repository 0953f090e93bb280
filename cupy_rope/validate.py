"""Argument checking, shared by the GPU path and the NumPy reference path.

:func:`check_call` turns the public arguments into a :class:`Call`, or raises
``ValueError`` / ``TypeError`` naming the offending argument and what was
expected. It looks only at shapes, strides, dtypes and devices (and, for
host data, at values), never at device memory: it costs no sync.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

from .interop import Tensor, describe

#: layout -> (batch axis, sequence axis) of the 4-D input.
LAYOUTS = {"bshd": (0, 1), "sbhd": (1, 0)}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
MAX_HEAD_DIM = 512


class Call(NamedTuple):
    x: Tensor
    out: Optional[Tensor]  # None: allocate a new output
    inplace: bool  # out is x itself
    layout: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    backward: bool
    source: str  # "table" | "inv_freq" | "angle_table"
    tables: tuple  # (cos, sin) | (inv_freq,) | (freqs,)
    max_position: int  # rows of the table; 0 for inv_freq
    positions: Optional[Tensor]
    offsets: Optional[Tensor]
    offset: int  # scalar added to every position


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _as_int(v, name):
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}") from None


def _same_device(t: Tensor, x: Tensor, name: str) -> None:
    if t.device != x.device:
        def where(dev):
            return "the CPU" if dev[0] == "cpu" else f"cuda:{dev[1]}"

        raise ValueError(f"{name}: expected an array on {where(x.device)} (where x is), "
                         f"got one on {where(t.device)}")


def _check_dtype(t: Tensor, name: str, allowed) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {t.dtype}")


def _overlaps(a_span: tuple, b_span: tuple) -> bool:
    """Do two [first byte, end) spans (Tensor.span()) share a byte?"""
    return a_span[0] < b_span[1] and b_span[0] < a_span[1]


def check_call(x, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None,
               offsets=None, layout="bshd", interleaved=False, rotary_dim=None,
               inplace=False, out=None, backward=False) -> Call:
    xt = x if isinstance(x, Tensor) else describe(x, "x")
    on_gpu = xt.on_gpu
    floats = FLOAT_DTYPES if on_gpu else FLOAT_DTYPES + ("float64",)

    # ---- x and layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if xt.ndim != 4:
        raise ValueError(f"x: expected a 4-D array {'[' + ', '.join(layout) + ']'} "
                         f"for layout {layout!r}, got shape {_fmt_shape(xt.shape)}")
    _check_dtype(xt, "x", floats)
    b_axis, s_axis = LAYOUTS[layout]
    batch, seqlen, heads, head_dim = xt.shape[b_axis], xt.shape[s_axis], xt.shape[2], xt.shape[3]
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"x: head_dim (last axis) must be even and >= 2, got {head_dim}")
    if on_gpu and head_dim > MAX_HEAD_DIM:
        raise ValueError(f"x: head_dim (last axis) must be <= {MAX_HEAD_DIM}, got {head_dim}")

    # ---- angle source
    given = [n for n, v in (("cos", cos), ("sin", sin), ("inv_freq", inv_freq), ("freqs", freqs))
             if v is not None]
    if given in (["cos", "sin"], ["inv_freq"], ["freqs"]):
        pass
    elif given == ["cos"] or given == ["sin"]:
        raise ValueError(f"{'sin' if given == ['cos'] else 'cos'}: cos and sin tables come "
                         "together; pass both")
    elif not given:
        raise ValueError("cos/sin, inv_freq or freqs: pass exactly one angle source, got none")
    else:
        raise ValueError(f"{', '.join(given)}: pass exactly one angle source "
                         "(cos and sin, or inv_freq, or freqs)")
    angle_dtypes = ("float32", xt.dtype) if xt.dtype != "float32" else ("float32",)
    if not on_gpu:
        angle_dtypes = angle_dtypes + ("float64",)
    if inv_freq is not None:
        source = "inv_freq"
        tables = (describe(inv_freq, "inv_freq"),)
        t = tables[0]
        if t.ndim != 1:
            raise ValueError(f"inv_freq: expected a 1-D array [rotary_dim / 2], "
                             f"got shape {_fmt_shape(t.shape)}")
        _check_dtype(t, "inv_freq", ("float32",) if on_gpu else ("float32", "float64"))
        width, max_position = t.shape[0], 0
    else:
        if freqs is not None:
            source, tables = "angle_table", (describe(freqs, "freqs"),)
            names = ("freqs",)
            allowed = ("float32",) if on_gpu else ("float32", "float64")
        else:
            source, tables = "table", (describe(cos, "cos"), describe(sin, "sin"))
            names = ("cos", "sin")
            allowed = angle_dtypes
        for t, n in zip(tables, names):
            if t.ndim != 2:
                raise ValueError(f"{n}: expected a 2-D table [max_position, rotary_dim / 2], "
                                 f"got shape {_fmt_shape(t.shape)}")
            _check_dtype(t, n, allowed)
        if source == "table":
            if tables[0].shape != tables[1].shape:
                raise ValueError(f"sin: expected the shape of cos {_fmt_shape(tables[0].shape)}, "
                                 f"got {_fmt_shape(tables[1].shape)}")
            if tables[0].dtype != tables[1].dtype:
                raise TypeError(f"sin: expected the dtype of cos ({tables[0].dtype}), "
                                f"got {tables[1].dtype}")
        max_position, width = tables[0].shape
        if max_position < 1:
            raise ValueError(f"{names[0]}: the table has no rows")

    src_name = {"table": "cos", "inv_freq": "inv_freq", "angle_table": "freqs"}[source]
    table_names = ("cos", "sin") if source == "table" else (src_name,)
    for t, n in zip(tables, table_names):
        _same_device(t, xt, n)

    # ---- rotary_dim
    if width < 1:
        raise ValueError(f"{src_name}: expected at least one frequency in its last axis "
                         f"(rotary_dim / 2 >= 1), got shape {_fmt_shape(tables[0].shape)}")
    if rotary_dim is None:
        rotary_dim = 2 * width
    else:
        rotary_dim = _as_int(rotary_dim, "rotary_dim")
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"rotary_dim: must be even and >= 2, got {rotary_dim}")
        if rotary_dim != 2 * width:
            raise ValueError(f"{src_name}: expected {rotary_dim // 2} frequencies "
                             f"(rotary_dim / 2) in its last axis, got {width}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: must be <= head_dim ({head_dim}), got {rotary_dim} "
                         f"(from {src_name} with {width} frequencies)")

    # ---- positions and offsets
    pos_t = None
    if positions is not None:
        pos_t = describe(positions, "positions")
        _same_device(pos_t, xt, "positions")
        _check_dtype(pos_t, "positions", INDEX_DTYPES)
        if pos_t.shape not in ((seqlen,), (batch, seqlen)):
            raise ValueError(f"positions: expected shape [{seqlen}] or [{batch}, {seqlen}] "
                             f"([s] or [b, s]), got {_fmt_shape(pos_t.shape)}")
    off_t, offset = None, 0
    if offsets is not None:
        if isinstance(offsets, bool):
            raise TypeError("offsets: expected an int or an int32/int64 array, got bool")
        if isinstance(offsets, int) or type(offsets).__name__.startswith(("int", "uint")):
            offset = _as_int(offsets, "offsets")
            if abs(offset) >= 2**62:
                raise ValueError(f"offsets: expected |offsets| < 2**62, got {offset}")
        else:
            off_t = describe(offsets, "offsets")
            _same_device(off_t, xt, "offsets")
            _check_dtype(off_t, "offsets", INDEX_DTYPES)
            if off_t.shape != (batch,):
                raise ValueError(f"offsets: expected shape [{batch}] (one per batch entry) "
                                 f"or an int, got {_fmt_shape(off_t.shape)}")

    # Positions known on the host are checked against the table here; device
    # positions cannot be (that would need a sync): the kernel then writes NaN
    # for any position outside the table instead of reading out of bounds.
    if source != "inv_freq" and seqlen > 0 and batch > 0:
        lo = hi = None
        if pos_t is None and off_t is None:
            lo, hi = offset, seqlen - 1 + offset
        elif not on_gpu:
            import numpy as np

            pos = (np.asarray(pos_t.obj).astype(np.int64) if pos_t is not None
                   else np.arange(seqlen, dtype=np.int64))
            pos = np.broadcast_to(pos, (batch, seqlen))
            if off_t is not None:
                pos = pos + np.asarray(off_t.obj).astype(np.int64)[:, None]
            pos = pos + offset
            lo, hi = int(pos.min()), int(pos.max())
        if lo is not None and (lo < 0 or hi >= max_position):
            raise ValueError(f"{src_name}: the table has {max_position} rows (positions "
                             f"0..{max_position - 1}) but positions reach {lo if lo < 0 else hi}")

    # ---- output
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected a bool, got {type(inplace).__name__}")
    out_t = None
    if out is not None:
        out_t = describe(out, "out")
        same_view = (out_t.ptr == xt.ptr and out_t.strides == xt.strides
                     and out_t.shape == xt.shape)
        if inplace and not same_view:
            raise ValueError("out: pass either out= or inplace=True, not both")
        if out_t.shape != xt.shape:
            raise ValueError(f"out: expected shape {_fmt_shape(xt.shape)} (that of x), "
                             f"got {_fmt_shape(out_t.shape)}")
        if out_t.dtype != xt.dtype:
            raise TypeError(f"out: expected dtype {xt.dtype} (that of x), got {out_t.dtype}")
        _same_device(out_t, xt, "out")
        if same_view:
            inplace, out_t = True, None
        elif _overlaps(out_t.span(), xt.span()):
            raise ValueError("out: overlaps x without being the same view; pass a separate "
                             "array or rotate in place (inplace=True)")
    read_only = [(t, n) for t, n in list(zip(tables, table_names)) +
                 [(pos_t, "positions"), (off_t, "offsets")] if t is not None]
    target = xt if inplace else out_t
    if target is not None:
        name = "x" if inplace else "out"
        if target.readonly:
            kind = "JAX arrays are immutable" if target.kind == "jax" else "it is read-only"
            raise TypeError(f"{name}: cannot be written in place ({kind}); "
                            "use the returned array instead")
        if target.self_overlapping():
            raise ValueError(f"{name}: has elements that share memory (stride 0 or overlapping "
                             "strides); cannot be written")
        target_span = target.span()
        for t, n in read_only:
            if _overlaps(t.span(), target_span):
                raise ValueError(f"{name}: overlaps {n}; the output must not alias the inputs")

    if on_gpu:
        for t, n in [(xt, "x")] + ([(out_t, "out")] if out_t is not None else []) + read_only:
            if t.ptr % t.itemsize:
                raise ValueError(f"{n}: data pointer {t.ptr:#x} is not aligned to its "
                                 f"{t.itemsize}-byte elements")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    return Call(xt, out_t, inplace, layout, batch, seqlen, heads, head_dim, rotary_dim,
                interleaved, bool(backward), source, tables, max_position, pos_t, off_t, offset)
