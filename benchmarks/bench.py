"""Benchmark: cupy-rope against a device copy of the same bytes and against peer implementations.

``python -m benchmarks.bench [--workloads A,B] [--filter REGEX] [--peers LIST]
[--json FILE] [--plot FILE.png] [--reps N] [--sets N] [--no-host] [--no-check]
[--strict] [--list]``; importable as ``run(...)``.

Method. Every workload runs forward and backward for cupy-rope and for each
peer present (``cupy_rope.peers``: the PyTorch formula eager and under
``torch.compile``, Liger's Triton kernel, FlashInfer) on the same inputs.
A time is the median over ``reps`` calls, each between its own pair of CUDA
events, after a warm-up, rotating among ``sets`` input sets so that the L2
cache does not flatter; all timed calls are queued behind a kernel that
spins on the GPU (long enough for the host to enqueue them all; checked
after the fact), so the events time GPU work and not the Python cost of a
call. The bytes of a workload are the reads and writes of x (or q and k)
and of the outputs that any implementation must do: read once and write
once, only the rotated channels for partial rotary in place (angle tables
and positions are not counted). "of copy" is the time of a device-to-device
copy moving the same bytes (half read, half written), measured in the same
run, divided by the workload's time. "speedup" is the best peer's time over
cupy-rope's. Every output is first checked against a float32 reference
(max error / max |reference|), and a peer that disagrees is not counted.
On thd workloads the peers take per-token positions, gathered from
cu_seqlens outside their timed call; cupy-rope is timed with cu_seqlens (it
finds each token's sequence itself) and, as "cupy-rope pos", on the same
positions the peers get: the row that acceptance item [1b] compares there.

The host cost of a cached call (decode, 64 tokens) is timed separately:
many calls timed on the host with one synchronization at the end, with torch
tensors and with CuPy arrays, and the per-call time of 100 calls captured in
a CUDA graph and replayed. The acceptance items of issue 6 are printed as
PASS/FAIL/SKIP lines, then the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from typing import Any, NamedTuple

import numpy as np

OURS = "cupy-rope"
#: thd workloads also time cupy-rope on the per-token positions the peers are
#: handed (gathered from cu_seqlens outside their timed call): the same
#: inputs, so acceptance [1b] compares this row on thd.
OURS_POSITIONS = "cupy-rope pos"
OURS_IMPLS = (OURS, OURS_POSITIONS)
MiB = 1 << 20
#: Workloads moving at least this many bytes are held to the copy roofline.
ROOFLINE_MIN_BYTES = 64 * MiB
#: Correctness tolerance: max |out - ref| / max |ref| per storage dtype.
CHECK_TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
#: Sizes of the host-cost microbenchmark.
HOST_CALLS = 2000
#: Timed passes of a peer's host timing (HOST_CALLS / 4 calls each); the
#: median pass is reported (and the range).
HOST_REPEATS = 5
#: Rounds of the decode step's host timings: each round times one pass of
#: every variant in turn (apply_rope_qk, RotaryEmbedding.qk_ and the bare
#: launch, torch and CuPy, and torch's x.add_(1)), so that a slow phase of
#: the host (on the pool's machines one lasts from a few passes to seconds:
#: run 2026-11-24o's torch qk_ passes went 7.0, 10.3, 10.7, 10.6, 10.4 us
#: while the CuPy ones timed next held 6.8-7.0) falls on all of them alike
#: instead of on whichever was timed then.
HOST_ROUNDS = 9
#: Each host timing first calls for at least this long (seconds), so that
#: the passes see the host's steady state: right after the GPU workloads the
#: bare launch's passes fell from 8.4 to 4.3 us over the first 0.1 s while
#: the same launch timed a moment later held 3.1 us (run 2026-11-24,
#: docs/perf-notes.md v16).
HOST_WARMUP_S = 0.5
GRAPH_CALLS = 100
NO_TORCH = "torch not available"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# Workloads (plain data; nothing here needs a GPU).


class Workload(NamedTuple):
    """One benchmark case.

    ``kind``: "single" (one tensor x), "qk" (q and k in one ``apply_rope_qk``
    call), "decode" (token-major q and k in place at explicit positions into
    a cos|sin cache, as vLLM does) or "thd" (packed sequences, ``cu_seqlens``).
    ``shape`` is x's (or q's) logical shape in ``layout``; k has ``k_heads``
    heads. ``strided``: x is a [b, h, s, d] tensor seen as [b, s, h, d].
    """

    name: str
    title: str
    kind: str
    layout: str
    shape: tuple
    dtype: str = "bfloat16"
    k_heads: int = 0
    mode: str = "new"          # "new" (into a preallocated output) | "inplace"
    rotary_frac: float = 1.0
    strided: bool = False
    n_seqs: int = 0            # thd: number of packed sequences
    max_position: int = 0      # decode: rows of the cos|sin cache
    interleaved: bool = False  # GPT-J pairs (2f, 2f + 1); else NeoX (f, f + r/2)

    @property
    def head_dim(self) -> int:
        return self.shape[-1]

    @property
    def rotary_dim(self) -> int:
        r = int(round(self.head_dim * self.rotary_frac))
        return r - r % 2

    @property
    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    @property
    def k_shape(self):
        if self.kind not in ("qk", "decode"):
            return None
        return tuple(self.shape[:-2]) + (self.k_heads, self.head_dim)

    @property
    def seq_len(self):
        """Sequence length for bshd/sbhd (positions are the sequence index)."""
        if self.layout == "bshd":
            return self.shape[1]
        if self.layout == "sbhd":
            return self.shape[0]
        return None

    def tensor_shapes(self) -> list:
        shapes = [tuple(self.shape)]
        if self.k_shape is not None:
            shapes.append(self.k_shape)
        return shapes

    def moved_bytes(self) -> int:
        """Bytes read plus bytes written of x/q/k and outputs."""
        elems = sum(math.prod(s) for s in self.tensor_shapes())
        total = 2 * elems * self.itemsize
        if self.mode == "inplace":
            total = total * self.rotary_dim // self.head_dim
        return total

    def copy_bytes(self) -> int:
        """Size of the device copy that moves the same bytes (read + write)."""
        return self.moved_bytes() // 2

    def describe(self) -> dict:
        d = self._asdict()
        d["shape"] = list(self.shape)
        d.update(rotary_dim=self.rotary_dim, moved_bytes=self.moved_bytes(),
                 copy_bytes=self.copy_bytes(),
                 k_shape=list(self.k_shape) if self.k_shape else None)
        return d


def _wl(name, title, kind, layout, shape, **kw) -> Workload:
    return Workload(name, title, kind, layout, tuple(shape), **kw)


WORKLOADS = [
    _wl("sbhd-4096x1x128x128", "bf16 sbhd [4096,1,128,128], out of place",
        "single", "sbhd", (4096, 1, 128, 128)),
    _wl("sbhd-512x32x24x128", "bf16 sbhd [512,32,24,128], out of place",
        "single", "sbhd", (512, 32, 24, 128)),
    _wl("llama3-8b-prefill-qk", "Llama-3-8B prefill: bf16 bshd q [4,4096,32,128] + "
        "k [4,4096,8,128] in one call, out of place", "qk", "bshd", (4, 4096, 32, 128),
        k_heads=8),
    *[_wl(f"decode-qk-t{t}", f"decode q32/k8 d128, {t} token(s): bf16 [T,h,d] in place at "
          "positions [T] into an fp32 cos|sin cache [8192,128]", "decode", "thd", (t, 32, 128),
          k_heads=8, mode="inplace", max_position=8192) for t in (1, 16, 64)],
    *[_wl(f"diffusion-qk-d{d}", f"diffusion q24/k24 d{d}: bf16 bshd [2,4096,24,{d}] each, "
          "one call, out of place", "qk", "bshd", (2, 4096, 24, d), k_heads=24)
      for d in (80, 96)],
    _wl("sbhd-fp32-128x8192x1x128", "fp32 sbhd [128,8192,1,128] (s=128, b=8192), out of place",
        "single", "sbhd", (128, 8192, 1, 128), dtype="float32"),
    *[_wl(f"thd-n{n}", f"bf16 thd [65536,32,128], {n} packed sequence(s) of random lengths, "
          "cu_seqlens int32, out of place", "thd", "thd", (65536, 32, 128), n_seqs=n)
      for n in (1, 128, 2401)],
    _wl("inplace-full", "bf16 bshd [4,4096,32,128] in place, full rotary (the partial rows' "
        "reference)", "single", "bshd", (4, 4096, 32, 128), mode="inplace"),
    *[_wl(f"partial-{f}", f"bf16 bshd [4,4096,32,128] in place, rotary_dim {int(128 * f)} "
          f"(fraction {f})", "single", "bshd", (4, 4096, 32, 128), mode="inplace",
          rotary_frac=f) for f in (0.5, 0.25)],
    _wl("bshd-contig", "bf16 bshd [4,4096,32,128] contiguous, out of place "
        "(the strided row's twin)", "single", "bshd", (4, 4096, 32, 128)),
    _wl("bshd-gptj", "bf16 bshd [4,4096,32,128] GPT-J (interleaved) pairs, out of place",
        "single", "bshd", (4, 4096, 32, 128), interleaved=True),
    _wl("bshd-strided", "bf16 [4,4096,32,128] bshd view of a [4,32,4096,128] bhsd tensor, "
        "out of place into an output of the same memory order (as the peers' new outputs)",
        "single", "bshd", (4, 4096, 32, 128), strided=True),
]


def select_workloads(names=None, filters=None, workloads=None) -> list:
    """``names``: exact names (a list or a comma-separated string); ``filters``:
    regular expressions searched in the name (a workload is kept if any
    matches). Both given: a workload must satisfy both."""
    pool = list(WORKLOADS if workloads is None else workloads)
    if names:
        if isinstance(names, str):
            names = [n for n in names.split(",") if n]
        by_name = {w.name: w for w in pool}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown workload(s) {', '.join(unknown)}; "
                             f"known: {', '.join(by_name)}")
        pool = [w for w in pool if w.name in set(names)]
    if filters:
        if isinstance(filters, str):
            filters = [filters]
        pats = [re.compile(f) for f in filters]
        pool = [w for w in pool if any(p.search(w.name) for p in pats)]
    return pool


def thd_cu_seqlens(total: int, n_seqs: int, seed: int = 0) -> np.ndarray:
    """int32 [n_seqs + 1] offsets of ``n_seqs`` random lengths (each >= 1)
    summing to ``total``; the same for the same arguments."""
    if not 1 <= n_seqs <= total:
        raise ValueError(f"need 1 <= n_seqs <= total, got {n_seqs}, {total}")
    rng = np.random.default_rng(seed + 7919 * n_seqs)
    cuts = np.sort(rng.choice(np.arange(1, total), size=n_seqs - 1, replace=False))
    return np.concatenate(([0], cuts, [total])).astype(np.int32)


def token_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    """int64 [T]: each token's index inside its sequence."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    return np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lengths)


def decode_positions(tokens: int, max_position: int, seed: int = 0) -> np.ndarray:
    """int64 [tokens]: random positions in [0, max_position) (one per sequence)."""
    rng = np.random.default_rng(seed + tokens)
    return rng.integers(0, max_position, size=tokens, dtype=np.int64)


def rope_tables(rows: int, rotary_dim: int, base: float = 10000.0):
    """float32 cos and sin tables [rows, rotary_dim / 2], computed in float64."""
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    theta = np.arange(rows, dtype=np.float64)[:, None] * inv_freq
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


# ----------------------------------------------------------------------------
# GPU timing.

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""
_spin_kernel = None


def _hold_stream(ms: float = 20.0) -> None:
    """Queue a kernel that keeps the GPU busy for ``ms`` (at ~2 GHz), so that
    the host can enqueue the timed calls behind it: the events then time the
    GPU work alone, not the Python overhead of each call."""
    global _spin_kernel
    import cupy

    if _spin_kernel is None:
        _spin_kernel = cupy.RawKernel(_SPIN, "spin")
    _spin_kernel((1,), (1,), (np.int64(ms * 2e6),))


def _sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def time_call(fn, sets, reps=30, warmup=5):
    """(median ms, held) of ``fn(*set)`` over ``reps`` calls rotating through ``sets``.

    Each call sits between its own pair of CUDA events; all calls are queued
    behind a spinning kernel sized from the host cost of a call, and
    ``held`` says whether the host finished enqueuing before the spin ended
    (if not, the spin is lengthened and the measurement repeated, twice at most).
    """
    import cupy

    for i in range(warmup):
        fn(*sets[i % len(sets)])
    _sync()
    n = max(3, len(sets))
    t0 = time.perf_counter()
    for i in range(n):
        fn(*sets[i % len(sets)])
    host_ms = (time.perf_counter() - t0) / n * 1e3
    _sync()
    hold = min(max(5.0, 2.0 * reps * host_ms + 2.0), 4000.0)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    held = False
    for _attempt in range(3):
        _hold_stream(hold)
        spin_done = cupy.cuda.Event()
        spin_done.record()
        for i, (start, stop) in enumerate(events):
            args = sets[i % len(sets)]
            start.record()
            fn(*args)
            stop.record()
        held = not spin_done.done
        events[-1][1].synchronize()
        if held:
            break
        hold = min(hold * 4, 16000.0)
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in events), held


def time_ms(fn, sets, reps=30, warmup=5):
    """Median milliseconds of ``fn(*set)`` over ``reps``, rotating through ``sets``."""
    return time_call(fn, sets, reps, warmup)[0]


def copy_ms(nbytes, n_sets=3, reps=30):
    """Median time of a device-to-device copy of ``nbytes`` (read + write)."""
    import cupy

    bufs = [(cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8))
            for _ in range(n_sets)]

    def run_copy(src, dst):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    t = time_ms(run_copy, bufs, reps)
    del bufs
    cupy.get_default_memory_pool().free_all_blocks()
    return t


# ----------------------------------------------------------------------------
# Arrays: torch tensors when torch sees the GPU (so the peers get the very
# same inputs), CuPy arrays otherwise.


class _Env:
    """Array factory. ``device="cpu"`` (torch only) is for CPU tests of the
    workload plumbing, the peers' adapters and the correctness check."""

    def __init__(self, use_torch=True, device="cuda"):
        self.device = device
        self.cupy = None
        if device != "cpu":
            import cupy

            self.cupy = cupy
        self.torch = None
        if use_torch:
            try:
                import torch

                if device == "cpu" or torch.cuda.is_available():
                    self.torch = torch
            except Exception:  # noqa: BLE001
                pass
        if self.cupy is None and self.torch is None:
            raise RuntimeError("a CPU environment needs torch")
        self.fw = "torch" if self.torch is not None else "cupy"

    def dtype(self, name, fw=None):
        if (fw or self.fw) == "torch":
            t = self.torch
            return {"bfloat16": t.bfloat16, "float16": t.float16, "float32": t.float32,
                    "int32": t.int32, "int64": t.int64}[name]
        if name == "bfloat16":
            import ml_dtypes

            return self.cupy.dtype(ml_dtypes.bfloat16)
        return self.cupy.dtype(name)

    def randn(self, shape, dtype, fw=None):
        fw = fw or self.fw
        if fw == "torch":
            return self.torch.randn(tuple(shape), device=self.device,
                                    dtype=self.dtype(dtype, fw))
        x = self.cupy.random.standard_normal(tuple(shape), dtype=self.cupy.float32)
        return x.astype(self.dtype(dtype, fw))

    def empty(self, shape, dtype, fw=None):
        fw = fw or self.fw
        if fw == "torch":
            return self.torch.empty(tuple(shape), device=self.device, dtype=self.dtype(dtype, fw))
        return self.cupy.empty(tuple(shape), dtype=self.dtype(dtype, fw))

    def asarray(self, a: np.ndarray, fw=None):
        fw = fw or self.fw
        a = np.ascontiguousarray(a)
        if fw == "torch":
            return self.torch.from_numpy(a).to(self.device)
        return self.cupy.asarray(a)

    def clone(self, a):
        if _module_of(a) == "torch":
            return a.clone()  # keeps the strides of a dense permuted tensor
        return a.copy(order="K")

    def swap12(self, a):
        return a.transpose(1, 2) if _module_of(a) == "torch" else a.swapaxes(1, 2)

    def sync(self):
        if self.cupy is not None:
            _sync()

    def free(self):
        if self.cupy is None:
            return
        if self.torch is not None:
            self.torch.cuda.empty_cache()
        self.cupy.get_default_memory_pool().free_all_blocks()

    def stream_context(self):
        """Make CuPy's current stream torch's current one (events, spin and
        copies must share the stream on which torch and the peers launch)."""
        import contextlib

        if self.torch is None or self.cupy is None:
            return contextlib.nullcontext()
        tptr = self.torch.cuda.current_stream().cuda_stream
        if tptr == self.cupy.cuda.get_current_stream().ptr:
            return contextlib.nullcontext()
        from .interop import external_stream

        return external_stream(tptr, self.torch.cuda.current_device())


def _module_of(a) -> str:
    return type(a).__module__.partition(".")[0]


@dataclasses.dataclass
class Context:
    """Shared, read-only data of one workload (device arrays in the env's framework)."""

    w: Workload
    cos_half: Any                # [P, r/2] float32
    sin_half: Any
    seq_len: Any = None          # bshd/sbhd
    positions: Any = None        # int64 [T]: per token (thd) or decode positions
    cu_seqlens: Any = None       # int32 [n + 1] (thd)
    cache: Any = None            # decode: float32 [P, r] = cos | sin


def make_context(w: Workload, env: _Env, fw=None) -> Context:
    r = w.rotary_dim
    if w.kind == "decode":
        cos, sin = rope_tables(w.max_position, r)
        cache = env.asarray(np.concatenate([cos, sin], axis=1), fw)
        pos = env.asarray(decode_positions(w.shape[0], w.max_position), fw)
        return Context(w, cache[:, : r // 2], cache[:, r // 2:], positions=pos, cache=cache)
    if w.kind == "thd":
        cu = thd_cu_seqlens(w.shape[0], w.n_seqs)
        cos, sin = rope_tables(int(np.diff(cu).max()), r)
        return Context(w, env.asarray(cos, fw), env.asarray(sin, fw),
                       positions=env.asarray(token_positions(cu), fw),
                       cu_seqlens=env.asarray(cu, fw))
    cos, sin = rope_tables(w.seq_len, r)
    return Context(w, env.asarray(cos, fw), env.asarray(sin, fw), seq_len=w.seq_len)


def _input_names(w):
    return ("q", "k") if w.kind in ("qk", "decode") else ("x",)


def make_set(w: Workload, env: _Env) -> dict:
    if w.kind in ("qk", "decode"):
        s = {"q": env.randn(w.shape, w.dtype), "k": env.randn(w.k_shape, w.dtype)}
        if w.mode == "new":
            s["out_q"] = env.empty(w.shape, w.dtype)
            s["out_k"] = env.empty(w.k_shape, w.dtype)
        return s
    s = {"x": _new_x(w, env, env.randn)}
    if w.mode == "new":
        s["out"] = _new_x(w, env, env.empty)
    return s


def _new_x(w: Workload, env: _Env, make):
    """x (or an output like it) of a single-tensor workload: for ``strided``
    a [b, h, s, d] array seen as [b, s, h, d]. (Torch and torch.compile give
    a new output the input's memory order, so cupy-rope writes into one of
    that order too.)"""
    if w.strided:
        b, sl, h, d = w.shape
        return env.swap12(make((b, h, sl, d), w.dtype))
    return make(w.shape, w.dtype)


def clone_set(s: dict, w: Workload, env: _Env) -> dict:
    out = {n: env.clone(s[n]) for n in _input_names(w)}
    if "out" in s:
        out["out"] = _new_x(w, env, env.empty)
    for n in ("out_q", "out_k"):
        if n in s:
            out[n] = env.empty(s[n].shape, w.dtype)
    return out


# ----------------------------------------------------------------------------
# cupy-rope's calls.

_DECODE_FORM = {}
#: Ways to call apply_rope_qk for a decode step, most direct first: the
#: vLLM cos|sin cache with thd, cos/sin views of it with thd, [1, T, h, d] views.
DECODE_FORMS = ("thd-cache", "thd", "bshd-view")


def _decode_kwargs(form, ctx, backward=False, positions=None):
    kw = {"positions": ctx.positions if positions is None else positions, "inplace": True,
          "backward": backward, "layout": "bshd" if form == "bshd-view" else "thd"}
    if form == "thd-cache":
        kw["cos_sin_cache"] = ctx.cache
    else:
        kw["cos"], kw["sin"] = ctx.cos_half, ctx.sin_half
    return kw


def _decode_views(form, q, k):
    if form == "bshd-view":
        return q.reshape((1,) + tuple(q.shape)), k.reshape((1,) + tuple(k.shape))
    return q, k


def _decode_form(ctx: Context, env: _Env, fw=None) -> str:
    """The first of DECODE_FORMS that the installed cupy-rope accepts."""
    import cupy_rope as cr

    fw = fw or env.fw
    if fw in _DECODE_FORM:
        return _DECODE_FORM[fw]
    if not hasattr(cr, "apply_rope_qk"):
        raise RuntimeError("cupy_rope has no apply_rope_qk yet")
    w = ctx.w
    errors = []
    n = min(2, int(ctx.positions.shape[0]))
    for form in DECODE_FORMS:
        q = env.randn((n,) + tuple(w.shape[1:]), w.dtype, fw)
        k = env.randn((n,) + tuple(w.k_shape[1:]), w.dtype, fw)
        try:
            cr.apply_rope_qk(*_decode_views(form, q, k),
                             **_decode_kwargs(form, ctx, positions=ctx.positions[:n]))
            env.sync()
            _DECODE_FORM[fw] = form
            return form
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{form}: {exc.__class__.__name__}: {exc}")
    raise RuntimeError("apply_rope_qk refused every decode form (" + "; ".join(errors) + ")")


def prepare_ours(w: Workload, ctx: Context, env: _Env, positions: bool = False):
    """cupy-rope bound to a workload (a peers.Prepared), or an error string;
    ``positions`` (thd): at the per-token positions the peers get instead of
    cu_seqlens."""
    import cupy_rope as cr

    from benchmarks.peers import Prepared

    r = w.rotary_dim
    cos, sin = ctx.cos_half, ctx.sin_half
    if w.kind in ("single", "thd"):
        kw = {"layout": w.layout, "rotary_dim": r, "interleaved": w.interleaved}
        if w.kind == "thd":
            if positions:
                kw["positions"] = ctx.positions
            else:
                kw["cu_seqlens"] = ctx.cu_seqlens
        if w.mode == "inplace":
            call = {b: (lambda x, _b=b: cr.apply_rope(x, cos, sin, inplace=True, backward=_b,
                                                      **kw)) for b in (False, True)}
            return Prepared(lambda s: (s["x"],), call, lambda a, ret: [a[0]], "in place")
        call = {b: (lambda x, out, _b=b: cr.apply_rope(x, cos, sin, out=out, backward=_b, **kw))
                for b in (False, True)}
        return Prepared(lambda s: (s["x"], s["out"]), call, lambda a, ret: [a[1]], "out=")
    if not hasattr(cr, "apply_rope_qk"):
        return "error: cupy_rope has no apply_rope_qk yet"
    if w.kind == "qk":
        call = {b: (lambda q, k, oq, ok, _b=b: cr.apply_rope_qk(
            q, k, cos, sin, layout=w.layout, rotary_dim=r, out_q=oq, out_k=ok, backward=_b))
            for b in (False, True)}
        return Prepared(lambda s: (s["q"], s["k"], s["out_q"], s["out_k"]), call,
                        lambda a, ret: [a[2], a[3]], "out_q=, out_k=")
    try:
        form = _decode_form(ctx, env)
    except Exception as exc:  # noqa: BLE001
        return f"error: {exc}"
    kws = {b: _decode_kwargs(form, ctx, b) for b in (False, True)}
    call = {b: (lambda q, k, _kw=kws[b]: cr.apply_rope_qk(q, k, **_kw)) for b in (False, True)}
    return Prepared(lambda s: _decode_views(form, s["q"], s["k"]), call,
                    lambda a, ret: [a[0].reshape(w.shape), a[1].reshape(w.k_shape)],
                    f"in place, form {form}")


# ----------------------------------------------------------------------------
# Correctness: a float32 reference in torch.


def reference(w: Workload, ctx: Context, tensors, backward: bool, torch):
    """float32 results of RoPE on ``tensors`` (logical layout), by torch."""
    h = w.rotary_dim // 2
    c, s = ctx.cos_half.float(), ctx.sin_half.float()
    if w.layout == "thd":
        c, s = c[ctx.positions].unsqueeze(-2), s[ctx.positions].unsqueeze(-2)
    elif w.layout == "bshd":
        c, s = c[: ctx.seq_len].view(1, ctx.seq_len, 1, h), s[: ctx.seq_len].view(
            1, ctx.seq_len, 1, h)
    else:
        c, s = c[: ctx.seq_len].view(ctx.seq_len, 1, 1, h), s[: ctx.seq_len].view(
            ctx.seq_len, 1, 1, h)
    if backward:
        s = -s
    out = []
    for t in tensors:
        y = t.float().clone()
        # NeoX pairs (f, f + h); GPT-J pairs (2f, 2f + 1).
        ia, ib = (slice(0, 2 * h, 2), slice(1, 2 * h, 2)) if w.interleaved else (
            slice(0, h), slice(h, 2 * h))
        a, b = y[..., ia].clone(), y[..., ib].clone()
        y[..., ia] = a * c - b * s
        y[..., ib] = b * c + a * s
        out.append(y)
    return out


def _rel_err(got, ref) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------
# The run.


def _row(w, direction, impl, status, note="", **kw):
    r = {"workload": w.name, "direction": direction, "impl": impl, "status": status,
         "mode": w.mode, "moved_bytes": w.moved_bytes(), "note": note, "time_us": None,
         "bandwidth_GBps": None, "fraction_of_copy": None, "check_error": None,
         "held": None}
    r.update(kw)
    return r


def check_outputs(w, ctx, prepared, base_set, env) -> dict:
    """{(impl, backward): max error / max |reference|, or the exception text}
    for every prepared implementation, each run once on a fresh copy of
    ``base_set``'s inputs."""
    checks = {}
    names = _input_names(w)
    pristine = clone_set(base_set, w, env)
    for b in (False, True):
        refs = reference(w, ctx, [pristine[n] for n in names], b, env.torch)
        for name, prep in prepared:
            if isinstance(prep, str):
                continue
            st = args = got = None
            try:
                st = clone_set(pristine, w, env)
                args = prep.make_args(st)
                got = prep.result(args, prep.call[b](*args))
                checks[name, b] = max(_rel_err(g, r) for g, r in zip(got, refs))
            except Exception as exc:  # noqa: BLE001
                checks[name, b] = f"{exc.__class__.__name__}: {exc}"
            del st, args, got
        del refs
    del pristine
    env.sync()
    env.free()
    return checks


def _run_workload(w, env, peer_objs, reps, n_sets, warmup, check):
    rows = []
    ctx = make_context(w, env)
    sets = [make_set(w, env) for _ in range(n_sets)]
    env.sync()
    t_copy = copy_ms(w.copy_bytes(), n_sets, reps)
    copy_info = {"copy_time_us": t_copy * 1e3,
                 "copy_bandwidth_GBps": w.moved_bytes() / (t_copy * 1e-3) / 1e9}

    impls = ([(OURS, None)] + ([(OURS_POSITIONS, None)] if w.kind == "thd" else [])
             + [(p.name, p) for p in peer_objs])
    prepared = []
    for name, peer in impls:
        try:
            prep = (prepare_ours(w, ctx, env, positions=name == OURS_POSITIONS)
                    if peer is None else peer.prepare(w, ctx))
        except Exception as exc:  # noqa: BLE001
            prep = f"error: {exc.__class__.__name__}: {exc}"
        prepared.append((name, prep))

    checks = {}
    if check and env.torch is not None:
        checks = check_outputs(w, ctx, prepared, sets[0], env)
    tol = CHECK_TOLERANCE[w.dtype]

    for name, prep in prepared:
        if isinstance(prep, str):
            status = "n/a" if prep.startswith("n/a") else "error"
            reason = prep.split(": ", 1)[1] if ": " in prep else prep
            rows += [_row(w, d, name, status, reason, **copy_info) for d in ("fwd", "bwd")]
            continue
        arg_sets = [prep.make_args(s) for s in sets]
        for b, direction in ((False, "fwd"), (True, "bwd")):
            err = checks.get((name, b))
            if isinstance(err, str):
                rows.append(_row(w, direction, name, "error", f"check call failed: {err}",
                                 **copy_info))
                continue
            try:
                t, held = time_call(prep.call[b], arg_sets, reps, warmup)
            except Exception as exc:  # noqa: BLE001
                rows.append(_row(w, direction, name, "error", f"{exc.__class__.__name__}: {exc}",
                                 **copy_info))
                continue
            note = prep.note
            status = "ok"
            if err is not None and err > tol:
                status = "mismatch"
                note = f"{note}; output differs from the reference by {err:.2g}"
            if not held:
                note += "; host-bound: the spin ended before all calls were queued"
            rows.append(_row(w, direction, name, status, note, time_us=t * 1e3,
                             bandwidth_GBps=w.moved_bytes() / (t * 1e-3) / 1e9,
                             fraction_of_copy=t_copy / t, check_error=err, held=held,
                             **copy_info))
            _log(f"{w.name} {direction} {name}: {t * 1e3:.1f} us, {t_copy / t:.3f} of copy"
                 + (f", err {err:.1e}" if err is not None else "") + f" [{status}]")
        del arg_sets
    del sets, prepared
    env.sync()
    env.free()

    for direction in ("fwd", "bwd"):
        peers_ok = [r for r in rows if r["impl"] not in OURS_IMPLS
                    and r["direction"] == direction and r["status"] == "ok"]
        if not peers_ok:
            continue
        best = min(peers_ok, key=lambda r: r["time_us"])
        for ours in (r for r in rows if r["impl"] in OURS_IMPLS and r["direction"] == direction):
            ours["best_peer"] = best["impl"]
            ours["best_peer_time_us"] = best["time_us"]
            if ours["status"] == "ok":
                ours["speedup_vs_best_peer"] = best["time_us"] / ours["time_us"]
    return rows


def _versions(env, peer_objs) -> dict:
    import platform

    import cupy

    import cupy_rope

    v = {"python": platform.python_version(), "cupy": cupy.__version__,
         "cupy_rope": getattr(cupy_rope, "__version__", "?")}
    if env.torch is not None:
        v["torch"] = env.torch.__version__
        v["torch_cuda"] = env.torch.version.cuda
    for p in peer_objs:
        v[p.name] = p.version()
    return v


def run(workloads=None, *, peers="all", reps=30, n_sets=3, warmup=5, check=True, host=True,
        checkpoint=None, arrays="torch") -> dict:
    """Run the benchmark and return the result (a JSON-ready dict).

    ``workloads``: Workload objects or names (default: all of ``WORKLOADS``);
    ``peers``: "all", None/"none"/() for none, or names from ``cupy_rope.peers``;
    ``host``: also time the host cost of a cached decode call and CUDA-graph
    replay; ``check``: compare every output with a float32 reference first;
    ``checkpoint(result)`` is called after each workload (partial results);
    ``arrays``: "torch" (torch tensors when torch sees the GPU, else CuPy) or
    "cupy" (CuPy arrays, no peers, no check).
    """
    import cupy

    from benchmarks import peers as peers_mod

    if workloads is None:
        workloads = WORKLOADS
    workloads = [w if isinstance(w, Workload) else select_workloads([w])[0] for w in workloads]
    env = _Env(use_torch=arrays != "cupy")
    candidates = [] if peers in (None, "none", (), []) else peers_mod.make(peers)
    if env.torch is None:
        candidates = []
    peer_objs, peer_status = [], {}
    for p in candidates:
        reason = p.available()
        peer_status[p.name] = "present" if reason is None else f"absent: {reason}"
        if reason is None:
            peer_objs.append(p)
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    result = {"device": props["name"].decode(), "arrays": env.fw,
              "config": {"reps": reps, "sets": n_sets, "warmup": warmup, "check": check},
              "peers": peer_status, "versions": _versions(env, peer_objs),
              "workloads": [w.describe() for w in workloads], "rows": []}
    with env.stream_context():
        for w in workloads:
            _log(f"workload {w.name}: {w.title}")
            try:
                result["rows"] += _run_workload(w, env, peer_objs, reps, n_sets, warmup, check)
            except Exception as exc:  # noqa: BLE001
                _log(f"{w.name} failed: {exc.__class__.__name__}: {exc}")
                result["rows"] += [_row(w, d, OURS, "error", f"{exc.__class__.__name__}: {exc}")
                                   for d in ("fwd", "bwd")]
                env.free()
            if checkpoint:
                checkpoint(result)
        if host:
            result["host"] = host_overhead(env, peer_objs=peer_objs)
    result["acceptance"] = acceptance(result)
    if checkpoint:
        checkpoint(result)
    return result


# ----------------------------------------------------------------------------
# Host cost of a cached call.


def _time_host_rounds(out, entries, calls, rounds=HOST_ROUNDS):
    """Time host-bound callables in interleaved rounds: ``entries`` are
    (name, fn, label). Each entry first runs for at least ``calls / 10``
    calls and ``HOST_WARMUP_S / len(entries)`` seconds (the whole warm-up
    lasts HOST_WARMUP_S); then every round runs one
    pass of ``calls`` calls of each entry in turn, with one synchronization
    per pass. out[name + "_us_per_call"] is the median over the rounds,
    out[name + "_us_per_call_runs"] every round's pass. An entry that raises
    is dropped from the later rounds and leaves out[name + "_error"] (and
    no times); the others are timed on. One entry: plain repeated passes."""
    failed = {}

    def attempt(name, fn, n):
        try:
            for _ in range(n):
                fn()
            _sync()
            return True
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"{exc.__class__.__name__}: {exc}"
            _log(f"host: {name} failed: {failed[name]}")
            return False

    for name, fn, _label in entries:
        t0, n = time.perf_counter(), 0
        while n < max(50, calls // 10) or time.perf_counter() - t0 < HOST_WARMUP_S / len(entries):
            if not attempt(name, fn, 50):
                break
            n += 50
    runs = {name: [] for name, _fn, _label in entries}
    for _ in range(rounds):
        for name, fn, _label in entries:
            if name in failed:
                continue
            _sync()
            t0 = time.perf_counter()
            if attempt(name, fn, calls):
                runs[name].append((time.perf_counter() - t0) / calls * 1e6)
    passes = f"{rounds} interleaved rounds" if len(entries) > 1 else f"{rounds} passes"
    for name, _fn, label in entries:
        if name in failed:
            out[f"{name}_error"] = failed[name]
            continue
        r = runs[name]
        out[f"{name}_us_per_call"] = statistics.median(r)
        out[f"{name}_us_per_call_runs"] = r
        _log(f"host: {label or name} {statistics.median(r):.2f} us per call (median of "
             f"{passes} of {calls}; {min(r):.2f}-{max(r):.2f})")


def _bare_launch(rope):
    """The kernel of ``rope``'s cached qk_ plan, launched with its packed
    parameters straight through CuPy's driver.launchKernel on the same
    stream, with a grid of one block (the GPU runs such launches faster than
    the host issues them, so this times the host): the driver's part of a
    bound call. None when rope has no cached launcher."""
    from cupy.cuda import driver

    from cupy_rope import launch

    go = next(iter(rope._fast.values()), None) if rope._fast else None
    plan = getattr(go, "plan", None)
    if not isinstance(plan, launch.Plan) or plan.empty:
        return None
    args = plan.own_buffer()[1]
    stream = plan.stream(plan.device_id)
    return lambda: driver.launchKernel(plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream, args, 0)


def host_overhead(env=None, calls=HOST_CALLS, graph_calls=GRAPH_CALLS, replays=20,
                  peer_objs=(), rounds=HOST_ROUNDS) -> dict:
    """Microseconds per call of a cached decode step (q32/k8 d128, 64 tokens,
    bf16, ``apply_rope_qk`` in place at positions [64] into an fp32 cos|sin
    cache): ``calls`` calls timed on the host, one synchronization at the end,
    in ``HOST_ROUNDS`` interleaved rounds after a warm-up (each round times
    one pass of every variant: apply_rope_qk, RotaryEmbedding.qk_ and the
    bare launch, with torch tensors and with CuPy arrays, and torch's
    x.add_(1)), the median pass reported (``*_runs`` holds every round's);
    and the per-call GPU time of
    ``graph_calls`` calls captured in a torch CUDA graph and replayed. For
    context, ``peer_objs`` get the same host-timed loop (their own calls on
    the same workload, passes of ``calls / 4``)."""
    import cupy_rope as cr

    env = env or _Env()
    w = select_workloads(["decode-qk-t64"])[0]
    rounds = max(1, int(rounds or HOST_ROUNDS))
    out = {"workload": w.title, "calls": calls, "rounds": rounds,
           "graph_calls": graph_calls}
    entries = []
    for fw in ("torch", "cupy"):
        out[f"{fw}_us_per_call"] = None
        if fw == "torch" and env.torch is None:
            out[f"{fw}_error"] = NO_TORCH
            continue
        try:
            ctx = make_context(w, env, fw)
            form = out["form"] = _decode_form(ctx, env, fw)
            kw = _decode_kwargs(form, ctx)
            q, k = _decode_views(form, env.randn(w.shape, w.dtype, fw),
                                 env.randn(w.k_shape, w.dtype, fw))
            cr.apply_rope_qk(q, k, **kw)
            entries.append((fw, lambda q=q, k=k, kw=kw: cr.apply_rope_qk(q, k, **kw), fw))
            if form == "thd-cache" and hasattr(cr, "RotaryEmbedding"):
                # The bound form: tables and options given once, q, k, positions per call.
                rope = cr.RotaryEmbedding(cos_sin_cache=ctx.cache, layout="thd")
                pos = kw["positions"]
                rope.qk_(q, k, pos)
                rope.qk_(q, k, pos)  # the second call finds the cached launcher
                entries.append((f"{fw}_bound", lambda rope=rope, q=q, k=k, pos=pos:
                                rope.qk_(q, k, pos), "RotaryEmbedding.qk_"))
                try:
                    bare = _bare_launch(rope)
                except Exception as exc:  # noqa: BLE001
                    bare = None
                    out[f"{fw}_launch_error"] = f"{exc.__class__.__name__}: {exc}"
                if bare is not None:
                    entries.append((f"{fw}_launch", bare,
                                    "the same kernel launched bare (one block)"))
        except Exception as exc:  # noqa: BLE001
            out[f"{fw}_error"] = f"{exc.__class__.__name__}: {exc}"
            _log(f"host: {fw} failed: {out[f'{fw}_error']}")
    if env.torch is not None:
        # The host's own speed, for reading the numbers above across machines:
        # torch's cheapest call that launches a kernel.
        small = env.torch.zeros(16, device="cuda")
        entries.append(("torch_add", lambda: small.add_(1), "torch x.add_(1), 16 floats"))
    _time_host_rounds(out, entries, calls, rounds)
    for fw in ("torch", "cupy"):
        # Python's part of a bound call: the round's qk_ pass less the same
        # round's bare launch, median over the rounds.
        b, l = out.get(f"{fw}_bound_us_per_call_runs"), out.get(f"{fw}_launch_us_per_call_runs")
        if b and l:
            out[f"{fw}_python_us_per_call"] = statistics.median(x - y for x, y in zip(b, l))
    out["peers_us_per_call"] = {}
    for p in peer_objs:
        try:
            ctx = make_context(w, env, "torch")
            prep = p.prepare(w, ctx)
            if isinstance(prep, str):
                continue
            args = prep.make_args(make_set(w, env))
            fn = prep.call[False]
            timed: dict = {}
            _time_host_rounds(timed, [(p.name, lambda: fn(*args), None)], max(1, calls // 4),
                              HOST_REPEATS)
            if f"{p.name}_error" in timed:
                continue  # logged by _time_host_rounds
            out["peers_us_per_call"][p.name] = timed[f"{p.name}_us_per_call"]
        except Exception as exc:  # noqa: BLE001
            _log(f"host: peer {p.name} failed: {exc.__class__.__name__}: {exc}")
    out["graph_us_per_call"] = None
    if env.torch is None:
        out["graph_error"] = NO_TORCH
        return out
    torch = env.torch
    try:
        ctx = make_context(w, env, "torch")
        form = _decode_form(ctx, env, "torch")
        kw = _decode_kwargs(form, ctx)
        q, k = _decode_views(form, env.randn(w.shape, w.dtype, "torch"),
                             env.randn(w.k_shape, w.dtype, "torch"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                cr.apply_rope_qk(q, k, **kw)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_calls):
                cr.apply_rope_qk(q, k, **kw)
        graph.replay()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)]
        with env.stream_context():
            _hold_stream(5.0)
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        per_replay_ms = statistics.median(a.elapsed_time(b) for a, b in events)
        out["graph_us_per_call"] = per_replay_ms * 1e3 / graph_calls
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        out["graph_wall_us_per_call"] = (time.perf_counter() - t0) / (replays * graph_calls) * 1e6
        _log(f"host: CUDA graph replay {out['graph_us_per_call']:.2f} us per call")
    except Exception as exc:  # noqa: BLE001
        out["graph_error"] = f"{exc.__class__.__name__}: {exc}"
        _log(f"host: CUDA graph failed: {out['graph_error']}")
    return out


# ----------------------------------------------------------------------------
# Acceptance (issue 6), computed from a result dict alone.


def _item(item, what, status, detail, failures=()):
    return {"item": item, "what": what, "status": status, "detail": detail,
            "failures": list(failures)}


def acceptance(result) -> list:
    rows = result.get("rows", [])
    wdefs = {w["name"]: w for w in result.get("workloads", [])}
    ours = {(r["workload"], r["direction"]): r for r in rows if r["impl"] == OURS}

    def t(name, direction):
        r = ours.get((name, direction))
        return r["time_us"] if r and r["status"] == "ok" else None

    # thd: cupy-rope also on the peers' per-token positions (OURS_POSITIONS)
    ours_pos = {(r["workload"], r["direction"]): r for r in rows if r["impl"] == OURS_POSITIONS}

    items = []
    big = [n for n, w in wdefs.items() if w["moved_bytes"] >= ROOFLINE_MIN_BYTES]
    what = "fwd and bwd >= 0.95 of copy, every workload moving >= 64 MiB"
    fails, worst, n = [], None, 0
    for name in big:
        for d in ("fwd", "bwd"):
            for r, label in ((ours.get((name, d)), f"{name} {d}"),
                             (ours_pos.get((name, d)), f"{name} {d} positions")):
                if r is None:
                    continue
                n += 1
                if r["status"] != "ok":
                    fails.append(f"{label}: {r['status']} ({r['note']})")
                    continue
                f = r["fraction_of_copy"]
                if worst is None or f < worst[0]:
                    worst = (f, label)
                if f < 0.95:
                    fails.append(f"{label}: {f:.3f}")
    if n == 0:
        items.append(_item("1a", what, "SKIP", "no such workload measured"))
    else:
        detail = f"{n} rows" + (f", lowest {worst[0]:.3f} ({worst[1]})" if worst else "")
        items.append(_item("1a", what, "FAIL" if fails else "PASS", detail, fails))

    what = ("faster than the best peer present, every workload moving >= 64 MiB (thd: on "
            "the per-token positions the peers are handed)")
    fails, no_peer, n, low, low_cu = [], [], 0, None, None
    for name in big:
        for d in ("fwd", "bwd"):
            r = ours_pos.get((name, d)) or ours.get((name, d))
            if r is None:
                continue
            label = f"{name} {d}" + (" positions" if r["impl"] == OURS_POSITIONS else "")
            if "best_peer" not in r:
                no_peer.append(label)
                continue
            n += 1
            sp = r.get("speedup_vs_best_peer")
            if sp is None:
                fails.append(f"{label}: {r['status']}")
                continue
            if low is None or sp < low[0]:
                low = (sp, f"{label} vs {r['best_peer']}")
            if sp <= 1.0:
                fails.append(f"{label}: {sp:.3f}x vs {r['best_peer']}")
            cu = ours.get((name, d)) if r["impl"] == OURS_POSITIONS else None
            sp_cu = cu.get("speedup_vs_best_peer") if cu else None
            if sp_cu is not None and (low_cu is None or sp_cu < low_cu[0]):
                low_cu = (sp_cu, f"{name} {d}")
    if n == 0:
        items.append(_item("1b", what, "SKIP", "no peer measured on these workloads"))
    else:
        detail = f"{n} rows" + (f", lowest speedup {low[0]:.3f}x ({low[1]})" if low else "")
        if low_cu:
            detail += (f"; thd with cu_seqlens, which no peer takes (their positions are "
                       f"gathered outside their timed call): lowest {low_cu[0]:.3f}x "
                       f"({low_cu[1]})")
        if no_peer:
            detail += f"; no peer on {len(no_peer)} rows"
        items.append(_item("1b", what, "FAIL" if fails else "PASS", detail, fails))

    def groups(pred, key):
        out = {}
        for n, w in wdefs.items():
            if pred(w):
                out.setdefault(key(w), []).append(n)
        return out

    what = "thd time within 5% from n_seqs 1 to 2401"
    fails, details = [], []
    thd = groups(lambda w: w["kind"] == "thd",
                 lambda w: (tuple(w["shape"]), w["dtype"], w["mode"], w["rotary_frac"]))
    for names in thd.values():
        if len(names) < 2:
            continue
        names = sorted(names, key=lambda n: wdefs[n]["n_seqs"])
        for d in ("fwd", "bwd"):
            ts = [(t(n, d), n) for n in names]
            if any(x is None for x, _ in ts):
                fails.append(f"{d}: missing or failed rows")
                continue
            spread = max(x for x, _ in ts) / min(x for x, _ in ts)
            details.append(f"{d} max/min {spread:.3f}")
            if spread > 1.05:
                fails.append(f"{d}: " + ", ".join(f"{n} {x:.1f} us" for x, n in ts))
    items.append(_item("2", what, "SKIP" if not (details or fails) else
                       ("FAIL" if fails else "PASS"),
                       "; ".join(details) or "needs two or more thd workloads", fails))

    def against_twin(item, what, is_row, twin_keys, twin_is, limit, label, empty):
        """Each row's time over its twin's (the same workload but for
        ``twin_is``) must stay within ``limit(w)``."""
        fails, details = [], []
        for n, w in wdefs.items():
            if not is_row(w):
                continue
            twins = [m for m, v in wdefs.items()
                     if twin_is(v) and all(v.get(k) == w.get(k) for k in twin_keys)]
            if not twins:
                continue
            for d in ("fwd", "bwd"):
                tr, tt = t(n, d), t(twins[0], d)
                if tr is None or tt is None:
                    fails.append(f"{n} {d}: missing or failed rows")
                    continue
                details.append(label(n, d, tr / tt, limit(w)))
                if tr > limit(w) * tt:
                    fails.append(f"{n} {d}: {tr:.1f} us vs {tt:.1f} us, ratio {tr / tt:.3f}")
        items.append(_item(item, what, "SKIP" if not (details or fails) else
                           ("FAIL" if fails else "PASS"), "; ".join(details) or empty, fails))

    against_twin(
        "3", "partial rotary in place <= (fraction + 0.1) x full rotary time",
        lambda w: w["mode"] == "inplace" and w["rotary_frac"] < 1.0,
        ("mode", "shape", "dtype", "layout", "kind", "interleaved"),
        lambda v: v["rotary_frac"] == 1.0,
        lambda w: w["rotary_frac"] + 0.1,
        lambda n, d, r, lim: f"{n} {d} {r:.3f} (<= {lim:.2f})",
        "needs partial and full in-place rows")
    against_twin(
        "4", "strided input within 5% of its contiguous twin", lambda w: w["strided"],
        ("shape", "dtype", "layout", "mode", "kind", "rotary_frac", "interleaved"),
        lambda v: not v["strided"],
        lambda w: 1.05, lambda n, d, r, lim: f"{d} {r:.3f}", "needs a strided row and its twin")

    host = result.get("host")
    what = ("decode 64 tokens, end to end per call <= 8 us (torch and CuPy; the bound "
            "RotaryEmbedding.qk_ where measured, apply_rope_qk otherwise)")
    if not host:
        items.append(_item("5", what, "SKIP", "host overhead not measured"))
    else:
        fails, details = [], []
        for fw in ("torch", "cupy"):
            v = host.get(f"{fw}_us_per_call")
            if v is None and host.get(f"{fw}_error") == NO_TORCH:
                details.append(f"{fw} not measured ({NO_TORCH})")
                continue
            if v is None:
                fails.append(f"{fw}: {host.get(f'{fw}_error', 'not measured')}")
                continue
            bound = host.get(f"{fw}_bound_us_per_call")
            if bound is not None:
                py = host.get(f"{fw}_python_us_per_call")
                split = (f", of which Python {py:.2f} us" if py is not None else "")
                details.append(f"{fw} {bound:.2f} us bound{split} ({v:.2f} us apply_rope_qk)")
                v = bound
            else:
                details.append(f"{fw} {v:.2f} us")
            if v > 8.0:
                fails.append(f"{fw}: {v:.2f} us")
        items.append(_item("5", what, "FAIL" if fails else "PASS", "; ".join(details), fails))
    what = "CUDA-graph replay per call <= 3 us"
    if not host:
        items.append(_item("6", what, "SKIP", "host overhead not measured"))
    else:
        v = host.get("graph_us_per_call")
        if v is None and host.get("graph_error") == NO_TORCH:
            items.append(_item("6", what, "SKIP", NO_TORCH))
        elif v is None:
            items.append(_item("6", what, "FAIL", host.get("graph_error", "not measured")))
        else:
            items.append(_item("6", what, "PASS" if v <= 3.0 else "FAIL", f"{v:.2f} us"))
    return items


# ----------------------------------------------------------------------------
# Output.


def _fmt(v, spec, width):
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"


def format_acceptance(items) -> str:
    lines = []
    for it in items:
        lines.append(f"{it['status']:4s} [{it['item']}] {it['what']}: {it['detail']}")
        for f in it["failures"]:
            lines.append(f"       - {f}")
    return "\n".join(lines)


def _passes(host) -> str:
    if host.get("rounds"):
        return f"{host['rounds']} interleaved rounds of passes"
    return f"{host.get('repeats', 1)} passes"


def format_host(host) -> str:
    if not host:
        return ""
    parts = []
    for fw in ("torch", "cupy"):
        v = host.get(f"{fw}_us_per_call")
        bound = host.get(f"{fw}_bound_us_per_call")
        py, bare = host.get(f"{fw}_python_us_per_call"), host.get(f"{fw}_launch_us_per_call")
        if py is None:
            split = ""
        elif host.get("rounds"):
            # (medians of different things: they need not add up to qk_'s)
            split = (f"; the kernel launched bare {bare:.2f} us; Python {py:.2f} us, "
                     f"the median over rounds of qk_ less the bare launch")
        else:
            split = f": driver launch {bare:.2f} us + Python {py:.2f} us"
        parts.append((f"{fw} {v:.2f} us" + (f" (RotaryEmbedding.qk_ {bound:.2f} us{split})"
                                             if bound is not None else ""))
                     if v is not None else f"{fw} failed ({host.get(f'{fw}_error', '?')})")
    g = host.get("graph_us_per_call")
    gs = (f"{g:.2f} us per call (wall {host.get('graph_wall_us_per_call', 0):.2f})"
          if g is not None else f"failed ({host.get('graph_error', '?')})")
    text = (f"host cost, {host['workload']} (call form: {host.get('form', '?')}):\n"
            f"  end to end per call, median of {_passes(host)} of "
            f"{host['calls']} calls: " + ", ".join(parts) + "\n"
            f"  CUDA graph of {host['graph_calls']} calls, replayed: {gs}")
    if host.get("torch_add_us_per_call") is not None:
        text += (f"\n  this host's speed: torch x.add_(1) on 16 floats "
                 f"{host['torch_add_us_per_call']:.2f} us per call")
    if host.get("peers_us_per_call"):
        text += "\n  peers, end to end per call (torch): " + ", ".join(
            f"{k} {v:.2f} us" for k, v in host["peers_us_per_call"].items())
    return text


def format_table(result) -> str:
    cfg = result.get("config", {})
    lines = [f"device: {result.get('device', '?')}; arrays: {result.get('arrays', '?')}; "
             f"median of {cfg.get('reps', '?')} calls over {cfg.get('sets', '?')} input sets",
             "peers: " + ", ".join(f"{k} {v}" for k, v in result.get("peers", {}).items()),
             f"{'workload':26s} {'dir':3s} {'impl':13s} {'time us':>9s} {'GB/s':>6s} "
             f"{'of copy':>7s} {'speedup':>7s}  note"]
    defs = {w["name"]: w for w in result.get("workloads", [])}
    seen = set()
    for r in result.get("rows", []):
        w = r["workload"]
        if w not in seen:
            seen.add(w)
            mb = defs.get(w, {}).get("moved_bytes", r.get("moved_bytes", 0)) / 1e6
            ct = r.get("copy_time_us")
            lines.append(f"{w:26s} {'':3s} {'d2d copy':13s} {_fmt(ct, '.1f', 9)} "
                         f"{_fmt(r.get('copy_bandwidth_GBps'), '.0f', 6)} {'':7s} {'':7s}  "
                         f"{mb:.1f} MB moved")
        if r["status"] in ("ok", "mismatch"):
            sp = r.get("speedup_vs_best_peer")
            sps = f"{sp:6.3f}x" if sp is not None else f"{'':7s}"
            note = r["note"]
            if r["impl"] in OURS_IMPLS and "best_peer" in r:
                note = f"best peer {r['best_peer']}; {note}"
            lines.append(f"{w:26s} {r['direction']:3s} {r['impl']:13s} "
                         f"{_fmt(r['time_us'], '.1f', 9)} {_fmt(r['bandwidth_GBps'], '.0f', 6)} "
                         f"{_fmt(r['fraction_of_copy'], '.3f', 7)} {sps}  {note}")
        else:
            note = r["note"] if len(r["note"]) <= 100 else r["note"][:97] + "..."
            lines.append(f"{w:26s} {r['direction']:3s} {r['impl']:13s} {r['status']:>9s} "
                         f"{'':6s} {'':7s} {'':7s}  {note}")
    return "\n".join(lines)


def plot(result, path) -> str:
    """Fraction of copy per workload and implementation, as a PNG at ``path``.
    Returns a message (written, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return f"plot skipped: matplotlib is not installed ({path} not written)"
    rows = [r for r in result.get("rows", []) if r.get("fraction_of_copy") is not None]
    if not rows:
        return "plot skipped: no timed rows"
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
    keys = list(dict.fromkeys((r["workload"], r["direction"]) for r in rows))
    val = {(r["workload"], r["direction"], r["impl"]): r["fraction_of_copy"] for r in rows}
    bar = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(9, 0.09 * len(keys) * max(2, len(impls)) + 1.2))
    for j, impl in enumerate(impls):
        ys = [i + j * bar for i, k in enumerate(keys) if (k[0], k[1], impl) in val]
        xs = [val[k[0], k[1], impl] for k in keys if (k[0], k[1], impl) in val]
        ax.barh(ys, xs, height=bar, label=impl)
    ax.set_yticks([i + 0.4 - bar / 2 for i in range(len(keys))])
    ax.set_yticklabels([f"{a} {b}" for a, b in keys], fontsize=6)
    ax.axvline(0.95, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, max(1.05, max(val.values()) + 0.02))
    ax.set_ylim(len(keys), -bar)
    ax.grid(axis="x", linewidth=0.3)
    ax.set_xlabel("fraction of a device copy of the same bytes (higher is faster)")
    ax.set_title(f"RoPE on {result.get('device', '?')}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.6 / max(0.5, fig.get_figheight() - 1.0)),
              ncol=len(impls), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"plot written to {path}"


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def write_json(result, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_json_default)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", help="comma-separated workload names (see --list)")
    ap.add_argument("--filter", action="append",
                    help="regular expression on workload names (repeatable: any matches)")
    ap.add_argument("--peers", default="all",
                    help="comma-separated peers, 'all' (default) or 'none'")
    ap.add_argument("--json", help="write the results here (updated after each workload)")
    ap.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated between calls")
    ap.add_argument("--no-host", action="store_true", help="skip the host-cost microbenchmark")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--strict", action="store_true", help="exit 1 when an item FAILs")
    ap.add_argument("--arrays", choices=("torch", "cupy"), default="torch",
                    help="input arrays: torch tensors (default, when torch sees the GPU) "
                         "or CuPy arrays (then no peers)")
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    args = ap.parse_args(argv)
    workloads = select_workloads(args.workloads, args.filter)
    if args.list:
        for w in workloads:
            print(f"{w.name:26s} {w.moved_bytes() / 1e6:9.1f} MB  {w.title}")
        return 0
    if not workloads:
        print("no workload selected", file=sys.stderr)
        return 2
    checkpoint = (lambda res: write_json(res, args.json)) if args.json else None
    result = run(workloads, peers=args.peers, reps=args.reps, n_sets=args.sets,
                 check=not args.no_check, host=not args.no_host, checkpoint=checkpoint,
                 arrays=args.arrays)
    if args.plot:
        _log(plot(result, args.plot))
    print(format_host(result.get("host")))
    print(format_acceptance(result["acceptance"]))
    print(format_table(result))
    if args.strict and any(it["status"] == "FAIL" for it in result["acceptance"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
