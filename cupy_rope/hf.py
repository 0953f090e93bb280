"""Hugging Face ``transformers`` integration: run a model's rotary embedding on cupy-rope.

One line, per model::

    model = cupy_rope.hf.patch(model)        # LlamaForCausalLM, Qwen2ForCausalLM, ...

Every attention layer of ``model`` whose ``forward`` calls the module-level
``apply_rotary_pos_emb`` of its modeling file (Llama, Qwen2, Mistral and the
other Llama-family models written that way) then calls
:func:`apply_rotary_pos_emb` below instead: q and k rotated by one
:func:`cupy_rope.torch.rope_qk` launch, differentiable (its backward is the
same kernel rotating by -theta), traceable by ``torch.compile`` and capturable
in CUDA graphs. Other models and other instances of the same class are not
affected, and :func:`unpatch` restores the stock behaviour. To switch a whole
model family instead (every instance, present and future), assign the
drop-in to the modeling module::

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

Anything else (CPU tensors, a partial rotary width, tables that require grad,
other shapes) falls back to the stock implementation, so patching never
changes what a model can run.
"""

from __future__ import annotations

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


def _fits(q, k, cos, sin, unsqueeze_dim) -> bool:
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
    if cos.dim() == 3:
        return cos.shape[1:] == (s, d) and cos.shape[0] in (1, q.shape[0]) and d % 2 == 0
    return cos.dim() == 2 and cos.shape == (s, d) and d % 2 == 0


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **unused):
    """Drop-in for ``transformers``' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.

    Same arguments and results (``q_embed``, ``k_embed`` with q's and k's
    shapes); see the module docstring for how cos and sin are read.
    """
    if not _fits(q, k, cos, sin, unsqueeze_dim):
        return _stock(q, k, cos, sin, unsqueeze_dim)
    d = q.shape[-1]
    half = d // 2
    qs, ks = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)  # bshd
    kw = {}
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


def _patched_forward(fn):
    """``fn`` (an attention ``forward``) resolving ``apply_rotary_pos_emb`` to ours."""
    g = dict(fn.__globals__)
    g["apply_rotary_pos_emb"] = apply_rotary_pos_emb
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    setattr(new, _MARK, True)
    return new


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s attention layers rotate q and k with cupy-rope; returns ``model``.

    Each attention module whose class ``forward`` calls the global
    ``apply_rotary_pos_emb`` gets an instance ``forward``: the same code
    with that one name bound to :func:`apply_rotary_pos_emb` (its other
    globals are a snapshot of the modeling module's, taken now). Idempotent.
    Raises ``ValueError`` when no such layer is found (then assign the
    drop-in to the modeling module, see the module docstring).
    """
    found = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), _MARK, False):
            found += 1
            continue
        fn = getattr(type(module), "forward", None)
        code = getattr(fn, "__code__", None)
        if code is None or "apply_rotary_pos_emb" not in code.co_names:
            continue
        module.forward = types.MethodType(_patched_forward(fn), module)
        found += 1
    if not found:
        raise ValueError(
            f"model: found no attention layer in {type(model).__name__} whose forward calls "
            "apply_rotary_pos_emb; assign cupy_rope.hf.apply_rotary_pos_emb to its modeling "
            "module instead")
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the attention layers use their class ``forward`` again."""
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), _MARK, False):
            del module.forward
    return model
