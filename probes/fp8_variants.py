"""FP8 decode rows of the fused op under kernel variants (timing only; the
variants' values are wrong on purpose): KDIR=dir CAP=n python probes/fp8_variants.py"""
import dataclasses
import os
import sys
from pathlib import Path

from cupy_rope import kv_cache, specialize

if os.environ.get("KDIR"):
    specialize.KERNEL_DIR = Path(os.environ["KDIR"]).resolve()
    specialize.kernel_source.cache_clear()
CAP = int(os.environ.get("CAP", "0"))
_orig = kv_cache.choose_spec


def capped(cc, unroll):
    s = _orig(cc, unroll)
    if CAP and cc.call.tokens <= 64 and s.pairs > CAP:
        s = dataclasses.replace(s, pairs=CAP)
    return s


kv_cache.choose_spec = capped
from benchmarks import cache_bench  # noqa: E402

_prep = cache_bench._prepare
cache_bench._prepare = lambda ctx, torch: [r for r in _prep(ctx, torch) if r[0] == cache_bench.FUSED]
sys.exit(cache_bench.main(["--filter", "decode"] + sys.argv[1:]))
