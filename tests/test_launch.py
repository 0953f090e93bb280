"""Launch policy and the generated decode launcher, on the CPU (no kernel runs)."""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import threading
import types
from typing import NamedTuple

import numpy as np
import pytest

from cupy_rope import launch

cupy = pytest.importorskip("cupy")


def fake_plan(slots, empty=False):
    calls = []
    plan = types.SimpleNamespace(
        slots=slots, dims=(80, 1, 1, 8, 8, 4), empty=empty, stream=lambda dev: 777,
        device_id=0, buf=bytes(launch.PARAMS_SIZE), buffers={}, kernel=4242, pick=None,
        launch=lambda ptrs, offset: calls.append(("general", ptrs)))
    plan.own_buffer = lambda: launch.Plan.own_buffer(plan)
    return plan, calls


@pytest.fixture
def driver_calls(monkeypatch):
    """Replace the CUDA launch and current-device query the launcher binds."""
    from cupy.cuda import driver
    from cupy_backends.cuda.api import runtime

    calls = []
    current = {"device": 0}
    monkeypatch.setattr(driver, "launchKernel", lambda *a: calls.append(a))
    monkeypatch.setattr(runtime, "getDevice", lambda: current["device"])
    return calls, current


# q (index 0) and k (1) written in place; cos|sin cache (6) and positions (7) read.
SLOTS = [(0, 0), (1, 0), (-1, 0), (0, 0), (1, 0), (-1, 0), (6, 0), (6, 256), (7, 0), (-1, 0),
         (-1, 0)]
PAIRS = [(0, (0, 1000), None, 1, (0, 500), None), (0, (0, 1000), None, 6, (0, 4096), None),
         (0, (0, 1000), None, 7, (0, 64), None), (1, (0, 500), None, 6, (0, 4096), None),
         (1, (0, 500), None, 7, (0, 64), None)]
CACHE = 1 << 20


def make(plan):
    return launch.bound_launcher(plan, PAIRS, {0: "q", 1: "k", 7: "positions"},
                                 {2: 0, 3: 0, 4: 0, 5: 0, 6: CACHE})


def test_bound_launcher_packs_pointers_and_launches(driver_calls):
    calls, _ = driver_calls
    plan, general = fake_plan(SLOTS)
    plan.buf = (b"\xff" * launch._DYNAMIC.size  # stale values
                + (bytes(range(256)) * (launch._FIXED.size // 256 + 1))[:launch._FIXED.size])
    go = make(plan)
    q, k, pos = 1 << 24, 2 << 24, 3 << 24
    assert go(q, k, pos) is True
    (buf, args_addr, _), = go.__globals__["buffers"].values()  # this thread's parameters
    assert calls == [(4242, 80, 1, 1, 8, 8, 4, 0, 777, args_addr, 0)] and not general
    packed = struct.unpack_from("<11Qq", buf, 0)
    assert packed == (q, k, 0, q, k, 0, CACHE, CACHE + 256, pos, 0, 0, 0)
    assert buf.raw[launch._DYNAMIC.size:] == plan.buf[launch._DYNAMIC.size:]  # fixed part
    assert ctypes.c_void_p.from_address(args_addr).value == ctypes.addressof(buf)


@pytest.fixture
def slow_launches(monkeypatch):
    """A fake driver launch that yields the GIL mid-launch (as the real one
    releases it) and records (thread, argument array, first parameter word
    at the start of the launch, the same word at its end)."""
    import time

    from cupy.cuda import driver
    from cupy_backends.cuda.api import runtime

    seen = []

    def fake_launch(*a):
        params = ctypes.c_void_p.from_address(a[9]).value
        first = ctypes.c_uint64.from_address(params).value
        time.sleep(1e-4)  # let other threads pack
        seen.append((threading.get_ident(), a[9], first,
                     ctypes.c_uint64.from_address(params).value))

    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    monkeypatch.setattr(runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(launch, "_launch_kernel", fake_launch)
    monkeypatch.setattr(launch, "_get_device", lambda: 0)
    return seen


@pytest.mark.parametrize("general_too", [False, True])
def test_threads_pack_their_own_parameters(slow_launches, general_too):
    """Concurrent calls: the parameters the driver reads during a launch are
    the calling thread's, whether the bound launcher or Plan.launch (every
    call that is not the bound decode step) packs them, and both paths of a
    thread share that thread's one buffer."""
    seen = slow_launches
    plan, _ = fake_plan(SLOTS)
    go = make(plan)
    start = threading.Barrier(6)

    def worker(i):
        start.wait()
        for n in range(50):
            q = ((i * 1000 + n) * 4 + 8) << 24
            if general_too and n % 2:
                launch.Plan.launch(plan, [q, q + (1 << 24), 0, 0, 0, 0, CACHE, q + (2 << 24)], 0)
            else:
                go(q, q + (1 << 24), q + (2 << 24))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 300 and all(a == b for _, _, a, b in seen)
    args_of = {}
    for ident, args_addr, _, _ in seen:
        args_of.setdefault(ident, set()).add(args_addr)
    assert len(args_of) == 6 and all(len(v) == 1 for v in args_of.values())
    assert len(set().union(*args_of.values())) == 6


@pytest.mark.parametrize("q,k,pos", [
    (1 << 24, (1 << 24) + 999, 3 << 24),    # k starts inside q
    (CACHE + 4000, 2 << 24, 3 << 24),      # q overlaps the cache's last bytes
    (1 << 24, 2 << 24, (2 << 24) + 400),   # positions inside k
    (CACHE - 999, 2 << 24, 3 << 24),       # q's span reaches into the cache
])
def test_bound_launcher_refuses_overlap_without_launching(driver_calls, q, k, pos):
    calls, _ = driver_calls
    plan, general = fake_plan(SLOTS)
    go = make(plan)
    assert go(q, k, pos) is False
    assert not calls and not general and not go.__globals__["buffers"]


def test_bound_launcher_other_device_takes_the_general_launch(driver_calls):
    calls, current = driver_calls
    current["device"] = 1
    plan, general = fake_plan(SLOTS)
    q, k, pos = 1 << 24, 2 << 24, 3 << 24
    assert make(plan)(q, k, pos) is True
    assert not calls
    assert general == [("general", [q, k, 0, 0, 0, 0, CACHE, pos])]


def test_bound_launcher_thread_without_context_takes_the_general_launch(monkeypatch):
    from cupy.cuda import driver
    from cupy_backends.cuda.api import runtime

    def no_context(*a):
        raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT: invalid device context")

    monkeypatch.setattr(driver, "launchKernel", no_context)
    monkeypatch.setattr(runtime, "getDevice", lambda: 0)
    plan, general = fake_plan(SLOTS)
    q, k, pos = 1 << 24, 2 << 24, 3 << 24
    assert make(plan)(q, k, pos) is True
    assert general == [("general", [q, k, 0, 0, 0, 0, CACHE, pos])]

    def other_error(*a):
        raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    monkeypatch.setattr(driver, "launchKernel", other_error)
    with pytest.raises(RuntimeError, match="OUT_OF_RESOURCES"):
        make(plan)(q, k, pos)


def test_bound_launcher_empty_plan_launches_nothing(driver_calls):
    calls, _ = driver_calls
    plan, general = fake_plan(SLOTS, empty=True)
    assert make(plan)(1 << 24, 2 << 24, 3 << 24) is True
    assert not calls and not general


@pytest.mark.parametrize("items, heads, computed_tokens", [
    (8, (32,), 8),      # NeoX [T, 32, 128]: 4 tokens would give 4 heads a thread, 8 give 8
    (8, (32, 8), 8),    # q32 / k8 in one call: the q slab decides
    (8, (8, 32), 8),    # the second slab decides as well
    (16, (32,), 4),     # GPT-J d128: 8 heads (two passes) with 4 tokens, 16 with 8
    (4, (32,), 4),      # d64 NeoX: 4 heads a thread either way
    (5, (24,), 4),      # d80: 6 heads either way
    (6, (24,), 4),      # d96
    (8, (8,), 4),       # 8 heads: the same block with either
])
def test_varlen_tokens_per_block_follow_the_search_depth_and_angle_source(
        items, heads, computed_tokens):
    """4 tokens a varlen block, but with angles computed in the kernel and
    more than LaunchPolicy.varlen_few_seqs sequences 8 where 4 would leave a
    thread fewer heads per computed angle than 8 do and than two passes
    (LaunchPolicy.varlen_computed_tokens; docs/performance.md, "varlen")."""
    policy = launch.POLICY
    few_seqs, many = policy.varlen_few_seqs, policy.varlen_few_seqs + 1
    shape = lambda n, source: launch.varlen_block_shape(  # noqa: E731
        items, heads, 65536, policy.unroll, 132, n, source)
    four = launch.block_shape(items, heads, 65536, policy.unroll, 132, policy.varlen_tokens)
    eight = launch.block_shape(items, heads, 65536, policy.unroll, 132,
                               policy.varlen_computed_tokens)
    for n in (1, few_seqs, many):
        assert shape(n, "table") == four
    for source in ("inv_freq", "freqs"):
        assert shape(1, source) == four and shape(few_seqs, source) == four
        assert shape(many, source) == (four if computed_tokens == 4 else eight)
    assert policy.varlen_computed_tokens > policy.varlen_tokens
    if computed_tokens == 8:  # the rule's reason: the fewer tokens halve some slab's heads
        assert any(a < min(b, 2 * policy.unroll) for a, b in zip(
            launch._heads_per_thread(four), launch._heads_per_thread(eight)))


def test_override_policy_applies_inside_the_block_only():
    """launch.override_policy changes the policy for its block (here every
    computed-angle call with many sequences gets varlen_computed_tokens) and
    restores the shipped one after it; unknown kernels are refused."""
    shipped = launch.POLICY
    args = (4, (32,), 65536, shipped.unroll, 132, shipped.varlen_few_seqs + 1, "inv_freq")
    eight = launch.block_shape(4, (32,), 65536, shipped.unroll, 132,
                               shipped.varlen_computed_tokens)
    with launch.override_policy(varlen_tokens=shipped.varlen_computed_tokens) as policy:
        assert launch.POLICY is policy and policy.varlen_tokens == shipped.varlen_computed_tokens
        assert launch.varlen_block_shape(*args) == eight
    assert launch.POLICY is shipped
    assert launch.varlen_block_shape(*args) != eight
    with pytest.raises(ValueError, match="kernels"):
        with launch.override_policy(kernels=("heads",)):
            pass
    with pytest.raises(TypeError):
        with launch.override_policy(no_such_field=1):
            pass
    assert launch.POLICY is shipped


@pytest.mark.parametrize("items, heads, min_tokens, block", [
    (8, 32, 4, (8, 8, 4)),   # thd [T, 32, 128] bf16 tables: 4 tokens fill 256 threads
    (8, 32, 8, (8, 4, 8)),   # inv_freq, many sequences: 8 tokens, 2 passes of 4 heads
    (4, 32, 4, (4, 8, 4)),   # d64: 128 threads of 4 tokens, not 256 of 8
    (8, 8, 4, (8, 2, 8)),    # 8 heads: 128 threads (the floor) of 8 tokens, not 256 of 16
    (8, 8, 8, (8, 2, 8)),
    (5, 24, 4, (5, 4, 6)),   # d80: 4 lanes of 6 heads, 6 tokens on 120 threads
    (6, 24, 8, (6, 4, 8)),   # d96 inv_freq: 192 threads
])
def test_varlen_blocks_hold_their_minimum_tokens_and_no_more(items, heads, min_tokens, block):
    grid, got, slabs = launch.block_shape(items, (heads,), 65536, 4, 132, min_tokens)
    assert got == block
    tokens = block[2] * (block[1] // slabs[0][2])
    assert grid[0] == -(-65536 // tokens) and tokens >= min_tokens


def test_too_many_heads_is_refused_before_launch():
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    heads = launch.MAX_HEADS
    x = Tensor(None, "cupy", 1 << 40, (1, heads, 2), (2 * heads, 2, 1), "float32", (CUDA, 0), False)
    inv = Tensor(None, "cupy", 1 << 41, (1,), (1,), "float32", (CUDA, 0), False)
    call = check_call(x, layout="thd", inv_freq=inv, inplace=True)
    with pytest.raises(ValueError, match=r"x: 1073741824 heads per token"):
        launch.choose_spec(call)
    heads -= 1  # the largest accepted
    x = Tensor(None, "cupy", 1 << 40, (1, heads, 2), (2 * heads, 2, 1), "float32", (CUDA, 0), False)
    assert launch.choose_spec(check_call(x, layout="thd", inv_freq=inv, inplace=True)).unroll == 4


@pytest.mark.parametrize("rotary_dim,inplace,unroll,mapping", [
    (128, True, 1, "flat"),    # full rotary, tables, implied positions: flat_kernel
    (128, False, 1, "flat"),
    (32, False, launch.POLICY.unroll, "rope"),  # partial out of place: the tail is copied
    (32, True, 1, "flat"),        # partial in place: the rotated packets only
    (64, True, 1, "flat"),
])
def test_unroll_policy_for_partial_rotary(rotary_dim, inplace, unroll, mapping):
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    h, d = 32, 128
    x = Tensor(None, "cupy", 1 << 40, (16, h, d), (h * d, d, 1), "bfloat16", (CUDA, 0), False)
    inv = Tensor(None, "cupy", 1 << 41, (rotary_dim // 2,), (1,), "float32", (CUDA, 0), False)
    cos = Tensor(None, "cupy", 1 << 44, (16, rotary_dim // 2), (rotary_dim // 2, 1), "float32",
                 (CUDA, 0), False)
    kw = dict(inplace=True) if inplace else dict(
        out=Tensor(None, "cupy", 1 << 42, (16, h, d), (h * d, d, 1), "bfloat16", (CUDA, 0), False))
    call = check_call(x, layout="thd", cos=cos, sin=cos, rotary_dim=rotary_dim, **kw)
    spec = launch.choose_spec(call)
    assert (spec.unroll, spec.mapping) == (unroll, mapping)
    if inplace:  # per-axis positions (M-RoPE) keep the multi-head kernels
        pos = Tensor(None, "cupy", 1 << 43, (3, 16), (16, 1), "int32", (CUDA, 0), False)
        call = check_call(x, layout="thd", inv_freq=inv, rotary_dim=rotary_dim, positions=pos,
                          sections=(rotary_dim // 2 - 2, 1, 1), inplace=True)
        assert launch.choose_spec(call).unroll == launch.POLICY.unroll


@pytest.mark.parametrize("source,heads,mapping", [
    ("table", 32, "flat"), ("inv_freq", 32, "rope"), ("freqs", 32, "rope"),
    ("inv_freq", launch.POLICY.computed_angles_heads - 1, "packet"), ("freqs", 8, "packet")])
def test_computed_angles_for_many_heads_use_rope_kernel(source, heads, mapping):
    """Angles computed in the kernel (inv_freq, freqs) are found once per
    thread: rope_kernel's thread shares them across several heads."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    d = 128
    x = Tensor(None, "cupy", 1 << 40, (16, heads, d), (heads * d, d, 1), "bfloat16", (CUDA, 0),
               False)
    kw = {"inv_freq": Tensor(None, "cupy", 1 << 41, (d // 2,), (1,), "float32", (CUDA, 0), False)}
    if source != "inv_freq":
        t = Tensor(None, "cupy", 1 << 41, (16, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
        kw = {"cos": t, "sin": t} if source == "table" else {"freqs": t}
    call = check_call(x, layout="thd", inplace=True, **kw)
    assert launch.choose_spec(call).mapping == mapping


@pytest.mark.parametrize("interleaved,inplace,dtype,last_stride,ptr_offset,mapping", [
    (False, False, "bfloat16", 1, 0, "packet"),
    (False, True, "bfloat16", 1, 0, "packet"),
    (True, True, "bfloat16", 1, 0, "packet"),
    (True, False, "float32", 1, 0, "packet"),
    (False, False, "bfloat16", 2, 0, "rope"),  # strided channels
    (False, False, "bfloat16", 1, 8, "rope"),  # 8-byte aligned: no 16-byte packets
])
def test_packet_kernel_policy(interleaved, inplace, dtype, last_stride, ptr_offset, mapping):
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    h, d = 8, 128
    st = (h * d * last_stride, d * last_stride, last_stride)
    x = Tensor(None, "cupy", (1 << 40) + ptr_offset, (16, h, d), st, dtype, (CUDA, 0), False)
    cos = Tensor(None, "cupy", 1 << 41, (16, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
    sin = Tensor(None, "cupy", 1 << 42, (16, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
    kw = dict(inplace=True) if inplace else dict(out=Tensor(
        None, "cupy", 1 << 43, (16, h, d), (h * d, d, 1), dtype, (CUDA, 0), False))
    call = check_call(x, cos=cos, sin=sin, layout="thd", interleaved=interleaved, **kw)
    assert launch.choose_spec(call, flat=False).mapping == mapping
    assert launch.choose_spec(call).mapping == ("flat" if mapping == "packet" else mapping)


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 24, 32, 40, 100, 4095, 65536, 65537,
                               (1 << 30) + 1, (1 << 31) - 1])
def test_reciprocal_divides_every_31_bit_numerator(d):
    mul, shift = launch.reciprocal(d)
    rng = np.random.default_rng(d)
    top = (1 << 31) - 1
    ns = np.concatenate([rng.integers(0, top, 20000), np.arange(0, 3000),
                         top - np.arange(0, 3000), np.arange(1, 2000) * d - 1,
                         np.arange(1, 2000) * d]).astype(object)
    for n in ns:
        if 0 <= n <= top:
            assert (int(n) * mul) >> shift == int(n) // d, (n, d)
    assert mul < 1 << 33 and shift < 64


@pytest.mark.parametrize("head_dim,dtype,interleaved,mapping,threads", [
    (64, "bfloat16", False, "packet", 4), (128, "float16", False, "packet", 8),
    (256, "float32", False, "packet", 32),
    (80, "bfloat16", False, "packet", 5), (96, "bfloat16", False, "packet", 6),
    (96, "float32", False, "packet", 12), (32, "float32", False, "packet", 4),
    (16, "bfloat16", False, "packet", 1),
    (4, "float32", False, "rope", None),  # 2-pair packets: 8 bytes
    # GPT-J: two adjacent packets per thread for 16-bit elements, one for fp32
    (128, "bfloat16", True, "packet", 8), (16, "bfloat16", True, "packet", 1),
    (8, "bfloat16", True, "rope", None),  # one packet per head: no pair to take
    (96, "bfloat16", True, "packet", 6), (24, "bfloat16", True, "rope", None),  # 3 packets
    (128, "float32", True, "packet", 32), (8, "float32", True, "packet", 2)])
def test_packet_kernel_threads_per_head(head_dim, dtype, interleaved, mapping, threads):
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    h, d = 8, head_dim
    x = Tensor(None, "cupy", 1 << 40, (16, h, d), (h * d, d, 1), dtype, (CUDA, 0), False)
    inv = Tensor(None, "cupy", 1 << 41, (d // 2,), (1,), "float32", (CUDA, 0), False)
    call = check_call(x, inv_freq=inv, layout="thd", inplace=True, interleaved=interleaved)
    spec = launch.choose_spec(call)
    assert spec.mapping == mapping
    if threads is not None:
        assert spec.rot_items == threads


@pytest.mark.parametrize("row_stride,strided", [(64, False), (68, True)])
def test_gptj_packets_read_16_bit_tables_whole_rows_only_when_aligned(row_stride, strided):
    """A GPT-J bf16 unit of packet_kernel reads 8 frequencies per table row
    (16 bytes of a bf16 table): rows only 8-byte aligned are read element by
    element."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    h, d = 8, 128
    x = Tensor(None, "cupy", 1 << 40, (16, h, d), (h * d, d, 1), "bfloat16", (CUDA, 0), False)
    cos = Tensor(None, "cupy", 1 << 41, (16, d // 2), (row_stride, 1), "bfloat16", (CUDA, 0),
                 False)
    sin = Tensor(None, "cupy", 1 << 42, (16, d // 2), (row_stride, 1), "bfloat16", (CUDA, 0),
                 False)
    for interleaved in (False, True):
        call = check_call(x, cos=cos, sin=sin, layout="thd", inplace=True,
                          interleaved=interleaved)
        # flat_kernel reads a packet's frequencies (NeoX 8: 16 bytes, GPT-J 4: 8
        # bytes) as one run, so NeoX needs 16-byte aligned rows
        assert launch.choose_spec(call).mapping == (
            "packet" if strided and not interleaved else "flat")
        spec = launch.choose_spec(call, flat=False)
        assert spec.mapping == "packet"
        assert spec.table_strided == strided
        if interleaved:
            # rope_kernel's GPT-J item reads 4 frequencies (8 bytes): aligned.
            assert not launch.choose_spec(call, packets=False).table_strided


@pytest.mark.parametrize("rule,tokens,mapping", [
    ("explicit", 16, "flat"), ("explicit", launch.POLICY.explicit_packet_rows // 8 - 1, "packet"),
    ("explicit", launch.POLICY.explicit_packet_rows // 8, "rope"), ("implied", 1 << 16, "flat"),
    ("varlen", 16, "rope")])
def test_packet_kernel_position_rules(rule, tokens, mapping):
    """Explicit positions into a small table use flat_kernel; into a table
    larger than FLAT_POSITIONS_TABLE_BYTES, packet_kernel below
    EXPLICIT_PACKET_ROWS rows (tokens x heads) and rope_kernel from there on
    (a packet thread's table read waits for its position read); cu_seqlens
    keep rope_kernel's token blocks (one sequence search per block of
    several tokens)."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    h, d = 8, 128
    x = Tensor(None, "cupy", 1 << 40, (tokens, h, d), (h * d, d, 1), "bfloat16", (CUDA, 0),
               False)
    rows = max(16, tokens)  # thd's implied position is the token index
    cos = Tensor(None, "cupy", 1 << 41, (rows, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
    sin = Tensor(None, "cupy", 1 << 42, (rows, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
    kw = ({"positions": Tensor(None, "cupy", 1 << 43, (tokens,), (1,), "int32", (CUDA, 0),
                               False)} if rule == "explicit" else
          {"cu_seqlens": Tensor(None, "cupy", 1 << 43, (3,), (1,), "int32", (CUDA, 0), False)}
          if rule == "varlen" else {})
    call = check_call(x, cos=cos, sin=sin, layout="thd", inplace=True, **kw)
    assert launch.choose_spec(call).mapping == mapping


@pytest.mark.parametrize("storage,packets,head_major", [
    ("bhsd", True, 1), ("bshd", True, 0), ("bhsd", False, 0)])
def test_packet_rows_head_major_when_heads_are_stored_outside_tokens(storage, packets,
                                                                    head_major):
    """packet_kernel walks a [b, h, s, d] array seen as bshd head by head
    (consecutive threads on consecutive memory); rope_kernel never does."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    b, s, h, d = 2, 16, 8, 128
    st = (h * s * d, d, s * d, 1) if storage == "bhsd" else (s * h * d, h * d, d, 1)
    x = Tensor(None, "cupy", 1 << 40, (b, s, h, d), st, "bfloat16", (CUDA, 0), False)
    cos = Tensor(None, "cupy", 1 << 41, (s, d // 2), (d // 2, 1), "float32", (CUDA, 0), False)
    call = check_call(x, cos=cos, sin=cos, layout="bshd", inplace=True)
    assert launch.choose_spec(call, flat=False).mapping == "packet"
    fixed = dict(zip((n for n, _ in launch.FIXED_FIELDS),
                     launch._FIXED.unpack(launch.fixed_params(call, [(0, 0, 0, 0)], packets))))
    assert fixed["slab[0].head_major"] == head_major


# ------------------------------------------------------------ flat_kernel --
def _dense(shape, order, dtype="bfloat16", ptr=1 << 40):
    """A Tensor of ``shape`` stored densely with its axes in ``order``
    (outermost first), e.g. a [b, s, h, d] view of [b, h, s, d] storage:
    order (0, 2, 1, 3)."""
    from cupy_rope.interop import CUDA, Tensor

    strides, acc = [0] * len(shape), 1
    for ax in reversed(order):
        strides[ax] = acc
        acc *= shape[ax]
    return Tensor(None, "cupy", ptr, tuple(shape), tuple(strides), dtype, (CUDA, 0), False)


def _table(rows, half, dtype="float32", ptr=1 << 41):
    from cupy_rope.interop import CUDA, Tensor

    return Tensor(None, "cupy", ptr, (rows, half), (half, 1), dtype, (CUDA, 0), False)


class FlatCall(NamedTuple):
    """A call for the flat_kernel policy tests: dense bf16 bshd [2, 16, 32,
    128] out of place with fp32 cos/sin tables and implied positions, but
    for the fields given."""

    layout: str = "bshd"
    shape: tuple = (2, 16, 32, 128)
    order: tuple = (0, 1, 2, 3)  # x's storage order, outermost axis first
    dtype: str = "bfloat16"
    interleaved: bool = False
    inplace: bool = False
    partial: bool = False  # rotary_dim = head_dim / 2
    angles: str = "table"  # "table", "inv_freq" or "unaligned table" (rows 4 apart of 16 bytes)
    contiguous_out: bool = False  # out in row-major order whatever x's order
    positions: bool = False  # explicit positions [b, s]
    offsets: bool = False  # offsets per batch entry
    cp: bool = False  # context parallel, rank 1 of 2


def _flat_call(c: FlatCall):
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    d = c.shape[-1]
    s = c.shape[0] if c.layout in ("sbhd", "thd") else c.shape[1]
    r = d // 2 if c.partial else d
    kw = {"interleaved": c.interleaved}
    if c.angles == "inv_freq":
        kw["inv_freq"] = Tensor(None, "cupy", 1 << 41, (r // 2,), (1,), "float32", (CUDA, 0),
                                False)
    elif c.angles == "unaligned table":
        t = Tensor(None, "cupy", 1 << 41, (s, d // 2), (d // 2 + 4, 1), "float32", (CUDA, 0),
                   False)
        kw.update(cos=t, sin=t)
    else:
        kw.update(cos=_table(2 * s, r // 2), sin=_table(2 * s, r // 2, ptr=1 << 42))
    b = c.shape[0]
    if c.positions:
        kw["positions"] = _dense((b, s), (0, 1), "int32", 1 << 43)
    if c.offsets:
        kw["offsets"] = _dense((b,), (0,), "int32", 1 << 43)
    if c.cp:
        kw.update(cp_size=2, cp_rank=1)
    if c.inplace:
        kw["inplace"] = True
    else:
        out_order = tuple(range(len(c.shape))) if c.contiguous_out else c.order
        kw["out"] = _dense(c.shape, out_order, c.dtype, 1 << 44)
    return check_call(_dense(c.shape, c.order, c.dtype), layout=c.layout, rotary_dim=r, **kw)


BHSD = (0, 2, 1, 3)  # a [b, s, h, d] view of [b, h, s, d] storage


@pytest.mark.parametrize("case,mapping,split,partner_load", [
    pytest.param(FlatCall(), "flat", False, False, id="bshd"),
    pytest.param(FlatCall(layout="sbhd", shape=(16, 2, 32, 128)), "flat", False, False,
                 id="sbhd"),
    pytest.param(FlatCall(order=BHSD), "flat", True, False, id="bhsd view"),
    pytest.param(FlatCall(order=BHSD, contiguous_out=True), "packet", None, None,
                 id="bhsd view, contiguous out"),
    pytest.param(FlatCall(layout="thd", shape=(16, 4, 128), order=(0, 1, 2)), "flat", True,
                 False, id="thd 4 heads"),
    pytest.param(FlatCall(inplace=True), "flat", False, False, id="in place"),
    pytest.param(FlatCall(order=BHSD, interleaved=True), "flat", False, False,
                 id="gptj bhsd view"),
    pytest.param(FlatCall(positions=True), "packet", None, None, id="explicit positions"),
    pytest.param(FlatCall(offsets=True), "packet", None, None, id="offsets per batch entry"),
    pytest.param(FlatCall(cp=True), "packet", None, None, id="context parallel"),
    pytest.param(FlatCall(shape=(2, 16, 32, 80)), "flat", False, False, id="d80 bf16"),
    pytest.param(FlatCall(shape=(2, 16, 32, 96)), "flat", False, True, id="d96 bf16"),
    pytest.param(FlatCall(shape=(2, 16, 32, 96), inplace=True), "packet", None, None,
                 id="d96 bf16 in place"),
    pytest.param(FlatCall(shape=(2, 16, 32, 96), interleaved=True), "flat", False, False,
                 id="d96 bf16 gptj"),
    pytest.param(FlatCall(shape=(2, 16, 32, 80), dtype="float32"), "flat", False, True,
                 id="d80 fp32"),
    pytest.param(FlatCall(shape=(2, 16, 32, 256), dtype="float32"), "flat", False, True,
                 id="d256 fp32"),
    pytest.param(FlatCall(shape=(2, 16, 32, 256), dtype="float32", inplace=True), "packet",
                 None, None, id="d256 fp32 in place"),
    pytest.param(FlatCall(shape=(2, 16, 32, 256), dtype="float32", interleaved=True), "flat",
                 False, False, id="d256 fp32 gptj"),
    pytest.param(FlatCall(partial=True), "rope", None, None, id="partial rotary"),
    pytest.param(FlatCall(partial=True, inplace=True), "flat", False, False,
                 id="partial rotary in place"),
    pytest.param(FlatCall(angles="inv_freq"), "rope", None, None, id="inv_freq"),
    pytest.param(FlatCall(angles="unaligned table"), "packet", None, None,
                 id="unaligned table rows")])
def test_flat_kernel_policy(case, mapping, split, partner_load):
    """flat_kernel takes dense slabs whose output has x's strides, full
    rotary, cos/sin tables, implied positions with a scalar offset only, and
    (NeoX) rows that fill a warp but for at most flat_max_idle_lanes lanes,
    or else an output apart from x (the thread loads its partner itself);
    NeoX lanes split the angle reads when a block's rows lie at several
    positions."""
    call = _flat_call(case)
    spec = launch.choose_spec(call)
    assert spec.mapping == mapping
    if split is not None:
        assert (spec.split_angles, spec.partner_load) == (split, partner_load)
    if mapping == "flat":  # flat=False: what runs without it (partial: one head per thread)
        assert spec.slabs == 1  # compiled for one slab: no run-time pick
        assert launch.choose_spec(call, flat=False).mapping == (
            "rope" if case.partial else "packet")


class PositionsCall(NamedTuple):
    """A call with explicit positions for the flat_kernel tests: thd [64,
    32, 128] bf16 out of place, int32 positions [t], fp32 tables of 4096
    rows, but for the fields given."""

    layout: str = "thd"
    b: int = 1  # batch entries (bshd, sbhd)
    s: int = 64
    h: int = 32
    d: int = 128
    dtype: str = "bfloat16"
    pos_dtype: str = "int32"
    interleaved: bool = False
    table_rows: int = 4096
    batch_positions: bool = False  # positions [b, s] (else [s])
    pos_stride: int = 1  # every pos_stride-th element of a longer array
    offsets: bool = False  # offsets per batch entry
    inplace: bool = False  # in place with rotary_dim 64
    kernels: tuple = launch.POLICY.kernels  # LaunchPolicy.kernels


_TABLE_BOUND = launch.POLICY.flat_table_bytes
_ROW_BYTES = 128 * 4  # fp32 cos and sin rows of 64 frequencies each


@pytest.mark.parametrize("case,mapping", [
    pytest.param(PositionsCall(), "flat", id="thd"),
    pytest.param(PositionsCall(pos_dtype="int64"), "flat", id="thd int64"),
    pytest.param(PositionsCall(interleaved=True), "flat", id="thd GPT-J"),
    pytest.param(PositionsCall(layout="bshd", b=2), "flat", id="bshd [s]"),
    pytest.param(PositionsCall(layout="bshd", b=1, batch_positions=True), "flat",
                 id="bshd [1, s]"),
    pytest.param(PositionsCall(layout="sbhd", b=2), "flat", id="sbhd [s]"),
    pytest.param(PositionsCall(layout="bshd", b=2, batch_positions=True), "packet",
                 id="bshd [b, s]"),
    # (16 heads: below explicit_packet_rows)
    pytest.param(PositionsCall(h=16, table_rows=_TABLE_BOUND // _ROW_BYTES + 1,
                               s=_TABLE_BOUND // _ROW_BYTES + 1), "packet",
                 id="table over the byte bound"),
    pytest.param(PositionsCall(h=16, table_rows=1 << 20, s=_TABLE_BOUND // _ROW_BYTES + 1),
                 "packet", id="positions over the byte bound"),
    pytest.param(PositionsCall(h=16, table_rows=_TABLE_BOUND // _ROW_BYTES,
                               s=_TABLE_BOUND // _ROW_BYTES), "flat",
                 id="table rows at the byte bound"),
    pytest.param(PositionsCall(table_rows=1 << 20), "flat",
                 id="large table, few positions"),  # decode into a long cos/sin cache
    pytest.param(PositionsCall(h=16, s=2 * _TABLE_BOUND // _ROW_BYTES, table_rows=64), "flat",
                 id="many positions, small table"),  # packed short sequences
    pytest.param(PositionsCall(pos_stride=3), "flat", id="strided positions"),
    pytest.param(PositionsCall(dtype="float32"), "packet", id="float32"),
    pytest.param(PositionsCall(d=80), "packet", id="d80 NeoX"),
    pytest.param(PositionsCall(h=4), "packet", id="split angles"),  # 4 rows a position, 8 a block
    pytest.param(PositionsCall(layout="bshd", b=2, offsets=True), "packet",
                 id="offsets per batch entry"),
    pytest.param(PositionsCall(kernels=("packet", "rope")), "packet",
                 id="packet_kernel and rope_kernel only"),
    pytest.param(PositionsCall(inplace=True), "flat", id="in place, rotary 64")])
def test_flat_kernel_explicit_positions_policy(monkeypatch, case, mapping):
    """Explicit positions run flat_kernel when they follow the sequence index
    alone ([t], [s], [1, s]), the table rows they can reach fit in
    LaunchPolicy.flat_table_bytes, and the kernel would ask for those rows
    late (16-bit x, rows that tile a warp or GPT-J, no split angles);
    otherwise packet_kernel (these calls are small) as before. The
    positions' stride and width reach FlatParams."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    monkeypatch.setattr(launch, "POLICY", dataclasses.replace(launch.POLICY,
                                                              kernels=case.kernels))
    b, s, h, d, layout = case.b, case.s, case.h, case.d, case.layout
    r = 64 if case.inplace else d
    kw = {"inplace": True} if case.inplace else {}
    if case.offsets:
        kw["offsets"] = _dense((b,), (0,), "int32", 1 << 43)
    if layout == "thd":
        shape = (s, h, d)
    else:
        shape = (b, s, h, d) if layout == "bshd" else (s, b, h, d)
    pos_shape = (b, s) if case.batch_positions else (s,)
    kw["positions"] = Tensor(None, "cupy", 1 << 42, pos_shape,
                             _dense(pos_shape, tuple(range(len(pos_shape)))).strides[:-1]
                             + (case.pos_stride,), case.pos_dtype, (CUDA, 0), False)
    if not case.inplace:
        kw["out"] = _dense(shape, tuple(range(len(shape))), case.dtype, 1 << 44)
    tab = _table(case.table_rows, r // 2)
    call = check_call(_dense(shape, tuple(range(len(shape))), case.dtype), cos=tab, sin=tab,
                      layout=layout, interleaved=case.interleaved, rotary_dim=r, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == mapping
    if mapping == "flat":
        assert spec.pos_mode == "explicit" and not spec.split_angles
        # one slab, explicit positions, table rows late (never early for positions)
        assert spec.name_expression().endswith(", 1, 1, false, false>")
        plan = launch.Plan.__new__(launch.Plan)
        plan.spec, plan.buf = spec, bytes(launch._DYNAMIC.size) + launch.flat_fixed_params(
            call, [(0, 0, 0, 0)], launch.flat_geometry(call))
        fixed = launch.unpack_fixed(plan)
        assert (fixed["pos_stride"], fixed["pos_is_64"]) == (
            case.pos_stride, int(case.pos_dtype == "int64"))
        # the row's sequence index: rows per step (h for token-major x), no modulo
        step = h * (b if layout == "sbhd" else 1)
        assert fixed["slab[0].seq_len"] == (s if layout == "bshd" and b > 1 else 0)
        assert launch.flat_geometry(call)[0][1] == step


class EarlyCall(NamedTuple):
    """A call for the early-table-rows tests: bf16 sbhd [s, 1, 32, 128] out
    of place, NeoX, implied positions, whose x holds at least the bound's
    bytes (``below``: one token of heads fewer), but for the fields given."""

    d: int = 128
    dtype: str = "bfloat16"
    interleaved: bool = False
    heads: int = 32
    below: bool = False
    layout: str = "sbhd"
    qk: bool = False  # bshd q of 24 heads and k of 8: the bytes of both
    positions: bool = False  # explicit positions [s]
    inplace: bool = False  # in place, rotary_dim 64: the rotated bytes count


@pytest.mark.parametrize("case,early", [
    pytest.param(EarlyCall(), True, id="sbhd at the bound"),
    pytest.param(EarlyCall(below=True), False, id="sbhd below the bound"),
    pytest.param(EarlyCall(layout="bshd", qk=True), True, id="bshd q + k at the bound"),
    pytest.param(EarlyCall(interleaved=True), True, id="GPT-J at the bound"),
    pytest.param(EarlyCall(dtype="float32"), False, id="float32 at the bound"),
    # rows of 10 packets: GPT-J asks late, NeoX early anyway
    pytest.param(EarlyCall(d=80, interleaved=True), True, id="d80 GPT-J at the bound"),
    pytest.param(EarlyCall(d=80), False, id="d80 NeoX at the bound"),
    pytest.param(EarlyCall(heads=4), False, id="split angles at the bound"),  # 4 rows a position
    pytest.param(EarlyCall(positions=True), False, id="explicit positions at the bound"),
    pytest.param(EarlyCall(inplace=True, below=True), False,
                 id="in place rotary 64, bytes walked below the bound"),
    pytest.param(EarlyCall(inplace=True), True,
                 id="in place rotary 64, bytes walked at the bound")])
def test_flat_kernel_early_tables_for_large_calls(monkeypatch, case, early):
    """flat_kernel rows that would ask for their table rows late ask early
    in calls with implied positions that walk flat_early_tables_bytes of x
    or more (the rotated channels of every slab); never for explicit
    positions, and the rows that ask early anyway are unchanged."""
    from cupy_rope.validate import check_call

    bound = 1 << 20  # a small bound, so that the shapes stay small
    monkeypatch.setattr(launch, "POLICY", dataclasses.replace(launch.POLICY,
                                                              flat_early_tables_bytes=bound))
    d, h, dtype, kw = case.d, case.heads, case.dtype, {}
    r = 64 if case.inplace else d
    rows = bound // (r * (4 if dtype == "float32" else 2))  # rows of the bound's bytes
    if case.below:
        rows -= h
    s = rows // h if case.below else -(-rows // h)  # at the bound: at least its bytes
    shape = (s, 1, h, d) if case.layout == "sbhd" else (1, s, h, d)
    if case.qk:
        shape, kw["k"] = (1, s, 24, d), _dense((1, s, 8, d), (0, 1, 2, 3), dtype, 1 << 45)
        kw["out_k"] = _dense((1, s, 8, d), (0, 1, 2, 3), dtype, 1 << 46)
    if case.positions:
        kw["positions"] = _dense((s,), (0,), "int32", 1 << 43)
    if case.inplace:
        kw["inplace"] = True
    else:
        kw["out"] = _dense(shape, (0, 1, 2, 3), dtype, 1 << 44)
    tab = _table(s, r // 2)
    call = check_call(_dense(shape, (0, 1, 2, 3), dtype), cos=tab, sin=tab, layout=case.layout,
                      interleaved=case.interleaved, rotary_dim=r, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    assert spec.early_tables == early
    b = lambda v: "true" if v else "false"  # noqa: E731
    assert spec.name_expression().endswith(f", {b(early)}, {b(spec.x_evict_last)}>")
    assert spec in launch.shipped_specs()  # compiled on CPU CI too
    monkeypatch.undo()
    assert not launch.choose_spec(call).early_tables  # the shipped bound: these calls are small


class EvictCall(NamedTuple):
    """A call for the evict-last tests: fp32 sbhd [16, 2, 8, 128] NeoX out
    of place with cos/sin tables, but for the fields given."""

    layout: str = "sbhd"
    batch: int = 2
    dtype: str = "float32"
    d: int = 128
    interleaved: bool = False
    qk: bool = False  # and k of 2 heads
    inplace: bool = False


@pytest.mark.parametrize("case,evict_last,partner_load", [
    pytest.param(EvictCall(), True, False, id="sbhd"),
    pytest.param(EvictCall(qk=True), True, False, id="sbhd q + k"),
    pytest.param(EvictCall(layout="thd"), True, False, id="thd"),
    pytest.param(EvictCall(layout="bshd", batch=1), True, False, id="bshd one batch entry"),
    pytest.param(EvictCall(layout="bshd"), False, False, id="bshd two batch entries"),
    pytest.param(EvictCall(inplace=True), False, False, id="in place"),
    pytest.param(EvictCall(dtype="bfloat16"), False, False, id="bfloat16"),
    pytest.param(EvictCall(d=96), False, True, id="d96 NeoX (partner load)"),
    pytest.param(EvictCall(d=96, interleaved=True), True, False, id="d96 GPT-J"),
    pytest.param(EvictCall(d=64), True, False, id="d64")])
def test_flat_kernel_x_evict_last_for_fp32_in_position_order(case, evict_last, partner_load):
    """fp32 calls out of place, full rotary, whose rows' positions never
    decrease through memory (no axis outside the sequence axis) load x with
    an L2 evict-last policy; a batch axis outside the sequence, in place,
    16-bit x and fp32 partner loads keep plain loads. Every such spec is
    shipped."""
    from cupy_rope.validate import check_call

    h, s, d, dtype, kw = 8, 16, case.d, case.dtype, {}
    shape = {"thd": (s, h, d), "bshd": (case.batch, s, h, d), "sbhd": (s, case.batch, h, d)}[
        case.layout]
    if case.qk:
        kw["k"] = _dense((s, case.batch, 2, d), (0, 1, 2, 3), dtype, 1 << 45)
        kw["out_k"] = _dense((s, case.batch, 2, d), (0, 1, 2, 3), dtype, 1 << 46)
    order = tuple(range(len(shape)))
    if case.inplace:
        kw["inplace"] = True
    else:
        kw["out"] = _dense(shape, order, dtype, 1 << 44)
    tab = _table(s, d // 2)
    call = check_call(_dense(shape, order, dtype), cos=tab, sin=tab, layout=case.layout,
                      interleaved=case.interleaved, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    assert spec.x_evict_last == evict_last
    assert spec.partner_load == partner_load
    if evict_last:
        assert spec in launch.shipped_specs()  # compiled on CPU CI too


@pytest.mark.parametrize("s,early", [(16383, False), (16384, True)])
def test_flat_kernel_early_tables_from_512_mib(s, early):
    """The shipped bound: bf16 sbhd [s, 1, 128, 128] asks for its table rows
    late below 512 MiB of x and early from there on."""
    from cupy_rope.validate import check_call

    shape, d = (s, 1, 128, 128), 128
    tab = _table(s, d // 2)
    call = check_call(_dense(shape, (0, 1, 2, 3)), cos=tab, sin=tab, layout="sbhd",
                      out=_dense(shape, (0, 1, 2, 3), "bfloat16", 1 << 44))
    assert s * 128 * d * 2 - (512 << 20) == (0 if early else -128 * d * 2)
    spec = launch.choose_spec(call)
    assert (spec.mapping, spec.early_tables) == ("flat", early)


@pytest.mark.parametrize("exact", [True, False], ids=["flat", "packet only"])
@pytest.mark.parametrize("k_heads", [0, 8])
def test_flat_kernel_slab_count(monkeypatch, exact, k_heads):
    """flat_kernel is compiled for the call's slab count (x alone: 1, q and
    k: 2), whose first block is 0; packet_kernel (flat_kernel not allowed)
    takes any count (0: each block picks its slab at run time)."""
    from cupy_rope.validate import check_call

    if not exact:
        monkeypatch.setattr(launch, "POLICY", dataclasses.replace(
            launch.POLICY, kernels=("packet", "rope")))
    b, s, h, d = 2, 16, 32, 128
    tab = _table(2 * s, d // 2)
    kw = {}
    if k_heads:
        kw = dict(k=_dense((b, s, k_heads, d), (0, 1, 2, 3), "bfloat16", 1 << 45),
                  out_k=_dense((b, s, k_heads, d), (0, 1, 2, 3), "bfloat16", 1 << 46))
    call = check_call(_dense((b, s, h, d), (0, 1, 2, 3), "bfloat16"), cos=tab, sin=tab,
                      out=_dense((b, s, h, d), (0, 1, 2, 3), "bfloat16", 1 << 44), **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == ("flat" if exact else "packet")
    assert spec.slabs == ((2 if k_heads else 1) if exact else 0)
    if not exact:
        return
    # implied positions (0), table rows as the kernel's rule asks for them
    assert spec.name_expression().endswith(f", {spec.slabs}, 0, false, false>")
    geometry = launch.flat_geometry(call)
    _, _, slabs = launch.flat_shape(16, False, [rows for rows, _, _ in geometry])
    assert slabs[0][0] == 0 and len(slabs) == len(call.slabs)


@pytest.mark.parametrize("dtype,d,r", [("bfloat16", 36, 16), ("float32", 18, 8)])
def test_flat_kernel_partial_rows_are_whole_packets_apart(dtype, d, r):
    """A single head row in place whose rotated channels fill 16-byte
    packets but whose head_dim does not (no stride tells the launcher):
    not flat_kernel, which walks rows whole packets apart (review of
    563c385: NVRTC refused the specialization)."""
    from cupy_rope import specialize
    from cupy_rope.validate import check_call

    for shape, layout in (((1, 1, d), "thd"), ((1, 1, 1, d), "bshd")):
        x = _dense(shape, tuple(range(len(shape))), dtype)
        tab = _table(4, r // 2)
        call = check_call(x, cos=tab, sin=tab, layout=layout, rotary_dim=r, inplace=True)
        spec = launch.choose_spec(call)
        assert spec.mapping != "flat"
        assert specialize.compile_for_arch([spec], "sm_90")


STORAGE = {  # layout, logical shape from (b, s, h), storage order of the logical axes
    "bshd": ("bshd", lambda b, s, h: (b, s, h), (0, 1, 2, 3)),
    "sbhd": ("sbhd", lambda b, s, h: (s, b, h), (0, 1, 2, 3)),
    "bhsd as bshd": ("bshd", lambda b, s, h: (b, s, h), (0, 2, 1, 3)),
    "hbsd as bshd": ("bshd", lambda b, s, h: (b, s, h), (2, 0, 1, 3)),
    "sbhd as bshd": ("bshd", lambda b, s, h: (b, s, h), (1, 0, 2, 3)),
    "shbd as sbhd": ("sbhd", lambda b, s, h: (s, b, h), (0, 2, 1, 3)),
    "bhsd as sbhd": ("sbhd", lambda b, s, h: (s, b, h), (1, 2, 0, 3)),
    "thd": ("thd", lambda b, s, h: (b * s, h), (0, 1, 2)),
    "htd as thd": ("thd", lambda b, s, h: (b * s, h), (1, 0, 2)),
}


@pytest.mark.parametrize("storage", sorted(STORAGE))
@pytest.mark.parametrize("b,s,h", [(1, 1, 1), (3, 1, 5), (1, 7, 1), (2, 9, 3), (3, 5, 4),
                                   (4, 33, 7), (1, 64, 32)])
@pytest.mark.parametrize("dtype,d,interleaved", [
    ("bfloat16", 128, False), ("bfloat16", 80, False), ("float32", 64, False),
    ("bfloat16", 96, True), ("float32", 256, True), ("bfloat16", 16, False),
    ("bfloat16", 96, False), ("float32", 80, False)])
def test_flat_kernel_index_math(storage, b, s, h, dtype, d, interleaved):
    """kernels/flat.cu's index math, emulated on the plan's parameters: the
    grid of flat_shape gives every (row, packet) of every slab to exactly one
    lane, and a row's position, (row / rows_per_step) % seq_len by host-made
    reciprocals, is the sequence index of the memory it addresses (row *
    head_dim elements from the start)."""
    _check_flat_index_math(storage, b, s, h, dtype, d, interleaved, d)


@pytest.mark.parametrize("storage", ["bshd", "bhsd as bshd", "htd as thd"])
@pytest.mark.parametrize("b,s,h", [(1, 1, 1), (2, 9, 3), (4, 33, 7), (1, 64, 32)])
@pytest.mark.parametrize("dtype,d,interleaved,rotary_dim", [
    ("bfloat16", 128, False, 64), ("bfloat16", 128, False, 32), ("bfloat16", 96, False, 48),
    ("bfloat16", 128, True, 32), ("float32", 256, True, 64), ("float32", 64, False, 32)])
def test_flat_kernel_index_math_partial_in_place(storage, b, s, h, dtype, d, interleaved,
                                                 rotary_dim):
    """Partial rotary in place: flat_kernel's lanes cover the rotated
    packets of every head row exactly once (the rest of the row is never
    addressed), at the row's sequence index."""
    _check_flat_index_math(storage, b, s, h, dtype, d, interleaved, rotary_dim)


def _check_flat_index_math(storage, b, s, h, dtype, d, interleaved, rotary_dim):
    from cupy_rope.validate import check_call

    layout, tokens, order = STORAGE[storage]
    shape = (*tokens(b, s, h), d)
    x = _dense(shape, order, dtype)
    tab = _table(max(s, b * s), rotary_dim // 2)
    where = (dict(inplace=True) if rotary_dim < d
             else dict(out=_dense(shape, order, dtype, 1 << 44)))
    call = check_call(x, cos=tab, sin=tab, layout=layout, interleaved=interleaved,
                      rotary_dim=rotary_dim, **where)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    geometry = launch.flat_geometry(call)
    (rows, step, seq), = geometry
    vec = 16 // (4 if dtype == "float32" else 2)
    packets = rotary_dim // vec  # the packets a lane walks per head row
    grid, block, slabs = launch.flat_shape(packets, interleaved or spec.partner_load, [rows])
    assert block == (launch.FLAT_THREADS, 1, 1) and slabs == [(0, 0, 0, 0)]
    fields = dict(zip((n for n, _ in launch.FLAT_FIXED_FIELDS), launch._FLAT_FIXED.unpack(
        launch.flat_fixed_params(call, slabs, geometry))))
    assert fields["slab[0].rows"] == rows == int(np.prod(shape)) // d
    assert fields["n_slabs"] == 1 and fields["max_position"] == tab.shape[0]
    assert fields["zero"] == 0  # ANDed into table addresses (kernels/flat.cu LATE_TABLES)

    # Every lane of the grid, as the kernel maps it.
    lanes = 32 if interleaved or spec.partner_load else 32 // packets * packets
    warp = np.arange(grid[0] * launch.FLAT_THREADS // 32)
    lane = np.arange(32)
    unit = (warp[:, None] * lanes + lane[None, :]).ravel()
    lane_of = np.broadcast_to(lane, (len(warp), 32)).ravel()
    row = unit // packets
    live = (lane_of < lanes) & (row < rows)
    pairs = row[live] * packets + unit[live] % packets
    assert np.array_equal(np.sort(pairs), np.arange(rows * packets))  # each exactly once
    # and the element each live lane addresses lies in its row's rotated channels
    first = row[live] * d + (unit[live] % packets) * vec
    assert ((first % d) + vec <= rotary_dim).all()
    if not interleaved and not spec.partner_load:  # NeoX by shuffle: partner in the same row
        pk = unit % packets
        half = packets // 2
        partner = lane_of + np.where(pk < half, half, -half)
        partner_unit = (unit - lane_of) + partner
        assert ((partner[live] >= 0) & (partner[live] < lanes)).all()
        assert np.array_equal(partner_unit[live] // packets, row[live])

    # Positions by the kernel's arithmetic against the memory each row addresses.
    r = np.arange(rows, dtype=np.int64)
    stp = (r * fields["slab[0].step_mul"]) >> fields["slab[0].step_shift"]
    n = fields["slab[0].seq_len"]
    index = stp - ((stp * fields["slab[0].seq_mul"]) >> fields["slab[0].seq_shift"]) * n \
        if n else stp
    offset = r * d  # element offset of the row; its logical indices by x's strides
    seq_axis = {"bshd": 1, "sbhd": 0, "thd": 0}[layout]
    strides = x.strides[:-1]
    idx = np.zeros((rows, len(strides)), dtype=np.int64)  # axes of size 1 stay at 0
    rem = offset.copy()
    for ax in sorted((a for a in range(len(strides)) if shape[a] > 1),
                     key=lambda a: -strides[a]):
        idx[:, ax] = rem // strides[ax]
        rem -= idx[:, ax] * strides[ax]
    assert not rem.any()
    assert np.array_equal(index, idx[:, seq_axis])
