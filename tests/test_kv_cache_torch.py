"""cupy_rope.torch's RoPE + KV-cache ops (issue 32): registration, fake
implementations, torch.compile, CUDA graphs.

CPU: the schemas declare the caches (and q in place) mutated; the fake
implementations give the real outputs' shapes and dtypes; the ops give what
the array API gives on the same tensors (its NumPy reference), padding
tokens write nothing, bad arguments are refused before anything is written,
and ``torch.compile(fullgraph=True)`` (aot_eager) traces them. GPU (marked
``gpu``): the ops equal the eager array API call bit for bit, compiled
(inductor) equals eager, and a CUDA graph of a decode step replayed with
fresh inputs copied in leaves the caches exactly as eager calls do.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

import cupy_rope.torch as crt  # noqa: E402
from cupy_rope import kv_cache  # noqa: E402

T, HQ, HK, D = 6, 4, 2, 64
BLOCKS, BLOCK_SIZE = 8, 4
FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def inputs(device="cpu", dtype=torch.float32, seed=0, t=T):
    """q, k, v [t, h, d], inv_freq, positions and distinct slots with one padding token."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, D, generator=g).to(device, dtype) for h in (HQ, HK, HK))
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
    pos = torch.randint(0, 100, (t,), generator=g)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:t]
    slots[t // 2] = -1  # a padding token
    return dict(q=q, k=k, v=v, inv_freq=inv.to(device), positions=pos.to(device),
                slots=slots.to(device))


def caches(layout="NHD", dtype=torch.float32, device="cpu", fill=float("nan"), blocks=BLOCKS):
    """k and v caches poisoned with ``fill`` (FP8: its bytes 0x7f, a NaN)."""
    shape = (blocks, BLOCK_SIZE, HK, D) if layout == "NHD" else (blocks, HK, BLOCK_SIZE, D)
    if dtype in FP8.values():
        return [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
                for _ in range(2)]
    return [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(2)]


def bits(t):
    return t.contiguous().view(torch.uint8)


def per_slot(cache, layout):
    """[slots, hk * d] rows of a cache (as its bytes)."""
    c = bits(cache)
    if layout == "HND":
        c = c.transpose(1, 2)
    return c.reshape(c.shape[0] * BLOCK_SIZE, -1)


def packed(x):
    return torch.cat([x["q"].flatten(1), x["k"].flatten(1), x["v"].flatten(1)], dim=1)


# ------------------------------------------------------------ registration --
OPS = {"rope_and_cache": ("k_cache", "v_cache"), "rope_and_cache_": ("q", "k_cache", "v_cache"),
       "qkv_rope_and_cache": ("k_cache", "v_cache"),
       "qkv_rope_and_cache_": ("qkv", "k_cache", "v_cache")}


@pytest.mark.parametrize("name", list(OPS))
def test_schema_declares_exactly_the_written_tensors(name):
    schema = getattr(torch.ops.cupy_rope, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
    assert written == set(OPS[name])


def opcheck_all(device, cache_dtype=torch.float32, dtype=torch.float32):
    """torch.library.opcheck (schema and declared mutations, fake tensors,
    autograd registration, AOT dispatch) of the four ops."""
    x = inputs(device, dtype)
    kc, vc = caches(dtype=cache_dtype, device=device, fill=0.0)
    fp8 = cache_dtype in FP8.values()
    scale = torch.tensor([0.5], device=device) if fp8 else None
    # cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, offset,
    # layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank
    common = (None, None, x["inv_freq"], None, None, x["positions"], None, None, 0, "thd", False,
              None, None, 1, 0)
    # cache_layout, cache_dtype, k_scale, v_scale, q_scale, k/v/q scale values, q_dtype
    cache = ("NHD", None, scale, None, None, None, 0.25 if fp8 else None, None, None)
    ops = torch.ops.cupy_rope
    torch.library.opcheck(ops.rope_and_cache.default,
                          (x["q"], x["k"], x["v"], kc, vc, x["slots"]) + common + cache)
    torch.library.opcheck(ops.rope_and_cache_.default,
                          (x["q"].clone(), x["k"], x["v"], kc, vc, x["slots"]) + common + cache)
    qkv = packed(x)
    heads = common + (HQ, HK) + cache
    torch.library.opcheck(ops.qkv_rope_and_cache.default, (qkv, kc, vc, x["slots"]) + heads)
    torch.library.opcheck(ops.qkv_rope_and_cache_.default,
                          (qkv.clone(), kc, vc, x["slots"]) + heads)


@pytest.fixture
def fp8_opcheck(monkeypatch):
    """opcheck without its test_schema, whose mutation check compares tensors
    with torch.allclose, which FP8 tensors do not support (the schemas are
    checked on the other dtypes)."""
    full = torch.library.opcheck
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    monkeypatch.setattr(torch.library, "opcheck",
                        lambda op, args: full(op, args, test_utils=utils))


def test_opcheck_cpu():
    opcheck_all("cpu")


def test_opcheck_cpu_fp8(fp8_opcheck):
    opcheck_all("cpu", torch.float8_e4m3fn)


@pytest.mark.parametrize("q_dtype", [None, torch.float8_e4m3fn])
def test_fake_outputs_have_the_real_shapes_and_dtypes(q_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = inputs()
    kc, vc = caches()
    scale = {} if q_dtype is None else {"q_scale": 0.5}
    real = crt.rope_and_cache(x["q"], x["k"], x["v"], kc, vc, x["slots"], inv_freq=x["inv_freq"],
                              positions=x["positions"], q_dtype=q_dtype, **scale)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = {n: mode.from_tensor(a) for n, a in x.items()}
        fk, fv = (mode.from_tensor(c) for c in caches())
        out = crt.rope_and_cache(fx["q"], fx["k"], fx["v"], fk, fv, fx["slots"],
                                 inv_freq=fx["inv_freq"], positions=fx["positions"],
                                 q_dtype=q_dtype, **scale)
        qkv = mode.from_tensor(packed(x))
        q_flat = crt.qkv_rope_and_cache(qkv, fk, fv, fx["slots"], inv_freq=fx["inv_freq"],
                                        positions=fx["positions"], num_q_heads=HQ,
                                        num_kv_heads=HK, q_dtype=q_dtype, **scale)
        q_heads = crt.qkv_rope_and_cache(qkv.view(T, HQ + 2 * HK, D), fk, fv, fx["slots"],
                                         inv_freq=fx["inv_freq"], positions=fx["positions"],
                                         num_q_heads=HQ, num_kv_heads=HK, q_dtype=q_dtype,
                                         **scale)
    want_dtype = q_dtype or torch.float32
    assert (out.shape, out.dtype) == (x["q"].shape, want_dtype)
    assert (q_flat.shape, q_flat.dtype) == ((T, HQ, D), want_dtype)
    assert (q_heads.shape, q_heads.dtype) == ((T, HQ, D), want_dtype)
    assert (real.shape, real.dtype) == (out.shape, out.dtype)


# --------------------------------------------------- CPU: the NumPy path --
CPU_CASES = [("NHD", False, False), ("HND", False, False), ("NHD", True, False),
             ("HND", False, True), ("NHD", True, True)]


@pytest.mark.parametrize("layout,inplace,qkv", CPU_CASES,
                         ids=[f"{lay}-{'inplace' if i else 'new'}-{'qkv' if p else 'qkv3'}"
                              for lay, i, p in CPU_CASES])
def test_cpu_equals_the_array_api(layout, inplace, qkv):
    """The ops' results, caches included, bit for bit those of
    cupy_rope.kv_cache's functions on the same CPU tensors; padding and
    unassigned slots keep their poison."""
    x = inputs()
    kw = dict(inv_freq=x["inv_freq"], positions=x["positions"], cache_layout=layout,
              inplace=inplace)
    got_c, want_c = caches(layout), caches(layout)
    if qkv:
        p_got, p_want = packed(x), packed(x)
        heads = dict(num_q_heads=HQ, num_kv_heads=HK)
        got = crt.qkv_rope_and_cache(p_got, *got_c, x["slots"], **heads, **kw)
        want = kv_cache.apply_qkv_rope_and_cache(p_want, *want_c, x["slots"], **heads, **kw)
        assert torch.equal(bits(p_got), bits(p_want))
        if inplace:
            assert got.data_ptr() == p_got.data_ptr()
    else:
        q_got, q_want = x["q"].clone(), x["q"].clone()
        got = crt.rope_and_cache(q_got, x["k"], x["v"], *got_c, x["slots"], **kw)
        want = kv_cache.apply_rope_and_cache(q_want, x["k"], x["v"], *want_c, x["slots"], **kw)
        assert (got is q_got) == inplace
        assert torch.equal(bits(q_got), bits(q_want))
    assert torch.equal(bits(got), bits(want))
    live = x["slots"][x["slots"] >= 0]
    for g, w in zip(got_c, want_c):
        assert torch.equal(bits(g), bits(w))
        rows = per_slot(g, layout)
        written = (rows != per_slot(caches(layout)[0], layout)).any(dim=1).nonzero().flatten()
        assert sorted(written.tolist()) == sorted(live.tolist())


@pytest.mark.parametrize("fmt", list(FP8))
def test_cpu_fp8_cache_and_q(fmt):
    """FP8 caches and q: torch's own conversion of x / scale, clamped to the
    format's finite range; scales as floats and as 1-element tensors."""
    x = inputs()
    dt, limit = FP8[fmt], kv_cache.FP8_FORMATS[fmt][1]
    kc, vc = caches(dtype=dt)
    q8 = crt.rope_and_cache(x["q"], x["k"], x["v"], kc, vc, x["slots"], inv_freq=x["inv_freq"],
                            positions=x["positions"], k_scale=0.5,
                            v_scale=torch.tensor([0.25]), q_dtype=dt, q_scale=0.125)
    q_rot, k_rot = crt.rope_qk(x["q"][None], x["k"][None], inv_freq=x["inv_freq"],
                               positions=x["positions"][None])

    def fp8(y, scale):
        return bits((y / scale).clamp(-limit, limit).to(dt))

    assert torch.equal(bits(q8), fp8(q_rot[0], 0.125))
    live = (x["slots"] >= 0).nonzero().flatten()
    slots = x["slots"][live]
    assert torch.equal(per_slot(kc, "NHD")[slots], fp8(k_rot[0][live], 0.5).flatten(1))
    assert torch.equal(per_slot(vc, "NHD")[slots], fp8(x["v"][live], 0.25).flatten(1))


BAD = [
    ("k_scale bool", dict(k_scale=True), TypeError, "k_scale: expected a float or a 1-element"),
    ("v_scale str", dict(v_scale="1"), TypeError, "v_scale: expected a float or a 1-element"),
    ("q_dtype str", dict(q_dtype="float8_e4m3fn"), TypeError, "q_dtype: expected a torch.dtype"),
    ("cache_layout int", dict(cache_layout=1), TypeError, "cache_layout: expected a str"),
    ("cache_dtype int", dict(cache_dtype=8), TypeError, "cache_dtype: expected a str"),
    ("cache_layout name", dict(cache_layout="NDH"), ValueError, "cache_layout: expected 'NHD'"),
    ("scale not fp8", dict(k_scale=0.5), ValueError, "k_scale: only for an FP8 cache"),
    ("inplace str", dict(inplace="yes"), TypeError, "inplace: expected a bool"),
    ("q_dtype in place", dict(q_dtype=torch.float8_e4m3fn, q_scale=1.0), ValueError,
     "q_dtype: only for a new q"),
    ("offsets float", dict(offsets=1.5), TypeError, "offsets: expected an int"),
    ("slot out of range", dict(slots=[0, 1, 2, 3, 4, BLOCKS * BLOCK_SIZE]), ValueError,
     "slot_mapping: slot 32 is out of range"),
    ("slot repeated", dict(slots=[0, 1, 2, 3, 4, 4]), ValueError,
     "slot_mapping: slot 4 is given to more than one token"),
    ("slots float", dict(slots=[0.0, 1, 2, 3, 4, 5]), TypeError, "slot_mapping"),
]


@pytest.mark.parametrize("kw,exc,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fn", ["rope_and_cache", "qkv_rope_and_cache"])
def test_bad_arguments_refused_before_anything_is_written(fn, kw, exc, text):
    x = inputs()
    kw = dict(kw)
    slots = torch.tensor(kw.pop("slots")) if "slots" in kw else x["slots"]
    kc, vc = caches()
    q, qkv = x["q"].clone(), packed(x)
    before = [bits(a).clone() for a in (kc, vc, q, qkv)]
    with pytest.raises(exc, match=re.escape(text)):
        if fn == "rope_and_cache":
            crt.rope_and_cache(q, x["k"], x["v"], kc, vc, slots, inv_freq=x["inv_freq"],
                               positions=x["positions"], **{"inplace": True, **kw})
        else:
            crt.qkv_rope_and_cache(qkv, kc, vc, slots, inv_freq=x["inv_freq"],
                                   positions=x["positions"], num_q_heads=HQ, num_kv_heads=HK,
                                   **{"inplace": True, **kw})
    for b, a in zip(before, (kc, vc, q, qkv)):
        assert torch.equal(b, bits(a))


def test_no_gradient_is_given():
    """An inference op: asking for a gradient through it is an error, not a silent zero."""
    x = inputs()
    q = x["q"].clone().requires_grad_(True)
    kc, vc = caches(fill=0.0)
    with pytest.raises(RuntimeError, match="(?i)autograd"):
        out = crt.rope_and_cache(q, x["k"], x["v"], kc, vc, x["slots"], inv_freq=x["inv_freq"],
                                 positions=x["positions"])
        out.sum().backward()


def decode_block(hq=HQ, hk=HK, inplace=False, packed_qkv=False):
    """A decode step's prologue as a function of (hidden, positions, slots, caches):
    a projection, the fused op, then a use of q (what attention would read)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn((hq + 2 * hk) * D, 32, generator=g) * 0.2
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()

    def step(h, positions, slots, k_cache, v_cache):
        qkv = h @ w.to(h.device, h.dtype).T
        kw = dict(inv_freq=inv.to(h.device), positions=positions)
        if packed_qkv:
            q = crt.qkv_rope_and_cache(qkv, k_cache, v_cache, slots, num_q_heads=hq,
                                       num_kv_heads=hk, inplace=inplace, **kw)
        else:
            q, k, v = qkv.view(-1, hq + 2 * hk, D).split([hq, hk, hk], dim=1)
            q = crt.rope_and_cache(q.contiguous(), k, v, k_cache, v_cache, slots,
                                   inplace=inplace, **kw)
        return q.float() * 2

    return step


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("packed_qkv", [False, True], ids=["qkv3", "qkv"])
def test_compile_fullgraph_traces_the_ops_cpu(inplace, packed_qkv):
    """torch.compile(fullgraph=True) (aot_eager: functionalization of the
    mutated caches and q, no code generation) gives what eager gives."""
    torch._dynamo.reset()
    step = decode_block(inplace=inplace, packed_qkv=packed_qkv)
    x = inputs()
    h = torch.randn(T, 32, generator=torch.Generator().manual_seed(3))
    eager_c, comp_c = caches(fill=0.0), caches(fill=0.0)
    want = step(h, x["positions"], x["slots"], *eager_c)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, x["positions"], x["slots"], *comp_c)
    assert torch.equal(got, want)
    for g, w in zip(comp_c, eager_c):
        assert torch.equal(g, w)


# ------------------------------------------------------------------- GPU --
DEV = "cuda"
GPU_CASES = [(lay, dt, i) for lay in ("NHD", "HND")
             for dt in ("bfloat16", "float8_e4m3fn", "float8_e5m2") for i in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,cache_dtype,inplace", GPU_CASES,
                         ids=[f"{a}-{b}-{'inplace' if c else 'new'}" for a, b, c in GPU_CASES])
@pytest.mark.parametrize("packed_qkv", [False, True], ids=["qkv3", "qkv"])
def test_gpu_op_equals_the_array_api(layout, cache_dtype, inplace, packed_qkv):
    x = inputs(DEV, torch.bfloat16, t=37)
    x["slots"] = _slots(37, DEV)
    dt = FP8.get(cache_dtype, torch.bfloat16)
    scales = {} if dt is torch.bfloat16 else {"k_scale": 0.05,
                                             "v_scale": torch.tensor([0.03], device=DEV)}
    kw = dict(inv_freq=x["inv_freq"], positions=x["positions"], cache_layout=layout,
              inplace=inplace, **scales)
    got_c, want_c = _big_caches(layout, dt), _big_caches(layout, dt)
    if packed_qkv:
        p_got, p_want = packed(x), packed(x)
        heads = dict(num_q_heads=HQ, num_kv_heads=HK)
        got = crt.qkv_rope_and_cache(p_got, *got_c, x["slots"], **heads, **kw)
        want = kv_cache.apply_qkv_rope_and_cache(p_want, *want_c, x["slots"], **heads, **kw)
        assert torch.equal(bits(p_got), bits(p_want))
    else:
        q_got, q_want = x["q"].clone(), x["q"].clone()
        got = crt.rope_and_cache(q_got, x["k"], x["v"], *got_c, x["slots"], **kw)
        want = kv_cache.apply_rope_and_cache(q_want, x["k"], x["v"], *want_c, x["slots"], **kw)
        assert torch.equal(bits(q_got), bits(q_want))
    assert torch.equal(bits(got), bits(want))
    for g, w in zip(got_c, want_c):
        assert torch.equal(bits(g), bits(w))


GPU_BLOCKS = 64


def _slots(t, device):
    """Distinct slots of a 64-block cache, every 5th token padding."""
    s = torch.randperm(GPU_BLOCKS * BLOCK_SIZE)[:t]
    s[::5] = -1
    return s.to(device)


def _big_caches(layout, dt):
    return caches(layout, dt, DEV, blocks=GPU_BLOCKS)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("packed_qkv", [False, True], ids=["qkv3", "qkv"])
def test_gpu_compile_fullgraph_equals_eager(inplace, packed_qkv):
    torch._dynamo.reset()
    step = decode_block(inplace=inplace, packed_qkv=packed_qkv)
    x = inputs(DEV, torch.bfloat16)
    h = torch.randn(T, 32, device=DEV, dtype=torch.bfloat16)
    eager_c = caches(dtype=torch.bfloat16, device=DEV, fill=0.0)
    comp_c = caches(dtype=torch.bfloat16, device=DEV, fill=0.0)
    want = step(h, x["positions"], x["slots"], *eager_c)
    compiled = torch.compile(step, fullgraph=True)  # inductor; raises on a graph break
    for _ in range(2):  # the second call reuses the compiled graph
        got = compiled(h, x["positions"], x["slots"], *comp_c)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for g, w in zip(comp_c, eager_c):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
        assert torch.equal(g == 0, w == 0)  # the same slots written, no others


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("packed_qkv", [False, True], ids=["qkv3", "qkv"])
def test_gpu_cuda_graph_replay_equals_eager(cache_dtype, packed_qkv):
    """A decode step of 8 rows (3 of them padding, slot -1) captured once;
    each replay with fresh hidden states, positions and slots copied in
    leaves the caches bit-identical to eager calls on the same inputs, and
    the padding rows write nothing."""
    dt = FP8.get(cache_dtype, torch.bfloat16)
    scales = {} if dt is torch.bfloat16 else {
        "k_scale": torch.tensor([0.05], device=DEV), "v_scale": torch.tensor([0.03],
                                                                            device=DEV)}
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float().to(DEV)
    w = torch.randn((HQ + 2 * HK) * D, 32, device=DEV, dtype=torch.bfloat16) * 0.2

    def step(h, positions, slots, k_cache, v_cache):
        qkv = h @ w.T
        kw = dict(inv_freq=inv, positions=positions, **scales)
        if packed_qkv:
            return crt.qkv_rope_and_cache(qkv, k_cache, v_cache, slots, num_q_heads=HQ,
                                          num_kv_heads=HK, **kw)
        q, k, v = qkv.view(-1, HQ + 2 * HK, D).split([HQ, HK, HK], dim=1)
        return crt.rope_and_cache(q, k, v, k_cache, v_cache, slots, **kw)

    rows = 8
    static = dict(h=torch.zeros(rows, 32, device=DEV, dtype=torch.bfloat16),
                  positions=torch.zeros(rows, dtype=torch.int64, device=DEV),
                  slots=torch.full((rows,), -1, dtype=torch.int64, device=DEV))
    graph_c, eager_c = _big_caches("NHD", dt), _big_caches("NHD", dt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels before capturing; all padding
        step(static["h"], static["positions"], static["slots"], *graph_c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_static = step(static["h"], static["positions"], static["slots"], *graph_c)
    for i in range(3):
        h = torch.randn(rows, 32, device=DEV, dtype=torch.bfloat16)
        pos = torch.randint(0, 1000, (rows,), device=DEV)
        slots = torch.randperm(GPU_BLOCKS * BLOCK_SIZE, device=DEV)[:rows]
        slots[[1, 4, 7]] = -1
        before = [per_slot(c, "NHD").clone() for c in graph_c]
        for name, value in (("h", h), ("positions", pos), ("slots", slots)):
            static[name].copy_(value)
        graph.replay()
        q_eager = step(h, pos, slots, *eager_c)
        assert torch.equal(bits(q_static), bits(q_eager)), f"replay {i}: q"
        live = slots[slots >= 0]
        for c, e, b in zip(graph_c, eager_c, before):
            assert torch.equal(bits(c), bits(e)), f"replay {i}: cache"
            changed = (per_slot(c, "NHD") != b).any(dim=1).nonzero().flatten()
            assert set(changed.tolist()) <= set(live.tolist()), f"replay {i}: padding wrote"


@pytest.mark.gpu
def test_gpu_opcheck():
    opcheck_all(DEV, torch.bfloat16, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_opcheck_fp8(fp8_opcheck):
    opcheck_all(DEV, torch.float8_e4m3fn, torch.bfloat16)
