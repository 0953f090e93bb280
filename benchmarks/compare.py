"""Compare two benchmark runs row by row: the code before a change against the code after it.

    python -m benchmarks.compare OLD.json NEW.json [--threshold 0.01]
                                 [--host-threshold T] [--impl NAME] [--strict]

OLD.json and NEW.json are what ``--json`` of the benchmark writes. For the
comparison to mean anything, take both on the same GPU in one session and
with the same flags (see ``benchmarks/bench.py``, "Comparing two versions of
the code", or ``BASELINE=`` in ``tools/gpu_suite.sh``)::

    (cd /path/to/old/tree && python -m cupy_rope.bench --json /tmp/old.json)
    python -m benchmarks.bench --json /tmp/new.json
    python -m benchmarks.compare /tmp/old.json /tmp/new.json

One table follows: every row of cupy-rope's (workload, implementation,
direction) with the old and the new microseconds, new/old, and new/old of the
same run's device copy of the same bytes (how much the GPU itself moved
between the runs); then the decode host cost, variant by variant. A row whose
new/old lies further than the threshold from 1 is flagged, and so is a row
present or ok in one run only. ``--strict`` exits 1 when any row is flagged.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple

#: cupy-rope's implementations in the benchmark's rows (bench.OURS_IMPLS;
#: repeated so that comparing needs no GPU libraries).
OURS_IMPLS = ("cupy-rope", "cupy-rope pos")
DEFAULT_THRESHOLD = 0.01

#: The host section's per-call figures, in the order shown, with their labels.
HOST_FIGURES = (
    ("torch", "torch apply_rope_qk"),
    ("torch_bound", "torch RotaryEmbedding.qk_"),
    ("torch_launch", "torch bare launch"),
    ("torch_python", "torch Python share of qk_"),
    ("cupy", "cupy apply_rope_qk"),
    ("cupy_bound", "cupy RotaryEmbedding.qk_"),
    ("cupy_launch", "cupy bare launch"),
    ("cupy_python", "cupy Python share of qk_"),
    ("torch_add", "torch x.add_(1) (host speed)"),
    ("graph", "CUDA graph replay, GPU per call"),
    ("graph_wall", "CUDA graph replay, wall per call"),
)


class Row(NamedTuple):
    """One compared figure. ``old`` and ``new`` are microseconds, or None
    where that run has no ok figure (``note`` says why)."""

    workload: str
    impl: str
    direction: str
    old: float | None
    new: float | None
    copy_ratio: float | None = None   # new/old of the same-run device copy
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.old is None or self.new is None or self.old <= 0:
            return None
        return self.new / self.old


class Comparison(NamedTuple):
    old_device: str
    new_device: str
    gpu: list        # Row per (workload, impl, direction)
    host: list       # Row per host figure (workload "host", direction "")
    threshold: float
    host_threshold: float
    old_config: dict | None = None   # the runs' "config" (reps, sets, ...)
    new_config: dict | None = None

    def flagged(self, row: Row) -> bool:
        """Beyond the threshold, or not comparable (missing or failed in a run)."""
        limit = self.host_threshold if row.workload == "host" else self.threshold
        return row.ratio is None or abs(row.ratio - 1.0) > limit

    def flags(self) -> list:
        return [r for r in self.gpu + self.host if self.flagged(r)]


def load(path: str, name: str = "path") -> dict:
    """A benchmark result from a JSON file; ValueError naming ``name`` if it is not one."""
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError(f"{name}: {path} is not a benchmark result (no 'rows' list)")
    return result


def _ours(result, impls) -> dict:
    return {(r["workload"], r["impl"], r["direction"]): r for r in result["rows"]
            if r["impl"] in impls}


def _time(row):
    """(microseconds or None, why not)."""
    if row is None:
        return None, "missing"
    if row.get("status") != "ok" or row.get("time_us") is None:
        return None, row.get("status", "?")
    return row["time_us"], ""


def _copy_ratio(old_row, new_row):
    old = (old_row or {}).get("copy_time_us")
    new = (new_row or {}).get("copy_time_us")
    return new / old if old and new else None


def gpu_rows(old: dict, new: dict, impls=OURS_IMPLS) -> list:
    """A :class:`Row` per (workload, impl, direction) of ``impls`` in either
    run: the old run's order, then rows only the new run has."""
    a, b = _ours(old, impls), _ours(new, impls)
    rows = []
    for key in list(a) + [k for k in b if k not in a]:
        (t_old, why_old), (t_new, why_new) = _time(a.get(key)), _time(b.get(key))
        note = "; ".join(f"{run}: {why}" for run, why in (("old", why_old), ("new", why_new))
                         if why)
        rows.append(Row(*key, t_old, t_new, _copy_ratio(a.get(key), b.get(key)), note))
    return rows


def host_rows(old: dict, new: dict) -> list:
    """A :class:`Row` per host figure that either run has (none without host sections)."""
    a, b = old.get("host") or {}, new.get("host") or {}
    rows = []
    for key, label in HOST_FIGURES:
        t_old, t_new = a.get(f"{key}_us_per_call"), b.get(f"{key}_us_per_call")
        if t_old is None and t_new is None:
            continue
        note = "; ".join(f"{run}: missing" for run, t in (("old", t_old), ("new", t_new))
                         if t is None)
        rows.append(Row("host", label, "", t_old, t_new, note=note))
    return rows


def compare(old: dict, new: dict, threshold=DEFAULT_THRESHOLD, host_threshold=None,
            impls=OURS_IMPLS) -> Comparison:
    """Row-by-row comparison of two benchmark results.

    Parameters
    ----------
    old, new : dict
        Benchmark results (as ``bench.run`` returns and ``--json`` writes).
    threshold : float
        A GPU row is flagged when ``|new/old - 1|`` exceeds it.
    host_threshold : float, optional
        The same for the host rows; defaults to ``threshold``.
    impls : tuple of str
        Implementations compared (default: cupy-rope's rows).

    Returns
    -------
    Comparison

    Raises
    ------
    ValueError
        If a threshold is negative.

    Example
    -------
    >>> c = compare(load("old.json"), load("new.json"))  # doctest: +SKIP
    >>> print(format_comparison(c))  # doctest: +SKIP
    """
    host_threshold = threshold if host_threshold is None else host_threshold
    for name, v in (("threshold", threshold), ("host_threshold", host_threshold)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    return Comparison(old.get("device", "?"), new.get("device", "?"), gpu_rows(old, new, impls),
                      host_rows(old, new), threshold, host_threshold, old.get("config", {}),
                      new.get("config", {}))


def _num(v, spec, width):
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"


def _line(c: Comparison, r: Row) -> str:
    flag = "<<" if c.flagged(r) else ""
    name = (f"  {r.impl:42s}" if r.workload == "host"
            else f"{r.workload:26s} {r.direction:3s} {r.impl:14s}")
    return (f"{name} {_num(r.old, '.2f', 10)} "
            f"{_num(r.new, '.2f', 10)} {_num(r.ratio, '.4f', 8)} "
            f"{_num(r.copy_ratio, '.4f', 9)}  {flag:2s} {r.note}").rstrip()


def format_comparison(c: Comparison) -> str:
    """The comparison as one table, flagged rows marked ``<<``, and a summary line."""
    same = "same GPU" if c.old_device == c.new_device else "DIFFERENT GPUs"
    lines = [f"old: {c.old_device}; new: {c.new_device} ({same})"]
    if c.old_config != c.new_config:
        lines.append(f"the runs' settings differ: old {c.old_config}, new {c.new_config}")
    lines.append(f"{'workload':26s} {'dir':3s} {'impl':14s} {'old us':>10s} {'new us':>10s} "
                 f"{'new/old':>8s} {'copy n/o':>9s}  flag")
    lines += [_line(c, r) for r in c.gpu]
    if c.host:
        lines.append("decode host cost, median per call:")
        lines += [_line(c, r) for r in c.host]
    flagged = c.flags()
    n = len(c.gpu) + len(c.host)
    lines.append(f"{len(flagged)} of {n} rows flagged (GPU rows beyond "
                 f"{c.threshold:.1%}, host rows beyond {c.host_threshold:.1%}, or missing)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="the baseline run's JSON")
    ap.add_argument("new", help="the run under test's JSON")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                    help="flag GPU rows whose new/old differs from 1 by more than this "
                         "(default %(default)s)")
    ap.add_argument("--host-threshold", type=float, default=None,
                    help="the same for the host rows (default: --threshold)")
    ap.add_argument("--impl", action="append",
                    help="implementation to compare (repeatable; default: cupy-rope's rows)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any row is flagged")
    args = ap.parse_args(argv)
    c = compare(load(args.old, "old"), load(args.new, "new"), args.threshold,
                args.host_threshold, tuple(args.impl) if args.impl else OURS_IMPLS)
    print(format_comparison(c))
    return 1 if args.strict and c.flags() else 0


if __name__ == "__main__":
    sys.exit(main())
