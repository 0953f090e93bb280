"""Quick GPU timings for kernel work: a few workloads vs a same-run copy,
and the host cost of a cached decode call. The full benchmark is
``python -m cupy_rope.bench``."""
import copy
import itertools
import statistics
import sys
import time

import cupy
import numpy as np

import cupy_rope

SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long c) { long long s = clock64(); while (clock64() - s < c) {} }
""", "spin")


def time_us(fn, sets, reps=30):
    for i in range(5):
        fn(*sets[i % len(sets)])
    ev = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    SPIN((1,), (1,), (np.int64(40e6),))
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(*sets[i % len(sets)])
        b.record()
    ev[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in ev) * 1e3


def copy_us(nbytes):
    bufs = [(cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)) for _ in range(3)]

    def run(src, dst):
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)
    return time_us(run, bufs)


def bf16():
    import ml_dtypes
    return cupy.dtype(ml_dtypes.bfloat16)


SHIPPED_NVRTC_OPTIONS = cupy_rope.specialize.NVRTC_OPTIONS


def use_macros(defines):
    """Compile the kernels from now on with -D``d`` for each ``d`` of
    ``defines`` (NAME or NAME=VALUE; none: as shipped); kernels and plans
    are made anew."""
    from cupy_rope import api, specialize
    specialize.NVRTC_OPTIONS = (*SHIPPED_NVRTC_OPTIONS, *[f"-D{d}" for d in defines])
    specialize._modules.clear()
    api.clear_plans()


def variant(unroll, min_blocks, lanes=32, varlen_tokens=None, threads=256, defines=()):
    from cupy_rope import launch
    launch.UNROLL = unroll
    launch.MAX_HEAD_LANES = lanes
    if varlen_tokens is not None:
        launch.VARLEN_MIN_TOKENS = launch.VARLEN_COMPUTED_MIN_TOKENS = varlen_tokens
    launch.THREADS_PER_BLOCK = threads
    use_macros((f"ROPE_MIN_BLOCKS_PER_SM={min_blocks}", *defines))


def parse_variant(arg):
    """NAME:ATTR=VALUE,... -> (NAME, {ATTR: VALUE}) (strings)."""
    name, _, rest = arg.partition(":")
    return name, dict(kv.partition("=")[::2] for kv in filter(None, rest.split(",")))


def set_policy(settings, defaults):
    """Restore ``defaults`` (cupy_rope.launch attributes), then set
    ``settings`` {ATTR or ATTR[KEY] (a dict's entry): integer}; plans are
    made anew."""
    from cupy_rope import api, launch
    for a, v in defaults.items():
        setattr(launch, a, copy.copy(v))
    for a, v in settings.items():
        if "[" in a:
            a, key = a.rstrip("]").split("[")
            getattr(launch, a)[int(key)] = int(v)
        else:
            setattr(launch, a, int(v))
    api.clear_plans()


def partial_floor(cos, sin, rnd, d=128):
    # In place, rotary 0.25 of d=128 bf16: 64 of every 256 bytes per head are
    # read and written. The floor of that access pattern: a kernel that
    # loads and stores those 16-byte vectors unchanged, vs the full rotation.
    x = rnd((1, 4096, 128, d))
    t_full = time_us(lambda a: cupy_rope.apply_rope(a, cos, sin, inplace=True), [(x,)])
    t_part = time_us(lambda a: cupy_rope.apply_rope(a, cos[:, :16], sin[:, :16],
                                                    rotary_dim=32, inplace=True), [(x,)])
    touch = cupy.RawKernel(r"""
    extern "C" __global__ void touch(uint4* x, long long n, int per_head, int head_vecs) {
      long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
      if (i >= n) return;
      long long a = (i / per_head) * head_vecs + i % per_head;
      uint4 v = x[a];
      v.x ^= 0x80008000u;  // flips two signs: a real read-modify-write
      x[a] = v;
    }""", "touch")

    def run_touch(a, per_head=4):
        n = a.size // 128 * per_head
        touch(((n + 255) // 256,), (256,), (a, np.int64(n), np.int32(per_head), np.int32(16)))
    t_touch = time_us(run_touch, [(x,)])
    for per_head in (2, 8, 16):
        t = time_us(lambda a: run_touch(a, per_head), [(x,)])
        print(f"touch kernel, {per_head * 16} of 256 bytes per head in place: {t:.1f} us")
    # Does the L2 fetch granularity (a device-wide limit; probe only) set the floor?
    rt = cupy.cuda.runtime
    limit = rt.cudaLimitMaxL2FetchGranularity
    default = rt.deviceGetLimit(limit)
    try:
        for g in (32, 64, 128):
            rt.deviceSetLimit(limit, g)
            got = rt.deviceGetLimit(limit)
            t4 = time_us(run_touch, [(x,)])
            tp = time_us(lambda a: cupy_rope.apply_rope(a, cos[:, :16], sin[:, :16],
                                                        rotary_dim=32, inplace=True), [(x,)])
            print(f"L2 fetch granularity {g} (reads back {got}): touch 64 of 256 B {t4:.1f} us, "
                  f"partial 0.25 {tp:.1f} us = {tp / t_full:.3f} of full")
    finally:
        rt.deviceSetLimit(limit, default)
    print(f"default L2 fetch granularity: {default}")
    t_copy = copy_us(x.nbytes // 4)
    print(f"partial 0.25 in place: {t_part:.1f} us = {t_part / t_full:.3f} of full "
          f"({t_full:.1f} us); touch-only kernel on the same bytes {t_touch:.1f} us = "
          f"{t_touch / t_full:.3f} of full; dense copy of as many bytes {t_copy:.1f} us")
    del x


def thd_probe():
    """thd T=65536 h32 d128 bf16 out of place: where does varlen lose against bshd?"""
    d, T = 128, 65536
    inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    th = cupy.arange(T + 8, dtype=cupy.float32)[:, None] * inv
    cos, sin = cupy.cos(th), cupy.sin(th)
    rnd = lambda shape: cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bf16())
    x = [rnd((T, 32, d)) for _ in range(2)]
    o = [cupy.empty_like(a) for a in x]
    sets = list(zip(x, o))
    t_copy = copy_us(x[0].nbytes)
    rows = []
    t = time_us(lambda a, b: cupy_rope.apply_rope(a[None], cos, sin, out=b[None]), sets)
    rows.append(("bshd [1,T,32,128] implied", t))
    rng = np.random.default_rng(0)
    for n in (1, 128, 2401, "2401 skewed"):
        if n == "2401 skewed":
            # log-normal lengths (sigma 2.5: 1 to ~13000 tokens): the
            # sequence of token t is often far from t * n / T
            lengths = np.random.default_rng(1).lognormal(0.0, 2.5, 2401)
            lengths = np.floor(lengths / lengths.sum() * (T - 2401)).astype(np.int64) + 1
            lengths[-1] += T - lengths.sum()
            cu_h = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            dev = np.abs(np.searchsorted(cu_h, np.arange(T), "right") - 1
                         - np.arange(T) * 2401 / T).max()
            print(f"skewed lengths {lengths.min()}..{lengths.max()}, "
                  f"max |sequence - t n / T| {dev:.0f}", flush=True)
        else:
            cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)) if n > 1 else []
            cu_h = np.concatenate([[0], cuts, [T]]).astype(np.int32)
        cu = cupy.asarray(cu_h)
        t = time_us(lambda a, b: cupy_rope.apply_rope(a, cos, sin, layout="thd", cu_seqlens=cu,
                                                      out=b), sets)
        rows.append((f"thd varlen n={n}", t))
        if n == "2401 skewed":
            continue
        pos = cupy.asarray(np.arange(T) - np.repeat(cu_h[:-1], np.diff(cu_h)), dtype=cupy.int32)
        t = time_us(lambda a, b: cupy_rope.apply_rope(a, cos, sin, layout="thd", positions=pos,
                                                      out=b), sets)
        rows.append((f"thd explicit positions n={n}", t))
        t = time_us(lambda a, b: cupy_rope.apply_rope(a, inv_freq=inv, layout="thd",
                                                      cu_seqlens=cu, out=b), sets)
        rows.append((f"thd varlen inv_freq n={n}", t))
    for name, t in rows:
        print(f"{name:40s} {t:9.1f} us  {t_copy / t:6.3f} of copy", flush=True)
    kernel_attributes()


def thd_shapes():
    """thd with 128 and 2401 packed sequences beyond the benchmark's [65536, 32, 128]
    NeoX row: GPT-J, 24 heads of 80, 8 heads, fp16; fp32 tables and inv_freq."""
    T = 65536
    rng = np.random.default_rng(0)
    cus = {n: cupy.asarray(np.concatenate([[0], np.sort(rng.choice(np.arange(1, T), n - 1,
                                                                    replace=False)), [T]])
                           .astype(np.int32)) for n in (128, 2401)}
    for heads, d, interleaved, dtype in ((32, 128, True, bf16()), (24, 80, False, bf16()),
                                         (24, 96, False, bf16()), (8, 128, False, bf16()),
                                         (32, 128, False, cupy.float16), (32, 64, False, bf16())):
        inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
        th = cupy.arange(T + 8, dtype=cupy.float32)[:, None] * inv
        cos, sin = cupy.cos(th), cupy.sin(th)
        x = [cupy.random.standard_normal((T, heads, d), dtype=cupy.float32).astype(dtype)
             for _ in range(2)]
        sets = list(zip(x, [cupy.empty_like(a) for a in x]))
        t_copy = copy_us(x[0].nbytes)
        name = f"thd [T, {heads}, {d}] {'GPT-J' if interleaved else 'NeoX'} {cupy.dtype(dtype).name}"
        for (n, cu), (src, kw) in itertools.product(
                cus.items(), (("tables", {"cos": cos, "sin": sin}), ("inv_freq", {"inv_freq": inv}))):
            t = time_us(lambda a, b: cupy_rope.apply_rope(a, layout="thd", cu_seqlens=cu, out=b,
                                                          interleaved=interleaved, **kw), sets)
            print(f"{name} n={n} {src:8s} {t:9.1f} us  {t_copy / t:6.3f} of copy", flush=True)


def kernel_attributes():
    """Registers and local memory (spills) of every kernel planned so far."""
    from cupy.cuda import driver
    from cupy_rope import api
    seen = set()
    for prepared in list(api._plans.values()):
        plan = prepared.plan
        if plan.kernel is None or plan.kernel in seen:
            continue
        seen.add(plan.kernel)
        regs = driver.funcGetAttribute(4, plan.kernel)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        local = driver.funcGetAttribute(3, plan.kernel)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
        sp = plan.spec
        print(f"  {sp.pos_mode:8s} {sp.source:8s} unroll={sp.unroll} pairs={sp.pairs} "
              f"grid={plan.grid[0]} block={plan.block}: {regs} registers, {local} B local",
              flush=True)


def small_probe():
    """Workloads of 30-130 us, where the grid's last partial wave shows."""
    rnd = lambda shape: cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bf16())
    d = 128
    inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    th = cupy.arange(8192, dtype=cupy.float32)[:, None] * inv
    cos, sin = cupy.cos(th), cupy.sin(th)
    rows = []
    for hd in (80, 96):
        sets = [(rnd((2, 4096, 24, hd)), rnd((2, 4096, 24, hd))) for _ in range(3)]
        sets = [s + (cupy.empty_like(s[0]), cupy.empty_like(s[1])) for s in sets]
        t_copy = copy_us(2 * sets[0][0].nbytes)
        cs, sn = cos[:, :hd // 2], sin[:, :hd // 2]
        t = time_us(lambda q, k, oq, ok: cupy_rope.apply_rope_qk(q, k, cs, sn, out_q=oq,
                                                                 out_k=ok), sets)
        rows.append((f"diffusion d{hd}", t, t_copy / t))
    sets = [(rnd((4, 4096, 32, d)), rnd((4, 4096, 8, d))) for _ in range(2)]
    sets = [s + (cupy.empty_like(s[0]), cupy.empty_like(s[1])) for s in sets]
    t_copy = copy_us(sets[0][0].nbytes + sets[0][1].nbytes)
    t = time_us(lambda q, k, oq, ok: cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=oq, out_k=ok),
                sets)
    rows.append(("prefill qk out=", t, t_copy / t))
    sets = [(rnd((4, 4096, 32, d)),) for _ in range(3)]
    t_copy = copy_us(sets[0][0].nbytes)
    t = time_us(lambda x: cupy_rope.apply_rope(x, cos, sin, inplace=True), sets)
    rows.append(("bshd [4,4096,32,128] in place", t, t_copy / t))
    sets = [(rnd((1, 4096, 128, d)), rnd((1, 4096, 128, d))) for _ in range(3)]
    t_copy = copy_us(sets[0][0].nbytes)
    t = time_us(lambda x, o: cupy_rope.apply_rope(x.transpose(1, 0, 2, 3), cos, sin,
                                                  out=o.transpose(1, 0, 2, 3), layout="sbhd"),
                sets)
    rows.append(("sbhd [4096,1,128,128]", t, t_copy / t))
    sets = [(rnd((4, 4096, 32, d)), rnd((4, 4096, 32, d))) for _ in range(3)]
    t_copy = copy_us(sets[0][0].nbytes)
    import ml_dtypes  # noqa: F401
    for name, kw in (("fp32 cos/sin", dict(cos=cos, sin=sin)),
                     ("bf16 cos/sin", dict(cos=cos.astype(bf16()), sin=sin.astype(bf16()))),
                     ("inv_freq", dict(inv_freq=inv))):
        t = time_us(lambda x, o: cupy_rope.apply_rope(x, out=o, **kw), sets)
        rows.append((f"bshd [4,4096,32,128] out= {name}", t, t_copy / t))
    for name, t, f in rows:
        print(f"{name:40s} {t:9.1f} us  {f:6.3f} of copy", flush=True)


def dims_sweep():
    """Every head_dim the card names, NeoX and GPT-J, bf16 (and fp16 / fp32 at
    d128), out of place and in place, on bshd [4, 4096, h, d] with h * d = 4096
    (134 MB each way in bf16), against a same-run copy. --dims-fp32: every
    head_dim in fp32 instead."""
    cases = [("bfloat16", d) for d in (64, 80, 96, 128, 256)] + [("float16", 128),
                                                                   ("float32", 128)]
    if "--dims-fp32" in sys.argv:
        cases = [("float32", d) for d in (64, 80, 96, 128, 256)]
    for dtype, d in cases:
        dt = bf16() if dtype == "bfloat16" else cupy.dtype(dtype)
        h = 4096 // d
        inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
        th = cupy.arange(4096, dtype=cupy.float32)[:, None] * inv
        cos, sin = cupy.cos(th), cupy.sin(th)
        sets = [(cupy.random.standard_normal((4, 4096, h, d), dtype=cupy.float32).astype(dt),
                 cupy.empty((4, 4096, h, d), dt)) for _ in range(2)]
        t_copy = copy_us(sets[0][0].nbytes)
        for inter in (False, True):
            t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o, interleaved=inter),
                        sets)
            ti = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, inplace=True,
                                                           interleaved=inter), sets)
            print(f"{dtype:8s} d{d:<3d} {'gptj' if inter else 'neox'}  out= {t:7.1f} us "
                  f"{t_copy / t:6.3f} of copy   in place {ti:7.1f} us {t_copy / ti:6.3f}",
                  flush=True)
        del sets


def placements():
    """bf16/fp16 bshd [4, 4096, h, d] out of place and in place against the
    same x with fp32 tables at six places in memory (allocated one after
    another, of different row counts): how much a kernel's speed depends on
    where the tables sit (bf16 d128 with 48 registers: 0.945-0.998 of copy)."""
    for dtype, d in (("bfloat16", 128), ("bfloat16", 64), ("bfloat16", 256), ("float16", 128)):
        dt = bf16() if dtype == "bfloat16" else cupy.dtype(dtype)
        h = 4096 // d
        sets = [(cupy.random.standard_normal((4, 4096, h, d), dtype=cupy.float32).astype(dt),
                 cupy.empty((4, 4096, h, d), dt)) for _ in range(2)]
        t_copy = copy_us(sets[0][0].nbytes)
        inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
        tables = []
        for rows in (4096, 70000, 4096, 8192, 16384, 4096):
            th = cupy.arange(rows, dtype=cupy.float32)[:, None] * inv
            tables.append((cupy.cos(th), cupy.sin(th)))
        for inter in (False, True):
            res = []
            for cos, sin in tables:
                t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o,
                                                              interleaved=inter), sets)
                ti = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, inplace=True,
                                                               interleaved=inter), sets)
                res.append(f"{t_copy / t:.3f}/{t_copy / ti:.3f}")
            print(f"{dtype:8s} d{d:<3d} {'gptj' if inter else 'neox'} (of copy, out=/in place): "
                  + " ".join(res), flush=True)
        del sets


def sources():
    """Angle sources (fp32 / bf16 tables, inv_freq, freqs) on packet_kernel ("pk")
    and rope_kernel ("rk"), out of place, over head counts (and a [b, h, s,
    d] array seen as bshd with an output of its order): where computed
    angles should leave packet_kernel (launch.COMPUTED_ANGLES_HEADS)."""
    from cupy_rope import api, launch
    d = 128
    rnd = lambda shape, dt=None: cupy.random.standard_normal(  # noqa: E731
        shape, dtype=cupy.float32).astype(dt or bf16())
    inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    th = cupy.arange(70000, dtype=cupy.float32)[:, None] * inv
    cos, sin = cupy.cos(th), cupy.sin(th)
    cos16, sin16 = cos.astype(bf16()), sin.astype(bf16())
    bhsd = lambda: rnd((4, 32, 4096, d)).transpose(0, 2, 1, 3)  # noqa: E731
    default_heads, default_packets = launch.COMPUTED_ANGLES_HEADS, launch.PACKET_KERNELS
    cases = [(s, lay, None, None) for s, lay in (
        ((4, 4096, 32, d), "bshd"), ((4096, 1, 128, d), "sbhd"), ((512, 32, 24, d), "sbhd"),
        ((2, 4096, 8, d), "bshd"), ((1, 65536, 4, d), "bshd"))]
    cases += [((128, 8192, 1, d), "sbhd", cupy.float32, None), (None, "bshd", None, bhsd)]
    for shape, layout, dt, make in cases:
        make = make or (lambda: rnd(shape, dt))
        sets = [(make(), make()) for _ in range(2)]
        t_copy = copy_us(sets[0][0].nbytes)
        res = []
        for name, kw in (("tables", dict(cos=cos, sin=sin)),
                         ("bf16_tables", dict(cos=cos16, sin=sin16)),
                         ("inv_freq", dict(inv_freq=inv)), ("freqs", dict(freqs=th))):
            if name == "bf16_tables" and dt == cupy.float32:
                continue  # tables are float32 or x's dtype
            for packets in (True, False):
                # "pk": packet_kernel at every head count (the launcher's own
                # choice sends computed angles for many heads to rope_kernel).
                launch.PACKET_KERNELS = packets
                launch.COMPUTED_ANGLES_HEADS = 1 << 30 if packets else default_heads
                api.clear_plans()
                t = time_us(lambda x, o: cupy_rope.apply_rope(x, out=o, layout=layout, **kw),
                            sets)
                res.append(f"{name}/{'pk' if packets else 'rk'} {t_copy / t:.3f}")
        what = "bhsd view" if shape is None else f"{layout} {list(shape)}"
        print(f"{what:24s}", " ".join(res), flush=True)
        del sets
    launch.PACKET_KERNELS, launch.COMPUTED_ANGLES_HEADS = default_packets, default_heads
    api.clear_plans()


def explicit():
    """Explicit positions on packet_kernel ("pk") and rope_kernel ("rk"), out
    of place, bf16: distinct positions per token (their table rows come from
    DRAM) and repeated ones (L2-resident rows), several head counts, GPT-J,
    d80, a bhsd view, a decode-sized call, and q + k prefill in place."""
    from cupy_rope import api, launch
    inv = lambda d: cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d),  # noqa: E731
                                 dtype=cupy.float32)
    rnd = lambda shape: cupy.random.standard_normal(  # noqa: E731
        shape, dtype=cupy.float32).astype(bf16())
    T = 65536
    default_rows, default_packets = launch.EXPLICIT_PACKET_ROWS, launch.PACKET_KERNELS

    def both_kernels(call, sets, t_copy):
        """"fl": the launcher's choice (flat_kernel where positions follow the
        sequence index alone); "pk": packet_kernel at every size (without
        flat_kernel the launcher sends explicit positions in large calls to
        rope_kernel); "rk": rope_kernel."""
        res = []
        for name in ("fl", "pk", "rk"):
            launch.FLAT_POSITIONS = name == "fl"
            launch.PACKET_KERNELS = name != "rk"
            launch.EXPLICIT_PACKET_ROWS = 1 << 62 if name == "pk" else default_rows
            api.clear_plans()
            t = time_us(call, sets)
            res.append(f"{name} {t:7.1f} us {t_copy / t:.3f}")
        launch.FLAT_POSITIONS = True
        return "  ".join(res)

    cu = np.sort(np.random.default_rng(0).choice(np.arange(1, T), 2400, replace=False))
    cu = np.concatenate([[0], cu, [T]])
    repeated = np.arange(T) - np.repeat(cu[:-1], np.diff(cu))
    cases = [("thd [T, 32, 128] distinct", (T, 32, 128), "thd", np.arange(T), False),
             ("thd [T, 32, 128] 2401 sequences", (T, 32, 128), "thd", repeated, False),
             ("thd [T, 8, 128] distinct", (T, 8, 128), "thd", np.arange(T), False),
             ("thd [T, 32, 128] distinct GPT-J", (T, 32, 128), "thd", np.arange(T), True),
             ("thd [T, 24, 80] distinct", (T, 24, 80), "thd", np.arange(T), False),
             ("thd [T, 32, 128] 2401 seqs GPT-J", (T, 32, 128), "thd", repeated, True),
             ("thd [T, 24, 80] 2401 sequences", (T, 24, 80), "thd", repeated, False),
             ("thd [4096, 32, 128] distinct", (4096, 32, 128), "thd", np.arange(4096), False),
             ("thd [1024, 32, 128] distinct", (1024, 32, 128), "thd", np.arange(1024), False),
             ("thd [256, 32, 128] distinct", (256, 32, 128), "thd", np.arange(256), False),
             ("bshd [4, 4096, 32, 128] arange", (4, 4096, 32, 128), "bshd",
              np.tile(np.arange(4096), (4, 1)), False),
             ("bshd [4, 4096, 32, 128] [s]", (4, 4096, 32, 128), "bshd",
              np.arange(4096) + 7, False),
             ("sbhd [4096, 1, 128, 128] [s]", (4096, 1, 128, 128), "sbhd",
              np.arange(4096)[::-1].copy(), False),
             ("thd [T, 32, 128] 2401 seqs in place", (T, 32, 128), "thd+", repeated, False),
             ("bhsd view [4, 4096, 32, 128] arange", (4, 32, 4096, 128), "bshd",
              np.tile(np.arange(4096), (4, 1)), False),
             ("thd [64, 32, 128] decode", (64, 32, 128), "thd",
              np.random.default_rng(1).integers(0, 8192, 64), False)]
    for name, shape, layout, pos_h, inter in cases:
        d = shape[-1]
        th = cupy.arange(70000, dtype=cupy.float32)[:, None] * inv(d)
        cos, sin = cupy.cos(th), cupy.sin(th)
        pos = cupy.asarray(pos_h, dtype=cupy.int32)
        # "bhsd view": [b, h, s, d] arrays seen as bshd, the output in x's order
        view = (lambda a: a.transpose(0, 2, 1, 3)) if name.startswith("bhsd") else (lambda a: a)
        sets = [(view(rnd(shape)), view(rnd(shape))) for _ in range(2)]
        if layout.endswith("+"):  # in place
            call = lambda x, o: cupy_rope.apply_rope(  # noqa: E731
                x, cos, sin, positions=pos, layout=layout[:-1], inplace=True)
        else:
            call = lambda x, o: cupy_rope.apply_rope(  # noqa: E731
                x, cos, sin, positions=pos, layout=layout, interleaved=inter, out=o)
        res = both_kernels(call, sets, copy_us(sets[0][0].nbytes))
        print(f"{name:34s}", res, flush=True)
        del sets
    # q + k in one launch, vLLM-style prefill: [tokens, h * d] views,
    # positions per token, a cos|sin cache [max_position, d]
    th = cupy.arange(70000, dtype=cupy.float32)[:, None] * inv(128)
    cache = cupy.concatenate([cupy.cos(th), cupy.sin(th)], axis=1)
    for name, pos_h in (("distinct", np.arange(16384)), ("4 x arange(4096)",
                                                         np.tile(np.arange(4096), 4))):
        pos = cupy.asarray(pos_h, dtype=cupy.int64)
        sets = [(rnd((16384, 32 * 128)), rnd((16384, 8 * 128))) for _ in range(2)]
        res = both_kernels(lambda q, k: cupy_rope.apply_rope_qk(
            q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=128,
            inplace=True), sets, copy_us(sum(a.nbytes for a in sets[0])))
        print(f"{'qk [16384, 32/8 x 128] ' + name:34s}", res, flush=True)
        del sets
    launch.PACKET_KERNELS, launch.EXPLICIT_PACKET_ROWS = default_packets, default_rows
    api.clear_plans()


def main(host=True):
    d = 128
    inv = cupy.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), dtype=cupy.float32)
    th = cupy.arange(70000, dtype=cupy.float32)[:, None] * inv
    cos, sin = cupy.cos(th), cupy.sin(th)
    rows = []
    # A probe flag runs that probe instead of the standard rows.
    probes = {"--thd-probe": thd_probe, "--thd-shapes": thd_shapes, "--small-probe": small_probe, "--dims": dims_sweep,
              "--placements": placements, "--sources": sources, "--explicit": explicit}
    asked = [fn for flag, fn in probes.items() if flag in sys.argv]
    for fn in asked:
        fn()
    if asked:
        return

    def rnd(shape):
        return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bf16())

    if "--partial-floor" in sys.argv:
        partial_floor(cos, sin, rnd)
        if "--only" in sys.argv:
            return

    # single tensor, the old reference point (0.98 of copy before the q/k rewrite)
    sets = [(rnd((1, 4096, 128, d)), rnd((1, 4096, 128, d))) for _ in range(2)]
    t_copy = copy_us(sets[0][0].nbytes)
    t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o), sets)
    rows.append(("bshd [1,4096,128,128] out=", t, t_copy / t))
    for shape, layout in (((4, 4096, 32, d), "bshd"), ((512, 32, 24, d), "sbhd")):
        sets = [(rnd(shape), rnd(shape)) for _ in range(2)]
        t_copy = copy_us(sets[0][0].nbytes)
        t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o, layout=layout), sets)
        rows.append((f"{layout} {list(shape)} out=", t, t_copy / t))
    sets = [(cupy.random.standard_normal((128, 8192, 1, d), dtype=cupy.float32),) * 2
            for _ in range(2)]
    sets = [(a, cupy.empty_like(a)) for a, _ in sets]
    t_copy = copy_us(sets[0][0].nbytes)
    t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o, layout="sbhd"), sets)
    rows.append(("fp32 sbhd [128,8192,1,128] out=", t, t_copy / t))
    del sets
    # Llama-3-8B prefill q32/k8, in place and out of place
    sets = [(rnd((4, 4096, 32, d)), rnd((4, 4096, 8, d))) for _ in range(2)]
    nbytes = sum(a.nbytes for a in sets[0])
    t_copy = copy_us(nbytes)
    t = time_us(lambda q, k: cupy_rope.apply_rope_qk(q, k, cos, sin, inplace=True), sets)
    rows.append(("prefill qk b4 s4096 32/8 inplace", t, t_copy / t))
    outs = [(cupy.empty_like(q), cupy.empty_like(k)) for q, k in sets]
    sets2 = [s + o for s, o in zip(sets, outs)]
    t = time_us(lambda q, k, oq, ok: cupy_rope.apply_rope_qk(q, k, cos, sin, out_q=oq, out_k=ok,
                                                               backward=True), sets2)
    rows.append(("prefill qk bwd out=", t, t_copy / t))
    del sets, sets2, outs
    # diffusion q24/k24 b2 s4096, d80 and d96, out of place
    for hd in (80, 96):
        sets = [(rnd((2, 4096, 24, hd)), rnd((2, 4096, 24, hd))) for _ in range(2)]
        outs = [(cupy.empty_like(q), cupy.empty_like(k)) for q, k in sets]
        sets2 = [s + o for s, o in zip(sets, outs)]
        t_copy = copy_us(sum(a.nbytes for a in sets[0]))
        cs, sn = cos[:, :hd // 2], sin[:, :hd // 2]
        for bwd in (False, True):
            t = time_us(lambda q, k, oq, ok: cupy_rope.apply_rope_qk(
                q, k, cs, sn, out_q=oq, out_k=ok, backward=bwd), sets2)
            rows.append((f"diffusion d{hd} bwd={bwd}", t, t_copy / t))
        del sets, sets2, outs
    # bshd [4,4096,32,128] in place: full and partial rotary; a strided (bhsd) view
    shape = (4, 4096, 32, d)
    sets = [(rnd(shape),) for _ in range(2)]
    t_copy = copy_us(sets[0][0].nbytes)
    t_full = None
    for r in (d, d // 2, d // 4):
        t = time_us(lambda x: cupy_rope.apply_rope(x, cos[:, :r // 2], sin[:, :r // 2],
                                                   rotary_dim=r, inplace=True), sets)
        t_full = t_full or t
        rows.append((f"in place rotary {r}/{d} ({t / t_full:.3f} of full)", t,
                     t_copy * r / d / t))
    bhsd_view = lambda: rnd((4, 32, 4096, d)).transpose(0, 2, 1, 3)  # noqa: E731
    for out_name, out in (("in x's order", bhsd_view), ("contiguous", lambda: rnd(shape))):
        sets = [(bhsd_view(), out()) for _ in range(2)]
        t = time_us(lambda x, o: cupy_rope.apply_rope(x, cos, sin, out=o), sets)
        rows.append((f"bshd view of bhsd, out= {out_name}", t, t_copy / t))
    del sets
    # thd T=65536 h32 across n_seqs
    T = 65536
    x = [rnd((T, 32, d)) for _ in range(2)]
    o = [cupy.empty_like(a) for a in x]
    t_copy = copy_us(x[0].nbytes)
    rng = np.random.default_rng(0)
    for n in (1, 128, 2401):
        cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)) if n > 1 else []
        cu = cupy.asarray(np.concatenate([[0], cuts, [T]]).astype(np.int32))
        for bwd in (False, True):
            t = time_us(lambda a, b: cupy_rope.apply_rope(a, cos, sin, layout="thd", cu_seqlens=cu,
                                                          out=b, backward=bwd), list(zip(x, o)))
            rows.append((f"thd n_seqs={n} bwd={bwd}", t, t_copy / t))
    del x, o
    for name, t, f in rows:
        print(f"{name:40s} {t:9.1f} us  {f:6.3f} of copy")

    if not host:
        return
    # host cost: decode q32/k8 64 tokens, in place, cos_sin_cache + positions
    for fw in ("cupy", "torch"):
        q = cupy.random.standard_normal((64, 32, d), dtype=cupy.float32).astype(cupy.float16)
        k = cupy.random.standard_normal((64, 8, d), dtype=cupy.float32).astype(cupy.float16)
        cache = cupy.concatenate([cos, sin], axis=1)[:8192].copy()
        pos = cupy.arange(64, dtype=cupy.int64) + 1000
        if fw == "torch":
            import torch
            q, k, cache, pos = (torch.from_dlpack(a) for a in (q, k, cache, pos))
        for _ in range(50):
            cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd",
                                    inplace=True)
        cupy.cuda.Device().synchronize()
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd",
                                    inplace=True)
        cupy.cuda.Device().synchronize()
        print(f"decode qk 64 tok {fw}: {(time.perf_counter() - t0) / n * 1e6:.2f} us per call "
              "end to end")
    # the same call with the launch itself stubbed out, and the bare launch
    from cupy_rope import api, launch
    key = next(k for k in api._plans if k[0] == "qk")
    plan = api._plans[key].plan
    real = launch.Plan.launch
    launch.Plan.launch = lambda self, ptrs, offset: None
    t0 = time.perf_counter()
    for _ in range(n):
        cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd",
                                inplace=True)
    print(f"  python path without the launch: {(time.perf_counter() - t0) / n * 1e6:.2f} us")
    launch.Plan.launch = real
    from cupy.cuda import driver
    stream = cupy.cuda.get_current_stream().ptr
    args = plan.own_buffer()[1]
    t0 = time.perf_counter()
    for _ in range(n):
        driver.launchKernel(plan.kernel, *plan.dims, 0, stream, args, 0)
    cupy.cuda.Device().synchronize()
    print(f"  bare driver.launchKernel: {(time.perf_counter() - t0) / n * 1e6:.2f} us")
    if "--profile" in sys.argv:
        import cProfile
        cProfile.runctx("for _ in range(2000): cupy_rope.apply_rope_qk(q, k, cos_sin_cache=cache, "
                        "positions=pos, layout='thd', inplace=True)", globals(), locals(),
                        sort="tottime")


if __name__ == "__main__":
    if "--variants" in sys.argv:
        # Launch-policy variants: NAME:ATTR=VALUE,ATTR=VALUE (cupy_rope.launch attributes,
        # ATTR[KEY]=VALUE for a dict's entry), e.g. base: up:LANES_ROUND_UP=1
        # small:SMALL_BLOCK_THREADS=128 (FLAT_PER_THREAD / FLAT_CARVEOUT: with
        # results/h100-2026-11-24/flat-per-thread.patch / flat-carveout.patch applied)
        from cupy_rope import launch
        defaults = {a: copy.copy(getattr(launch, a)) for a in ("LANES_ROUND_UP", "SMALL_BLOCK_THREADS",
                                                    "THREADS_PER_BLOCK", "MAX_HEAD_LANES",
                                                    "PACKET_KERNELS", "PACKET_THREADS",
                                                    "FLAT_KERNELS", "FLAT_PARTNER_LOAD_ALWAYS",
                                                    "FLAT_MAX_IDLE_LANES",
                                                    "VARLEN_FEW_SEQS", "VARLEN_MIN_TOKENS",
                                                    "VARLEN_COMPUTED_MIN_TOKENS", "VARLEN_COMPUTED_FEW_TOKENS",
                                                    "VARLEN_SMALL_BLOCKS",
                                                    "COMPUTED_ANGLES_HEADS",
                                                    "EXPLICIT_PACKET_ROWS", "FLAT_PER_THREAD",
                                                    "FLAT_CARVEOUT") if hasattr(launch, a)}
        for spec in sys.argv[sys.argv.index("--variants") + 1:]:
            name, settings = parse_variant(spec)
            rest = spec.partition(":")[2]
            # UNROLL and MINB (blocks per SM in __launch_bounds__) recompile the kernels.
            # D=NAME+NAME: preprocessor macros for the kernels.
            variant(int(settings.pop("UNROLL", 4)), int(settings.pop("MINB", 2)),
                    lanes=defaults["MAX_HEAD_LANES"],
                    defines=tuple(filter(None, settings.pop("D", "").split("+"))))
            set_policy(settings, defaults)
            print(f"== {name}: {rest or 'defaults'}", flush=True)
            main(host=False)
    elif "--sweep" in sys.argv:
        for unroll, mb, lanes, vt in ((4, 2, 32, 1), (4, 2, 32, 16), (4, 2, 8, 16),
                                      (4, 2, 2, 32), (2, 4, 8, 16), (2, 4, 2, 32)):
            variant(unroll, mb, lanes, vt)
            print(f"== UNROLL={unroll} MIN_BLOCKS_PER_SM={mb} MAX_HEAD_LANES={lanes} "
                  f"VARLEN_MIN_TOKENS={vt}", flush=True)
            main(host="--host" in sys.argv)
    else:
        main()
