"""What the benchmark hands each side, varied one thing at a time, against
torch.compile in the same process (each timed twice, A/B):

    python scripts/inputs_probe.py --tables  [workloads]
    python scripts/inputs_probe.py --outputs [workloads]

--tables: cupy-rope with its float32 [P, r/2] tables, with the peers' own
[P, r] tables in x's dtype (the first half viewed, no copy), and with
contiguous [P, r/2] tables in x's dtype. --outputs: cupy-rope writing into
out= rotating with the input sets (the benchmark's form), into one fixed
out=, or into a new output per call (the caching allocator hands back the
same block, as for torch.compile's result). Workloads: comma-separated
names from cupy_rope.bench (default: the single-tensor and thd rows)."""
import dataclasses
import sys

import torch

import cupy_rope as cr
from cupy_rope import bench, peers


def table_impls(w, ctx, sets, env):
    r = w.rotary_dim
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32}[w.dtype]
    full_c, full_s = peers.full_tables(ctx, dt)
    variants = {
        "fp32 tables": ctx,
        "peer tables": dataclasses.replace(ctx, cos_half=full_c[:, : r // 2],
                                           sin_half=full_s[:, : r // 2]),
        "x-dtype tables": dataclasses.replace(ctx, cos_half=ctx.cos_half.to(dt).contiguous(),
                                              sin_half=ctx.sin_half.to(dt).contiguous())}
    out = {}
    for name, c in variants.items():
        p = bench.prepare_ours(w, c, env)
        out[name] = ([p.make_args(s) for s in sets], p.call[False])
    return out


def output_impls(w, ctx, sets, env):
    cos, sin = ctx.cos_half, ctx.sin_half
    kw = {"layout": w.layout, "rotary_dim": w.rotary_dim, "interleaved": w.interleaved}
    if w.kind == "thd":
        kw["cu_seqlens"] = ctx.cu_seqlens
    fixed = sets[0]["out"]
    call = lambda x, o: cr.apply_rope(x, cos, sin, out=o, **kw)  # noqa: E731
    return {"out= rotating": ([(s["x"], s["out"]) for s in sets], call),
            "out= fixed": ([(s["x"], fixed) for s in sets], call),
            "new output": ([(s["x"],) for s in sets],
                           lambda x: cr.apply_rope(x, cos, sin, **kw))}


def workload_inputs(w, env, comp):
    """A benchmark workload's context, 3 input sets, the same-run copy time
    (ms) and torch.compile's (argument sets, forward call) on them."""
    ctx = bench.make_context(w, env)
    sets = [bench.make_set(w, env) for _ in range(3)]
    t_copy = bench.copy_ms(w.copy_bytes(), 3, 30)
    p = comp.prepare(w, ctx)
    return ctx, sets, t_copy, ([p.make_args(s) for s in sets], p.call[False])


def _ours(w, ctx, sets, env):
    """cupy-rope's Prepared for a workload and its argument sets."""
    ours = bench.prepare_ours(w, ctx, env)
    return ours, [ours.make_args(s) for s in sets]


def each_workload(names, run, prepare=_ours):
    """``run(workload, copy time ms, (torch.compile's argument sets, its
    forward call), *prepare(workload, context, input sets, env))`` for each
    named benchmark workload, on the benchmark's own inputs (by default
    ``prepare`` gives cupy-rope's Prepared and its argument sets); each
    workload's arrays are freed before the next one's are made."""
    env = bench._Env()
    comp = peers.TorchCompile()
    comp.available()  # also raises torch.compile's recompile limits: one graph per shape
    for w in bench.select_workloads(names):
        ctx, sets, t_copy, compiled = workload_inputs(w, env, comp)
        made = prepare(w, ctx, sets, env)
        run(w, t_copy, compiled, *made)
        del ctx, sets, compiled, made
        env.sync()
        env.free()


def main():
    make = table_impls if "--tables" in sys.argv else output_impls
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    names = names[0].split(",") if names else [
        w.name for w in bench.WORKLOADS if w.kind in ("single", "thd")
        and w.mode != "inplace"]

    def measure(w, t_copy, compiled, impls):
        impls["compile"] = compiled
        res = {k: [] for k in impls}
        for _ in range(2):
            for k, (args, fn) in impls.items():
                res[k].append(bench.time_call(fn, args, 30, 5)[0])
        line = " | ".join(f"{k} {' '.join(f'{t * 1e3:.1f}' for t in v)} "
                          f"({t_copy / min(v):.3f})" for k, v in res.items())
        print(f"{w.name:28s} copy {t_copy * 1e3:.1f}: {line}", flush=True)

    each_workload(names, measure, lambda w, ctx, sets, env: (make(w, ctx, sets, env),))


if __name__ == "__main__":
    main()
