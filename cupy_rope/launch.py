"""Launch policy and launch plans.

From a validated :class:`~cupy_rope.validate.Call` this module derives the
kernel :class:`~cupy_rope.specialize.Spec` (the vector widths it can prove
aligned), the grid/block shape, and the ``Params`` struct of
``kernels/params.cuh``. A :class:`Plan` holds all of that for one call
signature (shapes, strides, dtypes, pointer alignment, options), so a
repeated call only rewrites the data pointers and launches. This is the only
place that knows how work is spread over threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import operator
import struct
import threading

from . import interop
from .specialize import ITEMSIZE, Spec, get_kernel
from .validate import AXES, EXPLICIT, IMPLIED, VARLEN, Call, disjoint_at, lattice, rel_span

MAX_VECTOR_BYTES = 16  # widest single global load/store
THREADS_PER_BLOCK = 256
UNROLL = 4  # heads per thread per pass, loads issued together
MAX_BLOCK_Z = 64  # CUDA's limit on blockDim.z
BLOCKS_PER_SM = 8  # blocks to aim for before splitting heads over blockIdx.y
MAX_HEAD_LANES = 32  # head lanes per block; fewer lanes: more tokens, more heads per thread
# Head lanes: the power of two at or above heads / UNROLL, so that a thread
# makes one pass over fewer heads rather than a full pass plus a partial one
# (24 heads: 8 lanes of 3, not 4 lanes of 4 + 2; diffusion d80/d96 +3%).
# Not for blocks that take a minimum of tokens (varlen): see block_shape.
LANES_ROUND_UP = True
# Threads per block when a thread has fewer than UNROLL heads (one head per
# token, or 24 heads over 8 lanes): smaller blocks fit 5 per SM instead of
# 2, more warps in flight (fp32 one-head 0.73 -> 0.86 of copy). 0: keep 256.
SMALL_BLOCK_THREADS = 128

# Tokens per block to aim for with cu_seqlens: each block's first warp
# searches for its tokens' sequences (one dependent load per 32-fold
# narrowing) while the other warps issue their first loads
# (kernels/positions.cuh, SequenceSignal). thd [65536, 32, 128] bf16 on the
# H100, of copy, n_seqs 1 / 128 / 2401: fp32 tables, 4 tokens 0.975 / 1.005 /
# 0.984, 8 tokens 0.952 / 0.976 / 0.975; inv_freq with 2401 sequences, 4
# tokens 0.948, 8 tokens 0.973 (docs/perf-notes.md, v14).
VARLEN_MIN_TOKENS = 4
# Angles computed in the kernel (inv_freq, freqs) for more than
# VARLEN_FEW_SEQS sequences (three search steps): 8 tokens where 4 would
# leave a thread fewer heads per computed angle than 8 do and than two
# passes (2 x UNROLL): NeoX [T, 32, 128], 4 heads against 8 (with 4 tokens
# 0.971 -> 0.947 of copy, fp16 0.972 -> 0.938). Elsewhere 4, which changes
# no thread's heads (d64: 4 heads either way, 0.916 -> 0.975) or keeps two
# passes (GPT-J d128: 8 heads of 16, 0.966 -> 0.982); docs/perf-notes.md v15,
# v16. (Above VARLEN_FEW_SEQS, with tables, the searching warp also
# prefetches its first loads: kernels/rope.cu SEARCH_PREFETCH_MIN_SEQS, the
# same number.) Measured with 65536 tokens; with few tokens, where
# block_shape splits heads into groups, the comparison sees the groups.
# VARLEN_COMPUTED_FEW_TOKENS 0: always 8.
VARLEN_FEW_SEQS = 1024
VARLEN_COMPUTED_MIN_TOKENS = 8
VARLEN_COMPUTED_FEW_TOKENS = 1
# Varlen blocks hold their minimum of tokens and no more (at least
# SMALL_BLOCK_THREADS threads): a block of few heads no longer fills 256
# threads with further tokens. More, smaller blocks per SM, each with its own
# search (thd 2401 sequences, bf16, of copy on the H100: d64 / d80 / d96
# tables 0.964 / 0.940 / 0.951 -> 0.979 / 0.955 / 0.970, 8 heads inv_freq
# 0.885 -> 0.955; 32 heads of 128 fill 256 threads with 4 tokens as before;
# docs/perf-notes.md v15). 0: fill 256 threads.
VARLEN_SMALL_BLOCKS = 1
# packet_kernel (kernels/packet.cu) for full rotary on 16-byte aligned views
# with a unit channel stride: two 16-byte packets per thread (GPT-J fp32:
# one), a short prologue.
PACKET_KERNELS = True
# Heads per token from which angles computed in the kernel (inv_freq, freqs)
# go to rope_kernel, which shares them across a thread's heads.
COMPUTED_ANGLES_HEADS = 16
# Rows (tokens x heads) from which explicit positions go to rope_kernel.
EXPLICIT_PACKET_ROWS = 1 << 18
PACKET_THREADS = 256  # threads per block, at most kernels/packet.cu PACKET_THREADS (its launch bounds)
# flat_kernel (kernels/flat.cu) for dense slabs walked in memory order: one
# 16-byte packet per thread, implied positions and cos/sin tables.
FLAT_KERNELS = True
FLAT_THREADS = 128  # kernels/flat.cu FLAT_THREADS (its launch bounds and warp indexing)
# NeoX rows that leave more lanes of a warp idle than this (a warp holds
# whole rows: d96 bf16, 12 packets, idles 8) load their rotation partner
# themselves out of place, and stay on packet_kernel in place.
FLAT_MAX_IDLE_LANES = 2
FLAT_PARTNER_LOAD_ALWAYS = False  # scripts/quick_perf.py: every NeoX call out of place
# flat_kernel compiled for the call's slab count (Spec.slabs): one slab
# needs no run-time pick of each block's slab before its x address (bf16
# sbhd [512, 32, 24, 128] on the H100: 0.988 -> 0.996 of copy, [512, 8,
# 128, 128] 0.991 -> 0.999; kernels/flat.cu, docs/perf-notes.md v18).
# False: one kernel for every count (Spec.slabs 0), the previous kernel.
FLAT_EXACT_SLABS = True
# flat_kernel also for explicit positions that follow the sequence index
# alone (thd [t], bshd / sbhd [s] or [1, s]), read at the row's sequence
# index, where the table rows they can reach fit in FLAT_POSITIONS_TABLE_BYTES
# (min(positions, table rows) x a row of cos and sin) and the kernel asks for
# them late (16-bit x, rows that tile a warp or GPT-J, no split angles or
# partner loads: kernels/flat.cu LATE_TABLES). bf16 on the H100, of a
# same-run copy, flat_kernel against the kernel picked before: thd [65536,
# 32, 128] at the positions of 2401 sequences (a table of their longest
# length, 167 rows) 0.999 -> 1.012 (torch.compile on the same positions
# 1.009), 128 sequences (2698 rows) 1.002 -> 1.011; bshd [4, 4096, 32, 128]
# with positions [s] 0.977 -> 0.987; decode [64, 32, 128] 5.3 -> 4.9 us.
# Table rows from DRAM (65536 distinct positions into a 70000-row table)
# ran 0.964 -> 0.931, and d80 (rows of 10 packets) 0.988 -> 0.915: those
# stay where they were. The bound counts tokens, not distinct positions
# (the host cannot see device values), so it is conservative
# (docs/perf-notes.md v19). False: every explicit call as before.
FLAT_POSITIONS = True
FLAT_POSITIONS_TABLE_BYTES = 4 << 20
# Calls with implied positions that walk this many bytes of x or more ask
# for their table rows early even where flat_kernel would ask late (16-bit
# rows that tile a warp, or GPT-J, without split angles): on sbhd tensors
# of 512 MiB and more the late rows cost 0.4-4% (bf16 on the H100, of a
# same-run copy, late / early: [256, 8192, 1, 128] 0.970 / 1.010, [32768,
# 1, 128, 128] 0.969 / 0.997, [16384, 1, 128, 128] 0.990 / 1.006, [4096,
# 4, 128, 128] 0.992 / 1.011; bshd [1, 131072, 32, 128] 0.958 / 0.974;
# bshd [16, 8192, 32, 128] 1.006 / 1.004), where at 256 MiB and below they
# won (the benchmark's rows by 0.2-0.5%) or tied. Explicit positions keep
# them late (thd [65536, 32, 128], 512 MiB: 1.011 late, 0.956 early;
# docs/perf-notes.md v19).
FLAT_EARLY_TABLES_BYTES = 512 << 20
# fp32 calls out of place with full rotary whose rows' positions never
# decrease through memory (no axis stored outside the sequence axis: sbhd,
# thd, bshd with one batch entry; also one-token calls, unmeasured) load x
# with an L2 evict-last policy, as
# torch.compile's kernel does (kernels/flat.cu X_EVICT_LAST). fp32 on the
# H100, of a same-run copy: sbhd [128, 8192, 1, 128] 1.006 -> 1.013 (three
# runs 1.013-1.018; torch.compile 1.010-1.014), [1024, 16, 8, 128] 1.001 ->
# 1.015, [256, 32, 32, 128] 0.996 -> 1.011, [8192, 1, 32, 128] 0.995 ->
# 1.001, d64 sbhd +0.8%, bshd [1, 32768, 8, 128] 0.942 -> 0.955. Where a
# batch axis lies outside the sequence it lost (bshd [8, 4096, 8, 128] 0.999
# -> 0.958, [4, 4096, 16, 256] -2.3%), and 16-bit rows lost 0.5-4.3%
# (docs/perf-notes.md v20). In place and partial rotary (unmeasured) and the
# NeoX rows that load their partner (fp32 d80 / d96 / d256; d256 measured
# +0.3-0.7% on sbhd, -2.3% on bshd) keep plain loads.
FLAT_X_EVICT_LAST = True
MAX_PACKET_UNITS = 1 << 31  # packet_kernel indexes a slab's units in 32 bits
MAX_SLABS = 3
MAX_HEADS = 1 << 30  # heads per token (kernels/rope.cu indexes heads in 32 bits)
POS_MODES = {IMPLIED: 0, EXPLICIT: 1, VARLEN: 2, AXES: 3}

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


def choose_spec(call: Call, packets: bool = True, flat: bool = True) -> Spec:
    """The kernel instantiation for ``call`` (outputs must be described);
    ``packets=False``: rope_kernel's, also where packet_kernel or
    flat_kernel would run; ``flat=False``: packet_kernel's where flat_kernel
    would run."""
    d, r = call.head_dim, call.rotary_dim
    half = r // 2
    views = _moving_views(call)
    item = views[0][1]
    strided = any(sd != 1 for *_, sd in views)
    widths = [w for w in (16, 8, 4, 2, 1) if w <= MAX_VECTOR_BYTES // item]

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

    tables = call.tables
    row_strides = [t.strides[0] for t in tables if t.ndim == 2 and t.shape[0] > 1]

    def tables_aligned(freqs):
        """Can every table row be read in runs of ``freqs`` frequencies?"""
        return all(_aligned(freqs, t.ptr + off * t.itemsize, t.itemsize, row_strides)
                   for t, off in zip(tables, call.table_offsets))

    # AXES reads tables element by element (neighbouring pairs may use other axes).
    table_strided = (strided or call.pos_mode == AXES
                     or any(t.strides[-1] != 1 for t in tables) or not tables_aligned(pairs))

    copy_tail = not call.inplace and r < d
    tail_vec = 1
    if copy_tail and not strided:
        tail_vec = _widest(widths, lambda w: (d - r) % w == 0 and r % w == 0 and x_ok(w)) or 1
    # A tensor with fewer than UNROLL heads gives each thread one head to load
    # whatever UNROLL is; the one-head kernel needs far fewer registers (~62)
    # and runs twice the blocks per SM (fp32 [128, 8192, 1, 128]: 0.87 -> 0.98
    # of copy; docs/perf-notes.md).
    max_heads = max(sl.heads for sl in call.slabs)
    if max_heads >= MAX_HEADS:
        name = ("x", "k", "v")[[sl.heads for sl in call.slabs].index(max_heads)]
        raise ValueError(f"{name}: {max_heads} heads per token; at most {MAX_HEADS - 1} are "
                         "supported (the kernel counts heads in 32 bits)")
    # In place with rotary_dim < head_dim only part of each head row is read
    # and written (rotary 32 of 128: 64 of every 256 bytes). flat_kernel
    # takes such calls when it can (below); for the others (positions,
    # rotated channels that do not fill 16-byte packets) rope_kernel with one
    # head per thread keeps each warp on consecutive heads of a token, which brings
    # the partial call down to the floor of that access pattern (bshd [4,
    # 4096, 32, 128] bf16 in place on the H100, rotary 32: 45.0 -> 39.8 us,
    # a load/store-only kernel on the same bytes 39.2 us; rotary 64: 54.9 ->
    # 54.1 us; docs/perf-notes.md). Not for per-axis positions (M-RoPE):
    # their one-head kernels would spill registers under the 4-blocks-per-SM
    # bound (and are unmeasured).
    partial_in_place = call.inplace and r < d and call.pos_mode != AXES
    unroll = 1 if max_heads < UNROLL or partial_in_place else UNROLL
    spec = Spec(call.dtype, tables[0].dtype, d, r, call.interleaved, call.source, pairs,
                tail_vec, strided, table_strided, copy_tail, unroll, call.pos_mode)
    # Full rotary with 16-byte packets and implied or explicit positions:
    # packet_kernel, two packets per thread (GPT-J fp32: one). (bshd/sbhd
    # bf16 on the H100: 0.979-0.986 -> 0.992-0.996 of copy; d80 bf16, 5
    # threads per head: 0.94-0.95 -> 0.96-0.98 across head counts, d96 GPT-J
    # 0.93-0.97 -> 0.96-0.99, d96 NeoX within -1%/+1%; docs/perf-notes.md.)
    # cu_seqlens stay with rope_kernel, whose blocks of several tokens share
    # one sequence search. So do angles computed in the kernel (inv_freq,
    # freqs) for 16 or more heads: rope_kernel's thread finds them once for
    # its heads, packet_kernel once per head (sincosf; 48 registers). (bf16
    # d128 out of place, H100, packet / rope_kernel, of copy: 24-128 heads,
    # inv_freq 0.934-0.937 / 0.971-0.977, freqs 0.942-0.948 / 0.975-0.979;
    # [2, 4096, 8]: 0.88 / 0.80 and 0.86 / 0.82; [1, 65536, 4]: 0.93 /
    # 0.95 and 0.80 / 0.87; 9-15 heads unmeasured; docs/perf-notes.md v10.)
    # And explicit positions for large calls: a packet thread's table read
    # waits for its position read, with nothing else of its own in flight;
    # rope_kernel's thread has several heads' loads out meanwhile. (thd
    # [65536, h, d] bf16, packet / rope_kernel: distinct positions h32 d128
    # 0.88 / 0.96, GPT-J 0.91 / 0.97, h24 d80 0.84 / 0.93, h8 0.85 / 0.88;
    # positions of 2401 sequences d128 1.007 / 1.004, GPT-J 0.95 / 1.006,
    # d80 0.95 / 0.99; smaller calls favour packet_kernel or tie: [4096,
    # 32, 128] 0.95 / 0.89, [256, 32, 128] 0.73 / 0.74, decode [64, 32, 128]
    # 5.4 / 5.5 us; results/h100-2026-11-23f/explicit.txt.)
    # Dense slabs walked in memory order, full rotary, cos/sin tables and
    # implied positions: flat_kernel, one 16-byte packet per thread (NeoX
    # partner from the lane half a head away), a prologue of a few integer
    # operations. (bf16 on the H100, of copy, packet_kernel -> flat_kernel:
    # bshd [1, 4096, 128, 128] 0.989 -> 1.000, sbhd [512, 32, 24, 128] 0.981
    # -> 0.996, q + k prefill 0.990 -> 0.997, d80 q + k 0.978 -> 0.988. d96
    # NeoX, whose 12-packet rows would leave 8 lanes of every warp idle
    # (0.979), loads its partner itself out of place: 0.984-0.990 against
    # packet_kernel's 0.977-0.987, and stays on packet_kernel in place;
    # docs/perf-notes.md v11.) Partial rotary in place too: a lane per
    # rotated packet, the rest of each row never addressed (bshd [4, 4096,
    # 32, 128] bf16, rotary 64: 53.3 -> 51.9-52.1 us, rotary 32: 38.9 ->
    # 38.7-38.9 us, against 51.7 / 38.8 us for a kernel that only loads and
    # stores the same bytes; docs/perf-notes.md v12.) And explicit positions
    # that follow the sequence index alone into a table whose reachable rows
    # are few (FLAT_POSITIONS: thd at the positions of 2401 sequences 0.999
    # -> 1.012, decode 5.3 -> 4.9 us; docs/perf-notes.md v19).
    vec = 2 * pairs if call.interleaved else pairs  # channels per packet
    row_packets = r // vec  # flat_kernel: the rotated packets of a head row
    tiles = row_packets <= 32 and 32 % row_packets <= FLAT_MAX_IDLE_LANES
    partner_load = (not call.interleaved and not call.inplace
                    and (FLAT_PARTNER_LOAD_ALWAYS or not tiles))
    geometry = None
    # (flat_geometry says which rotary dims it takes; the rows must be whole
    # packets apart, which a single row's strides do not show.)
    if (packets and flat and FLAT_KERNELS and not strided and not table_strided
            and d % vec == 0
            and vec * item == MAX_VECTOR_BYTES and (call.interleaved or tiles or partner_load)):
        geometry = flat_geometry(call)
    if geometry is not None:
        # NeoX pair lanes split the table reads when a block's rows lie at
        # several positions (rows per position below rows per block).
        shuffle = not call.interleaved and not partner_load
        block_rows = FLAT_THREADS // 32 * (32 // row_packets) if shuffle else 0
        split = shuffle and any(0 < step < block_rows for _, step, _ in geometry)
        late = flat_late_tables(item, split, partner_load, call.interleaved, row_packets)
        if call.pos_mode == EXPLICIT:
            reachable = min(call.positions.shape[-1], call.max_position)
            row_bytes = sum(t.itemsize for t in tables) * half
            if not late or reachable * row_bytes > FLAT_POSITIONS_TABLE_BYTES:
                geometry = None
    if geometry is not None:
        walked = sum(rows for rows, _, _ in geometry) * r * item  # bytes of x the call reads
        early = call.pos_mode == IMPLIED and late and walked >= FLAT_EARLY_TABLES_BYTES
        x_evict_last = (FLAT_X_EVICT_LAST and not call.inplace
                        and flat_x_evict_last_fits(item, r, d, partner_load)
                        and all(seq == 0 for _, _, seq in geometry))
        return dataclasses.replace(spec, unroll=1, mapping="flat", split_angles=split,
                                   partner_load=partner_load,
                                   slabs=len(call.slabs) if FLAT_EXACT_SLABS else 0,
                                   early_tables=early, x_evict_last=x_evict_last)
    packet_spec = dataclasses.replace(spec, unroll=1, mapping="packets")
    units = packet_spec.rot_items  # packet_kernel threads per head
    # (NeoX packets tile each half by the choice of `pairs`; a GPT-J thread's
    # adjacent packets must tile the head.)
    units_tile = not call.interleaved or d % (packet_spec.vec * packet_spec.unit_packets) == 0
    if (packets and PACKET_KERNELS and r == d and not strided
            and packet_spec.vec * item == MAX_VECTOR_BYTES and units_tile and units >= 1
            and call.pos_mode in (IMPLIED, EXPLICIT)
            and (call.source == "table" or max_heads < COMPUTED_ANGLES_HEADS)
            and (call.pos_mode != EXPLICIT or call.tokens * max_heads < EXPLICIT_PACKET_ROWS)
            and call.tokens * max_heads * units < MAX_PACKET_UNITS):
        # A GPT-J 16-bit unit reads more frequencies per row than rope_kernel's item.
        if not table_strided and not tables_aligned(packet_spec.table_freqs):
            packet_spec = dataclasses.replace(packet_spec, table_strided=True)
        return packet_spec
    if spec.rot_items + spec.tail_items > THREADS_PER_BLOCK:
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
    ``unroll`` heads per pass. A slab with fewer heads uses fewer head lanes
    (``head_lanes``, a power of two dividing blockDim.y) and gives the
    other lanes further tokens, so its threads also load ``unroll`` heads at
    once. With few tokens (decode) a slab's heads are split into groups so
    that the grid still covers every SM several times. ``min_tokens`` > 1
    (varlen: each block searches cu_seqlens once): at least that many token
    lanes per block where the heads allow, head lanes rounded down, and
    (``VARLEN_SMALL_BLOCKS``) no more threads than those tokens need, but
    ``SMALL_BLOCK_THREADS``.

    Returns (grid, block, slabs) with slabs[k] = (block_begin, token_blocks,
    head_lanes, heads_per_block).
    """
    heads = max(slab_heads)
    lane_need = -(-heads // unroll)
    # Blocks with a minimum of tokens (varlen) round head lanes down: a
    # thread with a partial pass only (24 heads over 8 lanes) leaves its block
    # too few loads in flight to cover the sequence search (thd [65536, 24,
    # 80] with 128 / 2401 sequences: 0.912 / 0.900 -> 0.967 / 0.941 of copy).
    round_up = LANES_ROUND_UP and min_tokens == 1
    by = _pow2_ceil(lane_need) if round_up else _pow2_floor(lane_need)
    by = min(by, _pow2_floor(min(THREADS_PER_BLOCK // items, MAX_HEAD_LANES)))
    if min_tokens > 1:  # e.g. varlen: amortize the per-block sequence search
        by = min(by, _pow2_floor(THREADS_PER_BLOCK // (items * min_tokens)))
    threads = THREADS_PER_BLOCK
    if SMALL_BLOCK_THREADS and (-(-heads // by) < unroll or (VARLEN_SMALL_BLOCKS and min_tokens > 1)):
        # Less than one full pass of heads per thread, or varlen: smaller blocks, more of
        # them per SM (still min_tokens token lanes).
        threads = min(THREADS_PER_BLOCK, max(SMALL_BLOCK_THREADS, items * by * min_tokens))
    bz = max(1, min(threads // (items * by), MAX_BLOCK_Z))
    bz = min(bz, max(1, tokens))
    layout = []
    for h in slab_heads:
        lanes = min(by, 1 << (max(1, -(-h // unroll)) - 1).bit_length())
        token_blocks = -(-tokens // (bz * (by // lanes)))
        layout.append([h, lanes, token_blocks, -(-max(h, 1) // lanes)])  # head rows
    total = sum(tb for _, _, tb, _ in layout)
    target = BLOCKS_PER_SM * sm_count
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
    """Can flat_kernel load x with evict-last (FLAT_X_EVICT_LAST) for rows
    like these: fp32, full rotary, no partner load? (The call must also be
    out of place, in position order: choose_spec.)"""
    return itemsize == 4 and rotary_dim == head_dim and not partner_load


def flat_geometry(call: Call):
    """Per slab (head rows, rows per sequence step, sequence length or 0)
    when flat_kernel can run ``call`` (kernels/flat.cu), else None.

    flat_kernel walks a slab's head rows in memory order, so x must be a
    dense array of head rows (the batch, sequence and head axes, in any
    order, tile its memory with positive strides, head_dim innermost), the
    output must have x's strides (or be x), and a row's position must follow
    from its index: implied positions (or FLAT_POSITIONS' explicit ones)
    with a scalar offset only, no context
    parallelism, cos/sin tables, full rotary (or partial rotary in place:
    only the rotated packets of each row are walked), every slab rotated and
    no grouped (packed QKV) heads. The row index is (row / rows per step) %
    sequence length; the modulo is not needed (0) when no axis is stored
    outside the sequence axis. Explicit positions are read at that index,
    so they must follow it alone (choose_spec adds the table-size rule)."""
    # Explicit positions that follow the sequence index alone (thd [t]; [s],
    # or [1, s] for one batch entry) are read at the row's sequence index.
    positions_ok = call.pos_mode == IMPLIED or (
        FLAT_POSITIONS and call.pos_mode == EXPLICIT
        and (call.positions.ndim == 1 or call.batch == 1))
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
    threads then read consecutive memory. (bf16 [4, 4096, 32, 128] bhsd
    storage with an output in the same order, H100: 0.957 of copy
    token-major, 0.983-0.985 head-major.)"""
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
    """:func:`block_shape` for a call with cu_seqlens: VARLEN_MIN_TOKENS
    tokens a block, or, with angles computed in the kernel and more than
    VARLEN_FEW_SEQS sequences, VARLEN_COMPUTED_MIN_TOKENS where the fewer
    tokens would cut a thread's heads (its angles serve them all) below
    both what the more tokens give it and two passes."""
    few = block_shape(items, slab_heads, tokens, unroll, sm_count, VARLEN_MIN_TOKENS)
    if source == "table" or n_seqs <= VARLEN_FEW_SEQS:
        return few
    many = block_shape(items, slab_heads, tokens, unroll, sm_count, VARLEN_COMPUTED_MIN_TOKENS)
    if VARLEN_COMPUTED_FEW_TOKENS and all(
            a >= min(b, 2 * unroll)
            for a, b in zip(_heads_per_thread(few), _heads_per_thread(many))):
        return few
    return many


# ---------------------------------------------------------------- params --
def fixed_params(call: Call, slab_blocks: list, packets: bool = False) -> bytes:
    """The fixed part of Params (everything but pointers and the offset);
    ``packets``: for packet_kernel (which may walk rows head-major)."""
    s0 = call.slabs[0]
    sb, ss = s0.x_strides[0], s0.x_strides[1]
    # Tokens are walked with the smaller-stride axis inner, for locality.
    seq_inner = abs(ss) <= abs(sb) or call.batch == 1
    if seq_inner:
        n_outer, n_inner, seq_strides = call.batch, call.seqlen, (0, 1)
    else:
        n_outer, n_inner, seq_strides = call.seqlen, call.batch, (1, 0)

    def by_order(b_stride, s_stride):
        return (b_stride, s_stride) if seq_inner else (s_stride, b_stride)

    def view(strides5, hpg):
        b, s, g, h, d = strides5
        return (*by_order(b, s), g if g else hpg * h, h, d)

    fields = []
    for i in range(MAX_SLABS):
        if i < len(call.slabs):
            sl = call.slabs[i]
            fields += view(sl.x_strides, sl.heads_per_group)
            fields += view(sl.out_strides, sl.heads_per_group)
            fields += (*slab_blocks[i], sl.heads, sl.heads_per_group, int(sl.rotate),
                       *reciprocal(sl.heads),
                       int(packets and head_major(view(sl.x_strides, sl.heads_per_group),
                                                  sl.heads, sl.heads_per_group, n_inner)))
        else:
            fields += (0,) * len(_SLAB)

    tables = call.tables
    cos, sin = tables[0], tables[-1]
    pos_strides = (0, 0)
    p = call.positions
    axis_stride, n_axes = 0, 0
    if p is not None:
        st = p.strides
        if call.pos_mode == AXES:  # [axes, ...]: the rest as for one axis
            axis_stride, n_axes, st = st[0], p.shape[0], st[1:]
        if call.layout == "thd" or len(st) == 1:
            pos_strides = by_order(0, st[0])
        else:
            pos_strides = by_order(*st)
    sections = tuple(call.sections) + (0,) * (3 - len(call.sections))
    off_strides = (0, 0)
    if call.offsets is not None and call.pos_mode != VARLEN:
        off_strides = by_order(call.offsets.strides[0], 0)
    cp_chunk = call.seqlen // 2 if call.pos_mode == IMPLIED else 0
    fields += (
        len(call.slabs),
        cos.strides[0] if cos.ndim == 2 else 0, sin.strides[0] if sin.ndim == 2 else 0,
        cos.strides[-1], sin.strides[-1], call.max_position,
        *pos_strides, int(p is not None and p.dtype == "int64"),
        *off_strides, int(call.offsets is not None and call.offsets.dtype == "int64"),
        *seq_strides, axis_stride, n_axes, *sections, int(call.sections_interleaved),
        call.n_seqs, call.cp_size, call.cp_rank, cp_chunk,
        n_outer, n_inner, *reciprocal(n_inner),
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
    for flat_kernel), for tests and probes."""
    fields, packer = ((FLAT_FIXED_FIELDS, _FLAT_FIXED) if plan.spec.mapping == "flat"
                      else (FIXED_FIELDS, _FIXED))
    return dict(zip((n for n, _ in fields), packer.unpack_from(plan.buf, _DYNAMIC.size)))


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
        heads = tuple(s.heads for s in call.slabs)
        flat = None
        if spec.mapping == "heads":
            shape = (spec.rot_items + spec.tail_items, heads, call.tokens, spec.unroll,
                     _sm_count(self.device_id))
            self.grid, self.block, slab_blocks = (
                varlen_block_shape(*shape, call.n_seqs, call.source)
                if call.pos_mode == VARLEN else block_shape(*shape))
        elif spec.mapping == "flat":
            flat = flat_geometry(call)
            self.grid, self.block, slab_blocks = flat_shape(
                spec.rotary_dim // spec.vec, spec.interleaved or spec.partner_load,
                [rows for rows, _, _ in flat])
        else:
            self.grid, self.block, slab_blocks = packet_shape(spec.rot_items, heads, call.tokens)
        self.dims = (*self.grid, *self.block)
        self.kernel = None if self.empty else get_kernel(spec, self.device_id).ptr
        # The parameters with the dynamic fields zero; each launching thread
        # packs its pointers into its own copy (see own_buffer).
        self.buf = bytes(_DYNAMIC.size) + (
            flat_fixed_params(call, slab_blocks, flat) if flat is not None
            else fixed_params(call, slab_blocks, spec.mapping == "packets"))
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
    go.plan = plan  # for the benchmark's bare-launch timing and scripts/launch_cost.py
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


def shipped_specs() -> list:
    """Every specialization the launcher picks for aligned, contiguous inputs.

    The grid: dtype x head_dim {64, 80, 96, 128, 256} x rotary fraction
    {1, 1/2, 1/4} x NeoX/GPT-J x angle source (float32 tables, tables in x's
    dtype, inv_freq, angle table) x in place / out of place x position rule
    (implied, explicit, varlen, per-axis), plus the element-by-element path
    for a strided last axis; the same for one head per token with implied
    and explicit positions, and for 32 heads with implied positions. (The
    launcher picks the UNROLL 1 kernels for one head per token and for
    partial rotary in place; flat_kernel for dense slabs with implied
    positions (or explicit ones of the sequence index into a small table:
    16-bit x, no split angles) and tables, with split angles when a block's rows lie at
    several positions (few heads); packet_kernel where it can otherwise,
    with packet_kernel's twin for calls flat_kernel cannot take, and
    rope_kernel's for calls too large for it, for angles computed from
    inv_freq or freqs with 16 or more heads and for explicit positions in
    large calls.) The CPU tests compile
    all of them with NVRTC. Specs are derived by running :func:`choose_spec`
    on shape-only descriptions, so the list follows the launch policy.
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
    s = 16
    for h, dtype in itertools.product((32, 4, 1), ("float32", "float16", "bfloat16")):
        for d in SHIPPED_HEAD_DIMS:
            for frac in SHIPPED_ROTARY_FRACTIONS:
                r = int(d * frac) // 2 * 2
                sources = [("cos", "float32"), ("inv_freq", "float32"), ("freqs", "float32")]
                if dtype != "float32":
                    sources.append(("cos", dtype))
                for name, adt in sources:
                    for interleaved in (False, True):
                        for inplace in (False, True):
                            for pos_mode in ("implied", "explicit", "varlen", "axes"):
                                if h == 1 and pos_mode not in ("implied", "explicit"):
                                    continue  # the one-head kernels: a representative set
                                if h == 32 and pos_mode not in ("implied", "explicit"):
                                    continue  # flat_kernel for many heads (no split angles)
                                for last_stride in (1, 2):
                                    if last_stride == 2 and (inplace or pos_mode != "implied"):
                                        continue
                                    x = tensor((s, h, d), dtype,
                                               (h * d * last_stride, d * last_stride,
                                                last_stride))
                                    out = tensor((s, h, d), dtype)
                                    width = 1 if name == "inv_freq" else 2
                                    shape = (r // 2,) if width == 1 else (s, r // 2)
                                    kw = {name: tensor(shape, adt)}
                                    if name == "cos":
                                        kw["sin"] = tensor(shape, adt)
                                    if pos_mode == "explicit":
                                        kw["positions"] = tensor((s,), "int32")
                                    elif pos_mode == "varlen":
                                        kw["cu_seqlens"] = tensor((3,), "int32")
                                    elif pos_mode == "axes":
                                        kw["positions"] = tensor((3, s), "int32")
                                        kw["sections"] = (r // 2 - 2, 1, 1)
                                    call = check_call(x, layout="thd", interleaved=interleaved,
                                                      inplace=inplace,
                                                      out=None if inplace else out, **kw)
                                    specs.append(choose_spec(call))
                                    if pos_mode in ("implied", "explicit") and last_stride == 1:
                                        # one token: flat_kernel without split angles
                                        one = tensor((1, h, d), dtype)
                                        if pos_mode == "explicit":
                                            kw["positions"] = tensor((1,), "int32")
                                        specs.append(choose_spec(check_call(
                                            one, layout="thd", interleaved=interleaved,
                                            inplace=inplace,
                                            out=None if inplace else tensor((1, h, d), dtype),
                                            **kw)))
                                    # packet_kernel's, for calls flat_kernel cannot take
                                    specs.append(choose_spec(call, flat=False))
                                    # rope_kernel's twin, for calls of 2^31+ packets
                                    # and explicit positions in large calls
                                    specs.append(choose_spec(call, packets=False))
    # flat_kernel for q and k in one call: the same kernels compiled for two
    # slabs. (A fused QKV split copies v, which flat_kernel does not take, so
    # no flat call has three.)
    specs += [dataclasses.replace(sp, slabs=2) for sp in specs
              if sp.mapping == "flat" and sp.slabs]
    # flat_kernel asking for its table rows early in large calls (implied
    # positions, FLAT_EARLY_TABLES_BYTES), where it would ask late.
    specs += [dataclasses.replace(sp, early_tables=True) for sp in specs
              if sp.mapping == "flat" and sp.pos_mode == "implied" and flat_late_tables(
                  ITEMSIZE[sp.dtype], sp.split_angles, sp.partner_load, sp.interleaved,
                  sp.rotary_dim // sp.vec)]
    # fp32 flat_kernel loading x with an L2 evict-last policy (FLAT_X_EVICT_LAST).
    specs += [dataclasses.replace(sp, x_evict_last=True) for sp in specs
              if sp.mapping == "flat" and flat_x_evict_last_fits(
                  ITEMSIZE[sp.dtype], sp.rotary_dim, sp.head_dim, sp.partner_load)]
    return sorted(set(specs), key=repr)
