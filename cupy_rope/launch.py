"""Launch policy: vector widths, grid and block shape, the parameter block.

From a validated :class:`~cupy_rope.validate.Call` this module derives the
kernel :class:`~cupy_rope.specialize.Spec` (the widths it can prove aligned),
the grid/block shape, and the ``Params`` struct of ``kernels/params.cuh``,
then launches on the caller's stream. This is the only place that knows how
work is spread over threads.
"""

from __future__ import annotations

import ctypes
import functools
import struct

from .specialize import Spec, get_kernel
from .validate import LAYOUTS, Call

MAX_VECTOR_BYTES = 16  # widest single global load/store
THREADS_PER_BLOCK = 256
UNROLL = 4  # heads per thread per pass, loads issued together
MAX_BLOCK_Z = 64  # CUDA's limit on blockDim.z
BLOCKS_PER_SM = 8  # blocks to aim for before splitting heads over blockIdx.y

# The fields of rope::Params, in order: (name, struct code). Every field is
# 8 bytes; "f" pairs with the padding float.
PARAM_FIELDS = (
    ("x.data", "Q"), ("x.stride_outer", "q"), ("x.stride_inner", "q"),
    ("x.stride_head", "q"), ("x.stride_dim", "q"),
    ("out.data", "Q"), ("out.stride_outer", "q"), ("out.stride_inner", "q"),
    ("out.stride_head", "q"), ("out.stride_dim", "q"),
    ("cos", "Q"), ("sin", "Q"), ("cos_stride_row", "q"), ("sin_stride_row", "q"),
    ("cos_stride_col", "q"), ("sin_stride_col", "q"), ("max_position", "q"),
    ("positions", "Q"), ("offsets", "Q"), ("pos_stride_outer", "q"), ("pos_stride_inner", "q"),
    ("off_stride_outer", "q"), ("off_stride_inner", "q"), ("seq_stride_outer", "q"),
    ("seq_stride_inner", "q"), ("offset", "q"),
    ("n_outer", "q"), ("n_inner", "q"), ("n_heads", "q"), ("heads_per_group", "q"),
    ("sin_sign", "f"), ("pad_", "f"),
)
_PARAMS = struct.Struct("<" + "".join(code for _, code in PARAM_FIELDS))


def _aligned(elems: int, t, strides) -> bool:
    """Can ``t`` be read in packets of ``elems`` elements at these strides?"""
    return (t.ptr % (min(elems * t.itemsize, MAX_VECTOR_BYTES)) == 0
            and all(st % elems == 0 for st in strides))


def _widest(candidates, ok) -> int:
    for w in candidates:
        if ok(w):
            return w
    return 0


def _token_strides(t, call: Call):
    """(batch stride, seq stride, head stride) of a 4-D array in call's layout."""
    b_axis, s_axis = LAYOUTS[call.layout]
    return t.strides[b_axis], t.strides[s_axis], t.strides[2]


_spec_cache: dict = {}


def _spec_key(call: Call, out) -> tuple:
    """Everything :func:`choose_spec` looks at: shapes only as 'is it > 1'."""
    x = call.x
    return (x.dtype, x.strides, x.ptr & 15, out.strides, out.ptr & 15, call.layout,
            call.batch > 1, call.seqlen > 1, call.heads > 1, call.head_dim, call.rotary_dim,
            call.interleaved, call.inplace, call.source,
            tuple([(t.dtype, t.strides, t.shape[0] > 1, t.ptr & 15) for t in call.tables]),
            call.positions.dtype if call.positions is not None else None,
            call.offsets.dtype if call.offsets is not None else None)


def cached_spec(call: Call, out) -> Spec:
    """:func:`choose_spec`, memoized on the properties it depends on."""
    key = _spec_key(call, out)
    spec = _spec_cache.get(key)
    if spec is None:
        if len(_spec_cache) > 4096:
            _spec_cache.clear()
        spec = _spec_cache[key] = choose_spec(call, out)
    return spec


def choose_spec(call: Call, out) -> Spec:
    """The kernel instantiation for ``call`` writing to ``out`` (a Tensor)."""
    x = call.x
    d, r = call.head_dim, call.rotary_dim
    half = r // 2
    moving = [x] if call.inplace else [x, out]
    strided = any(t.strides[3] != 1 for t in moving)
    max_elems = MAX_VECTOR_BYTES // x.itemsize
    widths = [w for w in (16, 8, 4, 2, 1) if w <= max_elems]

    def x_ok(elems):
        return all(_aligned(elems, t, [s for s, n in zip(_token_strides(t, call),
                                                          (call.batch, call.seqlen, call.heads))
                                       if n > 1]) for t in moving)

    if strided:
        pairs = 1
    elif call.interleaved:  # one packet of 2 * pairs channels
        pairs = max(1, _widest([w for w in widths if w >= 2],
                               lambda w: half % (w // 2) == 0 and x_ok(w)) // 2)
        strided = not x_ok(2)
    else:  # two packets of `pairs` channels, half apart
        pairs = _widest(widths, lambda w: half % w == 0 and x_ok(w))  # 1 always fits

    tables = call.tables
    table_strided = strided or any(t.strides[-1] != 1 for t in tables)
    if not table_strided:
        row_strides = [t.strides[0] for t in tables if t.ndim == 2 and t.shape[0] > 1]
        table_strided = not all(_aligned(pairs, t, row_strides) for t in tables)

    copy_tail = not call.inplace and r < d
    tail_vec = 1
    if copy_tail and not strided:
        tail_vec = _widest(widths, lambda w: (d - r) % w == 0 and r % w == 0 and x_ok(w)) or 1

    pos_dtype = call.positions.dtype if call.positions is not None else "int32"
    off_dtype = call.offsets.dtype if call.offsets is not None else "int32"
    return Spec(x.dtype, tables[0].dtype, pos_dtype, off_dtype, d, r, call.interleaved,
                call.source, pairs, tail_vec, strided, table_strided, copy_tail, UNROLL)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


@functools.lru_cache(maxsize=4096)
def block_shape(items: int, heads: int, tokens: int, unroll: int, device_id: int):
    """(grid, block, heads_per_group) for ``tokens`` x ``heads`` x ``items`` work.

    A block is items x head lanes x tokens; each head lane takes ``unroll``
    heads per pass. With few tokens (decode) the heads are split into groups
    over blockIdx.y so that the grid still covers every SM several times.
    """
    by = max(1, min(-(-heads // unroll), THREADS_PER_BLOCK // items))
    bz = max(1, THREADS_PER_BLOCK // (items * by))
    bz = min(bz, max(1, tokens), MAX_BLOCK_Z)
    gx = -(-tokens // bz)
    head_rows = -(-heads // by)  # head iterations of one thread if one group
    groups = 1
    target = BLOCKS_PER_SM * _sm_count(device_id)
    if gx < target and head_rows > 1:  # few tokens: spread heads over blockIdx.y
        groups = min(head_rows, -(-target // gx))
    heads_per_group = by * -(-head_rows // groups)
    gy = -(-heads // heads_per_group)
    return (gx, gy, 1), (items, by, bz), heads_per_group


def pack_params(call: Call, out, heads_per_group: int) -> bytes:
    x = call.x
    xb, xs, xh = _token_strides(x, call)
    ob, os_, oh = _token_strides(out, call)
    # Tokens are walked with the smaller-stride axis inner, for locality.
    seq_inner = abs(xs) <= abs(xb) or call.batch == 1
    if seq_inner:
        n_outer, n_inner = call.batch, call.seqlen
        x_tok, o_tok = (xb, xs), (ob, os_)
        seq_strides = (0, 1)
    else:
        n_outer, n_inner = call.seqlen, call.batch
        x_tok, o_tok = (xs, xb), (os_, ob)
        seq_strides = (1, 0)

    def by_order(b_stride, s_stride):
        return (b_stride, s_stride) if seq_inner else (s_stride, b_stride)

    pos_strides = (0, 0)
    if call.positions is not None:
        p = call.positions
        pos_strides = by_order(*p.strides) if p.ndim == 2 else by_order(0, p.strides[0])
    off_strides = (0, 0)
    if call.offsets is not None:
        off_strides = by_order(call.offsets.strides[0], 0)

    tables = call.tables
    cos = tables[0]
    sin = tables[1] if len(tables) > 1 else tables[0]
    return _PARAMS.pack(
        x.ptr, *x_tok, xh, x.strides[3],
        out.ptr, *o_tok, oh, out.strides[3],
        cos.ptr, sin.ptr,
        cos.strides[0] if cos.ndim == 2 else 0, sin.strides[0] if sin.ndim == 2 else 0,
        cos.strides[-1], sin.strides[-1], call.max_position,
        call.positions.ptr if call.positions is not None else 0,
        call.offsets.ptr if call.offsets is not None else 0,
        *pos_strides, *off_strides, *seq_strides, call.offset,
        n_outer, n_inner, call.heads, heads_per_group,
        -1.0 if call.backward else 1.0, 0.0,
    )


def launch(call: Call, out, stream: int) -> None:
    """Run ``call`` writing into ``out`` (a Tensor) on ``stream``."""
    tokens = call.batch * call.seqlen
    if tokens == 0 or call.heads == 0:
        return
    spec = cached_spec(call, out)
    device_id = call.x.device[1]
    kernel = get_kernel(spec, device_id)
    grid, block, heads_per_group = block_shape(spec.rot_items + spec.tail_items,
                                               call.heads, tokens, spec.unroll, device_id)
    buf = ctypes.create_string_buffer(pack_params(call, out, heads_per_group), _PARAMS.size)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    from cupy.cuda import driver

    driver.launchKernel(kernel.ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                        0, stream, ctypes.addressof(args), 0)


# ------------------------------------------------------------- catalogue --
SHIPPED_HEAD_DIMS = (64, 80, 96, 128, 256)
SHIPPED_ROTARY_FRACTIONS = (1.0, 0.5, 0.25)


def shipped_specs() -> list:
    """Every specialization the launcher picks for aligned, contiguous inputs.

    The grid: dtype x head_dim {64, 80, 96, 128, 256} x rotary fraction
    {1, 1/2, 1/4} x NeoX/GPT-J x angle source (float32 tables, tables in x's
    dtype, inv_freq, angle table) x in place / out of place x int32/int64
    positions, plus the element-by-element path for a strided last axis. The
    CPU tests compile all of them with NVRTC. Specs are derived by running
    :func:`choose_spec` on shape-only descriptions, so the list follows the
    launch policy.
    """
    from .interop import CUDA, Tensor
    from .validate import check_call

    base = iter(range(1 << 30, 1 << 62, 1 << 30))  # distinct, 16-byte aligned fake pointers

    def tensor(shape, dtype, strides=None):
        if strides is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.insert(0, acc)
                acc *= n
        return Tensor(None, "cupy", next(base), tuple(shape), tuple(strides), dtype, (CUDA, 0),
                      False)

    specs = []
    b, s, h = 2, 16, 4
    for dtype in ("float32", "float16", "bfloat16"):
        for d in SHIPPED_HEAD_DIMS:
            for frac in SHIPPED_ROTARY_FRACTIONS:
                r = int(d * frac) // 2 * 2
                sources = [("cos", "float32"), ("inv_freq", "float32"), ("freqs", "float32")]
                if dtype != "float32":
                    sources.append(("cos", dtype))
                for name, adt in sources:
                    for interleaved in (False, True):
                        for inplace in (False, True):
                            for pos_dtype in ("int32", "int64"):
                                for last_stride in (1, 2):
                                    if last_stride == 2 and (inplace or pos_dtype == "int64"):
                                        continue
                                    x = tensor((b, s, h, d), dtype,
                                               (s * h * d * last_stride, h * d * last_stride,
                                                d * last_stride, last_stride))
                                    out = tensor((b, s, h, d), dtype)
                                    width = 1 if name == "inv_freq" else 2
                                    shape = (r // 2,) if width == 1 else (s, r // 2)
                                    kw = {name: tensor(shape, adt)}
                                    if name == "cos":
                                        kw["sin"] = tensor(shape, adt)
                                    call = check_call(
                                        x, positions=tensor((b, s), pos_dtype),
                                        offsets=tensor((b,), pos_dtype), interleaved=interleaved,
                                        inplace=inplace, out=None if inplace else out, **kw)
                                    specs.append(choose_spec(call, call.x if inplace else out))
    return sorted(set(specs), key=repr)
