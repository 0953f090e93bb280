"""The examples run (on the GPU where there is one, else their NumPy path)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["quickstart.py"])
def test_example_runs(script):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "numpy reference" in proc.stdout
