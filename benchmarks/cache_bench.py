"""Benchmark of the fused RoPE + KV-cache write (issue 32) against the unfused chains.

Run it from the repository root on a machine with a CUDA GPU::

    python -m benchmarks.cache_bench                       # every row, a Markdown table
    python -m benchmarks.cache_bench --json cache.json     # also the rows, runs.csv's columns
    python -m benchmarks.cache_bench --filter decode --cache bfloat16

Without a CUDA device it says so in one line and exits with status 2.

What it measures
----------------
Llama-3-8B attention shapes (q 32 heads, k and v 8 heads, d 128, bf16, NeoX
pairs, an fp32 vLLM-style cos|sin cache [8192, 128], int64 positions and
slots), a paged NHD cache of 16-token blocks in bf16 and in FP8 (e4m3 with
per-tensor scales): a prefill of 16384 tokens (4 sequences of 4096, on pages
drawn at random) and decode steps of 1, 16 and 64 tokens (one per sequence,
at random positions). Per row:

* ``cupy-rope fused``: ``cupy_rope.kv_cache.apply_rope_and_cache(..., inplace=True)``,
  one launch: q rotated in place, rotated k and v stored at their slots;
* ``cupy-rope + index_copy_``: the chain a user writes without it,
  ``apply_rope_qk(..., inplace=True)`` then ``index_copy_`` of k and of v
  into the cache seen as [slots, hk, d] (FP8: divided by the scale, clamped
  to the format's range and converted first, then copied as bytes);
* ``torch.compile rotation + scatter``: the same written with torch
  operations (the rotate-half formula on gathered bf16 tables) and compiled.

Times, the copy roofline and CUDA-graph replay are measured as
``benchmarks/harness.py`` describes: a time is the median over ``--reps``
calls between CUDA events, queued behind a spinning kernel, rotating among
``--sets`` input sets (q, k, v and caches of their own). "of copy" is a
device-to-device copy of the fused op's own bytes (q, k, v read; q written;
k and v written in the cache's dtype; tables, positions and slots not
counted), timed the same way in the same run, over the row's time.
"vs unfused" is the row's time over the best unfused chain's. Decode rows of
the fused op and of the eager chain also give the GPU time per call of
``GRAPH_CALLS`` calls captured in one CUDA graph and replayed. Every
implementation is first checked against a float32 torch reference (q and
the written cache rows); a mismatch is marked and not counted as best.

After the table, one PASS/FAIL line per fused row against issue 32's
targets: prefill at least 0.90 of copy and at most 0.7 of the best unfused
chain's time; decode at most 6 us of GPU time and 3 us per call replayed.
``--json`` writes ``device``, ``columns``, ``rows`` (results/runs.csv's
columns: direction ``fwd`` for the timed rows, ``host`` for the CUDA-graph
rows, as benchmarks/record.py records bench.py's), ``details`` (every
field) and ``acceptance``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import numpy as np

from benchmarks import harness
from benchmarks.bench import decode_positions, rope_tables
from benchmarks.harness import copy_ms, time_call

FUSED = "cupy-rope fused"
CHAIN = "cupy-rope + index_copy_"
COMPILED = "torch.compile rotation + scatter"
UNFUSED = (CHAIN, COMPILED)
CACHE_DTYPES = ("bfloat16", "float8_e4m3fn")
#: max |impl - reference| / max |reference| accepted, per cache dtype (FP8
#: e4m3: one step of its 3-bit mantissa, since the chains round twice).
CHECK_TOLERANCE = {"bfloat16": 2e-2, "float8_e4m3fn": 0.13}
FP8_MAX = 448.0
GRAPH_CALLS = 100
GRAPH_REPLAYS = 20
MAX_POSITION = 8192
#: The issue's targets (H100): prefill at least this fraction of copy and at
#: most this fraction of the best unfused chain; decode GPU time and graph
#: replay per call at most these microseconds.
PREFILL_OF_COPY, PREFILL_VS_UNFUSED = 0.90, 0.7
DECODE_US, GRAPH_US = 6.0, 3.0


_log = harness.logger("cache_bench")


# ----------------------------------------------------------------------------
# Workloads (plain data; nothing here needs a GPU).


class CacheWorkload(NamedTuple):
    """One shape: ``tokens`` new tokens in ``n_seqs`` sequences (prefill: all
    of each sequence; decode: one token per sequence)."""

    name: str
    title: str
    tokens: int
    n_seqs: int
    decode: bool
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 4096
    itemsize: int = 2  # q, k, v: bf16

    @property
    def shape(self) -> str:
        return f"{self.tokens}x{self.q_heads}x{self.kv_heads}x{self.head_dim}"

    def moved_bytes(self, cache_itemsize: int) -> int:
        """Bytes the fused op must move: q, k, v read, q written, k and v stored."""
        q = self.tokens * self.q_heads * self.head_dim
        kv = self.tokens * self.kv_heads * self.head_dim
        return (2 * q + 2 * kv) * self.itemsize + 2 * kv * cache_itemsize

    def copy_bytes(self, cache_itemsize: int) -> int:
        """Size of the device copy moving the same bytes (it reads and writes each)."""
        return self.moved_bytes(cache_itemsize) // 2


WORKLOADS = [
    CacheWorkload("cache-prefill-t16384", "Llama-3-8B prefill: 4 sequences of 4096 tokens, "
                  "q32/k8/v8 d128", 16384, 4, decode=False),
    *[CacheWorkload(f"cache-decode-t{t}", f"decode q32/k8/v8 d128, {t} sequence(s) of one new "
                    "token at random positions", t, t, decode=True,
                    num_blocks=t * MAX_POSITION // 16) for t in (1, 16, 64)],
]


def select_workloads(filters=None) -> list:
    """The workloads whose name matches any of the regular expressions (all if none)."""
    return harness.matching(WORKLOADS, filters)


class PageTable(NamedTuple):
    """FlashInfer's description of paged sequences (host int32 arrays)."""

    kv_indptr: np.ndarray        # [n_seqs + 1]: each sequence's pages in kv_indices
    kv_indices: np.ndarray       # the page (block) numbers, in order
    kv_last_page_len: np.ndarray  # [n_seqs]: tokens in each sequence's last page


def page_table(lengths, block_size: int, num_blocks: int, seed: int = 0) -> PageTable:
    """Sequences of ``lengths`` tokens on distinct pages drawn at random."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pages = -(-lengths // block_size)
    if pages.sum() > num_blocks:
        raise ValueError(f"{int(pages.sum())} pages needed, the cache has {num_blocks}")
    indices = np.random.default_rng(seed).permutation(num_blocks)[:pages.sum()]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    last = lengths - (pages - 1) * block_size
    return PageTable(indptr.astype(np.int32), indices.astype(np.int32), last.astype(np.int32))


def sequence_lengths(w: CacheWorkload) -> np.ndarray:
    """Every sequence's length including its new tokens, and the new tokens' positions."""
    if w.decode:
        return decode_positions(w.n_seqs, MAX_POSITION) + 1
    return np.full(w.n_seqs, w.tokens // w.n_seqs, dtype=np.int64)


def token_positions(w: CacheWorkload, lengths: np.ndarray) -> np.ndarray:
    """int64 positions of the new tokens: the last token of each sequence
    (decode) or all of them (prefill)."""
    if w.decode:
        return (lengths - 1).astype(np.int64)
    return np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)


# ----------------------------------------------------------------------------
# Inputs and implementations (GPU, torch).


class Context(NamedTuple):
    """One workload's shared, read-only device data."""

    w: CacheWorkload
    cache_dtype: str
    positions: Any       # int64 [T]
    slots: Any           # int64 [T]
    cos_sin_cache: Any   # float32 [MAX_POSITION, d]: cos | sin
    cos_full: Any        # bf16 [MAX_POSITION, d]: duplicated halves (the torch formula's)
    sin_full: Any
    k_scale: float
    v_scale: float
    device: str = "cuda"


def make_context(w: CacheWorkload, cache_dtype: str, torch, device: str = "cuda") -> Context:
    """The workload's tables, positions and slots (``device="cpu"``: for CPU
    tests of the plumbing, where cupy-rope runs its NumPy reference)."""
    from cupy_rope.kv_cache import slot_mapping_from_page_table

    lengths = sequence_lengths(w)
    table = page_table(lengths, w.block_size, w.num_blocks)
    slots = slot_mapping_from_page_table(*table, w.block_size,
                                         new_tokens=1 if w.decode else None)
    cos, sin = rope_tables(MAX_POSITION, w.head_dim)
    dev = device
    full = [torch.from_numpy(np.concatenate([t, t], axis=1)).to(dev, torch.bfloat16)
            for t in (cos, sin)]
    fp8 = cache_dtype != "bfloat16"
    return Context(w, cache_dtype,
                   torch.from_numpy(token_positions(w, lengths)).to(dev),
                   torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(dev),
                   torch.from_numpy(np.concatenate([cos, sin], axis=1)).to(dev),
                   full[0], full[1], 0.05 if fp8 else 1.0, 0.04 if fp8 else 1.0, device)


def make_set(ctx: Context, torch) -> dict:
    """Fresh q, k, v and zeroed caches [num_blocks, block_size, hk, d]."""
    w = ctx.w
    t, hq, hk, d = w.tokens, w.q_heads, w.kv_heads, w.head_dim
    dt = getattr(torch, ctx.cache_dtype)
    cache_shape = (w.num_blocks, w.block_size, hk, d)
    dev, bf16 = ctx.device, torch.bfloat16
    return {"q": torch.randn(t, hq, d, device=dev, dtype=bf16),
            "k": torch.randn(t, hk, d, device=dev, dtype=bf16),
            "v": torch.randn(t, hk, d, device=dev, dtype=bf16),
            "k_cache": torch.zeros(cache_shape, device=dev, dtype=dt),
            "v_cache": torch.zeros(cache_shape, device=dev, dtype=dt)}


def clone_set(s: dict) -> dict:
    return {n: a.clone() for n, a in s.items()}


def _quantized(x, scale: float, cache_dtype: str, torch):
    """x as the cache stores it: itself (bf16), or FP8 bytes of x / scale clamped."""
    if cache_dtype == "bfloat16":
        return x
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return y.to(getattr(torch, cache_dtype)).view(torch.uint8)


def _flat(cache, cache_dtype: str, torch):
    """The cache as [slots, hk, d] (FP8: its bytes), for index_copy_."""
    c = cache if cache_dtype == "bfloat16" else cache.view(torch.uint8)
    return c.view(-1, c.shape[-2], c.shape[-1])


def fused_call(ctx: Context) -> Callable:
    from cupy_rope.kv_cache import apply_rope_and_cache

    scales = {} if ctx.cache_dtype == "bfloat16" else {"k_scale": ctx.k_scale,
                                                       "v_scale": ctx.v_scale}

    def call(s):
        apply_rope_and_cache(s["q"], s["k"], s["v"], s["k_cache"], s["v_cache"], ctx.slots,
                             cos_sin_cache=ctx.cos_sin_cache, positions=ctx.positions,
                             layout="thd", inplace=True, **scales)
    return call


def chain_call(ctx: Context, torch) -> Callable:
    import cupy_rope

    cd = ctx.cache_dtype

    def call(s):
        cupy_rope.apply_rope_qk(s["q"], s["k"], cos_sin_cache=ctx.cos_sin_cache,
                                positions=ctx.positions, layout="thd", inplace=True)
        _flat(s["k_cache"], cd, torch).index_copy_(0, ctx.slots,
                                                   _quantized(s["k"], ctx.k_scale, cd, torch))
        _flat(s["v_cache"], cd, torch).index_copy_(0, ctx.slots,
                                                   _quantized(s["v"], ctx.v_scale, cd, torch))
    return call


def compiled_call(ctx: Context, torch) -> Callable:
    from benchmarks.peers import rope_formula

    cd, k_scale, v_scale = ctx.cache_dtype, ctx.k_scale, ctx.v_scale

    def rotate_and_scatter(q, k, v, k_flat, v_flat, slots, cos_full, sin_full, positions):
        cos = cos_full[positions].unsqueeze(-2)
        sin = sin_full[positions].unsqueeze(-2)
        q.copy_(rope_formula(q, cos, sin))
        k_flat.index_copy_(0, slots, _quantized(rope_formula(k, cos, sin), k_scale, cd, torch))
        v_flat.index_copy_(0, slots, _quantized(v, v_scale, cd, torch))

    fn = torch.compile(rotate_and_scatter, dynamic=False, fullgraph=True)

    def call(s):
        fn(s["q"], s["k"], s["v"], _flat(s["k_cache"], cd, torch),
           _flat(s["v_cache"], cd, torch), ctx.slots, ctx.cos_full, ctx.sin_full,
           ctx.positions)
    return call


# ----------------------------------------------------------------------------
# Correctness and timing.


def reference(ctx: Context, s: dict, torch) -> tuple:
    """float32 (q rotated, k rows stored, v rows stored) as floats, from set ``s``."""
    d = ctx.w.head_dim
    pos = ctx.positions
    cos = ctx.cos_sin_cache[pos, : d // 2].repeat(1, 2).unsqueeze(-2)
    sin = ctx.cos_sin_cache[pos, d // 2:].repeat(1, 2).unsqueeze(-2)

    def rot(x):
        x = x.float()
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1) * sin

    def stored(x, scale):
        if ctx.cache_dtype == "bfloat16":
            return x.to(torch.bfloat16).float()
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(getattr(torch, ctx.cache_dtype)).float()

    return rot(s["q"]), stored(rot(s["k"]), ctx.k_scale), stored(s["v"].float(), ctx.v_scale)


def check(ctx: Context, call: Callable, base: dict, torch) -> float:
    """max |got - reference| / max |reference| over q and the written cache rows."""
    s = clone_set(base)
    want = reference(ctx, base, torch)
    call(s)
    w = ctx.w
    # Rows gathered as bytes (indexing need not support FP8), then read as values.
    rows = [c.view(torch.uint8).view(-1, w.kv_heads, w.head_dim * c.element_size())[ctx.slots]
            .view(c.dtype).float() for c in (s["k_cache"], s["v_cache"])]
    errs = [(g.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
            for g, r in zip([s["q"]] + rows, want)]
    return max(errs)


def graph_us_per_call(call: Callable, s: dict, torch, calls=GRAPH_CALLS,
                      replays=GRAPH_REPLAYS) -> float:
    """GPU microseconds per call of ``calls`` calls on set ``s`` captured in one
    CUDA graph (median over ``replays`` replays, each between its own events)."""
    return harness.graph_us_per_call(call, (s,), torch, calls, replays)


def _prepare(ctx: Context, torch) -> list:
    """(implementation, call or None, note) for every implementation."""
    out = []
    for name, make in ((FUSED, lambda: fused_call(ctx)), (CHAIN, lambda: chain_call(ctx, torch)),
                       (COMPILED, lambda: compiled_call(ctx, torch))):
        try:
            out.append((name, make(), ""))
        except Exception as exc:  # noqa: BLE001
            out.append((name, None, f"error: {harness.exc_text(exc)}"))
    return out


def _timed_row(ctx, name, call, sets, copy_us, reps, warmup, torch, graph) -> dict:
    row = {"workload": ctx.w.name, "cache_dtype": ctx.cache_dtype, "shape": ctx.w.shape,
           "implementation": name, "microseconds": None, "copy_microseconds": copy_us,
           "note": ""}
    try:
        err = check(ctx, call, sets[0], torch)
        row["check_error"] = err
        if not err <= CHECK_TOLERANCE[ctx.cache_dtype]:
            row["note"] = f"mismatch: error {err:.3g} (not counted)"
        timed = time_call(call, [(s,) for s in sets], reps, warmup)
        row["microseconds"] = timed.ms * 1e3
        if not timed.held:
            row["note"] += f"; {harness.HOST_BOUND}"
        if graph:
            row["graph_microseconds"] = graph_us_per_call(call, sets[0], torch)
    except Exception as exc:  # noqa: BLE001
        row["note"] = f"error: {harness.exc_text(exc)}"
    return row


def run_workload(w: CacheWorkload, cache_dtype: str, *, reps=30, n_sets=3, warmup=5,
                 graph=True) -> list:
    """Every implementation's row on one workload and cache dtype."""
    import torch

    ctx = make_context(w, cache_dtype, torch)
    sets = [make_set(ctx, torch) for _ in range(n_sets)]
    torch.cuda.synchronize()
    cache_itemsize = torch.empty(0, dtype=getattr(torch, cache_dtype)).element_size()
    rows = []
    # CuPy's events, spin and copy on torch's stream, where the implementations run.
    with harness.torch_stream(torch):
        copy_us = copy_ms(w.copy_bytes(cache_itemsize), n_sets, reps) * 1e3
        for name, call, note in _prepare(ctx, torch):
            if call is None:
                rows.append({"workload": w.name, "cache_dtype": cache_dtype, "shape": w.shape,
                             "implementation": name, "microseconds": None,
                             "copy_microseconds": copy_us, "note": note})
                continue
            _log(f"{w.name} {cache_dtype}: {name}")
            rows.append(_timed_row(ctx, name, call, sets, copy_us, reps, warmup, torch,
                                   graph and w.decode and name != COMPILED))
    del sets
    torch.cuda.empty_cache()
    return finish_rows(rows)


def finish_rows(rows: list) -> list:
    """Add fraction_of_copy and vs_best_unfused (the row's time over the best
    unfused chain's; mismatched or failed rows are not counted as best)."""
    ok = [r for r in rows if r["implementation"] in UNFUSED and r["microseconds"]
          and not r["note"].startswith(("mismatch", "error"))]
    best = min((r["microseconds"] for r in ok), default=None)
    for r in rows:
        us = r["microseconds"]
        r["fraction_of_copy"] = r["copy_microseconds"] / us if us else None
        r["vs_best_unfused"] = us / best if us and best else None
    return rows


# ----------------------------------------------------------------------------
# Output.


def acceptance(rows: list) -> list:
    """(status, text) for each of the issue's targets that these rows measure."""
    out = []
    for r in rows:
        if r["implementation"] != FUSED:
            continue
        where = f"{r['workload']} {r['cache_dtype']}"
        if r["microseconds"] is None:
            out.append(("FAIL", f"{where}: {r['note']}"))
            continue
        if r["workload"].startswith("cache-prefill"):
            f, v = r["fraction_of_copy"], r["vs_best_unfused"]
            good = f >= PREFILL_OF_COPY and v is not None and v <= PREFILL_VS_UNFUSED
            vs = "n/a" if v is None else f"{v:.2f}"
            out.append(("PASS" if good else "FAIL",
                        f"{where}: {f:.3f} of copy (>= {PREFILL_OF_COPY}), {vs} of the best "
                        f"unfused chain (<= {PREFILL_VS_UNFUSED})"))
        else:
            g = r.get("graph_microseconds")
            good = r["microseconds"] <= DECODE_US and g is not None and g <= GRAPH_US
            gs = "n/a" if g is None else f"{g:.2f}"
            out.append(("PASS" if good else "FAIL",
                        f"{where}: {r['microseconds']:.2f} us GPU (<= {DECODE_US}), CUDA graph "
                        f"{gs} us per call (<= {GRAPH_US})"))
    return out


def format_table(rows: list) -> str:
    f = harness.fmt
    return harness.markdown_table(
        ["workload", "cache", "implementation", "us:", "copy us:", "of copy:",
         "vs best unfused:", "graph us/call:", "note"],
        [[r["workload"], r["cache_dtype"], r["implementation"],
          f(r["microseconds"], ".2f", "n/a"), f(r["copy_microseconds"], ".2f", "n/a"),
          f(r["fraction_of_copy"], ".3f", "n/a"), f(r["vs_best_unfused"], ".2f", "n/a"),
          f(r.get("graph_microseconds"), ".2f", "n/a"), r["note"]] for r in rows])


def csv_rows(rows: list) -> list:
    """The rows in results/runs.csv's columns, less the run fields: one per
    timed row (direction ``fwd``), and one per CUDA-graph timing (direction
    ``host``, implementation ``... CUDA graph replay``, as benchmarks/record.py
    records bench.py's)."""
    out = []
    for r in rows:
        where = (f"{r['workload']}-{r['cache_dtype']}", r["cache_dtype"], r["shape"])
        if r["microseconds"] is not None:
            out.append(harness.csv_row(*where, r["implementation"], "fwd", r["microseconds"],
                                       r["copy_microseconds"]))
        if r.get("graph_microseconds") is not None:
            out.append(harness.csv_row(*where, f"{r['implementation']} CUDA graph replay",
                                       "host", r["graph_microseconds"]))
    return out


def _parser():
    ap = harness.parser("cache_bench", __doc__)
    ap.add_argument("--filter", action="append",
                    help="regular expression searched in workload names (repeatable)")
    ap.add_argument("--cache", choices=CACHE_DTYPES, action="append",
                    help="cache dtype(s) (default: both)")
    harness.add_timing_args(ap)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    harness.add_rows_json_arg(ap)
    ap.add_argument("--run", help="the run's name in the JSON rows (default cache-DATE)")
    harness.add_list_arg(ap)
    return ap


def main(argv=None) -> int:
    args, workloads, status = harness.start(
        _parser(), argv, lambda a: select_workloads(a.filter),
        lambda w: f"{w.name:22s} {w.moved_bytes(2) / 1e6:8.2f} MB (bf16 cache)  {w.title}",
        "cache_bench")
    if status is not None:
        return status
    import torch

    rows = []
    for w in workloads:
        for cd in args.cache or CACHE_DTYPES:
            rows += run_workload(w, cd, reps=args.reps, n_sets=args.sets,
                                 graph=not args.no_graph)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}\n")
    print(format_table(rows))
    print()
    for status, text in acceptance(rows):
        print(f"{status}  {text}")
    if args.json:
        harness.write_rows(args.json, csv_rows(rows), gpu,
                           run=args.run or f"cache-{harness.today()}", details=rows,
                           acceptance=acceptance(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
