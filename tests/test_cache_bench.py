"""benchmarks/cache_bench.py: workloads, page tables, bytes, the check, rows and
output on the CPU (cupy-rope's NumPy path on torch CPU tensors); one tiny
workload end to end on the GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import cache_bench as cb
from benchmarks import harness, record
from benchmarks.record import COLUMNS

TINY = cb.CacheWorkload("tiny-prefill", "", tokens=12, n_seqs=3, decode=False, q_heads=4,
                        kv_heads=2, head_dim=16, block_size=4, num_blocks=16)
TINY_DECODE = cb.CacheWorkload("tiny-decode", "", tokens=3, n_seqs=3, decode=True, q_heads=4,
                               kv_heads=2, head_dim=16, block_size=4, num_blocks=8192)


def test_workloads_as_the_issue_states():
    by = {w.name: w for w in cb.WORKLOADS}
    assert set(by) == {"cache-prefill-t16384", "cache-decode-t1", "cache-decode-t16",
                       "cache-decode-t64"}
    pre = by["cache-prefill-t16384"]
    assert (pre.tokens, pre.q_heads, pre.kv_heads, pre.head_dim) == (16384, 32, 8, 128)
    assert [by[f"cache-decode-t{t}"].tokens for t in (1, 16, 64)] == [1, 16, 64]
    assert cb.select_workloads(["decode"]) == [by[f"cache-decode-t{t}"] for t in (1, 16, 64)]


def test_bytes_are_the_fused_ops_own():
    w = cb.WORKLOADS[0]
    q, kv = 16384 * 32 * 128, 16384 * 8 * 128
    # q, k, v read and q written in bf16; k and v stored in the cache's dtype
    assert w.moved_bytes(2) == 2 * (2 * q + 2 * kv) + 2 * 2 * kv
    assert w.moved_bytes(1) == 2 * (2 * q + 2 * kv) + 2 * kv
    assert w.copy_bytes(1) == w.moved_bytes(1) // 2


def test_page_table_pages_distinct_and_lengths_kept():
    lengths = np.array([5, 16, 17, 1])
    t = cb.page_table(lengths, 4, 64, seed=3)
    pages = np.diff(t.kv_indptr)
    assert list(pages) == [2, 4, 5, 1]
    assert len(set(t.kv_indices.tolist())) == len(t.kv_indices) == pages.sum()
    assert list((pages - 1) * 4 + t.kv_last_page_len) == list(lengths)
    with pytest.raises(ValueError, match="pages needed"):
        cb.page_table([100], 4, 8)


def test_positions_of_prefill_and_decode():
    lengths = cb.sequence_lengths(TINY)
    assert list(lengths) == [4, 4, 4]
    assert list(cb.token_positions(TINY, lengths)) == [0, 1, 2, 3] * 3
    dl = cb.sequence_lengths(TINY_DECODE)
    assert list(cb.token_positions(TINY_DECODE, dl)) == list(dl - 1)
    assert dl.min() >= 1 and dl.max() <= cb.MAX_POSITION


@pytest.mark.parametrize("cache_dtype", cb.CACHE_DTYPES)
@pytest.mark.parametrize("w", [TINY, TINY_DECODE], ids=["prefill", "decode"])
def test_unfused_chain_passes_the_check_and_a_wrong_call_fails(w, cache_dtype):
    """The reference and the check, through the eager chain on CPU tensors:
    the chain agrees; a call that stores k unrotated is caught."""
    torch = pytest.importorskip("torch")
    ctx = cb.make_context(w, cache_dtype, torch, device="cpu")
    base = cb.make_set(ctx, torch)
    slots = ctx.slots.tolist()
    assert len(set(slots)) == len(slots) and min(slots) >= 0
    assert cb.check(ctx, cb.chain_call(ctx, torch), base, torch) <= cb.CHECK_TOLERANCE[cache_dtype]

    def unrotated_k(s):
        cb.chain_call(ctx, torch)(s)
        flat = cb._flat(s["k_cache"], cache_dtype, torch)
        flat.index_copy_(0, ctx.slots, cb._quantized(base["k"].clone(), ctx.k_scale,
                                                      cache_dtype, torch))

    assert cb.check(ctx, unrotated_k, base, torch) > cb.CHECK_TOLERANCE[cache_dtype]


def _row(impl, us, note="", workload="cache-prefill-t16384", graph=None):
    r = {"workload": workload, "cache_dtype": "bfloat16", "shape": "16384x32x8x128",
         "implementation": impl, "microseconds": us, "copy_microseconds": 135.0, "note": note}
    if graph is not None:
        r["graph_microseconds"] = graph
    return r


def test_rows_ratios_acceptance_and_output():
    rows = cb.finish_rows([_row(cb.FUSED, 140.0), _row(cb.CHAIN, 228.0),
                           _row(cb.COMPILED, 100.0, note="mismatch: error 1 (not counted)")])
    fused = rows[0]
    assert fused["fraction_of_copy"] == pytest.approx(135 / 140)
    assert fused["vs_best_unfused"] == pytest.approx(140 / 228)  # the mismatch is not best
    assert [status for status, _ in cb.acceptance(rows)] == ["PASS"]
    slow = cb.finish_rows([_row(cb.FUSED, 200.0), _row(cb.CHAIN, 228.0)])
    assert cb.acceptance(slow)[0][0] == "FAIL"
    dec = cb.finish_rows([_row(cb.FUSED, 4.0, workload="cache-decode-t1", graph=2.5),
                          _row(cb.CHAIN, 13.0, workload="cache-decode-t1", graph=8.0)])
    assert cb.acceptance(dec)[0][0] == "PASS"
    dec[0]["graph_microseconds"] = 3.5
    assert cb.acceptance(dec)[0][0] == "FAIL"
    table = cb.format_table(rows + dec)
    assert table.count("\n") == 1 + len(rows + dec) and "| 0.964 |" in table
    csv = harness.with_run_fields(cb.csv_rows(rows + dec), date="2026-11-27", run="r",
                                  commit="abc", gpu="H100")
    assert all(list(r) == list(COLUMNS) for r in csv)
    graph_rows = [r for r in csv if r["direction"] == "host"]
    assert [r["implementation"] for r in graph_rows] == [
        f"{cb.FUSED} CUDA graph replay", f"{cb.CHAIN} CUDA graph replay"]
    assert [r["copy_microseconds"] for r in graph_rows] == ["", ""]
    assert csv[0]["workload"] == "cache-prefill-t16384-bfloat16"
    assert (csv[0]["microseconds"], csv[0]["fraction_of_copy"]) == ("140.000", "0.9643")


def test_json_rows_are_recordable(tmp_path):
    """--json's file, as benchmarks.record reads a run's NAME.rows.json."""
    rows = cb.finish_rows([_row(cb.FUSED, 140.0), _row(cb.CHAIN, 228.0)])
    harness.write_rows(tmp_path / "cache.rows.json", cb.csv_rows(rows), "H100", run="x",
                       details=rows)
    info = record.RunInfo(run="r", date="2030-01-01", commit="abc", gpu="")
    got = record.extra_rows(tmp_path, info)
    assert [(r["implementation"], r["microseconds"], r["gpu"], r["run"]) for r in got] == [
        (cb.FUSED, "140.000", "H100", "r"), (cb.CHAIN, "228.000", "H100", "r")]


def test_cli_list(capsys):
    assert cb.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(w.name in out for w in cb.WORKLOADS)


def test_main_past_the_device_check_prints_and_writes_rows(tmp_path, monkeypatch, capsys):
    """main() as tools/gpu_suite.sh calls it, with each workload's timing
    replaced by fixed rows: the table, the acceptance lines and --json."""
    torch = pytest.importorskip("torch")
    from cupy_rope import interop

    seen = []

    def fake_run_workload(w, cache_dtype, *, reps, n_sets, graph):
        seen.append((w.name, cache_dtype, reps, n_sets, graph))
        return cb.finish_rows([_row(cb.FUSED, 4.0, workload=w.name, graph=2.5),
                               _row(cb.CHAIN, 13.0, workload=w.name, graph=8.0)])

    monkeypatch.setattr(interop, "require_cuda", lambda what: None)
    monkeypatch.setattr(cb, "run_workload", fake_run_workload)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    path = tmp_path / "cache.rows.json"
    argv = ["--filter", "decode-t1$", "--cache", "bfloat16", "--reps", "5", "--json", str(path),
            "--run", "mine"]
    assert cb.main(argv) == 0
    assert seen == [("cache-decode-t1", "bfloat16", 5, 3, True)]
    out = capsys.readouterr().out
    assert "| cache-decode-t1 | bfloat16 | cupy-rope fused | 4.00 |" in out
    assert "PASS  cache-decode-t1 bfloat16" in out
    data = json.loads(path.read_text())
    assert (data["device"], data["columns"]) == ("Fake GPU", list(COLUMNS))
    assert {r["run"] for r in data["rows"]} == {"mine"} and len(data["rows"]) == 4
    assert [a[0] for a in data["acceptance"]] == ["PASS"] and len(data["details"]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("w", [TINY, TINY_DECODE], ids=["prefill", "decode"])
def test_tiny_workload_on_gpu(w, tmp_path):
    rows = []
    for cd in cb.CACHE_DTYPES:
        rows += cb.run_workload(w, cd, reps=3, n_sets=2, warmup=1, graph=True)
    for r in rows:
        assert r["microseconds"] and r["microseconds"] > 0, r
        assert not r["note"].startswith(("mismatch", "error")), r
        assert r["check_error"] <= cb.CHECK_TOLERANCE[r["cache_dtype"]]
        if w.decode and r["implementation"] != cb.COMPILED:
            assert r["graph_microseconds"] > 0, r
    assert [r["implementation"] for r in rows] == [cb.FUSED, cb.CHAIN, cb.COMPILED] * 2
    json.dumps(cb.csv_rows(rows))
