"""FP8 stores divide by the scale with its reciprocal and one correction
(kernels/rope_cache.cu fp8_quotients); here NumPy emulates exactly those
float32 operations and compares them with IEEE division, the bits
``(x.float() / scale)`` has in torch (CPU).

Per element the kernel computes, where the scale is in [FP8_SCALE_MIN,
FP8_SCALE_MAX], with r = rn(1 / scale) once per thread: q0 = rn(x r) and
q = fma(fma(-q0, scale, x), r, q0); it stores q with q0's sign where |q0| <=
FP8_QUOTIENT_MAX, else q0. Other scales (the host refuses them; a device
scale is not checked) make r NaN, and so every code. Where FP8_QUOTIENT_MIN <=
|q0| <= FP8_QUOTIENT_MAX the float bits equal IEEE division's; outside, only
the FP8 codes must (a zero of the quotient's sign, saturation, NaN), and
every check compares those too.

Coverage: every float32 mantissa of x at the exponents that matter for a
set of scales (away from the range edges a power of two scales every
intermediate exactly, so one binade of x stands for all), the corners of the
guarded range, every bf16 and fp16 bit pattern, random float32 bit patterns
with random scales, special values, and quotients near every FP8 rounding
tie; then the same after the FP8 conversion. The kernel's bounds are read
from its source, so the two cannot drift apart. (Every pair of mantissas,
2^46, was checked on the GPU: docs/performance.md, "Cache-op decode".)
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest

from cupy_rope import kv_cache, specialize

F32 = np.float32
LISTED_SCALES = [0.05, 0.04, 1.0, 0.5, 3.7, 1e-3, 12.5 / 448, 1000 / 57344]
CHUNK = 1 << 21  # elements per NumPy pass (memory)


def _kernel_bound(name: str) -> float:
    text = (specialize.KERNEL_DIR / "rope_cache.cu").read_text()
    m = re.search(rf"constexpr float {name} = (0x[0-9a-fp.+-]+)f;", text)
    assert m, f"{name} not found in kernels/rope_cache.cu"
    return float.fromhex(m.group(1))


SCALE_MIN, SCALE_MAX = _kernel_bound("FP8_SCALE_MIN"), _kernel_bound("FP8_SCALE_MAX")
QUOTIENT_MIN, QUOTIENT_MAX = _kernel_bound("FP8_QUOTIENT_MIN"), _kernel_bound("FP8_QUOTIENT_MAX")


def fma32(a, b, c) -> np.ndarray:
    """fmaf(a, b, c) on float32 arrays, rounded once as the GPU's FFMA rounds.

    The product of two float32 values is exact in float64 (24 + 24
    significand bits fit in 53; float32 exponents cannot leave float64's
    range). The float64 sum then rounds once more, so it is rounded to odd
    (an inexact sum whose last bit is even steps to its neighbour toward the
    exact value, found by TwoSum): rounding to odd with 53 >= 24 + 2 bits
    followed by round to nearest float32 equals one rounding of the exact
    a b + c (Boldo and Melquiond, IEEE Trans. Computers 57(4), 2008),
    subnormal and overflowing results included.
    """
    a64, b64, c64 = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c64
        z = s - p
        err = (p - (s - z)) + (c64 - z)  # exactly p + c - s where all are finite
        inexact = np.isfinite(err) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(inexact, np.nextafter(s, np.copysign(np.inf, err)), s)
        return s.astype(F32)


def ftz(a) -> np.ndarray:
    """Subnormal floats flushed to zeros of their sign, as the kernels run
    (CuPy compiles them with -ftz=true)."""
    a = np.asarray(a, F32)
    tiny = (a != 0) & (np.abs(a) < np.finfo(F32).smallest_normal)
    return np.where(tiny, np.copysign(F32(0), a), a).astype(F32)


def test_kernel_code_is_what_the_emulation_models():
    """The kernel's fp8_quotients holds the steps kernel_quotient emulates."""
    text = (specialize.KERNEL_DIR / "rope_cache.cu").read_text()
    body = text[text.index("void fp8_quotients("):]
    body = re.sub(r"\s+", " ", body[:body.index("\n}\n")])
    for step in ("const float q0 = __fmul_rn(x[i], recip);",
                 "const float q = fmaf(fmaf(-q0, scale, x[i]), recip, q0);",
                 "x[i] = fabsf(q0) <= FP8_QUOTIENT_MAX ? copysignf(q, q0) : q0;"):
        assert step in body, step
    assert "/" not in body.replace("//", "")  # no division left
    recip = text[text.index("float fp8_recip("):]
    recip = re.sub(r"\s+", " ", recip[:recip.index("\n}\n")])
    assert ("scale >= FP8_SCALE_MIN && scale <= FP8_SCALE_MAX ? __frcp_rn(scale) : "
            "__int_as_float(0x7fffffff)") in recip


def test_host_bounds_are_the_kernels():
    """The host refuses exactly the scales the kernel does not correct."""
    assert (kv_cache.FP8_MIN_SCALE, kv_cache.FP8_MAX_SCALE) == (SCALE_MIN, SCALE_MAX)
    for ok in (SCALE_MIN, SCALE_MAX, 1.0, 0.05):
        kv_cache._check_scale_value(ok, "k_scale")
    for bad in (np.nextafter(F32(SCALE_MIN), F32(0)), np.nextafter(F32(SCALE_MAX), F32(np.inf)),
                0.0, -1.0, 1e-40, np.inf, np.nan):
        with pytest.raises(ValueError, match="k_scale"):
            kv_cache._check_scale_value(float(bad), "k_scale")


def corrected(scale) -> bool:
    """Does the kernel correct (not divide) for this scale?"""
    return bool(SCALE_MIN <= F32(scale) <= SCALE_MAX)


def kernel_quotient(x, scale, *, correct=True) -> np.ndarray:
    """x / scale as kernels/rope_cache.cu computes it (``correct`` False: the
    product with the reciprocal alone, which must fail somewhere)."""
    x, s = ftz(x), F32(scale)
    with np.errstate(all="ignore"):
        r = F32(1) / s if corrected(s) else F32(np.nan)  # fp8_recip
        q0 = ftz(x * r)
        if not correct:
            return q0
        q = ftz(fma32(ftz(fma32(-q0, s, x)), r, q0))
        return np.where(np.abs(q0) <= QUOTIENT_MAX, np.copysign(q, q0), q0)


def in_identity_range(x, scale) -> np.ndarray:
    """Where the kernel's float bits must equal IEEE division's: the guarded
    range (only scales within the bounds are compared)."""
    x, s = np.asarray(x, F32), F32(scale)
    assert corrected(s), "a scale outside the bounds stores NaN"
    with np.errstate(all="ignore"):
        a = np.abs(x * (F32(1) / s))
    return (a >= QUOTIENT_MIN) & (a <= QUOTIENT_MAX)


def ieee_quotient(x, scale) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(x, F32) / F32(scale)


def mismatches(x, scale, **variant) -> np.ndarray:
    """The x (float32) whose kernel quotient's bits differ from IEEE
    division's where they must (in_identity_range), or whose FP8 codes do
    (both formats, everywhere)."""
    x = np.asarray(x, F32).reshape(-1)
    bad = []
    for i in range(0, x.size, CHUNK):
        part = x[i:i + CHUNK]
        got = kernel_quotient(part, scale, **variant)
        want = ieee_quotient(part, scale)
        wrong = in_identity_range(part, scale) & (got.view(np.uint32) != want.view(np.uint32))
        for fmt in kv_cache.FP8_FORMATS:
            wrong |= kv_cache.fp8_bits(got, 1.0, fmt) != kv_cache.fp8_bits(want, 1.0, fmt)
        bad.append(part[wrong])
    return np.concatenate(bad)


def assert_identity(x, scale) -> None:
    bad = mismatches(x, scale)
    assert bad.size == 0, (f"scale {float(F32(scale))!r}: {bad.size} inputs differ from IEEE "
                           f"division, e.g. x = {[float(v).hex() for v in bad[:4]]}")


def binade(exponent: int) -> np.ndarray:
    """Every float32 of [2^exponent, 2^(exponent + 1)) (normal exponents)."""
    m = np.arange(1 << 23, dtype=np.uint32)
    return (m | np.uint32((exponent + 127) << 23)).view(F32)


# ------------------------------------------------------- the emulation --
def _rn32(v: Fraction) -> F32:
    """The float32 nearest to an exact value (ties to even), by exact comparison."""
    guess = F32(float(v))  # within an ulp of the answer
    cands = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    dist = [abs(Fraction(float(c)) - v) for c in cands]
    best = min(dist)
    near = [c for c, d in zip(cands, dist) if d == best]
    return near[0] if len(near) == 1 else next(c for c in near if int(c.view(np.uint32)) % 2 == 0)


def test_fma_emulation_rounds_once(rng):
    """fma32 against the exact sum rounded once, on random triples and on
    the cancelling ones the correction makes (c close to -a b)."""
    n = 1500
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(F32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(F32)
    c = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(F32)
    cancel = (-(a.astype(np.float64) * b)).astype(F32)
    tiny = np.full(n, F32(2.0 ** -140))  # results in the subnormal range
    for cc in (c, cancel, cancel + tiny * rng.integers(-3, 4, n).astype(F32)):
        got = fma32(a, b, cc)
        want = [_rn32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                for x, y, z in zip(a, b, cc)]
        np.testing.assert_array_equal(got.view(np.uint32),
                                      np.array(want, F32).view(np.uint32))


def test_the_check_can_fail():
    """Without the correction the comparison finds inputs whose bits differ;
    tiny quotients, whose residual is not exact, differ from IEEE division in
    their float bits but not in their FP8 codes."""
    x = binade(0)[::64]
    assert mismatches(x, 3.7, correct=False).size > 1000
    tiny = np.concatenate([binade(-127 + 2)[::64], binade(-110)[::64]])
    with np.errstate(all="ignore"):
        floats_differ = kernel_quotient(tiny, 3.7e-3) != ieee_quotient(tiny, 3.7e-3)
    assert floats_differ.any() and not in_identity_range(tiny, 3.7e-3)[floats_differ].any()
    assert mismatches(tiny, 3.7e-3).size == 0


# --------------------------------------------------------- the identity --
@pytest.mark.parametrize("scale", LISTED_SCALES, ids=[f"{s:.4g}" for s in LISTED_SCALES])
def test_every_mantissa_of_a_binade(scale):
    """x of every mantissa (one binade stands for every normal x in range)."""
    assert_identity(binade(0), scale)


@pytest.mark.parametrize("scale_exp, x_exp", [(-32, -96), (-32, -95), (31, 95), (31, 96)],
                         ids=["low-scale-low-q", "low-scale-low-q+1", "high-scale-high-q",
                              "high-scale-high-q+1"])
def test_corners_of_the_guarded_range(rng, scale_exp, x_exp):
    """Scales at the ends of the scale bounds and quotients at the ends of
    the quotient bounds, where the residual's exactness is tightest: every
    mantissa of x (sampled by 4) for a few scale mantissas."""
    x = binade(x_exp)[rng.integers(0, 4)::4]
    for m in (1.0, 1.5, float(rng.uniform(1, 2)), 2 - 2.0 ** -23, 2.0):
        assert_identity(x, F32(m * 2.0 ** scale_exp))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16_bit_pattern(rng, dtype):
    """Every bf16 / fp16 value (the stored element rounded to its dtype),
    with the listed scales and 50 random scales in [1e-4, 1e4]."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    # a bf16 value is the top half of a float32 (no ml_dtypes needed)
    x = (bits << 16).view(F32) if dtype == "bfloat16" else bits.astype(np.uint16).view(
        np.float16).astype(F32)
    for s in LISTED_SCALES + list(np.exp(rng.uniform(np.log(1e-4), np.log(1e4), 50))):
        assert_identity(x, s)


def test_random_bit_patterns_and_scales(rng):
    """10^7 random float32 bit patterns (every exponent, NaN and inf
    included), 1000 random scales in [1e-4, 1e4]."""
    scales = np.exp(rng.uniform(np.log(1e-4), np.log(1e4), 1000)).astype(F32)
    x = rng.integers(0, 1 << 32, 10_000_000, dtype=np.uint64).astype(np.uint32).view(F32)
    for s, part in zip(scales, np.array_split(x, len(scales))):
        assert_identity(part, s)


def _specials() -> np.ndarray:
    fi = np.finfo(F32)
    vals = [0.0, fi.smallest_subnormal, fi.smallest_normal, fi.max, np.inf, np.nan,
            np.nextafter(fi.max, F32(0)), np.nextafter(fi.smallest_normal, F32(0)),
            3 * fi.smallest_subnormal, 1.0, 448.0, 57344.0, 2.0 ** -64, 2.0 ** 64,
            2.0 ** -96, 2.0 ** 96]
    v = np.array(vals, F32)
    return np.concatenate([v, -v, np.array([0x7FC00001, 0xFFC00000, 0x7F800001], np.uint32)
                           .view(F32)])


@pytest.mark.parametrize("scale", LISTED_SCALES + [
    2.0 ** -32, 2.0 ** 32, 1.5 * 2.0 ** -32, 2.0 ** 32 * (1 - 2.0 ** -24)])
def test_special_values(scale):
    """±0, subnormals, values near FLT_MAX, inf and NaN, with scales up to
    the bounds."""
    x = _specials()
    assert mismatches(x, scale).size == 0
    with np.errstate(all="ignore"):
        got, want = kernel_quotient(x, scale), ieee_quotient(x, scale)
    for fmt in kv_cache.FP8_FORMATS:  # NaN stays NaN, zeros keep their sign
        np.testing.assert_array_equal(kv_cache.fp8_bits(got, 1.0, fmt),
                                      kv_cache.fp8_bits(want, 1.0, fmt))


# ------------------------------------------------- after the conversion --
def _fp8_values(fmt: str) -> np.ndarray:
    """Every non-negative finite value of the FP8 format, ascending."""
    man, bias, last = (3, 7, 0x7E) if fmt == "float8_e4m3fn" else (2, 15, 0x7B)
    codes = np.arange(last + 1)
    e, m = codes >> man, codes & ((1 << man) - 1)
    return np.where(e == 0, m * 2.0 ** (1 - bias - man), (1 + m / 2 ** man) * 2.0 ** (e - bias))


@pytest.mark.parametrize("fmt", list(kv_cache.FP8_FORMATS))
def test_fp8_codes_near_every_rounding_tie(rng, fmt):
    """x whose quotient lies at or next to a tie between two FP8 values (and
    the saturation edge past the largest): the float bits and the FP8 codes
    (kv_cache.fp8_bits, the tests' conversion) equal those of IEEE division."""
    vals = _fp8_values(fmt)
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # where a format one code wider would round
    ties = np.concatenate([(vals[:-1] + vals[1:]) / 2, [top]])
    ties = np.concatenate([ties, -ties])
    for s in LISTED_SCALES + list(np.exp(rng.uniform(np.log(1e-4), np.log(1e4), 50))):
        s = F32(s)
        base = (ties * np.float64(s)).astype(F32)
        near = base.view(np.int32)[:, None] + np.arange(-3, 4, dtype=np.int32)[None, :]
        x = near.view(F32)
        exact = x.astype(np.float64) / np.float64(s)
        assert ((exact <= ties[:, None]).any(1) & (exact >= ties[:, None]).any(1)).all()
        x = x.reshape(-1)
        got, want = kernel_quotient(x, s), ieee_quotient(x, s)
        assert in_identity_range(x, s).all()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(kv_cache.fp8_bits(got, 1.0, fmt),
                                      kv_cache.fp8_bits(x, float(s), fmt))


def _subnormals() -> np.ndarray:
    """Every bf16 subnormal and a sweep of float32 ones, both signs."""
    bf16 = (np.arange(1, 1 << 7, dtype=np.uint32) << 16).view(F32)
    f32 = np.unique(np.geomspace(1, (1 << 23) - 1, 5000).astype(np.uint32)).view(F32)
    v = np.concatenate([bf16, f32])
    return np.concatenate([v, -v])


def test_the_flush_changes_no_code_within_the_bounds():
    """A subnormal x, which the kernels flush to a zero, stores IEEE's codes
    at every scale from the lower bound up."""
    specials = _specials()
    x = np.concatenate([_subnormals(), specials[~np.isnan(specials)]])
    for s in (SCALE_MIN, 2.0 ** -20, 1.0, SCALE_MAX):
        assert mismatches(x, s).size == 0, s


@pytest.mark.parametrize("scale", [np.nextafter(F32(2.0 ** -32), F32(0)), 2.0 ** 33, 2.0 ** 127,
                                   1e-40, 0.0, -0.5, np.inf, np.nan],
                         ids=["below-min", "2^33", "2^127", "subnormal", "zero", "negative",
                              "inf", "nan"])
def test_scales_outside_the_bounds_store_nan(scale):
    """A device scale the host would refuse: every code is NaN (never a
    quietly misrounded one), for every input."""
    got = kernel_quotient(_specials(), scale)
    assert np.isnan(got).all()
    for fmt in kv_cache.FP8_FORMATS:
        codes = kv_cache.fp8_bits(got, 1.0, fmt)
        assert ((codes & 0x7F) == 0x7F).all(), fmt
