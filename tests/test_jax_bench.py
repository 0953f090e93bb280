"""benchmarks.jax_bench's rows for benchmarks.record (CPU; needs jax)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from benchmarks import jax_bench, record  # noqa: E402


def test_csv_rows_are_recordable(tmp_path):
    rows = jax_bench.csv_rows("jax decode", "64x32x128", "vjp", 40.0,
                              {"jnp formula (jax)": 50.0, "cupy-rope (jax, xla)": 40.0})
    assert [r["fraction_of_copy"] for r in rows] == ["0.8000", "1.0000"]
    (tmp_path / "jax.rows.json").write_text(json.dumps({"rows": rows}))
    info = record.RunInfo(run="r", date="2030-01-01", commit="abc", gpu="GPU")
    got = record.extra_rows(tmp_path, info)
    assert [(r["implementation"], r["microseconds"], r["run"]) for r in got] == [
        ("jnp formula (jax)", "50.000", "r"), ("cupy-rope (jax, xla)", "40.000", "r")]


def test_model_rows_have_no_copy():
    (row,) = jax_bench.csv_rows("jax toy model", "", "forward", None, {"x": 10.0})
    assert row["copy_microseconds"] == row["fraction_of_copy"] == ""


def test_main_past_the_device_check_writes_the_header_and_json(tmp_path, monkeypatch, capsys):
    """main()'s plumbing with no row selected (nothing timed): the table
    header and an empty --json file in the harness's format."""
    from cupy_rope import interop

    monkeypatch.setattr(interop, "require_cuda", lambda what: None)
    path = tmp_path / "jax.rows.json"
    assert jax_bench.main(["--rows", "no such row", "--no-model", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| row | direction | copy | formula | cupy-rope |" in out
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["columns"] == list(record.COLUMNS)
