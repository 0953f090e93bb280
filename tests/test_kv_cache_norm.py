"""apply_rope_and_cache with the per-head q/k RMSNorm on NumPy arrays: the
float64 path against the formula written out here, the norm's argument
checks (nothing written on bad input), the specialization and the
parameter block it packs (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_rope import kv_cache, launch, norm_launch
from cupy_rope.kv_cache import apply_qkv_rope_and_cache, apply_rope_and_cache
from cupy_rope.validate import NormOptions

T, HQ, HK, D = 5, 4, 2, 64
NUM_BLOCKS, BLOCK_SIZE = 3, 4


def _inputs(rng, d=D):
    return (3 * rng.standard_normal((T, HQ, d)) + 0.5, 2 * rng.standard_normal((T, HK, d)),
            rng.standard_normal((T, HK, d)))


def _caches(layout="NHD", d=D):
    shape = (NUM_BLOCKS, BLOCK_SIZE, HK, d) if layout == "NHD" else (NUM_BLOCKS, HK, BLOCK_SIZE, d)
    return np.full(shape, np.nan), np.full(shape, np.nan)


def _rotated(x, pos, inv, rotary_dim, interleaved):
    """x [t, h, d] rotated by pos * inv in float64, the tail kept."""
    theta = pos[:, None, None] * inv[None, None, :]
    c, s = np.cos(theta), np.sin(theta)
    y = x.copy()
    if interleaved:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2] = a * c - b * s, b * c + a * s
    else:
        h = rotary_dim // 2
        a, b = x[..., :h], x[..., h:rotary_dim]
        y[..., :h], y[..., h:rotary_dim] = a * c - b * s, b * c + a * s
    return y


def _normed(x, w, mode, eps):
    """Per-head RMSNorm in float64: x / sqrt(mean(x^2) + eps) times w, 1 + w or 1."""
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if mode == "none" else y * (w if mode == "w" else 1.0 + w)


def _slot_rows(cache, slot, layout):
    blk, off = divmod(int(slot), BLOCK_SIZE)
    return cache[blk, off] if layout == "NHD" else cache[blk, :, off]


# ------------------------------------------------------------- semantics --
@pytest.mark.parametrize("mode", ["w", "1+w", "none"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("interleaved, rotary_dim", [(False, D), (True, D), (False, D // 2)],
                         ids=["neox", "gptj", "neox-partial"])
@pytest.mark.parametrize("q_mode", ["new", "inplace"])
def test_reference_is_norm_then_rotation_then_cache(rng, mode, layout, interleaved, rotary_dim,
                                                    q_mode):
    q, k, v = _inputs(rng)
    qw, kw = (rng.standard_normal(D) * 0.3 + (mode == "w"), rng.standard_normal(D) * 0.3)
    weights = dict(q_weight=qw, k_weight=kw) if mode != "none" else {}
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    k_cache, v_cache = _caches(layout)
    slots = np.array([5, -1, 0, 11, 3])
    pos = rng.integers(0, 100, T).astype(np.float64)
    inv = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    out = apply_rope_and_cache(q, k, v, k_cache, v_cache, slots, inv_freq=inv,
                               positions=pos.astype(np.int64), interleaved=interleaved,
                               rotary_dim=rotary_dim, cache_layout=layout, eps=1e-5,
                               weight_mode=mode, inplace=q_mode == "inplace", **weights)
    q_want = _rotated(_normed(q0, qw, mode, 1e-5), pos, inv, rotary_dim, interleaved)
    k_want = _rotated(_normed(k0, kw, mode, 1e-5), pos, inv, rotary_dim, interleaved)
    np.testing.assert_allclose(out, q_want, rtol=1e-12, atol=1e-12)  # the tail normalized
    assert (out is q) == (q_mode == "inplace")
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)
    for i, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_allclose(_slot_rows(k_cache, s, layout), k_want[i], rtol=1e-12,
                                       atol=1e-12)
            np.testing.assert_array_equal(_slot_rows(v_cache, s, layout), v0[i])  # v as it is
    untouched = set(range(NUM_BLOCKS * BLOCK_SIZE)) - set(slots[slots >= 0].tolist())
    for s in untouched:
        assert np.isnan(_slot_rows(k_cache, s, layout)).all()
        assert np.isnan(_slot_rows(v_cache, s, layout)).all()


def test_weights_alone_mean_weight_mode_w(rng):
    q, k, v = _inputs(rng)
    qw, kw = rng.standard_normal(D), rng.standard_normal(D)
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    pos = np.arange(T)
    runs = []
    for mode in (None, "w"):
        k_cache, v_cache = _caches()
        out = apply_rope_and_cache(q, k, v, k_cache, v_cache, np.arange(T), inv_freq=inv,
                                   positions=pos, q_weight=qw, k_weight=kw, weight_mode=mode)
        runs.append((out, k_cache))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_packed_qkv_with_norm_is_the_split_call(rng):
    q, k, v = _inputs(rng)
    qkv = np.concatenate([q, k, v], axis=1).reshape(T, -1)
    qw, kw = rng.standard_normal(D), rng.standard_normal(D)
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    kc1, vc1 = _caches()
    kc2, vc2 = _caches()
    slots = np.array([1, 2, -1, 7, 8])
    a = apply_qkv_rope_and_cache(qkv, kc1, vc1, slots, inv_freq=inv, positions=np.arange(T),
                                 num_q_heads=HQ, num_kv_heads=HK, q_weight=qw, k_weight=kw,
                                 rounding="after_weight")
    b = apply_rope_and_cache(q, k, v, kc2, vc2, slots, inv_freq=inv, positions=np.arange(T),
                             q_weight=qw, k_weight=kw, rounding="after_weight")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kc1, kc2)
    np.testing.assert_array_equal(vc1, vc2)


def test_bfloat16_rounds_as_the_norm_op(rng):
    """In bfloat16 the reference rounds x_hat, then x_hat * w (before_weight),
    then the rotation's result, as apply_qk_norm_rope's reference does."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import cupy_rope

    bf = ml_dtypes.bfloat16
    q, k, v = (a.astype(bf) for a in _inputs(rng))
    qw, kw = (rng.standard_normal(D).astype(bf) for _ in range(2))
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    pos = np.arange(T)
    k_cache, v_cache = (np.zeros(c.shape, bf) for c in _caches())
    out = apply_rope_and_cache(q, k, v, k_cache, v_cache, np.arange(T), inv_freq=inv,
                               positions=pos, q_weight=qw, k_weight=kw)
    q_ref, k_ref = cupy_rope.apply_qk_norm_rope(q, k, qw, kw, inv_freq=inv, positions=pos,
                                                layout="thd")
    np.testing.assert_array_equal(out.view(np.uint16), q_ref.view(np.uint16))
    for i in range(T):
        np.testing.assert_array_equal(_slot_rows(k_cache, i, "NHD").view(np.uint16),
                                      k_ref[i].view(np.uint16))


# ------------------------------------------------------------ bad input --
def _call(rng, **kw):
    q, k, v = _inputs(rng)
    k_cache, v_cache = _caches()
    args = dict(inv_freq=1.0 / 10000 ** (np.arange(0, D, 2) / D), positions=np.arange(T))
    args.update(kw)
    before = [a.copy() for a in (q, k, v, k_cache, v_cache)]
    try:
        apply_rope_and_cache(q, k, v, k_cache, v_cache, np.arange(T), **args)
    finally:  # whatever was raised, nothing was written
        for a, b in zip((q, k, v, k_cache, v_cache), before):
            np.testing.assert_array_equal(a, b)


W = np.ones(D)
BAD = [
    ("q_weight-missing", dict(k_weight=W), ValueError, "q_weight"),
    ("k_weight-missing-w", dict(q_weight=W, weight_mode="w"), ValueError, "k_weight"),
    ("1+w-no-weights", dict(weight_mode="1+w"), ValueError, "q_weight"),
    ("none-with-weights", dict(q_weight=W, k_weight=W, weight_mode="none"), ValueError,
     "q_weight"),
    ("bad-weight-mode", dict(q_weight=W, k_weight=W, weight_mode="1-w"), ValueError,
     "weight_mode"),
    ("bad-rounding", dict(q_weight=W, k_weight=W, rounding="never"), ValueError, "rounding"),
    ("eps-zero", dict(q_weight=W, k_weight=W, eps=0.0), ValueError, "eps"),
    ("eps-str", dict(q_weight=W, k_weight=W, eps="1e-6"), TypeError, "eps"),
    ("eps-underflows-fp32", dict(weight_mode="none", eps=1e-60), ValueError, "eps"),
    ("weight-shape", dict(q_weight=np.ones(D // 2), k_weight=np.ones(D // 2)), ValueError,
     "q_weight"),
    ("weight-token-shape", dict(q_weight=np.ones(HQ * D), k_weight=np.ones(HK * D)),
     ValueError, "q_weight"),
    ("weight-dtypes-differ", dict(q_weight=W, k_weight=W.astype(np.float32)), TypeError,
     "k_weight"),
    ("weight-strided", dict(q_weight=np.ones(2 * D)[::2], k_weight=W), ValueError, "q_weight"),
    ("weight-int", dict(q_weight=np.ones(D, np.int32), k_weight=W), TypeError, "q_weight"),
    ("eps-without-norm", dict(eps=1e-5), ValueError, "eps"),
    ("rounding-without-norm", dict(rounding="after_weight"), ValueError, "rounding"),
]


@pytest.mark.parametrize("kw, exc, name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_norm_arguments_name_the_argument(rng, kw, exc, name):
    with pytest.raises(exc, match=name):
        _call(rng, **kw)


def test_output_overlapping_a_weight_is_refused(rng):
    q, k, v = _inputs(rng)
    k_cache, v_cache = _caches()
    before = k_cache.copy()
    with pytest.raises(ValueError, match="k_weight"):
        apply_rope_and_cache(q, k, v, k_cache, v_cache, np.arange(T),
                             inv_freq=1.0 / 10000 ** (np.arange(0, D, 2) / D),
                             positions=np.arange(T), q_weight=W,
                             k_weight=k_cache[0, 0, 0])
    np.testing.assert_array_equal(k_cache, before)


# ------------------------------------------------- specialization, params --
def _fake_call(norm, rotary=128):
    return kv_cache._shipped_call("bfloat16", "same", 128, False, "table", "explicit", rotary,
                                  False, launch._FakeArrays(), norm)


@pytest.mark.parametrize("rotary, lanes", [(128, 8), (64, 16)])
def test_norm_spec_uses_the_norm_ops_items(rotary, lanes):
    """The pairs of an item, the tail items and the lanes are those the
    norm op picks (the widest the views allow, then its lane layout), so
    that both sum a row's squares in one order."""
    cc = _fake_call(NormOptions("head", "1+w", "after_weight"), rotary)
    spec = kv_cache.choose_spec(cc, 1)
    assert (spec.norm, spec.weight_mode, spec.round_before) == (True, "1+w", False)
    assert spec.pairs == 8 and spec.tail_vec == (8 if rotary < 128 else 1)
    assert (spec.lanes, spec.k_items) == (lanes, 1) == norm_launch.lane_layout(
        128, rotary, spec.pairs, spec.tail_vec)
    assert spec.items == lanes and not spec.copy_q_tail
    assert "true, rope::bf16, 2, false, %d, 1>" % lanes in spec.name_expression()


def test_without_the_norm_the_spec_is_todays():
    spec = kv_cache.choose_spec(_fake_call(None), 1)
    assert not spec.norm and spec.items == 8  # one thread an item: 64 pairs, 8 a thread
    assert spec.name_expression().endswith("false, false, float, 0, false, 1, 1>")


def test_eps_is_packed_where_the_kernel_reads_it():
    cc = _fake_call(NormOptions("head", "w", "before_weight", 3e-5))
    fixed = kv_cache._cache_fixed(cc)
    names = [n for n, _ in kv_cache.CACHE_FIXED_FIELDS]
    assert names[-1] == "eps"
    assert kv_cache._CACHE_FIXED.unpack(fixed)[-1] == np.float32(3e-5)
    assert [n for n, _ in kv_cache.CACHE_DYNAMIC_FIELDS][-2:] == ["weight[0]", "weight[1]"]


# -------------------------------------------------------------- torch op --
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_op_takes_the_norm(rng, inplace):
    """cupy_rope.torch's cache op with the norm weights (CPU tensors: the
    float64 path) writes what the library call writes."""
    torch = pytest.importorskip("torch")
    import cupy_rope.torch as crt

    q, k, v = _inputs(rng)
    qw, kw = rng.standard_normal(D), rng.standard_normal(D)
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    slots = np.array([1, 2, -1, 7, 8])
    kc, vc = _caches()
    want = apply_rope_and_cache(q, k, v, kc, vc, slots, inv_freq=inv, positions=np.arange(T),
                                q_weight=qw, k_weight=kw, weight_mode="1+w", eps=1e-5)
    t = lambda a: torch.from_numpy(a.copy())  # noqa: E731
    tk, tv = (t(c) for c in _caches())
    tq = t(q)
    got = crt.rope_and_cache(tq, t(k), t(v), tk, tv, t(slots), inv_freq=t(inv),
                             positions=torch.arange(T), q_weight=t(qw), k_weight=t(kw),
                             weight_mode="1+w", eps=1e-5, inplace=inplace)
    assert (got is tq) == inplace
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(tk.numpy(), kc)
    np.testing.assert_array_equal(tv.numpy(), vc)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(eps="small"), TypeError, "eps"), (dict(weight_mode=1), TypeError, "weight_mode"),
    (dict(q_weight=np.ones(D), k_weight=np.ones(D)), TypeError, "q_weight"),
    (dict(rounding=None), TypeError, "rounding")], ids=["eps", "weight_mode", "numpy-weight",
                                                         "rounding"])
def test_torch_op_checks_the_norm_arguments(rng, kw, exc, name):
    torch = pytest.importorskip("torch")
    import cupy_rope.torch as crt

    q, k, v = (torch.from_numpy(a) for a in _inputs(rng))
    kc, vc = (torch.from_numpy(c) for c in _caches())
    with pytest.raises(exc, match=name):
        crt.rope_and_cache(q, k, v, kc, vc, torch.arange(T), inv_freq=torch.ones(D // 2),
                           positions=torch.arange(T), **kw)
