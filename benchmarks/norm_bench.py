"""q/k RMSNorm + RoPE (issue 31): cupy-rope's fused op against its peers, forward and backward.

Run it from the repository root on a machine with a CUDA GPU (under three
minutes on an H100, most of it ``torch.compile``)::

    python -m benchmarks.norm_bench [--json PATH] [--reps N] [--workloads a,b]

Without a CUDA device it says so in one line and exits with status 2
(``--help`` and ``--list`` still work).

Workloads (bf16, NeoX rotation by float32 cos/sin tables, weights in bf16,
rounding "before_weight" as Qwen3's and Wan's modules round):

- ``qwen3-8b-prefill``: q [4, 4096, 32, 128], k [4, 4096, 8, 128], RMSNorm
  per head (weights [128]);
- ``wan-token``: q and k [1, 32760, 40, 128], RMSNorm across the heads of a
  token (weights [5120]);
- ``decode-qkv-t64``: 64 tokens of a packed projection qkv [64, (32 + 2 * 8)
  * 128] at per-token positions into [8192, 64] tables; cupy-rope writes q
  and k back into qkv (``apply_qkv_norm_rope(inplace=True)``), the peers
  return new q and k (as a model's attention does). Forward only; also
  timed per call of a replayed CUDA graph.

Implementations, each on the same inputs:

- ``cupy-rope``: ``cupy_rope.torch.qk_norm_rope`` (its autograd backward is
  one launch of ``apply_qk_norm_rope_backward``, weight gradients included);
- ``torch-compile``: ``torch.compile`` of a Hugging Face style module, the
  RMSNorm (fp32 statistics, rounded to bf16, times the weight) then
  ``q * cos + rotate_half(q) * sin`` on full-width bf16 tables (its
  backward compiled without donated buffers, which a retained graph
  cannot replay);
- ``rms_norm+rope_qk``: ``torch.nn.functional.rms_norm`` then
  ``cupy_rope.torch.rope_qk``, the unfused chain of library ops;
- ``liger+rope_qk``: Liger-Kernel's RMSNorm then ``cupy_rope.torch.rope_qk``,
  when ``liger_kernel`` imports (else the row says why not).

What it measures
----------------
* Times, the copy and the CUDA-graph replay are measured as
  ``benchmarks/harness.py`` describes: a time is the median over ``--reps``
  calls between CUDA events, queued behind a spinning kernel so that the
  events time GPU work, rotating among ``--sets`` input sets. The backward
  is ``torch.autograd.grad`` of a recorded forward (retained) for q, k and
  both weights: for the compiled module, its compiled backward.
* "of copy": a same-run device-to-device copy of the op's own bytes over the
  op's time (1.0 is the copy roofline). Forward: read q and k, write q and k;
  backward: read the output gradients and q, k, write dq and dk. Weights,
  their gradients and the tables are too small to count.
* "x compile": ``torch.compile``'s time over the row's (above 1: faster).
* Every implementation is first checked against a float32 formula (values
  and every gradient; max error over max |reference|); a row that disagrees
  is marked ``mismatch``.

``--json PATH`` writes ``{"device", "columns", "rows"}``, rows in the columns of
``results/runs.csv`` (``benchmarks.record`` adds a run's ``*.rows.json``);
a decode row under CUDA-graph replay is named ``<implementation> (CUDA graph)``.
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple, Optional

from benchmarks import harness

OURS = "cupy-rope"
COMPILE = "torch-compile"
#: Largest max |error| / max |reference| against the float32 formula (bf16).
CHECK_TOLERANCE = 3e-2
GRAPH_CALLS = 50
#: Where the inputs live (CPU only for tests of the plumbing and the check).
DEVICE = "cuda"
DIRECTIONS = ("fwd", "bwd")


_log = harness.logger("norm_bench", clock=True)


def _exc_text(exc: BaseException) -> str:
    return harness.exc_text(exc, first_line=True)


# ----------------------------------------------------------------------------
# Workloads (plain data; nothing here needs a GPU).


class NormWorkload(NamedTuple):
    """One benchmark case: q [batch, seq, q_heads, head_dim] and k with
    k_heads (decode: seq 1 and ``batch`` tokens of a packed qkv)."""

    name: str
    title: str
    batch: int
    seq: int
    q_heads: int
    k_heads: int
    head_dim: int
    scope: str  # "head" | "token"
    decode: bool = False
    dtype: str = "bfloat16"
    eps: float = 1e-6
    max_position: int = 8192

    @property
    def q_shape(self):
        return (self.batch, self.seq, self.q_heads, self.head_dim)

    @property
    def k_shape(self):
        return (self.batch, self.seq, self.k_heads, self.head_dim)

    @property
    def shape_text(self) -> str:
        if self.decode:
            return f"{self.batch}x{(self.q_heads + 2 * self.k_heads) * self.head_dim}"
        return "x".join(map(str, self.q_shape)) + "+" + "x".join(map(str, self.k_shape))

    def weight_len(self, heads: int) -> int:
        return self.head_dim * (heads if self.scope == "token" else 1)

    def qk_bytes(self) -> int:
        """Bytes of q and k together (bf16)."""
        return 2 * self.batch * self.seq * (self.q_heads + self.k_heads) * self.head_dim

    def copy_bytes(self, direction: str) -> int:
        """Size of the device copy moving the op's bytes (a copy of n bytes
        reads n and writes n): fwd reads and writes q, k; bwd reads dy and
        x, writes dx."""
        return self.qk_bytes() * (3 if direction == "bwd" else 2) // 2


WORKLOADS = (
    NormWorkload("qwen3-8b-prefill", "Qwen3-8B prefill, RMSNorm per head", 4, 4096, 32, 8,
                 128, "head"),
    NormWorkload("wan-token", "Wan-style self-attention, RMSNorm across 40 heads", 1, 32760,
                 40, 40, 128, "token"),
    NormWorkload("decode-qkv-t64", "decode, 64 tokens of a packed qkv, in place", 64, 1, 32,
                 8, 128, "head", decode=True),
)


def select(names: Optional[str]) -> list:
    if not names:
        return list(WORKLOADS)
    by_name = {w.name: w for w in WORKLOADS}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(unknown)} (see --list)")
    return [by_name[n] for n in names.split(",")]


# ----------------------------------------------------------------------------
# The module the peers run (Hugging Face style), and the float32 reference.


def hf_rms_norm(x, w, eps):
    """Qwen3RMSNorm / WanRMSNorm: fp32 statistics, x_hat rounded to x's
    dtype, then times the weight."""
    import torch

    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _normed(norm, x, w, eps, scope):
    """``norm`` over each head, or over all heads of a token."""
    rows = x.flatten(-2) if scope == "token" else x
    return norm(rows, w, eps).view(x.shape)


def rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def norm_rope_module(q, k, qw, kw, cos, sin, eps, scope):
    """RMSNorm of q and k, then ``x * cos + rotate_half(x) * sin`` on
    full-width tables broadcasting over the heads."""
    q = _normed(hf_rms_norm, q, qw, eps, scope)
    k = _normed(hf_rms_norm, k, kw, eps, scope)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ----------------------------------------------------------------------------
# Inputs.


class Tables(NamedTuple):
    cos: object  # float32 [rows, d / 2] (cupy-rope)
    sin: object
    cos_full: object  # bf16 [rows, d], halves duplicated (the module)
    sin_full: object
    positions: object  # decode: int32 [tokens]; else None


def make_tables(w: NormWorkload, torch) -> Tables:
    rows = w.max_position if w.decode else w.seq
    d = w.head_dim
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=DEVICE) / d)
    theta = torch.arange(rows, dtype=torch.float64, device=DEVICE)[:, None] * inv
    cos, sin = theta.cos().float(), theta.sin().float()
    positions = None
    if w.decode:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        positions = torch.randint(0, rows, (w.batch,), generator=gen, device=DEVICE,
                                  dtype=torch.int32)
    return Tables(cos, sin, torch.cat((cos, cos), -1).bfloat16(),
                  torch.cat((sin, sin), -1).bfloat16(), positions)


def make_set(w: NormWorkload, torch) -> dict:
    """One input set: q, k (decode: qkv), bf16 weights near 1, and the
    output gradients dq, dk."""
    def randn(*shape):
        return torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)

    s = {"q_weight": (1 + 0.1 * randn(w.weight_len(w.q_heads))),
         "k_weight": (1 + 0.1 * randn(w.weight_len(w.k_heads)))}
    if w.decode:
        s["qkv"] = randn(w.batch, (w.q_heads + 2 * w.k_heads) * w.head_dim)
        return s
    s.update(q=randn(*w.q_shape), k=randn(*w.k_shape), dq=randn(*w.q_shape),
             dk=randn(*w.k_shape))
    return s


def decode_views(w: NormWorkload, qkv):
    """q [t, hq, d] and k [t, hk, d]: views of the packed projection."""
    t, d = w.batch, w.head_dim
    q = qkv[:, :w.q_heads * d].view(t, w.q_heads, d)
    k = qkv[:, w.q_heads * d:(w.q_heads + w.k_heads) * d].view(t, w.k_heads, d)
    return q, k


def module_tables(w: NormWorkload, tables: Tables):
    """The module's cos, sin broadcasting over [b, s, h, d] (decode:
    gathered by position inside the call, as a model does)."""
    if w.decode:
        return None
    return (tables.cos_full.view(1, w.seq, 1, w.head_dim),
            tables.sin_full.view(1, w.seq, 1, w.head_dim))


# ----------------------------------------------------------------------------
# Implementations: ``forward`` gives f(q, k, q_weight, k_weight) -> (q, k),
# differentiable by autograd; ``decode`` gives f(qkv, q_weight, k_weight)
# -> (q, k) for the decode workload.


class Impl:
    name = ""

    def available(self) -> Optional[str]:
        """None when usable here, else why not."""
        return None

    def forward(self, w: NormWorkload, t: Tables) -> Callable:
        raise NotImplementedError

    def decode(self, w: NormWorkload, t: Tables) -> Callable:
        raise NotImplementedError

    def note(self, w: NormWorkload) -> str:
        return ""


def _norm_options(w: NormWorkload) -> dict:
    return dict(norm_scope=w.scope, eps=w.eps, weight_mode="w", rounding="before_weight")


def _api_autograd():
    """qk_norm_rope through the library's API on torch tensors, with the
    API's backward: for trees whose cupy_rope.torch has no such op yet."""
    import torch

    from cupy_rope import qk_norm

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, qw, kw, cos, sin, opts):
            ctx.save_for_backward(q, k, qw, kw, cos, sin)
            ctx.opts = opts
            return qk_norm.apply_qk_norm_rope(q, k, qw, kw, cos, sin, **opts)

        @staticmethod
        def backward(ctx, dq, dk):
            q, k, qw, kw, cos, sin = ctx.saved_tensors
            grads = qk_norm.apply_qk_norm_rope_backward(dq.contiguous(), dk.contiguous(), q, k,
                                                        qw, kw, cos, sin, **ctx.opts)
            return (*grads, None, None, None)

    return lambda q, k, qw, kw, cos, sin, **opts: Fn.apply(q, k, qw, kw, cos, sin, opts)


class Ours(Impl):
    name = OURS

    def available(self):
        try:
            import cupy_rope.qk_norm  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"cupy_rope.qk_norm not importable ({_exc_text(exc)})"
        return None

    @staticmethod
    def _op():
        import cupy_rope.torch as crt

        op = getattr(crt, "qk_norm_rope", None)
        return (op, "cupy_rope.torch.qk_norm_rope") if op else (_api_autograd(), "the API")

    def note(self, w):
        if w.decode:
            from cupy_rope import qk_norm

            if hasattr(qk_norm, "apply_qkv_norm_rope"):
                return "apply_qkv_norm_rope(inplace=True)"
            return "in place on views of qkv (apply_qk_norm_rope: no apply_qkv_norm_rope yet)"
        return "out of place, " + self._op()[1]

    def forward(self, w, t):
        op, opts = self._op()[0], _norm_options(w)
        return lambda q, k, qw, kw: op(q, k, qw, kw, t.cos, t.sin, **opts)

    def decode(self, w, t):
        from cupy_rope import qk_norm

        opts = dict(_norm_options(w), positions=t.positions, layout="thd", inplace=True)
        if not hasattr(qk_norm, "apply_qkv_norm_rope"):
            def views(qkv, qw, kw):
                q, k = decode_views(w, qkv)
                return qk_norm.apply_qk_norm_rope(q, k, qw, kw, t.cos, t.sin, **opts)
            return views

        def packed(qkv, qw, kw):
            qk_norm.apply_qkv_norm_rope(qkv, qw, kw, t.cos, t.sin, num_q_heads=w.q_heads,
                                        num_kv_heads=w.k_heads, head_dim=w.head_dim, **opts)
            return decode_views(w, qkv)
        return packed


class Compiled(Impl):
    name = COMPILE

    def available(self):
        from benchmarks.peers import TorchCompile

        reason = TorchCompile().available()  # also raises dynamo's recompile limits
        if reason is None:
            # The timed backward replays one retained graph, which a compiled
            # backward that donates its saved buffers refuses.
            import torch._functorch.config as functorch_config

            if hasattr(functorch_config, "donated_buffer"):
                functorch_config.donated_buffer = False
        return reason

    def note(self, w):
        return "new q, k; tables gathered by position in the call" if w.decode else "new q, k"

    def forward(self, w, t):
        import torch

        def module(q, k, qw, kw, cos, sin):
            return norm_rope_module(q, k, qw, kw, cos, sin, w.eps, w.scope)

        fn, (cos, sin) = torch.compile(module, dynamic=False), module_tables(w, t)
        return lambda q, k, qw, kw: fn(q, k, qw, kw, cos, sin)

    def decode(self, w, t):
        import torch

        def module(qkv, qw, kw, cos_full, sin_full, positions):
            q, k = decode_views(w, qkv)
            cos, sin = cos_full[positions].unsqueeze(1), sin_full[positions].unsqueeze(1)
            return norm_rope_module(q, k, qw, kw, cos, sin, w.eps, w.scope)

        fn = torch.compile(module, dynamic=False)
        return lambda qkv, qw, kw: fn(qkv, qw, kw, t.cos_full, t.sin_full, t.positions)


def torch_rms_norm(x, w, eps):
    import torch

    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def liger_rms_norm(x, w, eps):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, w, eps)


class Chain(Impl):
    """A library RMSNorm, then ``cupy_rope.torch.rope_qk``: two launches per
    tensor pair plus the norm's own, as a user composes them today."""

    def __init__(self, name, norm, module):
        self.name, self._norm, self._module = name, norm, module

    def available(self):
        import importlib

        try:
            mod, _, attr = self._module.rpartition(".")
            getattr(importlib.import_module(mod), attr)
        except Exception as exc:  # noqa: BLE001
            return f"{self._module} not importable ({_exc_text(exc)})"
        return None

    def note(self, w):
        return "new q, k"

    def forward(self, w, t):
        import cupy_rope.torch as crt

        def chain(q, k, qw, kw):
            q = _normed(self._norm, q, qw, w.eps, w.scope)
            k = _normed(self._norm, k, kw, w.eps, w.scope)
            return crt.rope_qk(q, k, t.cos, t.sin)
        return chain

    def decode(self, w, t):
        import cupy_rope.torch as crt

        def chain(qkv, qw, kw):
            q, k = decode_views(w, qkv)
            q = _normed(self._norm, q, qw, w.eps, w.scope)
            k = _normed(self._norm, k, kw, w.eps, w.scope)
            return crt.rope_qk(q, k, t.cos, t.sin, positions=t.positions, layout="thd")
        return chain


def implementations() -> list:
    return [Ours(), Compiled(),
            Chain("rms_norm+rope_qk", torch_rms_norm, "torch.nn.functional.rms_norm"),
            Chain("liger+rope_qk", liger_rms_norm,
                  "liger_kernel.ops.rms_norm.LigerRMSNormFunction")]


PEER_NAMES = tuple(i.name for i in implementations()[1:])


# ----------------------------------------------------------------------------
# Correctness against the float32 formula.

_NAMES = ("q", "k", "q_weight", "k_weight")


def _rel_err(got, ref) -> float:
    return float((got.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def reference(w: NormWorkload, s: dict, t: Tables, torch) -> dict:
    """float32 outputs ("fwd") and gradients of q, k and both weights ("bwd")
    of the module on set ``s`` (decode: outputs only)."""
    f32 = t._replace(cos_full=torch.cat((t.cos, t.cos), -1),
                     sin_full=torch.cat((t.sin, t.sin), -1))
    if w.decode:
        q, k = decode_views(w, s["qkv"].float())
        cos = f32.cos_full[t.positions.long()].unsqueeze(1)
        sin = f32.sin_full[t.positions.long()].unsqueeze(1)
        outs = norm_rope_module(q, k, s["q_weight"].float(), s["k_weight"].float(), cos, sin,
                                w.eps, w.scope)
        return {"fwd": outs}
    leaves = [s[n].float().requires_grad_() for n in _NAMES]
    outs = norm_rope_module(*leaves, *module_tables(w, f32), w.eps, w.scope)
    grads = torch.autograd.grad(outs, leaves, (s["dq"].float(), s["dk"].float()))
    return {"fwd": [o.detach() for o in outs], "bwd": list(grads)}


def check(w, fn, s, ref, torch) -> dict:
    """{direction: max relative error, or the error text of the call}."""
    out = {}
    try:
        if w.decode:
            got = fn(s["qkv"].clone(), s["q_weight"], s["k_weight"])
            return {"fwd": max(_rel_err(g, r) for g, r in zip(got, ref["fwd"]))}
        leaves = [s[n].detach().requires_grad_() for n in _NAMES]
        got = fn(*leaves)
        out["fwd"] = max(_rel_err(g, r) for g, r in zip(got, ref["fwd"]))
        grads = torch.autograd.grad(got, leaves, (s["dq"], s["dk"]))
        out["bwd"] = max(_rel_err(g, r) for g, r in zip(grads, ref["bwd"]))
    except Exception as exc:  # noqa: BLE001
        out = {d: _exc_text(exc) for d in DIRECTIONS if d not in out} | out
    return out


# ----------------------------------------------------------------------------
# Timing.


def _backward_calls(fn, sets, torch) -> list:
    """Per set, a call of autograd's backward of one recorded (retained)
    forward, for q, k and both weights."""
    calls = []
    for s in sets:
        leaves = [s[n].detach().requires_grad_() for n in _NAMES]
        outs = fn(*leaves)
        calls.append((lambda outs=outs, leaves=leaves, g=(s["dq"], s["dk"]):
                      torch.autograd.grad(outs, leaves, g, retain_graph=True),))
    return calls


def graph_us(fn, args, reps, torch) -> float:
    """GPU microseconds per call of ``GRAPH_CALLS`` calls captured in one CUDA
    graph, replayed (median over ``reps`` replays, by events, behind a spin)."""
    return harness.graph_us_per_call(fn, args, torch, GRAPH_CALLS, reps, hold_ms=5.0)


class Timing(NamedTuple):
    """What every implementation's rows on one workload share."""

    w: NormWorkload
    tables: Tables
    sets: list
    copy_us: dict  # direction -> same-run copy time
    ref: Optional[dict]
    reps: int
    warmup: int


def _row(w, direction, impl, status, note="", us=None, copy_us=None, err=None) -> dict:
    return {"workload": w.name, "shape": w.shape_text, "dtype": w.dtype, "direction": direction,
            "implementation": impl, "status": status, "note": note, "us": us,
            "copy_us": copy_us, "of_copy": copy_us / us if us and copy_us else None,
            "check_error": err}


def _timed(tm: Timing, direction, name, fn, args, errs, note, torch) -> dict:
    """One timed row: ``fn(*args[i])`` rotating over the sets (or, for
    ``direction`` "graph", a replayed CUDA graph of the decode call)."""
    w, copy_us = tm.w, tm.copy_us["fwd" if direction == "graph" else direction]
    err = errs.get("fwd" if direction == "graph" else direction)
    if isinstance(err, str):
        return _row(w, "fwd", name, "error", f"check call failed: {err}", copy_us=copy_us)
    try:
        if direction == "graph":
            us = graph_us(fn, args[0], tm.reps, torch)
        else:
            timed = harness.time_call(fn, args, tm.reps, tm.warmup)
            us = timed.ms * 1e3
            note += "" if timed.held else f"; {harness.HOST_BOUND}"
    except Exception as exc:  # noqa: BLE001
        return _row(w, "fwd" if direction == "graph" else direction, name, "error",
                    _exc_text(exc), copy_us=copy_us)
    status = "ok"
    if err is not None and err > CHECK_TOLERANCE:
        status, note = "mismatch", f"{note}; differs from the float32 formula by {err:.2g}"
    row = _row(w, "fwd" if direction == "graph" else direction, name, status, note, us,
               copy_us, err)
    _log(f"{w.name} {direction} {name}: {us:.1f} us, {row['of_copy']:.3f} of copy"
         + (f", err {err:.1e}" if err is not None else "") + f" [{status}]")
    return row


def impl_rows(tm: Timing, impl: Impl, torch) -> list:
    """The rows of one implementation on one workload."""
    w = tm.w
    try:
        fn = (impl.decode if w.decode else impl.forward)(w, tm.tables)
        note = impl.note(w)
    except Exception as exc:  # noqa: BLE001
        return [_row(w, d, impl.name, "error", _exc_text(exc))
                for d in DIRECTIONS[:1 + (not w.decode)]]
    errs = check(w, fn, tm.sets[0], tm.ref, torch) if tm.ref is not None else {}
    if w.decode:
        # Copies: an in-place implementation must not change the next one's inputs.
        args = [(s["qkv"].clone(), s["q_weight"], s["k_weight"]) for s in tm.sets]
        return [_timed(tm, "fwd", impl.name, fn, args, errs, note, torch),
                _timed(tm, "graph", f"{impl.name} (CUDA graph)", fn, args, errs, note,
                       torch)]
    args = [tuple(s[n] for n in _NAMES) for s in tm.sets]
    rows = [_timed(tm, "fwd", impl.name, fn, args, errs, note, torch)]
    try:
        calls = _backward_calls(fn, tm.sets, torch)
    except Exception as exc:  # noqa: BLE001
        return rows + [_row(w, "bwd", impl.name, "error", _exc_text(exc))]
    rows.append(_timed(tm, "bwd", impl.name, lambda g: g(), calls, errs,
                       note + "; autograd backward, weight gradients included", torch))
    del calls
    return rows


def _free(torch) -> None:
    import cupy

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def workload_rows(w: NormWorkload, impls: list, reps: int, n_sets: int, warmup: int,
                  check_values: bool, torch) -> list:
    """Every implementation's rows on one workload, with the same-run copy."""
    tables = make_tables(w, torch)
    sets = [make_set(w, torch) for _ in range(n_sets)]
    directions = ("fwd",) if w.decode else DIRECTIONS
    copy_us = {d: harness.copy_ms(w.copy_bytes(d), n_sets, reps) * 1e3 for d in directions}
    ref = reference(w, sets[0], tables, torch) if check_values else None
    tm = Timing(w, tables, sets, copy_us, ref, reps, warmup)
    rows = []
    for impl, reason in impls:
        if reason:
            rows += [_row(w, d, impl.name, "n/a", reason, copy_us=copy_us[d])
                     for d in directions]
            continue
        rows += impl_rows(tm, impl, torch)
        _free(torch)
    del tm, sets, ref
    _free(torch)
    _add_compile_ratio(rows)
    return rows


def _add_compile_ratio(rows) -> None:
    """``x_compile``: torch.compile's time over each row's, per direction
    (decode graph rows against the compiled module's graph row)."""
    def key(r):
        return r["direction"], r["implementation"].endswith("(CUDA graph)")

    compiled = {key(r): r["us"] for r in rows
                if r["implementation"].startswith(COMPILE) and r["status"] == "ok"}
    for r in rows:
        base = compiled.get(key(r))
        r["x_compile"] = base / r["us"] if base and r["us"] else None


def select_impls(peers: str) -> list:
    """(implementation, None or why it does not run) for cupy-rope and the peers asked."""
    impls = implementations()
    if peers == "none":
        wanted = {OURS}
    elif peers == "all":
        wanted = {i.name for i in impls}
    else:
        wanted = {OURS, *peers.split(",")}
        unknown = wanted - {i.name for i in impls}
        if unknown:
            raise ValueError(f"unknown peer {', '.join(sorted(unknown))}: expected some of "
                             + ", ".join(PEER_NAMES))
    return [(i, i.available()) for i in impls if i.name in wanted]


def run(workloads=WORKLOADS, peers="all", reps=30, n_sets=3, warmup=5, check_values=True):
    """Every row of ``workloads`` (a dict: device, versions, rows)."""
    import torch

    impls = select_impls(peers)
    for impl, reason in impls:
        if reason:
            _log(f"{impl.name}: not run ({reason})")
    rows = []
    for w in workloads:
        _log(f"{w.name}: {w.title}")
        rows += workload_rows(w, impls, reps, n_sets, warmup, check_values, torch)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


# ----------------------------------------------------------------------------
# Output.


def format_table(result) -> str:
    f = harness.fmt
    return "\n".join([
        f"# {result['device']}, torch {result['torch']}; median GPU microseconds per call; "
        "x compile > 1: faster than torch.compile", "",
        harness.markdown_table(
            ["workload", "dir", "implementation", "us:", "of copy:", "x compile:", "status",
             "note"],
            [[r["workload"], r["direction"], r["implementation"], f(r["us"], ".1f"),
              f(r["of_copy"], ".3f"), f(r.get("x_compile"), ".2f"), r["status"], r["note"]]
             for r in result["rows"]])])


def csv_rows(result) -> list:
    """The timed rows in the columns of results/runs.csv, less the run fields."""
    return [harness.csv_row(f"qk-norm {r['workload']}", r["dtype"], r["shape"],
                            r["implementation"], r["direction"], r["us"], r["copy_us"])
            for r in result["rows"] if r["status"] == "ok"]


def _parser():
    ap = harness.parser("norm_bench", __doc__)
    ap.add_argument("--workloads", help="comma-separated workload names (see --list)")
    harness.add_peers_arg(ap, PEER_NAMES)
    harness.add_rows_json_arg(ap)
    harness.add_timing_args(ap)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the check against the float32 formula")
    harness.add_list_arg(ap)
    return ap


def main(argv=None) -> int:
    args, workloads, status = harness.start(
        _parser(), argv, lambda a: select(a.workloads),
        lambda w: f"{w.name:18s} {w.shape_text:28s} {w.title}", "norm_bench")
    if status is not None:
        return status
    result = run(workloads, args.peers, args.reps, args.sets, check_values=not args.no_check)
    print(format_table(result))
    if args.json:
        harness.write_rows(args.json, csv_rows(result), result["device"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
