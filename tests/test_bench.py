"""The benchmark's plumbing: workload definitions, positions, the criteria,
table/JSON/plot output and the comparison of two runs (CPU); the peers'
adapters and the correctness check on the CPU with torch and stand-ins for
Liger and FlashInfer (skipped without torch); and one tiny workload end to
end on the GPU."""

from __future__ import annotations

import json
import sys
import types
from typing import NamedTuple

import numpy as np
import pytest

from benchmarks import bench, compare, peers

# ----------------------------------------------------------------------------
# Workload definitions.


def test_workload_names_unique_and_complete():
    names = [w.name for w in bench.WORKLOADS]
    assert len(names) == len(set(names))
    for n in ("sbhd-4096x1x128x128", "sbhd-512x32x24x128", "llama3-8b-prefill-qk",
              "decode-qk-t1", "decode-qk-t16", "decode-qk-t64", "diffusion-qk-d80",
              "diffusion-qk-d96", "sbhd-fp32-128x8192x1x128", "thd-n1", "thd-n128",
              "thd-n2401", "inplace-full", "partial-0.5", "partial-0.25", "bshd-contig",
              "bshd-strided"):
        assert n in names


def _w(name):
    return bench.select_workloads([name])[0]


class Expected(NamedTuple):
    """A workload's definition as the benchmark's docs state it."""

    name: str
    kind: str
    layout: str
    shape: tuple
    k_shape: tuple | None
    dtype: str
    mode: str
    seq_len: int | None
    moved_bytes: int


EXPECTED = [
    Expected("sbhd-4096x1x128x128", "single", "sbhd", (4096, 1, 128, 128), None, "bfloat16",
             "new", 4096, 2 * 2 * 4096 * 128 * 128),
    Expected("llama3-8b-prefill-qk", "qk", "bshd", (4, 4096, 32, 128), (4, 4096, 8, 128),
             "bfloat16", "new", 4096, 2 * 2 * 4 * 4096 * (32 + 8) * 128),
    Expected("decode-qk-t64", "decode", "thd", (64, 32, 128), (64, 8, 128), "bfloat16",
             "inplace", None, 2 * 2 * 64 * (32 + 8) * 128),
    Expected("sbhd-fp32-128x8192x1x128", "single", "sbhd", (128, 8192, 1, 128), None,
             "float32", "new", 128, 2 * 4 * 128 * 8192 * 128),
    Expected("diffusion-qk-d80", "qk", "bshd", (2, 4096, 24, 80), (2, 4096, 24, 80),
             "bfloat16", "new", 4096, 2 * 2 * 2 * 2 * 4096 * 24 * 80),
    Expected("diffusion-qk-d96", "qk", "bshd", (2, 4096, 24, 96), (2, 4096, 24, 96),
             "bfloat16", "new", 4096, 2 * 2 * 2 * 2 * 4096 * 24 * 96),
    Expected("thd-n2401", "thd", "thd", (65536, 32, 128), None, "bfloat16", "new", None,
             2 * 2 * 65536 * 32 * 128),
]


@pytest.mark.parametrize("want", EXPECTED, ids=[e.name for e in EXPECTED])
def test_shapes_and_bytes(want):
    w = _w(want.name)
    got = Expected(w.name, w.kind, w.layout, w.shape, w.k_shape, w.dtype, w.mode, w.seq_len,
                   w.moved_bytes())
    assert got == want
    assert w.copy_bytes() == w.moved_bytes() // 2
    assert w.rotary_dim == w.head_dim


def test_partial_rows_share_the_full_rows_shape():
    full = _w("inplace-full")
    assert full.mode == "inplace" and full.rotary_frac == 1.0
    for f, r in ((0.5, 64), (0.25, 32)):
        w = _w(f"partial-{f}")
        assert (w.shape, w.dtype, w.layout, w.mode) == (full.shape, full.dtype, full.layout,
                                                        full.mode)
        assert w.rotary_dim == r
        assert w.moved_bytes() == full.moved_bytes() * r // 128


def test_strided_twin():
    s, c = _w("bshd-strided"), _w("bshd-contig")
    assert s.strided and not c.strided
    assert s.shape == c.shape and s.moved_bytes() == c.moved_bytes()


#: The workloads too small to be held to the copy roofline.
BELOW_ROOFLINE = {"decode-qk-t1", "decode-qk-t16", "decode-qk-t64"}


@pytest.mark.parametrize("w", bench.WORKLOADS, ids=[w.name for w in bench.WORKLOADS])
def test_roofline_set(w):
    held = w.moved_bytes() >= bench.ROOFLINE_MIN_BYTES
    assert held == (w.name not in BELOW_ROOFLINE)


def test_select_workloads():
    assert [w.name for w in bench.select_workloads("thd-n1,partial-0.5")] == [
        "thd-n1", "partial-0.5"]
    assert {w.name for w in bench.select_workloads(filters=["^thd"])} == {
        "thd-n1", "thd-n128", "thd-n2401"}
    assert [w.name for w in bench.select_workloads("thd-n1,thd-n128", ["128"])] == ["thd-n128"]
    with pytest.raises(ValueError, match="unknown workload"):
        bench.select_workloads(["nope"])


def test_cli_list(capsys):
    assert bench.main(["--list", "--filter", "decode"]) == 0
    out = capsys.readouterr().out
    assert "decode-qk-t1 " in out and "thd-n1" not in out


def test_cli_help_documents_the_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for text in ("python -m benchmarks.bench", "of copy", "forward and backward",
                 "Decode host cost", "python -m benchmarks.compare", "--filter", "--peers"):
        assert text in out, text


# ----------------------------------------------------------------------------
# Positions and tables.


@pytest.mark.parametrize("n", [1, 2, 128, 2401])
def test_thd_cu_seqlens(n):
    cu = bench.thd_cu_seqlens(65536, n)
    assert cu.dtype == np.int32 and cu.shape == (n + 1,)
    assert cu[0] == 0 and cu[-1] == 65536
    assert (np.diff(cu) >= 1).all()
    np.testing.assert_array_equal(cu, bench.thd_cu_seqlens(65536, n))
    if n > 2:
        assert len(set(np.diff(cu).tolist())) > 1  # random lengths, not equal ones


def test_thd_cu_seqlens_bounds():
    with pytest.raises(ValueError):
        bench.thd_cu_seqlens(4, 5)


def test_token_positions():
    cu = np.array([0, 3, 4, 8], np.int32)
    np.testing.assert_array_equal(bench.token_positions(cu), [0, 1, 2, 0, 0, 1, 2, 3])


def test_decode_positions():
    p = bench.decode_positions(64, 8192)
    assert p.dtype == np.int64 and p.shape == (64,)
    assert p.min() >= 0 and p.max() < 8192


def test_rope_tables():
    cos, sin = bench.rope_tables(100, 64)
    assert cos.shape == sin.shape == (100, 32) and cos.dtype == np.float32
    np.testing.assert_allclose(cos[0], 1.0)
    np.testing.assert_allclose(sin[0], 0.0)
    np.testing.assert_allclose(cos ** 2 + sin ** 2, 1.0, atol=1e-6)
    np.testing.assert_allclose(np.arctan2(sin[1], cos[1])[1], 10000 ** (-2 / 64), rtol=1e-6)


# ----------------------------------------------------------------------------
# Acceptance and output, on synthetic results.


def _defs(*names):
    return [bench.select_workloads([n])[0].describe() for n in names]


def _r(w, d, impl, t, copy_t=None, status="ok", **kw):
    w = bench.select_workloads([w])[0]
    copy_t = copy_t if copy_t is not None else t * 0.97
    row = bench._row(w, d, impl, status, "note", time_us=t if status == "ok" else None,
                     bandwidth_GBps=w.moved_bytes() / (t * 1e-6) / 1e9,
                     fraction_of_copy=copy_t / t if status == "ok" else None,
                     copy_time_us=copy_t, copy_bandwidth_GBps=1.0, held=True)
    row.update(kw)
    return row


def _result(rows, names, host=None):
    res = {"device": "Fake GPU", "arrays": "torch", "config": {"reps": 3, "sets": 2},
           "peers": {"torch-eager": "present", "liger": "absent: not installed"},
           "workloads": _defs(*names), "rows": rows}
    if host is not None:
        res["host"] = host
    return res


def _with_best(rows):
    """What _run_workload adds to cupy-rope's rows, workload by workload."""
    for name in dict.fromkeys(r["workload"] for r in rows):
        bench._mark_best_peer([r for r in rows if r["workload"] == name])
    return rows


GOOD_HOST = {"workload": "decode", "calls": 10, "graph_calls": 100, "torch_us_per_call": 6.0,
             "cupy_us_per_call": 5.0, "graph_us_per_call": 2.5, "graph_wall_us_per_call": 2.6,
             "form": "thd"}


def _all_pass_result():
    names = ["sbhd-4096x1x128x128", "thd-n1", "thd-n128", "thd-n2401", "inplace-full",
             "partial-0.5", "partial-0.25", "bshd-contig", "bshd-strided", "decode-qk-t64"]
    times = {"sbhd-4096x1x128x128": 95, "thd-n1": 380, "thd-n128": 382, "thd-n2401": 390,
             "inplace-full": 95, "partial-0.5": 50, "partial-0.25": 28, "bshd-contig": 95,
             "bshd-strided": 97, "decode-qk-t64": 3}
    rows = []
    for n in names:
        for d in ("fwd", "bwd"):
            rows.append(_r(n, d, bench.OURS, times[n]))
            rows.append(_r(n, d, "torch-eager", times[n] * 3))
            rows.append(_r(n, d, "liger", 1.0, status="n/a"))
    return _result(_with_best(rows), names, GOOD_HOST)


def _status(items):
    return {it["item"]: it["status"] for it in items}


def test_criteria_table():
    assert [c.item for c in bench.CRITERIA] == ["1a", "1b", "2", "3", "4", "5", "6"]
    items = bench.acceptance(_all_pass_result())
    assert [(it["item"], it["what"]) for it in items] == [(c.item, c.what)
                                                          for c in bench.CRITERIA]


def test_acceptance_all_pass():
    items = bench.acceptance(_all_pass_result())
    assert _status(items) == {"1a": "PASS", "1b": "PASS", "2": "PASS", "3": "PASS",
                              "4": "PASS", "5": "PASS", "6": "PASS"}


def test_acceptance_failures():
    res = _all_pass_result()
    for r in res["rows"]:
        if r["impl"] != bench.OURS:
            continue
        if r["workload"] == "thd-n2401":        # 10% slower than n1
            r["time_us"] = 420.0
        if r["workload"] == "partial-0.25":     # > 0.35 x 95
            r["time_us"] = 40.0
        if r["workload"] == "bshd-strided" and r["direction"] == "bwd":
            r["time_us"] = 110.0
        if r["workload"] == "sbhd-4096x1x128x128" and r["direction"] == "fwd":
            r["fraction_of_copy"] = 0.9
    res["host"] = dict(GOOD_HOST, cupy_us_per_call=9.5, graph_us_per_call=3.5)
    items = bench.acceptance(res)
    assert _status(items) == {"1a": "FAIL", "1b": "PASS", "2": "FAIL", "3": "FAIL",
                              "4": "FAIL", "5": "FAIL", "6": "FAIL"}
    by = {it["item"]: it for it in items}
    assert any("sbhd-4096x1x128x128 fwd" in f for f in by["1a"]["failures"])
    assert any("partial-0.25" in f for f in by["3"]["failures"])
    assert any("cupy" in f for f in by["5"]["failures"])
    assert not any("torch" in f for f in by["5"]["failures"])


def test_acceptance_decode_uses_the_bound_form_when_measured():
    res = _all_pass_result()
    res["host"] = dict(GOOD_HOST, torch_us_per_call=12.0, torch_bound_us_per_call=7.5,
                       cupy_us_per_call=11.0, cupy_bound_us_per_call=8.5)
    by = {it["item"]: it for it in bench.acceptance(res)}
    assert by["5"]["status"] == "FAIL"
    assert by["5"]["failures"] == ["cupy: 8.50 us"]
    assert "torch 7.50 us bound (12.00 us apply_rope_qk)" in by["5"]["detail"]
    assert "RotaryEmbedding.qk_ 7.50 us" in bench.format_host(res["host"])


def test_host_report_splits_launch_and_python():
    host = dict(GOOD_HOST, torch_bound_us_per_call=7.5, torch_launch_us_per_call=3.25,
                torch_python_us_per_call=4.25, torch_add_us_per_call=6.5)
    text = bench.format_host(host)
    assert "RotaryEmbedding.qk_ 7.50 us: driver launch 3.25 us + Python 4.25 us" in text
    assert "torch x.add_(1) on 16 floats 6.50 us" in text
    res = _all_pass_result()
    res["host"] = host
    by = {it["item"]: it for it in bench.acceptance(res)}
    assert "torch 7.50 us bound, of which Python 4.25 us" in by["5"]["detail"]


def test_host_report_names_its_passes():
    rounds = dict(GOOD_HOST, rounds=9, torch_bound_us_per_call=7.5,
                  torch_launch_us_per_call=3.25, torch_python_us_per_call=4.0)
    text = bench.format_host(rounds)
    assert "median of 9 interleaved rounds of passes of 10 calls" in text
    assert ("RotaryEmbedding.qk_ 7.50 us; the kernel launched bare 3.25 us; Python 4.00 us, "
            "the median over rounds of qk_ less the bare launch") in text
    assert "median of 5 passes of 10 calls" in bench.format_host(dict(GOOD_HOST, repeats=5))


def test_host_rounds_interleave_and_survive_a_failure(monkeypatch):
    """Each round runs one pass of every entry in turn; an entry that raises
    leaves its error and no times, and the others are timed on."""
    monkeypatch.setattr(bench, "_sync", lambda: None)
    monkeypatch.setattr(bench, "HOST_WARMUP_S", 0.0)
    calls = []
    state = {"b": 0}

    def entry(name):
        def fn():
            calls.append(name)
        return fn

    def flaky():
        state["b"] += 1
        if state["b"] > 60:  # the warm-up's 50 calls pass, the first round fails
            raise RuntimeError("boom")

    out = {}
    bench._time_host_rounds(out, [("a", entry("a"), None), ("b", flaky, None),
                                  ("c", entry("c"), None)], calls=4, rounds=3)
    order = [n for i, n in enumerate(calls) if i == 0 or calls[i - 1] != n]
    assert order == ["a", "c"] + ["a", "c"] * 3  # warm-ups, then a and c alternate
    assert len(out["a_us_per_call_runs"]) == len(out["c_us_per_call_runs"]) == 3
    assert out["a_us_per_call"] == sorted(out["a_us_per_call_runs"])[1]
    assert out["b_error"] == "RuntimeError: boom"
    assert "b_us_per_call" not in out and "b_us_per_call_runs" not in out


def test_acceptance_slower_than_peer_and_errors():
    names = ["sbhd-4096x1x128x128", "llama3-8b-prefill-qk"]
    rows = []
    for d in ("fwd", "bwd"):
        rows.append(_r(names[0], d, bench.OURS, 100))
        rows.append(_r(names[0], d, "liger", 90))
        rows.append(_r(names[1], d, bench.OURS, 1.0, status="error"))
        rows.append(_r(names[1], d, "liger", 90))
    items = {it["item"]: it for it in bench.acceptance(_result(_with_best(rows), names))}
    assert items["1a"]["status"] == "FAIL"          # error rows fail the roofline item
    assert items["1b"]["status"] == "FAIL"
    assert any("0.900x vs liger" in f for f in items["1b"]["failures"])
    for k in ("2", "3", "4", "5", "6"):
        assert items[k]["status"] == "SKIP"


THD = ("thd-n1", "thd-n128", "thd-n2401")


def test_acceptance_thd_compares_the_positions_row_with_the_peers():
    """On thd the peers get per-token positions gathered outside their timed
    call: [1b] takes cupy-rope's row on those positions and reports the
    cu_seqlens row's speedup beside it; [1a] holds both rows to the copy
    roofline."""
    res = _all_pass_result()
    for r in list(res["rows"]):
        if r["workload"] in THD and r["impl"] == bench.OURS:
            pos = dict(r, impl=bench.OURS_POSITIONS, time_us=r["time_us"] * 0.98)
            res["rows"].append(pos)
            r["time_us"] *= 1.2  # cu_seqlens: slower than the peer below
    for r in res["rows"]:
        if r["workload"] in THD and r["impl"] == "torch-eager":
            r["time_us"] = 390.0 * 1.1
    for r in res["rows"]:  # what _run_workload computes for both of our rows
        r.pop("speedup_vs_best_peer", None)
        r.pop("best_peer", None)
    _with_best(res["rows"])
    by = {it["item"]: it for it in bench.acceptance(res)}
    assert by["1b"]["status"] == "PASS", by["1b"]
    assert "thd with cu_seqlens" in by["1b"]["detail"]
    for r in res["rows"]:
        if r["impl"] == bench.OURS_POSITIONS and r["workload"] == "thd-n128":
            r["time_us"] = 500.0
            r["speedup_vs_best_peer"] = r["best_peer_time_us"] / 500.0
            r["fraction_of_copy"] = 0.9
    by = {it["item"]: it for it in bench.acceptance(res)}
    assert by["1b"]["status"] == "FAIL"
    assert "thd-n128 fwd positions: 0.858x vs torch-eager" in by["1b"]["failures"]
    assert "thd-n128 fwd positions: 0.900" in by["1a"]["failures"]
    # an errored positions row fails both items, named as the positions row
    for r in res["rows"]:
        if r["impl"] == bench.OURS_POSITIONS and r["workload"] == "thd-n1":
            r.update(status="error", note="boom", time_us=None, fraction_of_copy=None)
            r.pop("speedup_vs_best_peer")
    by = {it["item"]: it for it in bench.acceptance(res)}
    assert "thd-n1 fwd positions: error" in by["1b"]["failures"]
    assert "thd-n1 fwd positions: error (boom)" in by["1a"]["failures"]


def test_acceptance_no_peer_is_skip():
    names = ["sbhd-4096x1x128x128"]
    rows = [_r(names[0], d, bench.OURS, 95) for d in ("fwd", "bwd")]
    items = {it["item"]: it for it in bench.acceptance(_result(rows, names))}
    assert items["1a"]["status"] == "PASS" and items["1b"]["status"] == "SKIP"


def test_acceptance_host_without_torch():
    res = _all_pass_result()
    res["host"] = dict(GOOD_HOST, torch_us_per_call=None, torch_error=bench.NO_TORCH,
                       graph_us_per_call=None, graph_error=bench.NO_TORCH)
    items = _status(bench.acceptance(res))
    assert items["5"] == "PASS" and items["6"] == "SKIP"
    res["host"]["cupy_us_per_call"] = None
    res["host"]["cupy_error"] = "RuntimeError: boom"
    assert _status(bench.acceptance(res))["5"] == "FAIL"


def test_format_table_and_json(tmp_path):
    res = _all_pass_result()
    res["rows"].append(_r("bshd-contig", "fwd", "flashinfer", 1.0, status="error"))
    res["acceptance"] = bench.acceptance(res)
    table = bench.format_table(res)
    lines = table.splitlines()
    assert lines[0].split(";")[0] == "device: Fake GPU"
    assert any("d2d copy" in ln and "thd-n1" in ln for ln in lines)
    ours = [ln for ln in lines if "sbhd-4096x1x128x128" in ln and bench.OURS in ln]
    assert len(ours) == 2 and all("3.000x" in ln and "best peer torch-eager" in ln for ln in ours)
    assert any("liger" in ln and "n/a" in ln for ln in lines)
    assert any("flashinfer" in ln and "error" in ln for ln in lines)
    acc = bench.format_acceptance(res["acceptance"])
    assert acc.count("PASS") == 7
    host = bench.format_host(res["host"])
    assert "torch 6.00 us" in host and "2.50 us per call" in host
    path = tmp_path / "r.json"
    bench.write_json(res, path)
    back = json.loads(path.read_text())
    assert back["rows"][0]["workload"] == res["rows"][0]["workload"]
    assert {w["name"] for w in back["workloads"]} >= {"thd-n1", "partial-0.25"}


def test_main_past_the_device_check_writes_json_and_judges(tmp_path, monkeypatch, capsys):
    """main() as tools/gpu_suite.sh calls it, with the run replaced by a fixed
    result: the JSON checkpoint, the printed sections, --strict's status."""
    from cupy_rope import interop

    res = _all_pass_result()
    res["acceptance"] = bench.acceptance(res)
    seen = {}

    def fake_run(workloads, **kw):
        seen.update(kw, workloads=[w.name for w in workloads])
        kw["checkpoint"](res)
        return res

    monkeypatch.setattr(interop, "require_cuda", lambda what: None)
    monkeypatch.setattr(bench, "run", fake_run)
    path = tmp_path / "bench.json"
    argv = ["--json", str(path), "--filter", "^thd", "--peers", "none", "--reps", "7",
            "--no-host", "--strict"]
    assert bench.main(argv) == 0
    assert seen["workloads"] == ["thd-n1", "thd-n128", "thd-n2401"]
    assert (seen["peers"], seen["reps"], seen["n_sets"], seen["host"]) == ("none", 7, 3, False)
    assert json.loads(path.read_text())["device"] == "Fake GPU"
    out = capsys.readouterr().out
    assert "host cost" in out and "PASS [1a]" in out and "d2d copy" in out
    res["acceptance"][0]["status"] = "FAIL"
    assert bench.main(argv) == 1


def test_plot(tmp_path):
    res = _all_pass_result()
    path = tmp_path / "r.png"
    msg = bench.plot(res, str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in msg and not path.exists()
    else:
        assert path.stat().st_size > 1000, msg


def test_peer_registry():
    assert [p.name for p in peers.make("torch-eager,liger")] == ["torch-eager", "liger"]
    assert [p.name for p in peers.make("all")] == list(peers.NAMES)
    assert peers.make("none") == []
    with pytest.raises(ValueError, match="unknown peer"):
        peers.make("nope")


# ----------------------------------------------------------------------------
# Comparing two runs (benchmarks/compare.py), on synthetic results.

CMP_NAMES = ["sbhd-4096x1x128x128", "thd-n1"]


def _run_result(factor=1.0, host_factor=1.0, drop=(), failed=()):
    """A synthetic run: cupy-rope (and on thd its positions row) and a peer on
    CMP_NAMES, times scaled by ``factor``; rows keyed (workload, impl,
    direction) in ``drop`` are left out, those in ``failed`` errored."""
    rows = []
    for n in CMP_NAMES:
        impls = [bench.OURS, "torch-eager"] + ([bench.OURS_POSITIONS] if n == "thd-n1" else [])
        for impl in impls:
            for d in ("fwd", "bwd"):
                if (n, impl, d) in drop:
                    continue
                t = 100.0 * factor * (3 if impl == "torch-eager" else 1)
                status = "error" if (n, impl, d) in failed else "ok"
                rows.append(_r(n, d, impl, t, copy_t=97.0, status=status))
    host = {k: v * host_factor if isinstance(v, float) else v for k, v in GOOD_HOST.items()}
    return _result(rows, CMP_NAMES, host)


class CmpCase(NamedTuple):
    factor: float
    threshold: float
    flagged: bool


CMP_CASES = {
    "same": CmpCase(1.0, 0.01, False),
    "within-noise": CmpCase(1.005, 0.01, False),
    "slower": CmpCase(1.02, 0.01, True),
    "faster": CmpCase(0.98, 0.01, True),
    "slower-wider-threshold": CmpCase(1.02, 0.05, False),
}


@pytest.mark.parametrize("case", CMP_CASES.values(), ids=CMP_CASES.keys())
def test_compare_flags_rows_beyond_the_threshold(case):
    c = compare.compare(_run_result(), _run_result(case.factor), threshold=case.threshold,
                        host_threshold=1.0)
    keys = [(r.workload, r.impl, r.direction) for r in c.gpu]
    assert keys == [("sbhd-4096x1x128x128", bench.OURS, "fwd"),
                    ("sbhd-4096x1x128x128", bench.OURS, "bwd"),
                    ("thd-n1", bench.OURS, "fwd"), ("thd-n1", bench.OURS, "bwd"),
                    ("thd-n1", bench.OURS_POSITIONS, "fwd"),
                    ("thd-n1", bench.OURS_POSITIONS, "bwd")]
    for r in c.gpu:
        assert r.old == pytest.approx(100.0) and r.new == pytest.approx(100.0 * case.factor)
        assert r.ratio == pytest.approx(case.factor) and r.copy_ratio == pytest.approx(1.0)
        assert c.flagged(r) == case.flagged
    assert len(c.flags()) == (6 if case.flagged else 0)


class MissingCase(NamedTuple):
    old: dict
    new: dict
    note: str


_KEY = ("thd-n1", bench.OURS_POSITIONS, "bwd")
MISSING_CASES = {
    "missing-in-new": MissingCase({}, {"drop": {_KEY}}, "new: missing"),
    "missing-in-old": MissingCase({"drop": {_KEY}}, {}, "old: missing"),
    "error-in-new": MissingCase({}, {"failed": {_KEY}}, "new: error"),
}


@pytest.mark.parametrize("case", MISSING_CASES.values(), ids=MISSING_CASES.keys())
def test_compare_flags_rows_that_one_run_lacks(case):
    c = compare.compare(_run_result(**case.old), _run_result(**case.new))
    (row,) = c.flags()
    assert (row.workload, row.impl, row.direction) == _KEY
    assert row.ratio is None and row.note == case.note
    assert len(c.gpu) == 6


def test_compare_host_rows_side_by_side():
    old = _run_result()
    old["host"].update(torch_bound_us_per_call=7.5, torch_python_us_per_call=4.0)
    new = _run_result(host_factor=1.03)
    new["host"].update(torch_bound_us_per_call=7.5, torch_python_us_per_call=4.0)
    c = compare.compare(old, new, threshold=0.01, host_threshold=0.05)
    host = {r.impl: r for r in c.host}
    assert list(host) == ["torch apply_rope_qk", "torch RotaryEmbedding.qk_",
                          "torch Python share of qk_", "cupy apply_rope_qk",
                          "CUDA graph replay, GPU per call", "CUDA graph replay, wall per call"]
    assert host["torch apply_rope_qk"].ratio == pytest.approx(1.03)
    assert host["torch RotaryEmbedding.qk_"].ratio == pytest.approx(1.0)
    assert not c.flags()  # 3% is within the host threshold
    assert len(compare.compare(old, new, threshold=0.01).flags()) == 4  # host defaults to 1%


def test_compare_other_impls_on_request():
    c = compare.compare(_run_result(), _run_result(), impls=("torch-eager",))
    assert {r.impl for r in c.gpu} == {"torch-eager"} and len(c.gpu) == 4


def test_compare_table_and_cli(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    bench.write_json(_run_result(), old)
    bench.write_json(_run_result(1.02), new)
    assert compare.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "old: Fake GPU; new: Fake GPU (same GPU)"
    row = next(ln for ln in out if ln.split()[:4] == ["thd-n1", "bwd", "cupy-rope", "pos"])
    assert row.split()[-5:] == ["100.00", "102.00", "1.0200", "1.0000", "<<"]
    assert "decode host cost, median per call:" in out
    assert out[-1] == ("6 of 10 rows flagged (GPU rows beyond 1.0%, host rows beyond 1.0%, "
                       "or missing)")
    assert compare.main([str(old), str(new), "--strict"]) == 1
    assert compare.main([str(old), str(new), "--strict", "--threshold", "0.05"]) == 0


def test_compare_names_differing_settings():
    old, new = _run_result(), _run_result()
    new["config"] = dict(old["config"], reps=5)
    text = compare.format_comparison(compare.compare(old, new))
    assert text.splitlines()[1] == ("the runs' settings differ: old {'reps': 3, 'sets': 2}, "
                                    "new {'reps': 5, 'sets': 2}")
    assert "settings differ" not in compare.format_comparison(compare.compare(old, old))


def test_compare_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "x"}))
    with pytest.raises(ValueError, match="old: .* is not a benchmark result"):
        compare.load(str(bad), "old")
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        compare.compare(_run_result(), _run_result(), threshold=-0.1)


def test_compare_knows_our_impls():
    assert compare.OURS_IMPLS == bench.OURS_IMPLS


# ----------------------------------------------------------------------------
# Peers' adapters and the check, on the CPU with torch (stand-ins for the
# GPU-only peers implement their documented calling conventions).


def _fake_liger(torch):
    def rot(q, k, cos, sin, backward):
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        r = cos.shape[-1]
        h = r // 2
        c = cos[..., :h].unsqueeze(2).float()
        s = sin[..., :h].unsqueeze(2).float() * (-1 if backward else 1)
        for t in (q, k):
            a, b = t[..., :h].float(), t[..., h:r].float()
            t[..., :h], t[..., h:r] = (a * c - b * s).to(t.dtype), (b * c + a * s).to(t.dtype)
        return q.transpose(1, 2), k.transpose(1, 2)

    rope = types.ModuleType("liger_kernel.ops.rope")
    rope.rope_forward = lambda q, k, cos, sin, *a, **kw: rot(q, k, cos, sin, False) + (cos, sin)
    rope.rope_backward = lambda q, k, cos, sin, *a, **kw: rot(q, k, cos, sin, True)
    return rope


def _fake_flashinfer(torch):
    def apply(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox and cos_sin_cache.dtype == torch.float32
        assert positions.shape[0] == query.shape[0] == key.shape[0]
        h = cos_sin_cache.shape[-1] // 2
        c = cos_sin_cache[positions, :h].unsqueeze(1)
        s = cos_sin_cache[positions, h:].unsqueeze(1)
        for t in (query, key):
            v = t.view(t.shape[0], -1, head_size)
            a, b = v[..., :h].float(), v[..., h: 2 * h].float()
            v[..., :h], v[..., h: 2 * h] = (a * c - b * s).to(t.dtype), (b * c + a * s).to(t.dtype)

    mod = types.ModuleType("flashinfer")
    mod.apply_rope_with_cos_sin_cache_inplace = apply
    return mod


def _small(w, *n_a):
    """A small workload for the CPU, and the peers that answer n/a on it."""
    return pytest.param(w, set(n_a), id=w.name)


SMALL = [
    _small(bench.Workload("t-sbhd-b1", "", "single", "sbhd", (16, 1, 4, 8))),
    _small(bench.Workload("t-sbhd-b3", "", "single", "sbhd", (16, 3, 4, 8)), "liger"),
    _small(bench.Workload("t-bshd", "", "single", "bshd", (2, 16, 4, 8))),
    _small(bench.Workload("t-fp32", "", "single", "sbhd", (8, 5, 1, 8), dtype="float32"),
           "liger", "flashinfer"),
    _small(bench.Workload("t-qk", "", "qk", "bshd", (2, 16, 4, 10), k_heads=2)),
    _small(bench.Workload("t-decode", "", "decode", "thd", (5, 4, 8), k_heads=2, mode="inplace",
                          max_position=64)),
    _small(bench.Workload("t-thd", "", "thd", "thd", (40, 4, 8), n_seqs=3)),
    _small(bench.Workload("t-full", "", "single", "bshd", (2, 16, 4, 16), mode="inplace")),
    _small(bench.Workload("t-partial", "", "single", "bshd", (2, 16, 4, 16), mode="inplace",
                          rotary_frac=0.25)),
    _small(bench.Workload("t-strided", "", "single", "bshd", (2, 16, 4, 8), strided=True),
           "flashinfer"),
]


@pytest.mark.parametrize("w, n_a", SMALL)
def test_peer_adapters_on_cpu(w, n_a, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", types.ModuleType("liger_kernel.ops"))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rope", _fake_liger(torch))
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(torch))
    env = bench._Env(device="cpu")
    ctx = bench.make_context(w, env)
    base = bench.make_set(w, env)
    if w.strided:
        # x is a [b, h, s, d] array seen as bshd; cupy-rope's output has the
        # same memory order (as torch's and torch.compile's new outputs do).
        for st in (base, bench.clone_set(base, w, env)):
            assert not st["x"].is_contiguous() and st["x"].transpose(1, 2).is_contiguous()
            if "out" in st:
                assert st["out"].stride() == st["x"].stride()
    prepared = [(p.name, p.prepare(w, ctx))
                for p in (peers.TorchFormula(), peers.Liger(), peers.FlashInfer())]
    unusable = {name: prep for name, prep in prepared if isinstance(prep, peers.Unusable)}
    assert set(unusable) == n_a, unusable
    assert all(u.status == "n/a" and u.reason for u in unusable.values()), unusable
    checks = bench.check_outputs(w, ctx, prepared, base, env)
    tol = bench.CHECK_TOLERANCE[w.dtype]
    for (name, backward), err in checks.items():
        assert not isinstance(err, str), (name, backward, err)
        assert err <= tol, (name, backward, err)
    # the check catches a wrong rotation
    bad = peers.Prepared(lambda s: (s["q"], s["k"]) if "q" in s else (s["x"],),
                         {b: (lambda *t: tuple(x * 1.0 for x in t)) for b in (False, True)},
                         lambda a, ret: list(ret))
    errs = bench.check_outputs(w, ctx, [("bad", bad)], base, env)
    assert max(errs.values()) > tol


class _NotApplicablePeer(peers.Peer):
    name = "never"

    def prepare(self, w, ctx):
        return peers.not_applicable("cannot express this")


RUN_CPU = [bench.Workload("t-sbhd-fp32", "", "single", "sbhd", (16, 3, 4, 8), dtype="float32"),
           bench.Workload("t-qk-fp32", "", "qk", "bshd", (2, 16, 4, 8), k_heads=2,
                          dtype="float32"),
           bench.Workload("t-decode-fp32", "", "decode", "thd", (5, 4, 8), k_heads=2,
                          mode="inplace", max_position=64, dtype="float32"),
           bench.Workload("t-thd-fp32", "", "thd", "thd", (40, 4, 8), n_seqs=3, dtype="float32"),
           bench.Workload("t-partial-fp32", "", "single", "bshd", (2, 16, 4, 16),
                          mode="inplace", rotary_frac=0.25, dtype="float32")]


@pytest.mark.parametrize("w", RUN_CPU, ids=[w.name for w in RUN_CPU])
def test_run_workload_rows_on_cpu(w, monkeypatch):
    """One workload's rows through the real plumbing (prepare, check, rows,
    best peer), on the CPU: cupy-rope's NumPy path on torch CPU tensors, the
    torch formula as the peer; the GPU timers replaced by fixed times."""
    pytest.importorskip("torch")
    times = iter(range(1, 1000))

    def fake_time_call(fn, sets, reps=30, warmup=5):
        fn(*sets[0])
        return bench.Timed(0.1 * next(times), True)

    monkeypatch.setattr(bench, "time_call", fake_time_call)
    monkeypatch.setattr(bench, "copy_ms", lambda nbytes, n_sets=3, reps=30: 0.05)
    env = bench._Env(device="cpu")
    rows = bench._run_workload(w, env, [peers.TorchFormula(), _NotApplicablePeer()], reps=3,
                               n_sets=2, warmup=1, check=True)
    ours = [bench.OURS] + ([bench.OURS_POSITIONS] if w.kind == "thd" else [])
    assert [(r["impl"], r["direction"]) for r in rows] == [
        (impl, d) for impl in ours + ["torch-eager", "never"] for d in ("fwd", "bwd")]
    by = {(r["impl"], r["direction"]): r for r in rows}
    for impl in ours + ["torch-eager"]:
        for d in ("fwd", "bwd"):
            r = by[impl, d]
            assert r["status"] == "ok", r
            assert r["check_error"] <= bench.CHECK_TOLERANCE["float32"]
            assert r["fraction_of_copy"] == pytest.approx(r["copy_time_us"] / r["time_us"])
    for d in ("fwd", "bwd"):
        assert by["never", d]["status"] == "n/a"
        assert by["never", d]["note"] == "cannot express this"
        peer = by["torch-eager", d]
        for impl in ours:
            r = by[impl, d]
            assert r["best_peer"] == "torch-eager"
            assert r["speedup_vs_best_peer"] == pytest.approx(peer["time_us"] / r["time_us"])


# ----------------------------------------------------------------------------
# GPU: one tiny workload end to end.


@pytest.mark.gpu
def test_smoke_tiny_workload_on_gpu(tmp_path):
    w = bench.Workload("tiny-sbhd", "bf16 sbhd [64,1,4,128]", "single", "sbhd", (64, 1, 4, 128))
    res = bench.run([w], peers="torch-eager", reps=3, n_sets=2, warmup=1, host=False)
    rows = [r for r in res["rows"] if r["workload"] == "tiny-sbhd"]
    ours = [r for r in rows if r["impl"] == bench.OURS]
    assert [r["direction"] for r in ours] == ["fwd", "bwd"]
    for r in ours:
        assert r["status"] == "ok", r
        assert r["time_us"] > 0 and r["fraction_of_copy"] > 0
        if r["check_error"] is not None:
            assert r["check_error"] <= bench.CHECK_TOLERANCE["bfloat16"]
    assert bench.format_table(res).count("tiny-sbhd") >= 3
    bench.write_json(res, tmp_path / "r.json")
    assert {it["item"] for it in res["acceptance"]} == {"1a", "1b", "2", "3", "4", "5", "6"}


@pytest.mark.gpu
def test_host_overhead_rounds_on_gpu(monkeypatch):
    """The decode step's host timings: every variant timed in each round, the
    median and the runs recorded, Python's part split off the bare launch."""
    monkeypatch.setattr(bench, "HOST_WARMUP_S", 0.01)
    host = bench.host_overhead(calls=20, graph_calls=4, replays=2, rounds=3)
    torch_present = host.get("torch_error") != bench.NO_TORCH
    fws = ["cupy"] + (["torch"] if torch_present else [])
    assert not [k for k in host if k.endswith("_error") and host[k] != bench.NO_TORCH], host
    for fw in fws:
        for name in (fw, f"{fw}_bound", f"{fw}_launch"):
            runs = host[f"{name}_us_per_call_runs"]
            assert len(runs) == 3 and min(runs) > 0, (name, runs)
            assert host[f"{name}_us_per_call"] == sorted(runs)[1]
        # Python's part: the median of the rounds' differences (timings are
        # not ordered here: under a loaded host one bare-launch pass can
        # outlast a whole bound pass)
        diffs = sorted(b - c for b, c in zip(host[f"{fw}_bound_us_per_call_runs"],
                                             host[f"{fw}_launch_us_per_call_runs"]))
        assert host[f"{fw}_python_us_per_call"] == diffs[1]
    if torch_present:
        assert len(host["torch_add_us_per_call_runs"]) == 3
        assert host["graph_us_per_call"] > 0
    assert host["rounds"] == 3
    assert "3 interleaved rounds of passes of 20 calls" in bench.format_host(host)
