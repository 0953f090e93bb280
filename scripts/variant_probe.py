"""Launch-policy and kernel variants on the benchmark's own inputs (or on
single-tensor shapes), alternating, with torch.compile in the same process
(GPU machine):

    PYTHONPATH=.:scripts python scripts/variant_probe.py WORKLOADS REPS VARIANT [VARIANT ...]

WORKLOADS: comma-separated cupy_rope.bench names, or LAYOUT:D0xD1xD2xD3 for
a single tensor of that shape (bf16, or LAYOUT:D0xD1xD2xD3:float32; out of
place, fp32 [P, r/2] tables, as the benchmark's sbhd rows); REPS: rounds (each round times every variant,
forward and backward, then torch.compile once); VARIANT: NAME:SETTING,...
with SETTING a cupy_rope.launch attribute ATTR=VALUE (ATTR[KEY]=VALUE sets a
dict's entry; FLAT_CARVEOUT exists with results/h100-2026-11-24/
flat-carveout.patch applied, FLAT_PER_THREAD with flat-per-thread.patch),
or D=MACRO+MACRO (-DMACRO or -DMACRO=VALUE for the kernels, as in
quick_perf.py --variants), e.g. c100:FLAT_CARVEOUT[4]=100 or
old:FLAT_EXACT_SLABS=0. Every attribute any variant names is restored
before each variant, and plans are remade (with flat-carveout.patch a plan
sets flat_kernel's carveout, a function attribute, when it is made).
Prints, per workload, each variant's forward / backward times (us, every
round) and the fraction of a same-run copy of its best round."""
import copy
import sys

from cupy_rope import bench, launch
from inputs_probe import each_workload
from quick_perf import parse_variant, set_policy, use_macros


def workload(name: str):
    """A cupy_rope.bench workload, or a single tensor of LAYOUT:D0xD1xD2xD3
    (bf16; LAYOUT:D0xD1xD2xD3:DTYPE for float32 or float16)."""
    if ":" not in name:
        return bench.select_workloads([name])[0]
    layout, dims, *dtype = name.split(":")
    dtype = dtype[0] if dtype else "bfloat16"
    shape = tuple(int(v) for v in dims.split("x"))
    return bench.Workload(name.replace(":", "-"), f"{dtype} {layout} {list(shape)}", "single",
                          layout, shape, dtype)


def main():
    workloads, reps = [workload(n) for n in sys.argv[1].split(",")], int(sys.argv[2])
    known = {w.name for w in bench.WORKLOADS}  # so that each_workload finds them by name
    bench.WORKLOADS.extend(w for w in workloads if w.name not in known)
    variants = [parse_variant(a) for a in sys.argv[3:]] or [("defaults", {})]
    variants = [(n, {a: v for a, v in s.items() if a != "D"},
                 tuple(filter(None, s.get("D", "").split("+")))) for n, s in variants]
    named = {a.split("[")[0] for _, settings, _ in variants for a in settings}
    defaults = {a: copy.copy(getattr(launch, a)) for a in named}

    def measure(w, t_copy, comp, ours, args):
        args_c, compiled = comp
        res = {n: ([], []) for n, _, _ in variants}
        comp_t = []
        for _ in range(reps):
            for n, settings, macros in variants:
                use_macros(macros)
                set_policy(settings, defaults)
                for b in (False, True):
                    res[n][b].append(bench.time_call(ours.call[b], args, 30, 5)[0] * 1e3)
            comp_t.append(bench.time_call(compiled, args_c, 30, 5)[0] * 1e3)
        use_macros(())
        set_policy({}, defaults)
        t = t_copy * 1e3
        parts = [f"{n} fwd {' '.join(f'{v:.1f}' for v in f)} ({t / min(f):.3f}) "
                 f"bwd {' '.join(f'{v:.1f}' for v in bw)} ({t / min(bw):.3f})"
                 for n, (f, bw) in res.items()]
        print(f"{w.name:26s} copy {t:.1f} | " + " | ".join(parts)
              + f" | compile {' '.join(f'{v:.1f}' for v in comp_t)} ({t / min(comp_t):.3f})",
              flush=True)

    each_workload([w.name for w in workloads], measure)


if __name__ == "__main__":
    main()
