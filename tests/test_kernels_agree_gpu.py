"""packet_kernel and rope_kernel give the same bits (GPU).

Full rotary on aligned views runs packet_kernel (kernels/packet.cu);
rope_kernel (kernels/rope.cu) still runs it for unaligned views and more
than 2^31 packets. Both spell the rotation with the same fmaf helpers, so
each call below is made twice, once per kernel, and the outputs must be
bitwise equal (and close to the float64 reference: the reference tests
cover packet_kernel through the launcher's default choice).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from conftest import assert_close, np_dtype, oracle
from cupy_rope import api, launch
from gpu_util import angle_sources, bits, full_nan, to_device, to_host

pytestmark = pytest.mark.gpu

ROWS = 64


def _run(packets: bool, monkeypatch, x_dev, kw_dev, mode, dtype, **common):
    """One call with packet_kernel allowed or not; returns (output, kernel mapping)."""
    import cupy

    monkeypatch.setattr(launch, "PACKET_KERNELS", packets)
    monkeypatch.setattr(api, "_plans", {})
    if mode == "inplace":
        work = cupy.empty_like(x_dev)
        work[...] = x_dev
        cupy_rope.apply_rope(work, **kw_dev, **common, inplace=True)
    else:
        work = full_nan(x_dev.shape, dtype)
        cupy_rope.apply_rope(x_dev, **kw_dev, **common, out=work)
    (prepared,) = api._plans.values()
    return to_host(work), prepared.plan.spec.mapping


@pytest.mark.parametrize("mode", ["out", "inplace"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_packet_and_heads_kernels_agree(rng, monkeypatch, interleaved, dtype, head_dim, mode):
    b, s, h = 2, 7, 5
    for layout, positions in (("bshd", False), ("sbhd", False), ("bshd", True)):
        shape = (b, s, h, head_dim) if layout == "bshd" else (s, b, h, head_dim)
        x = rng.standard_normal(shape).astype(np_dtype(dtype))
        x_dev = to_device(x)
        for name, src in angle_sources(rng, dtype, head_dim, ROWS).items():
            kw = dict(src)
            if positions:
                kw["positions"] = rng.integers(0, ROWS, (b, s)).astype(np.int32)
            kw_dev = {k: to_device(v) for k, v in kw.items()}
            for backward in (False, True):
                common = dict(layout=layout, interleaved=interleaved, backward=backward)
                got_p, kind_p = _run(True, monkeypatch, x_dev, kw_dev, mode, dtype, **common)
                got_h, kind_h = _run(False, monkeypatch, x_dev, kw_dev, mode, dtype, **common)
                what = f"{layout} positions={positions} {name} backward={backward}"
                assert (kind_p, kind_h) == ("packets", "heads"), what
                assert np.array_equal(bits(got_p), bits(got_h)), what
                assert_close(got_p, oracle(x, **kw, **common), dtype, what)
