"""The bad-input matrix: distinct bad calls across every public function,
each refused with an exception that names the argument, and every input
left unchanged (CPU, NumPy inputs through the shared checks)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupy_rope
from cupy_rope import frequencies


def inputs():
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    theta = np.arange(32)[:, None] * np.linspace(0.1, 1, 8)
    return {
        "x": f(2, 4, 3, 16), "q": f(2, 4, 4, 16), "k": f(2, 4, 2, 16),
        "t": f(10, 3, 16), "qkv": f(2, 4, 8, 16),
        "dq": f(2, 4, 4, 16), "dk": f(2, 4, 2, 16), "dv": f(2, 4, 2, 16),
        "cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32),
        "inv": np.linspace(0.1, 1, 8).astype(np.float32),
        "cu": np.array([0, 4, 10], np.int32), "pos3": np.zeros((3, 2, 4), np.int64),
    }


def _read_only(shape):
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


R, QK, QKV, QKVB = (cupy_rope.apply_rope, cupy_rope.apply_rope_qk, cupy_rope.apply_rope_qkv,
                    cupy_rope.apply_rope_qkv_backward)

# (id, call(a) with a = inputs(), exception, text naming the argument)
CASES = [
    ("x rank", lambda a: R(a["x"][0], inv_freq=a["inv"]), ValueError, "x: expected a 4-D"),
    ("x dtype", lambda a: R(a["x"].astype(np.int32), inv_freq=a["inv"]), TypeError, "x: expected dtype"),
    ("x not an array", lambda a: R("x", inv_freq=a["inv"]), TypeError, "x: expected an array"),
    ("odd head_dim", lambda a: R(a["x"][..., :15], inv_freq=a["inv"][:7]), ValueError, "x: head_dim"),
    ("no angle source", lambda a: R(a["x"]), ValueError, "pass exactly one angle source"),
    ("two angle sources", lambda a: R(a["x"], a["cos"], a["sin"], inv_freq=a["inv"]),
     ValueError, "pass exactly one angle source"),
    ("cos without sin", lambda a: R(a["x"], a["cos"]), ValueError, "sin:"),
    ("table too short", lambda a: R(a["x"], a["cos"][:3], a["sin"][:3]), ValueError, "cos: the table has 3 rows"),
    ("negative position", lambda a: R(a["x"], a["cos"], a["sin"], positions=np.array([0, 1, -2, 3])),
     ValueError, "positions reach -2"),
    ("position past table", lambda a: R(a["x"], a["cos"], a["sin"], offsets=30),
     ValueError, "positions reach 33"),
    ("cache odd width", lambda a: R(a["x"], cos_sin_cache=a["cos"][:, :7]), ValueError, "cos_sin_cache:"),
    ("rotary_dim > head_dim", lambda a: R(a["x"][..., :8], inv_freq=a["inv"]), ValueError, "rotary_dim: must be <="),
    ("layout", lambda a: R(a["x"], inv_freq=a["inv"], layout="bhsd"), ValueError, "layout:"),
    ("positions dtype", lambda a: R(a["x"], inv_freq=a["inv"], positions=np.zeros(4, np.float32)),
     TypeError, "positions: expected dtype"),
    ("offsets bool", lambda a: R(a["x"], inv_freq=a["inv"], offsets=True), TypeError, "offsets:"),
    ("inplace not bool", lambda a: R(a["x"], inv_freq=a["inv"], inplace=1), TypeError, "inplace:"),
    ("out shape", lambda a: R(a["x"], inv_freq=a["inv"], out=np.empty((2, 4, 3, 8), np.float32)),
     ValueError, "out: expected shape"),
    ("out overlaps x", lambda a: R(a["x"][:, :2], inv_freq=a["inv"], out=a["x"][:, 1:3]),
     ValueError, "out: overlaps x"),
    ("cu_seqlens dtype", lambda a: R(a["t"], inv_freq=a["inv"], layout="thd", cu_seqlens=a["cu"].astype(np.int64)),
     TypeError, "cu_seqlens: expected dtype int32"),
    ("cu_seqlens order", lambda a: R(a["t"], inv_freq=a["inv"], layout="thd", cu_seqlens=np.array([0, 6, 4, 10], np.int32)),
     ValueError, "cu_seqlens: must be non-decreasing"),
    ("cu_seqlens total", lambda a: R(a["t"], inv_freq=a["inv"], layout="thd", cu_seqlens=np.array([0, 4, 9], np.int32)),
     ValueError, "cu_seqlens: the last entry must be 10"),
    ("cu_seqlens strided", lambda a: R(a["t"], inv_freq=a["inv"], layout="thd", cu_seqlens=np.array([0, 0, 4, 0, 10], np.int32)[::2]),
     ValueError, "cu_seqlens: expected a contiguous array"),
    ("cp_rank", lambda a: R(a["x"], inv_freq=a["inv"], cp_size=2, cp_rank=-1), ValueError, "cp_rank:"),
    ("cp with cu lengths", lambda a: R(a["t"][:5], inv_freq=a["inv"], layout="thd", cp_size=2, cu_seqlens=a["cu"]),
     ValueError, "cu_seqlens: with cp_size=2"),
    ("sections sum", lambda a: R(a["x"], inv_freq=a["inv"], positions=a["pos3"], sections=[1, 1, 1]),
     ValueError, "sections: must sum"),
    ("qk tokens", lambda a: QK(a["q"], a["k"][:, :3], inv_freq=a["inv"]), ValueError, "k: expected the token axes"),
    ("qk dtype", lambda a: QK(a["q"], a["k"].astype(np.float16), inv_freq=a["inv"]), TypeError, "k: expected dtype"),
    ("qk one output", lambda a: QK(a["q"], a["k"], inv_freq=a["inv"], out_k=np.empty_like(a["k"])),
     ValueError, "out_q: pass an output for every input"),
    ("qk in place aliasing", lambda a: QK(a["q"], a["q"], inv_freq=a["inv"], inplace=True),
     ValueError, "overlaps"),
    ("qkv heads", lambda a: QKV(a["qkv"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=3),
     ValueError, "qkv: expected 10 heads"),
    ("qkv packing", lambda a: QKV(a["qkv"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2, packing="mixed"),
     ValueError, "packing:"),
    ("qkv grouped divisibility", lambda a: QKV(a["qkv"][..., :7, :], inv_freq=a["inv"], num_q_heads=3, num_kv_heads=2, packing="grouped"),
     ValueError, "num_q_heads: packing 'grouped'"),
    ("qkv partial outputs", lambda a: QKV(a["qkv"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2, out_q=np.empty_like(a["q"])),
     ValueError, "out_q, out_k, out_v: pass all three"),
    ("qkv backward heads", lambda a: QKVB(a["dq"], a["dk"][..., :1, :], a["dv"], inv_freq=a["inv"]),
     ValueError, "dv: expected 1 heads"),
    ("qkv out_k overlaps cos", lambda a: QKV(
        a["qkv"], a["cos"], a["sin"], num_q_heads=4, num_kv_heads=2, out_q=np.empty_like(a["q"]),
        out_k=a["cos"].reshape(2, 4, 2, 16), out_v=np.empty_like(a["k"])),
     ValueError, "out_k: overlaps cos"),
    ("qkv out_v read-only", lambda a: QKV(
        a["qkv"], inv_freq=a["inv"], num_q_heads=4, num_kv_heads=2, out_q=np.empty_like(a["q"]),
        out_k=np.empty_like(a["k"]), out_v=_read_only(a["k"].shape)),
     TypeError, "out_v: cannot be written"),
    ("qkv backward flattened heads", lambda a: QKVB(
        a["dq"].reshape(2, 4, 64), a["dk"].reshape(2, 4, 32), a["dv"].reshape(2, 4, 32),
        inv_freq=a["inv"]), ValueError, "head_dim: dq and dk have flattened heads"),
    ("qkv backward out overlaps dq", lambda a: (lambda buf: QKVB(
        buf[:, :, :4], a["dk"], a["dv"], inv_freq=a["inv"], out=buf))(np.zeros((2, 4, 8, 16), np.float32)),
     ValueError, "out: overlaps dq;"),
    ("qkv backward dq not an array", lambda a: QKVB("dq", a["dk"], a["dv"], inv_freq=a["inv"]),
     TypeError, "dq: expected an array"),
    ("stride not whole elements", lambda a: R(np.lib.stride_tricks.as_strided(
        a["x"], shape=(2, 4, 3, 16), strides=(768, 192, 64, 2)), inv_freq=a["inv"]),
     ValueError, "x: stride 2 bytes on axis 3 is not a multiple of its 4-byte elements"),
    ("positions past 2**62", lambda a: R(a["x"], inv_freq=a["inv"],
                                          positions=np.array([0, 1, 2, -2**63 + 3])),
     ValueError, "positions: expected values below 2**62 in magnitude"),
    ("offsets past 2**62", lambda a: R(a["x"], a["cos"], a["sin"], positions=np.array([0, 1, 2, 3]),
                                        offsets=np.array([2**62, 0])),
     ValueError, "offsets: expected values below 2**62 in magnitude"),
    ("computed angles past 2**53", lambda a: R(a["x"], inv_freq=a["inv"], offsets=2**53 - 2),
     ValueError, "positions: angles computed from inv_freq take positions below 2**53"),
    ("bound: no angle source", lambda a: cupy_rope.RotaryEmbedding(layout="thd"), ValueError,
     "RotaryEmbedding: give an angle source"),
    ("bound qk tokens", lambda a: cupy_rope.RotaryEmbedding(inv_freq=a["inv"]).qk(a["q"], a["k"][:, :3]),
     ValueError, "k: expected the token axes"),
    ("bound position past table", lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"]).rope(a["x"], offsets=30),
     ValueError, "positions reach 33"),
    ("bound in place aliasing", lambda a: cupy_rope.RotaryEmbedding(inv_freq=a["inv"]).qk_(a["q"], a["q"]),
     ValueError, "overlaps"),
    ("qk k None", lambda a: QK(a["q"], None, inv_freq=a["inv"], inplace=True), TypeError,
     "k: expected an array, got None; to rotate q alone use apply_rope"),
    ("bound qk_ k None", lambda a: cupy_rope.RotaryEmbedding(inv_freq=a["inv"]).qk_(a["q"], None),
     TypeError, "k: expected an array, got None"),
    ("out is x", lambda a: R(a["x"], inv_freq=a["inv"], out=a["x"]), ValueError,
     "out: is x itself; pass inplace=True"),
    ("qk out_k is k", lambda a: QK(a["q"], a["k"], inv_freq=a["inv"], out_q=np.empty_like(a["q"]),
                                   out_k=a["k"]), ValueError, "out_k: is k itself"),
    ("interleaved numpy int", lambda a: R(a["x"], inv_freq=a["inv"], interleaved=np.int64(1)),
     TypeError, "interleaved: expected a bool, got numpy.int64"),
    ("offsets float", lambda a: R(a["x"], inv_freq=a["inv"], offsets=1.5), TypeError,
     "offsets: expected an int or an int32/int64 array, got float"),
    ("offsets 0-d float", lambda a: R(a["x"], inv_freq=a["inv"], offsets=np.array(1.5)), TypeError,
     "offsets: expected dtype int32 or int64"),
    ("backward bogus", lambda a: cupy_rope.apply_rope_backward(a["x"], inv_freq=a["inv"], bogus=1),
     TypeError, "apply_rope_backward() got an unexpected keyword argument 'bogus'"),
    ("backward backward=", lambda a: cupy_rope.apply_rope_backward(a["x"], inv_freq=a["inv"],
                                                                    backward=False),
     TypeError, "apply_rope_backward() got an unexpected keyword argument 'backward'"),
    ("bound built: cos without sin", lambda a: cupy_rope.RotaryEmbedding(a["cos"]), ValueError,
     "sin: cos and sin tables come together"),
    ("bound built: layout", lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"], layout="tdh"),
     ValueError, "layout: expected one of"),
    ("bound built: interleaved", lambda a: cupy_rope.RotaryEmbedding(inv_freq=a["inv"],
                                                                      interleaved="yes"),
     TypeError, "interleaved: expected a bool, got str"),
    ("bound built: two sources", lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"],
                                                                      inv_freq=a["inv"]),
     ValueError, "pass exactly one angle source"),
    ("bound built: list tables", lambda a: cupy_rope.RotaryEmbedding(a["cos"].tolist(),
                                                                      a["sin"].tolist()),
     TypeError, "cos: expected an array"),
    ("frequencies scheme", lambda a: frequencies.rope_frequencies(16, rope_scaling={"rope_type": "warp"}),
     ValueError, "rope_type"),
    ("frequencies missing key", lambda a: frequencies.rope_frequencies(16, rope_scaling={"rope_type": "linear"}),
     (ValueError, KeyError), "factor"),
]


@pytest.mark.parametrize("call,exc,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_call_names_the_argument_and_changes_nothing(call, exc, text):
    a = inputs()
    before = {n: v.copy() for n, v in a.items()}
    with pytest.raises(exc, match=re.escape(text)):
        call(a)
    for n, v in a.items():
        assert np.array_equal(v, before[n]), f"{n} was modified"


def test_matrix_size():
    assert len(CASES) >= 30
    assert {c[1].__code__.co_names for c in CASES}  # every case calls something


def test_missing_nvrtc_says_what_to_install(monkeypatch):
    """A compile without NVRTC names the packages to install."""
    import builtins

    from cupy_rope import launch, specialize

    real_import = builtins.__import__

    def no_nvrtc(name, *args, **kwargs):
        if name == "cupy.cuda" and args and args[2] and "nvrtc" in args[2]:
            raise ImportError("libnvrtc.so: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvrtc)
    with pytest.raises(specialize.CompileError, match=r"cupy-rope\[cuda12\]"):
        specialize.compile_for_arch(launch.shipped_specs()[:1], "sm_90")
