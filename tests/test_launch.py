"""Launch policy and the generated decode launcher, on the CPU (no kernel runs)."""

from __future__ import annotations

import ctypes
import struct
import threading
import types

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
    more than VARLEN_FEW_SEQS sequences 8 where 4 would leave a thread
    fewer heads per computed angle than 8 do and than two passes
    (launch.VARLEN_COMPUTED_MIN_TOKENS; measured in docs/perf-notes.md v16)."""
    few_seqs, many = launch.VARLEN_FEW_SEQS, launch.VARLEN_FEW_SEQS + 1
    shape = lambda n, source: launch.varlen_block_shape(  # noqa: E731
        items, heads, 65536, launch.UNROLL, 132, n, source)
    four = launch.block_shape(items, heads, 65536, launch.UNROLL, 132, launch.VARLEN_MIN_TOKENS)
    eight = launch.block_shape(items, heads, 65536, launch.UNROLL, 132,
                               launch.VARLEN_COMPUTED_MIN_TOKENS)
    for n in (1, few_seqs, many):
        assert shape(n, "table") == four
    for source in ("inv_freq", "angle_table"):
        assert shape(1, source) == four and shape(few_seqs, source) == four
        assert shape(many, source) == (four if computed_tokens == 4 else eight)
    assert launch.VARLEN_COMPUTED_MIN_TOKENS > launch.VARLEN_MIN_TOKENS
    if computed_tokens == 8:  # the rule's reason: the fewer tokens halve some slab's heads
        assert any(a < min(b, 2 * launch.UNROLL) for a, b in zip(
            launch._heads_per_thread(four), launch._heads_per_thread(eight)))


def test_varlen_computed_few_tokens_switch(monkeypatch):
    """VARLEN_COMPUTED_FEW_TOKENS = 0 gives every computed-angle call with
    many sequences 8 tokens (the policy before the rule, for probes)."""
    monkeypatch.setattr(launch, "VARLEN_COMPUTED_FEW_TOKENS", 0)
    eight = launch.block_shape(4, (32,), 65536, launch.UNROLL, 132,
                               launch.VARLEN_COMPUTED_MIN_TOKENS)
    assert launch.varlen_block_shape(4, (32,), 65536, launch.UNROLL, 132,
                                     launch.VARLEN_FEW_SEQS + 1, "inv_freq") == eight


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
    (32, False, launch.UNROLL, "heads"),  # partial out of place: the tail is copied
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
        assert launch.choose_spec(call).unroll == launch.UNROLL


@pytest.mark.parametrize("source,heads,mapping", [
    ("table", 32, "flat"), ("inv_freq", 32, "heads"), ("freqs", 32, "heads"),
    ("inv_freq", launch.COMPUTED_ANGLES_HEADS - 1, "packets"), ("freqs", 8, "packets")])
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
    (False, False, "bfloat16", 1, 0, "packets"),
    (False, True, "bfloat16", 1, 0, "packets"),
    (True, True, "bfloat16", 1, 0, "packets"),
    (True, False, "float32", 1, 0, "packets"),
    (False, False, "bfloat16", 2, 0, "heads"),  # strided channels
    (False, False, "bfloat16", 1, 8, "heads"),  # 8-byte aligned: no 16-byte packets
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
    assert launch.choose_spec(call).mapping == ("flat" if mapping == "packets" else mapping)


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
    (64, "bfloat16", False, "packets", 4), (128, "float16", False, "packets", 8),
    (256, "float32", False, "packets", 32),
    (80, "bfloat16", False, "packets", 5), (96, "bfloat16", False, "packets", 6),
    (96, "float32", False, "packets", 12), (32, "float32", False, "packets", 4),
    (16, "bfloat16", False, "packets", 1),
    (4, "float32", False, "heads", None),  # 2-pair packets: 8 bytes
    # GPT-J: two adjacent packets per thread for 16-bit elements, one for fp32
    (128, "bfloat16", True, "packets", 8), (16, "bfloat16", True, "packets", 1),
    (8, "bfloat16", True, "heads", None),  # one packet per head: no pair to take
    (96, "bfloat16", True, "packets", 6), (24, "bfloat16", True, "heads", None),  # 3 packets
    (128, "float32", True, "packets", 32), (8, "float32", True, "packets", 2)])
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
            "packets" if strided and not interleaved else "flat")
        spec = launch.choose_spec(call, flat=False)
        assert spec.mapping == "packets"
        assert spec.table_strided == strided
        if interleaved:
            # rope_kernel's GPT-J item reads 4 frequencies (8 bytes): aligned.
            assert not launch.choose_spec(call, packets=False).table_strided


@pytest.mark.parametrize("rule,tokens,mapping", [
    ("explicit", 16, "flat"), ("explicit", launch.EXPLICIT_PACKET_ROWS // 8 - 1, "packets"),
    ("explicit", launch.EXPLICIT_PACKET_ROWS // 8, "heads"), ("implied", 1 << 16, "flat"),
    ("varlen", 16, "heads")])
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
    assert launch.choose_spec(call, flat=False).mapping == "packets"
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


@pytest.mark.parametrize("case,mapping,split,partner_load", [
    ("bshd", "flat", False, False), ("sbhd", "flat", False, False),
    ("bhsd view", "flat", True, False), ("bhsd view, contiguous out", "packets", None, None),
    ("thd 4 heads", "flat", True, False), ("in place", "flat", False, False),
    ("gptj bhsd view", "flat", False, False), ("explicit positions", "packets", None, None),
    ("offsets per batch entry", "packets", None, None),
    ("context parallel", "packets", None, None), ("d80 bf16", "flat", False, False),
    ("d96 bf16", "flat", False, True), ("d96 bf16 in place", "packets", None, None),
    ("d96 bf16 gptj", "flat", False, False), ("d80 fp32", "flat", False, True),
    ("d256 fp32", "flat", False, True), ("d256 fp32 in place", "packets", None, None),
    ("d256 fp32 gptj", "flat", False, False), ("partial rotary", "heads", None, None),
    ("partial rotary in place", "flat", False, False),
    ("inv_freq", "heads", None, None), ("unaligned table rows", "packets", None, None)])
def test_flat_kernel_policy(case, mapping, split, partner_load):
    """flat_kernel takes dense slabs whose output has x's strides, full
    rotary, cos/sin tables, implied positions with a scalar offset only, and
    (NeoX) rows that fill a warp but for at most FLAT_MAX_IDLE_LANES lanes,
    or else an output apart from x (the thread loads its partner itself);
    NeoX lanes split the angle reads when a block's rows lie at several
    positions."""
    from cupy_rope.interop import CUDA, Tensor
    from cupy_rope.validate import check_call

    b, s, h, d = 2, 16, 32, 128
    dtype = "float32" if "fp32" in case else "bfloat16"
    if case.startswith("d"):
        d = int(case[1:4])
    layout, shape, order = "bshd", (b, s, h, d), (0, 1, 2, 3)
    if case == "sbhd":
        layout, shape = "sbhd", (s, b, h, d)
    elif "bhsd view" in case:
        order = (0, 2, 1, 3)
    elif case == "thd 4 heads":
        layout, shape, order = "thd", (s, 4, d), (0, 1, 2)
    x = _dense(shape, order, dtype)
    kw = {"interleaved": "gptj" in case}
    r = d // 2 if case.startswith("partial rotary") else d
    if case == "inv_freq":
        kw["inv_freq"] = Tensor(None, "cupy", 1 << 41, (r // 2,), (1,), "float32", (CUDA, 0),
                                False)
    elif case == "unaligned table rows":
        t = Tensor(None, "cupy", 1 << 41, (s, d // 2), (d // 2 + 4, 1), "float32", (CUDA, 0),
                   False)
        kw.update(cos=t, sin=t)
    else:
        kw.update(cos=_table(2 * s, r // 2), sin=_table(2 * s, r // 2, ptr=1 << 42))
    if case == "explicit positions":
        kw["positions"] = _dense((b, s), (0, 1), "int32", 1 << 43)
    elif case == "offsets per batch entry":
        kw["offsets"] = _dense((b,), (0,), "int32", 1 << 43)
    elif case == "context parallel":
        kw.update(cp_size=2, cp_rank=1)
    if "in place" in case:
        kw["inplace"] = True
    else:
        out_order = order if "contiguous out" not in case else tuple(range(len(shape)))
        kw["out"] = _dense(shape, out_order, dtype, 1 << 44)
    call = check_call(x, layout=layout, rotary_dim=r, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == mapping
    if split is not None:
        assert (spec.split_angles, spec.partner_load) == (split, partner_load)
    if mapping == "flat":  # flat=False: what runs without it (partial: one head per thread)
        assert spec.slabs == 1  # compiled for one slab: no run-time pick (FLAT_EXACT_SLABS)
        assert launch.choose_spec(call, flat=False).mapping == (
            "heads" if case.startswith("partial") else "packets")


@pytest.mark.parametrize("case,mapping", [
    ("thd", "flat"), ("thd int64", "flat"), ("thd GPT-J", "flat"), ("bshd [s]", "flat"),
    ("bshd [1, s]", "flat"), ("sbhd [s]", "flat"), ("bshd [b, s]", "packets"),
    ("table over the byte bound", "packets"), ("positions over the byte bound", "packets"),
    ("table rows at the byte bound", "flat"), ("large table, few positions", "flat"),
    ("many positions, small table", "flat"),
    ("strided positions", "flat"), ("float32", "packets"),
    ("d80 NeoX", "packets"), ("split angles", "packets"), ("offsets per batch entry", "packets"),
    ("FLAT_POSITIONS off", "packets"), ("in place, rotary 64", "flat")])
def test_flat_kernel_explicit_positions_policy(monkeypatch, case, mapping):
    """Explicit positions run flat_kernel when they follow the sequence index
    alone ([t], [s], [1, s]), the table rows they can reach fit in
    FLAT_POSITIONS_TABLE_BYTES, and the kernel would ask for those rows
    late (16-bit x, rows that tile a warp or GPT-J, no split angles);
    otherwise packet_kernel (these calls are small) as before. The
    positions' stride and width reach FlatParams."""
    from cupy_rope.validate import check_call

    bound = launch.FLAT_POSITIONS_TABLE_BYTES
    b, s, h, d, r = 1, 64, 32, 128, 128
    layout, dtype, pos_dtype, interleaved = "thd", "bfloat16", "int32", False
    table_rows = 4096
    kw = {}
    if case == "thd int64":
        pos_dtype = "int64"
    elif case == "thd GPT-J":
        interleaved = True
    elif case.startswith(("bshd", "sbhd")):
        layout, b = case[:4], (1 if case == "bshd [1, s]" else 2)
    elif case == "table over the byte bound":  # (16 heads: below EXPLICIT_PACKET_ROWS)
        h, table_rows = 16, bound // (d * 4) + 1  # fp32 cos and sin: d * 4 bytes a row
        s = table_rows
    elif case == "positions over the byte bound":
        h, table_rows, s = 16, 1 << 20, bound // (d * 4) + 1
    elif case == "table rows at the byte bound":
        h, table_rows = 16, bound // (d * 4)
        s = table_rows
    elif case == "large table, few positions":  # decode into a long cos/sin cache
        table_rows = 1 << 20
    elif case == "many positions, small table":  # packed short sequences
        h, s, table_rows = 16, 2 * bound // (d * 4), 64
    elif case == "float32":
        dtype = "float32"
    elif case == "d80 NeoX":
        d = r = 80
    elif case == "split angles":
        h = 4  # 4 rows a position, 8 rows a block
    elif case == "offsets per batch entry":
        layout, b = "bshd", 2
        kw["offsets"] = _dense((b,), (0,), "int32", 1 << 43)
    elif case == "FLAT_POSITIONS off":
        monkeypatch.setattr(launch, "FLAT_POSITIONS", False)
    elif case.startswith("in place"):
        r = 64
        kw["inplace"] = True
    if layout == "thd":
        shape, pos_shape = (s, h, d), (s,)
    else:
        shape = (b, s, h, d) if layout == "bshd" else (s, b, h, d)
        pos_shape = (b, s) if case in ("bshd [b, s]", "bshd [1, s]") else (s,)
    pos_order = tuple(range(len(pos_shape)))
    kw["positions"] = _dense(pos_shape, pos_order, pos_dtype, 1 << 42)
    pos_stride = 1
    if case == "strided positions":  # every third element of a longer array
        from cupy_rope.interop import CUDA, Tensor

        pos_stride = 3
        kw["positions"] = Tensor(None, "cupy", 1 << 42, pos_shape, (3,), pos_dtype, (CUDA, 0),
                                 False)
    if "inplace" not in kw:
        kw["out"] = _dense(shape, tuple(range(len(shape))), dtype, 1 << 44)
    tab = _table(table_rows, r // 2)
    call = check_call(_dense(shape, tuple(range(len(shape))), dtype), cos=tab, sin=tab,
                      layout=layout, interleaved=interleaved, rotary_dim=r, **kw)
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
        assert (fixed["pos_stride"], fixed["pos_is_64"]) == (pos_stride,
                                                            int(pos_dtype == "int64"))
        # the row's sequence index: rows per step (h for token-major x), no modulo
        step = h * (b if layout == "sbhd" else 1)
        assert fixed["slab[0].seq_len"] == (s if layout == "bshd" and b > 1 else 0)
        assert launch.flat_geometry(call)[0][1] == step


@pytest.mark.parametrize("case,early", [
    ("sbhd at the bound", True), ("sbhd below the bound", False), ("bshd q + k at the bound", True),
    ("GPT-J at the bound", True), ("float32 at the bound", False),
    ("d80 GPT-J at the bound", True), ("d80 NeoX at the bound", False),
    ("split angles at the bound", False), ("explicit positions at the bound", False),
    ("in place rotary 64, bytes walked below the bound", False),
    ("in place rotary 64, bytes walked at the bound", True)])
def test_flat_kernel_early_tables_for_large_calls(monkeypatch, case, early):
    """flat_kernel rows that would ask for their table rows late ask early
    in calls with implied positions that walk FLAT_EARLY_TABLES_BYTES of x
    or more (the rotated channels of every slab); never for explicit
    positions, and the rows that ask early anyway are unchanged."""
    from cupy_rope.validate import check_call

    bound = 1 << 20  # a small bound, so that the shapes stay small
    monkeypatch.setattr(launch, "FLAT_EARLY_TABLES_BYTES", bound)
    d, r, dtype, interleaved, h, kw = 128, 128, "bfloat16", False, 32, {}
    if case.startswith("d80"):  # rows of 10 packets: GPT-J asks late, NeoX early anyway
        d = r = 80
        interleaved = "GPT-J" in case
    item = 4 if case.startswith("float32") else 2
    rows = bound // (d * item)  # bytes of x at the bound
    if case.startswith("split"):
        h = 4  # 4 rows a position, 8 rows a block
    if "below" in case:
        rows -= h
    if case.startswith("float32"):
        dtype = "float32"
    if case.startswith("GPT-J"):
        interleaved = True
    if case.startswith("in place"):
        r = 64
        rows = bound // (r * 2) - (h if "below" in case else 0)
        kw["inplace"] = True
    s = rows // h if "below" in case else -(-rows // h)  # at the bound: at least its bytes
    layout = "bshd" if case.startswith("bshd") else "sbhd"
    shape = (s, 1, h, d) if layout == "sbhd" else (1, s, h, d)
    if case.startswith("bshd q + k"):  # q 24 heads and k 8: the bytes of both
        shape, kw["k"] = (1, s, 24, d), _dense((1, s, 8, d), (0, 1, 2, 3), dtype, 1 << 45)
        kw["out_k"] = _dense((1, s, 8, d), (0, 1, 2, 3), dtype, 1 << 46)
    if case.startswith("explicit"):
        kw["positions"] = _dense((s,), (0,), "int32", 1 << 43)
    if "inplace" not in kw:
        kw["out"] = _dense(shape, (0, 1, 2, 3), dtype, 1 << 44)
    tab = _table(s, r // 2)
    call = check_call(_dense(shape, (0, 1, 2, 3), dtype), cos=tab, sin=tab, layout=layout,
                      interleaved=interleaved, rotary_dim=r, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    assert spec.early_tables == early
    b = lambda v: "true" if v else "false"  # noqa: E731
    assert spec.name_expression().endswith(f", {b(early)}, {b(spec.x_evict_last)}>")
    assert spec in launch.shipped_specs()  # compiled on CPU CI too
    monkeypatch.undo()
    assert not launch.choose_spec(call).early_tables  # the shipped bound: these calls are small


@pytest.mark.parametrize("case,evict_last", [
    ("sbhd", True), ("sbhd q + k", True), ("thd", True), ("bshd one batch entry", True),
    ("bshd two batch entries", False), ("in place", False), ("bfloat16", False),
    ("d96 NeoX (partner load)", False), ("d96 GPT-J", True), ("FLAT_X_EVICT_LAST off", False)])
def test_flat_kernel_x_evict_last_for_fp32_in_position_order(monkeypatch, case, evict_last):
    """fp32 calls out of place, full rotary, whose rows' positions never
    decrease through memory (no axis outside the sequence axis) load x with
    an L2 evict-last policy; a batch axis outside the sequence, in place,
    16-bit x and fp32 partner loads keep plain loads. Every such spec is
    shipped."""
    from cupy_rope.validate import check_call

    d, h, s, b, dtype, kw, layout, interleaved = 128, 8, 16, 2, "float32", {}, "sbhd", False
    if case == "FLAT_X_EVICT_LAST off":
        monkeypatch.setattr(launch, "FLAT_X_EVICT_LAST", False)
    if case == "bfloat16":
        dtype = "bfloat16"
    if case.startswith("d96"):
        d, interleaved = 96, "GPT-J" in case
    if case.startswith("thd"):
        layout, shape = "thd", (s, h, d)
    elif case.startswith("bshd"):
        layout, b = "bshd", 1 if "one" in case else 2
        shape = (b, s, h, d)
    else:
        shape = (s, b, h, d)
    if case == "sbhd q + k":
        kw["k"] = _dense((s, b, 2, d), (0, 1, 2, 3), dtype, 1 << 45)
        kw["out_k"] = _dense((s, b, 2, d), (0, 1, 2, 3), dtype, 1 << 46)
    order = tuple(range(len(shape)))
    if case == "in place":
        kw["inplace"] = True
    else:
        kw["out"] = _dense(shape, order, dtype, 1 << 44)
    tab = _table(s, d // 2)
    call = check_call(_dense(shape, order, dtype), cos=tab, sin=tab, layout=layout,
                      interleaved=interleaved, **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    assert spec.x_evict_last == evict_last
    assert spec.partner_load == (case == "d96 NeoX (partner load)")
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


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("k_heads", [0, 8])
def test_flat_kernel_slab_count(monkeypatch, exact, k_heads):
    """flat_kernel is compiled for the call's slab count (x alone: 1, q and
    k: 2), whose first block is 0; with FLAT_EXACT_SLABS off, for any count
    (0: each block picks its slab at run time)."""
    from cupy_rope.validate import check_call

    monkeypatch.setattr(launch, "FLAT_EXACT_SLABS", exact)
    b, s, h, d = 2, 16, 32, 128
    tab = _table(2 * s, d // 2)
    kw = {}
    if k_heads:
        kw = dict(k=_dense((b, s, k_heads, d), (0, 1, 2, 3), "bfloat16", 1 << 45),
                  out_k=_dense((b, s, k_heads, d), (0, 1, 2, 3), "bfloat16", 1 << 46))
    call = check_call(_dense((b, s, h, d), (0, 1, 2, 3), "bfloat16"), cos=tab, sin=tab,
                      out=_dense((b, s, h, d), (0, 1, 2, 3), "bfloat16", 1 << 44), **kw)
    spec = launch.choose_spec(call)
    assert spec.mapping == "flat"
    assert spec.slabs == ((2 if k_heads else 1) if exact else 0)
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
