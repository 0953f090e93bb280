"""flat_kernel, packet_kernel and rope_kernel give the same bits (GPU).

Dense slabs with implied positions and cos/sin tables run flat_kernel
(kernels/flat.cu); other full-rotary calls on aligned views run
packet_kernel (kernels/packet.cu); rope_kernel (kernels/rope.cu) still runs
unaligned views, more than 2^31 packets, and angles computed from inv_freq
or freqs for 16 or more heads. All spell the rotation with the same fmaf
helpers, so each call below is made once per kernel the launcher may pick
for it, and the outputs must be bitwise equal (and close to the float64
reference: the reference tests cover the launcher's default choice).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np
import pytest

import cupy_rope
from helpers import assert_close, np_dtype, oracle
from cupy_rope import api, launch
from gpu_util import angle_sources, bits, fresh_plans, full_nan, to_device, to_host

pytestmark = pytest.mark.gpu

ROWS = 64


#: The kernels a test allows, by the fastest of them (LaunchPolicy.kernels).
KERNELS_UP_TO = {"flat": ("flat", "packet", "rope"), "packet": ("packet", "rope"),
                 "rope": ("rope",)}


def _policy(monkeypatch, **fields) -> None:
    """This test's launch policy: the shipped one with ``fields`` changed
    (restored after the test), and empty plan caches."""
    monkeypatch.setattr(launch, "POLICY", dataclasses.replace(launch.POLICY, **fields))
    fresh_plans(monkeypatch)


def _run(kernels: str, monkeypatch, x_dev, kw_dev, mode, dtype, out_like_x=False,
         flat_early_tables_bytes=None, **common):
    """One call with the kernels allowed (KERNELS_UP_TO: "flat": all,
    "packet": packet_kernel and rope_kernel, "rope": rope_kernel only); returns
    (output, kernel mapping, head-major rows). ``out_like_x``: the output has
    x's memory order (else it is contiguous)."""
    import cupy

    fields = {} if flat_early_tables_bytes is None else {
        "flat_early_tables_bytes": flat_early_tables_bytes}
    _policy(monkeypatch, kernels=KERNELS_UP_TO[kernels], **fields)
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
    fixed = launch.unpack_fixed(prepared.plan)
    if prepared.plan.spec.mapping == "flat":
        assert fixed["zero"] == 0  # ANDed into table addresses (kernels/flat.cu LATE_TABLES)
    return to_host(work), prepared.plan.spec.mapping, fixed.get("slab[0].head_major", 0)


class StoredCall(NamedTuple):
    """How x is laid out for a kernel comparison."""

    layout: str
    storage: str  # the axis order x is stored in
    batch: int
    positions: bool  # explicit positions
    out_like_x: bool  # the output in x's memory order (else contiguous)


# Storage orders with heads outside the token axes (bhsd seen as bshd, shbd
# as sbhd, htd as thd) are walked head-major by packet_kernel: with the
# sequence inner, the batch inner, and one outer index.
STORED_CALLS = (
    StoredCall("bshd", "bshd", 2, False, False), StoredCall("sbhd", "sbhd", 2, False, False),
    StoredCall("bshd", "bshd", 2, True, False), StoredCall("bshd", "bhsd", 2, False, True),
    StoredCall("bshd", "bhsd", 2, True, True), StoredCall("bshd", "bhsd", 2, False, False),
    StoredCall("bshd", "bhsd", 1, False, True), StoredCall("sbhd", "shbd", 2, False, True),
    StoredCall("thd", "htd", 1, True, True))


@pytest.mark.parametrize("mode", ["out", "inplace"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_flat_packet_and_rope_kernels_agree(rng, monkeypatch, interleaved, dtype, head_dim,
                                             mode):
    s, h = 7, 5
    # flat_kernel's NeoX rows fill a warp but for at most 2 lanes, or (out
    # of place) the thread loads its partner itself
    packets = head_dim * np.dtype(np_dtype(dtype)).itemsize // 16
    flat_rows = (interleaved or mode != "inplace"
                 or (packets <= 32 and 32 % packets <= launch.POLICY.flat_max_idle_lanes))
    for layout, storage, b, positions, out_like_x in STORED_CALLS:
        shape = {"bshd": (b, s, h, head_dim), "sbhd": (s, b, h, head_dim),
                 "bhsd": (b, h, s, head_dim), "shbd": (s, h, b, head_dim),
                 "htd": (h, s, head_dim)}[storage]
        x = rng.standard_normal(shape).astype(np_dtype(dtype))
        x_dev = to_device(x)
        if storage in ("bhsd", "shbd"):
            x, x_dev = x.transpose(0, 2, 1, 3), x_dev.transpose(0, 2, 1, 3)
        elif storage == "htd":
            x, x_dev = x.transpose(1, 0, 2), x_dev.transpose(1, 0, 2)
        head_major = storage in ("bhsd", "shbd", "htd")
        pos_shape = (s,) if layout == "thd" else (b, s)
        for name, src in angle_sources(rng, dtype, head_dim, ROWS).items():
            kw = dict(src)
            if positions:
                kw["positions"] = rng.integers(0, ROWS, pos_shape).astype(np.int32)
            kw_dev = {k: to_device(v) for k, v in kw.items()}
            flat = (not positions and "cos" in src and flat_rows
                    and (mode == "inplace" or out_like_x or not head_major))
            if positions:
                # explicit positions of one batch entry ([s], thd) into a small
                # table, 16-bit x, rows whose table reads come late: only GPT-J
                # here (NeoX's 5 head rows a position split the angles)
                flat = ("cos" in src and (layout == "thd" or b == 1)
                        and interleaved and dtype != "float32"
                        and (mode == "inplace" or out_like_x or not head_major))
            for backward in (False, True):
                common = dict(layout=layout, interleaved=interleaved, backward=backward)
                got_f, kind_f, _ = _run("flat", monkeypatch, x_dev, kw_dev, mode, dtype,
                                        out_like_x, **common)
                got_p, kind_p, major_p = _run("packet", monkeypatch, x_dev, kw_dev, mode, dtype,
                                              out_like_x, **common)
                got_h, kind_h, _ = _run("rope", monkeypatch, x_dev, kw_dev, mode, dtype,
                                        out_like_x, **common)
                what = (f"{storage} as {layout} positions={positions} out_like_x={out_like_x} "
                        f"{name} backward={backward}")
                assert (kind_f, kind_p, kind_h) == (
                    "flat" if flat else "packet", "packet", "rope"), what
                assert major_p == head_major, what
                assert np.array_equal(bits(got_p), bits(got_h)), what
                assert np.array_equal(bits(got_f), bits(got_h)), what
                assert_close(got_p, oracle(x, **kw, **common), dtype, what)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qk_with_one_slab_walked_head_major(rng, monkeypatch, dtype):
    """q stored [b, h, s, d] (walked head-major by packet_kernel, rows at
    several positions per flat_kernel block) and k contiguous bshd in one
    launch: all kernels give the same bits, close to float64."""
    b, s, hq, hk, d = 2, 9, 6, 2, 64
    q = rng.standard_normal((b, hq, s, d)).astype(np_dtype(dtype)).transpose(0, 2, 1, 3)
    k = rng.standard_normal((b, s, hk, d)).astype(np_dtype(dtype))
    src = angle_sources(rng, dtype, d, ROWS)["table_f32"]
    kw_dev = {n: to_device(v) for n, v in src.items()}
    got = {}
    for kernels in ("flat", "packet", "rope"):
        _policy(monkeypatch, kernels=KERNELS_UP_TO[kernels])
        k_dev = to_device(k)
        q_dev = to_device(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
        out_q = full_nan((b, hq, s, d), dtype).transpose(0, 2, 1, 3)  # q's memory order
        out_k = full_nan(k.shape, dtype)
        cupy_rope.apply_rope_qk(q_dev, k_dev, **kw_dev, out_q=out_q, out_k=out_k)
        (prepared,) = api._plans.values()
        fixed = launch.unpack_fixed(prepared.plan)
        spec = prepared.plan.spec
        assert spec.mapping == kernels
        assert spec.split_angles == (kernels == "flat")
        assert (fixed.get("slab[0].head_major", 0), fixed.get("slab[1].head_major", 0)) == (
            (1, 0) if kernels == "packet" else (0, 0))
        got[kernels] = (to_host(out_q), to_host(out_k))
    for i, (x, name) in enumerate(((q, "q"), (k, "k"))):
        for kernels in ("flat", "packet"):
            assert np.array_equal(bits(got[kernels][i]), bits(got["rope"][i])), (kernels, name)
        assert_close(got["flat"][i], oracle(x, **src, layout="bshd"), dtype, name)


@pytest.mark.parametrize("k_heads", [0, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flat_kernel_for_the_slab_count(rng, monkeypatch, dtype, k_heads):
    """flat_kernel compiled for the call's slab count (x alone: 1, q and k:
    2) and rope_kernel (any count) write every element, the same bits, close
    to float64."""
    b, s, h, d = 2, 9, 5, 64
    x = rng.standard_normal((b, s, h, d)).astype(np_dtype(dtype))
    k = rng.standard_normal((b, s, k_heads, d)).astype(np_dtype(dtype))
    src = angle_sources(rng, dtype, d, ROWS)["table_f32"]
    kw_dev = {n: to_device(v) for n, v in src.items()}
    got = {}
    for exact in (True, False):  # flat_kernel, then rope_kernel
        _policy(monkeypatch, kernels=KERNELS_UP_TO["flat" if exact else "rope"])
        outs = [full_nan(x.shape, dtype), full_nan(k.shape, dtype)]
        if k_heads:
            cupy_rope.apply_rope_qk(to_device(x), to_device(k), **kw_dev, out_q=outs[0],
                                    out_k=outs[1])
        else:
            cupy_rope.apply_rope(to_device(x), **kw_dev, out=outs[0])
        (prepared,) = api._plans.values()
        spec = prepared.plan.spec
        assert spec.mapping == ("flat" if exact else "rope")
        assert spec.slabs == ((2 if k_heads else 1) if exact else 0)
        got[exact] = [to_host(o) for o in outs[:1 + bool(k_heads)]]
    for i, (arr, name) in enumerate(((x, "x"), (k, "k"))[:1 + bool(k_heads)]):
        assert np.array_equal(bits(got[True][i]), bits(got[False][i])), name
        assert_close(got[True][i], oracle(arr, **src, layout="bshd"), dtype, name)


@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_partial_rotary_in_place_flat_and_rope_kernels_agree(rng, monkeypatch, interleaved,
                                                              dtype, head_dim, fraction):
    """Partial rotary in place on flat_kernel (only the rotated packets of
    each row walked) gives rope_kernel's bits, and the channels past
    rotary_dim keep their bits."""
    s, h, b = 7, 5, 2
    r = int(head_dim * fraction) // 2 * 2
    vec = 16 // np.dtype(np_dtype(dtype)).itemsize
    packets = r // vec
    flat = ((r % vec == 0) if interleaved
            else ((r // 2) % vec == 0 and 32 % packets <= launch.POLICY.flat_max_idle_lanes))
    for layout, storage in (("bshd", "bshd"), ("sbhd", "sbhd"), ("bshd", "bhsd"),
                            ("thd", "thd")):
        shape = {"bshd": (b, s, h, head_dim), "sbhd": (s, b, h, head_dim),
                 "bhsd": (b, h, s, head_dim), "thd": (s, h, head_dim)}[storage]
        x = rng.standard_normal(shape).astype(np_dtype(dtype))
        x_dev = to_device(x)
        if storage == "bhsd":
            x, x_dev = x.transpose(0, 2, 1, 3), x_dev.transpose(0, 2, 1, 3)
        src = angle_sources(rng, dtype, r, ROWS)["table_f32"]
        kw_dev = {k: to_device(v) for k, v in src.items()}
        for backward in (False, True):
            common = dict(layout=layout, interleaved=interleaved, backward=backward, rotary_dim=r)
            got_f, kind_f, _ = _run("flat", monkeypatch, x_dev, kw_dev, "inplace", dtype, **common)
            got_h, kind_h, _ = _run("rope", monkeypatch, x_dev, kw_dev, "inplace", dtype,
                                    **common)
            what = f"{storage} as {layout} r={r} backward={backward}"
            assert (kind_f, kind_h) == ("flat" if flat else "rope", "rope"), what
            assert np.array_equal(bits(got_f), bits(got_h)), what
            assert np.array_equal(bits(got_f[..., r:]), bits(x[..., r:])), what  # untouched
            assert_close(got_f, oracle(x, **src, **common), dtype, what)


class PositionsCase(NamedTuple):
    """Explicit positions for flat_kernel: x's layout and storage order, its
    batch, and the positions' shape, dtype and view."""

    layout: str
    storage: str
    batch: int
    pos_shape: tuple
    pos_dtype: type
    view: Optional[str] = None  # "strided" (every other element) or "reversed"
    offset: int = 0  # scalar offset
    outside: bool = False  # two device positions outside the table


@pytest.mark.parametrize("mode", ["out", "inplace"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_flat_kernel_explicit_positions(rng, monkeypatch, interleaved, dtype, head_dim, mode):
    """Explicit positions that follow the sequence index alone (thd [t],
    bshd / sbhd [s], bshd [1, s], [b, h, s, d] storage seen as bshd with
    [s]; int32, int64, strided and reversed views, a scalar offset) run
    flat_kernel, which reads them at each row's sequence index: every element
    written, rope_kernel's bits, close to float64; device positions outside
    the table (past it, negative) give NaN in their tokens' rows and leave the
    others right, as in rope_kernel. In place, partial rotary too (the tail's
    bits untouched)."""
    s, h, d = 9, 32, head_dim
    src = angle_sources(rng, dtype, d, ROWS)["table_f32"]
    P = PositionsCase
    cases = [P("thd", "thd", 1, (s,), np.int32),
             P("thd", "thd", 1, (s,), np.int64, "strided", offset=3),
             P("thd", "thd", 1, (s,), np.int32, "reversed"),
             P("bshd", "bshd", 2, (s,), np.int32),
             P("bshd", "bshd", 1, (1, s), np.int64),
             P("sbhd", "sbhd", 2, (s,), np.int32, "strided"),
             P("bshd", "bhsd", 2, (s,), np.int32),
             P("thd", "thd", 1, (s,), np.int32, outside=True)]
    for layout, storage, b, pos_shape, pos_dtype, view, offset, outside in cases:
        shape = {"thd": (s, h, d), "bshd": (b, s, h, d), "sbhd": (s, b, h, d),
                 "bhsd": (b, h, s, d)}[storage]
        x = rng.standard_normal(shape).astype(np_dtype(dtype))
        x_dev = to_device(x)
        head_outside = storage == "bhsd"
        if head_outside:  # output in x's memory order (flat_kernel needs x's strides)
            x, x_dev = x.transpose(0, 2, 1, 3), x_dev.transpose(0, 2, 1, 3)
        pos = rng.integers(0, ROWS - offset, pos_shape)
        bad = np.zeros(s, bool)
        if outside:
            pos[3], pos[5] = ROWS + 5, -2
            bad[[3, 5]] = True
        if view == "strided":  # every other element of a longer array
            wide = np.zeros(pos_shape[:-1] + (2 * s,), dtype=pos_dtype)
            wide[..., ::2] = pos
            pos_dev = to_device(wide)[..., ::2]
        elif view == "reversed":  # a negative stride
            pos_dev = to_device(pos[..., ::-1].astype(pos_dtype))[..., ::-1]
        else:
            pos_dev = to_device(pos.astype(pos_dtype))
        kw = dict({k: to_device(v) for k, v in src.items()}, positions=pos_dev)
        # NeoX pairs on rows stored head-major lie at several positions a
        # block (split angles): packet_kernel keeps those
        want_kind = "packet" if head_outside and not interleaved else "flat"
        for backward in (False, True):
            common = dict(layout=layout, interleaved=interleaved, backward=backward)
            if offset:
                common["offsets"] = offset
            got_f, kind_f, _ = _run("flat", monkeypatch, x_dev, kw, mode, dtype,
                                    head_outside, **common)
            got_h, kind_h, _ = _run("rope", monkeypatch, x_dev, kw, mode, dtype,
                                    head_outside, **common)
            what = (f"{storage} as {layout} positions {pos_shape} {np.dtype(pos_dtype)} "
                    f"{view} offset={offset} outside={outside} backward={backward}")
            assert (kind_f, kind_h) == (want_kind, "rope"), what
            assert np.array_equal(bits(got_f), bits(got_h)), what
            plain = {k: v for k, v in common.items() if k != "offsets"}
            if outside:
                assert np.isnan(got_f[bad].astype(np.float32)).all(), what
                want = oracle(x[~bad], **src, positions=pos[~bad].astype(np.int64), **plain)
                assert_close(got_f[~bad], want, dtype, what)
            else:
                want = oracle(x, **src, positions=pos.astype(np.int64) + offset, **plain)
                assert_close(got_f, want, dtype, what)
    if mode == "inplace":  # partial rotary: the rotated packets of each row only
        r = d // 2
        part = angle_sources(rng, dtype, r, ROWS)["table_f32"]
        x = rng.standard_normal((s, h, d)).astype(np_dtype(dtype))
        pos = rng.integers(0, ROWS, (s,))
        kw = dict({k: to_device(v) for k, v in part.items()},
                  positions=to_device(pos.astype(np.int32)))
        common = dict(layout="thd", interleaved=interleaved, rotary_dim=r)
        got_f, kind_f, _ = _run("flat", monkeypatch, to_device(x), kw, mode, dtype, **common)
        got_h, kind_h, _ = _run("rope", monkeypatch, to_device(x), kw, mode, dtype, **common)
        assert (kind_f, kind_h) == ("flat", "rope")
        assert np.array_equal(bits(got_f), bits(got_h))
        assert np.array_equal(bits(got_f[..., r:]), bits(x[..., r:]))  # untouched
        assert_close(got_f, oracle(x, **part, positions=pos.astype(np.int64), **common), dtype)


@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
def test_flat_kernel_explicit_positions_q_and_k_decode(rng, monkeypatch, pos_dtype):
    """The vLLM decode form (q [t, 32 * d] and k [t, 8 * d] in place at
    positions [t] into a cos|sin cache) runs flat_kernel for two slabs:
    rope_kernel's bits, close to float64."""
    t, hq, hk, d = 5, 32, 8, 128
    q = rng.standard_normal((t, hq * d)).astype(np_dtype("bfloat16"))
    k = rng.standard_normal((t, hk * d)).astype(np_dtype("bfloat16"))
    src = angle_sources(rng, "bfloat16", d, ROWS)["table_f32"]
    cache = np.concatenate([src["cos"], src["sin"]], axis=1)
    pos = rng.integers(0, ROWS, (t,)).astype(pos_dtype)
    cache_dev, pos_dev = to_device(cache), to_device(pos)
    got = {}
    for kernels in ("flat", "rope"):
        _policy(monkeypatch, kernels=KERNELS_UP_TO[kernels])
        q_dev, k_dev = to_device(q), to_device(k)
        cupy_rope.apply_rope_qk(q_dev, k_dev, cos_sin_cache=cache_dev, positions=pos_dev,
                                layout="thd", head_dim=d, inplace=True)
        (prepared,) = api._plans.values()
        spec = prepared.plan.spec
        assert (spec.mapping, spec.pos_mode) == (kernels, "explicit")
        if kernels == "flat":
            assert spec.slabs == 2
        got[kernels] = (to_host(q_dev), to_host(k_dev))
    for i, (x, heads, name) in enumerate(((q, hq, "q"), (k, hk, "k"))):
        assert np.array_equal(bits(got["flat"][i]), bits(got["rope"][i])), name
        want = oracle(x.reshape(t, heads, d), **src, positions=pos.astype(np.int64),
                      layout="thd")
        assert_close(got["flat"][i].reshape(t, heads, d), want, dtype="bfloat16", what=name)


@pytest.mark.parametrize("mode", ["out", "inplace"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_flat_kernel_early_and_late_tables_agree(rng, monkeypatch, interleaved, dtype,
                                                 head_dim, mode):
    """flat_kernel asking for its table rows early (large calls,
    LaunchPolicy.flat_early_tables_bytes, here lowered to 0) and late gives the
    same bits, close to float64; in place with partial rotary too (the
    tail's bits untouched)."""
    s, b, h, d = 9, 2, 32, head_dim
    shipped = launch.POLICY.flat_early_tables_bytes
    for r in (d, d // 2) if mode == "inplace" else (d,):
        x = rng.standard_normal((s, b, h, d)).astype(np_dtype(dtype))
        src = angle_sources(rng, dtype, r, ROWS)["table_f32"]
        kw = {k: to_device(v) for k, v in src.items()}
        got = {}
        for bound in (shipped, 0):
            common = dict(layout="sbhd", interleaved=interleaved, rotary_dim=r)
            out, kind, _ = _run("flat", monkeypatch, to_device(x), kw, mode, dtype,
                                flat_early_tables_bytes=bound, **common)
            (prepared,) = api._plans.values()
            assert kind == "flat" and prepared.plan.spec.early_tables == (bound == 0)
            got[bound] = out
        assert np.array_equal(bits(got[0]), bits(got[shipped])), r
        assert np.array_equal(bits(got[0][..., r:]), bits(x[..., r:])), r  # untouched
        assert_close(got[0], oracle(x, **src, **common), dtype, f"r={r}")
    if mode == "out":  # q and k in one launch (two slabs)
        q = rng.standard_normal((s, b, h, d)).astype(np_dtype(dtype))
        k = rng.standard_normal((s, b, 8, d)).astype(np_dtype(dtype))
        src = angle_sources(rng, dtype, d, ROWS)["table_f32"]
        kw = {n: to_device(v) for n, v in src.items()}
        got = {}
        for bound in (shipped, 0):
            _policy(monkeypatch, flat_early_tables_bytes=bound)
            outs = (full_nan(q.shape, dtype), full_nan(k.shape, dtype))
            cupy_rope.apply_rope_qk(to_device(q), to_device(k), **kw, layout="sbhd",
                                    interleaved=interleaved, out_q=outs[0], out_k=outs[1])
            (prepared,) = api._plans.values()
            spec = prepared.plan.spec
            assert (spec.mapping, spec.slabs, spec.early_tables) == ("flat", 2, bound == 0)
            got[bound] = [to_host(o) for o in outs]
        for i, x in enumerate((q, k)):
            assert np.array_equal(bits(got[0][i]), bits(got[shipped][i])), i
            assert_close(got[0][i], oracle(x, **src, layout="sbhd", interleaved=interleaved),
                         dtype, f"slab {i}")


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_flat_kernel_x_evict_last_gives_the_same_bits(rng, monkeypatch, interleaved, head_dim):
    """fp32 x loaded by flat_kernel with an L2 evict-last policy (rows in
    position order, out of place) and by rope_kernel give the same bits,
    close to float64: sbhd, thd, bshd with one batch entry, q + k."""
    s, b, h, d = 9, 2, 8, head_dim
    src = angle_sources(rng, "float32", d, ROWS)["table_f32"]
    kw = {k: to_device(v) for k, v in src.items()}
    # fp32 NeoX rows of more than 32 packets, or that leave lanes idle (d96,
    # d256), load their partner themselves: plain loads (no evict-last)
    want = interleaved or d in (64, 128)
    for layout, shape in (("sbhd", (s, b, h, d)), ("thd", (s, h, d)), ("bshd", (1, s, h, d))):
        x = rng.standard_normal(shape).astype(np.float32)
        got = {}
        for on in (True, False):  # flat_kernel, then rope_kernel
            out, kind, _ = _run("flat" if on else "rope", monkeypatch, to_device(x), kw, "out",
                                "float32", layout=layout, interleaved=interleaved)
            (prepared,) = api._plans.values()
            assert kind == ("flat" if on else "rope"), layout
            assert prepared.plan.spec.x_evict_last == (on and want), layout
            got[on] = out
        assert np.array_equal(bits(got[True]), bits(got[False])), layout
        assert_close(got[True], oracle(x, **src, layout=layout, interleaved=interleaved),
                     "float32", layout)
    q = rng.standard_normal((s, b, h, d)).astype(np.float32)
    k = rng.standard_normal((s, b, 2, d)).astype(np.float32)
    got = {}
    for on in (True, False):
        _policy(monkeypatch, kernels=KERNELS_UP_TO["flat" if on else "rope"])
        outs = (full_nan(q.shape, "float32"), full_nan(k.shape, "float32"))
        cupy_rope.apply_rope_qk(to_device(q), to_device(k), **kw, layout="sbhd",
                                interleaved=interleaved, out_q=outs[0], out_k=outs[1])
        (prepared,) = api._plans.values()
        assert prepared.plan.spec.x_evict_last == (on and want)
        got[on] = [to_host(o) for o in outs]
    for i, x in enumerate((q, k)):
        assert np.array_equal(bits(got[True][i]), bits(got[False][i])), i
        assert_close(got[True][i], oracle(x, **src, layout="sbhd", interleaved=interleaved),
                     "float32", f"slab {i}")
