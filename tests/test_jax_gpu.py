"""cupy_rope.jax: values and jax.grad against a pure-JAX reference, eager and jitted (GPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from helpers import assert_close  # noqa: E402

crj = pytest.importorskip("cupy_rope.jax")

pytestmark = pytest.mark.gpu

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------- reference --
def axis_of_frequency(sections, sections_interleaved):
    """The position axis of each frequency: contiguous sections (Qwen2-VL, axial),
    or Qwen3-VL's interleaving (T H W T H W ... while H and W last, then T)."""
    if not sections_interleaved:
        return np.repeat(np.arange(len(sections)), sections)
    axis = []
    for f in range(sum(sections)):
        a = f % 3
        axis.append(a if a and f < 3 * sections[a] else 0)
    return np.array(axis)


def ref_rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None, offsets=None,
             layout="bshd", cu_seqlens=None, interleaved=False, rotary_dim=None, backward=False,
             sections=None, sections_interleaved=False):
    """Pure-JAX float32 reference (x upcast), differentiable by jax.grad in x.

    With ``sections``, positions are [axes, s] / [axes, b, s] (thd: [axes, t])
    and frequency f turns by the position of its axis."""
    x = x.astype(jnp.float32)
    if sections is not None:
        pos = np.asarray(positions)
        if layout != "thd":
            b, s = (x.shape[0], x.shape[1]) if layout == "bshd" else (x.shape[1], x.shape[0])
            pos = np.broadcast_to(pos.reshape(pos.shape[0], -1, s), (pos.shape[0], b, s))
            if layout == "sbhd":
                pos = pos.transpose(0, 2, 1)
        # [tokens..., r/2]: each frequency at the position of its axis
        pos = np.moveaxis(pos[axis_of_frequency(sections, sections_interleaved)], 0, -1)
        f = np.arange(pos.shape[-1])
        if inv_freq is not None:
            theta = pos.astype(np.float64) * np.asarray(inv_freq, np.float64)
            c, s_ = jnp.asarray(np.cos(theta), jnp.float32), jnp.asarray(np.sin(theta), jnp.float32)
        else:
            c, s_ = cos[pos, f].astype(jnp.float32), sin[pos, f].astype(jnp.float32)
        return _rotate(x, c, s_, interleaved, rotary_dim, backward)
    if layout == "thd":
        T = x.shape[0]
        if positions is not None:
            pos = positions
        else:
            cu = np.asarray(cu_seqlens)
            pos = np.concatenate([np.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)])
            if offsets is not None:
                pos = pos + np.repeat(np.asarray(offsets), np.diff(cu))
        pos = jnp.asarray(pos).reshape(T)
    else:
        b, s = (x.shape[0], x.shape[1]) if layout == "bshd" else (x.shape[1], x.shape[0])
        pos = jnp.broadcast_to(jnp.arange(s) if positions is None else positions, (b, s))
        if offsets is not None:
            pos = pos + (offsets if isinstance(offsets, int) else jnp.asarray(offsets)[:, None])
        if layout == "sbhd":
            pos = pos.T
    if inv_freq is not None:  # float64 angles on the host (positions are concrete here)
        theta = np.asarray(pos, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
        c, s_ = jnp.asarray(np.cos(theta), jnp.float32), jnp.asarray(np.sin(theta), jnp.float32)
    elif freqs is not None:
        c, s_ = jnp.cos(freqs[pos]), jnp.sin(freqs[pos])
    else:
        c, s_ = cos[pos].astype(jnp.float32), sin[pos].astype(jnp.float32)
    return _rotate(x, c, s_, interleaved, rotary_dim, backward)


def _rotate(x, c, s_, interleaved, rotary_dim, backward):
    """x [tokens..., h, d] rotated by angles whose cos, sin are [tokens..., r/2]."""
    c, s_ = c[..., None, :], s_[..., None, :]
    if backward:
        s_ = -s_
    r = 2 * c.shape[-1] if rotary_dim is None else rotary_dim
    if interleaved:
        a, b_ = x[..., 0:r:2], x[..., 1:r:2]
        rot = jnp.stack([a * c - b_ * s_, b_ * c + a * s_], axis=-1).reshape(x.shape[:-1] + (r,))
    else:
        a, b_ = x[..., :r // 2], x[..., r // 2:r]
        rot = jnp.concatenate([a * c - b_ * s_, b_ * c + a * s_], axis=-1)
    return jnp.concatenate([rot, x[..., r:]], axis=-1)


def tables(d, rows=64, dtype=jnp.float32, rotary_dim=None):
    r = rotary_dim or d
    inv_freq = 1.0 / 10000 ** (np.arange(0, r, 2) / r)
    theta = np.arange(rows)[:, None] * inv_freq
    return {"cos": jnp.asarray(np.cos(theta), dtype), "sin": jnp.asarray(np.sin(theta), dtype),
            "inv_freq": jnp.asarray(inv_freq, jnp.float32),
            "freqs": jnp.asarray(theta, jnp.float32)}


def randn(key, shape, dtype):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(DTYPES[dtype])


def check(ours, ref, args, dtype, what, jit=False):
    """Values and jax.grad (of a weighted sum) of ``ours`` vs ``ref``, eager or jitted."""
    outs = ours(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ws = [randn(100 + i, o.shape, "float32").astype(o.dtype) for i, o in enumerate(outs)]

    def loss(fn):
        def f(*a):
            r = fn(*a)
            r = r if isinstance(r, tuple) else (r,)
            return sum(jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32))
                       for o, w in zip(r, ws))
        return f

    grad = jax.grad(loss(ours), argnums=tuple(range(len(args))))
    if jit:
        ours_j = jax.jit(ours)
        outs = ours_j(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grad = jax.jit(grad)
    grads = grad(*args)
    ref_args = [a.astype(jnp.float32) for a in args]
    ref_outs = ref(*ref_args)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    ref_grads = jax.grad(loss(ref), argnums=tuple(range(len(args))))(*ref_args)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert isinstance(o, jax.Array) and o.dtype == args[0].dtype and o.shape == r.shape
        assert_close(np.asarray(o.astype(jnp.float32)), np.asarray(r), dtype, f"{what} out{i}")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == args[i].dtype and g.shape == args[i].shape
        assert_close(np.asarray(g.astype(jnp.float32)), np.asarray(r), dtype, f"{what} grad{i}")


class launch_mode:
    """Within the block, cupy_rope.jax lowers its ops by ``mode`` ("xla":
    the fast path where it serves; "callback": buffer_callback)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.saved, crj.xla.MODE = crj.xla.MODE, self.mode

    def __exit__(self, *exc):
        crj.xla.MODE = self.saved


# ------------------------------------------------------------------ tests --
def test_lowers_to_the_buffer_callback_not_a_host_callback():
    """Where the fast path does not serve (CUPY_ROPE_JAX_LAUNCH=callback
    here), the op is the buffer callback, never a host round trip."""
    t = tables(64)
    x = randn(0, (1, 8, 2, 64), "float32")
    with launch_mode("callback"):
        hlo = jax.jit(lambda x: crj.rope(x, t["cos"], t["sin"])).lower(x).as_text()
    assert "xla_buffer_python_gpu_callback" in hlo
    assert "pure_callback" not in hlo and "xla_python_gpu_callback" not in hlo


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("source", ["table", "inv_freq", "freqs"])
def test_rope_values_and_grad(jit, dtype, source):
    t = tables(64)
    kw = {"cos": t["cos"], "sin": t["sin"]} if source == "table" else {source: t[source]}
    x = randn(1, (2, 16, 4, 64), dtype)
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], dtype,
          f"rope {source}", jit)


@pytest.mark.parametrize("jit", [False, True])
def test_rope_sbhd_positions_offsets_interleaved_partial(jit):
    t = tables(64, rotary_dim=32)
    pos = jax.random.randint(jax.random.PRNGKey(2), (3, 16), 0, 40, jnp.int32)
    kw = dict(cos=t["cos"], sin=t["sin"], positions=pos, offsets=jnp.array([0, 5, 11]),
              layout="sbhd", interleaved=True, rotary_dim=32)
    x = randn(3, (16, 3, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
          "rope sbhd", jit)
    kw = dict(inv_freq=t["inv_freq"], offsets=7, backward=True)
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x[:, :2]], "float32",
          "rope backward=True", jit)


def test_tables_as_traced_arguments_and_no_recompile():
    """Tables, positions and offsets may be jit arguments; a second call reuses the program."""
    t = tables(64)

    @jax.jit
    def f(x, cos, sin, off):
        return crj.rope(x * 2.0, cos, sin, offsets=off) + 1.0

    x = randn(4, (2, 8, 2, 64), "float32")
    off = jnp.array([1, 3], jnp.int32)
    for i in range(2):
        y = f(x + i, t["cos"], t["sin"], off)
        ref = ref_rope((x + i) * 2.0, t["cos"], t["sin"], offsets=off) + 1.0
        assert_close(np.asarray(y), np.asarray(ref), "float32", "jit with traced tables")
    assert f._cache_size() == 1


def test_ordering_on_xla_stream():
    """A long producer chain before the op and consumers after it, new data every call:
    right results need the kernel ordered on XLA's stream (nothing synchronizes)."""
    t = tables(128)

    @jax.jit
    def f(a, x):
        a = jax.lax.fori_loop(0, 30, lambda i, a: jnp.tanh(a @ a) * 0.999, a)
        x = x + a[:4, :1, None, None] * 1e-3  # x is ready only after the chain
        y = crj.rope(x, inv_freq=t["inv_freq"])
        return y * 3.0, jnp.sum(y), x

    a = randn(5, (4096, 4096), "float32") * 0.02
    for i in range(3):
        y, total, x_used = f(a, randn(6 + i, (4, 512, 8, 128), "float32"))
        ref = ref_rope(x_used, inv_freq=t["inv_freq"])
        assert_close(np.asarray(y), np.asarray(ref * 3.0), "float32", f"ordered, call {i}")
        np.testing.assert_allclose(float(total), float(jnp.sum(ref)), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("jit", [False, True])
def test_rope_qk(jit):
    t = tables(128)
    kw = dict(cos=t["cos"], sin=t["sin"], offsets=jnp.array([3, 0]))
    q, k = randn(7, (2, 32, 8, 128), "bfloat16"), randn(8, (2, 32, 2, 128), "bfloat16")
    check(lambda q, k: crj.rope_qk(q, k, **kw),
          lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "bfloat16", "rope_qk",
          jit)


@pytest.mark.parametrize("jit", [False, True])
def test_rope_thd(jit):
    t = tables(64)
    cu = jnp.array([0, 5, 12, 30], jnp.int32)
    kw = dict(inv_freq=t["inv_freq"], layout="thd", cu_seqlens=cu)
    x = randn(9, (30, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32", "thd", jit)


def _split(qkv, hq, hk, packing):
    tokens = qkv.shape[:2]
    d = qkv.shape[-1] // (hq + 2 * hk) if qkv.ndim == 3 else qkv.shape[-1]
    heads = qkv.reshape(tokens + (hq + 2 * hk, d))
    if packing == "concat":
        return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
    g = hq // hk
    groups = heads.reshape(tokens + (hk, g + 2, d))
    return groups[..., :g, :].reshape(tokens + (hq, d)), groups[..., g, :], groups[..., g + 1, :]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("packing", ["concat", "grouped"])
def test_rope_qkv(jit, packing):
    hq, hk, d = 8, 2, 64
    t = tables(d)
    kw = dict(cos=t["cos"], sin=t["sin"])
    qkv = randn(10, (2, 16, (hq + 2 * hk) * d), "float32")

    def ref(qkv):
        q, k, v = _split(qkv, hq, hk, packing)
        return ref_rope(q, **kw), ref_rope(k, **kw), v

    check(lambda qkv: crj.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk, packing=packing, **kw),
          ref, [qkv], "float32", f"rope_qkv {packing}", jit)


# ----------------------------------------------- M-RoPE / axial RoPE ----
# scheme: (sections, interleaved pairs, sections_interleaved, angle source); head_dim 64.
MROPE = {"mrope": ((8, 12, 12), False, False, "table"),                 # Qwen2-VL
         "mrope_interleaved": ((12, 10, 10), False, True, "inv_freq"),  # Qwen3-VL
         "axial2d": ((16, 16), True, False, "inv_freq")}               # Flux-like


def mrope_kwargs(scheme, tokens, seed=20, rows=256, d=64):
    sections, interleaved, sec_inter, source = MROPE[scheme]
    if interleaved:  # axial: each axis its own frequency ladder
        inv = np.concatenate([1.0 / 10000 ** (np.arange(n) / n) for n in sections])
    else:
        inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    pos = jax.random.randint(jax.random.PRNGKey(seed), (len(sections),) + tuple(tokens), 0,
                             rows, jnp.int32)
    kw = dict(positions=pos, sections=sections, sections_interleaved=sec_inter,
              interleaved=interleaved)
    if source == "inv_freq":
        kw["inv_freq"] = jnp.asarray(inv, jnp.float32)
    else:
        theta = np.arange(rows)[:, None] * inv
        kw["cos"] = jnp.asarray(np.cos(theta), jnp.float32)
        kw["sin"] = jnp.asarray(np.sin(theta), jnp.float32)
    return kw


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scheme", list(MROPE))
def test_mrope_values_and_grad(jit, scheme):
    kw = mrope_kwargs(scheme, (2, 12))
    x = randn(21, (2, 12, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
          f"rope {scheme}", jit)
    q, k = randn(22, (2, 12, 4, 64), "bfloat16"), randn(23, (2, 12, 2, 64), "bfloat16")
    check(lambda q, k: crj.rope_qk(q, k, **kw),
          lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "bfloat16",
          f"rope_qk {scheme}", jit)


@pytest.mark.parametrize("jit", [False, True])
def test_mrope_thd_and_shared_positions(jit):
    kw = dict(mrope_kwargs("mrope_interleaved", (23,)), layout="thd")
    q, k = randn(24, (23, 4, 64), "float32"), randn(25, (23, 1, 64), "float32")
    check(lambda q, k: crj.rope_qk(q, k, **kw),
          lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "float32",
          "rope_qk thd", jit)
    kw = dict(mrope_kwargs("mrope", (12,)), backward=True)  # [3, s]: shared by the batch
    x = randn(26, (2, 12, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
          "rope [3, s] backward=True", jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("packing", ["concat", "grouped"])
def test_mrope_rope_qkv(jit, packing):
    hq, hk, d = 4, 2, 64
    kw = mrope_kwargs("mrope", (2, 12))
    qkv = randn(27, (2, 12, (hq + 2 * hk) * d), "float32")

    def ref(qkv):
        q, k, v = _split(qkv, hq, hk, packing)
        return ref_rope(q, **kw), ref_rope(k, **kw), v

    check(lambda qkv: crj.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk, packing=packing, **kw),
          ref, [qkv], "float32", f"rope_qkv {packing}", jit)


def test_mrope_traced_positions_no_recompile():
    """Per-axis positions as a jit argument: new positions reuse the program."""
    kw = mrope_kwargs("mrope_interleaved", (2, 12))
    pos0 = kw.pop("positions")

    @jax.jit
    def f(x, positions):
        return crj.rope(x, positions=positions, **kw) * 2.0

    x = randn(28, (2, 12, 4, 64), "float32")
    for i in range(2):
        pos = pos0 + 7 * i
        y = f(x, pos)
        assert_close(np.asarray(y), np.asarray(ref_rope(x, positions=pos, **kw) * 2.0),
                     "float32", f"traced positions, call {i}")
    assert f._cache_size() == 1


def _second_order(fn, x, w):
    """jax.grad of (jax.grad of sum(fn(x) ** 3)) . w: exercises the backward's own vjp."""
    def inner(u):
        outs = fn(u)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o ** 3) for o in outs)
    return jax.grad(lambda t: jnp.sum(jax.grad(inner)(t) * w))(x)


@pytest.mark.parametrize("op", ["rope", "rope_qk", "rope_qkv"])
def test_grad_of_grad(op):
    t = tables(64)
    x = randn(20, (2, 8, 4, 64), "float32")
    w = randn(21, x.shape, "float32")
    if op == "rope":
        ours, ref = (lambda u: crj.rope(u, t["cos"], t["sin"]),
                     lambda u: ref_rope(u, t["cos"], t["sin"]))
    elif op == "rope_qk":
        ours = lambda u: crj.rope_qk(u, u[:, :, :1], t["cos"], t["sin"])  # noqa: E731
        ref = lambda u: (ref_rope(u, t["cos"], t["sin"]),  # noqa: E731
                         ref_rope(u[:, :, :1], t["cos"], t["sin"]))
    else:  # packed [q q k v]: 2 q heads, 1 kv head
        ours = lambda u: crj.rope_qkv(u, t["cos"], t["sin"], num_q_heads=2,  # noqa: E731
                                      num_kv_heads=1)
        ref = lambda u: (ref_rope(u[:, :, :2], t["cos"], t["sin"]),  # noqa: E731
                         ref_rope(u[:, :, 2:3], t["cos"], t["sin"]), u[:, :, 3:])
    for f in (_second_order, jax.jit(_second_order, static_argnums=0)):
        got = f(ours, x, w)
        assert_close(np.asarray(got), np.asarray(_second_order(ref, x, w)), "float32",
                     f"{op} second order")


def test_scalar_offsets_array_in_a_jitted_decode_step():
    """A 0-d offsets array (one offset for every sequence) is traced, not static."""
    t = tables(64)
    step = jax.jit(lambda x, off: crj.rope(x, t["cos"], t["sin"], offsets=off))
    x = randn(22, (3, 1, 4, 64), "float32")
    for pos in (0, 5, 17):
        off = jnp.asarray(pos, jnp.int32)
        want = ref_rope(x, t["cos"], t["sin"], offsets=jnp.full((3,), pos))
        assert_close(np.asarray(step(x, off)), np.asarray(want), "float32", f"offset {pos}")
    assert step._cache_size() == 1


def test_host_int64_positions_beyond_int32_refused():
    if jax.config.jax_enable_x64:
        pytest.skip("with x64, int64 positions stay int64")
    t = tables(64)
    x = randn(23, (1, 4, 2, 64), "float32")
    with pytest.raises(ValueError, match="positions: values reach 4294967299, beyond int32"):
        crj.rope(x, inv_freq=t["inv_freq"], positions=np.full((1, 4), 2**32 + 3, np.int64))


def test_scalar_offsets_array_sbhd_and_thd_and_cupy_tables():
    """0-d offsets broadcast over sbhd's batch and thd's sequences; tables
    given as CuPy arrays (through __cuda_array_interface__) are accepted."""
    cupy = pytest.importorskip("cupy")
    t = tables(64)
    x = randn(24, (2, 6, 3, 64), "float32")
    want = ref_rope(x, t["cos"], t["sin"], offsets=jnp.full((2,), 4))
    off = jnp.asarray(4, jnp.int32)
    got = crj.rope(jnp.transpose(x, (1, 0, 2, 3)), t["cos"], t["sin"], layout="sbhd", offsets=off)
    assert_close(np.asarray(jnp.transpose(got, (1, 0, 2, 3))), np.asarray(want), "float32", "sbhd")
    got = crj.rope(x.reshape(12, 3, 64), t["cos"], t["sin"], layout="thd", offsets=off,
                   cu_seqlens=jnp.array([0, 6, 12], jnp.int32))
    assert_close(np.asarray(got).reshape(x.shape), np.asarray(want), "float32", "thd")
    cos, sin = cupy.asarray(np.asarray(t["cos"])), cupy.asarray(np.asarray(t["sin"]))
    got = crj.rope(x, cos, sin, offsets=off)
    assert_close(np.asarray(got), np.asarray(want), "float32", "CuPy tables")


def test_vmap_runs_each_element():
    """jax.vmap (eager, jitted, under grad): one launch per mapped element,
    the same values as calling per element; offsets mapped along."""
    t = tables(64)
    xs = randn(25, (3, 2, 8, 2, 64), "float32")
    offs = jnp.array([0, 4, 9], jnp.int32)
    f = lambda x, o: crj.rope(x, t["cos"], t["sin"], offsets=o)  # noqa: E731
    want = jnp.stack([ref_rope(xs[i], t["cos"], t["sin"], offsets=jnp.full((2,), int(offs[i])))
                      for i in range(3)])
    for vf in (jax.vmap(f), jax.jit(jax.vmap(f))):
        assert_close(np.asarray(vf(xs, offs)), np.asarray(want), "float32", "vmap")
    g = jax.grad(lambda a: jnp.sum(jax.vmap(f)(a, offs) ** 2))(xs)
    assert_close(np.asarray(g), np.asarray(2 * xs), "float32", "grad of vmap")  # a rotation


# ------------------------------------------ issue 30: what a new user hits --
@pytest.mark.parametrize("jit", [False, True])
def test_one_row_of_positions(jit):
    """positions [1, s] (Hugging Face's position_ids) are shared by the batch;
    [axes, 1, s] for M-RoPE."""
    t = tables(64)
    pos = jax.random.randint(jax.random.PRNGKey(30), (1, 16), 0, 60, jnp.int32)
    kw = dict(cos=t["cos"], sin=t["sin"], positions=pos)
    q, k = randn(31, (2, 16, 4, 64), "bfloat16"), randn(32, (2, 16, 2, 64), "bfloat16")
    check(lambda q, k: crj.rope_qk(q, k, **kw),
          lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "bfloat16",
          "rope_qk [1, s]", jit)
    kw = dict(inv_freq=t["inv_freq"], positions=pos, layout="sbhd")
    x = randn(33, (16, 2, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
          "rope sbhd [1, s]", jit)
    np.testing.assert_array_equal(np.asarray(crj.rope(x, **kw)),
                                  np.asarray(crj.rope(x, **dict(kw, positions=pos[0]))))
    kw = mrope_kwargs("mrope", (1, 12))
    x = randn(34, (2, 12, 4, 64), "float32")
    check(lambda x: crj.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
          "rope M-RoPE [3, 1, s]", jit)


# ------------------------------- issue 33: launched by XLA, no Python at run --
FAST_TARGETS = (crj.xla.PTX_TARGET,) + crj.xla.TRITON_TARGETS
CALLBACK_TARGET = "xla_buffer_python_gpu_callback"


def fast_path_or_skip():
    if crj.xla.target() is None:
        pytest.skip("this jaxlib has neither XLA's PTX custom call nor a GPU kernel launcher")
    if len([d for d in jax.devices() if d.platform == "gpu"]) != 1:
        pytest.skip("the fast path serves a single visible GPU")


def fast_cases():
    """(id, function, arguments, reference) for calls the fast path serves:
    the benchmark's shapes (smaller batches), q+k, qkv, thd decode, M-RoPE."""
    t = tables(128, rows=512)
    cs = dict(cos=t["cos"], sin=t["sin"])
    pos = jax.random.randint(jax.random.PRNGKey(40), (64,), 0, 500, jnp.int32)
    x1 = randn(41, (512, 1, 16, 128), "bfloat16")
    x2 = randn(42, (256, 4, 24, 128), "bfloat16")
    q, k = randn(43, (2, 256, 32, 128), "bfloat16"), randn(44, (2, 256, 8, 128), "bfloat16")
    qd, kd = randn(45, (64, 32, 128), "bfloat16"), randn(46, (64, 8, 128), "bfloat16")
    qkv = randn(47, (2, 128, 12 * 128), "bfloat16")
    mk = mrope_kwargs("mrope", (2, 64))
    xm = randn(48, (2, 64, 8, 64), "float32")
    return [
        ("sbhd", lambda x: crj.rope(x, layout="sbhd", **cs), [x1],
         lambda x: ref_rope(x, layout="sbhd", **cs)),
        ("sbhd-batch", lambda x: crj.rope(x, layout="sbhd", **cs), [x2],
         lambda x: ref_rope(x, layout="sbhd", **cs)),
        ("qk-prefill", lambda q, k: crj.rope_qk(q, k, **cs), [q, k],
         lambda q, k: (ref_rope(q, **cs), ref_rope(k, **cs))),
        ("qk-decode-thd", lambda q, k: crj.rope_qk(q, k, positions=pos, layout="thd", **cs),
         [qd, kd], lambda q, k: (ref_rope(q, positions=pos, layout="thd", **cs),
                                 ref_rope(k, positions=pos, layout="thd", **cs))),
        ("qkv", lambda a: crj.rope_qkv(a, num_q_heads=8, num_kv_heads=2, **cs), [qkv],
         lambda a: (ref_rope(a.reshape(2, 128, 12, 128)[:, :, :8], **cs),
                    ref_rope(a.reshape(2, 128, 12, 128)[:, :, 8:10], **cs),
                    a.reshape(2, 128, 12, 128)[:, :, 10:])),
        ("mrope", lambda x: crj.rope(x, **mk), [xm], lambda x: ref_rope(x, **mk)),
        # one array as q and k, and as cos and sin: one XLA buffer behind two
        # kernel arguments
        ("same-buffer-twice", lambda x: crj.rope_qk(x, x, t["cos"], t["cos"]), [x1],
         lambda x: (ref_rope(x, t["cos"], t["cos"]), ref_rope(x, t["cos"], t["cos"]))),
    ]


FAST_IDS = ["sbhd", "sbhd-batch", "qk-prefill", "qk-decode-thd", "qkv", "mrope",
            "same-buffer-twice"]


def _case(name):
    return next(c for c in fast_cases() if c[0] == name)


def _loss(fn):
    def f(*a):
        r = fn(*a)
        r = r if isinstance(r, tuple) else (r,)
        return sum(jnp.sum(o.astype(jnp.float32) ** 2 * 0.5 + o.astype(jnp.float32))
                   for o in r)
    return f


@pytest.mark.parametrize("name", FAST_IDS)
def test_fast_path_lowering_has_no_python_callback(name):
    """Forward, jax.grad and grad of grad lower to jaxlib's kernel launcher
    and to no Python callback."""
    fast_path_or_skip()
    _, fn, args, _ = _case(name)
    grad = jax.grad(_loss(fn), argnums=tuple(range(len(args))))
    second = jax.grad(lambda *a: sum(jnp.sum(g.astype(jnp.float32))
                                     for g in grad(*a)), argnums=0)
    with launch_mode("xla"):
        for what, f in (("forward", fn), ("grad", grad), ("grad of grad", second)):
            crj.xla.last_refusal[0] = ""
            hlo = jax.jit(f).lower(*args).as_text()
            assert any(t in hlo for t in FAST_TARGETS), (what, crj.xla.last_refusal[0])
            assert CALLBACK_TARGET not in hlo, (what, crj.xla.last_refusal[0])


class _Counting:
    """Counts the library calls the buffer callback makes (none on the fast path)."""

    NAMES = ("apply_rope", "apply_rope_qk", "apply_rope_qkv", "apply_rope_qkv_backward")

    def __init__(self, monkeypatch):
        self.calls = 0
        for n in self.NAMES:
            real = getattr(crj.api, n)
            monkeypatch.setattr(crj.api, n, self._wrap(real))

    def _wrap(self, real):
        @functools.wraps(real)  # the same signature (rope_qkv reads it)
        def counted(*a, **kw):
            self.calls += 1
            return real(*a, **kw)
        return counted


@pytest.mark.parametrize("name", FAST_IDS)
def test_fast_path_runs_no_python_and_equals_the_callback(name, monkeypatch):
    """Jitted and eager, forward and jax.grad: no Python runs at execution
    time (the library is never called), and the results are bitwise those
    of the callback path (the same kernel), and close to the reference."""
    fast_path_or_skip()
    _, fn, args, ref = _case(name)
    grad = jax.grad(_loss(fn), argnums=tuple(range(len(args))))
    counting = _Counting(monkeypatch)
    with launch_mode("xla"):
        fast = [jax.jit(fn)(*args), jax.jit(grad)(*args), fn(*args)]
        jax.block_until_ready(fast)
    assert counting.calls == 0
    with launch_mode("callback"):  # fresh functions: nothing traced above is reused
        slow = [jax.jit(lambda *a: fn(*a))(*args), jax.jit(lambda *a: grad(*a))(*args)]
        jax.block_until_ready(slow)
    assert counting.calls > 0  # the control: the counter sees the callback
    for got, want in zip(jax.tree_util.tree_leaves(fast[:2]), jax.tree_util.tree_leaves(slow)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)), err_msg=name)
    outs = fast[2] if isinstance(fast[2], tuple) else (fast[2],)
    refs = ref(*[a.astype(jnp.float32) for a in args])
    refs = refs if isinstance(refs, tuple) else (refs,)
    for o, r in zip(outs, refs):
        assert_close(np.asarray(o.astype(jnp.float32)), np.asarray(r), str(args[0].dtype), name)


def test_fast_path_takes_xlas_ptx_call_where_jaxlib_has_it():
    """From PTX_TARGET_JAXLIB on, XLA launches the kernel itself (a kernel
    thunk): not jaxlib's launcher, whose host code runs per execution."""
    fast_path_or_skip()
    _, fn, args, _ = _case("sbhd")
    with launch_mode("xla"):
        hlo = jax.jit(fn).lower(*args).as_text()
    uses_ptx = crj.xla._jaxlib_version() >= crj.xla.PTX_TARGET_JAXLIB
    assert (crj.xla.PTX_TARGET in hlo) == uses_ptx, crj.xla.last_refusal[0]
    assert any(t in hlo for t in crj.xla.TRITON_TARGETS) != uses_ptx


def test_fast_path_vmap_and_ordering(monkeypatch):
    """vmap (one launch per element) and a producer chain on XLA's stream,
    with no Python at execution time."""
    fast_path_or_skip()
    # Rows for every position: 64 tokens plus offsets up to 9 (a position
    # past the table gives NaN in the kernel, a clamped row in the reference).
    t = tables(128, rows=128)
    counting = _Counting(monkeypatch)
    xs = randn(50, (3, 2, 64, 8, 128), "float32")
    offs = jnp.array([0, 4, 9], jnp.int32)
    f = lambda x, o: crj.rope(x, t["cos"], t["sin"], offsets=o)  # noqa: E731
    want = jnp.stack([ref_rope(xs[i], t["cos"], t["sin"], offsets=jnp.full((2,), int(offs[i])))
                      for i in range(3)])

    @jax.jit
    def chain(a, x):
        a = jax.lax.fori_loop(0, 30, lambda i, a: jnp.tanh(a @ a) * 0.999, a)
        x = x + a[:4, :1, None, None] * 1e-3
        return crj.rope(x, inv_freq=t["inv_freq"]) * 3.0, x

    with launch_mode("xla"):
        assert_close(np.asarray(jax.jit(jax.vmap(f))(xs, offs)), np.asarray(want), "float32",
                     "vmap")
        a = randn(51, (4096, 4096), "float32") * 0.02
        for i in range(3):
            y, x_used = chain(a, randn(52 + i, (4, 512, 8, 128), "float32"))
            assert_close(np.asarray(y), np.asarray(ref_rope(x_used, inv_freq=t["inv_freq"]) * 3),
                         "float32", f"ordered, call {i}")
    assert counting.calls == 0
