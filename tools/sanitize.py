"""Every kernel path on small inputs, for compute-sanitizer (issue 7).

    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize.py [NAME ...]

(NAME: run only the cases whose function name contains it.)

Each case runs one public function on CuPy arrays and compares the result
with the library's float64 NumPy path on the same inputs, so a run is both a
sanitizer target and a correctness check. The cases cover every position
mode (implied, explicit [s] / [b, s], varlen with empty sequences, per-axis
M-RoPE, context parallel), every angle source (fp32 tables, tables in x's
dtype, cos|sin cache, inv_freq, angle table), both pair styles, partial
rotary in and out of place, strided / unaligned / transposed views, q+k with
GQA, decode head groups, fused QKV forward and backward, positions outside
the table (NaN, never an out-of-bounds read), empty inputs, the fused q/k
RMSNorm + RoPE (both scopes, forward and backward with weight gradients) and
RoPE + KV-cache write (both cache layouts, FP8, padding and out-of-range
device slots).
tools/gpu_suite.sh runs it under memcheck, racecheck and initcheck.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cupy_rope  # noqa: E402

# Every array its own cudaMalloc: memcheck then sees an access past any
# array's end (not just past a pooled block's), and initcheck sees a read of
# an output element the kernel never wrote (CuPy's pool would hand out
# memory already written by an earlier call).
cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
rng = np.random.default_rng(20261122)


def normal(shape, dtype="float32"):
    return rng.standard_normal(shape).astype(DTYPES[dtype])


def inv_freq(r):
    return (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)


def tables(r, rows, dtype="float32"):
    theta = np.arange(rows)[:, None] * inv_freq(r).astype(np.float64)
    return np.cos(theta).astype(DTYPES[dtype]), np.sin(theta).astype(DTYPES[dtype])


def up(v):
    """float64 host copy (recursively), for the reference call."""
    if isinstance(v, np.ndarray) and (v.dtype.kind == "f" or v.dtype == BF16):
        return v.astype(np.float64)
    if isinstance(v, tuple):
        return tuple(up(a) for a in v)
    return v


def dev(v):
    if isinstance(v, np.ndarray):
        return cupy.asarray(v)
    if isinstance(v, tuple):
        return tuple(dev(a) for a in v)
    return v


def host(v):
    if isinstance(v, tuple):
        return tuple(host(a) for a in v)
    return cupy.asnumpy(v)


def compare(got, want, dtype, name, nan_ok=False):
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            compare(g, w, dtype, name, nan_ok)
        return
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    assert g.shape == w.shape, (name, g.shape, w.shape)
    if not nan_ok:
        assert not np.isnan(g).any(), f"{name}: NaN (element not written)"
    finite = ~np.isnan(w)
    assert np.array_equal(np.isnan(g), ~finite), f"{name}: NaN pattern differs"
    if finite.any():
        scale = max(np.abs(w[finite]).max(), 1e-30)
        err = np.abs(g[finite] - w[finite]).max() / scale
        assert err <= TOL[dtype], f"{name}: max error {err:.3g}"


CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def run(name, func, dtype, arrays, kwargs=None, inplace_arrays=(), nan_ok=False, views=None):
    """func(*arrays, **kwargs) on the GPU vs on float64 host copies.

    ``views``: optional function turning the device arrays into the views
    passed (strided, unaligned); the host side gets the same values.
    """
    kwargs = kwargs or {}
    d_arrays = [dev(a) for a in arrays]
    if views is not None:
        d_arrays = views(d_arrays)
        arrays = [host(a) if isinstance(a, cupy.ndarray) else a for a in d_arrays]
    d_kwargs = {k: dev(v) for k, v in kwargs.items()}
    got = func(*d_arrays, **d_kwargs)
    if inplace_arrays:
        got = tuple(d_arrays[i] for i in inplace_arrays)
        got = got[0] if len(got) == 1 else got
    ref_kwargs = {k: up(v) for k, v in kwargs.items() if k != "inplace"}
    want = func(*[up(a) for a in arrays], **ref_kwargs)
    compare(host(got), want, dtype, name, nan_ok)


@case
def layouts_sources_styles():
    n = 0
    for dtype in DTYPES:
        for layout, shape in (("bshd", (2, 19, 3, 64)), ("sbhd", (19, 2, 3, 64)),
                              ("thd", (23, 3, 64))):
            for interleaved in (False, True):
                for r in (64, 32):
                    cos, sin = tables(r, 40)
                    cos_t, sin_t = tables(r, 40, dtype)
                    sources = [
                        {"cos": cos, "sin": sin},
                        {"cos": cos_t, "sin": sin_t},
                        {"cos_sin_cache": np.concatenate([cos, sin], 1)},
                        {"inv_freq": inv_freq(r)},
                        {"freqs": np.arange(40)[:, None].astype(np.float32) * inv_freq(r)},
                    ]
                    for src in sources:
                        for inplace in (False, True):
                            kw = dict(src, layout=layout, interleaved=interleaved,
                                      rotary_dim=r, inplace=inplace)
                            run(f"{layout} {dtype} {sorted(src)} r={r}", cupy_rope.apply_rope,
                                dtype, [normal(shape, dtype)], kw,
                                inplace_arrays=(0,) if inplace else ())
                            n += 1
    return n


@case
def positions_and_offsets():
    n = 0
    cos, sin = tables(64, 300)
    for dtype in ("float32", "bfloat16"):
        x = normal((3, 17, 4, 64), dtype)
        for kw in ({"positions": rng.integers(0, 280, 17).astype(np.int32)},
                   {"positions": rng.integers(0, 280, (3, 17)).astype(np.int64)},
                   {"offsets": 5},
                   {"offsets": rng.integers(0, 200, 3).astype(np.int32)},
                   {"positions": rng.integers(0, 200, (3, 17)).astype(np.int32),
                    "offsets": rng.integers(0, 50, 3).astype(np.int64)}):
            for backward in (False, True):
                run(f"positions {dtype} {sorted(kw)}", cupy_rope.apply_rope, dtype, [x],
                    dict(kw, cos=cos, sin=sin, backward=backward))
                n += 1
    return n


@case
def flat_rows():
    """flat_kernel: dense slabs in memory order, with rows at several
    positions per block (split angles: [b, h, s, d] storage seen as bshd,
    output of the same order), NeoX rows that leave lanes idle (d80 bf16)
    or that load their partner (d96 bf16, d80 / d96 fp32, out of place),
    a last warp with rows to spare, partial rotary in place (the rotated
    packets only), q + k with GQA, an offset, and explicit positions read
    at each row's sequence index."""
    n = 0
    for dtype in ("float32", "bfloat16"):
        for d, (b, s, h) in ((64, (2, 13, 3)), (80, (3, 7, 5)), (96, (2, 5, 3)),
                             (128, (1, 5, 3))):
            cos, sin = tables(d, 40)
            for interleaved in (False, True):
                def bhsd_view(arrays):
                    (x,) = arrays
                    return [cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)]
                for views in (None, bhsd_view):
                    for inplace in (False, True):
                        run(f"flat d{d} {dtype} gptj={interleaved} bhsd={views is not None} "
                            f"inplace={inplace}", cupy_rope.apply_rope, dtype,
                            [normal((b, s, h, d), dtype)],
                            dict(cos=cos, sin=sin, interleaved=interleaved, offsets=3,
                                 inplace=inplace),
                            inplace_arrays=(0,) if inplace else (), views=views)
                        n += 1
                for r in (d // 2, d // 4):  # partial rotary in place: rotated packets only
                    run(f"flat partial r{r} d{d} {dtype} gptj={interleaved}",
                        cupy_rope.apply_rope, dtype, [normal((b, s, h, d), dtype)],
                        dict(cos=cos[:, :r // 2], sin=sin[:, :r // 2], rotary_dim=r,
                             interleaved=interleaved, offsets=3, inplace=True),
                        inplace_arrays=(0,), views=bhsd_view)
                    n += 1
                run(f"flat q+k sbhd d{d} {dtype} gptj={interleaved}", cupy_rope.apply_rope_qk,
                    dtype, [normal((s, b, 4, d), dtype), normal((s, b, 1, d), dtype)],
                    dict(cos=cos, sin=sin, layout="sbhd", interleaved=interleaved))
                n += 1
    # explicit positions that follow the sequence index alone (16-bit x):
    # thd [t] and bshd [s], read at each row's sequence index
    for d in (64, 128, 256):
        cos, sin = tables(d, 40)
        for interleaved in (False, True):
            for inplace in (False, True):
                for layout, shape, pos in (
                        ("thd", (11, 32, d), rng.integers(0, 37, 11).astype(np.int64)),
                        ("bshd", (2, 9, 16, d), rng.integers(0, 37, 9).astype(np.int32))):
                    run(f"flat positions {layout} d{d} gptj={interleaved} inplace={inplace}",
                        cupy_rope.apply_rope, "bfloat16", [normal(shape, "bfloat16")],
                        dict(cos=cos, sin=sin, positions=pos, layout=layout, offsets=3,
                             interleaved=interleaved, inplace=inplace),
                        inplace_arrays=(0,) if inplace else ())
                    n += 1
    # table rows asked for early (what large calls do), here for small ones:
    # LaunchPolicy.flat_early_tables_bytes lowered to 0
    from cupy_rope import api, launch
    with launch.override_policy(flat_early_tables_bytes=0):
        for d in (64, 128):
            cos, sin = tables(d, 40)
            for interleaved in (False, True):
                for r, inplace in ((d, False), (d, True), (d // 2, True)):
                    run(f"flat early tables d{d} r{r} gptj={interleaved} inplace={inplace}",
                        cupy_rope.apply_rope, "bfloat16", [normal((7, 2, 16, d), "bfloat16")],
                        dict(cos=cos[:, :r // 2], sin=sin[:, :r // 2], rotary_dim=r,
                             layout="sbhd", interleaved=interleaved, inplace=inplace),
                        inplace_arrays=(0,) if inplace else ())
                    n += 1
            run(f"flat early tables q+k d{d}", cupy_rope.apply_rope_qk, "bfloat16",
                [normal((7, 2, 16, d), "bfloat16"), normal((7, 2, 8, d), "bfloat16")],
                dict(cos=cos, sin=sin, layout="sbhd"))
            n += 1
        assert all(p.plan.spec.early_tables for p in api._plans.values())
    # fp32 rows in position order, out of place: x with an L2 evict-last policy
    for d in (64, 128, 256):
        cos, sin = tables(d, 40)
        for interleaved in (False, True):
            run(f"flat fp32 x evict-last sbhd d{d} gptj={interleaved}", cupy_rope.apply_rope,
                "float32", [normal((7, 2, 16, d))],
                dict(cos=cos, sin=sin, layout="sbhd", interleaved=interleaved))
            run(f"flat fp32 x evict-last q+k d{d} gptj={interleaved}", cupy_rope.apply_rope_qk,
                "float32", [normal((7, 2, 16, d)), normal((7, 2, 4, d))],
                dict(cos=cos, sin=sin, layout="sbhd", interleaved=interleaved))
            n += 2
    # every call but d256 NeoX (its fp32 rows of 64 packets load their partner)
    assert sum(p.plan.spec.x_evict_last for p in api._plans.values()) == 10
    return n


@case
def few_heads():
    """Fewer heads than LaunchPolicy.unroll: the one-head kernels (unroll 1)."""
    n = 0
    cos, sin = tables(64, 70)
    for dtype in ("float32", "bfloat16"):
        for heads in (1, 3):
            for layout, shape in (("bshd", (4, 22, heads, 64)), ("sbhd", (22, 4, heads, 64))):
                for kw in ({}, {"positions": rng.integers(0, 60, 22).astype(np.int32)},
                           {"cp_size": 3, "cp_rank": 2, "rotary_dim": 32}):
                    for inplace in (False, True):
                        run(f"few heads {layout} h{heads} {sorted(kw)}", cupy_rope.apply_rope,
                            dtype, [normal(shape, dtype)],
                            dict(kw, cos=cos[:, :16] if "rotary_dim" in kw else cos,
                                 sin=sin[:, :16] if "rotary_dim" in kw else sin,
                                 layout=layout, inplace=inplace),
                            inplace_arrays=(0,) if inplace else ())
                        n += 1
            # out= laid out differently from x (bhsd memory seen as bshd)
            x = normal((4, 22, 3, 64), dtype)
            out = cupy.empty((4, 3, 22, 64), x.dtype).transpose(0, 2, 1, 3)
            got = cupy_rope.apply_rope(dev(x), dev(cos), dev(sin), out=out)
            compare(host(got), cupy_rope.apply_rope(up(x), up(cos), up(sin)), dtype,
                    "few heads, out= with other strides")
            n += 1
    return n


@case
def varlen_and_context_parallel():
    n = 0
    cos, sin = tables(64, 400)
    for dtype in ("float16", "bfloat16"):
        # The last two: more sequence starts in a block than a warp has lanes
        # (the per-lane search of kernels/positions.cuh).
        # [1] * 2500: more than 1024 sequences, where the searching warp
        # prefetches (kernels/rope.cu) with tables.
        for lengths in ([0, 5, 0, 17, 1, 0, 40], [64], [0], [3] * 50, [1] * 2500,
                        [2] + [0] * 40 + [1] * 20 + [0] * 70 + [5] + [1] * 40,
                        [2] + [0] * 200 + [3] + [1] * 40):
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            t = int(cu[-1])
            x = normal((t, 5, 64), dtype)
            offs = rng.integers(0, 100, len(lengths)).astype(np.int32)
            for kw in ({}, {"offsets": offs}, {"inv_freq": inv_freq(64)}):
                src = {} if "inv_freq" in kw else {"cos": cos, "sin": sin}
                run(f"varlen {dtype} {lengths[:4]} {sorted(kw)}", cupy_rope.apply_rope, dtype,
                    [x], dict(kw, **src, layout="thd", cu_seqlens=cu))
                n += 1
        for cp in (2, 4):
            for rank in range(cp):
                lengths = [8 * cp, 0, 4 * cp, 2 * cp]
                cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
                x = normal((int(cu[-1]) // cp, 3, 64), dtype)
                run(f"cp thd {cp}/{rank}", cupy_rope.apply_rope, dtype, [x],
                    dict(cos=cos, sin=sin, layout="thd", cu_seqlens=cu, cp_size=cp,
                         cp_rank=rank))
                for layout, shape in (("bshd", (2, 4 * cp, 3, 64)), ("sbhd", (4 * cp, 2, 3, 64))):
                    run(f"cp {layout} {cp}/{rank}", cupy_rope.apply_rope, dtype,
                        [normal(shape, dtype)], dict(cos=cos, sin=sin, layout=layout,
                                                     cp_size=cp, cp_rank=rank))
                    n += 1
                n += 1
    return n


@case
def axes():
    n = 0
    for interleaved_sections, sections in ((False, (16, 8, 8)), (True, (8, 12, 12)),
                                           (False, (20, 12))):
        r = 2 * sum(sections)
        for layout, shape, pshape in (("bshd", (2, 11, 3, 64), (len(sections), 2, 11)),
                                      ("thd", (13, 3, 64), (len(sections), 13))):
            pos = rng.integers(0, 90, pshape).astype(np.int32)
            cos, sin = tables(r, 100)
            for src in ({"inv_freq": inv_freq(r)}, {"cos": cos, "sin": sin}):
                run(f"axes {sections} {layout}", cupy_rope.apply_rope, "bfloat16",
                    [normal(shape, "bfloat16")],
                    dict(src, positions=pos, layout=layout, sections=sections,
                         sections_interleaved=interleaved_sections))
                n += 1
    return n


@case
def strided_and_unaligned_views():
    n = 0
    cos, sin = tables(48, 30)

    def stride2(arrs):
        big = cupy.empty(arrs[0].shape[:-1] + (2 * arrs[0].shape[-1],), arrs[0].dtype)
        big[..., ::2] = arrs[0]
        return [big[..., ::2]]

    def unaligned(arrs):
        flat = cupy.empty(arrs[0].size + 1, arrs[0].dtype)
        v = flat[1:].reshape(arrs[0].shape)
        v[...] = arrs[0]
        return [v]

    def transposed(arrs):  # [b, h, s, d] memory seen as [b, s, h, d]
        return [cupy.ascontiguousarray(arrs[0].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)]

    for dtype in DTYPES:
        for views in (stride2, unaligned, transposed):
            for interleaved in (False, True):
                for inplace in (False, True):
                    run(f"{views.__name__} {dtype}", cupy_rope.apply_rope, dtype,
                        [normal((2, 9, 5, 64), dtype)],
                        dict(cos=cos, sin=sin, interleaved=interleaved, inplace=inplace),
                        inplace_arrays=(0,) if inplace else (), views=views)
                    n += 1
        # odd head_dim and strided tables
        run(f"odd sizes {dtype}", cupy_rope.apply_rope, dtype, [normal((2, 7, 3, 18), dtype)],
            dict(cos=tables(10, 10)[0], sin=tables(10, 10)[1]))
        n += 1
    return n


@case
def qk_decode_and_qkv():
    n = 0
    cache = np.concatenate(tables(128, 5000), 1)
    for dtype in ("float16", "bfloat16", "float32"):
        for hq, hk in ((32, 8), (32, 1), (28, 4), (24, 24)):
            for tokens in (1, 16, 64, 300):
                pos = rng.integers(0, 5000, tokens).astype(np.int64)
                for inplace in (False, True):
                    run(f"qk thd {hq}/{hk} t{tokens}", cupy_rope.apply_rope_qk, dtype,
                        [normal((tokens, hq, 128), dtype), normal((tokens, hk, 128), dtype)],
                        dict(cos_sin_cache=cache, positions=pos, layout="thd",
                             inplace=inplace), inplace_arrays=(0, 1) if inplace else ())
                    n += 1
            # flattened [t, h * d] views
            run(f"qk flat {hq}/{hk}", cupy_rope.apply_rope_qk, dtype,
                [normal((7, hq * 128), dtype), normal((7, hk * 128), dtype)],
                dict(cos_sin_cache=cache, positions=rng.integers(0, 5000, 7), layout="thd",
                     head_dim=128))
            n += 1
        for packing in ("concat", "grouped"):
            hq, hk, d = 8, 2, 64
            cos, sin = tables(d, 50)
            qkv = normal((2, 13, (hq + 2 * hk) * d), dtype)
            run(f"qkv {packing}", cupy_rope.apply_rope_qkv, dtype, [qkv],
                dict(cos=cos, sin=sin, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                     packing=packing))
            grads = [normal((2, 13, h, d), dtype) for h in (hq, hk, hk)]
            run(f"qkv backward {packing}", cupy_rope.apply_rope_qkv_backward, dtype, grads,
                dict(cos=cos, sin=sin, packing=packing))
            n += 2
    return n


@case
def computed_angles_past_2_24():
    """inv_freq at positions fp32 cannot hold: the kernels' fp64 reduction
    (an out-of-line call) for some lanes, the fp32 one for the others."""
    n = 0
    for dtype in ("float32", "bfloat16"):
        x = normal((2, 9, 3, 64), dtype)
        pos = np.concatenate([rng.integers(2**24, 2**30, (2, 5)),
                              rng.integers(0, 2**20, (2, 4))], 1).astype(np.int64)
        for interleaved in (False, True):
            run(f"positions past 2^24 {dtype} interleaved={interleaved}", cupy_rope.apply_rope,
                dtype, [x], {"inv_freq": inv_freq(64), "positions": pos,
                             "interleaved": interleaved})
            n += 1
    return n


@case
def outside_the_table_and_empty():
    cos, sin = tables(32, 8)
    x = normal((2, 4, 2, 32))
    pos = np.array([[0, 1, 7, 8], [-1, 3, 1000000, 2]], np.int32)
    got = host(cupy_rope.apply_rope(dev(x), dev(cos), dev(sin), positions=dev(pos)))
    bad = (pos < 0) | (pos >= 8)
    assert np.isnan(got[bad][..., :16]).all() and not np.isnan(got[~bad]).any()
    cu = np.array([0, 3, 5], np.int32)  # device cu_seqlens: token 5 is in no sequence
    got = host(cupy_rope.apply_rope(dev(normal((6, 2, 32))), dev(cos), dev(sin), layout="thd",
                                    cu_seqlens=dev(cu)))
    assert np.isnan(got[5:, :, :16]).all() and not np.isnan(got[:5]).any()
    # cp_size 2 with a device cu_seqlens whose first length (6) does not split
    # into 4 chunks: NaN for its tokens and the misaligned ones after it.
    got = host(cupy_rope.apply_rope(dev(normal((7, 2, 32))), dev(cos), dev(sin), layout="thd",
                                    cu_seqlens=dev(np.array([0, 6, 14], np.int32)), cp_size=2,
                                    cp_rank=1))
    assert np.isnan(got[..., :16]).all()
    for shape in ((0, 4, 2, 32), (2, 0, 2, 32), (2, 4, 0, 32)):
        cupy_rope.apply_rope(cupy.zeros(shape, np.float32), dev(cos), dev(sin))
    return 6


def _norm_backward(name, dtype, arrays, kw):
    """apply_qk_norm_rope_backward(*arrays, **kw) on the GPU against float64."""
    from cupy_rope import qk_norm

    want = qk_norm.apply_qk_norm_rope_backward(*[up(a) for a in arrays],
                                               **{a: up(v) for a, v in kw.items()})
    got = qk_norm.apply_qk_norm_rope_backward(*[dev(a) for a in arrays],
                                              **{a: dev(v) for a, v in kw.items()})
    for g, w in zip(got, want):
        if w is not None:
            compare(host(g), w, dtype, name)


@case
def qk_norm_rope():
    """The fused q/k RMSNorm + RoPE: both scopes, weight modes, partial
    rotary, thd with cu_seqlens; the backward with its weight gradients."""
    from cupy_rope import qk_norm

    n = 0
    for dtype in ("bfloat16", "float32"):
        for scope, mode, d, r in (("head", "w", 128, 128), ("head", "1+w", 80, 40),
                                  ("token", "w", 64, 64), ("head", "none", 256, 128)):
            hq, hk, t = 6, 2, 37
            cos, sin = tables(r, 64)
            cu = np.array([0, 5, 5, 30, t], np.int32)
            wq = None if mode == "none" else normal((d if scope == "head" else hq * d,), dtype)
            wk = None if mode == "none" else normal((d if scope == "head" else hk * d,), dtype)
            kw = dict(cos=cos, sin=sin, layout="thd", cu_seqlens=cu, rotary_dim=r,
                      norm_scope=scope, weight_mode=mode)
            q, k = normal((t, hq, d), dtype), normal((t, hk, d), dtype)
            run(f"norm {scope} {mode} d{d}", qk_norm.apply_qk_norm_rope, dtype,
                [q, k, wq, wk], kw)
            grads = [normal((t, hq, d), dtype), normal((t, hk, d), dtype)]
            _norm_backward(f"norm backward {scope} {mode} d{d}", dtype, grads + [q, k, wq, wk],
                           kw)
            n += 2
    return n


@case
def qk_norm_rope_flat():
    """The fused norm's flat kernels (dense rows, implied positions): per
    head with 4 rows a thread and with 1 (a warp partly past the rows), per token
    over several warps a token; forward and backward; in place on a packed
    qkv (explicit positions, rows apart by a gap)."""
    from cupy_rope import norm_launch, qk_norm

    n = 0
    cases = (("bfloat16", "head", "w", 128, False, (3, 9, 16, 8)),
             ("bfloat16", "head", "1+w", 128, True, (1, 3, 5, 3)),
             ("float32", "head", "1+w", 64, True, (2, 7, 5, 3)),
             ("bfloat16", "token", "w", 128, False, (2, 5, 40, 40)),
             ("float32", "token", "none", 64, True, (3, 1, 8, 8)))
    for dtype, scope, mode, d, interleaved, (b, s, hq, hk) in cases:
        cos, sin = tables(d, 16)
        wq = None if mode == "none" else normal((d if scope == "head" else hq * d,), dtype)
        wk = None if mode == "none" else normal((d if scope == "head" else hk * d,), dtype)
        kw = dict(cos=cos, sin=sin, interleaved=interleaved, norm_scope=scope, weight_mode=mode)
        q, k = normal((b, s, hq, d), dtype), normal((b, s, hk, d), dtype)
        name = f"norm flat {scope} {mode} d{d} {hq}/{hk} heads"
        norm_launch._plans.clear()
        run(name, qk_norm.apply_qk_norm_rope, dtype, [q, k, wq, wk], kw)
        assert all(isinstance(p.spec, norm_launch.NormFlatSpec)  # not norm_rope_kernel
                   for p in norm_launch._plans.values()), name
        grads = [normal((b, s, hq, d), dtype), normal((b, s, hk, d), dtype)]
        _norm_backward(f"{name} backward", dtype, grads + [q, k, wq, wk], kw)
        n += 2
    # in place on the q and k of a packed projection (tokens apart by v too)
    cos, sin = tables(128, 16)
    qkv, w = normal((9, (16 + 2 * 8) * 128), "bfloat16"), normal((128,), "bfloat16")
    kw = dict(cos=cos, sin=sin, positions=np.array([3, 0, 15, 2, 2, 7, 1, 9, 4], np.int32),
              layout="thd", num_q_heads=16, num_kv_heads=8, inplace=True)
    got = dev(qkv)
    qk_norm.apply_qkv_norm_rope(got, dev(w), dev(w), **{a: dev(v) for a, v in kw.items()})
    want = up(qkv)
    qk_norm.apply_qkv_norm_rope(want, up(w), up(w), **{a: up(v) for a, v in kw.items()})
    compare(host(got), want, "bfloat16", "norm flat packed qkv in place")
    return n + 1


@case
def rope_and_cache():
    """RoPE + KV-cache write: NHD and HND, bf16 and FP8 caches, padding
    tokens and device slots past the cache (skipped, never written); the
    decode form (rope_cache_flat_kernel) and the general kernel."""
    from cupy_rope import kv_cache

    n = 0
    hq, hk, d, bs, blocks, t = 8, 2, 128, 16, 6, 9
    cos, sin = tables(d, 200)
    slots = np.array([3, 17, -1, 40, 95, 2, -1, 60, 4000], np.int64)  # 4000: past the cache
    pos = rng.integers(0, 200, t).astype(np.int64)
    for layout, fmt, flat in itertools.product(("NHD", "HND"), ("bfloat16", "float8_e4m3fn"),
                                               (True, False)):
        kv_cache.FLAT_DECODE = flat
        kv_cache.clear_plans()
        shape = (blocks, bs, hk, d) if layout == "NHD" else (blocks, hk, bs, d)
        q, k, v = (normal((t, h, d), "bfloat16") for h in (hq, hk, hk))
        fp8 = fmt != "bfloat16"
        kw = dict(cos=cos, sin=sin, positions=pos, cache_layout=layout)
        if fp8:
            kw.update(cache_dtype=fmt, k_scale=0.5, v_scale=0.25)
        store = np.uint8 if fp8 else BF16
        fill = np.full(shape, 0x7F if fp8 else np.nan, store)
        d_caches = [cupy.asarray(fill), cupy.asarray(fill)]
        d_q = kv_cache.apply_rope_and_cache(*[cupy.asarray(a) for a in (q, k, v)],
                                            *d_caches, cupy.asarray(slots),
                                            **{a: dev(b) for a, b in kw.items()})
        ref_slots = np.where(slots < blocks * bs, slots, -1)  # the host refuses 4000
        h_caches = [fill.copy(), fill.copy()]
        h_q = kv_cache.apply_rope_and_cache(q, k, v, *h_caches, ref_slots, **kw)
        compare(host(d_q), h_q, "bfloat16", f"cache q {layout} {fmt}")
        for got, want in zip(d_caches, h_caches):
            got = host(got)
            if fp8:
                assert np.array_equal(got, want), f"cache {layout} {fmt}: FP8 bits differ"
            else:
                compare(got, want, "bfloat16", f"cache {layout} {fmt}", nan_ok=True)
        assert [p.plan.spec.flat for p in kv_cache._plans.values()] == [flat], "kernel not taken"
        n += 1
    kv_cache.FLAT_DECODE = True
    kv_cache.clear_plans()
    # The prefill path (several heads a thread; forced on few tokens by a zero
    # blocks-per-SM threshold), on strided token rows, partial rotary, varlen
    # and an e5m2 cache.
    from cupy_rope import launch

    t, r = 40, 64
    cos, sin = tables(r, 64)
    cu = np.array([0, 7, 7, 40], np.int32)
    wide = normal((t, hq + 2 * hk + 1, d), "bfloat16")  # q, k, v as views of one array
    q, k, v = wide[:, :hq], wide[:, hq:hq + hk], wide[:, hq + hk:hq + 2 * hk]
    slots = rng.permutation(blocks * bs)[:t].astype(np.int64)
    kw = dict(cos=cos, sin=sin, layout="thd", cu_seqlens=cu, rotary_dim=r,
              cache_dtype="float8_e5m2", k_scale=2.0, v_scale=0.5)
    fill = np.full((blocks, bs, hk, d), 0x7F, np.uint8)
    with launch.override_policy(blocks_per_sm=0):
        d_wide = cupy.asarray(wide)
        d_caches = [cupy.asarray(fill), cupy.asarray(fill)]
        d_q = kv_cache.apply_rope_and_cache(d_wide[:, :hq], d_wide[:, hq:hq + hk],
                                            d_wide[:, hq + hk:hq + 2 * hk], *d_caches,
                                            cupy.asarray(slots),
                                            **{a: dev(b) for a, b in kw.items()})
    h_caches = [fill.copy(), fill.copy()]
    h_q = kv_cache.apply_rope_and_cache(q, k, v, *h_caches, slots, **kw)
    compare(host(d_q), h_q, "bfloat16", "cache prefill q")
    for got, want in zip(d_caches, h_caches):
        assert np.array_equal(host(got), want), "cache prefill: FP8 bits differ"
    return n + 1 + rope_and_cache_norm()


def rope_and_cache_norm() -> int:
    """The cache op with the per-head q/k RMSNorm: an FP8 cache with padding
    tokens and a device slot past the cache (decode), and partial rotary
    with 1 + w on a bf16 HND cache (the prefill path)."""
    from cupy_rope import kv_cache, launch

    hq, hk, d, bs, blocks = 8, 2, 128, 16, 6
    cases = [(9, 128, "NHD", "float8_e4m3fn", "w", "before_weight",
              np.array([3, 17, -1, 40, 95, 2, -1, 60, 4000], np.int64)),
             (40, 64, "HND", "bfloat16", "1+w", "after_weight",
              rng.permutation(blocks * bs)[:40].astype(np.int64))]
    for t, r, layout, fmt, mode, rounding, slots in cases:
        cos, sin = tables(r, 200)
        q, k, v = (normal((t, h, d), "bfloat16") for h in (hq, hk, hk))
        wq, wk = (normal((d,), "bfloat16") for _ in range(2))
        fp8 = fmt != "bfloat16"
        kw = dict(cos=cos, sin=sin, positions=rng.integers(0, 200, t).astype(np.int64),
                  cache_layout=layout, rotary_dim=r, weight_mode=mode, rounding=rounding)
        if fp8:
            kw.update(cache_dtype=fmt, k_scale=0.5, v_scale=0.25)
        shape = (blocks, bs, hk, d) if layout == "NHD" else (blocks, hk, bs, d)
        fill = np.full(shape, 0x7F if fp8 else np.nan, np.uint8 if fp8 else BF16)
        d_caches = [cupy.asarray(fill), cupy.asarray(fill)]
        with launch.override_policy(blocks_per_sm=0 if t > 9 else launch.POLICY.blocks_per_sm):
            d_q = kv_cache.apply_rope_and_cache(
                *[cupy.asarray(a) for a in (q, k, v)], *d_caches, cupy.asarray(slots),
                q_weight=dev(wq), k_weight=dev(wk), **{a: dev(b) for a, b in kw.items()})
        h_caches = [fill.copy(), fill.copy()]
        h_q = kv_cache.apply_rope_and_cache(q, k, v, *h_caches,
                                            np.where(slots < blocks * bs, slots, -1),
                                            q_weight=wq, k_weight=wk, **kw)
        compare(host(d_q), h_q, "bfloat16", f"cache norm q {layout} {fmt}")
        for got, want in zip(d_caches, h_caches):
            got = host(got)
            if fp8:  # fp32 and float64 statistics may round a value to the next FP8 code
                steps = np.abs(got.astype(np.int64) - want.astype(np.int64))
                assert steps.max() <= 1, f"cache norm {layout} {fmt}: FP8 codes differ"
            else:
                compare(got, want, "bfloat16", f"cache norm {layout} {fmt}", nan_ok=True)
    return len(cases)


def main(names=()) -> int:
    """Run every case, or those whose function name contains one of ``names``."""
    total = 0
    for fn in CASES:
        if names and not any(n in fn.__name__ for n in names):
            continue
        n = fn()
        print(f"{fn.__name__}: {n} calls OK", flush=True)
        total += n
    cupy.cuda.runtime.deviceSynchronize()
    print(f"sanitize.py: {total} calls, all match the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
