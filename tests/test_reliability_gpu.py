"""Reliability on the GPU: 64-bit sizes, threads and streams, devices, determinism.

- More than 2^31 elements: the last elements of a bf16 [9, 16384, 64, 256]
  tensor (2^31 + 2^28 elements, 4.5 GiB) are checked against float64, in
  bshd, sbhd and packed thd views of the same memory; q+k with q past 2^31
  elements; and thd with 2^32 + 5 tokens (token indices past 32 bits).
- Threads calling different specializations at once compile each one
  exactly once and all get correct results; calls on several streams from
  several threads give the same bits as sequential calls.
- The kernel runs on the device that holds the input, whatever the current
  device is (needs two GPUs; skipped otherwise); arrays on two devices are
  refused.
- Repeated calls give bitwise-identical outputs and gradients.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_rope  # noqa: E402
from helpers import assert_close, np_dtype  # noqa: E402
from cupy_rope import reference, specialize  # noqa: E402
from gpu_util import bits, fresh_plans, to_device, to_host  # noqa: E402

pytestmark = pytest.mark.gpu


def inv_freq_np(rotary_dim, base=10000.0):
    return (1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)


def tables_np(inv_freq, rows):
    theta = (np.arange(rows)[:, None] * inv_freq.astype(np.float64)).astype(np.float32)
    return np.cos(theta), np.sin(theta)


def host_bf16(t) -> np.ndarray:
    return t.view(torch.int16).cpu().numpy().view(np_dtype("bfloat16"))


def expected_rows(x_rows, positions, cos, sin, rotary_dim, interleaved):
    """float64 rotation of x rows [n, h, d] at positions [n] with fp32 tables."""
    x = x_rows.astype(np.float64)[None]
    c = cos[positions].astype(np.float64)[None]
    s = sin[positions].astype(np.float64)[None]
    return reference.rotate(x, c, s, rotary_dim, interleaved)[0]


# -------------------------------------------------------- 64-bit sizes --
BIG = (9, 16384, 64, 256)  # 2^31 + 2^28 elements: 4.5 GiB of bf16


def _free_gib():
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_more_than_2_31_elements(interleaved):
    if _free_gib() < 16:
        pytest.skip("needs 16 GiB of free device memory")
    b, s, h, d = BIG
    r = 192  # partial rotary: the untouched tail is checked bit for bit too
    n_elem = b * s * h * d
    assert n_elem > 2**31 and (b - 1) * s * h * d >= 2**31  # the last batch entry starts past int32
    g = torch.Generator(device="cuda").manual_seed(1234)
    x = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=g)
    inv_freq = inv_freq_np(r)
    cos, sin = tables_np(inv_freq, s)
    cos_t, sin_t = torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda()

    # bshd into out=: batch entry 8 starts at element 8 * 2^28 = 2^31.
    out = torch.full_like(x, float("nan"))
    cupy_rope.apply_rope(x, cos_t, sin_t, rotary_dim=r, interleaved=interleaved, out=out)
    torch.cuda.synchronize()
    # Rows: the very first and the very last tokens, and some in between.
    picks = [(0, 0), (0, s - 1), (3, 12345), (7, 0), (8, 0), (8, s - 2), (b - 1, s - 1)]
    for bi, si in picks:
        xr = host_bf16(x[bi, si])
        want = expected_rows(xr[None], np.array([si]), cos, sin, r, interleaved)[0]
        got = host_bf16(out[bi, si])
        assert_close(got, want, "bfloat16", f"bshd token ({bi}, {si})")
        assert np.array_equal(bits(got[:, r:]), bits(xr[:, r:]))
    assert not torch.isnan(out[-1, -64:]).any()  # the last elements were written
    flat_last = out.view(-1)[-4096:]
    assert not torch.isnan(flat_last).any()

    # sbhd view of the same memory ([s, b, h, d] with b the outer axis in memory).
    sb = x.transpose(0, 1)
    out_sb = torch.full_like(out, float("nan")).transpose(0, 1)
    cupy_rope.apply_rope(sb, cos_t, sin_t, rotary_dim=r, interleaved=interleaved, layout="sbhd",
                         out=out_sb)
    assert torch.equal(out_sb.transpose(0, 1), out)
    del out_sb

    # thd in place on the flat [b * s, h, d] view, b sequences of s tokens:
    # bit-identical to the bshd result, and the tail is not touched.
    cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    t = x.view(b * s, h, d)
    before_tail = x[-1, -1, :, r:].clone()
    cupy_rope.apply_rope(t, cos_t, sin_t, rotary_dim=r, interleaved=interleaved, layout="thd",
                         cu_seqlens=cu, inplace=True)
    assert torch.equal(x, out)
    assert torch.equal(x[-1, -1, :, r:], before_tail)


def test_qk_with_more_than_2_31_elements_in_q():
    if _free_gib() < 12:
        pytest.skip("needs 12 GiB of free device memory")
    t, hq, hk, d = 2**31 // (32 * 128) + 4096, 32, 8, 128  # q: 2^31 + 2^24 elements
    g = torch.Generator(device="cuda").manual_seed(99)
    q = torch.randn((t, hq, d), device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn((t, hk, d), device="cuda", dtype=torch.bfloat16, generator=g)
    inv_freq = inv_freq_np(d, 500000.0)
    pos = torch.randint(0, 1 << 20, (t,), device="cuda", dtype=torch.int64, generator=g)
    pos[-1] = (1 << 20) - 1
    q_last, k_last = host_bf16(q[-3:]), host_bf16(k[-3:])
    cupy_rope.apply_rope_qk(q, k, inv_freq=torch.from_numpy(inv_freq).cuda(), positions=pos,
                            layout="thd", inplace=True)
    p = pos[-3:].cpu().numpy()
    theta = p[:, None].astype(np.float64) * inv_freq.astype(np.float64)
    for got, x0 in ((host_bf16(q[-3:]), q_last), (host_bf16(k[-3:]), k_last)):
        want = reference.rotate(x0.astype(np.float64)[None], np.cos(theta)[None],
                                np.sin(theta)[None], d, False)[0]
        assert_close(got, want, "bfloat16", "last q/k tokens")


def test_more_than_2_32_tokens():
    """thd [2^32 + 5, 1, 2] in place: token indices past 32 bits (the kernel's
    64-bit token path) and 2^33 elements; the last tokens against float64."""
    if _free_gib() < 20:
        pytest.skip("needs 20 GiB of free device memory")
    t = 2**32 + 5
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((t, 1, 2), device="cuda", dtype=torch.bfloat16, generator=g)
    inv = np.array([1e-7], np.float32)
    first, last = host_bf16(x[:3]), host_bf16(x[-5:])
    cupy_rope.apply_rope(x, inv_freq=torch.from_numpy(inv).cuda(), layout="thd", inplace=True)
    for got, x0, pos in ((host_bf16(x[:3]), first, np.arange(3)),
                         (host_bf16(x[-5:]), last, np.arange(t - 5, t))):
        theta = pos[:, None].astype(np.float64) * np.float64(inv[0])
        want = reference.rotate(x0.astype(np.float64)[None], np.cos(theta)[None],
                                np.sin(theta)[None], 2, False)[0]
        assert_close(got, want, "bfloat16", f"tokens {pos[0]}..")
    assert abs(float(theta[-1, 0]) - 429.4967) < 1e-3  # the last angle really is ~2^32 * 1e-7


# ---------------------------------------------------------- concurrency --
# Twelve specializations (dtype x style x head_dim), two threads each.
SPECS = [(dtype, interleaved, d) for dtype in ("float32", "float16", "bfloat16")
         for interleaved in (False, True) for d in (64, 80)]


def _spec_inputs(rng, dtype, d, s=37, h=5):
    x = rng.standard_normal((2, s, h, d)).astype(np_dtype(dtype))
    inv = inv_freq_np(d) * rng.uniform(0.5, 1.5, d // 2).astype(np.float32)
    cos, sin = tables_np(inv, s)
    return x, cos, sin


def test_threads_compile_each_specialization_once(rng, monkeypatch):
    import cupy

    built: dict = {}
    count_lock = threading.Lock()
    real = cupy.RawModule

    def counting(*args, **kwargs):
        for name in kwargs.get("name_expressions") or []:
            with count_lock:
                built[name] = built.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting)
    # Forget compiled kernels and plans: the first calls below compile again
    # (from CuPy's disk cache when warm), racing each other.
    monkeypatch.setattr(specialize, "_modules", {})
    fresh_plans(monkeypatch)

    jobs = []
    for dtype, interleaved, d in SPECS:
        x, cos, sin = _spec_inputs(rng, dtype, d)
        want = reference.rotate(x.astype(np.float64), cos[None].astype(np.float64).repeat(2, 0),
                                sin[None].astype(np.float64).repeat(2, 0), d, interleaved)
        jobs.append((dtype, interleaved, x, cos, sin, want))
    jobs = jobs + jobs  # two threads per specialization
    barrier = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)
    errors: list = []

    def work(i, dtype, interleaved, x, cos, sin, want):
        try:
            cupy.cuda.Device(0).use()
            xd, cd, sd = to_device(x, "torch"), to_device(cos, "torch"), to_device(sin, "torch")
            torch.cuda.synchronize()
            barrier.wait()
            outs = [cupy_rope.apply_rope(xd, cd, sd, interleaved=interleaved) for _ in range(5)]
            torch.cuda.synchronize()
            results[i] = [to_host(o) for o in outs]
        except Exception as exc:  # reported below, with the thread's job
            errors.append((i, dtype, interleaved, repr(exc)))

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (dtype, interleaved, x, cos, sin, want), outs in zip(jobs, results):
        for o in outs:
            assert_close(o, want, dtype, f"{dtype} interleaved={interleaved}")
            assert np.array_equal(bits(o), bits(outs[0]))
    assert len(built) == len(SPECS), sorted(built)
    assert all(n == 1 for n in built.values()), built


def test_many_streams_and_threads_match_sequential(rng):
    n_streams, calls = 6, 20
    d, h = 128, 8
    inputs = []
    for i in range(n_streams):
        q = to_device(rng.standard_normal((3, 300, h, d)).astype(np_dtype("bfloat16")), "torch")
        k = to_device(rng.standard_normal((3, 300, 2, d)).astype(np_dtype("bfloat16")), "torch")
        inputs.append((q, k))
    inv = torch.from_numpy(inv_freq_np(d)).cuda()
    pos = torch.from_numpy(rng.integers(0, 4096, (3, 300))).cuda()
    want = [[to_host(t) for t in cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos)]
            for q, k in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(n_streams)]
    got: list = [None] * n_streams
    errors: list = []
    barrier = threading.Barrier(n_streams)

    def work(i):
        try:
            q, k = inputs[i]
            with torch.cuda.stream(streams[i]):
                barrier.wait()
                outs = [cupy_rope.apply_rope_qk(q, k, inv_freq=inv, positions=pos)
                        for _ in range(calls)]
                # In place on private copies, interleaved with the out-of-place calls.
                q2, k2 = q.clone(), k.clone()
                cupy_rope.apply_rope_qk(q2, k2, inv_freq=inv, positions=pos, inplace=True)
            streams[i].synchronize()
            got[i] = (outs, (q2, k2))
        except Exception as exc:
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(n_streams):
        outs, inplace = got[i]
        for pair in outs + [inplace]:
            for o, w in zip(pair, want[i]):
                assert np.array_equal(bits(to_host(o)), bits(w))


SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  long long t = clock64();
  while (clock64() - t < cycles) {}
}"""


def test_cupy_streams_are_followed(rng):
    """Each non-blocking CuPy stream is kept busy, then a copy of x is rotated in
    place on it: a launch on any other stream would rotate before the copy
    lands and leave y unrotated."""
    import cupy

    spin = cupy.RawKernel(SPIN, "spin")
    x = to_device(rng.standard_normal((4, 256, 16, 64)).astype(np.float16))
    inv = to_device(inv_freq_np(64))
    want = bits(to_host(cupy_rope.apply_rope(x, inv_freq=inv)))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    ys = []
    for st in streams:
        with st:
            spin((1,), (1,), (np.int64(20_000_000),))
            y = x.copy()
            cupy_rope.apply_rope(y, inv_freq=inv, inplace=True)
            ys.append(y)
    for st, y in zip(streams, ys):
        st.synchronize()
        assert np.array_equal(bits(to_host(y)), want)


# ------------------------------------------------------------- devices --
def _two_devices():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_input_on_a_non_current_device(rng, framework):
    _two_devices()
    import cupy

    d = 128
    x = rng.standard_normal((2, 50, 4, d)).astype(np.float32)
    inv = inv_freq_np(d)
    want = reference.rotate(
        x.astype(np.float64),
        *[f(np.arange(50)[:, None] * inv.astype(np.float64))[None].repeat(2, 0)
          for f in (np.cos, np.sin)], d, False)
    torch.cuda.set_device(0)
    cupy.cuda.Device(0).use()
    if framework == "torch":
        xd, invd = torch.from_numpy(x).to("cuda:1"), torch.from_numpy(inv).to("cuda:1")
    else:
        with cupy.cuda.Device(1):
            xd, invd = cupy.asarray(x), cupy.asarray(inv)
    for _ in range(3):  # first call plans and compiles for device 1; then the cached plan
        out = cupy_rope.apply_rope(xd, inv_freq=invd)
        if framework == "torch":
            assert out.device == torch.device("cuda:1")
        else:
            assert out.data.device_id == 1
        assert_close(to_host(out), want, "float32", f"{framework} on device 1")
        # In place on device 1 as well, and the caller's current device is kept.
        if framework == "torch":
            y = xd.clone()
        else:
            with cupy.cuda.Device(1):  # CuPy copies onto the current device
                y = xd.copy()
        cupy_rope.apply_rope(y, inv_freq=invd, inplace=True)
        assert_close(to_host(y), want, "float32", "in place on device 1")
    # The bound decode step on device 1: its cached launcher sees device 0
    # current and takes the general launch there.
    qh = rng.standard_normal((50, 4, d)).astype(np.float32)
    kh = rng.standard_normal((50, 2, d)).astype(np.float32)
    pos = rng.integers(0, 1000, 50)
    want_q, want_k = (reference.rotate(
        a.astype(np.float64)[None],
        *[f(pos[:, None] * inv.astype(np.float64))[None] for f in (np.cos, np.sin)], d,
        False)[0] for a in (qh, kh))
    rope = cupy_rope.RotaryEmbedding(inv_freq=invd, layout="thd")

    def put(a):
        if framework == "torch":
            return torch.from_numpy(a).to("cuda:1")
        with cupy.cuda.Device(1):
            return cupy.asarray(a)
    pos_d = put(pos.astype(np.int64))
    for _ in range(3):
        q1, k1 = put(qh), put(kh)
        rope.qk_(q1, k1, pos_d)
        assert_close(to_host(q1), want_q, "float32", f"{framework} qk_ q on device 1")
        assert_close(to_host(k1), want_k, "float32", f"{framework} qk_ k on device 1")
    assert len(rope._fast) == 1
    assert torch.cuda.current_device() == 0
    assert cupy.cuda.runtime.getDevice() == 0


def test_cupy_stream_of_the_input_device_is_used(rng):
    """CuPy input on device 1 while device 0 is current: the launch follows
    device 1's current stream, kept busy by a spin kernel before the input
    is copied on it (a launch on another stream would rotate too early),
    for apply_rope and for the bound decode step (planned, then cached)."""
    _two_devices()
    import cupy

    with cupy.cuda.Device(1):
        spin = cupy.RawKernel(SPIN, "spin")
        x = cupy.asarray(rng.standard_normal((4, 256, 16, 64)).astype(np.float16))
        inv = cupy.asarray(inv_freq_np(64))
        want = to_host(cupy_rope.apply_rope(x, inv_freq=inv))
        q = x[:, :, :8].reshape(-1, 8, 64).copy()
        k = x[:, :, 8:].reshape(-1, 8, 64).copy()
        pos = cupy.arange(q.shape[0], dtype=cupy.int32) % 256
        side = cupy.cuda.Stream(non_blocking=True)
        cupy_rope.apply_rope(x.copy(), inv_freq=inv, inplace=True)  # planned: no compile below
        cupy.cuda.Device(1).synchronize()
    rope = cupy_rope.RotaryEmbedding(inv_freq=inv, layout="thd")
    try:
        for step in range(3):
            with cupy.cuda.Device(1):
                side.use()
                spin((1,), (1,), (np.int64(50_000_000),))
                y, q2, k2 = x.copy(), q.copy(), k.copy()  # on `side`, after the spin
            cupy.cuda.Device(0).use()
            assert cupy.cuda.get_current_stream(1) == side
            cupy_rope.apply_rope(y, inv_freq=inv, inplace=True)
            rope.qk_(q2, k2, pos)
            side.synchronize()
            assert np.array_equal(bits(to_host(y)), bits(want))
            assert_close(to_host(q2).reshape(4, 256, 8, 64), want[:, :, :8], "float16", "qk_ q")
            assert_close(to_host(k2).reshape(4, 256, 8, 64), want[:, :, 8:], "float16", "qk_ k")
        assert len(rope._fast) == 1
    finally:
        with cupy.cuda.Device(1):
            cupy.cuda.Stream.null.use()
    assert cupy.cuda.runtime.getDevice() == 0


def test_arrays_on_two_devices_are_refused(rng):
    _two_devices()
    q = torch.randn(1, 8, 4, 64, device="cuda:0")
    k = torch.randn(1, 8, 2, 64, device="cuda:1")
    inv = torch.from_numpy(inv_freq_np(64)).cuda(0)
    with pytest.raises(ValueError, match=r"k: expected an array on cuda:0"):
        cupy_rope.apply_rope_qk(q, k, inv_freq=inv)
    with pytest.raises(ValueError, match=r"inv_freq: expected an array on cuda:1"):
        cupy_rope.apply_rope(k, inv_freq=inv)


def test_torch_stream_of_the_input_device_is_used(rng):
    _two_devices()
    x = torch.randn(2, 4096, 16, 128, device="cuda:1", dtype=torch.bfloat16)
    inv = torch.from_numpy(inv_freq_np(128)).to("cuda:1")
    want = cupy_rope.apply_rope(x, inv_freq=inv)
    torch.cuda.synchronize(1)
    side = torch.cuda.Stream(device=1)
    torch.cuda.set_device(0)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps `side` busy: a wrong stream would race ahead
        y = x.clone()  # on `side`, after the sleep
        torch.cuda.set_device(0)  # the caller's device is 0; device 1's stream stays `side`
        assert torch.cuda.current_stream(1) == side
        cupy_rope.apply_rope(y, inv_freq=inv, inplace=True)
        assert torch.cuda.current_device() == 0
    side.synchronize()
    assert torch.equal(y, want)


# ---------------------------------------------------------- determinism --
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_outputs_and_gradients_are_bitwise_repeatable(rng, layout):
    crt = pytest.importorskip("cupy_rope.torch")
    d, hq, hk = 128, 8, 2
    shape = (2, 333) if layout == "bshd" else (666,)
    q0 = torch.randn(*shape, hq, d, device="cuda", dtype=torch.bfloat16)
    k0 = torch.randn(*shape, hk, d, device="cuda", dtype=torch.bfloat16)
    gq = torch.randn_like(q0)
    gk = torch.randn_like(k0)
    cos, sin = (torch.from_numpy(t).cuda() for t in tables_np(inv_freq_np(d), 400))
    kw = {"layout": layout}
    if layout == "thd":
        kw["cu_seqlens"] = torch.tensor([0, 100, 100, 400, 666], device="cuda",
                                        dtype=torch.int32)
    first = None
    for _ in range(4):
        q = q0.clone().requires_grad_()
        k = k0.clone().requires_grad_()
        oq, ok = crt.rope_qk(q, k, cos, sin, **kw)
        torch.autograd.backward([oq, ok], [gq, gk])
        got = [t.detach().view(torch.int16).clone() for t in (oq, ok, q.grad, k.grad)]
        if first is None:
            first = got
        else:
            for a, b_ in zip(got, first):
                assert torch.equal(a, b_)
    # The gradient is the backward rotation, which undoes the forward one.
    back = cupy_rope.apply_rope_qk(first[0].view(torch.bfloat16), first[1].view(torch.bfloat16),
                                   cos, sin, backward=True, **kw)
    assert_close(to_host(back[0]).astype(np.float64), to_host(q0).astype(np.float64),
                 "bfloat16", "q after forward and backward")
