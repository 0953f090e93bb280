"""JAX adapter: differentiable RoPE that runs eagerly and inside ``jax.jit``.

``import cupy_rope.jax`` (``import cupy_rope`` alone never imports JAX) gives

- :func:`rope` (alias :func:`apply_rope`): rotated copy of x,
- :func:`rope_qk` (alias :func:`apply_rope_qk`): rotated q and k in one launch,
- :func:`rope_qkv` (alias :func:`apply_rope_qkv`): packed qkv -> (q, k, v),
- :func:`qk_norm_rope` (alias :func:`apply_qk_norm_rope`): RMSNorm of q and k,
  then their rotation, in one launch (gradients for q, k and both weights),

with the keyword arguments of :func:`cupy_rope.apply_rope` (``docs/api.md``).
Each is a ``jax.custom_vjp`` whose backward runs the same kernel rotating by
-theta (``jax.grad`` never differentiates through the kernel launch); for
``rope_qkv`` the backward is :func:`cupy_rope.apply_rope_qkv_backward`, which
packs dq, dk, dv back. Each backward is itself an op with a vjp (the
forward again), so ``jax.grad`` of ``jax.grad`` works. Gradients flow to x /
q / k / qkv only: angle tables, positions and offsets get zero cotangents.
JAX arrays are immutable, so there are no in-place variants.
``qk_norm_rope``'s backward is :func:`cupy_rope.apply_qk_norm_rope_backward`
(gradients for q, k and both weights, the norm recomputed from q and k); it
is not differentiable again.

``offsets``: a Python int is static (part of the compiled program: a new
value compiles a new one), a 0-d int array is one traced offset for every
sequence (a jitted decode step), a [batch] (thd: [n_seqs]) int array one per
sequence. Host (NumPy) int64 positions or offsets beyond int32 are refused
unless ``jax_enable_x64`` is on (JAX would narrow them to int32).

Per-axis positions (M-RoPE, axial RoPE; ``docs/api.md``): ``sections`` and
``sections_interleaved`` are static arguments (part of the compiled
program, like ``layout``); ``positions`` is a traced array.

How the kernel gets into an XLA program
---------------------------------------
Two paths; which one a call takes is decided when XLA lowers it (eager calls
are lowered too: JAX compiles the single op).

1. The fast path (:mod:`cupy_rope.xla`), for CUDA: an XLA custom call that
   XLA launches as one of its own kernels (``__gpu$xla.gpu.ptx``, jaxlib
   >= 0.11; jaxlib's launcher for compiled GPU kernels,
   ``triton_kernel_call_ffi``, before). The library plans the call at lowering time
   from the shapes and options (the same plan as for CuPy arrays), NVRTC
   compiles the kernel once per plan with an entry the launcher can call
   (the plan's fixed parameters in constant memory), and XLA then
   launches it on its own stream on every execution: no Python runs and
   nothing synchronizes.
2. ``jax.experimental.buffer_callback`` (JAX >= 0.7), the fallback: target
   ``xla_buffer_python_gpu_callback``, a Python function called on the host
   thread enqueueing XLA's work with XLA's stream and buffers; we wrap the
   buffers as CuPy arrays (no copy), make XLA's stream CuPy's current one and
   launch the same kernel there. It costs host time per op (the GIL, the
   library's argument checks) and is not marked ``command_buffer_compatible``.

Which calls take which path: the fast path serves every op (``rope``,
``rope_qk``, ``rope_qkv``, their backward and second order, M-RoPE, thd,
``jax.vmap``) on a process that sees a single GPU of compute capability 7.0
or newer, with a jaxlib that has either custom call, for dtypes CuPy has
(bfloat16 from CuPy 14). The callback serves the rest: CPU arrays (the
library's float64 NumPy reference), several visible GPUs, any call the
fast path's planning or compile refuses (``cupy_rope.xla.last_refusal``
says why), and every call while ``CUPY_ROPE_JAX_LAUNCH=callback`` is set.
``qk_norm_rope`` always takes the callback (the fast path plans the rope
kernels only).
Both paths order the kernel on XLA's stream, after the producers of its
inputs and before its consumers, with no host round trip.

Alternatives considered: ``jax.ffi.ffi_call`` needs an XLA FFI handler, a C
function compiled against ``xla/ffi/api/ffi.h`` (this package has no
compiled host code); ``jax.pure_callback`` copies every operand to host
memory and back and synchronizes the device.

Limits: under ``jax.vmap`` each op runs once per mapped element (a loop of
launches: for speed, fold the mapped axis into the batch axis instead);
forward-mode differentiation (``jax.jvp``) is not supported (``custom_vjp``);
a single device per call (no sharding rule).
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from . import api, validate, xla
from .validate import _as_int

__all__ = ["rope", "rope_qk", "rope_qkv", "apply_rope", "apply_rope_qk", "apply_rope_qkv",
           "qk_norm_rope", "apply_qk_norm_rope"]

_ARRAY_NAMES = ("cos", "sin", "inv_freq", "freqs", "positions", "offsets", "cu_seqlens")
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


class _Static(NamedTuple):
    """Hashable description of a call: which array arguments, and the static keywords."""

    names: tuple  # names of the angle/position arrays passed after the data arrays
    kw: tuple  # sorted (name, value) pairs of non-array library keywords


def _static_sections(sections, sections_interleaved):
    """sections as a hashable tuple of Python ints (None stays None)."""
    if sections is not None:
        try:
            if isinstance(sections, (str, bytes)) or any(isinstance(v, bool) for v in sections):
                raise TypeError
            sections = tuple(operator.index(v) for v in sections)
        except TypeError:
            raise TypeError("sections: expected a sequence of ints (frequencies per position "
                            f"axis), got {sections!r}") from None
    if not isinstance(sections_interleaved, (bool, np.bool_)):
        raise TypeError("sections_interleaved: expected a bool, got "
                        f"{type(sections_interleaved).__name__}")
    return sections, bool(sections_interleaved)


def _to_jax(v, name):
    """``v`` as a JAX array. Host integer arrays whose values JAX would
    narrow to int32 (jax_enable_x64 off) are refused rather than wrapped."""
    if isinstance(v, (np.ndarray, np.generic, list, tuple, int)):  # host values
        a = np.asarray(v)
        if (a.dtype.kind in "iu" and a.dtype.itemsize > 4 and a.size
                and not jax.config.jax_enable_x64):
            lo, hi = int(a.min()), int(a.max())
            if lo < -2**31 or hi >= 2**31:
                raise ValueError(f"{name}: values reach {hi if hi >= 2**31 else lo}, beyond "
                                 "int32, and JAX without jax_enable_x64 would narrow them to "
                                 "int32; enable x64 (jax.config.update('jax_enable_x64', True))")
    return jnp.asarray(v)


def _batch_count(shape, layout, cu_seqlens):
    """Entries of an offsets array: batch (bshd, sbhd) or sequences (thd)."""
    if layout == "thd":
        return None if cu_seqlens is None else int(np.shape(cu_seqlens)[0]) - 1
    return int(shape[1] if layout == "sbhd" else shape[0]) if len(shape) > 1 else None


def _collect(cos, sin, inv_freq, freqs, positions, offsets, cu_seqlens, layout, cp_size,
             cp_rank, interleaved, rotary_dim, head_dim, extra=(), sections=None,
             sections_interleaved=False, shape=()):
    arrays, names, kw = [], [], dict(extra)
    for name, v in zip(_ARRAY_NAMES, (cos, sin, inv_freq, freqs, positions, offsets,
                                      cu_seqlens)):
        if v is None:
            continue
        if name == "offsets" and isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            if int(v):
                kw["offsets"] = int(v)  # static: part of the compiled program
            continue
        a = _to_jax(v, name)
        if name == "offsets" and a.ndim == 0:
            # one offset for every sequence (a jitted decode step's traced scalar)
            n = _batch_count(shape, layout, cu_seqlens)
            if n is None:
                raise ValueError("offsets: a 0-d offsets array needs a batch (bshd, sbhd) "
                                 "or cu_seqlens (thd); pass an int otherwise")
            a = jnp.broadcast_to(a, (n,))
        names.append(name)
        arrays.append(a)
    sections, sections_interleaved = _static_sections(sections, sections_interleaved)
    api.option_kwargs(kw, layout, interleaved, rotary_dim, head_dim, cp_size, cp_rank, sections,
                      sections_interleaved)
    return _Static(tuple(names), tuple(sorted(kw.items()))), tuple(arrays)


# ------------------------------------------------------- inside the callback --
def _device(buf):
    dev_type, dev_id = buf.__dlpack_device__()
    return int(dev_type) in (_DL_CUDA, _DL_CUDA_MANAGED), int(dev_id)


class _DLPackView:
    """An XLA buffer seen only through DLPack (for dtypes CuPy cannot hold)."""

    __slots__ = ("_buf",)

    def __init__(self, buf):
        self._buf = buf

    def __dlpack__(self, stream=None, **kwargs):
        # Already on XLA's stream inside the callback: nothing to order.
        return self._buf.__dlpack__()

    def __dlpack_device__(self):
        return self._buf.__dlpack_device__()


def _view(buf):
    """A library-ready view of an XLA buffer (no copy).

    GPU: a CuPy array over the buffer's memory (the library's cached fast
    path), or a DLPack view where this CuPy has no such dtype (bfloat16
    before CuPy 14); CPU: a NumPy array (the reference path).
    """
    on_gpu, dev_id = _device(buf)
    if not on_gpu:
        return np.asarray(buf)
    import cupy

    dtype = np.dtype(buf.dtype)
    shape = tuple(int(n) for n in buf.shape)
    try:
        cdtype = cupy.dtype(dtype)
    except TypeError:
        return _DLPackView(buf)
    ptr = int(buf.__cuda_array_interface__["data"][0])
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, buf, dev_id)
    return cupy.ndarray(shape, cdtype, cupy.cuda.MemoryPointer(mem, 0))


def _launch(ctx, first_buf, fn):
    """Run ``fn()`` with CuPy's current device and stream set to XLA's."""
    on_gpu, dev_id = _device(first_buf)
    if not on_gpu:
        fn()
        return
    import cupy
    from cupy.cuda import driver, runtime

    if driver.ctxGetCurrent() == 0:  # a host thread with no CUDA context yet
        runtime.setDevice(dev_id)
    with cupy.cuda.Device(dev_id):
        with _cupy_stream(int(ctx.stream), dev_id):
            fn()


def _cupy_stream(ptr: int, dev_id: int):
    """A CuPy stream object for XLA's raw handle (which it does not own)."""
    from .interop import external_stream

    return external_stream(ptr, dev_id)


@functools.lru_cache(maxsize=1024)
def _callback(op: str, static: _Static, backward: bool):
    """One callable per (op, static, direction): XLA caches programs on its identity."""
    n_in = {"rope": 1, "rope_qk": 2, "rope_qkv": 1, "rope_qkv_backward": 3}[op]

    def callback(ctx, out, *args):
        data, arrays = args[:n_in], args[n_in:]

        def run():
            kw = dict(static.kw)
            kw.update({n: _view(a) for n, a in zip(static.names, arrays)})
            ins = [_view(a) for a in data]
            if op == "rope":
                api.apply_rope(ins[0], out=_view(out), backward=backward, **kw)
            elif op == "rope_qk":
                api.apply_rope_qk(ins[0], ins[1], out_q=_view(out[0]),
                                  out_k=_view(out[1]), backward=backward, **kw)
            elif op == "rope_qkv":
                api.apply_rope_qkv(ins[0], out_q=_view(out[0]),
                                   out_k=_view(out[1]),
                                   out_v=_view(out[2]), **kw)
            else:
                api.apply_rope_qkv_backward(ins[0], ins[1], ins[2],
                                            out=_view(out), **kw)

        _launch(ctx, data[0], run)

    callback.__name__ = f"cupy_rope_{op}{'_backward' if backward else ''}"
    return callback


_N_DATA = {"rope": 1, "rope_qk": 2, "rope_qkv": 1, "rope_qkv_backward": 3}


def _kernel_op(op, static, backward, result):
    """The XLA op launching ``op``'s kernel: on CUDA, jaxlib's kernel launcher
    where :mod:`cupy_rope.xla` serves the call, else the Python callback
    through ``buffer_callback`` (``CUPY_ROPE_JAX_LAUNCH=callback``: always).
    Under ``jax.vmap`` it runs once per mapped element: correct for any
    batching of its arguments, one launch per element."""
    callback = _callback(op, static, backward)
    fast = None
    if xla.MODE == "xla":
        fast = xla.kernel_op(op, static, backward, _N_DATA[op], callback, result)
    return fast or buffer_callback(callback, result, vmap_method="sequential")


def _flag(v, name):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return bool(v)


def _spec(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


# ---------------------------------------------------------------------- rope --
def _rope_impl(static, backward, x, arrays):
    return _kernel_op("rope", static, backward, _spec(x))(x, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rope(static, backward, x, arrays):
    return _rope_impl(static, backward, x, arrays)


def _rope_fwd(static, backward, x, arrays):
    return _rope(static, backward, x, arrays), arrays


def _rope_bwd(static, backward, arrays, g):
    # The backward is the op itself (rotation by -theta), so that it is
    # differentiable again (jax.grad of jax.grad).
    return _rope(static, not backward, g, arrays), None


_rope.defvjp(_rope_fwd, _rope_bwd)



#: The parameters most functions here share, in their docstrings (one text).
_SHARED_PARAMETERS = """cos, sin : jax.Array, optional
        Tables [max_position, r/2].
    inv_freq, freqs, positions : array, optional
        The other angle sources and the positions, as in
        :func:`cupy_rope.apply_rope` (reference: ``docs/api.md``); traced.
    offsets : int or array, optional
        A Python int (static: a new value compiles a new program), a 0-d int
        array (traced, one offset for every sequence) or one per sequence.
    layout : {"bshd", "sbhd", "thd"}, default "bshd"
        Static.
    cu_seqlens : array, optional
        Sequence boundaries of a packed thd batch; traced.
    cp_size, cp_rank, interleaved, rotary_dim, head_dim : optional
        Static, as in :func:`cupy_rope.apply_rope`.
    backward : bool, default False
        Rotate by -theta (static).
    sections, sections_interleaved : optional
        M-RoPE / axial RoPE (static); ``positions`` is then [axes, s],
        [axes, 1, s] or [axes, b, s] (thd: [axes, t])."""


#: The Raises text of the calls that take the shared parameters.
_RAISES = """Naming the argument, as :func:`cupy_rope.apply_rope` does; also a
        ``ValueError`` for host int64 positions or offsets beyond int32
        while ``jax_enable_x64`` is off."""


def _shared_doc(f):
    """Fill ``f``'s docstring with :data:`_SHARED_PARAMETERS` and :data:`_RAISES`."""
    for key, text in (("shared_parameters", _SHARED_PARAMETERS), ("raises", _RAISES)):
        f.__doc__ = f.__doc__.replace(f"%({key})s", text)
    return f

@_shared_doc
def rope(x, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None, offsets=None,
         layout="bshd", cu_seqlens=None, cp_size=1, cp_rank=0, interleaved=False,
         rotary_dim=None, head_dim=None, backward=False, sections=None,
         sections_interleaved=False):
    """Rotated copy of ``x``, eagerly or under ``jax.jit``, differentiable.

    ``jax.grad`` runs the kernel with ``backward`` flipped (rotation by
    -theta); the angle arrays get zero cotangents.

    Parameters
    ----------
    x : jax.Array
        [b, s, h, d] (bshd), [s, b, h, d] (sbhd) or [t, h, d] (thd).
    %(shared_parameters)s

    Returns
    -------
    jax.Array
        A new array of ``x``'s shape and dtype.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_rope.jax as crj
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> cos, sin = map(jnp.asarray, cos_sin_cache(rope_frequencies(64)[0], 128))
    >>> x = jnp.ones((2, 128, 8, 64), jnp.bfloat16)
    >>> jax.jit(lambda x: crj.rope(x, cos, sin))(x).shape
    (2, 128, 8, 64)
    """
    x = jnp.asarray(x)
    static, arrays = _collect(cos, sin, inv_freq, freqs, positions, offsets, cu_seqlens,
                              layout, cp_size, cp_rank, interleaved, rotary_dim, head_dim,
                              sections=sections, sections_interleaved=sections_interleaved,
                              shape=x.shape)
    return _rope(static, _flag(backward, "backward"), x, arrays)


# ------------------------------------------------------------------- q and k --
def _rope_qk_impl(static, backward, q, k, arrays):
    return tuple(_kernel_op("rope_qk", static, backward, (_spec(q), _spec(k)))(q, k, *arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rope_qk(static, backward, q, k, arrays):
    return _rope_qk_impl(static, backward, q, k, arrays)


def _rope_qk_fwd(static, backward, q, k, arrays):
    return _rope_qk(static, backward, q, k, arrays), arrays


def _rope_qk_bwd(static, backward, arrays, grads):
    dq, dk = _rope_qk(static, not backward, grads[0], grads[1], arrays)
    return dq, dk, None


_rope_qk.defvjp(_rope_qk_fwd, _rope_qk_bwd)


@_shared_doc
def rope_qk(q, k, cos=None, sin=None, *, inv_freq=None, freqs=None, positions=None,
            offsets=None, layout="bshd", cu_seqlens=None, cp_size=1, cp_rank=0,
            interleaved=False, rotary_dim=None, head_dim=None, backward=False, sections=None,
            sections_interleaved=False):
    """Rotated copies of q and k in one launch, differentiable with respect to both.

    Parameters
    ----------
    q : jax.Array
        [.., hq, d] in ``layout``.
    k : jax.Array
        [.., hk, d], the same tokens (any hk).
    %(shared_parameters)s

    Returns
    -------
    (jax.Array, jax.Array)
        New arrays of q's and k's shapes.

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_rope.jax as crj
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> cos, sin = map(jnp.asarray, cos_sin_cache(rope_frequencies(64)[0], 128))
    >>> q, k = jnp.ones((2, 128, 8, 64)), jnp.ones((2, 128, 2, 64))
    >>> [t.shape for t in crj.rope_qk(q, k, cos, sin)]
    [(2, 128, 8, 64), (2, 128, 2, 64)]
    """
    if k is None:
        raise validate.none_input("k", alone="cupy_rope.jax.rope")
    q, k = jnp.asarray(q), jnp.asarray(k)
    static, arrays = _collect(cos, sin, inv_freq, freqs, positions, offsets, cu_seqlens,
                              layout, cp_size, cp_rank, interleaved, rotary_dim, head_dim,
                              sections=sections, sections_interleaved=sections_interleaved,
                              shape=q.shape)
    return _rope_qk(static, _flag(backward, "backward"), q, k, arrays)


# ----------------------------------------------------------------- fused qkv --
def _qkv_shapes(shape, hq, hk, head_dim, layout):
    token_ndim = 1 if layout == "thd" else 2
    tokens = tuple(shape[:token_ndim])
    if len(shape) == token_ndim + 1:
        d = head_dim if head_dim is not None else shape[-1] // (hq + 2 * hk)
    elif len(shape) == token_ndim + 2:
        d = shape[-1]
    else:
        raise ValueError(f"qkv: expected {token_ndim} token axes then [(hq + 2 hk) * d] or "
                         f"[hq + 2 hk, d] for layout {layout!r}, got shape {list(shape)}")
    return tokens, d


def _qkv_impl(static, qkv, arrays, hq, hk, head_dim, layout):
    tokens, d = _qkv_shapes(qkv.shape, hq, hk, head_dim, layout)
    outs = (jax.ShapeDtypeStruct(tokens + (hq, d), qkv.dtype),
            jax.ShapeDtypeStruct(tokens + (hk, d), qkv.dtype),
            jax.ShapeDtypeStruct(tokens + (hk, d), qkv.dtype))
    return tuple(_kernel_op("rope_qkv", static, False, outs)(qkv, *arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _rope_qkv(static, bwd_static, geometry, qkv, arrays):
    return _qkv_impl(static, qkv, arrays, *geometry[:4])


def _rope_qkv_fwd(static, bwd_static, geometry, qkv, arrays):
    return _rope_qkv(static, bwd_static, geometry, qkv, arrays), arrays


def _rope_qkv_bwd(static, bwd_static, geometry, arrays, grads):
    dq, dk, dv = grads
    return _rope_qkv_backward(static, bwd_static, geometry, dq, dk, dv, arrays), None


_rope_qkv.defvjp(_rope_qkv_fwd, _rope_qkv_bwd)


# The backward of the split (rotate dq, dk by -theta, pack with dv) as an op
# of its own, whose gradient is the split again: jax.grad of jax.grad.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _rope_qkv_backward(static, bwd_static, geometry, dq, dk, dv, arrays):
    out = jax.ShapeDtypeStruct(geometry[4], dq.dtype)
    return _kernel_op("rope_qkv_backward", bwd_static, True, out)(
        dq, dk, dv, *arrays)


def _rope_qkv_backward_fwd(static, bwd_static, geometry, dq, dk, dv, arrays):
    return _rope_qkv_backward(static, bwd_static, geometry, dq, dk, dv, arrays), arrays


def _rope_qkv_backward_bwd(static, bwd_static, geometry, arrays, g):
    return (*_rope_qkv(static, bwd_static, geometry, g, arrays), None)


_rope_qkv_backward.defvjp(_rope_qkv_backward_fwd, _rope_qkv_backward_bwd)


def _split_qkv(qkv, hq, hk, head_dim, packing, layout):
    tokens, d = _qkv_shapes(qkv.shape, hq, hk, head_dim, layout)
    heads = qkv.reshape(tokens + (hq + 2 * hk, d))
    if packing == "concat":
        return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
    if packing == "grouped":
        if hk < 1 or hq % hk:
            raise ValueError(f"num_q_heads: must be a multiple of num_kv_heads for packing="
                             f"'grouped', got {hq} and {hk}")
        g = hq // hk
        groups = heads.reshape(tokens + (hk, g + 2, d))
        return (groups[..., :g, :].reshape(tokens + (hq, d)), groups[..., g, :],
                groups[..., g + 1, :])
    raise ValueError(f"packing: expected 'concat' or 'grouped', got {packing!r}")


@functools.lru_cache(maxsize=None)
def _named_params(fn) -> frozenset:
    return frozenset(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@_shared_doc
def rope_qkv(qkv, cos=None, sin=None, *, num_q_heads, num_kv_heads, head_dim=None,
             packing="concat", inv_freq=None, freqs=None, positions=None, offsets=None,
             layout="bshd", cu_seqlens=None, cp_size=1, cp_rank=0, interleaved=False,
             rotary_dim=None, sections=None, sections_interleaved=False):
    """Split a packed projection output into rotated q, rotated k and v.

    The gradient with respect to ``qkv`` comes back packed by
    :func:`cupy_rope.apply_rope_qkv_backward`. If the library's
    ``apply_rope_qkv`` cannot write into caller-provided outputs (``out_q``,
    ``out_k``, ``out_v``), the split is done by XLA and q, k are rotated by
    :func:`rope_qk` (gradients through XLA's slicing).

    Parameters
    ----------
    qkv : jax.Array
        Token axes ([b, s] / [s, b] / [t]) then [(hq + 2 hk) * d] or
        [hq + 2 hk, d].
    cos, sin : jax.Array, optional
        Tables [max_position, r/2].
    num_q_heads, num_kv_heads : int
        The numbers of q heads (hq) and of k and v heads (hk).
    head_dim : int, optional
        The head size d, where the heads are flattened and cannot say it.
    packing : {"concat", "grouped"}, default "concat"
        The order of the heads in ``qkv`` (``docs/api.md``).
    inv_freq, freqs, positions : array, optional
        The other angle sources and the positions, as in
        :func:`cupy_rope.apply_rope` (reference: ``docs/api.md``); traced.
    offsets : int or array, optional
        A Python int (static), a 0-d int array or one per sequence, as in
        :func:`rope`.
    layout : {"bshd", "sbhd", "thd"}, default "bshd"
        Static.
    cu_seqlens : array, optional
        Sequence boundaries of a packed thd batch; traced.
    cp_size, cp_rank, interleaved, rotary_dim : optional
        Static, as in :func:`cupy_rope.apply_rope`.
    sections, sections_interleaved : optional
        M-RoPE / axial RoPE (static); ``positions`` is then [axes, s],
        [axes, 1, s] or [axes, b, s] (thd: [axes, t]).

    Returns
    -------
    (jax.Array, jax.Array, jax.Array)
        The rotated q [.., hq, d], the rotated k and v [.., hk, d].

    Raises
    ------
    TypeError, ValueError
        %(raises)s

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_rope.jax as crj
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> cos, sin = map(jnp.asarray, cos_sin_cache(rope_frequencies(64)[0], 128))
    >>> qkv = jnp.ones((2, 128, (8 + 2 * 2) * 64))
    >>> q, k, v = crj.rope_qkv(qkv, cos, sin, num_q_heads=8, num_kv_heads=2)
    >>> q.shape, v.shape
    ((2, 128, 8, 64), (2, 128, 2, 64))
    """
    qkv = jnp.asarray(qkv)
    hq, hk = _as_int(num_q_heads, "num_q_heads"), _as_int(num_kv_heads, "num_kv_heads")
    args = (cos, sin, inv_freq, freqs, positions, offsets, cu_seqlens, layout, cp_size,
            cp_rank, interleaved, rotary_dim)
    axes = {"sections": sections, "sections_interleaved": sections_interleaved,
            "shape": qkv.shape}
    if {"out_q", "out_k", "out_v"} <= _named_params(api.apply_rope_qkv):
        extra = {"num_q_heads": hq, "num_kv_heads": hk, "packing": packing}
        static, arrays = _collect(*args, head_dim, extra=extra, **axes)
        bwd_extra = {"packing": packing}
        named = _named_params(api.apply_rope_qkv_backward)
        bwd_extra.update({k: v for k, v in (("num_q_heads", hq), ("num_kv_heads", hk))
                          if k in named})
        # dq, dk, dv are [.., h, d]: the packed output's shape says the rest.
        bwd_static, _ = _collect(*args, None, extra=bwd_extra, **axes)
        geometry = (hq, hk, head_dim, layout, tuple(qkv.shape))
        return _rope_qkv(static, bwd_static, geometry, qkv, arrays)
    q, k, v = _split_qkv(qkv, hq, hk, head_dim, packing, layout)
    static, arrays = _collect(*args, None, **axes)
    q, k = _rope_qk(static, False, q, k, arrays)
    return q, k, v


apply_rope = rope
apply_rope_qk = rope_qk
apply_rope_qkv = rope_qkv


# ------------------------------------------------- q/k RMSNorm + RoPE (issue 31) --
# The fused norm + rope op always launches through buffer_callback: the fast
# path (cupy_rope.xla) plans the rope ops' kernels only. Its callback calls
# cupy_rope.qk_norm's API on views of XLA's buffers, on XLA's stream.

#: Forward data operands (q, k) and backward ones (grad_q, grad_k, q, k).
_NORM_N_DATA = {False: 2, True: 4}


class _NormCall(NamedTuple):
    """Hashable description of a qk_norm_rope call."""

    static: _Static  # angle/position array names; rope and norm keywords
    weights: tuple  # (q_weight given, k_weight given)


def _qk_norm_module():
    """cupy_rope.qk_norm, imported on first use (jax.py imports without it)."""
    from . import qk_norm

    return qk_norm


def _norm_kwargs(eps, norm_scope, weight_mode, rounding) -> dict:
    """The norm keywords, checked by the library now (they are static)."""
    norm = _qk_norm_module().check_norm(norm_scope, weight_mode, rounding, eps)
    return {"eps": norm.eps, "norm_scope": norm.scope, "weight_mode": norm.weight_mode,
            "rounding": norm.rounding}


def _put(buf, value) -> None:
    """Write ``value`` (an array the library returned) into XLA's buffer."""
    view = _view(buf)
    if isinstance(view, _DLPackView):
        raise TypeError(f"this CuPy has no dtype {buf.dtype} for the weight gradient")
    view[...] = value


@functools.lru_cache(maxsize=1024)
def _qk_norm_callback(call: _NormCall, backward: bool):
    """One callable per (call, direction): XLA caches programs on its identity."""
    n_data = _NORM_N_DATA[backward]
    n_weights = sum(call.weights)

    def callback(ctx, out, *args):
        data = args[:n_data]
        weights, arrays = args[n_data:n_data + n_weights], args[n_data + n_weights:]

        def run():
            lib = _qk_norm_module()
            kw = dict(call.static.kw)
            kw.update({n: _view(a) for n, a in zip(call.static.names, arrays)})
            given = iter(_view(w) for w in weights)
            q_weight, k_weight = (next(given) if has else None for has in call.weights)
            ins = [_view(a) for a in data]
            outs = dict(out_q=_view(out[0]), out_k=_view(out[1]))
            if not backward:
                lib.apply_qk_norm_rope(*ins, q_weight, k_weight, **outs, **kw)
                return
            grads = lib.apply_qk_norm_rope_backward(*ins, q_weight, k_weight, **outs, **kw)
            dweights = (g for g, has in zip(grads[2:], call.weights) if has)
            for buf, g in zip(out[2:], dweights):
                _put(buf, g)

        _launch(ctx, data[0], run)

    callback.__name__ = f"cupy_rope_qk_norm_rope{'_backward' if backward else ''}"
    return callback


def _qk_norm_op(call, backward, data, weights, arrays):
    """The op's outputs: (q, k), or (dq, dk, *weight gradients) backward."""
    specs = [_spec(a) for a in data[-2:]] + [_spec(w) for w in weights] * backward
    op = buffer_callback(_qk_norm_callback(call, backward), tuple(specs),
                         vmap_method="sequential")
    return tuple(op(*data, *weights, *arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qk_norm_rope(call, q, k, weights, arrays):
    return _qk_norm_op(call, False, (q, k), weights, arrays)


def _qk_norm_rope_fwd(call, q, k, weights, arrays):
    # The backward recomputes the norm from q and k (nothing else is saved).
    return _qk_norm_rope(call, q, k, weights, arrays), (q, k, weights, arrays)


def _qk_norm_rope_bwd(call, residuals, grads):
    q, k, weights, arrays = residuals
    dq, dk, *dweights = _qk_norm_op(call, True, (grads[0], grads[1], q, k), weights, arrays)
    return dq, dk, tuple(dweights), None


_qk_norm_rope.defvjp(_qk_norm_rope_fwd, _qk_norm_rope_bwd)


def qk_norm_rope(q, k, q_weight=None, k_weight=None, cos=None, sin=None, *, inv_freq=None,
                 freqs=None, positions=None, offsets=None, layout="bshd", cu_seqlens=None,
                 cp_size=1, cp_rank=0, interleaved=False, rotary_dim=None, head_dim=None,
                 sections=None, sections_interleaved=False, eps=1e-6, norm_scope="head",
                 weight_mode="w", rounding="before_weight"):
    """RMSNorm of q and k, then their rotation, in one launch, differentiable.

    :func:`cupy_rope.apply_qk_norm_rope` as a ``jax.custom_vjp``, eagerly or
    under ``jax.jit``; ``jax.grad`` gives the gradients of q, k and both
    weights (:func:`cupy_rope.apply_qk_norm_rope_backward`, which recomputes
    the norm from q and k). The angle arrays get zero cotangents. The
    backward is not differentiable again, and the op always launches
    through ``buffer_callback`` (module docstring).

    Parameters
    ----------
    q : jax.Array
        [.., hq, d] in ``layout``.
    k : jax.Array
        [.., hk, d], the same tokens (any hk).
    q_weight, k_weight : jax.Array, optional
        [d] (``norm_scope="head"``) or [hq * d] / [hk * d] (``"token"``);
        None for ``weight_mode="none"``.
    cos, sin, inv_freq, freqs, positions, offsets, layout, cu_seqlens : optional
        The angles and token geometry, as for :func:`rope_qk` (arrays traced,
        the others static).
    cp_size, cp_rank, interleaved, rotary_dim, head_dim : optional
        Static, as in :func:`cupy_rope.apply_rope`; the norm covers the whole
        head, only the first ``rotary_dim`` channels rotate.
    sections, sections_interleaved : optional
        M-RoPE / axial RoPE (static), as for :func:`rope_qk`.
    eps : float, default 1e-6
        Added to the mean square (static).
    norm_scope : {"head", "token"}, default "head"
        Normalize each head, or all heads of a token (static).
    weight_mode : {"w", "1+w", "none"}, default "w"
        Scale by the weight, by 1 + weight (Gemma), or not at all (static).
    rounding : {"before_weight", "after_weight"}, default "before_weight"
        Round the normalized value to q's dtype before the weight
        (Llama, Qwen3), or once after it (Gemma, OLMo 2); static.

    Returns
    -------
    (jax.Array, jax.Array)
        New arrays of q's and k's shapes.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, as :func:`cupy_rope.apply_qk_norm_rope` does
        (the norm options at once; the checks of the arrays where the
        call runs, as a ``JaxRuntimeError`` carrying the message).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupy_rope.jax as crj
    >>> from cupy_rope.frequencies import cos_sin_cache, rope_frequencies
    >>> cos, sin = map(jnp.asarray, cos_sin_cache(rope_frequencies(64)[0], 128))
    >>> q, k = jnp.ones((2, 128, 8, 64)), jnp.ones((2, 128, 2, 64))
    >>> w = jnp.ones((64,))
    >>> [t.shape for t in jax.jit(crj.qk_norm_rope)(q, k, w, w, cos, sin)]
    [(2, 128, 8, 64), (2, 128, 2, 64)]
    """
    if k is None:
        raise validate.none_input("k", alone="cupy_rope.jax.rope")
    q, k = jnp.asarray(q), jnp.asarray(k)
    extra = _norm_kwargs(eps, norm_scope, weight_mode, rounding)
    static, arrays = _collect(cos, sin, inv_freq, freqs, positions, offsets, cu_seqlens,
                              layout, cp_size, cp_rank, interleaved, rotary_dim, head_dim,
                              extra=extra, sections=sections,
                              sections_interleaved=sections_interleaved, shape=q.shape)
    weights = tuple(jnp.asarray(w) for w in (q_weight, k_weight) if w is not None)
    call = _NormCall(static, (q_weight is not None, k_weight is not None))
    return _qk_norm_rope(call, q, k, weights, arrays)


apply_qk_norm_rope = qk_norm_rope
