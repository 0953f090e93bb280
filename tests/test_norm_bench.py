"""benchmarks.norm_bench on the CPU: its command line, the copy bytes of a row, and the check of each implementation against the float32 formula."""

from __future__ import annotations

import json

import pytest
from benchmarks import norm_bench, record


def test_norm_bench_cli_help_and_list(capsys):
    with pytest.raises(SystemExit) as exit_:
        norm_bench.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for text in ("python -m benchmarks.norm_bench", "of copy", "torch-compile", "--json",
                 "--peers", "CUDA graph"):
        assert text in out, text
    assert norm_bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(w.name in out for w in norm_bench.WORKLOADS)


def test_norm_bench_copy_bytes_are_the_ops_own():
    w = norm_bench.WORKLOADS[0]  # q [4, 4096, 32, 128], k [4, 4096, 8, 128], bf16
    qk = 2 * 4 * 4096 * (32 + 8) * 128
    assert w.copy_bytes("fwd") == qk  # read q, k; write q, k
    assert w.copy_bytes("bwd") == 3 * qk // 2  # read dy and x; write dx


@pytest.mark.parametrize("scope", ["head", "token"])
def test_norm_bench_implementations_agree_on_cpu(monkeypatch, scope):
    """The plumbing and the check on CPU tensors: cupy-rope (its NumPy
    path) and the torch chain against the float32 formula."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(norm_bench, "DEVICE", "cpu")
    for w in (norm_bench.NormWorkload("t", "", 2, 16, 4, 2, 64, scope),
              norm_bench.NormWorkload("d", "", 8, 1, 4, 2, 64, scope, decode=True,
                                      max_position=64)):
        tables, s = norm_bench.make_tables(w, torch), norm_bench.make_set(w, torch)
        ref = norm_bench.reference(w, s, tables, torch)
        for impl in (norm_bench.Ours(), norm_bench.Chain("rms_norm+rope_qk",
                     norm_bench.torch_rms_norm, "torch.nn.functional.rms_norm")):
            fn = (impl.decode if w.decode else impl.forward)(w, tables)
            errs = norm_bench.check(w, fn, s, ref, torch)
            assert set(errs) == ({"fwd"} if w.decode else {"fwd", "bwd"}), errs
            assert all(e < norm_bench.CHECK_TOLERANCE for e in errs.values()), (impl.name, errs)


def test_main_past_the_device_check_prints_and_writes_rows(tmp_path, monkeypatch, capsys):
    """main() as tools/gpu_suite.sh calls it, with the run replaced by fixed
    rows: the table, and --json's rows as benchmarks.record adds them (ok rows
    only)."""
    from cupy_rope import interop

    w = norm_bench.WORKLOADS[-1]
    rows = [norm_bench._row(w, "fwd", norm_bench.OURS, "ok", us=4.0, copy_us=2.0, err=1e-3),
            norm_bench._row(w, "fwd", "liger+rope_qk", "n/a", "not installed")]
    seen = []

    def fake_run(workloads, peers, reps, n_sets, check_values):
        seen.append(([x.name for x in workloads], peers, reps, n_sets, check_values))
        return {"device": "Fake GPU", "torch": "2.x", "rows": rows}

    monkeypatch.setattr(interop, "require_cuda", lambda what: None)
    monkeypatch.setattr(norm_bench, "run", fake_run)
    path = tmp_path / "norm.rows.json"
    assert norm_bench.main(["--workloads", w.name, "--peers", "none", "--reps", "5",
                            "--json", str(path)]) == 0
    assert seen == [([w.name], "none", 5, 3, True)]
    out = capsys.readouterr().out
    assert "| decode-qkv-t64 | fwd | cupy-rope | 4.0 | 0.500 |" in out
    assert json.loads(path.read_text())["device"] == "Fake GPU"
    got = record.extra_rows(tmp_path, record.RunInfo(run="r", date="d", commit="c", gpu=""))
    assert [(r["workload"], r["implementation"], r["microseconds"], r["fraction_of_copy"],
             r["gpu"]) for r in got] == [(f"qk-norm {w.name}", norm_bench.OURS, "4.000",
                                          "0.5000", "Fake GPU")]
