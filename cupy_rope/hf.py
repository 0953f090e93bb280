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
"""

from __future__ import annotations

import inspect
import types

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


def _rotate(q, k, cos, sin, unsqueeze_dim):
    """q and k rotated on the kernel (the inputs passed :func:`_fits`)."""
    r = cos.shape[-1]
    half = r // 2
    kw = {} if r == q.shape[-1] else {"rotary_dim": r}
    qs, ks = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)  # bshd
    if cos.dim() == 2:
        cos_t, sin_t = cos[:, :half], sin[:, :half]
    elif cos.shape[0] == 1 or cos.stride(0) == 0:
        cos_t, sin_t = cos[0, :, :half], sin[0, :, :half]
    else:
        b, s = cos.shape[0], cos.shape[1]
        cos_t = cos[..., :half].reshape(b * s, half)
        sin_t = sin[..., :half].reshape(b * s, half)
        kw["offsets"] = torch.arange(0, b * s, s, device=q.device, dtype=torch.int64)
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
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    setattr(new, _MARK, True)
    return new


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s attention layers rotate q and k with cupy-rope.

    Each attention module whose class ``forward`` calls the global
    ``apply_rotary_pos_emb``, where that function computes the Llama formula
    (see the module docstring), gets an instance ``forward``: the same code
    with that one name bound to a drop-in that runs the kernel where the
    call fits and the model's own function otherwise (its other globals are
    a snapshot of the modeling module's, taken now). Idempotent; other
    instances of the same classes are not affected.

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
        module.forward = types.MethodType(_patched_forward(fn, _drop_in_for(orig, partial)), module)
        found += 1
    if not found:
        why = (f"; {', '.join(sorted(other))} is not the Llama formula (NeoX rotate-half "
               "pairs, q, k, cos, sin arguments)" if other else
               "; assign cupy_rope.hf.apply_rotary_pos_emb to its modeling module instead")
        raise ValueError(f"model: found no attention layer in {type(model).__name__} whose "
                         f"forward calls a Llama-formula apply_rotary_pos_emb{why}")
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the attention layers use their class ``forward`` again.

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
