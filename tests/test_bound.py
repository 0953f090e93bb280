"""cupy_rope.RotaryEmbedding on the host: copies and pickles are made again
through the constructor (their own tables, their own signatures)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import cupy_rope


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_copies_are_rebuilt_with_the_same_options(rng, how):
    cos = rng.standard_normal((20, 8)).astype(np.float32)
    sin = rng.standard_normal((20, 8)).astype(np.float32)
    rope = cupy_rope.RotaryEmbedding(cos, sin, layout="sbhd", sections=[4, 4],
                                     interleaved=True)
    dup = {"deepcopy": copy.deepcopy, "copy": copy.copy,
           "pickle": lambda r: pickle.loads(pickle.dumps(r))}[how](rope)
    assert type(dup) is cupy_rope.RotaryEmbedding and dup._fixed == rope._fixed
    assert (dup._tables[0] is rope._tables[0]) == (how == "copy")
    x = rng.standard_normal((5, 2, 3, 16)).astype(np.float32)
    pos = np.stack([np.arange(5), np.arange(5)[::-1]])
    assert np.array_equal(dup(x, pos), rope(x, pos))
    if how != "copy":
        cos[...] = 0  # the original's table only
        assert np.array_equal(dup._tables[0], rope._tables[0]) is False
