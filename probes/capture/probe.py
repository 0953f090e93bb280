"""Does JAX working on the GPU in the same process invalidate a torch CUDA-graph
capture of cupy-rope's op in global capture mode? Run: python probe.py SCENARIO MODE"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch

import cupy_rope.torch as crt

scenario, mode = sys.argv[1], sys.argv[2]
if scenario == "jax":
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda a: (a * 2).sum())
    for _ in range(3):
        f(jnp.ones((1024, 1024))).block_until_ready()
DEV = "cuda"
d, rows = 64, 128
inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
th = torch.arange(rows, dtype=torch.float64)[:, None] * inv
cos, sin = th.cos().to(DEV, torch.float32), th.sin().to(DEV, torch.float32)
x = torch.zeros(2, 16, 4, 64, device=DEV, requires_grad=True)
g = torch.zeros(2, 16, 4, 64, device=DEV)
pos = torch.zeros(2, 16, device=DEV, dtype=torch.int64)


def step():
    y = crt.rope(x, cos=cos, sin=sin, positions=pos)
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), gx


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        step()
torch.cuda.current_stream().wait_stream(side)
ok = 0
for trial in range(20):
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            step()
        ok += 1
    except Exception as e:  # noqa: BLE001
        print(scenario, mode, "trial", trial, "FAILED:", str(e).splitlines()[0])
        break
print(scenario, mode, f"{ok}/20 captures ok")
