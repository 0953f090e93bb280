"""DLPack interop with torch, JAX and CuPy: types, zero copy, streams (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from helpers import assert_close, np_dtype, oracle
from gpu_util import bits, to_device, to_host

pytestmark = pytest.mark.gpu

D = 128


def _inputs(rng, dtype="bfloat16", shape=(2, 16, 4, D)):
    x = rng.standard_normal(shape).astype(np_dtype(dtype))
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    theta = np.arange(64)[:, None] * inv_freq
    return x, inv_freq, np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_in_torch_out(rng, dtype):
    torch = pytest.importorskip("torch")
    x, inv_freq, cos, sin = _inputs(rng, dtype)
    xt = to_device(x, "torch")
    y = cupy_rope.apply_rope(xt, to_device(cos, "torch"), to_device(sin, "torch"))
    assert isinstance(y, torch.Tensor) and y.dtype == xt.dtype and y.device == xt.device
    assert_close(to_host(y), oracle(x, cos=cos, sin=sin), dtype)
    # backward through the torch path too
    g = cupy_rope.apply_rope_backward(xt, inv_freq=to_device(inv_freq, "torch"))
    assert_close(to_host(g), oracle(x, inv_freq=inv_freq, backward=True), dtype)


def test_torch_inplace_is_zero_copy_on_a_transposed_view(rng):
    torch = pytest.importorskip("torch")
    x, inv_freq, _, _ = _inputs(rng)
    base = to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), "torch")  # bhsd
    view = base.transpose(1, 2)  # bshd view, not contiguous
    ptr = view.data_ptr()
    out = cupy_rope.apply_rope(view, inv_freq=to_device(inv_freq, "torch"), inplace=True)
    assert out is view and out.data_ptr() == ptr == base.data_ptr()
    assert_close(to_host(base).transpose(0, 2, 1, 3), oracle(x, inv_freq=inv_freq), "bfloat16")
    # out of place on the view keeps its memory order
    y = cupy_rope.apply_rope(view, inv_freq=to_device(inv_freq, "torch"))
    assert y.stride() == view.stride()


def test_torch_out_argument(rng):
    torch = pytest.importorskip("torch")
    x, inv_freq, cos, sin = _inputs(rng, "float16")
    xt = to_device(x, "torch")
    out = torch.full_like(xt, float("nan"))
    assert cupy_rope.apply_rope(xt, inv_freq=to_device(inv_freq, "torch"), out=out) is out
    assert_close(to_host(out), oracle(x, inv_freq=inv_freq), "float16")


def test_torch_runs_on_current_stream(rng):
    """Work queued before the call on a side stream is seen, with no sync."""
    torch = pytest.importorskip("torch")
    x, inv_freq, _, _ = _inputs(rng, "float32", shape=(4, 512, 8, D))
    src = to_device(x, "torch")
    freq = to_device(inv_freq, "torch")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        slow = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keeps `side` busy for a while
            slow = torch.tanh(slow @ slow)
        dst = src + slow[0, 0] * 0  # written only after the slow chain
        out = cupy_rope.apply_rope(dst, inv_freq=freq)
        done = out.clone()
    side.synchronize()
    assert_close(to_host(done), oracle(x, inv_freq=inv_freq), "float32")


def test_cupy_runs_on_current_stream(rng):
    import cupy

    x, inv_freq, _, _ = _inputs(rng, "float32", shape=(4, 512, 8, D))
    src, freq = to_device(x), to_device(inv_freq)
    cupy.cuda.Device().synchronize()
    with cupy.cuda.Stream(non_blocking=True) as side:
        slow = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            slow = cupy.tanh(slow @ slow)
        dst = src + slow[0, 0] * 0
        out = cupy_rope.apply_rope(dst, inv_freq=freq)
        done = out.copy()
    side.synchronize()
    assert_close(to_host(done), oracle(x, inv_freq=inv_freq), "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_in_jax_out(rng, dtype):
    jax = pytest.importorskip("jax")
    x, inv_freq, cos, sin = _inputs(rng, dtype)
    xj = to_device(x, "jax")
    y = cupy_rope.apply_rope(xj, inv_freq=to_device(inv_freq, "jax"))
    assert isinstance(y, jax.Array) and y.dtype == xj.dtype and y.shape == xj.shape
    assert_close(to_host(y), oracle(x, inv_freq=inv_freq), dtype)
    y2 = cupy_rope.apply_rope(xj, to_device(cos, "jax"), to_device(sin, "jax"),
                              positions=to_device(np.arange(16, dtype=np.int32)[::-1], "jax"))
    assert_close(to_host(y2), oracle(x, cos=cos, sin=sin,
                                     positions=np.arange(16, dtype=np.int32)[::-1]), dtype)


def test_jax_inplace_is_refused(rng):
    pytest.importorskip("jax")
    x, inv_freq, _, _ = _inputs(rng, "float32")
    xj = to_device(x, "jax")
    with pytest.raises(TypeError, match="x: cannot be written in place .JAX arrays are immutable"):
        cupy_rope.apply_rope(xj, inv_freq=to_device(inv_freq, "jax"), inplace=True)
    assert np.array_equal(bits(to_host(xj)), bits(x))


def test_cupy_inplace_zero_copy_and_bf16(rng):
    x, inv_freq, cos, sin = _inputs(rng, "bfloat16")
    xc = to_device(x)
    ptr = xc.data.ptr
    assert cupy_rope.apply_rope(xc, to_device(cos), to_device(sin), inplace=True) is xc
    assert xc.data.ptr == ptr
    assert_close(to_host(xc), oracle(x, cos=cos, sin=sin), "bfloat16")


def test_generic_dlpack_producer_gives_cupy(rng):
    import cupy

    class OnlyDLPack:  # exposes nothing but the protocol
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, stream=None):
            return self._a.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    x, inv_freq, _, _ = _inputs(rng, "float16")
    y = cupy_rope.apply_rope(OnlyDLPack(to_device(x)), inv_freq=OnlyDLPack(to_device(inv_freq)))
    assert isinstance(y, cupy.ndarray)
    assert_close(to_host(y), oracle(x, inv_freq=inv_freq), "float16")


def test_torch_bf16_never_needs_cupy_bf16(rng, monkeypatch):
    """bf16 goes to the kernel as a raw pointer: CuPy's dtype is never asked for."""
    pytest.importorskip("torch")
    from cupy_rope import interop

    def refuse(name):
        raise AssertionError("CuPy dtype requested for " + name)

    monkeypatch.setattr(interop, "_cupy_dtype", refuse)
    x, inv_freq, _, _ = _inputs(rng, "bfloat16")
    y = cupy_rope.apply_rope(to_device(x, "torch"), inv_freq=to_device(inv_freq, "torch"))
    assert_close(to_host(y), oracle(x, inv_freq=inv_freq), "bfloat16")
