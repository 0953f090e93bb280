"""benchmarks.record on a synthetic bench.json (CPU): the rows it writes, the
refusal of a run already recorded, and results/latest/ replaced."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks import record

DECODE_TITLE = "decode q32/k8 d128, 64 token(s): synthetic"


def _bench_json() -> dict:
    """A bench.json in the benchmark's format: two timed rows, one a peer
    cannot run, and a host section with one part missing."""
    row = {"workload": "bshd-contig", "status": "ok", "copy_time_us": 90.0}
    return {
        "device": "NVIDIA Test GPU",
        "workloads": [
            {"name": "bshd-contig", "title": "bf16 bshd", "dtype": "bfloat16",
             "shape": [4, 4096, 32, 128]},
            {"name": "decode-qk-t64", "title": DECODE_TITLE, "dtype": "bfloat16",
             "shape": [64, 32, 128]},
        ],
        "rows": [
            {**row, "direction": "fwd", "impl": "cupy-rope", "time_us": 100.0,
             "fraction_of_copy": 0.9},
            {**row, "direction": "bwd", "impl": "torch-compile", "time_us": 90.0,
             "fraction_of_copy": 1.0},
            {**row, "direction": "fwd", "impl": "liger", "status": "n/a", "time_us": None,
             "fraction_of_copy": None},
        ],
        "host": {"workload": DECODE_TITLE, "torch_us_per_call": 15.0,
                 "torch_bound_us_per_call": 10.0, "torch_launch_us_per_call": None,
                 "graph_us_per_call": 2.0, "peers_us_per_call": {"torch-compile": 58.0}},
    }


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "h100-2030-01-02"
    d.mkdir()
    (d / "bench.json").write_text(json.dumps(_bench_json()))
    for name in ("bench.png", "bench.log", "nvidia-smi.txt", "README.md", "scratch.patch"):
        (d / name).write_text(name)
    return d


def _rows(results):
    with (results / "runs.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_rows_written(run_dir, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    assert record.record(run_dir, results=results, commit="abc1234") == 6
    rows = _rows(results)
    assert tuple(rows[0]) == record.COLUMNS
    assert {r["run"] for r in rows} == {"h100-2030-01-02"}
    assert {r["date"] for r in rows} == {"2030-01-02"}
    assert {(r["commit"], r["gpu"]) for r in rows} == {("abc1234", "NVIDIA Test GPU")}
    fwd = rows[0]
    assert (fwd["workload"], fwd["dtype"], fwd["shape"]) == ("bshd-contig", "bfloat16",
                                                             "4x4096x32x128")
    assert (fwd["implementation"], fwd["direction"]) == ("cupy-rope", "fwd")
    assert (fwd["microseconds"], fwd["copy_microseconds"], fwd["fraction_of_copy"]) == (
        "100.000", "90.000", "0.9000")
    assert not any(r["implementation"] == "liger" for r in rows)


def test_host_rows(run_dir, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    record.record(run_dir, results=results, commit="abc1234")
    host = {r["implementation"]: r for r in _rows(results) if r["direction"] == "host"}
    assert set(host) == {"cupy-rope apply_rope_qk (torch)", "cupy-rope qk_ (torch)",
                         "cupy-rope CUDA graph replay", "torch-compile"}
    qk = host["cupy-rope qk_ (torch)"]
    assert (qk["workload"], qk["shape"], qk["microseconds"]) == ("decode-qk-t64",
                                                                 "64x32x128", "10.000")
    assert qk["copy_microseconds"] == qk["fraction_of_copy"] == ""


def _extra_row(**kw) -> dict:
    row = {"workload": "jax-decode", "dtype": "bfloat16", "shape": "64x32x128",
           "implementation": "cupy-rope (jax)", "direction": "fwd", "microseconds": "50.000",
           "copy_microseconds": "48.000", "fraction_of_copy": "0.9600"}
    return {**row, **kw}


def test_extra_rows(run_dir, tmp_path):
    """A benchmark's NAME.rows.json is added with the run's fields and kept in latest/."""
    (run_dir / "jax.rows.json").write_text(json.dumps(
        {"device": "ignored: bench.json names the GPU",
         "rows": [_extra_row(), _extra_row(direction="vjp", run="stale", commit="old")]}))
    results = tmp_path / "results"
    results.mkdir()
    assert record.record(run_dir, results=results, commit="abc1234") == 8
    extra = [r for r in _rows(results) if r["workload"] == "jax-decode"]
    assert [r["direction"] for r in extra] == ["fwd", "vjp"]
    assert {(r["run"], r["commit"], r["gpu"]) for r in extra} == {
        ("h100-2030-01-02", "abc1234", "NVIDIA Test GPU")}
    assert "jax.rows.json" in {p.name for p in (results / "latest").iterdir()}


def test_extra_rows_missing_column(run_dir, tmp_path):
    row = _extra_row()
    del row["microseconds"]
    (run_dir / "norm.rows.json").write_text(json.dumps([row]))
    results = tmp_path / "results"
    results.mkdir()
    with pytest.raises(ValueError, match="microseconds"):
        record.record(run_dir, results=results, commit="abc1234")
    assert not (results / "runs.csv").exists()


def test_duplicate_run_refused(run_dir, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    record.record(run_dir, results=results, commit="abc1234")
    before = (results / "runs.csv").read_text()
    with pytest.raises(ValueError, match="already"):
        record.record(run_dir, results=results, commit="abc1234")
    assert (results / "runs.csv").read_text() == before
    record.record(run_dir, results=results, commit="abc1234", run="again", date="2030-01-03")
    assert {r["run"] for r in _rows(results)} == {"h100-2030-01-02", "again"}


def test_latest_replaced(run_dir, tmp_path):
    results = tmp_path / "results"
    (results / "latest").mkdir(parents=True)
    (results / "latest" / "old-run.txt").write_text("old")
    record.record(run_dir, results=results, commit="abc1234")
    kept = sorted(p.name for p in (results / "latest").iterdir())
    assert kept == ["README.md", "bench.json", "bench.log", "bench.png", "nvidia-smi.txt"]


def test_partial_run_keeps_latest(tmp_path):
    """A run of only NAME.rows.json: its rows are added; latest/ keeps the last full run."""
    part = tmp_path / "h100-2030-01-05"
    part.mkdir()
    (part / "norm.rows.json").write_text(json.dumps(
        {"device": "NVIDIA Test GPU", "rows": [_extra_row(workload="qk-norm")]}))
    results = tmp_path / "results"
    (results / "latest").mkdir(parents=True)
    (results / "latest" / "bench.json").write_text("{}")
    assert record.record(part, results=results, commit="abc1234") == 1
    (row,) = _rows(results)
    assert (row["workload"], row["run"], row["gpu"]) == (
        "qk-norm", "h100-2030-01-05", "NVIDIA Test GPU")
    assert sorted(p.name for p in (results / "latest").iterdir()) == ["bench.json"]


def test_bad_input(run_dir, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    with pytest.raises(FileNotFoundError, match="run_dir"):
        record.record(tmp_path / "missing", results=results, commit="abc1234")
    with pytest.raises(ValueError, match="date"):
        record.record(run_dir, results=results, commit="abc1234", date="24/11/2026")
    with pytest.raises(ValueError, match="latest"):
        record.replace_latest(results / "latest", results / "latest")


def test_cli(run_dir, tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(record, "RESULTS", results)
    assert record.main([str(run_dir), "--commit", "abc1234", "--run", "r1"]) == 0
    assert {r["run"] for r in _rows(results)} == {"r1"}
    assert record.main([str(run_dir), "--commit", "abc1234", "--run", "r1"]) == 2
    assert "already" in capsys.readouterr().err
