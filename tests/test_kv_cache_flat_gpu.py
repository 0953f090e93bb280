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
