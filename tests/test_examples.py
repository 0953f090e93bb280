"""The examples run (on the GPU where there is one, else their NumPy path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str) -> subprocess.CompletedProcess:
    # The source checkout first on the path, so that the examples run without
    # an install (as the tests themselves do).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("script", ["quickstart.py"])
def test_example_runs(script):
    proc = run_example(script)
    assert proc.returncode == 0, proc.stderr
    assert "numpy reference" in proc.stdout
    assert "partial rotary: rotary_dim 32 of 128" in proc.stdout
