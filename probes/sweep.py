"""Probe (deleted once answered): norm_launch POLICY sweep, bf16, H100."""
import itertools, statistics, sys, dataclasses
import numpy as np
import torch
import cupy
import cupy_rope as cr
from cupy_rope import norm_launch as nl
from cupy_rope.specialize import get_kernel

dev = "cuda"; bf = torch.bfloat16


def tables(n, d):
    inv = 1.0 / (1e6 ** (np.arange(0, d, 2) / d))
    f = np.outer(np.arange(n), inv)
    return (torch.tensor(np.cos(f), dtype=torch.float32, device=dev),
            torch.tensor(np.sin(f), dtype=torch.float32, device=dev))


def timeit(fn, reps=25):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 100)
    return statistics.median(ts)


def setup(name):
    b, s, hq, hk, scope = (4, 4096, 32, 8, "head") if name == "qwen" else (1, 32760, 40, 40, "token")
    d = 128
    q = torch.randn(b, s, hq, d, device=dev, dtype=bf)
    k = torch.randn(b, s, hk, d, device=dev, dtype=bf)
    wl = d if scope == "head" else hq * d
    qw = torch.randn(wl, device=dev, dtype=bf) * 0.1 + 1
    kw = torch.randn(d if scope == "head" else hk * d, device=dev, dtype=bf) * 0.1 + 1
    cos, sin = tables(s, d)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    oq, ok = torch.empty_like(q), torch.empty_like(k)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    kw_ = dict(norm_scope=scope, eps=1e-6)
    fwd = lambda: cr.apply_qk_norm_rope(q, k, qw, kw, cos, sin, out_q=oq, out_k=ok, **kw_)
    bwd = lambda: cr.apply_qk_norm_rope_backward(gq, gk, q, k, qw, kw, cos, sin, out_q=dq, out_k=dk, **kw_)
    nbytes = (q.numel() + k.numel()) * 2
    src = torch.empty(nbytes // 2 * 3 // 2, dtype=bf, device=dev)
    dst = torch.empty_like(src)
    c2 = lambda: dst[: nbytes // 2].copy_(src[: nbytes // 2])
    c3 = lambda: dst.copy_(src)
    return fwd, bwd, c2, c3


def regs():
    out = []
    for key, p in list(nl._plans.items()):
        k = get_kernel(p.spec, 0)
        r = cupy.cuda.driver.funcGetAttribute(4, k.ptr)
        loc = cupy.cuda.driver.funcGetAttribute(3, k.ptr)
        out.append(f"r{r}l{loc}")
    return ",".join(out)


def main(which):
  base = nl.POLICY
  for name in ("qwen", "wan"):
      fwd, bwd, c2, c3 = setup(name)
      copy2, copy3 = timeit(c2), timeit(c3)
      print(f"== {name}: copy2 {copy2:.1f} copy3 {copy3:.1f}", flush=True)
      if which == "fwd":
          grid = itertools.product((4, 8), (2, 3, 4), (0, 1, 2), (16, 32, 64))
          for mp, mb, m, pf in grid:
              if name == "wan" and pf != 64: continue
              if name == "qwen" and pf == 64 and mp == 4: continue
              if mp == 8 and mb == 4: continue
              per = mb * m
              nl.POLICY = dataclasses.replace(base, min_blocks=(mb, base.min_blocks[1]), forward_blocks_per_sm=per,
                                              pass_floats=(pf, base.pass_floats[1]), max_pairs=(mp, 8))
              nl._plans.clear()
              try:
                  t = timeit(fwd)
                  print(f"fwd {name} mp{mp} mb{mb} per{per} pf{pf}: {t:.1f} us  {copy2 / t:.3f}  {regs()}", flush=True)
                  if name == "wan":
                      for tu in (2, 3, 4, 5, 6):
                          nl.POLICY = dataclasses.replace(nl.POLICY, min_token_unroll=tu); nl._plans.clear()
                          t = timeit(fwd)
                          print(f"fwd {name} mp{mp} mb{mb} per{per} tu{tu}: {t:.1f} us  {copy2 / t:.3f}  {regs()}", flush=True)
              except Exception as e:
                  print("ERR", mb, per, pf, repr(e)[:200])
      else:
          grid = itertools.product((2, 4, 8), (2, 3), (1, 2), (8, 16, 32))
          for mp, mb, m, pf in grid:
              if name == "wan" and pf != 16: continue
              per = mb * m
              nl.POLICY = dataclasses.replace(base, min_blocks=(base.min_blocks[0], mb), backward_blocks_per_sm=per,
                                              pass_floats=(base.pass_floats[0], pf), max_pairs=(8, mp))
              nl._plans.clear()
              try:
                  t = timeit(bwd)
                  print(f"bwd {name} mp{mp} mb{mb} per{per} pf{pf}: {t:.1f} us  {copy3 / t:.3f}  {regs()}", flush=True)
              except Exception as e:
                  print("ERR", mb, per, pf, repr(e)[:200])


if __name__ == "__main__":
    main(sys.argv[1])
