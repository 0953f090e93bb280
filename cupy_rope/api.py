"""The public functions: :func:`apply_rope` and its variants, and
:class:`RotaryEmbedding`.

Every function takes the angle, position and layout arguments described
once in ``docs/api.md``. A call goes down the layers: a signature seen
before launches from a cache here; any other call has each array
described once and validated (:mod:`cupy_rope.validate`), then is planned
(:mod:`cupy_rope.launch`) and launched, or, for NumPy inputs, computed by
the float64 reference (:mod:`cupy_rope.reference`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import NamedTuple

import numpy as np

from . import interop, launch, reference
from . import validate
from .validate import INPUT_NAMES, OUTPUT_NAMES, TABLE_NAMES

_plans: dict = {}
_plans_lock = threading.Lock()
_MAX_PLANS = 4096
#: Check device-resident cu_seqlens values too (costs a device sync per call).
CHECK_DEVICE_VALUES = os.environ.get("CUPY_ROPE_CHECK_DEVICE_VALUES", "") not in ("", "0")


# ------------------------------------------------------------- the ops --
# _execute gets an op's arrays as three tuples, ``head`` (its inputs),
# ``tables`` (TABLE_NAMES) and ``tail`` (positions, cu_seqlens, its outputs),
# and its options as one plain tuple (a tuple literal: building a named
# structure would cost every cached call), whose fields _Op.options names.
_COMMON_OPTIONS = ("layout", "interleaved", "rotary_dim", "head_dim", "cp_size", "cp_rank",
                   "sections", "sections_interleaved")


class _Op(NamedTuple):
    """How one operation's arguments reach _execute."""

    roles: tuple  # its arrays' names in _execute's order (head + tables + tail)
    options: tuple  # the validate.Options fields its option tuple holds, in order
    fixed: dict  # the Options it always has


def _op(name: str, options: tuple, **fixed) -> _Op:
    roles = INPUT_NAMES[name] + TABLE_NAMES + ("positions", "cu_seqlens") + OUTPUT_NAMES[name]
    return _Op(roles, _COMMON_OPTIONS + options, fixed)


_OPS = {"rope": _op("rope", ("inplace", "backward")),
        "qk": _op("qk", ("inplace", "backward")),
        "qkv": _op("qkv", ("backward", "num_q_heads", "num_kv_heads", "packing")),
        "qkv_backward": _op("qkv_backward", ("packing",), backward=True)}


def _first_output(op: str) -> int:
    return _OPS[op].roles.index(OUTPUT_NAMES[op][0])


# Where each op's outputs sit in its array tuple (the results read them on
# every call, so as constants).
_ROPE_OUT, _QK_OUT, _QKV_OUT, _QKV_BACKWARD_OUT = (
    _first_output(op) for op in ("rope", "qk", "qkv", "qkv_backward"))


def _named_options(op: str, options: tuple) -> validate.Options:
    """The op's option tuple as validate.Options."""
    spec = _OPS[op]
    return validate.Options(**dict(zip(spec.options, options)), **spec.fixed)


class _Prepared:
    """A launch plan plus what the call around it needs: output allocation,
    per-call value checks, and how to return the result."""

    __slots__ = ("plan", "allocs", "out_sigs", "disjoint", "apart", "offset_range", "result")

    def __init__(self, plan, allocs, out_sigs, disjoint, offset_range, result):
        self.plan, self.allocs, self.out_sigs = plan, allocs, out_sigs
        self.disjoint, self.offset_range, self.result = disjoint, offset_range, result
        self.apart = launch.spans_apart(disjoint)

    def run(self, arrays, ptrs, offset):
        """Launch, or return NotImplemented if the slow path must decide."""
        r = self.offset_range
        if not (r[0] <= offset < r[1]):
            return NotImplemented
        if not self.apart(ptrs) and not launch.check_disjoint(self.disjoint, ptrs):
            return NotImplemented
        outs = []
        if self.allocs:
            for alloc, want in zip(self.allocs, self.out_sigs):
                o = alloc(arrays)
                sig = []
                if not _sign(o, sig, ptrs) or sig[0] != want:
                    return NotImplemented
                outs.append(o)
        self.plan.launch(ptrs, offset)
        return self.result(arrays, outs)


_SIGNERS = interop.SIGNERS
_KEY3 = interop.KEY3


def _sign(a, key, ptrs) -> bool:
    """Append a device array's signature to ``key`` and its pointer to ``ptrs``."""
    f = _SIGNERS.get(type(a))
    if f is None:
        f = interop.signer(type(a))
    return f(a, key, ptrs)


def _sig_of(a):
    key: list = []
    _sign(a, key, [])
    return key[0] if key else None


# ------------------------------------------------------ functional fast path --
# A call (apply_rope*, or a RotaryEmbedding method; qk_ keeps launchers of
# its own and comes here only when those cannot serve) with no offsets array
# is first looked up by its op, options, the classes of its options and
# arrays (None included) and the bound object's tables if any: a _FastCall
# holds, for that pattern, a generated signer (straight-line reads of each
# array's dtype, shape, strides, device and pointer; a bound object's table
# pointers are constants) and a launcher per signature seen, made from the
# general path's cached plan. Anything else, and every first call, takes
# the general path below.
_fast_calls: dict = {}
#: Launchers (and patterns) kept before the fast path starts afresh (as _plans).
_MAX_FAST_LAUNCHERS = 4096
_fast_count = [0]


class _FastCall:
    """The signer and launchers of one (op, options, classes, bound tables) pattern."""

    __slots__ = ("op", "sign", "given", "n_slots", "bound", "launchers")

    def __init__(self, op, sign, given, n_slots, bound):
        self.op, self.sign, self.given, self.n_slots = op, sign, given, n_slots
        self.bound = bound  # a RotaryEmbedding's signed tables (or None), kept alive
        self.launchers: dict = {}

    def remember(self, sig):
        """The general path's ``remember``: keep a launcher for ``sig``."""
        def keep(prepared):
            if _fast_count[0] >= _MAX_FAST_LAUNCHERS:
                _fast_calls.clear()  # this pattern's object is dropped too
                _fast_count[0] = 0
            _fast_count[0] += 1
            if prepared.allocs:  # outputs made per call: the prepared plan does it
                run = prepared.run
                self.launchers[sig] = lambda arrays, p, offset: run(arrays, list(p), offset)
            else:
                self.launchers[sig] = launch.call_launcher(
                    prepared.plan, prepared.disjoint, self.given, self.n_slots,
                    prepared.offset_range, _RESULTS[self.op])
        return keep


def clear_plans() -> None:
    """Forget every cached launch plan.

    Clears the general path's plans and the functional fast path's
    launchers, and those of the fused ops (``qk_norm``, ``kv_cache``); a
    :class:`RotaryEmbedding` keeps its own ``qk_`` launchers.
    The next call of each signature is validated and planned again, under
    the launch policy of that moment: for scripts and tests that change it.

    Returns
    -------
    None

    Examples
    --------
    >>> import cupy_rope
    >>> cupy_rope.api.clear_plans()
    """
    from . import kv_cache, qk_norm  # they import this module

    with _plans_lock:
        _plans.clear()
        _fast_calls.clear()
        _fast_count[0] = 0
    qk_norm.clear_plans()
    kv_cache.clear_plans()


def _fast_call(op, classes, n_head, bound):
    """A _FastCall for arrays of these classes (None where absent), or False
    when some class has no straight-line signer (host arrays, JAX, ...).
    With ``bound`` (a RotaryEmbedding's signed tables, which follow the
    ``n_head`` head arrays) the tables' pointers are constants, not read.
    Arrays sharing a pointer (cos is sin, q is k) keep to the general path."""
    consts = {} if bound is None else {n_head + j: p for j, p in enumerate(bound[1]) if p}
    sign = interop.signature_reader(classes, consts, distinct=True)
    if sign is None:
        return False
    given = tuple(i for i, cls in enumerate(classes) if cls is not type(None) or i in consts)
    return _FastCall(op, sign, given, len(classes), bound)


def _execute(op, head, tables, tail, options, offsets, bound=None, remember=None):
    """The hot path: look the call's signature up, else validate and plan.

    The op's array arguments (None where absent) come in three parts:
    ``head`` (x; q, k; qkv; dq, dk, dv), ``tables`` (cos, sin, inv_freq,
    freqs, cos_sin_cache) and ``tail`` (positions, cu_seqlens, outputs), as
    ``_OPS[op].roles`` names them; ``options`` is the op's option tuple
    (``_OPS[op].options``). The key is the op, its options and every
    array's signature. ``bound`` (a :class:`RotaryEmbedding`'s signed
    tables) replaces signing the tables; ``remember(prepared)`` is called
    with the prepared plan of a call whose arrays all have distinct
    pointers (RotaryEmbedding.qk_ keeps a launcher). Calls without a
    ``remember`` of their own (qk_ brings one for a signature it will keep)
    look their pattern up in ``_fast_calls`` first; on a signature's first
    call there, its ``remember`` keeps the launcher.
    """
    if remember is None and (offsets is None or type(offsets) is int):
        arrays = head + tables + tail
        # A bound object's tables are its own: its pattern is its own too (the
        # _FastCall holds ``bound``, so the id stays unique while it lives).
        pattern = (op, options, tuple(map(type, options + arrays)),
                   None if bound is None else id(bound))
        try:
            fast = _fast_calls.get(pattern)
        except TypeError:  # an unhashable option: validation will say what is wrong
            fast = False
        if fast is None:
            if len(_fast_calls) >= _MAX_FAST_LAUNCHERS:
                _fast_calls.clear()
                _fast_count[0] = 0
            fast = _fast_calls[pattern] = _fast_call(op, tuple(map(type, arrays)), len(head),
                                                     bound)
        if fast:
            got = fast.sign(arrays)
            if got is not None:
                go = fast.launchers.get(got[0])
                if go is None:
                    remember = fast.remember(got[0])
                else:
                    result = go(arrays, got[1], offsets or 0)
                    if result is not NotImplemented:
                        return result
    if offsets is None:
        offset = 0
    elif type(offsets) is int:
        offset = offsets
    else:
        offset, offsets_array = _split_offsets(offsets)
        tail = tail + (offsets_array,)
        if offsets_array is None:
            offsets = offset  # validated as the int it is, not described again
    # The option types too: 64.0 == 64 and 1 == True, but validation refuses
    # a float rotary_dim or an int inplace, so they must not share a plan.
    key = [op, options, tuple(map(type, options))]
    ptrs: list = []
    signers = _SIGNERS
    for part in ((head, tables, tail) if bound is None else (head, tail)):
        for a in part:
            if a is None:
                key.append(None)
                ptrs.append(0)
                continue
            f = signers.get(type(a))
            if f is None:
                f = interop.signer(type(a))
            if not f(a, key, ptrs):
                key = None
                break
        if key is None:
            break
        if bound is not None and part is head:
            key.append(bound[0])
            ptrs.extend(bound[1])
    arrays = head + tables + tail
    if key is not None:
        nonzero = [p for p in ptrs if p]
        if len(set(nonzero)) != len(nonzero):
            # Arrays sharing a pointer (cos is sin, q is k): a plan of its own.
            key.append(_alias_pattern(ptrs))
            remember = None
        key = tuple(key)
        try:
            prepared = _plans.get(key)
        except TypeError:  # an unhashable option: validation will say what is wrong
            prepared = key = remember = None
        if prepared is not None:
            result = prepared.run(arrays, ptrs, offset)
            if result is not NotImplemented:
                if remember is not None:
                    remember(prepared)
                return result
    return _uncached(op, arrays, options, offsets, key, bound, remember)


def _uncached(op, arrays, options, offsets, key, bound, remember):
    """A call no cache served: the general path, then ``remember`` the plan
    it cached under ``key``, if any."""
    if bound is not None:
        n = len(INPUT_NAMES[op])
        _check_bound_tables(arrays[n:n + len(TABLE_NAMES)], bound[0])
    result = _slow(op, arrays, options, offsets, key)
    if remember is not None and key is not None:
        prepared = _plans.get(key)
        if prepared is not None:
            remember(prepared)
    return result


def option_kwargs(kw: dict, layout="bshd", interleaved=False, rotary_dim=None, head_dim=None,
                  cp_size=1, cp_rank=0, sections=None, sections_interleaved=False) -> dict:
    """Add the layout options that differ from the defaults to ``kw``.

    The framework adapters (:mod:`cupy_rope.torch`, :mod:`cupy_rope.jax`)
    build library calls with it.

    Parameters
    ----------
    kw : dict
        Keyword arguments of a library call, updated in place.
    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, sections, \
sections_interleaved
        As for :func:`apply_rope`.

    Returns
    -------
    dict
        ``kw``.

    Raises
    ------
    TypeError
        For a flag that is not a bool (Python or NumPy) or a count that is
        not an int.

    Examples
    --------
    >>> option_kwargs({}, layout="thd", rotary_dim=64)
    {'layout': 'thd', 'rotary_dim': 64}
    """
    if layout != "bshd":
        kw["layout"] = layout
    interleaved = validate._as_bool(interleaved, "interleaved")
    sections_interleaved = validate._as_bool(sections_interleaved, "sections_interleaved")
    if interleaved:
        kw["interleaved"] = True
    if rotary_dim is not None:
        kw["rotary_dim"] = validate._as_int(rotary_dim, "rotary_dim")
    if head_dim is not None:
        kw["head_dim"] = validate._as_int(head_dim, "head_dim")
    if cp_size != 1 or cp_rank != 0:
        kw["cp_size"] = validate._as_int(cp_size, "cp_size")
        kw["cp_rank"] = validate._as_int(cp_rank, "cp_rank")
    if sections is not None:
        kw["sections"] = tuple(validate._as_int(v, "sections") for v in sections)
    if sections_interleaved:
        kw["sections_interleaved"] = True
    return kw


def _check_bound_tables(tables, signed) -> None:
    """A RotaryEmbedding's tables must still be what it signed (else a plan made
    for the changed table would be cached under the old signature)."""
    for name, t, sig in zip(TABLE_NAMES, tables, signed[1:]):
        if t is not None and _sig_of(t) != sig:
            raise ValueError(f"{name}: the RotaryEmbedding's table changed since it was "
                             "bound (shape, strides, dtype, device or memory alignment); "
                             "make a new RotaryEmbedding for the new table")


def _alias_pattern(ptrs) -> tuple:
    """For each array, the index of the first array with the same pointer."""
    first: dict = {}
    return tuple(first.setdefault(p, i) if p else -1 for i, p in enumerate(ptrs))


def _split_offsets(offsets):
    """(scalar offset, offsets array or other object for the signature)."""
    if isinstance(offsets, np.integer):
        return int(offsets), None
    # A host 0-d integer array is a scalar offset: its value is launched as
    # one, not read from the array a cached plan would not look at again.
    value = validate.host_offset(offsets)
    if value is not None:
        return value, None
    return 0, offsets  # an array, or a bad value (bool, float) that validation refuses


# ------------------------------------------------------------ general path --
def _slow(op, arrays, options, offsets, key):
    """Describe each array once, validate, then compute on the NumPy
    reference or plan, launch and cache the plan under ``key`` (None: not
    cacheable). ``arrays`` are _execute's, in ``_OPS[op].roles`` order
    (then the offsets array, if any); raises on bad input."""
    named = validate.check_options(_named_options(op, options))
    n_in, n_tables = len(INPUT_NAMES[op]), len(TABLE_NAMES)
    at = n_in + n_tables  # positions, cu_seqlens, then the outputs
    described = validate.describe_arrays(
        op, arrays[:n_in], arrays[n_in:at], arrays[at], offsets, arrays[at + 1],
        arrays[at + 2:at + 2 + len(OUTPUT_NAMES[op])])
    call = validate.check(described, named)
    if not call.on_gpu:
        allocated = _allocate(op, call)
        if allocated:
            call = _attach(op, call, allocated, named)
        _numpy_into(call)
        return _RESULTS[op](arrays, allocated)
    return _plan_and_launch(op, arrays, call, named, key)


def _plan_and_launch(op, arrays, call, options, key):
    """The GPU part of the general path: upload host cu_seqlens, allocate
    outputs, plan, cache the plan (``key`` not None), launch."""
    cacheable = key is not None
    uploaded = []
    cu = call.cu_seqlens
    if cu is not None and not cu.on_gpu:
        # Host cu_seqlens (their values were checked): uploaded on the launch
        # stream for this call, which then waits for the kernel (below).
        uploaded = [interop.to_device(cu, call.device[1], interop.stream_for(call.x))]
        call = call._replace(cu_seqlens=interop.describe(uploaded[0], "cu_seqlens"))
        cacheable = False
    elif cu is not None and CHECK_DEVICE_VALUES:
        host = interop.describe(interop.to_host(cu.obj), "cu_seqlens")
        validate.check_cu_seqlens(host, call.tokens, call.cp_size)
        cacheable = False
    allocated = _allocate(op, call)
    if allocated:
        call = _attach(op, call, allocated, options)
    n_user = len(arrays)
    arrays = list(arrays) + allocated + uploaded
    disjoint = launch.disjoint_pairs(call, arrays, set(range(n_user, len(arrays))))
    plan = launch.Plan(call, arrays)
    if cacheable:
        prepared = _Prepared(plan, _fast_allocs(op, call, arrays, len(allocated)),
                             [_sig_of(o) for o in allocated], disjoint,
                             _offset_range(call), _RESULTS[op])
        with _plans_lock:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = prepared
    plan.launch(_pointers(call, arrays), call.offset)
    if uploaded:  # keep the uploaded cu_seqlens alive until the kernel has read them
        interop.synchronize_stream(interop.stream_for(call.x), call.device[1])
    return _RESULTS[op](arrays[:n_user], allocated)


def _pointers(call, arrays) -> list:
    """Each array's data pointer (0 where absent), from the call's
    descriptions where it has one (an array is not described again)."""
    described = [t for s in call.slabs for t in (s.x, s.out)] + [
        t for t in call.tables + (call.positions, call.offsets, call.cu_seqlens)]
    known = {id(t.obj): t.ptr for t in described if t is not None}
    return [0 if a is None else known[id(a)] if id(a) in known else interop.data_ptr(a)
            for a in arrays]


def _offset_range(call) -> tuple:
    """The scalar offsets a cached plan may launch with: those validation
    would accept for this call's signature."""
    if call.pos_mode != validate.IMPLIED or call.offsets is not None:
        return (-validate.MAX_INDEX + 1, validate.MAX_INDEX)
    # Implied positions [0, seqlen * cp_size) + offset must stay inside the
    # table, or (computed angles) below 2**53 in magnitude.
    span = call.seqlen * call.cp_size - 1
    if call.source != "inv_freq":
        return (0, call.max_position - span)
    top = validate.MAX_COMPUTED_POSITION
    return (-top + 1, top - span)


# ------------------------------------------------------------- per op --
# Each op: which outputs the library allocates, how they are made again on
# later calls of the same signature, and what the call returns.
def _allocate(op, call) -> list:
    """New outputs for a call that was given none ([] when given)."""
    slabs = call.slabs
    if slabs[0].out is not None:
        return []
    if op in ("rope", "qk"):
        return [interop.empty_like(s.x) for s in slabs]
    tok = tuple(slabs[0].x.shape[:1 if call.layout == "thd" else 2])
    if op == "qkv":
        return [interop.empty(slabs[0].x, tok + (s.heads, call.head_dim)) for s in slabs]
    # qkv_backward: one packed gradient [.., (hq + 2 hk) * d]
    return [interop.empty(slabs[0].x, tok + (call.heads * call.head_dim,))]


def _attach(op, call, allocated, options):
    """``call`` writing into the outputs just allocated for it."""
    names = OUTPUT_NAMES[op]
    return validate.attach_outputs(
        call, tuple(interop.describe(o, n) for o, n in zip(allocated, names)), options)


def _fast_allocs(op, call, arrays, n_alloc):
    """Functions (arrays -> new output) repeating _allocate on a cached plan."""
    if not n_alloc:
        return []
    slabs = call.slabs

    def index_of(t):
        return next(j for j, a in enumerate(arrays) if a is t.obj)

    if op in ("rope", "qk"):
        return [lambda arrays, i=index_of(s.x): interop.fast_empty_like(arrays[i])
                for s in slabs]
    x = slabs[0].x
    tok = tuple(x.shape[:1 if call.layout == "thd" else 2])
    if op == "qkv":
        shapes = [tok + (s.heads, call.head_dim) for s in slabs]
    else:
        shapes = [tok + (call.heads * call.head_dim,)]
    i = index_of(x)
    return [lambda arrays, shape=shape: interop.fast_empty(arrays[i], shape) for shape in shapes]


# Arrays of the caller's that a call wrote (in place, or out=) get their
# framework's record of it: torch tensors their version counter bumped, as
# torch's own in-place ops do, so that autograd refuses a backward through a
# tensor it saved and this call then overwrote (instead of a silent wrong
# gradient). Other frameworks keep no such record.
_VERSION_BUMPS: dict = {}


def _bumper(cls):
    f = _VERSION_BUMPS.get(cls)
    if f is None:
        torch = sys.modules.get("torch")
        f = False
        if torch is not None and isinstance(cls, type) and issubclass(cls, torch.Tensor):
            inc = torch._C._increment_version
            try:
                inc(())  # torch >= 2.5 takes a tuple of tensors
                f = inc
            except TypeError:  # older torch: one tensor
                def f(tensors, inc=inc):
                    for t in tensors:
                        inc(t)
        _VERSION_BUMPS[cls] = f
    return f


def written(arrays: tuple) -> None:
    """Record that the call wrote ``arrays`` (all of one class) in place.

    Parameters
    ----------
    arrays : tuple
        The caller's arrays the call wrote, all of one class.

    Returns
    -------
    None
        torch tensors get their version counter bumped; other arrays keep
        no record.

    Examples
    --------
    >>> written((q, k))                                       # doctest: +SKIP
    """
    f = _VERSION_BUMPS.get(type(arrays[0]))
    if f is None:
        f = _bumper(type(arrays[0]))
    if f:
        f(arrays)


def _result_rope(arrays, outs):
    x, out = arrays[0], arrays[_ROPE_OUT]
    if outs:
        return _wrap(x, outs[0])
    r = out if out is not None else x
    written((r,))
    return r


def _result_qk(arrays, outs):
    q, k = arrays[0], arrays[1]
    if outs:
        return _wrap(q, outs[0]), _wrap(q, outs[1])
    if arrays[_QK_OUT] is not None:
        q, k = arrays[_QK_OUT], arrays[_QK_OUT + 1]
    if type(q) is type(k):
        written((q, k))
    else:
        written((q,))
        written((k,))
    return q, k


def _result_qkv(arrays, outs):
    if outs:
        return tuple(_wrap(arrays[0], o) for o in outs)
    outs = arrays[_QKV_OUT:_QKV_OUT + 3]
    for o in outs:
        written((o,))
    return tuple(outs)


def _result_qkv_backward(arrays, outs):
    if outs:
        return _wrap(arrays[0], outs[0])
    out = arrays[_QKV_BACKWARD_OUT]
    written((out,))
    return out


def _wrap(like, arr):
    if type(like) is type(arr):
        return arr
    return interop.wrap_result(like, arr)


#: What each op's call returns, from its arrays and the outputs it allocated.
_RESULTS: dict = {"rope": _result_rope, "qk": _result_qk, "qkv": _result_qkv,
                  "qkv_backward": _result_qkv_backward}


def _numpy_into(call):
    """The NumPy reference path: write every slab's result into its output."""
    for slab, y in zip(call.slabs, reference.rope_slabs(call)):
        dst = reference.strided_view(slab.out, slab.out_offset, slab.out_strides, call.batch,
                                     call.seqlen, slab.heads, slab.heads_per_group,
                                     call.head_dim)
        y = y.reshape(dst.shape)
        if call.inplace and call.rotary_dim < call.head_dim:
            # In place, channels past rotary_dim are not touched at all.
            r = call.rotary_dim
            dst[..., :r] = reference.encoded(y[..., :r], dst, slab.out.dtype)
        else:
            dst[...] = reference.encoded(y, dst, slab.out.dtype)


def _key_sections(sections):
    """sections as a hashable key part (a list becomes a tuple)."""
    return tuple(sections) if isinstance(sections, list) else sections


# ------------------------------------------------------------- public --
def apply_rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
               positions=None, offsets=None, layout="bshd", interleaved=False, rotary_dim=None,
               inplace=False, out=None, backward=False, cu_seqlens=None, cp_size=1, cp_rank=0,
               head_dim=None, sections=None, sections_interleaved=False):
    """Apply rotary position embedding to ``x``.

    Each argument is described in full in ``docs/api.md`` (the section
    named after it in brackets below).

    Parameters
    ----------
    x : array
        [b, s, h, d] (``layout="bshd"``), [s, b, h, d] (``"sbhd"``) or
        [t, h, d] (``"thd"``), any strides; float32, float16 or bfloat16
        (float64 for NumPy). Heads may be flattened ([.., h * d]) with
        ``head_dim`` [Layouts].
    cos, sin : array, optional
        [max_position, r/2] tables, float32 or x's dtype [Angle sources].
    inv_freq : array, optional
        [r/2] float32: angles computed in the kernel [Angle sources].
    freqs : array, optional
        [max_position, r/2] float32 angles [Angle sources].
    cos_sin_cache : array, optional
        [max_position, r]: cos in the first half, sin in the second
        (vLLM / FlashInfer) [Angle sources]. Give exactly one angle source.
    positions : array, optional
        int32/int64 [s], [1, s] (Hugging Face's position_ids, shared by the
        batch) or [b, s] (thd: [t]); default: the sequence index [Positions].
    offsets : int or array, optional
        Added to every position: an int (or a 0-d integer array: a host one
        read as an int, a device one as one offset for every batch entry),
        or [b] (thd with ``cu_seqlens``: [n_seqs]) [Positions].
    layout : {"bshd", "sbhd", "thd"}
        [Layouts].
    interleaved : bool
        False: NeoX pairs (f, f + r/2); True: GPT-J pairs (2f, 2f + 1)
        [Styles].
    rotary_dim : int, optional
        Checks the angle source's r/2 frequencies; channels past it are
        copied [Partial rotary].
    inplace : bool
        Rotate ``x`` itself [Outputs and in-place].
    out : array, optional
        Where to write the result, shaped like ``x``, overlapping no input
        (not ``x`` itself: that is ``inplace=True``) [Outputs and in-place].
    backward : bool
        Rotate by -theta: the gradient with respect to x [Backward].
    cu_seqlens : array, optional
        thd: int32 [n_seqs + 1] cumulative lengths; positions restart in
        every sequence [Positions].
    cp_size, cp_rank : int
        Context parallelism for implied positions [Context parallel].
    head_dim : int, optional
        Splits a flattened [.., h * d] last axis [Layouts].
    sections : sequence of int, optional
        M-RoPE: frequencies per position axis, with ``positions``
        [axes, ...] [M-RoPE].
    sections_interleaved : bool
        Qwen3-VL's interleaved assignment of frequencies to axes [M-RoPE].

    Returns
    -------
    array
        A new array of x's framework, or ``out`` when given, or ``x`` with
        ``inplace=True``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument; nothing is written then.
        Positions the host cannot see are not checked: outside the table
        they give NaN, never an out-of-bounds read [Errors].

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> x = np.zeros((2, 16, 8, 64), np.float32)            # [b, s, h, d]
    >>> inv_freq = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    >>> cupy_rope.apply_rope(x, inv_freq=inv_freq.astype(np.float32)).shape
    (2, 16, 8, 64)
    """
    return _execute(
        "rope", (x,), (cos, sin, inv_freq, freqs, cos_sin_cache), (positions, cu_seqlens, out),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, _key_sections(sections),
         sections_interleaved, inplace, backward),
        offsets)


def apply_rope_backward(grad, cos=None, sin=None, *, inv_freq=None, freqs=None,
                        cos_sin_cache=None, positions=None, offsets=None, layout="bshd",
                        interleaved=False, rotary_dim=None, inplace=False, out=None,
                        cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None, sections=None,
                        sections_interleaved=False):
    """Gradient of :func:`apply_rope` with respect to x: rotation by -theta.

    The same as ``apply_rope(grad, ..., backward=True)`` [Backward in
    ``docs/api.md``].

    Parameters
    ----------
    grad : array
        The output gradient, shaped like the forward's ``x`` (error
        messages call it ``x``).
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
interleaved, rotary_dim, inplace, out, cu_seqlens, cp_size, cp_rank, \
head_dim, sections, sections_interleaved
        As for :func:`apply_rope`; pass the forward call's values.

    Returns
    -------
    array
        The gradient with respect to x: a new array, or ``out``, or
        ``grad`` itself with ``inplace=True``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument.

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> inv_freq = np.linspace(0.01, 1, 32).astype(np.float32)
    >>> dy = np.ones((2, 16, 8, 64), np.float32)             # [b, s, h, d]
    >>> cupy_rope.apply_rope_backward(dy, inv_freq=inv_freq).shape
    (2, 16, 8, 64)
    """
    return _execute(
        "rope", (grad,), (cos, sin, inv_freq, freqs, cos_sin_cache), (positions, cu_seqlens, out),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, _key_sections(sections),
         sections_interleaved, inplace, True),
        offsets)


def apply_rope_qk(q, k, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
                  positions=None, offsets=None, layout="bshd", interleaved=False,
                  rotary_dim=None, inplace=False, out_q=None, out_k=None, backward=False,
                  cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None, sections=None,
                  sections_interleaved=False):
    """Rotate q and k in one launch.

    q and k share the layout, token axes, head_dim, dtype and the angle and
    position arguments; their head counts are free (GQA, MQA). cos/sin are
    computed once per token for the heads of both.

    Parameters
    ----------
    q : array
        [.., hq, d] in ``layout``, as ``x`` of :func:`apply_rope`.
    k : array
        [.., hk, d] on q's token axes; not None (to rotate q alone use
        :func:`apply_rope`).
    out_q, out_k : array, optional
        Where to write the results (both or neither) [Outputs and in-place].
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
interleaved, rotary_dim, inplace, backward, cu_seqlens, cp_size, cp_rank, \
head_dim, sections, sections_interleaved
        As for :func:`apply_rope`.

    Returns
    -------
    tuple of array
        (q_rot, k_rot): new arrays, or (out_q, out_k), or (q, k) with
        ``inplace=True``.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument (``k`` overlapping ``q`` in
        place, among others).

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> q = np.zeros((64, 32, 128), np.float32)              # [t, hq, d]
    >>> k = np.zeros((64, 8, 128), np.float32)               # [t, hk, d]
    >>> cache = np.zeros((4096, 128), np.float32)            # [max_position, r]
    >>> pos = np.arange(64)
    >>> q, k = cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos,
    ...                                layout="thd", inplace=True)
    """
    return _execute(
        "qk", (q, k), (cos, sin, inv_freq, freqs, cos_sin_cache),
        (positions, cu_seqlens, out_q, out_k),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, _key_sections(sections),
         sections_interleaved, inplace, backward),
        offsets)


def apply_rope_qkv(qkv, cos=None, sin=None, *, num_q_heads, num_kv_heads, head_dim=None,
                   packing="concat", inv_freq=None, freqs=None, cos_sin_cache=None,
                   positions=None, offsets=None, layout="bshd", interleaved=False,
                   rotary_dim=None, out_q=None, out_k=None, out_v=None, backward=False,
                   cu_seqlens=None, cp_size=1, cp_rank=0, sections=None,
                   sections_interleaved=False):
    """Split a packed QKV projection into rotated q, rotated k and v, in one launch.

    Parameters
    ----------
    qkv : array
        The token axes of ``layout`` then [(hq + 2 hk) * d] or
        [hq + 2 hk, d] [Packed QKV].
    num_q_heads, num_kv_heads : int
        hq and hk.
    head_dim : int, optional
        d; the flat form can infer it.
    packing : {"concat", "grouped"}
        q heads, then k, then v (vLLM, Hugging Face); or hk groups of
        (hq/hk q, 1 k, 1 v) (Megatron-LM, TransformerEngine) [Packed QKV].
    out_q, out_k, out_v : array, optional
        Where to write q, k and v (all three or none).
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
interleaved, rotary_dim, backward, cu_seqlens, cp_size, cp_rank, sections, \
sections_interleaved
        As for :func:`apply_rope`.

    Returns
    -------
    tuple of array
        (q [.., hq, d], k [.., hk, d], v [.., hk, d]): new contiguous
        arrays, or (out_q, out_k, out_v). q and k are rotated, v copied.

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument.

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> qkv = np.zeros((2, 16, (32 + 2 * 8) * 128), np.float32)  # [b, s, (hq + 2 hk) * d]
    >>> inv_freq = np.linspace(0.01, 1, 64).astype(np.float32)
    >>> q, k, v = cupy_rope.apply_rope_qkv(qkv, inv_freq=inv_freq, num_q_heads=32,
    ...                                    num_kv_heads=8)
    >>> q.shape, k.shape
    ((2, 16, 32, 128), (2, 16, 8, 128))
    """
    return _execute(
        "qkv", (qkv,), (cos, sin, inv_freq, freqs, cos_sin_cache),
        (positions, cu_seqlens, out_q, out_k, out_v),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, _key_sections(sections),
         sections_interleaved, backward, num_q_heads, num_kv_heads, packing),
        offsets)


def apply_rope_qkv_backward(dq, dk, dv, cos=None, sin=None, *, packing="concat", inv_freq=None,
                            freqs=None, cos_sin_cache=None, positions=None, offsets=None,
                            layout="bshd", interleaved=False, rotary_dim=None, out=None,
                            cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None,
                            sections=None, sections_interleaved=False):
    """Gradient of :func:`apply_rope_qkv` with respect to ``qkv``, in one launch.

    Rotates dq and dk by -theta and packs them with dv [Backward, Packed
    QKV in ``docs/api.md``].

    Parameters
    ----------
    dq : array
        [.., hq, d], the gradient of the forward's q.
    dk, dv : array
        [.., hk, d], the gradients of its k and v.
    packing : {"concat", "grouped"}
        The forward's packing.
    out : array, optional
        Where to write the packed gradient, shaped like the forward's ``qkv``.
    cos, sin, inv_freq, freqs, cos_sin_cache, positions, offsets, layout, \
interleaved, rotary_dim, cu_seqlens, cp_size, cp_rank, head_dim, sections, \
sections_interleaved
        As for :func:`apply_rope`; pass the forward call's values.

    Returns
    -------
    array
        ``out`` when given, else a new [.., (hq + 2 hk) * d].

    Raises
    ------
    ValueError, TypeError
        For bad input, naming the argument.

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> dq = np.zeros((2, 16, 32, 128), np.float32)
    >>> dk = dv = np.zeros((2, 16, 8, 128), np.float32)
    >>> inv_freq = np.linspace(0.01, 1, 64).astype(np.float32)
    >>> cupy_rope.apply_rope_qkv_backward(dq, dk, dv, inv_freq=inv_freq).shape
    (2, 16, 6144)
    """
    return _execute(
        "qkv_backward", (dq, dk, dv), (cos, sin, inv_freq, freqs, cos_sin_cache),
        (positions, cu_seqlens, out),
        (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, _key_sections(sections),
         sections_interleaved, packing),
        offsets)


# ------------------------------------------------------------ bound form --
# The decode step's pointers as RotaryEmbedding.qk_ passes them to its
# launchers, by index in apply_rope_qk's arrays; the tables' indices follow.
_QK_ROLES = _OPS["qk"].roles
_QK_ARGS = {i: name for i, name in enumerate(_QK_ROLES) if name in ("q", "k", "positions")}
_QK_FIRST_TABLE = _QK_ROLES.index(TABLE_NAMES[0])


class RotaryEmbedding:
    """The angle source and options bound once; calls pass only what changes.

    The tables are signed once here (pointer, shape, strides, dtype), so a
    cached call reads only the per-call arrays: the cheapest way to launch a
    decode step from Python (:meth:`qk_`). Each method returns exactly what
    the matching ``apply_rope*`` function returns and is validated the same
    way the first time a signature is seen.

    Parameters
    ----------
    cos, sin, inv_freq, freqs, cos_sin_cache : array, optional
        The one angle source, as for :func:`apply_rope` [Angle sources in
        ``docs/api.md``]. Held, not copied: their contents may change
        between calls, but they must not be resized or re-pointed in place
        (``resize_``, ``set_``); make a new object instead.
    layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, sections, \
sections_interleaved
        As for :func:`apply_rope`.

    Raises
    ------
    ValueError, TypeError
        For bad arguments, as the functions check them: the angle source
        (exactly one; cos with sin; arrays of the allowed dtypes) and every
        option. What needs x (its dtype against the tables', head_dim) is
        checked on the first call.

    Notes
    -----
    Copies (``copy.copy``, ``copy.deepcopy``, pickling) are made again
    through the constructor, with their own tables' pointers.

    Examples
    --------
    >>> import numpy as np, cupy_rope
    >>> cache = np.zeros((4096, 128), np.float32)            # [max_position, r]
    >>> rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    >>> q = np.zeros((64, 32, 128), np.float32)              # [t, hq, d]
    >>> k = np.zeros((64, 8, 128), np.float32)               # [t, hk, d]
    >>> q, k = rope.qk_(q, k, np.arange(64))
    """

    __slots__ = ("_tables", "_bound", "_fixed", "_common", "_fast", "_qk_options")

    def __init__(self, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
                 layout="bshd", interleaved=False, rotary_dim=None, head_dim=None, cp_size=1,
                 cp_rank=0, sections=None, sections_interleaved=False):
        self._tables = (cos, sin, inv_freq, freqs, cos_sin_cache)
        if all(t is None for t in self._tables):
            raise ValueError("RotaryEmbedding: give an angle source: cos and sin, "
                             "cos_sin_cache, inv_freq or freqs")
        # Checked now with the calls' own checks, so that a bad argument fails
        # here and not on the first call; flags become Python bools.
        o = validate.check_bound(self._tables, validate.Options(
            layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, sections,
            sections_interleaved))
        layout, interleaved, head_dim, cp_size, cp_rank, sections_interleaved = (
            o.layout, o.interleaved, o.head_dim, o.cp_size, o.cp_rank, o.sections_interleaved)
        key: list = []
        ptrs: list = []
        signed = all(t is None or _sign(t, key, ptrs) for t in self._tables)
        if signed:  # (the None entries: as _execute writes them)
            it_key, it_ptr = iter(key), iter(ptrs)
            key = [None if t is None else next(it_key) for t in self._tables]
            ptrs = [0 if t is None else next(it_ptr) for t in self._tables]
        self._bound = (("bound",) + tuple(key), tuple(ptrs)) if signed else None
        self._fixed = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                           head_dim=head_dim, cp_size=cp_size, cp_rank=cp_rank,
                           sections=o.sections, sections_interleaved=sections_interleaved)
        # The options every op's tuple starts with (_COMMON_OPTIONS); the checked
        # sections, so that an array given for them still keys a cached plan.
        self._common = (layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank,
                        _key_sections(o.sections), sections_interleaved)
        # qk_'s own plans, keyed by the q, k, positions signatures alone.
        self._fast = {} if signed else None
        self._qk_options = self._common + (True, False)  # inplace, not backward

    def __reduce__(self):
        """Copies and pickles are made again through ``__init__``, which signs
        their own tables (a deep copy's tables have new pointers)."""
        return (_rotary_embedding, (self._tables, self._fixed))

    def rope(self, x, positions=None, offsets=None, *, inplace=False, out=None, backward=False,
             cu_seqlens=None):
        """:func:`apply_rope` with the bound angles and options (also ``rope(...)``
        as ``self(...)``).

        Parameters
        ----------
        x, positions, offsets, inplace, out, backward, cu_seqlens
            As for :func:`apply_rope`.

        Returns
        -------
        array
            What :func:`apply_rope` returns.

        Raises
        ------
        ValueError, TypeError
            As :func:`apply_rope`; also when a bound table changed its shape,
            strides, dtype or memory since it was bound.

        Examples
        --------
        >>> y = rope(x, positions)                                # doctest: +SKIP
        """
        return _execute("rope", (x,), self._tables, (positions, cu_seqlens, out),
                        self._common + (inplace, backward), offsets, self._bound)

    __call__ = rope

    def qk(self, q, k, positions=None, offsets=None, *, inplace=False, out_q=None, out_k=None,
           backward=False, cu_seqlens=None):
        """:func:`apply_rope_qk` with the bound angles and options.

        Parameters
        ----------
        q, k, positions, offsets, inplace, out_q, out_k, backward, cu_seqlens
            As for :func:`apply_rope_qk`.

        Returns
        -------
        tuple of array
            What :func:`apply_rope_qk` returns.

        Raises
        ------
        ValueError, TypeError
            As :meth:`rope`.

        Examples
        --------
        >>> q_rot, k_rot = rope.qk(q, k, positions)               # doctest: +SKIP
        """
        return _execute("qk", (q, k), self._tables, (positions, cu_seqlens, out_q, out_k),
                        self._common + (inplace, backward), offsets, self._bound)

    def qk_(self, q, k, positions=None):
        """Rotate q and k in place at ``positions``: the decode step.

        Once a (q, k, positions) signature has been validated, a call reads
        the three arrays' signatures and pointers, checks that the written
        arrays overlap nothing, and launches. (vLLM's
        ``rotary_emb(positions, q, k)`` puts positions first.)

        Parameters
        ----------
        q, k : array
            As for :func:`apply_rope_qk`; rotated in place.
        positions : array, optional
            As for :func:`apply_rope`.

        Returns
        -------
        tuple of array
            (q, k).

        Raises
        ------
        ValueError, TypeError
            As :meth:`rope` (k overlapping q among others).

        Examples
        --------
        >>> q, k = rope.qk_(q, k, positions)                      # doctest: +SKIP
        """
        fast = self._fast
        remember = None
        cls = type(q)
        if fast is not None and type(k) is cls and type(positions) is cls:
            key3 = _KEY3.get(cls) or interop.key3(cls)
            got = key3(q, k, positions)
            if got is not None:
                go = fast.get(got[0])
                # A plan of this object's with nothing to allocate: only the
                # overlap test is left per call (go returns False on overlap).
                if go is not None and go(*got[1]):
                    written((q, k))
                    return q, k
                if go is None and len(fast) < 256:
                    remember = functools.partial(self._remember, fast, got[0], self._bound[1])
        return _execute(
            "qk", (q, k), self._tables, (positions, None, None, None), self._qk_options, None,
            self._bound, remember)

    @staticmethod
    def _remember(fast, key, table_ptrs, prepared):
        """qk_'s cache entry: a launcher of (q, k, positions) pointers for a plan
        with nothing to allocate and any offset allowed (offset 0 is used)."""
        r = prepared.offset_range
        if not prepared.allocs and r[0] <= 0 < r[1]:
            consts = {_QK_FIRST_TABLE + i: p for i, p in enumerate(table_ptrs)}
            fast[key] = launch.bound_launcher(prepared.plan, prepared.disjoint, _QK_ARGS, consts)

    def qkv(self, qkv, positions=None, offsets=None, *, num_q_heads, num_kv_heads,
            packing="concat", out_q=None, out_k=None, out_v=None, backward=False,
            cu_seqlens=None):
        """:func:`apply_rope_qkv` with the bound angles and options.

        Parameters
        ----------
        qkv, positions, offsets, num_q_heads, num_kv_heads, packing, out_q, \
out_k, out_v, backward, cu_seqlens
            As for :func:`apply_rope_qkv`.

        Returns
        -------
        tuple of array
            What :func:`apply_rope_qkv` returns.

        Raises
        ------
        ValueError, TypeError
            As :meth:`rope`.

        Examples
        --------
        >>> q, k, v = rope.qkv(qkv, num_q_heads=32, num_kv_heads=8)  # doctest: +SKIP
        """
        return _execute(
            "qkv", (qkv,), self._tables, (positions, cu_seqlens, out_q, out_k, out_v),
            self._common + (backward, num_q_heads, num_kv_heads, packing), offsets, self._bound)

    def qkv_backward(self, dq, dk, dv, positions=None, offsets=None, *, packing="concat",
                     out=None, cu_seqlens=None):
        """:func:`apply_rope_qkv_backward` with the bound angles and options.

        Parameters
        ----------
        dq, dk, dv, positions, offsets, packing, out, cu_seqlens
            As for :func:`apply_rope_qkv_backward`.

        Returns
        -------
        array
            What :func:`apply_rope_qkv_backward` returns.

        Raises
        ------
        ValueError, TypeError
            As :meth:`rope`.

        Examples
        --------
        >>> dqkv = rope.qkv_backward(dq, dk, dv)                  # doctest: +SKIP
        """
        return _execute(
            "qkv_backward", (dq, dk, dv), self._tables, (positions, cu_seqlens, out),
            self._common + (packing,), offsets, self._bound)


def _rotary_embedding(tables, fixed):
    """RotaryEmbedding.__reduce__'s constructor."""
    cos, sin, inv_freq, freqs, cos_sin_cache = tables
    return RotaryEmbedding(cos, sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
                           **fixed)
