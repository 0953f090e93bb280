"""examples/tour.ipynb runs top to bottom: its code cells are executed in one
namespace in a subprocess (no Jupyter needed), on the reference path (CPU,
NumPy arrays) anywhere and on the GPU path where there is a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "tour.ipynb"

# Executes the notebook's code cells in order in one namespace, then prints the
# path the notebook took (it sets TOUR_PATH).
RUNNER = r"""
import json, sys
with open(sys.argv[1]) as f:
    nb = json.load(f)
ns = {"__name__": "__main__"}
for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
        continue
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    print(f"--- cell {i}", flush=True)
    exec(compile(src, f"<tour.ipynb cell {i}>", "exec"), ns)
print("TOUR_PATH=" + ns["TOUR_PATH"], flush=True)
"""


def load():
    with open(NOTEBOOK) as f:
        return json.load(f)


def run_notebook(device: str, tmp_path, timeout: int):
    env = dict(os.environ, CUPY_ROPE_TOUR_DEVICE=device, MPLBACKEND="Agg",
               CUPY_ROPE_TOUR_PLOT=str(tmp_path / "tour_bench.png"))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NOTEBOOK)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"notebook failed (exit {proc.returncode})\n--- stdout (tail)\n{proc.stdout[-4000:]}"
        f"\n--- stderr (tail)\n{proc.stderr[-4000:]}")
    return proc.stdout


def test_notebook_is_nbformat4_without_outputs():
    nb = load()
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    for c in nb["cells"]:
        assert c["cell_type"] in ("markdown", "code")
        assert isinstance(c["source"], (list, str))
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(), as_version=4))


def test_notebook_runs_on_the_reference_path(tmp_path):
    """CPU: NumPy arrays through the float64 reference, benchmark skipped."""
    out = run_notebook("cpu", tmp_path, timeout=300)
    assert "TOUR_PATH=reference" in out
    assert "benchmark skipped" in out
    assert "tour finished on the reference path" in out


@pytest.mark.gpu
def test_notebook_runs_on_the_gpu_path(tmp_path):
    """GPU: the kernels, the correctness table and the benchmark (the notebook
    raises if it cannot take the GPU path)."""
    out = run_notebook("gpu", tmp_path, timeout=600)
    assert "TOUR_PATH=gpu" in out
    assert "benchmark skipped" not in out
    assert "FAIL" not in out
    if importlib.util.find_spec("matplotlib") is not None:  # the notebook saved its plot
        assert (tmp_path / "tour_bench.png").stat().st_size > 0


def test_first_cell_without_cupy_says_so_in_one_line(tmp_path):
    """Where CuPy cannot be imported (here made so, on any machine): one line
    names the cause, no traceback, and the reference path is taken."""
    fake = tmp_path / "cupy"  # shadows any installed CuPy
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no CuPy here')\n")
    first = next(c for c in load()["cells"] if c["cell_type"] == "code")
    src = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
    path = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, CUPY_ROPE_TOUR_DEVICE="auto", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", src + "\nprint('TOUR_PATH=' + TOUR_PATH)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "CUDA device" in line]
    assert said == ["no CUDA device found (CuPy is not installed)"], proc.stdout
    assert "TOUR_PATH=reference" in proc.stdout


def test_first_cell_without_a_gpu_says_so_in_one_line(tmp_path):
    """auto on a machine without a usable GPU (no CuPy, no driver or no device):
    one line says so, no traceback, and the reference path is taken."""
    from helpers import gpu_available

    if gpu_available():
        pytest.skip("a CUDA device is usable here")
    first = next(c for c in load()["cells"] if c["cell_type"] == "code")
    src = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
    env = dict(os.environ, CUPY_ROPE_TOUR_DEVICE="auto")
    proc = subprocess.run([sys.executable, "-c", src + "\nprint('TOUR_PATH=' + TOUR_PATH)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if "CUDA device" in line]
    assert len(said) == 1 and said[0].startswith("no CUDA device found"), proc.stdout
    assert "TOUR_PATH=reference" in proc.stdout
