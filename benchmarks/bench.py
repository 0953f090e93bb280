"""The cupy-rope benchmark: every workload, forward and backward, in one command.

Run it from the repository root on a machine with a CUDA GPU::

    python -m benchmarks.bench --json bench.json --plot bench.png   # everything
    python -m benchmarks.bench --list                               # the workloads
    python -m benchmarks.bench --filter '^thd' --peers none --no-host   # a quick subset

It prints the decode host cost, the criteria (PASS/FAIL/SKIP, see
``CRITERIA``) and one table; ``--json`` keeps everything as data. Without a
CUDA device it says so in one line and exits with status 2 (``--list`` and
``--help`` still work).

What it measures
----------------
Each workload (``--list``) runs forward and backward for cupy-rope and, side
by side on the same inputs, for each peer that imports here
(``benchmarks/peers.py``: the PyTorch formula eager and under
``torch.compile``, Liger's Triton kernel, FlashInfer).

* A time is the median over ``--reps`` calls, each between its own pair of
  CUDA events, after a warm-up, rotating among ``--sets`` input sets so that
  the L2 cache does not flatter. The timed calls are queued behind a kernel
  that spins on the GPU until the host has enqueued them all (checked after
  the fact), so the events time GPU work, not Python. This method, the copy
  baseline below and the CUDA-graph replay are shared with the other
  benchmarks (``benchmarks/harness.py``).
* "of copy": every workload is timed against a device-to-device copy of the
  same bytes, measured the same way in the same run: the copy's time over
  the workload's (1.0 is the copy roofline). The bytes are the reads and
  writes of x (or q and k) and of the outputs that any implementation must
  do: read once, write once, only the rotated channels for partial rotary in
  place; angle tables and positions are not counted.
* "speedup": the best peer's time over cupy-rope's.
* Every output is first checked against a float32 reference (max error over
  max |reference|); a peer that disagrees is marked and not counted.
* thd workloads: the peers take per-token positions, gathered from
  cu_seqlens outside their timed call; cupy-rope is timed with cu_seqlens
  ("cupy-rope") and on the same positions the peers get ("cupy-rope pos").
* Decode host cost: a cached decode call (64 tokens) timed on the host, many
  calls per synchronization, with torch tensors and with CuPy arrays, through
  ``apply_rope_qk``, ``RotaryEmbedding.qk_`` and the bare kernel launch, in
  interleaved rounds; and per call of 100 calls captured in a CUDA graph and
  replayed.

Comparing two versions of the code
----------------------------------
Run each tree's benchmark on the same GPU in one session and compare the two
JSON files (``benchmarks/compare.py``). The tree before the package split
keeps its harness inside the package; run it from that tree's root, since
``python -m`` puts the current folder first on the path and this tree's
``cupy_rope`` would be imported instead::

    (cd /path/to/old/tree && python -m cupy_rope.bench --json /tmp/old.json)
    python -m benchmarks.bench --json /tmp/new.json
    python -m benchmarks.compare /tmp/old.json /tmp/new.json

``SKIP_TESTS=1 SKIP_SANITIZE=1 BASELINE=/path/to/old/tree bash tools/gpu_suite.sh``
does all three in one call. Give both runs the same flags (the old harness
takes the same ones); ``--peers none`` leaves out the peers, which
``compare`` does not read, and shortens each run the most.

Importable as :func:`run`, which returns the same dict that ``--json`` writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from benchmarks import harness
from benchmarks import peers as peers_mod
# Imported by name: the CPU tests replace bench's own time_call, copy_ms and _sync.
from benchmarks.harness import Timed, copy_ms, time_call  # noqa: F401 (Timed: for callers)
from benchmarks.harness import sync as _sync
from benchmarks.peers import Prepared, Unusable

OURS = "cupy-rope"
#: thd workloads also time cupy-rope on the per-token positions the peers are
#: handed, so that the comparison with the peers is on the same inputs.
OURS_POSITIONS = "cupy-rope pos"
OURS_IMPLS = (OURS, OURS_POSITIONS)
DIRECTIONS = ("fwd", "bwd")
MiB = 1 << 20
#: Workloads moving at least this many bytes are held to the copy roofline.
ROOFLINE_MIN_BYTES = 64 * MiB
#: Correctness tolerance: max |out - ref| / max |ref| per storage dtype.
CHECK_TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
#: Calls per pass of the host-cost timings.
HOST_CALLS = 2000
#: Timed passes of a peer's host timing (HOST_CALLS / 4 calls each).
HOST_REPEATS = 5
#: Rounds of the decode step's host timings. Each round times one pass of
#: every variant in turn, so that a slow phase of a shared host falls on all
#: variants alike instead of on whichever was being timed then.
HOST_ROUNDS = 9
#: Seconds each host timing first runs untimed: right after the GPU
#: workloads the host takes a while to reach its steady state.
HOST_WARMUP_S = 0.5
GRAPH_CALLS = 100
NO_TORCH = "torch not available"


_log = harness.logger("bench")
_exc_text = harness.exc_text


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
    return harness.matching(pool, [filters] if isinstance(filters, str) else filters)


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
        return harness.torch_stream(self.torch)


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
            errors.append(f"{form}: {_exc_text(exc)}")
    raise RuntimeError("apply_rope_qk refused every decode form (" + "; ".join(errors) + ")")


def prepare_ours(w: Workload, ctx: Context, env: _Env, positions: bool = False):
    """cupy-rope bound to a workload: a :class:`Prepared`, or an :class:`Unusable`.

    ``positions`` (thd): call at the per-token positions the peers get
    instead of with cu_seqlens.
    """
    import cupy_rope as cr

    if w.kind in ("single", "thd"):
        return _prepare_single(cr, w, ctx, positions)
    if w.kind == "qk":
        return _prepare_qk(cr, w, ctx)
    return _prepare_decode(cr, w, ctx, env)


def _prepare_single(cr, w, ctx, positions):
    cos, sin = ctx.cos_half, ctx.sin_half
    kw = {"layout": w.layout, "rotary_dim": w.rotary_dim, "interleaved": w.interleaved}
    if w.kind == "thd":
        if positions:
            kw["positions"] = ctx.positions
        else:
            kw["cu_seqlens"] = ctx.cu_seqlens
    if w.mode == "inplace":
        call = {b: (lambda x, _b=b: cr.apply_rope(x, cos, sin, inplace=True, backward=_b, **kw))
                for b in (False, True)}
        return Prepared(lambda s: (s["x"],), call, lambda a, ret: [a[0]], "in place")
    call = {b: (lambda x, out, _b=b: cr.apply_rope(x, cos, sin, out=out, backward=_b, **kw))
            for b in (False, True)}
    return Prepared(lambda s: (s["x"], s["out"]), call, lambda a, ret: [a[1]], "out=")


def _prepare_qk(cr, w, ctx):
    cos, sin, r = ctx.cos_half, ctx.sin_half, w.rotary_dim
    call = {b: (lambda q, k, oq, ok, _b=b: cr.apply_rope_qk(
        q, k, cos, sin, layout=w.layout, rotary_dim=r, out_q=oq, out_k=ok, backward=_b))
        for b in (False, True)}
    return Prepared(lambda s: (s["q"], s["k"], s["out_q"], s["out_k"]), call,
                    lambda a, ret: [a[2], a[3]], "out_q=, out_k=")


def _prepare_decode(cr, w, ctx, env):
    try:
        form = _decode_form(ctx, env)
    except Exception as exc:  # noqa: BLE001
        return Unusable("error", str(exc))
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
            if isinstance(prep, Unusable):
                continue
            st = args = got = None
            try:
                st = clone_set(pristine, w, env)
                args = prep.make_args(st)
                got = prep.result(args, prep.call[b](*args))
                checks[name, b] = max(_rel_err(g, r) for g, r in zip(got, refs))
            except Exception as exc:  # noqa: BLE001
                checks[name, b] = _exc_text(exc)
            del st, args, got
        del refs
    del pristine
    env.sync()
    env.free()
    return checks


def _prepare_all(w, ctx, env, peer_objs) -> list:
    """[(impl, Prepared or Unusable)]: cupy-rope (twice on thd), then each peer."""
    impls = ([(OURS, None)] + ([(OURS_POSITIONS, None)] if w.kind == "thd" else [])
             + [(p.name, p) for p in peer_objs])
    prepared = []
    for name, peer in impls:
        try:
            prep = (prepare_ours(w, ctx, env, positions=name == OURS_POSITIONS)
                    if peer is None else peer.prepare(w, ctx))
        except Exception as exc:  # noqa: BLE001
            prep = Unusable("error", _exc_text(exc))
        prepared.append((name, prep))
    return prepared


@dataclasses.dataclass
class _WorkloadTiming:
    """What every implementation's timing on one workload shares."""

    w: Workload
    sets: list
    copy_info: dict   # the same-run copy's copy_time_us and copy_bandwidth_GBps
    checks: dict      # check_outputs' result (empty without the check)
    reps: int
    warmup: int

    def rows(self, name, prep) -> list:
        """The fwd and bwd rows of one implementation."""
        if isinstance(prep, Unusable):
            return [_row(self.w, d, name, prep.status, prep.reason, **self.copy_info)
                    for d in DIRECTIONS]
        arg_sets = [prep.make_args(s) for s in self.sets]
        return [self._timed_row(name, prep, arg_sets, b) for b in (False, True)]

    def _timed_row(self, name, prep, arg_sets, backward) -> dict:
        w, direction = self.w, DIRECTIONS[backward]
        err = self.checks.get((name, backward))
        if isinstance(err, str):
            return _row(w, direction, name, "error", f"check call failed: {err}",
                        **self.copy_info)
        try:
            t, held = time_call(prep.call[backward], arg_sets, self.reps, self.warmup)
        except Exception as exc:  # noqa: BLE001
            return _row(w, direction, name, "error", _exc_text(exc), **self.copy_info)
        note, status = prep.note, "ok"
        if err is not None and err > CHECK_TOLERANCE[w.dtype]:
            status = "mismatch"
            note = f"{note}; output differs from the reference by {err:.2g}"
        if not held:
            note += f"; {harness.HOST_BOUND}"
        of_copy = self.copy_info["copy_time_us"] / (t * 1e3)
        _log(f"{w.name} {direction} {name}: {t * 1e3:.1f} us, {of_copy:.3f} of copy"
             + (f", err {err:.1e}" if err is not None else "") + f" [{status}]")
        return _row(w, direction, name, status, note, time_us=t * 1e3,
                    bandwidth_GBps=w.moved_bytes() / (t * 1e-3) / 1e9,
                    fraction_of_copy=of_copy, check_error=err, held=held, **self.copy_info)


def _mark_best_peer(rows) -> None:
    """Give cupy-rope's rows the best peer's name, time and the speedup over it."""
    for direction in DIRECTIONS:
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


def _run_workload(w, env, peer_objs, reps, n_sets, warmup, check) -> list:
    """Every implementation's fwd and bwd rows on one workload."""
    ctx = make_context(w, env)
    sets = [make_set(w, env) for _ in range(n_sets)]
    env.sync()
    t_copy = copy_ms(w.copy_bytes(), n_sets, reps)
    copy_info = {"copy_time_us": t_copy * 1e3,
                 "copy_bandwidth_GBps": w.moved_bytes() / (t_copy * 1e-3) / 1e9}
    prepared = _prepare_all(w, ctx, env, peer_objs)
    checks = {}
    if check and env.torch is not None:
        checks = check_outputs(w, ctx, prepared, sets[0], env)
    timing = _WorkloadTiming(w, sets, copy_info, checks, reps, warmup)
    rows = []
    for name, prep in prepared:
        rows += timing.rows(name, prep)
    del timing, sets, prepared
    env.sync()
    env.free()
    _mark_best_peer(rows)
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


def _present_peers(peers, env):
    """(peer objects usable here, {name: "present" or "absent: why"})."""
    candidates = [] if peers in (None, "none", (), []) else peers_mod.make(peers)
    if env.torch is None:
        candidates = []
    peer_objs, peer_status = [], {}
    for p in candidates:
        reason = p.available()
        peer_status[p.name] = "present" if reason is None else f"absent: {reason}"
        if reason is None:
            peer_objs.append(p)
    return peer_objs, peer_status


def run(workloads=None, *, peers="all", reps=30, n_sets=3, warmup=5, check=True, host=True,
        checkpoint=None, arrays="torch") -> dict:
    """Run the benchmark on the current CUDA device.

    Parameters
    ----------
    workloads : list of Workload or str, optional
        Workloads or their names (default: all of ``WORKLOADS``).
    peers : str or sequence of str
        ``"all"`` (every peer that imports here), ``"none"`` (or None or ()),
        or names from ``benchmarks.peers.NAMES``, comma-separated or a list.
    reps, n_sets, warmup : int
        Timed calls per row (the median is kept), input sets rotated between
        calls, untimed calls first.
    check : bool
        Compare every output with a float32 reference first (needs torch).
    host : bool
        Also time the host cost of a cached decode call and CUDA-graph replay.
    checkpoint : callable, optional
        Called with the partial result after each workload and at the end.
    arrays : {"torch", "cupy"}
        Torch tensors (when torch sees the GPU, else CuPy arrays), or CuPy
        arrays (then no peers and no check).

    Returns
    -------
    dict
        JSON-ready: device, arrays, config, peers, versions, workloads, rows
        (one per workload, implementation and direction), host (if timed) and
        acceptance (each of ``CRITERIA`` judged).

    Raises
    ------
    ValueError
        If a workload or peer name is unknown.

    Example
    -------
    >>> result = run(["thd-n1"], peers="none", host=False)  # doctest: +SKIP
    >>> print(format_table(result))  # doctest: +SKIP
    """
    import cupy

    workloads = [w if isinstance(w, Workload) else select_workloads([w])[0]
                 for w in (WORKLOADS if workloads is None else workloads)]
    env = _Env(use_torch=arrays != "cupy")
    peer_objs, peer_status = _present_peers(peers, env)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
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
                _log(f"{w.name} failed: {_exc_text(exc)}")
                result["rows"] += [_row(w, d, OURS, "error", _exc_text(exc)) for d in DIRECTIONS]
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


class HostEntry(NamedTuple):
    """A host-timed callable: ``name`` keys its figures in the result,
    ``label`` (or the name) is what the log calls it."""

    name: str
    fn: Callable[[], Any]
    label: str | None = None


def _time_host_rounds(out, entries, calls, rounds=HOST_ROUNDS):
    """Time host-bound callables (:class:`HostEntry`) in interleaved rounds.

    Each entry first runs for at least ``calls / 10`` calls and
    ``HOST_WARMUP_S / len(entries)`` seconds (the whole warm-up lasts
    HOST_WARMUP_S); then every round runs one pass of ``calls`` calls of each
    entry in turn, with one synchronization per pass. out[name +
    "_us_per_call"] is the median over the rounds, out[name +
    "_us_per_call_runs"] every round's pass. An entry that raises is dropped
    from the later rounds and leaves out[name + "_error"] (and no times); the
    others are timed on. One entry: plain repeated passes.
    """
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
    """The kernel of ``rope``'s cached qk_ launcher, launched with its packed
    parameters straight through CuPy's driver.launchKernel on the same
    stream, with a grid of one block (the GPU runs such launches faster than
    the host issues them, so this times the host): the driver's part of a
    bound call. None when rope has no cached launcher.

    Reads the launcher's ``plan`` (``cupy_rope.launch.Plan``): its
    ``kernel``, ``dims``, ``device_id``, ``stream``, ``own_buffer`` and
    ``empty``.
    """
    from cupy.cuda import driver

    go = next(iter(rope._fast.values()), None) if rope._fast else None
    plan = getattr(go, "plan", None)
    if plan is None or plan.empty:
        return None
    args = plan.own_buffer()[1]
    stream = plan.stream(plan.device_id)
    return lambda: driver.launchKernel(plan.kernel, 1, 1, 1, *plan.dims[3:], 0, stream, args, 0)


def _add_decode_entries(entries, out, env, w, fw) -> None:
    """Append the decode step's host-timed variants with ``fw`` arrays:
    apply_rope_qk, then (with the cos|sin cache) RotaryEmbedding.qk_ and its
    kernel launched bare. A failure is recorded in ``out`` and ends the list
    for this framework."""
    import cupy_rope as cr

    out[f"{fw}_us_per_call"] = None
    if fw == "torch" and env.torch is None:
        out[f"{fw}_error"] = NO_TORCH
        return
    try:
        ctx = make_context(w, env, fw)
        form = out["form"] = _decode_form(ctx, env, fw)
        kw = _decode_kwargs(form, ctx)
        q, k = _decode_views(form, env.randn(w.shape, w.dtype, fw),
                             env.randn(w.k_shape, w.dtype, fw))
        cr.apply_rope_qk(q, k, **kw)
        call = (lambda q=q, k=k, kw=kw: cr.apply_rope_qk(q, k, **kw))
        entries.append(HostEntry(fw, call, fw))
        if form != "thd-cache":
            return
        # The bound form: tables and options given once, q, k, positions per call.
        rope = cr.RotaryEmbedding(cos_sin_cache=ctx.cache, layout="thd")
        pos = kw["positions"]
        rope.qk_(q, k, pos)
        rope.qk_(q, k, pos)  # the second call finds the cached launcher
        entries.append(HostEntry(f"{fw}_bound", lambda rope=rope, q=q, k=k, pos=pos:
                                 rope.qk_(q, k, pos), "RotaryEmbedding.qk_"))
        try:
            bare = _bare_launch(rope)
        except Exception as exc:  # noqa: BLE001
            bare = None
            out[f"{fw}_launch_error"] = _exc_text(exc)
        if bare is not None:
            entries.append(HostEntry(f"{fw}_launch", bare,
                                     "the same kernel launched bare (one block)"))
    except Exception as exc:  # noqa: BLE001
        out[f"{fw}_error"] = _exc_text(exc)
        _log(f"host: {fw} failed: {out[f'{fw}_error']}")


def _add_python_share(out) -> None:
    """Python's part of a bound call: each round's qk_ pass less the same
    round's bare launch, median over the rounds."""
    for fw in ("torch", "cupy"):
        bound = out.get(f"{fw}_bound_us_per_call_runs")
        bare = out.get(f"{fw}_launch_us_per_call_runs")
        if bound and bare:
            out[f"{fw}_python_us_per_call"] = statistics.median(
                x - y for x, y in zip(bound, bare))


def _peer_host_costs(env, w, peer_objs, calls) -> dict:
    """{peer: microseconds per call} of each peer's own call on ``w``, host-timed."""
    costs = {}
    for p in peer_objs:
        try:
            ctx = make_context(w, env, "torch")
            prep = p.prepare(w, ctx)
            if isinstance(prep, Unusable):
                continue
            args = prep.make_args(make_set(w, env))
            fn = prep.call[False]
            timed: dict = {}
            _time_host_rounds(timed, [HostEntry(p.name, lambda: fn(*args))],
                              max(1, calls // 4), HOST_REPEATS)
            if f"{p.name}_error" in timed:
                continue  # logged by _time_host_rounds
            costs[p.name] = timed[f"{p.name}_us_per_call"]
        except Exception as exc:  # noqa: BLE001
            _log(f"host: peer {p.name} failed: {_exc_text(exc)}")
    return costs


def _captured_decode_graph(env, w, graph_calls):
    """A torch CUDA graph of ``graph_calls`` decode calls, replayed once."""
    import cupy_rope as cr

    ctx = make_context(w, env, "torch")
    form = _decode_form(ctx, env, "torch")
    kw = _decode_kwargs(form, ctx)
    q, k = _decode_views(form, env.randn(w.shape, w.dtype, "torch"),
                         env.randn(w.k_shape, w.dtype, "torch"))
    return harness.capture_graph(lambda: cr.apply_rope_qk(q, k, **kw), (), graph_calls,
                                 env.torch)


def _graph_replay_cost(env, w, graph_calls, replays) -> dict:
    """graph_us_per_call (GPU time per call of a replayed graph, by events)
    and graph_wall_us_per_call, or graph_error."""
    out = {"graph_us_per_call": None}
    if env.torch is None:
        out["graph_error"] = NO_TORCH
        return out
    torch = env.torch
    try:
        graph = _captured_decode_graph(env, w, graph_calls)
        out["graph_us_per_call"] = harness.graph_replay_us(graph, graph_calls, replays, torch,
                                                           hold_ms=5.0)
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        out["graph_wall_us_per_call"] = (time.perf_counter() - t0) / (replays * graph_calls) * 1e6
        _log(f"host: CUDA graph replay {out['graph_us_per_call']:.2f} us per call")
    except Exception as exc:  # noqa: BLE001
        out["graph_error"] = _exc_text(exc)
        _log(f"host: CUDA graph failed: {out['graph_error']}")
    return out


def host_overhead(env=None, calls=HOST_CALLS, graph_calls=GRAPH_CALLS, replays=20,
                  peer_objs=(), rounds=HOST_ROUNDS) -> dict:
    """Host cost of a cached decode step, in microseconds per call.

    The step: q32/k8 d128, 64 tokens, bf16, in place at positions [64] into
    an fp32 cos|sin cache. ``calls`` calls are timed on the host with one
    synchronization at the end, in ``rounds`` interleaved rounds after a
    warm-up; each round times one pass of every variant (apply_rope_qk,
    RotaryEmbedding.qk_ and the bare launch, with torch tensors and with
    CuPy arrays, and torch's x.add_(1) as a measure of the host's speed).
    ``<name>_us_per_call`` is the median pass, ``<name>_us_per_call_runs``
    every round's. ``graph_us_per_call``: GPU time per call of
    ``graph_calls`` calls captured in a torch CUDA graph and replayed.
    ``peers_us_per_call``: for context, each of ``peer_objs`` in the same
    host-timed loop (its own call on the same workload, passes of
    ``calls / 4``).
    """
    env = env or _Env()
    w = select_workloads(["decode-qk-t64"])[0]
    rounds = max(1, int(rounds or HOST_ROUNDS))
    out = {"workload": w.title, "calls": calls, "rounds": rounds,
           "graph_calls": graph_calls}
    entries = []
    for fw in ("torch", "cupy"):
        _add_decode_entries(entries, out, env, w, fw)
    if env.torch is not None:
        # The host's own speed, for reading the numbers above across machines:
        # torch's cheapest call that launches a kernel.
        small = env.torch.zeros(16, device="cuda")
        entries.append(HostEntry("torch_add", lambda: small.add_(1),
                                 "torch x.add_(1), 16 floats"))
    _time_host_rounds(out, entries, calls, rounds)
    _add_python_share(out)
    out["peers_us_per_call"] = _peer_host_costs(env, w, peer_objs, calls)
    out.update(_graph_replay_cost(env, w, graph_calls, replays))
    return out


# ----------------------------------------------------------------------------
# Criteria, judged from a result dict alone (so also from a saved JSON).

#: [1a] cupy-rope's fraction of copy on every workload moving ROOFLINE_MIN_BYTES.
ROOFLINE_FRACTION = 0.95
#: [2] slowest over fastest thd time across the numbers of packed sequences.
THD_SPREAD_MAX = 1.05
#: [3] partial rotary in place: time at most (fraction + this) x full rotary's.
PARTIAL_SLACK = 0.1
#: [4] strided input over its contiguous twin.
STRIDED_MAX = 1.05
#: [5] decode step, end to end per call (microseconds).
DECODE_HOST_MAX_US = 8.0
#: [6] CUDA-graph replay per call (microseconds).
GRAPH_MAX_US = 3.0
_NO_HOST = "host overhead not measured"


class Verdict(NamedTuple):
    status: str             # "PASS", "FAIL" or "SKIP"
    detail: str
    failures: tuple = ()


def _judged(fails, detail) -> Verdict:
    return Verdict("FAIL" if fails else "PASS", detail, tuple(fails))


def _judged_rows(fails, details, empty) -> Verdict:
    """SKIP with ``empty`` when no row was judged, else PASS or FAIL."""
    if not (details or fails):
        return Verdict("SKIP", empty)
    return _judged(fails, "; ".join(details) or empty)


@dataclasses.dataclass
class _Measured:
    """A result dict as the criteria read it."""

    wdefs: dict      # workload name -> Workload.describe()
    ours: dict       # (workload, direction) -> cupy-rope's row
    ours_pos: dict   # the same for cupy-rope at the peers' positions (thd)
    host: Any        # host_overhead's dict, or None

    @classmethod
    def of(cls, result):
        rows = result.get("rows", [])

        def by_key(impl):
            return {(r["workload"], r["direction"]): r for r in rows if r["impl"] == impl}

        return cls({w["name"]: w for w in result.get("workloads", [])}, by_key(OURS),
                   by_key(OURS_POSITIONS), result.get("host"))

    def time(self, name, direction):
        """cupy-rope's microseconds, or None when missing or not ok."""
        r = self.ours.get((name, direction))
        return r["time_us"] if r and r["status"] == "ok" else None

    def big(self) -> list:
        """Workloads held to the copy roofline."""
        return [n for n, w in self.wdefs.items() if w["moved_bytes"] >= ROOFLINE_MIN_BYTES]


def _at_roofline(m: _Measured) -> Verdict:
    fails, worst, n = [], None, 0
    for name in m.big():
        for d in DIRECTIONS:
            for r, label in ((m.ours.get((name, d)), f"{name} {d}"),
                             (m.ours_pos.get((name, d)), f"{name} {d} positions")):
                if r is None:
                    continue
                n += 1
                if r["status"] != "ok":
                    fails.append(f"{label}: {r['status']} ({r['note']})")
                    continue
                f = r["fraction_of_copy"]
                if worst is None or f < worst[0]:
                    worst = (f, label)
                if f < ROOFLINE_FRACTION:
                    fails.append(f"{label}: {f:.3f}")
    if n == 0:
        return Verdict("SKIP", "no such workload measured")
    return _judged(fails, f"{n} rows" + (f", lowest {worst[0]:.3f} ({worst[1]})" if worst else ""))


def _lowest_cu_seqlens_speedup(m: _Measured):
    """(speedup, label) of cupy-rope's cu_seqlens row where its positions
    row has one (thd), the lowest; None without such rows."""
    low = None
    for name in m.big():
        for d in DIRECTIONS:
            pos = m.ours_pos.get((name, d))
            if pos is None or pos.get("speedup_vs_best_peer") is None:
                continue
            sp = (m.ours.get((name, d)) or {}).get("speedup_vs_best_peer")
            if sp is not None and (low is None or sp < low[0]):
                low = (sp, f"{name} {d}")
    return low


def _faster_than_peers(m: _Measured) -> Verdict:
    fails, no_peer, n, low = [], [], 0, None
    for name in m.big():
        for d in DIRECTIONS:
            r = m.ours_pos.get((name, d)) or m.ours.get((name, d))
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
    if n == 0:
        return Verdict("SKIP", "no peer measured on these workloads")
    detail = f"{n} rows" + (f", lowest speedup {low[0]:.3f}x ({low[1]})" if low else "")
    low_cu = _lowest_cu_seqlens_speedup(m)
    if low_cu:
        detail += (f"; thd with cu_seqlens, which no peer takes (their positions are "
                   f"gathered outside their timed call): lowest {low_cu[0]:.3f}x ({low_cu[1]})")
    if no_peer:
        detail += f"; no peer on {len(no_peer)} rows"
    return _judged(fails, detail)


def _thd_flat(m: _Measured) -> Verdict:
    groups: dict = {}
    for n, w in m.wdefs.items():
        if w["kind"] == "thd":
            key = (tuple(w["shape"]), w["dtype"], w["mode"], w["rotary_frac"])
            groups.setdefault(key, []).append(n)
    fails, details = [], []
    for names in groups.values():
        if len(names) < 2:
            continue
        names = sorted(names, key=lambda n: m.wdefs[n]["n_seqs"])
        for d in DIRECTIONS:
            ts = [(m.time(n, d), n) for n in names]
            if any(x is None for x, _ in ts):
                fails.append(f"{d}: missing or failed rows")
                continue
            spread = max(x for x, _ in ts) / min(x for x, _ in ts)
            details.append(f"{d} max/min {spread:.3f}")
            if spread > THD_SPREAD_MAX:
                fails.append(f"{d}: " + ", ".join(f"{n} {x:.1f} us" for x, n in ts))
    return _judged_rows(fails, details, "needs two or more thd workloads")


class _Twins(NamedTuple):
    """Rows judged against a twin workload: the same in ``same`` but for
    what ``is_twin`` tells apart."""

    is_row: Callable[[dict], bool]
    is_twin: Callable[[dict], bool]
    same: tuple
    limit: Callable[[dict], float]
    label: Callable[[str, str, float, float], str]
    empty: str


def _against_twin(m: _Measured, tw: _Twins) -> Verdict:
    """Each row's time over its twin's must stay within ``tw.limit(row)``."""
    fails, details = [], []
    for n, w in m.wdefs.items():
        if not tw.is_row(w):
            continue
        twins = [t for t, v in m.wdefs.items()
                 if tw.is_twin(v) and all(v.get(k) == w.get(k) for k in tw.same)]
        if not twins:
            continue
        for d in DIRECTIONS:
            tr, tt = m.time(n, d), m.time(twins[0], d)
            if tr is None or tt is None:
                fails.append(f"{n} {d}: missing or failed rows")
                continue
            details.append(tw.label(n, d, tr / tt, tw.limit(w)))
            if tr > tw.limit(w) * tt:
                fails.append(f"{n} {d}: {tr:.1f} us vs {tt:.1f} us, ratio {tr / tt:.3f}")
    return _judged_rows(fails, details, tw.empty)


def _partial_rotary(m: _Measured) -> Verdict:
    return _against_twin(m, _Twins(
        is_row=lambda w: w["mode"] == "inplace" and w["rotary_frac"] < 1.0,
        is_twin=lambda v: v["rotary_frac"] == 1.0,
        same=("mode", "shape", "dtype", "layout", "kind", "interleaved"),
        limit=lambda w: w["rotary_frac"] + PARTIAL_SLACK,
        label=lambda n, d, r, lim: f"{n} {d} {r:.3f} (<= {lim:.2f})",
        empty="needs partial and full in-place rows"))


def _strided(m: _Measured) -> Verdict:
    return _against_twin(m, _Twins(
        is_row=lambda w: w["strided"],
        is_twin=lambda v: not v["strided"],
        same=("shape", "dtype", "layout", "mode", "kind", "rotary_frac", "interleaved"),
        limit=lambda w: STRIDED_MAX,
        label=lambda n, d, r, lim: f"{d} {r:.3f}",
        empty="needs a strided row and its twin"))


def _decode_host_cost(m: _Measured) -> Verdict:
    """The bound RotaryEmbedding.qk_ where measured, apply_rope_qk otherwise."""
    host = m.host
    if not host:
        return Verdict("SKIP", _NO_HOST)
    fails, details = [], []
    for fw in ("torch", "cupy"):
        v = host.get(f"{fw}_us_per_call")
        if v is None:
            err = host.get(f"{fw}_error", "not measured")
            if err == NO_TORCH:
                details.append(f"{fw} not measured ({NO_TORCH})")
            else:
                fails.append(f"{fw}: {err}")
            continue
        bound = host.get(f"{fw}_bound_us_per_call")
        if bound is not None:
            py = host.get(f"{fw}_python_us_per_call")
            split = f", of which Python {py:.2f} us" if py is not None else ""
            details.append(f"{fw} {bound:.2f} us bound{split} ({v:.2f} us apply_rope_qk)")
            v = bound
        else:
            details.append(f"{fw} {v:.2f} us")
        if v > DECODE_HOST_MAX_US:
            fails.append(f"{fw}: {v:.2f} us")
    return _judged(fails, "; ".join(details))


def _graph_replay(m: _Measured) -> Verdict:
    host = m.host
    if not host:
        return Verdict("SKIP", _NO_HOST)
    v = host.get("graph_us_per_call")
    if v is None and host.get("graph_error") == NO_TORCH:
        return Verdict("SKIP", NO_TORCH)
    if v is None:
        return Verdict("FAIL", host.get("graph_error", "not measured"))
    return Verdict("PASS" if v <= GRAPH_MAX_US else "FAIL", f"{v:.2f} us")


class Criterion(NamedTuple):
    item: str
    what: str
    judge: Callable[[_Measured], Verdict]


#: What a run is judged by, in the order printed.
CRITERIA = (
    Criterion("1a", f"fwd and bwd >= {ROOFLINE_FRACTION} of copy, every workload moving "
              f">= {ROOFLINE_MIN_BYTES // MiB} MiB", _at_roofline),
    Criterion("1b", f"faster than the best peer present, every workload moving >= "
              f"{ROOFLINE_MIN_BYTES // MiB} MiB (thd: on the per-token positions the peers "
              "are handed)", _faster_than_peers),
    Criterion("2", f"thd time within {THD_SPREAD_MAX - 1:.0%} from n_seqs 1 to 2401",
              _thd_flat),
    Criterion("3", f"partial rotary in place <= (fraction + {PARTIAL_SLACK}) x full rotary "
              "time", _partial_rotary),
    Criterion("4", f"strided input within {STRIDED_MAX - 1:.0%} of its contiguous twin",
              _strided),
    Criterion("5", f"decode 64 tokens, end to end per call <= {DECODE_HOST_MAX_US:g} us "
              "(torch and CuPy; the bound RotaryEmbedding.qk_ where measured, apply_rope_qk "
              "otherwise)", _decode_host_cost),
    Criterion("6", f"CUDA-graph replay per call <= {GRAPH_MAX_US:g} us", _graph_replay),
)


def _item(item, what, status, detail, failures=()):
    return {"item": item, "what": what, "status": status, "detail": detail,
            "failures": list(failures)}


def acceptance(result) -> list:
    """Each of ``CRITERIA`` judged on ``result``: dicts with item, what,
    status (PASS, FAIL or SKIP), detail and failures."""
    m = _Measured.of(result)
    return [_item(c.item, c.what, *c.judge(m)) for c in CRITERIA]


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


def _host_part(host, fw) -> str:
    """One framework's decode host cost, as format_host prints it."""
    v = host.get(f"{fw}_us_per_call")
    if v is None:
        return f"{fw} failed ({host.get(f'{fw}_error', '?')})"
    bound = host.get(f"{fw}_bound_us_per_call")
    if bound is None:
        return f"{fw} {v:.2f} us"
    py, bare = host.get(f"{fw}_python_us_per_call"), host.get(f"{fw}_launch_us_per_call")
    if py is None:
        split = ""
    elif host.get("rounds"):
        # (medians of different things: they need not add up to qk_'s)
        split = (f"; the kernel launched bare {bare:.2f} us; Python {py:.2f} us, "
                 f"the median over rounds of qk_ less the bare launch")
    else:
        split = f": driver launch {bare:.2f} us + Python {py:.2f} us"
    return f"{fw} {v:.2f} us (RotaryEmbedding.qk_ {bound:.2f} us{split})"


def format_host(host) -> str:
    if not host:
        return ""
    parts = [_host_part(host, fw) for fw in ("torch", "cupy")]
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


def _parser():
    ap = harness.parser("bench", __doc__)
    ap.add_argument("--workloads", help="comma-separated workload names (see --list)")
    ap.add_argument("--filter", action="append",
                    help="regular expression searched in workload names (repeatable: a "
                         "workload is kept if any matches; with --workloads, both must hold)")
    harness.add_peers_arg(ap, peers_mod.NAMES)
    ap.add_argument("--json", help="write the results here (updated after each workload)")
    ap.add_argument("--plot", help="write a PNG chart of the fractions of copy here "
                                   "(needs matplotlib)")
    harness.add_timing_args(ap)
    ap.add_argument("--no-host", action="store_true",
                    help="skip the decode host-cost timings")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the check against the float32 reference")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a criterion FAILs")
    ap.add_argument("--arrays", choices=("torch", "cupy"), default="torch",
                    help="input arrays: torch tensors (default, when torch sees the GPU) "
                         "or CuPy arrays (then no peers and no check)")
    harness.add_list_arg(ap)
    return ap


def main(argv=None):
    args, workloads, status = harness.start(
        _parser(), argv, lambda a: select_workloads(a.workloads, a.filter),
        lambda w: f"{w.name:26s} {w.moved_bytes() / 1e6:9.1f} MB  {w.title}", "bench")
    if status is not None:
        return status
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
