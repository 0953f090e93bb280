"""Bad input gets a clear exception naming the argument (CPU, through the shared checks)."""

import re

import numpy as np
import pytest

import cupy_rope


def _x(shape=(2, 4, 3, 8), dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _tables(rows=16, half=4, dtype=np.float32):
    theta = np.arange(rows)[:, None] * np.linspace(0.1, 1, half)
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


COS, SIN = _tables()
INV = np.linspace(0.1, 1, 4).astype(np.float32)

CASES = [
    # (id, call, exception type, text that must appear)
    ("odd head_dim", lambda: cupy_rope.apply_rope(_x((2, 4, 3, 7)), inv_freq=INV),
     ValueError, "x: head_dim"),
    ("odd rotary_dim", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, rotary_dim=3),
     ValueError, "rotary_dim: must be even"),
    ("rotary_dim vs table", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, rotary_dim=6),
     ValueError, "inv_freq: expected 3 frequencies"),
    ("rotary_dim > head_dim",
     lambda: cupy_rope.apply_rope(_x(), inv_freq=np.ones(5, np.float32)),
     ValueError, "rotary_dim: must be <= head_dim (8)"),
    ("wrong rank", lambda: cupy_rope.apply_rope(_x((4, 3, 8)), inv_freq=INV),
     ValueError, "x: expected a 4-D array"),
    ("unknown layout", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, layout="bhsd"),
     ValueError, "layout: expected one of"),
    ("table dtype", lambda: cupy_rope.apply_rope(_x(), *_tables(dtype=np.float16)),
     TypeError, "cos: expected dtype float32"),
    ("cos/sin dtypes differ",
     lambda: cupy_rope.apply_rope(_x(), COS, SIN.astype(np.float64)), TypeError, "sin: expected"),
    ("x dtype", lambda: cupy_rope.apply_rope(_x(dtype=np.int32), inv_freq=INV),
     TypeError, "x: expected dtype"),
    ("cos without sin", lambda: cupy_rope.apply_rope(_x(), COS), ValueError, "sin:"),
    ("two sources", lambda: cupy_rope.apply_rope(_x(), COS, SIN, inv_freq=INV),
     ValueError, "exactly one angle source"),
    ("no source", lambda: cupy_rope.apply_rope(_x()), ValueError, "exactly one angle source"),
    ("table rank", lambda: cupy_rope.apply_rope(_x(), COS[None], SIN[None]),
     ValueError, "cos: expected a 2-D table"),
    ("cos/sin shapes", lambda: cupy_rope.apply_rope(_x(), COS, SIN[:8]),
     ValueError, "sin: expected the shape of cos"),
    ("positions shape",
     lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, positions=np.zeros((4, 2), np.int32)),
     ValueError, "positions: expected shape [4], [1, 4] or [2, 4]"),
    ("positions dtype",
     lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, positions=np.zeros(4, np.float32)),
     TypeError, "positions: expected dtype int32 or int64"),
    ("offsets shape",
     lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, offsets=np.zeros(3, np.int32)),
     ValueError, "offsets: expected shape [2]"),
    ("table too short", lambda: cupy_rope.apply_rope(_x((2, 20, 3, 8)), COS, SIN),
     ValueError, "cos: the table has 16 rows"),
    ("table too short with offset", lambda: cupy_rope.apply_rope(_x(), COS, SIN, offsets=13),
     ValueError, "positions reach 16"),
    ("negative position", lambda: cupy_rope.apply_rope(
        _x(), COS, SIN, positions=np.array([0, 1, -1, 2])), ValueError, "positions reach -1"),
    ("position past table", lambda: cupy_rope.apply_rope(
        _x(), COS, SIN, positions=np.array([[0, 1, 2, 3], [0, 1, 2, 16]])),
     ValueError, "positions reach 16"),
    ("out shape", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, out=_x((2, 4, 3, 10))),
     ValueError, "out: expected shape [2, 4, 3, 8]"),
    ("out dtype", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV,
                                               out=_x(dtype=np.float16)),
     TypeError, "out: expected dtype float32"),
    ("out and inplace", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, out=_x(), inplace=True),
     ValueError, "out: pass either out= or inplace=True"),
    ("inplace read-only", lambda: cupy_rope.apply_rope(_readonly(), inv_freq=INV, inplace=True),
     TypeError, "x: cannot be written in place"),
    ("inplace broadcast", lambda: cupy_rope.apply_rope(
        np.broadcast_to(_x((1, 4, 3, 8)), (2, 4, 3, 8)), inv_freq=INV, inplace=True),
     (ValueError, TypeError), "x:"),
    ("not an array", lambda: cupy_rope.apply_rope([[1.0, 2.0]], inv_freq=INV),
     TypeError, "x: expected an array supporting DLPack"),
    ("no frequencies", lambda: cupy_rope.apply_rope(_x(), inv_freq=np.zeros(0, np.float32)),
     ValueError, "inv_freq: expected at least one frequency"),
    ("offsets bool", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, offsets=True),
     TypeError, "offsets: expected an int or an int32/int64 array, got bool"),
    ("offsets huge", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, offsets=2**63),
     ValueError, "offsets: expected |offsets| < 2**62"),
    ("rotary_dim type", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, rotary_dim=4.0),
     TypeError, "rotary_dim: expected an int"),
    # packed varlen (thd) and context parallel
    ("cu_seqlens dtype", lambda: _thd(cu_seqlens=np.array([0, 4, 10], np.int64)),
     TypeError, "cu_seqlens: expected dtype int32"),
    ("cu_seqlens not monotonic", lambda: _thd(cu_seqlens=np.array([0, 6, 4, 10], np.int32)),
     ValueError, "cu_seqlens: must be non-decreasing, but cu_seqlens[2] = 4 < cu_seqlens[1] = 6"),
    ("cu_seqlens start", lambda: _thd(cu_seqlens=np.array([1, 4, 10], np.int32)),
     ValueError, "cu_seqlens: must start at 0, got 1"),
    ("cu_seqlens last", lambda: _thd(cu_seqlens=np.array([0, 4, 9], np.int32)),
     ValueError, "cu_seqlens: the last entry must be 10 (the tokens of x), got 9"),
    ("cu_seqlens rank", lambda: _thd(cu_seqlens=np.array([[0, 4, 10]], np.int32)),
     ValueError, "cu_seqlens: expected a 1-D array [n_seqs + 1]"),
    ("cu_seqlens with bshd", lambda: cupy_rope.apply_rope(
        _x(), inv_freq=INV, cu_seqlens=np.array([0, 4], np.int32)),
     ValueError, "cu_seqlens: only for layout 'thd'"),
    ("cu_seqlens and positions", lambda: _thd(cu_seqlens=np.array([0, 10], np.int32),
                                              positions=np.arange(10)),
     ValueError, "positions: pass either explicit positions or cu_seqlens"),
    ("cp lengths", lambda: _thd(n=5, cu_seqlens=np.array([0, 4, 10], np.int32), cp_size=2),
     ValueError, "cu_seqlens: with cp_size=2 every sequence length must be divisible by "
                 "2 * cp_size = 4; sequence 1 has length 6"),
    ("cp total", lambda: _thd(n=10, cu_seqlens=np.array([0, 4, 8], np.int32), cp_size=2),
     ValueError, "cu_seqlens: the last entry must be 20"),
    ("cp_rank range", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, cp_size=2, cp_rank=2),
     ValueError, "cp_rank: expected 0 <= cp_rank < cp_size (2), got 2"),
    ("cp_size range", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, cp_size=0),
     ValueError, "cp_size: expected an int >= 1, got 0"),
    ("cp odd local length", lambda: cupy_rope.apply_rope(_x((2, 5, 3, 8)), inv_freq=INV,
                                                         cp_size=2, cp_rank=0),
     ValueError, "x: with cp_size=2 the local sequence length must be even"),
    ("cp with positions", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, cp_size=2,
                                                       positions=np.arange(4)),
     ValueError, "positions: explicit positions are already global"),
    ("thd offsets array without cu_seqlens", lambda: _thd(offsets=np.zeros(10, np.int32)),
     ValueError, "offsets: an offsets array with layout 'thd' needs cu_seqlens"),
    ("thd offsets per sequence", lambda: _thd(cu_seqlens=np.array([0, 4, 10], np.int32),
                                              offsets=np.zeros(3, np.int32)),
     ValueError, "offsets: expected shape [2] (one per sequence)"),
    ("thd positions shape", lambda: _thd(positions=np.arange(9)),
     ValueError, "positions: expected shape [10] (one per token)"),
    ("thd rank", lambda: cupy_rope.apply_rope(_x(), inv_freq=INV, layout="thd"),
     ValueError, "x: expected a 3-D array [t, h, d] for layout 'thd'"),
    ("flat head_dim", lambda: cupy_rope.apply_rope(_x((10, 24)), inv_freq=INV, layout="thd",
                                                   head_dim=7),
     ValueError, "x: the last axis (24) is not a multiple of head_dim (7)"),
    # q and k in one launch
    ("q/k tokens differ", lambda: cupy_rope.apply_rope_qk(_x(), _x((2, 5, 1, 8)), inv_freq=INV),
     ValueError, "k: expected the token axes of q"),
    ("q/k head_dim differ", lambda: cupy_rope.apply_rope_qk(_x(), _x((2, 4, 1, 10)),
                                                            inv_freq=INV),
     ValueError, "k: expected head_dim 8 (that of q), got 10"),
    ("q/k dtypes differ", lambda: cupy_rope.apply_rope_qk(_x(), _x(dtype=np.float16),
                                                          inv_freq=INV),
     TypeError, "k: expected dtype float32 (that of q), got float16"),
    ("q/k one out", lambda: cupy_rope.apply_rope_qk(_x(), _x(), inv_freq=INV, out_q=_x()),
     ValueError, "out_k: pass an output for every input, or none"),
    # fused QKV
    ("qkv width", lambda: cupy_rope.apply_rope_qkv(_x((2, 4, 50)), inv_freq=INV, num_q_heads=4,
                                                   num_kv_heads=1),
     ValueError, "qkv: the last axis (50) is not a multiple of num_q_heads + 2 * num_kv_heads"),
    ("qkv grouped divisibility", lambda: cupy_rope.apply_rope_qkv(
        _x((2, 4, 9, 8)), inv_freq=INV, num_q_heads=5, num_kv_heads=2, packing="grouped"),
     ValueError, "num_q_heads: packing 'grouped' needs num_q_heads (5) to be a multiple"),
    ("qkv packing", lambda: cupy_rope.apply_rope_qkv(_x((2, 4, 6, 8)), inv_freq=INV,
                                                     num_q_heads=4, num_kv_heads=1,
                                                     packing="interleaved"),
     ValueError, "packing: expected one of 'concat', 'grouped'"),
    ("qkv heads", lambda: cupy_rope.apply_rope_qkv(_x((2, 4, 6, 8)), inv_freq=INV,
                                                   num_q_heads=4, num_kv_heads=2),
     ValueError, "qkv: expected 8 heads (num_q_heads + 2 * num_kv_heads) in axis 2, got 6"),
]


def _thd(n=10, **kw):
    return cupy_rope.apply_rope(_x((n, 3, 8)), inv_freq=INV, layout="thd", **kw)


def _readonly():
    x = _x()
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("call,exc,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(call, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        call()


def test_out_partially_overlapping_x_is_rejected():
    buf = np.zeros(2 * 4 * 3 * 8 + 8, np.float32)
    x = buf[:192].reshape(2, 4, 3, 8)
    x[...] = _x()
    before = buf.copy()
    out = buf[8:200].reshape(2, 4, 3, 8)
    with pytest.raises(ValueError, match="out: overlaps x"):
        cupy_rope.apply_rope(x, inv_freq=INV, out=out)
    np.testing.assert_array_equal(buf, before)  # nothing written


def test_out_overlapping_a_table_is_rejected():
    buf = np.zeros(16 * 4 + 2 * 4 * 3 * 8, np.float32)
    cos = buf[:64].reshape(16, 4)
    out = buf[32:32 + 192].reshape(2, 4, 3, 8)
    with pytest.raises(ValueError, match="out: overlaps cos"):
        cupy_rope.apply_rope(_x(), cos, SIN, out=out)


def test_out_that_is_x_is_refused():
    x = _x()
    before = x.copy()
    with pytest.raises(ValueError, match="out: is x itself; pass inplace=True"):
        cupy_rope.apply_rope(x, inv_freq=INV, out=x)
    np.testing.assert_array_equal(x, before)


def test_inputs_unchanged_after_errors():
    x, cos, sin = _x(), COS.copy(), SIN.copy()
    saved = [a.copy() for a in (x, cos, sin)]
    for kw in ({"rotary_dim": 3}, {"layout": "x"}, {"out": _x((1, 1, 1, 2))}):
        with pytest.raises((ValueError, TypeError)):
            cupy_rope.apply_rope(x, cos, sin, inplace=True, **kw)
    for a, b in zip((x, cos, sin), saved):
        np.testing.assert_array_equal(a, b)


def test_heads_of_one_buffer_are_disjoint_at_the_token_period():
    """q and k as head ranges of one [b, s, h, d] buffer interleave at the
    period of a token's heads (not of a batch entry's tokens): apart, and
    in place together; a k inside q's heads overlaps."""
    from cupy_rope import interop, validate

    buf = np.zeros((2, 16, 4, 64), np.float32)
    q, k, inside = (interop.describe(v, "v") for v in (buf[:, :, :3], buf[:, :, 3:],
                                                           buf[:, :, 2:3]))
    assert validate.disjoint(q, k) and validate.disjoint(k, q)
    assert not validate.disjoint(q, inside) and not validate.disjoint(inside, q)
    x = np.random.default_rng(0).standard_normal((2, 16, 4, 64)).astype(np.float32)
    cos = np.cos(np.arange(16)[:, None] * np.linspace(0.01, 1, 32)).astype(np.float32)
    sin = np.sin(np.arange(16)[:, None] * np.linspace(0.01, 1, 32)).astype(np.float32)
    want = cupy_rope.apply_rope_qk(x[:, :, :3].copy(), x[:, :, 3:].copy(), cos, sin)
    cupy_rope.apply_rope_qk(x[:, :, :3], x[:, :, 3:], cos, sin, inplace=True)
    assert np.array_equal(x[:, :, :3], want[0]) and np.array_equal(x[:, :, 3:], want[1])
    with pytest.raises(ValueError, match="overlaps"):
        cupy_rope.apply_rope_qk(x[:, :, :3], x[:, :, 2:3], cos, sin, inplace=True)


def test_disjoint_never_calls_sharing_views_apart():
    """validate.disjoint is sufficient: over random strided byte views of one
    buffer (several lattice levels), every pair it calls disjoint shares no
    byte."""
    from cupy_rope import interop, validate

    rng = np.random.default_rng(7)
    base = np.zeros(4096, np.int8)
    by_lattice = 0
    for _ in range(4000):
        views = []
        for j in range(2):
            nd = int(rng.integers(2, 5))
            shape = tuple(int(v) for v in rng.integers(1, 5, nd))
            unit = int(rng.choice([1, 2, 4, 8]))
            strides = sorted((int(v) * unit for v in rng.integers(1, 12, nd)), reverse=True)
            # nested blocks (each stride a multiple of the next) make lattice levels
            if rng.random() < 0.5:
                strides = [unit * int(np.prod([2 + i for i in range(nd - 1 - m)]))
                           for m in range(nd)]
            off = int(rng.integers(0, 64))
            if j and rng.random() < 0.7:  # a neighbour of the first: same strides, close by
                strides, nd = list(views[0].strides), views[0].ndim
                shape = tuple(int(rng.integers(1, n + 1)) for n in views[0].shape)
                off = first_off + int(rng.integers(0, 2 * strides[-1] * views[0].shape[-1] + 1))
            first_off = off if not j else first_off
            if off + sum((n - 1) * s for n, s in zip(shape, strides)) >= base.size:
                break
            views.append(np.lib.stride_tricks.as_strided(base[off:], shape, strides))
        if len(views) < 2:
            continue
        a, b = (interop.describe(v, "v") for v in views)
        if not validate.disjoint(a, b):
            continue
        sa, sb = validate.rel_span(a), validate.rel_span(b)
        by_lattice += a.ptr + sa[0] < b.ptr + sb[1] and b.ptr + sb[0] < a.ptr + sa[1]
        bytes_a = {a.ptr + sum(i * s for i, s in zip(ix, views[0].strides))
                   for ix in np.ndindex(views[0].shape)}
        bytes_b = {b.ptr + sum(i * s for i, s in zip(ix, views[1].strides))
                   for ix in np.ndindex(views[1].shape)}
        assert not bytes_a & bytes_b
    assert by_lattice > 20  # the lattice test, not only the spans, was exercised


@pytest.mark.parametrize("op", ["rope", "qk", "qkv", "qkv_backward"])
def test_each_array_argument_is_described_once_per_call(monkeypatch, op):
    """The general path describes every array argument once (validation
    works on those descriptions), whatever the op and the options."""
    from cupy_rope import validate

    seen = []
    real = validate.describe
    monkeypatch.setattr(validate, "describe", lambda a, name: seen.append(id(a)) or real(a, name))
    cos, sin = _tables()
    pos, offs = np.arange(4), np.array([1, 2])
    if op == "rope":
        args = (_x(), cos, sin)
        kw = dict(positions=pos, offsets=offs, out=_x())
        cupy_rope.apply_rope(*args, **kw)
    elif op == "qk":
        args = (_x(), _x((2, 4, 1, 8)), cos, sin)
        kw = dict(positions=pos, offsets=offs, out_q=_x(), out_k=_x((2, 4, 1, 8)))
        cupy_rope.apply_rope_qk(*args, **kw)
    elif op == "qkv":
        args = (_x((2, 4, 48)), cos, sin)
        kw = dict(positions=pos, offsets=offs, num_q_heads=4, num_kv_heads=1,
                  out_q=_x((2, 4, 4, 8)), out_k=_x((2, 4, 1, 8)), out_v=_x((2, 4, 1, 8)))
        cupy_rope.apply_rope_qkv(*args, **kw)
    else:
        args = (_x((2, 4, 4, 8)), _x((2, 4, 1, 8)), _x((2, 4, 1, 8)), cos, sin)
        kw = dict(positions=pos, offsets=offs, out=_x((2, 4, 48)))
        cupy_rope.apply_rope_qkv_backward(*args, **kw)
    given = [id(a) for a in args] + [id(v) for v in kw.values() if isinstance(v, np.ndarray)]
    assert sorted(seen) == sorted(given)


def test_apply_rope_backward_takes_apply_ropes_parameters_but_backward():
    import inspect

    forward = dict(inspect.signature(cupy_rope.apply_rope).parameters)
    backward = dict(inspect.signature(cupy_rope.apply_rope_backward).parameters)
    del forward["backward"], forward["x"], backward["grad"]
    assert backward == forward
    x, cos, sin = _x(), *_tables()
    np.testing.assert_array_equal(cupy_rope.apply_rope_backward(x, cos, sin, offsets=3),
                                  cupy_rope.apply_rope(x, cos, sin, offsets=3, backward=True))


def test_check_call_equals_describe_then_check():
    """check_call (keyword arguments) is describe_arrays + check_options + check."""
    from cupy_rope import validate

    x, cos, sin = _x(), *_tables()
    pos = np.arange(4)
    want = validate.check_call(x, cos, sin, positions=pos, offsets=2, interleaved=True)
    arrays = validate.describe_arrays("rope", (x,), (cos, sin, None, None, None), positions=pos,
                                      offsets=2)
    options = validate.check_options(validate.Options(interleaved=True))
    assert validate.check(arrays, options) == want
