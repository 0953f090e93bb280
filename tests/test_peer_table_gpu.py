"""The README's "Coming from another library" rows, checked (GPU, torch).

Each peer's convention is written here as a plain float64 formula from its
documented inputs (TransformerEngine's freqs, Liger's cos/sin, MLX's
fast.rope arguments, vLLM's cos|sin cache), and the cupy-rope call that the
README gives for it must produce the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_rope  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"


def rotated(x: np.ndarray, theta: np.ndarray, interleaved: bool) -> np.ndarray:
    """float64 RoPE of x [..., D] by angles theta [..., r/2] (broadcast over
    x's leading axes); channels [r, D) unchanged."""
    x = x.astype(np.float64)
    half = theta.shape[-1]
    c, s = np.cos(theta), np.sin(theta)
    y = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = a * c - b * s, b * c + a * s
    return y


def rand(*shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def host(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float64)


def close(got, want):
    np.testing.assert_allclose(host(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_transformer_engine_freqs(interleaved):
    s, b, h, d, r = 24, 2, 3, 64, 48
    inv = 1.0 / 10000 ** (np.arange(0, r, 2) / r)
    ang = np.arange(s)[:, None] * inv  # [s, r/2]
    # TE's freqs [s, 1, 1, r]: each angle twice in a row when interleaved,
    # else the halves repeated.
    te = np.repeat(ang, 2, axis=1) if interleaved else np.concatenate([ang, ang], axis=1)
    freqs = torch.from_numpy(te[:, None, None, :].astype(np.float32)).to(DEV)
    t = rand(s, b, h, d).to(DEV)
    f = freqs[:, 0, 0, ::2] if interleaved else freqs[:, 0, 0, :r // 2]
    y = cupy_rope.apply_rope(t, freqs=f, layout="sbhd", interleaved=interleaved)
    close(y, rotated(host(t), ang[:, None, None, :], interleaved))


def test_transformer_engine_fused_qkv():
    s, b, hq, hk, d = 16, 2, 6, 2, 32
    g = hq // hk
    ang = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))
    f = torch.from_numpy(ang.astype(np.float32)).to(DEV)
    qkv = rand(s, b, hk, (g + 2) * d, seed=1).to(DEV)  # TE's [s, b, groups, (hq/hk + 2) * d]
    q, k, v = cupy_rope.apply_rope_qkv(qkv.view(s, b, -1, d), freqs=f, num_q_heads=hq,
                                       num_kv_heads=hk, packing="grouped", layout="sbhd")
    x = host(qkv).reshape(s, b, hk, g + 2, d)
    theta = ang[:, None, None, :]
    close(q, rotated(x[:, :, :, :g].reshape(s, b, hq, d), theta, False))
    close(k, rotated(x[:, :, :, g], theta, False))
    close(v, x[:, :, :, g + 1])


def test_liger_cos_sin():
    b, hq, hk, s, d = 2, 4, 2, 20, 64
    ang = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))
    full = np.concatenate([ang, ang], axis=1)[None]  # Liger's cos/sin [1, s, d]
    cos = torch.from_numpy(np.cos(full).astype(np.float32)).to(DEV)
    sin = torch.from_numpy(np.sin(full).astype(np.float32)).to(DEV)
    q, k = rand(b, hq, s, d, seed=2).to(DEV), rand(b, hk, s, d, seed=3).to(DEV)  # bhsd
    yq, yk = cupy_rope.apply_rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos[0, :, :d // 2],
                                     sin[0, :, :d // 2])
    theta = ang[None, :, None, :]  # results are [b, s, h, d]
    close(yq, rotated(host(q).transpose(0, 2, 1, 3), theta, False))
    close(yk, rotated(host(k).transpose(0, 2, 1, 3), theta, False))


@pytest.mark.parametrize("traditional", [False, True])
def test_mlx_fast_rope(traditional):
    bsz, h, t, dd, dims, base, scale, offset = 2, 3, 12, 64, 32, 10000.0, 0.5, 7
    x = rand(bsz, h, t, dd, seed=4).to(DEV)  # MLX's [B, H, T, D]
    inv = torch.from_numpy((scale / base ** (np.arange(0, dims, 2) / dims)).astype(np.float32))
    y = cupy_rope.apply_rope(x.transpose(1, 2), inv_freq=inv.to(DEV), interleaved=traditional,
                             offsets=offset)
    # MLX: position (offset + i) * scale, frequency base^(-2j / dims) on the first dims features.
    pos = (offset + np.arange(t)) * scale
    theta = pos[:, None] * base ** (-np.arange(0, dims, 2) / dims)
    want = rotated(host(x), theta[None, None], traditional)  # [B, H, T, D]
    close(y, want.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("is_neox_style", [True, False])
def test_vllm_cos_sin_cache(is_neox_style):
    tokens, hq, hk, d, max_pos = 9, 4, 2, 64, 100
    ang = np.arange(max_pos)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))
    cache = torch.from_numpy(np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32))
    cache = cache.to(DEV)
    positions = torch.tensor([5, 0, 99, 17, 17, 3, 42, 8, 64], device=DEV)
    query = rand(tokens, hq * d, seed=5).to(DEV)
    key = rand(tokens, hk * d, seed=6).to(DEV)
    want_q = rotated(host(query).reshape(tokens, hq, d), ang[host(positions).astype(int)][:, None],
                     not is_neox_style)
    want_k = rotated(host(key).reshape(tokens, hk, d), ang[host(positions).astype(int)][:, None],
                     not is_neox_style)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd", head_dim=d,
                                     interleaved=not is_neox_style)
    q2, k2 = query.clone(), key.clone()
    rope.qk_(q2, k2, positions)
    close(q2.view(tokens, hq, d), want_q)
    close(k2.view(tokens, hk, d), want_k)
    cupy_rope.apply_rope_qk(query, key, cos_sin_cache=cache, positions=positions, layout="thd",
                            head_dim=d, interleaved=not is_neox_style, inplace=True)
    close(query.view(tokens, hq, d), want_q)
    close(key.view(tokens, hk, d), want_k)


def test_readme_fused_qkv_snippet():
    """README quickstart: the concat-packed projection split by apply_rope_qkv."""
    tokens, hq, hk, d, max_pos = 7, 4, 2, 32, 50
    ang = np.arange(max_pos)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))
    cache = torch.from_numpy(np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32))
    cache = cache.to(DEV)
    positions = torch.tensor([3, 1, 4, 1, 5, 9, 2], device=DEV)
    qkv = rand(tokens, (hq + 2 * hk) * d, seed=7).to(DEV)
    q, k, v = cupy_rope.apply_rope_qkv(qkv, cos_sin_cache=cache, positions=positions,
                                       layout="thd", head_dim=d, num_q_heads=hq, num_kv_heads=hk)
    x = host(qkv).reshape(tokens, hq + 2 * hk, d)
    theta = ang[host(positions).astype(int)][:, None]
    close(q, rotated(x[:, :hq], theta, False))
    close(k, rotated(x[:, hq:hq + hk], theta, False))
    close(v, x[:, hq + hk:])
