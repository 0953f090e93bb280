"""apply_rope_and_cache with the per-head q/k RMSNorm on the GPU: q and
every cache byte bit-identical to apply_qk_norm_rope followed by the cache
write (FP8: torch's conversion of the norm op's k), untouched bytes kept,
the packed projection in place, the torch op under torch.compile (GPU)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import cupy_rope
from cupy_rope import kv_cache

pytestmark = pytest.mark.gpu

POISON = 0xFF  # NaN in every cache dtype (FP8 included)
K_SCALE, V_SCALE = 0.05, 0.3


class Case(NamedTuple):
    dtype: str
    fmt: str  # cache format: "same" or an FP8 dtype
    cache_layout: str
    tokens: int  # 1, 16: decode; 300: prefill
    hq: int
    hk: int
    d: int
    rotary_dim: int
    interleaved: bool
    weight_mode: str
    rounding: str
    q_mode: str  # new | inplace | out


def _id(c: Case) -> str:
    return (f"{c.dtype}-{c.fmt}-{c.cache_layout}-t{c.tokens}-q{c.hq}k{c.hk}d{c.d}r{c.rotary_dim}-"
            f"{'gptj' if c.interleaved else 'neox'}-{c.weight_mode}-{c.rounding}-{c.q_mode}")


B, A = "before_weight", "after_weight"
CASES = [
    # Qwen3: weights "w", rounding before the weight; decode and prefill
    Case("bfloat16", "same", "NHD", 1, 16, 8, 128, 128, False, "w", B, "inplace"),
    Case("bfloat16", "same", "HND", 300, 16, 8, 128, 128, False, "w", B, "new"),
    Case("bfloat16", "float8_e4m3fn", "NHD", 16, 32, 8, 128, 128, False, "w", B, "inplace"),
    Case("bfloat16", "float8_e5m2", "HND", 300, 8, 2, 128, 128, False, "w", B, "out"),
    Case("float16", "same", "NHD", 300, 8, 2, 64, 64, False, "1+w", A, "new"),
    Case("float16", "float8_e4m3fn", "HND", 1, 8, 1, 256, 256, False, "none", B, "out"),
    Case("float32", "same", "HND", 16, 4, 2, 128, 128, True, "w", A, "inplace"),
    Case("float32", "float8_e5m2", "NHD", 300, 4, 4, 64, 64, False, "1+w", B, "new"),
    # partial rotary (the tail normalized, q's in place too), GPT-J, head_dim 256
    Case("bfloat16", "same", "NHD", 300, 8, 2, 128, 64, False, "w", B, "inplace"),
    Case("float16", "float8_e4m3fn", "HND", 16, 4, 2, 256, 128, True, "1+w", A, "out"),
    Case("bfloat16", "same", "HND", 1, 32, 4, 256, 256, False, "w", A, "new"),
    Case("float32", "same", "NHD", 300, 2, 1, 80, 40, False, "none", A, "inplace"),
]


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _angles(rotary_dim: int, rows: int = 4096):
    import torch

    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    theta = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return theta.cos().float().cuda(), theta.sin().float().cuda()


def _weights(mode: str, d: int, dtype):
    import torch

    if mode == "none":
        return None, None
    center = 1.0 if mode == "w" else 0.0
    return tuple((center + 0.3 * torch.randn(d, device="cuda")).to(dtype) for _ in range(2))


def _poisoned(shape, fmt: str, dtype):
    import torch

    tdt = _torch_dtype(fmt) if fmt != "same" else dtype
    item = torch.empty((), dtype=tdt).element_size()
    raw = torch.full(tuple(shape[:-1]) + (shape[-1] * item,), POISON, dtype=torch.uint8,
                     device="cuda")
    return raw.view(tdt)


def _stored(x, fmt: str, scale: float):
    """The bytes a cache of ``fmt`` holds for values x: x itself, or torch's
    FP8 conversion of x.float() / scale (a device scale), clamped."""
    import torch

    if fmt == "same":
        return x.contiguous().view(torch.uint8)
    limit = kv_cache.FP8_FORMATS[fmt][1]
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / s).clamp(-limit, limit).to(_torch_dtype(fmt)).view(torch.uint8)


def _expected(poison, slots, values, layout: str, block_size: int):
    """Poisoned cache bytes with ``values`` [t, hk, bytes] at the live slots."""
    exp = poison.clone()
    live = (slots >= 0).nonzero().flatten()
    blk, off = slots[live] // block_size, slots[live] % block_size
    if layout == "NHD":
        exp[blk, off] = values[live]
    else:
        exp[blk, :, off] = values[live]
    return exp


def _bytes(t):
    import torch

    return t.view(torch.uint8)


def _setup(c: Case, block_size: int = 16):
    import torch

    dtype = _torch_dtype(c.dtype)
    t = c.tokens
    q = (2.5 * torch.randn(t, c.hq, c.d, device="cuda") + 0.5).to(dtype)
    k = (4.0 * torch.randn(t, c.hk, c.d, device="cuda") - 0.3).to(dtype)
    v = (3.0 * torch.randn(t, c.hk, c.d, device="cuda")).to(dtype)
    cos, sin = _angles(c.rotary_dim)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    num_blocks = -(-2 * t // block_size) + 1
    shape = ((num_blocks, block_size, c.hk, c.d) if c.cache_layout == "NHD"
             else (num_blocks, c.hk, block_size, c.d))
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:t]
    slots[torch.rand(t, device="cuda") < 0.2] = -1  # padding tokens
    return dtype, q, k, v, cos, sin, positions, shape, slots


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_equals_norm_op_then_cache_write(case):
    import torch

    c = case
    dtype, q, k, v, cos, sin, positions, shape, slots = _setup(c)
    qw, kw = _weights(c.weight_mode, c.d, dtype)
    norm = dict(eps=1e-6 if c.dtype != "float16" else 1e-5, weight_mode=c.weight_mode,
                rounding=c.rounding)
    rope = dict(cos=cos, sin=sin, positions=positions, layout="thd", interleaved=c.interleaved,
                rotary_dim=c.rotary_dim)
    q_ref, k_ref = cupy_rope.apply_qk_norm_rope(q, k, qw, kw, **rope, **norm)
    k_cache, v_cache = _poisoned(shape, c.fmt, dtype), _poisoned(shape, c.fmt, dtype)
    poison = _bytes(k_cache).clone()
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if c.fmt != "same" else {}
    out_q = torch.full_like(q, float("nan")) if c.q_mode == "out" else None
    result = kv_cache.apply_rope_and_cache(
        q, k, v, k_cache, v_cache, slots, q_weight=qw, k_weight=kw, cache_layout=c.cache_layout,
        inplace=c.q_mode == "inplace", out_q=out_q, **scales, **rope, **norm)
    torch.cuda.synchronize()
    assert torch.equal(_bytes(result), _bytes(q_ref))  # every channel, the tail included
    assert (result is q) == (c.q_mode == "inplace")
    if c.q_mode != "inplace":
        assert torch.equal(_bytes(q), _bytes(q_in))
    assert torch.equal(_bytes(k), _bytes(k_in)) and torch.equal(_bytes(v), _bytes(v_in))
    flat = lambda b: b.reshape(c.tokens, c.hk, -1)  # noqa: E731
    k_want = flat(_stored(k_ref, c.fmt, K_SCALE))  # the norm op's k, as the cache stores it
    assert torch.equal(_bytes(k_cache), _expected(poison, slots, k_want, c.cache_layout, 16))
    v_want = flat(_stored(v, c.fmt, V_SCALE))  # v as it is
    assert torch.equal(_bytes(v_cache), _expected(poison, slots, v_want, c.cache_layout, 16))


@pytest.mark.parametrize("weight_mode", ["w", "none"])
def test_packed_qkv_in_place(weight_mode):
    """Qwen3's prologue from the projection: q normalized and rotated in
    place in qkv, k cached, v cached as it is; k and v parts of qkv kept."""
    import torch

    t, hq, hk, d = 37, 16, 8, 128
    dtype = torch.bfloat16
    qkv = (2 * torch.randn(t, (hq + 2 * hk) * d, device="cuda")).to(dtype)
    heads = qkv.view(t, hq + 2 * hk, d)
    q, k, v = heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]
    qw, kw = _weights(weight_mode, d, dtype)
    cos, sin = _angles(d)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    rope = dict(cos=cos, sin=sin, positions=positions, layout="thd")
    q_ref, k_ref = cupy_rope.apply_qk_norm_rope(q, k, qw, kw, weight_mode=weight_mode, **rope)
    v_ref, kv_before = v.clone(), heads[:, hq:].clone()
    shape = (8, 16, hk, d)
    k_cache, v_cache = (_poisoned(shape, "float8_e4m3fn", dtype) for _ in range(2))
    poison = _bytes(k_cache).clone()
    slots = torch.randperm(128, device="cuda")[:t]
    slots[::5] = -1
    out = kv_cache.apply_qkv_rope_and_cache(
        qkv, k_cache, v_cache, slots, num_q_heads=hq, num_kv_heads=hk, inplace=True,
        q_weight=qw, k_weight=kw, weight_mode=weight_mode, k_scale=K_SCALE, v_scale=V_SCALE,
        **rope)
    torch.cuda.synchronize()
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(_bytes(heads[:, :hq].contiguous()), _bytes(q_ref))
    assert torch.equal(_bytes(heads[:, hq:].contiguous()), _bytes(kv_before))
    flat = lambda b: b.reshape(t, hk, -1)  # noqa: E731
    assert torch.equal(_bytes(k_cache), _expected(
        poison, slots, flat(_stored(k_ref, "float8_e4m3fn", K_SCALE)), "NHD", 16))
    assert torch.equal(_bytes(v_cache), _expected(
        poison, slots, flat(_stored(v_ref, "float8_e4m3fn", V_SCALE)), "NHD", 16))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_against_float64_reference(strided):
    """The device call and the NumPy float64 path of the same call agree to
    the dtype's tolerance (q, and the cached k of written slots); strided
    q and k read element by element: 96 items a head, three a lane."""
    import torch

    from gpu_util import to_host
    from helpers import assert_close

    c = Case("bfloat16", "same", "NHD", 40, 8, 2, 128, 64, False, "w", B, "new")
    dtype, q, k, v, cos, sin, positions, shape, slots = _setup(c)
    qw, kw = _weights("w", c.d, dtype)
    if strided:
        q, k = (torch.stack([x, x], -1).flatten(-2)[..., ::2] for x in (q, k))
        spec = kv_cache.choose_spec(kv_cache.check_cache_call(
            q, k, v, torch.empty(shape, dtype=dtype, device="cuda"),
            torch.empty(shape, dtype=dtype, device="cuda"), slots, (cos, sin, None, None, None),
            positions, rotary_dim=64, q_weight=qw, k_weight=kw), 1)
        assert spec.strided and (spec.lanes, spec.k_items) == (32, 3)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype, device="cuda"), torch.zeros(
        shape, dtype=dtype, device="cuda")
    got = kv_cache.apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, cos=cos, sin=sin,
                                        positions=positions, rotary_dim=64, q_weight=qw,
                                        k_weight=kw)
    up = lambda a: to_host(a).astype(np.float64)  # noqa: E731
    kc64, vc64 = np.zeros(shape), np.zeros(shape)
    q64 = kv_cache.apply_rope_and_cache(
        up(q), up(k), up(v), kc64, vc64, to_host(slots), cos=up(cos), sin=up(sin),
        positions=to_host(positions), rotary_dim=64, q_weight=up(qw), k_weight=up(kw))
    assert_close(to_host(got), q64, "bfloat16", "q")
    written = kc64 != 0
    assert written.any()
    assert_close(up(k_cache)[written], kc64[written], "bfloat16", "k_cache")
    np.testing.assert_array_equal(up(v_cache), vc64)


def test_torch_op_compiles_fullgraph():
    """cupy_rope.torch.qkv_rope_and_cache with the norm weights under
    torch.compile(fullgraph=True) writes what the eager call writes."""
    import torch

    import cupy_rope.torch as crt

    t, hq, hk, d = 4, 8, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    qw, kw = _weights("w", d, torch.bfloat16)
    cos, sin = _angles(d)
    positions = torch.arange(t, device="cuda") + 7
    slots = torch.tensor([3, -1, 17, 40], device="cuda")

    def step(qkv, k_cache, v_cache, positions, slots):
        return crt.qkv_rope_and_cache(qkv, k_cache, v_cache, slots, cos, sin,
                                      positions=positions, num_q_heads=hq, num_kv_heads=hk,
                                      q_weight=qw, k_weight=kw, eps=1e-6)

    caches = [[torch.zeros(4, 16, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for _ in range(2)]
    eager = step(qkv, *caches[0], positions, slots)
    compiled = torch.compile(step, fullgraph=True)(qkv, *caches[1], positions, slots)
    torch.cuda.synchronize()
    assert torch.equal(eager, compiled)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert caches[0][0].abs().sum() > 0
