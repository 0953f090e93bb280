"""cupy_rope.torch's argument checks on the CPU (the ops run the NumPy
reference for CPU tensors): the same rules as the array API, and angle
tensors that ask for a gradient refused rather than given a silent zero."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_rope.torch as crt  # noqa: E402


def tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 16, generator=g)
    theta = torch.arange(16)[:, None] * torch.linspace(0.1, 1, 8)
    return x, theta.cos(), theta.sin()


BAD = [
    ("offsets float", dict(offsets=1.9), TypeError, "offsets: expected an int"),
    ("offsets bool", dict(offsets=True), TypeError, "offsets: expected an int"),
    ("interleaved str", dict(interleaved="no"), TypeError, "interleaved: expected a bool"),
    ("cp_size float", dict(cp_size=2.7), TypeError, "cp_size: expected an int"),
    ("rotary_dim float", dict(rotary_dim=8.0), TypeError, "rotary_dim: expected an int"),
]


@pytest.mark.parametrize("kw,exc,text", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fn", ["rope", "rope_qk"])
def test_bad_arguments_refused_as_the_array_api_does(fn, kw, exc, text):
    x, cos, sin = tensors()
    call = (lambda: crt.rope(x, cos, sin, **kw)) if fn == "rope" else (
        lambda: crt.rope_qk(x, x[:, :, :1], cos, sin, **kw))
    with pytest.raises(exc, match=re.escape(text)):
        call()


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_angles_that_require_grad_are_refused(name):
    x, cos, sin = tensors()
    x.requires_grad_(True)
    tables = {"cos": cos, "sin": sin}
    tables[name] = tables[name].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=f"{name}: requires grad"):
        crt.rope(x, tables["cos"], tables["sin"])
    with torch.no_grad():  # nothing is recorded: the tables are plain inputs
        out = crt.rope(x, tables["cos"], tables["sin"])
    want = crt.rope(x.detach(), cos, sin)
    np.testing.assert_array_equal(out.numpy(), want.numpy())
    inv = torch.linspace(0.1, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="inv_freq: requires grad"):
        crt.rope(x, inv_freq=inv)


def test_array_api_writes_bump_torch_versions():
    """apply_rope in place (or out=) on torch tensors counts as an in-place
    op for autograd: a backward through a saved tensor it overwrote is refused."""
    import cupy_rope

    x, cos, sin = tensors()
    w = x.clone().requires_grad_(True)
    y = torch.exp(w)  # exp saves its result for the backward
    v = y._version
    with torch.no_grad():
        cupy_rope.apply_rope(y, cos, sin, inplace=True)
    assert y._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # out= and q/k in place too; a fresh result is not bumped
    out, q, k = torch.empty_like(x), x.clone(), x[:, :, :1].clone()
    versions = out._version, q._version, k._version
    cupy_rope.apply_rope(x, cos, sin, out=out)
    cupy_rope.apply_rope_qk(q, k, cos, sin, inplace=True)
    assert out._version > versions[0] and q._version > versions[1] and k._version > versions[2]
    assert cupy_rope.apply_rope(x, cos, sin)._version == 0


def test_docstring_examples():
    """The Examples of the public functions run as written (CPU tensors)."""
    import doctest

    result = doctest.testmod(crt, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed
