"""apply_rope_and_cache on the GPU: q and every cache byte against the
rotation kernels and the float64 reference, FP8 against torch's own
conversion, untouched bytes bit-identical (GPU)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytest

import cupy_rope
from cupy_rope import kv_cache
from helpers import assert_close, np_dtype
from gpu_util import to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
FORMATS = ["same", "float8_e4m3fn", "float8_e5m2"]
POISON = 0xFF  # FP8 NaN in both formats; NaN for the float caches too (all bits set)


class Case(NamedTuple):
    dtype: str
    fmt: str  # cache format
    cache_layout: str
    block_size: int
    mode: str  # prefill | decode | varlen | bshd
    tokens: int
    hq: int
    hk: int
    d: int
    rotary_dim: int
    interleaved: bool
    source: str  # table | inv_freq | cos_sin_cache | freqs
    q_mode: str  # new | inplace | out | out_fp8
    framework: str  # torch | cupy


def _id(c: Case) -> str:
    return (f"{c.dtype}-{c.fmt}-{c.cache_layout}-bs{c.block_size}-{c.mode}{c.tokens}-"
            f"q{c.hq}k{c.hk}d{c.d}r{c.rotary_dim}-{'gptj' if c.interleaved else 'neox'}-"
            f"{c.source}-{c.q_mode}-{c.framework}")


def _cases():
    modes = [("prefill", 300), ("decode", 1), ("varlen", 77), ("decode", 64), ("bshd", 24),
             ("decode", 16)]
    out = []
    for i, (dtype, fmt, layout) in enumerate(itertools.product(DTYPES, FORMATS, ("NHD", "HND"))):
        mode, tokens = modes[i % len(modes)]
        bs = (1, 16, 64)[i % 3]
        source = ("table", "inv_freq", "cos_sin_cache", "freqs")[i % 4]
        q_mode = ("new", "inplace", "out", "out_fp8")[i % 4]
        framework = "torch" if fmt != "same" or i % 2 else "cupy"
        if q_mode == "out_fp8" and framework == "cupy":
            q_mode = "out"
        out.append(Case(dtype, fmt, layout, bs, mode, tokens, 8, 2, 128, 128, i % 5 == 3, source,
                        q_mode, framework))
    # Llama-3-8B heads, partial rotary, GPT-J, MQA, head_dim 64 and 80
    out += [
        Case("bfloat16", "same", "NHD", 16, "prefill", 257, 32, 8, 128, 128, False, "table", "inplace",
             "torch"),
        Case("bfloat16", "float8_e4m3fn", "HND", 16, "decode", 64, 32, 8, 128, 128, False,
             "cos_sin_cache", "inplace", "torch"),
        Case("float16", "same", "NHD", 16, "prefill", 50, 4, 1, 64, 32, False, "table", "out",
             "torch"),
        Case("bfloat16", "float8_e5m2", "HND", 64, "varlen", 90, 6, 2, 80, 40, True, "inv_freq",
             "new", "torch"),
        Case("float32", "same", "HND", 1, "decode", 7, 2, 1, 96, 48, False, "inv_freq", "inplace",
             "cupy"),
        Case("bfloat16", "float8_e4m3fn", "NHD", 16, "bshd", 24, 4, 4, 128, 64, True, "table",
             "out_fp8", "torch"),
        # CuPy has no FP8 dtype: uint8 caches with cache_dtype=
        Case("float16", "float8_e4m3fn", "NHD", 16, "decode", 16, 8, 2, 128, 128, False,
             "table", "inplace", "cupy"),
        Case("float32", "float8_e5m2", "HND", 1, "varlen", 40, 8, 2, 64, 64, True, "inv_freq",
             "new", "cupy"),
    ]
    return out


CASES = _cases()


def _tables(rng, c: Case, rows: int) -> dict:
    r = c.rotary_dim
    inv_freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    theta = (np.arange(rows)[:, None] * inv_freq.astype(np.float64)).astype(np.float32)
    cos, sin = np.cos(theta), np.sin(theta)
    if c.source == "table":
        return {"cos": cos, "sin": sin}
    if c.source == "cos_sin_cache":
        return {"cos_sin_cache": np.concatenate([cos, sin], axis=1)}
    if c.source == "freqs":
        return {"freqs": theta}
    return {"inv_freq": inv_freq}


def _geometry(rng, c: Case, rows: int) -> dict:
    """layout, token shape, position keywords (host) and the number of tokens."""
    if c.mode == "bshd":
        b, s = 2, c.tokens // 2
        return {"layout": "bshd", "tok": (b, s), "pos": {"offsets": np.array([3, 11])}}
    if c.mode == "varlen":
        cuts = np.sort(rng.choice(np.arange(1, c.tokens), 3, replace=False))
        cu = np.concatenate([[0], cuts, [c.tokens]]).astype(np.int32)
        return {"layout": "thd", "tok": (c.tokens,), "pos": {"cu_seqlens": cu}}
    pos = rng.integers(0, rows, c.tokens).astype(np.int64 if c.mode == "decode" else np.int32)
    return {"layout": "thd", "tok": (c.tokens,), "pos": {"positions": pos}}


def _poisoned(shape, fmt: str, dtype: str, framework: str):
    """A cache of poison bytes: uint8 storage viewed as the cache dtype."""
    import torch

    item = 1 if fmt != "same" else np.dtype(np_dtype(dtype)).itemsize
    raw = torch.full(tuple(shape[:-1]) + (shape[-1] * item,), POISON, dtype=torch.uint8,
                     device="cuda")
    tdt = getattr(torch, fmt if fmt != "same" else dtype)
    if framework == "torch":
        return raw.view(tdt)
    import cupy

    arr = cupy.from_dlpack(raw)
    if fmt != "same":
        return arr  # uint8 storage with cache_dtype=
    return arr.view(np_dtype(dtype)) if dtype != "bfloat16" else raw.view(tdt)


def _cache_bytes(a) -> np.ndarray:
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().view(torch.uint8).cpu().numpy()
    return a.view(np.uint8).get()


def _torch(a):
    import torch

    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def _fp8_like_torch(x, scale: float, fmt: str) -> np.ndarray:
    """torch's own conversion: (x.float() / scale).clamp(-max, max).to(fp8), as
    bytes. The scale is a device tensor: torch divides a CUDA tensor by a
    Python float as a product with the fp32 reciprocal, which differs from
    x / scale by an FP8 step in a few elements."""
    import torch

    limit = kv_cache.FP8_FORMATS[fmt][1]
    t = _torch(x)
    s = torch.tensor(scale, dtype=torch.float32, device=t.device)
    y = (t.float() / s).clamp(-limit, limit).to(getattr(torch, fmt))
    return y.view(torch.uint8).cpu().numpy()


def _value_bytes(x, fmt: str, scale) -> np.ndarray:
    """Bytes the cache must hold for device values x [.., h, d] of the input dtype."""
    import torch

    if fmt != "same":
        return _fp8_like_torch(x, scale, fmt)
    return _torch(x).contiguous().view(torch.uint8).cpu().numpy()


def _slots(rng, tok, n_slots):
    n = int(np.prod(tok))
    slots = rng.choice(n_slots, n, replace=False).astype(np.int64)
    slots[rng.random(n) < 0.15] = -1  # padding tokens
    return slots.reshape(tok)


def _expected_cache(poison: np.ndarray, slots: np.ndarray, values: np.ndarray, layout: str,
                    block_size: int) -> np.ndarray:
    """The poisoned cache bytes with ``values`` [tokens, hk, d * item] at their slots."""
    exp = poison.copy()
    for t, s in enumerate(slots.reshape(-1)):
        if s < 0:
            continue
        blk, off = divmod(int(s), block_size)
        if layout == "NHD":
            exp[blk, off] = values[t]
        else:
            exp[blk, :, off] = values[t]
    return exp


def _run_case(rng, c: Case):
    import torch

    rows = 4096
    geo = _geometry(rng, c, rows)
    tok, layout = geo["tok"], geo["layout"]
    dt = np_dtype(c.dtype)
    q_h = rng.standard_normal(tok + (c.hq, c.d)).astype(dt)
    k_h = (3 * rng.standard_normal(tok + (c.hk, c.d))).astype(dt)
    v_h = (3 * rng.standard_normal(tok + (c.hk, c.d))).astype(dt)
    fw = c.framework
    dev = lambda a: to_device(a, fw)  # noqa: E731
    q, k, v = dev(q_h), dev(k_h), dev(v_h)
    tables = {n: dev(a) for n, a in _tables(rng, c, rows).items()}
    pos = {n: dev(a) for n, a in geo["pos"].items()}
    n_tokens = int(np.prod(tok))
    num_blocks = -(-2 * n_tokens // c.block_size) + 1
    shape = ((num_blocks, c.block_size, c.hk, c.d) if c.cache_layout == "NHD"
             else (num_blocks, c.hk, c.block_size, c.d))
    k_cache = _poisoned(shape, c.fmt, c.dtype, fw)
    v_cache = _poisoned(shape, c.fmt, c.dtype, fw)
    poison = _cache_bytes(k_cache)
    slots_h = _slots(rng, tok, num_blocks * c.block_size)
    slots = dev(slots_h if c.mode != "decode" else slots_h.astype(np.int32))
    kw = dict(layout=layout, interleaved=c.interleaved, rotary_dim=c.rotary_dim,
              cache_layout=c.cache_layout, **tables, **pos)
    if c.fmt != "same":
        kw.update(k_scale=0.07, v_scale=0.3)
        if fw == "cupy":
            kw["cache_dtype"] = c.fmt
    # The rotation alone, out of place, on the same device arrays: the bits q
    # and the cached k must have.
    q_rot, k_rot = cupy_rope.apply_rope_qk(
        q, k, layout=layout, interleaved=c.interleaved, rotary_dim=c.rotary_dim,
        **tables, **pos)
    out_q = None
    if c.q_mode == "out":
        out_q = dev(np.full(q_h.shape, np.nan, dt))
    elif c.q_mode == "out_fp8":
        out_q = torch.full(q_h.shape, POISON, dtype=torch.uint8, device="cuda").view(
            torch.float8_e4m3fn)
        kw["q_scale"] = 0.02
    result = kv_cache.apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, inplace=c.q_mode == "inplace",
                                           out_q=out_q, **kw)
    torch.cuda.synchronize()
    # q: the rotation's bits (FP8: torch's conversion of them)
    if c.q_mode == "out_fp8":
        assert result is out_q
        np.testing.assert_array_equal(_cache_bytes(result), _fp8_like_torch(q_rot, 0.02,
                                                                             "float8_e4m3fn"))
    else:
        assert (result is q) == (c.q_mode == "inplace")
        np.testing.assert_array_equal(_cache_bytes(result), _cache_bytes(q_rot))
    if c.q_mode != "inplace":
        np.testing.assert_array_equal(to_host(q).view(np.uint8), q_h.view(np.uint8))
    # k and v unchanged; every cache byte as expected (written slots, and the poison elsewhere)
    np.testing.assert_array_equal(to_host(k).view(np.uint8), k_h.view(np.uint8))
    np.testing.assert_array_equal(to_host(v).view(np.uint8), v_h.view(np.uint8))
    flat = lambda a: a.reshape(n_tokens, c.hk, -1)  # noqa: E731
    k_exp = flat(_value_bytes(k_rot, c.fmt, 0.07))
    v_exp = flat(_value_bytes(v, c.fmt, 0.3))
    np.testing.assert_array_equal(
        _cache_bytes(k_cache), _expected_cache(poison, slots_h, k_exp, c.cache_layout, c.block_size))
    np.testing.assert_array_equal(
        _cache_bytes(v_cache), _expected_cache(poison, slots_h, v_exp, c.cache_layout, c.block_size))
    return q_h, k_h, v_h, slots_h, geo, kw, result, k_cache, shape


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cache_matches_rotation_and_torch_fp8(rng, case):
    _run_case(rng, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.fmt == "same"
                                  and c.q_mode != "out_fp8"][:6], ids=_id)
def test_against_float64_reference(rng, case):
    """q and the cached k against the NumPy float64 path of the same call."""
    q_h, k_h, v_h, slots_h, geo, kw, result, k_cache, shape = _run_case(rng, case)
    up = lambda a: a.astype(np.float64)  # noqa: E731
    host_kw = {n: up(a) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
               for n, a in {**_host_tables(kw), **geo["pos"]}.items()}
    kc64 = np.zeros(shape)
    q64 = kv_cache.apply_rope_and_cache(
        up(q_h), up(k_h), up(v_h), kc64, np.zeros(shape), slots_h, layout=geo["layout"],
        interleaved=case.interleaved, rotary_dim=case.rotary_dim,
        cache_layout=case.cache_layout, **host_kw)
    assert_close(to_host(result), q64, case.dtype, "q")
    got = to_host(k_cache)
    written = kc64 != 0
    assert_close(got[written], kc64[written], case.dtype, "k_cache")


def _host_tables(kw) -> dict:
    names = ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache")
    return {n: to_host(kw[n]) for n in names if n in kw}


@pytest.mark.parametrize("framework,slot_dtype", [("torch", np.int64), ("cupy", np.int64),
                                                  ("torch", np.int32)])
def test_device_slots_out_of_range_are_skipped(rng, framework, slot_dtype):
    import torch

    t, hq, hk, d, bs, nb = 6, 4, 2, 64, 16, 2
    dev = lambda a: to_device(a, framework)  # noqa: E731
    q = dev(rng.standard_normal((t, hq, d)).astype(np.float32))
    k = dev(rng.standard_normal((t, hk, d)).astype(np.float32))
    v = dev(rng.standard_normal((t, hk, d)).astype(np.float32))
    inv = dev((1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    pos = dev(np.arange(t))
    k_cache = _poisoned((nb, bs, hk, d), "same", "float32", framework)
    v_cache = _poisoned((nb, bs, hk, d), "same", "float32", framework)
    poison = _cache_bytes(k_cache)
    big = (2**40, 2**62) if slot_dtype == np.int64 else (2**30, 2**31 - 1)
    slots = dev(np.array([nb * bs, big[0], -5, 3, nb * bs - 1, big[1]], slot_dtype))
    q_rot, k_rot = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd")
    out = kv_cache.apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, inv_freq=inv,
                                        positions=pos)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(to_host(out), to_host(q_rot))  # q of every token rotated
    kb = _value_bytes(k_rot, "same", None).reshape(t, hk, -1)
    written = np.array([-1, -1, -1, 3, nb * bs - 1, -1])
    exp = _expected_cache(poison, written, kb, "NHD", bs)
    np.testing.assert_array_equal(_cache_bytes(k_cache), exp)
    vb = _value_bytes(v, "same", None).reshape(t, hk, -1)
    np.testing.assert_array_equal(_cache_bytes(v_cache),
                                  _expected_cache(poison, written, vb, "NHD", bs))


def test_device_scales_and_qkv_packed(rng):
    """A packed projection (a torch [t, (hq + 2 hk) * d] tensor) with device
    FP8 scales gives what the three views with float scales give."""
    import torch

    t, hq, hk, d, bs = 33, 8, 2, 128, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    ccache = torch.from_numpy(np.concatenate(
        [np.cos(np.arange(512)[:, None] * np.ones(d // 2) * 1e-2),
         np.sin(np.arange(512)[:, None] * np.ones(d // 2) * 1e-2)], 1).astype(np.float32)).cuda()
    pos = torch.randint(0, 512, (t,), device="cuda")
    slots = torch.randperm(4 * bs, device="cuda")[:t]
    caches = [torch.full((4, hk, bs, d), POISON, dtype=torch.uint8, device="cuda").view(
        torch.float8_e5m2) for _ in range(4)]
    scale = torch.tensor([0.5], device="cuda")
    q1 = kv_cache.apply_qkv_rope_and_cache(
        qkv, caches[0], caches[1], slots, cos_sin_cache=ccache, positions=pos, num_q_heads=hq,
        num_kv_heads=hk, cache_layout="HND", k_scale=scale, v_scale=scale)
    q, k, v = qkv.view(t, hq + 2 * hk, d).split([hq, hk, hk], dim=1)
    q2 = kv_cache.apply_rope_and_cache(
        q, k, v, caches[2], caches[3], slots, cos_sin_cache=ccache, positions=pos,
        cache_layout="HND", k_scale=0.5, v_scale=0.5)
    torch.cuda.synchronize()
    assert torch.equal(q1, q2)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert int((caches[0].view(torch.uint8) != POISON).sum()) == t * hk * d


def test_channel_strided_views(rng):
    """q, k and v with a channel stride of 2 and an HND cache sliced from a
    larger one: the element-by-element path."""
    import torch

    t, hq, hk, d, bs = 9, 4, 2, 64, 16
    big = torch.randn(t, hq + 2 * hk, 2 * d, device="cuda", dtype=torch.float16)
    q, k, v = big[..., ::2].split([hq, hk, hk], dim=1)
    inv = torch.from_numpy((1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)).cuda()
    pos = torch.arange(t, device="cuda") + 5
    full = torch.full((3, hk + 1, bs, d), float("nan"), dtype=torch.float16, device="cuda")
    k_cache, v_cache = full[:, 1:], full.clone()[:, 1:]
    slots = torch.tensor([0, 17, 33, 2, -1, 5, 6, 40, 47], device="cuda")
    q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd")
    before = full.clone()
    out = kv_cache.apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, inv_freq=inv,
                                        positions=pos, cache_layout="HND")
    assert torch.equal(out, q_ref)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // bs, :, s % bs], k_ref[i])
            assert torch.equal(v_cache[s // bs, :, s % bs], v[i])
    assert torch.isnan(full[:, 0]).all() and torch.equal(before[:, 0].isnan(), full[:, 0].isnan())


def test_repeated_calls_take_the_cached_plan(rng, monkeypatch):
    """A second call of one signature launches the cached plan with the new
    arrays (no validation); arrays that overlap go back to validation."""
    import torch

    t, hq, hk, d, bs = 5, 8, 2, 128, 16
    monkeypatch.setattr(kv_cache, "_plans", {})
    inv = torch.from_numpy((1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)).cuda()

    def arrays():
        q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
                   for h in (hq, hk, hk))
        caches = [torch.full((4, bs, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16)
                  for _ in range(2)]
        return q, k, v, caches, torch.randperm(4 * bs, device="cuda")[:t], torch.randint(
            0, 1000, (t,), device="cuda")

    q, k, v, caches, slots, pos = arrays()
    kv_cache.apply_rope_and_cache(q, k, v, *caches, slots, inv_freq=inv, positions=pos,
                                  inplace=True)
    assert len(kv_cache._plans) == 1

    class Validated(Exception):
        pass

    def refuse(*a, **kw):
        raise Validated

    monkeypatch.setattr(kv_cache, "check_cache_call", refuse)
    q, k, v, caches, slots, pos = arrays()
    q_ref, k_ref = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd")
    out = kv_cache.apply_rope_and_cache(q, k, v, *caches, slots, inv_freq=inv, positions=pos,
                                        inplace=True)
    torch.cuda.synchronize()
    assert out is q and torch.equal(q, q_ref)
    s = slots.tolist()
    for i in range(t):
        assert torch.equal(caches[0][s[i] // bs, s[i] % bs], k_ref[i])
        assert torch.equal(caches[1][s[i] // bs, s[i] % bs], v[i])
    with pytest.raises(Validated):  # k_cache is v_cache: the cached plan does not take it
        kv_cache.apply_rope_and_cache(q, k, v, caches[0], caches[0], slots, inv_freq=inv,
                                      positions=pos, inplace=True)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("new_tokens", [1, 3, None, "array"])
def test_slot_mapping_from_page_table_on_device(rng, framework, new_tokens):
    """Device page tables give the NumPy result, in their framework."""
    bs = 16
    pages = rng.integers(0, 5, 9)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(100)[:indptr[-1]].astype(np.int32)
    last = rng.integers(1, bs + 1, 9).astype(np.int32)
    count = rng.integers(0, 40, 9).astype(np.int64) if new_tokens == "array" else new_tokens
    want = kv_cache.slot_mapping_from_page_table(indptr, indices, last, bs, new_tokens=count)
    dev = lambda a: to_device(a, framework)  # noqa: E731
    got = kv_cache.slot_mapping_from_page_table(
        dev(indptr), dev(indices), dev(last), bs,
        new_tokens=dev(count) if new_tokens == "array" else count)
    assert type(got).__module__.partition(".")[0] == framework
    np.testing.assert_array_equal(to_host(got), want)


@pytest.mark.parametrize("case", CASES[::2] + CASES[-8:], ids=_id)
def test_prefill_launch_shape(rng, case, monkeypatch):
    """The prefill shape (UNROLL 4, passes over several heads, tokens a
    block), which only large calls take, on the small cases."""
    from cupy_rope import launch

    monkeypatch.setattr(kv_cache, "_plans", {})
    with launch.override_policy(blocks_per_sm=0):
        shape = kv_cache.launch_shape(8, case.hq + 2 * case.hk, case.tokens, 132)
        assert shape.unroll == kv_cache.PREFILL_UNROLL
        _run_case(rng, case)


FP8_SPECIALS = np.array([0.0, -0.0, 1e-45, -3e-45, 1e-39, -1e-38, 1e-30, -1e-20, 3e38, -3.4e38,
                         np.inf, -np.inf, 1.0, -2.5, 31.0], np.float32)


def _fp8_special_call(rng, dtype, fmt, scale, where):
    """apply_rope_and_cache of v holding FP8_SPECIALS among ordinary values,
    k_scale = v_scale = ``scale`` (a float, or a device tensor): (k_cache,
    v_cache, their poison, slots, rotated k, v)."""
    import torch

    t, hq, hk, d, bs = 16, 4, 2, 128, 16
    v_h = (3 * rng.standard_normal((t, hk, d))).astype(np.float32)
    at = rng.choice(v_h.size, 300, replace=False)
    v_h.reshape(-1)[at] = rng.choice(FP8_SPECIALS, at.size)
    tdt = getattr(torch, dtype)
    v = torch.from_numpy(v_h).cuda().to(tdt)
    q = torch.randn(t, hq, d, device="cuda", dtype=tdt)
    k = torch.randn(t, hk, d, device="cuda", dtype=tdt)
    inv = torch.from_numpy((1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)).cuda()
    pos = torch.arange(t, device="cuda")
    k_cache = _poisoned((4, bs, hk, d), fmt, dtype, "torch")
    v_cache = _poisoned((4, bs, hk, d), fmt, dtype, "torch")
    poison = _cache_bytes(v_cache)
    slots_h = rng.choice(4 * bs, t, replace=False).astype(np.int64)
    s = scale if where == "host" else torch.tensor([scale], dtype=torch.float32, device="cuda")
    _, k_rot = cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos, layout="thd")
    kv_cache.apply_rope_and_cache(q, k, v, k_cache, v_cache, torch.from_numpy(slots_h).cuda(),
                                  inv_freq=inv, positions=pos, k_scale=s, v_scale=s)
    torch.cuda.synchronize()
    return k_cache, v_cache, poison, slots_h, k_rot, v


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("scale", [0.07, 2.0 ** -32, 2.0 ** 32], ids=["0.07", "min", "max"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_special_values_match_torch(rng, dtype, fmt, scale, where):
    """v holding zeros of both signs, subnormals, tiny and huge values and
    infinities among ordinary ones, with an ordinary scale and the bounds of
    the quotient's (kernels/rope_cache.cu fp8_quotients), as floats and as
    device tensors: the cached bytes are torch's conversion of v / scale,
    and k's of the rotated k."""
    k_cache, v_cache, poison, slots_h, k_rot, v = _fp8_special_call(rng, dtype, fmt, scale,
                                                                   where)
    for cache, x in ((k_cache, k_rot), (v_cache, v)):
        want = _fp8_like_torch(x, scale, fmt).reshape(*x.shape[:2], -1)
        np.testing.assert_array_equal(_cache_bytes(cache),
                                      _expected_cache(poison, slots_h, want, "NHD", 16))


@pytest.mark.parametrize("scale", [2.0 ** -33, 2.0 ** 40, 0.0, -1.0, float("nan")],
                         ids=["2^-33", "2^40", "zero", "negative", "nan"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_device_scale_outside_the_bounds_stores_nan(rng, fmt, scale):
    """A device scale the host would refuse (it is not read on the host):
    every written code is NaN, never a quietly misrounded value; other
    slots keep their bytes."""
    k_cache, v_cache, poison, slots_h, _, _ = _fp8_special_call(rng, "bfloat16", fmt, scale,
                                                                "device")
    rows = poison.reshape(-1, 2, 128)  # [slots, hk, d] bytes
    others = np.setdiff1d(np.arange(rows.shape[0]), slots_h)
    for cache in (k_cache, v_cache):
        got = _cache_bytes(cache).reshape(rows.shape)
        np.testing.assert_array_equal(got[others], rows[others])
        assert (got[slots_h] == 0x7F).all()  # the canonical NaN (the poison is 0xFF)
