"""PROBE (issue 32 decode): rope_cache_flat_kernel against rope_cache_kernel
on cache_bench's decode workloads. Run: PYTHONPATH=. python probes/flat/probe.py"""
import json, os, sys
from pathlib import Path
import torch
from benchmarks import cache_bench as cb, harness
from cupy_rope import kv_cache


def measure(t, dtype, device_scale=False):
    w = [x for x in cb.WORKLOADS if x.name == f"cache-decode-t{t}"][0]
    ctx = cb.make_context(w, dtype, torch)
    if device_scale and dtype != "bfloat16":
        ctx = ctx._replace(k_scale=torch.tensor(ctx.k_scale, device="cuda"),
                           v_scale=torch.tensor(ctx.v_scale, device="cuda"))
    sets = [cb.make_set(ctx, torch) for _ in range(3)]
    torch.cuda.synchronize()
    call = cb.fused_call(ctx)
    with harness.torch_stream(torch):
        copy_us = harness.copy_ms(w.copy_bytes(1 if dtype != "bfloat16" else 2), 3, 30) * 1e3
        err = cb.check(ctx, call, sets[0], torch)
        timed = harness.time_call(call, [(s,) for s in sets], 30, 5)
        g = cb.graph_us_per_call(call, sets[0], torch)
    return err, timed.ms * 1e3, g, copy_us


rows = []
for rep in range(3):
    for flat in (False, True):
        kv_cache.FLAT_DECODE = flat
        kv_cache.clear_plans()
        for dt in ("bfloat16", "float8_e4m3fn"):
            for t in (1, 16, 64):
                err, us, g, cp = measure(t, dt)
                rows.append(dict(flat=flat, dtype=dt, t=t, err=err, gpu=us, graph=g, copy=cp))
                print(f"flat={flat!s:5} {dt:14s} t{t:<3d} err {err:.3g} gpu {us:5.2f} "
                      f"graph {g:5.2f} copy {cp:5.2f}", flush=True)
for flat in (False, True):
    kv_cache.FLAT_DECODE = flat
    kv_cache.clear_plans()
    err, us, g, cp = measure(64, "float8_e4m3fn", True)
    print(f"flat={flat!s:5} devscale t64 err {err:.3g} gpu {us:5.2f} graph {g:5.2f}", flush=True)
out = Path(os.environ.get("OUT", "/tmp"))
(out / "flat_probe.json").write_text(json.dumps(rows, indent=1))
