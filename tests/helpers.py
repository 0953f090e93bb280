"""Shared test helpers: dtypes, tolerances, the float64 oracle, the GPU probe."""

from __future__ import annotations

import functools

import numpy as np

from cupy_rope import reference
from cupy_rope.validate import check_call


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


#: (max element error / max |ref|, norm error / norm ref) per dtype.
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (2e-3, 1e-3), "bfloat16": (1e-2, 5e-3),
             "float64": (1e-12, 1e-12)}


def assert_close(out, ref, dtype: str, what: str = "") -> None:
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if ref.size == 0:
        return
    assert not np.isnan(out).any(), f"{what}: NaN in output (element not written?)"
    scale = max(np.abs(ref).max(), 1e-30)
    max_tol, norm_tol = TOLERANCE[dtype]
    err = np.abs(out - ref)
    assert err.max() <= max_tol * scale, f"{what}: max error {err.max() / scale:.3g} of max |ref|"
    norm = np.linalg.norm(err) / max(np.linalg.norm(ref), 1e-30)
    assert norm <= norm_tol, f"{what}: norm error {norm:.3g}"


def oracle(x, **kwargs) -> np.ndarray:
    """float64 reference for NumPy inputs (any dtype): upcasts every float array."""
    def up(a):
        if isinstance(a, np.ndarray) and (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
            return a.astype(np.float64)
        return a

    kwargs = {k: up(v) for k, v in kwargs.items()}
    for k in ("inplace", "out"):
        kwargs.pop(k, None)
    return reference.rope(check_call(up(x), **kwargs))
