"""PROBE: what a kernel's parameter block size costs per launch (decode-sized grids).
Run: PYTHONPATH=. python probes/params/probe.py"""
import ctypes
import torch, cupy
from benchmarks import harness
from cupy_rope import launch

SRC = r'''
template <int N> struct Blob { unsigned long long v[N]; };
template <int N> __global__ void k(const Blob<N> p) {
  if (threadIdx.x == 0 && p.v[0] == 12345ull) *reinterpret_cast<int*>(p.v[N - 1]) = 1;
}
'''
SIZES = [4, 40, 64, 101, 126, 184]
names = [f"k<{n}>" for n in SIZES]
mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
kern = {n: mod.get_function(f"k<{n}>").kernel.ptr for n in SIZES}
bufs = {}
for n in SIZES:
    b = ctypes.create_string_buffer(8 * n)
    bufs[n] = (b, (ctypes.c_void_p * 1)(ctypes.addressof(b)))


def call_for(n, grid):
    def call(_):
        stream = torch.cuda.current_stream().cuda_stream
        launch._launch_kernel(kern[n], grid, 1, 1, 128, 1, 1, 0, stream, ctypes.addressof(bufs[n][1]), 0)
    return call


with harness.torch_stream(torch):
    for rep in range(3):
        for grid in (3, 192):
            for n in SIZES:
                c = call_for(n, grid)
                g = harness.graph_us_per_call(c, ({},), torch, 100, 20)
                t = harness.time_call(c, [({},)] * 3, 30, 5)
                print(f"grid {grid:3d} params {8 * n:5d} B: graph {g:.2f} us/call, GPU {t.ms * 1e3:.2f} us", flush=True)
