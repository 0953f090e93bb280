"""Public functions.

Every function takes the same angle and position arguments (docs/api.md):

- One angle source, indexed by frequency f in [0, r/2) (r = rotary_dim):
  ``cos``, ``sin``: [max_position, r/2] tables (float32 or the input's dtype);
  ``cos_sin_cache``: [max_position, r] with cos in the first half and sin in
  the second (vLLM / FlashInfer); ``inv_freq``: [r/2] float32, the angle
  position * inv_freq[f] computed in the kernel (no table traffic);
  ``freqs``: [max_position, r/2] float32 angles.
- Positions: by default the sequence index (bshd/sbhd: the s axis; thd: the
  index inside each ``cu_seqlens`` sequence, or the token index without
  cu_seqlens); ``positions`` replaces it ([s] or [b, s]; thd: [t]);
  ``offsets`` (an int, or [b] / [n_seqs] int32/int64) is added. With
  ``cp_size`` > 1 implied positions are those of context-parallel rank
  ``cp_rank`` (see :func:`apply_rope`).
- ``layout``: "bshd" [b, s, h, d], "sbhd" [s, b, h, d] or "thd" [t, h, d];
  any strides, no copies. Heads and channels may be flattened ([.., h * d])
  when ``head_dim`` is given.
- ``interleaved``: False for NeoX / rotate-half pairs (f, f + r/2), True for
  GPT-J pairs (2f, 2f + 1). ``backward=True`` rotates by -theta: the gradient
  of the forward rotation.

Inputs are torch, JAX, CuPy or any DLPack arrays on a CUDA device; results
come back in the caller's framework (torch -> torch, JAX -> JAX, others ->
CuPy), computed on the caller's current stream without any sync. NumPy
inputs run the float64 NumPy reference. A call whose signature (shapes,
strides, dtypes, pointer alignment, options) was seen before reuses its
launch plan: only the data pointers are read and the kernel is launched.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import numpy as np

from . import interop, launch, reference
from . import validate
from .validate import check_call

_plans: dict = {}
_plans_lock = threading.Lock()
_MAX_PLANS = 4096
#: Check device-resident cu_seqlens values too (costs a device sync per call).
CHECK_DEVICE_VALUES = os.environ.get("CUPY_ROPE_CHECK_DEVICE_VALUES", "") not in ("", "0")


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
    """Forget every cached launch plan: the general path's and the functional
    fast path's (RotaryEmbedding objects keep their own qk_ launchers). The
    next call of each signature is validated and planned again, under the
    launcher's rules of that moment (scripts and tests that change them)."""
    with _plans_lock:
        _plans.clear()
        _fast_calls.clear()
        _fast_count[0] = 0


def _fast_call(op, classes, n_head, bound):
    """A _FastCall for arrays of these classes (None where absent), or False
    when some class has no straight-line signer (host arrays, JAX, ...).
    With ``bound`` (a RotaryEmbedding's signed tables, which follow the
    ``n_head`` head arrays) the tables' pointers are constants, not read.
    Arrays sharing a pointer (out=x, q is k) keep to the general path."""
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
    freqs, cos_sin_cache) and ``tail`` (positions, cu_seqlens, outputs).
    The key is the op, its options and every array's signature. ``bound``
    (a :class:`RotaryEmbedding`'s signed tables) replaces signing the tables;
    ``remember(prepared)`` is called with the prepared plan of a call whose
    arrays all have distinct pointers (RotaryEmbedding.qk_ keeps a launcher).
    Calls without a ``remember`` of their own (qk_ brings one for a
    signature it will keep) look their pattern up in ``_fast_calls`` first;
    on a signature's first call there, its ``remember`` keeps the launcher.
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
    # The option types too: 64.0 == 64 and 1 == True, but validation refuses
    # a float rotary_dim or an int inplace, so they must not share a plan.
    key = [op, options, tuple(map(type, options))]
    ptrs: list = []
    signers = _SIGNERS
    if bound is None:
        parts = (head, tables, tail)
    else:
        parts = (head, tail)
    for part in parts:
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
            # Arrays sharing a pointer (out=x, cos is sin, q is k): a plan of its own.
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
    if bound is not None:
        _check_bound_tables(tables, bound[0])
    result = _slow(op, arrays, _KWARGS[op](head, tables, tail, options), offsets, key)
    if remember is not None and key is not None:
        prepared = _plans.get(key)
        if prepared is not None:
            remember(prepared)
    return result


def option_kwargs(kw: dict, layout="bshd", interleaved=False, rotary_dim=None, head_dim=None,
                   cp_size=1, cp_rank=0, sections=None, sections_interleaved=False) -> dict:
    """Add the layout options that differ from the defaults to ``kw`` (the
    framework adapters build library calls with it); returns ``kw``."""
    if layout != "bshd":
        kw["layout"] = layout
    for flag, name in ((interleaved, "interleaved"),
                       (sections_interleaved, "sections_interleaved")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
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


_TABLE_NAMES = ("cos", "sin", "inv_freq", "freqs", "cos_sin_cache")


def _check_bound_tables(tables, signed) -> None:
    """A RotaryEmbedding's tables must still be what it signed (else a plan made
    for the changed table would be cached under the old signature)."""
    for name, t, sig in zip(_TABLE_NAMES, tables, signed[1:]):
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
    return 0, offsets  # an array, or a bad value (bool, float) that validation refuses


def _slow(op, arrays, kwargs, offsets, key):
    """Validate everything, allocate outputs, plan, launch; cache the plan."""
    call = check_call(offsets=offsets, **kwargs)  # raises on bad input
    if not call.on_gpu:
        allocated, out_kw = _allocate(op, call)
        if allocated:
            call = check_call(offsets=offsets, **{**kwargs, **out_kw})
        _numpy_into(call)
        return _RESULTS[op](arrays, allocated)
    cacheable = key is not None
    uploaded = []
    cu = call.cu_seqlens
    if cu is not None and not cu.on_gpu:
        # Host cu_seqlens (their values were checked): uploaded on the launch
        # stream for this call, which then waits for the kernel (below).
        uploaded = [interop.to_device(cu, call.device[1], interop.stream_for(call.x))]
        kwargs = {**kwargs, "cu_seqlens": uploaded[0]}
        cacheable = False
    elif cu is not None and CHECK_DEVICE_VALUES:
        host = interop.describe(interop.to_host(cu.obj), "cu_seqlens")
        validate.check_cu_seqlens(host, call.tokens, call.cp_size)
        cacheable = False
    allocated, out_kw = _allocate(op, call)
    if allocated or uploaded:
        kwargs = {**kwargs, **out_kw}
        call = check_call(offsets=offsets, **kwargs)
    n_user = len(arrays)
    arrays = list(arrays) + allocated + uploaded
    disjoint = launch.disjoint_pairs(call, arrays, set(range(n_user, len(arrays))))
    plan = launch.Plan(call, arrays)
    offset_range = (-(2**62) + 1, 2**62)  # what validation accepts
    if call.pos_mode == "implied" and call.offsets is None:
        # Implied positions [0, seqlen * cp_size) + offset must stay inside the
        # table, or (computed angles) below 2**53 in magnitude.
        span = call.seqlen * call.cp_size - 1
        if call.source != "inv_freq":
            offset_range = (0, call.max_position - span)
        else:
            top = validate.MAX_COMPUTED_POSITION
            offset_range = (-top + 1, top - span)
    if cacheable:
        prepared = _Prepared(plan, _fast_allocs(op, call, arrays, len(allocated)),
                             [_sig_of(o) for o in allocated], disjoint,
                             offset_range, _RESULTS[op])
        with _plans_lock:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = prepared
    plan.launch([interop.data_ptr(a) if a is not None else 0 for a in arrays], call.offset)
    if uploaded:  # keep the uploaded cu_seqlens alive until the kernel has read them
        interop.synchronize_stream(interop.stream_for(call.x), call.device[1])
    return _RESULTS[op](arrays[:n_user], allocated)


# ------------------------------------------------------------- per op --
# Each op: which outputs the library allocates, how they are made again on
# later calls of the same signature, and what the call returns.
def _allocate(op, call):
    """Outputs to allocate for this call (list) and the kwargs naming them."""
    slabs = call.slabs
    if slabs[0].out is not None:
        return [], {}
    if op in ("rope", "qk"):
        outs = [interop.empty_like(s.x) for s in slabs]
        return outs, ({"out": outs[0]} if op == "rope" else {"out": outs[0], "out_k": outs[1]})
    tok = tuple(slabs[0].x.shape[:1 if call.layout == "thd" else 2])
    if op == "qkv":
        outs = [interop.empty(slabs[0].x, tok + (s.heads, call.head_dim)) for s in slabs]
        return outs, {"out": tuple(outs)}
    # qkv_backward: one packed gradient [.., (hq + 2 hk) * d]
    packed = interop.empty(slabs[0].x, tok + (call.heads * call.head_dim,))
    return [packed], {"out": packed}


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
    return [lambda arrays, shape=shape: interop.empty(interop.describe(arrays[i], "x"), shape)
            for shape in shapes]


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
    """Record that the call wrote ``arrays`` (all of one class) in place."""
    f = _VERSION_BUMPS.get(type(arrays[0]))
    if f is None:
        f = _bumper(type(arrays[0]))
    if f:
        f(arrays)


def _result_rope(arrays, outs):
    x, out = arrays[0], arrays[_OUT_INDEX["rope"]]
    if outs:
        return _wrap(x, outs[0])
    r = out if out is not None else x
    written((r,))
    return r


def _result_qk(arrays, outs):
    q, k = arrays[0], arrays[1]
    if outs:
        return _wrap(q, outs[0]), _wrap(q, outs[1])
    i = _OUT_INDEX["qk"]
    if arrays[i] is not None:
        q, k = arrays[i], arrays[i + 1]
    if type(q) is type(k):
        written((q, k))
    else:
        written((q,))
        written((k,))
    return q, k


def _result_qkv(arrays, outs):
    if outs:
        return tuple(_wrap(arrays[0], o) for o in outs)
    i = _OUT_INDEX["qkv"]
    for o in arrays[i:i + 3]:
        written((o,))
    return tuple(arrays[i:i + 3])


def _result_qkv_backward(arrays, outs):
    if outs:
        return _wrap(arrays[0], outs[0])
    out = arrays[_OUT_INDEX["qkv_backward"]]
    written((out,))
    return out


def _wrap(like, arr):
    if type(like) is type(arr):
        return arr
    return interop.wrap_result(interop.describe(like, "x"), arr)


_RESULTS = {"rope": _result_rope, "qk": _result_qk, "qkv": _result_qkv,
            "qkv_backward": _result_qkv_backward}


# The keyword arguments of check_call for each op, rebuilt from _execute's
# parts (the public functions pass no closure: its cells would cost every
# call, the cached ones too). ``options`` are ordered as the functions build
# them; ``tail`` may end with an offsets array (not an argument here).
def _common_kwargs(tables, tail, layout, interleaved, rotary_dim, cp_size, cp_rank, head_dim,
                   sections, sections_interleaved) -> dict:
    return dict(zip(_TABLE_NAMES, tables), positions=tail[0], cu_seqlens=tail[1],
                layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, cp_size=cp_size,
                cp_rank=cp_rank, head_dim=head_dim, sections=sections,
                sections_interleaved=sections_interleaved)


def _rope_kwargs(head, tables, tail, options) -> dict:
    layout, interleaved, rotary_dim, inplace, backward, cp_size, cp_rank, head_dim, *sec = options
    return dict(x=head[0], inplace=inplace, out=tail[2], backward=backward,
                **_common_kwargs(tables, tail, layout, interleaved, rotary_dim, cp_size, cp_rank,
                                 head_dim, *sec))


def _qk_kwargs(head, tables, tail, options) -> dict:
    layout, interleaved, rotary_dim, inplace, backward, cp_size, cp_rank, head_dim, *sec = options
    return dict(x=head[0], k=head[1], inplace=inplace, out=tail[2], out_k=tail[3],
                backward=backward,
                **_common_kwargs(tables, tail, layout, interleaved, rotary_dim, cp_size, cp_rank,
                                 head_dim, *sec))


def _qkv_kwargs(head, tables, tail, options) -> dict:
    (layout, interleaved, rotary_dim, backward, cp_size, cp_rank, head_dim, num_q_heads,
     num_kv_heads, packing, *sec) = options
    outs = tail[2:5]
    return dict(qkv=head[0], backward=backward, out=outs if outs[0] is not None else None,
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, packing=packing,
                **_common_kwargs(tables, tail, layout, interleaved, rotary_dim, cp_size, cp_rank,
                                 head_dim, *sec))


def _qkv_backward_kwargs(head, tables, tail, options) -> dict:
    layout, interleaved, rotary_dim, cp_size, cp_rank, head_dim, packing, *sec = options
    dq, dk, _ = head
    return dict(qkv_grads=tuple(head), backward=True, out=tail[2],
                num_q_heads=_heads(dq, layout, head_dim), num_kv_heads=_heads(dk, layout, head_dim),
                packing=packing,
                **_common_kwargs(tables, tail, layout, interleaved, rotary_dim, cp_size, cp_rank,
                                 head_dim, *sec))


_KWARGS = {"rope": _rope_kwargs, "qk": _qk_kwargs, "qkv": _qkv_kwargs,
           "qkv_backward": _qkv_backward_kwargs}
# Where the outputs sit in each op's array tuple: inputs, the seven angle and
# position arrays (cos, sin, inv_freq, freqs, cos_sin_cache, positions,
# cu_seqlens), the outputs, then the offsets array.
_OUT_INDEX = {"rope": 8, "qk": 9, "qkv": 8, "qkv_backward": 10}


def _numpy_into(call):
    """The NumPy reference path: write every slab's result into its output."""
    for slab, y in zip(call.slabs, reference.rope_slabs(call)):
        dst = reference.strided_view(slab.out, slab.out_offset, slab.out_strides, call.batch,
                                     call.seqlen, slab.heads, slab.heads_per_group,
                                     call.head_dim)
        y = y.reshape(dst.shape)
        if call.inplace and call.rotary_dim < call.head_dim:
            # In place, channels past rotary_dim are not touched at all.
            dst[..., :call.rotary_dim] = y[..., :call.rotary_dim].astype(dst.dtype)
        else:
            dst[...] = y.astype(dst.dtype)


# ------------------------------------------------------------- public --
def apply_rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
               positions=None, offsets=None, layout="bshd", interleaved=False, rotary_dim=None,
               inplace=False, out=None, backward=False, cu_seqlens=None, cp_size=1, cp_rank=0,
               head_dim=None, sections=None, sections_interleaved=False):
    """Apply rotary position embedding to ``x``.

    Shapes (b = batch, s = sequence, t = packed tokens, h = heads,
    d = head_dim, r = rotary_dim):

    - ``x``: [b, s, h, d] (``layout="bshd"``), [s, b, h, d] (``"sbhd"``) or
      [t, h, d] (``"thd"``), any strides (e.g. ``q.transpose(1, 2)`` of a
      [b, h, s, d] tensor) with no copy; or with heads flattened
      ([.., h * d]) when ``head_dim`` is given. float32, float16 or bfloat16.
    - Angle source: ``cos`` and ``sin`` [max_position, r/2], or
      ``cos_sin_cache`` [max_position, r], or ``inv_freq`` [r/2] (angles
      computed in the kernel: fp32 product reduced exactly, accurate sincos),
      or ``freqs`` [max_position, r/2] angles.
    - Positions: the sequence index by default; ``positions`` ([s] or [b, s];
      thd: [t]) replaces it; ``offsets`` (int, or [b]; thd with ``cu_seqlens``:
      [n_seqs]) is added.
    - ``cu_seqlens`` (thd): int32 [n_seqs + 1] cumulative lengths; positions
      restart at 0 in every sequence; empty sequences are fine.
    - ``sections`` (M-RoPE, axial RoPE): frequencies per position axis
      (1 to 3 axes, summing to r/2), with ``positions`` [axes, s], [axes, b, s]
      or (thd) [axes, t]: frequency f rotates by the position of its axis.
      Contiguous sections: the first sections[0] frequencies use axis 0, and
      so on (Qwen2-VL's ``mrope_section``; Flux's ``axes_dim`` / 2 with
      ``inv_freq`` the concatenation of each axis's frequencies).
      ``sections_interleaved=True``: Qwen3-VL's assignment (f % 3 == 1 and
      f < 3 * sections[1] use axis 1, f % 3 == 2 and f < 3 * sections[2]
      axis 2, every other f axis 0).
    - Context parallelism (``cp_size`` > 1, rank ``cp_rank``), for implied
      positions: every full sequence of length L is cut into 2 * cp_size
      chunks of c = L / (2 * cp_size) tokens and this rank holds chunks
      ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` back to back, so local
      index i < c has position cp_rank * c + i and i >= c has position
      (2 * cp_size - 1 - cp_rank) * c + (i - c). bshd/sbhd: x holds the
      rank's 2c tokens of every sequence. thd: ``cu_seqlens`` describe the
      full sequences (each length divisible by 2 * cp_size) and x holds
      cu_seqlens[-1] / cp_size tokens; sequence s starts at local token
      cu_seqlens[s] / cp_size (as in Megatron / TransformerEngine).
    - ``rotary_dim``: set by the angle source (r/2 frequencies); passing it
      checks that (partial rotary: give a source of r/2 frequencies, e.g.
      ``cos[:, :r // 2]``). Channels [r, d) are copied bit-exact when
      writing a new array and not touched at all in place.
    - ``interleaved=False``: NeoX / rotate-half pairs (f, f + r/2);
      ``interleaved=True``: GPT-J pairs (2f, 2f + 1). Each pair (a, b)
      becomes (a cos - b sin, b cos + a sin); ``backward=True`` applies the
      transpose (rotation by -theta), the gradient with respect to x.

    Returns a new array of x's framework, or ``out`` when given, or ``x``
    itself with ``inplace=True``. A position outside a table that the host
    cannot see (device positions, offsets or cu_seqlens), a token that device
    cu_seqlens leave out, or (cp_size > 1) a device cu_seqlens sequence
    whose length is not a multiple of 2 * cp_size (and every later one,
    whose start is then misaligned) yields NaN in the rotated channels, never
    an out-of-bounds read; host-visible positions and cu_seqlens are checked
    up front.
    """
    return _execute(
        "rope", (x,), (cos, sin, inv_freq, freqs, cos_sin_cache), (positions, cu_seqlens, out),
        (layout, interleaved, rotary_dim, inplace, backward, cp_size, cp_rank, head_dim,
         _key_sections(sections), sections_interleaved),
        offsets)


def apply_rope_backward(grad, cos=None, sin=None, **kwargs):
    """Gradient of :func:`apply_rope` with respect to x: rotation by -theta.

    Takes the output gradient ``grad`` (shaped like x) and the same angle,
    position and layout arguments as the forward call.
    """
    kwargs["backward"] = True
    return apply_rope(grad, cos, sin, **kwargs)


def apply_rope_qk(q, k, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
                  positions=None, offsets=None, layout="bshd", interleaved=False,
                  rotary_dim=None, inplace=False, out_q=None, out_k=None, backward=False,
                  cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None, sections=None,
                  sections_interleaved=False):
    """Rotate q [.., hq, d] and k [.., hk, d] in one launch.

    q and k share the layout, token axes, head_dim, dtype and the angle and
    position arguments of :func:`apply_rope`; their head counts are free
    (GQA, MQA: hq % hk need not be 0). Token-major [t, h, d] arrays and
    flattened [t, h * d] views (``layout="thd"``, ``head_dim=d``) with
    ``positions`` [t] into a cos/sin cache are the vLLM / FlashInfer form.
    cos/sin are computed once per token for all heads of both.

    Returns (q_rot, k_rot): new arrays, or (out_q, out_k), or (q, k) with
    ``inplace=True``.
    """
    return _execute(
        "qk", (q, k), (cos, sin, inv_freq, freqs, cos_sin_cache),
        (positions, cu_seqlens, out_q, out_k),
        (layout, interleaved, rotary_dim, inplace, backward, cp_size, cp_rank, head_dim,
         _key_sections(sections), sections_interleaved),
        offsets)


def _qkv_outputs(out_q, out_k, out_v):
    """The three outputs, checked to be all given or all None."""
    outs = (out_q, out_k, out_v)
    given = [o is not None for o in outs]
    if any(given) and not all(given):
        raise ValueError("out_q, out_k, out_v: pass all three outputs, or none")
    return outs


def apply_rope_qkv(qkv, cos=None, sin=None, *, num_q_heads, num_kv_heads, head_dim=None,
                   packing="concat", inv_freq=None, freqs=None, cos_sin_cache=None,
                   positions=None, offsets=None, layout="bshd", interleaved=False,
                   rotary_dim=None, out_q=None, out_k=None, out_v=None, backward=False,
                   cu_seqlens=None, cp_size=1, cp_rank=0, sections=None,
                   sections_interleaved=False):
    """Split a packed QKV projection into rotated q, rotated k and v, in one launch.

    ``qkv``: the token axes of ``layout`` ([b, s], [s, b] or [t]) followed by
    [(hq + 2 hk) * d] or [hq + 2 hk, d] (hq = ``num_q_heads``, hk =
    ``num_kv_heads``; d = ``head_dim``, which the flat form can infer).
    Supported packings of the head axis:

    - ``"concat"``: all q heads, then all k heads, then all v heads (vLLM,
      Hugging Face fused qkv_proj).
    - ``"grouped"``: hk groups, each (hq/hk q heads, 1 k head, 1 v head)
      (Megatron-LM / TransformerEngine); for hq == hk, q, k and v side by
      side per head. A [.., groups, (hq/hk + 2) * d] array (TE's shape)
      goes in flattened ([.., hk * (hq/hk + 2) * d]) or as
      [.., hq + 2 hk, d].

    Returns new q [.., hq, d], k [.., hk, d] and v [.., hk, d] (or out_q,
    out_k, out_v), each contiguous. q and k are rotated as by
    :func:`apply_rope` (same angle and position arguments); v is copied.
    """
    outs = _qkv_outputs(out_q, out_k, out_v)
    return _execute(
        "qkv", (qkv,), (cos, sin, inv_freq, freqs, cos_sin_cache), (positions, cu_seqlens) + outs,
        (layout, interleaved, rotary_dim, backward, cp_size, cp_rank, head_dim, num_q_heads,
         num_kv_heads, packing, _key_sections(sections), sections_interleaved),
        offsets)


def apply_rope_qkv_backward(dq, dk, dv, cos=None, sin=None, *, packing="concat", inv_freq=None,
                            freqs=None, cos_sin_cache=None, positions=None, offsets=None,
                            layout="bshd", interleaved=False, rotary_dim=None, out=None,
                            cu_seqlens=None, cp_size=1, cp_rank=0, head_dim=None,
                            sections=None, sections_interleaved=False):
    """Gradient of :func:`apply_rope_qkv` with respect to ``qkv``, in one launch.

    Takes dq [.., hq, d], dk and dv [.., hk, d] (the gradients of its three
    outputs) and the forward's angle, position, layout and ``packing``
    arguments; rotates dq and dk by -theta and packs them with dv. Returns
    ``out`` when given (shaped like the forward's ``qkv``), else a new
    array [.., (hq + 2 hk) * d].
    """
    return _execute(
        "qkv_backward", (dq, dk, dv), (cos, sin, inv_freq, freqs, cos_sin_cache),
        (positions, cu_seqlens, out),
        (layout, interleaved, rotary_dim, cp_size, cp_rank, head_dim, packing,
         _key_sections(sections), sections_interleaved),
        offsets)


def _key_sections(sections):
    """sections as a hashable key part (a list becomes a tuple)."""
    return tuple(sections) if isinstance(sections, list) else sections


def _heads(a, layout, head_dim):
    """Head count of a gradient array (for the packed geometry)."""
    shape = getattr(a, "shape", None)
    if shape is None:
        return None
    n_tok = 1 if layout == "thd" else 2
    if len(shape) == n_tok + 2:
        return shape[-2]
    if len(shape) == n_tok + 1 and head_dim:
        return shape[-1] // head_dim
    return None


# ------------------------------------------------------------ bound form --
class RotaryEmbedding:
    """The angle source and options bound once; calls pass only what changes.

    ``RotaryEmbedding(cos, sin, *, inv_freq, freqs, cos_sin_cache, layout,
    interleaved, rotary_dim, head_dim, cp_size, cp_rank, sections,
    sections_interleaved)`` takes the angle and layout arguments of
    :func:`apply_rope`; its methods take the arrays of one call:

    - ``rope(x, positions=None, offsets=None, *, inplace, out, backward,
      cu_seqlens)`` (also ``rope(...)`` via calling the object),
    - ``qk(q, k, positions=None, offsets=None, *, inplace, out_q, out_k,
      backward, cu_seqlens)``, and ``qk_(q, k, positions)`` for the in-place
      serving step (vLLM's ``rotary_emb(positions, q, k)`` order differs:
      positions come last here),
    - ``qkv(qkv, positions=None, offsets=None, *, num_q_heads, num_kv_heads,
      packing, out_q, out_k, out_v, backward, cu_seqlens)`` and
      ``qkv_backward(dq, dk, dv, positions=None, offsets=None, *, packing,
      out, cu_seqlens)``.

    Each returns exactly what the matching ``apply_rope*`` call returns, and
    is validated the same way the first time a signature is seen. The tables
    are signed once here (pointer, shape, strides, dtype), so a cached call
    reads only the per-call arrays: this is the cheapest way to launch a
    decode step from Python. The tables are held (not copied); their
    contents may change between calls, but they must not be resized or
    re-pointed in place (``resize_``, ``set_``): make a new object instead.
    Copies (``copy.copy``, ``copy.deepcopy``, pickling) are made again
    through the constructor, with their own tables' pointers.
    """

    __slots__ = ("_tables", "_bound", "_fixed", "_fast", "_qk_options")

    def __init__(self, cos=None, sin=None, *, inv_freq=None, freqs=None, cos_sin_cache=None,
                 layout="bshd", interleaved=False, rotary_dim=None, head_dim=None, cp_size=1,
                 cp_rank=0, sections=None, sections_interleaved=False):
        self._tables = (cos, sin, inv_freq, freqs, cos_sin_cache)
        if all(t is None for t in self._tables):
            raise ValueError("RotaryEmbedding: give an angle source: cos and sin, "
                             "cos_sin_cache, inv_freq or freqs")
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
                           sections=sections, sections_interleaved=sections_interleaved)
        # qk_'s own plans, keyed by the q, k, positions signatures alone.
        self._fast = {} if signed else None
        self._qk_options = self._options(True, False)

    def __reduce__(self):
        """Copies and pickles are made again through ``__init__``, which signs
        their own tables (a deep copy's tables have new pointers)."""
        return (_rotary_embedding, (self._tables, self._fixed))

    def _options(self, *front, tail=()):
        f = self._fixed
        return (f["layout"], f["interleaved"], f["rotary_dim"], *front, f["cp_size"],
                f["cp_rank"], f["head_dim"], *tail, _key_sections(f["sections"]),
                f["sections_interleaved"])

    def rope(self, x, positions=None, offsets=None, *, inplace=False, out=None, backward=False,
             cu_seqlens=None):
        """:func:`apply_rope` with the bound angles and options."""
        return _execute("rope", (x,), self._tables, (positions, cu_seqlens, out),
                        self._options(inplace, backward), offsets, self._bound)

    __call__ = rope

    def qk(self, q, k, positions=None, offsets=None, *, inplace=False, out_q=None, out_k=None,
           backward=False, cu_seqlens=None):
        """:func:`apply_rope_qk` with the bound angles and options."""
        return _execute("qk", (q, k), self._tables, (positions, cu_seqlens, out_q, out_k),
                        self._options(inplace, backward), offsets, self._bound)

    def qk_(self, q, k, positions=None):
        """Rotate q and k in place at ``positions``; returns (q, k).

        The decode step: once a (q, k, positions) signature has been
        validated, a call reads the three arrays' signatures and pointers,
        checks that the written arrays overlap nothing, and launches.
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
            # Array indices as _execute lists them: q, k, the five tables,
            # positions, cu_seqlens, out_q, out_k.
            consts = {2 + i: p for i, p in enumerate(table_ptrs)}
            fast[key] = launch.bound_launcher(prepared.plan, prepared.disjoint,
                                              {0: "q", 1: "k", 7: "positions"}, consts)

    def qkv(self, qkv, positions=None, offsets=None, *, num_q_heads, num_kv_heads,
            packing="concat", out_q=None, out_k=None, out_v=None, backward=False,
            cu_seqlens=None):
        """:func:`apply_rope_qkv` with the bound angles and options."""
        outs = _qkv_outputs(out_q, out_k, out_v)
        return _execute(
            "qkv", (qkv,), self._tables, (positions, cu_seqlens) + outs,
            self._options(backward, tail=(num_q_heads, num_kv_heads, packing)), offsets, self._bound)

    def qkv_backward(self, dq, dk, dv, positions=None, offsets=None, *, packing="concat",
                     out=None, cu_seqlens=None):
        """:func:`apply_rope_qkv_backward` with the bound angles and options."""
        return _execute(
            "qkv_backward", (dq, dk, dv), self._tables, (positions, cu_seqlens, out),
            self._options(tail=(packing,)), offsets, self._bound)


def _rotary_embedding(tables, fixed):
    """RotaryEmbedding.__reduce__'s constructor."""
    cos, sin, inv_freq, freqs, cos_sin_cache = tables
    return RotaryEmbedding(cos, sin, inv_freq=inv_freq, freqs=freqs, cos_sin_cache=cos_sin_cache,
                           **fixed)
