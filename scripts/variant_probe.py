"""Launch-policy variants on the benchmark's own inputs, alternating, with
torch.compile in the same process (GPU machine):

    PYTHONPATH=. python scripts/variant_probe.py WORKLOADS REPS VARIANT [VARIANT ...]

WORKLOADS: comma-separated cupy_rope.bench names; REPS: rounds (each round
times every variant, forward and backward, then torch.compile once);
VARIANT: NAME:ATTR=VALUE,... with cupy_rope.launch attributes (ATTR[KEY]=VALUE
sets a dict's entry; FLAT_CARVEOUT exists with
results/h100-2026-11-24/flat-carveout.patch applied, FLAT_PER_THREAD with
flat-per-thread.patch), e.g. c100:FLAT_CARVEOUT[4]=100. Every attribute any
variant names is restored before each variant, and plans are remade (with
flat-carveout.patch a plan sets flat_kernel's carveout, a function
attribute, when it is made). Prints, per workload,
each variant's forward / backward times (us, every round) and the fraction
of a same-run copy of its best round."""
import copy
import sys

from cupy_rope import bench, launch
from inputs_probe import each_workload
from quick_perf import parse_variant, set_policy


def main():
    names, reps = sys.argv[1], int(sys.argv[2])
    variants = [parse_variant(a) for a in sys.argv[3:]] or [("defaults", {})]
    named = {a.split("[")[0] for _, settings in variants for a in settings}
    defaults = {a: copy.copy(getattr(launch, a)) for a in named}

    def measure(w, t_copy, comp, ours, args):
        args_c, compiled = comp
        res = {n: ([], []) for n, _ in variants}
        comp_t = []
        for _ in range(reps):
            for n, settings in variants:
                set_policy(settings, defaults)
                for b in (False, True):
                    res[n][b].append(bench.time_call(ours.call[b], args, 30, 5)[0] * 1e3)
            comp_t.append(bench.time_call(compiled, args_c, 30, 5)[0] * 1e3)
        set_policy({}, defaults)
        t = t_copy * 1e3
        parts = [f"{n} fwd {' '.join(f'{v:.1f}' for v in f)} ({t / min(f):.3f}) "
                 f"bwd {' '.join(f'{v:.1f}' for v in bw)} ({t / min(bw):.3f})"
                 for n, (f, bw) in res.items()]
        print(f"{w.name:26s} copy {t:.1f} | " + " | ".join(parts)
              + f" | compile {' '.join(f'{v:.1f}' for v in comp_t)} ({t / min(comp_t):.3f})",
              flush=True)

    each_workload(names, measure)


if __name__ == "__main__":
    main()
