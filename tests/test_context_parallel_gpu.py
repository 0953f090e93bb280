"""Context parallelism across ranks: examples/context_parallel.py.

The CPU part checks the example's slicing and reassembly, then the whole
identity (the ranks' rotated slices, gathered, equal the full rotation) on
the NumPy reference path, and runs the example over gloo on CPU processes
when torch is installed. The GPU part runs it over NCCL on two GPUs.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupy_rope
from cupy_rope.validate import cp_global_index

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "context_parallel.py"
CHECKS = [f"{case} {direction}: ok" for case in ("thd cos/sin", "bshd cos/sin", "thd inv_freq")
          for direction in ("forward", "backward")]


def _load_example():
    spec = importlib.util.spec_from_file_location("context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_dual_chunk_index_is_the_library_remap(cp_size):
    # The example slices with the same convention that cupy-rope's implied
    # positions assume for cp_rank.
    length = 2 * cp_size * 5
    local = np.arange(length // cp_size)
    for rank in range(cp_size):
        want = cp_global_index(local, length // (2 * cp_size), cp_size, rank)
        np.testing.assert_array_equal(example.dual_chunk_index(length, cp_size, rank), want)


def test_dual_chunk_index_refuses_an_indivisible_length():
    with pytest.raises(ValueError, match="length: must be divisible by 2 \\* cp_size = 4"):
        example.dual_chunk_index(6, 2, 0)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
@pytest.mark.parametrize("chunks", [(5,), (3, 1, 6, 0, 2)])
def test_rank_slices_partition_the_tokens_and_reassemble(cp_size, chunks):
    lengths = [2 * cp_size * n for n in chunks]
    cu = np.cumsum([0] + lengths)
    tokens = np.arange(cu[-1])
    slices = [example.rank_index(lengths, cp_size, r) for r in range(cp_size)]
    for rank, held in enumerate(slices):
        assert held.size == cu[-1] // cp_size
        # Sequence k starts at local token cu[k] / cp_size, as cupy-rope reads
        # the full cu_seqlens, and keeps its tokens in sequence order.
        for k in range(len(lengths)):
            part = held[cu[k] // cp_size:cu[k + 1] // cp_size]
            assert ((part >= cu[k]) & (part < cu[k + 1])).all()
            np.testing.assert_array_equal(part - cu[k],
                                          example.dual_chunk_index(lengths[k], cp_size, rank))
    gathered = np.concatenate([tokens[held] for held in slices])
    np.testing.assert_array_equal(gathered[example.gather_order(lengths, cp_size)], tokens)


def _gathered(x, axis, lengths, cp_size, rotate):
    """The ranks' rotated slices (rotate(slice, rank)), reassembled in sequence order."""
    parts = [rotate(np.take(x, example.rank_index(lengths, cp_size, r), axis), r)
             for r in range(cp_size)]
    return np.take(np.concatenate(parts, axis), example.gather_order(lengths, cp_size), axis)


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("source", ["cos/sin", "inv_freq"])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
@pytest.mark.parametrize("backward", [False, True])
def test_reference_gathered_slices_equal_the_full_rotation(rng, cp_size, source, layout,
                                                           backward):
    h, d = 3, 16
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    if layout == "thd":
        lengths = [2 * cp_size * n for n in (4, 1, 7)]
        x = rng.standard_normal((sum(lengths), h, d)).astype(np.float32)
        options = dict(layout="thd", cu_seqlens=np.cumsum([0] + lengths).astype(np.int32))
    else:
        lengths = [2 * cp_size * 6]
        x = rng.standard_normal((2, lengths[0], h, d)).astype(np.float32)
        options = dict(layout="bshd")
    theta = np.arange(max(lengths))[:, None] * inv_freq.astype(np.float64)
    options |= (dict(inv_freq=inv_freq) if source == "inv_freq" else
                dict(cos=np.cos(theta).astype(np.float32), sin=np.sin(theta).astype(np.float32)))
    options["backward"] = backward

    def rotate(part, rank):
        return cupy_rope.apply_rope(part, **options, cp_size=cp_size, cp_rank=rank)

    got = _gathered(x, 0 if layout == "thd" else 1, lengths, cp_size, rotate)
    np.testing.assert_array_equal(got, cupy_rope.apply_rope(x, **options))


def _torch_distributed():
    """torch.distributed, or None where torch or its distributed package is missing."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def _run_example(nproc: int, env: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(EXAMPLE)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _assert_all_ok(proc, header: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert header in proc.stdout, output
    for line in CHECKS:
        assert line in proc.stdout, output


def test_example_on_cpu_ranks_over_gloo():
    dist = _torch_distributed()
    if dist is None or not dist.is_gloo_available():
        pytest.skip("needs torch with gloo")
    # Hidden GPUs: the ranks take the CPU path (gloo, the NumPy reference).
    proc = _run_example(2, {"CUDA_VISIBLE_DEVICES": ""})
    _assert_all_ok(proc, "2 ranks, gloo, torch.float32")


@pytest.mark.gpu
@pytest.mark.gpu2
def test_example_on_two_gpus_over_nccl():
    dist = _torch_distributed()
    if dist is None or not dist.is_nccl_available():
        pytest.skip("needs torch with NCCL")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, found {torch.cuda.device_count()}")
    proc = _run_example(2, {})
    _assert_all_ok(proc, "2 ranks, nccl, torch.bfloat16")
