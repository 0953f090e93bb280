"""Helpers for GPU tests: NumPy <-> device arrays for every dtype, bit views."""

from __future__ import annotations

import numpy as np

from helpers import np_dtype


def cupy_bf16_ok() -> bool:
    try:
        import cupy
        import ml_dtypes

        cupy.dtype(ml_dtypes.bfloat16)
        return True
    except Exception:
        return False


def to_device(a: np.ndarray, framework: str = "cupy"):
    """A device copy of ``a`` (same dtype, C-contiguous) in ``framework``."""
    a = np.ascontiguousarray(a)
    if framework == "torch" or (a.dtype.name == "bfloat16" and not cupy_bf16_ok()):
        import torch

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(a.copy()).cuda()
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    import cupy

    return cupy.asarray(a)


def to_host(a) -> np.ndarray:
    """NumPy copy of a device array, keeping its dtype (bfloat16 via ml_dtypes)."""
    mod = type(a).__module__.partition(".")[0]
    if mod == "torch":
        import torch

        a = a.detach()
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).cpu().numpy().view(np_dtype("bfloat16"))
        return a.cpu().numpy()
    if mod == "cupy":
        return a.get()
    return np.asarray(a)


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bit patterns, for bit-exact comparisons."""
    return np.ascontiguousarray(a).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def full_nan(shape, dtype: str, framework: str = "cupy"):
    return to_device(np.full(shape, np.nan, dtype=np_dtype(dtype)), framework)


def angle_sources(rng, dtype, rotary_dim, rows):
    """Every angle source for rotary_dim (inv_freq scaled at random), by name:
    float32 tables, tables in x's dtype (not for float32), inv_freq, freqs."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    inv_freq *= rng.uniform(0.5, 1.5, inv_freq.shape).astype(np.float32)
    theta = (np.arange(rows)[:, None] * inv_freq.astype(np.float64)).astype(np.float32)
    cos, sin = np.cos(theta), np.sin(theta)
    out = {"table_f32": {"cos": cos, "sin": sin}, "inv_freq": {"inv_freq": inv_freq},
           "freqs": {"freqs": theta}}
    if dtype != "float32":
        out["table_x"] = {"cos": cos.astype(np_dtype(dtype)), "sin": sin.astype(np_dtype(dtype))}
    return out


def fresh_plans(monkeypatch) -> None:
    """Empty plan caches for this test (restored after it): the next call of
    every signature is planned under the launcher rules the test sets."""
    from cupy_rope import api

    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_fast_calls", {})
    monkeypatch.setattr(api, "_fast_count", [0])
