"""Record a benchmark run: its rows go into results/runs.csv, its files into results/latest/.

    python -m benchmarks.record RUN_DIR [--commit HASH] [--date YYYY-MM-DD] [--run NAME]

RUN_DIR is a folder written by ``bash tools/gpu_suite.sh`` (bench.json,
bench.png, logs). Every timed row of bench.json becomes one CSV row, and so
does every timing of its decode host section (direction ``host``), so that
the history of any figure is a filter on one file. The other benchmarks
(JAX, the fused ops) write ``NAME.rows.json``: rows in the CSV's columns,
which are added as they are, with the run's date, name, commit and GPU.

A run of only those other benchmarks (no bench.json) is a partial run: its
rows are appended, and ``results/latest/`` keeps the latest full run.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"

COLUMNS = ("date", "run", "commit", "gpu", "workload", "dtype", "shape", "implementation",
           "direction", "microseconds", "copy_microseconds", "fraction_of_copy")

# The files of a run that results/latest/ keeps; anything else in RUN_DIR stays out.
LATEST_KINDS = ("bench.json", "bench.png", "README.md", "*.log", "*.txt", "*.rows.json")
# The run fields record() fills in; the other columns come from the benchmark.
RUN_FIELDS = ("date", "run", "commit", "gpu")

# The decode host section's timings in bench.json, each with the implementation
# it is recorded as. A key missing from a run's JSON is skipped, since earlier
# versions of the benchmark did not time every part.
HOST_TIMINGS = (
    ("torch_us_per_call", "cupy-rope apply_rope_qk (torch)"),
    ("torch_bound_us_per_call", "cupy-rope qk_ (torch)"),
    ("torch_launch_us_per_call", "cupy-rope bare launch (torch)"),
    ("torch_python_us_per_call", "cupy-rope qk_ Python (torch)"),
    ("cupy_us_per_call", "cupy-rope apply_rope_qk (cupy)"),
    ("cupy_bound_us_per_call", "cupy-rope qk_ (cupy)"),
    ("cupy_launch_us_per_call", "cupy-rope bare launch (cupy)"),
    ("cupy_python_us_per_call", "cupy-rope qk_ Python (cupy)"),
    ("graph_us_per_call", "cupy-rope CUDA graph replay"),
    ("torch_add_us_per_call", "torch x.add_(1)"),
)


@dataclass(frozen=True)
class RunInfo:
    """What every CSV row of one run repeats.

    Attributes
    ----------
    run : str
        The run's name, e.g. the folder name ``h100-2026-11-24r``.
    date : str
        ``YYYY-MM-DD``.
    commit : str
        The code commit the run measured.
    gpu : str
        The device name the benchmark reported.
    """

    run: str
    date: str
    commit: str
    gpu: str


def _us(value) -> str:
    return "" if value is None else f"{value:.3f}"


def _workload_fields(workload: dict | None) -> dict:
    """dtype and shape (``4x4096x32x128``) of a bench.json workload entry."""
    if not workload:
        return {"dtype": "", "shape": ""}
    return {"dtype": workload.get("dtype", ""),
            "shape": "x".join(str(n) for n in workload.get("shape", ()))}


def device_rows(result: dict, info: RunInfo) -> list[dict]:
    """CSV rows of the timed device rows of a bench.json result.

    Parameters
    ----------
    result : dict
        The parsed bench.json.
    info : RunInfo
        The run the rows belong to.

    Returns
    -------
    list of dict
        One row per row of ``result["rows"]`` with a time (rows a peer cannot
        run, or that failed, have none and are left out), keyed by ``COLUMNS``.
    """
    workloads = {w["name"]: w for w in result.get("workloads", [])}
    rows = []
    for r in result.get("rows", []):
        if r.get("time_us") is None:
            continue
        fraction = r.get("fraction_of_copy")
        rows.append({**vars(info), "workload": r["workload"],
                     **_workload_fields(workloads.get(r["workload"])),
                     "implementation": r["impl"], "direction": r["direction"],
                     "microseconds": _us(r["time_us"]),
                     "copy_microseconds": _us(r.get("copy_time_us")),
                     "fraction_of_copy": "" if fraction is None else f"{fraction:.4f}"})
    return rows


def host_rows(result: dict, info: RunInfo) -> list[dict]:
    """CSV rows of the decode host section of a bench.json result.

    Parameters
    ----------
    result : dict
        The parsed bench.json; its ``host`` entry may be absent.
    info : RunInfo
        The run the rows belong to.

    Returns
    -------
    list of dict
        One row per timing in ``HOST_TIMINGS`` and per peer timed, direction
        ``host``, microseconds per call; no copy or fraction of copy.
    """
    host = result.get("host") or {}
    by_title = {w.get("title"): w for w in result.get("workloads", [])}
    workload = by_title.get(host.get("workload"))
    base = {**vars(info), "workload": workload["name"] if workload else host.get("workload", ""),
            **_workload_fields(workload), "direction": "host",
            "copy_microseconds": "", "fraction_of_copy": ""}
    timings = [(name, host.get(key)) for key, name in HOST_TIMINGS]
    timings += list((host.get("peers_us_per_call") or {}).items())
    return [{**base, "implementation": name, "microseconds": _us(us)}
            for name, us in timings if us is not None]


def rows_of(result: dict, info: RunInfo) -> list[dict]:
    """Every CSV row of one bench.json result: device rows, then host rows."""
    return device_rows(result, info) + host_rows(result, info)


def extra_rows(run_dir: Path, info: RunInfo) -> list[dict]:
    """CSV rows of every ``*.rows.json`` in ``run_dir`` (sorted by name).

    Each file holds a list of rows, or an object with ``rows`` (and
    ``device``), keyed by the CSV's columns; the run fields come from ``info``
    (the file's ``device`` where ``info`` has no GPU name).

    Raises
    ------
    ValueError
        If a row lacks one of the columns other than the run fields.
    """
    rows = []
    for path in sorted(run_dir.glob("*.rows.json")):
        data = json.loads(path.read_text())
        listed = data if isinstance(data, list) else data.get("rows", [])
        gpu = info.gpu or ("" if isinstance(data, list) else data.get("device", ""))
        for r in listed:
            missing = [c for c in COLUMNS if c not in RUN_FIELDS and c not in r]
            if missing:
                raise ValueError(f"{path.name}: a row without {', '.join(missing)}")
            rows.append({**{c: r.get(c, "") for c in COLUMNS}, **vars(info), "gpu": gpu})
    return rows


def recorded_runs(csv_path: Path) -> set[str]:
    """The run names already in ``csv_path`` (empty when it does not exist)."""
    if not csv_path.exists():
        return set()
    with csv_path.open(newline="") as f:
        return {row["run"] for row in csv.DictReader(f)}


def append_rows(csv_path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``csv_path``, writing the header first if the file is new.

    Raises
    ------
    ValueError
        If the existing file's header is not ``COLUMNS``.
    """
    new = not csv_path.exists() or csv_path.stat().st_size == 0
    if not new:
        with csv_path.open(newline="") as f:
            header = tuple(next(csv.reader(f), ()))
        if header != COLUMNS:
            raise ValueError(f"{csv_path} has columns {header}, expected {COLUMNS}")
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def latest_files(run_dir: Path) -> list[Path]:
    """The files of ``run_dir`` that match ``LATEST_KINDS``, sorted by name."""
    found = {p for kind in LATEST_KINDS for p in run_dir.glob(kind) if p.is_file()}
    return sorted(found)


def replace_latest(run_dir: Path, latest: Path) -> list[Path]:
    """Make ``latest`` hold ``run_dir``'s files of the known kinds and nothing else.

    Returns
    -------
    list of Path
        The files now in ``latest``.

    Raises
    ------
    ValueError
        If ``run_dir`` is ``latest`` itself (its files would be deleted).
    """
    if run_dir.resolve() == latest.resolve():
        raise ValueError(f"run_dir {run_dir} is the latest folder itself")
    files = latest_files(run_dir)
    if latest.exists():
        shutil.rmtree(latest)
    latest.mkdir(parents=True)
    return [Path(shutil.copy2(p, latest / p.name)) for p in files]


def _default_date(run: str) -> str:
    """The ``YYYY-MM-DD`` in the run's name, else today's date (UTC)."""
    found = re.search(r"\d{4}-\d{2}-\d{2}", run)
    if found:
        return found.group()
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def _head_commit() -> str:
    """The short hash of the checked-out commit, the code a fresh run measured."""
    # Imported here: the harness imports this module's COLUMNS.
    from benchmarks.harness import commit

    found = commit()
    if not found:
        raise ValueError("commit: git cannot name HEAD here; pass --commit HASH")
    return found


def record(run_dir, results=None, commit=None, date=None, run=None) -> int:
    """Append a run's rows to ``results/runs.csv`` and make it ``results/latest/``
    (a full run: one with bench.json).

    Parameters
    ----------
    run_dir : str or Path
        The run's folder; it must hold bench.json or a ``NAME.rows.json``.
    results : str or Path, optional
        The folder of ``runs.csv`` and ``latest/``; default: the repository's
        ``results/``.
    commit : str, optional
        The code commit the run measured; default: git's HEAD.
    date : str, optional
        ``YYYY-MM-DD``; default: the date in the run's name, else today.
    run : str, optional
        The run's name in the CSV; default: ``run_dir``'s folder name.

    Returns
    -------
    int
        The number of rows appended.

    Raises
    ------
    FileNotFoundError
        If ``run_dir`` has neither bench.json nor a ``NAME.rows.json``.
    ValueError
        If ``run`` is already in the CSV, or ``date`` is not ``YYYY-MM-DD``.

    Example
    -------
    >>> record("gpu-logs", commit="abc1234")  # doctest: +SKIP
    """
    run_dir, results = Path(run_dir), Path(results or RESULTS)
    bench = run_dir / "bench.json"
    full = bench.is_file()
    if not full and not list(run_dir.glob("*.rows.json")):
        raise FileNotFoundError(f"run_dir: no bench.json or NAME.rows.json in {run_dir}")
    run = run or run_dir.resolve().name
    date = date or _default_date(run)
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ValueError(f"date: expected YYYY-MM-DD, got {date!r}")
    csv_path = results / "runs.csv"
    if run in recorded_runs(csv_path):
        raise ValueError(f"run: {run!r} is already in {csv_path}; pass --run NAME")
    result = json.loads(bench.read_text()) if full else {}
    info = RunInfo(run=run, date=date, commit=commit or _head_commit(),
                   gpu=result.get("device", ""))
    rows = (rows_of(result, info) if full else []) + extra_rows(run_dir, info)
    append_rows(csv_path, rows)
    if full:
        replace_latest(run_dir, results / "latest")
    return len(rows)


def main(argv=None) -> int:
    """Command line: ``python -m benchmarks.record RUN_DIR [--commit] [--date] [--run]``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.record",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="folder with bench.json, bench.png and the logs of one run")
    ap.add_argument("--commit", help="the code commit the run measured (default: git HEAD)")
    ap.add_argument("--date", help="YYYY-MM-DD (default: the date in the run's name, else today)")
    ap.add_argument("--run", help="the run's name in the CSV (default: RUN_DIR's folder name)")
    args = ap.parse_args(argv)
    try:
        n = record(args.run_dir, commit=args.commit, date=args.date, run=args.run)
    except (FileNotFoundError, ValueError) as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 2
    kept = "replaced" if (Path(args.run_dir) / "bench.json").is_file() else "kept (a partial run)"
    print(f"record: {n} rows appended to {RESULTS / 'runs.csv'}; {RESULTS / 'latest'} {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
