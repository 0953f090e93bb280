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


def _run(packets: bool, monkeypatch, x_dev, kw_dev, mode, dtype, out_like_x=False, **common):
    """One call with packet_kernel allowed or not; returns (output, kernel
    mapping, head-major rows). ``out_like_x``: the output has x's memory
    order (else it is contiguous)."""
    import cupy

    monkeypatch.setattr(launch, "PACKET_KERNELS", packets)
    monkeypatch.setattr(api, "_plans", {})
    if mode == "inplace":
        work = cupy.empty_like(x_dev)
        work[...] = x_dev
        cupy_rope.apply_rope(work, **kw_dev, **common, inplace=True)
    else:
        work = full_nan(x_dev.shape, dtype)
        if out_like_x:
            work, nan = cupy.empty_like(x_dev), work
            work[...] = nan
        cupy_rope.apply_rope(x_dev, **kw_dev, **common, out=work)
    (prepared,) = api._plans.values()
    fixed = dict(zip((n for n, _ in launch.FIXED_FIELDS),
                     launch._FIXED.unpack_from(prepared.plan.buf, launch._DYNAMIC.size)))
    return to_host(work), prepared.plan.spec.mapping, fixed["slab[0].head_major"]


@pytest.mark.parametrize("mode", ["out", "inplace"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_packet_and_heads_kernels_agree(rng, monkeypatch, interleaved, dtype, head_dim, mode):
    b, s, h = 2, 7, 5
    # (layout, x stored as, explicit positions, output in x's memory order):
    # "bhsd" storage is a [b, h, s, d] array seen as bshd, which
    # packet_kernel walks head-major.
    for layout, storage, positions, out_like_x in (
            ("bshd", "bshd", False, False), ("sbhd", "sbhd", False, False),
            ("bshd", "bshd", True, False), ("bshd", "bhsd", False, True),
            ("bshd", "bhsd", True, True), ("bshd", "bhsd", False, False)):
        shape = {"bshd": (b, s, h, head_dim), "sbhd": (s, b, h, head_dim),
                 "bhsd": (b, h, s, head_dim)}[storage]
        x = rng.standard_normal(shape).astype(np_dtype(dtype))
        x_dev = to_device(x)
        if storage == "bhsd":
            x, x_dev = x.transpose(0, 2, 1, 3), x_dev.transpose(0, 2, 1, 3)
        for name, src in angle_sources(rng, dtype, head_dim, ROWS).items():
            kw = dict(src)
            if positions:
                kw["positions"] = rng.integers(0, ROWS, (b, s)).astype(np.int32)
            kw_dev = {k: to_device(v) for k, v in kw.items()}
            for backward in (False, True):
                common = dict(layout=layout, interleaved=interleaved, backward=backward)
                got_p, kind_p, major_p = _run(True, monkeypatch, x_dev, kw_dev, mode, dtype,
                                              out_like_x, **common)
                got_h, kind_h, _ = _run(False, monkeypatch, x_dev, kw_dev, mode, dtype,
                                        out_like_x, **common)
                what = (f"{storage} as {layout} positions={positions} out_like_x={out_like_x} "
                        f"{name} backward={backward}")
                assert (kind_p, kind_h) == ("packets", "heads"), what
                assert major_p == (storage == "bhsd"), what
                assert np.array_equal(bits(got_p), bits(got_h)), what
                assert_close(got_p, oracle(x, **kw, **common), dtype, what)
