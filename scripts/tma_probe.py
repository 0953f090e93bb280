"""Bulk-copy (TMA, cp.async.bulk) experiment for dense rows (GPU machine, sm_90):

    PYTHONPATH=.:scripts python scripts/tma_probe.py [REPS]

A block streams tiles of whole head rows global -> shared with
cp.async.bulk (one mbarrier per stage), rotates them in shared memory (NeoX,
d = 128, fp32 cos / sin tables [S, 64], position = row / rows_per_position),
and writes each tile back with a bulk store. Timed against cudaMemcpy of the
same bytes and cupy_rope.apply_rope on the same arrays, alternating in one
process; the copy-only variant (no rotation) shows what the bulk path moves.
"""
import sys

import cupy
import numpy as np

import cupy_rope
from cupy_rope import bench

SOURCE = r"""
typedef unsigned short bf16_t;

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void bar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred p;\n"
        "W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra W;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ float bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned bf_round(float f) {
    unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ unsigned bf_pack(float lo, float hi) {
    return bf_round(lo) | (bf_round(hi) << 16);
}

// One 16-byte pair (x1 = first half, x2 = second half) rotated in shared memory.
template <typename T>
__device__ __forceinline__ void rotate_pair(uint4* a, uint4* b, const float* c, const float* s);

template <>
__device__ __forceinline__ void rotate_pair<bf16_t>(uint4* a, uint4* b, const float* c,
                                                    const float* s) {
    uint4 x1 = *a, x2 = *b;
    float4 c0 = reinterpret_cast<const float4*>(c)[0], c1 = reinterpret_cast<const float4*>(c)[1];
    float4 s0 = reinterpret_cast<const float4*>(s)[0], s1 = reinterpret_cast<const float4*>(s)[1];
    float cc[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    float ss[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    unsigned w1[4] = {x1.x, x1.y, x1.z, x1.w}, w2[4] = {x2.x, x2.y, x2.z, x2.w};
    unsigned o1[4], o2[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float a0 = bf_lo(w1[i]), a1 = bf_hi(w1[i]), b0 = bf_lo(w2[i]), b1 = bf_hi(w2[i]);
        float C0 = cc[2 * i], C1 = cc[2 * i + 1], S0 = ss[2 * i], S1 = ss[2 * i + 1];
        o1[i] = bf_pack(a0 * C0 - b0 * S0, a1 * C1 - b1 * S1);
        o2[i] = bf_pack(b0 * C0 + a0 * S0, b1 * C1 + a1 * S1);
    }
    *a = make_uint4(o1[0], o1[1], o1[2], o1[3]);
    *b = make_uint4(o2[0], o2[1], o2[2], o2[3]);
}

template <>
__device__ __forceinline__ void rotate_pair<float>(uint4* a, uint4* b, const float* c,
                                                   const float* s) {
    float4 x1 = *reinterpret_cast<float4*>(a), x2 = *reinterpret_cast<float4*>(b);
    float4 C = *reinterpret_cast<const float4*>(c), S = *reinterpret_cast<const float4*>(s);
    *reinterpret_cast<float4*>(a) = make_float4(x1.x * C.x - x2.x * S.x, x1.y * C.y - x2.y * S.y,
                                                x1.z * C.z - x2.z * S.z, x1.w * C.w - x2.w * S.w);
    *reinterpret_cast<float4*>(b) = make_float4(x2.x * C.x + x1.x * S.x, x2.y * C.y + x1.y * S.y,
                                                x2.z * C.z + x1.z * S.z, x2.w * C.w + x1.w * S.w);
}

// Rows of D = 128 elements; TILE_ROWS rows a tile, STAGES tiles in flight a
// block, TILES tiles a block (grid = tiles / TILES). ROTATE = false: copy.
template <typename T, int TILE_ROWS, int STAGES, int TILES, bool ROTATE>
__global__ void __launch_bounds__(256) bulk_rope(const T* __restrict__ x, T* __restrict__ out,
        const float* __restrict__ cos, const float* __restrict__ sin,
        long long n_rows, long long rows_per_position) {
    constexpr int D = 128;
    constexpr int ROW_BYTES = D * sizeof(T);
    constexpr int TILE_BYTES = TILE_ROWS * ROW_BYTES;
    constexpr int HALF_PACKETS = ROW_BYTES / 32;          // 16-byte packets in half a row
    constexpr int PER_PACKET = 16 / sizeof(T);            // elements in a packet
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[STAGES];
    const int tid = threadIdx.x;
    const long long first_tile = (long long)blockIdx.x * TILES;
    const long long n_tiles_all = (n_rows + TILE_ROWS - 1) / TILE_ROWS;
    const int n = (int)min((long long)TILES, n_tiles_all - first_tile);
    auto tile_bytes = [&](int k) -> unsigned {
        long long r0 = (first_tile + k) * TILE_ROWS;
        long long rows = min((long long)TILE_ROWS, n_rows - r0);
        return (unsigned)(rows * ROW_BYTES);
    };
    auto src = [&](int k) { return reinterpret_cast<const unsigned char*>(x) + (first_tile + k) * (long long)TILE_BYTES; };
    auto dst = [&](int k) { return reinterpret_cast<unsigned char*>(out) + (first_tile + k) * (long long)TILE_BYTES; };
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) bar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
        for (int k = 0; k < STAGES && k < n; ++k) {
            bar_expect(&full[k], tile_bytes(k));
            bulk_load(smem + k * TILE_BYTES, src(k), tile_bytes(k), &full[k]);
        }
    }
    for (int k = 0; k < n; ++k) {
        const int s = k % STAGES;
        unsigned char* buf = smem + s * TILE_BYTES;
        bar_wait(&full[s], (k / STAGES) & 1);
        if (ROTATE) {
            const long long r0 = (first_tile + k) * TILE_ROWS;
            const int items = (int)(tile_bytes(k) / ROW_BYTES) * HALF_PACKETS;
            for (int i = tid; i < items; i += blockDim.x) {
                const int row = i / HALF_PACKETS, j = i % HALF_PACKETS;
                const long long pos = (r0 + row) / rows_per_position;
                uint4* a = reinterpret_cast<uint4*>(buf + row * ROW_BYTES) + j;
                const float* c = cos + pos * (D / 2) + j * PER_PACKET;
                const float* sn = sin + pos * (D / 2) + j * PER_PACKET;
                rotate_pair<T>(a, a + HALF_PACKETS, c, sn);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
        __syncthreads();
        if (tid == 0) {
            bulk_store(dst(k), buf, tile_bytes(k));
            // Refill the buffer of tile k - 1 once its store has read it.
            const int kk = k - 1 + STAGES;
            if (k >= 1 && kk < n) {
                bulk_wait_read<1>();
                const int s2 = (k - 1) % STAGES;
                bar_expect(&full[s2], tile_bytes(kk));
                bulk_load(smem + s2 * TILE_BYTES, src(kk), tile_bytes(kk), &full[s2]);
            }
        }
    }
    if (tid == 0) bulk_wait_all();
}
"""

CONFIGS = [  # (tile rows, stages, tiles a block, threads)
    (32, 4, 8, 256), (64, 4, 8, 256), (64, 3, 16, 256), (32, 6, 16, 256),
    (128, 3, 8, 256), (16, 8, 16, 128), (64, 4, 8, 128),
]


def names(t):
    return [f"bulk_rope<{t},{r},{s},{k},{rot}>" for r, s, k, _ in CONFIGS
            for rot in ("true", "false")]


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    import ml_dtypes

    bf = cupy.dtype(ml_dtypes.bfloat16)
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17",),
                         name_expressions=names("bf16_t") + names("float"))
    shapes = [("sbhd", (512, 32, 24, 128), "bf16_t"), ("sbhd", (4096, 1, 128, 128), "bf16_t"),
              ("sbhd", (128, 8192, 1, 128), "float"), ("sbhd", (512, 8, 128, 128), "bf16_t")]
    rng = np.random.default_rng(0)
    for layout, shape, t in shapes:
        dt = bf if t == "bf16_t" else cupy.dtype(cupy.float32)
        S = shape[0]
        rows = int(np.prod(shape[:-1]))
        rpp = rows // S
        theta = rng.random((S, 64)) * 6.0
        cos = cupy.asarray(np.cos(theta), dtype=cupy.float32)
        sin = cupy.asarray(np.sin(theta), dtype=cupy.float32)
        sets = []
        for _ in range(3):
            x = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)
            sets.append((x, cupy.empty_like(x)))
        nbytes = sets[0][0].nbytes
        ref = cupy_rope.apply_rope(sets[0][0], cos, sin, layout=layout)
        kernels = {}
        for r, s, k, threads in CONFIGS:
            for rot in (True, False):
                fn = mod.get_function(f"bulk_rope<{t},{r},{s},{k},{'true' if rot else 'false'}>")
                smem = r * 128 * dt.itemsize * s
                fn.max_dynamic_shared_size_bytes = smem
                tiles = (rows + r - 1) // r
                grid = (tiles + k - 1) // k

                def call(x, o, fn=fn, grid=grid, threads=threads, smem=smem):
                    fn((grid,), (threads,), (x, o, cos, sin, np.int64(rows), np.int64(rpp)),
                       shared_mem=smem)
                kernels[f"{'rope' if rot else 'copy'} r{r} s{s} k{k} t{threads}"] = (call, rot)
        for name, (call, rot) in kernels.items():
            x, o = sets[0]
            o.fill(np.nan if t == "float" else 0)
            call(x, o)
            want = ref if rot else x
            err = float(cupy.max(cupy.abs(o.astype(cupy.float32) - want.astype(cupy.float32))))
            if err > (1e-5 if t == "float" else 2e-2):
                print(f"{name}: WRONG (max err {err})", flush=True)
        print(f"== {layout} {list(shape)} {t}, {2 * nbytes / 1e6:.1f} MB moved", flush=True)
        results = {n: [] for n in kernels}
        ours, copies = [], []
        for _ in range(reps):
            copies.append(bench.copy_ms(nbytes) * 1e3)
            ours.append(bench.time_ms(lambda x, o: cupy_rope.apply_rope(x, cos, sin, layout=layout,
                                                                        out=o), sets) * 1e3)
            for n, (call, _) in kernels.items():
                results[n].append(bench.time_ms(call, sets) * 1e3)
        c = min(copies)
        print(f"  copy {' '.join(f'{v:.1f}' for v in copies)} us", flush=True)
        print(f"  cupy-rope {' '.join(f'{v:.1f}' for v in ours)} us  best {c / min(ours):.3f} of copy",
              flush=True)
        for n, ts in results.items():
            print(f"  {n:24s} {' '.join(f'{v:.1f}' for v in ts)} us  best {c / min(ts):.3f} of copy",
                  flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
