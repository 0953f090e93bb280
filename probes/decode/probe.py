"""PROBE (issue 32 decode): kernel variants x launch shapes x slot spread.
Run: PYTHONPATH=. python probes/decode/probe.py OUTDIR"""
import json, os, sys, time
from pathlib import Path
import numpy as np
import torch, cupy
from benchmarks import cache_bench as cb, harness
from cupy_rope import kv_cache, specialize

HERE = Path(__file__).resolve().parent
orig_shape = kv_cache.launch_shape


def set_kernels(name):
    specialize.KERNEL_DIR = HERE / name.split("-")[0]
    specialize.kernel_source.cache_clear()
    specialize._modules.clear()
    kv_cache.clear_plans()


def set_shape(lanes, bz, unroll=1, per_block=None):
    def shape(items, heads, tokens, sm_count):
        s = orig_shape(items, heads, tokens, sm_count)
        if s.unroll != 1 or lanes is None:
            return s
        z = max(1, min(bz, tokens))
        pb = per_block or lanes
        return kv_cache._Shape((-(-tokens // z), -(-heads // pb), 1), (items, lanes, z), unroll)
    kv_cache.launch_shape = shape
    kv_cache.clear_plans()


def measure(t, dtype, compact=False, device_scale=False):
    w = [x for x in cb.WORKLOADS if x.name == f"cache-decode-t{t}"][0]
    ctx = cb.make_context(w, dtype, torch)
    if compact:
        ctx = ctx._replace(slots=torch.arange(t, device="cuda", dtype=torch.int64) * 16)
    if device_scale and dtype != "bfloat16":
        ctx = ctx._replace(k_scale=torch.tensor(ctx.k_scale, device="cuda"),
                           v_scale=torch.tensor(ctx.v_scale, device="cuda"))
    sets = [cb.make_set(ctx, torch) for _ in range(3)]
    torch.cuda.synchronize()
    call = cb.fused_call(ctx)
    with harness.torch_stream(torch):
        err = cb.check(ctx, call, sets[0], torch)
        timed = harness.time_call(call, [(s,) for s in sets], 30, 5)
        g = cb.graph_us_per_call(call, sets[0], torch)
    del sets
    return err, timed.ms * 1e3, g


def empty_floor():
    k = cupy.RawKernel('extern "C" __global__ void e(){}', "e")
    def call(_):
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            k((1,), (32,), ())
    with harness.torch_stream(torch):
        return cb.graph_us_per_call(call, {}, torch)


def main(out):
    rows = []
    def run(kern, lanes, bz, unroll, pb, dtype, t, compact=False, device_scale=False):
        set_kernels(kern); set_shape(lanes, bz, unroll, pb)
        err, us, g = measure(t, dtype, compact, device_scale)
        r = dict(kern=kern, lanes=lanes, bz=bz, unroll=unroll, pb=pb, dtype=dtype, t=t, compact=compact, dev=device_scale, err=err, gpu=us, graph=g)
        rows.append(r)
        print(f"{kern:8s} L{lanes} z{bz} U{unroll} pb{pb} {dtype:14s} t{t:<3d} {'devscale' if device_scale else ('compact' if compact else 'spread ')} err {err:.3g} gpu {us:6.2f} graph {g:5.2f}", flush=True)
    print("empty kernel graph floor", empty_floor())
    D = ("bfloat16", "float8_e4m3fn")
    import dataclasses
    orig_choose = kv_cache.choose_spec
    def pairs_cap(cap):
        def choose(cc, unroll):
            spec = orig_choose(cc, unroll)
            return dataclasses.replace(spec, pairs=min(spec.pairs, cap)) if cap else spec
        kv_cache.choose_spec = choose
    for rep in range(3):
        for kern in ("kA", "kfinal"):
            for dt in D[1:]:
                for t in (1, 16, 64):
                    run(kern, None, None, 1, None, dt, t)
    pairs_cap(None)
    print("empty kernel graph floor", empty_floor())
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp/probe"))
