"""What a new user hits (issue 30): k=None, out=x, RotaryEmbedding checked when
built, NumPy bools, 0-d and non-integer offsets, the backward functions'
own signatures, and no CUDA device. CPU on the NumPy (and torch CPU)
reference path; the GPU-only behaviour in the tests marked gpu."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupy_rope
from cupy_rope import api, frequencies, interop

ROOT = Path(__file__).resolve().parent.parent
D = 16


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    theta = np.arange(32)[:, None] * np.linspace(0.1, 1, D // 2)
    return {"x": f(2, 4, 3, D), "q": f(2, 4, 4, D), "k": f(2, 4, 2, D),
            "cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32)}


def refused(exc, text, call, *unchanged):
    """``call()`` raises ``exc`` whose message contains ``text``; the arrays in
    ``unchanged`` are left as they were."""
    before = [np.array(a, copy=True) for a in unchanged]
    with pytest.raises(exc, match=re.escape(text)):
        call()
    for a, b in zip(unchanged, before):
        np.testing.assert_array_equal(np.asarray(a), b)


# ------------------------------------------------------------ 3: k=None ----
K_NONE = "k: expected an array, got None; to rotate q alone use apply_rope"


@pytest.mark.parametrize("entry", ["apply_rope_qk", "apply_rope_qk inplace", "qk", "qk inplace",
                                   "qk_", "qk_ positions"])
def test_k_none_is_refused_by_every_q_and_k_entry_point(entry):
    a = arrays()
    q, cos, sin = a["q"], a["cos"], a["sin"]
    rope = cupy_rope.RotaryEmbedding(cos, sin)
    call = {"apply_rope_qk": lambda: cupy_rope.apply_rope_qk(q, None, cos, sin),
            "apply_rope_qk inplace": lambda: cupy_rope.apply_rope_qk(q, None, cos, sin,
                                                                     inplace=True),
            "qk": lambda: rope.qk(q, None),
            "qk inplace": lambda: rope.qk(q, None, inplace=True),
            "qk_": lambda: rope.qk_(q, None),
            "qk_ positions": lambda: rope.qk_(q, None, np.arange(4))}[entry]
    refused(TypeError, K_NONE, call, q)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_k_none_never_reaches_a_cached_decode_launcher(framework):
    """qk_'s cached launchers serve (q, k, positions) of one class; a None k
    is validated (and refused) every time, also after the signature of the
    same q and positions has been cached."""
    if framework == "torch":
        pytest.importorskip("torch")
    from gpu_util import to_device, to_host

    a = arrays()
    cache = np.concatenate([a["cos"], a["sin"]], axis=1)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=to_device(cache, framework), layout="thd")
    q0, k0 = a["q"].reshape(8, 4, D), a["k"].reshape(8, 2, D)
    pos = to_device(np.arange(8, dtype=np.int64), framework)
    q, k = to_device(q0, framework), to_device(k0, framework)
    for _ in range(3):  # the signature cached
        rope.qk_(q, k, pos)
    before = to_host(q)
    for _ in range(2):
        with pytest.raises(TypeError, match=re.escape(K_NONE)):
            rope.qk_(q, None, pos)
        with pytest.raises(TypeError, match=re.escape(K_NONE)):
            cupy_rope.apply_rope_qk(q, None, cos_sin_cache=rope._tables[4], positions=pos,
                                    layout="thd", inplace=True)
    np.testing.assert_array_equal(to_host(q), before)


# -------------------------------------------------------------- 6: out=x ----
@pytest.mark.parametrize("entry", ["apply_rope", "apply_rope_backward", "rope", "view of x"])
def test_out_that_is_x_is_refused(entry):
    a = arrays()
    x, cos, sin = a["x"], a["cos"], a["sin"]
    rope = cupy_rope.RotaryEmbedding(cos, sin)
    call = {"apply_rope": lambda: cupy_rope.apply_rope(x, cos, sin, out=x),
            "apply_rope_backward": lambda: cupy_rope.apply_rope_backward(x, cos, sin, out=x),
            "rope": lambda: rope(x, out=x),
            "view of x": lambda: cupy_rope.apply_rope(x, cos, sin, out=x[...])}[entry]
    refused(ValueError, "out: is x itself; pass inplace=True to rotate x in place", call, x)


@pytest.mark.parametrize("entry", ["apply_rope_qk", "qk"])
def test_out_q_that_is_q_is_refused(entry):
    a = arrays()
    q, k, cos, sin = a["q"], a["k"], a["cos"], a["sin"]
    rope = cupy_rope.RotaryEmbedding(cos, sin)
    for outs, text in (((q, k), "out_q: is q itself"),
                       ((np.empty_like(q), k), "out_k: is k itself")):
        call = {"apply_rope_qk": lambda: cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=outs[0],
                                                                 out_k=outs[1]),
                "qk": lambda: rope.qk(q, k, out_q=outs[0], out_k=outs[1])}[entry]
        refused(ValueError, text + "; pass inplace=True to rotate q and k in place", call, q, k)


def test_out_and_inplace_together_are_refused_even_for_x_itself():
    a = arrays()
    x = a["x"]
    refused(ValueError, "out: pass either out= or inplace=True, not both",
            lambda: cupy_rope.apply_rope(x, a["cos"], a["sin"], out=x, inplace=True), x)


def test_qkv_outputs_inside_qkv_are_refused():
    a = arrays()
    qkv = np.random.default_rng(1).standard_normal((2, 4, 8, D)).astype(np.float32)
    refused(ValueError, "out_q: overlaps qkv", lambda: cupy_rope.apply_rope_qkv(
        qkv, a["cos"], a["sin"], num_q_heads=4, num_kv_heads=2, out_q=qkv[:, :, :4],
        out_k=np.empty((2, 4, 2, D), np.float32), out_v=np.empty((2, 4, 2, D), np.float32)), qkv)


def test_out_that_is_x_is_refused_for_torch_cpu():
    torch = pytest.importorskip("torch")
    a = arrays()
    x = torch.from_numpy(a["x"])
    refused(ValueError, "out: is x itself", lambda: cupy_rope.apply_rope(
        x, torch.from_numpy(a["cos"]), torch.from_numpy(a["sin"]), out=x), x.numpy())


def test_in_place_still_works():
    a = arrays()
    x = a["x"].copy()
    want = cupy_rope.apply_rope(x, a["cos"], a["sin"])
    assert cupy_rope.apply_rope(x, a["cos"], a["sin"], inplace=True) is x
    np.testing.assert_allclose(x, want, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_out_that_is_x_is_refused_on_the_gpu_after_caching(framework):
    """Refused on every call, also once the same signature with a separate out
    is cached (a pointer shared by x and out never takes a cached launcher)."""
    if framework == "torch":
        pytest.importorskip("torch")
    from gpu_util import to_device, to_host

    a = arrays()
    x, cos, sin = (to_device(a[n], framework) for n in ("x", "cos", "sin"))
    out = to_device(np.zeros_like(a["x"]), framework)
    for _ in range(3):
        cupy_rope.apply_rope(x, cos, sin, out=out)
    q, k = to_device(a["q"], framework), to_device(a["k"], framework)
    cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=to_device(np.zeros_like(a["q"]), framework),
                            out_k=to_device(np.zeros_like(a["k"]), framework))
    for _ in range(2):
        with pytest.raises(ValueError, match="out: is x itself"):
            cupy_rope.apply_rope(x, cos, sin, out=x)
        with pytest.raises(ValueError, match="out_q: is q itself"):
            cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=q, out_k=k)
    np.testing.assert_array_equal(to_host(x), a["x"])
    np.testing.assert_array_equal(to_host(q), a["q"])


def test_no_package_code_passes_out_as_its_input():
    """The adapters hand the library new outputs (torch.empty_like, XLA's
    result buffers): none relies on out=x, which is now refused."""
    for name in ("torch.py", "jax.py", "hf.py", "frequencies.py"):
        src = (ROOT / "cupy_rope" / name).read_text()
        assert not re.search(r"\bout(_[qkv])?=(x|q|k|qkv|a\[\"x\"\])\b", src), name


# ----------------------------------------- 7: RotaryEmbedding when built ----
BAD_BOUND = [
    ("cos without sin", dict(cos="cos"), ValueError),
    ("sin without cos", dict(sin="sin"), ValueError),
    ("two angle sources", dict(cos="cos", sin="sin", inv_freq="inv"), ValueError),
    ("list tables", dict(cos="cos list", sin="sin list"), TypeError),
    ("int tables", dict(cos="cos int", sin="sin int"), TypeError),
    ("inv_freq 2-D", dict(inv_freq="cos"), ValueError),
    ("layout", dict(cos="cos", sin="sin", layout="tdh"), ValueError),
    ("interleaved", dict(cos="cos", sin="sin", interleaved="yes"), TypeError),
    ("sections_interleaved", dict(cos="cos", sin="sin", sections_interleaved=1), TypeError),
    ("rotary_dim", dict(cos="cos", sin="sin", rotary_dim=6), ValueError),
    ("rotary_dim float", dict(cos="cos", sin="sin", rotary_dim=16.0), TypeError),
    ("cp_size", dict(cos="cos", sin="sin", cp_size=0), ValueError),
    ("cp_rank", dict(cos="cos", sin="sin", cp_size=2, cp_rank=2), ValueError),
    ("sections", dict(cos="cos", sin="sin", sections=[1, 1]), ValueError),
    ("sections_interleaved needs sections", dict(cos="cos", sin="sin",
                                                 sections_interleaved=True), ValueError),
]


def _bound_kwargs(spec):
    a = arrays()
    named = {"cos": a["cos"], "sin": a["sin"], "inv": np.linspace(0.1, 1, D // 2, dtype=np.float32),
             "cos list": a["cos"].tolist(), "sin list": a["sin"].tolist(),
             "cos int": a["cos"].astype(np.int32), "sin int": a["sin"].astype(np.int32)}
    return {k: named[v] if isinstance(v, str) and v in named else v for k, v in spec.items()}


@pytest.mark.parametrize("spec,exc", [c[1:] for c in BAD_BOUND], ids=[c[0] for c in BAD_BOUND])
def test_rotary_embedding_is_checked_when_built_as_a_call_is(spec, exc):
    """The constructor refuses what the first call would, with the same message."""
    kw = _bound_kwargs(spec)
    with pytest.raises(exc) as at_call:
        cupy_rope.apply_rope(arrays()["x"], **kw)
    with pytest.raises(exc) as built:
        cupy_rope.RotaryEmbedding(**kw)
    assert str(built.value) == str(at_call.value)


def test_rotary_embedding_head_dim_bounds_rotary_dim_when_built():
    a = arrays()
    with pytest.raises(ValueError, match=re.escape("rotary_dim: must be <= head_dim (8)")):
        cupy_rope.RotaryEmbedding(a["cos"], a["sin"], head_dim=8)


def test_rotary_embedding_accepts_what_a_call_accepts():
    a = arrays()
    x = a["x"]
    for kw in (dict(cos=a["cos"], sin=a["sin"]),
               dict(cos=a["cos"].astype(np.float16), sin=a["sin"].astype(np.float16)),
               dict(cos_sin_cache=np.concatenate([a["cos"], a["sin"]], axis=1)),
               dict(inv_freq=np.linspace(0.1, 1, D // 2, dtype=np.float32)),
               dict(freqs=(np.arange(32)[:, None] * np.linspace(0.1, 1, D // 2)).astype(np.float32),
                    layout="sbhd", interleaved=True, rotary_dim=D, head_dim=D, cp_size=2,
                    cp_rank=1)):
        rope = cupy_rope.RotaryEmbedding(**kw)
        xx = x.astype(kw["cos"].dtype) if "cos" in kw else x
        np.testing.assert_array_equal(rope(xx), cupy_rope.apply_rope(xx, **kw))


# ----------------------------------------------------- 8: NumPy bools ----
@pytest.mark.parametrize("flag", ["interleaved", "inplace", "backward"])
def test_numpy_bools_are_bools(flag):
    a = arrays()
    want = cupy_rope.apply_rope(a["x"].copy(), a["cos"], a["sin"], **{flag: True})
    got = cupy_rope.apply_rope(a["x"].copy(), a["cos"], a["sin"], **{flag: np.True_})
    np.testing.assert_array_equal(got, want)


def test_numpy_bools_in_rotary_embedding_and_sections_interleaved():
    a = arrays()
    rope = cupy_rope.RotaryEmbedding(a["cos"], a["sin"], interleaved=np.True_)
    assert rope._common[1] is True  # the Python bool, as a call's signature has it
    want = cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], interleaved=True)
    np.testing.assert_array_equal(rope(a["x"], backward=np.False_), want)
    pos = np.zeros((3, 2, 4), np.int64)
    y = cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], positions=pos, sections=[4, 2, 2],
                             sections_interleaved=np.True_)
    np.testing.assert_array_equal(y, cupy_rope.apply_rope(
        a["x"], a["cos"], a["sin"], positions=pos, sections=[4, 2, 2], sections_interleaved=True))
    kw = api.option_kwargs({}, interleaved=np.True_, sections_interleaved=np.False_)
    assert kw == {"interleaved": True} and type(kw["interleaved"]) is bool


@pytest.mark.parametrize("value,name", [(1, "int"), (np.int64(1), "numpy.int64"),
                                        ("yes", "str"), (None, "NoneType")])
def test_refused_flags_name_the_type_in_full(value, name):
    a = arrays()
    refused(TypeError, f"interleaved: expected a bool, got {name}",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], interleaved=value))


def test_refused_ints_name_the_type_in_full():
    a = arrays()
    refused(TypeError, "rotary_dim: expected an int, got numpy.float64",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], rotary_dim=np.float64(16)))
    refused(TypeError, "cp_size: expected an int, got numpy.bool",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], cp_size=np.True_))


# --------------------------------------------------------- 9: offsets ----
@pytest.mark.parametrize("value,name", [(1.5, "float"), ("3", "str"), ([1, 2], "list"),
                                        (np.float64(1.0), "numpy.float64")])
def test_offsets_that_are_no_int_or_array_say_what_is_expected(value, name):
    a = arrays()
    refused(TypeError, f"offsets: expected an int or an int32/int64 array, got {name}",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=value))


@pytest.mark.parametrize("zero_d", [np.array(3), np.array(3, np.int32)], ids=["int64", "int32"])
def test_host_0d_integer_offsets_are_a_scalar_offset(zero_d):
    a = arrays()
    want = cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=3)
    np.testing.assert_array_equal(
        cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=zero_d), want)
    t = np.random.default_rng(2).standard_normal((10, 3, D)).astype(np.float32)
    cu = np.array([0, 4, 10], np.int32)
    np.testing.assert_array_equal(
        cupy_rope.apply_rope(t, a["cos"], a["sin"], layout="thd", cu_seqlens=cu, offsets=zero_d),
        cupy_rope.apply_rope(t, a["cos"], a["sin"], layout="thd", cu_seqlens=cu, offsets=3))
    rope = cupy_rope.RotaryEmbedding(a["cos"], a["sin"])
    np.testing.assert_array_equal(rope(a["x"], offsets=zero_d), want)


def test_host_0d_offsets_are_checked_as_an_int():
    a = arrays()
    refused(ValueError, "positions reach 33",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=np.array(30)))
    refused(TypeError, "offsets: expected dtype int32 or int64, got float64",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=np.array(1.5)))
    # the dtype rule of offsets arrays holds for 0-d ones too
    refused(TypeError, "offsets: expected dtype int32 or int64, got uint8",
            lambda: cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], offsets=np.array(3, np.uint8)))


def test_torch_cpu_0d_offsets():
    torch = pytest.importorskip("torch")
    a = arrays()
    x, cos, sin = (torch.from_numpy(a[n]) for n in ("x", "cos", "sin"))
    want = cupy_rope.apply_rope(x, cos, sin, offsets=3)
    assert torch.equal(cupy_rope.apply_rope(x, cos, sin, offsets=torch.tensor(3)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_device_0d_offsets_are_one_offset_for_every_batch_entry(framework):
    """A device 0-d offsets array is read by the kernel (no sync) as the
    offset of every batch entry; a cached plan reads each call's value."""
    if framework == "torch":
        pytest.importorskip("torch")
    from gpu_util import to_device, to_host

    from helpers import assert_close

    def scalar(value, dtype):  # to_device makes 1-D arrays of 0-d ones
        if framework == "torch":
            import torch

            return torch.tensor(value, dtype=getattr(torch, dtype), device="cuda")
        import cupy

        return cupy.asarray(np.array(value, dtype))

    a = arrays()
    x, cos, sin = (to_device(a[n], framework) for n in ("x", "cos", "sin"))
    for layout in ("bshd", "sbhd"):
        for value, dtype in ((3, "int64"), (5, "int64"), (3, "int64"), (4, "int32")):
            off = scalar(value, dtype)
            assert off.ndim == 0
            got = cupy_rope.apply_rope(x, cos, sin, layout=layout, offsets=off)
            want = cupy_rope.apply_rope(x, cos, sin, layout=layout, offsets=value)
            assert_close(to_host(got), to_host(want), "float32", f"{layout} offsets={value}")
    t = to_device(np.random.default_rng(3).standard_normal((10, 3, D)).astype(np.float32),
                  framework)
    cu = to_device(np.array([0, 4, 10], np.int32), framework)
    with pytest.raises(ValueError, match=re.escape("offsets: a 0-d device array is one offset "
                                                   "for every batch entry")):
        cupy_rope.apply_rope(t, cos, sin, layout="thd", cu_seqlens=cu,
                             offsets=scalar(3, "int32"))


# ------------------------------------------- 10: the backward functions ----
@pytest.mark.parametrize("call,text", [
    (lambda a: cupy_rope.apply_rope_backward(a["x"], a["cos"], a["sin"], bogus=1),
     "apply_rope_backward() got an unexpected keyword argument 'bogus'"),
    (lambda a: cupy_rope.apply_rope_backward(a["x"], a["cos"], a["sin"], backward=False),
     "apply_rope_backward() got an unexpected keyword argument 'backward'"),
    (lambda a: cupy_rope.apply_rope_qkv_backward(a["q"], a["k"], a["k"], a["cos"], a["sin"],
                                                 backward=True),
     "apply_rope_qkv_backward() got an unexpected keyword argument 'backward'"),
    (lambda a: cupy_rope.apply_rope_qkv_backward(a["q"], a["k"], a["k"], a["cos"], a["sin"],
                                                 bogus=1),
     "apply_rope_qkv_backward() got an unexpected keyword argument 'bogus'"),
    (lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"]).qkv_backward(
        a["q"], a["k"], a["k"], backward=True),
     "qkv_backward() got an unexpected keyword argument 'backward'"),
    (lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"]).rope(a["x"], bogus=1),
     "rope() got an unexpected keyword argument 'bogus'"),
    (lambda a: cupy_rope.RotaryEmbedding(a["cos"], a["sin"]).qk_(a["q"], a["k"], inplace=True),
     "qk_() got an unexpected keyword argument 'inplace'"),
], ids=["backward bogus", "backward backward=", "qkv_backward backward=", "qkv_backward bogus",
        "bound qkv_backward backward=", "bound rope bogus", "bound qk_ inplace="])
def test_backward_functions_have_their_own_signature(call, text):
    a = arrays()
    refused(TypeError, text, lambda: call(a), a["x"], a["q"], a["k"])


def test_apply_rope_backward_is_the_backward_rotation():
    a = arrays()
    np.testing.assert_array_equal(
        cupy_rope.apply_rope_backward(a["x"], a["cos"], a["sin"]),
        cupy_rope.apply_rope(a["x"], a["cos"], a["sin"], backward=True))


# ---------------------------------------------------- 12: no CUDA device ----
def test_no_cuda_device_error_is_one_class_everywhere():
    assert cupy_rope.NoCudaDeviceError is interop.NoCudaDeviceError
    assert frequencies.NoCudaDeviceError is interop.NoCudaDeviceError
    assert issubclass(cupy_rope.NoCudaDeviceError, RuntimeError)
    assert "NoCudaDeviceError" in cupy_rope.__all__


def test_require_cuda_without_cupy_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(cupy_rope.NoCudaDeviceError) as e:
        interop.require_cuda("my step")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("my step: no CUDA device was found (")
    assert "the NumPy reference path still works" in msg


def _bench(*prelude: str):
    code = "; ".join(prelude + ("from benchmarks import bench", "sys.exit(bench.main([]))"))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", "import sys; " + code], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
                          timeout=300)


def test_bench_without_cupy_says_so_in_one_line_and_exits_2():
    proc = _bench("sys.modules['cupy'] = None")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m benchmarks.bench: no CUDA device was found")
    assert "NumPy reference path still works" in lines[0]


def test_bench_on_this_machine_without_a_gpu():
    from helpers import gpu_available

    if gpu_available():
        pytest.skip("a CUDA device is usable here")
    proc = _bench()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "no CUDA device was found" in proc.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_jax_arrays_run_the_reference_and_stay_jax(dtype):
    """apply_rope / apply_rope_qk on JAX arrays on the CPU: the NumPy
    reference runs and the results are JAX arrays on that device (before,
    the output was allocated with CuPy, which fails without a GPU)."""
    jax = pytest.importorskip("jax")
    a = arrays()
    cpu = jax.devices("cpu")[0]
    x, q, k = (jax.device_put(a[n], cpu).astype(dtype) for n in ("x", "q", "k"))
    y = cupy_rope.apply_rope(x, a["cos"], a["sin"])
    want = cupy_rope.apply_rope(np.asarray(x.astype("float32")), a["cos"], a["sin"])
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.devices() == {cpu}
    tol = 1e-6 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(y.astype("float32")), want, atol=tol, rtol=tol)
    rq, rk = cupy_rope.apply_rope_qk(q, k, a["cos"], a["sin"])
    assert isinstance(rq, jax.Array) and rk.shape == k.shape


def test_messages_for_peer_conventions():
    """A Hugging Face full-width table and vLLM's argument order get a hint."""
    a = arrays()
    full = np.concatenate([a["cos"], a["cos"]], axis=1)  # [positions, d]
    with pytest.raises(ValueError, match=r"rotary_dim.*full-width table.*cos\[\.\.\., :8\]"):
        cupy_rope.apply_rope(a["x"], full, full)
    cache = np.concatenate([a["cos"], a["sin"]], axis=1)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd", head_dim=D)
    q, k = a["q"].reshape(-1, 4 * D), a["k"].reshape(-1, 2 * D)
    with pytest.raises(TypeError, match="positions come last"):
        rope.qk_(np.arange(q.shape[0]), q, k)
