"""Packed varlen (thd), context parallel, q+k in one launch, fused QKV split (GPU).

Every result is compared with the float64 reference (cupy_rope.reference.rotate)
on positions built here independently of the library's position rules.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from helpers import assert_close, np_dtype
from cupy_rope import reference
from gpu_util import bits, full_nan, to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
STYLES = pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])


def inv_freq_for(rng, rotary_dim):
    f = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    return (f * rng.uniform(0.5, 1.5, f.shape)).astype(np.float32)


def tables(inv_freq, rows):
    theta = (np.arange(rows)[:, None] * inv_freq.astype(np.float64)).astype(np.float32)
    return np.cos(theta), np.sin(theta)


def expected(x_bshd, pos_bs, inv_freq, rotary_dim, interleaved, backward, source="inv_freq"):
    """float64 rotation of x [b, s, h, d] at integer positions [b, s]."""
    x = np.asarray(x_bshd).astype(np.float64)
    if source == "inv_freq":
        theta = pos_bs[..., None].astype(np.float64) * inv_freq.astype(np.float64)
        c, s = np.cos(theta), np.sin(theta)
    else:  # float32 tables, as the kernel reads them
        cos, sin = tables(inv_freq, int(pos_bs.max()) + 1 if pos_bs.size else 1)
        c, s = cos[pos_bs].astype(np.float64), sin[pos_bs].astype(np.float64)
    return reference.rotate(x, c, s, rotary_dim, interleaved, backward)


def angle_kw(source, inv_freq, rows):
    if source == "inv_freq":
        return {"inv_freq": to_device(inv_freq)}
    cos, sin = tables(inv_freq, rows)
    if source == "cache":
        return {"cos_sin_cache": to_device(np.concatenate([cos, sin], axis=1))}
    return {"cos": to_device(cos), "sin": to_device(sin)}


def random_lengths(rng, n_seqs, mean):
    lengths = rng.integers(0, 2 * mean + 1, n_seqs)
    lengths[rng.random(n_seqs) < 0.15] = 0  # empty sequences are legal
    return lengths


def check_tail_and_input(got, x, rotary_dim, x_dev_after, inplace):
    assert np.array_equal(bits(got[..., rotary_dim:]), bits(x[..., rotary_dim:]))
    if not inplace:
        assert np.array_equal(bits(to_host(x_dev_after)), bits(x))


# ------------------------------------------------------------------ thd --
@pytest.mark.parametrize("n_seqs", [1, 7, 128, 2401])
@pytest.mark.parametrize("dtype", DTYPES)
@STYLES
def test_thd_cu_seqlens(rng, n_seqs, dtype, interleaved):
    d, r, h = 64, 48, 3
    lengths = random_lengths(rng, n_seqs, 6 if n_seqs > 100 else 40)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(cu[-1])
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    offsets = rng.integers(0, 100, n_seqs).astype(np.int64)
    pos_off = pos + np.repeat(offsets, lengths)
    x = rng.standard_normal((t, h, d)).astype(np_dtype(dtype))
    inv_freq = inv_freq_for(rng, r)
    rows = int(pos_off.max(initial=0)) + 1
    for source in ("inv_freq", "table"):
        for with_offsets in (False, True):
            p = pos_off if with_offsets else pos
            for backward in (False, True):
                want = expected(x[None], p[None], inv_freq, r, interleaved, backward, source)[0]
                for mode in ("new", "out", "inplace"):
                    x_dev = to_device(x)
                    kw = dict(layout="thd", cu_seqlens=to_device(cu), interleaved=interleaved,
                              backward=backward, **angle_kw(source, inv_freq, rows))
                    if with_offsets:
                        kw["offsets"] = to_device(offsets)
                    if mode == "inplace":
                        y = cupy_rope.apply_rope(x_dev, inplace=True, **kw)
                        assert y is x_dev
                    elif mode == "out":
                        out = full_nan(x.shape, dtype)
                        y = cupy_rope.apply_rope(x_dev, out=out, **kw)
                        assert y is out
                    else:
                        y = cupy_rope.apply_rope(x_dev, **kw)
                    got = to_host(y)
                    what = f"{source} offsets={with_offsets} bwd={backward} {mode}"
                    assert_close(got[..., :r], want[..., :r], dtype, what)
                    check_tail_and_input(got, x, r, x_dev, mode == "inplace")


def test_thd_host_cu_seqlens_and_explicit_positions(rng):
    """NumPy cu_seqlens are checked and uploaded; explicit per-token positions."""
    d, h = 128, 4
    lengths = np.array([5, 0, 17, 1, 9])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = rng.standard_normal((int(cu[-1]), h, d)).astype(np.float32)
    inv_freq = inv_freq_for(rng, d)
    pos = np.concatenate([np.arange(n) for n in lengths])
    want = expected(x[None], pos[None], inv_freq, d, False, False)[0]
    got = cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq), layout="thd",
                               cu_seqlens=cu)
    assert_close(to_host(got), want, "float32")
    explicit = rng.integers(0, 5000, len(pos)).astype(np.int32)
    got = cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq), layout="thd",
                               positions=to_device(explicit), offsets=3)
    assert_close(to_host(got), expected(x[None], explicit[None] + 3, inv_freq, d, False,
                                        False)[0], "float32")


@pytest.mark.parametrize("tokens,d", [(1, 4), (2, 8), (3, 16), (5, 64), (40, 8)])
def test_thd_blocks_smaller_than_a_warp(rng, tokens, d):
    """Blocks of fewer than 32 threads still find their sequences."""
    x = rng.standard_normal((tokens, 1, d)).astype(np.float32)
    cuts = np.sort(rng.choice(np.arange(tokens + 1), 3))
    cu = np.concatenate([[0], cuts, [tokens]]).astype(np.int32)
    inv_freq = inv_freq_for(rng, d)
    pos = np.concatenate([np.arange(n) for n in np.diff(cu)])
    got = cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq), layout="thd",
                               cu_seqlens=to_device(cu))
    assert_close(to_host(got), expected(x[None], pos[None], inv_freq, d, False, False)[0],
                 "float32")


@pytest.mark.parametrize("source", ["inv_freq", "table"])
@pytest.mark.parametrize("h,d", [(1, 8), (4, 64), (32, 128)])
def test_thd_many_sequence_starts_in_one_block(rng, h, d, source):
    """Blocks spanning more sequence starts than a warp has lanes (runs of
    empty and one-token sequences, up to 200 in a row) take the per-lane
    search; the others the one-probe count. Both must give every token its
    own sequence. (1677 sequences: with tables the searching warp also
    prefetches, kernels/rope.cu.)"""
    runs = [3, *[0] * 40, *[1] * 20, *[0] * 70, 5, *[1] * 33, 0, 2, *[1] * 90, 0, 0, 17,
            *[0] * 33, *[1] * 64, 7, *[0] * 200, 4]
    lengths = np.array(runs * 3)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = rng.standard_normal((int(cu[-1]), h, d)).astype(np.float32)
    inv_freq = inv_freq_for(rng, d)
    pos = np.concatenate([np.arange(n) for n in lengths])
    offsets = rng.integers(0, 50, len(lengths)).astype(np.int32)
    pos_off = pos + np.repeat(offsets, lengths)
    for with_offsets in (False, True):
        kw = {"offsets": to_device(offsets)} if with_offsets else {}
        out = full_nan(x.shape, "float32")
        p = pos_off if with_offsets else pos
        cupy_rope.apply_rope(to_device(x), layout="thd", cu_seqlens=to_device(cu), out=out,
                             **angle_kw(source, inv_freq, int(p.max()) + 1), **kw)
        assert_close(to_host(out), expected(x[None], p[None], inv_freq, d, False, False, source)[0],
                     "float32", f"offsets={with_offsets}")


def test_thd_device_cu_seqlens_past_the_tokens_give_nan(rng):
    """A device cu_seqlens that covers fewer tokens than x: NaN, no stray access."""
    x = rng.standard_normal((10, 2, 16)).astype(np.float32)
    cu = to_device(np.array([0, 3, 7], np.int32))  # tokens 7..9 in no sequence
    y = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(np.ones(8, np.float32)),
                                     layout="thd", cu_seqlens=cu))
    assert not np.isnan(y[:7]).any() and np.isnan(y[7:]).all()


@pytest.mark.parametrize("cu", [[3, 3, 8], [3] * 34 + [8], [3] * 34 + [11], [3] * 300 + [8],
                                [3] * 300 + [11], [0]],
                         ids=["probe", "search", "search-long", "search-300", "search-300-long",
                              "no-sequences"])
def test_thd_device_cu_seqlens_starting_after_token_0(rng, cu):
    """Device cu_seqlens with cu_seqlens[0] > 0 (the host refuses them): the
    tokens before it get NaN, the others their own positions, whether the
    block counts the probed starts or searches (over 32 starts in a block;
    with 300 equal starts the search for the block's last sequence takes
    several steps)."""
    t = max(cu[-1], 5)
    x = rng.standard_normal((t, 1, 16)).astype(np.float32)
    inv = inv_freq_for(rng, 16)
    y = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv), layout="thd",
                                     cu_seqlens=to_device(np.array(cu, np.int32))))
    covered = np.arange(t) >= cu[0]
    covered &= np.arange(t) < cu[-1]
    assert np.isnan(y[~covered]).all()
    pos = np.arange(t)[covered] - cu[0]  # one non-empty sequence, starting at cu[0]
    assert_close(y[covered], expected(x[covered][None], pos[None], inv, 16, False, False)[0],
                 "float32")


def test_thd_device_cu_seqlens_not_splitting_for_cp_give_nan(rng):
    """cp_size=2 with device cu_seqlens whose first length (6) is not a multiple
    of 2 * cp_size: that sequence's tokens (and the next ones, now misaligned)
    get NaN, never wrong positions; a valid set gives numbers."""
    x = rng.standard_normal((7, 2, 16)).astype(np.float32)
    inv = to_device(np.full(8, 0.1, np.float32))
    bad = to_device(np.array([0, 6, 14], np.int32))
    y = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=inv, layout="thd", cu_seqlens=bad,
                                     cp_size=2, cp_rank=1))
    assert np.isnan(y[..., :16]).all()
    good = to_device(np.array([0, 8, 12], np.int32))
    y = to_host(cupy_rope.apply_rope(to_device(x[:6]), inv_freq=inv, layout="thd",
                                     cu_seqlens=good, cp_size=2, cp_rank=1))
    assert not np.isnan(y).any()


# --------------------------------------------------------- context parallel --
def cp_local_index(s_full, cp_size, rank):
    """Indices of the full sequence that rank holds, in local order."""
    c = s_full // (2 * cp_size)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * cp_size - 1 - rank) * c, (2 * cp_size - rank) * c)])


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_context_parallel_matches_full_sequence(rng, cp_size, layout, dtype):
    """Rotate the full sequence, slice the rank's chunks: equal to the rank's call."""
    d, h, b = 64, 2, 2
    inv_freq = inv_freq_for(rng, d)
    if layout == "thd":
        lengths = rng.integers(0, 6, 5) * 2 * cp_size
        lengths[1] = 0
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        full = rng.standard_normal((int(cu[-1]), h, d)).astype(np_dtype(dtype))
        full_pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    else:
        s_full = 8 * cp_size
        full = rng.standard_normal((b, s_full, h, d)).astype(np_dtype(dtype))
    for interleaved in (False, True):
        for backward in (False, True):
            for rank in range(cp_size):
                if layout == "thd":
                    want_full = expected(full[None], full_pos[None], inv_freq, d, interleaved,
                                         backward, "table")[0]
                    idx = np.concatenate([cu[i] + cp_local_index(int(n), cp_size, rank)
                                          for i, n in enumerate(lengths)]).astype(np.int64)
                    local, want = full[idx], want_full[idx]
                    kw = {"cu_seqlens": to_device(cu)}
                else:
                    pos = np.broadcast_to(np.arange(full.shape[1]), full.shape[:2])
                    want_full = expected(full, pos, inv_freq, d, interleaved, backward, "table")
                    idx = cp_local_index(full.shape[1], cp_size, rank)
                    local, want = full[:, idx], want_full[:, idx]
                    if layout == "sbhd":
                        local, want = local.transpose(1, 0, 2, 3), want.transpose(1, 0, 2, 3)
                    kw = {}
                rows = 8 * cp_size if layout != "thd" else int(cu[-1]) + 1
                got = cupy_rope.apply_rope(to_device(np.ascontiguousarray(local)), layout=layout,
                                           cp_size=cp_size, cp_rank=rank,
                                           interleaved=interleaved, backward=backward,
                                           **angle_kw("table", inv_freq, rows), **kw)
                assert_close(to_host(got), want, dtype,
                             f"{layout} cp={cp_size} rank={rank} bwd={backward}")


# -------------------------------------------------------------------- q+k --
HEADS = [(32, 8), (32, 1), (24, 24), (28, 4)]


def make_qk(rng, layout, shape_tok, hq, hk, d, dtype):
    q = rng.standard_normal(shape_tok + (hq, d)).astype(np_dtype(dtype))
    k = rng.standard_normal(shape_tok + (hk, d)).astype(np_dtype(dtype))
    return q, k


def to_bshd(a, layout):
    if layout == "sbhd":
        return a.transpose(1, 0, 2, 3)
    if layout in ("thd", "thd_flat"):
        return a[None]
    return a


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd", "thd_flat"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_one_launch(rng, hq, hk, layout, dtype):
    d, r = 128, 128
    shape_tok = {"bshd": (2, 9), "sbhd": (9, 2), "thd": (37,), "thd_flat": (37,)}[layout]
    q, k = make_qk(rng, layout, shape_tok, hq, hk, d, dtype)
    inv_freq = inv_freq_for(rng, r)
    b, s = to_bshd(q, layout).shape[:2]
    call_layout = "thd" if layout.startswith("thd") else layout
    if call_layout == "thd":
        pos = rng.integers(0, 300, s).astype(np.int64)
        pos_kw = {"positions": to_device(pos)}
        pos_bs = pos[None]
    else:
        pos_bs = np.broadcast_to(np.arange(s) + 11, (b, s))
        pos_kw = {"offsets": 11}
    for interleaved in (False, True):
        for backward in (False, True):
            want_q = expected(to_bshd(q, layout), pos_bs, inv_freq, r, interleaved, backward,
                              "table")
            want_k = expected(to_bshd(k, layout), pos_bs, inv_freq, r, interleaved, backward,
                              "table")
            for mode in ("new", "out", "inplace"):
                qd, kd = to_device(q), to_device(k)
                kw = dict(layout=call_layout, interleaved=interleaved, backward=backward,
                          **pos_kw, **angle_kw("cache", inv_freq, 320))
                args = (qd, kd)
                if layout == "thd_flat":
                    args = (qd.reshape(s, hq * d), kd.reshape(s, hk * d))
                    kw["head_dim"] = d
                if mode == "inplace":
                    yq, yk = cupy_rope.apply_rope_qk(*args, inplace=True, **kw)
                    assert yq is args[0] and yk is args[1]
                elif mode == "out":
                    oq, ok = full_nan(args[0].shape, dtype), full_nan(args[1].shape, dtype)
                    yq, yk = cupy_rope.apply_rope_qk(*args, out_q=oq, out_k=ok, **kw)
                    assert yq is oq and yk is ok
                else:
                    yq, yk = cupy_rope.apply_rope_qk(*args, **kw)
                what = f"{layout} {hq}/{hk} {mode} bwd={backward} gptj={interleaved}"
                got_q = to_bshd(to_host(yq).reshape(q.shape), layout)
                got_k = to_bshd(to_host(yk).reshape(k.shape), layout)
                assert_close(got_q, want_q, dtype, "q " + what)
                assert_close(got_k, want_k, dtype, "k " + what)
                if mode != "inplace":
                    assert np.array_equal(bits(to_host(qd)), bits(q))
                    assert np.array_equal(bits(to_host(kd)), bits(k))


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_qk_decode_token_major(rng, tokens):
    """vLLM-style decode: [t, h * d] views, positions [t] into a cos/sin cache, in place."""
    import cupy

    hq, hk, d = 32, 8, 128
    qkv = cupy.asarray(rng.standard_normal((tokens, (hq + 2 * hk) * d)).astype(np.float16))
    before = to_host(qkv)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]  # strided views of one buffer
    pos = rng.integers(0, 4000, tokens).astype(np.int64)
    inv_freq = inv_freq_for(rng, d)
    cos, sin = tables(inv_freq, 4096)
    cache = to_device(np.concatenate([cos, sin], axis=1))
    cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=to_device(pos),
                            layout="thd", head_dim=d, inplace=True)
    after = to_host(qkv)
    for lo, n in ((0, hq), (hq, hk)):
        x = before[:, lo * d:(lo + n) * d].reshape(tokens, n, d)
        want = expected(x[None], pos[None], inv_freq, d, False, False, "table")[0]
        assert_close(after[:, lo * d:(lo + n) * d].reshape(tokens, n, d), want, "float16")
    assert np.array_equal(bits(after[:, (hq + hk) * d:]), bits(before[:, (hq + hk) * d:]))


# -------------------------------------------------------------- fused QKV --
def pack(q, k, v, packing):
    """q [.., hq, d], k, v [.., hk, d] -> [.., hq + 2 hk, d] in ``packing`` order."""
    if packing == "concat":
        return np.concatenate([q, k, v], axis=-2)
    hq, hk = q.shape[-2], k.shape[-2]
    g = hq // hk
    qg = q.reshape(q.shape[:-2] + (hk, g, q.shape[-1]))
    return np.concatenate([qg, k[..., None, :], v[..., None, :]], axis=-2).reshape(
        q.shape[:-2] + (hq + 2 * hk, q.shape[-1]))


@pytest.mark.parametrize("packing", ["concat", "grouped"])
@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_split(rng, packing, hq, hk, layout, dtype):
    d, r = 96, 48
    shape_tok = {"bshd": (2, 7), "sbhd": (7, 2), "thd": (23,)}[layout]
    q = rng.standard_normal(shape_tok + (hq, d)).astype(np_dtype(dtype))
    k = rng.standard_normal(shape_tok + (hk, d)).astype(np_dtype(dtype))
    v = rng.standard_normal(shape_tok + (hk, d)).astype(np_dtype(dtype))
    packed = pack(q, k, v, packing)
    inv_freq = inv_freq_for(rng, r)
    b, s = to_bshd(q, layout).shape[:2]
    if layout == "thd":
        lengths = np.array([10, 0, 13])
        kw_pos = {"cu_seqlens": to_device(np.array([0, 10, 10, 23], np.int32))}
        pos_bs = np.concatenate([np.arange(n) for n in lengths])[None]
    else:
        kw_pos = {}
        pos_bs = np.broadcast_to(np.arange(s), (b, s))
    for interleaved in (False, True):
        want_q = expected(to_bshd(q, layout), pos_bs, inv_freq, r, interleaved, False)
        want_k = expected(to_bshd(k, layout), pos_bs, inv_freq, r, interleaved, False)
        kw = dict(layout=layout, interleaved=interleaved, inv_freq=to_device(inv_freq), **kw_pos)
        for flat in (False, True):
            src = packed.reshape(shape_tok + (-1,)) if flat else packed
            src_dev = to_device(src)
            yq, yk, yv = cupy_rope.apply_rope_qkv(src_dev, num_q_heads=hq, num_kv_heads=hk,
                                                  packing=packing, **kw)
            what = f"{packing} flat={flat} gptj={interleaved}"
            assert_close(to_bshd(to_host(yq), layout), want_q, dtype, "q " + what)
            assert_close(to_bshd(to_host(yk), layout), want_k, dtype, "k " + what)
            assert np.array_equal(bits(to_host(yv)), bits(v)), what
            assert np.array_equal(bits(to_host(src_dev)), bits(src))
            # tails of q and k copied bit-exact
            assert np.array_equal(bits(to_host(yq)[..., r:]), bits(q[..., r:]))
        # backward: the packed gradient of (dq, dk, dv)
        dq = rng.standard_normal(q.shape).astype(q.dtype)
        dk = rng.standard_normal(k.shape).astype(k.dtype)
        dv = rng.standard_normal(v.shape).astype(v.dtype)
        want = pack(
            to_layout(expected(to_bshd(dq, layout), pos_bs, inv_freq, r, interleaved, True),
                      layout),
            to_layout(expected(to_bshd(dk, layout), pos_bs, inv_freq, r, interleaved, True),
                      layout),
            dv.astype(np.float64), packing)
        got = cupy_rope.apply_rope_qkv_backward(to_device(dq), to_device(dk), to_device(dv),
                                                packing=packing, **kw)
        assert got.shape == shape_tok + ((hq + 2 * hk) * d,)
        assert_close(to_host(got).reshape(want.shape), want, dtype, "backward " + packing)
        out = full_nan(packed.shape, dtype)
        assert cupy_rope.apply_rope_qkv_backward(to_device(dq), to_device(dk), to_device(dv),
                                                 packing=packing, out=out, **kw) is out
        assert_close(to_host(out), want, dtype, "backward out= " + packing)


def to_layout(a_bshd, layout):
    if layout == "sbhd":
        return a_bshd.transpose(1, 0, 2, 3)
    if layout == "thd":
        return a_bshd[0]
    return a_bshd


def test_plan_cache_reuses_and_revalidates(rng):
    """A cached signature with new pointers: still correct; a new offset is re-checked."""
    import cupy

    from cupy_rope import api

    d = 64
    inv_freq = inv_freq_for(rng, d)
    cos, sin = (to_device(t) for t in tables(inv_freq, 40))
    for i in range(3):
        x = rng.standard_normal((2, 8, 3, d)).astype(np.float32)
        y = cupy_rope.apply_rope(to_device(x), cos, sin, offsets=i)
        pos = np.broadcast_to(np.arange(8) + i, (2, 8))
        assert_close(to_host(y), expected(x, pos, inv_freq, d, False, False, "table"), "float32")
    n = len(api._plans)
    with pytest.raises(ValueError, match="cos: the table has 40 rows"):
        cupy_rope.apply_rope(to_device(x), cos, sin, offsets=33)
    assert len(api._plans) == n
    # out=x is refused and caches nothing; a plan made with cos is sin is not
    # reused for separate tables
    x1 = rng.standard_normal((2, 8, 3, d)).astype(np.float32)
    a1 = to_device(x1)
    with pytest.raises(ValueError, match="out: is x itself"):
        cupy_rope.apply_rope(a1, cos, sin, out=a1)
    x2 = rng.standard_normal((2, 8, 3, d)).astype(np.float32)
    a2, y2 = to_device(x2), full_nan(x2.shape, "float32")
    assert cupy_rope.apply_rope(a2, cos, sin, out=y2) is y2
    want = expected(x2, np.broadcast_to(np.arange(8), (2, 8)), inv_freq, d, False, False, "table")
    assert_close(to_host(y2), want, "float32")
    assert np.array_equal(to_host(a2), x2)
    same = to_device(np.ones((40, d // 2), np.float32))
    cupy_rope.apply_rope(a2, same, same, out=y2)
    assert cupy_rope.apply_rope(a2, cos, sin, out=y2) is y2
    assert_close(to_host(y2), want, "float32")
    # overlapping out on a cached signature is still refused
    buf = cupy.zeros(2 * 8 * 3 * d + d, cupy.float32)
    a = buf[:-d].reshape(2, 8, 3, d)
    cupy_rope.apply_rope(a, cos, sin, out=cupy.empty_like(a))
    with pytest.raises(ValueError, match="out: overlaps x"):
        cupy_rope.apply_rope(a, cos, sin, out=buf[d:].reshape(2, 8, 3, d))
