"""cupy_rope.torch: autograd, torch.compile, CUDA graphs and streams (GPU).

Forward values and gradients are compared against a float64 torch
reference written with plain tensor ops (x * cos + rotate_half(x) * sin),
whose gradients come from torch's own autograd: an independent check of the
registered backward (the same kernel rotating by -theta).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_rope  # noqa: E402
from helpers import assert_close  # noqa: E402

crt = pytest.importorskip("cupy_rope.torch")

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------- reference --
def ref_positions(tokens_shape, layout, positions=None, offsets=None, cu_seqlens=None):
    """int64 positions shaped like the token axes of x."""
    if layout == "thd":
        (T,) = tokens_shape
        if positions is not None:
            pos = positions.long().cpu()
        elif cu_seqlens is not None:
            cu = cu_seqlens.long().cpu()
            pos = torch.cat([torch.arange(int(cu[i + 1] - cu[i])) for i in range(len(cu) - 1)])
        else:
            pos = torch.arange(T)
        if offsets is not None:
            if isinstance(offsets, int):
                pos = pos + offsets
            else:
                cu = cu_seqlens.long().cpu()
                lens = (cu[1:] - cu[:-1])
                pos = pos + torch.repeat_interleave(offsets.long().cpu(), lens)
        return pos
    b, s = tokens_shape if layout == "bshd" else tokens_shape[::-1]
    pos = torch.arange(s) if positions is None else positions.long().cpu()
    pos = pos.expand(b, s)
    if offsets is not None:
        pos = pos + (offsets if isinstance(offsets, int) else offsets.long().cpu()[:, None])
    return pos if layout == "bshd" else pos.T


def ref_rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None, offsets=None,
             layout="bshd", cu_seqlens=None, interleaved=False, rotary_dim=None, head_dim=None,
             backward=False):
    """float64 reference on the CPU, differentiable in x (autograd gives the gradient)."""
    x = x.double().cpu()
    shape = x.shape
    token_ndim = 1 if layout == "thd" else 2
    if head_dim is not None and x.dim() == token_ndim + 1:
        x = x.reshape(*shape[:-1], shape[-1] // head_dim, head_dim)
    pos = ref_positions(tuple(x.shape[:token_ndim]), layout, positions, offsets, cu_seqlens)
    if inv_freq is not None:
        theta = pos[..., None].double() * inv_freq.double().cpu()
        c, s = theta.cos(), theta.sin()
    elif freqs is not None:
        theta = freqs.double().cpu()[pos]
        c, s = theta.cos(), theta.sin()
    else:
        c, s = cos.double().cpu()[pos], sin.double().cpu()[pos]
    c, s = c[..., None, :], s[..., None, :]
    if backward:
        s = -s
    r = 2 * c.shape[-1] if rotary_dim is None else rotary_dim
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = x[..., :r // 2], x[..., r // 2:r]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, x[..., r:]], dim=-1).reshape(shape)


def ref_split_qkv(qkv, hq, hk, packing, token_ndim=2, head_dim=None):
    tokens = qkv.shape[:token_ndim]
    d = qkv.shape[-1] if qkv.dim() == token_ndim + 2 else (
        head_dim or qkv.shape[-1] // (hq + 2 * hk))
    heads = qkv.reshape(*tokens, hq + 2 * hk, d)
    if packing == "concat":
        return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
    g = hq // hk
    groups = heads.reshape(*tokens, hk, g + 2, d)
    return groups[..., :g, :].reshape(*tokens, hq, d), groups[..., g, :], groups[..., g + 1, :]


def tables(d, rows=64, dtype=torch.float32, rotary_dim=None):
    r = rotary_dim or d
    inv_freq = 1.0 / 10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    theta = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq
    return {"cos": theta.cos().to(DEV, dtype), "sin": theta.sin().to(DEV, dtype),
            "inv_freq": inv_freq.to(DEV, torch.float32),
            "freqs": theta.to(DEV, torch.float32)}


def angle_kwargs(source, t):
    if source == "table":
        return {"cos": t["cos"], "sin": t["sin"]}
    return {source: t[source]}


def randn(shape, dtype, requires_grad=True):
    return torch.randn(shape, device=DEV).to(DTYPES[dtype]).requires_grad_(requires_grad)


def grads_vs_ref(fn, ref_fn, inputs, dtype, what):
    """Forward outputs and autograd gradients of ``fn`` against ``ref_fn`` (float64)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cots = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, inputs, cots)
    ref_in = [i.detach().double().cpu().requires_grad_() for i in inputs]
    ref_outs = ref_fn(*ref_in)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    ref_grads = torch.autograd.grad(ref_outs, ref_in, [c.double().cpu() for c in cots])
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == inputs[0].dtype and o.device == inputs[0].device
        assert_close(o.detach().float().cpu().numpy(), r.detach().numpy(), dtype, f"{what} out{i}")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == inputs[i].shape
        assert_close(g.float().cpu().numpy(), r.numpy(), dtype, f"{what} grad{i}")


# ------------------------------------------------------------ autograd ----
def test_import_cupy_rope_does_not_import_torch_or_jax():
    code = "import sys, cupy_rope; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("source", ["table", "inv_freq", "freqs"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_values_and_gradients(dtype, source, interleaved):
    t = tables(64)
    kw = dict(angle_kwargs(source, t), interleaved=interleaved)
    x = randn((2, 16, 4, 64), dtype)
    grads_vs_ref(lambda x: crt.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], dtype,
                 f"rope {source}")


def test_rope_views_positions_offsets_rotary_dim():
    """sbhd view of a bhsd-like tensor, [b, s] positions, per-batch offsets, r < d."""
    t = tables(64, rotary_dim=32)
    base = randn((3, 4, 16, 64), "float32", requires_grad=False)  # [b, h, s, d]
    xs = base.permute(2, 0, 1, 3).detach().requires_grad_()  # [s, b, h, d] view
    pos = torch.randint(0, 40, (3, 16), device=DEV, dtype=torch.int32)
    off = torch.tensor([0, 5, 11], device=DEV)
    kw = dict(cos=t["cos"], sin=t["sin"], positions=pos, offsets=off, layout="sbhd",
              rotary_dim=32)
    grads_vs_ref(lambda x: crt.rope(x, **kw), lambda x: ref_rope(x, **kw), [xs], "float32",
                 "rope sbhd")
    # a Python int offset and backward=True (the op is its own transpose)
    kw = dict(inv_freq=t["inv_freq"], offsets=7, backward=True)
    x = randn((2, 8, 2, 64), "float32")
    grads_vs_ref(lambda x: crt.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
                 "rope backward=True")


def test_double_backward():
    """The backward is differentiable: its gradient is the forward rotation."""
    t = tables(64)
    x = randn((2, 8, 2, 64), "float32")
    y = crt.rope(x, t["cos"], t["sin"])
    c = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, c, create_graph=True)
    w = torch.randn_like(gx)
    (gc,) = torch.autograd.grad(gx, c, w)
    assert_close(gc.cpu().numpy(), ref_rope(w, t["cos"], t["sin"]).numpy(), "float32", "ggrad")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_qk_gqa(dtype):
    t = tables(128)
    kw = dict(cos=t["cos"], sin=t["sin"], offsets=torch.tensor([3, 0], device=DEV))
    q = randn((2, 32, 8, 128), dtype)
    k = randn((2, 32, 2, 128), dtype)
    grads_vs_ref(lambda q, k: crt.rope_qk(q, k, **kw),
                 lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], dtype, "rope_qk")


def test_rope_thd_cu_seqlens():
    t = tables(64)
    cu = torch.tensor([0, 5, 12, 30], device=DEV, dtype=torch.int32)
    kw = dict(inv_freq=t["inv_freq"], layout="thd", cu_seqlens=cu)
    x = randn((30, 4, 64), "float32")
    grads_vs_ref(lambda x: crt.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "float32",
                 "rope thd")
    # flattened [T, h * d] with head_dim=, per-sequence offsets
    kw = dict(cos=t["cos"], sin=t["sin"], layout="thd", cu_seqlens=cu, head_dim=64,
              offsets=torch.tensor([1, 2, 3], device=DEV))
    x = randn((30, 4 * 64), "bfloat16")
    grads_vs_ref(lambda x: crt.rope(x, **kw), lambda x: ref_rope(x, **kw), [x], "bfloat16",
                 "rope thd flat")
    q, k = randn((30, 4, 64), "float32"), randn((30, 1, 64), "float32")
    kw = dict(freqs=t["freqs"], layout="thd", cu_seqlens=cu)
    grads_vs_ref(lambda q, k: crt.rope_qk(q, k, **kw),
                 lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "float32",
                 "rope_qk thd")


@pytest.mark.parametrize("packing", ["concat", "grouped"])
@pytest.mark.parametrize("flat", [True, False])
def test_rope_qkv(packing, flat):
    hq, hk, d = 8, 2, 64
    t = tables(d)
    shape = (2, 16, (hq + 2 * hk) * d) if flat else (2, 16, hq + 2 * hk, d)
    qkv = randn(shape, "bfloat16")
    kw = dict(cos=t["cos"], sin=t["sin"])

    def ref(qkv):
        q, k, v = ref_split_qkv(qkv, hq, hk, packing)
        return ref_rope(q, **kw), ref_rope(k, **kw), v

    grads_vs_ref(lambda qkv: crt.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk,
                                          packing=packing, **kw),
                 ref, [qkv], "bfloat16", f"rope_qkv {packing}")


def test_rope_qkv_thd_and_double_backward():
    hq, hk, d = 4, 4, 64
    t = tables(d)
    cu = torch.tensor([0, 7, 20], device=DEV, dtype=torch.int32)
    kw = dict(inv_freq=t["inv_freq"], layout="thd", cu_seqlens=cu)
    qkv = randn((20, (hq + 2 * hk) * d), "float32")

    def ref(qkv):
        q, k, v = ref_split_qkv(qkv, hq, hk, "concat", token_ndim=1)
        return ref_rope(q, **kw), ref_rope(k, **kw), v

    grads_vs_ref(lambda qkv: crt.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk, **kw),
                 ref, [qkv], "float32", "rope_qkv thd")
    # the backward op is differentiable too (its gradient is the forward op)
    q, k, v = crt.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk, **kw)
    gq, gk, gv = (torch.randn_like(a, requires_grad=True) for a in (q, k, v))
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, (gq, gk, gv), create_graph=True)
    w = torch.randn_like(dqkv)
    grads = torch.autograd.grad(dqkv, (gq, gk, gv), w)
    ref_grads = ref(w.detach().cpu())
    for g, r in zip(grads, ref_grads):
        assert_close(g.cpu().numpy(), r.detach().numpy(), "float32", "qkv double backward")


# -------------------------------------------------------------- in place ----
def test_inplace_without_grad_is_zero_copy():
    t = tables(64)
    base = randn((2, 4, 16, 64), "bfloat16", requires_grad=False)  # bhsd
    x0 = base.clone()
    view = base.transpose(1, 2)  # bshd view
    assert crt.rope_(view, t["cos"], t["sin"]) is view
    ref = ref_rope(x0.transpose(1, 2), t["cos"], t["sin"])
    assert_close(base.transpose(1, 2).float().cpu().numpy(), ref.numpy(), "bfloat16", "rope_")
    q = randn((2, 16, 4, 64), "float32", requires_grad=False)
    k = randn((2, 16, 2, 64), "float32", requires_grad=False)
    q0, k0, qp = q.clone(), k.clone(), q.data_ptr()
    rq, rk = crt.rope_qk_(q, k, inv_freq=t["inv_freq"])
    assert rq is q and rk is k and q.data_ptr() == qp
    assert_close(q.cpu().numpy(), ref_rope(q0, inv_freq=t["inv_freq"]).numpy(), "float32")
    assert_close(k.cpu().numpy(), ref_rope(k0, inv_freq=t["inv_freq"]).numpy(), "float32")


def test_inplace_with_grad():
    t = tables(64, rotary_dim=32)
    w = randn((2, 8, 2, 64), "float32")
    kw = dict(cos=t["cos"], sin=t["sin"], rotary_dim=32)

    def ours(w):
        x = w * 2.0  # non-leaf, so it can be modified in place under autograd
        return crt.rope_(x, **kw)

    grads_vs_ref(ours, lambda w: ref_rope(w * 2.0, **kw), [w], "float32", "rope_ with grad")
    # the mutating op itself (no grad recorded) under torch.inference_mode
    with torch.inference_mode():
        x = w.detach().clone()
        crt.rope_(x, **kw)
    assert_close(x.cpu().numpy(), ref_rope(w.detach(), **kw).numpy(), "float32")


def test_opcheck():
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    t = tables(64)
    x = torch.randn(2, 8, 2, 64, device=DEV)
    # cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, offset,
    # layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, backward
    args = (t["cos"], t["sin"], None, None, None, None, None, None, 0, "bshd", False, None,
            None, 1, 0, False)
    torch.library.opcheck(torch.ops.cupy_rope.rope.default, (x,) + args)
    torch.library.opcheck(torch.ops.cupy_rope.rope_.default, (x.clone(),) + args)
    k = torch.randn(2, 8, 1, 64, device=DEV)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qk.default, (x, k) + args)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qk_.default, (x.clone(), k.clone()) + args)
    qkv = torch.randn(2, 8, 6 * 64, device=DEV)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qkv.default,
                          (qkv,) + args[:-1] + (2, 2, "concat"))


# ------------------------------------------------------- torch.compile ----
class Attention(torch.nn.Module):
    """A small GQA attention block using the ops: qkv projection, RoPE, SDPA, output."""

    def __init__(self, dim=256, hq=4, hk=2, d=64, mode="qk"):
        super().__init__()
        self.hq, self.hk, self.d, self.mode = hq, hk, d, mode
        self.qkv = torch.nn.Linear(dim, (hq + 2 * hk) * d, bias=False)
        self.out = torch.nn.Linear(hq * d, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        hq, hk, d = self.hq, self.hk, self.d
        packed = self.qkv(x)
        if self.mode == "qkv":
            q, k, v = crt.rope_qkv(packed, cos, sin, num_q_heads=hq, num_kv_heads=hk)
        else:
            q, k, v = packed.view(b, s, hq + 2 * hk, d).split([hq, hk, hk], dim=2)
            if self.mode == "qk":
                q, k = crt.rope_qk(q, k, cos, sin)
            elif self.mode == "rope":
                q, k = crt.rope(q, cos, sin), crt.rope(k, cos, sin)
            else:  # "inplace": rotate copies in place
                q, k = q.contiguous(), k.contiguous()
                crt.rope_(q, cos, sin)
                crt.rope_(k, cos, sin)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, hq * d))


@pytest.mark.parametrize("mode", ["rope", "inplace", "qk", "qkv"])
def test_compile_fullgraph_matches_eager(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Attention(mode=mode).to(DEV)
    t = tables(64, rows=128)
    x = torch.randn(2, 32, 256, device=DEV, requires_grad=True)
    y_eager = block(x, t["cos"], t["sin"])
    g = torch.randn_like(y_eager)
    grads_eager = torch.autograd.grad(y_eager, [x] + list(block.parameters()), g)
    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    y = compiled(x, t["cos"], t["sin"])
    grads = torch.autograd.grad(y, [x] + list(block.parameters()), g)
    close(y, y_eager)
    for a, b in zip(grads, grads_eager):
        close(a, b)
    with torch.no_grad():  # inference graph too (the in-place op is functionalized)
        close(compiled(x, t["cos"], t["sin"]), y_eager)


def close(a, b):
    """Compiled vs eager: the same kernels, up to fusion and reduction order elsewhere."""
    b = b.detach().cpu().numpy()
    np.testing.assert_allclose(a.detach().cpu().numpy(), b, rtol=1e-4,
                               atol=1e-4 * np.abs(b).max())


# --------------------------------------------------------- CUDA graphs ----
def test_cuda_graph_capture_and_replay():
    t = tables(64, rows=128)
    static_x = torch.zeros(2, 16, 4, 64, device=DEV, requires_grad=True)
    static_g = torch.zeros(2, 16, 4, 64, device=DEV)
    static_pos = torch.zeros(2, 16, device=DEV, dtype=torch.int64)
    kw = dict(cos=t["cos"], sin=t["sin"], positions=static_pos)

    def step():
        y = crt.rope(static_x, **kw)
        (gx,) = torch.autograd.grad(y, static_x, static_g)
        return y.detach(), gx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compiles the kernels before capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, gx_static = step()
    for _ in range(3):
        x = torch.randn(2, 16, 4, 64)
        g = torch.randn(2, 16, 4, 64)
        pos = torch.randint(0, 128, (2, 16))
        with torch.no_grad():
            static_x.copy_(x)
        static_g.copy_(g)
        static_pos.copy_(pos)
        graph.replay()
        ref_kw = dict(cos=t["cos"], sin=t["sin"], positions=pos)
        assert_close(y_static.cpu().numpy(), ref_rope(x, **ref_kw).numpy(), "float32", "replay y")
        assert_close(gx_static.cpu().numpy(), ref_rope(g, backward=True, **ref_kw).numpy(),
                     "float32", "replay grad")


def test_cuda_graph_of_compiled_block():
    """torch.compile(mode="reduce-overhead") captures the ops in CUDA graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Attention(mode="rope").to(DEV).eval()
    t = tables(64, rows=128)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 32, 256, device=DEV)
            out = compiled(x, t["cos"], t["sin"]).clone()
            assert_close(out.cpu().numpy(), block(x, t["cos"], t["sin"]).cpu().numpy(),
                         "float32", "reduce-overhead")


# -------------------------------------------------------------- streams ----
def test_runs_on_the_current_stream_forward_and_backward():
    t = tables(64)
    x_host = torch.randn(4, 256, 8, 64)
    g_host = torch.randn(4, 256, 8, 64)
    src, g_src = x_host.to(DEV), g_host.to(DEV)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        slow = torch.randn(4096, 4096, device=DEV)
        for _ in range(20):  # keeps `side` busy for a while
            slow = torch.tanh(slow @ slow)
        x = (src + slow[0, 0] * 0).requires_grad_()  # ready only after the slow chain
        y = crt.rope(x, inv_freq=t["inv_freq"])
        (gx,) = torch.autograd.grad(y, x, g_src + slow[1, 1] * 0)
        y_done, gx_done = y.detach().clone(), gx.clone()
    side.synchronize()
    assert_close(y_done.cpu().numpy(), ref_rope(x_host, inv_freq=t["inv_freq"]).numpy(),
                 "float32", "side stream y")
    assert_close(gx_done.cpu().numpy(),
                 ref_rope(g_host, inv_freq=t["inv_freq"], backward=True).numpy(),
                 "float32", "side stream grad")


# ----------------------------------------------- M-RoPE / axial RoPE ----
# scheme: (sections, interleaved pairs, sections_interleaved); head_dim 64.
MROPE = {"mrope": ((8, 12, 12), False, False),            # Qwen2-VL
         "mrope_interleaved": ((12, 10, 10), False, True),  # Qwen3-VL
         "axial2d": ((16, 16), True, False)}               # Flux-like, GPT-J pairs


def mrope_kwargs(scheme, tokens, source="inv_freq", d=64, rows=256):
    """Angle and per-axis position arguments (device tensors) for ``scheme``."""
    sections, interleaved, sec_inter = MROPE[scheme]
    # each axis its own frequencies (axial RoPE); for M-RoPE one ladder over r/2
    inv = (torch.cat([1.0 / 10000 ** (torch.arange(n, dtype=torch.float64) / n)
                      for n in sections]) if interleaved else
           1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.randint(0, rows, (len(sections),) + tuple(tokens), device=DEV)
    kw = dict(positions=pos, sections=sections, sections_interleaved=sec_inter,
              interleaved=interleaved)
    if source == "inv_freq":
        kw["inv_freq"] = inv.to(DEV, torch.float32)
    else:
        theta = torch.arange(rows, dtype=torch.float64)[:, None] * inv
        kw["cos"] = theta.cos().to(DEV, torch.float32)
        kw["sin"] = theta.sin().to(DEV, torch.float32)
    return kw


def np64(t):
    """float64 (floats) / int64 (ints) NumPy copy of a tensor: the library's reference path."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu()
    return (t.double() if t.is_floating_point() else t.long()).numpy()


def np_kwargs(kw):
    return {n: np64(v) for n, v in kw.items()}


def vs_numpy(fn, fwd_ref, bwd_ref, inputs, dtype, what):
    """Outputs and autograd gradients of ``fn`` against the library's float64 NumPy
    reference: ``fwd_ref(*inputs)`` and ``bwd_ref(*cotangents)`` (the op is linear)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cots = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, inputs, cots)
    ref_outs = fwd_ref(*[np64(i) for i in inputs])
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    ref_grads = bwd_ref(*[np64(c) for c in cots])
    ref_grads = ref_grads if isinstance(ref_grads, tuple) else (ref_grads,)
    assert len(ref_outs) == len(outs) and len(ref_grads) == len(grads)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == inputs[0].dtype and o.device == inputs[0].device
        assert_close(o.detach().float().cpu().numpy(), r, dtype, f"{what} out{i}")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == inputs[i].shape
        assert_close(g.float().cpu().numpy(), np.reshape(r, g.shape), dtype, f"{what} grad{i}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", list(MROPE))
def test_mrope_rope_and_rope_qk(dtype, scheme):
    """Per-axis positions [axes, b, s]: rope and rope_qk (GQA), values and gradients."""
    kw = mrope_kwargs(scheme, (2, 12), source="table" if scheme == "mrope" else "inv_freq")
    hk = np_kwargs(kw)
    x = randn((2, 12, 4, 64), dtype)
    vs_numpy(lambda x: crt.rope(x, **kw),
             lambda x: cupy_rope.apply_rope(x, **hk),
             lambda g: cupy_rope.apply_rope(g, backward=True, **hk), [x], dtype,
             f"rope {scheme}")
    q, k = randn((2, 12, 4, 64), dtype), randn((2, 12, 2, 64), dtype)
    vs_numpy(lambda q, k: crt.rope_qk(q, k, **kw),
             lambda q, k: cupy_rope.apply_rope_qk(q, k, **hk),
             lambda gq, gk: cupy_rope.apply_rope_qk(gq, gk, backward=True, **hk), [q, k], dtype,
             f"rope_qk {scheme}")


def test_mrope_thd_inplace_and_shared_positions():
    """thd with positions [axes, t]; bshd with positions [axes, s] shared by the batch;
    the in-place ops, with and without autograd."""
    kw = mrope_kwargs("mrope_interleaved", (23,))
    kw["layout"] = "thd"
    hk = np_kwargs(kw)
    q, k = randn((23, 4, 64), "float32"), randn((23, 1, 64), "float32")
    vs_numpy(lambda q, k: crt.rope_qk(q, k, **kw),
             lambda q, k: cupy_rope.apply_rope_qk(q, k, **hk),
             lambda gq, gk: cupy_rope.apply_rope_qk(gq, gk, backward=True, **hk), [q, k],
             "float32", "rope_qk thd")
    kw = mrope_kwargs("mrope", (12,))  # positions [3, s]: every batch entry alike
    hk = np_kwargs(kw)
    w = randn((2, 12, 4, 64), "float32")

    def ours(w):
        x = w * 1.0  # non-leaf, so it can be modified in place under autograd
        return crt.rope_(x, **kw)

    vs_numpy(ours, lambda x: cupy_rope.apply_rope(x, **hk),
             lambda g: cupy_rope.apply_rope(g, backward=True, **hk), [w], "float32",
             "rope_ with grad")
    with torch.no_grad():
        q, k = w.detach().clone(), w.detach()[:, :, :1].clone()
        crt.rope_qk_(q, k, **kw)
    assert_close(q.cpu().numpy(), cupy_rope.apply_rope(np64(w), **hk), "float32", "rope_qk_ q")
    assert_close(k.cpu().numpy(), cupy_rope.apply_rope(np64(w)[:, :, :1], **hk), "float32",
                 "rope_qk_ k")


@pytest.mark.parametrize("packing", ["concat", "grouped"])
def test_mrope_rope_qkv(packing):
    hq, hk, d = 4, 2, 64
    kw = mrope_kwargs("mrope", (2, 12))
    hkw = np_kwargs(kw)
    qkv = randn((2, 12, (hq + 2 * hk) * d), "bfloat16")
    vs_numpy(lambda qkv: crt.rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk, packing=packing,
                                      **kw),
             lambda qkv: tuple(cupy_rope.apply_rope_qkv(qkv, num_q_heads=hq, num_kv_heads=hk,
                                                        packing=packing, **hkw)),
             lambda dq, dk, dv: cupy_rope.apply_rope_qkv_backward(dq, dk, dv, packing=packing,
                                                                  **hkw),
             [qkv], "bfloat16", f"rope_qkv {packing}")


def test_mrope_opcheck():
    """The schemas' per-axis arguments (last, with defaults) under torch.library.opcheck."""
    kw = mrope_kwargs("mrope_interleaved", (2, 8))
    x = torch.randn(2, 8, 2, 64, device=DEV)
    k = torch.randn(2, 8, 1, 64, device=DEV)
    # cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, offset,
    # layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank
    common = (None, None, kw["inv_freq"], None, None, kw["positions"], None, None, 0, "bshd",
              False, None, None, 1, 0)
    axes = (list(kw["sections"]), True)
    torch.library.opcheck(torch.ops.cupy_rope.rope.default, (x,) + common + (False,) + axes)
    torch.library.opcheck(torch.ops.cupy_rope.rope_.default,
                          (x.clone(),) + common + (True,) + axes)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qk.default, (x, k) + common + (False,) + axes)
    qkv = torch.randn(2, 8, 4 * 64, device=DEV)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qkv.default,
                          (qkv,) + common + (2, 1, "grouped") + axes)


class MRopeAttention(torch.nn.Module):
    """A small GQA block whose q and k are rotated by rope_qk with per-axis positions."""

    def __init__(self, dim=256, hq=4, hk=2, d=64, sections=(8, 12, 12),
                 sections_interleaved=False):
        super().__init__()
        self.hq, self.hk, self.d = hq, hk, d
        self.sections, self.sections_interleaved = sections, sections_interleaved
        self.qkv = torch.nn.Linear(dim, (hq + 2 * hk) * d, bias=False)
        self.out = torch.nn.Linear(hq * d, dim, bias=False)

    def forward(self, x, inv_freq, positions):
        b, s, _ = x.shape
        hq, hk, d = self.hq, self.hk, self.d
        q, k, v = self.qkv(x).view(b, s, hq + 2 * hk, d).split([hq, hk, hk], dim=2)
        q, k = crt.rope_qk(q, k, inv_freq=inv_freq, positions=positions, sections=self.sections,
                           sections_interleaved=self.sections_interleaved)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, hq * d))


@pytest.mark.parametrize("sections_interleaved", [False, True])
def test_mrope_compile_fullgraph_matches_eager(sections_interleaved):
    torch._dynamo.reset()
    torch.manual_seed(0)
    sections = (12, 10, 10) if sections_interleaved else (8, 12, 12)
    block = MRopeAttention(sections=sections, sections_interleaved=sections_interleaved).to(DEV)
    inv_freq = tables(64)["inv_freq"]
    pos = torch.randint(0, 100, (3, 2, 32), device=DEV)
    x = torch.randn(2, 32, 256, device=DEV, requires_grad=True)
    y_eager = block(x, inv_freq, pos)
    g = torch.randn_like(y_eager)
    grads_eager = torch.autograd.grad(y_eager, [x] + list(block.parameters()), g)
    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    y = compiled(x, inv_freq, pos)
    grads = torch.autograd.grad(y, [x] + list(block.parameters()), g)
    close(y, y_eager)
    for a, b in zip(grads, grads_eager):
        close(a, b)
    with torch.no_grad():
        pos2 = torch.randint(0, 100, (3, 2, 32), device=DEV)  # new positions, same graph
        close(compiled(x, inv_freq, pos2), block(x, inv_freq, pos2))


def test_mrope_cuda_graph_capture_and_replay():
    """rope_qk with per-axis positions, forward and backward, captured once and
    replayed with new inputs and new positions."""
    kw = mrope_kwargs("mrope_interleaved", (2, 16), source="table", rows=128)
    static_pos = torch.zeros_like(kw["positions"])
    kw["positions"] = static_pos
    static_q = torch.zeros(2, 16, 4, 64, device=DEV, requires_grad=True)
    static_k = torch.zeros(2, 16, 2, 64, device=DEV, requires_grad=True)
    static_gq = torch.zeros(2, 16, 4, 64, device=DEV)
    static_gk = torch.zeros(2, 16, 2, 64, device=DEV)

    def step():
        yq, yk = crt.rope_qk(static_q, static_k, **kw)
        gq, gk = torch.autograd.grad((yq, yk), (static_q, static_k), (static_gq, static_gk))
        return yq.detach(), yk.detach(), gq, gk

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compiles the kernels before capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        new = [torch.randn(a.shape) for a in (static_q, static_k, static_gq, static_gk)]
        pos = torch.randint(0, 128, tuple(static_pos.shape))
        with torch.no_grad():
            for dst, src in zip((static_q, static_k, static_gq, static_gk), new):
                dst.copy_(src)
        static_pos.copy_(pos)
        graph.replay()
        hk = np_kwargs({**kw, "positions": pos})
        want = (cupy_rope.apply_rope(np64(new[0]), **hk), cupy_rope.apply_rope(np64(new[1]), **hk),
                cupy_rope.apply_rope(np64(new[2]), backward=True, **hk),
                cupy_rope.apply_rope(np64(new[3]), backward=True, **hk))
        for i, (o, w) in enumerate(zip(outs, want)):
            assert_close(o.cpu().numpy(), w, "float32", f"mrope replay {i}")


# ------------------------------------------ issue 30: what a new user hits --
def _only_plan(fn):
    """The one general-path plan that ``fn()`` caches (from empty caches)."""
    from cupy_rope import api

    api.clear_plans()
    fn()
    (prepared,) = api._plans.values()
    return prepared.plan


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_hf_position_ids_one_row(layout):
    """positions [1, s] (Hugging Face's position_ids) are shared by the batch:
    values and gradients, the in-place ops, the bound decode step, M-RoPE's
    [axes, 1, s], and the plan of [s] (same kernel, same parameters)."""
    from cupy_rope import launch

    t = tables(64)
    shape = (2, 12, 4, 64) if layout == "bshd" else (12, 2, 4, 64)
    pos = torch.randint(0, 60, (1, 12), device=DEV)
    kw = dict(cos=t["cos"], sin=t["sin"], positions=pos, layout=layout)
    q, k = randn(shape, "bfloat16"), randn(shape[:2] + (2, 64), "bfloat16")
    grads_vs_ref(lambda q, k: crt.rope_qk(q, k, **kw),
                 lambda q, k: (ref_rope(q, **kw), ref_rope(k, **kw)), [q, k], "bfloat16",
                 f"rope_qk [1, s] {layout}")
    with torch.no_grad():
        one = crt.rope_qk(q, k, **kw)
        row = crt.rope_qk(q, k, **dict(kw, positions=pos[0]))
        assert torch.equal(one[0], row[0]) and torch.equal(one[1], row[1])
        qq, kk = q.detach().clone(), k.detach().clone()
        crt.rope_qk_(qq, kk, **kw)
        assert torch.equal(qq, one[0]) and torch.equal(kk, one[1])
        rope = cupy_rope.RotaryEmbedding(t["cos"], t["sin"], layout=layout)
        for _ in range(2):  # the second call takes the bound launcher
            qq, kk = q.detach().clone(), k.detach().clone()
            rope.qk_(qq, kk, pos)
            assert torch.equal(qq, one[0]) and torch.equal(kk, one[1])
        plans = [_only_plan(lambda p=p: cupy_rope.apply_rope_qk(q.detach(), k.detach(),
                                                               **dict(kw, positions=p)))
                 for p in (pos, pos[0])]
    assert plans[0].spec == plans[1].spec
    assert launch.unpack_fixed(plans[0]) == launch.unpack_fixed(plans[1])
    assert plans[0].dims == plans[1].dims
    # M-RoPE: [axes, 1, s] as [axes, s]
    mk = mrope_kwargs("mrope", (1, 12))
    x = randn((2, 12, 4, 64), "float32")
    with torch.no_grad():
        rows = dict(mk, positions=mk["positions"][:, 0])
        assert torch.equal(crt.rope(x, **mk), crt.rope(x, **rows))
    hk = np_kwargs(mk)
    vs_numpy(lambda x: crt.rope(x, **mk), lambda x: cupy_rope.apply_rope(x, **hk),
             lambda g: cupy_rope.apply_rope(g, backward=True, **hk), [x], "float32",
             "rope M-RoPE [3, 1, s]")


def test_numpy_cu_seqlens():
    """cupy_rope.torch takes host NumPy cu_seqlens as the array API does: checked
    on the host, then copied to the device without a sync; the same results."""
    t = tables(64)
    cu = np.array([0, 5, 12, 30], np.int32)
    kw = dict(inv_freq=t["inv_freq"], layout="thd")
    x = randn((30, 4, 64), "float32")
    got = crt.rope(x, cu_seqlens=cu, **kw)
    want = crt.rope(x, cu_seqlens=torch.from_numpy(cu).to(DEV), **kw)
    assert torch.equal(got, want)
    (g,) = torch.autograd.grad(got, x, torch.ones_like(got))
    (gw,) = torch.autograd.grad(want, x, torch.ones_like(want))
    assert torch.equal(g, gw)
    with pytest.raises(ValueError, match="cu_seqlens: the last entry must be 30"):
        crt.rope(x, cu_seqlens=np.array([0, 5, 12, 31], np.int32), **kw)
