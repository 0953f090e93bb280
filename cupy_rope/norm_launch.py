"""Plan and launch of the fused q/k RMSNorm + RoPE kernels (kernels/norm_flat.cu
for dense head rows, kernels/norm_rope.cu for every call).

Interface (called by :mod:`cupy_rope.qk_norm`)::

    forward(call, arrays, weights, norm) -> None
    backward(call, arrays, inputs, weights, weight_grads, norm) -> None
    prepare(call, arrays, ptrs, weights, norm, inputs, weight_grads, backward)
        -> Prepared, whose launch(ptrs, offset) repeats the call's launches
        for another call of its signature (qk_norm's call cache)

From a validated :class:`~cupy_rope.validate.Call` of op ``"qk"`` (outputs
attached) and the norm's :class:`~cupy_rope.validate.NormOptions` this
module derives the kernel specialization (:class:`NormFlatSpec` where a
flat kernel takes the call, else :class:`NormSpec`), the launch shape and
the parameter block (``rope::NormFlatParams``: ``rope::FlatParams``, the
norm's part and the gaps; or ``rope::NormParams``: ``rope::Params`` as
:mod:`cupy_rope.launch` packs it, then the norm's part), and launches on the
stream of the caller's framework. Kernels compile through
:func:`cupy_rope.specialize.get_kernel` (NVRTC, cached in memory and on
disk), which takes any spec with ``source_file`` and ``name_expression``.

A :class:`Plan` (spec, shape, fixed parameters) is cached per call
signature, so a repeated call only packs its pointers; :data:`POLICY` holds
the tuned launch choices.

Forward is one launch. Backward is two: the norm kernel, whose blocks each
write a float32 row of weight-gradient partial sums into a workspace, then
weight_grad_reduce, which sums those rows in a fixed order (no atomics), so
the weight gradients are the same bits on every run of a call signature on
one device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import threading
from typing import NamedTuple, Optional

from . import interop
from . import launch
from .specialize import ANGLE_SOURCES, CXX_TYPES, POS_MODES, get_kernel
from .validate import VARLEN, Call, NormOptions, head_view

#: Threads per block (kernels/norm_rope.cu NORM_THREADS, its launch bounds).
NORM_THREADS = 256
#: Most threads of a norm_flat_token_kernel block, and of its backward's
#: (kernels/norm_flat.cu NORM_FLAT_TOKEN_THREADS and
#: NORM_FLAT_TOKEN_BACKWARD_THREADS, their launch bounds).
FLAT_TOKEN_THREADS = 1024
FLAT_TOKEN_BACKWARD_THREADS = 512
#: weight_grad_reduce's block: REDUCE_COLS channels x REDUCE_ROWS partial sums.
REDUCE_COLS, REDUCE_ROWS = 32, 32
SCOPES = {"head": 0, "token": 1}
WEIGHT_MODES = {"none": 0, "w": 1, "1+w": 2}
#: Most heads a thread holds per token (scope "token": every head of a
#: token is held at once).
MAX_UNROLL = 8


@dataclasses.dataclass(frozen=True)
class NormPolicy:
    """The tuned launch choices (forward, backward)."""

    #: Values (channels) of a pass's heads one thread may hold: fewer heads
    #: per pass where a head's items are wide, so registers do not spill.
    pass_floats: tuple = (64, 16)
    #: Blocks per SM the register budget leaves room for (launch bounds).
    min_blocks: tuple = (2, 2)
    #: Backward: blocks per SM that walk the units (each writes one partial row).
    backward_blocks_per_sm: int = 4
    #: Forward: blocks per SM that walk the units, each asking L2 for its
    #: next unit while it works on one (0: a block per unit).
    forward_blocks_per_sm: int = 4
    #: Forward calls with fewer rows (tokens x the most heads) than this
    #: (decode): one head per pass and a block per unit, for latency.
    few_rows: int = 1 << 14
    #: Scope "token", forward: fewest heads a thread holds (fewer threads
    #: per token, so that a block holds several tokens).
    token_unroll: int = 3
    #: The forward kernels tried in order: "flat" (norm_flat_kernel, where
    #: it applies), then "rows" (norm_rope_kernel, which takes every call).
    kernels: tuple = ("flat", "rows")
    #: norm_flat_kernel: head rows a thread holds where a warp's rows share
    #: a position (their angles and weights read once for all).
    flat_rows: int = 4
    #: norm_flat_token_kernel: the threads a block aims at (whole tokens,
    #: at least one).
    flat_token_block: int = 256
    #: The flat backward kernels: head rows a thread holds per step (as
    #: flat_rows), and threads per SM of the blocks that walk the rows (each
    #: block writes one partial row of weight-gradient sums).
    flat_backward_rows: int = 2
    flat_backward_threads_per_sm: int = 512


#: The policy in force (tools replace it, then clear ``_plans``).
POLICY = NormPolicy()


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """Compile-time choices of one norm_rope_kernel instantiation."""

    dtype: str
    angle_dtype: str
    weight_dtype: str  # "float32" without a weight
    head_dim: int
    rotary_dim: int
    interleaved: bool
    source: str  # key of specialize.ANGLE_SOURCES
    pairs: int
    tail_vec: int
    strided: bool
    table_strided: bool
    pos_mode: str
    scope: str  # key of SCOPES
    weight_mode: str  # key of WEIGHT_MODES
    weight_vec: bool  # weights read in packets as x is (aligned), else element by element
    round_before: bool  # forward only (False for backward)
    lanes: int  # blockDim.x: lanes over a head's items (a power of two <= 32)
    items: int  # items per lane (kernel K)
    unroll: int  # heads per pass (kernel U)
    backward: bool = False
    weight_grad: bool = False
    min_blocks: int = 2  # launch bounds: blocks per SM

    source_file = "norm_rope.cu"

    def name_expression(self) -> str:
        b = lambda v: "true" if v else "false"  # noqa: E731
        return "rope::norm_rope_kernel<" + ", ".join([
            CXX_TYPES[self.dtype], CXX_TYPES[self.angle_dtype], CXX_TYPES[self.weight_dtype],
            str(self.head_dim), str(self.rotary_dim), b(self.interleaved),
            str(ANGLE_SOURCES[self.source]), str(self.pairs), str(self.tail_vec),
            b(self.strided), b(self.table_strided), str(POS_MODES[self.pos_mode]),
            str(SCOPES[self.scope]), str(WEIGHT_MODES[self.weight_mode]), b(self.weight_vec),
            b(self.round_before),
            str(self.lanes), str(self.items), str(self.unroll), b(self.backward),
            b(self.weight_grad), str(self.min_blocks)]) + ">"


@dataclasses.dataclass(frozen=True)
class NormFlatSpec:
    """Compile-time choices of one flat norm kernel instantiation
    (kernels/norm_flat.cu: forward or backward, scope "head" or "token",
    over dense head rows, a packet a thread and row)."""

    dtype: str
    angle_dtype: str
    weight_dtype: str  # "float32" without a weight
    head_dim: int
    interleaved: bool
    slabs: int  # the call's slab count
    pos_mode: str  # implied or explicit
    weight_mode: str
    round_before: bool
    rows: int = 1  # head rows a thread holds, all at one position (kernel U)
    scope: str = "head"
    heads: int = 0  # scope "token": every slab's heads (kernel HEADS)
    backward: bool = False
    weight_grad: bool = False
    gapped: bool = False  # scope "head" forward: tokens further apart than their rows

    source_file = "norm_flat.cu"

    def name_expression(self) -> str:
        b = lambda v: "true" if v else "false"  # noqa: E731
        kernel = ("norm_flat" + ("_token" if self.scope == "token" else "")
                  + ("_backward" if self.backward else "") + "_kernel")
        return f"rope::{kernel}<" + ", ".join([
            CXX_TYPES[self.dtype], CXX_TYPES[self.angle_dtype], CXX_TYPES[self.weight_dtype],
            str(self.head_dim), b(self.interleaved), str(self.slabs),
            str(POS_MODES[self.pos_mode]), str(WEIGHT_MODES[self.weight_mode]),
            b(self.weight_grad if self.backward else self.round_before), str(self.rows)]
            + ([str(self.heads)] if self.scope == "token" else [])
            + ([b(self.gapped)] if self.scope == "head" and not self.backward else [])) + ">"


@dataclasses.dataclass(frozen=True)
class ReduceSpec:
    """weight_grad_reduce for one weight-gradient dtype."""

    weight_dtype: str

    source_file = "norm_rope.cu"

    def name_expression(self) -> str:
        return f"rope::weight_grad_reduce<{CXX_TYPES[self.weight_dtype]}>"


# rope::NormSlab per slab, then eps and its padding (kernels/norm_items.cuh,
# norm_rope.cu).
_NORM_SLAB = "QQQ" + "q" * 5 + "qqq"
_NORM = struct.Struct("<" + _NORM_SLAB * launch.MAX_SLABS + "ff")
NORM_PARAMS_SIZE = launch.PARAMS_SIZE + _NORM.size
# rope::FlatGap per slab (kernels/norm_flat.cu): elements, heads_mul, heads_shift.
_GAP = struct.Struct("<" + "qqq" * launch.MAX_SLABS)
NORM_FLAT_PARAMS_SIZE = launch.FLAT_PARAMS_SIZE + _NORM.size + _GAP.size  # rope::NormFlatParams
_REDUCE = struct.Struct("<" + "Q" * (2 * launch.MAX_SLABS) + "q" * (2 * launch.MAX_SLABS))


# ------------------------------------------------------------- the spec --
def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _input_views(call: Call, inputs) -> list:
    """The backward's forward inputs as (Tensor, element offset, strides5)
    per slab: given as Tensors, or as validate.Slab records reading them."""
    views = []
    for s, t in zip(call.slabs, inputs):
        if hasattr(t, "x_strides"):
            views.append((t.x, t.x_offset, t.x_strides))
        else:
            views.append((t, 0, head_view(t, s.name, call.layout, call.head_dim)[4]))
    return views


def _widths(call: Call, inputs) -> "launch._Widths":
    """rope's vector widths for every view the kernel reads or writes (the
    backward's forward inputs too), with the tail always written: the norm
    changes every channel, in place too."""
    slabs = list(call.slabs)
    for s, (t, off, st) in zip(call.slabs, _input_views(call, inputs or ())):
        slabs.append(s._replace(x=t, x_offset=off, x_strides=st, out=None))
    return launch._vector_widths(call._replace(slabs=tuple(slabs), inplace=False))


def choose_spec(call: Call, norm: NormOptions, weights, backward: bool = False,
                weight_grad: bool = False, inputs=None) -> "NormSpec | NormFlatSpec":
    """The kernel instantiation for ``call`` (outputs attached): a flat
    kernel's :class:`NormFlatSpec` where one takes it, else
    norm_rope_kernel's :class:`NormSpec`.

    ``weights``: (q_weight, k_weight) descriptions of one dtype, or None;
    ``inputs``: the backward's forward inputs (q, k). Raises ValueError
    where a token's heads do not fit one block (scope "token").
    """
    if "flat" in POLICY.kernels:
        flat = _flat_spec(call, norm, weights, backward, weight_grad, inputs)
        if flat is not None:
            return flat
    w = _widths(call, inputs)
    d, r = call.head_dim, call.rotary_dim
    tail_vec = w.tail_vec if r < d else 1
    lanes, k_items = lane_layout(d, r, w.pairs, tail_vec)
    per_head = k_items * 2 * w.pairs
    heads = max(s.heads for s in call.slabs)
    if norm.scope == "token":
        least = 1 if backward else min(POLICY.token_unroll,
                                       max(1, POLICY.pass_floats[0] // per_head))
        unroll = _token_unroll(lanes, heads, call.slabs[0].name, least)
        if not _slots_used([s.heads for s in call.slabs], unroll):
            unroll = _token_unroll(lanes, heads, call.slabs[0].name)
    elif not backward and _few_rows(call):
        unroll = 1
    else:
        unroll = 4
        while unroll > 1 and (unroll * per_head > POLICY.pass_floats[backward]
                              or unroll > heads):
            unroll //= 2
    weights = _weights(weights) if norm.weight_mode != "none" else None
    runs = ([w.pairs if not call.interleaved else 2 * w.pairs]
            + ([tail_vec] if r < d else []))
    return NormSpec(
        call.dtype, call.tables[0].dtype, _weight_dtype(weights) or "float32", d, r,
        call.interleaved, call.source, w.pairs, tail_vec, w.strided, w.table_strided,
        call.pos_mode, norm.scope, norm.weight_mode,
        _weights_aligned(weights, runs, d if norm.scope == "token" else 0),
        norm.rounding == "before_weight" and not backward, lanes, k_items, unroll, backward,
        weight_grad and weights is not None, POLICY.min_blocks[backward])


def _flat_spec(call: Call, norm: NormOptions, weights, backward: bool = False,
               weight_grad: bool = False, inputs=None) -> Optional[NormFlatSpec]:
    """The flat kernels' spec for ``call``, or None where they do not
    apply. They need full rotary on flat_kernel's layouts (:func:`_flat_layout`:
    also a packed projection in place, for the scope-"head" forward), head
    rows of 2 to 32 aligned packets (a power of two: scope "head" then sums
    a row's lanes in norm_rope_kernel's order, so both kernels give the
    same bits) and weights aligned for packets. Scope "token" also needs
    every slab's heads innermost in memory, as many heads in each slab and
    a token within one block; the backward, forward inputs with the
    gradients' strides."""
    d = call.head_dim
    vec = launch.MAX_VECTOR_BYTES // launch.ITEMSIZE[call.dtype]
    packets = d // vec
    layout = _flat_layout(call)
    if (call.rotary_dim != d or d % vec or not 2 <= packets <= 32 or packets & (packets - 1)
            or layout is None or (any(layout.gaps) and (backward or norm.scope != "head"))):
        return None
    geometry = layout.geometry
    if backward and any(st != s.x_strides
                        for s, (_, _, st) in zip(call.slabs, _input_views(call, inputs))):
        return None
    w = _widths(call, inputs if backward else None)
    if w.strided or w.table_strided or w.pairs * (2 if call.interleaved else 1) != vec:
        return None
    weights = _weights(weights) if norm.weight_mode != "none" else None
    if not _weights_aligned(weights, [vec], d if norm.scope == "token" else 0):
        return None
    pass_rows = 32 // packets
    spec = NormFlatSpec(call.dtype, call.tables[0].dtype, _weight_dtype(weights) or "float32",
                        d, call.interleaved, len(call.slabs), call.pos_mode, norm.weight_mode,
                        norm.rounding == "before_weight")
    spec = dataclasses.replace(spec, round_before=spec.round_before and not backward,
                               backward=backward, weight_grad=weight_grad and weights is not None)
    # The kernels hold at most 4 rows a thread (the backward 2).
    most_rows = min(POLICY.flat_backward_rows, 2) if backward else min(POLICY.flat_rows, 4)
    if norm.scope == "token":
        heads = call.slabs[0].heads
        if any(s.heads != heads or (heads > 1 and s.x_strides[3] != d) for s in call.slabs):
            return None
        most_threads = FLAT_TOKEN_BACKWARD_THREADS if backward else FLAT_TOKEN_THREADS
        rows = next((u for u in (4, 2, 1) if u <= most_rows and heads % (pass_rows * u) == 0
                     and heads // (pass_rows * u) * 32 <= most_threads), 0)
        return dataclasses.replace(spec, rows=rows, scope="token", heads=heads) if rows else None
    rows = most_rows
    while rows > 1 and any(step % (pass_rows * rows) for _, step, _ in geometry):
        rows //= 2
    return dataclasses.replace(spec, rows=rows, gapped=any(layout.gaps))


class _FlatLayout(NamedTuple):
    geometry: list  # launch.flat_geometry of the slabs' dense twins
    gaps: list  # per slab, elements between one token's head rows and the next's
    heads: list  # per slab, head rows a token


def _flat_layout(call: Call) -> Optional[_FlatLayout]:
    """How the flat norm kernels walk ``call``'s slabs, or None where they
    cannot: :func:`cupy_rope.launch.flat_geometry`'s dense head rows, or
    (the q and k of a packed projection) a token's head rows dense but the
    tokens further apart, walked as their dense twin with the gap added by
    the kernel (rope::FlatGap)."""
    d, twins, gaps = call.head_dim, [], []
    for s in call.slabs:
        b_st, s_st, g_st, h_st, d_st = s.x_strides
        outer = [st for st, n in ((b_st, call.batch), (s_st, call.seqlen)) if n > 1]
        step, dense = min(outer, default=0), s.heads * d
        same_out = call.inplace or tuple(s.out_strides) == tuple(s.x_strides)
        gap = 0
        if (step > dense and (s.heads == 1 or h_st == d) and same_out
                and all(st % step == 0 for st in outer)):
            gap = step - dense
            scale = (lambda st: st // step * dense if st % step == 0 and st else st)  # noqa: E731
            st = (scale(b_st), scale(s_st), g_st, h_st, d_st)
            s = s._replace(x_strides=st, out_strides=st if not call.inplace else s.out_strides)
        twins.append(s)
        gaps.append(gap)
    geometry = launch.flat_geometry(call._replace(slabs=tuple(twins)))
    if geometry is None:
        return None
    return _FlatLayout(geometry, gaps, [s.heads for s in call.slabs])


def _flat_gaps(layout: _FlatLayout) -> bytes:
    """rope::FlatGap of every slab (zeros past the call's slabs)."""
    fields = []
    for i in range(launch.MAX_SLABS):
        gap = layout.gaps[i] if i < len(layout.gaps) else 0
        fields += [gap, *(launch.reciprocal(layout.heads[i]) if gap else (0, 0))]
    return _GAP.pack(*fields)


def lane_layout(head_dim: int, rotary_dim: int, pairs: int, tail_vec: int) -> tuple:
    """(lanes, items per lane) over one head's items: the order in which a
    head's sum of squares is taken. The KV-cache op's norm path uses the
    same layout, so that both ops round a row's statistics alike."""
    items = rotary_dim // 2 // pairs + (head_dim - rotary_dim) // tail_vec
    lanes = min(32, _pow2_ceil(items))
    return lanes, -(-items // lanes)


def _weights_aligned(weights, runs, head_stride: int) -> bool:
    """Can the weights be read in packets of each of ``runs`` elements (as
    x is), at every head's offset ``head_stride`` apart (scope "token")?"""
    if weights is None:
        return True
    return all(launch._aligned(n, w.ptr, w.itemsize, [head_stride] if head_stride else [])
               for w in weights for n in runs)


def _few_rows(call: Call) -> bool:
    """Is a forward call decode-sized (launched for latency rather than bandwidth)?"""
    return call.tokens * max(s.heads for s in call.slabs) < POLICY.few_rows


def _slots_used(slab_heads, unroll: int, floor: float = 0.75) -> bool:
    """Scope "token": does every slab fill at least ``floor`` of its head
    lanes' slots when a thread holds ``unroll`` heads? (A slab's head lanes
    must divide blockDim.y, which the largest slab sets: with GQA and
    several heads a thread, k may find only a count far above its need.)"""
    by = -(-max(slab_heads) // unroll)
    return all(h >= floor * _slab_lanes(h, by, unroll) * unroll for h in slab_heads if h)


def _slab_lanes(heads: int, by: int, unroll: int) -> int:
    """Head lanes of a slab of ``heads`` heads in blocks of ``by`` head lanes:
    the fewest that hold its heads, ``unroll`` a lane, and divide ``by``."""
    need = -(-heads // unroll)
    return next(n for n in range(max(need, 1), by + 1) if by % n == 0)


def _token_unroll(lanes: int, heads: int, name: str, least: int = 1) -> int:
    """Scope "token": the fewest heads per thread, at least ``least``, that
    let one block hold a token's heads."""
    least = min(least, heads)
    for unroll in range(1, MAX_UNROLL + 1):
        if lanes * -(-heads // unroll) <= NORM_THREADS and unroll >= least:
            return unroll
    most = NORM_THREADS // lanes * MAX_UNROLL
    raise ValueError(f"{name}: {heads} heads per token; norm_scope='token' supports at most "
                     f"{most} heads of this head_dim and dtype (one block holds a token)")


# ------------------------------------------------------------ the shape --
class _Shape(NamedTuple):
    grid: tuple
    block: tuple
    slab_blocks: list  # per slab (block_begin, token_blocks, head_lanes, heads_per_block)
    units: list  # per slab: token blocks x head groups (flat kernels: head rows)
    blocks: list  # per slab: blocks launched (a block walks units[k] / blocks[k] units)


def _token_scope_layout(spec: NormSpec, slab_heads, tokens: int):
    """(block, per-slab (token_blocks, head_lanes, heads_per_block)) for
    scope "token": a slab's head lanes times the unroll cover its heads;
    its head lanes divide blockDim.y (the rest of y takes further tokens)."""
    by = -(-max(slab_heads) // spec.unroll)
    bz = max(1, min(NORM_THREADS // (spec.lanes * by), launch.MAX_BLOCK_Z, tokens))
    layout = []
    for h in slab_heads:
        lanes = _slab_lanes(h, by, spec.unroll)
        layout.append((-(-tokens // (bz * (by // lanes))), lanes, max(h, 1)))
    return (spec.lanes, by, bz), layout


def _flat_shape(call: Call, spec: NormFlatSpec, sm_count: int,
                layout: Optional[_FlatLayout] = None) -> _Shape:
    """The flat kernels' grid: per slab, as many warps as its rows over the
    rows a thread holds (scope "head"), or whole tokens a block (scope
    "token"), or for the backward blocks of at most
    flat_backward_threads_per_sm threads an SM, which walk the rows (scope
    "token": a block holds one token); units: the slab's rows."""
    slab_rows = [r for r, _, _ in (layout or _flat_layout(call)).geometry]
    packets = spec.head_dim * launch.ITEMSIZE[spec.dtype] // launch.MAX_VECTOR_BYTES
    if spec.backward:
        if spec.scope == "token":  # a block: one token's warps
            threads = spec.heads * packets // spec.rows
            steps = [r // spec.heads for r in slab_rows]
        else:  # a block: FLAT_THREADS threads, U rows each per step
            threads = launch.FLAT_THREADS
            steps = [-(-r // (32 // packets * spec.rows * threads // 32)) for r in slab_rows]
        most = max(1, POLICY.flat_backward_threads_per_sm // threads) * sm_count
        blocks = [min(n, most) for n in steps]
        slab_blocks = [(sum(blocks[:i]), 0, 0, 0) for i in range(len(blocks))]
        return _Shape((sum(blocks), 1, 1), (threads, 1, 1), slab_blocks, slab_rows, blocks)
    if spec.scope == "head":
        grid, block, slab_blocks = launch.flat_shape(packets, True,
                                                     [-(-r // spec.rows) for r in slab_rows])
    else:
        token_threads = spec.heads * packets // spec.rows
        per_block = max(1, min(POLICY.flat_token_block, FLAT_TOKEN_THREADS) // token_threads)
        block = (per_block * token_threads, 1, 1)
        slab_blocks, begin = [], 0
        for r in slab_rows:
            slab_blocks.append((begin, 0, 0, 0))
            begin += -(-(r // spec.heads) // per_block)
        grid = (begin, 1, 1)
    ends = [b[0] for b in slab_blocks[1:]] + [grid[0]]
    return _Shape(grid, block, slab_blocks, slab_rows,
                  [e - b[0] for b, e in zip(slab_blocks, ends)])


def launch_shape(call: Call, spec: NormSpec, sm_count: int,
                 layout: Optional[_FlatLayout] = None) -> _Shape:
    """Grid, block and per-slab layout of ``spec`` running ``call``
    (``layout``: :func:`_flat_layout` of the call, where the plan has it)."""
    heads = tuple(s.heads for s in call.slabs)
    if isinstance(spec, NormFlatSpec):
        return _flat_shape(call, spec, sm_count, layout)
    if spec.scope == "token":
        block, layout = _token_scope_layout(spec, heads, call.tokens)
    else:
        shape = (spec.lanes, heads, call.tokens, spec.unroll, sm_count)
        _, block, slabs = (launch.varlen_block_shape(*shape, call.n_seqs, call.source)
                           if call.pos_mode == VARLEN else launch.block_shape(*shape))
        layout = [sb[1:] for sb in slabs]
    units = [tb * (-(-h // hpb) if h else 0) for h, (tb, _, hpb) in zip(heads, layout)]
    per_sm = POLICY.backward_blocks_per_sm
    if not spec.backward:
        per_sm = 0 if _few_rows(call) else POLICY.forward_blocks_per_sm
    blocks = [min(u, per_sm * sm_count) for u in units] if per_sm else units
    slab_blocks, begin = [], 0
    for (tb, lanes, hpb), n in zip(layout, blocks):
        slab_blocks.append((begin, tb, lanes, hpb))
        begin += n
    return _Shape((begin, 1, 1), block, slab_blocks, units, blocks)


# ----------------------------------------------------------- parameters --
def _dynamic(call: Call) -> list:
    """rope::CallData's pointers (x, out, tables, positions) and offset."""
    slabs = list(call.slabs) + [None] * (launch.MAX_SLABS - len(call.slabs))

    def ptr(t, off=0):
        return 0 if t is None else t.ptr + off * t.itemsize

    return ([ptr(s.x, s.x_offset) if s else 0 for s in slabs]
            + [ptr(s.out, s.out_offset) if s else 0 for s in slabs]
            + [ptr(call.tables[0], call.table_offsets[0]),
               ptr(call.tables[-1], call.table_offsets[-1]),
               ptr(call.positions), ptr(call.offsets), ptr(call.cu_seqlens), call.offset])


def _norm_fields(call: Call, spec: NormSpec, shape: _Shape, weights, inputs, partials,
                 eps: float) -> bytes:
    """rope::NormSlab per slab, then eps."""
    order = launch._token_order(call)
    views = _input_views(call, inputs) if inputs is not None else None
    fields = []
    for i in range(launch.MAX_SLABS):
        if i >= len(call.slabs):
            fields += [0] * (3 + 5 + 3)
            continue
        s = call.slabs[i]
        weight = weights[i].ptr if weights is not None and i < len(weights) else 0
        view, data = (0,) * 5, 0
        if views is not None:
            t, off, st = views[i]
            view, data = order.view(st, s.heads_per_group), t.ptr + off * t.itemsize
        fields += [weight, partials[i] if partials else 0, data, *view,
                   shape.blocks[i], shape.units[i], _weight_len(call, spec.scope, i)]
    return _NORM.pack(*fields, float(eps), 0.0)


def _weight_len(call: Call, scope: str, i: int) -> int:
    """Channels of slab i's weight: head_dim, or heads * head_dim (scope "token")."""
    return call.head_dim * (call.slabs[i].heads if scope == "token" else 1)


class Plan(NamedTuple):
    """What a call signature needs, computed once (see :func:`plan`)."""

    spec: "NormSpec | NormFlatSpec"
    shape: _Shape
    fixed: bytes  # the fixed part of rope::Params, or of rope::FlatParams (NormFlatSpec)
    tail: bytes = b""  # after the norm's part: NormFlatSpec's rope::FlatGap per slab


_plans: dict = {}
_MAX_PLANS = 512


def _tensor_key(t, offset: int = 0):
    """What a plan depends on of one array: geometry, dtype, device and
    16-byte alignment (not the pointer itself)."""
    if t is None:
        return None
    return (t.shape, t.strides, t.dtype, t.device, (t.ptr + offset * t.itemsize) % 16)


def _signature(call: Call, weights, inputs, norm: NormOptions, backward: bool,
               weight_grad: bool) -> tuple:
    slabs = tuple((s.name, _tensor_key(s.x, s.x_offset), s.x_strides,
                   _tensor_key(s.out, s.out_offset), s.out_strides, s.heads, s.heads_per_group,
                   s.rotate) for s in call.slabs)
    tables = tuple(_tensor_key(t, o) for t, o in zip(call.tables, call.table_offsets))
    rest = (call.layout, call.batch, call.seqlen, call.head_dim, call.rotary_dim,
            call.interleaved, call.backward, call.inplace, call.source, call.max_position,
            call.pos_mode, _tensor_key(call.positions), _tensor_key(call.offsets),
            _tensor_key(call.cu_seqlens), call.n_seqs, call.cp_size, call.cp_rank,
            tuple(call.sections), call.sections_interleaved)
    w = None if weights is None else tuple(_tensor_key(t) for t in weights)
    ins = None if inputs is None else tuple(
        (_tensor_key(t, off), st) for t, off, st in _input_views(call, inputs))
    return (slabs, tables, rest, w, ins, norm.scope, norm.weight_mode, norm.rounding, backward,
            weight_grad)


def plan(call: Call, weights, norm: NormOptions, backward: bool = False,
         weight_grad: bool = False, inputs=None) -> Plan:
    """The spec, launch shape and fixed parameters of a call, cached by its
    signature (shapes, strides, dtypes, alignment, options), so that a
    repeated call only packs its pointers."""
    key = _signature(call, weights, inputs, norm, backward, weight_grad)
    found = _plans.get(key)
    if found is not None:
        return found
    spec = choose_spec(call, norm, weights, backward, weight_grad, inputs)
    layout = _flat_layout(call) if isinstance(spec, NormFlatSpec) else None
    shape = launch_shape(call, spec, launch._sm_count(call.device[1]), layout)
    if layout is not None:
        found = Plan(spec, shape, launch.flat_fixed_params(call, shape.slab_blocks,
                                                           layout.geometry), _flat_gaps(layout))
    else:
        found = Plan(spec, shape, launch.fixed_params(call, shape.slab_blocks))
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = found
    return found


def _params(call: Call, plan_: Plan, weights, inputs, partials, eps: float) -> bytes:
    """The whole parameter block (rope::NormParams, or rope::NormFlatParams)
    of one launch."""
    return (launch._DYNAMIC.pack(*_dynamic(call)) + plan_.fixed
            + _norm_fields(call, plan_.spec, plan_.shape, weights, inputs, partials, eps)
            + plan_.tail)


# --------------------------------------------------------------- launch --
def _launch(kernel_spec, device_id: int, stream: int, grid, block, params: bytes) -> None:
    """Launch one kernel with its by-value parameter block on ``stream``."""
    import cupy
    from cupy.cuda import driver

    buf = ctypes.create_string_buffer(params, len(params))
    args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    with cupy.cuda.Device(device_id):
        kernel = get_kernel(kernel_spec, device_id)
        driver.launchKernel(kernel.ptr, *grid, *block, 0, stream, ctypes.addressof(args), 0)


def _weights(weights):
    """(q_weight, k_weight) descriptions, or None without weights (given
    as None or as a pair of None)."""
    if weights is None or all(w is None for w in weights):
        return None
    return tuple(weights)


def _weight_dtype(weights) -> Optional[str]:
    if weights is None:
        return None
    if weights[0].dtype != weights[1].dtype:
        raise TypeError(f"k_weight: expected dtype {weights[0].dtype} (that of q_weight), "
                        f"got {weights[1].dtype}")
    return weights[0].dtype


def _empty(call: Call) -> bool:
    return call.tokens == 0 or call.heads == 0


def forward(call: Call, arrays, weights, norm: NormOptions) -> None:
    """Normalize and rotate q and k of ``call`` into its outputs: one launch
    on the current stream of the framework of q.

    ``arrays`` (the caller's arrays) is not needed by this launcher, which
    takes every pointer from the call's descriptions; ``weights``: (q_weight,
    k_weight) descriptions, or None for weight_mode "none".
    """
    if _empty(call):
        return
    dev = call.device[1]
    weights = _weights(weights)
    p = plan(call, weights, norm)
    params = _params(call, p, weights, None, None, norm.eps)
    _launch(p.spec, dev, interop.stream_for(call.x), p.shape.grid, p.shape.block, params)


def backward(call: Call, arrays, inputs, weights, weight_grads, norm: NormOptions) -> None:
    """Gradients of q, k (into the call's outputs) and, with
    ``weight_grads``, of both weights, on the current stream of the
    framework of the gradients.

    ``call``: op "qk" over (grad_q, grad_k), backward; ``inputs``: the
    forward's (q, k) descriptions. The weight gradients are summed over
    every row (scope "head": every token and head) in a fixed order.
    """
    dev = call.device[1]
    stream = interop.stream_for(call.x)
    weights = _weights(weights)
    wgrad = bool(weight_grads) and weights is not None and norm.weight_mode != "none"
    wdtype = _weight_dtype(weights)
    if _empty(call):
        if wgrad:
            _reduce(call, None, [0] * len(call.slabs), weight_grads, wdtype, stream, dev, norm)
        return
    p = plan(call, weights, norm, True, wgrad, inputs)
    workspace, partials = None, None
    if wgrad:
        lens = [_weight_len(call, norm.scope, i) for i in range(len(call.slabs))]
        sizes = [b * n for b, n in zip(p.shape.blocks, lens)]
        workspace = _float32_workspace(call.x, sum(sizes))
        base = interop.data_ptr(workspace)
        partials = [base + 4 * sum(sizes[:i]) for i in range(len(sizes))]
    params = _params(call, p, weights, inputs, partials, norm.eps)
    _launch(p.spec, dev, stream, p.shape.grid, p.shape.block, params)
    if wgrad:
        _reduce(call, partials, p.shape.blocks, weight_grads, wdtype, stream, dev, norm)
    # The workspace goes back to the framework's stream-ordered allocator
    # here, after both launches were queued on `stream`.
    del workspace


def _reduce(call: Call, partials, blocks, weight_grads, wdtype, stream, dev, norm) -> None:
    """weight_grad_reduce: each slab's weight gradient from its partial rows
    (no rows: zeros)."""
    n = len(call.slabs)
    lens = [_weight_len(call, norm.scope, i) for i in range(n)]
    pad = [0] * (launch.MAX_SLABS - n)
    fields = ([*(partials or [0] * n), *pad] + [g.ptr for g in weight_grads] + pad
              + list(blocks) + pad + lens + pad)
    cols = -(-max(lens) // REDUCE_COLS)
    if cols:
        _launch(ReduceSpec(wdtype), dev, stream, (cols, n, 1), (REDUCE_COLS, REDUCE_ROWS, 1),
                _REDUCE.pack(*fields))


def _float32_workspace(like, size: int):
    """A float32 array of ``size`` elements from the allocator of ``like``'s
    framework (torch or CuPy), on its device."""
    if like.kind == "torch":
        import torch

        return torch.empty(max(size, 1), dtype=torch.float32, device=like.obj.device)
    import cupy

    with cupy.cuda.Device(like.device[1]):
        return cupy.empty(max(size, 1), dtype=cupy.float32)


# --------------------------------------------------------- prepared calls --
# qk_norm keeps one Prepared per call signature it has seen: the parameter
# blocks built once, with the places of their per-call pointers, so that a
# repeated call only packs its pointers and launches (as launch.Plan does for
# the rotation).
_Q = struct.Struct("<Q")
_NORM_SLAB_SIZE = struct.calcsize("<" + _NORM_SLAB)


class Prepared:
    """The launches of one call signature, their parameters computed once.

    Built by :func:`prepare`; :meth:`launch` takes the call's array
    pointers (``ptrs[i]`` of array i of the list it was prepared with) and
    the scalar position offset. ``policy`` is the :data:`POLICY` it was
    planned under (a cache drops it when that changes).
    """

    __slots__ = ("policy", "device_id", "kernel", "dims", "buf", "pack", "reduce_kernel",
                 "reduce_dims", "reduce_buf", "pack_reduce", "workspace", "stream", "buffers")

    def own_buffers(self):
        """The calling thread's (params, args address, reduce params, reduce
        args address, keep-alive), made on its first launch: the driver reads
        the parameters during the launch call, which releases the GIL, so
        threads must not share them (as launch.Plan.own_buffer)."""
        entry = self.buffers.get(threading.get_ident())
        if entry is None:
            made = []
            for block in (self.buf, self.reduce_buf):
                buf = ctypes.create_string_buffer(block, max(len(block), 1))
                args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
                made += [buf, ctypes.addressof(args), args]
            entry = self.buffers[threading.get_ident()] = tuple(made)
        return entry

    def launch(self, ptrs, offset: int) -> None:
        """Pack ``ptrs`` and ``offset`` into this thread's parameters and
        launch on the current stream of the call's framework."""
        buf, args, _, rbuf, rargs, _ = self.own_buffers()
        dev = self.device_id
        stream = self.stream(dev)
        workspace, base = self.workspace() if self.workspace is not None else (None, 0)
        if self.kernel is not None:
            self.pack(buf, ptrs, offset, base)
            _raw_launch(self.kernel, self.dims, stream, args, dev)
        if self.reduce_kernel is not None:
            self.pack_reduce(rbuf, ptrs, base)
            _raw_launch(self.reduce_kernel, self.reduce_dims, stream, rargs, dev)
        # The workspace goes back to the framework's stream-ordered allocator
        # here, after both launches were queued on the stream.
        del workspace


def _raw_launch(kernel: int, dims: tuple, stream: int, args: int, dev: int) -> None:
    """launchKernel with a prepared argument array; makes ``dev`` current
    first where another device is, or the thread has no CUDA context yet."""
    if launch._get_device() == dev:
        try:
            launch._launch_kernel(kernel, *dims, 0, stream, args, 0)
            return
        except Exception as exc:  # a thread without a CUDA context yet
            if "INVALID_CONTEXT" not in str(exc):
                raise
    import cupy

    with cupy.cuda.Device(dev):
        cupy.cuda.runtime.setDevice(dev)
        launch._launch_kernel(kernel, *dims, 0, stream, args, 0)


def _slot_of(arrays, ptrs):
    """A function (description, byte offset) -> the text of that pointer in
    a packer taking the array pointers as ``p`` ("0" without an array)."""
    def slot(t, byte_offset=0) -> str:
        if t is None:
            return "0"
        for i, a in enumerate(arrays):
            if a is t.obj:
                off = int(t.ptr - ptrs[i] + byte_offset)
                return f"(p[{i}] + {off})" if off else f"p[{i}]"
        raise KeyError("an array of the call is not in its array list")
    return slot


def _packer(params: str, lines: list):
    """Compile straight-line packing code (integers, indices and the
    packers' names only): it runs on every cached call."""
    src = f"def pack({params}):\n" + "".join(f"    {line}\n" for line in lines)
    env = {"pack_dynamic": launch._pack_dynamic, "pack_q": _Q.pack_into,
           "pack_reduce": _REDUCE.pack_into}
    exec(src, env)  # noqa: S102
    return env["pack"]


def _workspace_maker(like, size: int):
    """A function () -> (float32 array of ``size`` elements on ``like``'s
    device from its framework's allocator, its pointer)."""
    n = max(size, 1)
    if like.kind == "torch":
        import torch

        device = like.obj.device

        def make():
            w = torch.empty(n, dtype=torch.float32, device=device)
            return w, w.data_ptr()
        return make
    import cupy

    dev = like.device[1]

    def make():
        with cupy.cuda.Device(dev):
            w = cupy.empty(n, dtype=cupy.float32)
        return w, w.data.ptr
    return make


def prepare(call: Call, arrays, ptrs, weights, norm: NormOptions, inputs=None,
            weight_grads=(), backward: bool = False) -> Prepared:
    """The launches of ``call`` (what :func:`forward`, or with ``backward``
    :func:`backward`, would launch) with their parameters built once.

    ``arrays``: every array of the call (the caller's and those allocated
    for it), which the descriptions' ``obj`` name; ``ptrs``: their data
    pointers (0 where absent). The prepared launch takes such a pointer
    list of a later call of the same signature.
    """
    p = Prepared()
    p.policy, p.device_id, p.buffers = POLICY, call.device[1], {}
    p.stream = (interop.torch_stream_getter() if call.x.kind == "torch"
                else interop.cupy_stream_getter())
    weights = _weights(weights)
    inputs = inputs if backward else None
    wgrad = (backward and bool(weight_grads) and weights is not None
             and norm.weight_mode != "none")
    slot = _slot_of(arrays, ptrs)
    n = len(call.slabs)
    p.kernel = p.workspace = p.reduce_kernel = None
    p.buf = p.reduce_buf = b""
    blocks, partials = [0] * n, ["0"] * n
    if not _empty(call):
        pl = plan(call, weights, norm, backward, wgrad, inputs)
        p.kernel = get_kernel(pl.spec, p.device_id).ptr
        p.dims = (*pl.shape.grid, *pl.shape.block)
        p.buf = _params(call, pl, weights, inputs, None, norm.eps)
        blocks = list(pl.shape.blocks)
        if wgrad:
            lens = [_weight_len(call, norm.scope, i) for i in range(n)]
            sizes = [b * m for b, m in zip(blocks, lens)]
            p.workspace = _workspace_maker(call.x, sum(sizes))
            partials = [f"(w + {4 * sum(sizes[:i])})" for i in range(n)]
        p.pack = _packer("buf, p, offset, w",
                         [_dynamic_line(call, slot)]
                         + _norm_lines(call, len(pl.fixed), weights, inputs, partials, slot))
    if wgrad:
        _prepare_reduce(p, call, norm, weights, weight_grads, blocks, partials, slot)
    return p


def _dynamic_line(call: Call, slot) -> str:
    """pack_dynamic of rope::CallData (as :func:`_dynamic`), pointers from ``p``."""
    slabs = list(call.slabs) + [None] * (launch.MAX_SLABS - len(call.slabs))
    t0, t1 = call.tables[0], call.tables[-1]
    vals = ([slot(s.x, s.x_offset * s.x.itemsize) if s else "0" for s in slabs]
            + [slot(s.out, s.out_offset * s.out.itemsize) if s else "0" for s in slabs]
            + [slot(t0, call.table_offsets[0] * t0.itemsize),
               slot(t1, call.table_offsets[-1] * t1.itemsize),
               slot(call.positions), slot(call.offsets), slot(call.cu_seqlens), "offset"])
    return f"pack_dynamic(buf, 0, {', '.join(vals)})"


def _norm_lines(call: Call, fixed_size: int, weights, inputs, partials, slot) -> list:
    """pack_q of each rope::NormSlab's pointers (weight, partial sums, the
    backward's forward input), as :func:`_norm_fields` lays them out; none
    for a pointer that is always 0 (the block built once holds those)."""
    views = _input_views(call, inputs) if inputs is not None else None
    lines = []
    for i in range(len(call.slabs)):
        at = launch._DYNAMIC.size + fixed_size + i * _NORM_SLAB_SIZE
        w = weights[i] if weights is not None and i < len(weights) else None
        data = "0"
        if views is not None:
            t, off, _ = views[i]
            data = slot(t, off * t.itemsize)
        for k, val in enumerate((slot(w), partials[i], data)):
            if val != "0":
                lines.append(f"pack_q(buf, {at + 8 * k}, {val})")
    return lines


def _prepare_reduce(p: Prepared, call: Call, norm, weights, weight_grads, blocks, partials,
                    slot) -> None:
    """weight_grad_reduce's kernel, grid and packer (as :func:`_reduce`)."""
    n = len(call.slabs)
    lens = [_weight_len(call, norm.scope, i) for i in range(n)]
    cols = -(-max(lens) // REDUCE_COLS)
    if not cols:
        return
    pad = ["0"] * (launch.MAX_SLABS - n)
    vals = ([*partials, *pad] + [slot(g) for g in weight_grads] + pad
            + [str(int(b)) for b in blocks] + pad + [str(int(m)) for m in lens] + pad)
    p.reduce_kernel = get_kernel(ReduceSpec(_weight_dtype(weights)), p.device_id).ptr
    p.reduce_dims = (cols, n, 1, REDUCE_COLS, REDUCE_ROWS, 1)
    p.reduce_buf = bytes(_REDUCE.size)
    p.pack_reduce = _packer("buf, p, w",
                            [f"pack_reduce(buf, 0, {', '.join(vals)})"])

# ------------------------------------------------------------- catalogue --
SHIPPED_HEAD_DIMS = (64, 80, 128, 256)
LARGE_TOKENS = 8192  # 4 q heads: above NormPolicy.few_rows


def _shipped_call(tensor, dtype, d, r, interleaved, inplace, pos_mode, source, s=16,
                  heads=(4, 2)):
    """A shape-only qk call (q and k ``heads`` heads, ``s`` tokens, thd)."""
    from .validate import check_call

    kw = {}
    if source == "inv_freq":
        kw["inv_freq"] = tensor((r // 2,), "float32")
    else:
        kw["cos"], kw["sin"] = tensor((s, r // 2), "float32"), tensor((s, r // 2), "float32")
    if pos_mode == "explicit":
        kw["positions"] = tensor((s,), "int32")
    elif pos_mode == "varlen":
        kw["cu_seqlens"] = tensor((3,), "int32")
    elif pos_mode == "axes":
        kw["positions"] = tensor((3, s), "int32")
        kw["sections"] = (r // 2 - 2, 1, 1)
    (hq, hk) = heads
    q, k = tensor((s, hq, d), dtype), tensor((s, hk, d), dtype)
    outs = {} if inplace else dict(out=tensor((s, hq, d), dtype), out_k=tensor((s, hk, d), dtype))
    return check_call(q, k=k, layout="thd", interleaved=interleaved, inplace=inplace, **outs,
                      **kw)


def _packed_call(tensor, dtype, d, interleaved, pos_mode, s=16):
    """A shape-only in-place call on the q (4 heads) and k (2 heads) of a
    packed projection [s, (4 + 2 * 2) * d], cos/sin tables (the serving form)."""
    from .validate import check_call

    row = 8 * d
    packed = tensor((s, row), dtype)
    q = packed._replace(shape=(s, 4, d), strides=(row, d, 1))
    k = packed._replace(shape=(s, 2, d), strides=(row, d, 1),
                        ptr=packed.ptr + 4 * d * packed.itemsize)
    kw = dict(positions=tensor((s,), "int32")) if pos_mode == "explicit" else {}
    return check_call(q, k=k, layout="thd", interleaved=interleaved, inplace=True,
                      cos=tensor((s, d // 2), "float32"), sin=tensor((s, d // 2), "float32"),
                      **kw)


def shipped_specs() -> list:
    """The specializations the CPU compile test builds: dtype x head_dim
    {64, 80, 128, 256} x full / half rotary x NeoX / GPT-J x scope x
    (weight w rounded before, 1 + w rounded after, no weight), forward for
    decode-sized and large calls (scope "head" also in place on a packed
    projection), backward with and without weight gradients (scope "token"
    also with as many k heads as q heads); plus each
    position rule and computed angles for head_dim 128. (In place and out
    of place share their kernels.)"""
    import itertools

    tensor = launch._FakeArrays()
    modes = [("w", "before_weight"), ("1+w", "after_weight"), ("none", "before_weight")]
    specs = set()
    grid = itertools.product(("float32", "float16", "bfloat16"), SHIPPED_HEAD_DIMS, (1, 2),
                             (False, True), ("head", "token"), modes)
    for dtype, d, frac, interleaved, scope, (wm, rounding) in grid:
        r = d // frac
        norm = NormOptions(scope, wm, rounding)
        extra = [("implied", "table")]
        if d == 128:
            extra += [("explicit", "table"), ("varlen", "table"), ("axes", "table"),
                      ("implied", "inv_freq")]
        n = d * (4 if scope == "token" else 1)
        weights = (tensor((n,), dtype), tensor((n,), dtype))
        for pos_mode, source in extra:
            for tokens in (16, LARGE_TOKENS):  # decode-sized and large forward calls
                call = _shipped_call(tensor, dtype, d, r, interleaved, False, pos_mode, source,
                                     tokens)
                specs.add(choose_spec(call, norm, weights))
            for h in ((8, 6) if scope == "token" and pos_mode == "implied" else ()):
                # as many q as k heads: flat too (8: rows grouped a thread, 6: one)
                even = _shipped_call(tensor, dtype, d, r, interleaved, False, pos_mode, source,
                                     LARGE_TOKENS, (h, h))
                even_w = (tensor((h * d,), dtype),) * 2
                specs.add(choose_spec(even, norm, even_w))
                for wgrad in (False, True):
                    specs.add(choose_spec(even, norm, even_w, True, wgrad,
                                          [s.x for s in even.slabs]))
            if scope == "head" and frac == 1 and pos_mode in ("implied", "explicit"):
                specs.add(choose_spec(_packed_call(tensor, dtype, d, interleaved, pos_mode),
                                      norm, weights))
                # 4 rows a thread (q 16, k 8 heads); float32 weights with 16-bit x
                wide = _shipped_call(tensor, dtype, d, r, interleaved, False, pos_mode, source,
                                     LARGE_TOKENS, (16, 8))
                wide_in = [s.x for s in wide.slabs]
                f32 = (tensor((d,), "float32"),) * 2 if wm != "none" else weights
                for w in {weights, f32}:
                    specs.add(choose_spec(wide, norm, w))
                    specs.add(choose_spec(wide, norm, w, True, True, wide_in))
            inputs = [s.x for s in call.slabs]
            for wgrad in (False, True):
                specs.add(choose_spec(call, norm, weights, True, wgrad, inputs))
    return sorted(specs, key=repr) + [ReduceSpec(t) for t in ("float32", "float16", "bfloat16")]
