"""Kernels against the float64 reference on fresh random inputs (GPU)."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import cupy_rope
from cupy_rope import reference
from helpers import assert_close, np_dtype, oracle
from gpu_util import angle_sources, bits, full_nan, to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
HEAD_DIMS = [64, 80, 96, 128, 256]
FRACTIONS = [1.0, 0.5, 0.25]
B, S, H = 2, 5, 3
EXTRA_ROWS = 16


def make_x(rng, layout, dtype, head_dim, b=B, s=S, h=H):
    """(host x in the call's layout, device x as the call sees it)."""
    if layout == "bhsd_view":  # a transposed [b, h, s, d] tensor seen as bshd, no copy
        base = rng.standard_normal((b, h, s, head_dim)).astype(np_dtype(dtype))
        return base.transpose(0, 2, 1, 3), to_device(base).transpose(0, 2, 1, 3)
    shape = (b, s, h, head_dim) if layout == "bshd" else (s, b, h, head_dim)
    x = rng.standard_normal(shape).astype(np_dtype(dtype))
    return x, to_device(x)


def position_modes(rng, b, s, rows):
    return {
        "default": {},
        "offsets": {"offsets": rng.integers(0, rows - s, b).astype(np.int32)},
        "positions_bs": {"positions": rng.integers(0, rows, (b, s)).astype(np.int64)},
        "positions_s+int": {"positions": rng.integers(0, rows - 7, s).astype(np.int32),
                            "offsets": 7},
    }


def dev(kw):
    return {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def run_and_check(x_host, x_dev, dtype, layout, rotary_dim, interleaved, kw_host, mode,
                  backward):
    """One call in `mode` (new | out | inplace); checks values, poison, tail bits."""
    call_layout = "sbhd" if layout == "sbhd" else "bshd"
    common = dict(layout=call_layout, interleaved=interleaved, backward=backward)
    expected = oracle(x_host, **kw_host, **common)
    kw_dev = dev(kw_host)
    what = f"{mode} backward={backward} {sorted(kw_host)}"
    if mode == "inplace":
        import cupy

        work = cupy.empty_like(x_dev)  # keeps the strides of a permuted view
        work[...] = x_dev
        assert all(a == b for a, b, n in zip(work.strides, x_dev.strides, x_dev.shape)
                   if n > 1)  # (the stride of a length-1 axis is arbitrary)
        ptr = work.data.ptr
        result = cupy_rope.apply_rope(work, **kw_dev, **common, inplace=True)
        assert result is work and work.data.ptr == ptr
    elif mode == "out":
        work = full_nan(x_host.shape, dtype)
        result = cupy_rope.apply_rope(x_dev, **kw_dev, **common, out=work)
        assert result is work
    else:
        import cupy

        poison = full_nan(x_host.shape, dtype)  # the pool hands this block out next
        del poison
        result = cupy_rope.apply_rope(x_dev, **kw_dev, **common)
        assert isinstance(result, cupy.ndarray) and result.shape == x_host.shape
    got = to_host(result)
    assert_close(got[..., :rotary_dim], expected[..., :rotary_dim], dtype, what)
    # Channels past rotary_dim: bit-identical to the input (copied, or untouched).
    assert np.array_equal(bits(got[..., rotary_dim:]), bits(x_host[..., rotary_dim:])), what
    if mode != "inplace":  # the input is never modified
        assert np.array_equal(bits(to_host(x_dev)), bits(x_host)), what


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd_view"])
def test_matches_reference(rng, layout, interleaved, dtype, head_dim, fraction):
    """Every angle source x position mode x output mode x direction."""
    rotary_dim = int(head_dim * fraction) // 2 * 2
    x_host, x_dev = make_x(rng, layout, dtype, head_dim)
    b, s = (x_host.shape[1], x_host.shape[0]) if layout == "sbhd" else x_host.shape[:2]
    rows = s + EXTRA_ROWS
    for src_name, src in angle_sources(rng, dtype, rotary_dim, rows).items():
        for pos_name, pos in position_modes(rng, b, s, rows).items():
            for mode in ("new", "out", "inplace"):
                for backward in (False, True):
                    run_and_check(x_host, x_dev, dtype, layout, rotary_dim, interleaved,
                                  {**src, **pos}, mode, backward)


#: The table cases of test_general_paths whose one strided table is named.
STRIDED_TABLE = {"cos_strided_sin_dense": "cos", "cos_dense_sin_strided": "sin"}
TABLE_CASES = {"table_row_slice", "table_transposed", *STRIDED_TABLE}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("case", ["last_dim_stride2", "misaligned", "table_row_slice",
                                  "table_transposed", "cos_strided_sin_dense",
                                  "cos_dense_sin_strided", "odd_sizes"])
def test_general_paths(rng, case, interleaved, dtype):
    """Strided last axis, unaligned pointers, strided tables: correct general paths."""
    import cupy

    d, r = 64, 32
    b, s, h = 3, 9, 5
    rows = s + EXTRA_ROWS
    src = angle_sources(rng, dtype, r, rows)["table_f32"]
    x = rng.standard_normal((b, s, h, d)).astype(np_dtype(dtype))
    x_dev = to_device(x)
    if case == "last_dim_stride2":
        big = rng.standard_normal((b, s, h, 2 * d)).astype(np_dtype(dtype))
        x, x_dev = big[..., ::2], to_device(big)[..., ::2]
    elif case == "misaligned":
        flat = to_device(np.concatenate([np.zeros(1, x.dtype), x.ravel()]))
        x_dev = flat[1:].reshape(x.shape)
    elif case == "table_row_slice":  # an HF-style [rows, r] table, first half used
        src = {k: np.concatenate([v, v], axis=1) for k, v in src.items()}
        kw_dev = {k: to_device(v)[:, : r // 2] for k, v in src.items()}
        src = {k: v[:, : r // 2] for k, v in src.items()}
    elif case == "table_transposed":
        kw_dev = {k: to_device(np.ascontiguousarray(v.T)).T for k, v in src.items()}
    elif case in STRIDED_TABLE:
        strided_one = STRIDED_TABLE[case]
        kw_dev = {k: (to_device(np.repeat(v, 2, axis=1))[:, ::2] if k == strided_one
                      else to_device(v)) for k, v in src.items()}
    elif case == "odd_sizes":
        d, r = 18, 10
        x = rng.standard_normal((b, s, 7, d)).astype(np_dtype(dtype))
        x_dev = to_device(x)
        src = angle_sources(rng, dtype, r, rows)["table_f32"]
    if case not in TABLE_CASES:  # the cases above that build their own device tables
        kw_dev = dev(src)
    for mode in ("out", "inplace"):
        expected = oracle(x, **src, interleaved=interleaved)
        if mode == "out":
            out = full_nan(x.shape, dtype)
            got = to_host(cupy_rope.apply_rope(x_dev, **kw_dev, interleaved=interleaved,
                                               out=out))
        else:
            work = x_dev.copy()
            if case == "last_dim_stride2":
                work = cupy.empty((b, s, h, 2 * d), dtype=x_dev.dtype)[..., ::2]
                work[...] = x_dev
            elif case == "misaligned":
                work = cupy.concatenate([x_dev.ravel()[:1], x_dev.ravel()])[1:].reshape(x.shape)
            cupy_rope.apply_rope(work, **kw_dev, interleaved=interleaved, inplace=True)
            got = to_host(work)
        assert_close(got[..., :r], expected[..., :r], dtype, f"{case} {mode}")
        assert np.array_equal(bits(got[..., r:]), bits(x[..., r:]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("placement", ["row_stride_68", "offset_4"])
def test_tables_in_x_dtype_aligned_to_8_bytes_only(rng, placement, interleaved, dtype):
    """Full rotary on packet_kernel with 16-bit tables whose rows are only
    8-byte aligned: a GPT-J unit reads 8 frequencies (16 bytes) per row, so
    the launcher must read such tables element by element (an aligned-width
    load here faulted with a misaligned address)."""
    d, b, s, h = 128, 2, 9, 5
    rows = s + EXTRA_ROWS
    src = {k: v.astype(np_dtype(dtype))
           for k, v in angle_sources(rng, dtype, d, rows)["table_f32"].items()}
    kw_dev = {}
    for k, v in src.items():
        if placement == "row_stride_68":
            big = np.zeros((rows, 68), v.dtype)
            big[:, : d // 2] = v
            kw_dev[k] = to_device(big)[:, : d // 2]
        else:
            flat = to_device(np.concatenate([np.zeros(4, v.dtype), v.ravel()]))
            kw_dev[k] = flat[4:].reshape(v.shape)
    x = rng.standard_normal((b, s, h, d)).astype(np_dtype(dtype))
    out = full_nan(x.shape, dtype)
    cupy_rope.apply_rope(to_device(x), **kw_dev, interleaved=interleaved, out=out)
    assert_close(to_host(out), oracle(x, **src, interleaved=interleaved), dtype, placement)


@pytest.mark.parametrize("source", ["table", "freqs"])
def test_positions_outside_table_give_nan_not_oob(rng, source):
    d = 32
    x = rng.standard_normal((2, 4, 2, d)).astype(np.float32)
    theta = (np.arange(8)[:, None] * np.linspace(0.1, 1, d // 4)[None]).astype(np.float32)
    kw = ({"cos": np.cos(theta), "sin": np.sin(theta)} if source == "table"
          else {"freqs": theta.astype(np.float32)})
    positions = np.array([[0, 1, 7, 8], [-1, 3, 1000000, 2]], np.int32)
    got = to_host(cupy_rope.apply_rope(to_device(x), **dev(kw),
                                       positions=to_device(positions)))
    bad = (positions < 0) | (positions >= 8)
    assert np.isnan(got[bad][..., : d // 2]).all()
    assert not np.isnan(got[~bad]).any()
    assert np.array_equal(got[..., d // 2:], x[..., d // 2:])  # tail still copied
    ok = oracle(x[~bad][None], **kw, positions=positions[~bad][None])
    assert_close(got[~bad][None], ok, "float32")


def test_device_offsets_past_table_give_nan(rng):
    x = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    theta = (np.arange(8)[:, None] * np.ones(4)).astype(np.float32)
    got = to_host(cupy_rope.apply_rope(to_device(x), to_device(np.cos(theta)),
                                       to_device(np.sin(theta)),
                                       offsets=to_device(np.array([0, 5], np.int32))))
    assert not np.isnan(got[0]).any()
    assert np.isnan(got[1, 3:]).all() and not np.isnan(got[1, :3]).any()


@pytest.mark.parametrize("shape", [(0, 4, 2, 8), (2, 0, 2, 8), (2, 4, 0, 8)])
def test_empty_inputs(shape):
    import cupy

    x = cupy.zeros(shape, cupy.float32)
    y = cupy_rope.apply_rope(x, inv_freq=cupy.ones(4, cupy.float32))
    assert y.shape == shape


def test_decode_shapes_split_heads(rng):
    """A few tokens and many heads (decode): heads spread over blockIdx.y."""
    x = rng.standard_normal((4, 1, 64, 128)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)
    offsets = rng.integers(0, 5000, 4).astype(np.int64)
    got = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq),
                                       offsets=to_device(offsets)))
    assert_close(got, oracle(x, inv_freq=inv_freq, offsets=offsets), "float32")


def test_head_dim_512_and_large_batch(rng):
    x = rng.standard_normal((64, 33, 2, 512)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 384, 2) / 384)).astype(np.float32)
    got = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq)))
    assert_close(got, oracle(x, inv_freq=inv_freq), "float32")


def test_mixed_devices_rejected(rng):
    x = to_device(rng.standard_normal((1, 2, 1, 8)).astype(np.float32))
    with pytest.raises(ValueError, match=r"inv_freq: expected an array on cuda:0"):
        cupy_rope.apply_rope(x, inv_freq=np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"positions: expected an array on cuda:0"):
        cupy_rope.apply_rope(x, inv_freq=to_device(np.ones(4, np.float32)),
                             positions=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"out: expected an array on cuda:0"):
        cupy_rope.apply_rope(x, inv_freq=to_device(np.ones(4, np.float32)),
                             out=np.zeros((1, 2, 1, 8), np.float32))


def test_repeated_calls_are_bitwise_identical(rng):
    x = to_device(rng.standard_normal((2, 64, 8, 128)).astype(np_dtype("bfloat16")))
    inv_freq = to_device((1.0 / 10000 ** (np.arange(0, 128, 2) / 128)).astype(np.float32))
    first = bits(to_host(cupy_rope.apply_rope(x, inv_freq=inv_freq)))
    for _ in range(3):
        assert np.array_equal(bits(to_host(cupy_rope.apply_rope(x, inv_freq=inv_freq))), first)


#: Documented bound for in-kernel angles (kernels/angles.cuh): the reduced
#: fp32 angle is within ~4e-7 rad of the exact position * inv_freq.
ANGLE_ERROR_BOUND = 2e-6


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_long_context_angles_stay_accurate(rng, interleaved):
    """Positions up to 2^20 (and past): inv_freq angles vs float64."""
    d = 128
    x = rng.standard_normal((1, 64, 2, d)).astype(np.float32)
    inv_freq = (1.0 / 500000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    positions = np.concatenate([rng.integers(0, 2**20, 48), 2**20 - 1 - np.arange(8),
                                rng.integers(2**20, 2**24, 8)]).astype(np.int64)
    got = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq),
                                       positions=to_device(positions),
                                       interleaved=interleaved))
    ref = oracle(x, inv_freq=inv_freq, positions=positions, interleaved=interleaved)
    err = np.abs(got - ref).max() / np.abs(x).max()
    print(f"max error at positions up to 2^24: {err:.3g} (of max |x|)")
    assert err <= ANGLE_ERROR_BOUND


#: 2 pi to 60 digits, for angles reduced exactly in rationals.
_TWO_PI = Fraction(Decimal("6.283185307179586476925286766559005768394338798750211641949889"))


def _exact_cos_sin(positions, inv_freq):
    """cos, sin [n, r/2] of position * inv_freq (float32 values), reduced
    exactly (float64 alone loses ~1e-4 rad at positions near 2^40)."""
    cos = np.empty((len(positions), len(inv_freq)))
    sin = np.empty_like(cos)
    for i, p in enumerate(positions):
        for f, v in enumerate(inv_freq):
            t = Fraction(int(p)) * Fraction(float(v))
            r = float(t - round(t / _TWO_PI) * _TWO_PI)
            cos[i, f], sin[i, f] = np.cos(r), np.sin(r)
    return cos, sin


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("how", ["explicit", "offset", "sections"])
def test_positions_past_2_24_computed_angles(rng, how, interleaved):
    """inv_freq angles at positions fp32 cannot hold (|p| >= 2^24, to 2^40):
    reduced in fp64 in the kernel, against exactly reduced angles."""
    d, r = 64, 64
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    wide = [2**24 - 1, 2**24, 2**24 + 1, 2**30 + 7, 2**33 + 5, 2**40 + 3, -(2**24) - 5, 12345]
    if how == "offset":  # implied positions 2^33 .. 2^33 + 7 from a host offset
        positions, kw = np.arange(8, dtype=np.int64) + 2**33, {"offsets": 2**33}
    else:
        positions = np.array(wide, np.int64)
        kw = {"positions": to_device(positions[None])}
        if how == "sections":  # one position per axis: the per-pair (axes) path
            kw = {"positions": to_device(np.stack([positions, positions[::-1]])[:, None]),
                  "sections": [16, 16]}
    x = rng.standard_normal((1, len(positions), 2, d)).astype(np.float32)
    got = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq),
                                       interleaved=interleaved, **kw))
    cos, sin = _exact_cos_sin(positions, inv_freq)
    if how == "sections":  # frequencies 16.. take the second axis (positions reversed)
        cos2, sin2 = _exact_cos_sin(positions[::-1], inv_freq)
        cos[:, 16:], sin[:, 16:] = cos2[:, 16:], sin2[:, 16:]
    want = reference.rotate(x.astype(np.float64), cos[None], sin[None], r, interleaved)
    err = np.abs(got - want).max() / np.abs(x).max()
    print(f"max error at positions past 2^24: {err:.3g} (of max |x|)")
    assert err <= ANGLE_ERROR_BOUND


def test_computed_angles_past_2_53_give_nan_or_are_refused(rng):
    """Device positions fp64 cannot hold give NaN (not a rounded angle);
    host-visible ones are refused, on the cached path too."""
    d = 32
    inv_freq = to_device((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    x = rng.standard_normal((1, 4, 2, d)).astype(np.float32)
    pos = np.array([[2**53, -(2**53), 2**53 - 1, 5]], np.int64)
    got = to_host(cupy_rope.apply_rope(to_device(x), inv_freq=inv_freq, positions=to_device(pos)))
    assert np.isnan(got[0, :2]).all() and np.isfinite(got[0, 2:]).all()
    xd = to_device(x)
    cupy_rope.apply_rope(xd, inv_freq=inv_freq, offsets=2**53 - 4)  # positions up to 2^53 - 1
    for offset in (2**53 - 3, -(2**53)):
        with pytest.raises(ValueError, match="below 2\\*\\*53"):
            cupy_rope.apply_rope(xd, inv_freq=inv_freq, offsets=offset)


@pytest.mark.parametrize("head_dim,heads", [(2, 1), (4, 1), (8, 1), (16, 3), (8, 200)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_tiny_head_dims(rng, head_dim, heads, interleaved):
    """Few threads per token: many tokens per block (blockDim.z stays <= 64)."""
    x = rng.standard_normal((3, 300, heads, head_dim)).astype(np_dtype("bfloat16"))
    inv_freq = rng.uniform(0.01, 1, head_dim // 2).astype(np.float32)
    out = full_nan(x.shape, "bfloat16")
    cupy_rope.apply_rope(to_device(x), inv_freq=to_device(inv_freq), interleaved=interleaved,
                         out=out)
    assert_close(to_host(out), oracle(x, inv_freq=inv_freq, interleaved=interleaved),
                 "bfloat16")


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd_view"])
@pytest.mark.parametrize("positions", ["default", "positions_s+int", "cp", "offsets"])
def test_few_heads_one_head_kernel(rng, heads, layout, positions):
    """Fewer than UNROLL heads: the one-head kernels (UNROLL 1, 4 blocks per
    SM). Every mode against the float64 oracle, tails bit-exact."""
    from cupy_rope import launch, validate

    b, s, d, r = 5, 24, 64, 48
    rows = 80
    src = angle_sources(rng, "bfloat16", r, rows)["table_f32"]
    kw = {"positions_s+int": {"positions": rng.integers(0, rows - 7, s).astype(np.int32),
                              "offsets": 7},
          "offsets": {"offsets": rng.integers(0, rows - s, b).astype(np.int32)},
          "cp": {"cp_size": 2, "cp_rank": 1}, "default": {}}[positions]
    call_layout = "sbhd" if layout == "sbhd" else "bshd"
    x = rng.standard_normal((s, b, heads, d) if layout == "sbhd" else (b, s, heads, d))
    x = x.astype(np_dtype("bfloat16"))
    x_dev = to_device(x)
    if layout == "bhsd_view":
        x_dev = to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    call = validate.check_call(x_dev, **dev({**src, **kw}), layout=call_layout)
    assert launch.choose_spec(call).unroll == 1  # the case under test
    for mode in ("new", "out", "inplace"):
        for backward in (False, True):
            run_and_check(x, x_dev, "bfloat16", layout, r, False, {**src, **kw}, mode, backward)
