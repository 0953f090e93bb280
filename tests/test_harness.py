"""benchmarks/harness.py: rows, tables, the command line (CPU), and the timers
on a known amount of GPU work."""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import types

import pytest

from benchmarks import harness, record
from benchmarks.record import COLUMNS
from cupy_rope import interop
from cupy_rope.interop import NoCudaDeviceError

W = collections.namedtuple("W", "name")
POOL = [W("decode-t1"), W("decode-t64"), W("prefill")]


def test_csv_row_formats_and_run_fields():
    row = harness.csv_row("w", "bfloat16", "4x8", "impl", "fwd", 50.0, 40.0)
    assert (row["microseconds"], row["copy_microseconds"], row["fraction_of_copy"]) == (
        "50.000", "40.000", "0.8000")
    bare = harness.csv_row("w", "bfloat16", "", "impl", "host", 2.5)
    assert bare["copy_microseconds"] == bare["fraction_of_copy"] == ""
    (full,) = harness.with_run_fields([row], date="2030-01-01", run="r", commit="c", gpu="g")
    assert list(full) == list(COLUMNS)
    assert [full[c] for c in record.RUN_FIELDS] == ["2030-01-01", "r", "c", "g"]


def test_written_rows_are_what_record_adds(tmp_path):
    rows = [harness.csv_row("w", "bfloat16", "4x8", "impl", "fwd", 50.0, 40.0)]
    harness.write_rows(tmp_path / "x.rows.json", rows, "GPU", run="mine", acceptance=[])
    data = json.loads((tmp_path / "x.rows.json").read_text())
    assert (data["device"], data["columns"], data["acceptance"]) == ("GPU", list(COLUMNS), [])
    assert data["rows"][0]["run"] == "mine" and data["rows"][0]["date"] == harness.today()
    got = record.extra_rows(tmp_path, record.RunInfo(run="r", date="d", commit="c", gpu=""))
    assert [(r["gpu"], r["run"], r["microseconds"]) for r in got] == [("GPU", "r", "50.000")]


def test_markdown_table_aligns_numbers_right():
    table = harness.markdown_table(["name", "us:"], [["a", harness.fmt(1.234, ".1f")],
                                                     ["b", harness.fmt(None, ".1f", "n/a")]])
    assert table.splitlines() == ["| name | us |", "|---|---:|", "| a | 1.2 |", "| b | n/a |"]


def test_matching_and_exception_text():
    assert harness.matching(POOL, None) == POOL
    assert harness.matching(POOL, ["t64$", "^pre"]) == POOL[1:]
    exc = ValueError("first\nsecond")
    assert harness.exc_text(exc) == "ValueError: first\nsecond"
    assert harness.exc_text(exc, first_line=True) == "ValueError: first"
    assert harness.exc_text(RuntimeError(), first_line=True) == "RuntimeError: "


def _parser():
    ap = harness.parser("mine", "What it measures.")
    harness.add_timing_args(ap)
    harness.add_peers_arg(ap, ("p1", "p2"))
    harness.add_rows_json_arg(ap)
    harness.add_list_arg(ap)
    ap.add_argument("--filter", action="append")
    return ap


def _start(argv, monkeypatch, gpu):
    def require_cuda(what):
        if not gpu:
            raise NoCudaDeviceError(f"{what}: no CUDA device was found")

    monkeypatch.setattr(interop, "require_cuda", require_cuda)
    return harness.start(_parser(), argv, lambda a: harness.matching(POOL, a.filter),
                         lambda w: f"* {w.name}", "mine")


def test_start_lists_refuses_and_goes_on(monkeypatch, capsys):
    ap = _parser()
    assert ap.prog == "python -m benchmarks.mine"
    args = ap.parse_args([])
    assert (args.reps, args.sets, args.peers, args.json, args.list) == (30, 3, "all", None,
                                                                        False)
    listed = _start(["--list", "--filter", "decode"], monkeypatch, gpu=False)
    assert listed.status == 0 and capsys.readouterr().out == "* decode-t1\n* decode-t64\n"
    none = _start(["--filter", "nothing"], monkeypatch, gpu=True)
    assert none.status == 2 and "no workload selected" in capsys.readouterr().err
    no_gpu = _start([], monkeypatch, gpu=False)
    err = capsys.readouterr().err
    assert no_gpu.status == 2 and err == "python -m benchmarks.mine: no CUDA device was found\n"
    go = _start(["--reps", "5"], monkeypatch, gpu=True)
    assert (go.status, go.args.reps, go.workloads) == (None, 5, POOL)


def test_logger_prefix(capsys):
    harness.logger("mine")("hello")
    assert capsys.readouterr().err == "[mine] hello\n"
    harness.logger("mine", clock=True)("hello")
    err = capsys.readouterr().err
    assert err.startswith("[mine ") and err.endswith("] hello\n")


class _Clock:
    """A fake GPU: a clock in milliseconds that work advances, and events
    that read it (enough of CuPy and torch.cuda for the timers' plumbing)."""

    def __init__(self, spin_outlasts_host=True):
        self.ms, self.spins, self.capturing = 0.0, [], None
        self.spin_outlasts_host = spin_outlasts_host

    def work(self, ms):
        if self.capturing is not None:
            self.capturing.ms += ms
        else:
            self.ms += ms

    def event(self, *_, **__):
        clock = self

        class Event:
            done = not self.spin_outlasts_host

            def record(self, *_):
                self.t = clock.ms

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t
        return Event()

    def cupy(self):
        cuda = types.SimpleNamespace(
            Event=self.event, Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
            get_elapsed_time=lambda a, b: a.elapsed_time(b))
        def raw_kernel(source, name):
            return lambda grid, block, args: self.spins.append(float(args[0]))
        return types.SimpleNamespace(cuda=cuda, RawKernel=raw_kernel)

    def torch(self):
        clock = self

        class Graph:
            ms = 0.0

            def replay(self):
                clock.ms += self.ms

        @contextlib.contextmanager
        def capture(graph):
            clock.capturing = graph
            yield
            clock.capturing = None

        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        cuda = types.SimpleNamespace(
            Stream=lambda: stream, current_stream=lambda: stream,
            stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None,
            CUDAGraph=Graph, graph=capture, Event=self.event)
        return types.SimpleNamespace(cuda=cuda)


def test_time_call_medians_the_events_and_lengthens_a_short_spin(monkeypatch):
    clock = _Clock()
    monkeypatch.setitem(sys.modules, "cupy", clock.cupy())
    monkeypatch.setattr(harness, "_spin_kernel", None)
    timed = harness.time_call(clock.work, [(0.5,), (1.5,), (0.25,)], reps=5, warmup=2)
    assert timed == harness.Timed(0.5, True)  # median of 0.5, 1.5, 0.25, 0.5, 1.5
    assert len(clock.spins) == 1
    short = _Clock(spin_outlasts_host=False)
    monkeypatch.setitem(sys.modules, "cupy", short.cupy())
    monkeypatch.setattr(harness, "_spin_kernel", None)
    assert harness.time_call(short.work, [(1.0,)], reps=3, warmup=0).held is False
    assert len(short.spins) == 3 and short.spins[0] < short.spins[1] < short.spins[2]


def test_graph_replay_is_per_call_of_the_captured_calls():
    clock = _Clock()
    torch = clock.torch()
    calls = []

    def call(ms):
        calls.append(clock.capturing is not None)
        clock.work(ms)

    us = harness.graph_us_per_call(call, (0.004,), torch, calls=10, replays=3)
    assert us == pytest.approx(4.0)  # 0.004 ms per call
    assert calls == [False] * 3 + [True] * 10  # warm-up off the capture, then captured


@pytest.mark.gpu
def test_timers_measure_gpu_work():
    """A spin of known length times as such, queued behind the hold (held);
    a copy of 64 MiB takes longer than one of 1 MiB; a graph of longer
    sleeps times longer."""
    import torch

    one = harness.time_call(harness.hold_stream, [(0.2,), (0.2,)], reps=5, warmup=1)
    assert one.held and 0.1 < one.ms < 0.5, one
    assert harness.copy_ms(64 << 20) > harness.copy_ms(1 << 20) > 0
    short = harness.graph_us_per_call(lambda: torch.cuda._sleep(100_000), (), torch,
                                      calls=10, replays=3, hold_ms=1.0)
    long = harness.graph_us_per_call(lambda: torch.cuda._sleep(200_000), (), torch,
                                     calls=10, replays=3)
    assert 0 < short < long, (short, long)


def test_commit_outside_a_checkout_is_empty_and_record_asks_for_one(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "REPO", tmp_path)
    assert harness.commit() == ""
    with pytest.raises(ValueError, match="pass --commit HASH"):
        record._head_commit()
