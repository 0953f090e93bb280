"""Probe (deleted once answered): kernel variants by -D flags, current policy."""
import sys
from cupy_rope import specialize as sp, norm_launch as nl
from probes.sweep import setup, timeit

VARIANTS = {"base": [], "rsqrt": ["-DNR_RSQRT=1"], "rsqrt+noprefetch": ["-DNR_RSQRT=1", "-DNR_NO_PREFETCH=1"],
            "rsqrt+noforget": ["-DNR_RSQRT=1", "-DNR_NO_FORGET=1"]}
for name in ("qwen", "wan"):
    fwd, bwd, c2, c3 = setup(name)
    print(f"== {name}: copy2 {timeit(c2):.1f} copy3 {timeit(c3):.1f}", flush=True)
    for vn, flags in VARIANTS.items():
        sp.NVRTC_OPTIONS = ("-std=c++17", *flags)
        sp._modules.clear(); nl._plans.clear()
        tf, tb = timeit(fwd), timeit(bwd)
        print(f"{name} {vn}: fwd {tf:.1f} bwd {tb:.1f}", flush=True)
