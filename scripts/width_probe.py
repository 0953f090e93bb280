"""Plain copy kernels (one item per thread, no loop) moving 4, 8 or 16 bytes
per thread, 128 / 256-thread blocks, against cudaMemcpy of the same bytes:
does the access width per thread change the DRAM rate on this GPU?

    PYTHONPATH=. python scripts/width_probe.py"""
import cupy
import numpy as np

from quick_perf import time_us

SRC = r"""
template <typename V>
__global__ void copy_items(const V* __restrict__ a, V* __restrict__ b, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i];
}
template __global__ void copy_items<unsigned>(const unsigned*, unsigned*, unsigned);
template __global__ void copy_items<uint2>(const uint2*, uint2*, unsigned);
template __global__ void copy_items<uint4>(const uint4*, uint4*, unsigned);
"""
mod = cupy.RawModule(code=SRC, options=("-std=c++17",),
                     name_expressions=["copy_items<unsigned>", "copy_items<uint2>",
                                       "copy_items<uint4>"])

for nbytes in (100_663_296, 268_435_456):
    sets = [(cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)) for _ in range(3)]
    for a, _ in sets:
        a[:] = 1

    def memcpy(a, b):
        cupy.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)
    t_copy = min(time_us(memcpy, sets) for _ in range(2))
    res = []
    for width, name in ((4, "copy_items<unsigned>"), (8, "copy_items<uint2>"),
                        (16, "copy_items<uint4>")):
        k = mod.get_function(name)
        n = nbytes // width
        for threads in (128, 256):
            grid = (n + threads - 1) // threads
            t = min(time_us(lambda a, b: k((grid,), (threads,), (a, b, np.uint32(n))), sets)
                    for _ in range(2))
            res.append(f"{width}B/{threads}: {t:.1f} us ({t_copy / t:.3f})")
    print(f"{nbytes / 1e6:.0f} MB each way: memcpy {t_copy:.1f} us | " + " | ".join(res),
          flush=True)
    del sets
