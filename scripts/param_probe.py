"""Does the size of a kernel's parameter block cost time per launch? The
lean kernel C of scripts/lean_probe.py with its 6 arguments, and the same
kernel with a 1472-byte struct argument appended (rope::Params was 952
bytes before flat_kernel got its own 304-byte FlatParams),
on the same arrays; plus empty kernels with small and large parameters
timed back to back.

    PYTHONPATH=. python scripts/param_probe.py"""
import numpy as np

import cupy

from lean_probe import SRC, bf16, tables, time_us

BIG = SRC + r"""
struct Big { long long v[184]; };
extern "C" __global__ void __launch_bounds__(128) lean_c_big(const u16* x, u16* o, const float* cs,
    const float* sn, unsigned heads, unsigned n, const Big big) {
  lean_c_body(x, o, cs, sn, heads, n + (unsigned)big.v[183]);
}
extern "C" __global__ void empty_small(long long a) {}
extern "C" __global__ void empty_big(const Big big) {}
"""


def main():
    mod = cupy.RawModule(code=BIG, options=("-std=c++17",))
    d = 128
    cos, sin = tables(d)
    big = np.zeros(184, np.int64)
    big_arg = np.void(big.tobytes())
    for T, H in ((16384, 24), (16384, 32), (1024, 32), (64, 32)):
        sets = [(cupy.random.standard_normal((T, H, d), dtype=cupy.float32).astype(bf16()),
                 cupy.empty((T, H, d), dtype=bf16())) for _ in range(3)]
        n = T * H * d // 8
        grid = ((n + 127) // 128,)
        small = mod.get_function("lean_c")
        large = mod.get_function("lean_c_big")
        res = []
        for rep in range(2):
            ts = time_us(lambda x, o: small(grid, (128,), (x, o, cos, sin, np.uint32(H),
                                                           np.uint32(n))), sets)
            tb = time_us(lambda x, o: large(grid, (128,), (x, o, cos, sin, np.uint32(H),
                                                           np.uint32(n), big_arg)), sets)
            res.append(f"small {ts:.2f} / 1.5 KB {tb:.2f} us")
        print(f"lean C [{T}, {H}, 128]: " + " | ".join(res), flush=True)
    es, eb = mod.get_function("empty_small"), mod.get_function("empty_big")
    for rep in range(2):
        ts = time_us(lambda: es((1,), (32,), (np.int64(0),)), [()])
        tb = time_us(lambda: eb((1,), (32,), (big_arg,)), [()])
        print(f"empty kernel: 8-byte params {ts:.2f} us, 1.5 KB params {tb:.2f} us")


if __name__ == "__main__":
    main()
