"""Launch cupy-rope's kernels from XLA itself: no Python at execution time.

:mod:`cupy_rope.jax` binds :func:`primitive`, a JAX primitive whose CUDA
lowering is an XLA custom call that launches a kernel given as PTX, with the
call's buffers (operands, then results) as the kernel's arguments, in order,
and a one-dimensional block of whole warps. Two such calls exist
(:func:`target` picks one):

- ``__gpu$xla.gpu.ptx`` (:data:`PTX_TARGET`, jaxlib >= 0.11): XLA loads the
  PTX with the program and launches it as one of its own kernels, so a call
  costs what a fused XLA op costs and can be part of XLA's CUDA graphs;
- jaxlib's launcher for compiled GPU kernels (``triton_kernel_call_ffi``, the
  one jax-triton uses; a zlib-compressed ``TritonKernelCall`` proto as its
  ``opaque``) on older jaxlibs: the same launch, from jaxlib's host code,
  which adds host time to every execution.

Our kernels take one by-value struct (``rope::Params`` or
``rope::FlatParams``, ``kernels/params.cuh``) and two- or three-dimensional
blocks, so each launch plan (made at lowering time by the library's own
planner, on stand-in arrays of the call's shapes) is compiled here by NVRTC
from its kernel's source with a different entry (:func:`plan_source`,
cached per plan):

- arguments: one pointer per XLA buffer (operands, then results);
- the plan's parameter block, with its data pointers zero, is a
  ``__constant__`` array initialised in the source; the entry rebuilds
  ``p`` from it and sets each data pointer from its XLA buffer (plus the
  byte offset the plan gives it). Every index is known at compile time, so
  the kernel reads the fixed fields from constant memory where it uses them,
  as the regular kernel reads its by-value parameter: no per-block copy, no
  barrier;
- ``threadIdx`` and ``blockDim`` read the plan's block shape (compile-time
  constants), unflattened from the launcher's one-dimensional block
  (rounded up to whole warps: the threads beyond the plan's exit first).

What the fast path cannot serve is lowered to ``buffer_callback`` instead
(:func:`lower_or_none` returns None): neither custom call in this jaxlib, more
than one visible GPU, a GPU older than sm_70, arrays CuPy has no dtype for,
an empty call, or anything the planner or the compile refuses. The CPU
platform always takes the callback. Set ``CUPY_ROPE_JAX_LAUNCH=callback`` to
use the callback everywhere.

The lowered program refers to nothing in this process: the custom call
carries the PTX (for this GPU's compute capability) with the plan's
constants in it.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import zlib
from typing import NamedTuple, Optional

import numpy as np

from . import launch, specialize, validate

#: "xla" (the fast path where it serves, else the callback) or "callback".
MODE = os.environ.get("CUPY_ROPE_JAX_LAUNCH", "xla")

# The pointers of rope::CallData: its fields less the scalar offset.
SLOTS = sum(1 for _, code in launch.DYNAMIC_FIELDS if code == "Q")
# What the plan may assume of every XLA buffer: the widest vector access.
ALIGN = launch.MAX_VECTOR_BYTES
_LIB_OP = {"rope": "rope", "rope_qk": "qk", "rope_qkv": "qkv",
           "rope_qkv_backward": "qkv_backward"}


class Unsupported(Exception):
    """The fast path cannot serve this call (the callback does)."""


class KernelCall(NamedTuple):
    """A lowered launch: the custom call's target and what it launches."""

    target: str  # PTX_TARGET, or one of jaxlib's launcher (TRITON_TARGETS)
    name: str  # the kernel's lowered name in the PTX
    ptx: str
    grid: tuple  # (x, y, z)
    threads: int  # one-dimensional block: the plan's threads in whole warps
    n_outputs: int  # the last buffers are the results
    opaque: bytes  # jaxlib's launcher only: its compressed TritonKernelCall


#: XLA's own custom call for a kernel given as PTX: XLA loads it with the
#: program and launches it as it launches its fusions (a kernel thunk, no host
#: code of ours and none of jaxlib's per execution).
PTX_TARGET = "__gpu$xla.gpu.ptx"
#: jaxlib's launcher for compiled GPU kernels (the FFI form, then the legacy one).
TRITON_TARGETS = ("triton_kernel_call_ffi", "triton_kernel_call")
#: The first jaxlib whose XLA serves PTX_TARGET as this module uses it
#: (older ones take jaxlib's launcher, which costs host time per execution).
PTX_TARGET_JAXLIB = (0, 11)


# ------------------------------------------------------------ the kernel --
# What every entry shares: the thread index and block shape rebuilt from the
# launcher's one-dimensional block, and the parameter block put together from
# the plan's constants and the call's buffers. It follows the plan's own
# declarations (_PLAN), which it reads.
_PRELUDE = r"""
namespace rope_xla {
__device__ __forceinline__ uint3 ntid() { return make_uint3(BLOCK_X, BLOCK_Y, BLOCK_Z); }

// The plan's thread index, from the launcher's one-dimensional block, whose
// threads beyond the plan's have exited (telling the compiler so lets it
// simplify the index math).
__device__ __forceinline__ uint3 tid() {
  const unsigned t = threadIdx.x;
  if constexpr (BLOCK_Y * BLOCK_Z == 1) {
    return make_uint3(t, 0, 0);
  } else {
    __builtin_assume(t < THREADS);
    return make_uint3(t % BLOCK_X, t / BLOCK_X % BLOCK_Y, t / (BLOCK_X * BLOCK_Y));
  }
}

// The kernel's parameters: FIXED, with each CallData pointer set from its
// XLA buffer. Every index is a compile-time one, so the compiler keeps the
// struct out of local memory and reads the fixed fields from constant
// memory where the kernel uses them, as it reads a by-value parameter.
template <typename P>
__device__ __forceinline__ P params(const void* const (&b)[N_BUFFERS]) {
  static_assert(sizeof(P) == sizeof(FIXED), "the plan's parameter block");
  P p;
  memcpy(&p, FIXED, sizeof(P));
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    if (SLOT_BUFFER[s] < 0) continue;  // stays null
    const char* ptr = static_cast<const char*>(b[SLOT_BUFFER[s]]) + SLOT_OFFSET[s];
    memcpy(reinterpret_cast<char*>(&p) + sizeof(ptr) * s, &ptr, sizeof(ptr));
  }
  return p;
}
}  // namespace rope_xla
"""

# One plan's constants: its block shape, where each CallData pointer comes
# from (an XLA buffer, -1 for none; a byte offset into it), and its parameter
# block (the pointers zero), in constant memory.
_PLAN = r"""
namespace rope_xla {
constexpr int N_BUFFERS = %(buffers)d;
constexpr int SLOTS = %(slots)d;
constexpr unsigned BLOCK_X = %(bx)du, BLOCK_Y = %(by)du, BLOCK_Z = %(bz)du;
constexpr unsigned THREADS = BLOCK_X * BLOCK_Y * BLOCK_Z;
constexpr int SLOT_BUFFER[SLOTS] = {%(slot_buffer)s};
constexpr long long SLOT_OFFSET[SLOTS] = {%(slot_offset)s};
__constant__ unsigned long long FIXED[%(words)d] = {%(fixed)s};
}  // namespace rope_xla
"""

_SIGNATURE = re.compile(r"\b(\w+_kernel)\(const (Params|FlatParams) p\)\s*\{")


class EntryPlan(NamedTuple):
    """What a launch's entry is compiled for (one NVRTC program each)."""

    spec: object  # the library's specialize.Spec
    n_buffers: int  # XLA buffers: operands, then results
    block: tuple  # the plan's block shape (x, y, z)
    slot_buffer: tuple  # per CallData pointer: its XLA buffer, -1 for none
    slot_offset: tuple  # per CallData pointer: byte offset into its buffer
    fixed: bytes  # the parameter block, the pointers zero


def _entry(match, n_buffers: int) -> str:
    args = ", ".join(f"const void* b{i}" for i in range(n_buffers))
    ptrs = ", ".join(f"b{i}" for i in range(n_buffers))
    return (f"{match.group(1)}({args}) {{\n"
            f"  static_assert(sizeof(rope::CallData) == 8 * (rope_xla::SLOTS + 1), "
            f"\"CallData: SLOTS pointers, then the offset\");\n"
            # The launcher's block is whole warps: the threads beyond the
            # plan's exit (from sm_70 on, block barriers do not wait for them).
            f"  if (rope_xla::THREADS % 32 && threadIdx.x >= rope_xla::THREADS) return;\n"
            f"  const {match.group(2)} p = rope_xla::params<{match.group(2)}>({{{ptrs}}});\n")


@functools.lru_cache(maxsize=None)
def entry_source(source_file: str, n_buffers: int) -> str:
    """``source_file``'s kernel source with XLA entries of ``n_buffers``
    pointer arguments (module docstring), less the plan's constants.

    Raises
    ------
    Unsupported
        If the source has no kernel signature this transformation knows.
    """
    src = specialize.kernel_source(source_file)
    src = re.sub(r"\bthreadIdx\b", "rope_xla::tid()", src)
    src = re.sub(r"\bblockDim\b", "rope_xla::ntid()", src)
    src, n = _SIGNATURE.subn(lambda m: _entry(m, n_buffers), src)
    if n == 0:
        raise Unsupported(f"{source_file}: no kernel signature (const Params p) found")
    return _PRELUDE + src


def plan_source(entry: EntryPlan) -> str:
    """The NVRTC source of ``entry``: its constants, then :func:`entry_source`."""
    words = np.frombuffer(entry.fixed, "<u8")
    constants = _PLAN % {
        "buffers": entry.n_buffers, "slots": SLOTS, "bx": entry.block[0],
        "by": entry.block[1], "bz": entry.block[2],
        "slot_buffer": ", ".join(str(i) for i in entry.slot_buffer),
        "slot_offset": ", ".join(f"{o}ll" for o in entry.slot_offset),
        "words": len(words), "fixed": ", ".join(f"{int(w):#x}ull" for w in words)}
    return constants + entry_source(entry.spec.source_file, entry.n_buffers)


_compile_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def compile_entry(entry: EntryPlan, compute_capability: int):
    """(PTX, lowered kernel name) of ``entry``, compiled by NVRTC for
    ``compute_<compute_capability>``; raises ``specialize.CompileError``."""
    from cupy.cuda import nvrtc

    spec = entry.spec
    name = spec.name_expression()
    with _compile_lock:
        prog = nvrtc.createProgram(plan_source(entry), spec.source_file, [], [])
        try:
            nvrtc.addNameExpression(prog, name)
            try:
                nvrtc.compileProgram(prog, list(specialize.NVRTC_OPTIONS)
                                     + [f"-arch=compute_{compute_capability}"])
            except nvrtc.NVRTCError as exc:
                raise specialize.CompileError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from exc
            ptx = nvrtc.getPTX(prog)
            ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")
            return portable_ptx(ptx, compute_capability), nvrtc.getLoweredName(prog, name)
        finally:
            nvrtc.destroyProgram(prog)


def portable_ptx(ptx: str, compute_capability: int) -> str:
    """``ptx`` declaring PTX ISA 8.0 where its target needs no newer one.

    jaxlib assembles the PTX with the ptxas XLA finds, which may be older
    than this NVRTC (an NVRTC 13.5 writes ISA 9.5, a CUDA 13.0 ptxas reads up
    to 9.0); the kernels use nothing past ISA 8.0, which sm_90 and older accept.
    """
    if compute_capability > 90:
        return ptx
    return re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M)


# -------------------------------------------------------------- the plan --
def _stand_ins(avals, device_id: int) -> list:
    """A CuPy array per aval at distinct, ``ALIGN``-aligned fake addresses:
    the planner reads shapes, strides and pointers, never the memory."""
    import cupy

    out = []
    for i, a in enumerate(avals):
        try:
            dtype = cupy.dtype(np.dtype(a.dtype))
        except TypeError:
            raise Unsupported(f"CuPy has no dtype {a.dtype}") from None
        nbytes = max(1, dtype.itemsize * int(np.prod(a.shape, dtype=np.int64)))
        # 2^40 bytes apart (no two arrays overlap), aligned to ALIGN only.
        ptr = (1 << 44) + (i << 40) + ALIGN
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, device_id)
        out.append(cupy.ndarray(tuple(a.shape), dtype, cupy.cuda.MemoryPointer(mem, 0)))
    return out


def plan_call(op: str, static, backward: bool, n_data: int, in_avals, out_avals,
              device_id: int = 0):
    """(plan, arrays) of the library for this call's shapes and options,
    ``arrays`` being one stand-in per XLA buffer (operands, then results).
    Raises (``Unsupported``, or the library's errors) where it cannot."""
    lib_op = _LIB_OP[op]
    fakes = _stand_ins(list(in_avals) + list(out_avals), device_id)
    data, aux, outs = fakes[:n_data], fakes[n_data:len(in_avals)], fakes[len(in_avals):]
    kw = dict(static.kw)
    by_name = dict(zip(static.names, aux))
    fields = {k: v for k, v in kw.items() if k in validate.Options._fields}
    if lib_op in ("rope", "qk"):
        fields["backward"] = backward
    if lib_op == "qkv_backward":
        fields["backward"] = True
    named = validate.check_options(validate.Options(**fields))
    offsets = by_name.get("offsets", kw.get("offsets"))
    described = validate.describe_arrays(
        lib_op, data, tuple(by_name.get(n) for n in validate.TABLE_NAMES),
        by_name.get("positions"), offsets, by_name.get("cu_seqlens"), outs)
    call = validate.check(described, named)
    if not call.on_gpu:
        raise Unsupported("not a GPU call")
    if call.tokens == 0 or call.heads == 0:
        raise Unsupported("an empty call")
    return launch.Plan(call, fakes), fakes, call.offset


def entry_plan(plan, offset: int, n_buffers: int) -> EntryPlan:
    """What ``plan``'s entry is compiled for, with the call's static
    ``offset`` in its parameter block (CallData's word after the pointers)."""
    params = bytearray(plan.buf)
    params[8 * SLOTS:8 * SLOTS + 8] = np.int64(offset).tobytes()
    return EntryPlan(plan.spec, n_buffers, tuple(int(n) for n in plan.block),
                     tuple(max(int(index), -1) for index, _ in plan.slots),
                     tuple(int(byte_offset) for _, byte_offset in plan.slots), bytes(params))


# -------------------------------------------------------------- lowering --
def launcher():
    """jaxlib's GPU kernel launcher module, or None."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return None
    return gpu_triton if hasattr(gpu_triton, "TritonKernelCall") else None


def _jaxlib_version() -> tuple:
    from jax._src.lib import version

    return tuple(version)


def target() -> Optional[str]:
    """The custom call the fast path lowers to with this jaxlib (XLA's PTX
    call, else jaxlib's launcher), or None where it has neither."""
    if _jaxlib_version() >= PTX_TARGET_JAXLIB:
        return PTX_TARGET
    lib = launcher()
    return None if lib is None else _triton_target(lib)


def _triton_target(lib) -> str:
    """The launcher's custom call: the FFI one where this jaxlib has it (as
    Pallas decides: registered from Python, or any jaxlib after 0.10.2)."""
    try:
        names = lib._cuda_triton.registrations()
    except Exception:  # a jaxlib without FFI registrations
        names = {}
    if TRITON_TARGETS[0] in names or _jaxlib_version() > (0, 10, 2):
        return TRITON_TARGETS[0]
    return TRITON_TARGETS[1]


def _single_gpu() -> int:
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) != 1:
        raise Unsupported(f"{len(gpus)} GPUs visible (the fast path serves one)")
    return int(getattr(gpus[0], "local_hardware_id", None) or 0)


def build(op: str, static, backward: bool, n_data: int, in_avals, out_avals) -> KernelCall:
    """The launch of this call by XLA (or jaxlib's launcher); raises where the
    fast path cannot serve (``Unsupported``, compile or planner errors)."""
    call_target = target()
    if call_target is None:
        raise Unsupported("this jaxlib has neither XLA's PTX custom call nor jaxlib's "
                          "GPU kernel launcher (gpu_triton)")
    device_id = _single_gpu()
    plan, _, offset = plan_call(op, static, backward, n_data, in_avals, out_avals, device_id)
    cc = _compute_capability(device_id)
    if cc < 70:
        raise Unsupported(f"compute capability {cc} (threads beyond a block's must exit)")
    n = len(in_avals) + len(out_avals)
    ptx, name = compile_entry(entry_plan(plan, offset, n), cc)
    threads = 32 * -(-plan.block[0] * plan.block[1] * plan.block[2] // 32)
    grid = tuple(int(g) for g in plan.grid)
    opaque = b""
    if call_target != PTX_TARGET:
        lib = launcher()
        params = [lib.create_array_parameter(0, ALIGN)] * n
        kernel = _triton_kernel(lib, name, threads // 32, ptx, cc)
        opaque = zlib.compress(lib.TritonKernelCall(kernel, *grid, params).to_proto(name, b""))
    return KernelCall(call_target, name, ptx, grid, threads, len(out_avals), opaque)


def _triton_kernel(lib, name: str, warps: int, ptx: str, cc: int):
    """jaxlib's kernel object (no dynamic shared memory, one CTA per cluster):
    its constructor's arguments differ between jaxlib versions."""
    forms = ((name, warps, 1, 0, ptx, "", cc),  # num_ctas, then shared memory
             (name, warps, 0, ptx, "", cc, 1, 1, 1),  # cluster dims last
             (name, warps, 0, ptx, "", cc))
    for args in forms[:-1]:
        try:
            return lib.TritonKernel(*args)
        except TypeError:
            continue
    return lib.TritonKernel(*forms[-1])


def _compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def lower_or_none(op: str, static, backward: bool, n_data: int, in_avals: tuple,
                  out_avals: tuple) -> Optional[KernelCall]:
    """:func:`build`, or None where the fast path cannot serve (then the
    callback does); the reason is kept in :data:`last_refusal`."""
    if MODE != "xla":
        return None
    return _lower_cached(op, static, backward, n_data, in_avals, out_avals)


@functools.lru_cache(maxsize=1024)
def _lower_cached(op, static, backward, n_data, in_avals, out_avals):
    try:
        return build(op, static, backward, n_data, in_avals, out_avals)
    except Exception as exc:  # any refusal: the callback serves the call
        last_refusal[0] = f"{type(exc).__name__}: {exc}"
        return None


#: Why the last call the fast path refused went to the callback (for tests).
last_refusal = [""]


# ------------------------------------------------------------- primitive --
def _make_primitive():
    """The primitive :mod:`cupy_rope.jax` binds: CUDA lowering to the
    launcher where :func:`lower_or_none` serves, else (and on every other
    platform) to the op's ``buffer_callback``; vmap runs it once per mapped
    element, as the callback's ``vmap_method="sequential"`` does."""
    import jax
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    from jax._src.interpreters import batching
    from jax._src import dispatch
    from jax._src.core import ShapedArray
    from jax._src.interpreters import mlir as mlir_internal
    from jax.experimental.buffer_callback import buffer_callback

    prim = Primitive("cupy_rope_kernel")
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))

    def abstract(*avals, outs, **_):
        return [ShapedArray(o.shape, o.dtype) for o in outs]

    prim.def_abstract_eval(abstract)

    def by_callback(*args, callback, outs, single, **_):
        result = outs[0] if single else outs
        res = buffer_callback(callback, result, vmap_method="sequential")(*args)
        return list(res) if isinstance(res, (tuple, list)) else [res]

    fallback = mlir.lower_fun(by_callback, multiple_results=True)

    def cuda_rule(ctx, *args, callback, outs, single, op, static, backward, n_data):
        found = lower_or_none(op, static, backward, n_data,
                              tuple(_aval_key(a) for a in ctx.avals_in),
                              tuple(_aval_key(a) for a in ctx.avals_out))
        if found is None:
            return fallback(ctx, *args, callback=callback, outs=outs, single=single, op=op,
                            static=static, backward=backward, n_data=n_data)
        try:
            results = _custom_call(mlir_internal, ctx, args, found)
        except Exception as exc:  # a jaxlib whose custom call API differs
            last_refusal[0] = f"{type(exc).__name__}: {exc}"
            return fallback(ctx, *args, callback=callback, outs=outs, single=single, op=op,
                            static=static, backward=backward, n_data=n_data)
        last_lowered[0] = found
        return results

    mlir.register_lowering(prim, fallback)
    mlir.register_lowering(prim, cuda_rule, platform="cuda")

    def batch(args, dims, **params):
        mapped = [None if _unmapped(batching, d) else jax.numpy.moveaxis(a, d, 0)
                  for a, d in zip(args, dims)]

        def one(xs):
            it = iter(xs)
            full = [next(it) if m is not None else a for a, m in zip(args, mapped)]
            return prim.bind(*full, **params)

        outs = jax.lax.map(one, [m for m in mapped if m is not None])
        return list(outs), [0] * len(outs)

    batching.primitive_batchers[prim] = batch
    return prim


def _unmapped(batching, d) -> bool:
    """Is batch dimension ``d`` "not mapped" (None, or NotMapped in newer JAX)?"""
    return d is None or isinstance(d, getattr(batching, "NotMapped", ()))


class _Aval(NamedTuple):
    shape: tuple
    dtype: str


def _aval_key(aval) -> _Aval:
    return _Aval(tuple(int(n) for n in aval.shape), np.dtype(aval.dtype).name)


def _custom_call(mlir_internal, ctx, args, found: KernelCall):
    """The custom call of ``found`` on the operands ``args`` (row-major)."""
    ir = mlir_internal.ir
    layouts = [list(reversed(range(len(a.shape)))) for a in ctx.avals_in]
    result_layouts = [list(reversed(range(len(a.shape)))) for a in ctx.avals_out]
    result_types = [ir.RankedTensorType.get(a.shape, mlir_internal.dtype_to_ir_type(a.dtype))
                    for a in ctx.avals_out]
    common = dict(result_types=result_types, operands=list(args), operand_layouts=layouts,
                  result_layouts=result_layouts)
    if found.target == PTX_TARGET:
        config = _ptx_config(ir, found, len(ctx.avals_in))
    elif found.target == TRITON_TARGETS[0]:
        config = dict(name=ir.StringAttr.get(found.name),
                      opaque=ir.StringAttr.get(found.opaque))
    else:
        return mlir_internal.custom_call(found.target, backend_config=found.opaque,
                                         api_version=2, **common).results
    return mlir_internal.custom_call(found.target, backend_config=config, **common).results


def _ptx_config(ir, found: KernelCall, n_inputs: int) -> dict:
    """PTX_TARGET's attributes: the kernel, its launch shape, and its
    arguments (one per buffer: the operands, then the results)."""
    i32 = ir.IntegerType.get_signless(32)
    ints = dict(zip(("grid_x", "grid_y", "grid_z"), found.grid),
                block_x=found.threads, block_y=1, block_z=1, shared_mem_bytes=0)
    config = {k: ir.IntegerAttr.get(i32, int(v)) for k, v in ints.items()}
    config.update(name=ir.StringAttr.get(found.name), kernel_type=ir.StringAttr.get("ptx"),
                  kernel_data=ir.StringAttr.get(found.ptx),
                  output_indices=ir.ArrayAttr.get([ir.IntegerAttr.get(i32, n_inputs + i)
                                                   for i in range(found.n_outputs)]))
    return config


#: The last KernelCall the CUDA lowering emitted (for tests).
last_lowered = [None]


@functools.lru_cache(maxsize=None)
def primitive():
    """The JAX primitive (made on first use)."""
    return _make_primitive()


def kernel_op(op: str, static, backward: bool, n_data: int, callback, result):
    """A function of the op's arrays (data, then the other arrays) returning
    ``result``'s structure (one ShapeDtypeStruct or a tuple of them), lowered
    to the fast path on CUDA where it serves, else to ``callback`` through
    ``buffer_callback``; None where this JAX cannot host the primitive."""
    try:
        prim = primitive()
    except Exception as exc:  # JAX internals this module uses have moved
        last_refusal[0] = f"{type(exc).__name__}: {exc}"
        return None
    single = not isinstance(result, (tuple, list))
    outs = (result,) if single else tuple(result)

    def run(*args):
        res = prim.bind(*args, callback=callback, outs=outs, single=single, op=op,
                               static=static, backward=bool(backward), n_data=n_data)
        return res[0] if single else tuple(res)

    return run
