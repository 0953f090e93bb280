"""cupy-rope's kernel and torch.compile's on one shape, for Nsight Compute:

    ncu --clock-control none --launch-skip 6 --launch-count 2 \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,... \
        python scripts/ncu_compare.py sbhd

The last two launches are ours then compile's (table in x's dtype, as the
benchmark's peer uses)."""
import sys

import torch

import cupy_rope

shape = {"sbhd": (4096, 1, 128, 128), "bshd": (4, 4096, 32, 128),
         "sbhd24": (512, 32, 24, 128)}[sys.argv[1]]
layout = sys.argv[1][:4]
d = shape[-1]
s_len = shape[0] if layout == "sbhd" else shape[1]
inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
th = torch.arange(s_len, device="cuda", dtype=torch.float32)[:, None] * inv
cos, sin = th.cos(), th.sin()
x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
o = torch.empty_like(x)
full_c = torch.cat((cos, cos), -1).to(torch.bfloat16)
full_s = torch.cat((sin, sin), -1).to(torch.bfloat16)
view = (s_len, 1, 1, d) if layout == "sbhd" else (1, s_len, 1, d)
full_c, full_s = full_c.view(view), full_s.view(view)


def formula(x, c, s):
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


f = torch.compile(formula, dynamic=False)
for _ in range(3):
    f(x, full_c, full_s)
torch.cuda.synchronize()
for _ in range(3):  # launches 1..3 of ours after compile's warm-up (not counted by ncu's skip)
    cupy_rope.apply_rope(x, cos, sin, out=o, layout=layout)
torch.cuda.synchronize()
cupy_rope.apply_rope(x, cos, sin, out=o, layout=layout)
f(x, full_c, full_s)
torch.cuda.synchronize()
