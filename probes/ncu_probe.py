"""Probe (deleted once answered): the fused kernels under ncu."""
import sys
import numpy as np
import torch
import cupy_rope as cr

which = sys.argv[1]
dev = "cuda"
bf = torch.bfloat16


def tables(n, d):
    inv = 1.0 / (1e6 ** (np.arange(0, d, 2) / d))
    f = np.outer(np.arange(n), inv)
    return (torch.tensor(np.cos(f), dtype=torch.float32, device=dev),
            torch.tensor(np.sin(f), dtype=torch.float32, device=dev))


if which in ("qwen", "wan"):
    b, s, hq, hk, scope = (4, 4096, 32, 8, "head") if which == "qwen" else (1, 32760, 40, 40, "token")
    d = 128
    q = torch.randn(b, s, hq, d, device=dev, dtype=bf)
    k = torch.randn(b, s, hk, d, device=dev, dtype=bf)
    wl = d if scope == "head" else hq * d
    qw = torch.randn(wl, device=dev, dtype=bf)
    kw = torch.randn(wl if scope == "head" else hk * d, device=dev, dtype=bf)
    cos, sin = tables(s, d)
    kw_ = dict(norm_scope=scope, eps=1e-6)
    for _ in range(3):
        oq, ok = cr.apply_qk_norm_rope(q, k, qw, kw, cos, sin, **kw_)
    for _ in range(3):
        r = cr.apply_qk_norm_rope_backward(oq, ok, q, k, qw, kw, cos, sin, **kw_)
    torch.cuda.synchronize()
else:
    fp8 = which == "decode-fp8"
    t, hq, hk, d, bs, nb = 16, 32, 8, 128, 16, 4096
    q = torch.randn(t, hq, d, device=dev, dtype=bf)
    k = torch.randn(t, hk, d, device=dev, dtype=bf)
    v = torch.randn(t, hk, d, device=dev, dtype=bf)
    cdt = torch.float8_e4m3fn if fp8 else bf
    kc = torch.zeros(nb, bs, hk, d, device=dev, dtype=cdt)
    vc = torch.zeros(nb, bs, hk, d, device=dev, dtype=cdt)
    slots = torch.randperm(nb * bs, device=dev)[:t].to(torch.int64)
    pos = torch.randint(0, 8000, (t,), device=dev)
    cos, sin = tables(8192, d)
    extra = dict(k_scale=0.05, v_scale=0.04) if fp8 else {}
    for _ in range(5):
        cr.apply_rope_and_cache(q, k, v, kc, vc, slots, cos, sin, positions=pos, inplace=True, **extra)
    torch.cuda.synchronize()
print("ok", which)
