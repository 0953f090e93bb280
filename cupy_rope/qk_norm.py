"""Fused q/k RMSNorm + RoPE: :func:`apply_qk_norm_rope`, its backward and the
packed-projection form :func:`apply_qkv_norm_rope`.

Each call normalizes the rows of q and k (one head, or all heads of a
token), applies the weight, then rotates as :func:`cupy_rope.apply_rope_qk`
does, in one pass (``docs/api.md``, "q/k RMSNorm + RoPE"). The rotation's
arguments are described and validated by :mod:`cupy_rope.validate` exactly
as for the RoPE calls; this module adds the norm's options and weights, then
computes on the NumPy float64 reference (host arrays) or launches through
:mod:`cupy_rope.norm_launch` (device arrays).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import api, interop, launch, reference, validate
from .validate import NormOptions, Options, Slab, fmt_shape, type_name

NORM_SCOPES = ("head", "token")
WEIGHT_MODES = ("w", "1+w", "none")
ROUNDINGS = ("before_weight", "after_weight")
WEIGHT_NAMES = ("q_weight", "k_weight")
WEIGHT_GRAD_NAMES = ("dq_weight", "dk_weight")


# ------------------------------------------------------------ validation --
def check_norm(norm_scope="head", weight_mode="w", rounding="before_weight",
               eps=1e-6) -> NormOptions:
    """The norm's options, checked.

    Parameters
    ----------
    norm_scope : {"head", "token"}
        Normalize each head's d channels, or all h * d channels of a token.
    weight_mode : {"w", "1+w", "none"}
        Multiply by the weight, by 1 + weight (Gemma), or by nothing.
    rounding : {"before_weight", "after_weight"}
        Where the result is rounded to the input's dtype (docs/api.md).
    eps : float
        Added to the mean square; finite, > 0 and > 0 in float32 (the
        kernels add it in fp32).

    Returns
    -------
    cupy_rope.validate.NormOptions
        With ``eps`` a Python float.

    Raises
    ------
    ValueError
        A value outside its set, or a bad ``eps``, naming the argument.
    TypeError
        A non-number ``eps``.

    Examples
    --------
    >>> check_norm("token", "1+w", "after_weight", 1e-5).scope
    'token'
    """
    for value, name, allowed in ((norm_scope, "norm_scope", NORM_SCOPES),
                                 (weight_mode, "weight_mode", WEIGHT_MODES),
                                 (rounding, "rounding", ROUNDINGS)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}: expected one of {', '.join(map(repr, allowed))}, "
                             f"got {value!r}")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer,
                                                                 np.floating)):
        raise TypeError(f"eps: expected a float, got {type_name(eps)}")
    eps = float(eps)
    with np.errstate(over="ignore"):
        in_fp32 = np.float32(eps)
    if not (math.isfinite(eps) and eps > 0 and np.isfinite(in_fp32) and in_fp32 > 0):
        raise ValueError(f"eps: expected a finite float > 0 (also in float32, where the "
                         f"kernels add it), got {eps!r}")
    return NormOptions(norm_scope, weight_mode, rounding, eps)


def describe_weights(q_weight, k_weight, norm: NormOptions) -> tuple:
    """(q_weight, k_weight) described, or (None, None) for weight_mode "none".

    Parameters
    ----------
    q_weight, k_weight : array or None
        The weights as the caller passed them.
    norm : cupy_rope.validate.NormOptions
        The checked norm options.

    Returns
    -------
    tuple
        Two :class:`~cupy_rope.interop.Tensor` descriptions, or two None.

    Raises
    ------
    ValueError
        A weight given for weight_mode "none", or one missing for "w" / "1+w".
    TypeError
        A weight that is not an array.

    Examples
    --------
    >>> describe_weights(None, None, NormOptions(weight_mode="none"))
    (None, None)
    """
    given = (q_weight, k_weight)
    if norm.weight_mode == "none":
        for w, name in zip(given, WEIGHT_NAMES):
            if w is not None:
                raise ValueError(f"{name}: weight_mode 'none' takes no weight; pass None, or "
                                 "weight_mode 'w' or '1+w' to apply it")
        return (None, None)
    for w, name in zip(given, WEIGHT_NAMES):
        if w is None:
            raise ValueError(f"{name}: weight_mode {norm.weight_mode!r} needs both q_weight "
                             "and k_weight; got None (weight_mode 'none' for no weight)")
    return tuple(interop.describe(w, name) for w, name in zip(given, WEIGHT_NAMES))


def check_weights(call: validate.Call, weights: tuple, norm: NormOptions, read=()) -> None:
    """The weights against a checked call: dtype, device, shape, stride, and
    that no array the call writes overlaps a weight or another array in ``read``.

    Parameters
    ----------
    call : cupy_rope.validate.Call
        The checked call; its rotating slabs are q then k.
    weights : tuple
        From :func:`describe_weights`.
    norm : cupy_rope.validate.NormOptions
        The checked norm options.
    read : sequence of (Tensor, str), optional
        Other arrays the call reads (the backward's q and k), with their names.

    Returns
    -------
    None

    Raises
    ------
    ValueError, TypeError
        Naming the weight (or the written array) and what was expected.

    Examples
    --------
    >>> check_weights(call, weights, norm)                    # doctest: +SKIP
    """
    slabs = [s for s in call.slabs if s.rotate]
    for slab, w, name in zip(slabs, weights, WEIGHT_NAMES):
        if w is None:
            continue
        validate._check_dtype(w, name, validate._floats(call.on_gpu))
        validate._same_device(w, call.device, name, "q")
        n = call.head_dim if norm.scope == "head" else slab.heads * call.head_dim
        what = ("head_dim" if norm.scope == "head"
                else f"{slab.name}'s heads * head_dim = {slab.heads} * {call.head_dim}")
        if w.shape != (n,):
            raise ValueError(f"{name}: expected a 1-D array [{n}] ({what}) for norm_scope "
                             f"{norm.scope!r}, got shape {fmt_shape(w.shape)}")
        if n > 1 and w.strides[0] != 1:
            raise ValueError(f"{name}: expected a contiguous array (stride 1), "
                             f"got stride {w.strides[0]}")
        if call.on_gpu and w.ptr % w.itemsize:
            raise ValueError(f"{name}: data pointer {w.ptr:#x} is not aligned to its "
                             f"{w.itemsize}-byte elements")
    if weights[0] is not None and weights[1].dtype != weights[0].dtype:
        raise TypeError(f"k_weight: expected the dtype of q_weight ({weights[0].dtype}), "
                        f"got {weights[1].dtype}")
    read = [(w, n) for w, n in zip(weights, WEIGHT_NAMES) if w is not None] + list(read)
    for slab in slabs:
        if slab.out is None:
            continue
        written = slab.name if slab.out is slab.x else "out_" + slab.name
        for other, n in read:
            if not validate.disjoint(slab.out, other):
                raise ValueError(f"{written}: overlaps {n}; the output must not alias the "
                                 "inputs")


def _checked(op, inputs, tables, positions, offsets, cu_seqlens, outputs, options, norm,
             weights) -> validate.Call:
    """describe + validate for the rotation's arguments, then the weights."""
    call = validate.check(validate.describe_arrays(op, inputs, tables, positions, offsets,
                                                   cu_seqlens, outputs), options)
    check_weights(call, weights, norm)
    return call


# -------------------------------------------------------------- compute --
class _Job(NamedTuple):
    """One validated call: what the computation needs, outputs attached."""

    kind: str  # "forward" | "backward" | "qkv"
    call: validate.Call
    weights: tuple  # (q_weight, k_weight) descriptions, or (None, None)
    inputs: tuple  # backward: the forward's q and k as slabs; else ()
    weight_grads: tuple  # backward: the weight gradients' descriptions; else ()
    norm: NormOptions
    allocated: list  # arrays the library allocated: outputs, then weight gradients
    # (index of the array each allocated one is made like, its shape or None
    # for the same shape): how a cached call allocates them again
    made_like: tuple


def _write(call, slab: Slab, y: np.ndarray) -> None:
    """The NumPy path: a float64 [b, s, h, d] result into the slab's output
    (every channel: the norm changes the tail too)."""
    dst = reference.strided_view(slab.out, slab.out_offset, slab.out_strides, call.batch,
                                 call.seqlen, slab.heads, slab.heads_per_group, call.head_dim)
    dst[...] = reference.encoded(y.reshape(dst.shape), dst, slab.out.dtype)


def _device_cu_seqlens(call):
    """(call, uploaded): host cu_seqlens (their values are checked) copied to
    the device on the launch stream; the caller syncs that stream after the
    launch so that the copy outlives the kernel's reads. Device cu_seqlens
    are read back and checked only with CUPY_ROPE_CHECK_DEVICE_VALUES."""
    cu = call.cu_seqlens
    if cu is None:
        return call, []
    if cu.on_gpu:
        if api.CHECK_DEVICE_VALUES:
            host = interop.describe(interop.to_host(cu.obj), "cu_seqlens")
            validate.check_cu_seqlens(host, call.tokens, call.cp_size)
        return call, []
    up = interop.to_device(cu, call.device[1], interop.stream_for(call.x))
    return call._replace(cu_seqlens=interop.describe(up, "cu_seqlens")), [up]


def _compute(job: _Job, arrays) -> None:
    """Launch :mod:`cupy_rope.norm_launch` (imported here, so that the NumPy
    path never needs it), or write the NumPy reference's results."""
    call, weights, norm = job.call, job.weights, job.norm
    if call.on_gpu:
        from . import norm_launch

        call, uploaded = _device_cu_seqlens(call)
        arrays = list(arrays) + uploaded
        if job.kind == "backward":
            norm_launch.backward(call, arrays, job.inputs, weights, job.weight_grads, norm)
        else:
            norm_launch.forward(call, arrays, weights, norm)
        if uploaded:
            interop.synchronize_stream(interop.stream_for(call.x), call.device[1])
    elif job.kind != "backward":
        for slab, y in zip(call.slabs, reference.qk_norm_rope_slabs(call, weights, norm)):
            _write(call, slab, y)
    else:
        dxs, dws = reference.qk_norm_rope_backward_slabs(call, job.inputs, weights, norm)
        for slab, dx in zip(call.slabs, dxs):
            _write(call, slab, dx)
        for t, dw in zip(job.weight_grads, dws or ()):
            host = reference.host_array(t)
            host[...] = reference.encoded(dw, host, t.dtype)


# ------------------------------------------------------------ the calls --
# Each call's arrays come as one tuple (None where absent) and its other
# arguments as one tuple, in these orders; _execute keys cached plans on them.
_FORWARD_ARRAYS = ("q", "k", "q_weight", "k_weight") + validate.TABLE_NAMES + (
    "positions", "cu_seqlens", "out_q", "out_k")
_BACKWARD_ARRAYS = ("grad_q", "grad_k", "q", "k", "q_weight", "k_weight") + (
    validate.TABLE_NAMES + ("positions", "cu_seqlens", "out_q", "out_k"))
_QKV_ARRAYS = ("qkv", "q_weight", "k_weight") + validate.TABLE_NAMES + ("positions",
                                                                        "cu_seqlens")
_FORWARD_OUT = _FORWARD_ARRAYS.index("out_q")
_BACKWARD_OUT = _BACKWARD_ARRAYS.index("out_q")
_BACKWARD_WEIGHT = _BACKWARD_ARRAYS.index("q_weight")
#: The rotation's options (validate.Options' first fields), then the norm's.
_ROPE_OPTIONS = 8


def _rope_options(options, **more) -> Options:
    """The rotation's options of an option tuple, checked as the RoPE calls check them."""
    return validate.check_options(Options(*options[:_ROPE_OPTIONS], **more))


def _norm(options) -> NormOptions:
    """The norm's options (eps, norm_scope, weight_mode, rounding), checked."""
    eps, scope, mode, rounding = options[_ROPE_OPTIONS:_ROPE_OPTIONS + 4]
    return check_norm(scope, mode, rounding, eps)


def _named(names, arrays) -> tuple:
    """(the arrays by name, the angle source arrays in TABLE_NAMES order)."""
    a = dict(zip(names, arrays))
    return a, tuple(a[n] for n in validate.TABLE_NAMES)


def _prepare_forward(arrays, options, offsets) -> _Job:
    a, tables = _named(_FORWARD_ARRAYS, arrays)
    norm = _norm(options)
    opts = _rope_options(options, inplace=options[-1])
    weights = describe_weights(a["q_weight"], a["k_weight"], norm)
    call = _checked("qk", (a["q"], a["k"]), tables, a["positions"], offsets, a["cu_seqlens"],
                    (a["out_q"], a["out_k"]), opts, norm, weights)
    allocated = api._allocate("qk", call)
    if allocated:
        call = api._attach("qk", call, allocated, opts)
    return _Job("forward", call, weights, (), (), norm, allocated,
                ((0, None), (1, None)) if allocated else ())


def _forward_inputs(call, q, k) -> tuple:
    """The backward's q and k: described, checked against the gradients
    (shape, dtype, device) and read as slabs of the call's geometry."""
    slabs = []
    for a, grad, name in zip((q, k), call.slabs, ("q", "k")):
        t = validate._describe_input(a, name)
        if t.shape != grad.x.shape:
            raise ValueError(f"{name}: expected the shape of grad_{name} "
                             f"{fmt_shape(grad.x.shape)}, got {fmt_shape(t.shape)}")
        if t.dtype != call.dtype:
            raise TypeError(f"{name}: expected the dtype of grad_{name} ({call.dtype}), "
                            f"got {t.dtype}")
        validate._same_device(t, call.device, name, f"grad_{name}")
        if call.on_gpu and t.ptr % t.itemsize:
            raise ValueError(f"{name}: data pointer {t.ptr:#x} is not aligned to its "
                             f"{t.itemsize}-byte elements")
        strides = validate.head_view(t, name, call.layout, call.head_dim)[4]
        slabs.append(grad._replace(x=t, x_strides=strides, out=None, out_strides=None))
    return tuple(slabs)


def _prepare_backward(arrays, options, offsets) -> _Job:
    a, tables = _named(_BACKWARD_ARRAYS, arrays)
    norm = _norm(options)
    opts = _rope_options(options, backward=True)
    weights = describe_weights(a["q_weight"], a["k_weight"], norm)
    call = validate.check(validate.describe_arrays(
        "qk", (a["grad_q"], a["grad_k"]), tables, a["positions"], offsets, a["cu_seqlens"],
        (a["out_q"], a["out_k"])), opts)
    inputs = _forward_inputs(call, a["q"], a["k"])
    check_weights(call, weights, norm, read=[(s.x, s.name) for s in inputs])
    allocated = api._allocate("qk", call)
    if allocated:
        call = api._attach("qk", call, allocated, opts)
    made_like = ((0, None), (1, None)) if allocated else ()
    grads = [interop.empty_like(w) for w in weights if w is not None]
    if grads:
        made_like += ((_BACKWARD_WEIGHT, None), (_BACKWARD_WEIGHT + 1, None))
    described = tuple(interop.describe(g, n) for g, n in zip(grads, WEIGHT_GRAD_NAMES))
    return _Job("backward", call, weights, inputs, described, norm, allocated + grads, made_like)


def _in_place_qk(call) -> validate.Call:
    """A packed call (q, k, v slabs reading qkv) that writes q and k back
    where it reads them and leaves v alone."""
    packed = call.slabs[0].x
    read_only = [(t, "the angle source") for t in call.tables] + [
        (t, n) for t, n in ((call.positions, "positions"), (call.offsets, "offsets"),
                            (call.cu_seqlens, "cu_seqlens")) if t is not None]
    validate._check_writable(packed, "qkv", read_only)
    slabs = tuple(s._replace(out=s.x, out_offset=s.x_offset, out_strides=s.x_strides)
                  for s in call.slabs if s.rotate)
    return call._replace(slabs=slabs, inplace=True)


def _prepare_qkv(arrays, options, offsets) -> _Job:
    a, tables = _named(_QKV_ARRAYS, arrays)
    norm = _norm(options)
    num_q_heads, num_kv_heads, packing, inplace = options[-4:]
    inplace = validate._as_bool(inplace, "inplace")
    opts = _rope_options(options, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                         packing=packing)
    weights = describe_weights(a["q_weight"], a["k_weight"], norm)
    call = validate.check(validate.describe_arrays(
        "qkv", (a["qkv"],), tables, a["positions"], offsets, a["cu_seqlens"]), opts)
    if inplace:
        call = _in_place_qk(call)
    check_weights(call, weights, norm)
    allocated = api._allocate("qkv", call)
    if allocated:
        call = api._attach("qkv", call, allocated, opts)
    return _Job("qkv", call, weights, (), (), norm, allocated,
                tuple((0, tuple(o.shape)) for o in allocated))


def _written(arrays) -> tuple:
    """The caller's arrays a call wrote (one, or two), their torch version
    counters bumped."""
    arrays = tuple(arrays)
    if type(arrays[0]) is type(arrays[-1]):
        api.written(arrays)
    else:
        for a in arrays:
            api.written((a,))
    return arrays


class _QkvViews(NamedTuple):
    """How the q, k and v views of an in-place packed call are cut from qkv."""

    token_axes: int  # 1 (thd) or 2
    hq: int
    hk: int
    head_dim: int
    grouped: bool  # packing "grouped": [hk, hq / hk + 2, d] per token


def _views(job: _Job):
    """What the job's result needs besides its arrays (the packed form's views)."""
    if job.kind != "qkv":
        return None
    c = job.call
    q = c.slabs[0]
    return _QkvViews(1 if c.layout == "thd" else 2, q.heads, c.slabs[1].heads, c.head_dim,
                     q.heads_per_group != q.heads)


def _result_forward(views, arrays, new) -> tuple:
    if new:
        return api._wrap(arrays[0], new[0]), api._wrap(arrays[0], new[1])
    out = arrays[_FORWARD_OUT:_FORWARD_OUT + 2]
    return _written(arrays[:2] if out[0] is None else out)


def _result_backward(views, arrays, new) -> tuple:
    wrap = functools.partial(api._wrap, arrays[0])
    out = arrays[_BACKWARD_OUT:_BACKWARD_OUT + 2]
    if out[0] is None:
        dq, dk, new = wrap(new[0]), wrap(new[1]), new[2:]
    else:
        dq, dk = _written(out)
    dwq, dwk = (wrap(g) for g in new) if new else (None, None)
    return dq, dk, dwq, dwk


def _result_qkv(views: _QkvViews, arrays, new) -> tuple:
    if new:
        return tuple(api._wrap(arrays[0], o) for o in new)
    qkv = arrays[0]
    _written((qkv,))
    n_tok, hq, hk, d, grouped = views
    tok = tuple(qkv.shape[:n_tok])
    heads = qkv.reshape(tok + (hq + 2 * hk, d))
    if not grouped:  # concat: q, k, v heads one after the other
        return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
    g = hq // hk
    groups = heads.reshape(tok + (hk, g + 2, d))
    return groups[..., :g, :], groups[..., g, :], groups[..., g + 1, :]


_PREPARE = {"forward": _prepare_forward, "backward": _prepare_backward, "qkv": _prepare_qkv}
_RESULT = {"forward": _result_forward, "backward": _result_backward, "qkv": _result_qkv}


# ------------------------------------------------------------ the cache --
# A device call whose arrays (torch or CuPy on a GPU, offsets None or an int)
# and options were seen before skips describe, validate and plan. Its
# pattern (kind, options, the classes of options and arrays) gives a
# generated signature reader and the entries of the signatures seen; an
# entry holds the call's prepared launch (norm_launch.Prepared: parameters
# built once, the pointers packed per call) and tests again only what
# depends on pointer values: outputs apart from what the call reads and from
# each other, an int offset inside the table, outputs allocated alike.
_calls: dict = {}
_MAX_PLANS = 1024
_n_entries = [0]


def clear_plans() -> None:
    """Forget every cached call of this module (as :func:`cupy_rope.api.clear_plans`).

    Returns
    -------
    None

    Examples
    --------
    >>> from cupy_rope import qk_norm
    >>> qk_norm.clear_plans()
    """
    _calls.clear()
    _n_entries[0] = 0


class _Pattern:
    """The signature reader of one (kind, options, classes) pattern and the
    entries of the signatures seen."""

    __slots__ = ("read", "n_given", "entries")

    def __init__(self, classes):
        #: Straight-line code for torch and CuPy arrays, else the signers one by one.
        self.read = interop.signature_reader(classes) or _sign_each
        self.n_given = sum(cls is not type(None) for cls in classes)
        self.entries: dict = {}


class _Entry:
    """One signature's prepared launch and the per-call checks around it."""

    __slots__ = ("launcher", "module", "made_like", "sigs", "pairs", "apart", "offset_range",
                 "result")

    def __init__(self, launcher, module, job, sigs, pairs):
        self.launcher, self.module, self.made_like = launcher, module, job.made_like
        self.sigs, self.pairs, self.apart = sigs, pairs, launch.spans_apart(pairs)
        self.offset_range = api._offset_range(job.call)
        self.result = functools.partial(_RESULT[job.kind], _views(job))

    def run(self, arrays, ptrs, offset):
        """Launch and return the result, or NotImplemented where the general
        path must decide (an overlap, an offset out of range, an output
        allocated with another signature, a new launch policy)."""
        lo, hi = self.offset_range
        if not lo <= offset < hi or self.launcher.policy is not self.module.POLICY:
            return NotImplemented
        if not self.apart(ptrs) and not launch.check_disjoint(self.pairs, ptrs):
            return NotImplemented
        new = []
        if self.made_like:
            ptrs = list(ptrs)
            for (i, shape), want in zip(self.made_like, self.sigs):
                o = (interop.fast_empty_like(arrays[i]) if shape is None
                     else interop.fast_empty(arrays[i], shape))
                sig: list = []
                if not api._sign(o, sig, ptrs) or sig[0] != want:
                    return NotImplemented
                new.append(o)
        self.launcher.launch(ptrs, offset)
        return self.result(arrays, new)


def _sign_each(arrays):
    """(signatures, pointers) of the arrays through their signers (None
    where absent), or None when one cannot be signed (a host array)."""
    sigs: list = []
    ptrs: list = []
    for a in arrays:
        if a is None:
            sigs.append(None)
            ptrs.append(0)
        elif not api._sign(a, sigs, ptrs):
            return None
    return tuple(sigs), ptrs


def _signature(kind, arrays, options, offsets):
    """(pattern, signature, pointers) of a device call; (None, None, None)
    where it is not cacheable."""
    if offsets is not None and type(offsets) is not int:
        return None, None, None
    key = (kind, options, tuple(map(type, options + arrays)))
    try:
        pattern = _calls.get(key)
    except TypeError:  # an unhashable option: validation will say what is wrong
        return None, None, None
    if pattern is None:
        if len(_calls) >= _MAX_PLANS:
            clear_plans()
        pattern = _calls[key] = _Pattern(key[2][len(options):])
    got = pattern.read(arrays)
    if got is None:
        return None, None, None
    sig, ptrs = got
    given = set(ptrs)
    given.discard(0)
    if len(given) != pattern.n_given:  # arrays sharing memory: a plan of their own
        sig = sig + (api._alias_pattern(ptrs),)
    return pattern, sig, ptrs


def _pairs(job: _Job, index, ptrs, n_user: int) -> list:
    """launch.check_disjoint's pairs: each output the caller gave (or wrote
    in place) against everything the call reads and the other outputs."""
    c = job.call
    written = [s.out for s in c.slabs if s.out is not None and index[id(s.out.obj)] < n_user]
    read = [s.x for s in c.slabs + job.inputs] + [
        t for t in c.tables + (c.positions, c.offsets, c.cu_seqlens) + job.weights
        if t is not None]
    pairs, seen = [], set()
    for w in written:
        for r in read + written:
            i, j = index[id(w.obj)], index[id(r.obj)]
            if i == j or frozenset((i, j)) in seen:
                continue
            seen.add(frozenset((i, j)))
            span_w = (w.span()[0] - ptrs[i], w.span()[1] - ptrs[i])
            span_r = (r.span()[0] - ptrs[j], r.span()[1] - ptrs[j])
            pairs.append((i, span_w, validate.lattice(w), j, span_r, validate.lattice(r)))
    return pairs


def _remember(pattern: _Pattern, sig, job: _Job, arrays, ptrs) -> None:
    """Keep ``job``'s prepared launch under ``sig`` (a device call that ran
    the general path)."""
    c = job.call
    if not c.on_gpu or (c.cu_seqlens is not None and api.CHECK_DEVICE_VALUES):
        return
    from . import norm_launch

    every = list(arrays) + job.allocated
    ptrs = list(ptrs)
    sigs = []
    for o in job.allocated:
        s: list = []
        if not api._sign(o, s, ptrs):
            return
        sigs.append(s[0])
    index: dict = {}
    for i, a in enumerate(every):
        if a is not None:
            index.setdefault(id(a), i)
    try:
        pairs = _pairs(job, index, ptrs, len(arrays))
        launcher = norm_launch.prepare(c, every, ptrs, job.weights, job.norm, job.inputs,
                                       job.weight_grads, backward=job.kind == "backward")
    except KeyError:  # a description of an array the call was not given: not cached
        return
    if _n_entries[0] >= _MAX_PLANS:
        clear_plans()
    _n_entries[0] += 1
    pattern.entries[sig] = _Entry(launcher, norm_launch, job, sigs, pairs)


def _execute(kind: str, arrays: tuple, options: tuple, offsets):
    """A cached device call's prepared launch, else describe, validate,
    allocate, compute (and cache); returns the result."""
    pattern, sig, ptrs = _signature(kind, arrays, options, offsets)
    if sig is not None:
        entry = pattern.entries.get(sig)
        if entry is not None:
            result = entry.run(arrays, ptrs, offsets or 0)
            if result is not NotImplemented:
                return result
    job = _PREPARE[kind](arrays, options, offsets)
    _compute(job, list(arrays) + job.allocated)
    if sig is not None:
        _remember(pattern, sig, job, arrays, ptrs)
    return _RESULT[kind](_views(job), arrays, job.allocated)


# --------------------------------------------------------------- public --
def apply_qk_norm_rope(q, k, q_weight=None, k_weight=None, cos=None, sin=None, *,
                       inv_freq=None, freqs=None, cos_sin_cache=None, positions=None,
                       offsets=None, layout="bshd", cu_seqlens=None, cp_size=1, cp_rank=0,
                       interleaved=False, rotary_dim=None, head_dim=None, sections=None,
                       sections_interleaved=False, eps=1e-6, norm_scope="head",
                       weight_mode="w", rounding="before_weight", inplace=False, out_q=None,
                       out_k=None):
    """RMSNorm of q and k, then the rotation of :func:`apply_rope_qk`, in one pass.

    Per row (a head with ``norm_scope="head"``, all heads of a token with
    ``"token"``): x_hat = x / sqrt(mean(x^2) + eps) in fp32, times the
    weight (w, 1 + w, or none), rounded to x's dtype in the order of
    ``rounding``; then every rule of the rotation applies [q/k RMSNorm +
    RoPE in ``docs/api.md``]. Channels past rotary_dim are normalized, not
    rotated.

    Parameters
    ----------
    q : array
        [.., hq, d] in ``layout`` (float32, float16, bfloat16; float64 for
        NumPy), as ``x`` of :func:`apply_rope`.
    k : array
        [.., hk, d] on q's token axes, q's dtype.
    q_weight, k_weight : array, optional
        1-D contiguous [d] (``norm_scope="head"``) or [hq * d] and [hk * d]
        (``"token"``), float32, float16 or bfloat16 (float64 for NumPy),
        both of one dtype, on q's device; both given unless
        ``weight_mode="none"``, then both None.
    eps : float
        Added to the mean square; finite and > 0.
    norm_scope : {"head", "token"}
        Qwen3, Gemma 3: "head"; OLMo 2, Wan: "token".
    weight_mode : {"w", "1+w", "none"}
        x_hat * w; x_hat * (1 + w) (Gemma); x_hat (plain RMS: Llama 4's norm).
    rounding : {"before_weight", "after_weight"}
        round(round(x_hat) * w) (Llama, Qwen3) or round(x_hat * w) (Gemma,
        OLMo 2), rounding to x's dtype.
    inplace : bool
        Overwrite q and k (every channel).
    out_q, out_k : array, optional
        Where to write the results (both or neither), overlapping no input.
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
cu_seqlens, cp_size, cp_rank, interleaved, rotary_dim, head_dim, sections, \
sections_interleaved
        As for :func:`apply_rope`.

    Returns
    -------
    tuple of array
        (q_out, k_out): new arrays of q's framework, or (out_q, out_k), or
        (q, k) with ``inplace=True``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument (a weight of the wrong shape,
        dtype or device, eps <= 0, an unknown option, a weight for
        ``weight_mode="none"``, ...); nothing is written then.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_rope import qk_norm
    >>> q = np.ones((2, 16, 8, 64), np.float32)              # [b, s, hq, d]
    >>> k = np.ones((2, 16, 2, 64), np.float32)              # [b, s, hk, d]
    >>> w = np.ones(64, np.float32)                          # per-head weight [d]
    >>> inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
    >>> q2, k2 = qk_norm.apply_qk_norm_rope(q, k, w, w, inv_freq=inv_freq)
    >>> q2.shape, k2.shape
    ((2, 16, 8, 64), (2, 16, 2, 64))
    """
    return _execute(
        "forward", (q, k, q_weight, k_weight, cos, sin, inv_freq, freqs, cos_sin_cache,
                    positions, cu_seqlens, out_q, out_k),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, api._key_sections(sections),
         sections_interleaved, eps, norm_scope, weight_mode, rounding, inplace), offsets)


def apply_qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight=None, k_weight=None, cos=None,
                                sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
                                positions=None, offsets=None, layout="bshd", cu_seqlens=None,
                                cp_size=1, cp_rank=0, interleaved=False, rotary_dim=None,
                                head_dim=None, sections=None, sections_interleaved=False,
                                eps=1e-6, norm_scope="head", weight_mode="w",
                                rounding="before_weight", out_q=None, out_k=None):
    """Gradients of :func:`apply_qk_norm_rope` with respect to q, k and the weights.

    In fp32 without rounding: g = the output gradient rotated by -theta;
    dn = g * w'; dx = rstd * (dn - x_hat * mean(dn * x_hat)) per row; the
    weight's gradient sums g * x_hat over every row, deterministically
    [q/k RMSNorm + RoPE in ``docs/api.md``].

    Parameters
    ----------
    grad_q, grad_k : array
        The gradients of the forward's outputs, shaped like q and k (the
        rotation's error messages call them q and k, as the forward does).
    q, k : array
        The forward's inputs (before the norm), shaped like the gradients,
        of their dtype.
    out_q, out_k : array, optional
        Where to write dq and dk (both or neither).
    q_weight, k_weight, cos, sin, inv_freq, freqs, cos_sin_cache, positions, \
offsets, layout, cu_seqlens, cp_size, cp_rank, interleaved, rotary_dim, \
head_dim, sections, sections_interleaved, eps, norm_scope, weight_mode, rounding
        The forward call's values (``rounding`` only checked).

    Returns
    -------
    tuple
        (dq, dk, dq_weight, dk_weight): dq and dk new arrays (or out_q,
        out_k); the weight gradients new arrays of the weights' shape and
        dtype in q's framework, None for ``weight_mode="none"``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument; nothing is written then.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_rope import qk_norm
    >>> q = np.ones((2, 16, 8, 64), np.float32)
    >>> k = np.ones((2, 16, 2, 64), np.float32)
    >>> w = np.ones(64, np.float32)
    >>> inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
    >>> dq, dk, dwq, dwk = qk_norm.apply_qk_norm_rope_backward(q, k, q, k, w, w,
    ...                                                        inv_freq=inv_freq)
    >>> dwq.shape
    (64,)
    """
    return _execute(
        "backward", (grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, inv_freq, freqs,
                     cos_sin_cache, positions, cu_seqlens, out_q, out_k),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, api._key_sections(sections),
         sections_interleaved, eps, norm_scope, weight_mode, rounding), offsets)


def apply_qkv_norm_rope(qkv, q_weight=None, k_weight=None, cos=None, sin=None, *,
                        num_q_heads, num_kv_heads, head_dim=None, packing="concat",
                        inv_freq=None, freqs=None, cos_sin_cache=None, positions=None,
                        offsets=None, layout="bshd", cu_seqlens=None, cp_size=1, cp_rank=0,
                        interleaved=False, rotary_dim=None, sections=None,
                        sections_interleaved=False, eps=1e-6, norm_scope="head",
                        weight_mode="w", rounding="before_weight", inplace=False):
    """:func:`apply_qk_norm_rope` on the q and k heads of a packed projection.

    Parameters
    ----------
    qkv : array
        The token axes of ``layout`` then [(hq + 2 hk) * d] or
        [hq + 2 hk, d] [Packed QKV in ``docs/api.md``].
    num_q_heads, num_kv_heads : int
        hq and hk.
    head_dim : int, optional
        d; the flat form can infer it.
    packing : {"concat", "grouped"}
        As for :func:`apply_rope_qkv`.
    inplace : bool
        Normalize and rotate the q and k heads inside ``qkv`` (the serving
        form; v untouched) and return views of it; else new arrays. Not for
        JAX.
    q_weight, k_weight, eps, norm_scope, weight_mode, rounding
        As for :func:`apply_qk_norm_rope` (``"token"`` weights: [hq * d]
        and [hk * d]).
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
cu_seqlens, cp_size, cp_rank, interleaved, rotary_dim, sections, \
sections_interleaved
        As for :func:`apply_rope`.

    Returns
    -------
    tuple of array
        (q, k, v): new contiguous q [.., hq, d], k and v [.., hk, d] (v
        copied); with ``inplace=True`` views of ``qkv`` of those shapes,
        but q [.., hk, hq / hk, d] for ``packing="grouped"``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument; nothing is written then.

    Examples
    --------
    >>> import numpy as np
    >>> from cupy_rope import qk_norm
    >>> qkv = np.ones((64, (32 + 2 * 8) * 128), np.float32)  # [t, (hq + 2 hk) * d]
    >>> w = np.ones(128, np.float32)
    >>> inv_freq = np.linspace(0.01, 1, 64).astype(np.float32)
    >>> q, k, v = qk_norm.apply_qkv_norm_rope(qkv, w, w, inv_freq=inv_freq, num_q_heads=32,
    ...                                       num_kv_heads=8, layout="thd", inplace=True)
    >>> q.shape, v.shape
    ((64, 32, 128), (64, 8, 128))
    """
    return _execute(
        "qkv", (qkv, q_weight, k_weight, cos, sin, inv_freq, freqs, cos_sin_cache, positions,
                cu_seqlens),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, api._key_sections(sections),
         sections_interleaved, eps, norm_scope, weight_mode, rounding, num_q_heads, num_kv_heads,
         packing, inplace), offsets)
