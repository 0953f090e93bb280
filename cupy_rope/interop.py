"""Framework interop: describe arrays, pick the stream, allocate and return.

An array from any framework is reduced to a :class:`Tensor` record (device
pointer, shape, strides in elements, dtype name, device) without copying:
PyTorch and CuPy through their attributes (the fast path), anything else
through the DLPack protocol (``__dlpack_device__`` / ``__dlpack__``), whose
capsule is read with ctypes, so bfloat16 works whether or not CuPy has a
bfloat16 dtype. Results go back in the caller's framework: torch in, torch
out; JAX in, JAX out; CuPy (and any other DLPack producer) in, CuPy out.
:func:`require_cuda` says in one line when there is no CUDA device.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, NamedTuple

import numpy as np

CPU, CUDA = "cpu", "cuda"

# DLPack constants (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_DTYPES = {
    (0, 32): "int32", (0, 64): "int64", (0, 16): "int16", (0, 8): "int8",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (6, 8): "bool",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
            "int32": 4, "int64": 8, "int16": 2, "int8": 1, "uint8": 1,
            "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "float8_e4m3fn": 1,
            "float8_e5m2": 1}


class Tensor(NamedTuple):
    """What the kernels need to know about an array; strides are in elements."""

    obj: Any
    kind: str  # "torch" | "cupy" | "jax" | "numpy" | "dlpack"
    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: tuple  # ("cpu", 0) or ("cuda", id)
    readonly: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def on_gpu(self) -> bool:
        return self.device[0] == CUDA

    def span(self) -> tuple:
        """[first byte, one past the last byte] this view can touch."""
        if 0 in self.shape:
            return (self.ptr, self.ptr)
        lo = hi = 0
        for n, st in zip(self.shape, self.strides):
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
        item = ITEMSIZE[self.dtype]
        return (self.ptr + lo * item, self.ptr + (hi + 1) * item)

    def self_overlapping(self) -> bool:
        """True if two indices can reach one element (e.g. a stride-0 broadcast)."""
        if 0 in self.shape:
            return False
        dims = sorted((abs(st), n) for n, st in zip(self.shape, self.strides) if n > 1)
        reach = 1  # elements covered by the dims seen so far
        for st, n in dims:
            if st < reach:
                return True
            reach = st * (n - 1) + reach
        return False


# ----------------------------------------------------------------- DLPack --
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_capsule(obj, kind: str, capsule, readonly: bool) -> Tensor:
    """Read a legacy ("dltensor") DLPack capsule without consuming it.

    The capsule keeps the producer's buffer alive while we hold it; it is
    released (its deleter runs) when the capsule is garbage collected, and
    the caller keeps ``obj`` alive for as long as the launch needs it.
    """
    addr = _capsule_pointer(capsule, b"dltensor")
    t = _DLManagedTensor.from_address(addr).dl_tensor
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(ndim))
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    if t.dtype.lanes != 1 or (t.dtype.code, t.dtype.bits) not in _DL_DTYPES:
        raise TypeError(f"unsupported DLPack dtype code={t.dtype.code} bits={t.dtype.bits} "
                        f"lanes={t.dtype.lanes}")
    dtype = _DL_DTYPES[(t.dtype.code, t.dtype.bits)]
    dev_type = t.device.device_type
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        device = (CUDA, t.device.device_id)
    elif dev_type in (_DL_CPU, _DL_CUDA_HOST):
        device = (CPU, 0)
    else:
        raise TypeError(f"unsupported DLPack device type {dev_type}")
    return Tensor(obj, kind, (t.data or 0) + t.byte_offset, shape, strides, dtype, device, readonly)


# ------------------------------------------------------------- describe ----
_TORCH_DTYPES: dict = {}


def _torch_dtype_name(dt) -> str:
    name = _TORCH_DTYPES.get(dt)
    if name is None:
        name = str(dt).replace("torch.", "")
        _TORCH_DTYPES[dt] = name
    return name


_DTYPE_NAMES: dict = {}


def _dtype_name(dt) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


def _module_of(x) -> str:
    return type(x).__module__.partition(".")[0]


def _element_strides(x, name: str) -> tuple:
    """A CuPy or NumPy array's byte strides in elements; a stride that is not
    a whole number of elements (possible with byte strides) is refused
    rather than rounded, on every axis that has more than one element."""
    item = x.itemsize
    strides = x.strides
    out = [s // item for s in strides]
    for axis, (s, n) in enumerate(zip(strides, x.shape)):
        if s % item and n > 1:
            raise ValueError(f"{name}: stride {s} bytes on axis {axis} is not a multiple of "
                             f"its {item}-byte elements")
    return tuple(out)


def describe(x, name: str) -> Tensor:
    """A :class:`Tensor` record for ``x``; ``name`` is used in error messages."""
    if isinstance(x, Tensor):
        return x
    mod = _module_of(x)
    if mod == "torch":
        dev = x.device
        device = (CUDA, dev.index) if dev.type == "cuda" else (CPU, 0)
        return Tensor(x, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                      _torch_dtype_name(x.dtype), device, False)
    if mod == "cupy" and hasattr(x, "data") and hasattr(x, "strides"):
        mem = x.data
        return Tensor(x, "cupy", mem.ptr, x.shape, _element_strides(x, name),
                      _dtype_name(x.dtype), (CUDA, mem.device_id), False)
    if isinstance(x, np.ndarray):
        return Tensor(x, "numpy", x.ctypes.data, x.shape, _element_strides(x, name),
                      x.dtype.name, (CPU, 0), not x.flags.writeable)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind = "jax" if mod in ("jax", "jaxlib") else "dlpack"
        dev_type, dev_id = x.__dlpack_device__()
        stream = None
        if int(dev_type) in (_DL_CUDA, _DL_CUDA_MANAGED):
            stream = cupy_stream(int(dev_id))  # the consumer's stream on the array's device
            if stream == 0:  # DLPack spells the legacy default stream 1
                stream = 1
        try:
            capsule = x.__dlpack__(stream=stream)
        except TypeError:
            capsule = x.__dlpack__()
        return _from_capsule(x, kind, capsule, readonly=(kind == "jax"))
    raise TypeError(f"{name}: expected an array supporting DLPack (torch, JAX, CuPy) or a "
                    f"NumPy array, got {type(x).__name__}")


# --------------------------------------------------------------- streams ---
def cupy_stream(device_id: int = -1) -> int:
    """CuPy's current stream on ``device_id`` (default: the current device)."""
    import cupy

    return cupy.cuda.get_current_stream(device_id).ptr


def cupy_stream_getter():
    """A function device_id -> CuPy's current stream on that device, as a raw handle."""
    import cupy

    current = cupy.cuda.get_current_stream
    return lambda device_id: current(device_id).ptr


def torch_stream_getter():
    """A function device_id -> torch's current stream there, as a raw handle."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)


def torch_stream(device_id: int) -> int:
    """torch's current stream on ``device_id``, as a raw handle."""
    return torch_stream_getter()(device_id)


def stream_for(t: Tensor) -> int:
    """The stream the caller's framework would run on now, as a raw handle."""
    if t.kind == "torch":
        return torch_stream(t.device[1])
    return cupy_stream(t.device[1] if t.device[0] != CPU else -1)


def current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


# ------------------------------------------------------------- fast path ---
# A signer appends a device array's signature (everything a launch plan
# depends on: dtype, shape, strides, device, pointer alignment; the dtype
# object also tells the framework) to a key list and its data pointer to a
# pointer list, reading torch/CuPy attributes directly. It returns False
# for anything else (host arrays, other frameworks): the slow path.
def _torch_sign(t, key, ptrs) -> bool:
    dev = t.get_device()
    if dev < 0:
        return False
    p = t.data_ptr()
    key.append((t.dtype, t.shape, t.stride(), dev, p & 15))
    ptrs.append(p)
    return True


def _cupy_sign(a, key, ptrs) -> bool:
    mem = a.data
    p = mem.ptr
    key.append((a.dtype, a.shape, a.strides, mem.device_id, p & 15))
    ptrs.append(p)
    return True


def torch_readers() -> dict:
    """torch tensor metadata readers through TensorBase's unbound methods and
    descriptors, cheaper than attribute lookups (benchmarks/launch_cost.py
    times both): get_device, data_ptr, dtype, shape, stride. Empty when
    torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    tb = torch._C.TensorBase
    return dict(get_device=tb.get_device, data_ptr=tb.data_ptr, dtype=tb.dtype.__get__,
                shape=tb.shape.__get__, stride=tb.stride)


def signature_reader(classes, consts=None, distinct=False, head="arrays"):
    """A generated function reading, in straight-line code, what the signers
    read (dtype, shape, strides, device, pointer alignment) of arrays of
    these classes (None: absent), or None when some class has none
    (sign_kind). ``head="arrays"``: ``f(arrays)`` takes them as one tuple;
    ``head="args"``: ``f(a0, a1, ...)``. ``f`` returns (signature tuple,
    pointer tuple over every position, 0 where absent), or None when an
    array is off the GPU or (``distinct``) two given pointers are equal.
    ``consts`` maps positions to fixed pointers, written in as constants
    and not read (a RotaryEmbedding's signed tables).
    """
    consts = consts or {}
    ptr = {i: str(int(p)) for i, p in consts.items()}
    body, sig = [], []
    for i, cls in enumerate(classes):
        if cls is type(None) or i in ptr:
            continue
        a, d, p = f"a{i}", f"d{i}", f"p{i}"
        ptr[i] = p
        kind = sign_kind(cls)
        if head == "arrays":
            body.append(f"{a} = arrays[{i}]")
        if kind == "torch":
            body += [f"{d} = get_device({a})", f"if {d} < 0:", "    return None",
                     f"{p} = data_ptr({a})"]
            sig.append(f"dtype({a}), shape({a}), stride({a}), {d}, {p} & 15")
        elif kind == "cupy":
            body += [f"m{i} = {a}.data", f"{p} = m{i}.ptr"]
            sig.append(f"{a}.dtype, {a}.shape, {a}.strides, m{i}.device_id, {p} & 15")
        else:
            return None
    if not sig:
        return None
    given = [ptr[i] for i in range(len(classes)) if i in ptr]
    if distinct and len(given) > 1:
        body += [f"if len({{{', '.join(given)}}}) != {len(given)}:", "    return None"]
    params = "arrays" if head == "arrays" else ", ".join(f"a{i}" for i in range(len(classes)))
    src = (f"def read({params}):\n" + "".join(f"    {line}\n" for line in body)
           + f"    return ({', '.join(sig)}), ({', '.join(ptr.get(i, '0') for i in range(len(classes)))},)\n")
    env = torch_readers()
    exec(src, env)  # noqa: S102 - indices, integers and fixed names only
    return env["read"]


def _no_key3(a, b, c):
    return None


KEY3: dict = {}


def key3(cls):
    """For three arrays of class ``cls``: a function giving (signature, their
    three pointers), or None where the arrays are not on a CUDA device. The
    decode fast path (RotaryEmbedding.qk_) keys its plans on it."""
    f = KEY3.get(cls)
    if f is None:
        f = KEY3[cls] = signature_reader((cls, cls, cls), head="args") or _no_key3
    return f


def _no_sign(a, key, ptrs) -> bool:
    return False


SIGNERS: dict = {}


def signer(cls):
    """The signer for arrays of class ``cls`` (cached per class)."""
    f = SIGNERS.get(cls)
    if f is None:
        mod = cls.__module__.partition(".")[0]
        torch = sys.modules.get("torch")
        cupy = sys.modules.get("cupy")
        if mod == "torch" and torch is not None and issubclass(cls, torch.Tensor):
            f = _torch_sign
        elif cupy is not None and issubclass(cls, cupy.ndarray):
            f = _cupy_sign
        else:
            f = _no_sign
        SIGNERS[cls] = f
    return f


def sign_kind(cls):
    """"torch" or "cupy": whose metadata, read straight (torch_readers for
    torch), signs arrays of class ``cls`` as their signer does; None for
    other classes, torch subclasses included (a subclass may override
    those attributes in Python, which TensorBase's readers do not see)."""
    f = signer(cls)
    if f is _cupy_sign:
        return "cupy"
    torch = sys.modules.get("torch")
    if f is _torch_sign and cls in (torch.Tensor, torch.nn.Parameter):
        return "torch"
    return None


def data_ptr(a) -> int:
    """Data pointer of an array (torch, CuPy, or anything ``describe`` reads)."""
    ptrs: list = []
    if signer(type(a))(a, [], ptrs):
        return ptrs[0]
    return describe(a, "array").ptr


# ------------------------------------------------------------ allocation ---
def _cupy_dtype(name: str):
    import cupy

    if name == "bfloat16":
        try:
            import ml_dtypes

            return cupy.dtype(ml_dtypes.bfloat16)
        except Exception as exc:
            raise TypeError(
                "a bfloat16 result for this framework needs CuPy's bfloat16 dtype "
                "(install ml_dtypes with CuPy >= 14); or pass out=, or use torch tensors"
            ) from exc
    return cupy.dtype(name)


def _numpy_dtype(name: str):
    """The NumPy dtype of a dtype name (bfloat16: ml_dtypes', which JAX brings)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def empty_like(t: Tensor):
    """A new uninitialised array of ``t``'s framework, shape, dtype and device.

    Torch and CuPy keep ``t``'s strides when it is dense (a permuted view gets
    an output with the same memory order); otherwise the result is
    contiguous.
    """
    if t.kind == "torch":
        return sys.modules["torch"].empty_like(t.obj)
    if t.kind == "numpy":
        return np.empty_like(t.obj)
    if not t.on_gpu:  # a host JAX / DLPack array: the NumPy reference's output
        return np.empty(t.shape, dtype=_numpy_dtype(t.dtype))
    import cupy

    with cupy.cuda.Device(t.device[1]):
        if t.kind == "cupy":
            return cupy.empty_like(t.obj)
        return cupy.empty(t.shape, dtype=_cupy_dtype(t.dtype))


def empty(t: Tensor, shape):
    """A new contiguous array of ``shape`` in ``t``'s framework, dtype and device."""
    if t.kind == "torch":
        return sys.modules["torch"].empty(shape, dtype=t.obj.dtype, device=t.obj.device)
    if t.kind == "numpy":
        return np.empty(shape, dtype=t.obj.dtype)
    if not t.on_gpu:
        return np.empty(shape, dtype=_numpy_dtype(t.dtype))
    import cupy

    with cupy.cuda.Device(t.device[1]):
        dtype = t.obj.dtype if t.kind == "cupy" else _cupy_dtype(t.dtype)
        return cupy.empty(shape, dtype=dtype)


def fast_empty_like(a):
    """empty_like for a torch tensor or CuPy array, on the array's device."""
    if type(a).__module__.startswith("torch"):
        return sys.modules["torch"].empty_like(a)
    import cupy

    dev = a.data.device_id
    if dev == current_device():
        return cupy.empty_like(a)
    with cupy.cuda.Device(dev):
        return cupy.empty_like(a)


def fast_empty(a, shape):
    """empty for a torch tensor or CuPy array: a new contiguous array of
    ``shape`` with ``a``'s dtype, on its device."""
    if type(a).__module__.startswith("torch"):
        return sys.modules["torch"].empty(shape, dtype=a.dtype, device=a.device)
    import cupy

    with cupy.cuda.Device(a.data.device_id):
        return cupy.empty(shape, dtype=a.dtype)


def to_host(a) -> np.ndarray:
    """A NumPy copy of a device array (syncs; debugging checks only)."""
    import cupy

    return cupy.asnumpy(cupy.from_dlpack(a) if not isinstance(a, cupy.ndarray) else a)


class _StreamHandle:
    """A raw CUDA stream handle, offered through the CUDA stream protocol."""

    __slots__ = ("_ptr",)

    def __init__(self, ptr: int):
        self._ptr = ptr

    def __cuda_stream__(self):
        return (0, self._ptr)


def external_stream(ptr: int, device_id: int):
    """A CuPy stream object for a raw handle it does not own (CuPy 14's
    ``Stream.from_external``; ``ExternalStream`` before, deprecated since)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)


def to_device(t: Tensor, device_id: int, stream: int):
    """A CuPy copy of host array ``t`` on ``device_id``, made on ``stream``
    (for host cu_seqlens)."""
    import cupy

    with cupy.cuda.Device(device_id), external_stream(stream, device_id):
        return cupy.asarray(np.ascontiguousarray(np.asarray(t.obj)))


def synchronize_stream(stream: int, device_id: int) -> None:
    import cupy

    with cupy.cuda.Device(device_id):
        external_stream(stream, device_id).synchronize()


def wrap_result(like, arr):
    """Return ``arr`` (allocated by :func:`empty_like` or :func:`empty` for
    ``like``) in ``like``'s framework: a JAX array for JAX, else as it is."""
    if _module_of(like) in ("jax", "jaxlib"):
        import jax
        import jax.dlpack

        if isinstance(arr, np.ndarray):  # a host result: onto the input's device
            return jax.device_put(arr, next(iter(like.devices())))
        return jax.dlpack.from_dlpack(arr)
    return arr


# ---------------------------------------------------------- CUDA present ---
class NoCudaDeviceError(RuntimeError):
    """A GPU function was called where CuPy sees no CUDA device (or is not installed)."""


def require_cuda(what: str):
    """CuPy, once it is known to see a CUDA device.

    CuPy's own error on a machine without a GPU (``cudaErrorInsufficientDriver``
    and the like) names neither the cause nor what still works; this says
    both in one line.

    Parameters
    ----------
    what : str
        What needs the device (a function, a command), named in the message.

    Returns
    -------
    module
        ``cupy``.

    Raises
    ------
    NoCudaDeviceError
        (a ``RuntimeError``) where CuPy is missing or sees no CUDA device.

    Examples
    --------
    >>> cupy = require_cuda("my_gpu_step")                    # doctest: +SKIP
    """
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        why = "CuPy sees 0 devices" if count == 0 else None
    except Exception as e:  # ImportError, or CUDARuntimeError without a driver
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        raise NoCudaDeviceError(
            f"{what}: no CUDA device was found ({why}); the NumPy reference path still works "
            "(NumPy arrays to cupy_rope.apply_rope*, cupy_rope.frequencies.cos_sin_cache for "
            "the tables)")
    return cupy
