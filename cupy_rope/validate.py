"""Argument checking, shared by the GPU path and the NumPy reference path.

A call's array arguments are described once (:func:`describe_arrays`, an
:class:`Arrays` of :class:`~cupy_rope.interop.Tensor` records by role) and
its other arguments gathered in :class:`Options`; :func:`check` turns the
two into a :class:`Call`, or raises ``ValueError`` / ``TypeError`` naming
the offending argument and what was expected. :func:`check_call` does all
of that from the public keyword arguments. Checks look only at shapes,
strides, dtypes and devices, and at the values of host arrays (NumPy
positions, cu_seqlens); never at device memory, so they cost no sync.

Every operation is described the same way: up to three *slabs* (q, k, v), each
a strided [batch, seq, heads, head_dim] view of an input array and of an
output array, sharing one token geometry, one angle source and one position
rule. ``thd`` inputs have batch 1 and seq = tokens.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional

import numpy as np

from .interop import Tensor, describe

#: layout -> (batch axis, sequence axis) of the 4-D input; thd has one token axis.
LAYOUTS = {"bshd": (0, 1), "sbhd": (1, 0), "thd": None}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
MAX_HEAD_DIM = 512
PACKINGS = ("concat", "grouped")

#: Position rules (kernels/positions.cuh).
IMPLIED, EXPLICIT, VARLEN, AXES = "implied", "explicit", "varlen", "axes"

#: The operations, and the names of their input and output arrays (as the
#: public functions call them, and as error messages name them).
INPUT_NAMES = {"rope": ("x",), "qk": ("q", "k"), "qkv": ("qkv",),
               "qkv_backward": ("dq", "dk", "dv")}
OUTPUT_NAMES = {"rope": ("out",), "qk": ("out_q", "out_k"), "qkv": ("out_q", "out_k", "out_v"),
                "qkv_backward": ("out",)}
#: The angle source arrays, in the order every operation passes them.
TABLE_NAMES = ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache")


class Options(NamedTuple):
    """A call's arguments other than arrays (docs/api.md), defaults as the
    public functions have them. ``offsets`` travels with the arrays."""

    layout: str = "bshd"
    interleaved: bool = False
    rotary_dim: Optional[int] = None
    head_dim: Optional[int] = None
    cp_size: int = 1
    cp_rank: int = 0
    sections: Any = None
    sections_interleaved: bool = False
    backward: bool = False
    inplace: bool = False
    num_q_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    packing: str = "concat"


class NormOptions(NamedTuple):
    """The q/k RMSNorm that :func:`cupy_rope.apply_qk_norm_rope` applies
    before the rotation (docs/api.md), defaults as the function has them."""

    scope: str = "head"  # "head": each head's head_dim channels; "token": all heads of a token
    weight_mode: str = "w"  # "w": x_hat * w; "1+w": x_hat * (1 + w) (Gemma); "none": no weight
    # "before_weight": x_hat rounded to x's dtype, then times w, rounded (Llama, Qwen3);
    # "after_weight": x_hat * w in fp32, rounded once (Gemma, OLMo 2)
    rounding: str = "before_weight"
    eps: float = 1e-6


class Arrays(NamedTuple):
    """A call's array arguments, each described once; None where absent.

    ``inputs`` and ``outputs`` follow :data:`INPUT_NAMES` and
    :data:`OUTPUT_NAMES` of ``op``; ``tables`` follow :data:`TABLE_NAMES`.
    """

    op: str  # "rope" | "qk" | "qkv" | "qkv_backward"
    inputs: tuple
    tables: tuple
    positions: Optional[Tensor]
    offsets: Any  # a Tensor, or the scalar as given (an int; check refuses others)
    cu_seqlens: Optional[Tensor]
    outputs: tuple


class Slab(NamedTuple):
    """One tensor of a launch: where its heads are read and written.

    Offsets are in elements from the array's data pointer; strides are
    (batch, seq, group, head, dim) in elements. Head j sits at
    (j // heads_per_group) * group stride + (j % heads_per_group) * head stride.
    """

    name: str
    x: Tensor
    x_offset: int
    x_strides: tuple
    out: Optional[Tensor]  # None while the output is still to be allocated
    out_offset: int
    out_strides: Optional[tuple]
    heads: int
    heads_per_group: int
    rotate: bool


class Call(NamedTuple):
    layout: str
    batch: int
    seqlen: int  # tokens per batch entry; all tokens for thd
    head_dim: int
    rotary_dim: int
    interleaved: bool
    backward: bool
    inplace: bool
    slabs: tuple
    dtype: str
    device: tuple
    source: str  # "table" | "inv_freq" | "freqs"
    tables: tuple  # (cos, sin) | (inv_freq,) | (freqs,); cos/sin may share one array
    table_offsets: tuple  # element offset of each table from its array's pointer
    max_position: int  # rows of the table; 0 for inv_freq
    pos_mode: str
    positions: Optional[Tensor]
    offsets: Optional[Tensor]
    offset: int  # scalar added to every position
    cu_seqlens: Optional[Tensor]
    n_seqs: int
    cp_size: int
    cp_rank: int
    sections: tuple = ()  # AXES: frequencies per position axis
    sections_interleaved: bool = False

    @property
    def x(self) -> Tensor:
        return self.slabs[0].x

    @property
    def heads(self) -> int:
        return sum(s.heads for s in self.slabs)

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def on_gpu(self) -> bool:
        return self.device[0] == "cuda"


class _Geometry(NamedTuple):
    """What the input slabs share: token axes, head_dim, dtype and device."""

    batch: int
    seqlen: int
    head_dim: int
    dtype: str
    device: tuple


class _Angles(NamedTuple):
    """A checked angle source (the fields of :class:`Call` of that name)."""

    source: str
    tables: tuple
    table_offsets: tuple
    width: int  # frequencies: rotary_dim / 2
    max_position: int
    name: str  # the argument, for messages


class _Positions(NamedTuple):
    """The checked position rule (the fields of :class:`Call` of that name)."""

    mode: str
    positions: Optional[Tensor]
    offsets: Optional[Tensor]
    offset: int
    cu_seqlens: Optional[Tensor]
    n_seqs: int
    cp_size: int
    cp_rank: int


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def type_name(v) -> str:
    """The full name of ``v``'s type for messages: ``numpy.bool``, not ``bool``
    (NumPy's scalar types share the builtins' short names)."""
    cls = type(v)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _as_int(v, name):
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {type_name(v)}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type_name(v)}") from None


def _as_bool(v, name: str) -> bool:
    """A flag given as a Python or NumPy bool, as a Python bool (so that both
    validate to the same call and kernel)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise TypeError(f"{name}: expected a bool, got {type_name(v)}")


def _where(dev) -> str:
    return "the CPU" if dev[0] == "cpu" else f"cuda:{dev[1]}"


def _same_device(t: Tensor, device: tuple, name: str, what: str = "x") -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected an array on {_where(device)} (where {what} is), "
                         f"got one on {_where(t.device)}")


def _check_dtype(t: Tensor, name: str, allowed) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {t.dtype}")


def _floats(on_gpu: bool) -> tuple:
    """The input dtypes: float64 only on the NumPy reference path."""
    return FLOAT_DTYPES if on_gpu else FLOAT_DTYPES + ("float64",)


def lattice(t: Tensor):
    """The (period, reach) pairs in bytes such that every byte of ``t`` lies
    in ptr + period * Z + [0, reach) with reach <= period, one per axis
    whose stride can serve as the period (finest first); None if none.

    This describes views that interleave with others in one buffer, such as
    q and k slices of a packed [t, (hq + 2 hk) * d] projection, or of
    [b, s, hq + 2 hk, d]: at some shared period their footprints do not
    meet (for [b, s, h, d] the period of one token's heads, not of a batch
    entry's tokens).
    """
    dims = sorted((st, n) for n, st in zip(t.shape, t.strides) if n > 1)
    if not dims or dims[0][0] <= 0:
        return None
    levels, reach = [], 1
    for i, (st, n) in enumerate(dims):
        if i and st >= reach and all(o % st == 0 for o, _ in dims[i:]):
            levels.append((st * t.itemsize, reach * t.itemsize))
        reach = max(reach, st * (n - 1) + reach)
    return tuple(levels) or None


def disjoint_at(pa: int, span_a: tuple, lat_a, pb: int, span_b: tuple, lat_b) -> bool:
    """Can two views at data pointers pa, pb (spans and lattices relative to
    their pointers) share no byte? A sufficient test: spans apart, or a
    period both lattices have at which the footprints do not meet."""
    if not (pa + span_a[0] < pb + span_b[1] and pb + span_b[0] < pa + span_a[1]):
        return True
    if lat_a is None or lat_b is None:
        return False
    reach_b = dict(lat_b)
    for period, reach_a in lat_a:
        rb = reach_b.get(period)
        if rb is not None:
            d = (pb - pa) % period  # where b's footprint starts, counted from a's
            if d >= reach_a and period - d >= rb:
                return True
    return False


def rel_span(t: Tensor) -> tuple:
    lo, hi = t.span()
    return lo - t.ptr, hi - t.ptr


def disjoint(a: Tensor, b: Tensor) -> bool:
    return disjoint_at(a.ptr, rel_span(a), lattice(a), b.ptr, rel_span(b), lattice(b))


def _layout_axes(layout: str) -> str:
    return {"bshd": "[b, s, h, d]", "sbhd": "[s, b, h, d]", "thd": "[t, h, d]"}[layout]


def head_view(t: Tensor, name: str, layout: str, head_dim: Optional[int]):
    """(batch, seqlen, heads, d, strides5) of an activation in ``layout``.

    Accepts the layout's own rank ([b, s, h, d], [s, b, h, d], [t, h, d]) or
    one less with heads and channels flattened ([.., h * d]) when
    ``head_dim`` is given. strides5 = (batch, seq, group=0, head, dim).
    """
    n_tok = 1 if layout == "thd" else 2
    if t.ndim == n_tok + 2:
        h, d = t.shape[n_tok], t.shape[n_tok + 1]
        sh, sd = t.strides[n_tok], t.strides[n_tok + 1]
        if head_dim is not None and head_dim != d:
            raise ValueError(f"head_dim: expected {d} (the last axis of {name}), got {head_dim}")
    elif t.ndim == n_tok + 1 and head_dim is not None:
        w, sd = t.shape[n_tok], t.strides[n_tok]
        if head_dim < 2 or w % head_dim:
            raise ValueError(f"{name}: the last axis ({w}) is not a multiple of "
                             f"head_dim ({head_dim})")
        h, d, sh = w // head_dim, head_dim, head_dim * sd
    else:
        flat = _layout_axes(layout).replace(", h, d]", ", h * d] with head_dim=")
        raise ValueError(f"{name}: expected a {n_tok + 2}-D array {_layout_axes(layout)} for "
                         f"layout {layout!r} (or {flat}), got shape {fmt_shape(t.shape)}")
    if layout == "thd":
        batch, seqlen, sb, ss = 1, t.shape[0], 0, t.strides[0]
    else:
        b_axis, s_axis = LAYOUTS[layout]
        batch, seqlen = t.shape[b_axis], t.shape[s_axis]
        sb, ss = t.strides[b_axis], t.strides[s_axis]
    return batch, seqlen, h, d, (sb, ss, 0, sh, sd)


def _check_head_dim(d: int, name: str, on_gpu: bool) -> None:
    if d % 2 or d < 2:
        raise ValueError(f"{name}: head_dim (last axis) must be even and >= 2, got {d}")
    if on_gpu and d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim (last axis) must be <= {MAX_HEAD_DIM}, got {d}")


#: Angles computed from inv_freq take positions p with |p| < 2**53, which
#: fp64 holds exactly (kernels/angles.cuh: NaN beyond).
MAX_COMPUTED_POSITION = 2**53


def _host_values(t: Tensor) -> Optional[np.ndarray]:
    """Values of a host array (NumPy, CPU torch), else None."""
    if t.on_gpu:
        return None
    return np.asarray(t.obj if t.kind != "torch" else t.obj.numpy())


# ------------------------------------------------------------- describe ----
def _is_scalar_offset(offsets) -> bool:
    """An offsets value that is not an array (an int; bool for the message)."""
    return isinstance(offsets, (bool, int, np.integer))


def describe_arrays(op: str, inputs, tables, positions=None, offsets=None, cu_seqlens=None,
                    outputs=()) -> Arrays:
    """Describe every array argument of one call once, by role (see
    :class:`Arrays`; ``outputs`` may be shorter than the op's, meaning
    None). Raises ``TypeError`` naming an argument that is no array."""
    def one(a, name):
        return None if a is None else describe(a, name)

    outputs = tuple(outputs) + (None,) * (len(OUTPUT_NAMES[op]) - len(outputs))
    return Arrays(
        op, tuple(_describe_input(a, n) for a, n in zip(inputs, INPUT_NAMES[op])),
        tuple(one(a, n) for a, n in zip(tables, TABLE_NAMES)),
        one(positions, "positions"),
        _describe_offsets(offsets),
        one(cu_seqlens, "cu_seqlens"),
        tuple(one(a, n) for a, n in zip(outputs, OUTPUT_NAMES[op])))


def _describe_input(a, name: str) -> Tensor:
    """An input array, described; None is refused."""
    if a is None:
        raise none_input(name)
    return describe(a, name)


def none_input(name: str, alone: str = "apply_rope (RotaryEmbedding.rope)") -> TypeError:
    """The error for an input given as None; for k it names ``alone``, the
    call that rotates q alone (the q + k calls have no q-alone form). The
    framework adapters raise it too, naming their own call."""
    hint = f"; to rotate q alone use {alone}" if name == "k" else ""
    return TypeError(f"{name}: expected an array, got None{hint}")


def host_offset(offsets) -> Optional[int]:
    """The value of a host 0-d integer array (NumPy, CPU torch) passed as
    ``offsets``, else None: such an array is a scalar offset, as an int is."""
    if getattr(offsets, "ndim", None) != 0 or isinstance(offsets, np.generic):
        return None
    # Device arrays are told apart without a description: cached calls with a
    # device 0-d offsets array pass through here.
    if type(offsets) is not np.ndarray and (getattr(offsets, "is_cuda", False)
                                            or hasattr(offsets, "__cuda_array_interface__")):
        return None
    try:
        t = describe(offsets, "offsets")
    except (TypeError, ValueError):
        return None
    if t.on_gpu or t.dtype not in INDEX_DTYPES:
        return None
    return int(_host_values(t))


def _describe_offsets(offsets):
    """``offsets`` as :func:`check` takes it: None, an int (also from a host
    0-d integer array) or the description of an array."""
    if offsets is None or _is_scalar_offset(offsets):
        return offsets
    value = host_offset(offsets)
    if value is not None:
        return value
    if not isinstance(offsets, (Tensor, np.ndarray)) and not hasattr(offsets, "__dlpack__"):
        raise TypeError(f"offsets: expected an int or an int32/int64 array, "
                        f"got {type_name(offsets)}")
    return describe(offsets, "offsets")


#: The options that are flags: a Python or NumPy bool, validated as a Python bool.
FLAGS = ("inplace", "interleaved", "backward", "sections_interleaved")


def check_options(options: Options) -> Options:
    """The checks of options that come before any array is looked at;
    returns ``options`` with its flags Python bools and ``head_dim``,
    ``cp_size`` and ``cp_rank`` ints."""
    layout = options.layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    fixed = {name: _as_bool(getattr(options, name), name) for name in FLAGS}
    if options.head_dim is not None:
        fixed["head_dim"] = _as_int(options.head_dim, "head_dim")
    fixed["cp_size"], fixed["cp_rank"] = check_context_parallel(options.cp_size, options.cp_rank)
    return options._replace(**fixed)


def check_bound(tables, options: Options) -> Options:
    """The checks a :class:`~cupy_rope.api.RotaryEmbedding` runs when built:
    its options (:func:`check_options`), then its angle source (``tables`` in
    TABLE_NAMES order) and what follows from it alone (rotary_dim, sections),
    as a call checks them for an x of the tables' dtype on their device.
    What needs x (head_dim, the table dtype against x's) waits for the call.
    Returns the checked options."""
    options = check_options(options)
    described = tuple(None if t is None else describe(t, n) for t, n in zip(tables, TABLE_NAMES))
    _source_name(described)
    first = next(t for t in described if t is not None)
    # An x the tables can go with: of their dtype where an input may have it.
    like_x = _Geometry(batch=1, seqlen=1, head_dim=0, device=first.device,
                       dtype=first.dtype if first.dtype in _floats(first.on_gpu) else "float32")
    angles = _angle_source(described, like_x)
    # Without head_dim the head's size is x's: no upper bound on rotary_dim yet.
    head_dim = options.head_dim if options.head_dim is not None else MAX_INDEX
    rotary_dim = _rotary_dim(options.rotary_dim, angles.width, head_dim, angles.name)
    sections = _sections(options.sections, options.sections_interleaved, rotary_dim)
    return options._replace(sections=tuple(sections) if options.sections is not None else None)


def check_context_parallel(cp_size, cp_rank) -> tuple:
    """(cp_size, cp_rank) as ints, checked: cp_size >= 1, 0 <= cp_rank < cp_size."""
    cp_size, cp_rank = _as_int(cp_size, "cp_size"), _as_int(cp_rank, "cp_rank")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size ({cp_size}), got {cp_rank}")
    return cp_size, cp_rank


# --------------------------------------------------------------- angles ----
def _source_name(tables) -> str:
    """Which one angle source the tables give (a name of TABLE_NAMES; "cos" for cos and sin)."""
    given = [n for n, v in zip(TABLE_NAMES, tables) if v is not None]
    if given in (["cos", "sin"], ["inv_freq"], ["freqs"], ["cos_sin_cache"]):
        return given[0]
    if given == ["cos"] or given == ["sin"]:
        raise ValueError(f"{'sin' if given == ['cos'] else 'cos'}: cos and sin tables come "
                         "together; pass both")
    if not given:
        raise ValueError("cos/sin, inv_freq, freqs or cos_sin_cache: pass exactly one angle "
                         "source, got none")
    raise ValueError(f"{', '.join(given)}: pass exactly one angle source "
                     "(cos and sin, inv_freq, freqs, or cos_sin_cache)")


def _angle_dtypes(dtype: str) -> tuple:
    """(dtypes of inv_freq and freqs, dtypes of cos, sin and cos_sin_cache)
    for input of ``dtype``, one rule on every device: tables float32 or the
    input's dtype, inv_freq and freqs float32 (what the kernels read). float64
    goes only with float64 input, which only the NumPy reference takes, so a
    call the NumPy path accepts is one the GPU path accepts too."""
    computed = ("float32", "float64") if dtype == "float64" else ("float32",)
    return computed, ("float32",) if dtype == "float32" else ("float32", dtype)


def _check_table_dtype(t: Tensor, name: str, allowed) -> None:
    """An angle source's dtype, with the cast that fixes a refused one."""
    if t.dtype in allowed:
        return
    cast = {"torch": ".float()", "jax": ".astype(jax.numpy.float32)"}.get(
        t.kind, ".astype(numpy.float32)")
    rule = ("inv_freq and freqs are float32" if name in ("inv_freq", "freqs")
            else "cos, sin and cos_sin_cache are float32 or the input's dtype")
    raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {t.dtype}; {rule} "
                    f"(float64 only with float64 input); cast it with {cast}")


def _angle_source(tables, geometry: _Geometry) -> _Angles:
    """The checked angle source of the described ``tables`` (TABLE_NAMES order)."""
    cos, sin, inv_freq, freqs, cos_sin_cache = tables
    name = _source_name(tables)
    dtype, device = geometry.dtype, geometry.device
    f32, table_dtypes = _angle_dtypes(dtype)
    if name == "inv_freq":
        t = inv_freq
        if t.ndim != 1:
            raise ValueError(f"inv_freq: expected a 1-D array [rotary_dim / 2], "
                             f"got shape {fmt_shape(t.shape)}")
        _check_table_dtype(t, "inv_freq", f32)
        _same_device(t, device, "inv_freq")
        return _Angles("inv_freq", (t,), (0,), t.shape[0], 0, "inv_freq")
    if name == "cos_sin_cache":
        return _cos_sin_cache(cos_sin_cache, table_dtypes, device)
    if name == "freqs":
        source, found, names, allowed = "freqs", (freqs,), ("freqs",), f32
    else:
        source, found, names, allowed = "table", (cos, sin), ("cos", "sin"), table_dtypes
    for t, n in zip(found, names):
        if t.ndim != 2:
            raise ValueError(f"{n}: expected a 2-D table [max_position, rotary_dim / 2], "
                             f"got shape {fmt_shape(t.shape)}")
        _check_table_dtype(t, n, allowed)
        _same_device(t, device, n)
    if source == "table":
        if cos.shape != sin.shape:
            raise ValueError(f"sin: expected the shape of cos {fmt_shape(cos.shape)}, "
                             f"got {fmt_shape(sin.shape)}")
        if cos.dtype != sin.dtype:
            raise TypeError(f"sin: expected the dtype of cos ({cos.dtype}), got {sin.dtype}")
    max_position, width = found[0].shape
    if max_position < 1:
        raise ValueError(f"{names[0]}: the table has no rows")
    return _Angles(source, found, (0,) * len(found), width, max_position, names[0])


def _cos_sin_cache(t: Tensor, allowed, device) -> _Angles:
    """One [max_position, rotary_dim] table: cos in the first half, sin in the second."""
    if t.ndim != 2 or t.shape[1] % 2:
        raise ValueError("cos_sin_cache: expected a 2-D table [max_position, rotary_dim] "
                         f"(cos in the first half, sin in the second), got shape "
                         f"{fmt_shape(t.shape)}")
    _check_table_dtype(t, "cos_sin_cache", allowed)
    _same_device(t, device, "cos_sin_cache")
    half = t.shape[1] // 2
    if t.shape[0] < 1:
        raise ValueError("cos_sin_cache: the table has no rows")
    return _Angles("table", (t, t), (0, half * t.strides[1]), half, t.shape[0], "cos_sin_cache")


def _rotary_dim(rotary_dim, width: int, head_dim: int, src_name: str) -> int:
    if width < 1:
        raise ValueError(f"{src_name}: expected at least one frequency in its last axis "
                         f"(rotary_dim / 2 >= 1)")
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
        hint = ""
        if width == head_dim and src_name in ("cos", "sin", "freqs"):
            hint = (f"; {src_name} holds one value per pair ([positions, rotary_dim / 2]): "
                    f"for a full-width table (Hugging Face's [positions, head_dim]) pass "
                    f"{src_name}[..., :{head_dim // 2}]")
        raise ValueError(f"rotary_dim: must be <= head_dim ({head_dim}), got {rotary_dim} "
                         f"(from {src_name} with {width} frequencies){hint}")
    return rotary_dim


# ------------------------------------------------------------ positions ----
def check_cu_seqlens(cu_t: Tensor, tokens: int, cp_size: int) -> int:
    if cu_t.ndim != 1 or cu_t.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected a 1-D array [n_seqs + 1], "
                         f"got shape {fmt_shape(cu_t.shape)}")
    _check_dtype(cu_t, "cu_seqlens", ("int32",))
    if cu_t.shape[0] > 1 and cu_t.strides[0] != 1:
        raise ValueError(f"cu_seqlens: expected a contiguous array (stride 1), "
                         f"got stride {cu_t.strides[0]}")
    n_seqs = cu_t.shape[0] - 1
    cu = _host_values(cu_t)
    if cu is not None:
        cu = cu.astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: must start at 0, got {cu[0]}")
        lengths = np.diff(cu)
        if (lengths < 0).any():
            i = int(np.argmax(lengths < 0))
            raise ValueError(f"cu_seqlens: must be non-decreasing, but cu_seqlens[{i + 1}] = "
                             f"{cu[i + 1]} < cu_seqlens[{i}] = {cu[i]}")
        if cp_size > 1 and (lengths % (2 * cp_size)).any():
            i = int(np.argmax(lengths % (2 * cp_size) != 0))
            raise ValueError(f"cu_seqlens: with cp_size={cp_size} every sequence length must be "
                             f"divisible by 2 * cp_size = {2 * cp_size}; sequence {i} has "
                             f"length {lengths[i]}")
        if cu[-1] != tokens * cp_size:
            want = (f"{tokens} (the tokens of x)" if cp_size == 1 else
                    f"{tokens * cp_size} (the tokens of x times cp_size: cu_seqlens describe the "
                    "full sequences)")
            raise ValueError(f"cu_seqlens: the last entry must be {want}, got {cu[-1]}")
    return n_seqs


def _sections(sections, interleaved, rotary_dim: int):
    """Validated per-axis frequency counts (M-RoPE / axial RoPE)."""
    if not isinstance(interleaved, bool):
        raise TypeError(f"sections_interleaved: expected a bool, got {type(interleaved).__name__}")
    if sections is None:
        if interleaved:
            raise ValueError("sections_interleaved: needs sections")
        return ()
    try:
        sections = tuple(_as_int(v, "sections") for v in sections)
    except TypeError:
        raise TypeError("sections: expected a sequence of ints (frequencies per position "
                        f"axis), got {sections!r}") from None
    if not 1 <= len(sections) <= 3 or any(v < 0 for v in sections):
        raise ValueError(f"sections: expected 1 to 3 non-negative frequency counts (one per "
                         f"position axis), got {list(sections)}")
    if sum(sections) != rotary_dim // 2:
        raise ValueError(f"sections: must sum to rotary_dim / 2 = {rotary_dim // 2} (frequencies, "
                         f"not channels), got {list(sections)} (sum {sum(sections)})")
    if interleaved and len(sections) != 3:
        raise ValueError("sections_interleaved: the interleaved assignment (Qwen3-VL) needs 3 "
                         f"sections, got {len(sections)}")
    return sections


#: Positions and offsets stay below this in magnitude, so that no position
#: plus offset wraps around in int64, on the host or in the kernel.
MAX_INDEX = 2**62


def _below_max_index(v, name: str) -> None:
    """An int offset, or the values of a host array (device arrays cannot be
    read without a sync), below MAX_INDEX in magnitude."""
    if not isinstance(v, Tensor):
        if abs(v) >= MAX_INDEX:
            raise ValueError(f"{name}: expected |{name}| < 2**62, got {v}")
        return
    values = _host_values(v)
    if values is not None and values.size:
        big = max(-int(values.min()), int(values.max()))
        if big >= MAX_INDEX:
            raise ValueError(f"{name}: expected values below 2**62 in magnitude, got {big}")


def _positions(arrays: Arrays, options: Options, geometry: _Geometry,
               n_axes: int = 0) -> _Positions:
    """The position rule of a call: positions, offsets and cu_seqlens checked
    against the token axes and each other (n_axes: rows of per-axis positions)."""
    cp_size = _as_int(options.cp_size, "cp_size")
    cp_rank = _as_int(options.cp_rank, "cp_rank")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size ({cp_size}), got {cp_rank}")
    layout, seqlen, device = options.layout, geometry.seqlen, geometry.device
    cu_t, n_seqs = arrays.cu_seqlens, 0
    if cu_t is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens: only for layout 'thd' (packed sequences), "
                             f"got layout {layout!r}")
        if cu_t.on_gpu or device[0] != "cuda":  # host cu_seqlens are checked, then uploaded
            _same_device(cu_t, device, "cu_seqlens")
        n_seqs = check_cu_seqlens(cu_t, seqlen, cp_size)
    pos_t = arrays.positions
    if n_axes and pos_t is None:
        raise ValueError(f"positions: sections need explicit positions, one row per axis "
                         f"([{n_axes}, ...])")
    if pos_t is not None:
        if cu_t is not None:
            raise ValueError("positions: pass either explicit positions or cu_seqlens, not both")
        if cp_size > 1:
            raise ValueError("positions: explicit positions are already global; cp_size/cp_rank "
                             "remap only the implied positions (leave positions out, or use "
                             "cp_size=1)")
        pos_t = _explicit_positions(pos_t, layout, geometry, n_axes)
    elif cp_size > 1 and cu_t is None and seqlen % 2:
        raise ValueError(f"x: with cp_size={cp_size} the local sequence length must be even "
                         f"(two chunks per rank), got {seqlen}")
    off_t, offset = _offsets(arrays.offsets, layout, geometry, cu_t, n_seqs)
    mode = (AXES if n_axes else EXPLICIT if pos_t is not None else
            VARLEN if cu_t is not None else IMPLIED)
    return _Positions(mode, pos_t, off_t, offset, cu_t, n_seqs, cp_size, cp_rank)


def _explicit_positions(pos_t: Tensor, layout: str, geometry: _Geometry, n_axes: int) -> Tensor:
    """positions: [s], [1, s] or [b, s] (thd: [t]), with a leading [axes] for
    sections; returned described as [s] where given as [1, s] for a larger
    batch (Hugging Face's position_ids), so that both forms get one plan."""
    batch, seqlen = geometry.batch, geometry.seqlen
    _same_device(pos_t, geometry.device, "positions")
    _check_dtype(pos_t, "positions", INDEX_DTYPES)
    _below_max_index(pos_t, "positions")
    lead = (n_axes,) if n_axes else ()
    if layout != "thd" and batch != 1 and pos_t.shape == lead + (1, seqlen):
        return pos_t._replace(shape=lead + (seqlen,),
                              strides=pos_t.strides[:len(lead)] + pos_t.strides[-1:])
    want = ((seqlen,),) if layout == "thd" else ((seqlen,), (batch, seqlen))
    if pos_t.shape not in [lead + w for w in want]:
        raise ValueError(f"positions: expected shape {_positions_shapes(layout, geometry, n_axes)}"
                         f", got {fmt_shape(pos_t.shape)}")
    return pos_t


def _positions_shapes(layout: str, geometry: _Geometry, n_axes: int) -> str:
    """The accepted shapes of positions, in numbers and in words (for messages)."""
    s, b = geometry.seqlen, geometry.batch
    lead, rows = (f"{n_axes}, ", "axes, ") if n_axes else ("", "")
    per_axis = f"one row per axis: len(sections) = {n_axes}"
    if layout == "thd":
        return f"[{lead}{s}] ({per_axis if n_axes else 'one per token'})"
    forms = [f"[{lead}{s}]"] + [f"[{lead}{n}, {s}]" for n in dict.fromkeys((1, b))]
    words = [f"[{rows}s]"] + ([f"[{rows}1, s]"] if b != 1 else []) + [f"[{rows}b, s]"]

    def listed(items):
        return f"{', '.join(items[:-1])} or {items[-1]}"

    return f"{listed(forms)} ({listed(words)}{'; ' + per_axis if n_axes else ''})"


def _offsets(offsets, layout: str, geometry: _Geometry, cu_t, n_seqs: int):
    """(offsets array or None, scalar offset): one per batch entry, or with
    cu_seqlens one per sequence, or one int for every token."""
    if offsets is None:
        return None, 0
    if isinstance(offsets, bool):
        raise TypeError("offsets: expected an int or an int32/int64 array, got bool")
    if _is_scalar_offset(offsets):
        offset = int(offsets)
        _below_max_index(offset, "offsets")
        return None, offset
    off_t = offsets
    _same_device(off_t, geometry.device, "offsets")
    _check_dtype(off_t, "offsets", INDEX_DTYPES)
    _below_max_index(off_t, "offsets")
    if off_t.ndim == 0:
        off_t = _broadcast_offset(off_t, layout, geometry.batch, n_seqs)
    if layout == "thd":
        if cu_t is None:
            raise ValueError("offsets: an offsets array with layout 'thd' needs "
                             "cu_seqlens (one offset per sequence); pass an int otherwise")
        if off_t.shape != (n_seqs,):
            raise ValueError(f"offsets: expected shape [{n_seqs}] (one per sequence) "
                             f"or an int, got {fmt_shape(off_t.shape)}")
        if n_seqs > 1 and off_t.strides[0] != 1:
            raise ValueError(f"offsets: expected a contiguous array (stride 1) with "
                             f"cu_seqlens, got stride {off_t.strides[0]}")
    elif off_t.shape != (geometry.batch,):
        raise ValueError(f"offsets: expected shape [{geometry.batch}] (one per batch entry) "
                         f"or an int, got {fmt_shape(off_t.shape)}")
    return off_t, 0


def _broadcast_offset(off_t: Tensor, layout: str, batch: int, n_seqs: int) -> Tensor:
    """A device 0-d offsets array (a host one is an int by now) as one offset
    for every batch entry: read through stride 0, so it costs no sync. The
    kernel reads per-sequence offsets (cu_seqlens) contiguously, so there
    only one sequence can take it."""
    if layout != "thd":
        return off_t._replace(shape=(batch,), strides=(0,))
    if n_seqs > 1:
        raise ValueError(f"offsets: a 0-d device array is one offset for every batch entry "
                         f"(bshd, sbhd); with cu_seqlens pass one per sequence "
                         f"[{n_seqs}], or an int")
    return off_t._replace(shape=(n_seqs,), strides=(0,)) if n_seqs else off_t


def _check_position_range(call: Call, src_name: str) -> None:
    """Positions the host can see against the table (computed angles: against
    the range where fp64 holds them exactly). Device positions cannot be
    checked without a sync: the kernel writes NaN for any position outside
    the table instead of reading out of bounds."""
    if call.tokens == 0:
        return
    if call.pos_mode == IMPLIED and call.offsets is None:
        lo, hi = call.offset, (call.seqlen * call.cp_size - 1) + call.offset
    else:
        pos = host_positions(call)
        if pos is None or not pos.size:
            return
        lo, hi = int(pos.min()), int(pos.max())
    if call.source == "inv_freq":
        if lo <= -MAX_COMPUTED_POSITION or hi >= MAX_COMPUTED_POSITION:
            raise ValueError(f"positions: angles computed from inv_freq take positions "
                             f"below 2**53 in magnitude, but positions reach "
                             f"{hi if hi >= MAX_COMPUTED_POSITION else lo}")
    elif lo < 0 or hi >= call.max_position:
        raise ValueError(f"{src_name}: the table has {call.max_position} rows (positions "
                         f"0..{call.max_position - 1}) but positions reach "
                         f"{lo if lo < 0 else hi}")


def host_positions(call: Call) -> Optional[np.ndarray]:
    """int64 [batch, seqlen] positions of every token if the host knows them
    (cp remap included; [axes, batch, seqlen] with sections), else None."""
    b, s = call.batch, call.seqlen
    off = None
    if call.offsets is not None:
        off = _host_values(call.offsets)
        if off is None:
            return None
        off = off.astype(np.int64)
    if call.pos_mode == AXES:  # [axes, b, s]
        pos = _host_values(call.positions)
        if pos is None:
            return None
        pos = np.broadcast_to(pos.astype(np.int64)[:, None] if pos.ndim == 2 and
                              call.layout != "thd" else
                              pos.astype(np.int64).reshape(pos.shape[0], -1, s),
                              (pos.shape[0], b, s))
        if off is not None:
            pos = pos + off[None, :, None]
        return pos + call.offset
    if call.pos_mode == EXPLICIT:
        pos = _host_values(call.positions)
        if pos is None:
            return None
        pos = np.broadcast_to(pos.astype(np.int64), (b, s))
    elif call.pos_mode == IMPLIED:
        i = np.arange(s, dtype=np.int64)
        if call.cp_size > 1:
            i = cp_global_index(i, s // 2, call.cp_size, call.cp_rank)
        pos = np.broadcast_to(i, (b, s))
    else:
        cu = _host_values(call.cu_seqlens)
        if cu is None:
            return None
        cu = cu.astype(np.int64)
        starts = cu // call.cp_size
        t = np.arange(s, dtype=np.int64)
        seq = np.searchsorted(starts, t, side="right") - 1
        i = t - starts[seq]
        if call.cp_size > 1:
            chunk = (cu[seq + 1] - cu[seq]) // (2 * call.cp_size)
            i = cp_global_index(i, chunk, call.cp_size, call.cp_rank)
        pos = i[None]
        if off is not None:
            pos = pos + off[seq][None]
            off = None
    if off is not None:
        pos = pos + off[:, None]
    return pos + call.offset


def cp_global_index(i, chunk, cp_size, cp_rank):
    """Dual-chunk context parallelism: local index -> index in the full sequence.

    A sequence of length L is cut into 2 * cp_size chunks of c = L / (2 * cp_size);
    rank r holds chunks r and 2 * cp_size - 1 - r, in that order.
    """
    return np.where(i < chunk, cp_rank * chunk + i, (2 * cp_size - 1 - cp_rank) * chunk + i - chunk)


# --------------------------------------------------------------- output ----
def _check_writable(t: Tensor, name: str, read_only) -> None:
    if t.readonly:
        kind = "JAX arrays are immutable" if t.kind == "jax" else "it is read-only"
        raise TypeError(f"{name}: cannot be written in place ({kind}); "
                        "use the returned array instead")
    if t.self_overlapping():
        raise ValueError(f"{name}: has elements that share memory (stride 0 or overlapping "
                         "strides); cannot be written")
    for other, n in read_only:
        if other is not t and not disjoint(other, t):
            raise ValueError(f"{name}: overlaps {n}; the output must not alias the inputs")


def _check_out(out_t: Tensor, name: str, shape, dtype: str, device: tuple) -> None:
    if tuple(out_t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {fmt_shape(shape)}, "
                         f"got {fmt_shape(out_t.shape)}")
    if out_t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out_t.dtype}")
    _same_device(out_t, device, name)


def _same_view(a: Tensor, b: Tensor) -> bool:
    """The very same elements (empty arrays hold none, whatever their pointer)."""
    return (a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape
            and 0 not in a.shape)




# ----------------------------------------------------------------- core ----
def check_call(x=None, cos=None, sin=None, *, k=None, qkv=None, inv_freq=None, freqs=None,
               cos_sin_cache=None, positions=None, offsets=None, layout="bshd",
               interleaved=False, rotary_dim=None, inplace=False, out=None, out_k=None,
               backward=False, cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None,
               num_q_heads=None, num_kv_heads=None, packing="concat", qkv_grads=None,
               sections=None, sections_interleaved=False) -> Call:
    """Validate one operation given the public keyword arguments.

    - ``x`` alone: apply_rope (out -> ``out``).
    - ``x`` and ``k``: apply_rope_qk (outputs ``out`` and ``out_k``).
    - ``qkv``: apply_rope_qkv forward: slabs read views of the packed array;
      ``out`` is (out_q, out_k, out_v) or None (Slab.out None: the caller
      allocates them).
    - ``qkv_grads=(dq, dk, dv)``: apply_rope_qkv_backward: slabs read the three
      arrays and write views of ``out`` (the packed gradient) when given;
      ``num_q_heads`` / ``num_kv_heads`` default to the heads of dq and dk.

    Arrays may be given as :class:`~cupy_rope.interop.Tensor` descriptions.
    """
    options = check_options(Options(layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank,
                                     sections, sections_interleaved, backward, inplace,
                                     num_q_heads, num_kv_heads, packing))
    if qkv_grads is not None:
        if len(qkv_grads) != 3:
            raise ValueError("dq, dk, dv: expected three gradients")
        op, inputs, outputs = "qkv_backward", tuple(qkv_grads), (out,)
    elif qkv is not None:
        op, inputs, outputs = "qkv", (qkv,), (() if out is None else tuple(out))
    elif k is None:
        if out_k is not None:
            raise ValueError("out_k: only for apply_rope_qk")
        op, inputs, outputs = "rope", (x,), (out,)
    else:
        op, inputs, outputs = "qk", (x, k), (out, out_k)
    return check(describe_arrays(op, inputs, (cos, sin, inv_freq, freqs, cos_sin_cache),
                                 positions, offsets, cu_seqlens, outputs), options)


def check(arrays: Arrays, options: Options) -> Call:
    """Validate one call from its described arrays and its options (which
    :func:`check_options` has seen): inputs, angle source, position rule,
    outputs, then what depends on all of them (position range, alignment)."""
    slabs, geometry = _input_slabs(arrays, options)
    _check_head_dim(geometry.head_dim, slabs[0].name, geometry.device[0] == "cuda")
    angles = _angle_source(arrays.tables, geometry)
    rotary_dim = _rotary_dim(options.rotary_dim, angles.width, geometry.head_dim, angles.name)
    sections = _sections(options.sections, options.sections_interleaved, rotary_dim)
    if sections and (arrays.cu_seqlens is not None or options.cp_size != 1):
        raise ValueError("sections: per-axis positions are explicit; cu_seqlens and context "
                         "parallelism do not apply")
    pos = _positions(arrays, options, geometry, len(sections))
    table_names = (("cos", "sin") if angles.name == "cos" else (angles.name,) * len(angles.tables))
    read_only = list(zip(angles.tables, table_names)) + [
        (t, n) for t, n in ((pos.positions, "positions"), (pos.offsets, "offsets"),
                            (pos.cu_seqlens, "cu_seqlens")) if t is not None]
    slabs, inplace = _output_slabs(arrays, options, slabs, geometry, read_only)
    call = Call(options.layout, geometry.batch, geometry.seqlen, geometry.head_dim, rotary_dim,
                options.interleaved, options.backward, inplace, tuple(slabs), geometry.dtype,
                geometry.device, angles.source, angles.tables, angles.table_offsets,
                angles.max_position, pos.mode, pos.positions, pos.offsets, pos.offset,
                pos.cu_seqlens, pos.n_seqs, pos.cp_size, pos.cp_rank, sections,
                options.sections_interleaved)
    _check_position_range(call, angles.name)
    if call.on_gpu:
        _check_alignment([(s.x, s.name) for s in slabs] + [
            (s.out, "out") for s in slabs if s.out is not None] + read_only)
    return call


def _check_alignment(named) -> None:
    """Every device array's data pointer on a whole element (the kernels' loads need it)."""
    for t, n in named:
        if t.ptr % t.itemsize:
            raise ValueError(f"{n}: data pointer {t.ptr:#x} is not aligned to its "
                             f"{t.itemsize}-byte elements")


def attach_outputs(call: Call, outputs: tuple, options: Options) -> Call:
    """``call`` writing into outputs the caller allocated for it (described;
    as the library allocates them: like each input, [.., h, d] per slab for
    apply_rope_qkv, one packed [.., (hq + 2 hk) * d] for its backward)."""
    slabs = call.slabs
    if len(outputs) == 1 and len(slabs) == 3:  # the packed gradient
        packed = outputs[0]
        view = _packed_view(packed, "out", call.layout, call.head_dim, call.heads)
        split = _split_heads(options.packing, slabs[0].heads, slabs[1].heads, view)
        slabs = [s._replace(out=packed, out_offset=off, out_strides=st5, heads_per_group=hpg)
                 for s, (off, st5, hpg) in zip(slabs, split)]
    else:
        head_dim = None if len(slabs) == 3 else call.head_dim
        slabs = [s._replace(out=o, out_strides=head_view(o, "out", call.layout, head_dim)[4])
                 for s, o in zip(slabs, outputs)]
    return call._replace(slabs=tuple(slabs))


# ------------------------------------------------------- slabs: activations --
def _input_slabs(arrays: Arrays, options: Options):
    """(slabs reading the inputs, their shared _Geometry)."""
    if arrays.op in ("rope", "qk"):
        return _activation_slabs(arrays, options)
    if options.inplace:
        raise ValueError("inplace: the fused QKV split writes new arrays")
    hq, hk = _qkv_heads(arrays, options)
    if arrays.op == "qkv":
        return _qkv_forward_slabs(arrays, options, hq, hk)
    return _qkv_backward_slabs(arrays, options, hq, hk)


def _activation_slabs(arrays: Arrays, options: Options):
    """x, or q and k: one slab each, on the same token axes."""
    layout, head_dim = options.layout, options.head_dim
    names = INPUT_NAMES[arrays.op]
    xt = arrays.inputs[0]
    if xt.dtype in INDEX_DTYPES:  # positions passed first, as vLLM's forward(positions, q, k)
        raise TypeError(f"{names[0]}: expected dtype {' or '.join(_floats(xt.on_gpu))}, got "
                        f"{xt.dtype}; positions come last (positions=, or after the arrays "
                        "to rotate)")
    _check_dtype(xt, names[0], _floats(xt.on_gpu))
    batch, seqlen, h, d, st = head_view(xt, names[0], layout, head_dim)
    slabs = [Slab(names[0], xt, 0, st, None, 0, None, h, h, True)]
    if arrays.op == "qk":
        kt = arrays.inputs[1]
        _same_device(kt, xt.device, "k", "q")
        if kt.dtype != xt.dtype:
            raise TypeError(f"k: expected dtype {xt.dtype} (that of q), got {kt.dtype}")
        kb, ks, kh, kd, kst = head_view(kt, "k", layout, head_dim)
        if (kb, ks) != (batch, seqlen):
            tok = fmt_shape((batch, seqlen)) if layout != "thd" else seqlen
            raise ValueError(f"k: expected the token axes of q ({tok}), "
                             f"got shape {fmt_shape(kt.shape)}")
        if kd != d:
            raise ValueError(f"k: expected head_dim {d} (that of q), got {kd}")
        slabs.append(Slab("k", kt, 0, kst, None, 0, None, kh, kh, True))
    return slabs, _Geometry(batch, seqlen, d, xt.dtype, xt.device)


def _output_slabs(arrays: Arrays, options: Options, slabs, geometry: _Geometry, read_only):
    """(slabs with their given outputs checked as written, inplace)."""
    if arrays.op in ("rope", "qk"):
        return _activation_outputs(arrays.outputs, slabs, options, geometry, read_only)
    if slabs[0].out is None:
        pass
    elif arrays.op == "qkv_backward":  # into the given packed gradient
        _check_writable(slabs[0].out, "out", read_only + [(s.x, s.name) for s in slabs])
    else:  # into the given out_q, out_k, out_v
        for s in slabs:
            _check_writable(s.out, "out_" + s.name, read_only + [(s.x, "qkv")] +
                            [(o.out, "out_" + o.name) for o in slabs if o is not s])
    return slabs, options.inplace


def _activation_outputs(outputs, slabs, options: Options, geometry: _Geometry, read_only):
    """apply_rope / apply_rope_qk: new outputs (Slab.out None), the given
    ones (never an input itself: in place is ``inplace=True``), or the
    inputs themselves (in place)."""
    out_names = OUTPUT_NAMES["rope" if len(slabs) == 1 else "qk"]
    given = [o is not None for o in outputs]
    if any(given) and not all(given):
        raise ValueError(f"{out_names[given.index(False)]}: pass an output for every input, "
                         "or none")
    for s, ot, n in zip(slabs, outputs, out_names):
        if ot is not None:
            _check_out(ot, n, s.x.shape, geometry.dtype, geometry.device)
    inplace = options.inplace
    if all(given):
        if inplace:
            what = "out=" if len(slabs) == 1 else "outputs"
            raise ValueError(f"{out_names[0]}: pass either {what} or inplace=True, not both")
        for s, ot, n in zip(slabs, outputs, out_names):
            if _same_view(ot, s.x):
                names = " and ".join(sl.name for sl in slabs)
                raise ValueError(f"{n}: is {s.name} itself; pass inplace=True to rotate "
                                 f"{names} in place")
    others = [(s.x, s.name) for s in slabs]
    result = []
    for i, (s, ot) in enumerate(zip(slabs, outputs)):
        if inplace:
            _check_writable(s.x, s.name, read_only + [o for o in others if o[0] is not s.x])
            result.append(s._replace(out=s.x, out_strides=s.x_strides))
        elif ot is not None:
            for other, n in others:
                if not disjoint(ot, other):
                    raise ValueError(f"{out_names[i]}: overlaps {n}; pass a separate array, "
                                     "or rotate in place with inplace=True")
            _check_writable(ot, out_names[i], read_only +
                            [(o, out_names[j]) for j, o in enumerate(outputs) if j != i])
            st = head_view(ot, out_names[i], options.layout, options.head_dim)[4]
            result.append(s._replace(out=ot, out_strides=st))
        else:
            result.append(s)
    if inplace and len(slabs) == 2 and not disjoint(slabs[0].x, slabs[1].x):
        raise ValueError("k: overlaps q; rotating both in place needs separate memory")
    return result, inplace


# -------------------------------------------------------- slabs: fused QKV --
class _PackedView(NamedTuple):
    """A packed [.., hq + 2 hk, d] (or flat [.., (hq + 2 hk) * d]) array's
    token axes, head_dim and element strides."""

    batch: int
    seqlen: int
    head_dim: int
    batch_stride: int
    seq_stride: int
    head_stride: int
    dim_stride: int


def _qkv_heads(arrays: Arrays, options: Options):
    """(num_q_heads, num_kv_heads), checked; for the backward read off dq and dk
    when not given."""
    packing, hq, hk = options.packing, options.num_q_heads, options.num_kv_heads
    if packing not in PACKINGS:
        raise ValueError(f"packing: expected one of {', '.join(map(repr, PACKINGS))}, "
                         f"got {packing!r}")
    if arrays.op == "qkv_backward" and hq is None and hk is None:
        hq, hk = (_heads_of(t, options) for t in arrays.inputs[:2])
    if hq is None or hk is None:
        if arrays.op == "qkv_backward":
            raise ValueError("head_dim: dq and dk have flattened heads [.., h * d] (or not the "
                             "dimensions of this layout); pass head_dim= to split them")
        raise ValueError("num_q_heads, num_kv_heads: both are required for a fused QKV split")
    hq, hk = _as_int(hq, "num_q_heads"), _as_int(hk, "num_kv_heads")
    if hq < 1 or hk < 1:
        raise ValueError(f"num_q_heads, num_kv_heads: expected >= 1, got {hq}, {hk}")
    if packing == "grouped" and hq % hk:
        raise ValueError(f"num_q_heads: packing 'grouped' needs num_q_heads ({hq}) to be a "
                         f"multiple of num_kv_heads ({hk})")
    return hq, hk


def _heads_of(t: Tensor, options: Options):
    """Head count of a gradient array, or None where its shape does not tell."""
    n_tok = 1 if options.layout == "thd" else 2
    if t.ndim == n_tok + 2:
        return t.shape[-2]
    if t.ndim == n_tok + 1 and options.head_dim:
        return t.shape[-1] // options.head_dim
    return None


def _packed_view(t: Tensor, name: str, layout: str, head_dim, heads_total: int) -> _PackedView:
    """The view of a packed QKV array ``t`` holding ``heads_total`` heads."""
    n_tok = 1 if layout == "thd" else 2
    if t.ndim == n_tok + 1:
        w = t.shape[-1]
        if head_dim is None:
            if w % heads_total:
                raise ValueError(f"{name}: the last axis ({w}) is not a multiple of "
                                 f"num_q_heads + 2 * num_kv_heads = {heads_total}")
            d = w // heads_total
        else:
            d = head_dim
        if w != heads_total * d:
            raise ValueError(f"{name}: expected a last axis of (num_q_heads + 2 * "
                             f"num_kv_heads) * head_dim = {heads_total * d}, got {w}")
        sd = t.strides[-1]
        sh = d * sd
    elif t.ndim == n_tok + 2:
        if t.shape[-2] != heads_total:
            raise ValueError(f"{name}: expected {heads_total} heads (num_q_heads + 2 * "
                             f"num_kv_heads) in axis {n_tok}, got {t.shape[-2]}")
        d, sh, sd = t.shape[-1], t.strides[-2], t.strides[-1]
        if head_dim is not None and head_dim != d:
            raise ValueError(f"head_dim: expected {d} (the last axis of {name}), "
                             f"got {head_dim}")
    else:
        raise ValueError(f"{name}: expected the token axes of layout {layout!r} then "
                         f"[(hq + 2 hk) * d] or [hq + 2 hk, d], got shape "
                         f"{fmt_shape(t.shape)}")
    if layout == "thd":
        return _PackedView(1, t.shape[0], d, 0, t.strides[0], sh, sd)
    ba, sa = LAYOUTS[layout]
    return _PackedView(t.shape[ba], t.shape[sa], d, t.strides[ba], t.strides[sa], sh, sd)


def _split_heads(packing: str, hq: int, hk: int, v: _PackedView) -> list:
    """(element offset, strides5, heads_per_group) of q, k and v in a packed view."""
    if packing == "concat":
        st5 = (v.batch_stride, v.seq_stride, 0, v.head_stride, v.dim_stride)
        return [(0, st5, hq), (hq * v.head_stride, st5, hk), ((hq + hk) * v.head_stride, st5, hk)]
    g = hq // hk  # hk groups of (g q heads, 1 k head, 1 v head)
    st5 = (v.batch_stride, v.seq_stride, (g + 2) * v.head_stride, v.head_stride, v.dim_stride)
    return [(0, st5, g), (g * v.head_stride, st5, 1), ((g + 1) * v.head_stride, st5, 1)]


def _qkv_forward_slabs(arrays: Arrays, options: Options, hq: int, hk: int):
    """apply_rope_qkv: q, k and v read views of ``qkv``; written into the given
    out_q, out_k, out_v (all three or none), else into new arrays."""
    packed = arrays.inputs[0]
    _check_dtype(packed, "qkv", _floats(packed.on_gpu))
    view = _packed_view(packed, "qkv", options.layout, options.head_dim, hq + 2 * hk)
    heads = (hq, hk, hk)
    slabs = [Slab(n, packed, off, st5, None, 0, None, h, hpg, n != "v")
             for (off, st5, hpg), h, n in zip(_split_heads(options.packing, hq, hk, view), heads,
                                              ("q", "k", "v"))]
    outs = arrays.outputs
    if any(o is not None for o in outs):
        if not all(o is not None for o in outs):
            raise ValueError("out_q, out_k, out_v: pass all three outputs, or none")
        tok = tuple(packed.shape[:1 if options.layout == "thd" else 2])
        for i, (ot, n) in enumerate(zip(outs, OUTPUT_NAMES["qkv"])):
            _check_out(ot, n, tok + (heads[i], view.head_dim), packed.dtype, packed.device)
            st5 = head_view(ot, n, options.layout, None)[4]
            slabs[i] = slabs[i]._replace(out=ot, out_strides=st5)
    return slabs, _Geometry(view.batch, view.seqlen, view.head_dim, packed.dtype, packed.device)


def _qkv_backward_slabs(arrays: Arrays, options: Options, hq: int, hk: int):
    """apply_rope_qkv_backward: dq, dk, dv read as they are; written into views
    of the packed gradient ``out`` when given (its dtype and device rule)."""
    layout, packing = options.layout, options.packing
    packed = arrays.outputs[0]
    ref = packed if packed is not None else arrays.inputs[0]
    floats = _floats(ref.on_gpu)
    _check_dtype(ref, "out" if packed is not None else "dq", floats)
    dtype, device = ref.dtype, ref.device
    slabs, tok = [], None
    for gt, h, n in zip(arrays.inputs, (hq, hk, hk), INPUT_NAMES["qkv_backward"]):
        _check_dtype(gt, n, floats)
        if gt.dtype != dtype:
            raise TypeError(f"{n}: expected dtype {dtype}, got {gt.dtype}")
        _same_device(gt, device, n, "dq")
        gb, gs, gh, gd, gst = head_view(gt, n, layout, options.head_dim)
        tok = tok or (gb, gs, gd)
        if (gb, gs, gd) != tok or gh != h:
            raise ValueError(f"{n}: expected {h} heads of head_dim {tok[2]} on the token axes "
                             f"of dq, got shape {fmt_shape(gt.shape)}")
        slabs.append(Slab(n, gt, 0, gst, None, 0, None, h, h, n != "dv"))
    b, s, d = tok
    if packed is None:
        # Group geometry is that of the packed array the caller will allocate.
        split = _split_heads(packing, hq, hk, _PackedView(b, s, d, 0, 0, d, 1))
        slabs = [sl._replace(heads_per_group=hpg) for sl, (_, _, hpg) in zip(slabs, split)]
        return slabs, _Geometry(b, s, d, dtype, device)
    view = _packed_view(packed, "out", layout, options.head_dim, hq + 2 * hk)
    if (view.batch, view.seqlen, view.head_dim) != tok:
        axes = (s,) if layout == "thd" else ((b, s) if layout == "bshd" else (s, b))
        raise ValueError(f"out: expected a packed gradient with token axes "
                         f"{fmt_shape(axes)} and head_dim {d}, got shape "
                         f"{fmt_shape(packed.shape)}")
    slabs = [sl._replace(out=packed, out_offset=off, out_strides=st5, heads_per_group=hpg)
             for sl, (off, st5, hpg) in zip(slabs, _split_heads(packing, hq, hk, view))]
    return slabs, _Geometry(b, s, d, dtype, device)
