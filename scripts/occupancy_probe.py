"""flat_kernel with its resident blocks per SM capped by dynamic shared
memory, against torch.compile, same process:

    PYTHONPATH=. python scripts/occupancy_probe.py WORKLOADS BYTES,BYTES,...

WORKLOADS: comma-separated cupy_rope.bench names (single-tensor rows);
BYTES: dynamic shared memory per block for each variant (0: none). Every
driver launch of the process gets that shared memory (a probe, not a
launch policy)."""
import sys

from cupy.cuda import driver

from cupy_rope import api, bench
from inputs_probe import each_workload

orig = driver.launchKernel
SHMEM = [0]


def launch(kernel, gx, gy, gz, bx, by, bz, shmem, stream, args, extra):
    return orig(kernel, gx, gy, gz, bx, by, bz, SHMEM[0], stream, args, extra)


driver.launchKernel = launch
names = sys.argv[1].split(",")
sizes = [int(v) for v in sys.argv[2].split(",")]


def measure(w, t_copy, comp, ours, args_o):
    args_c, compiled = comp
    res = []
    for size in sizes:
        api.clear_plans()
        SHMEM[0] = 0
        ours.call[False](*args_o[0])
        plan = [v.plan for v in api._plans.values()][0]
        try:
            driver.funcSetAttribute(plan.kernel, 8, size)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        except Exception as exc:  # noqa: BLE001
            print("attribute", size, exc)
        SHMEM[0] = size
        occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(plan.kernel, plan.dims[3], size)
        try:
            ts = [bench.time_call(ours.call[False], args_o, 30, 5)[0] for _ in range(2)]
        except Exception as exc:  # noqa: BLE001
            print("launch", size, occ, exc, flush=True)
            continue
        res.append(f"{size // 1024}K/{occ}blk {' '.join(f'{t * 1e3:.1f}' for t in ts)} "
                   f"({t_copy / min(ts):.3f})")
    tc = [bench.time_call(compiled, args_c, 30, 5)[0] for _ in range(2)]
    print(f"{w.name:26s} copy {t_copy * 1e3:.1f} | " + " | ".join(res)
          + f" | compile {' '.join(f'{t * 1e3:.1f}' for t in tc)} ({t_copy / min(tc):.3f})",
          flush=True)
    SHMEM[0] = 0


each_workload(names, measure)
