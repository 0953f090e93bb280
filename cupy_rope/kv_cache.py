"""RoPE fused with the KV-cache write: the serving prologue in one launch.

:func:`apply_rope_and_cache` rotates q (in place, into ``out_q`` or into a
new array) and k, and stores the rotated k and v at their cache slots, in
one launch of ``rope_cache_kernel`` (kernels/rope_cache.cu), or for a
decode step of dense head rows of ``rope_cache_flat_kernel``.
:func:`apply_qkv_rope_and_cache` does the same from a packed projection.
:func:`slot_mapping_from_page_table` turns FlashInfer-style page tables
into the ``slot_mapping`` the calls take.

The layers are those of the other calls (docs/architecture.md): the q/k part
is described and validated by :func:`cupy_rope.validate.check` (op "qk"),
this module adds v, the caches, the slots and the scales (:class:`CacheCall`),
then either computes the float64 reference (NumPy arrays) or plans and
launches the kernel with rope_kernel's ``Params`` followed by the cache
fields (``CacheParams``).

FP8 caches: torch ``float8_e4m3fn`` / ``float8_e5m2`` tensors and NumPy
arrays of ml_dtypes' FP8 types are taken as they are; arrays of a framework
without FP8 dtypes (CuPy) are passed as ``uint8`` storage with
``cache_dtype=`` naming the format.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import threading
from typing import NamedTuple, Optional

import numpy as np

from . import interop, launch, norm_launch, qk_norm, reference, validate
from .api import written
from .interop import Tensor
from .specialize import ANGLE_SOURCES, CXX_TYPES, ITEMSIZE, POS_MODES, get_kernel
from .validate import INDEX_DTYPES, Call, NormOptions, Options, Slab, fmt_shape

#: FP8 formats: kernel code (kernels/rope_cache.cu StoreFormat) and largest finite value.
FP8_FORMATS = {"float8_e4m3fn": (1, 448.0), "float8_e5m2": (2, 57344.0)}
#: Cache layouts: the axes of [num_blocks, ., ., head_dim] holding (slot offset, head).
CACHE_LAYOUTS = {"NHD": (1, 2), "HND": (2, 1)}
SAME = "same"  # an output stored in its input's dtype

THREADS = 256  # kernels/rope_cache.cu __launch_bounds__
MAX_BLOCK_Z = 64


# ------------------------------------------------------------------ spec --
@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Compile-time choices of one rope_cache_kernel instantiation (the
    rope_kernel fields of :class:`cupy_rope.specialize.Spec`, then the
    output formats), or with ``flat`` of rope_cache_flat_kernel.
    :func:`cupy_rope.specialize.get_kernel` compiles it."""

    dtype: str
    angle_dtype: str
    head_dim: int
    rotary_dim: int
    interleaved: bool
    source: str
    pairs: int
    tail_vec: int
    strided: bool
    table_strided: bool
    unroll: int
    pos_mode: str
    q_format: str  # SAME or a key of FP8_FORMATS
    cache_format: str
    copy_q_tail: bool  # q out of place with partial rotary
    # The per-head q/k RMSNorm (kernels/rope_cache.cu NORM): off, or the
    # weights' dtype, weight mode, rounding order and the lanes x items a
    # head row is held by (norm_launch.lane_layout, as the norm op's).
    norm: bool = False
    weight_dtype: str = "float32"
    weight_mode: str = "none"
    round_before: bool = False
    lanes: int = 1
    k_items: int = 1
    # rope_cache_flat_kernel, the decode form (one 16-byte packet a thread;
    # only dtype, head_dim, interleaved and cache_format matter then).
    flat: bool = False

    source_file = "rope_cache.cu"

    @property
    def vec(self) -> int:
        return 2 * self.pairs if self.interleaved else self.pairs

    @property
    def items(self) -> int:
        """Threads per head row: rotating items, then tail items (with the
        norm: the lanes, each holding ``k_items`` items)."""
        if self.norm:
            return self.lanes
        return self.rotary_dim // 2 // self.pairs + (self.head_dim - self.rotary_dim) // \
            self.tail_vec

    def name_expression(self) -> str:
        b = lambda v: "true" if v else "false"  # noqa: E731
        fmt = lambda f: str(FP8_FORMATS[f][0] if f != SAME else 0)  # noqa: E731
        if self.flat:
            return "rope::rope_cache_flat_kernel<" + ", ".join([
                CXX_TYPES[self.dtype], str(self.head_dim), b(self.interleaved),
                fmt(self.cache_format)]) + ">"
        return "rope::rope_cache_kernel<" + ", ".join([
            CXX_TYPES[self.dtype], CXX_TYPES[self.angle_dtype], str(self.head_dim),
            str(self.rotary_dim), b(self.interleaved), str(ANGLE_SOURCES[self.source]),
            str(self.pairs), str(self.tail_vec), b(self.strided), b(self.table_strided),
            str(self.unroll), str(POS_MODES[self.pos_mode]), fmt(self.q_format),
            fmt(self.cache_format), b(self.copy_q_tail), b(self.norm),
            CXX_TYPES[self.weight_dtype], str(norm_launch.WEIGHT_MODES[self.weight_mode]),
            b(self.round_before), str(self.lanes), str(self.k_items)]) + ">"


# ------------------------------------------------------------- describe --
class Cache(NamedTuple):
    """A checked pair of caches: storage descriptions (FP8 as uint8), format, geometry."""

    k: Tensor
    v: Tensor
    layout: str
    format: str  # SAME or a key of FP8_FORMATS
    num_blocks: int
    block_size: int


class CacheCall(NamedTuple):
    """A validated call: rope's Call (slabs q with its output, k, v), the
    caches, the slots and the scales (q out, k cache, v cache; each None, a
    float, or a 1-element float32 Tensor), and the per-head q/k norm (None
    for none; then its weights, described, or (None, None))."""

    call: Call
    cache: Cache
    slots: Tensor
    scales: tuple
    q_format: str
    norm: Optional[NormOptions] = None
    weights: tuple = (None, None)


def _storage(a, name: str, fmt_hint: Optional[str]):
    """(description with FP8 as uint8 storage, format name or None) of an output array."""
    t = interop.describe(a, name)
    if t.dtype in FP8_FORMATS:
        if fmt_hint is not None and fmt_hint != t.dtype:
            raise TypeError(f"{name}: is {t.dtype}, but cache_dtype={fmt_hint!r}")
        return t._replace(dtype="uint8"), t.dtype
    if t.dtype == "uint8" and fmt_hint is not None:
        return t, fmt_hint
    return t, None


def _check_format(fmt, t: Tensor, name: str, dtype: str) -> str:
    """SAME or the FP8 format of an output of inputs of ``dtype``."""
    if fmt is not None:
        return fmt
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (that of q) or "
                        f"{' or '.join(FP8_FORMATS)} (uint8 storage with cache_dtype=), "
                        f"got {t.dtype}")
    return SAME


def _check_caches(k_cache, v_cache, cache_layout, cache_dtype, geometry) -> Cache:
    """The caches: [num_blocks, block_size, hk, d] (NHD) or [num_blocks, hk,
    block_size, d] (HND), one shape, one format, q's device."""
    if not isinstance(cache_layout, str) or cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout: expected 'NHD' or 'HND', got {cache_layout!r}")
    if cache_dtype is not None and cache_dtype not in FP8_FORMATS:
        raise ValueError(f"cache_dtype: expected one of {', '.join(FP8_FORMATS)} or None, "
                         f"got {cache_dtype!r}")
    dtype, device, hk, d = geometry
    off_axis, head_axis = CACHE_LAYOUTS[cache_layout]
    described = []
    for a, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if a is None:
            raise TypeError(f"{name}: expected an array, got None")
        t, fmt = _storage(a, name, cache_dtype)
        if cache_dtype is not None and fmt is None:
            raise ValueError(f"cache_dtype: only for uint8 (or FP8) caches; {name} is {t.dtype}")
        fmt = _check_format(fmt, t, name, dtype)
        if t.ndim != 4:
            axes = "[num_blocks, block_size, hk, d]" if cache_layout == "NHD" else \
                "[num_blocks, hk, block_size, d]"
            raise ValueError(f"{name}: expected a 4-D array {axes} for cache_layout "
                             f"{cache_layout!r}, got shape {fmt_shape(t.shape)}")
        if t.shape[head_axis] != hk or t.shape[3] != d:
            raise ValueError(f"{name}: expected {hk} heads (those of k) in axis {head_axis} and "
                             f"head_dim {d} in axis 3 for cache_layout {cache_layout!r}, "
                             f"got shape {fmt_shape(t.shape)}")
        validate._same_device(t, device, name, "q")
        described.append((t, fmt))
    (kt, kf), (vt, vf) = described
    if vt.shape != kt.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {fmt_shape(kt.shape)}, "
                         f"got {fmt_shape(vt.shape)}")
    if vf != kf:
        raise TypeError(f"v_cache: expected the format of k_cache ({kf}), got {vf}")
    return Cache(kt, vt, cache_layout, kf, kt.shape[0], kt.shape[off_axis])


def _check_slots(slot_mapping, call: Call, cache: Cache) -> Tensor:
    """slot_mapping: int32/int64 on q's token axes ([t] thd, [b, s] else);
    host values in range and distinct (negative: padding)."""
    if slot_mapping is None:
        raise TypeError("slot_mapping: expected an int32/int64 array, got None")
    t = interop.describe(slot_mapping, "slot_mapping")
    validate._check_dtype(t, "slot_mapping", INDEX_DTYPES)
    validate._same_device(t, call.device, "slot_mapping", "q")
    want = (call.seqlen,) if call.layout == "thd" else (call.batch, call.seqlen)
    if t.shape != want:
        what = "[t], one per token" if call.layout == "thd" else "[b, s], one per token"
        raise ValueError(f"slot_mapping: expected shape {fmt_shape(want)} ({what}), "
                         f"got {fmt_shape(t.shape)}")
    host = validate._host_values(t)
    if host is not None:
        n_slots = cache.num_blocks * cache.block_size
        live = host[host >= 0]
        if live.size and live.max() >= n_slots:
            raise ValueError(f"slot_mapping: slot {int(live.max())} is out of range; the caches "
                             f"hold {cache.num_blocks} blocks of {cache.block_size} = {n_slots} "
                             "slots (negative: a padding token)")
        uniq, counts = np.unique(live, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"slot_mapping: slot {int(uniq[counts > 1][0])} is given to more "
                             "than one token; each token needs a slot of its own")
    return t


def _check_scale(scale, name: str, needed: bool, what: str, device: tuple):
    """A scale: None where not needed, else a positive float or a 1-element
    float32 array on q's device."""
    if not needed:
        if scale is not None:
            raise ValueError(f"{name}: only for an FP8 {what}; this one is not FP8")
        return None
    if scale is None:
        raise ValueError(f"{name}: required for an FP8 {what} (stored value = x / {name})")
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float or a 1-element float32 array, got bool")
    if isinstance(scale, (int, float, np.integer, np.floating)):
        _check_scale_value(float(scale), name)
        return float(scale)
    t = interop.describe(scale, name)
    if t.dtype != "float32" or int(np.prod(t.shape)) != 1:
        raise TypeError(f"{name}: expected a float or a 1-element float32 array, got "
                        f"{t.dtype} {fmt_shape(t.shape)}")
    validate._same_device(t, device, name, "q")
    if not t.on_gpu:  # a device scale is not read on the host (no sync)
        _check_scale_value(float(np.asarray(scale, np.float32).reshape(-1)[0]), name)
    return t


#: The FP8 scales the kernel stores exactly as torch does (its quotient's
#: bounds, kernels/rope_cache.cu FP8_SCALE_MIN and FP8_SCALE_MAX): far wider
#: than amax / 448 of any activation, and away from the subnormal floats,
#: which the kernels flush to zero (CuPy compiles with -ftz=true).
FP8_MIN_SCALE = 2.0 ** -32
FP8_MAX_SCALE = 2.0 ** 32


def _check_scale_value(value: float, name: str) -> None:
    """The kernel takes the scale as a float32: rounded there it must lie
    in [FP8_MIN_SCALE, FP8_MAX_SCALE]."""
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = float(np.float32(value)) if np.isfinite(value) else value
    if not FP8_MIN_SCALE <= as_f32 <= FP8_MAX_SCALE:  # NaN fails too
        raise ValueError(f"{name}: expected a scale in [2^-32, 2^32] ({FP8_MIN_SCALE:.3g} to "
                         f"{FP8_MAX_SCALE:.3g}) as a float32, got {value}")


def _v_slab(v, call: Call, head_dim) -> Slab:
    """v: q's dtype and token axes, k's heads and head_dim."""
    if v is None:
        raise TypeError("v: expected an array, got None")
    t = interop.describe(v, "v")
    validate._same_device(t, call.device, "v", "q")
    if t.dtype != call.dtype:
        raise TypeError(f"v: expected dtype {call.dtype} (that of q), got {t.dtype}")
    b, s, h, d, st = validate.head_view(t, "v", call.layout, head_dim)
    hk = call.slabs[1].heads
    if (b, s) != (call.batch, call.seqlen) or h != hk or d != call.head_dim:
        raise ValueError(f"v: expected {hk} heads (those of k) of head_dim {call.head_dim} on "
                         f"the token axes of q, got shape {fmt_shape(t.shape)}")
    return Slab("v", t, 0, st, t, 0, st, h, h, False)


def _check_writes(written, read_only) -> None:
    """Every written (array, name) writable, apart from the others and from every input."""
    for i, (t, name) in enumerate(written):
        others = [(o, n) for j, (o, n) in enumerate(written) if j != i and o is not t]
        validate._check_writable(t, name, read_only + others)


def _table_names(call: Call) -> tuple:
    """The argument names of the call's angle source arrays, for messages."""
    if call.source != "table":
        return (call.source,)
    cos, sin = call.tables
    return ("cos_sin_cache",) * 2 if cos.obj is sin.obj else ("cos", "sin")


def check_cache_norm(q_weight, k_weight, eps, weight_mode, rounding):
    """(the norm's options or None, the weights described) of a cache call.

    ``weight_mode=None`` means no norm without weights and "w" with them;
    the checks are those of :func:`cupy_rope.apply_qk_norm_rope` with
    norm_scope "head" (the only scope offered here)."""
    if weight_mode is None and q_weight is None and k_weight is None:
        qk_norm.check_norm("head", "none", rounding, eps)  # bad options still raise
        for name, value in (("eps", eps), ("rounding", rounding)):
            if value != NormOptions._field_defaults[name]:  # would be ignored without a norm
                raise ValueError(f"{name}: applies to the q/k norm, which runs only with "
                                 f"q_weight and k_weight or weight_mode='none'; got {value!r}")
        return None, (None, None)
    norm = qk_norm.check_norm("head", "w" if weight_mode is None else weight_mode, rounding, eps)
    return norm, qk_norm.describe_weights(q_weight, k_weight, norm)


def check_cache_call(q, k, v, k_cache, v_cache, slot_mapping, tables, positions=None,
                     offsets=None, cu_seqlens=None, *, layout="thd", interleaved=False,
                     rotary_dim=None, head_dim=None, cache_layout="NHD", cache_dtype=None,
                     k_scale=None, v_scale=None, q_scale=None, inplace=False,
                     out_q=None, q_weight=None, k_weight=None, eps=1e-6, weight_mode=None,
                     rounding="before_weight") -> CacheCall:
    """Validate one call of :func:`apply_rope_and_cache` (``tables`` in
    TABLE_NAMES order) before anything is written; raises TypeError or
    ValueError naming the argument."""
    options = validate.check_options(Options(layout, interleaved, rotary_dim, head_dim))
    inplace = validate._as_bool(inplace, "inplace")
    norm, weights = check_cache_norm(q_weight, k_weight, eps, weight_mode, rounding)
    arrays = validate.describe_arrays("qk", (q, k), tables, positions, offsets, cu_seqlens)
    call = validate.check(arrays, options)
    qs, ks = call.slabs
    if norm is not None:
        qk_norm.check_weights(call, weights, norm)
    vs = _v_slab(v, call, options.head_dim)
    cache = _check_caches(k_cache, v_cache, cache_layout, cache_dtype,
                          (call.dtype, call.device, ks.heads, call.head_dim))
    q_format = SAME
    if out_q is not None:
        if inplace:
            raise ValueError("out_q: pass either out_q or inplace=True, not both")
        ot, fmt = _storage(out_q, "out_q", cache_dtype)
        q_format = _check_format(fmt, ot, "out_q", call.dtype)
        if ot.shape != qs.x.shape:
            raise ValueError(f"out_q: expected shape {fmt_shape(qs.x.shape)} (that of q), "
                             f"got {fmt_shape(ot.shape)}")
        validate._same_device(ot, call.device, "out_q", "q")
        st = validate.head_view(ot, "out_q", layout, options.head_dim)[4]
        qs = qs._replace(out=ot, out_strides=st)
    elif inplace:
        qs = qs._replace(out=qs.x, out_strides=qs.x_strides)
    slots = _check_slots(slot_mapping, call, cache)
    fp8_cache = cache.format != SAME
    scales = (_check_scale(q_scale, "q_scale", q_format != SAME, "out_q", call.device),
              _check_scale(k_scale, "k_scale", fp8_cache, "cache", call.device),
              _check_scale(v_scale, "v_scale", fp8_cache, "cache", call.device))
    read_only = [(s.x, s.name) for s in (qs, ks, vs) if not (inplace and s is qs)] + [
        (t, n) for t, n in zip(call.tables, _table_names(call))] + [
        (t, n) for t, n in ((call.positions, "positions"), (call.offsets, "offsets"),
                            (call.cu_seqlens, "cu_seqlens"), (slots, "slot_mapping"))
        if t is not None] + [(t, n) for t, n in zip(scales, ("q_scale", "k_scale", "v_scale"))
                             if isinstance(t, Tensor)] + [
        (t, n) for t, n in zip(weights, qk_norm.WEIGHT_NAMES) if t is not None]
    written = [(cache.k, "k_cache"), (cache.v, "v_cache")]
    if qs.out is not None:
        written.append((qs.out, "q" if inplace else "out_q"))
    _check_writes(written, read_only)
    if call.on_gpu:
        validate._check_alignment(written + [(vs.x, "v")])
    call = call._replace(slabs=(qs, ks._replace(out=ks.x, out_strides=ks.x_strides), vs),
                         inplace=inplace)
    return CacheCall(call, cache, slots, scales, q_format, norm, weights)


# ------------------------------------------------------------- reference --
def fp8_bits(x: np.ndarray, scale: float, fmt: str) -> np.ndarray:
    """FP8 codes of fp32 ``x / scale``: round to nearest even, saturated to
    the format's largest finite value, NaN kept (the kernel's rule; plain
    NumPy, no FP8 dtype needed).

    Parameters
    ----------
    x : numpy.ndarray
        Values (any float dtype; taken as float32).
    scale : float
        The per-tensor scale.
    fmt : str
        "float8_e4m3fn" or "float8_e5m2".

    Returns
    -------
    numpy.ndarray
        uint8 codes, the shape of ``x``.

    Examples
    --------
    >>> fp8_bits(np.array([1.0, 1000.0, -0.001]), 1.0, "float8_e4m3fn")
    array([ 56, 126, 129], dtype=uint8)
    """
    man, bias, max_code = (3, 7, 0x7E) if fmt == "float8_e4m3fn" else (2, 15, 0x7B)
    y = np.ascontiguousarray(np.asarray(x, np.float32) / np.float32(scale))
    u = y.view(np.uint32).astype(np.int64)
    a = u & 0x7FFFFFFF
    shift = 23 - man
    normal = ((a + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift) - ((127 - bias) << man)
    # below the smallest normal: a multiple of the subnormal step (exact scaling, rint is RNE)
    tiny = np.where(np.abs(y) < 1.0, np.abs(y), 0.0).astype(np.float64)  # (also NaN, inf)
    small = np.rint(tiny * 2.0 ** (man - 1 + bias)).astype(np.int64)
    code = np.minimum(np.where((a >> 23) < 128 - bias, small, normal), max_code)
    code = np.where(np.isnan(y), 0x7F, code)
    return (code | ((u >> 24) & 0x80)).astype(np.uint8)


def _encode(y: np.ndarray, dtype: str, fmt: str, scale, like: np.ndarray) -> np.ndarray:
    """float64 results of inputs of ``dtype`` as stored in ``like`` (format ``fmt``)."""
    if fmt == SAME:
        return reference.encoded(y, like, dtype)
    return fp8_bits(reference.round_to(y, dtype), scale, fmt)


def _host_scale(s) -> Optional[float]:
    if isinstance(s, Tensor):
        return float(np.asarray(validate._host_values(s)).reshape(-1)[0])
    return s


def _host(t: Tensor, fmt: str) -> np.ndarray:
    """A NumPy array over a host output's memory (FP8 as its uint8 codes)."""
    if fmt == SAME:
        return reference.host_array(t)
    if t.kind == "torch":  # torch's .numpy() has no FP8 types
        import torch

        return t.obj.detach().view(torch.uint8).numpy()
    a = np.asarray(t.obj)
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def reference_into(cc: CacheCall) -> None:
    """The NumPy path: rotate in float64 and write q's output and the cache
    slots as the kernel does (rounded to the input dtype, then FP8 if so)."""
    call, cache = cc.call, cc.cache
    qk = call._replace(slabs=call.slabs[:2])
    if cc.norm is None:
        q_rot, k_rot = reference.rope_slabs(qk)
    else:
        q_rot, k_rot = reference.qk_norm_rope_slabs(qk, cc.weights, cc.norm)
    qs, ks, vs = call.slabs
    v_val = reference.slab_input(call, vs)
    scales = [_host_scale(s) for s in cc.scales]
    if qs.out is not None:
        base = _host(qs.out, cc.q_format)
        dst = reference.strided_view(qs.out._replace(obj=base, kind="numpy"), 0, qs.out_strides,
                                     call.batch, call.seqlen, qs.heads, qs.heads, call.head_dim)
        y = q_rot.reshape(dst.shape)
        # In place, q's tail stays as it is, unless the norm changed it.
        r = call.rotary_dim if call.inplace and cc.norm is None else call.head_dim
        dst[..., :r] = _encode(y[..., :r], call.dtype, cc.q_format, scales[0], dst)
    slots = np.asarray(validate._host_values(cc.slots)).reshape(call.batch, call.seqlen)
    off_axis, head_axis = CACHE_LAYOUTS[cache.layout]
    for values, t, scale in ((k_rot, cache.k, scales[1]), (v_val, cache.v, scales[2])):
        arr = _host(t, cache.format)
        for b, s in zip(*np.nonzero(slots >= 0)):
            blk, off = divmod(int(slots[b, s]), cache.block_size)
            row = arr[blk, off] if off_axis == 1 else arr[blk, :, off]  # [hk, d]
            row[...] = _encode(values[b, s], call.dtype, cache.format, scale, row)


# ------------------------------------------------------------------ plan --
#: CacheParams' fields after rope::Params (kernels/rope_cache.cu), in order.
CACHE_DYNAMIC_FIELDS = (("slot_mapping", "Q"), ("cache_data[0]", "Q"), ("cache_data[1]", "Q"),
                        ("scale_ptr[0]", "Q"), ("scale_ptr[1]", "Q"), ("scale_ptr[2]", "Q"),
                        ("weight[0]", "Q"), ("weight[1]", "Q"))
CACHE_FIXED_FIELDS = tuple(
    [(f"cache[{c}].{f}", "q") for c in range(2)
     for f in ("stride_block", "stride_offset", "stride_head", "stride_dim")]
    + [(n, "q") for n in ("n_slots", "block_size", "slot_stride_outer", "slot_stride_inner",
                          "slot_is_64", "heads_q", "heads_kv")]
    + [("scale[0]", "f"), ("scale[1]", "f"), ("scale[2]", "f"), ("eps", "f")])
_CACHE_DYNAMIC = struct.Struct("<" + "".join(c for _, c in CACHE_DYNAMIC_FIELDS))
_CACHE_FIXED = struct.Struct("<" + "".join(c for _, c in CACHE_FIXED_FIELDS))
CACHE_PARAMS_SIZE = launch.PARAMS_SIZE + _CACHE_DYNAMIC.size + _CACHE_FIXED.size


def _cache_strides(t: Tensor, layout: str) -> tuple:
    """(block, slot offset, head, channel) element strides of a cache."""
    off_axis, head_axis = CACHE_LAYOUTS[layout]
    return (t.strides[0], t.strides[off_axis], t.strides[head_axis], t.strides[3])


def _views(cc: CacheCall) -> list:
    """(pointer, itemsize, strides that vary, channel stride) of every array
    the kernel moves head rows of."""
    call = cc.call
    views = []
    for s in call.slabs:
        for t, st in ((s.x, s.x_strides), (s.out, s.out_strides)):
            if t is not None:
                b, sq, _, h, d = st
                varying = [v for v, n in zip((b, sq, h), (call.batch, call.seqlen, s.heads))
                           if n > 1]
                views.append((t.ptr, t.itemsize, tuple(varying), d))
    for t in (cc.cache.k, cc.cache.v):
        blk, off, head, d = _cache_strides(t, cc.cache.layout)
        varying = [v for v, n in zip((blk, off, head), (cc.cache.num_blocks, cc.cache.block_size,
                                                        call.slabs[1].heads)) if n > 1]
        views.append((t.ptr, t.itemsize, tuple(varying), d))
    return views


def choose_spec(cc: CacheCall, unroll: int) -> CacheSpec:
    """The widest packets every view (inputs, q's output, both caches) and
    the tables are aligned for, as rope_kernel's choice (launch._vector_widths)."""
    call = cc.call
    d, r = call.head_dim, call.rotary_dim
    views = _views(cc)
    strided = any(sd != 1 for *_, sd in views)
    widths = [w for w in (16, 8, 4, 2, 1) if w * ITEMSIZE[call.dtype] <= launch.MAX_VECTOR_BYTES]

    def ok(elems):
        return all(launch._aligned(elems, p, it, st) for p, it, st, _ in views)

    if strided:
        pairs = 1
    elif call.interleaved:
        pairs = max(1, launch._widest([w for w in widths if w >= 2],
                                      lambda w: (r // 2) % (w // 2) == 0 and ok(w)) // 2)
        strided = not ok(2)
    else:
        pairs = launch._widest(widths, lambda w: (r // 2) % w == 0 and ok(w))
    table_strided = (strided or any(t.strides[-1] != 1 for t in call.tables)
                     or not launch._tables_aligned(call, pairs))
    tail_vec = 1
    if r < d and not strided:
        tail_vec = launch._widest(widths, lambda w: (d - r) % w == 0 and r % w == 0 and ok(w)) or 1
    spec = CacheSpec(call.dtype, call.tables[0].dtype, d, r, call.interleaved, call.source,
                     pairs, tail_vec, strided, table_strided, unroll, call.pos_mode,
                     cc.q_format, cc.cache.format, not call.inplace and r < d)
    if cc.norm is None:
        return spec
    # The norm op's items (norm_launch.choose_spec: the same widths, then
    # lane_layout), so that both sum a row's squares in one order.
    lanes, k_items = norm_launch.lane_layout(d, r, pairs, tail_vec)
    weights = [w for w in cc.weights if w is not None]
    # With the norm every q channel is written: COPY_Q_TAIL does not apply.
    return dataclasses.replace(
        spec, copy_q_tail=False, norm=True,
        weight_dtype=weights[0].dtype if weights else "float32",
        weight_mode=cc.norm.weight_mode, round_before=cc.norm.rounding == "before_weight",
        lanes=lanes, k_items=k_items)


class _Shape(NamedTuple):
    grid: tuple  # (token blocks, head groups, 1)
    block: tuple  # (items, head lanes, token lanes)
    unroll: int


#: Heads a prefill thread loads per pass (kernels/rope_cache.cu UNROLL), and
#: the passes a thread aims for: with q, k and v of a token spread over few
#: lanes (and more tokens a block), a thread's angles serve more heads and
#: the block's loads span more tokens (the sweep is in the issue 32 report).
PREFILL_UNROLL = 4
PREFILL_PASSES = 3
#: Decode: head lanes a block (one head a thread, one token a block, the
#: heads split over blocks): more, smaller blocks for the few rows.
DECODE_MAX_LANES = 16


def launch_shape(items: int, heads: int, tokens: int, sm_count: int) -> _Shape:
    """Grid and block for ``tokens`` x ``heads`` (q, k and v) head rows of
    ``items`` threads: about ``PREFILL_PASSES`` passes of ``PREFILL_UNROLL``
    heads a thread, the rest of the block's threads on more tokens, when
    the grid then still covers every SM several times (prefill); else one
    head a thread and one token a block, the heads split over blocks
    (decode)."""
    lanes_max = launch._pow2_floor(max(1, THREADS // items))
    for unroll in (PREFILL_UNROLL, 1):
        per_thread = unroll * PREFILL_PASSES if unroll > 1 else 1
        lanes = min(launch._pow2_ceil(-(-heads // per_thread)), lanes_max,
                    lanes_max if unroll > 1 else DECODE_MAX_LANES)
        per_block = heads if unroll > 1 else lanes
        bz = max(1, min(THREADS // (items * lanes), MAX_BLOCK_Z, tokens)) if unroll > 1 else 1
        blocks = -(-tokens // bz) * -(-heads // per_block)
        if unroll == 1 or blocks >= launch.POLICY.blocks_per_sm * sm_count:
            return _Shape((-(-tokens // bz), -(-heads // per_block), 1), (items, lanes, bz),
                          unroll)
    raise AssertionError("unreachable")


#: Decode calls of dense head rows take rope_cache_flat_kernel (tests turn
#: it off to run rope_cache_kernel on the same calls), up to the largest
#: token count measured (docs/performance.md, "Cache-op decode").
FLAT_DECODE = True
FLAT_DECODE_MAX_TOKENS = 64
FLAT_DECODE_THREADS = 128  # kernels/rope_cache.cu CACHE_FLAT_THREADS


def flat_decode_shape(cc: CacheCall, spec: CacheSpec, shape: _Shape) -> Optional[_Shape]:
    """rope_cache_flat_kernel's grid for a decode call it takes (one 16-byte
    packet of a head row a thread), else None: the decode shape and at
    most FLAT_DECODE_MAX_TOKENS tokens of one outer index (thd; tokens are
    the kernel's inner index), no norm, full rotary, x's 16-byte packets
    aligned in every view, float32 cos/sin tables, explicit positions, q
    stored in its dtype, and every slab's heads dense rows of a plain head
    axis."""
    call = cc.call
    item = ITEMSIZE[call.dtype]
    vec, d = 16 // item, call.head_dim
    packets = d // vec
    order = launch._token_order(call)
    heads = sum(sl.heads for sl in call.slabs)
    if not (FLAT_DECODE and shape.unroll == 1 and call.tokens <= FLAT_DECODE_MAX_TOKENS
            and cc.norm is None and cc.q_format == SAME
            and call.rotary_dim == d and d % vec == 0 and 32 % packets == 0
            and (call.interleaved or packets % 2 == 0) and spec.vec == vec
            and not spec.strided and not spec.table_strided and call.source == "table"
            and call.tables[0].dtype == "float32" and call.pos_mode == "explicit"
            and order.n_outer == 1 and call.tokens * heads * packets < 2 ** 31):
        return None
    for i, sl in enumerate(call.slabs):
        views = [sl.x_strides] + ([sl.out_strides] if i == 0 else [])
        for st in views:
            _, _, _, head, dim = order.view(st, sl.heads_per_group)
            if sl.heads_per_group < sl.heads or (sl.heads > 1 and head != d) or dim != 1:
                return None
    threads = call.tokens * heads * packets
    return _Shape((-(-threads // FLAT_DECODE_THREADS), 1, 1), (FLAT_DECODE_THREADS, 1, 1), 1)


def _cache_fixed(cc: CacheCall) -> bytes:
    call, cache = cc.call, cc.cache
    order = launch._token_order(call)
    st = cc.slots.strides
    slot_strides = order.by_order(0, st[0]) if len(st) == 1 else order.by_order(*st)
    fields = [*_cache_strides(cache.k, cache.layout), *_cache_strides(cache.v, cache.layout),
              cache.num_blocks * cache.block_size, cache.block_size, *slot_strides,
              int(cc.slots.dtype == "int64"), call.slabs[0].heads, call.slabs[1].heads]
    fields += [s if isinstance(s, float) else 1.0 for s in cc.scales]
    fields.append(cc.norm.eps if cc.norm is not None else 0.0)
    return _CACHE_FIXED.pack(*fields)


#: The array arguments of apply_rope_and_cache, in the order plans index them.
ARG_NAMES = ("q", "k", "v", "k_cache", "v_cache", "slot_mapping", "cos", "sin", "inv_freq",
             "freqs", "cos_sin_cache", "positions", "offsets", "cu_seqlens", "out_q",
             "q_scale", "k_scale", "v_scale", "q_weight", "k_weight")
_OUT_Q = ARG_NAMES.index("out_q")


class Plan:
    """Kernel, launch shape and packed parameters of one call signature.

    ``sources`` says where each per-call pointer comes from: (index into
    the call's array list, byte offset), index -1 for none; only those
    pointers and the scalar offset change between calls of one signature.
    """

    def __init__(self, cc: CacheCall, arrays: list):
        call = cc.call
        self.device_id = call.device[1]
        heads = call.slabs[0].heads + 2 * call.slabs[1].heads
        self.empty = call.tokens == 0 or heads == 0
        probe = choose_spec(cc, 1)
        if probe.items > THREADS:
            raise ValueError(
                f"q: head_dim {call.head_dim} with rotary_dim {call.rotary_dim} on views whose "
                f"last axis has a stride != 1 (or is unaligned) needs {probe.items} threads "
                f"per head, more than {THREADS}; pass contiguous last axes")
        shape = launch_shape(probe.items, heads, call.tokens, launch._sm_count(self.device_id))
        self.spec = dataclasses.replace(probe, unroll=shape.unroll)
        flat = None if self.empty else flat_decode_shape(cc, self.spec, shape)
        if flat is not None:
            self.spec, shape = dataclasses.replace(self.spec, flat=True), flat
        self.shape = shape
        fixed = launch.fixed_params(call, [(0, 0, 0, 0)] * launch.MAX_SLABS)
        self.buf = (bytes(launch._DYNAMIC.size) + fixed + bytes(_CACHE_DYNAMIC.size)
                    + _cache_fixed(cc))
        self.kernel = None if self.empty else get_kernel(self.spec, self.device_id).ptr
        self.stream = (interop.torch_stream_getter() if call.x.kind == "torch"
                       else interop.cupy_stream_getter())
        self.buffers: dict = {}

        def source(t, elems=0):
            if t is None:
                return (-1, 0)
            for i, a in enumerate(arrays):
                if a is t.obj:
                    return (i, t.ptr - interop.data_ptr(a) + elems * t.itemsize)
            raise AssertionError("array of the call not found")

        slabs = call.slabs
        self.sources = (
            [source(s.x, s.x_offset) for s in slabs] + [source(s.out, s.out_offset) for s in slabs]
            + [source(call.tables[0], call.table_offsets[0]),
               source(call.tables[-1], call.table_offsets[-1]),
               source(call.positions), source(call.offsets), source(call.cu_seqlens)])
        self.cache_sources = [source(t) for t in (cc.slots, cc.cache.k, cc.cache.v)] + [
            source(t) if isinstance(t, Tensor) else (-1, 0) for t in cc.scales] + [
            source(t) for t in cc.weights]

    def launch(self, ptrs: list, offset: int) -> None:
        """Launch with the call's array pointers (``ptrs[i]`` of array i) on
        the current stream of the arrays' framework."""
        if self.empty:
            return
        ptr = lambda i, off: ptrs[i] + off if i >= 0 else 0  # noqa: E731
        buf = self.buffers.get(threading.get_ident())
        if buf is None:  # each thread packs its own copy (the launch releases the GIL)
            buf = ctypes.create_string_buffer(self.buf, len(self.buf))
            args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
            buf = self.buffers[threading.get_ident()] = (buf, args)
        raw, args = buf
        launch._pack_dynamic(raw, 0, *[ptr(i, o) for i, o in self.sources], offset)
        _CACHE_DYNAMIC.pack_into(raw, launch.PARAMS_SIZE,
                                 *[ptr(i, o) for i, o in self.cache_sources])
        dims = (*self.shape.grid, *self.shape.block)
        stream = self.stream(self.device_id)
        if launch._get_device() == self.device_id:  # the usual case: no context switch
            launch._launch_kernel(self.kernel, *dims, 0, stream, ctypes.addressof(args), 0)
            return
        import cupy

        with cupy.cuda.Device(self.device_id):
            launch._launch_kernel(self.kernel, *dims, 0, stream, ctypes.addressof(args), 0)


class _Prepared(NamedTuple):
    """A cached plan and what a call of its signature does besides launching."""

    plan: Plan
    apart: object  # ptrs -> True when the written arrays' spans are apart from the others'
    pairs: list  # the (written, other) pairs, for the exact test when spans meet
    allocate: bool  # q's result is a new array
    offset: int


_plans: dict = {}
_MAX_PLANS = 1024


def clear_plans() -> None:
    """Forget every cached plan (tests change launch policies through it)."""
    _plans.clear()


def _signature(arrays: list, options: tuple):
    """(key, pointers) of a call whose arrays are all CUDA torch/CuPy arrays
    (or None), read without describing them; (None, None) otherwise."""
    key, ptrs = [options], []
    for a in arrays:
        if a is None:
            key.append(None)
            ptrs.append(0)
        elif not interop.signer(type(a))(a, key, ptrs):
            return None, None
    return tuple(key), ptrs


def _written_pairs(cc: CacheCall, arrays: list) -> list:
    """(i, span, lattice, j, span, lattice) for every written array i (the
    caches, q in place, out_q) and every other array j of the call."""
    call = cc.call
    qs = call.slabs[0]
    written = [cc.cache.k, cc.cache.v] + ([qs.out] if qs.out is not None else [])
    index = {id(a): i for i, a in enumerate(arrays) if a is not None}
    described = {id(t.obj): t for t in
                 [s.x for s in call.slabs] + [qs.out, cc.cache.k, cc.cache.v, cc.slots]
                 + list(call.tables) + [call.positions, call.offsets, call.cu_seqlens]
                 + [s for s in cc.scales if isinstance(s, Tensor)] + list(cc.weights)
                 if t is not None}
    pairs = []
    for w in written:
        for j, t in described.items():
            if j != id(w.obj) and id(w.obj) in index and j in index:
                pairs.append((index[id(w.obj)], validate.rel_span(w), validate.lattice(w),
                              index[j], validate.rel_span(t), validate.lattice(t)))
    return pairs


def _run(cc: CacheCall, arrays: list, key):
    """Reference or launch; returns q's result in the caller's framework
    and, for device calls with a signature ``key``, caches the plan."""
    call = cc.call
    qs = call.slabs[0]
    q = arrays[0]
    allocated = None
    if qs.out is None:  # a new array like q
        allocated = interop.empty_like(qs.x)
        ot = interop.describe(allocated, "out_q")
        flat = ot.ndim == (2 if call.layout == "thd" else 3)  # heads flattened, as q's
        st = validate.head_view(ot, "out_q", call.layout, call.head_dim if flat else None)[4]
        cc = cc._replace(call=call._replace(slabs=(qs._replace(out=ot, out_strides=st),)
                                            + call.slabs[1:]))
    if not call.on_gpu:
        reference_into(cc)
    else:
        cu = call.cu_seqlens
        launched = list(arrays) + [allocated]
        if cu is not None and not cu.on_gpu:  # host cu_seqlens: uploaded for this call
            uploaded = interop.to_device(cu, call.device[1], interop.stream_for(call.x))
            launched[ARG_NAMES.index("cu_seqlens")] = uploaded
            cc = cc._replace(call=cc.call._replace(
                cu_seqlens=interop.describe(uploaded, "cu_seqlens")))
            key = None
        plan = Plan(cc, launched)
        ptrs = [0 if a is None else interop.data_ptr(a) for a in launched]
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            pairs = _written_pairs(cc, arrays)
            _plans[key] = _Prepared(plan, launch.spans_apart(pairs), pairs,
                                    allocated is not None, call.offset)
        plan.launch(ptrs, call.offset)
        if cu is not None and not cu.on_gpu:  # keep the upload alive until the kernel read it
            interop.synchronize_stream(plan.stream(call.device[1]), call.device[1])
    return _result(arrays, allocated)


def _result(arrays: list, allocated):
    """q's result; torch tensors written are recorded as written (version counters)."""
    q, out_q = arrays[0], arrays[_OUT_Q]
    for a in (arrays[3], arrays[4]):
        written((a,))
    if allocated is not None:
        return interop.wrap_result(q, allocated)
    r = out_q if out_q is not None else q
    written((r,))
    return r


def _fast(prepared: _Prepared, arrays: list, ptrs: list):
    """A cached plan's launch, or NotImplemented where the general path must decide."""
    if not prepared.apart(ptrs) and not launch.check_disjoint(prepared.pairs, ptrs):
        return NotImplemented
    allocated = None
    if prepared.allocate:
        allocated = interop.fast_empty_like(arrays[0])
        ptrs = ptrs + [interop.data_ptr(allocated)]
    prepared.plan.launch(ptrs, prepared.offset)
    return _result(arrays, allocated)


def apply_rope_and_cache(q, k, v, k_cache, v_cache, slot_mapping, cos=None, sin=None, *,
                         inv_freq=None, freqs=None, cos_sin_cache=None, positions=None,
                         offsets=None, layout="thd", cu_seqlens=None, interleaved=False,
                         rotary_dim=None, head_dim=None, cache_layout="NHD", cache_dtype=None,
                         k_scale=None, v_scale=None, q_scale=None, inplace=False, out_q=None,
                         q_weight=None, k_weight=None, eps=1e-6, weight_mode=None,
                         rounding="before_weight"):
    """Rotate q and k and write the rotated k and v into a paged KV cache, in one launch.

    q is rotated in place (``inplace=True``), into ``out_q``, or into a new
    array; k and v are only read: rotated k and v go to ``k_cache`` and
    ``v_cache`` at their tokens' slots. Angles, positions and styles are
    those of :func:`cupy_rope.apply_rope_qk` (docs/api.md).

    Parameters
    ----------
    q : array
        [t, hq, d] (``layout="thd"``, the default) or [b, s, hq, d] /
        [s, b, hq, d] (``"bshd"`` / ``"sbhd"``); heads may be flattened
        ([.., hq * d]) with ``head_dim``; any strides.
    k, v : array
        [.., hk, d] on q's token axes, q's dtype (GQA/MQA: any hk).
    k_cache, v_cache : array
        [num_blocks, block_size, hk, d] (``cache_layout="NHD"``) or
        [num_blocks, hk, block_size, d] (``"HND"``), any strides; q's dtype,
        or FP8 (torch float8_e4m3fn / float8_e5m2, NumPy ml_dtypes FP8, or
        uint8 storage with ``cache_dtype``).
    slot_mapping : array
        int32/int64 [t] (thd) or [b, s]: slot = block * block_size + offset
        of each token. A negative slot marks a padding token: neither cache
        is written for it (q is rotated all the same). Host (NumPy) slots
        are checked: in range and distinct. Device slots are not read on
        the host: the kernel skips slots >= num_blocks * block_size.
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, \
interleaved, rotary_dim, head_dim
        As for :func:`cupy_rope.apply_rope_qk`; the tail channels
        [rotary_dim, d) of k and v are cached unrotated.
    cache_layout : {"NHD", "HND"}
        Axis order of the caches.
    cache_dtype : {"float8_e4m3fn", "float8_e5m2"}, optional
        The FP8 format of uint8 caches (and of a uint8 ``out_q``).
    k_scale, v_scale : float or array, optional
        Per-tensor scales, required for FP8 caches and refused otherwise:
        stored = x / scale (x rounded to q's dtype first), saturated to the
        format's finite range (448, 57344), round to nearest even. A float
        in [2^-32, 2^32], or a 1-element float32 array on q's device (not
        read on the host: a value outside those bounds stores NaN codes).
    q_scale : float or array, optional
        The same for an FP8 ``out_q``.
    inplace : bool
        Rotate q in place (its tail channels untouched).
    out_q : array, optional
        q's shape, q's dtype or FP8 (with ``q_scale``); its tail channels
        are copied from q.
    q_weight, k_weight : array, optional
        The per-head q/k RMSNorm of :func:`cupy_rope.apply_qk_norm_rope`
        (norm_scope "head", the only scope here), applied before the
        rotation: 1-D contiguous [d], one float dtype, on q's device. q and
        k heads are normalized, weighted, rounded, rotated and stored (q's
        tail channels normalized, in place too); v is cached as it is.
    eps : float
        Added to the mean square (with the norm; without one, a value other
        than the default raises, as does ``rounding``).
    weight_mode : {None, "w", "1+w", "none"}
        None: no norm without weights, "w" with both weights; "w" and
        "1+w" need both weights, "none" (a weightless RMS norm) takes none.
    rounding : {"before_weight", "after_weight"}
        As for :func:`cupy_rope.apply_qk_norm_rope` (Qwen3: "before_weight").
        q and the cached k are bit-identical to ``apply_qk_norm_rope``'s
        results (then cached as this call caches) where both calls read
        with the same vector widths, as aligned contiguous arrays do.

    Returns
    -------
    array
        Rotated q: ``q`` (in place), ``out_q``, or a new array like q.

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument; nothing is written.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_rope.kv_cache import apply_rope_and_cache
    >>> t, hq, hk, d = 3, 4, 2, 64
    >>> q = np.ones((t, hq, d), np.float32); k = np.ones((t, hk, d), np.float32)
    >>> v = np.ones((t, hk, d), np.float32)
    >>> k_cache = np.zeros((8, 16, hk, d), np.float32); v_cache = np.zeros_like(k_cache)
    >>> inv_freq = (1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    >>> q_rot = apply_rope_and_cache(
    ...     q, k, v, k_cache, v_cache, np.array([16, 17, -1]), inv_freq=inv_freq,
    ...     positions=np.array([0, 1, 2]))
    >>> bool((k_cache[1, 0] != 0).any()), bool((k_cache[1, 2] == 0).all())
    (True, True)
    """
    scalar = lambda s: isinstance(s, (int, float, np.number))  # noqa: E731
    scales = [None if scalar(s) else s for s in (q_scale, k_scale, v_scale)]
    arrays = [q, k, v, k_cache, v_cache, slot_mapping, cos, sin, inv_freq, freqs, cos_sin_cache,
              positions, None if scalar(offsets) else offsets, cu_seqlens, out_q, *scales,
              q_weight, k_weight]
    options = (layout, interleaved, rotary_dim, head_dim, cache_layout, cache_dtype, inplace,
               *[(type(s), s) if scalar(s) else None for s in (q_scale, k_scale, v_scale,
                                                              offsets)],
               (type(eps), eps if scalar(eps) else id(eps)), weight_mode, rounding)
    key, ptrs = _signature(arrays, options)
    if not (scalar(eps) and isinstance(weight_mode, (str, type(None)))
            and isinstance(rounding, str)):
        key = None  # the general path checks (and refuses) these
    if key is not None:
        prepared = _plans.get(key)
        if prepared is not None:
            result = _fast(prepared, arrays, ptrs)
            if result is not NotImplemented:
                return result
    cc = check_cache_call(
        q, k, v, k_cache, v_cache, slot_mapping, (cos, sin, inv_freq, freqs, cos_sin_cache),
        positions, offsets, cu_seqlens, layout=layout, interleaved=interleaved,
        rotary_dim=rotary_dim, head_dim=head_dim, cache_layout=cache_layout,
        cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale,
        inplace=inplace, out_q=out_q, q_weight=q_weight, k_weight=k_weight, eps=eps,
        weight_mode=weight_mode, rounding=rounding)
    return _run(cc, arrays, key)


def apply_qkv_rope_and_cache(qkv, k_cache, v_cache, slot_mapping, cos=None, sin=None, *,
                             num_q_heads, num_kv_heads, head_dim=None, inv_freq=None, freqs=None,
                             cos_sin_cache=None, positions=None, offsets=None, layout="thd",
                             cu_seqlens=None, interleaved=False, rotary_dim=None,
                             cache_layout="NHD", cache_dtype=None, k_scale=None, v_scale=None,
                             q_scale=None, inplace=False, out_q=None, q_weight=None,
                             k_weight=None, eps=1e-6, weight_mode=None, rounding="before_weight"):
    """:func:`apply_rope_and_cache` from a packed projection, in one launch.

    Parameters
    ----------
    qkv : array
        [t, (hq + 2 hk) * d] (thd; [b, s, ..] / [s, b, ..] for bshd / sbhd)
        or [.., hq + 2 hk, d]: q's heads, then k's, then v's. Only read,
        unless ``inplace=True`` (q's part rotated in place).
    num_q_heads, num_kv_heads : int
        hq and hk.
    head_dim : int, optional
        d (default: from the width and the head counts).
    k_cache, v_cache, slot_mapping, cos, sin, ... : see :func:`apply_rope_and_cache`.
    q_weight, k_weight, eps, weight_mode, rounding
        The per-head q/k RMSNorm (Qwen3, Gemma 3), as for
        :func:`apply_rope_and_cache`: a Qwen3 attention prologue in one launch.

    Returns
    -------
    array
        Rotated q [.., hq, d] (a view of ``qkv`` in place), ``out_q``, or a
        new array [.., hq, d].

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument; nothing is written.

    Examples
    --------
    >>> q_rot = apply_qkv_rope_and_cache(qkv, k_cache, v_cache, slots,  # doctest: +SKIP
    ...     cos_sin_cache=cache, positions=pos, num_q_heads=32, num_kv_heads=8)
    """
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads, head_dim, layout)
    return apply_rope_and_cache(
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin, inv_freq=inv_freq, freqs=freqs,
        cos_sin_cache=cos_sin_cache, positions=positions, offsets=offsets, layout=layout,
        cu_seqlens=cu_seqlens, interleaved=interleaved, rotary_dim=rotary_dim,
        cache_layout=cache_layout, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
        q_scale=q_scale, inplace=inplace, out_q=out_q, q_weight=q_weight, k_weight=k_weight,
        eps=eps, weight_mode=weight_mode, rounding=rounding)


def split_qkv(qkv, num_q_heads, num_kv_heads, head_dim, layout):
    """Views q, k, v [.., h, d] of a packed [.., (hq + 2 hk) * d] or [.., hq + 2 hk, d]
    array (no copy; the caller's framework)."""
    hq = validate._as_int(num_q_heads, "num_q_heads")
    hk = validate._as_int(num_kv_heads, "num_kv_heads")
    if hq < 1 or hk < 1:
        raise ValueError(f"num_q_heads, num_kv_heads: expected >= 1, got {hq}, {hk}")
    if layout not in validate.LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, validate.LAYOUTS))}, "
                         f"got {layout!r}")
    t = interop.describe(qkv, "qkv")
    n_tok = 1 if layout == "thd" else 2
    view = validate._packed_view(t, "qkv", layout, head_dim, hq + 2 * hk)
    shape = getattr(qkv, "shape")
    if t.ndim == n_tok + 1:
        qkv = qkv.reshape(tuple(shape[:n_tok]) + (hq + 2 * hk, view.head_dim)) \
            if hasattr(qkv, "reshape") else qkv
    return qkv[..., :hq, :], qkv[..., hq:hq + hk, :], qkv[..., hq + hk:, :]


# ------------------------------------------------------------ page table --
def slot_mapping_from_page_table(kv_indptr, kv_indices, kv_last_page_len, block_size, *,
                                 new_tokens=None):
    """The cache slots of each sequence's last tokens, from a FlashInfer-style page table.

    Sequence b holds pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, all
    full but the last, which holds ``kv_last_page_len[b]`` tokens, so its
    length is ``(pages - 1) * block_size + kv_last_page_len[b]`` (0 without
    pages). Token i of it sits at slot ``kv_indices[kv_indptr[b] + i //
    block_size] * block_size + i % block_size``.

    Parameters
    ----------
    kv_indptr : array
        int32/int64 [B + 1].
    kv_indices : array
        int32/int64 [pages]: page (block) numbers.
    kv_last_page_len : array
        int32/int64 [B].
    block_size : int
        Tokens per page.
    new_tokens : int, array or None
        How many of each sequence's last tokens: an int (the same for every
        sequence; a decode step: 1), an int array [B], or None for the
        whole sequences. A sequence shorter than an int ``new_tokens`` gets
        -1 (padding) for its missing tokens.

    Returns
    -------
    array
        int64 slots, sequence after sequence, in the inputs' framework and
        device (NumPy in, NumPy out; torch/CuPy device arrays in, the same
        out, computed on that framework's current stream). With an int
        ``new_tokens`` the result has B * new_tokens entries and nothing is
        read back to the host; otherwise the result's length is read back
        once (a sync).

    Raises
    ------
    TypeError, ValueError
        Arrays of the wrong dtype, rank or length, naming the argument; for
        host arrays also indices out of order.

    Examples
    --------
    >>> slot_mapping_from_page_table(np.array([0, 2, 3]), np.array([5, 1, 7]),
    ...                              np.array([3, 16]), 16, new_tokens=1)
    array([ 18, 127])
    """
    bs = validate._as_int(block_size, "block_size")
    if bs < 1:
        raise ValueError(f"block_size: expected >= 1, got {bs}")
    ts = [interop.describe(a, n) for a, n in ((kv_indptr, "kv_indptr"),
                                             (kv_indices, "kv_indices"),
                                             (kv_last_page_len, "kv_last_page_len"))]
    for t, n in zip(ts, ("kv_indptr", "kv_indices", "kv_last_page_len")):
        validate._check_dtype(t, n, INDEX_DTYPES)
        if t.ndim != 1:
            raise ValueError(f"{n}: expected a 1-D array, got shape {fmt_shape(t.shape)}")
        validate._same_device(t, ts[0].device, n, "kv_indptr")
    n_seq = ts[2].shape[0]
    if ts[0].shape[0] != n_seq + 1:
        raise ValueError(f"kv_indptr: expected {n_seq + 1} entries (len(kv_last_page_len) + 1), "
                         f"got {ts[0].shape[0]}")
    count = new_tokens
    if isinstance(count, (bool, np.bool_)):
        raise TypeError("new_tokens: expected an int, an int array or None, got bool")
    if count is not None and not isinstance(count, (int, np.integer)):
        nt = interop.describe(count, "new_tokens")
        validate._check_dtype(nt, "new_tokens", INDEX_DTYPES)
        validate._same_device(nt, ts[0].device, "new_tokens", "kv_indptr")
        if nt.shape != (n_seq,):
            raise ValueError(f"new_tokens: expected an int or an array [{n_seq}], "
                             f"got shape {fmt_shape(nt.shape)}")
    elif count is not None and count < 0:
        raise ValueError(f"new_tokens: expected >= 0, got {count}")
    if not ts[0].on_gpu:
        host = [np.asarray(validate._host_values(t)).astype(np.int64) for t in ts]
        if np.any(np.diff(host[0]) < 0) or (n_seq and (host[0][0] < 0
                                                       or host[0][-1] > host[1].shape[0])):
            raise ValueError("kv_indptr: expected non-decreasing offsets within kv_indices")
        pages = np.diff(host[0])
        bad = (pages > 0) & ((host[2] < 1) | (host[2] > bs))
        if bad.any():
            raise ValueError(f"kv_last_page_len: expected 1 to block_size ({bs}) tokens in the "
                             f"last page of a sequence with pages, got {int(host[2][bad][0])}")
        if count is not None and not isinstance(count, (int, np.integer)):
            count = np.asarray(validate._host_values(interop.describe(count, "new_tokens")))
            if (count < 0).any():
                raise ValueError(f"new_tokens: expected counts >= 0, got {int(count.min())}")
        return _page_slots(np, *host, bs, count)
    return _device_page_slots(ts, bs, count)


def _page_slots(xp, indptr, indices, last_len, bs: int, count):
    """The slots, with array module ``xp`` (NumPy or CuPy); no host reads
    when ``count`` is an int."""
    pages = indptr[1:] - indptr[:-1]
    length = xp.where(pages > 0, (pages - 1) * bs + last_len, 0)
    n_seq = length.shape[0]
    if isinstance(count, (int, np.integer)):
        n = int(count)
        seq = xp.arange(n_seq * n, dtype=xp.int64) // max(n, 1)
        i = length[seq] - n + xp.arange(n_seq * n, dtype=xp.int64) % max(n, 1)
    else:
        take = length if count is None else xp.clip(xp.asarray(count, dtype=xp.int64), 0, length)
        starts = xp.cumsum(take) - take
        total = int(take.sum())  # the result's length (a sync on a device)
        seq = xp.searchsorted(xp.cumsum(take), xp.arange(total, dtype=xp.int64), side="right")
        i = length[seq] - take[seq] + (xp.arange(total, dtype=xp.int64) - starts[seq])
    # A token before the sequence's start, or (device metadata, unchecked) on
    # a page the sequence does not have, gets no slot.
    valid = (i >= 0) & (i // bs < pages[seq]) & (indptr[seq] + i // bs < indices.shape[0])
    ii = xp.where(valid, i, 0)
    page_at = xp.where(valid, indptr[seq] + ii // bs, 0)
    page = indices[page_at] if indices.shape[0] else xp.zeros_like(ii)
    return xp.where(valid, page * bs + ii % bs, -1).astype(xp.int64)


def _device_page_slots(ts, bs: int, count):
    """:func:`_page_slots` with CuPy on the inputs' device and their
    framework's current stream; the result in their framework."""
    import cupy

    dev = ts[0].device[1]
    stream = interop.stream_for(ts[0])
    with cupy.cuda.Device(dev), interop.external_stream(stream, dev):
        arrs = [cupy.from_dlpack(t.obj).astype(cupy.int64) for t in ts]
        if count is not None and not isinstance(count, (int, np.integer)):
            count = cupy.from_dlpack(count).astype(cupy.int64)
        out = _page_slots(cupy, *arrs, bs, count)
    if ts[0].kind == "torch":
        import torch

        return torch.from_dlpack(out)
    return interop.wrap_result(ts[0].obj, out)


# ------------------------------------------------------------- catalogue --
def _shipped_call(dtype: str, fmt: str, d: int, interleaved: bool, source: str,
                  pos_mode: str, rotary: int, q_fp8: bool, tensor,
                  norm: Optional[NormOptions] = None) -> CacheCall:
    """One shape-only call of the shipped grid (Llama-like heads, thd; with
    ``norm``, its per-head q/k RMSNorm with weights of q's dtype)."""
    tokens, hq, hk = 16, 32, 8
    store = dtype if fmt == SAME else "uint8"
    caches = [tensor((64, 16, hk, d), store) for _ in range(2)]
    kw = {"inv_freq": tensor((rotary // 2,), "float32")} if source == "inv_freq" else {
        "cos": tensor((4096, rotary // 2), "float32"), "sin": tensor((4096, rotary // 2),
                                                                     "float32")}
    pos = ({"positions": tensor((tokens,), "int64")} if pos_mode == "explicit"
           else {"cu_seqlens": tensor((3,), "int32")})
    tables = tuple(kw.get(n) for n in ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache"))
    weighted = norm is not None and norm.weight_mode != "none"
    weights = [tensor((d,), dtype) if weighted else None for _ in range(2)]
    norm_kw = {} if norm is None else dict(weight_mode=norm.weight_mode,
                                           rounding=norm.rounding, eps=norm.eps)
    return check_cache_call(
        tensor((tokens, hq, d), dtype), tensor((tokens, hk, d), dtype),
        tensor((tokens, hk, d), dtype), *caches, tensor((tokens,), "int64"), tables,
        pos.get("positions"), None, pos.get("cu_seqlens"), interleaved=interleaved,
        rotary_dim=rotary, cache_dtype=fmt if fmt != SAME or q_fp8 else None,
        k_scale=1.0 if fmt != SAME else None, v_scale=1.0 if fmt != SAME else None,
        inplace=not q_fp8, out_q=tensor((tokens, hq, d), "uint8") if q_fp8 else None,
        q_scale=1.0 if q_fp8 else None, q_weight=weights[0], k_weight=weights[1], **norm_kw)


def shipped_specs() -> list:
    """The specializations the launcher picks for aligned, contiguous thd
    calls over this grid: dtype x cache format (the input's, e4m3, e5m2) x
    head_dim {64, 128} x NeoX/GPT-J x angle source (float32 cos/sin tables,
    inv_freq) with explicit positions, q in place, full rotary, each for
    decode (one head a thread) and prefill (UNROLL 4); plus cu_seqlens
    (head_dim 128, tables), half rotary out of place and q written as FP8;
    plus the per-head q/k norm (Qwen3's: weights "w", rounding before the
    weight) for each dtype and cache format at head_dim 64, 128 and 256,
    and its other weight modes and rounding, GPT-J pairs and half rotary
    at head_dim 128, float32 GPT-J at head_dim 256 (two items a lane), and
    with cu_seqlens or q written as FP8 (bfloat16, head_dim 128).
    The CPU tests compile them all with NVRTC.

    Returns
    -------
    list of CacheSpec
        Distinct specs, sorted by their repr.
    """
    import itertools

    tensor = launch._FakeArrays()
    specs = set()
    dtypes, formats = ("float32", "float16", "bfloat16"), (SAME, *FP8_FORMATS)
    grid = itertools.product(dtypes, formats, (64, 128), (False, True), ("table", "inv_freq"))
    calls = [_shipped_call(dt, fmt, d, il, src, "explicit", d, False, tensor)
             for dt, fmt, d, il, src in grid]
    calls += [_shipped_call(dt, fmt, 128, il, "table", "varlen", 128, False, tensor)
              for dt, fmt, il in itertools.product(dtypes, formats, (False, True))]
    calls += [_shipped_call(dt, fmt, 128, False, "table", "explicit", 64, q8, tensor)
              for dt, fmt, q8 in itertools.product(("float16", "bfloat16"), FP8_FORMATS,
                                                  (False, True))]
    qwen3 = NormOptions("head", "w", "before_weight")
    calls += [_shipped_call(dt, fmt, d, False, "table", "explicit", d, False, tensor, qwen3)
              for dt, fmt, d in itertools.product(dtypes, formats, (64, 128, 256))]
    calls += [_shipped_call(dt, fmt, 128, il, "table", "explicit", r, False, tensor,
                            NormOptions("head", mode, rounding))
              for dt, fmt, (mode, rounding, il, r) in itertools.product(
                  ("float16", "bfloat16"), (SAME, "float8_e4m3fn"),
                  (("1+w", "after_weight", False, 128), ("none", "before_weight", False, 128),
                   ("w", "after_weight", True, 128), ("w", "before_weight", False, 64)))]
    # float32 GPT-J pairs at head_dim 256: 64 items, two a lane
    calls += [_shipped_call("float32", fmt, 256, True, "table", "explicit", 256, False, tensor,
                            qwen3) for fmt in (SAME, "float8_e4m3fn")]
    # the norm with cu_seqlens, and with q written as FP8
    calls += [_shipped_call("bfloat16", fmt, 128, False, "table", "varlen", 128, False, tensor,
                            qwen3) for fmt in (SAME, "float8_e4m3fn")]
    calls += [_shipped_call("bfloat16", fmt, 128, False, "table", "explicit", 128, True, tensor,
                            qwen3) for fmt in FP8_FORMATS]
    for cc in calls:
        for unroll in (1, 4):
            specs.add(choose_spec(cc, unroll))
        decode = choose_spec(cc, 1)
        heads = sum(sl.heads for sl in cc.call.slabs)
        shape = launch_shape(decode.items, heads, cc.call.tokens, sm_count=132)
        if flat_decode_shape(cc, decode, shape) is not None:
            specs.add(dataclasses.replace(decode, flat=True))
    return sorted(specs, key=repr)
