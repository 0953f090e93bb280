"""The cached path of functional calls and RotaryEmbedding methods
(api._fast_calls): a repeated signature launches without the general path,
gives the general path's bits, and still re-checks what may change per call
(offset range, overlap, aliasing, the calling thread, host arrays of the
same class, each object's own tables)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cupy_rope
from cupy_rope import api
from helpers import np_dtype
from gpu_util import bits, to_device, to_host

pytestmark = pytest.mark.gpu

D = 64
ROWS = 48


def angles(d=D, rows=ROWS):
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    theta = (np.arange(rows)[:, None] * inv.astype(np.float64)).astype(np.float32)
    return np.cos(theta), np.sin(theta)


def rand(rng, shape, dtype, fw):
    return to_device(rng.standard_normal(shape).astype(np_dtype(dtype)), fw)


def poison(shape, dtype, fw):
    return to_device(np.full(shape, np.nan, np_dtype(dtype)), fw)


def case(name, rng, fw):
    """(function, args, kwargs) of one call; fresh arrays of one signature per call."""
    dtype = "float32" if fw == "cupy" else "bfloat16"
    cos, sin = (to_device(t, fw) for t in angles())
    cache = to_device(np.concatenate(angles(), 1), fw)
    if name == "rope new output":
        return cupy_rope.apply_rope, (rand(rng, (2, 16, 3, D), dtype, fw), cos, sin), {}
    if name == "rope in place, offset":
        return (cupy_rope.apply_rope, (rand(rng, (16, 2, 3, D), dtype, fw), cos, sin),
                dict(layout="sbhd", inplace=True, offsets=7))
    if name == "rope out=, partial":
        return (cupy_rope.apply_rope, (rand(rng, (2, 16, 3, D), dtype, fw), cos[:, :16], sin[:, :16]),
                dict(out=poison((2, 16, 3, D), dtype, fw), interleaved=True))
    if name == "qk decode in place":
        pos = to_device(rng.integers(0, ROWS, 9).astype(np.int64), fw)
        return (cupy_rope.apply_rope_qk, (rand(rng, (9, 8, D), dtype, fw),
                                         rand(rng, (9, 2, D), dtype, fw)),
                dict(cos_sin_cache=cache, positions=pos, layout="thd", inplace=True))
    if name == "qk new outputs, cu_seqlens":
        cu = to_device(np.array([0, 5, 5, 20], np.int32), fw)
        return (cupy_rope.apply_rope_qk, (rand(rng, (20, 4, D), dtype, fw),
                                         rand(rng, (20, 1, D), dtype, fw), cos, sin),
                dict(layout="thd", cu_seqlens=cu))
    if name == "qkv":
        return (cupy_rope.apply_rope_qkv, (rand(rng, (2, 8, 6 * D), dtype, fw), cos, sin),
                dict(num_q_heads=4, num_kv_heads=1, head_dim=D))
    if name == "qkv backward, out=":
        return (cupy_rope.apply_rope_qkv_backward,
                (rand(rng, (2, 8, 4, D), dtype, fw), rand(rng, (2, 8, 1, D), dtype, fw),
                 rand(rng, (2, 8, 1, D), dtype, fw), cos, sin),
                dict(out=poison((2, 8, 6 * D), dtype, fw)))
    raise AssertionError(name)


CASES = ["rope new output", "rope in place, offset", "rope out=, partial", "qk decode in place",
         "qk new outputs, cu_seqlens", "qkv", "qkv backward, out="]


def host(result):
    if isinstance(result, tuple):
        return [bits(to_host(r)) for r in result]
    return [bits(to_host(result))]


def general_path(monkeypatch):
    """Every functional call takes the general path from here on."""
    monkeypatch.setattr(api, "_fast_calls", {})
    monkeypatch.setattr(api, "_fast_call", lambda *a: False)


def no_general_path(monkeypatch):
    """A call that reaches the general path from here on fails the test."""
    def refuse(*a, **kw):
        raise AssertionError("the general path was taken")
    monkeypatch.setattr(api, "_slow", refuse)
    monkeypatch.setattr(api, "_plans", {})


@pytest.mark.parametrize("fw", ["torch", "cupy"])
@pytest.mark.parametrize("name", CASES)
def test_repeated_signature_takes_the_fast_path_with_the_same_bits(rng, monkeypatch, fw, name):
    if fw == "torch":
        pytest.importorskip("torch")
    seed = int(rng.integers(2**31))
    fn, args, kwargs = case(name, np.random.default_rng(seed), fw)
    fn(*args, **kwargs)  # plans; the fast path keeps a launcher
    # Three more calls of that signature on fresh arrays with the same values.
    _, args, kwargs = case(name, np.random.default_rng(seed), fw)
    _, args2, kwargs2 = case(name, np.random.default_rng(seed), fw)
    _, ref_args, ref_kwargs = case(name, np.random.default_rng(seed), fw)
    with monkeypatch.context() as m:
        no_general_path(m)
        got = fn(*args, **kwargs)
        again = fn(*args2, **kwargs2)
    with monkeypatch.context() as m:
        general_path(m)
        want = fn(*ref_args, **ref_kwargs)
    first = got if isinstance(got, tuple) else (got,)
    second = again if isinstance(again, tuple) else (again,)
    for g, a, w in zip(host(got), host(again), host(want)):
        assert np.array_equal(g, w) and np.array_equal(a, w), name
    for r in first:  # every element written (out= arrays are NaN-poisoned)
        assert not np.isnan(to_host(r).astype(np.float64)).any(), name
    assert all(type(r) is type(args[0]) for r in first)
    if "in place" in name:
        assert first[0] is args[0] and second[0] is args2[0]
    elif "out=" in name:
        assert first[0] is kwargs["out"] and second[0] is kwargs2["out"]
    else:  # outputs made per call: new arrays every time
        assert all(a is not b for a, b in zip(first, second))


@pytest.mark.parametrize("fw", ["torch", "cupy"])
def test_fast_path_offsets_are_range_checked(rng, fw):
    if fw == "torch":
        pytest.importorskip("torch")
    cos, sin = (to_device(t, fw) for t in angles())
    x0 = rng.standard_normal((2, 16, 3, D)).astype(np.float32)
    for offset in (0, 5, ROWS - 16):  # the last one reaches the table's last row
        x = to_device(x0, fw)
        got = cupy_rope.apply_rope(x, cos, sin, offsets=offset, inplace=True)
        want = cupy_rope.apply_rope(to_device(x0, fw), cos, sin,
                                    positions=to_device(np.arange(16) + offset, fw))
        assert np.array_equal(bits(to_host(got)), bits(to_host(want)))
    x = to_device(x0, fw)
    with pytest.raises(ValueError, match="cos: the table has 48 rows"):
        cupy_rope.apply_rope(x, cos, sin, offsets=ROWS - 15, inplace=True)
    with pytest.raises(ValueError, match="positions reach -1"):
        cupy_rope.apply_rope(x, cos, sin, offsets=-1, inplace=True)
    assert np.array_equal(bits(to_host(x)), bits(x0))  # untouched


def test_fast_path_still_refuses_overlap_and_keeps_aliases_apart(rng):
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    buf = torch.randn(2 * 16 * 3 * D + D, device="cuda")
    x = buf[:-D].view(2, 16, 3, D)
    cupy_rope.apply_rope(x, cos, sin, out=torch.empty_like(x))
    cupy_rope.apply_rope(x, cos, sin, out=torch.empty_like(x))  # cached
    before = buf.clone()
    with pytest.raises(ValueError, match="out: overlaps x"):
        cupy_rope.apply_rope(x, cos, sin, out=buf[D:].view(2, 16, 3, D))  # same signature
    assert torch.equal(buf, before)
    # out=x (one pointer twice) is refused on every call, cached or not
    x0 = torch.randn(2, 16, 3, D, device="cuda")
    want = cupy_rope.apply_rope(x0, cos, sin)
    for _ in range(2):
        x = x0.clone()
        with pytest.raises(ValueError, match="out: is x itself"):
            cupy_rope.apply_rope(x, cos, sin, out=x)
        assert torch.equal(x, x0)
    # cos is sin: never the fast path (its launchers assume distinct arrays)
    y = cupy_rope.apply_rope(x0, cos, cos)
    assert torch.equal(y, cupy_rope.apply_rope(x0, cos, cos.clone()))
    assert not torch.equal(y, want)


def test_aliased_arrays_always_take_the_general_path(rng, monkeypatch):
    """Arrays sharing a pointer never reach a launcher made for distinct
    ones, even one of the very same signature."""
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    x = torch.randn(2, 16, 3, D, device="cuda")
    for _ in range(2):
        cupy_rope.apply_rope(x, cos, sin)  # the launcher of distinct tables
        y = cupy_rope.apply_rope(x, cos, cos)
    with monkeypatch.context() as m:
        no_general_path(m)
        cupy_rope.apply_rope(x, cos, sin)  # on the fast path
        with pytest.raises(AssertionError, match="general path"):
            cupy_rope.apply_rope(x, cos, cos)
        with pytest.raises(AssertionError, match="general path"):
            x2 = x.clone()
            cupy_rope.apply_rope(x2, cos, sin, out=x2)
    assert torch.equal(y, cupy_rope.apply_rope(x, cos, cos.clone()))


def test_clear_plans_replans_and_the_cache_is_bounded(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    slow = []
    real = api._slow
    monkeypatch.setattr(api, "_slow", lambda *a: slow.append(1) or real(*a))
    x = torch.randn(2, 16, 3, D, device="cuda")
    want = cupy_rope.apply_rope(x, cos, sin)
    cupy_rope.apply_rope(x, cos, sin)
    n = len(slow)
    api.clear_plans()
    assert torch.equal(cupy_rope.apply_rope(x, cos, sin), want)
    assert len(slow) == n + 1  # planned again
    # At most _MAX_FAST_LAUNCHERS launchers: then the fast path starts afresh.
    monkeypatch.setattr(api, "_MAX_FAST_LAUNCHERS", 2)
    api.clear_plans()
    xs = [torch.randn(2, s, 3, D, device="cuda") for s in (5, 6, 7)]
    wants = [cupy_rope.apply_rope(v, cos, sin) for v in xs]
    for _ in range(2):
        for v, w in zip(xs, wants):
            assert torch.equal(cupy_rope.apply_rope(v, cos, sin), w)
            assert api._fast_count[0] <= 2
            assert sum(len(f.launchers) for f in api._fast_calls.values() if f) <= 2


def test_q_and_k_sliced_from_one_qkv_buffer_stay_on_the_fast_path(rng, monkeypatch):
    """In-place q and k cut from one packed projection (vLLM's layout): their
    spans interleave, so the launchers use the exact overlap test."""
    torch = pytest.importorskip("torch")
    t, hq, hk = 12, 8, 2
    cache = to_device(np.concatenate(angles(), 1), "torch")
    pos = torch.randint(0, ROWS, (t,), device="cuda")
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")

    def views(buf):
        return (buf[:, :hq * D].view(t, hq, D), buf[:, hq * D:(hq + hk) * D].view(t, hk, D))

    qkv0 = torch.randn(t, (hq + 2 * hk) * D, device="cuda", dtype=torch.bfloat16)
    want = qkv0.clone()
    cupy_rope.apply_rope_qk(*views(want), cos_sin_cache=cache, positions=pos, layout="thd",
                            inplace=True)
    bufs = [qkv0.clone() for _ in range(4)]
    cupy_rope.apply_rope_qk(*views(bufs[0]), cos_sin_cache=cache, positions=pos, layout="thd",
                            inplace=True)
    rope.qk_(*views(bufs[1]), pos)
    with monkeypatch.context() as m:
        no_general_path(m)  # qk_ off its fast path would reach it too
        cupy_rope.apply_rope_qk(*views(bufs[2]), cos_sin_cache=cache, positions=pos,
                                layout="thd", inplace=True)
        rope.qk_(*views(bufs[3]), pos)
    for b in bufs:
        assert torch.equal(b, want)  # v untouched, q and k rotated as by the general path


def test_fast_path_signature_follows_strides_and_skips_host_tensors(rng):
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    x = torch.randn(2, 3, 16, D, device="cuda")  # [b, h, s, d] storage
    view = x.transpose(1, 2)  # bshd view, same shape as the contiguous one below
    dense = view.contiguous()
    for _ in range(2):
        a = cupy_rope.apply_rope(dense, cos, sin)
        b = cupy_rope.apply_rope(view, cos, sin)
        assert torch.equal(a, b)
    # The same class on the host: the NumPy reference, not a GPU launcher.
    h = cupy_rope.apply_rope(dense.cpu(), cos.cpu(), sin.cpu())
    assert h.device.type == "cpu"
    assert torch.allclose(h, a.cpu(), rtol=1e-5, atol=1e-5)


def test_fast_path_in_a_new_thread(rng, monkeypatch):
    """A cached in-place call (a generated launcher) from a thread with no
    CUDA context yet: the launcher's general launch makes it current."""
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    q0 = torch.randn(9, 8, D, device="cuda")
    k0 = torch.randn(9, 2, D, device="cuda")
    pos = torch.randint(0, ROWS, (9,), device="cuda")
    kw = dict(positions=pos, layout="thd", inplace=True)
    want = cupy_rope.apply_rope_qk(q0.clone(), k0.clone(), cos, sin, **kw)  # plans
    q, k = q0.clone(), k0.clone()
    got, errors = [], []

    def step():
        try:
            got.append(cupy_rope.apply_rope_qk(q, k, cos, sin, **kw))
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    with monkeypatch.context() as m:
        no_general_path(m)
        t = threading.Thread(target=step)
        t.start()
        t.join()
    assert not errors, errors
    assert got[0][0] is q and torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_parameters_take_the_fast_path(rng, monkeypatch):
    """torch.nn.Parameter (requiring grad or not) is signed like a tensor."""
    torch = pytest.importorskip("torch")
    cos, sin = (to_device(t, "torch") for t in angles())
    x = torch.randn(2, 16, 3, D, device="cuda")
    want = cupy_rope.apply_rope(x, cos, sin)
    for grad in (False, True):
        p = torch.nn.Parameter(x.clone(), requires_grad=grad)
        assert torch.equal(cupy_rope.apply_rope(p, cos, sin), want)
        with monkeypatch.context() as m:
            no_general_path(m)
            got = cupy_rope.apply_rope(torch.nn.Parameter(x.clone(), requires_grad=grad), cos, sin)
        assert torch.equal(got, want)


@pytest.mark.parametrize("fw", ["torch", "cupy"])
def test_bound_methods_take_the_fast_path_with_their_own_tables(rng, monkeypatch, fw):
    """RotaryEmbedding.rope / qk / qkv / qkv_backward: cached calls skip the
    general path, and two objects whose tables differ only in their values
    (the same signatures) each launch with their own tables."""
    if fw == "torch":
        pytest.importorskip("torch")
    dtype = "float32"
    cos, sin = angles()
    ropes = [cupy_rope.RotaryEmbedding(to_device(c, fw), to_device(s_, fw))
             for c, s_ in ((cos, sin), (sin, cos))]
    seed = int(rng.integers(2**31))

    def calls(rope, r):
        x = rand(r, (2, 16, 3, D), dtype, fw)
        q, k = rand(r, (2, 16, 4, D), dtype, fw), rand(r, (2, 16, 1, D), dtype, fw)
        qkv = rand(r, (2, 16, 6 * D), dtype, fw)
        dq, dk, dv = (rand(r, (2, 16, h, D), dtype, fw) for h in (4, 1, 1))
        return [rope(x), rope.qk(q, k, out_q=poison(q.shape, dtype, fw),
                                 out_k=poison(k.shape, dtype, fw)),
                rope.qkv(qkv, num_q_heads=4, num_kv_heads=1),
                rope.qkv_backward(dq, dk, dv)]

    def flat(results):
        out = []
        for r in results:
            out += host(r)
        return out

    for rope in ropes:
        calls(rope, np.random.default_rng(seed))  # plans
    got = []
    with monkeypatch.context() as m:
        no_general_path(m)
        for rope in ropes:
            got.append(flat(calls(rope, np.random.default_rng(seed))))
    with monkeypatch.context() as m:
        general_path(m)
        want = [flat(calls(rope, np.random.default_rng(seed))) for rope in ropes]
    for g, w in zip(got, want):
        assert len(g) == len(w) == 7
        assert all(np.array_equal(a, b) for a, b in zip(g, w))
    assert not np.array_equal(got[0][0], got[1][0])  # each object its own tables


def test_bound_fast_path_checks_offsets_overlap_and_each_objects_tables(rng, monkeypatch):
    """A bound method's cached launcher (rope.qk in place: tables written in
    as constants) checks the offset range and the overlap per call, and an
    object made after another one was dropped uses its own tables."""
    torch = pytest.importorskip("torch")
    import gc

    cos, sin = angles()
    x0 = torch.randn(2, 16, 3, D, device="cuda")
    k0 = torch.randn(2, 16, 1, D, device="cuda")

    def want_of(c, s_, offset):
        return cupy_rope.apply_rope_qk(x0, k0, to_device(c, "torch"), to_device(s_, "torch"),
                                       offsets=offset)

    rope = cupy_rope.RotaryEmbedding(to_device(cos, "torch"), to_device(sin, "torch"))
    for offset in (None, 3):
        q, k = x0.clone(), k0.clone()
        rope.qk(q, k, offsets=offset, inplace=True)  # planned
    offsets = (None, 3, ROWS - 16)
    wants = [want_of(cos, sin, offset) for offset in offsets]
    with monkeypatch.context() as m:
        no_general_path(m)
        for offset, want in zip(offsets, wants):
            q, k = x0.clone(), k0.clone()
            assert rope.qk(q, k, offsets=offset, inplace=True)[0] is q
            assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    q, k = x0.clone(), k0.clone()
    with pytest.raises(ValueError, match="positions reach 48"):
        rope.qk(q, k, offsets=ROWS - 15, inplace=True)
    assert torch.equal(q, x0) and torch.equal(k, k0)
    buf = torch.randn(2, 16, 4, D, device="cuda")
    for _ in range(2):  # q and k heads of one buffer, apart: planned, then cached
        rope.qk(buf[:, :, :3], buf[:, :, 3:], inplace=True)
    before = buf.clone()
    with pytest.raises(ValueError, match="overlap"):  # the same signatures, k inside q
        rope.qk(buf[:, :, :3], buf[:, :, 2:3], inplace=True)
    assert torch.equal(buf, before)
    del rope
    gc.collect()
    other = cupy_rope.RotaryEmbedding(to_device(sin, "torch"), to_device(cos, "torch"))
    for _ in range(2):
        q, k = x0.clone(), k0.clone()
        other.qk(q, k, inplace=True)
        want = want_of(sin, cos, None)
        assert torch.equal(q, want[0]) and torch.equal(k, want[1])



def test_torch_version_counters_bumped_on_every_path(rng):
    """Writes into the caller's torch tensors bump their version counters on
    the general path, the cached plan, the functional fast launcher and
    RotaryEmbedding.qk_'s own launcher alike (three calls each)."""
    torch = pytest.importorskip("torch")
    api.clear_plans()
    cos, sin = (to_device(t, "torch") for t in angles())
    x = rand(rng, (2, 8, 3, D), "float32", "torch")
    out = torch.empty_like(x)
    q, k = rand(rng, (5, 4, D), "bfloat16", "torch"), rand(rng, (5, 2, D), "bfloat16", "torch")
    pos = torch.arange(5, device="cuda")
    rope = cupy_rope.RotaryEmbedding(cos, sin, layout="thd")
    calls = [
        (lambda: cupy_rope.apply_rope(x, cos, sin, inplace=True), (x,)),
        (lambda: cupy_rope.apply_rope(x, cos, sin, out=out), (out,)),
        (lambda: cupy_rope.apply_rope_qk(q, k, cos, sin, positions=pos, layout="thd",
                                         inplace=True), (q, k)),
        (lambda: rope.qk_(q, k, pos), (q, k)),
    ]
    for call, written in calls:
        for _ in range(3):
            before = [t._version for t in written]
            call()
            assert all(t._version > v for t, v in zip(written, before))
    assert cos._version == 0 and sin._version == 0 and pos._version == 0
