"""The examples run (on the GPU where there is one, else their NumPy path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    # The source checkout first on the path, so that the examples run without
    # an install (as the tests themselves do).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("script", ["quickstart.py"])
def test_example_runs(script):
    proc = run_example(script)
    assert proc.returncode == 0, proc.stderr
    assert "numpy reference" in proc.stdout
    assert "partial rotary: rotary_dim 32 of 128" in proc.stdout


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_paged_decode_example(model):
    """examples/paged_decode.py: on a GPU its logits, tokens and CUDA-graph
    cache match the stock model (exit status 0 only then), Qwen3's with its
    q/k norm inside the cache op; without one it says that it needs a GPU."""
    pytest.importorskip("transformers")
    from helpers import gpu_available

    proc = run_example("paged_decode.py", "--model", model)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not gpu_available():
        assert "needs a CUDA GPU" in proc.stdout
        return
    assert proc.stdout.count(" ok\n") == 8, proc.stdout
    assert "all checks passed" in proc.stdout


def test_jax_example_without_jax_says_how_to_get_it(tmp_path):
    """Where JAX is missing, examples/jax_jit.py says in one line how to
    install it (the ``jax`` extra), without a traceback."""
    fake = tmp_path / "jax"  # shadows any installed JAX: importing it fails as a missing one
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'jax'\", name='jax')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_jit.py")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip() == ('this example needs JAX with CUDA: pip install -e ".[cuda12,jax]" '
                                   'from the checkout')
