"""apply_rope_and_cache on NumPy arrays (the float64 reference path), its
argument checks, the FP8 encodings and slot_mapping_from_page_table (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from cupy_rope import kv_cache, launch, specialize
from cupy_rope.kv_cache import apply_qkv_rope_and_cache, apply_rope_and_cache
from helpers import np_dtype

T, HQ, HK, D = 7, 4, 2, 64
NUM_BLOCKS, BLOCK_SIZE = 3, 4


def _inv_freq(r):
    return (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)


def _inputs(rng, dtype="float32", t=T, hq=HQ, hk=HK, d=D, tok=None):
    tok = tok or (t,)
    dt = np_dtype(dtype)
    return (rng.standard_normal(tok + (hq, d)).astype(dt),
            rng.standard_normal(tok + (hk, d)).astype(dt),
            rng.standard_normal(tok + (hk, d)).astype(dt))


def _caches(layout="NHD", dtype="float32", hk=HK, d=D, nb=NUM_BLOCKS, bs=BLOCK_SIZE):
    shape = (nb, bs, hk, d) if layout == "NHD" else (nb, hk, bs, d)
    fill = np.nan if np.dtype(np_dtype(dtype)).kind == "f" or dtype == "bfloat16" else 0xFF
    return (np.full(shape, fill, np_dtype(dtype)), np.full(shape, fill, np_dtype(dtype)))


def _slot_rows(cache, slot, layout, bs=BLOCK_SIZE):
    blk, off = divmod(int(slot), bs)
    return cache[blk, off] if layout == "NHD" else cache[blk, :, off]


# ------------------------------------------------------------- semantics --
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("interleaved, rotary_dim", [(False, D), (True, D), (False, D // 2),
                                                     (True, D // 4)],
                         ids=["neox", "gptj", "neox-partial", "gptj-partial"])
def test_cache_holds_rotated_k_and_v_at_slots(rng, dtype, layout, interleaved, rotary_dim):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")  # NumPy's bfloat16
    q, k, v = _inputs(rng, dtype)
    k_cache, v_cache = _caches(layout, dtype)
    k0, v0, q0 = k.copy(), v.copy(), q.copy()
    slots = np.array([5, 0, -1, 11, 3, -7, 6])
    pos = rng.integers(0, 100, T)
    inv = _inv_freq(rotary_dim)
    q_out = apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, inv_freq=inv, positions=pos,
                                 interleaved=interleaved, rotary_dim=rotary_dim,
                                 cache_layout=layout)
    q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd",
                                           interleaved=interleaved, rotary_dim=rotary_dim)
    np.testing.assert_array_equal(q_out, q_ref)  # tail channels copied
    assert q_out is not q
    for a, b in ((q, q0), (k, k0), (v, v0)):  # inputs untouched
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    written = np.zeros(NUM_BLOCKS * BLOCK_SIZE, bool)
    for i, s in enumerate(slots):
        if s >= 0:
            written[s] = True
            np.testing.assert_array_equal(_slot_rows(k_cache, s, layout), k_ref[i])
            np.testing.assert_array_equal(_slot_rows(v_cache, s, layout), v[i])
    for s in np.nonzero(~written)[0]:  # every other slot still poisoned
        assert np.isnan(_slot_rows(k_cache, s, layout).astype(np.float32)).all()
        assert np.isnan(_slot_rows(v_cache, s, layout).astype(np.float32)).all()


def test_in_place_q_keeps_its_tail_and_out_q_gets_it(rng):
    q, k, v = _inputs(rng)
    inv = _inv_freq(D // 2)
    slots = np.arange(T)
    q_ref, _ = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=np.arange(T), layout="thd",
                                       rotary_dim=D // 2)
    out_q = np.full_like(q, np.nan)
    r = apply_rope_and_cache(q, k, v, *_caches(), slots, inv_freq=inv, positions=np.arange(T),
                             rotary_dim=D // 2, out_q=out_q)
    assert r is out_q
    np.testing.assert_array_equal(out_q, q_ref)
    q_tail = q[..., D // 2:].copy()
    r = apply_rope_and_cache(q, k, v, *_caches(), slots, inv_freq=inv, positions=np.arange(T),
                             rotary_dim=D // 2, inplace=True)
    assert r is q
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(q[..., D // 2:], q_tail)


@pytest.mark.parametrize("hq, hk", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_head_counts_and_angle_sources(rng, hq, hk):
    q, k, v = _inputs(rng, hq=hq, hk=hk)
    theta = np.arange(64)[:, None] * _inv_freq(D)[None].astype(np.float64)
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    pos = rng.integers(0, 64, T)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:T]
    for kw in ({"cos": cos, "sin": sin}, {"cos_sin_cache": np.concatenate([cos, sin], 1)},
               {"freqs": theta.astype(np.float32)}, {"inv_freq": _inv_freq(D)}):
        kc, vc = _caches(hk=hk)
        q_out = apply_rope_and_cache(q, k, v, kc, vc, slots, positions=pos, **kw)
        q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, positions=pos, layout="thd", **kw)
        np.testing.assert_array_equal(q_out, q_ref)
        for i, s in enumerate(slots):
            np.testing.assert_array_equal(_slot_rows(kc, s, "NHD"), k_ref[i])
            np.testing.assert_array_equal(_slot_rows(vc, s, "NHD"), v[i])


def test_bshd_varlen_and_flattened_heads(rng):
    # bshd with [b, s] slots and offsets
    b, s = 2, 3
    q, k, v = _inputs(rng, tok=(b, s))
    slots = np.array([[0, 1, 2], [8, -1, 10]])
    inv = _inv_freq(D)
    kc, vc = _caches()
    apply_rope_and_cache(q, k, v, kc, vc, slots, inv_freq=inv, layout="bshd",
                         offsets=np.array([4, 9]))
    _, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, offsets=np.array([4, 9]))
    np.testing.assert_array_equal(kc[2, 2], k_ref[1, 2])
    assert np.isnan(kc[2, 1]).all()
    # thd varlen with flattened heads [t, h * d]
    q, k, v = _inputs(rng)
    cu = np.array([0, 2, 7], np.int32)
    kc, vc = _caches()
    q_out = apply_rope_and_cache(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), kc, vc,
                                 np.arange(T)[::-1].copy(), inv_freq=inv, cu_seqlens=cu,
                                 head_dim=D)
    q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, cu_seqlens=cu, layout="thd")
    np.testing.assert_array_equal(q_out.reshape(q.shape), q_ref)
    np.testing.assert_array_equal(kc[0, 0], k_ref[T - 1])


def test_qkv_packed_equals_split_views(rng):
    qkv = rng.standard_normal((T, (HQ + 2 * HK) * D)).astype(np.float32)
    inv = _inv_freq(D)
    pos = rng.integers(0, 50, T)
    caches_a, caches_b = _caches("HND"), _caches("HND")
    qa = apply_qkv_rope_and_cache(qkv, *caches_a, np.arange(T), inv_freq=inv, positions=pos,
                                  num_q_heads=HQ, num_kv_heads=HK, cache_layout="HND")
    view = qkv.reshape(T, HQ + 2 * HK, D)
    qb = apply_rope_and_cache(view[:, :HQ], view[:, HQ:HQ + HK], view[:, HQ + HK:], *caches_b,
                              np.arange(T), inv_freq=inv, positions=pos, cache_layout="HND")
    np.testing.assert_array_equal(qa, qb)
    for a, b in zip(caches_a, caches_b):
        np.testing.assert_array_equal(a, b)
    # in place: q's part of the projection rotated, k's and v's untouched
    before = qkv.copy()
    r = apply_qkv_rope_and_cache(qkv, *_caches("HND"), np.arange(T), inv_freq=inv,
                                 positions=pos, num_q_heads=HQ, num_kv_heads=HK,
                                 cache_layout="HND", inplace=True)
    assert np.shares_memory(r, qkv)
    np.testing.assert_array_equal(r, qa)
    np.testing.assert_array_equal(qkv[:, HQ * D:], before[:, HQ * D:])


# ------------------------------------------------------------------- FP8 --
def _torch_fp8(x, scale, fmt):
    torch = pytest.importorskip("torch")
    limit = kv_cache.FP8_FORMATS[fmt][1]
    s = torch.tensor(scale, dtype=torch.float32)  # a true division (tests/test_kv_cache_gpu.py)
    y = (torch.from_numpy(np.asarray(x, np.float32)).float() / s).clamp(-limit, limit)
    return y.to(getattr(torch, fmt)).view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt", list(kv_cache.FP8_FORMATS))
def test_fp8_bits_equal_torch_conversion(rng, fmt):
    limit = kv_cache.FP8_FORMATS[fmt][1]
    x = np.concatenate([rng.standard_normal(4000) * 10 ** rng.uniform(-8, 6, 4000),
                        [0.0, -0.0, limit, -limit, 2 * limit, -1e30, np.inf, -np.inf,
                         limit * 1.03, 1e-9]]).astype(np.float32)
    for scale in (1.0, 0.0173, 3.5):
        np.testing.assert_array_equal(kv_cache.fp8_bits(x, scale, fmt), _torch_fp8(x, scale, fmt))


@pytest.mark.parametrize("fmt", list(kv_cache.FP8_FORMATS))
@pytest.mark.parametrize("storage", ["ml_dtypes", "uint8", "torch"])
def test_fp8_caches_and_out_q(rng, fmt, storage):
    q, k, v = _inputs(rng, "float16")
    inv = _inv_freq(D)
    pos = rng.integers(0, 100, T)
    slots = np.array([3, 2, 1, -1, 0, 8, 9])
    shape = (NUM_BLOCKS, BLOCK_SIZE, HK, D)
    raw = [np.full(shape, 0xFF, np.uint8) for _ in range(2)]
    out_raw = np.full(q.shape, 0xFF, np.uint8)
    kw = {}
    if storage == "ml_dtypes":
        dt = np.dtype(getattr(pytest.importorskip("ml_dtypes"), fmt))
        arrays = [a.view(dt) for a in raw] + [out_raw.view(dt)]
    elif storage == "uint8":
        arrays, kw = raw + [out_raw], {"cache_dtype": fmt}
    else:
        torch = pytest.importorskip("torch")
        arrays = [torch.from_numpy(a).view(getattr(torch, fmt)) for a in raw + [out_raw]]
    r = apply_rope_and_cache(q, k, v, arrays[0], arrays[1], slots, inv_freq=inv, positions=pos,
                             k_scale=0.25, v_scale=np.array([0.5], np.float32), out_q=arrays[2],
                             q_scale=0.125, **kw)
    assert r is arrays[2]
    q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd")
    np.testing.assert_array_equal(out_raw, _torch_fp8(q_ref.astype(np.float32), 0.125, fmt))
    for i, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(raw[0][s // BLOCK_SIZE, s % BLOCK_SIZE],
                                          _torch_fp8(k_ref[i].astype(np.float32), 0.25, fmt))
            np.testing.assert_array_equal(raw[1][s // BLOCK_SIZE, s % BLOCK_SIZE],
                                          _torch_fp8(v[i].astype(np.float32), 0.5, fmt))
    assert (raw[0][1] == 0xFF).all() and (raw[0][2, 2:] == 0xFF).all()  # slots 4-7, 10, 11
    assert (raw[1][1] == 0xFF).all() and (raw[1][2, 2:] == 0xFF).all()


# ------------------------------------------------------------- bad input --
def _valid(rng):
    q, k, v = _inputs(rng)
    kc, vc = _caches()
    return dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=np.arange(T),
                inv_freq=_inv_freq(D), positions=np.arange(T))


def _u8(shape=(NUM_BLOCKS, BLOCK_SIZE, HK, D)):
    return np.zeros(shape, np.uint8)


def _torch_fp8_arrays(**shapes):
    """CPU torch FP8 tensors by name: {name: (shape, format)} (torch has FP8 dtypes)."""
    torch = pytest.importorskip("torch")
    return {n: torch.zeros(shape, dtype=getattr(torch, fmt)) for n, (shape, fmt) in
            shapes.items()}


FP8_CACHES = {"k_cache": _u8(), "v_cache": _u8(), "cache_dtype": "float8_e4m3fn"}
CACHE_SHAPE = (NUM_BLOCKS, BLOCK_SIZE, HK, D)


BAD = {
    # name: (changes, error type, words in the message)
    "k_cache-3d": ({"k_cache": np.zeros((3, 4, D), np.float32)}, ValueError, "k_cache"),
    "k_cache-heads": ({"k_cache": np.zeros((3, 4, 3, D), np.float32)}, ValueError, "k_cache"),
    "k_cache-head_dim": ({"k_cache": np.zeros((3, 4, HK, 32), np.float32)}, ValueError,
                         "k_cache"),
    "k_cache-dtype": ({"k_cache": np.zeros((3, 4, HK, D), np.float16)}, TypeError, "k_cache"),
    "k_cache-None": ({"k_cache": None}, TypeError, "k_cache"),
    "k_cache-read-only": ("read_only_cache", TypeError, "k_cache"),
    "k_cache-is-v_cache": ("same_cache", ValueError, "k_cache"),
    "k_cache-overlaps-q": ("cache_on_q", ValueError, "k_cache"),
    "v_cache-shape": ({"v_cache": np.zeros((2, 4, HK, D), np.float32)}, ValueError, "v_cache"),
    "v_cache-format": (lambda: {**_torch_fp8_arrays(k_cache=(CACHE_SHAPE, "float8_e4m3fn"),
                                                    v_cache=(CACHE_SHAPE, "float8_e5m2")),
                                "k_scale": 1.0, "v_scale": 1.0}, TypeError, "v_cache"),
    "v_cache-float-with-fp8": ({"k_cache": _u8(), "cache_dtype": "float8_e4m3fn"}, ValueError,
                               "cache_dtype"),
    "cache_layout": ({"cache_layout": "NDH"}, ValueError, "cache_layout"),
    "cache_layout-HND-of-NHD": ({"cache_layout": "HND"}, ValueError, "k_cache"),
    "cache_dtype-name": ({"cache_dtype": "float8"}, ValueError, "cache_dtype"),
    "cache_dtype-float-cache": ({"cache_dtype": "float8_e5m2"}, ValueError, "cache_dtype"),
    "v-heads": ({"v": np.zeros((T, 3, D), np.float32)}, ValueError, "v"),
    "v-dtype": ({"v": np.zeros((T, HK, D), np.float16)}, TypeError, "v"),
    "v-tokens": ({"v": np.zeros((T + 1, HK, D), np.float32)}, ValueError, "v"),
    "v-None": ({"v": None}, TypeError, "v"),
    "k-head_dim": ({"k": np.zeros((T, HK, 32), np.float32)}, ValueError, "k"),
    "slot_mapping-float": ({"slot_mapping": np.arange(T, dtype=np.float32)}, TypeError,
                           "slot_mapping"),
    "slot_mapping-length": ({"slot_mapping": np.arange(T - 1)}, ValueError, "slot_mapping"),
    "slot_mapping-range": ({"slot_mapping": np.array([0, 1, 2, 3, 4, 5, 12])}, ValueError,
                           "slot_mapping"),
    "slot_mapping-repeated": ({"slot_mapping": np.array([0, 1, 2, 3, 4, 5, 1])}, ValueError,
                              "slot_mapping"),
    "slot_mapping-None": ({"slot_mapping": None}, TypeError, "slot_mapping"),
    "k_scale-missing": ({**FP8_CACHES, "v_scale": 1.0}, ValueError, "k_scale"),
    "v_scale-missing": ({**FP8_CACHES, "k_scale": 1.0}, ValueError, "v_scale"),
    "k_scale-not-fp8": ({"k_scale": 1.0}, ValueError, "k_scale"),
    "q_scale-not-fp8": ({"q_scale": 1.0}, ValueError, "q_scale"),
    "q_scale-missing": (lambda: _torch_fp8_arrays(out_q=((T, HQ, D), "float8_e5m2")),
                        ValueError, "q_scale"),
    "k_scale-negative": ({**FP8_CACHES, "k_scale": -1.0, "v_scale": 1.0}, ValueError,
                         "k_scale"),
    "k_scale-array": ({**FP8_CACHES, "k_scale": np.ones(2, np.float32), "v_scale": 1.0},
                      TypeError, "k_scale"),
    "k_scale-bool": ({**FP8_CACHES, "k_scale": True, "v_scale": 1.0}, TypeError, "k_scale"),
    # the kernel divides in float32: a scale float32 cannot hold is refused
    "k_scale-underflows-float32": ({**FP8_CACHES, "k_scale": 1e-50, "v_scale": 1.0},
                                   ValueError, "k_scale"),
    "v_scale-overflows-float32": ({**FP8_CACHES, "k_scale": 1.0, "v_scale": 1e60},
                                  ValueError, "v_scale"),
    # host scales outside [kv_cache.FP8_MIN_SCALE, FP8_MAX_SCALE] are refused (device: NaN codes)
    "k_scale-subnormal": ({**FP8_CACHES, "k_scale": 1e-40, "v_scale": 1.0}, ValueError,
                          "k_scale"),
    "v_scale-below-min": ({**FP8_CACHES, "k_scale": 1.0, "v_scale": 2.0 ** -33}, ValueError,
                          "v_scale"),
    "k_scale-above-max": ({**FP8_CACHES, "k_scale": 2.0 ** 33, "v_scale": 1.0}, ValueError,
                          "k_scale"),
    "k_scale-host-array-negative": ({**FP8_CACHES, "k_scale": np.array([-1.0], np.float32),
                                     "v_scale": 1.0}, ValueError, "k_scale"),
    "v_scale-host-array-nan": ({**FP8_CACHES, "k_scale": 1.0,
                                "v_scale": np.array([np.nan], np.float32)}, ValueError,
                               "v_scale"),
    "out_q-and-inplace": ({"out_q": np.zeros((T, HQ, D), np.float32), "inplace": True},
                          ValueError, "out_q"),
    "out_q-shape": ({"out_q": np.zeros((T, HQ, 32), np.float32)}, ValueError, "out_q"),
    "out_q-dtype": ({"out_q": np.zeros((T, HQ, D), np.float16)}, TypeError, "out_q"),
    "positions-length": ({"positions": np.arange(T + 2)}, ValueError, "positions"),
    "k_cache-device": ("cache_on_gpu", ValueError, "k_cache"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument_and_writes_nothing(rng, name):
    kw = _valid(rng)
    change, error, word = BAD[name]
    if callable(change):
        change = change()
    if isinstance(change, dict):
        kw.update({n: a.copy() if isinstance(a, np.ndarray) else a for n, a in change.items()})
    elif change == "read_only_cache":
        kw["k_cache"].setflags(write=False)
    elif change == "same_cache":
        kw["v_cache"] = kw["k_cache"]
    elif change == "cache_on_q":
        kw["k_cache"] = np.lib.stride_tricks.as_strided(kw["q"], (1, 4, HK, D),
                                                        (0, HK * D * 4, D * 4, 4))
        kw["v_cache"] = np.zeros((1, 4, HK, D), np.float32)
        kw["slot_mapping"] = np.array([0, 1, 2, 3, -1, -1, -1])
    elif isinstance(change, str) and change == "cache_on_gpu":
        kw["k_cache"] = launch._FakeArrays()((NUM_BLOCKS, BLOCK_SIZE, HK, D), "float32")
    snapshot = {n: a.copy() for n, a in kw.items() if isinstance(a, np.ndarray)}
    with pytest.raises(error) as info:
        apply_rope_and_cache(**kw)
    assert word in str(info.value).split(":")[0], str(info.value)
    for n, a in snapshot.items():
        np.testing.assert_array_equal(kw[n].view(np.uint8), a.view(np.uint8), err_msg=n)


def test_qkv_bad_head_counts(rng):
    qkv = np.zeros((T, (HQ + 2 * HK) * D), np.float32)
    kc, vc = _caches()
    with pytest.raises(ValueError, match="qkv"):
        apply_qkv_rope_and_cache(qkv, kc, vc, np.arange(T), inv_freq=_inv_freq(D),
                                 num_q_heads=HQ + 1, num_kv_heads=HK, head_dim=D)
    with pytest.raises(ValueError, match="num_q_heads"):
        apply_qkv_rope_and_cache(qkv, kc, vc, np.arange(T), inv_freq=_inv_freq(D),
                                 num_q_heads=0, num_kv_heads=HK)
    with pytest.raises(ValueError, match="k_cache"):  # caches of other heads than k's
        apply_qkv_rope_and_cache(qkv.reshape(T, -1)[:, :(HQ + 2) * D], kc, vc, np.arange(T),
                                 inv_freq=_inv_freq(D), num_q_heads=HQ, num_kv_heads=1)


# ------------------------------------------------------------ page table --
def _slots_by_loop(indptr, indices, last, bs, new_tokens):
    out = []
    for b in range(len(last)):
        pages = indices[indptr[b]:indptr[b + 1]]
        length = (len(pages) - 1) * bs + last[b] if len(pages) else 0
        n = length if new_tokens is None else (
            new_tokens if np.isscalar(new_tokens) else min(new_tokens[b], length))
        for i in range(length - n, length):
            out.append(-1 if i < 0 else pages[i // bs] * bs + i % bs)
    return np.array(out, np.int64)


@pytest.mark.parametrize("new_tokens", [None, 1, 3, "array"])
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_slot_mapping_from_page_table(rng, new_tokens, dtype):
    bs = 4
    pages = rng.integers(0, 4, 6)  # pages per sequence (some empty)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(dtype)
    indices = rng.permutation(50)[:indptr[-1]].astype(dtype)
    last = rng.integers(1, bs + 1, 6).astype(dtype)
    if new_tokens == "array":
        new_tokens = rng.integers(0, 6, 6).astype(dtype)
    got = kv_cache.slot_mapping_from_page_table(indptr, indices, last, bs,
                                                new_tokens=new_tokens)
    want = _slots_by_loop(indptr, indices, last, bs, new_tokens)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("args, error, word", [
    ((np.array([0, 1]), np.array([3]), np.array([1, 1]), 4), ValueError, "kv_indptr"),
    ((np.array([0, 1.0]), np.array([3]), np.array([1]), 4), TypeError, "kv_indptr"),
    ((np.array([0, 1]), np.array([[3]]), np.array([1]), 4), ValueError, "kv_indices"),
    ((np.array([0, 2]), np.array([3]), np.array([1]), 4), ValueError, "kv_indptr"),
    ((np.array([0, 1]), np.array([3]), np.array([1]), 0), ValueError, "block_size"),
    # a last page fuller than a page would reach into another sequence's page
    ((np.array([0, 1, 2]), np.array([5, 9]), np.array([20, 3]), 16), ValueError,
     "kv_last_page_len"),
    ((np.array([0, 1, 2]), np.array([5, 9]), np.array([0, 3]), 16), ValueError,
     "kv_last_page_len"),
    ((np.array([0, 1, 2]), np.array([5, 9]), np.array([2, 3]), 16, np.array([-3, 1])),
     ValueError, "new_tokens"),
], ids=["indptr-length", "indptr-dtype", "indices-rank", "indptr-past-indices", "block_size",
        "last_page_len-past-page", "last_page_len-zero", "new_tokens-negative"])
def test_slot_mapping_from_page_table_bad_input(args, error, word):
    with pytest.raises(error, match=word):
        kv_cache.slot_mapping_from_page_table(*args[:4], new_tokens=(args[4:] or [None])[0])


# ------------------------------------------------------------------ plan --
def _fake_call(cache_shape=(64, 16, 8, 128), cache_strides=None, fmt="same", tokens=16,
               dtype="bfloat16", **kw):
    """check_cache_call on shape-only CUDA descriptions (no GPU needed)."""
    tensor = launch._FakeArrays()
    store = dtype if fmt == "same" else "uint8"
    caches = [tensor(cache_shape, store, cache_strides) for _ in range(2)]
    scales = {"k_scale": 1.0, "v_scale": 1.0, "cache_dtype": fmt} if fmt != "same" else {}
    scales.update(kw)
    return kv_cache.check_cache_call(
        tensor((tokens, 32, 128), dtype), tensor((tokens, 8, 128), dtype),
        tensor((tokens, 8, 128), dtype), *caches, tensor((tokens,), "int64"),
        (tensor((4096, 64), "float32"), tensor((4096, 64), "float32"), None, None, None),
        tensor((tokens,), "int64"), **scales)


@pytest.mark.parametrize("fmt, strides, pairs", [
    ("same", None, 8),                                   # 16-byte packets everywhere
    ("float8_e4m3fn", None, 8),                          # 8-byte FP8 packets in the caches
    ("same", (16 * 8 * 132, 8 * 132, 132, 1), 4),        # cache rows 8-byte aligned only
    ("same", (16 * 8 * 130, 8 * 130, 130, 1), 2),        # 4-byte aligned rows
    ("same", (16 * 8 * 129, 8 * 129, 129, 1), 1),        # element-aligned rows
], ids=["bf16", "fp8", "rows-8B", "rows-4B", "rows-2B"])
def test_vector_width_follows_every_view(fmt, strides, pairs):
    spec = kv_cache.choose_spec(_fake_call(cache_strides=strides, fmt=fmt, inplace=True), 1)
    assert spec.pairs == pairs and not spec.strided and spec.cache_format == fmt


def test_launch_shape_decode_splits_heads_prefill_unrolls():
    decode = kv_cache.launch_shape(8, 48, 16, 132)
    assert decode.unroll == 1 and decode.grid[1] > 1 and decode.block[0] == 8
    assert decode.block[2] == 1 and decode.grid[0] == 16  # one token a block
    assert decode.grid[1] * decode.block[1] >= 48  # a thread for each head
    prefill = kv_cache.launch_shape(8, 48, 16384, 132)
    assert prefill.unroll == 4 and prefill.grid[1] == 1
    assert prefill.grid[0] * prefill.block[2] >= 16384
    assert all(int(np.prod(s.block)) <= kv_cache.THREADS for s in (decode, prefill))


@pytest.mark.parametrize("items, heads, tokens", [(8, 48, 1), (8, 48, 64), (16, 40, 3), (4, 3, 5),
                                                   (32, 96, 20000), (8, 48, 16384)])
def test_launch_shape_walks_every_head_once(items, heads, tokens):
    """The kernel's walk (rope_cache_kernel: lane l of head group g takes
    head g * blockDim.y + l, then every gridDim.y * blockDim.y further) over
    the shape's grid and block covers each head exactly once."""
    s = kv_cache.launch_shape(items, heads, tokens, 132)
    lanes, groups = s.block[1], s.grid[1]
    walked = [h for g in range(groups) for lane in range(lanes)
              for h in range(g * lanes + lane, heads, groups * lanes)]
    assert sorted(walked) == list(range(heads))
    assert s.grid[0] * s.block[2] >= tokens


def test_device_values_are_not_read_and_devices_must_match():
    cc = _fake_call(inplace=True)  # device slot_mapping: its values are the kernel's to skip
    assert cc.slots.on_gpu and cc.cache.block_size == 16 and cc.call.inplace
    with pytest.raises(ValueError, match="^k_scale"):
        _fake_call(fmt="float8_e5m2", k_scale=np.ones(1, np.float32))  # host scale, device q


@pytest.mark.parametrize("kw, flat", [
    ({"inplace": True}, True),
    ({"inplace": True, "fmt": "float8_e4m3fn"}, True),
    ({"inplace": True, "interleaved": True}, True),
    ({"inplace": True, "cache_strides": (16 * 8 * 132, 8 * 132, 132, 1)}, False),  # 8-byte rows
    ({"inplace": True, "tokens": 20000}, False),                       # prefill shape
    ({"inplace": True, "tokens": kv_cache.FLAT_DECODE_MAX_TOKENS + 1}, False),  # unmeasured
    ({"inplace": True, "weight_mode": "none"}, False),                 # the q/k norm
], ids=["bf16", "fp8", "gptj", "unaligned-cache", "prefill", "tokens", "norm"])
def test_flat_decode_takes_dense_decode_calls_only(kw, flat):
    """rope_cache_flat_kernel takes decode calls of dense, aligned head rows
    with full rotary (kv_cache.flat_decode_shape); the rest keep
    rope_cache_kernel."""
    cc = _fake_call(**kw)
    spec = kv_cache.choose_spec(cc, 1)
    heads = sum(sl.heads for sl in cc.call.slabs)
    shape = kv_cache.launch_shape(spec.items, heads, cc.call.tokens, 132)
    got = kv_cache.flat_decode_shape(cc, spec, shape)
    assert (got is not None) == flat
    if flat:  # a thread for each 16-byte packet of every head row, one block more at most
        threads = cc.call.tokens * heads * 128 * 2 // 16
        assert got.block == (kv_cache.FLAT_DECODE_THREADS, 1, 1)
        assert threads <= got.grid[0] * got.block[0] < threads + got.block[0]


def test_flat_decode_threads_are_the_kernels():
    """The host's block size is the kernel's launch bound."""
    text = (specialize.KERNEL_DIR / "rope_cache.cu").read_text()
    assert f"constexpr int CACHE_FLAT_THREADS = {kv_cache.FLAT_DECODE_THREADS};" in text
