"""Explicit positions against cu_seqlens, and flat_kernel against the
kernels explicit positions took before (launch.FLAT_POSITIONS), on the
benchmark's own thd inputs, with torch.compile (which the benchmark hands
the same per-token positions) in the same process (GPU machine):

    PYTHONPATH=.:scripts python scripts/positions_probe.py [WORKLOADS] [REPS]

WORKLOADS: comma-separated thd workloads of cupy_rope.bench (default
thd-n1,thd-n128,thd-n2401). Per workload and round, forward times (us) of:
cupy-rope with cu_seqlens (the benchmark's call), with the positions
torch.compile gets on flat_kernel ("positions flat") and on the previous
kernels ("positions before", FLAT_POSITIONS off), and torch.compile; then
each one's fraction of a same-run copy for its best round."""
import sys

import cupy_rope as cr
from cupy_rope import api, bench, launch
from inputs_probe import each_workload
from quick_perf import use_macros


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "thd-n1,thd-n128,thd-n2401").split(",")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    # NAME:MACRO+MACRO: flat_kernel on the positions compiled with -DMACRO
    macro_variants = [(a.split(":")[0], tuple(a.split(":")[1].split("+"))) for a in sys.argv[3:]]

    def prepare(w, ctx, sets, env):
        ours = bench.prepare_ours(w, ctx, env)
        cos, sin, pos = ctx.cos_half, ctx.sin_half, ctx.positions
        args = [ours.make_args(s) for s in sets]
        with_pos = lambda x, out: cr.apply_rope(x, cos, sin, positions=pos,  # noqa: E731
                                                layout="thd", out=out)
        return ours.call[False], with_pos, args

    def run(w, t_copy, comp, cu_call, pos_call, args):
        args_c, compiled = comp
        res = {n: [] for n in ("cu_seqlens", "positions flat", "positions before",
                               *[m for m, _ in macro_variants], "compile")}
        for _ in range(reps):
            res["cu_seqlens"].append(bench.time_call(cu_call, args, 30, 5)[0] * 1e3)
            for name, flag in (("positions flat", True), ("positions before", False)):
                launch.FLAT_POSITIONS = flag
                api.clear_plans()
                res[name].append(bench.time_call(pos_call, args, 30, 5)[0] * 1e3)
            launch.FLAT_POSITIONS = True
            for name, macros in macro_variants:
                use_macros(macros)
                res[name].append(bench.time_call(pos_call, args, 30, 5)[0] * 1e3)
            use_macros(())
            res["compile"].append(bench.time_call(compiled, args_c, 30, 5)[0] * 1e3)
        t = t_copy * 1e3
        print(f"{w.name:12s} copy {t:.1f} | " + " | ".join(
            f"{n} {' '.join(f'{v:.1f}' for v in ts)} ({t / min(ts):.3f})"
            for n, ts in res.items()), flush=True)

    each_workload(names, run, prepare)


if __name__ == "__main__":
    main()
