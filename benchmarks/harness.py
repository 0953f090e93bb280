"""What every benchmark script shares: GPU timing, the copy baseline, CUDA-graph
replay, rows in results/runs.csv's columns, tables and the command line.

Each script (``bench``, ``norm_bench``, ``cache_bench``, ``jax_bench``,
``launch_cost``) keeps its workloads, its implementations and its own rows;
the method below is written once, here.

The method
----------
* GPU time of a call (:func:`time_call`): the median over ``reps`` calls,
  each between its own pair of CUDA events, after a warm-up, rotating among
  input sets so that the L2 cache does not flatter. The timed calls are
  queued behind a kernel that spins on the GPU until the host has enqueued
  them all (checked after the fact: ``Timed.held``), so the events time GPU
  work, not Python.
* The copy roofline (:func:`copy_ms`): a device-to-device copy of the bytes
  an implementation must move, timed the same way in the same run; "of
  copy" is the copy's time over the row's (1.0 is the roofline).
* CUDA-graph replay (:func:`graph_us_per_call`): GPU time per call of many
  calls captured in one torch CUDA graph, replayed between events.
* Rows (:func:`csv_row`, :func:`write_rows`): results/runs.csv's columns, so
  that ``benchmarks.record`` adds a run's ``NAME.rows.json`` as it is.
* Command line (:func:`parser`, :func:`start`): a flag means the same in
  every script that takes it (``--json``, ``--reps``, ``--sets``,
  ``--list``, ``--peers``; each script's ``--help`` lists its own); without
  a CUDA device a script says so in one line and exits with status 2
  (``--help`` and ``--list`` still work).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from benchmarks.record import COLUMNS

#: The checkout whose commit a run measured (this file's tree, not the cwd).
REPO = Path(__file__).resolve().parents[1]

#: The note of a row whose timed calls outran the spin (the events then
#: include host time).
HOST_BOUND = "host-bound: the spin ended before all calls were queued"


def logger(name: str, clock: bool = False) -> Callable[[str], None]:
    """A function printing ``[name] msg`` (with the time if ``clock``) to stderr."""
    def log(msg: str) -> None:
        stamp = f" {time.strftime('%H:%M:%S')}" if clock else ""
        print(f"[{name}{stamp}] {msg}", file=sys.stderr, flush=True)
    return log


def exc_text(exc: BaseException, first_line: bool = False) -> str:
    """``Type: message`` of an exception (only the message's first line if asked)."""
    msg = str(exc)
    if first_line:
        msg = msg.splitlines()[0] if msg else ""
    return f"{exc.__class__.__name__}: {msg}"


def matching(workloads, filters) -> list:
    """The workloads whose ``name`` matches any of the regular expressions (all if none)."""
    if not filters:
        return list(workloads)
    pats = [re.compile(f) for f in filters]
    return [w for w in workloads if any(p.search(w.name) for p in pats)]


# ----------------------------------------------------------------------------
# GPU timing.

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""
_spin_kernel = None


def hold_stream(ms: float = 20.0) -> None:
    """Queue a kernel that keeps the GPU busy for ``ms`` (at ~2 GHz), so that
    the host can enqueue the timed calls behind it: the events then time the
    GPU work alone, not the Python overhead of each call."""
    global _spin_kernel
    import cupy

    if _spin_kernel is None:
        _spin_kernel = cupy.RawKernel(_SPIN, "spin")
    _spin_kernel((1,), (1,), (np.int64(ms * 2e6),))


def sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


class Timed(NamedTuple):
    ms: float      # median milliseconds per call
    held: bool     # the host enqueued every call before the spin ended


def time_call(fn, sets, reps=30, warmup=5) -> Timed:
    """Median time of ``fn(*set)`` over ``reps`` calls rotating through ``sets``.

    Each call sits between its own pair of CUDA events; all calls are queued
    behind a spinning kernel sized from the host cost of a call, and
    ``held`` says whether the host finished enqueuing before the spin ended
    (if not, the spin is lengthened and the measurement repeated, twice at most).
    """
    import cupy

    for i in range(warmup):
        fn(*sets[i % len(sets)])
    sync()
    n = max(3, len(sets))
    t0 = time.perf_counter()
    for i in range(n):
        fn(*sets[i % len(sets)])
    host_ms = (time.perf_counter() - t0) / n * 1e3
    sync()
    hold = min(max(5.0, 2.0 * reps * host_ms + 2.0), 4000.0)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    held = False
    for _attempt in range(3):
        hold_stream(hold)
        spin_done = cupy.cuda.Event()
        spin_done.record()
        for i, (start, stop) in enumerate(events):
            args = sets[i % len(sets)]
            start.record()
            fn(*args)
            stop.record()
        held = not spin_done.done
        events[-1][1].synchronize()
        if held:
            break
        hold = min(hold * 4, 16000.0)
    return Timed(statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in events), held)


def time_ms(fn, sets, reps=30, warmup=5):
    """Median milliseconds of ``fn(*set)`` over ``reps``, rotating through ``sets``."""
    return time_call(fn, sets, reps, warmup).ms


def copy_ms(nbytes, n_sets=3, reps=30):
    """Median time of a device-to-device copy of ``nbytes`` (read + write)."""
    import cupy

    bufs = [(cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8))
            for _ in range(n_sets)]

    def run_copy(src, dst):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    t = time_ms(run_copy, bufs, reps)
    del bufs
    cupy.get_default_memory_pool().free_all_blocks()
    return t


def torch_stream(torch):
    """A context making CuPy's current stream torch's current one, so that the
    events, the spin and the copy share the stream the timed calls launch on."""
    import cupy

    tptr = torch.cuda.current_stream().cuda_stream
    if tptr == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext()
    from cupy_rope.interop import external_stream

    return external_stream(tptr, torch.cuda.current_device())


def capture_graph(call: Callable, args: tuple, calls: int, torch):
    """A torch CUDA graph of ``calls`` calls of ``call(*args)``, replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture, as torch asks
        for _ in range(3):
            call(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_replay_us(graph, calls: int, replays: int, torch, hold_ms: Optional[float] = None):
    """GPU microseconds per call of ``graph`` (``calls`` calls): the median
    over ``replays`` replays, each between its own events, queued behind a
    spin of ``hold_ms`` if given."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    if hold_ms:
        with torch_stream(torch):
            hold_stream(hold_ms)
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events) * 1e3 / calls


def graph_us_per_call(call: Callable, args: tuple, torch, calls: int, replays: int,
                      hold_ms: Optional[float] = None) -> float:
    """GPU microseconds per call of ``calls`` calls of ``call(*args)`` captured
    in one CUDA graph and replayed (:func:`graph_replay_us`)."""
    graph = capture_graph(call, args, calls, torch)
    return graph_replay_us(graph, calls, replays, torch, hold_ms)


# ----------------------------------------------------------------------------
# Rows in results/runs.csv's columns.


def commit() -> str:
    """The short hash of the checked-out commit, the code a run measured (""
    when git cannot name it)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def today() -> str:
    """``YYYY-MM-DD`` (UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def fmt(v, spec: str, missing: str = "") -> str:
    """``format(v, spec)``, or ``missing`` for None."""
    return missing if v is None else format(v, spec)


def csv_row(workload: str, dtype: str, shape: str, implementation: str, direction: str,
            us: float, copy_us: Optional[float] = None) -> dict:
    """One timed row in results/runs.csv's columns, less the run fields
    (microseconds to 3 decimals, the fraction of copy to 4; no copy: "")."""
    return {"workload": workload, "dtype": dtype, "shape": shape,
            "implementation": implementation, "direction": direction,
            "microseconds": f"{us:.3f}", "copy_microseconds": fmt(copy_us, ".3f"),
            "fraction_of_copy": "" if copy_us is None else f"{copy_us / us:.4f}"}


def with_run_fields(rows: list, *, date: str, run: str, commit: str, gpu: str) -> list:
    """``rows`` (:func:`csv_row`) with the run fields, in COLUMNS' order."""
    fields = {"date": date, "run": run, "commit": commit, "gpu": gpu}
    return [{c: {**r, **fields}[c] for c in COLUMNS} for r in rows]


def write_rows(path: str, rows: list, gpu: str, run: str = "", **extra: Any) -> None:
    """Write ``{"device", "columns", "rows", **extra}`` to ``path``: ``rows``
    (:func:`csv_row`) with today's date, ``run``, the commit and ``gpu``, as
    ``benchmarks.record`` adds a run's ``NAME.rows.json``."""
    out = {"device": gpu, "columns": list(COLUMNS),
           "rows": with_run_fields(rows, date=today(), run=run, commit=commit(), gpu=gpu),
           **extra}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def markdown_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_header(columns) -> str:
    """A Markdown table's two header lines; a column named with a trailing
    ``:`` is right-aligned (numbers)."""
    rule = "|" + "|".join("---:" if c.endswith(":") else "---" for c in columns) + "|"
    return markdown_row(c.rstrip(":") for c in columns) + "\n" + rule


def markdown_table(columns, rows) -> str:
    """A Markdown table (:func:`markdown_header`) of ``rows``, lists of cells."""
    return "\n".join([markdown_header(columns), *(markdown_row(r) for r in rows)])


# ----------------------------------------------------------------------------
# Command line.


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.<module>``, its docstring as help."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    """``--reps`` and ``--sets`` (:func:`time_call`'s reps and input sets)."""
    ap.add_argument("--reps", type=int, default=30,
                    help="timed calls per row; the median is kept (default %(default)s)")
    ap.add_argument("--sets", type=int, default=3,
                    help="input sets rotated between calls (default %(default)s)")


def add_peers_arg(ap: argparse.ArgumentParser, names) -> None:
    ap.add_argument("--peers", default="all",
                    help="comma-separated peers (" + ", ".join(names) + "), 'all' "
                         "(default: those that import) or 'none'")


def add_rows_json_arg(ap: argparse.ArgumentParser) -> None:
    """``--json PATH``: where :func:`write_rows` writes the rows."""
    ap.add_argument("--json", help="write the rows (results/runs.csv's columns) here")


def add_list_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")


class Start(NamedTuple):
    """A script's parsed command line, its workloads, and its exit status when
    there is nothing to time (None: go on)."""

    args: argparse.Namespace
    workloads: list
    status: Optional[int]


def start(ap: argparse.ArgumentParser, argv, select: Callable[[argparse.Namespace], list],
          line: Callable[[Any], str], module: str) -> Start:
    """Parse ``argv`` and select the workloads (``select(args)``); status 0
    after printing ``line(w)`` per workload for ``--list``; 2 with one line on
    stderr when no workload is selected or there is no CUDA device."""
    args = ap.parse_args(argv)
    workloads = select(args)
    if args.list:
        for w in workloads:
            print(line(w))
        return Start(args, workloads, 0)
    if not workloads:
        print("no workload selected", file=sys.stderr)
        return Start(args, workloads, 2)
    return Start(args, workloads, no_gpu(module))


def no_gpu(module: str) -> Optional[int]:
    """2, after one line on stderr, when there is no CUDA device; else None."""
    # Imported here: benchmarks.record (a CPU tool) imports this module.
    from cupy_rope.interop import NoCudaDeviceError, require_cuda

    try:
        require_cuda(f"python -m benchmarks.{module}")
    except NoCudaDeviceError as e:  # one line instead of CuPy's traceback
        print(e, file=sys.stderr)
        return 2
    return None
