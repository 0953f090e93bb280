"""Which v elements differ from torch's conversion with a subnormal scale (1e-40)?"""
import numpy as np
import torch

from cupy_rope import kv_cache

specials = np.array([0.0, -0.0, 1e-45, -3e-45, 1e-39, -1e-38, 1e-30, -1e-20, 3e38, -3.4e38,
                     np.inf, -np.inf, 1.0, -2.5, 31.0], np.float32)
t, hq, hk, d = 1, 4, 2, 128
for fmt in ("float8_e4m3fn",):
    v_h = np.zeros((t, hk, d), np.float32)
    v_h.reshape(-1)[:specials.size] = specials
    v = torch.from_numpy(v_h).cuda()
    q = torch.randn(t, hq, d, device="cuda")
    k = torch.randn(t, hk, d, device="cuda")
    inv = torch.from_numpy((1 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)).cuda()
    kc = torch.zeros((4, 16, hk, d), dtype=getattr(torch, fmt), device="cuda")
    vc = torch.zeros_like(kc)
    kv_cache.apply_rope_and_cache(q, k, v, kc, vc, torch.tensor([5], device="cuda"),
                                  inv_freq=inv, positions=torch.arange(t, device="cuda"),
                                  k_scale=1e-40, v_scale=1e-40)
    got = vc.view(torch.uint8)[0, 5].reshape(-1)[:specials.size].cpu().numpy()
    s = torch.tensor(1e-40, dtype=torch.float32, device="cuda")
    y = (v.float() / s).clamp(-448, 448)
    want = y.to(getattr(torch, fmt)).view(torch.uint8).reshape(-1)[:specials.size].cpu().numpy()
    yq = y.reshape(-1)[:specials.size].cpu().numpy()
    print("scale as float32 on device:", s.item(), "x/s torch:", yq)
    for x, g, w in zip(specials, got, want):
        print(f"{x!r:>12} kernel {g:#04x} torch {w:#04x} {'DIFF' if g != w else ''}")
