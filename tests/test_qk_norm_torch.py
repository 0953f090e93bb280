"""cupy_rope.torch.qk_norm_rope / qk_norm_rope_: the fused q/k RMSNorm + RoPE ops.

CPU: the ops run the library's float64 NumPy reference, so
``torch.autograd.gradcheck`` checks the registered backward against finite
differences of the forward, and an independent float64 torch formula (norm
then rotate-half, differentiated by torch's autograd) checks both; the
schemas, fake implementations and autograd registration go through
``torch.library.opcheck`` and ``torch.compile(fullgraph=True)``.
GPU (marked ``gpu``): values and gradients against the CPU float64 result,
weight gradients bit-identical from run to run, ``torch.compile`` against
eager, CUDA-graph capture and replay.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_rope.torch as crt  # noqa: E402
from helpers import assert_close  # noqa: E402

NORMS = [(scope, mode) for scope in ("head", "token") for mode in ("w", "1+w", "none")]
NORM_IDS = [f"{scope}-{mode}" for scope, mode in NORMS]


# ------------------------------------------------------------ reference --
def inv_freq(rotary_dim, dtype=torch.float64, device="cpu"):
    return (1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
            ).to(device, dtype)


def ref_norm(x, w, scope, mode, eps):
    """float64 RMSNorm of x [.., h, d] per head or over all heads of a token."""
    x = x.double()
    rows = x if scope == "head" else x.flatten(-2)
    y = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    if mode != "none":
        y = y * (w.double() if mode == "w" else 1 + w.double())
    return y.reshape(x.shape)


def ref_rotate(x, pos, inv, rotary_dim, interleaved):
    """x [b, s, h, d] float64 rotated at positions pos [b, s] (NeoX or GPT-J pairs)."""
    theta = pos[..., None].double() * inv.double()
    c, s = theta.cos()[..., None, :], theta.sin()[..., None, :]
    r = rotary_dim
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = x[..., :r // 2], x[..., r // 2:r]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, x[..., r:]], dim=-1)


def ref_qk_norm_rope(q, k, wq, wk, pos, inv, *, scope, mode, eps=1e-6, rotary_dim=None,
                     interleaved=False):
    """The fused op's meaning in float64 torch ops (bshd), differentiable by autograd."""
    r = rotary_dim or q.shape[-1]
    return tuple(ref_rotate(ref_norm(x, w, scope, mode, eps), pos, inv, r, interleaved)
                 for x, w in ((q, wq), (k, wk)))


def make(shape_q, shape_k, scope, mode, dtype=torch.float64, device="cpu", seed=0):
    """q, k and the weights the norm takes (None for mode "none"), requiring grad."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return t.to(device, dtype).requires_grad_()

    q, k = rnd(*shape_q), rnd(*shape_k)
    if mode == "none":
        return q, k, None, None
    d = shape_q[-1]
    nq, nk = (d, d) if scope == "head" else (shape_q[-2] * d, shape_k[-2] * d)
    base = 1.0 if mode == "w" else 0.0  # Gemma's weights sit around 0
    wq = (torch.randn(nq, generator=g, dtype=torch.float64) * 0.3 + base).to(device, dtype)
    wk = (torch.randn(nk, generator=g, dtype=torch.float64) * 0.3 + base).to(device, dtype)
    return q, k, wq.requires_grad_(), wk.requires_grad_()


def grad_inputs(*tensors):
    return [t for t in tensors if t is not None]


# ----------------------------------------------------------------- CPU ----
@pytest.mark.parametrize("scope,mode", NORMS, ids=NORM_IDS)
def test_gradcheck_float64(scope, mode):
    """The registered backward (the backward op) against finite differences,
    for q, k and both weights."""
    q, k, wq, wk = make((1, 3, 2, 8), (1, 3, 1, 8), scope, mode)
    inv = inv_freq(8)
    kw = dict(inv_freq=inv, norm_scope=scope, weight_mode=mode, eps=1e-5)
    if mode == "none":
        assert torch.autograd.gradcheck(lambda q, k: crt.qk_norm_rope(q, k, **kw), (q, k))
    else:
        assert torch.autograd.gradcheck(lambda q, k, wq, wk: crt.qk_norm_rope(q, k, wq, wk, **kw),
                                        (q, k, wq, wk))


CASES = {  # name: (layout, interleaved, rotary_dim, offsets)
    "bshd": ("bshd", False, None, None),
    "bshd-gptj-partial": ("bshd", True, 8, None),
    "sbhd-offsets": ("sbhd", False, None, 3),
    "thd-varlen": ("thd", False, 12, None),
}


def call_layout(layout, q, k, wq, wk, inv, cu, **kw):
    """The op on q, k in ``layout`` built from bshd tensors; results as bshd."""
    if layout == "bshd":
        return crt.qk_norm_rope(q, k, wq, wk, inv_freq=inv, **kw)
    if layout == "sbhd":
        out = crt.qk_norm_rope(q.transpose(0, 1), k.transpose(0, 1), wq, wk, inv_freq=inv,
                               layout="sbhd", **kw)
        return tuple(o.transpose(0, 1) for o in out)
    out = crt.qk_norm_rope(q.flatten(0, 1), k.flatten(0, 1), wq, wk, inv_freq=inv,
                           layout="thd", cu_seqlens=cu, **kw)
    return tuple(o.reshape(q.shape[:2] + o.shape[1:]) for o in out)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scope,mode", NORMS, ids=NORM_IDS)
def test_forward_and_grads_match_torch_formula(case, scope, mode):
    """Values and gradients (q, k, weights) against torch ops in float64."""
    layout, interleaved, rotary_dim, offset = CASES[case]
    b, s, d = 2, 5, 16
    q, k, wq, wk = make((b, s, 4, d), (b, s, 2, d), scope, mode)
    inv = inv_freq(rotary_dim or d)
    pos = torch.arange(s).expand(b, s) + (offset or 0)
    cu = None
    if layout == "thd":  # two sequences of s tokens, positions restarting at 0
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
    kw = dict(norm_scope=scope, weight_mode=mode, eps=1e-5, interleaved=interleaved,
              rotary_dim=rotary_dim)
    if offset:
        kw["offsets"] = offset
    outs = call_layout(layout, q, k, wq, wk, inv, cu, **kw)
    ref = ref_qk_norm_rope(q, k, wq, wk, pos, inv, scope=scope, mode=mode, eps=1e-5,
                           rotary_dim=rotary_dim, interleaved=interleaved)
    inputs = grad_inputs(q, k, wq, wk)
    cots = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, inputs, cots)
    ref_grads = torch.autograd.grad(ref, inputs, cots)
    for o, r in zip(outs, ref):
        assert o.dtype == torch.float64 and o.shape == r.shape
        assert_close(o.detach().numpy(), r.detach().numpy(), "float64", f"{case} out")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == inputs[i].shape
        assert_close(g.numpy(), r.numpy(), "float64", f"{case} grad {i}")


def test_bfloat16_rounding_orders_on_cpu():
    """bfloat16 on the reference path: each rounding order is its model
    family's formula (Qwen3: round x_hat then times w; Gemma / OLMo 2: round
    once), to one rounding of the output."""
    q, k, wq, wk = make((2, 4, 4, 16), (2, 4, 2, 16), "head", "w", dtype=torch.bfloat16)
    inv = inv_freq(16)
    pos = torch.arange(4).expand(2, 4)
    for rounding in ("before_weight", "after_weight"):
        got = crt.qk_norm_rope(q, k, wq, wk, inv_freq=inv.float(), rounding=rounding)
        for x, w, y in zip((q, k), (wq, wk), got):
            xf = x.detach().float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            n = (x_hat.to(torch.bfloat16) * w.detach() if rounding == "before_weight" else
                 (x_hat * w.detach().float()).to(torch.bfloat16))
            want = ref_rotate(n.double(), pos, inv, 16, False)
            assert y.dtype == torch.bfloat16
            # one bf16 rounding of the output: within half an ulp (2^-9 relative)
            err = (y.double() - want).abs() / want.abs().clamp_min(1e-3)
            assert err.max() <= 2.0 ** -8, (rounding, err.max())


@pytest.mark.parametrize("scope,mode", [("head", "w"), ("token", "1+w")])
def test_inplace(scope, mode):
    """Without grad: the mutating op writes q and k (no new buffer); with
    grad: copies, the same values and gradients as the functional op."""
    q, k, wq, wk = make((2, 5, 4, 16), (2, 5, 2, 16), scope, mode)
    kw = dict(inv_freq=inv_freq(16), norm_scope=scope, weight_mode=mode)
    want = crt.qk_norm_rope(q, k, wq, wk, **kw)
    with torch.no_grad():
        q2, k2 = q.detach().clone(), k.detach().clone()
        ptr = q2.data_ptr()
        rq, rk = crt.qk_norm_rope_(q2, k2, wq, wk, **kw)
    assert rq is q2 and rk is k2 and q2.data_ptr() == ptr
    for a, b in zip((q2, k2), want):
        np.testing.assert_array_equal(a.numpy(), b.detach().numpy())
    # with grad: non-leaf inputs, gradients reach q, k and the weights
    qa, ka = q * 1.0, k * 1.0
    ra = crt.qk_norm_rope_(qa, ka, wq, wk, **kw)
    assert ra[0] is qa
    cots = [torch.randn_like(o) for o in want]
    got = torch.autograd.grad(ra, [q, k, wq, wk], cots)
    ref = torch.autograd.grad(want, [q, k, wq, wk], cots)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def op_args(inv, scope="head", mode="w"):
    """The op's positional arguments after q, k and the weights: cos, sin,
    inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, offset,
    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, then
    norm_scope, weight_mode, rounding, eps."""
    return (None, None, inv, None, None, None, None, None, 0, "bshd", False, None, None, 1, 0,
            scope, mode, "before_weight", 1e-6)


@pytest.mark.parametrize("scope,mode", [("head", "w"), ("token", "none")])
def test_opcheck(scope, mode):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    q, k, wq, wk = (t.detach().float() if t is not None else None
                    for t in make((2, 3, 4, 16), (2, 3, 2, 16), scope, mode))
    args = op_args(inv_freq(16, torch.float32), scope, mode)
    ops = torch.ops.cupy_rope
    torch.library.opcheck(ops.qk_norm_rope.default, (q.requires_grad_(), k, wq, wk) + args)
    torch.library.opcheck(ops.qk_norm_rope_.default,
                          (q.detach().clone(), k.clone(), wq, wk) + args)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.library.opcheck(ops.qk_norm_rope_backward.default,
                          (gq, gk, q.detach(), k, wq, wk) + args)


class NormRope(torch.nn.Module):
    """Projections, q/k norm + rope, a product of the results (the ops in a model)."""

    def __init__(self, scope, mode, dim=32, hq=4, hk=2, d=16):
        super().__init__()
        self.hq, self.hk, self.d, self.scope, self.mode = hq, hk, d, scope, mode
        self.q_proj = torch.nn.Linear(dim, hq * d, bias=False)
        self.k_proj = torch.nn.Linear(dim, hk * d, bias=False)
        nq, nk = (d, d) if scope == "head" else (hq * d, hk * d)
        self.q_weight = torch.nn.Parameter(1 + 0.2 * torch.randn(nq))
        self.k_weight = torch.nn.Parameter(1 + 0.2 * torch.randn(nk))
        self.register_buffer("inv_freq", inv_freq(d, torch.float32))

    def forward(self, x, inplace=False):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.hq, self.d)
        k = self.k_proj(x).view(b, s, self.hk, self.d)
        fn = crt.qk_norm_rope_ if inplace else crt.qk_norm_rope
        q, k = fn(q, k, self.q_weight, self.k_weight, inv_freq=self.inv_freq,
                  norm_scope=self.scope, weight_mode=self.mode, eps=1e-5)
        return (q[:, :, :self.hk] * k).sum(-1)


@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
@pytest.mark.parametrize("scope", ["head", "token"])
def test_compile_fullgraph_cpu(scope, inplace):
    """torch.compile(fullgraph=True) traces the ops with no graph break
    (aot_eager on the CPU: the fake implementations and the backward op);
    forward and parameter gradients equal eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = NormRope(scope, "w")
    x = torch.randn(2, 6, 32, requires_grad=True)
    y = block(x, inplace)
    params = [x] + list(block.parameters())
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, params, g)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    y2 = compiled(x, inplace)
    got = torch.autograd.grad(y2, params, g)
    np.testing.assert_allclose(y2.detach().numpy(), y.detach().numpy(), rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


BAD = [
    ("eps zero", dict(eps=0.0), ValueError, "eps: expected a finite float > 0"),
    ("eps str", dict(eps="1e-6"), TypeError, "eps: expected a float"),
    ("scope", dict(norm_scope="layer"), ValueError, "norm_scope: expected one of"),
    ("weight_mode", dict(weight_mode="w+1"), ValueError, "weight_mode: expected one of"),
    ("rounding", dict(rounding="late"), ValueError, "rounding: expected one of"),
    ("weight for none", dict(weight_mode="none"), ValueError, "q_weight: weight_mode 'none'"),
    ("weight shape", dict(norm_scope="token"), ValueError, "q_weight: expected a 1-D array"),
    ("offsets float", dict(offsets=1.5), TypeError, "offsets: expected an int"),
]


@pytest.mark.parametrize("kw,exc,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fn", ["qk_norm_rope", "qk_norm_rope_"])
def test_bad_arguments_named_and_nothing_written(fn, kw, exc, text):
    q, k, wq, wk = (t.detach() for t in make((2, 3, 4, 16), (2, 3, 2, 16), "head", "w"))
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(exc, match=re.escape(text)):
        getattr(crt, fn)(q, k, wq, wk, inv_freq=inv_freq(16), **kw)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_missing_inputs_and_weights_named():
    q, k, wq, wk = (t.detach() for t in make((2, 3, 4, 16), (2, 3, 2, 16), "head", "w"))
    inv = inv_freq(16)
    with pytest.raises(TypeError, match="k: expected a torch tensor, got NoneType"):
        crt.qk_norm_rope(q, None, wq, wk, inv_freq=inv)
    with pytest.raises(ValueError, match="k_weight: weight_mode 'w' needs both"):
        crt.qk_norm_rope(q, k, wq, None, inv_freq=inv)
    with pytest.raises(ValueError, match="inv_freq: requires grad"):
        crt.qk_norm_rope(q.requires_grad_(), k, wq, wk, inv_freq=inv.clone().requires_grad_())


# ----------------------------------------------------------------- GPU ----
DEV = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vs_cpu_float64(fn, inputs, dtype, what):
    """``fn`` on the device inputs against ``fn`` on their CPU float64 copies
    (the reference path): outputs and the gradients of every input."""
    outs = fn(*inputs)
    cots = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, inputs, cots)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in inputs]
    ref_outs = fn(*ref_in)
    ref_grads = torch.autograd.grad(ref_outs, ref_in, [c.double().cpu() for c in cots])
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == inputs[0].dtype and o.device == inputs[0].device
        assert_close(o.detach().float().cpu().numpy(), r.detach().numpy(), dtype,
                     f"{what} out{i}")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == inputs[i].shape and g.dtype == inputs[i].dtype
        assert_close(g.float().cpu().numpy(), r.numpy(), dtype, f"{what} grad{i}")


GPU_CASES = {  # name: (dtype, d, layout, rotary_dim, interleaved)
    "fp32-d64-bshd": ("float32", 64, "bshd", None, False),
    "bf16-d128-bshd": ("bfloat16", 128, "bshd", None, False),
    "bf16-d128-sbhd-partial": ("bfloat16", 128, "sbhd", 64, False),
    "fp32-d80-thd-gptj": ("float32", 80, "thd", None, True),
    "fp16-d256-bshd": ("float16", 256, "bshd", None, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("scope,mode", NORMS, ids=NORM_IDS)
def test_gpu_values_and_gradients_vs_cpu_float64(scope, mode, case):
    dtype, d, layout, rotary_dim, interleaved = GPU_CASES[case]
    b, s, hq, hk = 2, 24, 8, 2
    q, k, wq, wk = make((b, s, hq, d), (b, s, hk, d), scope, mode, DTYPES[dtype], DEV)
    inv = inv_freq(rotary_dim or d, torch.float32, DEV)
    kw = dict(inv_freq=inv, norm_scope=scope, weight_mode=mode, rotary_dim=rotary_dim,
              interleaved=interleaved, rounding="after_weight" if mode == "1+w" else
              "before_weight")
    if layout == "sbhd":
        q, k = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k))
        kw["layout"] = "sbhd"
    elif layout == "thd":
        q, k = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k))
        cu = torch.tensor([0, 7, b * s], dtype=torch.int32)
        kw.update(layout="thd", offsets=torch.tensor([0, 3]))

    def fn(*ts):
        on = ts[0].device
        extra = {n: (v.to(on) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
        if layout == "thd":
            extra["cu_seqlens"] = cu.to(on)
        ws = ts[2:] if len(ts) == 4 else (None, None)
        if on.type == "cpu":
            ws = tuple(w.double() if w is not None else None for w in ws)
            extra["inv_freq"] = extra["inv_freq"].double()
        return crt.qk_norm_rope(ts[0], ts[1], *ws, **extra)

    vs_cpu_float64(fn, grad_inputs(q, k, wq, wk), dtype, f"{scope}-{mode} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["head", "token"])
def test_gpu_weight_gradients_bit_identical_across_runs(scope):
    q, k, wq, wk = make((4, 512, 8, 128), (4, 512, 2, 128), scope, "w", torch.bfloat16, DEV)
    inv = inv_freq(128, torch.float32, DEV)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    runs = []
    for _ in range(3):
        out = crt.qk_norm_rope(q, k, wq, wk, inv_freq=inv, norm_scope=scope)
        runs.append(torch.autograd.grad(out, [q, k, wq, wk], [gq, gk]))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
def test_gpu_inplace():
    q, k, wq, wk = (t.detach() for t in make((2, 16, 8, 64), (2, 16, 2, 64), "token", "w",
                                             torch.bfloat16, DEV))
    kw = dict(inv_freq=inv_freq(64, torch.float32, DEV), norm_scope="token")
    want = crt.qk_norm_rope(q, k, wq, wk, **kw)
    view = q.transpose(0, 1).contiguous().transpose(0, 1)  # a strided bshd view
    ptr = view.data_ptr()
    rq, rk = crt.qk_norm_rope_(view, k, wq, wk, **kw)
    assert rq is view and rk is k and view.data_ptr() == ptr
    assert torch.equal(view, want[0]) and torch.equal(k, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("scope,mode", [("head", "w"), ("token", "none")])
def test_gpu_opcheck(scope, mode):
    q, k, wq, wk = (t.detach().float() if t is not None else None
                    for t in make((2, 8, 4, 64), (2, 8, 2, 64), scope, mode, device=DEV))
    args = op_args(inv_freq(64, torch.float32, DEV), scope, mode)
    ops = torch.ops.cupy_rope
    torch.library.opcheck(ops.qk_norm_rope.default, (q.requires_grad_(), k, wq, wk) + args)
    torch.library.opcheck(ops.qk_norm_rope_.default,
                          (q.detach().clone(), k.clone(), wq, wk) + args)
    torch.library.opcheck(ops.qk_norm_rope_backward.default,
                          (torch.randn_like(q), torch.randn_like(k), q.detach(), k, wq, wk) + args)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
@pytest.mark.parametrize("scope", ["head", "token"])
def test_gpu_compile_fullgraph_matches_eager(scope, inplace):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = NormRope(scope, "1+w" if scope == "head" else "w", dim=256, hq=8, hk=2,
                     d=64).to(DEV)
    x = torch.randn(2, 32, 256, device=DEV, requires_grad=True)
    y = block(x, inplace)
    params = [x] + list(block.parameters())
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, params, g)
    compiled = torch.compile(block, fullgraph=True)  # raises on any graph break
    y2 = compiled(x, inplace)
    got = torch.autograd.grad(y2, params, g)
    close(y2, y)
    for a, b in zip(got, want):
        close(a, b)
    with torch.no_grad():  # the inference graph (the in-place op functionalized)
        close(compiled(x, inplace), y)


def close(a, b):
    """Compiled vs eager: the same kernels, up to fusion and reduction order elsewhere."""
    b = b.detach().float().cpu().numpy()
    np.testing.assert_allclose(a.detach().float().cpu().numpy(), b, rtol=1e-4,
                               atol=1e-4 * np.abs(b).max())


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["head", "token"])
def test_gpu_cuda_graph_capture_and_replay(scope):
    """Forward and backward (q, k and weight gradients) captured once, replayed
    on new inputs copied into the static tensors."""
    shapes = ((2, 16, 8, 64), (2, 16, 2, 64))
    static = [t.detach() for t in make(*shapes, scope, "w", torch.float32, DEV)]
    static_q, static_k, static_wq, static_wk = (t.requires_grad_() for t in static)
    static_gq, static_gk = torch.zeros(shapes[0], device=DEV), torch.zeros(shapes[1], device=DEV)
    static_pos = torch.zeros(2, 16, device=DEV, dtype=torch.int64)
    inv = inv_freq(64, torch.float32, DEV)
    leaves = [static_q, static_k, static_wq, static_wk]

    def step():
        out = crt.qk_norm_rope(*leaves, inv_freq=inv, positions=static_pos, norm_scope=scope)
        grads = torch.autograd.grad(out, leaves, [static_gq, static_gk])
        return [o.detach() for o in out] + list(grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compiles the kernels before the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    for seed in range(3):
        new = [t.detach() for t in make(*shapes, scope, "w", torch.float32, seed=seed + 1)]
        gq, gk = torch.randn(shapes[0]), torch.randn(shapes[1])
        pos = torch.randint(0, 128, (2, 16))
        with torch.no_grad():
            for dst, src in zip(leaves, new):
                dst.copy_(src)
        static_gq.copy_(gq)
        static_gk.copy_(gk)
        static_pos.copy_(pos)
        graph.replay()
        ref_in = [t.double().requires_grad_() for t in new]
        ref_out = crt.qk_norm_rope(*ref_in, inv_freq=inv.double().cpu(), positions=pos,
                                   norm_scope=scope)
        ref = [o.detach() for o in ref_out] + list(torch.autograd.grad(ref_out, ref_in,
                                                                       [gq.double(),
                                                                        gk.double()]))
        for i, (got, want) in enumerate(zip(results, ref)):
            assert_close(got.cpu().numpy(), want.numpy(), "float32", f"replay {seed} #{i}")
