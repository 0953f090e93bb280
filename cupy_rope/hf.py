"""Hugging Face ``transformers`` integration: run a model's rotary embedding on cupy-rope.

One line, per model::

    model = cupy_rope.hf.patch(model)        # LlamaForCausalLM, Qwen2ForCausalLM, ...

Every attention layer of ``model`` whose ``forward`` calls the module-level
``apply_rotary_pos_emb`` of its modeling file, where that function computes
the Llama formula (checked when patching, on small CPU inputs: NeoX
rotate-half pairs over the first ``cos.shape[-1]`` channels, the rest passed
through; Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, OLMo and the other
models written that way), then rotates q and k by one
:func:`cupy_rope.torch.rope_qk` launch, differentiable (its backward is the
same kernel rotating by -theta), traceable by ``torch.compile`` and capturable
in CUDA graphs. Layers whose function is another formula (GPT-J style
interleaved pairs as in Cohere, a rotation the other way, other argument
orders) are left alone; :func:`patch` raises when no layer qualifies. Other instances of the
same class are not affected, and :func:`unpatch` restores the stock
behaviour. To switch a whole Llama-formula model family instead (every
instance, present and future), assign the drop-in to the modeling module::

    import transformers.models.llama.modeling_llama as m
    m.apply_rotary_pos_emb = cupy_rope.hf.apply_rotary_pos_emb

How the HF tensors map onto the kernel: HF passes q [b, hq, s, d] and
k [b, hk, s, d] (views of [b, s, h, d] projections, so ``q.transpose(1, 2)`` is
our bshd layout with no copy) and cos, sin [b, s, d] built by the model's
rotary module: NeoX-style, the two halves of the last axis are equal, and any
attention scaling of the rope type (YaRN, LongRoPE, ...) is already
multiplied in. So the kernel reads ``cos[..., :d // 2]`` as its table, which
keeps every rope type's frequencies and scaling exactly as the model computed
them. Positions: when the batch axis of cos has one row (or is a broadcast),
that row is the table for every sequence and positions are the sequence
index; otherwise the [b, s, d/2] half is viewed (no copy) as a
[b * s, d/2] table and sequence i reads rows i * s ... i * s + s - 1 through
``offsets = [0, s, 2 s, ...]``, which is right whatever ``position_ids`` were.

A partial rotary width (cos narrower than the head, as Phi-3/Phi-4-mini
build it) runs on the kernel with ``rotary_dim`` = that width where the
model's own function rotates only those channels. Anything else (CPU
tensors, tables that require grad, other shapes or arguments) calls the
model's own function, so patching never changes what a model computes or
can run.

Layers that normalize q and k right before the rotation (``q_norm`` and
``k_norm`` RMSNorm-like modules: Qwen3 and Gemma 3 per head, weight [d];
OLMo 2 over the whole [b, s, h * d] projection) go further: one
:func:`cupy_rope.torch.qk_norm_rope` launch normalizes and rotates q and k,
with gradients for the norms' weights. When patching, each norm is probed on
small CPU rows (weight as w or 1 + w, its ``variance_epsilon`` / ``eps``,
which of the two rounding orders it uses in bfloat16), then the whole
layer on a small CPU copy: its forward with the norms deferred and the fused
formula in place of ``apply_rotary_pos_emb`` must give what its own forward
gives. Such a layer's ``q_norm`` and ``k_norm`` then return their input
(an instance ``forward``), and its ``apply_rotary_pos_emb`` receives the
projections and normalizes them: on the kernel where the call fits (it also
needs the weights in q's dtype, on its device), else with the norms' own
class ``forward`` followed by the rotation above. Layers that fail a probe
are rotated only. :func:`unpatch` restores the norms too.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from typing import NamedTuple

import torch

from . import torch as _crt

__all__ = ["patch", "unpatch", "apply_rotary_pos_emb"]

_DEVICES = ("cuda",)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MARK = "_cupy_rope_patched"


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _stock(q, k, cos, sin, unsqueeze_dim=1):
    """HF's reference formula (used when the inputs do not fit the kernel)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _fits(q, k, cos, sin, unsqueeze_dim, partial=False) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.device.type not in _DEVICES or not (q.device == k.device == cos.device == sin.device):
        return False
    if q.dim() != 4 or k.dim() != 4 or unsqueeze_dim not in (1, 2):
        return False
    if q.dtype not in _FLOATS or k.dtype != q.dtype:
        return False
    if cos.shape != sin.shape or cos.dtype != sin.dtype or cos.dtype not in (torch.float32,
                                                                             q.dtype):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # the kernel gives no gradient for the tables
    seq_axis = 2 if unsqueeze_dim == 1 else 1
    s, d = q.shape[seq_axis], q.shape[-1]
    if k.shape[seq_axis] != s or k.shape[-1] != d or k.shape[0] != q.shape[0]:
        return False
    r = cos.shape[-1]  # the rotated width: d, or less where the model rotates a part
    if r % 2 or r < 2 or r > d or (r < d and not partial):
        return False
    if cos.dim() == 3:
        return cos.shape[1] == s and cos.shape[0] in (1, q.shape[0])
    return cos.dim() == 2 and cos.shape[0] == s


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **unused):
    """Drop-in for ``transformers``' ``apply_rotary_pos_emb`` of Llama-formula models.

    The kernel runs where the call fits (CUDA tensors, full rotary width,
    tables that need no gradient); anything else runs Hugging Face's formula.
    See the module docstring for how cos and sin are read.

    Parameters
    ----------
    q : torch.Tensor
        [b, hq, s, d] (``unsqueeze_dim=1``) or [b, s, hq, d] (2).
    k : torch.Tensor
        [b, hk, s, d] or [b, s, hk, d].
    cos, sin : torch.Tensor
        [b, s, d] or [s, d], as the model's rotary module builds them.
    unsqueeze_dim : {1, 2}, default 1
        The head axis of q and k, as in transformers.
    **unused
        Ignored (some modeling files pass ``position_ids``).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``q_embed`` and ``k_embed``, new tensors of q's and k's shapes.

    Examples
    --------
    >>> import transformers.models.llama.modeling_llama as m    # doctest: +SKIP
    >>> m.apply_rotary_pos_emb = cupy_rope.hf.apply_rotary_pos_emb  # doctest: +SKIP

    q [1, 32, 512, 128] and k [1, 8, 512, 128] with cos, sin [1, 512, 128]
    give q_embed [1, 32, 512, 128] and k_embed [1, 8, 512, 128].
    """
    if not _fits(q, k, cos, sin, unsqueeze_dim):
        return _stock(q, k, cos, sin, unsqueeze_dim)
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def _tables(q, cos, sin):
    """(cos table, sin table, keyword arguments) of the kernel call for HF's
    cos, sin (see the module docstring): the first half of the last axis,
    ``rotary_dim`` where cos is narrower than the head, and per-sequence
    offsets into a [b * s, r/2] view where each sequence has its own rows."""
    r = cos.shape[-1]
    half = r // 2
    kw = {} if r == q.shape[-1] else {"rotary_dim": r}
    if cos.dim() == 2:
        return cos[:, :half], sin[:, :half], kw
    if cos.shape[0] == 1 or cos.stride(0) == 0:
        return cos[0, :, :half], sin[0, :, :half], kw
    b, s = cos.shape[0], cos.shape[1]
    kw["offsets"] = torch.arange(0, b * s, s, device=q.device, dtype=torch.int64)
    return cos[..., :half].reshape(b * s, half), sin[..., :half].reshape(b * s, half), kw


def _rotate(q, k, cos, sin, unsqueeze_dim):
    """q and k rotated on the kernel (the inputs passed :func:`_fits`)."""
    cos_t, sin_t, kw = _tables(q, cos, sin)
    qs, ks = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)  # bshd
    q_out, k_out = _crt.rope_qk(qs, ks, cos_t, sin_t, **kw)
    if unsqueeze_dim == 1:
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def _probe_inputs(width, d=8):
    """Small float32 CPU inputs (explicitly on the CPU: a default device set
    by the caller must not move them)."""
    g = torch.Generator(device="cpu").manual_seed(width)
    kw = dict(generator=g, dtype=torch.float32, device="cpu")
    q = torch.randn(2, 3, 5, d, **kw)
    k = torch.randn(2, 1, 5, d, **kw)
    theta = torch.rand(2, 5, width // 2, **kw) * 6
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    return q, k, cos, sin


def _expected(q, k, cos, sin):
    """The drop-in's meaning: NeoX pairs over the first cos.shape[-1] channels."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(1).double(), sin.unsqueeze(1).double()
    out = []
    for t in (q.double(), k.double()):
        rot, rest = t[..., :r], t[..., r:]
        out.append(torch.cat([rot * c + _rotate_half(rot) * s, rest], -1))
    return out


def _agrees(fn, width) -> bool:
    """Whether ``fn(q, k, cos, sin)`` gives the drop-in's result on a probe,
    to fp32 rounding (models that compute in fp32 or in place qualify; a
    different pairing, direction or scaling is off by O(1))."""
    try:
        q, k, cos, sin = _probe_inputs(width)
        want = _expected(q, k, cos, sin)
        got = fn(q.clone(), k.clone(), cos.clone(), sin.clone())
        return (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(g, torch.Tensor) and g.shape == w.shape
                        and torch.allclose(g.detach().double().cpu(), w, rtol=1e-5, atol=1e-6)
                        for g, w in zip(got, want)))
    except Exception:
        return False


def _formula(fn):
    """(full, partial): whether the modeling module's ``fn`` computes the Llama
    formula over the whole head and over a narrower cos; (False, False) for a
    function with another signature or formula. Tried once per function."""
    known = _FORMULAS.get(fn)
    if known is None:
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        if names[:4] != ["q", "k", "cos", "sin"]:
            known = (False, False)
        else:
            known = (_agrees(fn, 8), _agrees(fn, 4))
        _FORMULAS[fn] = known
    return known


_FORMULAS: dict = {}


def _drop_in_for(orig, partial):
    """``apply_rotary_pos_emb`` for a module whose own function is ``orig``
    (the Llama formula): the kernel where the call fits, else ``orig``."""
    names = list(inspect.signature(orig).parameters)
    takes_unsqueeze = "unsqueeze_dim" in names
    positional_unsqueeze = names[4:5] == ["unsqueeze_dim"]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = 1
        if args or kwargs:
            if len(args) == 1 and not kwargs and positional_unsqueeze:
                unsqueeze_dim = args[0]
            elif not args and set(kwargs) == {"unsqueeze_dim"} and takes_unsqueeze:
                unsqueeze_dim = kwargs["unsqueeze_dim"]
            else:
                unsqueeze_dim = None
        if unsqueeze_dim is None or not _fits(q, k, cos, sin, unsqueeze_dim, partial):
            return orig(q, k, cos, sin, *args, **kwargs)
        return _rotate(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = orig
    return apply_rotary_pos_emb


def _patched_forward(fn, drop_in):
    """``fn`` (an attention ``forward``) resolving ``apply_rotary_pos_emb`` to ``drop_in``."""
    g = dict(fn.__globals__)
    g["apply_rotary_pos_emb"] = drop_in
    # Without a module name torch.compile guards these globals as the dict
    # they are; with one it would read them back from the modeling module,
    # where apply_rotary_pos_emb is the model's own function.
    del g["__name__"]
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    setattr(new, _MARK, True)
    return new


# ------------------------------------------------ fused q/k norm + rope --
class _Norms(NamedTuple):
    """How a layer's ``q_norm`` and ``k_norm`` normalize, as the probe found:
    the arguments of :func:`cupy_rope.torch.qk_norm_rope` that reproduce them."""

    scope: str  # "head": weight [d], each head; "token": weight [h * d], all heads of a token
    weight_mode: str  # "w" or "1+w"
    rounding: str  # "before_weight" or "after_weight"
    eps: float


def _deferred_norm(x):
    """A deferred norm's forward: the input as it is (the fused call normalizes)."""
    return x


setattr(_deferred_norm, _MARK, True)


def _norm_eps(norm):
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        return None
    return float(eps)


def _stock_norm(norm, x, scope):
    """``norm``'s own class forward on x [b, h, s, d], as the layer applies it:
    on the heads (scope "head"), or on the [b, s, h * d] projection ("token")."""
    forward = type(norm).forward
    if scope == "head":
        return forward(norm, x)
    b, h, s, d = x.shape
    return forward(norm, x.transpose(1, 2).flatten(2)).view(b, s, h, d).transpose(1, 2)


def _normalized(x, w, norms: _Norms, out_dtype):
    """The fused op's norm of x [b, h, s, d] with weight w (or None), rounded to
    ``out_dtype`` as ``norms.rounding`` says; x_hat in float64 for a float64
    x, else in float32 as the kernel computes it."""
    calc = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, h, s, d = x.shape
    rows = x.to(calc) if norms.scope == "head" else x.transpose(1, 2).flatten(2).to(calc)
    x_hat = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + norms.eps)
    if norms.scope == "token":
        x_hat = x_hat.view(b, s, h, d).transpose(1, 2)
        w = None if w is None else w.view(h, 1, d)
    w = None if w is None else (w.to(calc) if norms.weight_mode == "w" else 1 + w.to(calc))
    if w is None:
        return x_hat.to(out_dtype)
    if norms.rounding == "before_weight":
        return (x_hat.to(out_dtype).to(calc) * w).to(out_dtype)
    return (x_hat * w).to(out_dtype)


def _fused_expected(q, k, cos, sin, q_weight, k_weight, norms: _Norms):
    """The fused op's meaning on HF tensors (q, k [b, h, s, d], cos, sin
    [b, s, r]): the norm, then NeoX pairs over the first r channels."""
    n = [_normalized(x, w, norms, x.dtype) for x, w in ((q, q_weight), (k, k_weight))]
    return [y.to(x.dtype) for y, x in zip(_expected(n[0], n[1], cos, sin), (q, k))]


def _norm_kind(norm):
    """(weight_mode, rounding, eps, weight length) of an RMSNorm-like module
    whose own forward gives, on small CPU rows with a random weight, x_hat * w
    or x_hat * (1 + w) (within float32 rounding) and in bfloat16 exactly one
    of the two rounding orders; None for anything else."""
    weight, eps = getattr(norm, "weight", None), _norm_eps(norm)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    with torch.device("cpu"):  # whatever the caller's default device
        return _probe_norm(norm, weight.shape[0], eps)


def _probe_norm(norm, n, eps):
    """:func:`_norm_kind` of a norm with a weight [n] and ``eps``."""
    g = torch.Generator(device="cpu").manual_seed(n)
    kw = dict(generator=g, device="cpu")
    # row scales around 1, and one whose mean square is of the order of eps
    x = torch.randn(3, 1, 1, n, **kw) * torch.tensor([1.0, eps ** 0.5, 30.0]).view(3, 1, 1, 1)
    mode = None
    for candidate, base in (("w", 1.0), ("1+w", 0.0)):
        w = torch.randn(n, **kw) * 0.5 + base
        norms = _Norms("head", candidate, "after_weight", eps)
        got = _norm_forward(norm, w, x)
        want = _normalized(x.double(), w.double(), norms, torch.float64)
        if got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7):
            mode = candidate
            break
    if mode is None:
        return None
    got = _norm_forward(norm, w.bfloat16(), x.bfloat16())
    if got.dtype != torch.bfloat16 or got.shape != x.shape:
        return None
    misses = {r: int((got != _normalized(x.bfloat16(), w.bfloat16(), _Norms("head", mode, r, eps),
                                         torch.bfloat16)).sum())
              for r in ("before_weight", "after_weight")}
    # The two orders differ on a good share of the elements; the model's own
    # order matches all of them but a few (where its fp32 x_hat differs in
    # the last bit from rsqrt's).
    rounding, other = sorted(misses, key=misses.get)
    if misses[rounding] > x.numel() // 100 or 4 * misses[rounding] >= misses[other]:
        return None
    return mode, rounding, eps, n


def _norm_forward(norm, weight, x):
    """The class forward of a shallow copy of ``norm`` holding ``weight``."""
    clone = copy.copy(norm)
    clone._parameters = {**norm._parameters, "weight": torch.nn.Parameter(weight, False)}
    with torch.no_grad():
        return type(norm).forward(clone, x)


def _layer_norms(module, fn):
    """The :class:`_Norms` of an attention module whose class ``forward`` (fn)
    normalizes q and k with RMSNorm-like ``q_norm`` / ``k_norm`` and then
    rotates, checked on a small CPU copy of the layer (:func:`_layer_agrees`);
    None where any part does not fit (the layer is then only rotated)."""
    if not {"q_norm", "k_norm"} <= set(fn.__code__.co_names):
        return None
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    d = getattr(module, "head_dim", None)
    if not (isinstance(q_norm, torch.nn.Module) and isinstance(k_norm, torch.nn.Module)
            and isinstance(d, int) and d > 0):
        return None
    kinds = [_norm_kind(q_norm), _norm_kind(k_norm)]
    if None in kinds or kinds[0][:3] != kinds[1][:3]:
        return None
    nq, nk = kinds[0][3], kinds[1][3]
    if nq % d or nk % d:
        return None
    norms = _Norms("head" if nq == nk == d else "token", *kinds[0][:3])
    return norms if _layer_agrees(module, fn, norms) else None


_PROBE_HIDDEN = 16  # the hidden size of the layer's probe copy


def _probe_child(name, child):
    """A small CPU stand-in for one child of the layer's probe copy: q_norm /
    k_norm with random weights, the projections with a small hidden size,
    stateless children as they are; anything else raises (no probe)."""
    if name in ("q_norm", "k_norm"):
        clone = copy.copy(child)
        g = torch.Generator(device="cpu").manual_seed(1 if name == "q_norm" else 2)
        w = torch.randn(child.weight.shape[0], generator=g, device="cpu") * 0.3 + 1.0
        clone._parameters = {**child._parameters, "weight": torch.nn.Parameter(w, False)}
        clone.__dict__.pop("forward", None)
        return clone
    if isinstance(child, torch.nn.Linear) and name.endswith("_proj"):
        bias = child.bias is not None
        if name == "o_proj":
            return torch.nn.Linear(child.in_features, _PROBE_HIDDEN, bias=bias, device="cpu")
        return torch.nn.Linear(_PROBE_HIDDEN, child.out_features, bias=bias, device="cpu")
    if next(iter(child.parameters()), None) is None and next(iter(child.buffers()), None) is None:
        return child
    raise TypeError(f"no probe stand-in for {name}")


def _probe_copy(module):
    """A shallow copy of the attention module on small CPU children, in eval
    mode, with eager attention (the probe runs on the CPU)."""
    clone = copy.copy(module)
    clone.__dict__.pop("forward", None)
    clone._parameters = {n: None if p is None else torch.nn.Parameter(
        torch.randn(p.shape, device="cpu") * 0.1, False) for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else b.to("cpu") for n, b in module._buffers.items()}
    clone._modules = {n: _probe_child(n, c) for n, c in module._modules.items()}
    clone.training = False
    if getattr(module, "config", None) is not None:
        clone.config = _EagerConfig(module.config)
    return clone


class _EagerConfig:
    """The layer's config as its probe copy reads it: eager attention (which
    runs on the CPU), everything else the config's own (nothing is set on it)."""

    _attn_implementation = "eager"

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def _layer_agrees(module, fn, norms: _Norms) -> bool:
    """Whether the layer's own ``forward`` (fn) computes, on a small CPU copy
    (:func:`_probe_copy`), what it computes with its norms deferred and the
    fused formula (:func:`_fused_expected`) in place of its
    ``apply_rotary_pos_emb``: norms applied to q and k right before the
    rotation, nothing in between, per head or per token as ``norms`` says."""
    try:
        # fork_rng: the copy's layers initialise from torch's global RNG,
        # which patching must leave as the caller had it.
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
            clone = _probe_copy(module)
            g = torch.Generator(device="cpu").manual_seed(0)
            h = torch.randn(2, 5, _PROBE_HIDDEN, generator=g)
            theta = torch.rand(2, 5, module.head_dim // 2, generator=g) * 6
            cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
            args = dict(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
            want = fn(clone, **args)

            def fused(q, k, cos, sin):
                return _fused_expected(q, k, cos, sin, clone.q_norm.weight,
                                       clone.k_norm.weight, norms)

            for name in ("q_norm", "k_norm"):
                clone._modules[name].forward = _deferred_norm
            got = _patched_forward(fn, fused)(clone, **args)
        want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
        return (got.shape == want.shape
                and torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())))
    except Exception:
        return False


def _weights_fit(q, k, q_weight, k_weight, norms: _Norms) -> bool:
    """Whether the kernel takes the layer's weights for q and k as they are
    (the call's other inputs passed :func:`_fits`) and computes what the
    norms do: a weight in q's dtype (or float32 where the norm multiplies in
    float32 anyway), on q's device, 1-D contiguous, of the scope's width."""
    d = q.shape[-1]
    for w, x in ((q_weight, q), (k_weight, k)):
        n = d if norms.scope == "head" else x.shape[1] * d
        if not isinstance(w, torch.Tensor) or w.device != q.device or w.shape != (n,):
            return False
        if w.dtype != q.dtype and not (norms.rounding == "after_weight"
                                       and w.dtype == torch.float32):
            return False
        if w.stride(0) != 1:
            return False
    return q_weight.dtype == k_weight.dtype


def _fused_drop_in(module, rope_drop_in, partial: bool, norms: _Norms):
    """``apply_rotary_pos_emb`` of a fused layer: it receives q and k as
    projected (the layer's norms are deferred) and normalizes and rotates
    them in one :func:`cupy_rope.torch.qk_norm_rope` launch where the call
    fits; otherwise it applies the layer's own norms, then ``rope_drop_in``
    (the kernel's rotation or the model's own function)."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        q_norm, k_norm = module.q_norm, module.k_norm
        if (not args and not kwargs and _fits(q, k, cos, sin, 1, partial)
                and _weights_fit(q, k, q_norm.weight, k_norm.weight, norms)):
            cos_t, sin_t, kw = _tables(q, cos, sin)
            q_out, k_out = _crt.qk_norm_rope(
                q.transpose(1, 2), k.transpose(1, 2), q_norm.weight, k_norm.weight, cos_t,
                sin_t, norm_scope=norms.scope, weight_mode=norms.weight_mode,
                rounding=norms.rounding, eps=norms.eps, **kw)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        q, k = _stock_norm(q_norm, q, norms.scope), _stock_norm(k_norm, k, norms.scope)
        return rope_drop_in(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = rope_drop_in
    return apply_rotary_pos_emb


class _FusedForward:
    """The instance ``forward`` of a fused layer: the class ``forward``'s code
    with ``apply_rotary_pos_emb`` bound to the layer's fused drop-in.

    An object rather than a bound function so that ``copy.deepcopy`` of a
    patched model gives each copy a drop-in reading its own norms' weights
    (a function's globals are shared by its copies).
    """

    def __init__(self, module, fn, rope_drop_in, partial: bool, norms: _Norms):
        self.module, self.fn, self.rope_drop_in = module, fn, rope_drop_in
        self.partial, self.norms = partial, norms
        self.code = _patched_forward(fn, _fused_drop_in(module, rope_drop_in, partial, norms))

    def __call__(self, *args, **kwargs):
        return self.code(self.module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return _FusedForward(copy.deepcopy(self.module, memo), self.fn, self.rope_drop_in,
                             self.partial, self.norms)


setattr(_FusedForward, _MARK, True)


def _patch_layer(module, fn, rope_drop_in, partial: bool) -> None:
    """Give ``module`` its instance forward: fused norms + rope where the
    probe finds the norms (then its q_norm / k_norm defer to the fused call),
    else the rotation alone."""
    norms = _layer_norms(module, fn)
    if norms is None:
        module.forward = types.MethodType(_patched_forward(fn, rope_drop_in), module)
        return
    module.forward = _FusedForward(module, fn, rope_drop_in, partial, norms)
    module.q_norm.forward = _deferred_norm
    module.k_norm.forward = _deferred_norm


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s attention layers rotate q and k with cupy-rope.

    Each attention module whose class ``forward`` calls the global
    ``apply_rotary_pos_emb``, where that function computes the Llama formula
    (see the module docstring), gets an instance ``forward``: the same code
    with that one name bound to a drop-in that runs the kernel where the
    call fits and the model's own function otherwise (its other globals are
    a snapshot of the modeling module's, taken now). Where the layer
    normalizes q and k with ``q_norm`` / ``k_norm`` right before that call
    and the probes reproduce it (module docstring), the drop-in normalizes
    and rotates in one fused launch instead, and the two norms pass their
    input through. Idempotent; other instances of the same classes are not
    affected.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model (or any module holding such attention layers).

    Returns
    -------
    torch.nn.Module
        ``model`` itself, patched.

    Raises
    ------
    ValueError
        When no layer qualifies, naming the functions that are another formula.

    Warns
    -----
    UserWarning
        When every parameter of ``model`` is on the CPU: the patched layers
        run the model's own formula there (the kernels need CUDA tensors).

    Examples
    --------
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)  # doctest: +SKIP
    >>> model = cupy_rope.hf.patch(model.cuda())                    # doctest: +SKIP
    >>> cupy_rope.hf.unpatch(model) is model                        # doctest: +SKIP
    True
    """
    found, other = 0, set()
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), _MARK, False):
            found += 1
            continue
        fn = getattr(type(module), "forward", None)
        code = getattr(fn, "__code__", None)
        if code is None or "apply_rotary_pos_emb" not in code.co_names:
            continue
        orig = fn.__globals__.get("apply_rotary_pos_emb")
        full, partial = _formula(orig) if callable(orig) else (False, False)
        if not full:
            other.add(f"{getattr(orig, '__module__', '?')}.apply_rotary_pos_emb")
            continue
        _patch_layer(module, fn, _drop_in_for(orig, partial), partial)
        found += 1
    if not found:
        why = (f"; {', '.join(sorted(other))} is not the Llama formula (NeoX rotate-half "
               "pairs, q, k, cos, sin arguments)" if other else
               "; assign cupy_rope.hf.apply_rotary_pos_emb to its modeling module instead")
        raise ValueError(f"model: found no attention layer in {type(model).__name__} whose "
                         f"forward calls a Llama-formula apply_rotary_pos_emb{why}")
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if devices and not devices.intersection(_DEVICES):
        warnings.warn("model: every parameter is on the CPU, where the patched layers run the "
                      "model's own formula; cupy-rope's kernels run once the model is on a "
                      "CUDA device", stacklevel=2)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: attention layers and q/k norms use their class ``forward`` again.

    Parameters
    ----------
    model : torch.nn.Module
        A model passed to :func:`patch` (a model never patched is left as it is).

    Returns
    -------
    torch.nn.Module
        ``model`` itself.

    Examples
    --------
    >>> cupy_rope.hf.unpatch(cupy_rope.hf.patch(model)) is model  # doctest: +SKIP
    True
    """
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), _MARK, False):
            del module.forward
    return model
