"""Fused q/k RMSNorm + RoPE on the NumPy float64 reference path (CPU):
the reference against Hugging Face-style torch formulas (forward, and
autograd for the backward), the rounding orders, in place and out=, the
packed QKV form, and the bad-input matrix."""

from __future__ import annotations

import ctypes
import re
import threading
from typing import NamedTuple, Optional

import numpy as np
import pytest
import torch

from cupy_rope import apply_rope_qk, interop
from cupy_rope.qk_norm import (apply_qk_norm_rope, apply_qk_norm_rope_backward,
                               apply_qkv_norm_rope)
from cupy_rope.validate import NormOptions
from helpers import np_dtype as _np_dtype


def np_dtype(name: str):
    """NumPy's dtype of ``name``; bfloat16 needs ml_dtypes (not a dependency)."""
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    return _np_dtype(name)


# ------------------------------------------------ the independent formula --
def hf_norm(x, w, eps, scope, mode):
    """RMSNorm in float64 torch: Qwen3RMSNorm per head ([b, s, h, d] rows),
    OLMo 2's norm over the flattened hidden [b, s, h * d], Gemma's 1 + w."""
    rows = x.flatten(-2) if scope == "token" else x
    h = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "w":
        h = h * w
    elif mode == "1+w":
        h = h * (1.0 + w)
    return h.reshape(x.shape)


def hf_rope(y, angles, r, interleaved):
    """Hugging Face's apply_rotary_pos_emb on the first r channels (rotate_half
    for NeoX; the interleaved form for GPT-J); y [b, s, h, d], angles the
    (cos, sin) of every token's angles [b, s, r/2]."""
    cos, sin = (torch.from_numpy(a)[:, :, None] for a in angles)
    rot, rest = y[..., :r], y[..., r:]
    if interleaved:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)
    else:
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        half = torch.cat((-rot[..., r // 2:], rot[..., :r // 2]), -1)
    return torch.cat([rot * c + half * s, rest], -1)


# ------------------------------------------------------------------ cases --
class Case(NamedTuple):
    scope: str = "head"
    mode: str = "w"
    rounding: str = "before_weight"
    d: int = 64
    r: Optional[int] = None  # rotary_dim; None: d
    interleaved: bool = False
    layout: str = "bshd"
    hq: int = 4
    hk: int = 2
    source: str = "inv_freq"  # or "table", "cache"
    eps: float = 1e-6


CASES = {
    "qwen3 head w d128 gqa": Case(d=128, hq=8, hk=2),
    "olmo2 token w d64": Case(scope="token", hq=4, hk=4),
    "gemma3 head 1+w after d256": Case(mode="1+w", rounding="after_weight", d=256, hq=2, hk=1),
    "plain rms none d80 eps": Case(mode="none", d=80, eps=0.25),
    "token 1+w sbhd gptj": Case(scope="token", mode="1+w", layout="sbhd", interleaved=True),
    "head w partial d80 r32": Case(d=80, r=32),
    "head w partial gptj d128 r64 table": Case(d=128, r=64, interleaved=True, source="table"),
    "token none partial sbhd": Case(scope="token", mode="none", r=16, layout="sbhd"),
    "head w thd cu_seqlens offsets": Case(layout="thd"),
    "token w thd cache mqa": Case(scope="token", layout="thd", hq=6, hk=1, source="cache"),
    "head 1+w bshd cache d256 r128": Case(mode="1+w", d=256, r=128, source="cache"),
}


def _make(case: Case, rng, dtype=np.float64):
    """Inputs of a case in its layout, the weights, the (cos, sin) of every
    token's angles [b, s, r/2] for the formula, and the call's keywords."""
    b, s, d = (1, 13, case.d) if case.layout == "thd" else (2, 5, case.d)
    r = case.r or d
    tok = {"bshd": (b, s), "sbhd": (s, b), "thd": (s,)}[case.layout]
    q = rng.standard_normal(tok + (case.hq, d)).astype(dtype)
    k = (3 * rng.standard_normal(tok + (case.hk, d))).astype(dtype)
    n = d if case.scope == "head" else None
    wq = rng.uniform(0.5, 1.5, n or case.hq * d).astype(dtype)
    wk = rng.uniform(-0.5, 0.5, n or case.hk * d).astype(dtype)
    inv_freq = (1.0 / 10000 ** (np.arange(0, r, 2) / r)).astype(np.float32)
    kw = dict(layout=case.layout, interleaved=case.interleaved, rotary_dim=case.r,
              norm_scope=case.scope, weight_mode=case.mode, rounding=case.rounding,
              eps=case.eps)
    if case.layout == "thd":
        cu = np.array([0, 4, 4, 13], np.int32)
        offsets = np.array([3, 7, 11], np.int64)
        seq = np.searchsorted(cu, np.arange(s), side="right") - 1
        pos = (np.arange(s) - cu[seq] + offsets[seq])[None]
        kw.update(cu_seqlens=cu, offsets=offsets)
    else:
        pos = np.broadcast_to(np.arange(s) + 2, (b, s))
        kw.update(offsets=2)
    theta = pos[..., None] * inv_freq.astype(np.float64)
    angles = np.cos(theta), np.sin(theta)
    if case.source == "inv_freq":
        kw.update(inv_freq=inv_freq)
    else:
        table = np.arange(64)[:, None] * inv_freq.astype(np.float64)
        cos, sin = np.cos(table).astype(np.float32), np.sin(table).astype(np.float32)
        angles = cos.astype(np.float64)[pos], sin.astype(np.float64)[pos]  # the table's values
        if case.source == "table":
            kw.update(cos=cos, sin=sin)
        else:
            kw.update(cos_sin_cache=np.concatenate([cos, sin], 1))
    if case.mode == "none":
        wq = wk = None
    return q, k, wq, wk, angles, kw


def bshd(a, layout):
    """A [b, s, h, d] float64 torch view of a layout's array (a tensor keeps its graph)."""
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a, np.float64))
    return {"bshd": t, "sbhd": t.transpose(0, 1), "thd": t[None]}[layout]


def from_bshd(t, layout):
    return {"bshd": t, "sbhd": t.transpose(0, 1), "thd": t[0]}[layout].detach().numpy()


def formula(case, q, k, wq, wk, angles):
    """The torch float64 forward on [b, s, h, d] tensors (weights as tensors or None)."""
    r = case.r or case.d
    return tuple(hf_rope(hf_norm(x, w, case.eps, case.scope, case.mode), angles, r,
                         case.interleaved) for x, w in ((q, wq), (k, wk)))


def _t(a):
    return None if a is None else torch.from_numpy(np.asarray(a, np.float64)).requires_grad_()


# --------------------------------------------------------------- forward --
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_matches_hf_formula(rng, case):
    q, k, wq, wk, angles, kw = _make(case, rng)
    got_q, got_k = apply_qk_norm_rope(q, k, wq, wk, **kw)
    want_q, want_k = formula(case, bshd(q, case.layout), bshd(k, case.layout), _t(wq), _t(wk),
                             angles)
    np.testing.assert_allclose(got_q, from_bshd(want_q, case.layout), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_k, from_bshd(want_k, case.layout), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_backward_matches_autograd(rng, case):
    q, k, wq, wk, angles, kw = _make(case, rng)
    gq, gk = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    dq, dk, dwq, dwk = apply_qk_norm_rope_backward(gq, gk, q, k, wq, wk, **kw)
    tq, tk, twq, twk = _t(q), _t(k), _t(wq), _t(wk)
    yq, yk = formula(case, bshd(tq, case.layout), bshd(tk, case.layout), twq, twk, angles)
    ((yq * bshd(gq, case.layout)).sum() + (yk * bshd(gk, case.layout)).sum()).backward()
    np.testing.assert_allclose(dq, tq.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dk, tk.grad.numpy(), rtol=1e-10, atol=1e-10)
    if case.mode == "none":
        assert dwq is None and dwk is None
    else:
        np.testing.assert_allclose(dwq, twq.grad.numpy(), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(dwk, twk.grad.numpy(), rtol=1e-10, atol=1e-10)
        assert dwq.dtype == wq.dtype and dwq.shape == wq.shape


def test_sections_go_through_the_norm_call(rng):
    """M-RoPE sections rotate the normalized q and k as apply_rope_qk rotates."""
    q = rng.standard_normal((2, 6, 4, 32))
    k = rng.standard_normal((2, 6, 2, 32))
    w = rng.uniform(0.5, 1.5, 32)
    inv_freq = np.linspace(0.01, 1, 16).astype(np.float32)
    pos = rng.integers(0, 40, (3, 2, 6))
    got = apply_qk_norm_rope(q, k, w, w, inv_freq=inv_freq, positions=pos, sections=(8, 4, 4))
    normed = [hf_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6, "head", "w").numpy()
              for x in (q, k)]
    want = apply_rope_qk(*normed, inv_freq=inv_freq, positions=pos, sections=(8, 4, 4))
    for g, wv in zip(got, want):
        np.testing.assert_allclose(g, wv, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------- rounding orders --
def _hf_low_precision(x, w, mode, rounding, eps, scope):
    """The stock models' norms in x's dtype (torch CPU): Qwen3/Llama (fp32
    normalize, round, times w in x's dtype), Gemma and OLMo 2 (fp32
    throughout, one rounding; OLMo 2 over the flattened heads)."""
    rows = x.flatten(-2) if scope == "token" else x
    h = rows.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    wf = w.float() if mode == "w" else 1.0 + w.float()
    if rounding == "before_weight":
        return (h.to(x.dtype).float() * wf).to(x.dtype).reshape(x.shape)
    return (h * wf).to(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scope,mode,rounding", [
    ("head", "w", "before_weight"), ("head", "1+w", "after_weight"),
    ("token", "w", "after_weight"), ("token", "w", "before_weight")],
    ids=["qwen3", "gemma3", "olmo2", "wan"])
def test_rounding_orders_match_the_models(rng, dtype, scope, mode, rounding):
    """With positions 0 (no rotation) the result is the norm alone, rounded
    as the stock model rounds it: mostly equal, else a rounding or two apart
    (the stock model's fp32 mean square differs from float64's in its last
    bits; for float32 that is all there is)."""
    q = (rng.standard_normal((2, 3, 4, 64)) * 4).astype(np_dtype(dtype))
    k = rng.standard_normal((2, 3, 2, 64)).astype(np_dtype(dtype))
    n = 64 if scope == "head" else 4 * 64
    w = rng.uniform(0.5, 2.0, n).astype(np_dtype(dtype))
    wk = rng.uniform(0.5, 2.0, n // 2 if scope == "token" else n).astype(np_dtype(dtype))
    zero = np.zeros(3, np.int64)
    got_q, _ = apply_qk_norm_rope(q, k, w, wk, inv_freq=np.ones(32, np.float32), positions=zero,
                                  norm_scope=scope, weight_mode=mode, rounding=rounding)
    assert got_q.dtype == q.dtype
    tq = torch.from_numpy(q.astype(np.float32)).to(getattr(torch, dtype))
    tw = torch.from_numpy(w.astype(np.float32)).to(getattr(torch, dtype))
    want = _hf_low_precision(tq, tw, mode, rounding, 1e-6, scope).float().numpy()
    got = got_q.astype(np.float32)
    ulp = np.spacing(np.abs(want).astype(np_dtype(dtype))).astype(np.float32)
    ulps = 16 if dtype == "float32" else 2
    assert np.all(np.abs(got - want) <= ulps * ulp), "more than a rounding or two apart"
    if dtype != "float32":
        assert np.mean(got == want) > 0.95


def test_rounding_orders_differ_in_bfloat16(rng):
    q = rng.standard_normal((1, 64, 4, 64)).astype(np_dtype("bfloat16"))
    w = rng.uniform(0.5, 2.0, 64).astype(np_dtype("bfloat16"))
    kw = dict(inv_freq=np.ones(32, np.float32), positions=np.zeros(64, np.int64))
    before = apply_qk_norm_rope(q, q.copy(), w, w, **kw)[0]
    after = apply_qk_norm_rope(q, q.copy(), w, w, rounding="after_weight", **kw)[0]
    assert not np.array_equal(before, after)


def test_torch_cpu_bfloat16_matches_numpy(rng):
    """CPU torch tensors (bfloat16 as bits) take the reference path and come back as tensors."""
    q = rng.standard_normal((2, 4, 4, 64)).astype(np_dtype("bfloat16"))
    k = rng.standard_normal((2, 4, 2, 64)).astype(np_dtype("bfloat16"))
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
    want = apply_qk_norm_rope(q, k, w, w, inv_freq=inv_freq)

    def tb(a):
        return torch.from_numpy(a.astype(np.float32)).bfloat16()

    got = apply_qk_norm_rope(tb(q), tb(k), torch.from_numpy(w), torch.from_numpy(w),
                             inv_freq=torch.from_numpy(inv_freq))
    for g, wv in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16
        np.testing.assert_array_equal(g.float().numpy(), wv.astype(np.float32))
    grads = apply_qk_norm_rope_backward(tb(q), tb(k), tb(q), tb(k), torch.from_numpy(w),
                                        torch.from_numpy(w), inv_freq=torch.from_numpy(inv_freq))
    assert all(isinstance(g, torch.Tensor) for g in grads)
    assert grads[2].dtype == torch.float32 and grads[0].dtype == torch.bfloat16


# ---------------------------------------------------- in place, out= ------
@pytest.mark.parametrize("case", [CASES["head w partial d80 r32"],
                                  CASES["token 1+w sbhd gptj"]], ids=["partial", "token sbhd"])
def test_inplace_and_out_agree_with_new_arrays(rng, case):
    q, k, wq, wk, _, kw = _make(case, rng, np.float32)
    want = apply_qk_norm_rope(q, k, wq, wk, **kw)
    out_q, out_k = np.full_like(q, np.nan), np.full_like(k, np.nan)
    got = apply_qk_norm_rope(q, k, wq, wk, out_q=out_q, out_k=out_k, **kw)
    assert got[0] is out_q and got[1] is out_k
    qi, ki = q.copy(), k.copy()
    got_in = apply_qk_norm_rope(qi, ki, wq, wk, inplace=True, **kw)
    assert got_in[0] is qi and got_in[1] is ki
    for w_, o, i in zip(want, (out_q, out_k), (qi, ki)):
        np.testing.assert_array_equal(o, w_)
        np.testing.assert_array_equal(i, w_)  # the tail is normalized in place too


def test_backward_into_out(rng):
    case = CASES["qwen3 head w d128 gqa"]
    q, k, wq, wk, _, kw = _make(case, rng, np.float32)
    gq, gk = np.ones_like(q), np.ones_like(k)
    want = apply_qk_norm_rope_backward(gq, gk, q, k, wq, wk, **kw)
    out_q, out_k = np.full_like(q, np.nan), np.full_like(k, np.nan)
    got = apply_qk_norm_rope_backward(gq, gk, q, k, wq, wk, out_q=out_q, out_k=out_k, **kw)
    assert got[0] is out_q and got[1] is out_k
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)


# ------------------------------------------------------------ packed qkv --
@pytest.mark.parametrize("packing", ["concat", "grouped"])
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("scope,flat", [("head", True), ("token", False)], ids=["head flat",
                                                                                 "token 4d"])
def test_qkv_matches_split_call(rng, packing, inplace, scope, flat):
    t, hq, hk, d = 9, 4, 2, 64
    heads = rng.standard_normal((t, hq + 2 * hk, d)).astype(np.float32)
    g = hq // hk
    if packing == "concat":
        q, k, v = heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]
    else:
        grp = heads.reshape(t, hk, g + 2, d)
        q, k, v = grp[:, :, :g].reshape(t, hq, d), grp[:, :, g], grp[:, :, g + 1]
    n = d if scope == "head" else None
    wq, wk = rng.uniform(0.5, 1.5, n or hq * d), rng.uniform(0.5, 1.5, n or hk * d)
    wq, wk = wq.astype(np.float32), wk.astype(np.float32)
    kw = dict(inv_freq=np.linspace(0.01, 1, 32).astype(np.float32), layout="thd",
              positions=rng.integers(0, 100, t), norm_scope=scope)
    want_q, want_k = apply_qk_norm_rope(q, k, wq, wk, **kw)
    qkv = heads.reshape(t, -1) if flat else heads
    before = qkv.copy()
    got = apply_qkv_norm_rope(qkv, wq, wk, num_q_heads=hq, num_kv_heads=hk, packing=packing,
                              inplace=inplace, **kw)
    gq = got[0].reshape(t, hq, d)
    np.testing.assert_array_equal(gq, want_q)
    np.testing.assert_array_equal(got[1], want_k)
    np.testing.assert_array_equal(got[2], v if not inplace else
                                  before.reshape(heads.shape)[:, hq + hk:] if packing == "concat"
                                  else before.reshape(t, hk, g + 2, d)[:, :, g + 1])
    if inplace:
        assert all(np.shares_memory(a, qkv) for a in got)
        assert np.array_equal(got[2], v)  # v untouched
    else:
        np.testing.assert_array_equal(qkv, before)
        assert not any(np.shares_memory(a, qkv) for a in got)


# -------------------------------------------------------------- bad input --
def inputs():
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {"q": f(2, 4, 4, 16), "k": f(2, 4, 2, 16), "w": f(16), "wt": f(64),
            "wide": f(16, 2), "inv": np.linspace(0.1, 1, 8).astype(np.float32),
            "qkv": f(2, 4, 8, 16), "gq": f(2, 4, 4, 16), "gk": f(2, 4, 2, 16)}


def _on_gpu(a):
    """A description of ``a`` that says it lives on cuda:0."""
    return interop.describe(a, "w")._replace(device=("cuda", 0))


def N(a, qw="w", kw="w", **opts):
    """The forward in place (so that a write before the check would show)."""
    opts.setdefault("inv_freq", a["inv"])
    return apply_qk_norm_rope(a["q"], a["k"], a[qw] if isinstance(qw, str) else qw,
                              a[kw] if isinstance(kw, str) else kw, inplace=True, **opts)


def B(a, **opts):
    opts.setdefault("inv_freq", a["inv"])
    return apply_qk_norm_rope_backward(a["gq"], a["gk"], a["q"], a["k"], a["w"], a["w"], **opts)


# (id, call(a), exception, text naming the argument)
BAD = [
    ("weight length", lambda a: N(a, qw=a["w"][:15]), ValueError,
     "q_weight: expected a 1-D array [16] (head_dim)"),
    ("weight 2-D", lambda a: N(a, kw="wide"), ValueError, "k_weight: expected a 1-D array [16]"),
    ("token weight per head", lambda a: N(a, norm_scope="token"), ValueError,
     "q_weight: expected a 1-D array [64] (q's heads * head_dim = 4 * 16)"),
    ("token k weight", lambda a: N(a, qw="wt", kw="wt", norm_scope="token"), ValueError,
     "k_weight: expected a 1-D array [32]"),
    ("weight dtype", lambda a: N(a, qw=a["w"].astype(np.int32)), TypeError,
     "q_weight: expected dtype"),
    ("weight dtypes differ", lambda a: N(a, kw=a["w"].astype(np.float16)), TypeError,
     "k_weight: expected the dtype of q_weight"),
    ("weight strided", lambda a: N(a, qw=a["wt"][::4]), ValueError,
     "q_weight: expected a contiguous array (stride 1), got stride 4"),
    ("weight on another device", lambda a: N(a, kw=_on_gpu(a["w"])), ValueError,
     "k_weight: expected an array on the CPU (where q is), got one on cuda:0"),
    ("weight not an array", lambda a: N(a, qw=[1.0] * 16), TypeError,
     "q_weight: expected an array"),
    ("eps zero", lambda a: N(a, eps=0.0), ValueError, "eps: expected a finite float > 0"),
    ("eps negative", lambda a: N(a, eps=-1e-6), ValueError, "eps: expected a finite float > 0"),
    ("eps nan", lambda a: N(a, eps=float("nan")), ValueError, "eps: expected a finite float > 0"),
    ("eps inf", lambda a: N(a, eps=float("inf")), ValueError, "eps: expected a finite float > 0"),
    ("eps zero in float32", lambda a: N(a, eps=1e-50), ValueError, "eps: expected a finite"),
    ("eps string", lambda a: N(a, eps="1e-6"), TypeError, "eps: expected a float, got str"),
    ("eps bool", lambda a: N(a, eps=True), TypeError, "eps: expected a float, got bool"),
    ("norm_scope", lambda a: N(a, norm_scope="channel"), ValueError,
     "norm_scope: expected one of 'head', 'token', got 'channel'"),
    ("weight_mode", lambda a: N(a, weight_mode="2w"), ValueError, "weight_mode: expected one of"),
    ("rounding", lambda a: N(a, rounding="never"), ValueError, "rounding: expected one of"),
    ("q weight for none", lambda a: N(a, kw=None, weight_mode="none"), ValueError,
     "q_weight: weight_mode 'none' takes no weight"),
    ("k weight for none", lambda a: N(a, qw=None, weight_mode="none"), ValueError,
     "k_weight: weight_mode 'none' takes no weight"),
    ("missing q weight", lambda a: N(a, qw=None), ValueError, "q_weight: weight_mode 'w' needs"),
    ("missing k weight 1+w", lambda a: N(a, kw=None, weight_mode="1+w"), ValueError,
     "k_weight: weight_mode '1+w' needs"),
    ("in place over the weight", lambda a: N(a, qw=a["q"][0, 0, 0]), ValueError,
     "q: overlaps q_weight"),
    ("out_k over k_weight", lambda a: (lambda o: apply_qk_norm_rope(
        a["q"], a["k"], a["w"], o[1, 3, 1], inv_freq=a["inv"], out_q=np.empty_like(a["q"]),
        out_k=o))(np.zeros_like(a["k"])), ValueError, "out_k: overlaps k_weight"),
    ("rotation checks still apply", lambda a: N(a, layout="bhsd"), ValueError, "layout:"),
    ("backward q shape", lambda a: apply_qk_norm_rope_backward(
        a["gq"], a["gk"], a["q"][:, :3], a["k"], a["w"], a["w"], inv_freq=a["inv"]),
     ValueError, "q: expected the shape of grad_q [2, 4, 4, 16]"),
    ("backward k dtype", lambda a: apply_qk_norm_rope_backward(
        a["gq"], a["gk"], a["q"], a["k"].astype(np.float16), a["w"], a["w"], inv_freq=a["inv"]),
     TypeError, "k: expected the dtype of grad_k (float32)"),
    ("backward missing weight", lambda a: apply_qk_norm_rope_backward(
        a["gq"], a["gk"], a["q"], a["k"], a["w"], inv_freq=a["inv"]), ValueError,
     "k_weight: weight_mode 'w' needs"),
    ("backward out over q", lambda a: B(a, out_q=a["q"], out_k=np.empty_like(a["k"])), ValueError,
     "out_q: overlaps q"),
    ("backward eps", lambda a: B(a, eps=0), ValueError, "eps:"),
    ("qkv token weight length", lambda a: apply_qkv_norm_rope(
        a["qkv"], a["wt"], a["wt"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2,
        norm_scope="token", inplace=True), ValueError, "k_weight: expected a 1-D array [32]"),
    ("qkv in place read-only", lambda a: apply_qkv_norm_rope(
        _read_only(a["qkv"]), a["w"], a["w"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2,
        inplace=True), TypeError, "qkv: cannot be written in place"),
    ("qkv inplace not bool", lambda a: apply_qkv_norm_rope(
        a["qkv"], a["w"], a["w"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2, inplace=1),
     TypeError, "inplace: expected a bool"),
    ("qkv weight inside qkv", lambda a: apply_qkv_norm_rope(
        a["qkv"], a["qkv"][0, 0, 7], a["w"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2,
        inplace=True), ValueError, "overlaps q_weight"),
]


def _read_only(a):
    b = a.copy()
    b.flags.writeable = False
    return b


@pytest.mark.parametrize("call,exc,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_call_names_the_argument_and_changes_nothing(call, exc, text):
    a = inputs()
    before = {n: v.copy() for n, v in a.items()}
    with pytest.raises(exc, match=re.escape(text)):
        call(a)
    for n, v in a.items():
        assert np.array_equal(v, before[n]), f"{n} was modified"


# ------------------------------------------- the device branch's plumbing --
def _cuda(a):
    """A description of host array ``a`` that says it lives on cuda:0: the
    device branch runs up to norm_launch, which the fake below replaces."""
    return interop.describe(a, "a")._replace(device=("cuda", 0))


@pytest.fixture
def fake_launch(monkeypatch):
    """norm_launch.forward/backward computing on the reference (the 'device'
    arrays are host memory), recording what they were handed."""
    from cupy_rope import norm_launch, reference

    seen = []

    def write(call, slabs, results):
        for slab, y in zip(slabs, results):
            dst = reference.strided_view(slab.out, slab.out_offset, slab.out_strides, call.batch,
                                         call.seqlen, slab.heads, slab.heads_per_group,
                                         call.head_dim)
            dst[...] = reference.encoded(y.reshape(dst.shape), dst, slab.out.dtype)

    def forward(call, arrays, weights, norm):
        seen.append(("forward", call, weights, norm))
        write(call, call.slabs, reference.qk_norm_rope_slabs(call, weights, norm))

    def backward(call, arrays, inputs, weights, weight_grads, norm):
        seen.append(("backward", call, weights, norm, inputs, weight_grads))
        dxs, dws = reference.qk_norm_rope_backward_slabs(call, inputs, weights, norm)
        write(call, call.slabs, dxs)
        for t, dw in zip(weight_grads, dws or ()):
            reference.host_array(t)[...] = dw

    monkeypatch.setattr(norm_launch, "forward", forward)
    monkeypatch.setattr(norm_launch, "backward", backward)
    return seen


@pytest.mark.parametrize("case", [CASES["qwen3 head w d128 gqa"], CASES["token 1+w sbhd gptj"],
                                  CASES["plain rms none d80 eps"]], ids=["head", "token", "none"])
def test_device_branch_hands_norm_launch_the_checked_call(rng, fake_launch, case):
    q, k, wq, wk, _, kw = _make(case, rng, np.float32)
    kw["offsets"] = 0
    want = apply_qk_norm_rope(q, k, wq, wk, **kw)
    dev = {n: _cuda(a) for n, a in (("q", q), ("k", k), ("wq", wq), ("wk", wk),
                                    ("inv_freq", kw["inv_freq"])) if a is not None}
    kw["inv_freq"] = dev["inv_freq"]
    got = apply_qk_norm_rope(dev["q"], dev["k"], dev.get("wq"), dev.get("wk"), **kw)
    (op, call, weights, norm), = fake_launch
    assert call.on_gpu and all(s.out is not None for s in call.slabs)
    assert norm.scope == case.scope and norm.weight_mode == case.mode
    assert [w is None for w in weights] == [case.mode == "none"] * 2
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)
    gq, gk = rng.standard_normal(q.shape).astype(np.float32), np.ones_like(k)
    host_kw = kw | {"inv_freq": kw["inv_freq"].obj}
    want = apply_qk_norm_rope_backward(gq, gk, q, k, wq, wk, **host_kw)
    got = apply_qk_norm_rope_backward(_cuda(gq), _cuda(gk), dev["q"], dev["k"], dev.get("wq"),
                                      dev.get("wk"), **kw)
    op, call, weights, norm, inputs, weight_grads = fake_launch[1]
    assert op == "backward" and call.backward
    assert [s.x.ptr for s in inputs] == [dev["q"].ptr, dev["k"].ptr]
    assert len(weight_grads) == (0 if case.mode == "none" else 2)
    for g, w_ in zip(got, want):
        if w_ is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, w_, rtol=1e-6, atol=1e-6)


def test_device_branch_packed_qkv_copies_v(rng, fake_launch):
    t, hq, hk, d = 7, 4, 2, 64
    qkv = rng.standard_normal((t, (hq + 2 * hk) * d)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
    kw = dict(num_q_heads=hq, num_kv_heads=hk, layout="thd", packing="grouped")
    want = apply_qkv_norm_rope(qkv, w, w, inv_freq=inv_freq, **kw)
    got = apply_qkv_norm_rope(_cuda(qkv), _cuda(w), _cuda(w), inv_freq=_cuda(inv_freq), **kw)
    (op, call, weights, norm), = fake_launch
    assert [s.rotate for s in call.slabs] == [True, True, False]
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)


# ------------------------------------------------------- the call cache --
class FakeDev:
    """A host array that is described and signed as if on cuda:0, so that
    device calls (computed by ``fake_launch``) reach the call cache."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a

    @property
    def shape(self):
        return self.a.shape

    def reshape(self, shape):
        return FakeDev(self.a.reshape(shape))

    def __getitem__(self, i):
        return FakeDev(self.a[i])


def _at(addr, t):
    """A NumPy array of description ``t``'s geometry over host memory at ``addr``."""
    lo, hi = t._replace(ptr=addr).span()
    buf = (ctypes.c_char * max(hi - lo, 1)).from_address(lo)
    item = np.dtype(t.dtype).itemsize
    return np.ndarray(t.shape, np.dtype(t.dtype), buffer=buf, offset=addr - lo,
                      strides=tuple(s * item for s in t.strides))


def _map_descriptions(call, weights, inputs, weight_grads, f):
    """The call, weights, inputs and weight gradients with ``f`` applied to
    every array description (None included)."""
    def slab(s):
        return s._replace(x=f(s.x), out=f(s.out))

    call = call._replace(slabs=tuple(map(slab, call.slabs)), tables=tuple(map(f, call.tables)),
                         positions=f(call.positions), offsets=f(call.offsets),
                         cu_seqlens=f(call.cu_seqlens))
    return call, tuple(map(f, weights or ())), tuple(map(slab, inputs or ())), tuple(
        map(f, weight_grads or ()))


class FakePrepared:
    """norm_launch.prepare's stand-in for FakeDev arrays: keeps each array
    description as (array index, byte offset from its pointer) and, launched,
    computes through ``fake_launch`` on the memory at the pointers it is
    handed (FakeDev arrays are host memory), so that a cached call's
    pointers, not its first call's arrays, decide what is read and written."""

    launches = []  # (offset,) of every prepared launch, for the tests

    def __init__(self, call, arrays, ptrs, weights, norm, inputs=None, weight_grads=(),
                 backward=False):
        from cupy_rope import norm_launch

        def strip(t):
            if t is None:
                return None
            i = next((i for i, a in enumerate(arrays) if a is t.obj), None)
            if i is None:
                raise KeyError("array of the call not found")
            return t._replace(obj=i, ptr=t.ptr - ptrs[i])

        self.policy, self.norm, self.backward = norm_launch.POLICY, norm, backward
        self.parts = _map_descriptions(call, weights, inputs, weight_grads, strip)

    def launch(self, ptrs, offset):
        from cupy_rope import norm_launch

        def dress(t):
            if t is None:
                return None
            addr = ptrs[t.obj] + t.ptr
            return t._replace(obj=_at(addr, t), ptr=addr)

        call, weights, inputs, weight_grads = _map_descriptions(*self.parts, dress)
        FakePrepared.launches.append(offset)
        call = call._replace(offset=offset)
        if self.backward:
            norm_launch.backward(call, None, inputs, weights, weight_grads, self.norm)
        else:
            norm_launch.forward(call, None, weights, self.norm)


@pytest.fixture
def fake_device(monkeypatch, fake_launch):
    """FakeDev arrays through describe, the signers and the allocators, and
    cached calls through FakePrepared; returns the number of validations
    so far (a list of one count)."""
    from cupy_rope import norm_launch, qk_norm, validate

    real = interop.describe
    checks = [0]

    def describe(x, name):
        if isinstance(x, FakeDev):
            return real(x.a, name)._replace(obj=x, device=("cuda", 0))
        return real(x, name)

    def sign(a, key, ptrs):
        p = a.a.ctypes.data
        key.append((a.a.dtype, a.a.shape, a.a.strides, 0, p & 15))
        ptrs.append(p)
        return True

    real_check = validate.check

    def check(*args):
        checks[0] += 1
        return real_check(*args)

    def empty_like(a):
        return FakeDev(np.full_like(np.asarray(a.obj if hasattr(a, "obj") else a), np.nan))

    monkeypatch.setattr(interop, "describe", describe)
    monkeypatch.setattr(validate, "describe", describe)
    monkeypatch.setattr(validate, "check", check)
    monkeypatch.setitem(interop.SIGNERS, FakeDev, sign)
    monkeypatch.setattr(interop, "empty_like", empty_like)
    monkeypatch.setattr(interop, "fast_empty_like", empty_like)
    monkeypatch.setattr(interop, "empty", lambda t, shape: FakeDev(
        np.full(shape, np.nan, np.asarray(t.obj).dtype)))
    monkeypatch.setattr(interop, "fast_empty", lambda a, shape: FakeDev(
        np.full(shape, np.nan, a.a.dtype)))
    monkeypatch.setattr(norm_launch, "prepare", FakePrepared)
    FakePrepared.launches.clear()
    qk_norm.clear_plans()
    yield checks
    qk_norm.clear_plans()


def _host(r):
    return None if r is None else np.asarray(r)


@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
def test_cache_serves_repeated_device_calls(rng, fake_device, mode):
    """The second call of a signature is not validated again, and computes
    on its own arrays what the NumPy path computes."""
    case = CASES["head w thd cu_seqlens offsets"]._replace(scope="token", hq=4, hk=2)
    for round_ in range(3):
        q, k, wq, wk, _, kw = _make(case, rng, np.float32)
        del kw["cu_seqlens"]
        kw["offsets"] = 3 + round_
        kw["inv_freq"] = FakeDev(kw["inv_freq"])
        want = apply_qk_norm_rope(q, k, wq, wk, **kw | {"inv_freq": kw["inv_freq"].a})
        dq, dk = FakeDev(q.copy()), FakeDev(k.copy())
        extra = {"new": {}, "inplace": {"inplace": True},
                 "out": {"out_q": FakeDev(np.full_like(q, np.nan)),
                         "out_k": FakeDev(np.full_like(k, np.nan))}}[mode]
        before = fake_device[0]
        got = apply_qk_norm_rope(dq, dk, FakeDev(wq), FakeDev(wk), **kw, **extra)
        assert fake_device[0] == before + (round_ == 0), "validated again"
        if mode == "inplace":
            assert got[0] is dq and got[1] is dk
        elif mode == "out":
            assert got[0] is extra["out_q"]
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(_host(g), w_)
    assert FakePrepared.launches == [4, 5]  # the cached calls, with their own offsets


def test_cache_serves_backward_and_qkv(rng, fake_device):
    case = CASES["qwen3 head w d128 gqa"]
    for round_ in range(2):
        q, k, wq, wk, _, kw = _make(case, rng, np.float32)
        gq, gk = rng.standard_normal(q.shape).astype(np.float32), np.ones_like(k)
        want = apply_qk_norm_rope_backward(gq, gk, q, k, wq, wk, **kw)
        kw["inv_freq"] = FakeDev(kw["inv_freq"])
        before = fake_device[0]
        got = apply_qk_norm_rope_backward(*map(FakeDev, (gq, gk, q, k, wq, wk)), **kw)
        assert fake_device[0] == before + (round_ == 0)
        for g, w_ in zip(got, want):
            np.testing.assert_allclose(_host(g), w_, rtol=1e-6, atol=1e-6)
    for inplace in (False, True, True):
        qkv = rng.standard_normal((7, 8 * 64)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
        inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
        kw = dict(num_q_heads=4, num_kv_heads=2, layout="thd", inplace=inplace)
        want = apply_qkv_norm_rope(qkv.copy(), w, w, inv_freq=inv_freq, **kw)
        got = apply_qkv_norm_rope(FakeDev(qkv), FakeDev(w), FakeDev(w), inv_freq=FakeDev(inv_freq),
                                  **kw)
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(_host(g), w_)
    assert len(FakePrepared.launches) == 2  # the second backward, the second in-place qkv


def test_cache_checks_pointers_and_offsets_again(rng, fake_device):
    """A cached signature still refuses an output over a weight and an offset
    past the table: the general path then raises."""
    q = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 5, 2, 16)).astype(np.float32)
    theta = np.arange(64)[:, None] * np.linspace(0.1, 1, 8)
    cos, sin = FakeDev(np.cos(theta).astype(np.float32)), FakeDev(np.sin(theta).astype(np.float32))
    buf = np.zeros(q.size + 64, np.float32)
    out_q = buf[:q.size].reshape(q.shape)
    w_apart, w_inside = buf[q.size:q.size + 16], buf[16:32]
    assert w_apart.ctypes.data % 16 == w_inside.ctypes.data % 16
    wk = FakeDev(np.ones(16, np.float32))

    def call(w, offsets=0):
        return apply_qk_norm_rope(FakeDev(q), FakeDev(k), FakeDev(w), wk, cos, sin,
                                  out_q=FakeDev(out_q), out_k=FakeDev(np.zeros_like(k)),
                                  offsets=offsets)

    call(w_apart)
    checks = fake_device[0]
    call(w_apart, offsets=7)
    assert fake_device[0] == checks  # cached
    with pytest.raises(ValueError, match="out_q: overlaps q_weight"):
        call(w_inside)
    with pytest.raises(ValueError, match="cos: the table has 64 rows"):
        call(w_apart, offsets=60)


# ---------------------------------------------- norm_launch.prepare (CPU) --
def _relabel(call, weights, inputs, weight_grads, f):
    """``f`` applied to every description of a call and its norm arrays
    (inputs as Tensors or as slabs reading them)."""
    def slab(s):
        return s._replace(x=f(s.x), out=f(s.out)) if hasattr(s, "x_strides") else f(s)

    call = call._replace(slabs=tuple(map(slab, call.slabs)), tables=tuple(map(f, call.tables)),
                         positions=f(call.positions), offsets=f(call.offsets),
                         cu_seqlens=f(call.cu_seqlens))
    return (call, tuple(map(f, weights)), None if inputs is None else tuple(map(slab, inputs)),
            tuple(map(f, weight_grads)))


class PreparedCase(NamedTuple):
    scope: str
    mode: str
    backward: bool = False
    tokens: int = 16
    rotary_dim: int = 128
    table: str = "cos_sin"  # or "cos_sin_cache"
    positions: bool = False
    inplace: bool = False
    packed: bool = False  # in place in a grouped qkv (forward)
    slab_inputs: bool = False  # the backward's inputs as qk_norm passes them


PREPARED_CASES = {c_id: c for c_id, c in [
    ("forward partial positions", PreparedCase("head", "w", rotary_dim=64, positions=True)),
    ("forward token cos_sin_cache inplace", PreparedCase("token", "1+w", table="cos_sin_cache",
                                                         inplace=True)),
    ("forward none", PreparedCase("head", "none")),
    ("forward packed qkv in place", PreparedCase("head", "w", packed=True, positions=True)),
    ("backward head slab inputs", PreparedCase("head", "w", True, positions=True,
                                               slab_inputs=True)),
    ("backward token partial", PreparedCase("token", "1+w", True, rotary_dim=64)),
    ("backward none", PreparedCase("head", "none", True)),
    ("backward no tokens", PreparedCase("head", "w", True, tokens=0)),
]}


def _prepared_call(case: PreparedCase, tensor):
    """(call, weights, inputs, weight gradients) of a case, as fake device arrays."""
    from cupy_rope import qk_norm
    from cupy_rope.validate import check_call

    s, d, r = case.tokens, 128, case.rotary_dim
    rope = dict(layout="thd", rotary_dim=r, backward=case.backward)
    if case.table == "cos_sin_cache":
        rope["cos_sin_cache"] = tensor((64, r), "float32")
    else:
        rope["cos"], rope["sin"] = tensor((64, r // 2), "float32"), tensor((64, r // 2),
                                                                             "float32")
    if case.positions:
        rope["positions"] = tensor((s,), "int32")
    if case.packed:
        call = qk_norm._in_place_qk(check_call(
            qkv=tensor((s, 8 * d), "bfloat16"), num_q_heads=4, num_kv_heads=2,
            packing="grouped", **rope))
    else:
        q, k = tensor((s, 4, d), "bfloat16"), tensor((s, 2, d), "bfloat16")
        if not case.inplace:
            rope["out"], rope["out_k"] = tensor(q.shape, "bfloat16"), tensor(k.shape, "bfloat16")
        call = check_call(q, k=k, inplace=case.inplace, **rope)
    n = [d * (s_.heads if case.scope == "token" else 1) for s_ in call.slabs]
    weights = ((None, None) if case.mode == "none"
               else (tensor((n[0],), "bfloat16"), tensor((n[1],), "bfloat16")))
    inputs = grads = None
    if case.backward:
        inputs = tuple(tensor(sl.x.shape, "bfloat16") for sl in call.slabs)
        if case.slab_inputs:  # slabs reading q and k from an element offset
            inputs = tuple(sl._replace(x=t, x_offset=64, out=None, out_strides=None)
                           for sl, t in zip(call.slabs, inputs))
        grads = weights if case.mode != "none" else ()
        grads = tuple(tensor(g.shape, "bfloat16") for g in grads)
    return call, weights, inputs, grads or ()


@pytest.fixture
def no_gpu_kernels(monkeypatch):
    """norm_launch planning without a GPU: an SM count, kernels as fake
    handles (1234: norm_rope_kernel, 5678: weight_grad_reduce)."""
    import types

    from cupy_rope import launch, norm_launch

    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(norm_launch, "_plans", {})
    monkeypatch.setattr(norm_launch, "get_kernel", lambda spec, device_id: types.SimpleNamespace(
        ptr=5678 if isinstance(spec, norm_launch.ReduceSpec) else 1234))


@pytest.mark.parametrize("case", PREPARED_CASES.values(), ids=PREPARED_CASES.keys())
def test_prepared_launch_packs_each_calls_parameters(no_gpu_kernels, monkeypatch, case):
    """norm_launch.prepare's launch writes, for a later call's pointers and
    offset, the bytes norm_launch packs for that call from scratch (every
    pointer at its place), and the reduce's; each thread its own block."""
    from cupy_rope import launch, norm_launch

    tensor = launch._FakeArrays()
    objs: dict = {}  # each fake array, by pointer, as an object of its own
    call, weights, inputs, grads = _relabel(
        *_prepared_call(case, tensor),
        lambda t: None if t is None else t._replace(obj=objs.setdefault(t.ptr, object())))
    norm = NormOptions(case.scope, case.mode, "after_weight", 1e-5)
    arrays, ptrs = [None] + list(objs.values()), [0] + list(objs)
    p = norm_launch.prepare(call, arrays, ptrs, weights, norm, inputs, grads,
                            backward=case.backward)
    moved = [0] + [ptr + (i + 1) * (1 << 24) for i, ptr in enumerate(ptrs[1:])]
    by_obj = dict(zip(map(id, arrays[1:]), moved[1:]))
    call2, weights2, inputs2, grads2 = _relabel(
        call, weights, inputs, grads,
        lambda t: None if t is None else t._replace(ptr=by_obj[id(t.obj)]))
    work, n_tok = 1 << 40, case.tokens
    lens = [norm_launch._weight_len(call, case.scope, i) for i in range(2)]
    blocks, partials, want = [0, 0], [0, 0], []
    if n_tok:
        plan = norm_launch.plan(call, norm_launch._weights(weights), norm, case.backward,
                                bool(grads), inputs)
        blocks = list(plan.shape.blocks)
        partials = [work, work + 4 * blocks[0] * lens[0]] if grads else None
        want = [(1234, p.dims, norm_launch._params(
            call2._replace(offset=5), plan, norm_launch._weights(weights2), inputs2, partials,
            norm.eps))]
    if grads:
        pad = [0] * (launch.MAX_SLABS - 2)
        want.append((5678, p.reduce_dims, norm_launch._REDUCE.pack(
            *partials, *pad, *(g.ptr for g in grads2), *pad, *blocks, *pad, *lens, *pad)))
    assert p.policy is norm_launch.POLICY and p.kernel == (1234 if n_tok else None)
    assert (p.workspace is not None) == bool(grads and n_tok)
    assert (p.reduce_kernel is not None) == bool(grads)
    launched = []

    def raw_launch(kernel, dims, stream, args, dev):
        size = len(p.buf) if kernel == 1234 else norm_launch._REDUCE.size
        assert (stream, dev) == (99, 0)
        launched.append((kernel, dims, ctypes.string_at(
            ctypes.c_void_p.from_address(args).value, size)))

    monkeypatch.setattr(norm_launch, "_raw_launch", raw_launch)
    p.stream = lambda device_id: 99
    if p.workspace is not None:
        p.workspace = lambda: (None, work)
    p.launch(moved, 5)
    thread = threading.Thread(target=p.launch, args=(moved, 5))
    thread.start()
    thread.join()
    assert len(p.buffers) == 2  # a parameter block per thread
    assert launched == want * 2


@pytest.mark.parametrize("heads, unroll, used", [
    ((40, 40), 3, True),   # Wan: 14 head lanes hold 42 slots for 40 heads
    ((32, 32), 3, True),
    ((32, 8), 3, False),   # k's lanes must divide 11: 33 slots for 8 heads
    ((32, 8), 1, True),
    ((40, 8, 8), 3, False),
], ids=["wan", "equal-heads", "gqa", "gqa-one-head-a-thread", "gqa-qkv"])
def test_token_scope_heads_a_thread_keep_slots_used(heads, unroll, used):
    """Scope "token" forward takes several heads a thread only where every
    slab still fills its head lanes (GQA falls back to one a thread)."""
    from cupy_rope import norm_launch

    assert norm_launch._slots_used(list(heads), unroll) is used
