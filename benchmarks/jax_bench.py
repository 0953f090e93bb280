"""JAX under ``jit``: cupy-rope against the ``jnp`` formula XLA fuses (issue 33).

``python -m benchmarks.jax_bench`` (a GPU; about a minute) prints, per row,
microseconds per call of back-to-back calls of one jitted function (the
median of several rounds), forward and ``jax.vjp`` (the backward given a
cotangent):

- ``copy``: XLA negating the row's inputs (the same bytes read and written),
  the memory roofline measured in the same run;
- ``formula``: the rotation written with ``jnp`` (cos/sin rows gathered at
  the positions), which XLA fuses into one kernel;
- ``cupy-rope``: :mod:`cupy_rope.jax` as it lowers here, and the ``path``
  it took (``xla``: jaxlib's kernel launcher, no Python at execution time;
  ``callback``: ``buffer_callback``);
- ``callback``: cupy-rope forced onto ``buffer_callback``
  (``CUPY_ROPE_JAX_LAUNCH=callback``), for comparison.

Rows: bf16 sbhd [4096,1,128,128] and [512,32,24,128]; Llama-3-8B prefill q
[4,4096,32,128] + k [4,4096,8,128] in one call; a decode step (64 tokens, thd,
q32/k8, at positions into [8192, 64] tables); and a jitted 8-layer toy model
(projections, RoPE, ``jax.nn.dot_product_attention``), forward and a
gradient step, with the formula and with cupy-rope.

These are host timings of back-to-back jitted calls (``per_call_us``,
``interleaved_us``), not ``benchmarks/harness.py``'s event timing; the rows,
the table and the command line are the harness's. Without a CUDA device it
says so in one line and exits with status 2.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

import cupy_rope.jax as crj
from benchmarks import harness

F32 = jnp.float32


class Row(NamedTuple):
    """One benchmark row: its inputs and the function of each implementation."""

    name: str
    args: tuple  # the data arrays (x, or q and k)
    formula: Callable
    ours: Callable


def tables(rows: int, d: int):
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    theta = np.arange(rows)[:, None] * inv
    return jnp.asarray(np.cos(theta), F32), jnp.asarray(np.sin(theta), F32)


def rotate(x, c, s):
    """The NeoX rotation of x [..., d] by angles whose cos, sin broadcast as [..., d/2]."""
    h = x.shape[-1] // 2
    a, b = x[..., :h].astype(F32), x[..., h:].astype(F32)
    return jnp.concatenate([a * c - b * s, b * c + a * s], -1).astype(x.dtype)


def bf16(key: int, shape):
    return jax.random.normal(jax.random.PRNGKey(key), shape, F32).astype(jnp.bfloat16)


# ------------------------------------------------------------------- rows --
def sbhd_row(shape, label: str = "sbhd") -> Row:
    cos, sin = tables(shape[0], shape[-1])
    c, s = cos[:, None, None, :], sin[:, None, None, :]
    return Row(f"{label} {list(shape)}", (bf16(0, shape),),
               lambda x: rotate(x, c, s),
               lambda x: crj.rope(x, cos, sin, layout="sbhd"))


def prefill_row() -> Row:
    b, t, d = 4, 4096, 128
    cos, sin = tables(t, d)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return Row("Llama-3-8B prefill q+k", (bf16(1, (b, t, 32, d)), bf16(2, (b, t, 8, d))),
               lambda q, k: (rotate(q, c, s), rotate(k, c, s)),
               lambda q, k: crj.rope_qk(q, k, cos, sin))


def decode_row(tokens: int = 64) -> Row:
    cos, sin = tables(8192, 128)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 8192, tokens), jnp.int32)

    def formula(q, k):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        return rotate(q, c, s), rotate(k, c, s)

    return Row(f"decode step, {tokens} tokens q+k", (bf16(3, (tokens, 32, 128)),
                                                      bf16(4, (tokens, 8, 128))),
               formula, lambda q, k: crj.rope_qk(q, k, cos, sin, positions=pos, layout="thd"))


# ----------------------------------------------------------------- timing --
def per_call_us(f, args, rounds: int = 5, target_s: float = 0.05) -> float:
    """Median over ``rounds`` of the time per call of back-to-back calls."""
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    n = int(min(2000, max(10, target_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times) * 1e6


ROUNDS = [9]  # interleaved rounds per timing (--rounds)


def interleaved_us(variants, rounds: int = 0, target_s: float = 0.02) -> list:
    """Median time per call of each ``(f, args)``, timed in interleaved rounds
    (each round one pass of every variant in turn), so that a slow phase of
    the host falls on all of them alike."""
    counts = []
    for f, args in variants:
        jax.block_until_ready(f(*args))
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        counts.append(int(min(2000, max(10, target_s / max(time.perf_counter() - start, 1e-6)))))
    times = [[] for _ in variants]
    for _ in range(rounds or ROUNDS[0]):
        for i, ((f, args), n) in enumerate(zip(variants, counts)):
            start = time.perf_counter()
            for _ in range(n):
                out = f(*args)
            jax.block_until_ready(out)
            times[i].append((time.perf_counter() - start) / n)
    return [statistics.median(t) * 1e6 for t in times]


def vjp_of(fn):
    """The jitted backward of ``fn``: its vjp applied to a cotangent."""
    return jax.jit(lambda args, cts: jax.vjp(fn, *args)[1](cts))


def path_of(fn, args) -> str:
    hlo = jax.jit(fn).lower(*args).as_text()
    if any(t in hlo for t in (crj.xla.PTX_TARGET,) + crj.xla.TRITON_TARGETS):
        return "xla"
    return "callback" if "xla_buffer_python_gpu_callback" in hlo else "?"


def with_mode(mode, make):
    """``make()`` with cupy-rope lowering by ``mode`` (traced and compiled inside)."""
    saved, crj.xla.MODE = crj.xla.MODE, mode
    try:
        return make()
    finally:
        crj.xla.MODE = saved


def max_difference(row: Row) -> float:
    """The largest |cupy-rope - formula| over the row's outputs."""
    got = jax.tree_util.tree_leaves(jax.jit(row.ours)(*row.args))
    want = jax.tree_util.tree_leaves(jax.jit(row.formula)(*row.args))
    return max(float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32)))) for a, b in zip(got, want))


def time_row(row: Row) -> list:
    """[(direction, copy, formula, ours, path, callback)] for ``row``."""
    args = row.args
    copy = jax.jit(lambda *a: tuple(-x for x in a))
    cts = tuple(jnp.ones_like(a) for a in args)
    cts = cts[0] if len(cts) == 1 else cts
    out = []
    fwd = [jax.jit(row.formula), jax.jit(row.ours)]
    bwd = [vjp_of(row.formula), vjp_of(row.ours)]
    # fresh functions: a program traced or compiled for the other mode is not reused
    slow_f = with_mode("callback", lambda: jax.jit(lambda *a: row.ours(*a)).lower(*args)
                       .compile())
    slow_b = with_mode("callback", lambda: vjp_of(lambda *a: row.ours(*a)).lower(args, cts)
                       .compile())
    path = path_of(row.ours, args)
    c, f, o, cb = interleaved_us([(copy, args), (fwd[0], args), (fwd[1], args), (slow_f, args)])
    out.append(("forward", c, f, o, path, cb))
    b_args = (args, cts)
    c, f, o, cb = interleaved_us([(copy, args), (bwd[0], b_args), (bwd[1], b_args),
                                  (slow_b, b_args)])
    out.append(("vjp", c, f, o, path, cb))
    return out


# -------------------------------------------------------------- toy model --
class ToyModel(NamedTuple):
    """An 8-layer attention stack: per layer q, k, v projections, RoPE on q
    and k, causal ``jax.nn.dot_product_attention`` (GQA), output projection
    and residual."""

    batch: int = 2
    tokens: int = 2048
    width: int = 2048
    q_heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    layers: int = 8

    def params(self):
        d, hd = self.width, self.head_dim
        shapes = [(d, self.q_heads * hd), (d, self.kv_heads * hd), (d, self.kv_heads * hd),
                  (self.q_heads * hd, d)]
        return [[bf16(100 + 4 * i + j, s) * (1.0 / np.sqrt(s[0])) for j, s in enumerate(shapes)]
                for i in range(self.layers)]

    def step(self, rope_qk):
        b, t, hd = self.batch, self.tokens, self.head_dim

        def forward(params, h):
            for wq, wk, wv, wo in params:
                q = (h @ wq).reshape(b, t, self.q_heads, hd)
                k = (h @ wk).reshape(b, t, self.kv_heads, hd)
                v = (h @ wv).reshape(b, t, self.kv_heads, hd)
                q, k = rope_qk(q, k)
                a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
                h = h + a.reshape(b, t, self.q_heads * hd) @ wo
            return h

        return forward


def model_rows(model: ToyModel = ToyModel()) -> list:
    """[(direction, formula, ours, path, callback)] of the toy model."""
    cos, sin = tables(model.tokens, model.head_dim)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    formula = model.step(lambda q, k: (rotate(q, c, s), rotate(k, c, s)))

    def make_ours():
        return model.step(lambda q, k: crj.rope_qk(q, k, cos, sin))

    params, h = model.params(), bf16(99, (model.batch, model.tokens, model.width))

    def grad_of(fwd):
        return jax.jit(jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(F32) ** 2)))

    ours = make_ours()
    path = path_of(ours, (params, h))
    slow_f = with_mode("callback", lambda: jax.jit(make_ours()).lower(params, h).compile())
    slow_g = with_mode("callback", lambda: grad_of(make_ours()).lower(params, h).compile())
    args = (params, h)
    return [("forward", per_call_us(jax.jit(formula), args), per_call_us(jax.jit(ours), args),
             path, per_call_us(slow_f, args)),
            ("grad step", per_call_us(grad_of(formula), args), per_call_us(grad_of(ours), args),
             path, per_call_us(slow_g, args))]


# ------------------------------------------------------------------- main --
def csv_rows(workload: str, shape: str, direction: str, copy, timings: dict) -> list:
    """Rows in results/runs.csv's columns (less the run's fields) for one
    timed row: ``timings`` maps each implementation to its microseconds."""
    return [harness.csv_row(workload, "bfloat16", shape, impl, direction, us, copy)
            for impl, us in timings.items()]


def _shape_of(args) -> str:
    return "+".join("x".join(str(n) for n in a.shape) for a in args)


def main(argv=None) -> int:
    """Print the table (module docstring); ``--no-model`` skips the toy model,
    ``--json PATH`` also writes the rows for benchmarks.record."""
    parser = harness.parser("jax_bench", __doc__)
    parser.add_argument("--no-model", action="store_true", help="skip the toy model rows")
    parser.add_argument("--rows", default="", help="only the rows whose name has this text")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per timing")
    harness.add_rows_json_arg(parser)
    opts = parser.parse_args(argv)
    status = harness.no_gpu("jax_bench")
    if status is not None:
        return status
    ROUNDS[0] = opts.rounds
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; microseconds per call "
          f"(median of {opts.rounds} interleaved rounds of back-to-back calls); "
          "ours/formula < 1 is faster")
    print(harness.markdown_header(["row", "direction", "copy", "formula", "cupy-rope",
                                   "ours/formula", "path", "callback", "max diff"]))
    rows = [sbhd_row((4096, 1, 128, 128)), sbhd_row((512, 32, 24, 128)), prefill_row(),
            decode_row(64), decode_row(1), sbhd_row((64, 1, 32, 128), "decode-sized sbhd")]
    out = []
    for row in (r for r in rows if opts.rows in r.name):
        diff = max_difference(row)
        for direction, copy, formula, ours, path, slow in time_row(row):
            print(harness.markdown_row([row.name, direction, f"{copy:.1f}", f"{formula:.1f}",
                                        f"{ours:.1f}", f"{ours / formula:.3f}", path,
                                        f"{slow:.1f}", f"{diff:.3g}"]), flush=True)
            out += csv_rows(f"jax {row.name}", _shape_of(row.args), direction, copy,
                            {"jnp formula (jax)": formula, f"cupy-rope (jax, {path})": ours,
                             "cupy-rope (jax, callback)": slow})
    if crj.xla.last_refusal[0]:
        print(f"# last call the fast path refused: {crj.xla.last_refusal[0]}")
    if not opts.no_model and opts.rows in "toy model, 8 layers":
        for direction, formula, ours, path, slow in model_rows():
            print(harness.markdown_row(["toy model, 8 layers", direction, "-", f"{formula:.1f}",
                                        f"{ours:.1f}", f"{ours / formula:.3f}", path,
                                        f"{slow:.1f}", "-"]), flush=True)
            out += csv_rows("jax toy model, 8 layers", "", direction, None,
                            {"jnp formula (jax)": formula, f"cupy-rope (jax, {path})": ours,
                             "cupy-rope (jax, callback)": slow})
    if opts.json:
        harness.write_rows(opts.json, out, jax.devices()[0].device_kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
