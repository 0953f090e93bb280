"""Context parallelism across processes: each rank rotates its dual-chunk slice.

Run on two GPUs (any number of ranks works)::

    torchrun --nproc-per-node 2 examples/context_parallel.py

Every rank builds the same inputs from a fixed seed: a packed ``thd`` batch
of sequences of different lengths and a ``bshd`` batch. With N ranks, each
sequence is cut into 2 N chunks and rank r keeps chunks r and 2 N - 1 - r
(the load-balanced layout of Megatron / TransformerEngine). The rank rotates
its slice with ``cupy_rope.torch.rope(..., cp_size=N, cp_rank=r)`` (thd: the
full ``cu_seqlens``), and takes the autograd gradient of ``sum(out * g)`` for
a random ``g``. The slices are gathered with ``all_gather``, put back in
sequence order and compared with the rotation of the full batch with
``cp_size=1`` on one device, bit for bit (``torch.equal``), forward and
backward. One line per check; the exit status is non-zero on a mismatch.

GPUs talk over NCCL and run the kernels in bfloat16. Without CUDA the ranks
use gloo and the NumPy float64 reference path (float32 tensors), so the
script also runs on a CPU machine.
"""

from __future__ import annotations

import os
import sys

import numpy as np

try:  # the index helpers need only NumPy (tests import them without torch)
    import torch
    import torch.distributed as dist

    import cupy_rope.torch as crt  # autograd ops: torch.ops.cupy_rope.*
except ImportError:
    torch = dist = crt = None

HEADS, HEAD_DIM, BATCH = 4, 64, 2
#: Chunks per sequence for each rank: the packed thd sequences and the bshd sequence.
THD_CHUNKS, BSHD_CHUNKS = (5, 1, 12, 7), 8


def dual_chunk_index(length: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Token indices of one sequence that rank ``cp_rank`` holds, in its local order.

    The sequence is cut into 2 * cp_size chunks of c = length / (2 * cp_size);
    the rank holds chunks cp_rank and 2 * cp_size - 1 - cp_rank, back to back.

    Returns
    -------
    numpy.ndarray
        int64 [2 c]: the rank's local token i is token ``result[i]`` of the sequence.

    Raises
    ------
    ValueError
        If ``length`` is not divisible by 2 * cp_size.
    """
    if length % (2 * cp_size):
        raise ValueError(f"length: must be divisible by 2 * cp_size = {2 * cp_size}, "
                         f"got {length}")
    c = length // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return np.concatenate([np.arange(first, first + c), np.arange(second, second + c)])


def rank_index(lengths, cp_size: int, cp_rank: int) -> np.ndarray:
    """Indices along the sequence axis of the tokens rank ``cp_rank`` holds.

    Parameters
    ----------
    lengths : sequence of int
        The lengths of the sequences packed along that axis: ``diff(cu_seqlens)``
        for thd (every sequence is split on its own), ``[s]`` for bshd.
    cp_size, cp_rank : int
        The number of ranks and this rank.

    Returns
    -------
    numpy.ndarray
        int64 [sum(lengths) / cp_size]: taking these along the sequence axis
        gives the rank's slice, the input cupy-rope expects with ``cp_size``
        and ``cp_rank`` (and, for thd, the full ``cu_seqlens``).
    """
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.concatenate([start + dual_chunk_index(n, cp_size, cp_rank)
                           for start, n in zip(starts, lengths)]).astype(np.int64)


def gather_order(lengths, cp_size: int) -> np.ndarray:
    """Indices that put the ranks' slices, concatenated in rank order, back in sequence order.

    Returns
    -------
    numpy.ndarray
        int64 [sum(lengths)]: ``concatenate(slices)[result]`` (along the
        sequence axis) is the full batch, for ``slices[r]`` taken with
        ``rank_index(lengths, cp_size, r)``.
    """
    held = np.concatenate([rank_index(lengths, cp_size, r) for r in range(cp_size)])
    order = np.empty_like(held)
    order[held] = np.arange(held.size)
    return order


def start() -> torch.device:
    """Join the process group: NCCL with one GPU per rank (by LOCAL_RANK), else gloo on the CPU."""
    if "RANK" not in os.environ:
        sys.exit("start the ranks with: torchrun --nproc-per-node 2 examples/context_parallel.py")
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_rank >= torch.cuda.device_count():
        sys.exit(f"local rank {local_rank}: needs one GPU per rank, found "
                 f"{torch.cuda.device_count()}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def rotate(x, g, layout: str, angles: dict, cu_seqlens, cp_size: int, cp_rank: int):
    """``rope(x)`` and the gradient of ``sum(rope(x) * g)`` with respect to x (autograd)."""
    x = x.detach().requires_grad_()
    out = crt.rope(x, **angles, layout=layout, cu_seqlens=cu_seqlens, cp_size=cp_size,
                   cp_rank=cp_rank)
    (dx,) = torch.autograd.grad(out, x, g)
    return out.detach(), dx


def gather(local, axis: int, order):
    """Every rank's slice (all_gather), back in full sequence order along ``axis``."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=axis).index_select(axis, order)


def check(name: str, layout: str, x, angles: dict, cu_seqlens, lengths) -> bool:
    """Rotate the rank's slice, gather, compare with the full rotation; print on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    axis = 0 if layout == "thd" else 1
    mine = torch.from_numpy(rank_index(lengths, world, rank)).to(x.device)
    order = torch.from_numpy(gather_order(lengths, world)).to(x.device)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x)
    out, dx = rotate(x.index_select(axis, mine), g.index_select(axis, mine), layout, angles,
                     cu_seqlens, world, rank)
    want_out, want_dx = rotate(x, g, layout, angles, cu_seqlens, 1, 0)
    ok = True
    for direction, got, want in (("forward", gather(out, axis, order), want_out),
                                 ("backward", gather(dx, axis, order), want_dx)):
        same = torch.equal(got, want)
        ok &= same
        if rank == 0:
            verdict = "ok" if same else (f"MISMATCH (max |diff| "
                                         f"{(got.float() - want.float()).abs().max().item()})")
            print(f"{name} {direction}: {verdict}", flush=True)
    return ok


def main() -> int:
    device = start()
    world = dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)  # on the CPU: the same numbers on every rank

    thd_lengths = [2 * world * n for n in THD_CHUNKS]
    cu_seqlens = torch.tensor(np.cumsum([0] + thd_lengths), dtype=torch.int32, device=device)
    x_thd = torch.randn(sum(thd_lengths), HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    s = 2 * world * BSHD_CHUNKS
    x_bshd = torch.randn(BATCH, s, HEADS, HEAD_DIM, generator=gen).to(device, dtype)

    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    theta = torch.arange(max(thd_lengths + [s]), dtype=torch.float64)[:, None] * inv_freq
    tables = {"cos": theta.cos().float().to(device), "sin": theta.sin().float().to(device)}
    computed = {"inv_freq": inv_freq.float().to(device)}

    if dist.get_rank() == 0:
        print(f"{world} ranks, {dist.get_backend()}, {dtype}", flush=True)
    ok = check("thd cos/sin", "thd", x_thd, tables, cu_seqlens, thd_lengths)
    ok &= check("bshd cos/sin", "bshd", x_bshd, tables, None, [s])
    ok &= check("thd inv_freq", "thd", x_thd, computed, cu_seqlens, thd_lengths)
    # Every rank past its last collective before any tears down: gloo could
    # abort a rank whose peer left while its own work was still in flight.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
