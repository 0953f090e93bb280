"""cupy_rope.RotaryEmbedding on the GPU: the bound form gives exactly the
results of the apply_rope* calls, on its cached path too, and keeps checking
what changes per call (pointer overlap, signatures, table contents)."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_rope
from helpers import np_dtype
from gpu_util import bits, to_device, to_host

pytestmark = pytest.mark.gpu


def tables(d, rows):
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    theta = (np.arange(rows)[:, None] * inv.astype(np.float64)).astype(np.float32)
    return inv, np.cos(theta), np.sin(theta)


def angle_kwargs(source, d, rows, fw):
    inv, cos, sin = tables(d, rows)
    if source == "cache":
        return {"cos_sin_cache": to_device(np.concatenate([cos, sin], 1), fw)}
    if source == "inv_freq":
        return {"inv_freq": to_device(inv, fw)}
    return {"cos": to_device(cos, fw), "sin": to_device(sin, fw)}


def same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            same(u, v)
        return
    assert type(a) is type(b)
    assert np.array_equal(bits(to_host(a)), bits(to_host(b)))


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("source", ["cache", "cos_sin", "inv_freq"])
def test_bound_calls_equal_apply_rope(rng, framework, source):
    if framework == "torch":
        pytest.importorskip("torch")
    d, hq, hk, rows = 128, 8, 2, 512
    ang = angle_kwargs(source, d, rows, framework)
    dt = np_dtype("bfloat16")
    for layout in ("thd", "bshd"):
        rope = cupy_rope.RotaryEmbedding(**ang, layout=layout)
        tok = (37,) if layout == "thd" else (2, 19)
        for _ in range(3):  # fresh inputs each time: the cached plan is reused
            q = to_device(rng.standard_normal(tok + (hq, d)).astype(dt), framework)
            k = to_device(rng.standard_normal(tok + (hk, d)).astype(dt), framework)
            pos = to_device(rng.integers(0, rows, tok).astype(np.int64), framework)
            same(rope(q, pos), cupy_rope.apply_rope(q, **ang, positions=pos, layout=layout))
            same(rope.rope(q, pos, backward=True),
                 cupy_rope.apply_rope(q, **ang, positions=pos, layout=layout, backward=True))
            same(rope.qk(q, k, pos), cupy_rope.apply_rope_qk(q, k, **ang, positions=pos,
                                                            layout=layout))
            want = cupy_rope.apply_rope_qk(q, k, **ang, positions=pos, layout=layout)
            q2 = q.clone() if framework == "torch" else q.copy()
            k2 = k.clone() if framework == "torch" else k.copy()
            got = rope.qk_(q2, k2, pos)
            assert got[0] is q2 and got[1] is k2
            same((q2, k2), want)
            assert len(rope._fast) == 1  # qk_'s own cache holds this signature's plan
            qkv = to_device(rng.standard_normal(tok + ((hq + 2 * hk) * d,)).astype(dt), framework)
            outs = rope.qkv(qkv, pos, num_q_heads=hq, num_kv_heads=hk)
            same(outs, cupy_rope.apply_rope_qkv(qkv, **ang, positions=pos, layout=layout,
                                                num_q_heads=hq, num_kv_heads=hk))
            same(rope.qkv_backward(*outs, pos),
                 cupy_rope.apply_rope_qkv_backward(*outs, **ang, positions=pos, layout=layout))


def test_bound_cached_path_still_checks_overlap(rng):
    torch = pytest.importorskip("torch")
    rope = cupy_rope.RotaryEmbedding(inv_freq=torch.from_numpy(tables(64, 1)[0]).cuda(),
                                     layout="thd")
    buf = torch.randn(64, 6, 64, device="cuda")
    q, k = buf[:32, :4], buf[32:, 4:]
    pos = torch.arange(32, device="cuda")
    rope.qk_(q, k, pos)  # disjoint: planned and cached
    rope.qk_(q, k, pos)
    before = buf.clone()
    with pytest.raises(ValueError, match="overlaps"):
        rope.qk_(buf[:32, :4], buf[:32, 3:5], pos)  # same signature, overlapping memory
    assert torch.equal(buf, before)


def test_bound_fast_path_is_taken(rng, monkeypatch):
    torch = pytest.importorskip("torch")
    from cupy_rope import api

    _, cos, sin = tables(128, 600)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=torch.from_numpy(
        np.concatenate([cos, sin], 1)).cuda(), layout="thd")
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 600, (64,), device="cuda")
    rope.qk_(q.clone(), k.clone(), pos)  # plans and fills the fast cache
    calls = []
    monkeypatch.setattr(api, "_execute", lambda *a, **kw: calls.append(a))
    q2, k2 = q.clone(), k.clone()
    got = rope.qk_(q2, k2, pos)
    assert got[0] is q2 and got[1] is k2 and not calls  # no general path
    monkeypatch.undo()
    same((q2, k2), cupy_rope.apply_rope_qk(q, k, cos_sin_cache=rope._tables[4], positions=pos,
                                           layout="thd"))


def test_bound_table_changed_in_place_is_refused(rng):
    torch = pytest.importorskip("torch")
    _, cos, sin = tables(64, 100)
    cache = torch.from_numpy(np.concatenate([cos, sin], 1)).cuda()
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    x = torch.randn(10, 3, 64, device="cuda")
    rope(x, torch.arange(10, device="cuda"))
    cache.resize_(50, 64)  # the contract: make a new object instead
    with pytest.raises(ValueError, match="cos_sin_cache: .*changed since"):
        rope(torch.randn(11, 3, 64, device="cuda"), torch.arange(11, device="cuda"))


def test_bound_sees_new_table_contents(rng):
    torch = pytest.importorskip("torch")
    _, cos, sin = tables(64, 100)
    cache = torch.from_numpy(np.concatenate([cos, sin], 1)).cuda()
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    x = torch.randn(10, 3, 64, device="cuda")
    pos = torch.arange(10, device="cuda") + 50
    first = rope(x, pos)
    cache.mul_(-1)  # contents change in place; the object keeps reading the same memory
    second = rope(x, pos)
    want = cupy_rope.apply_rope(x, cos_sin_cache=cache, positions=pos, layout="thd")
    assert torch.equal(second, want)
    assert not torch.equal(first, second)


def test_bound_device_positions_outside_table_give_nan(rng):
    torch = pytest.importorskip("torch")
    _, cos, sin = tables(32, 8)
    rope = cupy_rope.RotaryEmbedding(torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda(),
                                     layout="thd")
    x = torch.randn(4, 2, 32, device="cuda")
    out = rope(x, torch.tensor([0, 7, 8, -1], device="cuda"))
    assert not out[:2].isnan().any() and out[2:, :, :16].isnan().all()


def test_cached_plan_does_not_accept_options_validation_refuses(rng):
    """A plan made for rotary_dim=32, inplace=True is not reused for 32.0 or 1."""
    torch = pytest.importorskip("torch")
    _, cos, sin = tables(32, 16)
    cos, sin = torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda()
    x = torch.randn(2, 16, 3, 64, device="cuda")
    cupy_rope.apply_rope(x, cos, sin, rotary_dim=32, inplace=True)
    before = x.clone()
    with pytest.raises(TypeError, match="rotary_dim"):
        cupy_rope.apply_rope(x, cos, sin, rotary_dim=32.0, inplace=True)
    with pytest.raises(TypeError, match="inplace"):
        cupy_rope.apply_rope(x, cos, sin, rotary_dim=32, inplace=1)
    assert torch.equal(x, before)


def test_bound_fast_path_in_a_new_thread_and_planned_once(rng, monkeypatch):
    """A cached qk_ called from a thread that has no CUDA context yet still
    launches (the general launch makes the context current); repeated calls,
    including ones whose q and k spans interleave (the general path's finer
    overlap test), build the generated launcher once."""
    torch = pytest.importorskip("torch")
    import threading

    from cupy_rope import launch

    built = []
    real = launch.bound_launcher
    monkeypatch.setattr(launch, "bound_launcher",
                        lambda *a, **kw: built.append(1) or real(*a, **kw))
    _, cos, sin = tables(64, 300)
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=torch.from_numpy(
        np.concatenate([cos, sin], 1)).cuda(), layout="thd")
    q0 = torch.randn(40, 4, 64, device="cuda")
    k0 = torch.randn(40, 2, 64, device="cuda")
    pos = torch.randint(0, 300, (40,), device="cuda")
    want = cupy_rope.apply_rope_qk(q0, k0, cos_sin_cache=rope._tables[4], positions=pos,
                                   layout="thd")
    for _ in range(3):
        q, k = q0.clone(), k0.clone()
        rope.qk_(q, k, pos)
    assert len(built) == 1
    got, errors = [], []

    def step():
        try:
            q, k = q0.clone(), k0.clone()
            rope.qk_(q, k, pos)
            torch.cuda.synchronize()
            got.append((q, k))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    for _ in range(2):
        th = threading.Thread(target=step)
        th.start()
        th.join()
    assert not errors and len(got) == 2 and len(built) == 1
    for q, k in got:
        same((q, k), want)
    # q and k as interleaved views of one buffer: spans overlap, lattices do not.
    buf = torch.randn(40, 2, 6, 64, device="cuda")
    qi, ki = buf[:, 0, :4], buf[:, 1, :2]
    for _ in range(3):
        rope.qk_(qi, ki, pos)
    assert len(built) == 2


def test_bound_deep_copy_signs_its_own_tables(rng):
    """A deep copy's tables have new pointers: its cached calls read them,
    not the original's (which here change and then go away)."""
    torch = pytest.importorskip("torch")
    import copy

    _, cos, sin = tables(64, 100)
    cache = torch.from_numpy(np.concatenate([cos, sin], 1)).cuda()
    rope = cupy_rope.RotaryEmbedding(cos_sin_cache=cache, layout="thd")
    x = torch.randn(10, 3, 64, device="cuda")
    q, k = torch.randn(10, 4, 64, device="cuda"), torch.randn(10, 2, 64, device="cuda")
    pos = torch.arange(10, device="cuda") + 50
    want = rope(x, pos)
    want_qk = rope.qk(q, k, pos)
    rope.qk_(q.clone(), k.clone(), pos)  # qk_'s own launcher cached
    dup = copy.deepcopy(rope)
    cache.mul_(-1)
    del rope, cache
    for _ in range(2):  # planned, then cached
        assert torch.equal(dup(x, pos), want)
        q2, k2 = q.clone(), k.clone()
        dup.qk_(q2, k2, pos)
        assert torch.equal(q2, want_qk[0]) and torch.equal(k2, want_qk[1])
