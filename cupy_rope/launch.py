"""Launch policy and launch plans.

From a validated :class:`~cupy_rope.validate.Call` this module derives the
kernel :class:`~cupy_rope.specialize.Spec` (which kernel, and the vector
widths it can prove aligned), the grid/block shape, and the parameter struct
of ``kernels/params.cuh``. A :class:`Plan` holds all of that for one call
signature (shapes, strides, dtypes, pointer alignment, options), so a
repeated call only rewrites the data pointers and launches. This is the only
place that knows how work is spread over threads.

The three kernels (``Spec.mapping``, docs/architecture.md):

- ``"rope"``: ``rope_kernel`` (kernels/rope.cu), a thread walks several
  heads; any rotary_dim, layout, position rule and angle source.
- ``"packet"``: ``packet_kernel`` (kernels/packet.cu), a thread rotates one
  unit of one or two 16-byte packets; full rotary on aligned views.
- ``"flat"``: ``flat_kernel`` (kernels/flat.cu), one 16-byte packet per
  thread over dense slabs walked in memory order, cos/sin tables.

The tuned thresholds behind these choices are :data:`POLICY`; the numbers
that set them are in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import itertools
import operator
import struct
import threading
from typing import NamedTuple, Optional

from . import interop
from .specialize import ITEMSIZE, KERNELS, Spec, get_kernel
from .validate import AXES, EXPLICIT, IMPLIED, VARLEN, Call, disjoint_at, lattice, rel_span

# Hardware and kernel ABI limits (not tunable).
MAX_VECTOR_BYTES = 16  # widest single global load/store
THREADS_PER_BLOCK = 256  # rope_kernel's launch bounds (kernels/rope.cu MAX_THREADS)
MAX_BLOCK_Z = 64  # CUDA's limit on blockDim.z
PACKET_THREADS = 256  # packet_kernel's launch bounds (kernels/packet.cu PACKET_THREADS)
FLAT_THREADS = 128  # flat_kernel's launch bounds and warp indexing (kernels/flat.cu)
MAX_PACKET_UNITS = 1 << 31  # packet_kernel and flat_kernel index a slab's units in 32 bits
MAX_SLABS = 3  # q, k, v (kernels/params.cuh MAX_SLABS)
MAX_HEADS = 1 << 30  # heads per token (kernels/rope.cu indexes heads in 32 bits)


@dataclasses.dataclass(frozen=True)
class LaunchPolicy:
    """The tuned thresholds of the launch decisions.

    One frozen object, :data:`POLICY`; tests change it only through
    :func:`override_policy`. docs/performance.md ("Launch policy") gives the
    measurements behind each value.
    """

    #: Kernels :func:`choose_spec` may pick, fastest first; rope_kernel takes
    #: every call, so it is always allowed (tests narrow this to compare kernels).
    kernels: tuple = ("flat", "packet", "rope")
    #: rope_kernel: heads a thread loads before its first store (a pass).
    unroll: int = 4
    #: Blocks per SM a grid aims for before heads are split into groups (decode).
    blocks_per_sm: int = 8
    #: Most head lanes per block; fewer lanes leave room for more tokens.
    max_head_lanes: int = 32
    #: Block size when a thread has less than one full pass of heads, or with
    #: cu_seqlens: smaller blocks fit more per SM.
    small_block_threads: int = 128
    #: cu_seqlens: token lanes per block, so one sequence search serves several tokens.
    varlen_tokens: int = 4
    #: cu_seqlens: above this many sequences (a search of three steps) angles
    #: computed in the kernel may take varlen_computed_tokens a block
    #: (also kernels/rope.cu SEARCH_PREFETCH_MIN_SEQS).
    varlen_few_seqs: int = 1024
    #: cu_seqlens with computed angles and many sequences: token lanes per
    #: block where varlen_tokens would cut a thread's heads per angle.
    varlen_computed_tokens: int = 8
    #: Heads per token from which computed angles (inv_freq, freqs) stay on
    #: rope_kernel, whose thread shares them across its heads.
    computed_angles_heads: int = 16
    #: Rows (tokens x heads) from which explicit positions stay on rope_kernel,
    #: whose thread has several heads' loads in flight while it waits.
    explicit_packet_rows: int = 1 << 18
    #: flat_kernel NeoX: rows that leave more idle lanes per warp than this
    #: load their rotation partner themselves (out of place only).
    flat_max_idle_lanes: int = 2
    #: flat_kernel with explicit positions: the most bytes of table rows they
    #: can reach, so that the rows stay in cache.
    flat_table_bytes: int = 4 << 20
    #: flat_kernel, implied positions: from this many bytes of x on, ask for
    #: table rows early even where the kernel would ask late.
    flat_early_tables_bytes: int = 512 << 20


#: The launch policy in force (replaced only by :func:`override_policy`).
POLICY = LaunchPolicy()


@contextlib.contextmanager
def override_policy(**fields):
    """Run a block under a launch policy with some fields changed.

    Clears the cached plans on entry and exit (``cupy_rope.api.clear_plans``),
    so that calls inside the block are planned under the new policy and calls
    after it under the restored one. A RotaryEmbedding keeps the ``qk_``
    launchers it made before: build it inside the block. Not thread-safe: for
    tests and tools.

    Parameters
    ----------
    **fields
        :class:`LaunchPolicy` field names and their values for the block.

    Returns
    -------
    contextlib.AbstractContextManager
        Yields the policy in force inside the block.

    Raises
    ------
    TypeError
        A name that is not a :class:`LaunchPolicy` field.
    ValueError
        ``kernels`` naming a kernel other than "flat", "packet" or "rope".

    Example
    -------
    >>> with override_policy(kernels=("rope",)):  # doctest: +SKIP
    ...     apply_rope(x, cos, sin)  # planned with rope_kernel only
    """
    global POLICY
    if "kernels" in fields and not set(fields["kernels"]) <= set(KERNELS):
        raise ValueError(f"kernels: expected names from {KERNELS}, got {fields['kernels']!r}")
    saved = POLICY
    POLICY = dataclasses.replace(saved, **fields)
    _clear_plans()
    try:
        yield POLICY
    finally:
        POLICY = saved
        _clear_plans()


def _clear_plans() -> None:
    from . import api

    api.clear_plans()


# The fields of rope::Params, in order: (name, struct code). Every field is 8
# bytes; "f" pairs with the padding float (in FlatParams: "f" sin_sign and
# "I" zero). The leading block (rope::CallData, which FlatParams starts with
# too) changes per call.
DYNAMIC_FIELDS = (
    [(f"x_data[{i}]", "Q") for i in range(MAX_SLABS)]
    + [(f"out_data[{i}]", "Q") for i in range(MAX_SLABS)]
    + [("cos", "Q"), ("sin", "Q"), ("positions", "Q"), ("offsets", "Q"), ("cu_seqlens", "Q"),
       ("offset", "q")])
_VIEW = ("stride_outer", "stride_inner", "stride_group", "stride_head", "stride_dim")
_SLAB = ([f"x.{f}" for f in _VIEW] + [f"out.{f}" for f in _VIEW]
         + ["block_begin", "token_blocks", "head_lanes", "heads_per_block", "n_heads",
            "heads_per_group", "rotate", "head_mul", "head_shift", "head_major"])
FIXED_FIELDS = (
    [(f"slab[{i}].{f}", "q") for i in range(MAX_SLABS) for f in _SLAB]
    + [(n, "q") for n in (
        "n_slabs", "cos_stride_row", "sin_stride_row", "cos_stride_col", "sin_stride_col",
        "max_position", "pos_stride_outer", "pos_stride_inner", "pos_is_64",
        "off_stride_outer", "off_stride_inner", "off_is_64", "seq_stride_outer",
        "seq_stride_inner", "pos_stride_axis", "n_axes", "section[0]", "section[1]",
        "section[2]", "sections_interleaved", "n_seqs", "cp_size", "cp_rank", "cp_chunk", "n_outer",
        "n_inner", "inner_mul", "inner_shift")]
    + [("sin_sign", "f"), ("pad_", "f")])
PARAM_FIELDS = tuple(DYNAMIC_FIELDS) + tuple(FIXED_FIELDS)
_DYNAMIC = struct.Struct("<" + "".join(c for _, c in DYNAMIC_FIELDS))
_pack_dynamic = _DYNAMIC.pack_into
_FIXED = struct.Struct("<" + "".join(c for _, c in FIXED_FIELDS))
PARAMS_SIZE = _DYNAMIC.size + _FIXED.size

# rope::FlatParams (flat_kernel): the same per-call block, then only the
# fields flat_kernel reads (a smaller block is cheaper to launch).
_FLAT_SLAB = ("block_begin", "rows", "step_mul", "step_shift", "seq_len", "seq_mul",
              "seq_shift")
FLAT_FIXED_FIELDS = (
    [(f"slab[{i}].{f}", "q") for i in range(MAX_SLABS) for f in _FLAT_SLAB]
    + [(n, "q") for n in ("n_slabs", "cos_stride_row", "sin_stride_row", "max_position",
                          "pos_stride", "pos_is_64")]
    + [("sin_sign", "f"), ("zero", "I")])
FLAT_PARAM_FIELDS = tuple(DYNAMIC_FIELDS) + tuple(FLAT_FIXED_FIELDS)
_FLAT_FIXED = struct.Struct("<" + "".join(c for _, c in FLAT_FIXED_FIELDS))
FLAT_PARAMS_SIZE = _DYNAMIC.size + _FLAT_FIXED.size


# ---------------------------------------------------------- vector widths --
def _aligned(elems: int, ptr: int, itemsize: int, strides) -> bool:
    """Can memory at ``ptr`` be read in packets of ``elems`` elements at these strides?"""
    return (ptr % min(elems * itemsize, MAX_VECTOR_BYTES) == 0
            and all(st % elems == 0 for st in strides))


def _widest(candidates, ok) -> int:
    for w in candidates:
        if ok(w):
            return w
    return 0


def _moving_views(call: Call):
    """(pointer, itemsize, strides that vary, dim stride) of every slab input and output."""
    sizes = (call.batch, call.seqlen)
    views = []
    for s in call.slabs:
        groups = s.heads // s.heads_per_group if s.heads else 0
        extents = (sizes[0], sizes[1], groups, s.heads_per_group)
        for t, off, st in ((s.x, s.x_offset, s.x_strides), (s.out, s.out_offset, s.out_strides)):
            if t is not None:
                b, sq, g, h, d = st
                st = (b, sq, g or s.heads_per_group * h, h, d)  # as the kernel steps groups
                varying = tuple(v for v, n in zip(st[:4], extents) if n > 1)
                views.append((t.ptr + off * t.itemsize, t.itemsize, varying, st[4]))
    return list(dict.fromkeys(views))


def _tables_aligned(call: Call, freqs: int) -> bool:
    """Can every table row be read in runs of ``freqs`` frequencies?"""
    row_strides = [t.strides[0] for t in call.tables if t.ndim == 2 and t.shape[0] > 1]
    return all(_aligned(freqs, t.ptr + off * t.itemsize, t.itemsize, row_strides)
               for t, off in zip(call.tables, call.table_offsets))


class _Widths(NamedTuple):
    """The vector accesses every view of a call allows."""

    pairs: int  # channel pairs per item (a packet's width)
    strided: bool  # x or out read element by element
    table_strided: bool  # tables read element by element
    copy_tail: bool  # out of place, partial rotary: channels [rotary_dim, head_dim) copied
    tail_vec: int  # channels per tail-copy item


def _vector_widths(call: Call) -> _Widths:
    """The widest packets that every slab view (and table) is aligned for."""
    d, r = call.head_dim, call.rotary_dim
    half = r // 2
    views = _moving_views(call)
    strided = any(sd != 1 for *_, sd in views)
    widths = [w for w in (16, 8, 4, 2, 1) if w <= MAX_VECTOR_BYTES // views[0][1]]

    def x_ok(elems):
        return all(_aligned(elems, ptr, it, varying) for ptr, it, varying, _ in views)

    if strided:
        pairs = 1
    elif call.interleaved:  # one packet of 2 * pairs channels
        pairs = max(1, _widest([w for w in widths if w >= 2],
                               lambda w: half % (w // 2) == 0 and x_ok(w)) // 2)
        strided = not x_ok(2)
    else:  # two packets of `pairs` channels, half apart
        pairs = _widest(widths, lambda w: half % w == 0 and x_ok(w))  # 1 always fits
    # AXES reads tables element by element (neighbouring pairs may use other axes).
    table_strided = (strided or call.pos_mode == AXES
                     or any(t.strides[-1] != 1 for t in call.tables)
                     or not _tables_aligned(call, pairs))
    copy_tail = not call.inplace and r < d
    tail_vec = 1
    if copy_tail and not strided:
        tail_vec = _widest(widths, lambda w: (d - r) % w == 0 and r % w == 0 and x_ok(w)) or 1
    return _Widths(pairs, strided, table_strided, copy_tail, tail_vec)


# ---------------------------------------------------------- kernel choice --
def _max_heads(call: Call) -> int:
    """The most heads per token of any slab; raises beyond :data:`MAX_HEADS`."""
    max_heads = max(sl.heads for sl in call.slabs)
    if max_heads >= MAX_HEADS:
        name = next(sl.name for sl in call.slabs if sl.heads == max_heads)
        raise ValueError(f"{name}: {max_heads} heads per token; at most {MAX_HEADS - 1} are "
                         "supported (the kernel counts heads in 32 bits)")
    return max_heads


def _rope_spec(call: Call) -> Spec:
    """rope_kernel's spec for ``call``, the kernel that takes every call.

    One head per thread (unroll 1) where a token has fewer heads than a pass:
    the one-head kernel needs far fewer registers. Also for partial rotary in
    place, where a warp then stays on consecutive heads of one token (not for
    per-axis positions, whose one-head kernels would spill).
    """
    w = _vector_widths(call)
    unroll = POLICY.unroll
    partial_in_place = (call.inplace and call.rotary_dim < call.head_dim
                        and call.pos_mode != AXES)
    if _max_heads(call) < unroll or partial_in_place:
        unroll = 1
    return Spec(call.dtype, call.tables[0].dtype, call.head_dim, call.rotary_dim,
                call.interleaved, call.source, w.pairs, w.tail_vec, w.strided, w.table_strided,
                w.copy_tail, unroll, call.pos_mode)


def _flat_spec(call: Call, spec: Spec) -> Optional[Spec]:
    """flat_kernel's spec for ``call`` where it takes the call, else None.

    flat_kernel needs 16-byte packets and whole rows per warp (NeoX rows
    that would idle too many lanes load their partner instead, out of place
    only), and the dense layout :func:`flat_geometry` checks. NeoX blocks
    whose rows lie at several positions split the table reads over the pair.
    """
    item = ITEMSIZE[spec.dtype]
    row_packets = spec.rotary_dim // spec.vec  # the rotated packets of a head row
    tiles = row_packets <= 32 and 32 % row_packets <= POLICY.flat_max_idle_lanes
    partner_load = not call.interleaved and not call.inplace and not tiles
    if (spec.strided or spec.table_strided or spec.head_dim % spec.vec
            or spec.vec * item != MAX_VECTOR_BYTES
            or not (call.interleaved or tiles or partner_load)):
        return None
    geometry = flat_geometry(call)
    if geometry is None:
        return None
    shuffle = not call.interleaved and not partner_load
    block_rows = FLAT_THREADS // 32 * (32 // row_packets) if shuffle else 0
    split = shuffle and any(0 < step < block_rows for _, step, _ in geometry)
    late = flat_late_tables(item, split, partner_load, call.interleaved, row_packets)
    if call.pos_mode == EXPLICIT and not (late and _flat_tables_small(call)):
        return None
    walked = sum(rows for rows, _, _ in geometry) * spec.rotary_dim * item  # bytes of x read
    early = call.pos_mode == IMPLIED and late and walked >= POLICY.flat_early_tables_bytes
    x_evict_last = (not call.inplace
                    and flat_x_evict_last_fits(item, spec.rotary_dim, spec.head_dim,
                                               partner_load)
                    and all(seq == 0 for _, _, seq in geometry))
    return dataclasses.replace(spec, unroll=1, mapping="flat", split_angles=split,
                               partner_load=partner_load, slabs=len(call.slabs),
                               early_tables=early, x_evict_last=x_evict_last)


def _flat_tables_small(call: Call) -> bool:
    """Explicit positions: do the table rows they can reach fit the policy's
    bytes (counted from tokens, as the host cannot see device positions)?"""
    reachable = min(call.positions.shape[-1], call.max_position)
    row_bytes = sum(t.itemsize for t in call.tables) * (call.rotary_dim // 2)
    return reachable * row_bytes <= POLICY.flat_table_bytes


def _packet_spec(call: Call, spec: Spec) -> Optional[Spec]:
    """packet_kernel's spec for ``call`` where it takes the call, else None.

    Full rotary on 16-byte packets with implied or explicit positions.
    rope_kernel keeps cu_seqlens (its blocks share one sequence search),
    computed angles for many heads (its thread shares them across heads) and
    explicit positions in large calls (its thread has other loads in flight
    while it waits for a position).
    """
    packet = dataclasses.replace(spec, unroll=1, mapping="packet")
    heads = max(sl.heads for sl in call.slabs)
    rows = call.tokens * heads
    units = packet.rot_items  # threads per head
    # NeoX packets tile each half by the choice of `pairs`; a GPT-J thread's
    # adjacent packets must tile the head.
    units_tile = (not call.interleaved
                  or call.head_dim % (packet.vec * packet.unit_packets) == 0)
    if not (call.rotary_dim == call.head_dim and not spec.strided
            and packet.vec * ITEMSIZE[spec.dtype] == MAX_VECTOR_BYTES and units_tile
            and 1 <= units and rows * units < MAX_PACKET_UNITS
            and call.pos_mode in (IMPLIED, EXPLICIT)):
        return None
    if call.source != "table" and heads >= POLICY.computed_angles_heads:
        return None
    if call.pos_mode == EXPLICIT and rows >= POLICY.explicit_packet_rows:
        return None
    # A GPT-J 16-bit unit reads more frequencies per row than rope_kernel's item.
    if not packet.table_strided and not _tables_aligned(call, packet.table_freqs):
        packet = dataclasses.replace(packet, table_strided=True)
    return packet


def choose_spec(call: Call, packets: bool = True, flat: bool = True) -> Spec:
    """The kernel instantiation for ``call`` (its outputs must be described).

    The fastest kernel of :attr:`LaunchPolicy.kernels` that takes the call:
    flat_kernel, then packet_kernel, then rope_kernel, which takes every call.

    Parameters
    ----------
    call : validate.Call
        The validated call.
    packets : bool
        False: rope_kernel's spec, also where another kernel would run.
    flat : bool
        False: packet_kernel's spec where flat_kernel would run.

    Returns
    -------
    Spec
        The kernel instantiation.

    Raises
    ------
    ValueError
        Too many heads per token, or a strided head too wide for one block.
    """
    spec = _rope_spec(call)
    allowed = POLICY.kernels
    if packets and flat and "flat" in allowed:
        chosen = _flat_spec(call, spec)
        if chosen is not None:
            return chosen
    if packets and "packet" in allowed:
        chosen = _packet_spec(call, spec)
        if chosen is not None:
            return chosen
    if spec.rot_items + spec.tail_items > THREADS_PER_BLOCK:
        d, r = call.head_dim, call.rotary_dim
        raise ValueError(f"x: head_dim {d} with rotary_dim {r} on a last axis with stride != 1 "
                         f"(or unaligned) needs {spec.rot_items + spec.tail_items} threads per "
                         f"head, more than {THREADS_PER_BLOCK}; pass a contiguous last axis")
    return spec


# ------------------------------------------------------------ grid shape --
@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def block_shape(items: int, slab_heads: tuple, tokens: int, unroll: int, sm_count: int,
                min_tokens: int = 1):
    """Grid, block and per-slab block layout for ``tokens`` x heads x ``items``.

    A block is items x head lanes x token lanes; each head lane takes
    ``unroll`` heads per pass. Head lanes are the power of two at or above
    heads / ``unroll``, so that a thread makes one pass over fewer heads
    rather than a full pass and a partial one. A slab with fewer heads uses
    fewer head lanes (``head_lanes``, a power of two dividing blockDim.y) and
    gives the other lanes further tokens, so its threads also load
    ``unroll`` heads at once. With few tokens (decode) a slab's heads are
    split into groups so that the grid still covers every SM several times.
    ``min_tokens`` > 1 (varlen: each block searches cu_seqlens once): at
    least that many token lanes per block where the heads allow, head lanes
    rounded down (a thread with a partial pass only leaves too few loads in
    flight to cover the search), and no more threads than those tokens need,
    but :attr:`LaunchPolicy.small_block_threads`.

    Returns (grid, block, slabs) with slabs[k] = (block_begin, token_blocks,
    head_lanes, heads_per_block).
    """
    policy = POLICY
    heads = max(slab_heads)
    lane_need = -(-heads // unroll)
    by = _pow2_ceil(lane_need) if min_tokens == 1 else _pow2_floor(lane_need)
    by = min(by, _pow2_floor(min(THREADS_PER_BLOCK // items, policy.max_head_lanes)))
    if min_tokens > 1:  # e.g. varlen: amortize the per-block sequence search
        by = min(by, _pow2_floor(THREADS_PER_BLOCK // (items * min_tokens)))
    threads = THREADS_PER_BLOCK
    if -(-heads // by) < unroll or min_tokens > 1:
        # Less than one full pass of heads per thread, or varlen: smaller
        # blocks, more of them per SM (still min_tokens token lanes).
        threads = min(THREADS_PER_BLOCK,
                      max(policy.small_block_threads, items * by * min_tokens))
    bz = max(1, min(threads // (items * by), MAX_BLOCK_Z))
    bz = min(bz, max(1, tokens))
    layout = []
    for h in slab_heads:
        lanes = min(by, 1 << (max(1, -(-h // unroll)) - 1).bit_length())
        token_blocks = -(-tokens // (bz * (by // lanes)))
        layout.append([h, lanes, token_blocks, -(-max(h, 1) // lanes)])  # head rows
    total = sum(tb for _, _, tb, _ in layout)
    target = policy.blocks_per_sm * sm_count
    groups = 1
    if total < target:  # few tokens: split heads into groups over more blocks
        groups = -(-target // max(total, 1))
    slabs, begin = [], 0
    for h, lanes, token_blocks, rows in layout:
        g = min(groups, rows)
        heads_per_block = lanes * -(-rows // g)
        n_groups = -(-h // heads_per_block) if h else 0
        slabs.append((begin, token_blocks, lanes, heads_per_block))
        begin += token_blocks * n_groups
    return (begin, 1, 1), (items, by, bz), slabs


def packet_shape(units_per_row: int, slab_heads: tuple, tokens: int):
    """Grid, block and per-slab block layout for packet_kernel: each slab's
    tokens x heads x units_per_row units, one per thread, in blocks of
    PACKET_THREADS; slabs[k] = (block_begin, 0, 0, 0)."""
    slabs, begin = [], 0
    for h in slab_heads:
        slabs.append((begin, 0, 0, 0))
        begin += -(-tokens * h * units_per_row // PACKET_THREADS)
    return (begin, 1, 1), (PACKET_THREADS, 1, 1), slabs


def flat_late_tables(itemsize: int, split: bool, partner_load: bool, interleaved: bool,
                     row_packets: int) -> bool:
    """Does flat_kernel ask for these rows' cos/sin once x has arrived
    (kernels/flat.cu LATE_TABLES, unless EARLY_TABLES)?"""
    return (itemsize == 2 and not split and not partner_load
            and (interleaved or 32 % row_packets == 0))


def flat_x_evict_last_fits(itemsize: int, rotary_dim: int, head_dim: int,
                           partner_load: bool) -> bool:
    """Can flat_kernel load x with an L2 evict-last policy (kernels/flat.cu
    X_EVICT_LAST) for rows like these: fp32, full rotary, no partner load?
    The call must also be out of place, its rows' positions never decreasing
    through memory (:func:`choose_spec`)."""
    return itemsize == 4 and rotary_dim == head_dim and not partner_load


def flat_geometry(call: Call):
    """Per slab (head rows, rows per sequence step, sequence length or 0)
    when flat_kernel can run ``call`` (kernels/flat.cu), else None.

    flat_kernel walks a slab's head rows in memory order, so x must be a
    dense array of head rows (the batch, sequence and head axes, in any
    order, tile its memory with positive strides, head_dim innermost), the
    output must have x's strides (or be x), and a row's position must follow
    from its index: implied positions, or explicit ones that follow the
    sequence index alone (thd [t]; [s], or [1, s] for one batch entry), with
    a scalar offset only, no context parallelism, cos/sin tables, full
    rotary (or partial rotary in place: only the rotated packets of each row
    are walked), every slab rotated and no grouped (packed QKV) heads. The
    row index is (row / rows per step) % sequence length; the modulo is not
    needed (0) when no axis is stored outside the sequence axis. Explicit
    positions are read at that index (choose_spec adds the table-size rule).
    """
    positions_ok = call.pos_mode == IMPLIED or (
        call.pos_mode == EXPLICIT and (call.positions.ndim == 1 or call.batch == 1))
    if not (positions_ok and call.source == "table" and call.offsets is None
            and call.cp_size == 1 and (call.rotary_dim == call.head_dim or call.inplace)):
        return None
    d, geometry = call.head_dim, []
    for sl in call.slabs:
        if not sl.rotate or sl.heads_per_group < sl.heads:
            return None
        if not call.inplace and tuple(sl.out_strides) != tuple(sl.x_strides):
            return None
        b_st, s_st, _, h_st, d_st = sl.x_strides
        axes = sorted((st, n) for st, n in ((b_st, call.batch), (s_st, call.seqlen),
                                            (h_st, sl.heads)) if n > 1)
        expected = d
        for st, n in axes:
            if st != expected or d_st != 1:
                return None
            expected *= n
        rows = call.tokens * sl.heads
        packets = d * sl.x.itemsize // MAX_VECTOR_BYTES
        if (rows + 1) * packets + 32 >= MAX_PACKET_UNITS:  # the kernel counts units in 32 bits
            return None
        if call.seqlen > 1:
            outside = any(st > s_st for st, _ in axes)
            geometry.append((rows, s_st // d, call.seqlen if outside else 0))
        else:
            geometry.append((rows, 0, 0))  # every row at sequence index 0
    return geometry


def flat_shape(packets_per_row: int, all_lanes: bool, slab_rows):
    """Grid, block and per-slab block layout for flat_kernel: each slab's
    head rows of ``packets_per_row`` packets, one per thread; a NeoX warp
    that shuffles (``all_lanes`` False) holds whole rows (its idle lanes, if
    32 is not a multiple of the row, count too); slabs[k] = (block_begin, 0,
    0, 0)."""
    lanes = 32 if all_lanes else 32 // packets_per_row * packets_per_row
    warps_per_block = FLAT_THREADS // 32
    slabs, begin = [], 0
    for rows in slab_rows:
        slabs.append((begin, 0, 0, 0))
        warps = -(-rows * packets_per_row // lanes)
        begin += -(-warps // warps_per_block)
    return (begin, 1, 1), (FLAT_THREADS, 1, 1), slabs


def head_major(x_view, heads: int, heads_per_group: int, n_inner: int) -> bool:
    """Does packet_kernel walk a slab's rows (outer, head, inner) rather than
    (outer, inner, head)? Yes when x stores a plain head axis outside the
    inner token axis (x_view: the kernel's View strides, outer, inner,
    group, head, dim), as a [b, h, s, d] tensor seen as bshd: consecutive
    threads then read consecutive memory."""
    _, inner, _, head, _ = x_view
    return heads > 1 and n_inner > 1 and heads_per_group >= heads and abs(head) > abs(inner)


def reciprocal(d: int):
    """(mul, shift) with floor(n / d) == (n * mul) >> shift for 0 <= n < 2^31
    (kernels/params.cuh divide()); (0, 0) for d == 0."""
    if d <= 0:
        return 0, 0
    shift = 31 + (d - 1).bit_length()
    return (1 << shift) // d + 1, shift


def _heads_per_thread(shape) -> list:
    """Heads each thread of a :func:`block_shape` walks, per slab (a slab's
    heads over its head lanes)."""
    _, _, slabs = shape
    return [-(-heads_per_block // lanes) for _, _, lanes, heads_per_block in slabs]


def varlen_block_shape(items: int, slab_heads: tuple, tokens: int, unroll: int,
                       sm_count: int, n_seqs: int, source: str):
    """:func:`block_shape` for a call with cu_seqlens: ``varlen_tokens``
    tokens a block, or, with angles computed in the kernel and more than
    ``varlen_few_seqs`` sequences, ``varlen_computed_tokens`` where the
    fewer tokens would cut a thread's heads (its angles serve them all)
    below both what the more tokens give it and two passes."""
    policy = POLICY
    few = block_shape(items, slab_heads, tokens, unroll, sm_count, policy.varlen_tokens)
    if source == "table" or n_seqs <= policy.varlen_few_seqs:
        return few
    many = block_shape(items, slab_heads, tokens, unroll, sm_count,
                       policy.varlen_computed_tokens)
    if all(a >= min(b, 2 * unroll)
           for a, b in zip(_heads_per_thread(few), _heads_per_thread(many))):
        return few
    return many


# ---------------------------------------------------------------- params --
class _TokenOrder(NamedTuple):
    """How the kernels walk tokens: (outer, inner) with the smaller-stride
    axis inner, for locality."""

    seq_inner: bool  # the sequence axis is the inner one
    n_outer: int
    n_inner: int

    def by_order(self, b_stride, s_stride) -> tuple:
        """(outer, inner) of a (batch, sequence) pair of strides."""
        return (b_stride, s_stride) if self.seq_inner else (s_stride, b_stride)

    def view(self, strides5, heads_per_group) -> tuple:
        """The kernel's View of a slab's (batch, seq, group, head, dim) strides."""
        b, s, g, h, d = strides5
        return (*self.by_order(b, s), g if g else heads_per_group * h, h, d)


def _token_order(call: Call) -> _TokenOrder:
    sb, ss = call.slabs[0].x_strides[:2]
    if abs(ss) <= abs(sb) or call.batch == 1:
        return _TokenOrder(True, call.batch, call.seqlen)
    return _TokenOrder(False, call.seqlen, call.batch)


def _slab_fields(call: Call, order: _TokenOrder, slab_blocks: list, packets: bool) -> list:
    """The Slab structs of Params (unused slabs zero)."""
    fields = []
    for i in range(MAX_SLABS):
        if i >= len(call.slabs):
            fields += (0,) * len(_SLAB)
            continue
        sl = call.slabs[i]
        x_view = order.view(sl.x_strides, sl.heads_per_group)
        fields += x_view
        fields += order.view(sl.out_strides, sl.heads_per_group)
        fields += (*slab_blocks[i], sl.heads, sl.heads_per_group, int(sl.rotate),
                   *reciprocal(sl.heads),
                   int(packets and head_major(x_view, sl.heads, sl.heads_per_group,
                                              order.n_inner)))
    return fields


def _position_fields(call: Call, order: _TokenOrder) -> tuple:
    """Params' position strides, from pos_stride_outer to n_axes."""
    p = call.positions
    pos_strides, axis_stride, n_axes = (0, 0), 0, 0
    if p is not None:
        st = p.strides
        if call.pos_mode == AXES:  # [axes, ...]: the rest as for one axis
            axis_stride, n_axes, st = st[0], p.shape[0], st[1:]
        if call.layout == "thd" or len(st) == 1:
            pos_strides = order.by_order(0, st[0])
        else:
            pos_strides = order.by_order(*st)
    off_strides = (0, 0)
    if call.offsets is not None and call.pos_mode != VARLEN:
        off_strides = order.by_order(call.offsets.strides[0], 0)
    seq_strides = (0, 1) if order.seq_inner else (1, 0)
    return (*pos_strides, int(p is not None and p.dtype == "int64"),
            *off_strides, int(call.offsets is not None and call.offsets.dtype == "int64"),
            *seq_strides, axis_stride, n_axes)


def fixed_params(call: Call, slab_blocks: list, packets: bool = False) -> bytes:
    """The fixed part of Params (everything but pointers and the offset);
    ``packets``: for packet_kernel (which may walk rows head-major)."""
    order = _token_order(call)
    cos, sin = call.tables[0], call.tables[-1]
    sections = tuple(call.sections) + (0,) * (3 - len(call.sections))
    cp_chunk = call.seqlen // 2 if call.pos_mode == IMPLIED else 0
    fields = _slab_fields(call, order, slab_blocks, packets)
    fields += (
        len(call.slabs),
        cos.strides[0] if cos.ndim == 2 else 0, sin.strides[0] if sin.ndim == 2 else 0,
        cos.strides[-1], sin.strides[-1], call.max_position,
        *_position_fields(call, order), *sections, int(call.sections_interleaved),
        call.n_seqs, call.cp_size, call.cp_rank, cp_chunk,
        order.n_outer, order.n_inner, *reciprocal(order.n_inner),
        -1.0 if call.backward else 1.0, 0.0)
    return _FIXED.pack(*fields)


def flat_fixed_params(call: Call, slab_blocks: list, flat: list) -> bytes:
    """The fixed part of FlatParams: per slab its first block and
    :func:`flat_geometry`'s (rows, rows per sequence step, sequence length)
    with reciprocals for the two divisions; the table row strides, the
    table's rows, the direction and ``zero`` (always 0: kernels/flat.cu
    LATE_TABLES)."""
    fields = []
    for i in range(MAX_SLABS):
        if i < len(call.slabs):
            rows, step, seq = flat[i]
            fields += (slab_blocks[i][0], rows, *reciprocal(step), seq, *reciprocal(seq))
        else:
            fields += (0,) * len(_FLAT_SLAB)
    cos, sin = call.tables[0], call.tables[-1]
    p = call.positions  # EXPLICIT: indexed by the sequence index (flat_geometry)
    pos_stride = p.strides[-1] if p is not None else 0
    fields += (len(call.slabs), cos.strides[0], sin.strides[0], call.max_position,
               pos_stride, int(p is not None and p.dtype == "int64"),
               -1.0 if call.backward else 1.0, 0)
    return _FLAT_FIXED.pack(*fields)


def unpack_fixed(plan) -> dict:
    """The fixed parameter fields of a plan by name (Params, or FlatParams
    for flat_kernel), for tests and tools."""
    fields, packer = ((FLAT_FIXED_FIELDS, _FLAT_FIXED) if plan.spec.mapping == "flat"
                      else (FIXED_FIELDS, _FIXED))
    return dict(zip((n for n, _ in fields), packer.unpack_from(plan.buf, _DYNAMIC.size)))


def _launch_shape(call: Call, spec: Spec, device_id: int):
    """(grid, block, fixed part of the parameters) of ``spec`` running ``call``."""
    heads = tuple(s.heads for s in call.slabs)
    if spec.mapping == "flat":
        geometry = flat_geometry(call)
        grid, block, slab_blocks = flat_shape(
            spec.rotary_dim // spec.vec, spec.interleaved or spec.partner_load,
            [rows for rows, _, _ in geometry])
        return grid, block, flat_fixed_params(call, slab_blocks, geometry)
    if spec.mapping == "packet":
        grid, block, slab_blocks = packet_shape(spec.rot_items, heads, call.tokens)
        return grid, block, fixed_params(call, slab_blocks, packets=True)
    shape = (spec.rot_items + spec.tail_items, heads, call.tokens, spec.unroll,
             _sm_count(device_id))
    grid, block, slab_blocks = (varlen_block_shape(*shape, call.n_seqs, call.source)
                                if call.pos_mode == VARLEN else block_shape(*shape))
    return grid, block, fixed_params(call, slab_blocks)


# ------------------------------------------------------------------ plan --
class Plan:
    """Everything a call signature needs, computed once.

    ``slots`` says where each per-call pointer comes from: (index into the
    call's array list, byte offset). ``disjoint`` lists pairs of arrays whose
    memory must not overlap, with their spans relative to their pointers:
    the one check that depends on pointer values, redone on every call.
    """

    __slots__ = ("spec", "kernel", "grid", "block", "buf", "buffers", "slots", "pick",
                 "device_id", "stream", "empty", "dims")

    def __init__(self, call: Call, arrays: list):
        self.device_id = call.device[1]
        self.empty = call.tokens == 0 or call.heads == 0
        self.spec = spec = choose_spec(call)
        self.grid, self.block, fixed = _launch_shape(call, spec, self.device_id)
        self.dims = (*self.grid, *self.block)
        self.kernel = None if self.empty else get_kernel(spec, self.device_id).ptr
        # The parameters with the dynamic fields zero; each launching thread
        # packs its pointers into its own copy (see own_buffer).
        self.buf = bytes(_DYNAMIC.size) + fixed
        self.buffers: dict = {}

        def slot(t, byte_offset=0):
            if t is None:
                return (-1, 0)  # index -1: the 0 appended to the pointer list
            for i, a in enumerate(arrays):
                if a is t.obj:
                    return (i, t.ptr - interop.data_ptr(a) + byte_offset)
            raise AssertionError("array of the call not found")

        slabs = list(call.slabs) + [None] * (MAX_SLABS - len(call.slabs))
        self.slots = (
            [slot(s.x, s.x_offset * s.x.itemsize) if s else (-1, 0) for s in slabs]
            + [slot(s.out, s.out_offset * s.out.itemsize) if s else (-1, 0) for s in slabs]
            + [slot(call.tables[0], call.table_offsets[0] * call.tables[0].itemsize),
               slot(call.tables[-1], call.table_offsets[-1] * call.tables[-1].itemsize),
               slot(call.positions), slot(call.offsets), slot(call.cu_seqlens)])
        # Without byte offsets (the usual case) the pointers are picked as they are.
        self.pick = None
        if all(off == 0 for _, off in self.slots):
            self.pick = operator.itemgetter(*[i for i, _ in self.slots])
        if call.x.kind == "torch":
            self.stream = interop.torch_stream_getter()
        else:
            self.stream = interop.cupy_stream_getter()

    def own_buffer(self):
        """The calling thread's (parameter buffer, address of the kernel's
        argument array), made on its first launch. No lock: the driver reads
        the parameters during the launch call, which releases the GIL, so
        threads must not share a buffer."""
        entry = self.buffers.get(threading.get_ident())
        if entry is None:
            buf = ctypes.create_string_buffer(self.buf, len(self.buf))
            args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
            entry = self.buffers[threading.get_ident()] = (buf, ctypes.addressof(args), args)
        return entry

    def launch(self, ptrs: list, offset: int) -> None:
        """Launch with these per-array data pointers (``ptrs[i]`` of array i)."""
        if self.empty:
            return
        ptrs.append(0)
        if self.pick is not None:
            vals = self.pick(ptrs)
        else:
            vals = [ptrs[i] + off for i, off in self.slots]
        dev = self.device_id
        stream = self.stream(dev)
        buf, args_addr, _ = self.own_buffer()
        _pack_dynamic(buf, 0, *vals, offset)
        if _get_device() == dev:
            try:
                _launch_kernel(self.kernel, *self.dims, 0, stream, args_addr, 0)
                return
            except Exception as exc:  # a thread without a CUDA context yet
                if "INVALID_CONTEXT" not in str(exc):
                    raise
        import cupy

        with cupy.cuda.Device(dev):  # makes the device's context current
            cupy.cuda.runtime.setDevice(dev)
            _launch_kernel(self.kernel, *self.dims, 0, stream, args_addr, 0)


def _get_device():
    global _get_device
    from cupy_backends.cuda.api.runtime import getDevice

    _get_device = getDevice
    return getDevice()


def _launch_kernel(*args):
    global _launch_kernel
    from cupy.cuda import driver

    _launch_kernel = driver.launchKernel
    return driver.launchKernel(*args)


def disjoint_pairs(call: Call, arrays: list, out_indices) -> list:
    """Pairs (i, span_i, lattice_i, j, span_j, lattice_j) of array indices
    whose memory must stay apart (validate.disjoint_at): each caller-given
    output against every input, and, in place, each written array against
    the read-only inputs and the other slab."""
    def idx(t):
        for i, a in enumerate(arrays):
            if a is t.obj:
                return i
        return None

    written, read = [], []
    for s in call.slabs:
        if call.inplace:
            written.append(s.x)
        elif s.out is not None and idx(s.out) not in out_indices:
            written.append(s.out)
        read.append(s.x)
    read += [t for t in call.tables + (call.positions, call.offsets, call.cu_seqlens)
             if t is not None]
    pairs, seen = [], set()
    for w in written:
        for r in read + written:
            i, j = idx(w), idx(r)
            if r is w or i is None or j is None or i == j or frozenset((i, j)) in seen:
                continue
            seen.add(frozenset((i, j)))
            pairs.append((i, rel_span(w), lattice(w), j, rel_span(r), lattice(r)))
    return pairs


def _apart_expr(pairs, ref) -> str:
    """One boolean expression: every pair's byte spans are apart, with
    ``ref(i)`` the source text of array i's pointer ("True" for no pairs)."""
    return " and ".join(
        f"({ref(j)} + {int(sj[1])} <= {ref(i)} + {int(si[0])} or "
        f"{ref(i)} + {int(si[1])} <= {ref(j)} + {int(sj[0])})"
        for i, si, _, j, sj, _ in pairs) or "True"


def spans_apart(pairs):
    """A function ptrs -> True when every pair's byte spans are apart.

    The same interval test as :func:`check_disjoint`'s first step, for a
    fixed list of pairs, generated as one expression (no loop): this runs on
    every cached call. False means "maybe overlapping": ask check_disjoint.
    """
    expr = _apart_expr(pairs, lambda i: f"p[{int(i)}]")
    return eval("lambda p: " + expr)  # noqa: S307 - integers and indices only


def bound_launcher(plan: Plan, pairs, args: dict, consts: dict):
    """A function of a few named per-call pointers that launches ``plan``.

    ``args`` maps array indices (as in the plan's pointer list) to parameter
    names (the function's parameters, in that order), ``consts`` maps the
    other indices to fixed pointers (a RotaryEmbedding's tables; 0 for
    absent arrays). The function tests
    ``pairs`` apart (as :func:`check_disjoint`) and returns False without
    launching if they overlap; otherwise it packs the data pointers
    (scalar offset 0) into the calling thread's copy of the plan's
    parameters and launches on the current stream, returning True.
    Generated once per plan as straight-line code: it runs on every cached
    decode step.
    """
    def ref(i, byte_offset=0):
        if i in args:
            return f"({args[i]} + {int(byte_offset)})" if byte_offset else args[i]
        return str(int(consts.get(i, 0)) + int(byte_offset) if i >= 0 else 0)

    n_slots = max([*args, *consts]) + 1
    return _generate_launcher(plan, pairs, list(dict.fromkeys(args.values())), ref, n_slots,
                              "0", None, "True", "False", {})


def call_launcher(plan: Plan, pairs, given, n_slots: int, offset_range, result):
    """``go(arrays, p, offset)``: launch ``plan`` for a functional call.

    ``p`` holds the call's ``n_slots`` array pointers (0 for absent
    arrays), ``given`` the indices of the arrays present (the others are
    the constant 0). ``go`` returns ``NotImplemented`` without launching
    when ``offset`` lies outside ``offset_range`` or ``pairs`` overlap
    (the general path then raises), else launches with the scalar
    ``offset`` and returns ``result(arrays, ())``. Straight-line code as
    :func:`bound_launcher`'s; api keeps one per signature seen.
    """
    given = set(given)

    def ref(i, byte_offset=0):
        if i in given:
            return f"(p[{int(i)}] + {int(byte_offset)})" if byte_offset else f"p[{int(i)}]"
        return str(int(byte_offset)) if i >= 0 else "0"

    lo, hi = (int(v) for v in offset_range)
    return _generate_launcher(plan, pairs, ["arrays", "p", "offset"], ref, n_slots, "offset",
                              f"{lo} <= offset < {hi}", "result(arrays, ())",
                              "NotImplemented", {"result": result})


def _generate_launcher(plan, pairs, params, ref, n_slots, offset, guard, done, refused, extra):
    """Source and compile the straight-line launcher of ``plan``: ``ref(i,
    byte_offset)`` is the text of array i's pointer (plus a byte offset),
    ``offset`` the text of the scalar position offset, ``guard`` an extra
    condition (or None), ``done`` / ``refused`` the returned texts. Spans
    that the quick test cannot tell apart (q and k sliced from one qkv
    buffer interleave) get the exact test, as _Prepared.run gives them."""
    apart = _apart_expr(pairs, ref)
    ptrs = ", ".join(ref(i, off) for i, off in plan.slots)
    slow = ", ".join(ref(i) for i in range(n_slots))
    checks = f"""    if not ({guard}):
        return {refused}
""" if guard is not None else ""
    if pairs:
        checks += f"""    if not ({apart}) and not disjoint(pairs, [{slow}]):
        return {refused}
"""
    src = f"""def go({", ".join(params)}):
{checks}    if empty:
        return {done}
    stream = stream_of(dev)
    mine = buffers.get(ident())
    if mine is None:
        mine = plan.own_buffer()
    pack(mine[0], 0, {ptrs}, {offset})
    if get_device() == dev:
        try:
            launch_kernel(kernel, {", ".join(map(str, plan.dims))}, 0, stream, mine[1], 0)
            return {done}
        except Exception as exc:  # a thread without a CUDA context yet
            if "INVALID_CONTEXT" not in str(exc):
                raise
    # Another device is current, or this thread has no context: the general
    # launch makes the plan's device current for the call.
    plan.launch([{slow}], {offset})
    return {done}
"""
    from cupy.cuda import driver
    from cupy_backends.cuda.api.runtime import getDevice

    # Each thread packs its own copy of the parameters (Plan.own_buffer).
    env = dict(empty=plan.empty, stream_of=plan.stream, dev=plan.device_id, buffers=plan.buffers,
               ident=threading.get_ident, pack=_pack_dynamic,
               get_device=getDevice, kernel=plan.kernel, launch_kernel=driver.launchKernel,
               plan=plan, disjoint=check_disjoint, pairs=pairs, **extra)
    exec(src, env)  # noqa: S102 - integers, indices and fixed names only
    go = env["go"]
    go.plan = plan  # for the benchmark's bare-launch timing (benchmarks/)
    return go


def check_disjoint(pairs, ptrs) -> bool:
    for i, span_i, lat_i, j, span_j, lat_j in pairs:
        pi, pj = ptrs[i], ptrs[j]
        if (pi + span_i[0] < pj + span_j[1] and pj + span_j[0] < pi + span_i[1]
                and not disjoint_at(pi, span_i, lat_i, pj, span_j, lat_j)):
            return False
    return True


# ------------------------------------------------------------- catalogue --
SHIPPED_HEAD_DIMS = (64, 80, 96, 128, 256)
SHIPPED_ROTARY_FRACTIONS = (1.0, 0.5, 0.25)
_SHIPPED_TOKENS = 16


class _ShippedCase(NamedTuple):
    """One point of the shipped grid (see :func:`shipped_specs`)."""

    heads: int
    dtype: str
    head_dim: int
    rotary_dim: int
    source: str  # "cos", "inv_freq" or "freqs"
    angle_dtype: str
    interleaved: bool
    inplace: bool
    pos_mode: str
    last_stride: int


def _shipped_cases():
    """The grid of :func:`shipped_specs`, one-head and 32-head calls with
    implied and explicit positions only (a representative set; flat_kernel
    for many heads)."""
    for h, dtype, d, frac in itertools.product((32, 4, 1), ("float32", "float16", "bfloat16"),
                                               SHIPPED_HEAD_DIMS, SHIPPED_ROTARY_FRACTIONS):
        sources = [("cos", "float32"), ("inv_freq", "float32"), ("freqs", "float32")]
        if dtype != "float32":
            sources.append(("cos", dtype))
        pos_modes = ("implied", "explicit") if h in (1, 32) else (
            "implied", "explicit", "varlen", "axes")
        for (name, adt), interleaved, inplace, pos_mode, last_stride in itertools.product(
                sources, (False, True), (False, True), pos_modes, (1, 2)):
            if last_stride == 2 and (inplace or pos_mode != "implied"):
                continue
            yield _ShippedCase(h, dtype, d, int(d * frac) // 2 * 2, name, adt, interleaved,
                               inplace, pos_mode, last_stride)


class _FakeArrays:
    """Shape-only CUDA tensor descriptions at distinct, 16-byte aligned fake pointers."""

    def __init__(self):
        self._base = iter(range(1 << 30, 1 << 62, 1 << 30))

    def __call__(self, shape, dtype, strides=None):
        from .interop import CUDA, Tensor

        if strides is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.insert(0, acc)
                acc *= n
        return Tensor(None, "cupy", next(self._base), tuple(shape), tuple(strides), dtype,
                      (CUDA, 0), False)


def _shipped_calls(case: _ShippedCase, tensor: _FakeArrays) -> list:
    """The calls of one grid point: ``_SHIPPED_TOKENS`` tokens, and with a
    contiguous last axis and implied or explicit positions one token too
    (flat_kernel without split angles)."""
    from .validate import check_call

    s, h, d, r, lst = _SHIPPED_TOKENS, case.heads, case.head_dim, case.rotary_dim, \
        case.last_stride
    shape = (r // 2,) if case.source == "inv_freq" else (s, r // 2)
    kw = {case.source: tensor(shape, case.angle_dtype)}
    if case.source == "cos":
        kw["sin"] = tensor(shape, case.angle_dtype)
    if case.pos_mode == "explicit":
        kw["positions"] = tensor((s,), "int32")
    elif case.pos_mode == "varlen":
        kw["cu_seqlens"] = tensor((3,), "int32")
    elif case.pos_mode == "axes":
        kw["positions"] = tensor((3, s), "int32")
        kw["sections"] = (r // 2 - 2, 1, 1)
    x = tensor((s, h, d), case.dtype, (h * d * lst, d * lst, lst))
    out = tensor((s, h, d), case.dtype)
    common = dict(layout="thd", interleaved=case.interleaved, inplace=case.inplace)
    calls = [check_call(x, out=None if case.inplace else out, **common, **kw)]
    if case.pos_mode in ("implied", "explicit") and lst == 1:
        one = tensor((1, h, d), case.dtype)
        if case.pos_mode == "explicit":
            kw["positions"] = tensor((1,), "int32")
        calls.append(check_call(one, out=None if case.inplace else tensor((1, h, d), case.dtype),
                                **common, **kw))
    return calls


def _flat_variants(specs: list) -> list:
    """flat_kernel specs that the grid's small calls do not reach: the same
    kernels compiled for q and k (two slabs; a fused QKV split copies v,
    which flat_kernel does not take, so no flat call has three), asking for
    table rows early (large calls), and fp32 with x loaded evict-last."""
    flat = [sp for sp in specs if sp.mapping == "flat"]
    specs = specs + [dataclasses.replace(sp, slabs=2) for sp in flat]
    flat = [sp for sp in specs if sp.mapping == "flat"]
    specs += [dataclasses.replace(sp, early_tables=True) for sp in flat
              if sp.pos_mode == "implied" and flat_late_tables(
                  ITEMSIZE[sp.dtype], sp.split_angles, sp.partner_load, sp.interleaved,
                  sp.rotary_dim // sp.vec)]
    flat = [sp for sp in specs if sp.mapping == "flat"]
    specs += [dataclasses.replace(sp, x_evict_last=True) for sp in flat
              if flat_x_evict_last_fits(ITEMSIZE[sp.dtype], sp.rotary_dim, sp.head_dim,
                                        sp.partner_load)]
    return specs


def shipped_specs() -> list:
    """Every specialization the launcher picks for aligned, contiguous inputs.

    The grid: dtype x head_dim {64, 80, 96, 128, 256} x rotary fraction
    {1, 1/2, 1/4} x NeoX/GPT-J x angle source (float32 tables, tables in x's
    dtype, inv_freq, freqs) x in place / out of place x position rule
    (implied, explicit, varlen, per-axis), plus the element-by-element path
    for a strided last axis; the same for one head per token and for 32
    heads with implied and explicit positions. For each call the spec
    :func:`choose_spec` picks, packet_kernel's (for calls flat_kernel cannot
    take) and rope_kernel's (for calls too large for the others), and the
    flat_kernel variants of :func:`_flat_variants`. Specs are derived from
    shape-only descriptions, so the list follows the launch policy; the CPU
    tests compile all of them with NVRTC.

    Returns
    -------
    list of Spec
        Distinct specs, sorted by their repr.
    """
    tensor = _FakeArrays()
    specs = []
    for case in _shipped_cases():
        calls = _shipped_calls(case, tensor)
        specs += [choose_spec(c) for c in calls]
        specs.append(choose_spec(calls[0], flat=False))
        specs.append(choose_spec(calls[0], packets=False))
    return sorted(set(_flat_variants(specs)), key=repr)
