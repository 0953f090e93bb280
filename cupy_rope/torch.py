"""PyTorch adapter: autograd, ``torch.compile`` and CUDA-graph friendly RoPE ops.

``import cupy_rope.torch`` (``import cupy_rope`` alone never imports torch)
registers these operators in the ``cupy_rope`` namespace with
:mod:`torch.library`:

- ``rope``: x -> new rotated tensor (its backward: itself with ``backward``
  flipped, i.e. rotation by -theta);
- ``rope_``: x rotated in place (``mutates_args=("x",)``);
- ``rope_qk``: (q, k) -> two new tensors in one launch; ``rope_qk_`` in place;
- ``rope_qkv``: packed qkv -> new (q, k, v) (its backward: ``rope_qkv_backward``);
- ``rope_qkv_backward``: (dq, dk, dv) -> packed dqkv (its backward: ``rope_qkv``);

and wraps them in the Python functions below, which take the keyword
arguments of :func:`cupy_rope.apply_rope` (see ``docs/api.md``):

- :func:`rope` (alias :func:`apply_rope`), :func:`rope_` (in place),
- :func:`rope_qk` (alias :func:`apply_rope_qk`), :func:`rope_qk_` (in place),
- :func:`rope_qkv` (alias :func:`apply_rope_qkv`).

Every op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)``
traces a model that uses them with no graph break, and a backward registered
with ``torch.library.register_autograd``: the gradient of a rotation is the
same op with ``backward=True`` (rotation by -theta); for the fused QKV op the
backward op packs dq, dk, dv back into the layout of the packed input.
Gradients flow to x / q / k / qkv only: the angle sources (``cos``, ``sin``,
``cos_sin_cache``, ``inv_freq``, ``freqs``) are treated as constants.

Per-axis positions (M-RoPE, axial RoPE; ``docs/api.md``): in the operator
schemas ``sections`` and ``sections_interleaved`` are the last two arguments,
``int[]? sections=None, bool sections_interleaved=False``, so positional
calls written for the earlier schemas still work.

Kernels are enqueued on torch's current stream, outputs are allocated with
``torch.empty_like`` / ``torch.empty`` (torch's caching allocator) and passed
to the library as ``out=``, and nothing synchronizes, so the ops can be
captured in a ``torch.cuda.CUDAGraph`` once each specialization has been
compiled (run the op once before capturing, as torch's warm-up rule asks
anyway: NVRTC compilation and module loading cannot happen during capture).

In-place ops and autograd: torch cannot attach a backward formula to an
operator that mutates its input, so :func:`rope_` / :func:`rope_qk_` run the
mutating operator (no new buffer) when no gradient is being recorded for the
inputs, and otherwise compute with the functional operator and ``copy_`` the
result back (one temporary; autograd then sees an ordinary in-place copy).

CPU tensors (float32, float16, bfloat16, float64) run the library's float64
NumPy reference, which is slow but lets the autograd and compile plumbing be
exercised without a GPU; results come back as CPU tensors of the input's dtype.
"""

import functools
import inspect
import operator
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from . import api, validate
from .interop import describe
from .validate import _as_int, check_cu_seqlens

__all__ = ["rope", "rope_", "rope_qk", "rope_qk_", "rope_qkv", "apply_rope", "apply_rope_qk",
           "apply_rope_qkv"]

_NS = "cupy_rope"
_ANGLE_NAMES = ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache", "positions", "offsets",
                "cu_seqlens")
_NT = len(_ANGLE_NAMES)  # optional tensor arguments of every op, after the data tensors
_NSTATIC = 7  # then: offset, layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank
_NAXES = 2  # and, last in every schema: sections, sections_interleaved


# ------------------------------------------------------------ call helpers --
def _library_kwargs(tensors, offset, layout, interleaved, rotary_dim, head_dim, cp_size,
                    cp_rank, sections=None, sections_interleaved=False) -> dict:
    """Keyword arguments for the library call; defaults are left out."""
    kw = {n: t for n, t in zip(_ANGLE_NAMES, tensors) if t is not None}
    if "offsets" not in kw and offset:
        kw["offsets"] = int(offset)
    return api.option_kwargs(kw, layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank,
                             sections, sections_interleaved)


@functools.lru_cache(maxsize=None)
def _named_params(fn) -> frozenset:
    """The explicitly named parameters of a library function."""
    return frozenset(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _call(fn, *args, **kw):
    """``fn(*args, **kw)``; on the GPU make sure this thread has a CUDA context
    (autograd runs backward ops on its own worker threads, which may have
    none yet). CPU tensors go to the library as they are: its NumPy
    reference reads and writes them in place, bfloat16 included."""
    x = args[0]
    if x.device.type != "cpu":
        from cupy.cuda import driver, runtime

        if driver.ctxGetCurrent() == 0:
            runtime.setDevice(x.device.index if x.device.index is not None else 0)
    return fn(*args, **kw)


# The operators all take, after their data tensors, the same optional tensors
# (_ANGLE_NAMES) and the same static arguments (offset, layout, interleaved,
# rotary_dim, head_dim, cp_size, cp_rank); rope and rope_qk then take
# ``backward``, rope_qkv (num_q_heads, num_kv_heads, packing), and
# rope_qkv_backward those and the packed shape; every op ends with the
# per-axis arguments (_AXES, with defaults, so that positional calls of the
# earlier schemas keep working). Everything is positional (register_autograd
# refuses keyword-only tensors).
_COMMON = ("Tensor? cos, Tensor? sin, Tensor? inv_freq, Tensor? freqs, Tensor? cos_sin_cache, "
           "Tensor? positions, Tensor? offsets, Tensor? cu_seqlens, SymInt offset, str layout, "
           "bool interleaved, SymInt? rotary_dim, SymInt? head_dim, SymInt cp_size, "
           "SymInt cp_rank")
_AXES = ", int[]? sections=None, bool sections_interleaved=False"
_AXES_DEFAULTS = {"sections": None, "sections_interleaved": False}


def _kwargs_of(common: tuple, head_dim=True) -> dict:
    """Library keyword arguments from the common op arguments (tensors, statics,
    then the per-axis arguments)."""
    tensors, static = common[:_NT], common[_NT:]
    offset, layout, interleaved, rotary_dim, hd, cp_size, cp_rank, sections, sec_inter = static
    return _library_kwargs(tensors, offset, layout, interleaved, rotary_dim,
                           hd if head_dim else None, cp_size, cp_rank, sections, sec_inter)


def _define(name: str, data: str, extra: str, returns: str, impl, mutates=()):
    """A ``torch.library.custom_op`` with an explicit schema; ``impl`` gets {name: arg}."""
    params = f"{data}, {_COMMON}{extra}{_AXES}"
    schema = f"({params}) -> {returns}"
    names = [p.split("=")[0].split()[-1] for p in params.split(",")]

    def fn(*args):
        # The dispatcher leaves out trailing arguments that the caller did not
        # pass (those with defaults): fill them in.
        return impl({**_AXES_DEFAULTS, **dict(zip(names, args))})

    fn.__name__ = name
    return torch.library.custom_op(f"{_NS}::{name}", fn, mutates_args=mutates, schema=schema)


_ORDER = _ANGLE_NAMES + ("offset", "layout", "interleaved", "rotary_dim", "head_dim", "cp_size",
                         "cp_rank")
_AXES_ORDER = ("sections", "sections_interleaved")


def _common(a: dict) -> tuple:
    """The common arguments, then the per-axis ones (what _kwargs_of takes)."""
    return tuple(a[n] for n in _ORDER + _AXES_ORDER)


# ------------------------------------------------------------ rope (one x) --
def _rope_impl(a):
    out = torch.empty_like(a["x"])
    _call(api.apply_rope, a["x"], out=out, backward=a["backward"], **_kwargs_of(_common(a)))
    return out


def _rope_inplace_impl(a):
    _call(api.apply_rope, a["x"], inplace=True, backward=a["backward"], **_kwargs_of(_common(a)))


_rope_op = _define("rope", "Tensor x", ", bool backward", "Tensor", _rope_impl)
_rope_inplace_op = _define("rope_", "Tensor(a!) x", ", bool backward", "()", _rope_inplace_impl,
                           mutates=("x",))
_rope_op.register_fake(lambda x, *args: torch.empty_like(x))
_rope_inplace_op.register_fake(lambda x, *args: None)


def _save_common(ctx, inputs, n_data, n_extra):
    """Save the angle tensors; keep the statics, the op's own ``n_extra``
    arguments (``ctx.rest``) and the per-axis arguments (``ctx.axes``)."""
    ctx.save_for_backward(*inputs[n_data:n_data + _NT])
    start = n_data + _NT + _NSTATIC
    ctx.static = tuple(inputs[n_data + _NT:start])
    ctx.rest = tuple(inputs[start:start + n_extra])
    axes = tuple(inputs[start + n_extra:start + n_extra + _NAXES])
    ctx.axes = axes + tuple(_AXES_DEFAULTS[n] for n in _AXES_ORDER[len(axes):])


def _rope_setup(ctx, inputs, output):
    _save_common(ctx, inputs, 1, 1)


def _rope_backward(ctx, grad):
    (backward,) = ctx.rest
    dx = torch.ops.cupy_rope.rope(grad, *ctx.saved_tensors, *ctx.static, not backward,
                                  *ctx.axes)
    return (dx,) + (None,) * (_NT + _NSTATIC + 1 + _NAXES)


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


# ----------------------------------------------------------------- q and k --
def _rope_qk_impl(a):
    out_q, out_k = torch.empty_like(a["q"]), torch.empty_like(a["k"])
    _call(api.apply_rope_qk, a["q"], a["k"], out_q=out_q, out_k=out_k, backward=a["backward"],
          **_kwargs_of(_common(a)))
    return out_q, out_k


def _rope_qk_inplace_impl(a):
    _call(api.apply_rope_qk, a["q"], a["k"], inplace=True, backward=a["backward"],
          **_kwargs_of(_common(a)))


_rope_qk_op = _define("rope_qk", "Tensor q, Tensor k", ", bool backward", "(Tensor, Tensor)",
                      _rope_qk_impl)
_rope_qk_inplace_op = _define("rope_qk_", "Tensor(a!) q, Tensor(b!) k", ", bool backward", "()",
                              _rope_qk_inplace_impl, mutates=("q", "k"))
_rope_qk_op.register_fake(lambda q, k, *args: (torch.empty_like(q), torch.empty_like(k)))
_rope_qk_inplace_op.register_fake(lambda q, k, *args: None)


def _rope_qk_setup(ctx, inputs, output):
    _save_common(ctx, inputs, 2, 1)


def _rope_qk_backward(ctx, grad_q, grad_k):
    (backward,) = ctx.rest
    dq, dk = torch.ops.cupy_rope.rope_qk(grad_q, grad_k, *ctx.saved_tensors, *ctx.static,
                                         not backward, *ctx.axes)
    return (dq, dk) + (None,) * (_NT + _NSTATIC + 1 + _NAXES)


_rope_qk_op.register_autograd(_rope_qk_backward, setup_context=_rope_qk_setup)


# --------------------------------------------------------------- fused qkv --
def _qkv_shapes(shape, num_q_heads: int, num_kv_heads: int, head_dim: Optional[int],
                layout: str):
    """(q shape, k/v shape) of a packed [tokens..., (hq + 2 hk) * d | hq + 2 hk, d]."""
    token_ndim = 1 if layout == "thd" else 2
    heads = num_q_heads + 2 * num_kv_heads
    tokens = tuple(shape[:token_ndim])
    if len(shape) == token_ndim + 1:
        d = head_dim if head_dim is not None else shape[-1] // heads
    elif len(shape) == token_ndim + 2:
        d = shape[-1]
    else:
        raise ValueError(f"qkv: expected {token_ndim} token axes then [(hq + 2 hk) * d] or "
                         f"[hq + 2 hk, d] for layout {layout!r}, got shape {list(shape)}")
    return tokens + (num_q_heads, d), tokens + (num_kv_heads, d)


def _rope_qkv_impl(a):
    qkv = a["qkv"]
    hq, hk, packing = a["num_q_heads"], a["num_kv_heads"], a["packing"]
    q_shape, kv_shape = _qkv_shapes(qkv.shape, hq, hk, a["head_dim"], a["layout"])
    kw = _kwargs_of(_common(a))
    kw.update(num_q_heads=hq, num_kv_heads=hk, packing=packing)
    outs = (qkv.new_empty(q_shape), qkv.new_empty(kv_shape), qkv.new_empty(kv_shape))
    _call(api.apply_rope_qkv, qkv, out_q=outs[0], out_k=outs[1], out_v=outs[2], **kw)
    return outs


def _rope_qkv_fake(qkv, *args):
    a = dict(zip(_ORDER + ("num_q_heads", "num_kv_heads", "packing"), args))
    q_shape, kv_shape = _qkv_shapes(qkv.shape, a["num_q_heads"], a["num_kv_heads"],
                                    a["head_dim"], a["layout"])
    return qkv.new_empty(q_shape), qkv.new_empty(kv_shape), qkv.new_empty(kv_shape)


def _rope_qkv_backward_impl(a):
    dq, dk, dv = a["dq"], a["dk"], a["dv"]
    out = dq.new_empty(a["packed_shape"])
    # dq, dk, dv are [.., h, d]: the packed output's shape says the rest (no head_dim).
    kw = _kwargs_of(_common(a), head_dim=False)
    kw["packing"] = a["packing"]
    fn = api.apply_rope_qkv_backward
    named = _named_params(fn)
    for name in ("num_q_heads", "num_kv_heads"):
        if name in named:
            kw[name] = a[name]
    _call(fn, dq, dk, dv, out=out, **kw)
    return out


_QKV_EXTRA = ", SymInt num_q_heads, SymInt num_kv_heads, str packing"
_rope_qkv_op = _define("rope_qkv", "Tensor qkv", _QKV_EXTRA, "(Tensor, Tensor, Tensor)",
                       _rope_qkv_impl)
_rope_qkv_backward_op = _define("rope_qkv_backward", "Tensor dq, Tensor dk, Tensor dv",
                                _QKV_EXTRA + ", SymInt[] packed_shape", "Tensor",
                                _rope_qkv_backward_impl)
_rope_qkv_op.register_fake(_rope_qkv_fake)
# packed_shape follows the common arguments and (num_q_heads, num_kv_heads, packing).
_rope_qkv_backward_op.register_fake(
    lambda dq, dk, dv, *args: dq.new_empty(args[_NT + _NSTATIC + 3]))


def _rope_qkv_setup(ctx, inputs, output):
    _save_common(ctx, inputs, 1, 3)
    ctx.packed_shape = list(inputs[0].shape)


def _rope_qkv_grad(ctx, dq, dk, dv):
    dqkv = torch.ops.cupy_rope.rope_qkv_backward(dq, dk, dv, *ctx.saved_tensors, *ctx.static,
                                                 *ctx.rest, ctx.packed_shape, *ctx.axes)
    return (dqkv,) + (None,) * (_NT + _NSTATIC + 3 + _NAXES)


_rope_qkv_op.register_autograd(_rope_qkv_grad, setup_context=_rope_qkv_setup)


def _rope_qkv_backward_setup(ctx, inputs, output):
    _save_common(ctx, inputs, 3, 4)


def _rope_qkv_backward_grad(ctx, grad):
    # The backward op is linear (rotate by -theta, then pack); its own
    # gradient is the forward op (unpack, then rotate by +theta).
    q, k, v = torch.ops.cupy_rope.rope_qkv(grad, *ctx.saved_tensors, *ctx.static,
                                           *ctx.rest[:3], *ctx.axes)
    return (q, k, v) + (None,) * (_NT + _NSTATIC + 4 + _NAXES)


_rope_qkv_backward_op.register_autograd(_rope_qkv_backward_grad,
                                        setup_context=_rope_qkv_backward_setup)


# -------------------------------------------------------- public functions --
def _op_args(x, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
             layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank) -> tuple:
    """The common positional op arguments from the public keyword arguments,
    checked by the array API's own rules before they meet the op's schema
    (an int is an int, a bool a bool), and refusing angle tensors that ask
    for a gradient: the kernels give none for them (the angles are
    constants), and a silent zero would train learnable frequencies wrongly."""
    offset = 0
    if offsets is not None and not isinstance(offsets, Tensor):
        offsets, offset = None, _as_int(offsets, "offsets")
    options = api.option_kwargs({}, layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    if torch.is_grad_enabled():
        for name, t in zip(_TABLE_ARGS, (cos, sin, inv_freq, freqs, cos_sin_cache)):
            if isinstance(t, Tensor) and t.requires_grad:
                raise ValueError(f"{name}: requires grad, but cupy-rope gives no gradient for "
                                 "the angles (they are constants here); pass it detached, or "
                                 "rotate with torch operations where the angles must learn")
    cp_size = options.get("cp_size", 1)
    cu_seqlens = _cu_seqlens_tensor(cu_seqlens, x, layout, cp_size)
    return (cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens, offset,
            layout, interleaved, options.get("rotary_dim"), options.get("head_dim"),
            cp_size, options.get("cp_rank", 0))


def _cu_seqlens_tensor(cu_seqlens, x, layout, cp_size):
    """cu_seqlens as the ops take them: a tensor. A NumPy array (as the array
    API takes it) has its values checked here on the host, where a device
    copy's could not be without a sync, and is then copied to x's device
    without waiting (the copy is staged from pageable memory at once)."""
    if cu_seqlens is None or isinstance(cu_seqlens, Tensor):
        return cu_seqlens
    if not isinstance(cu_seqlens, np.ndarray):
        raise TypeError("cu_seqlens: expected a torch tensor or a NumPy array (int32 "
                        f"[n_seqs + 1]), got {type(cu_seqlens).__name__}")
    host = torch.from_numpy(np.array(cu_seqlens))  # a copy: the caller may reuse theirs
    if not isinstance(x, Tensor) or x.device.type == "cpu" or layout != "thd":
        return host  # checked by the library, as any host cu_seqlens
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        raise ValueError("cu_seqlens: a NumPy array is copied to the GPU on every call, which "
                         "torch.compile and CUDA-graph capture cannot record; pass a device "
                         "tensor")
    check_cu_seqlens(describe(host, "cu_seqlens"), x.shape[0], cp_size)
    return host.to(x.device, non_blocking=True)


_TABLE_ARGS = ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache")


def _axes_args(sections, sections_interleaved) -> tuple:
    """The per-axis op arguments: (a list of ints, or None; a bool)."""
    if sections is not None:
        try:
            if isinstance(sections, (str, bytes)) or any(isinstance(v, bool) for v in sections):
                raise TypeError
            sections = [operator.index(v) for v in sections]
        except TypeError:
            raise TypeError("sections: expected a sequence of ints (frequencies per position "
                            f"axis), got {sections!r}") from None
    if not isinstance(sections_interleaved, bool):
        raise TypeError("sections_interleaved: expected a bool, got "
                        f"{type(sections_interleaved).__name__}")
    return sections, sections_interleaved


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)



#: The parameters most functions here share, in their docstrings (one text).
_SHARED_PARAMETERS = """cos, sin : torch.Tensor, optional
        Tables [max_position, r/2].
    inv_freq, freqs, cos_sin_cache, positions, offsets, layout, cu_seqlens : optional
        The other angle sources, the positions and the layout, as in
        :func:`cupy_rope.apply_rope` (reference: ``docs/api.md``).
    cp_size, cp_rank, interleaved, rotary_dim, head_dim : optional
        Context parallel rank, pairing style and rotated width, as in
        :func:`cupy_rope.apply_rope`.
    backward : bool, default False
        Rotate by -theta.
    sections, sections_interleaved : optional
        M-RoPE / axial RoPE: frequencies per position axis; ``positions`` is
        then [axes, s], [axes, 1, s] or [axes, b, s] (thd: [axes, t])."""


#: The Raises text of the calls that take the shared parameters.
_RAISES = """Naming the argument, as :func:`cupy_rope.apply_rope` does; also a
        ``ValueError`` for an angle tensor that requires grad (no gradient
        is given for the angles), and a ``TypeError`` for a CPU tensor of a
        dtype the NumPy reference does not take."""


def _shared_doc(f):
    """Fill ``f``'s docstring with :data:`_SHARED_PARAMETERS` and :data:`_RAISES`."""
    for key, text in (("shared_parameters", _SHARED_PARAMETERS), ("raises", _RAISES)):
        f.__doc__ = f.__doc__.replace(f"%({key})s", text)
    return f


@_shared_doc
def rope(x: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, *,
         inv_freq=None, freqs=None, cos_sin_cache=None, positions=None, offsets=None,
         layout: str = "bshd", cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
         interleaved: bool = False, rotary_dim: Optional[int] = None,
         head_dim: Optional[int] = None, backward: bool = False,
         sections: Optional[Sequence[int]] = None, sections_interleaved: bool = False) -> Tensor:
    """Rotated copy of ``x``, differentiable with respect to ``x``.

    The gradient is the same kernel with ``backward`` flipped (rotation by
    -theta); traceable by ``torch.compile(fullgraph=True)`` and capturable in
    a CUDA graph. CPU tensors run the NumPy reference.

    Parameters
    ----------
    x : torch.Tensor
        [b, s, h, d] (bshd), [s, b, h, d] (sbhd) or [t, h, d] (thd); heads may
        be flattened into the last axis where ``head_dim`` is given.
    %(shared_parameters)s

    Returns
    -------
    torch.Tensor
        A new tensor of ``x``'s shape and dtype.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> inv, _ = rope_frequencies(64)
    >>> cos, sin = (torch.from_numpy(t) for t in cos_sin_cache(inv, 128))
    >>> x = torch.randn(2, 128, 8, 64, requires_grad=True)
    >>> y = crt.rope(x, cos, sin)
    >>> y.shape
    torch.Size([2, 128, 8, 64])
    >>> y.sum().backward()                   # x.grad: rotation by -theta
    """
    args = _op_args(x, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
                    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    axes = _axes_args(sections, sections_interleaved)
    return torch.ops.cupy_rope.rope(x, *args, bool(backward), *axes)


@_shared_doc
def rope_(x: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, *,
          inv_freq=None, freqs=None, cos_sin_cache=None, positions=None, offsets=None,
          layout: str = "bshd", cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
          interleaved: bool = False, rotary_dim: Optional[int] = None,
          head_dim: Optional[int] = None, backward: bool = False,
          sections: Optional[Sequence[int]] = None, sections_interleaved: bool = False) -> Tensor:
    """Rotate ``x`` in place and return it (channels past ``rotary_dim`` untouched).

    With autograd recording for ``x``, the result is computed out of place and
    copied back (see the module docstring); otherwise no buffer is allocated.

    Parameters
    ----------
    x : torch.Tensor
        As in :func:`rope`; overwritten.
    %(shared_parameters)s

    Returns
    -------
    torch.Tensor
        ``x`` itself.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> inv, _ = rope_frequencies(64)
    >>> cos, sin = (torch.from_numpy(t) for t in cos_sin_cache(inv, 128))
    >>> x = torch.randn(2, 128, 8, 64)
    >>> crt.rope_(x, cos, sin) is x
    True
    """
    args = _op_args(x, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
                    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    axes = _axes_args(sections, sections_interleaved)
    if _records_grad(x):
        # Out of place copies channels past rotary_dim bit-exact, so copying
        # the whole result back leaves them as they were.
        x.copy_(torch.ops.cupy_rope.rope(x, *args, bool(backward), *axes))
        return x
    torch.ops.cupy_rope.rope_(x, *args, bool(backward), *axes)
    return x


@_shared_doc
def rope_qk(q: Tensor, k: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
            *, inv_freq=None, freqs=None, cos_sin_cache=None, positions=None, offsets=None,
            layout: str = "bshd", cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
            interleaved: bool = False, rotary_dim: Optional[int] = None,
            head_dim: Optional[int] = None, backward: bool = False,
            sections: Optional[Sequence[int]] = None,
            sections_interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Rotated copies of q and k in one launch, differentiable with respect to both.

    Parameters
    ----------
    q : torch.Tensor
        [.., hq, d] in ``layout``.
    k : torch.Tensor
        [.., hk, d], the same tokens (any hk).
    %(shared_parameters)s

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        New tensors of q's and k's shapes.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> inv, _ = rope_frequencies(64)
    >>> cos, sin = (torch.from_numpy(t) for t in cos_sin_cache(inv, 128))
    >>> q, k = torch.randn(2, 128, 8, 64), torch.randn(2, 128, 2, 64)
    >>> [t.shape for t in crt.rope_qk(q, k, cos, sin)]
    [torch.Size([2, 128, 8, 64]), torch.Size([2, 128, 2, 64])]
    """
    if k is None:
        raise validate.none_input("k", alone="cupy_rope.torch.rope")
    args = _op_args(q, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
                    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    axes = _axes_args(sections, sections_interleaved)
    return torch.ops.cupy_rope.rope_qk(q, k, *args, bool(backward), *axes)


@_shared_doc
def rope_qk_(q: Tensor, k: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
             *, inv_freq=None, freqs=None, cos_sin_cache=None, positions=None, offsets=None,
             layout: str = "bshd", cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
             interleaved: bool = False, rotary_dim: Optional[int] = None,
             head_dim: Optional[int] = None, backward: bool = False,
             sections: Optional[Sequence[int]] = None,
             sections_interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Rotate q and k in place in one launch and return ``(q, k)``.

    With autograd recording for q or k, computed out of place and copied back.

    Parameters
    ----------
    q, k : torch.Tensor
        As in :func:`rope_qk`; overwritten.
    %(shared_parameters)s

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``q`` and ``k`` themselves.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> inv, _ = rope_frequencies(64)
    >>> cos, sin = (torch.from_numpy(t) for t in cos_sin_cache(inv, 128))
    >>> q, k = torch.randn(2, 128, 8, 64), torch.randn(2, 128, 2, 64)
    >>> crt.rope_qk_(q, k, cos, sin)[0] is q
    True
    """
    if k is None:
        raise validate.none_input("k", alone="cupy_rope.torch.rope_")
    args = _op_args(q, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
                    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    axes = _axes_args(sections, sections_interleaved)
    if _records_grad(q, k):
        yq, yk = torch.ops.cupy_rope.rope_qk(q, k, *args, bool(backward), *axes)
        q.copy_(yq)
        k.copy_(yk)
        return q, k
    torch.ops.cupy_rope.rope_qk_(q, k, *args, bool(backward), *axes)
    return q, k


@_shared_doc
def rope_qkv(qkv: Tensor, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, *,
             num_q_heads: int, num_kv_heads: int, head_dim: Optional[int] = None,
             packing: str = "concat", inv_freq=None, freqs=None, cos_sin_cache=None,
             positions=None, offsets=None, layout: str = "bshd", cu_seqlens=None,
             cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
             rotary_dim: Optional[int] = None, sections: Optional[Sequence[int]] = None,
             sections_interleaved: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Split a packed projection output into new rotated q, rotated k and v.

    The gradient with respect to ``qkv`` comes back packed like ``qkv``.

    Parameters
    ----------
    qkv : torch.Tensor
        Token axes ([b, s] / [s, b] / [t]) then [(hq + 2 hk) * d] or
        [hq + 2 hk, d].
    cos, sin : torch.Tensor, optional
        Tables [max_position, r/2].
    num_q_heads, num_kv_heads : int
        The numbers of q heads (hq) and of k and v heads (hk).
    head_dim : int, optional
        The head size d, where the heads are flattened and cannot say it.
    packing : {"concat", "grouped"}, default "concat"
        All q heads, then all k, then all v heads; or hk groups of hq/hk q
        heads, one k head and one v head (``docs/api.md``).
    inv_freq, freqs, cos_sin_cache, positions, offsets, layout, cu_seqlens : optional
        The other angle sources, the positions and the layout, as in
        :func:`cupy_rope.apply_rope` (reference: ``docs/api.md``).
    cp_size, cp_rank, interleaved, rotary_dim : optional
        As in :func:`cupy_rope.apply_rope`.
    sections, sections_interleaved : optional
        M-RoPE / axial RoPE, as in :func:`rope`.

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        Contiguous q [.., hq, d], k and v [.., hk, d].

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> inv, _ = rope_frequencies(64)
    >>> cos, sin = (torch.from_numpy(t) for t in cos_sin_cache(inv, 128))
    >>> qkv = torch.randn(2, 128, (8 + 2 * 2) * 64)
    >>> q, k, v = crt.rope_qkv(qkv, cos, sin, num_q_heads=8, num_kv_heads=2)
    >>> q.shape, v.shape
    (torch.Size([2, 128, 8, 64]), torch.Size([2, 128, 2, 64]))
    """
    args = _op_args(qkv, cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens,
                    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank)
    axes = _axes_args(sections, sections_interleaved)
    return torch.ops.cupy_rope.rope_qkv(qkv, *args, int(num_q_heads), int(num_kv_heads),
                                        packing, *axes)


apply_rope = rope
apply_rope_qk = rope_qk
apply_rope_qkv = rope_qkv


# ======================================== q/k RMSNorm + RoPE (issue 31) ==
# ``qk_norm_rope``: (q, k, q_weight, k_weight) -> new (q, k), normalized then
# rotated in one launch (cupy_rope.qk_norm.apply_qk_norm_rope); its backward
# is ``qk_norm_rope_backward`` -> (dq, dk, dq_weight, dk_weight), which needs
# the forward's inputs (the norm is not linear), so q, k and the weights are
# saved. ``qk_norm_rope_`` normalizes and rotates in place. The norm's
# options follow the common arguments, before the per-axis ones.
from . import qk_norm as _qk_norm  # noqa: E402

__all__ += ["qk_norm_rope", "qk_norm_rope_", "apply_qk_norm_rope"]

_NORM_DATA = "Tensor? q_weight, Tensor? k_weight"
_NORM_EXTRA = ", str norm_scope, str weight_mode, str rounding, float eps"
_NORM_ORDER = ("norm_scope", "weight_mode", "rounding", "eps")
_NNORM = len(_NORM_ORDER)


def _norm_kwargs(a: dict) -> dict:
    """Library keyword arguments of a norm op: the rotation's, then the norm's."""
    kw = _kwargs_of(_common(a))
    kw.update((n, a[n]) for n in _NORM_ORDER)
    return kw


def _qk_norm_rope_impl(a):
    out_q, out_k = torch.empty_like(a["q"]), torch.empty_like(a["k"])
    _call(_qk_norm.apply_qk_norm_rope, a["q"], a["k"], a["q_weight"], a["k_weight"],
          out_q=out_q, out_k=out_k, **_norm_kwargs(a))
    return out_q, out_k


def _qk_norm_rope_inplace_impl(a):
    _call(_qk_norm.apply_qk_norm_rope, a["q"], a["k"], a["q_weight"], a["k_weight"],
          inplace=True, **_norm_kwargs(a))


def _qk_norm_rope_backward_impl(a):
    dq, dk = torch.empty_like(a["grad_q"]), torch.empty_like(a["grad_k"])
    _, _, dwq, dwk = _call(_qk_norm.apply_qk_norm_rope_backward, a["grad_q"], a["grad_k"],
                           a["q"], a["k"], a["q_weight"], a["k_weight"], out_q=dq, out_k=dk,
                           **_norm_kwargs(a))
    if dwq is None:  # weight_mode "none": the schema returns tensors, so empty ones
        dwq, dwk = dq.new_empty(0), dq.new_empty(0)
    return dq, dk, dwq, dwk


def _weight_grads_fake(grad_q, q_weight, k_weight):
    if q_weight is None:
        return grad_q.new_empty(0), grad_q.new_empty(0)
    return torch.empty_like(q_weight), torch.empty_like(k_weight)


_qk_norm_rope_op = _define("qk_norm_rope", f"Tensor q, Tensor k, {_NORM_DATA}", _NORM_EXTRA,
                           "(Tensor, Tensor)", _qk_norm_rope_impl)
_qk_norm_rope_inplace_op = _define("qk_norm_rope_", f"Tensor(a!) q, Tensor(b!) k, {_NORM_DATA}",
                                   _NORM_EXTRA, "()", _qk_norm_rope_inplace_impl,
                                   mutates=("q", "k"))
_qk_norm_rope_backward_op = _define(
    "qk_norm_rope_backward", f"Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, {_NORM_DATA}",
    _NORM_EXTRA, "(Tensor, Tensor, Tensor, Tensor)", _qk_norm_rope_backward_impl)
_qk_norm_rope_op.register_fake(lambda q, k, *args: (torch.empty_like(q), torch.empty_like(k)))
_qk_norm_rope_inplace_op.register_fake(lambda q, k, *args: None)
_qk_norm_rope_backward_op.register_fake(
    lambda grad_q, grad_k, q, k, q_weight, k_weight, *args:
    (torch.empty_like(grad_q), torch.empty_like(grad_k))
    + _weight_grads_fake(grad_q, q_weight, k_weight))


def _qk_norm_rope_setup(ctx, inputs, output):
    """Save q, k, the weights and the angle tensors; keep the statics, the
    norm's options and the per-axis arguments."""
    ctx.save_for_backward(*inputs[:4 + _NT])
    start = 4 + _NT + _NSTATIC
    ctx.static = tuple(inputs[4 + _NT:start])
    ctx.norm = tuple(inputs[start:start + _NNORM])
    axes = tuple(inputs[start + _NNORM:start + _NNORM + _NAXES])
    ctx.axes = axes + tuple(_AXES_DEFAULTS[n] for n in _AXES_ORDER[len(axes):])


def _qk_norm_rope_grad(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, *angles = ctx.saved_tensors
    dq, dk, dwq, dwk = torch.ops.cupy_rope.qk_norm_rope_backward(
        grad_q, grad_k, q, k, q_weight, k_weight, *angles, *ctx.static, *ctx.norm, *ctx.axes)
    if q_weight is None:
        dwq = dwk = None
    return (dq, dk, dwq, dwk) + (None,) * (_NT + _NSTATIC + _NNORM + _NAXES)


_qk_norm_rope_op.register_autograd(_qk_norm_rope_grad, setup_context=_qk_norm_rope_setup)


def _norm_op_args(q, k, q_weight, k_weight, angles: dict, norm: dict) -> tuple:
    """Positional op arguments after q and k: the weights, the rotation's
    arguments (checked as :func:`rope_qk` checks them), the norm's options
    (checked by the library's own rules, so that a bad value is named before
    it meets the schema) and the per-axis arguments."""
    for t, name in ((q, "q"), (k, "k")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if torch.compiler.is_compiling():
        # Traced: the library checks the values when the op runs (its check
        # uses NumPy, which dynamo does not trace); the schema checks the types.
        options = tuple(norm[n] for n in _NORM_ORDER)
    else:
        options = _qk_norm.check_norm(**norm)
    args = _op_args(q, *(angles[n] for n in _ANGLE_NAMES), angles["layout"],
                    angles["interleaved"], angles["rotary_dim"], angles["head_dim"],
                    angles["cp_size"], angles["cp_rank"])
    axes = _axes_args(angles["sections"], angles["sections_interleaved"])
    return (q_weight, k_weight, *args, *options, *axes)


#: The norm's parameters of :func:`qk_norm_rope` and :func:`qk_norm_rope_`.
_NORM_PARAMETERS = """q_weight, k_weight : torch.Tensor, optional
        1-D [d] (``norm_scope="head"``) or [hq * d] and [hk * d]
        (``"token"``), of one dtype, on q's device; both None for
        ``weight_mode="none"``. Gradients flow to them.
    cos, sin : torch.Tensor, optional
        Tables [max_position, r/2].
    inv_freq, freqs, cos_sin_cache, positions, offsets, layout, cu_seqlens, \
cp_size, cp_rank, interleaved, rotary_dim, head_dim, sections, sections_interleaved : optional
        The rotation's arguments, as in :func:`rope_qk` (``docs/api.md``).
    eps : float, default 1e-6
        Added to the mean square (the module's ``variance_epsilon`` / ``eps``).
    norm_scope : {"head", "token"}, default "head"
        Normalize each head (Qwen3, Gemma 3) or all heads of a token (OLMo 2).
    weight_mode : {"w", "1+w", "none"}, default "w"
        x_hat * w, x_hat * (1 + w) (Gemma), or no weight.
    rounding : {"before_weight", "after_weight"}, default "before_weight"
        Round x_hat to q's dtype before the weight (Llama, Qwen3) or once
        after it (Gemma, OLMo 2's ``(w * x_hat).to(dtype)``)."""


def _norm_doc(f):
    """Fill ``f``'s docstring with :data:`_NORM_PARAMETERS`."""
    f.__doc__ = f.__doc__ % {"norm_parameters": _NORM_PARAMETERS}
    return f


@_norm_doc
def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Optional[Tensor] = None,
                 k_weight: Optional[Tensor] = None, cos: Optional[Tensor] = None,
                 sin: Optional[Tensor] = None, *, inv_freq=None, freqs=None,
                 cos_sin_cache=None, positions=None, offsets=None, layout: str = "bshd",
                 cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                 rotary_dim: Optional[int] = None, head_dim: Optional[int] = None,
                 sections: Optional[Sequence[int]] = None, sections_interleaved: bool = False,
                 eps: float = 1e-6, norm_scope: str = "head", weight_mode: str = "w",
                 rounding: str = "before_weight") -> Tuple[Tensor, Tensor]:
    """RMSNorm of q and k, then their rotation, in one launch; differentiable
    with respect to q, k and both weights.

    The math of :func:`cupy_rope.apply_qk_norm_rope`: per row, x_hat = x /
    sqrt(mean(x^2) + eps) in fp32, times the weight, rounded as ``rounding``
    says, then rotated; channels past ``rotary_dim`` are normalized, not
    rotated. The backward is one launch of
    :func:`cupy_rope.apply_qk_norm_rope_backward` (the weight gradients are
    reduced over tokens deterministically). Traceable by
    ``torch.compile(fullgraph=True)`` and capturable in a CUDA graph; CPU
    tensors run the NumPy reference.

    Parameters
    ----------
    q : torch.Tensor
        [.., hq, d] in ``layout`` (heads may be flattened where ``head_dim``
        is given).
    k : torch.Tensor
        [.., hk, d] on q's token axes, q's dtype.
    %(norm_parameters)s

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        New tensors of q's and k's shapes and dtype.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, as :func:`cupy_rope.apply_qk_norm_rope` does
        (a weight of the wrong shape, dtype or device, eps <= 0, an unknown
        option, a weight given for ``weight_mode="none"``); also a
        ``ValueError`` for an angle tensor that requires grad.

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> q, k = torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64)
    >>> wq = torch.ones(64, requires_grad=True)
    >>> wk = torch.ones(64, requires_grad=True)
    >>> inv = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    >>> q2, k2 = crt.qk_norm_rope(q, k, wq, wk, inv_freq=inv, eps=1e-6)
    >>> (q2.sum() + k2.sum()).backward()           # wq.grad, wk.grad: [64]
    >>> wq.grad.shape
    torch.Size([64])
    """
    args = _norm_op_args(q, k, q_weight, k_weight, dict(
        cos=cos, sin=sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
        positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, layout=layout,
        interleaved=interleaved, rotary_dim=rotary_dim, head_dim=head_dim, cp_size=cp_size,
        cp_rank=cp_rank, sections=sections, sections_interleaved=sections_interleaved),
        dict(norm_scope=norm_scope, weight_mode=weight_mode, rounding=rounding, eps=eps))
    return torch.ops.cupy_rope.qk_norm_rope(q, k, *args)


@_norm_doc
def qk_norm_rope_(q: Tensor, k: Tensor, q_weight: Optional[Tensor] = None,
                  k_weight: Optional[Tensor] = None, cos: Optional[Tensor] = None,
                  sin: Optional[Tensor] = None, *, inv_freq=None, freqs=None,
                  cos_sin_cache=None, positions=None, offsets=None, layout: str = "bshd",
                  cu_seqlens=None, cp_size: int = 1, cp_rank: int = 0,
                  interleaved: bool = False, rotary_dim: Optional[int] = None,
                  head_dim: Optional[int] = None, sections: Optional[Sequence[int]] = None,
                  sections_interleaved: bool = False, eps: float = 1e-6,
                  norm_scope: str = "head", weight_mode: str = "w",
                  rounding: str = "before_weight") -> Tuple[Tensor, Tensor]:
    """Normalize and rotate q and k in place in one launch and return ``(q, k)``.

    Every channel is overwritten (the norm changes channels past
    ``rotary_dim`` too). With autograd recording for q, k or a weight, the
    result is computed out of place from copies of q and k (the backward
    needs the inputs, which the write would destroy) and copied back;
    otherwise no buffer is allocated.

    Parameters
    ----------
    q, k : torch.Tensor
        As in :func:`qk_norm_rope`; overwritten.
    %(norm_parameters)s

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``q`` and ``k`` themselves.

    Raises
    ------
    TypeError, ValueError
        As :func:`qk_norm_rope`; nothing is written then.

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> q, k = torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64)
    >>> w = torch.ones(64)
    >>> inv = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    >>> crt.qk_norm_rope_(q, k, w, w, inv_freq=inv)[0] is q
    True
    """
    args = _norm_op_args(q, k, q_weight, k_weight, dict(
        cos=cos, sin=sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
        positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, layout=layout,
        interleaved=interleaved, rotary_dim=rotary_dim, head_dim=head_dim, cp_size=cp_size,
        cp_rank=cp_rank, sections=sections, sections_interleaved=sections_interleaved),
        dict(norm_scope=norm_scope, weight_mode=weight_mode, rounding=rounding, eps=eps))
    if _records_grad(q, k, *(w for w in (q_weight, k_weight) if isinstance(w, Tensor))):
        yq, yk = torch.ops.cupy_rope.qk_norm_rope(q.clone(), k.clone(), *args)
        q.copy_(yq)
        k.copy_(yk)
        return q, k
    torch.ops.cupy_rope.qk_norm_rope_(q, k, *args)
    return q, k


apply_qk_norm_rope = qk_norm_rope


# ------------------------------------------------ rope + KV-cache write --
# Issue 32's ops (cupy_rope.kv_cache): rotate q and k and store the rotated
# k and v at their cache slots, in one launch. After their data tensors
# they take the common arguments, then the cache options (_CACHE_EXTRA).
# A per-tensor FP8 scale is a tensor (device-resident: a replayed CUDA graph
# reads its current value) or a float (a constant of the call); each has a
# schema slot of its own, since a schema argument has one type. No backward
# is registered: these are inference ops (a cache write has no gradient).
# The per-head q/k RMSNorm's weights and options follow (issue 32 item 6),
# with defaults (_CACHE_NORM_DEFAULTS), so that positional calls of the
# schema without them keep working.
_CACHE_EXTRA = (", str cache_layout, str? cache_dtype, Tensor? k_scale, Tensor? v_scale, "
                "Tensor? q_scale, float? k_scale_value, float? v_scale_value, "
                "float? q_scale_value, ScalarType? q_dtype, Tensor? q_weight=None, "
                "Tensor? k_weight=None, float eps=1e-06, str? weight_mode=None, "
                "str rounding=\"before_weight\"")
_CACHE_NORM_DEFAULTS = {"q_weight": None, "k_weight": None, "eps": 1e-6, "weight_mode": None,
                        "rounding": "before_weight"}
_CACHE_NAMES = ("cache_layout", "cache_dtype", "k_scale", "v_scale", "q_scale", "k_scale_value",
                "v_scale_value", "q_scale_value", "q_dtype", "q_weight", "k_weight", "eps",
                "weight_mode", "rounding")
_HEADS_EXTRA = ", SymInt num_q_heads, SymInt num_kv_heads"


def _cache_kwargs(a: dict) -> dict:
    """Library keyword arguments of a cache op: the common ones, the layout
    always (the library's default, thd, is not the schema's bshd), the cache
    options and whichever form of each scale was given."""
    kw = _kwargs_of(_common(a))
    kw.update(layout=a["layout"], cache_layout=a["cache_layout"])
    kw.update({n: a.get(n, v) for n, v in _CACHE_NORM_DEFAULTS.items()})
    if a["cache_dtype"] is not None:
        kw["cache_dtype"] = a["cache_dtype"]
    for name in ("k_scale", "v_scale", "q_scale"):
        value = a[name] if a[name] is not None else a[name + "_value"]
        if value is not None:
            kw[name] = value
    return kw


def _new_q(like: Tensor, shape, q_dtype) -> Tensor:
    """The rotated q's new tensor: q's dtype, or an FP8 ``q_dtype``."""
    return like.new_empty(shape, dtype=like.dtype if q_dtype is None else q_dtype)


def _rope_and_cache_impl(a):
    from . import kv_cache

    out_q = _new_q(a["q"], a["q"].shape, a["q_dtype"])
    _call(kv_cache.apply_rope_and_cache, a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"],
          a["slot_mapping"], out_q=out_q, **_cache_kwargs(a))
    return out_q


def _rope_and_cache_inplace_impl(a):
    from . import kv_cache

    _call(kv_cache.apply_rope_and_cache, a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"],
          a["slot_mapping"], inplace=True, **_cache_kwargs(a))


def _qkv_q_shape(a) -> tuple:
    return _qkv_shapes(a["qkv"].shape, a["num_q_heads"], a["num_kv_heads"], a["head_dim"],
                       a["layout"])[0]


def _qkv_rope_and_cache_impl(a):
    from . import kv_cache

    out_q = _new_q(a["qkv"], _qkv_q_shape(a), a["q_dtype"])
    _call(kv_cache.apply_qkv_rope_and_cache, a["qkv"], a["k_cache"], a["v_cache"],
          a["slot_mapping"], out_q=out_q, num_q_heads=a["num_q_heads"],
          num_kv_heads=a["num_kv_heads"], **_cache_kwargs(a))
    return out_q


def _qkv_rope_and_cache_inplace_impl(a):
    from . import kv_cache

    _call(kv_cache.apply_qkv_rope_and_cache, a["qkv"], a["k_cache"], a["v_cache"],
          a["slot_mapping"], inplace=True, num_q_heads=a["num_q_heads"],
          num_kv_heads=a["num_kv_heads"], **_cache_kwargs(a))


_CACHE_DATA = "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping"
_rope_and_cache_op = _define("rope_and_cache", "Tensor q, Tensor k, Tensor v, " + _CACHE_DATA,
                             _CACHE_EXTRA, "Tensor", _rope_and_cache_impl,
                             mutates=("k_cache", "v_cache"))
_rope_and_cache_inplace_op = _define(
    "rope_and_cache_", "Tensor(a!) q, Tensor k, Tensor v, " + _CACHE_DATA, _CACHE_EXTRA, "()",
    _rope_and_cache_inplace_impl, mutates=("q", "k_cache", "v_cache"))
_qkv_rope_and_cache_op = _define("qkv_rope_and_cache", "Tensor qkv, " + _CACHE_DATA,
                                 _HEADS_EXTRA + _CACHE_EXTRA, "Tensor",
                                 _qkv_rope_and_cache_impl, mutates=("k_cache", "v_cache"))
_qkv_rope_and_cache_inplace_op = _define(
    "qkv_rope_and_cache_", "Tensor(a!) qkv, " + _CACHE_DATA, _HEADS_EXTRA + _CACHE_EXTRA, "()",
    _qkv_rope_and_cache_inplace_impl, mutates=("qkv", "k_cache", "v_cache"))


def _cache_fake_args(n_data: int, extra: tuple, args: tuple) -> dict:
    """{name: arg} of a cache op's arguments after its ``n_data`` data tensors."""
    return dict(zip(_ORDER + extra + _CACHE_NAMES, args[n_data - 1:]))


@_rope_and_cache_op.register_fake
def _rope_and_cache_fake(q, *args):
    return _new_q(q, q.shape, _cache_fake_args(6, (), args)["q_dtype"])


@_qkv_rope_and_cache_op.register_fake
def _qkv_rope_and_cache_fake(qkv, *args):
    a = _cache_fake_args(4, ("num_q_heads", "num_kv_heads"), args)
    a["qkv"] = qkv
    return _new_q(qkv, _qkv_q_shape(a), a["q_dtype"])


_rope_and_cache_inplace_op.register_fake(lambda *args: None)
_qkv_rope_and_cache_inplace_op.register_fake(lambda *args: None)


def _scale_args(scale, name: str) -> tuple:
    """(tensor, float) schema slots of a scale: a tensor, a number, or None."""
    if scale is None or isinstance(scale, Tensor):
        return scale, None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"{name}: expected a float or a 1-element float32 tensor, got "
                        f"{type(scale).__name__}")
    return None, float(scale)


def _in_place(inplace, q_dtype) -> bool:
    """The ``inplace`` flag, checked (an in-place q keeps its dtype)."""
    if validate._as_bool(inplace, "inplace") and q_dtype is not None:
        raise ValueError("q_dtype: only for a new q; with inplace=True q keeps its dtype")
    return bool(inplace)


def _cache_op_args(x, angles: dict, cache: dict) -> tuple:
    """The common op arguments (checked as the other ops' are), then the cache
    options in schema order, from the public keyword arguments."""
    common = _op_args(x, *(angles[n] for n in ("cos", "sin", "inv_freq", "freqs",
                                              "cos_sin_cache", "positions", "offsets",
                                              "cu_seqlens", "layout", "interleaved",
                                              "rotary_dim", "head_dim")), 1, 0)
    for name, optional in (("cache_layout", False), ("cache_dtype", True)):
        value = cache[name]
        if not isinstance(value, str) and not (optional and value is None):
            raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    q_dtype = cache["q_dtype"]
    if q_dtype is not None and not isinstance(q_dtype, torch.dtype):
        raise TypeError(f"q_dtype: expected a torch.dtype or None, got {type(q_dtype).__name__}")
    tensors, values = zip(*(_scale_args(cache[n], n) for n in ("k_scale", "v_scale", "q_scale")))
    return common + (cache["cache_layout"], cache["cache_dtype"], *tensors, *values, q_dtype,
                     *_norm_args(cache))


def _norm_args(cache: dict) -> tuple:
    """The norm's schema arguments (q_weight, k_weight, eps, weight_mode,
    rounding), type-checked for the schema; their values are checked by
    the library (cupy_rope.kv_cache.check_cache_norm)."""
    for name in ("q_weight", "k_weight"):
        if cache[name] is not None and not isinstance(cache[name], Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got "
                            f"{type(cache[name]).__name__}")
    eps = cache["eps"]
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer,
                                                                 np.floating)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    for name, optional in (("weight_mode", True), ("rounding", False)):
        value = cache[name]
        if not isinstance(value, str) and not (optional and value is None):
            raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    return (cache["q_weight"], cache["k_weight"], float(eps), cache["weight_mode"],
            cache["rounding"])


#: The parameters of the cache functions, in their docstrings (one text).
_CACHE_PARAMETERS = """k_cache, v_cache : torch.Tensor
        [num_blocks, block_size, hk, d] (``cache_layout="NHD"``) or
        [num_blocks, hk, block_size, d] (``"HND"``), q's dtype or FP8
        (``torch.float8_e4m3fn`` / ``float8_e5m2``); written at the slots.
    slot_mapping : torch.Tensor
        int32/int64 [t] (thd) or [b, s]: slot = block * block_size + offset
        of each token; a negative slot marks a padding token (nothing is
        written for it). CPU slots are checked (in range, distinct); device
        slots are not read on the host: the kernel skips those out of range.
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, cu_seqlens : optional
        The angle sources and positions, as in :func:`cupy_rope.apply_rope`
        (reference: ``docs/api.md``).
    layout : {"thd", "bshd", "sbhd"}, default "thd"
        Token axes of q, k and v.
    interleaved, rotary_dim, head_dim : optional
        Pairing style and rotated width, as in :func:`cupy_rope.apply_rope`;
        the tail channels of k and v are cached unrotated.
    cache_layout : {"NHD", "HND"}, default "NHD"
        Axis order of the caches.
    cache_dtype : {"float8_e4m3fn", "float8_e5m2"}, optional
        The FP8 format of caches given as uint8 storage.
    k_scale, v_scale : float or torch.Tensor, optional
        FP8 caches only (required then): stored = x / scale, saturated to
        the format's finite range, round to nearest even. A float in
        [2^-32, 2^32], or a 1-element float32 tensor on q's device (read by
        the kernel, so a replayed CUDA graph uses its current value; outside
        those bounds the written codes are NaN).
    q_dtype : torch.dtype, optional
        Out of place only: an FP8 dtype returns q in it (with ``q_scale``),
        for FP8 attention.
    q_scale : float or torch.Tensor, optional
        The scale of an FP8 ``q_dtype``.
    inplace : bool, default False
        Rotate q in place (its tail channels untouched, unless normalized)
        instead of returning a new tensor.
    q_weight, k_weight : torch.Tensor, optional
        The per-head q/k RMSNorm applied before the rotation (Qwen3, Gemma
        3), as :func:`cupy_rope.torch.qk_norm_rope` with norm_scope "head":
        [d] each, one float dtype, on q's device; v is cached as it is.
    eps : float, default 1e-6
        Added to the mean square (with the norm).
    weight_mode : {None, "w", "1+w", "none"}, default None
        None: no norm without weights, "w" with both; "none": a weightless
        RMS norm.
    rounding : {"before_weight", "after_weight"}, default "before_weight"
        Where the normalized value is rounded to q's dtype (Qwen3: before)."""


def _cache_doc(f):
    """Fill ``f``'s docstring with :data:`_CACHE_PARAMETERS`."""
    f.__doc__ = f.__doc__ % {"cache_parameters": _CACHE_PARAMETERS}
    return f


@_cache_doc
def rope_and_cache(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor, cos: Optional[Tensor] = None,
                   sin: Optional[Tensor] = None, *, inv_freq=None, freqs=None,
                   cos_sin_cache=None, positions=None, offsets=None, layout: str = "thd",
                   cu_seqlens=None, interleaved: bool = False, rotary_dim: Optional[int] = None,
                   head_dim: Optional[int] = None, cache_layout: str = "NHD",
                   cache_dtype: Optional[str] = None, k_scale=None, v_scale=None,
                   q_scale=None, q_dtype: Optional[torch.dtype] = None,
                   inplace: bool = False, q_weight: Optional[Tensor] = None,
                   k_weight: Optional[Tensor] = None, eps: float = 1e-6,
                   weight_mode: Optional[str] = None, rounding: str = "before_weight") -> Tensor:
    """Rotate q and k and write the rotated k and v into a paged KV cache, in one launch.

    The torch op ``cupy_rope::rope_and_cache`` (``rope_and_cache_`` in
    place) of :func:`cupy_rope.kv_cache.apply_rope_and_cache`: it declares
    the caches (and q in place) mutated and has a fake implementation, so
    ``torch.compile(fullgraph=True)`` traces it and a CUDA graph captures it
    (run it once before capturing; new positions and slots are copied into
    the captured tensors before a replay). No gradient: an inference op.

    Parameters
    ----------
    q : torch.Tensor
        [t, hq, d] (thd) or [b, s, hq, d] / [s, b, hq, d]; heads may be
        flattened with ``head_dim``.
    k, v : torch.Tensor
        [.., hk, d] on q's token axes, q's dtype; only read.
    %(cache_parameters)s

    Returns
    -------
    torch.Tensor
        The rotated q: a new tensor of q's shape (dtype ``q_dtype`` or q's),
        or q itself (``inplace=True``).

    Raises
    ------
    TypeError, ValueError
        Naming the argument, as :func:`cupy_rope.kv_cache.apply_rope_and_cache`
        does; nothing is written then.

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> t, hq, hk, d = 3, 4, 2, 64
    >>> q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    >>> k_cache, v_cache = torch.zeros(8, 16, hk, d), torch.zeros(8, 16, hk, d)
    >>> inv = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    >>> q_rot = crt.rope_and_cache(q, k, v, k_cache, v_cache, torch.tensor([16, 17, -1]),
    ...                            inv_freq=inv, positions=torch.tensor([0, 1, 2]))
    >>> torch.equal(v_cache[1, :2], v[:2]), bool((v_cache[1, 2:] == 0).all())
    (True, True)
    """
    args = _cache_op_args(q, dict(
        cos=cos, sin=sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
        positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, layout=layout,
        interleaved=interleaved, rotary_dim=rotary_dim, head_dim=head_dim), dict(
        cache_layout=cache_layout, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
        q_scale=q_scale, q_dtype=q_dtype, q_weight=q_weight, k_weight=k_weight, eps=eps,
        weight_mode=weight_mode, rounding=rounding))
    if _in_place(inplace, q_dtype):
        torch.ops.cupy_rope.rope_and_cache_(q, k, v, k_cache, v_cache, slot_mapping, *args)
        return q
    return torch.ops.cupy_rope.rope_and_cache(q, k, v, k_cache, v_cache, slot_mapping, *args)


@_cache_doc
def qkv_rope_and_cache(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                       cos: Optional[Tensor] = None, sin: Optional[Tensor] = None, *,
                       num_q_heads: int, num_kv_heads: int, head_dim: Optional[int] = None,
                       inv_freq=None, freqs=None, cos_sin_cache=None, positions=None,
                       offsets=None, layout: str = "thd", cu_seqlens=None,
                       interleaved: bool = False, rotary_dim: Optional[int] = None,
                       cache_layout: str = "NHD", cache_dtype: Optional[str] = None,
                       k_scale=None, v_scale=None, q_scale=None,
                       q_dtype: Optional[torch.dtype] = None, inplace: bool = False,
                       q_weight: Optional[Tensor] = None, k_weight: Optional[Tensor] = None,
                       eps: float = 1e-6, weight_mode: Optional[str] = None,
                       rounding: str = "before_weight") -> Tensor:
    """:func:`rope_and_cache` from a packed projection: split, rotate and store in one launch.

    The torch op ``cupy_rope::qkv_rope_and_cache`` (``qkv_rope_and_cache_``
    in place) of :func:`cupy_rope.kv_cache.apply_qkv_rope_and_cache`.

    Parameters
    ----------
    qkv : torch.Tensor
        Token axes ([t] thd, [b, s] / [s, b]) then [(hq + 2 hk) * d] or
        [hq + 2 hk, d]: q's heads, then k's, then v's; only read unless
        ``inplace=True`` (q's part rotated in place).
    num_q_heads, num_kv_heads : int
        hq and hk.
    head_dim : int, optional
        d, where the heads are flattened (default: the width over hq + 2 hk).
    %(cache_parameters)s

    Returns
    -------
    torch.Tensor
        The rotated q [.., hq, d]: a new tensor, or (``inplace=True``) a
        view of q's part of ``qkv``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, as
        :func:`cupy_rope.kv_cache.apply_qkv_rope_and_cache` does; nothing is
        written then.

    Examples
    --------
    >>> import torch, cupy_rope.torch as crt
    >>> t, hq, hk, d = 3, 4, 2, 64
    >>> qkv = torch.randn(t, (hq + 2 * hk) * d)
    >>> k_cache, v_cache = torch.zeros(8, hk, 16, d), torch.zeros(8, hk, 16, d)
    >>> inv = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    >>> q = crt.qkv_rope_and_cache(qkv, k_cache, v_cache, torch.tensor([0, 1, 2]),
    ...                            inv_freq=inv, positions=torch.tensor([5, 6, 7]),
    ...                            num_q_heads=hq, num_kv_heads=hk, cache_layout="HND")
    >>> q.shape, torch.equal(v_cache[0, :, 2], qkv[2, (hq + hk) * d:].view(hk, d))
    (torch.Size([3, 4, 64]), True)
    """
    hq = validate._as_int(num_q_heads, "num_q_heads")
    hk = validate._as_int(num_kv_heads, "num_kv_heads")
    args = _cache_op_args(qkv, dict(
        cos=cos, sin=sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
        positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, layout=layout,
        interleaved=interleaved, rotary_dim=rotary_dim, head_dim=head_dim), dict(
        cache_layout=cache_layout, cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale,
        q_scale=q_scale, q_dtype=q_dtype, q_weight=q_weight, k_weight=k_weight, eps=eps,
        weight_mode=weight_mode, rounding=rounding))
    heads = args[:_NT + _NSTATIC] + (hq, hk) + args[_NT + _NSTATIC:]
    if not _in_place(inplace, q_dtype):
        return torch.ops.cupy_rope.qkv_rope_and_cache(qkv, k_cache, v_cache, slot_mapping,
                                                      *heads)
    torch.ops.cupy_rope.qkv_rope_and_cache_(qkv, k_cache, v_cache, slot_mapping, *heads)
    q_shape, _ = _qkv_shapes(qkv.shape, hq, hk, args[_NT + 4], layout)
    if qkv.dim() < len(q_shape):  # heads flattened: splitting the last axis is a view
        qkv = qkv.unflatten(-1, (hq + 2 * hk, q_shape[-1]))
    return qkv[..., :hq, :]


apply_rope_and_cache = rope_and_cache
apply_qkv_rope_and_cache = qkv_rope_and_cache
__all__ += ["rope_and_cache", "qkv_rope_and_cache", "apply_rope_and_cache",
            "apply_qkv_rope_and_cache"]
