"""cupy-rope (optionally several kernel variants) and torch.compile on
benchmark-style single-tensor workloads of shapes given on the command line,
alternating in one process (GPU machine):

    PYTHONPATH=.:scripts python scripts/shape_probe.py PASSES SHAPE [SHAPE ...] \
        [--variant NAME:SETTING+SETTING ...]

SHAPE: LAYOUT:D0xD1xD2xD3 (bf16, out of place, fp32 [P, r/2] tables, as the
benchmark's sbhd rows) or the name of a cupy_rope.bench workload, e.g.
``2 sbhd:512x32x24x128 bshd-gptj --variant partner:FLAT_PARTNER_LOAD_ALWAYS=1``.
A variant's settings are cupy_rope.launch attributes (ATTR=VALUE, an
integer) or macros the kernels are compiled with (MACRO or -DMACRO=VALUE); the
variant "base", the shipped policy, is always timed first. Prints, per shape, each
side's forward times (us, every pass) and the fraction of the same-run copy
of its best pass."""
import copy
import sys

import torch

from cupy_rope import bench, launch, specialize
from inputs_probe import each_workload
from quick_perf import set_policy


def workload(spec: str):
    if ":" not in spec:
        return bench.select_workloads([spec])[0]
    layout, dims = spec.split(":")
    shape = tuple(int(v) for v in dims.split("x"))
    return bench.Workload(f"{layout}-{dims}", f"bf16 {layout} {list(shape)}", "single",
                          layout, shape)


def use(settings, defaults):
    """Compile with the settings' macros and set their launch attributes
    (the others back to ``defaults``)."""
    macros = [d if d.startswith("-D") else f"-D{d}" for d in settings if not is_attr(d)]
    specialize.NVRTC_OPTIONS = ("-std=c++17", *macros)
    specialize._modules.clear()
    set_policy(dict(d.split("=") for d in settings if is_attr(d)), defaults)


def is_attr(setting):
    return "=" in setting and not setting.startswith("-D")


def main():
    args = sys.argv[1:]
    variants = [("base", ())]
    while "--variant" in args:
        i = args.index("--variant")
        name, _, macros = args[i + 1].partition(":")
        variants.append((name, tuple(filter(None, macros.split("+")))))
        del args[i:i + 2]
    passes, workloads = int(args[0]), [workload(s) for s in args[1:]]
    named = {d.split("=")[0] for _, settings in variants for d in settings if is_attr(d)}
    defaults = {a: copy.copy(getattr(launch, a)) for a in named}
    known = {w.name for w in bench.WORKLOADS}  # so that each_workload finds them by name
    bench.WORKLOADS.extend(w for w in workloads if w.name not in known)
    torch._dynamo.config.recompile_limit = 256  # torch.compile, one graph per shape

    def measure(w, t_copy, compiled, ours, ours_args):
        times = {n: [] for n, _ in variants}
        times["compile"] = []
        for _ in range(passes):
            for n, settings in variants:
                use(settings, defaults)
                times[n].append(bench.time_call(ours.call[False], ours_args, 30, 5)[0] * 1e3)
            times["compile"].append(bench.time_call(compiled[1], compiled[0], 30, 5)[0] * 1e3)
        use((), defaults)
        t = t_copy * 1e3
        print(f"{w.name:24s} copy {t:6.1f} | " + " | ".join(
            f"{n} {' '.join(f'{v:.2f}' for v in ts)} ({t / min(ts):.4f})"
            for n, ts in times.items()), flush=True)

    each_workload([w.name for w in workloads], measure)  # (bench.WORKLOADS' order)


if __name__ == "__main__":
    main()
