"""What a new user hits on the CPU (issue 30, items 1, 4 and 5, and NumPy
cu_seqlens in cupy_rope.torch): Hugging Face's [1, s] position_ids, torch CPU
bfloat16, one table-dtype rule on every device."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupy_rope
from cupy_rope import launch, reference
from cupy_rope.interop import CUDA, Tensor
from cupy_rope.validate import check_call
from helpers import np_dtype, oracle

B, S, H, D = 2, 6, 3, 16


def rng_x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def inv_freq(d=D):
    return (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)


def tables(rows=64, d=D):
    theta = np.arange(rows)[:, None] * inv_freq(d).astype(np.float64)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def fake(shape, dtype, device=CUDA, strides=None):
    """A shape-only array description at a fake, aligned pointer (no memory)."""
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    fake.ptr += 1 << 20
    return Tensor(None, "cupy", fake.ptr, tuple(shape), tuple(strides), dtype,
                  (device, 0), False)


fake.ptr = 1 << 30


# ------------------------------------------------ item 1: [1, s] positions --
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_one_row_of_positions_is_shared_by_the_batch(layout):
    """positions [1, s] (Hugging Face's position_ids) = [s] = the row tiled [b, s]."""
    shape = (B, S, H, D) if layout == "bshd" else (S, B, H, D)
    q, k = rng_x(shape, 1), rng_x(shape[:2] + (1, D), 2)
    row = np.array([3, 1, 4, 1, 5, 9])
    cos, sin = tables()
    forms = {"[1, s]": row[None], "[s]": row, "[b, s]": np.tile(row, (B, 1))}
    for angles in (dict(inv_freq=inv_freq()), dict(cos=cos, sin=sin)):
        kw = dict(angles, layout=layout)
        got = {n: cupy_rope.apply_rope_qk(q, k, positions=p, **kw) for n, p in forms.items()}
        for n in ("[s]", "[b, s]"):
            np.testing.assert_array_equal(got["[1, s]"][0], got[n][0], err_msg=n)
            np.testing.assert_array_equal(got["[1, s]"][1], got[n][1], err_msg=n)
        np.testing.assert_array_equal(cupy_rope.apply_rope(q, positions=row[None], **kw),
                                      got["[s]"][0])
        rope = cupy_rope.RotaryEmbedding(**kw)
        np.testing.assert_array_equal(rope(q, row[None]), got["[s]"][0])
        np.testing.assert_array_equal(rope.qk(q, k, row[None])[1], got["[s]"][1])
        qq, kk = q.copy(), k.copy()
        rope.qk_(qq, kk, row[None])
        np.testing.assert_array_equal(qq, got["[s]"][0])
    qkv = rng_x(shape[:2] + ((H + 2) * D,), 3)
    one = cupy_rope.apply_rope_qkv(qkv, inv_freq=inv_freq(), positions=row[None], num_q_heads=H,
                                   num_kv_heads=1, layout=layout)
    per = cupy_rope.apply_rope_qkv(qkv, inv_freq=inv_freq(), positions=row, num_q_heads=H,
                                   num_kv_heads=1, layout=layout)
    for a, b in zip(one, per):
        np.testing.assert_array_equal(a, b)


def test_one_row_per_axis_for_sections():
    """M-RoPE: positions [axes, 1, s] = [axes, s]."""
    pos = np.random.default_rng(4).integers(0, 50, (3, S))
    x = rng_x((B, S, H, D))
    kw = dict(inv_freq=inv_freq(), sections=[4, 2, 2])
    np.testing.assert_array_equal(cupy_rope.apply_rope(x, positions=pos[:, None], **kw),
                                  cupy_rope.apply_rope(x, positions=pos, **kw))


def test_position_shape_message_lists_the_one_row_form():
    x = rng_x((B, S, H, D))
    with pytest.raises(ValueError, match=re.escape(
            "positions: expected shape [6], [1, 6] or [2, 6] ([s], [1, s] or [b, s]), "
            "got [3, 6]")):
        cupy_rope.apply_rope(x, inv_freq=inv_freq(), positions=np.zeros((3, S), np.int64))
    with pytest.raises(ValueError, match=re.escape(
            "positions: expected shape [3, 6], [3, 1, 6] or [3, 2, 6] ([axes, s], [axes, 1, s] "
            "or [axes, b, s]; one row per axis")):
        cupy_rope.apply_rope(x, inv_freq=inv_freq(), positions=np.zeros((3, 4, S), np.int64),
                             sections=[4, 2, 2])


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("axes", [0, 3])
def test_gpu_call_of_one_row_is_that_of_s(layout, axes):
    """On the GPU, [1, s] is described as [s] (stride of its last axis), so the
    launch policy sees one call and plans it alike."""
    shape = (B, S, H, D) if layout == "bshd" else (S, B, H, D)
    x = fake(shape, "bfloat16")
    kw = dict(cos=fake((64, D // 2), "float32"), sin=fake((64, D // 2), "float32"),
              out=fake(shape, "bfloat16"), layout=layout)
    if axes:
        kw["sections"] = (4, 2, 2)
    lead = (axes,) if axes else ()
    calls = [check_call(x, positions=fake(lead + tok, "int32"), **kw) for tok in ((S,), (1, S))]
    pos = [c.positions for c in calls]
    assert pos[1].shape == pos[0].shape and pos[1].strides == pos[0].strides
    assert (calls[1]._replace(positions=pos[0]) == calls[0])
    assert launch.choose_spec(calls[1]) == launch.choose_spec(calls[0])


def test_transformers_position_ids_recipe():
    """README's Hugging Face recipe: apply_rope_qk(q.transpose(1, 2), k.transpose(1, 2),
    inv_freq=rotary_emb.inv_freq, positions=position_ids) with position_ids [1, s]."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=1,
                      head_dim=D, max_position_embeddings=64)
    rotary = llama.LlamaRotaryEmbedding(cfg)
    q = torch.from_numpy(rng_x((B, H, S, D), 5))  # HF's [b, h, s, d]
    k = torch.from_numpy(rng_x((B, 1, S, D), 6))
    position_ids = torch.arange(7, 7 + S)[None]  # [1, s]
    cos, sin = rotary(q, position_ids)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = cupy_rope.apply_rope_qk(q.transpose(1, 2), k.transpose(1, 2),
                                           inv_freq=rotary.inv_freq, positions=position_ids)
    np.testing.assert_allclose(got_q.transpose(1, 2).numpy(), want_q.numpy(), atol=2e-5)
    np.testing.assert_allclose(got_k.transpose(1, 2).numpy(), want_k.numpy(), atol=2e-5)


def test_torch_ops_take_one_row_of_positions():
    torch = pytest.importorskip("torch")
    crt = pytest.importorskip("cupy_rope.torch")
    row = torch.tensor([3, 1, 4, 1, 5, 9])
    inv = torch.from_numpy(inv_freq())
    q = torch.from_numpy(rng_x((B, S, H, D))).requires_grad_()
    k = torch.from_numpy(rng_x((B, S, 1, D), 1)).requires_grad_()
    outs = crt.rope_qk(q, k, inv_freq=inv, positions=row[None])
    want = crt.rope_qk(q.detach(), k.detach(), inv_freq=inv, positions=row)
    for o, w in zip(outs, want):
        torch.testing.assert_close(o.detach(), w, rtol=0, atol=0)
    gq, gk = torch.autograd.grad(outs, (q, k), (torch.ones_like(q), torch.ones_like(k)))
    torch.testing.assert_close(gq, crt.rope(torch.ones_like(q), inv_freq=inv, positions=row,
                                            backward=True), rtol=0, atol=0)
    x = q.detach().clone()
    crt.rope_(x, inv_freq=inv, positions=row[None], layout="bshd")
    torch.testing.assert_close(x, want[0], rtol=0, atol=0)
    pos3 = torch.randint(0, 30, (3, 1, S))
    y = crt.rope(q.detach(), inv_freq=inv, positions=pos3, sections=[4, 2, 2])
    torch.testing.assert_close(y, crt.rope(q.detach(), inv_freq=inv, positions=pos3[:, 0],
                                           sections=[4, 2, 2]), rtol=0, atol=0)


def test_jax_ops_take_one_row_of_positions():
    jax = pytest.importorskip("jax")
    crj = pytest.importorskip("cupy_rope.jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU form (the GPU form is in test_jax_gpu.py)")
    x = rng_x((B, S, H, D))
    row = np.array([3, 1, 4, 1, 5, 9], np.int32)
    want = cupy_rope.apply_rope(x, inv_freq=inv_freq(), positions=row)
    f = jax.jit(lambda x, p: crj.rope(x, inv_freq=inv_freq(), positions=p))
    np.testing.assert_array_equal(np.asarray(f(x, row[None])), want)
    g = jax.grad(lambda x: crj.rope(x, inv_freq=inv_freq(), positions=row[None]).sum())(x)
    np.testing.assert_allclose(np.asarray(g), cupy_rope.apply_rope(
        np.ones_like(x), inv_freq=inv_freq(), positions=row, backward=True), rtol=1e-6)


# --------------------------------------------- item 4: torch CPU bfloat16 --
def test_bfloat16_rounding_is_torchs():
    """The reference stores bfloat16 as torch rounds a float64 tensor to it."""
    torch = pytest.importorskip("torch")
    v = np.concatenate([np.random.default_rng(0).standard_normal(20000) * 8,
                        [np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, 1.00390625,
                         1.01171875, 1 + 2.0 ** -8 + 2.0 ** -30]])
    got = reference.encoded(v, np.zeros(1, np.uint16), "bfloat16")
    want = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)
    nan = reference.encoded(np.array([np.nan]), np.zeros(1, np.uint16), "bfloat16")
    assert np.isnan(reference.decoded(nan, "bfloat16")).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_cpu_half_precision_array_api(dtype):
    """torch CPU bfloat16 / float16 in, the same out: computed in float64."""
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    x = torch.from_numpy(rng_x((B, S, H, D))).to(tdt)
    cos, sin = (torch.from_numpy(t) for t in tables())
    x64 = x.double().numpy()
    for angles in (dict(cos=cos, sin=sin), dict(cos=cos.to(tdt), sin=sin.to(tdt)),
                   dict(inv_freq=torch.from_numpy(inv_freq()))):
        y = cupy_rope.apply_rope(x, positions=np.arange(S)[None], **angles)
        assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.device.type == "cpu"
        ref = oracle(x64, **{n: t.double().numpy() for n, t in angles.items()})
        torch.testing.assert_close(y, torch.from_numpy(ref).to(tdt), rtol=0, atol=0)
    # in place on a view, channels past rotary_dim left as they were
    base = x.clone()
    view = base[:, :, 1:]
    cupy_rope.apply_rope(view, cos[:, :4], sin[:, :4], rotary_dim=8, inplace=True)
    assert torch.equal(base[:, :, 0], x[:, :, 0]) and torch.equal(base[..., 8:], x[..., 8:])
    ref = oracle(x64[:, :, 1:], cos=cos[:, :4].double().numpy(), sin=sin[:, :4].double().numpy(),
                 rotary_dim=8)
    torch.testing.assert_close(base[:, :, 1:], torch.from_numpy(ref).to(tdt), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_cpu_half_precision_ops(dtype):
    torch = pytest.importorskip("torch")
    crt = pytest.importorskip("cupy_rope.torch")
    tdt = getattr(torch, dtype)
    cos, sin = (torch.from_numpy(t) for t in tables())
    x = torch.from_numpy(rng_x((B, S, H, D))).to(tdt).requires_grad_()
    y = crt.rope(x, cos, sin)
    want = cupy_rope.apply_rope(x.detach(), cos, sin)
    assert y.dtype == tdt and torch.equal(y.detach(), want)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert g.dtype == tdt
    assert torch.equal(g, cupy_rope.apply_rope(torch.ones_like(x), cos, sin, backward=True))
    z = x.detach().clone()
    assert torch.equal(crt.rope_(z, cos, sin), want)
    q, k = crt.rope_qk(x.detach(), x.detach()[:, :, :1], cos, sin)
    assert torch.equal(q, want) and torch.equal(k, want[:, :, :1])
    qkv = torch.from_numpy(rng_x((B, S, (2 + 2) * D), 1)).to(tdt).requires_grad_()
    q, k, v = crt.rope_qkv(qkv, cos, sin, num_q_heads=2, num_kv_heads=1)
    heads = qkv.detach().view(B, S, 4, D)
    assert q.dtype == tdt and torch.equal(v, heads[:, :, 3:])
    assert torch.equal(k, cupy_rope.apply_rope(heads[:, :, 2:3], cos, sin))
    (gqkv,) = torch.autograd.grad((q.sum() + k.sum() + v.sum()), qkv)
    assert gqkv.dtype == tdt and gqkv.shape == qkv.shape


# ------------------------------------------- item 5: one table-dtype rule --
SOURCES = {"cos": lambda t: dict(cos=t((64, D // 2)), sin=t((64, D // 2))),
           "cos_sin_cache": lambda t: dict(cos_sin_cache=t((64, D))),
           "inv_freq": lambda t: dict(inv_freq=t((D // 2,))),
           "freqs": lambda t: dict(freqs=t((64, D // 2)))}


@pytest.mark.parametrize("x_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_cpu_and_gpu_take_the_same_table_dtypes(x_dtype, source):
    """For every input dtype both take, the NumPy path and the GPU path
    accept and refuse the same angle-source dtypes (float32 or x's dtype for
    tables; float32 for inv_freq and freqs)."""
    for table_dtype in ("float16", "bfloat16", "float32", "float64"):
        verdicts = []
        for device in ("cpu", CUDA):
            x = fake((B, S, H, D), x_dtype, device)
            angles = SOURCES[source](lambda shape: fake(shape, table_dtype, device))
            try:
                check_call(x, **angles)
                verdicts.append("accepted")
            except TypeError as e:
                assert f"got {table_dtype}" in str(e)
                verdicts.append("refused")
        assert verdicts[0] == verdicts[1], (table_dtype, verdicts)
        want = table_dtype == "float32" or (table_dtype == x_dtype and source in ("cos",
                                                                                  "cos_sin_cache"))
        assert verdicts[0] == ("accepted" if want else "refused"), (table_dtype, verdicts)


@pytest.mark.parametrize("source", list(SOURCES))
def test_float64_tables_with_float32_x_refused_with_the_cast(source):
    """The natural ``1 / 10000 ** (np.arange(0, d, 2) / d)`` is float64: say how to fix it."""
    x = rng_x((B, S, H, D))
    cos, sin = tables()
    values = {"cos": cos, "sin": sin, "cos_sin_cache": np.concatenate([cos, sin], 1),
              "inv_freq": inv_freq(), "freqs": np.arange(64)[:, None] * inv_freq()}
    angles = {n: values[n].astype(np.float64) for n in SOURCES[source](lambda s: None)}
    with pytest.raises(TypeError, match=re.escape(f"{source}: expected dtype float32, got "
                                                  "float64")) as e:
        cupy_rope.apply_rope(x, **angles)
    assert ".astype(numpy.float32)" in str(e.value)
    f32 = {n: a.astype(np.float32) for n, a in angles.items()}
    cupy_rope.apply_rope(x, **f32)
    # float64 input takes float64 tables (the reference's own dtype)
    np.testing.assert_allclose(cupy_rope.apply_rope(x.astype(np.float64), **angles),
                               cupy_rope.apply_rope(x.astype(np.float64), **f32), atol=1e-6)


def test_refusals_name_the_dtype_and_the_cast_for_each_framework():
    pytest.importorskip("ml_dtypes")
    x = rng_x((B, S, H, D), dtype=np.float16)
    cos, sin = tables()
    bf16 = np_dtype("bfloat16")
    with pytest.raises(TypeError, match=re.escape("cos: expected dtype float32 or float16, "
                                                  "got bfloat16")):
        cupy_rope.apply_rope(x, cos.astype(bf16), sin.astype(bf16))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"inv_freq: expected dtype float32, got float64; .*"
                                        r"\.float\(\)"):
        cupy_rope.apply_rope(torch.from_numpy(x), inv_freq=torch.from_numpy(
            inv_freq().astype(np.float64)))


def test_frequency_builders_give_float32_and_the_oracle_upcasts():
    """What the library builds is accepted with float32 x, and the tests'
    float64 oracle (x upcast too) still runs."""
    from cupy_rope.frequencies import cos_sin_cache, rope_frequencies

    inv, factor = rope_frequencies(D, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32})
    cos, sin = cos_sin_cache(inv, 64, factor)
    assert inv.dtype == cos.dtype == sin.dtype == np.float32
    x = rng_x((B, S, H, D))
    np.testing.assert_allclose(cupy_rope.apply_rope(x, cos, sin), oracle(x, cos=cos, sin=sin),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cupy_rope.apply_rope(x, inv_freq=inv),
                               oracle(x, inv_freq=inv), rtol=1e-5, atol=1e-6)


# -------------------------------- finding: NumPy cu_seqlens in cupy_rope.torch --
def test_torch_ops_take_numpy_cu_seqlens():
    torch = pytest.importorskip("torch")
    crt = pytest.importorskip("cupy_rope.torch")
    cu = np.array([0, 5, 12, 20], np.int32)
    inv = torch.from_numpy(inv_freq())
    x = torch.from_numpy(rng_x((20, H, D)))
    want = crt.rope(x, inv_freq=inv, layout="thd", cu_seqlens=torch.from_numpy(cu))
    torch.testing.assert_close(crt.rope(x, inv_freq=inv, layout="thd", cu_seqlens=cu), want,
                               rtol=0, atol=0)
    q, _ = crt.rope_qk(x, x[:, :1], inv_freq=inv, layout="thd", cu_seqlens=cu)
    torch.testing.assert_close(q, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        crt.rope(x, inv_freq=inv, layout="thd", cu_seqlens=cu + 1)
    with pytest.raises(TypeError, match=re.escape("cu_seqlens: expected a torch tensor or a "
                                                  "NumPy array")):
        crt.rope(x, inv_freq=inv, layout="thd", cu_seqlens=[0, 5, 12, 20])
