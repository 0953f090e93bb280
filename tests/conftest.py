"""pytest set-up: the GPU marker and the seeded random generator (helpers live in helpers.py)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from helpers import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    # Fresh inputs on every run; the seed is printed so a failure can be replayed.
    seed = int(np.random.SeedSequence().entropy % (2**63))
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)
