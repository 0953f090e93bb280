"""The decode form of the cache op (kernels/rope_cache.cu
rope_cache_flat_kernel, one 16-byte packet a thread) against the general
kernel (rope_cache_kernel) on the calls it takes: q and every cache byte
bit-identical, padding and out-of-range slots untouched (GPU)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cupy_rope import kv_cache

pytestmark = pytest.mark.gpu

POISON = 0xFF


def _call(rng, dtype, fmt, d, interleaved, layout, tokens, source, scale_on_device, flat):
    import torch

    hq, hk, bs, blocks = 8, 2, 16, 8
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 30)))
    q = torch.randn(tokens, hq, d, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(tokens, hk, d, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(tokens, hk, d, device="cuda", dtype=tdt, generator=gen)
    store = 1 if fmt != "same" else q.element_size()
    shape = (blocks, bs, hk, d) if layout == "NHD" else (blocks, hk, bs, d)
    caches = [torch.full(shape[:-1] + (d * store,), POISON, dtype=torch.uint8, device="cuda")
              .view(getattr(torch, fmt) if fmt != "same" else tdt) for _ in range(2)]
    slots = rng.choice(blocks * bs, tokens, replace=False).astype(np.int64)
    if tokens > 2:  # a padding token and one past the cache (device slots: skipped)
        slots[0], slots[-1] = -1, blocks * bs + 3
    rows = 64
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    theta = np.arange(rows)[:, None] * inv[None, :].astype(np.float64)
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    tables = ({"cos": torch.from_numpy(cos).cuda(), "sin": torch.from_numpy(sin).cuda()}
              if source == "table" else
              {"cos_sin_cache": torch.from_numpy(np.concatenate([cos, sin], 1)).cuda()})
    pos = torch.from_numpy(rng.integers(0, rows, tokens)).cuda()
    if tokens > 2:
        pos[1] = rows + 5  # outside the table: NaN, in both kernels
    scales = {}
    if fmt != "same":
        scales = {"k_scale": 0.05, "v_scale": 0.04}
        if scale_on_device:
            scales = {n: torch.tensor([s], device="cuda") for n, s in scales.items()}
    kv_cache.FLAT_DECODE = flat
    kv_cache.clear_plans()
    kv_cache.apply_rope_and_cache(q, k, v, *caches, torch.from_numpy(slots).cuda(),
                                  positions=pos, layout="thd", cache_layout=layout,
                                  interleaved=interleaved, inplace=True, **scales, **tables)
    torch.cuda.synchronize()
    chosen = [p.plan.spec.flat for p in kv_cache._plans.values()]
    return (q.view(torch.uint8).cpu().numpy(),
            *[c.view(torch.uint8).cpu().numpy() for c in caches], chosen)


@pytest.fixture(autouse=True)
def _restore_flat():
    yield
    kv_cache.FLAT_DECODE = True
    kv_cache.clear_plans()


CASES = [(dt, fmt, d, il, layout, t, src, dev)
         for (dt, fmt, d, il), (layout, t, src, dev) in itertools.product(
             itertools.product(["bfloat16", "float16", "float32"],
                               ["same", "float8_e4m3fn", "float8_e5m2"], [64, 128],
                               [False, True]),
             [("NHD", 64, "cos_sin_cache", False), ("HND", 5, "table", True),
              ("NHD", 1, "table", False)])]


@pytest.mark.parametrize(
    "dtype, fmt, d, interleaved, layout, tokens, source, scale_on_device", CASES,
    ids=[f"{dt}-{fmt}-d{d}-{'gptj' if il else 'neox'}-{lay}-t{t}-{src}{'-devscale' if dev else ''}"
         for dt, fmt, d, il, lay, t, src, dev in CASES])
def test_flat_decode_matches_the_general_kernel(rng, dtype, fmt, d, interleaved, layout, tokens,
                                                source, scale_on_device):
    seed = int(rng.integers(1 << 30))
    got = _call(np.random.default_rng(seed), dtype, fmt, d, interleaved, layout, tokens, source,
                scale_on_device, True)
    want = _call(np.random.default_rng(seed), dtype, fmt, d, interleaved, layout, tokens, source,
                 scale_on_device, False)
    assert got[-1] == [True] and want[-1] == [False]  # each kernel ran
    for name, a, b in zip(("q", "k_cache", "v_cache"), got[:-1], want[:-1]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert (got[1] != POISON).any()  # something was cached


def _both(run):
    """run() under each kernel: ((q bytes, caches...), flat chosen) twice."""
    out = []
    for flat in (True, False):
        kv_cache.FLAT_DECODE = flat
        kv_cache.clear_plans()
        res = run()
        chosen = [p.plan.spec.flat for p in kv_cache._plans.values()]
        out.append((res, chosen))
    return out


def _bytes(t):
    import torch

    return t.contiguous().view(torch.uint8).cpu().numpy()


@pytest.mark.parametrize("form", ["odd-heads", "out-padded", "packed-qkv", "int32"])
def test_flat_decode_other_forms(rng, form):
    """Warps with idle lanes (5 + 2 heads of 8 packets, 7 tokens), q out of
    place with padded token rows, a packed projection in place, int32
    positions and slots: both kernels write the same bytes."""
    import torch

    hq, hk, d, t = (5, 1, 64, 7) if form == "odd-heads" else (8, 2, 128, 9)
    bs, blocks = 16, 4
    base = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    pos_dt = torch.int32 if form == "int32" else torch.int64
    pos = torch.from_numpy(rng.integers(0, 64, t)).cuda().to(pos_dt)
    slots = torch.from_numpy(rng.choice(blocks * bs, t, replace=False)).cuda().to(pos_dt)
    slots[2] = -1
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    theta = np.arange(64)[:, None] * inv[None, :].astype(np.float64)
    csc = torch.from_numpy(np.concatenate([np.cos(theta), np.sin(theta)], 1).astype(np.float32))
    kw = dict(cos_sin_cache=csc.cuda(), positions=pos, layout="thd")

    def run():
        qkv = base.clone()
        caches = [torch.full((blocks, bs, hk, d), float("nan"), device="cuda",
                             dtype=torch.bfloat16) for _ in range(2)]
        if form == "packed-qkv":
            kv_cache.apply_qkv_rope_and_cache(qkv, *caches, slots, num_q_heads=hq,
                                              num_kv_heads=hk, head_dim=d, inplace=True, **kw)
            return [_bytes(qkv), *map(_bytes, caches)]
        q, k, v = (qkv[:, a * d:b * d].view(t, -1, d)
                   for a, b in ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk)))
        if form == "out-padded":
            out = torch.full((t, hq * d + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
            kv_cache.apply_rope_and_cache(q, k, v, *caches, slots, out_q=out[:, :hq * d]
                                          .view(t, hq, d), **kw)
            return [_bytes(out), *map(_bytes, caches)]
        kv_cache.apply_rope_and_cache(q, k, v, *caches, slots, inplace=True, **kw)
        return [_bytes(qkv), *map(_bytes, caches)]

    (got, flat), (want, general) = _both(run)
    assert flat == [True] and general == [False]
    for name, a, b in zip(("q", "k_cache", "v_cache"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
