"""Other RoPE implementations, run by the benchmark on the same inputs.

Each peer is used only if it can be imported in the running environment:

- ``torch-eager``: the plain PyTorch formula, NeoX rotate-half
  ``x * cos + rotate_half(x) * sin`` on full-width (duplicated halves) cos/sin
  tables in x's dtype, as Hugging Face models write it; partial rotary by
  slicing and ``cat``; per-token positions (thd, decode) by gathering table
  rows inside the timed call.
- ``torch-compile``: ``torch.compile`` of the same functions (fixed shapes).
- ``liger``: Liger-Kernel's Triton RoPE (``liger_kernel.ops.rope``), in place
  on q and k given as [b, h, s, d] views of [b, s, h, d] storage, cos/sin
  [1, s, r]; per-token tables are gathered inside the timed call.
- ``flashinfer``: ``apply_rope_with_cos_sin_cache_inplace`` (token-major q and
  k, int64 positions, fp32 [max_position, r] cos|sin cache).

The backward of every peer is the rotation by -theta written the same way
(what a hand-written autograd function does: Liger's own backward does
exactly this), not the graph that autograd would record for the forward
formula, which launches more kernels; this favours the peers.

Single-tensor workloads are given to the two-tensor peers (Liger, FlashInfer)
as two tensors holding the first and the second half of x's heads (copies
made outside the timed region), so the kernel moves exactly x's bytes in one
launch. A peer that cannot express a workload without extra copies answers
``n/a`` with the reason (an :class:`Unusable`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, NamedTuple


@dataclasses.dataclass
class Prepared:
    """One implementation bound to one workload.

    ``make_args(input_set)`` builds the positional arguments of a call from an
    input set (outside the timed region: views, or copies where the peer
    needs its own tensors); ``call[backward](*args)`` is the timed call;
    ``result(args, returned)`` gives the outputs in the workload's logical
    layout (a list: [y] or [q, k]), for the correctness check.
    """

    make_args: Callable[[dict], tuple]
    call: dict
    result: Callable[[tuple, Any], list]
    note: str = ""


class Unusable(NamedTuple):
    """Why an implementation has no timed row on a workload.

    ``status`` is ``"n/a"`` (it cannot express the workload without extra
    copies) or ``"error"`` (preparing it failed); ``reason`` says why.
    """

    status: str
    reason: str


def not_applicable(reason: str) -> Unusable:
    return Unusable("n/a", reason)


try:  # optional: without torch no peer runs
    import torch
except Exception:  # noqa: BLE001
    torch = None


# ----------------------------------------------------------------------------
# The plain formula (shared by torch-eager and torch-compile).


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_formula(x, cos, sin):
    """NeoX RoPE on the first ``cos.shape[-1]`` channels of x; the rest is
    carried over with ``cat`` (partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr = x[..., :r]
    return torch.cat((xr * cos + rotate_half(xr) * sin, x[..., r:]), dim=-1)


def rotate_every_two(x):
    """GPT-J's partner of every channel: (x0, x1) -> (-x1, x0) per pair."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope_formula_interleaved(x, cos, sin):
    """GPT-J RoPE on all of x, as GPT-J-style models write it: cos and sin
    with every angle repeated twice (f0 f0 f1 f1 ...)."""
    return x * cos + rotate_every_two(x) * sin


def _formula_x(x, cos, sin):
    return rope_formula(x, cos, sin)


def _formula_x_gather(x, cos_t, sin_t, pos):
    return rope_formula(x, cos_t[pos].unsqueeze(-2), sin_t[pos].unsqueeze(-2))


def _formula_qk(q, k, cos, sin):
    return rope_formula(q, cos, sin), rope_formula(k, cos, sin)


def _formula_qk_gather(q, k, cos_t, sin_t, pos):
    cos = cos_t[pos].unsqueeze(-2)
    sin = sin_t[pos].unsqueeze(-2)
    return rope_formula(q, cos, sin), rope_formula(k, cos, sin)


def full_tables(ctx, dtype, negate_sin=False, interleaved=False):
    """[P, r] cos and sin tables in ``dtype``: duplicated halves (HF style),
    or (interleaved) every column repeated twice."""
    if interleaved:
        cos = ctx.cos_half.repeat_interleave(2, dim=-1)
        sin = ctx.sin_half.repeat_interleave(2, dim=-1)
    else:
        cos = torch.cat((ctx.cos_half, ctx.cos_half), dim=-1)
        sin = torch.cat((ctx.sin_half, ctx.sin_half), dim=-1)
    if negate_sin:
        sin = -sin
    return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


def _torch_dtype(name):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[name]


_GATHER_NOTE = "; cos/sin rows gathered by position in the call"
_ODD_HEADS = "odd head count cannot be split into its q and k"


def _rotated_names(w):
    return ("q", "k") if w.kind in ("qk", "decode") else ("x",)


class Peer:
    name = ""

    def available(self):
        """None when usable here, else the reason it is not."""
        raise NotImplementedError

    def prepare(self, w, ctx):
        """A :class:`Prepared`, or an :class:`Unusable` saying why the workload is n/a."""
        raise NotImplementedError

    def version(self):
        return ""


class TorchFormula(Peer):
    name = "torch-eager"
    _compiled = False

    def available(self):
        if torch is None:
            return "torch not importable"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        return None

    def version(self):
        return torch.__version__

    def _fn(self, which):
        return {"x": _formula_x, "x_gather": _formula_x_gather,
                "qk": _formula_qk, "qk_gather": _formula_qk_gather,
                "x_interleaved": rope_formula_interleaved}[which]

    def prepare(self, w, ctx):
        dtype = _torch_dtype(w.dtype)
        tables = {b: full_tables(ctx, dtype, negate_sin=b, interleaved=w.interleaved)
                  for b in (False, True)}
        names = _rotated_names(w)
        gather = w.layout == "thd"
        if w.interleaved and (gather or len(names) == 2 or w.rotary_dim != w.head_dim):
            return not_applicable("the GPT-J formula here covers full rotary on one bshd/sbhd "
                                  "tensor")
        which = ("qk" if len(names) == 2 else "x") + ("_gather" if gather else "")
        which += "_interleaved" * w.interleaved
        fn = self._fn(which)
        if gather:
            pos = ctx.positions
            call = {b: (lambda *t, _c=tables[b][0], _s=tables[b][1]: fn(*t, _c, _s, pos))
                    for b in (False, True)}
        else:
            s_len = ctx.seq_len
            r = w.rotary_dim
            shape = (1, s_len, 1, r) if w.layout == "bshd" else (s_len, 1, 1, r)
            bc = {b: (tables[b][0][:s_len].view(shape), tables[b][1][:s_len].view(shape))
                  for b in (False, True)}
            call = {b: (lambda *t, _c=bc[b][0], _s=bc[b][1]: fn(*t, _c, _s))
                    for b in (False, True)}

        def make_args(s):
            return tuple(s[n] for n in names)

        def result(args, ret):
            return list(ret) if isinstance(ret, tuple) else [ret]

        return Prepared(make_args, call, result, note="out of place" + _GATHER_NOTE * gather)


class TorchCompile(TorchFormula):
    name = "torch-compile"

    def __init__(self):
        self._cache = {}

    def available(self):
        reason = super().available()
        if reason:
            return reason
        if not hasattr(torch, "compile"):
            return "torch.compile missing"
        try:
            import triton  # noqa: F401
        except Exception:  # noqa: BLE001
            return "triton not importable (inductor needs it for CUDA)"
        cfg = torch._dynamo.config
        # One compiled graph per workload shape: raise the recompile limits.
        for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(cfg, attr):
                setattr(cfg, attr, max(getattr(cfg, attr), 1024))
        return None

    def _fn(self, which):
        if which not in self._cache:
            self._cache[which] = torch.compile(super()._fn(which), dynamic=False)
        return self._cache[which]


def _torch_and(module: str):
    """None when torch sees a CUDA device and ``module`` imports, else why not."""
    reason = TorchFormula().available()
    if reason:
        return reason
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        return f"{module.partition('.')[0]} not importable ({exc.__class__.__name__}: {exc})"
    return None


class Liger(Peer):
    name = "liger"

    def available(self):
        return _torch_and("liger_kernel.ops.rope")

    def version(self):
        try:
            from importlib.metadata import version

            return version("liger-kernel")
        except Exception:  # noqa: BLE001
            return "?"

    def prepare(self, w, ctx):
        reason = self._unusable(w)
        if reason:
            return not_applicable(reason)
        call = {b: self._bind(w, ctx, b) for b in (False, True)}
        gathered = _GATHER_NOTE * (w.layout == "thd")
        if len(_rotated_names(w)) == 2:
            return Prepared(lambda s: (_liger_view(w, s["q"]), _liger_view(w, s["k"])), call,
                            lambda args, ret: [_from_liger_view(w, t) for t in ret],
                            note="in place" + gathered)
        note = "in place; x's heads split into its q and k" + gathered
        if w.strided:
            note += "; bhsd storage (Liger copies to bshd first)"
        return Prepared(lambda s: _liger_halves(w, s["x"]), call,
                        lambda args, ret: [_from_liger_halves(w, ret)], note=note)

    @staticmethod
    def _unusable(w):
        if w.interleaved:
            return "Liger's RoPE rotates NeoX halves only"
        if w.layout == "sbhd" and w.shape[1] != 1:
            return "sbhd with batch > 1 (Liger's rows are batch-major [b, s])"
        if len(_rotated_names(w)) == 1 and w.shape[-2] % 2:
            return _ODD_HEADS
        return None

    @staticmethod
    def _bind(w, ctx, backward):
        """Liger's forward or backward on (q, k) views; per-token tables
        (thd) are gathered inside the call."""
        from liger_kernel.ops.rope import rope_backward, rope_forward

        op = rope_backward if backward else rope_forward
        # Liger's backward negates sin itself: both directions take the plain tables.
        cos_t, sin_t = full_tables(ctx, _torch_dtype(w.dtype))
        if w.layout == "thd":
            pos = ctx.positions
            return lambda q, k: op(q, k, cos_t[pos].unsqueeze(0), sin_t[pos].unsqueeze(0))[:2]
        cos = cos_t[:ctx.seq_len].unsqueeze(0).contiguous()
        sin = sin_t[:ctx.seq_len].unsqueeze(0).contiguous()
        return lambda q, k: op(q, k, cos, sin)[:2]


def _to_bshd(w, t):
    """The workload's tensor as a [b, s, h, d] view."""
    if w.layout == "thd":
        return t.unsqueeze(0)
    if w.layout == "sbhd":
        return t.transpose(0, 1)
    return t


def _from_bshd(w, t):
    if w.layout == "thd":
        return t[0]
    if w.layout == "sbhd":
        return t.transpose(0, 1)
    return t


def _liger_view(w, t):
    """q or k as the [b, h, s, d] view of [b, s, h, d] storage that Liger takes."""
    return _to_bshd(w, t).transpose(1, 2)


def _from_liger_view(w, t):
    return _from_bshd(w, t.transpose(1, 2))


def _liger_halves(w, x):
    """x's first and second half of heads as Liger's q and k (copies)."""
    x = _to_bshd(w, x)
    h2 = w.shape[-2] // 2
    if w.strided:
        # bhsd storage, as the caller has it: Liger gets bhsd halves.
        st = x.transpose(1, 2)
        return (st[:, :h2].contiguous(), st[:, h2:].contiguous())
    return (x[:, :, :h2].contiguous().transpose(1, 2), x[:, :, h2:].contiguous().transpose(1, 2))


def _from_liger_halves(w, ret):
    return _from_bshd(w, torch.cat([t.transpose(1, 2) for t in ret], dim=2))


class FlashInfer(Peer):
    name = "flashinfer"

    def available(self):
        reason = _torch_and("flashinfer")
        if reason:
            return reason
        if self._fn() is None:
            return "flashinfer has no apply_rope_with_cos_sin_cache_inplace"
        return None

    def version(self):
        try:
            import flashinfer

            return getattr(flashinfer, "__version__", "?")
        except Exception:  # noqa: BLE001
            return "?"

    @staticmethod
    def _fn():
        import flashinfer

        fn = getattr(flashinfer, "apply_rope_with_cos_sin_cache_inplace", None)
        if fn is None:
            fn = getattr(getattr(flashinfer, "rope", None), "apply_rope_with_cos_sin_cache_inplace",
                         None)
        return fn

    def prepare(self, w, ctx):
        fn = self._fn()
        if w.strided:
            return not_applicable("needs token-major rows (a [b, h, s, d] view would be copied)")
        names = _rotated_names(w)
        heads, d = w.shape[-2], w.head_dim
        if len(names) == 1 and heads % 2:
            return not_applicable(_ODD_HEADS)
        caches = {}
        for b in (False, True):
            sin = -ctx.sin_half if b else ctx.sin_half
            caches[b] = torch.cat((ctx.cos_half, sin), dim=-1).float().contiguous()
        if w.layout == "thd":
            pos = ctx.positions.long()
        else:
            bsz = w.shape[0] if w.layout == "bshd" else w.shape[1]
            ar = torch.arange(ctx.seq_len, device=ctx.cos_half.device)
            pos = ar.repeat(bsz) if w.layout == "bshd" else ar.repeat_interleave(bsz)
        rows = pos.numel()
        neox = not w.interleaved
        call = {b: (lambda q2, k2, _c=caches[b]: fn(pos, q2, k2, d, _c, neox))
                for b in (False, True)}
        h2 = heads // 2
        if len(names) == 2:
            def make_args(s):
                return (s["q"].reshape(rows, -1), s["k"].reshape(rows, -1))

            def result(args, ret):
                return [args[0].view(w.shape), args[1].view(w.k_shape)]
            note = "in place"
        else:
            def make_args(s):
                x = s["x"].reshape(rows, heads, d)
                return (x[:, :h2].reshape(rows, h2 * d).contiguous(),
                        x[:, h2:].reshape(rows, (heads - h2) * d).contiguous())

            def result(args, ret):
                y = torch.cat((args[0].view(rows, h2, d), args[1].view(rows, heads - h2, d)), 1)
                return [y.view(w.shape)]
            note = "in place; x's heads split into its q and k"
        return Prepared(make_args, call, result, note=note)


#: Every peer, in the order of the table.
ALL = (TorchFormula, TorchCompile, Liger, FlashInfer)
NAMES = tuple(p.name for p in ALL)


def make(names=None):
    """Peer instances for ``names`` (None or "all": every known peer)."""
    if names is None or names == "all":
        names = NAMES
    if isinstance(names, str):
        names = [n for n in names.split(",") if n and n != "none"]
    by_name = {p.name: p for p in ALL}
    out = []
    for n in names:
        if n not in by_name:
            raise ValueError(f"unknown peer {n!r}; known: {', '.join(NAMES)}")
        out.append(by_name[n]())
    return out
