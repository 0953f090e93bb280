"""cupy_rope.jax.qk_norm_rope: values against the NumPy float64 API, gradients
(q, k and both weights) against jax.grad of a pure-jnp formula and against the
NumPy float64 backward, eagerly and under jax.jit (GPU)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from helpers import assert_close, np_dtype  # noqa: E402

crj = pytest.importorskip("cupy_rope.jax")
from cupy_rope import qk_norm  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = jnp.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------- inputs --
class Case(NamedTuple):
    """One call's geometry and options."""

    dtype: str = "float32"
    scope: str = "head"
    weight_mode: str = "w"
    rounding: str = "before_weight"
    q_shape: tuple = (2, 16, 8, 64)  # in layout
    k_heads: int = 2
    layout: str = "bshd"
    rotary_dim: int = None
    eps: float = 1e-6

    @property
    def k_shape(self):
        return self.q_shape[:-2] + (self.k_heads, self.q_shape[-1])

    def weight_len(self, heads):
        return self.q_shape[-1] * (heads if self.scope == "token" else 1)

    def options(self):
        return dict(norm_scope=self.scope, weight_mode=self.weight_mode, rounding=self.rounding,
                    eps=self.eps, layout=self.layout, rotary_dim=self.rotary_dim)


def angle_tables(rotary_dim, rows=64):
    """float32 cos, sin [rows, rotary_dim / 2] (NumPy)."""
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    theta = np.arange(rows)[:, None] * inv_freq
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def make_inputs(rng, case):
    """NumPy q, k, q_weight, k_weight in the case's dtype (weights None for
    weight_mode "none"; near 0 for "1+w", as Gemma stores them)."""
    dt = np_dtype(case.dtype)
    q = rng.standard_normal(case.q_shape).astype(np.float32) * 3 + 0.5
    k = rng.standard_normal(case.k_shape).astype(np.float32) * 3 - 0.5
    ws = [None, None]
    if case.weight_mode != "none":
        centre = 0.0 if case.weight_mode == "1+w" else 1.0
        ws = [(centre + 0.3 * rng.standard_normal(case.weight_len(h))).astype(dt)
              for h in (case.q_shape[-2], case.k_heads)]
    return q.astype(dt), k.astype(dt), ws[0], ws[1]


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def jx(a):
    return None if a is None else jnp.asarray(a)


def to_np32(a):
    return np.asarray(jnp.asarray(a).astype(F32))


# ---------------------------------------------------------- references --
def formula(x, w, cos, sin, *, scope, weight_mode, eps, rotary_dim=None):
    """Pure-jnp float32 RMSNorm then NeoX rotation of bshd x at positions
    0..s-1: what jax.grad differentiates for the reference gradients."""
    x = x.astype(F32)
    rows = x.reshape(x.shape[:-2] + (-1,)) if scope == "token" else x
    y = rows * jax.lax.rsqrt(jnp.mean(rows * rows, -1, keepdims=True) + eps)
    if weight_mode != "none":
        w = w.astype(F32)
        y = y * (1.0 + w if weight_mode == "1+w" else w)
    y = y.reshape(x.shape)
    half = cos.shape[-1]
    c = cos[:x.shape[1]][None, :, None, :]
    s = sin[:x.shape[1]][None, :, None, :]
    a, b = y[..., :half], y[..., half:2 * half]
    return jnp.concatenate([a * c - b * s, b * c + a * s, y[..., 2 * half:]], -1)


def _up(options: dict) -> dict:
    """Float arrays among the keyword arguments as float64."""
    return {n: f64(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
            for n, v in options.items()}


def numpy_forward(q, k, q_weight, k_weight, **options):
    """The library's NumPy float64 path on float64 copies of every array."""
    return qk_norm.apply_qk_norm_rope(f64(q), f64(k), f64(q_weight), f64(k_weight),
                                      **_up(options))


def numpy_backward(dq, dk, q, k, q_weight, k_weight, **options):
    return qk_norm.apply_qk_norm_rope_backward(f64(dq), f64(dk), f64(q), f64(k), f64(q_weight),
                                               f64(k_weight), **_up(options))


def ours(q, k, q_weight, k_weight, jit=False, **options):
    """cupy_rope.jax.qk_norm_rope on JAX copies, eagerly or jitted (arrays
    as arguments of the jitted function, options static)."""
    arrays = {n: jx(v) for n, v in options.items() if isinstance(v, np.ndarray)}
    static = {n: v for n, v in options.items() if n not in arrays}

    def f(q, k, qw, kw, arrays):
        return crj.qk_norm_rope(q, k, qw, kw, **arrays, **static)

    return (jax.jit(f) if jit else f)(jx(q), jx(k), jx(q_weight), jx(k_weight), arrays)


# ------------------------------------------------------------- bad input --
# First in the file: a call failing inside the buffer callback leaves its error
# in JAX's last output runtime token, reported again at exit ("Exception
# ignored in atexit callback") unless a later new program replaces it, as the
# tests below do.
@pytest.mark.parametrize("options, match", [
    (dict(eps=0.0), "eps"),
    (dict(eps="1e-6"), "eps"),
    (dict(norm_scope="channel"), "norm_scope"),
    (dict(weight_mode="w+1"), "weight_mode"),
    (dict(rounding="never"), "rounding"),
], ids=["eps-zero", "eps-str", "scope", "weight-mode", "rounding"])
def test_bad_norm_options_raise_when_called(options, match):
    q, k, w = jnp.ones((1, 4, 2, 64)), jnp.ones((1, 4, 1, 64)), jnp.ones(64)
    cos, sin = map(jnp.asarray, angle_tables(64))
    with pytest.raises((TypeError, ValueError), match=match):
        crj.qk_norm_rope(q, k, w, w, cos, sin, **options)


@pytest.mark.parametrize("weights, match", [
    ((np.ones(32, np.float32), np.ones(64, np.float32)), "q_weight"),
    ((np.ones(64, np.float32), np.ones(128, np.float32)), "k_weight"),
    ((np.ones(64, np.float32), np.ones(64, np.float16)), "k_weight"),
], ids=["q-weight-shape", "k-weight-shape", "k-weight-dtype"])
def test_bad_weight_names_it_and_later_calls_work(weights, match):
    q, k = jnp.ones((1, 4, 2, 64)), jnp.ones((1, 4, 1, 64))
    cos, sin = map(jnp.asarray, angle_tables(64))
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(crj.qk_norm_rope(q, k, *map(jnp.asarray, weights), cos, sin))
    w = jnp.ones(64)
    q2, k2 = jax.block_until_ready(crj.qk_norm_rope(q, k, w, w, cos, sin))
    # all-ones rows normalize to ones; position 0 does not rotate
    np.testing.assert_allclose(np.asarray(q2[0, 0]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(k2[0, 0]), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- values --
VALUE_CASES = {
    "f32-head-w": Case(),
    "bf16-head-w-qwen3": Case("bfloat16"),
    "bf16-head-1+w-after-gemma": Case("bfloat16", weight_mode="1+w", rounding="after_weight"),
    "f16-token-w-olmo2": Case("float16", "token", eps=1e-5),
    "bf16-token-none": Case("bfloat16", "token", "none"),
    "f32-token-1+w-after": Case("float32", "token", "1+w", "after_weight"),
    "f32-head-none-mqa-d128": Case(weight_mode="none", q_shape=(1, 12, 4, 128), k_heads=1),
    "bf16-head-w-partial-d80": Case("bfloat16", q_shape=(2, 8, 4, 80), rotary_dim=32),
    "f16-token-w-d256-partial": Case("float16", "token", q_shape=(1, 8, 2, 256), k_heads=1,
                                     rotary_dim=128),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(VALUE_CASES))
def test_values_match_the_numpy_float64_api(rng, name, jit):
    case = VALUE_CASES[name]
    q, k, qw, kw = make_inputs(rng, case)
    cos, sin = angle_tables(case.rotary_dim or case.q_shape[-1])
    got = ours(q, k, qw, kw, jit, cos=cos, sin=sin, **case.options())
    ref = numpy_forward(q, k, qw, kw, cos=cos, sin=sin, **case.options())
    for g, r, a, what in zip(got, ref, (q, k), ("q", "k")):
        assert g.dtype == DTYPES[case.dtype] and g.shape == a.shape
        assert_close(to_np32(g), r, case.dtype, f"{name} {what}")


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_layouts_positions_offsets_and_angle_sources(rng, layout):
    """sbhd with traced positions and inv_freq; thd with cu_seqlens, offsets
    per sequence and GPT-J pairs; eager and jitted agree bit for bit."""
    case = Case("bfloat16", "token", q_shape=(16, 3, 4, 64) if layout == "sbhd" else (40, 4, 64),
                layout=layout)
    q, k, qw, kw = make_inputs(rng, case)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    if layout == "sbhd":
        extra = dict(inv_freq=inv_freq,
                     positions=rng.integers(0, 50, (3, 16)).astype(np.int32))
    else:
        cos, sin = angle_tables(64, rows=128)
        extra = dict(cos=cos, sin=sin, cu_seqlens=np.array([0, 7, 7, 25, 40], np.int32),
                     offsets=np.array([3, 0, 60, 11], np.int32), interleaved=True)
    options = {**case.options(), **extra}
    eager = ours(q, k, qw, kw, **options)
    jitted = ours(q, k, qw, kw, jit=True, **options)
    ref = numpy_forward(q, k, qw, kw, **options)
    for e, j, r, what in zip(eager, jitted, ref, ("q", "k")):
        assert_close(to_np32(j), r, case.dtype, f"{layout} {what}")
        np.testing.assert_array_equal(to_np32(e), to_np32(j))


def test_launches_through_the_buffer_callback():
    case = Case()
    q, k, qw, kw = (jnp.zeros(s) for s in (case.q_shape, case.k_shape, (64,), (64,)))
    cos, sin = map(jnp.asarray, angle_tables(64))
    hlo = jax.jit(crj.qk_norm_rope).lower(q, k, qw, kw, cos, sin).as_text()
    assert "xla_buffer_python_gpu_callback" in hlo or "xla_buffer_python_cpu_callback" in hlo
    assert "pure_callback" not in hlo


# ------------------------------------------------------------- gradients --
def weighted_loss(fn, cq, ck):
    def loss(q, k, qw, kw):
        oq, ok = fn(q, k, qw, kw)
        return jnp.sum(oq.astype(F32) * cq) + jnp.sum(ok.astype(F32) * ck)
    return loss


GRAD_CASES = {
    "head-w": Case(),
    "head-1+w": Case(weight_mode="1+w", rounding="after_weight"),
    "head-none": Case(weight_mode="none"),
    "token-w": Case(scope="token"),
    "token-1+w": Case(scope="token", weight_mode="1+w"),
    "token-none-partial": Case(scope="token", weight_mode="none", rotary_dim=32),
    "head-w-partial-d128": Case(q_shape=(1, 24, 4, 128), k_heads=4, rotary_dim=64),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_grad_matches_jax_grad_of_the_formula(rng, name, jit):
    """float32: jax.grad for q, k and both weights against jax.grad of the
    jnp formula; the weight gradients are bit-identical on a second run."""
    case = GRAD_CASES[name]
    q, k, qw, kw = make_inputs(rng, case)
    cos, sin = map(jnp.asarray, angle_tables(case.rotary_dim or case.q_shape[-1]))
    cq = jnp.asarray(rng.standard_normal(case.q_shape), F32)
    ck = jnp.asarray(rng.standard_normal(case.k_shape), F32)
    norm = dict(scope=case.scope, weight_mode=case.weight_mode, eps=case.eps)
    with_w = case.weight_mode != "none"
    argnums = (0, 1, 2, 3) if with_w else (0, 1)

    def mine(q, k, qw, kw):
        return crj.qk_norm_rope(q, k, qw, kw, cos, sin, **{
            n: v for n, v in case.options().items() if n != "layout"})

    def reference(q, k, qw, kw):
        return (formula(q, qw, cos, sin, rotary_dim=case.rotary_dim, **norm),
                formula(k, kw, cos, sin, rotary_dim=case.rotary_dim, **norm))

    grad = jax.grad(weighted_loss(mine, cq, ck), argnums=argnums)
    grad = jax.jit(grad) if jit else grad
    args = tuple(jx(a) for a in (q, k, qw, kw))
    got = grad(*args)
    want = jax.grad(weighted_loss(reference, cq, ck), argnums=argnums)(*args)
    for g, w, a, what in zip(got, want, args, ("q", "k", "q_weight", "k_weight")):
        assert g.shape == a.shape and g.dtype == a.dtype, what
        assert_close(np.asarray(g), np.asarray(w), "float32", f"{name} d{what}")
    again = grad(*args)
    for g, h in zip(got[2:], again[2:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("scope", ["head", "token"])
def test_vjp_in_bfloat16_matches_the_numpy_float64_backward(rng, scope):
    """bf16 under jit: the cotangents of q, k and both weights against
    apply_qk_norm_rope_backward on float64 NumPy arrays."""
    case = Case("bfloat16", scope, "1+w", q_shape=(2, 32, 8, 128))
    q, k, qw, kw = make_inputs(rng, case)
    cos, sin = angle_tables(128)
    dq = rng.standard_normal(case.q_shape).astype(np_dtype("bfloat16"))
    dk = rng.standard_normal(case.k_shape).astype(np_dtype("bfloat16"))
    options = case.options()
    tables = (jnp.asarray(cos), jnp.asarray(sin))

    @jax.jit
    def vjp(q, k, qw, kw, dq, dk):
        _, pull = jax.vjp(lambda *a: crj.qk_norm_rope(*a, *tables, **options), q, k, qw, kw)
        return pull((dq, dk))

    got = vjp(*(jnp.asarray(a) for a in (q, k, qw, kw, dq, dk)))
    ref = numpy_backward(dq, dk, q, k, qw, kw, cos=cos, sin=sin, **options)
    for g, r, what in zip(got, ref, ("dq", "dk", "dq_weight", "dk_weight")):
        assert g.dtype == jnp.bfloat16, what
        assert_close(to_np32(g), r, "bfloat16", f"{scope} {what}")
