"""The float64 NumPy reference, checked against independent formulations (CPU)."""

import numpy as np
import pytest

import cupy_rope
from cupy_rope import reference, validate
from cupy_rope.validate import check_call


def rope_complex(x, theta, rotary_dim, interleaved):
    """RoPE as complex multiplication z * exp(i theta), x [b, s, h, d], theta [b, s, r/2]."""
    r = rotary_dim
    if interleaved:
        z = x[..., 0:r:2] + 1j * x[..., 1:r:2]
    else:
        z = x[..., : r // 2] + 1j * x[..., r // 2 : r]
    z = z * np.exp(1j * theta)[:, :, None, :]
    y = x.copy()
    if interleaved:
        y[..., 0:r:2], y[..., 1:r:2] = z.real, z.imag
    else:
        y[..., : r // 2], y[..., r // 2 : r] = z.real, z.imag
    return y


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 8), (16, 8), (10, 4), (64, 16)])
def test_reference_matches_complex_formulation(rng, interleaved, head_dim, rotary_dim):
    b, s, h = 3, 5, 2
    x = rng.standard_normal((b, s, h, head_dim))
    inv_freq = rng.uniform(0.01, 1.0, rotary_dim // 2)
    positions = rng.integers(0, 1000, (b, s))
    offsets = rng.integers(0, 50, b)
    y = cupy_rope.apply_rope(x, inv_freq=inv_freq, positions=positions, offsets=offsets,
                             interleaved=interleaved)
    theta = (positions + offsets[:, None])[..., None] * inv_freq
    np.testing.assert_allclose(y, rope_complex(x, theta, rotary_dim, interleaved),
                               rtol=1e-12, atol=1e-12)
    assert np.array_equal(y[..., rotary_dim:], x[..., rotary_dim:])


def test_hand_computed_cases():
    x = np.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    inv_freq = np.array([np.pi / 2, np.pi])
    neox = cupy_rope.apply_rope(x, inv_freq=inv_freq, offsets=1)
    # pairs (x0, x2) by pi/2 and (x1, x3) by pi
    np.testing.assert_allclose(neox.ravel(), [-3.0, -2.0, 1.0, -4.0], atol=1e-12)
    gptj = cupy_rope.apply_rope(x, inv_freq=inv_freq, offsets=1, interleaved=True)
    # pairs (x0, x1) by pi/2 and (x2, x3) by pi
    np.testing.assert_allclose(gptj.ravel(), [-2.0, 1.0, -3.0, -4.0], atol=1e-12)
    # position 0: identity
    np.testing.assert_array_equal(cupy_rope.apply_rope(x, inv_freq=inv_freq), x)
    # backward of a quarter turn is a quarter turn the other way
    back = cupy_rope.apply_rope_backward(x, inv_freq=inv_freq[:1], offsets=1, rotary_dim=2)
    np.testing.assert_allclose(back.ravel(), [2.0, -1.0, 3.0, 4.0], atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_is_transpose_and_inverse(rng, interleaved):
    x = rng.standard_normal((2, 6, 3, 16))
    g = rng.standard_normal((2, 6, 3, 16))
    cos_sin = np.arange(40)[:, None] * rng.uniform(0.01, 1, 6)
    kw = dict(cos=np.cos(cos_sin), sin=np.sin(cos_sin), interleaved=interleaved,
              positions=rng.integers(0, 40, (2, 6)))
    y = cupy_rope.apply_rope(x, **kw)
    gx = cupy_rope.apply_rope_backward(g, **kw)
    # <R x, g> == <x, R^T g>, and R^T R = I
    assert np.isclose(np.vdot(y, g), np.vdot(x, gx), rtol=1e-12)
    np.testing.assert_allclose(cupy_rope.apply_rope_backward(y, **kw), x, atol=1e-12)


def test_angle_sources_agree(rng):
    x = rng.standard_normal((2, 7, 3, 12))
    inv_freq = rng.uniform(0.01, 1, 6)
    theta = np.arange(20)[:, None] * inv_freq
    a = cupy_rope.apply_rope(x, inv_freq=inv_freq)
    b = cupy_rope.apply_rope(x, np.cos(theta), np.sin(theta))
    c = cupy_rope.apply_rope(x, freqs=theta)
    np.testing.assert_allclose(a, b, atol=1e-12)
    np.testing.assert_allclose(a, c, atol=1e-12)


def test_sbhd_is_transposed_bshd(rng):
    x = rng.standard_normal((3, 5, 2, 8))  # bshd
    inv_freq = rng.uniform(0.01, 1, 4)
    offsets = rng.integers(0, 9, 3)
    positions = rng.integers(0, 99, (3, 5))
    for kw in ({}, {"offsets": offsets}, {"positions": positions}, {"positions": positions[0]}):
        a = cupy_rope.apply_rope(x, inv_freq=inv_freq, **kw)
        b = cupy_rope.apply_rope(x.transpose(1, 0, 2, 3), inv_freq=inv_freq, layout="sbhd", **kw)
        np.testing.assert_array_equal(a, b.transpose(1, 0, 2, 3))


def test_numpy_path_out_and_inplace(rng):
    x = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    inv_freq = rng.uniform(0.01, 1, 4).astype(np.float32)  # rotary_dim 8 of 16
    expected = cupy_rope.apply_rope(x, inv_freq=inv_freq)
    assert expected.dtype == np.float32
    out = np.full_like(x, np.nan)
    assert cupy_rope.apply_rope(x, inv_freq=inv_freq, out=out) is out
    np.testing.assert_array_equal(out, expected)
    y = x.copy()
    assert cupy_rope.apply_rope(y, inv_freq=inv_freq, inplace=True) is y
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])


def test_reference_positions_of(rng):
    x = np.zeros((2, 3, 1, 2))
    call = check_call(x, inv_freq=np.ones(1), offsets=np.array([5, 7]))
    np.testing.assert_array_equal(validate.host_positions(call), [[5, 6, 7], [7, 8, 9]])
    call = check_call(x, inv_freq=np.ones(1), positions=np.array([4, 1, 2]), offsets=3)
    np.testing.assert_array_equal(validate.host_positions(call), [[7, 4, 5], [7, 4, 5]])
