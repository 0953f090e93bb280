"""The fused q/k RMSNorm + RoPE kernels against the float64 reference on
fresh random inputs, forward and backward (GPU).

Expected values come from cupy_rope.reference (q/k norm + rope in float64,
y rounded to x's dtype as the kernels round it) on the same host inputs.
Outputs are poisoned with NaN before each launch; in place on strided views,
every byte the call does not own is checked bit-identical afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupy_rope import reference
from cupy_rope.qk_norm import (_forward_inputs, apply_qk_norm_rope,
                               apply_qk_norm_rope_backward, apply_qkv_norm_rope, check_norm)
from cupy_rope.validate import check_call
from gpu_util import bits, full_nan, to_device, to_host
from helpers import assert_close, np_dtype

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float16", "bfloat16"]
HEAD_DIMS = [64, 80, 128, 256]
SCOPES = ["head", "token"]
EXTRA_ROWS = 16


class Variant:
    """One norm + rotation setting: weight mode, rounding, style, rotary fraction."""

    def __init__(self, weight_mode, rounding, interleaved, fraction):
        self.weight_mode, self.rounding = weight_mode, rounding
        self.interleaved, self.fraction = interleaved, fraction

    def rotary_dim(self, d):
        return int(d * self.fraction) // 2 * 2

    def __repr__(self):
        style = "gptj" if self.interleaved else "neox"
        return f"{self.weight_mode}-{self.rounding}-{style}-r{self.fraction}"


#: Together they cover each weight mode, both roundings, both styles and
#: full and partial rotary; every dtype x head_dim x scope runs all four.
VARIANTS = [Variant("w", "before_weight", False, 1.0), Variant("1+w", "after_weight", True, 0.5),
            Variant("none", "before_weight", False, 0.5), Variant("w", "after_weight", True, 1.0)]


# ----------------------------------------------------------------- data --
def randn(rng, shape, dtype, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np_dtype(dtype))


def weights(rng, n_q, n_k, dtype, mode):
    """(q_weight, k_weight) host arrays for ``mode`` (None for "none"):
    around 1 for "w", around 0 for "1+w", as trained models have them."""
    if mode == "none":
        return None, None
    shift = 1.0 if mode == "w" else 0.0
    return randn(rng, (n_q,), dtype, 0.3, shift), randn(rng, (n_k,), dtype, 0.3, shift)


def tables(rng, rotary_dim, rows):
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    inv_freq = inv_freq * rng.uniform(0.5, 1.5, inv_freq.shape)
    theta = np.arange(rows)[:, None] * inv_freq
    return {"cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32)}


def weight_len(scope, heads, d):
    return d * (heads if scope == "token" else 1)


def weight_lens(scope, q, k, rope_kw):
    """The weight lengths of q and k (heads flattened into [.., h * d] too)."""
    def heads_dim(a):
        d = rope_kw.get("head_dim")
        return (a.shape[-1] // d, d) if d else a.shape[-2:]

    return [weight_len(scope, *heads_dim(a)) for a in (q, k)]


def dev(kw):
    return {k: to_device(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def device_view(a):
    """A device copy of host ``a`` with its memory order: a permuted view
    (say [b, h, s, d] seen as bshd) stays a permuted view of a dense array."""
    if a.flags.c_contiguous:
        return to_device(a)
    order = [int(i) for i in np.argsort([-abs(s) for s in a.strides], kind="stable")]
    base = to_device(np.ascontiguousarray(a.transpose(order)))
    inverse = [int(i) for i in np.argsort(order)]
    return base.permute(*inverse) if hasattr(base, "permute") else base.transpose(*inverse)


def norm_kw(scope, variant, eps=1e-6):
    return dict(norm_scope=scope, weight_mode=variant.weight_mode, rounding=variant.rounding,
                eps=eps)


# -------------------------------------------------------------- oracles --
def _norm(kw):
    return check_norm(kw["norm_scope"], kw["weight_mode"], kw["rounding"], kw["eps"])


def expected_forward(q, k, wq, wk, nkw, rope_kw):
    """float64 (q_out, k_out) in q's and k's shapes."""
    call = check_call(q, k=k, **rope_kw)
    ys = reference.qk_norm_rope_slabs(call, (wq, wk), _norm(nkw))
    return [reference.to_layout(call, y, a.shape) for y, a in zip(ys, (q, k))]


def expected_backward(gq, gk, q, k, wq, wk, nkw, rope_kw):
    """float64 (dq, dk, dq_weight, dk_weight)."""
    call = check_call(gq, k=gk, backward=True, **rope_kw)
    inputs = _forward_inputs(call, q, k)
    dxs, dws = reference.qk_norm_rope_backward_slabs(call, inputs, (wq, wk), _norm(nkw))
    dq, dk = (reference.to_layout(call, y, a.shape) for y, a in zip(dxs, (gq, gk)))
    return (dq, dk, *(dws or (None, None)))


# ------------------------------------------------------------- runners --
def run_forward(q, k, wq, wk, nkw, rope_kw, mode, dtype):
    """apply_qk_norm_rope on device copies in ``mode`` (new | out | inplace);
    returns host (q_out, k_out) and checks the inputs are untouched (out of place)."""
    qd, kd = device_view(q), device_view(k)
    wd = [None if w is None else to_device(w) for w in (wq, wk)]
    kw = {**dev(rope_kw), **nkw}
    if mode == "inplace":
        res = apply_qk_norm_rope(qd, kd, *wd, inplace=True, **kw)
        assert res[0] is qd and res[1] is kd
    elif mode == "out":
        oq, ok = full_nan(q.shape, dtype), full_nan(k.shape, dtype)
        res = apply_qk_norm_rope(qd, kd, *wd, out_q=oq, out_k=ok, **kw)
        assert res[0] is oq and res[1] is ok
    else:
        poison = [full_nan(q.shape, dtype), full_nan(k.shape, dtype)]  # handed out next
        del poison
        res = apply_qk_norm_rope(qd, kd, *wd, **kw)
    if mode != "inplace":
        assert np.array_equal(bits(to_host(qd)), bits(q))
        assert np.array_equal(bits(to_host(kd)), bits(k))
    return [to_host(r) for r in res]


def check_forward(rng, q, k, scope, variant, rope_kw, dtype, modes=("new", "out", "inplace")):
    nkw = norm_kw(scope, variant)
    n_q, n_k = weight_lens(scope, q, k, rope_kw)
    wq, wk = weights(rng, n_q, n_k, dtype, variant.weight_mode)
    want = expected_forward(q, k, wq, wk, nkw, rope_kw)
    for mode in modes:
        got = run_forward(q, k, wq, wk, nkw, rope_kw, mode, dtype)
        for g, w, name in zip(got, want, ("q", "k")):
            assert_close(g, w, dtype, f"{name} {mode} {scope} {variant!r}")


def run_backward(gq, gk, q, k, wq, wk, nkw, rope_kw, dtype, out=False):
    d = [device_view(a) for a in (gq, gk, q, k)]
    wd = [None if w is None else to_device(w) for w in (wq, wk)]
    extra = {}
    if out:
        extra = dict(out_q=full_nan(gq.shape, dtype), out_k=full_nan(gk.shape, dtype))
    res = apply_qk_norm_rope_backward(*d, *wd, **dev(rope_kw), **nkw, **extra)
    if out:
        assert res[0] is extra["out_q"] and res[1] is extra["out_k"]
    for a, host in zip(d, (gq, gk, q, k)):  # no input is modified
        assert np.array_equal(bits(to_host(a)), bits(host))
    return [None if r is None else to_host(r) for r in res]


def check_backward(rng, q, k, scope, variant, rope_kw, dtype, out=False, repeats=1):
    nkw = norm_kw(scope, variant)
    n_q, n_k = weight_lens(scope, q, k, rope_kw)
    wq, wk = weights(rng, n_q, n_k, dtype, variant.weight_mode)
    gq, gk = randn(rng, q.shape, dtype), randn(rng, k.shape, dtype)
    want = expected_backward(gq, gk, q, k, wq, wk, nkw, rope_kw)
    runs = [run_backward(gq, gk, q, k, wq, wk, nkw, rope_kw, dtype, out) for _ in range(repeats)]
    got = runs[0]
    names = ("dq", "dk", "dq_weight", "dk_weight")
    for g, w, name in zip(got, want, names):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == np_dtype(dtype), name
        assert_close(g, w, dtype, f"{name} {scope} {variant!r}")
    for other in runs[1:]:  # bit-identical from run to run
        for g, o, name in zip(got, other, names):
            if g is not None:
                assert np.array_equal(bits(g), bits(o)), f"{name} differs between runs"


# ------------------------------------------------------------- forward --
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS, ids=repr)
def test_forward_matches_float64(rng, variant, dtype, head_dim, scope):
    """bshd, GQA (q 6 heads, k 2), new / out / in place, offsets."""
    b, s = 2, 7
    q, k = randn(rng, (b, s, 6, head_dim), dtype), randn(rng, (b, s, 2, head_dim), dtype)
    r = variant.rotary_dim(head_dim)
    rope_kw = {**tables(rng, r, s + EXTRA_ROWS), "interleaved": variant.interleaved,
               "offsets": rng.integers(0, EXTRA_ROWS, b).astype(np.int32)}
    check_forward(rng, q, k, scope, variant, rope_kw, dtype)


LAYOUTS = ["sbhd", "thd_varlen", "bhsd_view", "positions", "flat_heads", "inv_freq", "decode",
           "many_heads", "mrope", "context_parallel"]


def layout_case(rng, case, dtype, d, r):
    """(q, k, rope keyword arguments) host arrays for a layout case."""
    tab = tables(rng, r, 64)
    if case == "sbhd":
        q, k = randn(rng, (9, 3, 4, d), dtype), randn(rng, (9, 3, 1, d), dtype)
        return q, k, {**tab, "layout": "sbhd", "offsets": np.array([0, 5, 11], np.int64)}
    if case == "thd_varlen":
        q, k = randn(rng, (21, 4, d), dtype), randn(rng, (21, 2, d), dtype)
        cu = np.array([0, 5, 5, 13, 21], np.int32)
        return q, k, {**tab, "layout": "thd", "cu_seqlens": cu,
                      "offsets": np.array([3, 0, 9, 1], np.int32)}
    if case == "bhsd_view":  # a transposed [b, h, s, d] tensor seen as bshd
        q = randn(rng, (2, 4, 6, d), dtype).transpose(0, 2, 1, 3)
        k = randn(rng, (2, 2, 6, d), dtype).transpose(0, 2, 1, 3)
        return q, k, dict(tab)
    if case == "positions":
        q, k = randn(rng, (2, 5, 3, d), dtype), randn(rng, (2, 5, 3, d), dtype)
        return q, k, {**tab, "positions": rng.integers(0, 64, (2, 5)).astype(np.int64)}
    if case == "flat_heads":  # [b, s, h * d]
        q, k = randn(rng, (2, 5, 4 * d), dtype), randn(rng, (2, 5, 2 * d), dtype)
        return q, k, {**tab, "head_dim": d}
    if case == "inv_freq":
        q, k = randn(rng, (2, 5, 4, d), dtype), randn(rng, (2, 5, 2, d), dtype)
        inv_freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
        return q, k, {"inv_freq": inv_freq, "offsets": 1000}
    if case == "decode":  # one token per sequence, q 32 heads and k 8 (head groups split blocks)
        q, k = randn(rng, (4, 1, 32, d), dtype), randn(rng, (4, 1, 8, d), dtype)
        return q, k, {**tab, "offsets": np.array([7, 60, 0, 33], np.int32)}
    if case == "mrope":  # per-axis positions [3, b, s] and sections
        q, k = randn(rng, (2, 5, 4, d), dtype), randn(rng, (2, 5, 2, d), dtype)
        pos = rng.integers(0, 64, (3, 2, 5)).astype(np.int64)
        return q, k, {**tab, "positions": pos, "sections": (r // 4, r // 8, r // 8)}
    if case == "context_parallel":  # rank 1 of 2: local chunks 1 and 2 of 4
        q, k = randn(rng, (2, 6, 4, d), dtype), randn(rng, (2, 6, 2, d), dtype)
        return q, k, {**tab, "cp_size": 2, "cp_rank": 1}
    assert case == "many_heads"  # 40 heads per token (Wan), k 8
    q, k = randn(rng, (1, 6, 40, d), dtype), randn(rng, (1, 6, 8, d), dtype)
    return q, k, dict(tab)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", LAYOUTS)
def test_forward_layouts(rng, case, dtype, scope):
    d = 128
    for variant in (VARIANTS[0], VARIANTS[1]):
        q, k, rope_kw = layout_case(rng, case, dtype, d, variant.rotary_dim(d))
        rope_kw["interleaved"] = variant.interleaved
        check_forward(rng, q, k, scope, variant, rope_kw, dtype)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_on_packed_views_leaves_other_bytes(rng, dtype, scope):
    """q and k as strided views of one packed [t, (hq + 2 hk) d] buffer,
    rotated in place: v and everything else keep their bits."""
    t, hq, hk, d = 11, 4, 2, 64
    variant = VARIANTS[1]
    packed = randn(rng, (t, hq + 2 * hk, d), dtype)
    q, k = packed[:, :hq], packed[:, hq:hq + hk]
    rope_kw = {**tables(rng, variant.rotary_dim(d), t + 4), "layout": "thd",
               "interleaved": True}
    nkw = norm_kw(scope, variant)
    wq, wk = weights(rng, weight_len(scope, hq, d), weight_len(scope, hk, d), dtype, "1+w")
    want = expected_forward(np.ascontiguousarray(q), np.ascontiguousarray(k), wq, wk, nkw,
                            rope_kw)
    buf = to_device(packed)
    qd, kd = buf[:, :hq], buf[:, hq:hq + hk]
    apply_qk_norm_rope(qd, kd, to_device(wq), to_device(wk), inplace=True, **dev(rope_kw),
                       **nkw)
    got = to_host(buf)
    assert_close(got[:, :hq], want[0], dtype, "q")
    assert_close(got[:, hq:hq + hk], want[1], dtype, "k")
    assert np.array_equal(bits(got[:, hq + hk:]), bits(packed[:, hq + hk:]))  # v untouched


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("inplace", [False, True], ids=["split", "inplace"])
def test_packed_projection(rng, inplace, scope):
    """apply_qkv_norm_rope: q and k heads of a packed qkv normalized and
    rotated; v copied (split) or untouched (in place)."""
    dtype, t, hq, hk, d = "bfloat16", 9, 8, 2, 128
    variant = VARIANTS[0]
    packed = randn(rng, (t, (hq + 2 * hk) * d), dtype)
    heads = packed.reshape(t, hq + 2 * hk, d)
    rope_kw = {**tables(rng, d, t), "layout": "thd"}
    nkw = norm_kw(scope, variant)
    wq, wk = weights(rng, weight_len(scope, hq, d), weight_len(scope, hk, d), dtype, "w")
    want = expected_forward(np.ascontiguousarray(heads[:, :hq]),
                            np.ascontiguousarray(heads[:, hq:hq + hk]), wq, wk, nkw, rope_kw)
    buf = to_device(packed)
    res = apply_qkv_norm_rope(buf, to_device(wq), to_device(wk), num_q_heads=hq,
                              num_kv_heads=hk, inplace=inplace, **dev(rope_kw), **nkw)
    qo, ko, vo = (to_host(r) for r in res)
    assert_close(qo, want[0], dtype, "q")
    assert_close(ko, want[1], dtype, "k")
    assert np.array_equal(bits(vo), bits(np.ascontiguousarray(heads[:, hq + hk:])))
    if not inplace:
        assert np.array_equal(bits(to_host(buf)), bits(packed))


def test_bf16_input_with_float32_weights(rng):
    q, k = randn(rng, (2, 5, 4, 128), "bfloat16"), randn(rng, (2, 5, 2, 128), "bfloat16")
    rope_kw = tables(rng, 128, 5)
    nkw = norm_kw("head", VARIANTS[0])
    wq, wk = weights(rng, 128, 128, "float32", "w")
    want = expected_forward(q, k, wq, wk, nkw, rope_kw)
    got = run_forward(q, k, wq, wk, nkw, rope_kw, "out", "bfloat16")
    for g, w in zip(got, want):
        assert_close(g, w, "bfloat16", "bf16 x, fp32 weight")


# ------------------------------------------------------------ backward --
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS[:3], ids=repr)
def test_backward_matches_float64(rng, variant, dtype, head_dim, scope):
    """dq, dk and both weight gradients; the weight gradients bit-identical
    over three runs."""
    b, s = 2, 7
    q, k = randn(rng, (b, s, 6, head_dim), dtype), randn(rng, (b, s, 2, head_dim), dtype)
    rope_kw = {**tables(rng, variant.rotary_dim(head_dim), s + EXTRA_ROWS),
               "interleaved": variant.interleaved,
               "offsets": rng.integers(0, EXTRA_ROWS, b).astype(np.int32)}
    check_backward(rng, q, k, scope, variant, rope_kw, dtype, out=dtype == "float16",
                   repeats=3)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("case", LAYOUTS)
def test_backward_layouts(rng, case, scope):
    dtype, d = "bfloat16", 128
    variant = VARIANTS[1]
    q, k, rope_kw = layout_case(rng, case, dtype, d, variant.rotary_dim(d))
    rope_kw["interleaved"] = variant.interleaved
    check_backward(rng, q, k, scope, variant, rope_kw, dtype)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_large_call(rng, dtype, scope):
    """A call above NormPolicy.few_rows: several heads a thread, and blocks
    that walk several units each (asking L2 for the next one)."""
    q, k = randn(rng, (2, 2048, 8, 128), dtype), randn(rng, (2, 2048, 2, 128), dtype)
    rope_kw = {**tables(rng, 128, 2048 + EXTRA_ROWS),
               "offsets": np.array([0, EXTRA_ROWS], np.int32)}
    check_forward(rng, q, k, scope, VARIANTS[0], rope_kw, dtype, modes=("out", "inplace"))


#: Launch policies other than the default, each taking paths of its own in
#: norm_rope_kernel (a block per unit; one head a pass; many units a block;
#: wide passes), which then also runs the dense per-head forward.
ROWS = dict(kernels=("rows",))
POLICIES = {"block_per_unit": dict(ROWS, forward_blocks_per_sm=0),
            "one_head_a_pass": dict(ROWS, pass_floats=(16, 16), few_rows=0),
            "many_units_a_block": dict(ROWS, forward_blocks_per_sm=1, backward_blocks_per_sm=1),
            "wide_passes": dict(ROWS, pass_floats=(64, 64), min_blocks=(2, 2))}


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_launch_policies_agree(rng, monkeypatch, name, scope):
    import dataclasses

    from cupy_rope import norm_launch

    monkeypatch.setattr(norm_launch, "POLICY",
                        dataclasses.replace(norm_launch.NormPolicy(), **POLICIES[name]))
    monkeypatch.setattr(norm_launch, "_plans", {})
    dtype = "bfloat16"
    q, k = randn(rng, (1, 3000, 8, 128), dtype), randn(rng, (1, 3000, 2, 128), dtype)
    rope_kw = {**tables(rng, 128, 3000), "interleaved": True}
    check_forward(rng, q, k, scope, VARIANTS[3], rope_kw, dtype, modes=("out",))
    check_backward(rng, q, k, scope, VARIANTS[0], rope_kw, dtype, repeats=2)


FLAT_CASES = {f"{dtype}-d{d}-{v!r}": (dtype, d, v)
              for dtype, dims in (("float32", (64, 128)), ("float16", (64, 256)),
                                  ("bfloat16", (64, 128, 256)))
              for d in dims
              for v in (VARIANTS[0], VARIANTS[3], Variant("1+w", "after_weight", False, 1.0),
                        Variant("none", "before_weight", True, 1.0))}


@pytest.mark.parametrize("case", FLAT_CASES.values(), ids=FLAT_CASES.keys())
def test_flat_kernel_gives_the_rows_kernels_bits(rng, monkeypatch, case):
    """A dense per-head forward runs norm_flat_kernel; it matches float64 and
    gives norm_rope_kernel's bits (policy kernels ("rows",)), so the KV-cache
    op's norm path, which keeps norm_rope_kernel's layout, agrees with it."""
    from cupy_rope import norm_launch

    dtype, d, variant = case
    nkw = norm_kw("head", variant)
    wq, wk = weights(rng, d, d, dtype, variant.weight_mode)
    rows_a_thread = set()
    # heads that let a thread hold several rows at one position, heads that
    # do not (the last warp partly past the rows), one token a sequence
    for (b, s, hq, hk) in ((2, 300, 16, 8), (2, 300, 5, 3), (1, 3, 5, 3), (3, 1, 5, 3)):
        q, k = randn(rng, (b, s, hq, d), dtype), randn(rng, (b, s, hk, d), dtype)
        rope_kw = {**tables(rng, d, 300), "interleaved": variant.interleaved}
        if s == 1:
            rope_kw["offsets"] = 7
        want = expected_forward(q, k, wq, wk, nkw, rope_kw)
        got = {}
        for kernels in (("flat", "rows"), ("rows",)):
            monkeypatch.setattr(norm_launch, "POLICY", norm_launch.NormPolicy(kernels=kernels))
            monkeypatch.setattr(norm_launch, "_plans", {})
            got[kernels] = run_forward(q, k, wq, wk, nkw, rope_kw, "out", dtype)
            specs = [p.spec for p in norm_launch._plans.values()]
            flat = "flat" in kernels
            assert [type(p) for p in specs] == [
                norm_launch.NormFlatSpec if flat else norm_launch.NormSpec]
            rows_a_thread |= {specs[0].rows} if flat else set()
            for g, w, name in zip(got[kernels], want, ("q", "k")):
                assert_close(g, w, dtype, f"{name} {kernels} {hq}/{hk} heads, s {s}")
        for flat, rows in zip(*got.values()):
            assert np.array_equal(bits(flat), bits(rows))
        # the backward (norm_flat_backward_kernel), weight gradients the same bits twice
        monkeypatch.setattr(norm_launch, "POLICY", norm_launch.NormPolicy())
        monkeypatch.setattr(norm_launch, "_plans", {})
        check_backward(rng, q, k, "head", variant, rope_kw, dtype, out=s > 1, repeats=2)
        assert all(p.spec.backward and isinstance(p.spec, norm_launch.NormFlatSpec)
                   for p in norm_launch._plans.values())
    assert len(rows_a_thread) > 1 and 1 in rows_a_thread


@pytest.mark.parametrize("case", FLAT_CASES.values(), ids=FLAT_CASES.keys())
def test_flat_token_kernel_matches_float64(rng, monkeypatch, case):
    """Scope "token" on dense rows with as many heads in q as in k runs
    norm_flat_token_kernel (several tokens a block, a token over several
    warps) and its backward: against float64, in place and out of place,
    weight gradients the same bits twice."""
    from cupy_rope import norm_launch

    dtype, d, variant = case
    packets = d * np.dtype(np_dtype(dtype)).itemsize // 16
    for (b, s, h) in ((2, 150, 8), (3, 1, 16), (1, 40, 40)):
        monkeypatch.setattr(norm_launch, "_plans", {})
        q, k = randn(rng, (b, s, h, d), dtype), randn(rng, (b, s, h, d), dtype)
        rope_kw = {**tables(rng, d, 160), "interleaved": variant.interleaved, "offsets": 5}
        check_forward(rng, q, k, "token", variant, rope_kw, dtype, modes=("out", "inplace"))
        check_backward(rng, q, k, "token", variant, rope_kw, dtype, repeats=2)
        flat = {p.spec.backward for p in norm_launch._plans.values()
                if isinstance(p.spec, norm_launch.NormFlatSpec) and p.spec.scope == "token"}
        # the backward's block holds a token at 2 rows a thread, within its launch bounds
        assert flat == ({False, True} if h * packets // 2 <= norm_launch.FLAT_TOKEN_BACKWARD_THREADS
                        else {False})


FLAT_ODD = {"bf16-d128-h6": ("bfloat16", 128, 6), "fp32-d64-h6": ("float32", 64, 6),
            "bf16-d256-h5": ("bfloat16", 256, 5)}


@pytest.mark.parametrize("case", FLAT_ODD.values(), ids=FLAT_ODD.keys())
def test_flat_token_kernels_one_row_a_thread(rng, monkeypatch, case):
    """Scope "token" with heads that no warp's rows group into 2 or 4 a
    thread: the flat kernels hold one row a thread, forward and backward."""
    from cupy_rope import norm_launch

    dtype, d, h = case
    monkeypatch.setattr(norm_launch, "_plans", {})
    q, k = randn(rng, (2, 30, h, d), dtype), randn(rng, (2, 30, h, d), dtype)
    rope_kw = tables(rng, d, 30)
    check_forward(rng, q, k, "token", VARIANTS[0], rope_kw, dtype, modes=("out",))
    check_backward(rng, q, k, "token", VARIANTS[0], rope_kw, dtype, repeats=2)
    specs = [p.spec for p in norm_launch._plans.values()]
    assert {(type(p), p.scope, p.rows, p.backward) for p in specs} == {
        (norm_launch.NormFlatSpec, "token", 1, False), (norm_launch.NormFlatSpec, "token", 1, True)}


@pytest.mark.parametrize("scope", SCOPES)
def test_flat_kernels_fp32_weights_and_explicit_positions(rng, monkeypatch, scope):
    """bf16 x with float32 weights (32-byte weight packets) and 1-D explicit
    positions on the flat kernels, forward and backward, against float64;
    the weight gradients come back in float32."""
    from cupy_rope import norm_launch

    monkeypatch.setattr(norm_launch, "_plans", {})
    q, k = randn(rng, (2, 40, 8, 128), "bfloat16"), randn(rng, (2, 40, 8, 128), "bfloat16")
    rope_kw = {**tables(rng, 128, 64), "positions": rng.permutation(64)[:40].astype(np.int32)}
    nkw = norm_kw(scope, VARIANTS[0])
    n = weight_len(scope, 8, 128)
    wq, wk = weights(rng, n, n, "float32", "w")
    for got, want in zip(run_forward(q, k, wq, wk, nkw, rope_kw, "out", "bfloat16"),
                         expected_forward(q, k, wq, wk, nkw, rope_kw)):
        assert_close(got, want, "bfloat16", f"{scope} fp32 weights forward")
    gq, gk = randn(rng, q.shape, "bfloat16"), randn(rng, k.shape, "bfloat16")
    want = expected_backward(gq, gk, q, k, wq, wk, nkw, rope_kw)
    got = run_backward(gq, gk, q, k, wq, wk, nkw, rope_kw, "bfloat16")
    for g, w, name in zip(got, want, ("dq", "dk", "dq_weight", "dk_weight")):
        assert g.dtype == (np.float32 if "weight" in name else np_dtype("bfloat16")), name
        assert_close(g, w, "bfloat16", f"{scope} fp32 weights {name}")
    specs = [p.spec for p in norm_launch._plans.values()]
    assert {(type(p), p.weight_dtype, p.pos_mode) for p in specs} == {
        (norm_launch.NormFlatSpec, "float32", "explicit")} and len(specs) == 2


@pytest.mark.parametrize("scope", SCOPES)
def test_weight_grads_bit_identical_on_a_large_call(rng, scope):
    """Many blocks walk the tokens (more units than blocks): the weight
    gradients still match float64 and are the same bits on every run."""
    dtype = "bfloat16"
    q, k = randn(rng, (2, 2048, 8, 128), dtype), randn(rng, (2, 2048, 2, 128), dtype)
    rope_kw = tables(rng, 128, 2048)
    check_backward(rng, q, k, scope, VARIANTS[0], rope_kw, dtype, repeats=3)


def test_backward_strided_inputs(rng):
    """Forward inputs and gradients with their own (non-contiguous) strides."""
    dtype, d = "float32", 64
    qb, kb = randn(rng, (2, 5, 4, 2 * d), dtype), randn(rng, (2, 5, 2, 2 * d), dtype)
    q, k = qb[..., :d], kb[..., :d]  # head rows with a gap
    variant = VARIANTS[0]
    nkw = norm_kw("head", variant)
    wq, wk = weights(rng, d, d, dtype, "w")
    gq, gk = randn(rng, q.shape, dtype), randn(rng, k.shape, dtype)
    rope_kw = tables(rng, d, 5)
    want = expected_backward(gq, gk, np.ascontiguousarray(q), np.ascontiguousarray(k), wq, wk,
                             nkw, rope_kw)
    res = apply_qk_norm_rope_backward(to_device(gq), to_device(gk), to_device(qb)[..., :d],
                                      to_device(kb)[..., :d], to_device(wq), to_device(wk),
                                      **dev(rope_kw), **nkw)
    for g, w, name in zip(res, want, ("dq", "dk", "dq_weight", "dk_weight")):
        assert_close(to_host(g), w, dtype, name)
