"""Kernel specializations: the key, the source, and the NVRTC compile.

Everything that becomes a compile-time template argument lives in
:class:`Spec`; one ``Spec`` is one kernel instantiation. Kernels are
compiled on first use for the device that runs them, cached in memory per
(spec, device) and on disk by CuPy's kernel cache (``CUPY_CACHE_DIR``,
default ``~/.cupy/kernel_cache``), so a new process loads the cubin instead of
compiling again.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from pathlib import Path

#: Directory of the CUDA C++ templates (shipped inside the package).
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
if not KERNEL_DIR.is_dir():  # running from a source checkout
    KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

#: NVRTC options shared by the runtime compile and the CPU compile test.
#: No fast-math: sincosf keeps its full-accuracy range reduction.
NVRTC_OPTIONS = ("-std=c++17",)

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

# C++ spelling of each storage dtype.
CXX_TYPES = {
    "float32": "float",
    "float16": "rope::f16",
    "bfloat16": "rope::bf16",
}

#: Angle sources (kernels/angles.cuh AngleSource): cos/sin tables, inv_freq,
#: or a table of angles (the ``freqs`` argument).
ANGLE_SOURCES = {"table": 0, "inv_freq": 1, "freqs": 2}

#: Position rules (kernels/positions.cuh PosMode).
POS_MODES = {"implied": 0, "explicit": 1, "varlen": 2, "axes": 3}

#: The kernels (``Spec.mapping``) and their source files: rope_kernel,
#: packet_kernel and flat_kernel (docs/architecture.md).
KERNEL_FILES = {"flat": "flat.cu", "packet": "packet.cu", "rope": "rope.cu"}
KERNELS = tuple(KERNEL_FILES)


@dataclass(frozen=True)
class Spec:
    """Compile-time choices of one kernel instantiation (rope_kernel,
    packet_kernel or flat_kernel)."""

    dtype: str  # x and out: float32 | float16 | bfloat16
    angle_dtype: str  # cos/sin tables, angles or inv_freq
    head_dim: int
    rotary_dim: int
    interleaved: bool  # GPT-J pairs (2f, 2f+1); else NeoX (f, f + rotary_dim/2)
    source: str  # key of ANGLE_SOURCES
    pairs: int  # channel pairs per thread item (vector width)
    tail_vec: int  # channels per tail-copy item
    strided: bool  # last dim of an input or output has a stride other than 1
    table_strided: bool  # tables read element by element
    copy_tail: bool  # out of place: copy channels [rotary_dim, head_dim)
    unroll: int  # heads a thread loads before its first store
    pos_mode: str  # key of POS_MODES: implied | explicit | varlen | axes
    # Which kernel (a key of KERNEL_FILES): "rope" (rope_kernel: a thread
    # walks several heads; any call), "packet" (packet_kernel: a thread
    # rotates one unit of 16-byte packets; full rotary, aligned views) or
    # "flat" (flat_kernel: one 16-byte packet per thread over dense slabs in
    # memory order; cos/sin tables, positions that follow the sequence index).
    mapping: str = "rope"
    # flat_kernel, NeoX: the two lanes of a rotation pair each read half of
    # the angles they share and swap halves (for blocks whose rows lie at
    # several positions).
    split_angles: bool = False
    # flat_kernel, NeoX out of place: a thread loads its rotation partner
    # itself (rows need not tile a warp).
    partner_load: bool = False
    # flat_kernel: the call's slab count (x alone: 1; q and k: 2); 0 for the
    # other kernels, which pick each block's slab at run time.
    slabs: int = 0
    # flat_kernel, 16-bit rows that would ask for their table rows once x has
    # arrived (kernels/flat.cu LATE_TABLES): ask early instead (large calls).
    early_tables: bool = False
    # flat_kernel: x loaded with an L2 evict-last policy (fp32 rows walked in
    # position order, out of place).
    x_evict_last: bool = False

    @property
    def source_file(self) -> str:
        return KERNEL_FILES[self.mapping]

    @property
    def vec(self) -> int:
        """Channels per packet (one vector access): a NeoX packet holds one
        channel of each of ``pairs`` pairs, a GPT-J packet ``pairs`` whole pairs."""
        return 2 * self.pairs if self.interleaved else self.pairs

    @property
    def unit_packets(self) -> int:
        """packet_kernel: packets per thread (kernels/packet.cu PACKETS): NeoX
        partners or two adjacent GPT-J packets; GPT-J fp32 one."""
        return 1 if self.interleaved and ITEMSIZE[self.dtype] == 4 else 2

    @property
    def table_freqs(self) -> int:
        """Frequencies a thread reads from a table row at once (packet_kernel
        UNIT_FREQS, rope_kernel PAIRS): the run the tables must be aligned for."""
        if self.mapping == "packet" and self.interleaved:
            return self.pairs * self.unit_packets
        return self.pairs

    @property
    def rot_items(self) -> int:
        """Threads per head for the rotated channels (packet_kernel: per head)."""
        if self.mapping == "packet" and self.interleaved:
            return self.rotary_dim // (self.vec * self.unit_packets)
        return self.rotary_dim // 2 // self.pairs

    @property
    def tail_items(self) -> int:
        return (self.head_dim - self.rotary_dim) // self.tail_vec if self.copy_tail else 0

    def name_expression(self) -> str:
        b = lambda v: "true" if v else "false"  # noqa: E731
        if self.mapping == "flat":
            return "rope::flat_kernel<" + ", ".join([
                CXX_TYPES[self.dtype], CXX_TYPES[self.angle_dtype], str(self.head_dim),
                str(self.rotary_dim), b(self.interleaved), b(self.split_angles),
                b(self.partner_load), str(self.slabs), str(POS_MODES[self.pos_mode]),
                b(self.early_tables), b(self.x_evict_last)]) + ">"
        if self.mapping == "packet":
            return "rope::packet_kernel<" + ", ".join([
                CXX_TYPES[self.dtype], CXX_TYPES[self.angle_dtype], str(self.head_dim),
                b(self.interleaved), str(ANGLE_SOURCES[self.source]), str(self.vec),
                b(self.table_strided), str(POS_MODES[self.pos_mode])]) + ">"
        args = [
            CXX_TYPES[self.dtype],
            CXX_TYPES[self.angle_dtype],
            str(self.head_dim),
            str(self.rotary_dim),
            b(self.interleaved),
            str(ANGLE_SOURCES[self.source]),
            str(self.pairs),
            str(self.tail_vec),
            b(self.strided),
            b(self.table_strided),
            b(self.copy_tail),
            str(self.unroll),
            str(POS_MODES[self.pos_mode]),
        ]
        return "rope::rope_kernel<" + ", ".join(args) + ">"


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


@functools.lru_cache(maxsize=None)
def kernel_source(name: str = "rope.cu") -> str:
    """The kernel file with its local includes inlined (each once).

    Inlining makes the source self-contained, so CuPy's disk cache, which
    hashes the source text, sees every header change.
    """
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (KERNEL_DIR / fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


# ---------------------------------------------------------------- runtime --
_lock = threading.Lock()
_modules: dict = {}  # (Spec, device id) -> (RawModule, Function)


class CompileError(RuntimeError):
    """NVRTC could not be found or could not compile a specialization."""


def _nvrtc_help(exc: Exception) -> CompileError:
    return CompileError(
        f"cupy-rope could not compile its CUDA kernel with NVRTC ({type(exc).__name__}: {exc}). "
        "NVRTC comes with CuPy's CUDA extras: install cupy-rope[cuda12] "
        "(cupy-cuda12x and nvidia-cuda-nvrtc-cu12) or cupy-rope[cuda13] "
        "(cupy-cuda13x and nvidia-cuda-nvrtc), or a CUDA toolkit with libnvrtc on the "
        "library path."
    )


def get_kernel(spec: Spec, device_id: int):
    """The compiled kernel for ``spec`` on ``device_id`` (a cupy Function)."""
    key = (spec, device_id)
    hit = _modules.get(key)
    if hit is not None:
        return hit[1]
    with _lock:  # compile each key once, even with many threads
        hit = _modules.get(key)
        if hit is not None:
            return hit[1]
        import cupy

        name = spec.name_expression()
        try:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(
                    code=kernel_source(spec.source_file), options=NVRTC_OPTIONS,
                    name_expressions=[name]
                )
                function = module.get_function(name).kernel  # cupy.cuda.function.Function
        except cupy.cuda.compiler.CompileException:
            raise
        except Exception as exc:  # missing libnvrtc and the like
            raise _nvrtc_help(exc) from exc
        _modules[key] = (module, function)
        return function


def _nvrtc_compile(specs, arch: str, read):
    """Compile ``specs`` (one source file) with NVRTC for ``arch`` (``sm_XX``:
    a cubin, ``compute_XX``: PTX) and return ``read(nvrtc, prog)``; raises
    :class:`CompileError` with NVRTC's log on failure."""
    try:
        from cupy.cuda import nvrtc
    except Exception as exc:  # pragma: no cover - depends on the install
        raise _nvrtc_help(exc) from exc
    source_file = specs[0].source_file if specs else "rope.cu"
    try:
        prog = nvrtc.createProgram(kernel_source(source_file), source_file, [], [])
    except Exception as exc:
        raise _nvrtc_help(exc) from exc
    try:
        for s in specs:
            nvrtc.addNameExpression(prog, s.name_expression())
        try:
            nvrtc.compileProgram(prog, list(NVRTC_OPTIONS) + [f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from exc
        return read(nvrtc, prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_for_arch(specs, arch: str = "sm_90") -> dict:
    """Compile ``specs`` with NVRTC for ``arch`` without a GPU.

    Returns ``{name_expression: lowered_name}``; raises :class:`CompileError`
    with NVRTC's log on failure or on any warning. Used by the CPU tests to
    check every shipped specialization; the runtime path compiles through
    CuPy with the same source and options.
    """
    files = sorted({s.source_file for s in specs}) or ["rope.cu"]
    if len(files) > 1:  # one NVRTC program per source file
        out = {}
        for f in files:
            out.update(compile_for_arch([s for s in specs if s.source_file == f], arch))
        return out

    def read(nvrtc, prog):
        log = nvrtc.getProgramLog(prog).strip()
        if log:
            raise CompileError(f"NVRTC warnings for {arch}:\n{log}")
        if not nvrtc.getCUBIN(prog):
            raise CompileError(f"NVRTC produced no cubin for {arch}")
        names = (s.name_expression() for s in specs)
        return {n: nvrtc.getLoweredName(prog, n) for n in names}

    return _nvrtc_compile(specs, arch, read)


def ptx_for_arch(specs, arch: str = "sm_90") -> str:
    """NVRTC's PTX for ``specs`` (one source file) on ``arch``'s virtual
    architecture (compute_XX), for tests that read the generated code."""
    def read(nvrtc, prog):
        ptx = nvrtc.getPTX(prog)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")

    return _nvrtc_compile(specs, f"compute_{arch[3:]}", read)
