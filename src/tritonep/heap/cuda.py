"""GPU symmetric heap on PyTorch symmetric memory (CUDA backend, or NVSHMEM on request)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from .base import SymmetricHeap

BACKENDS = ("CUDA", "NVSHMEM")


def set_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    if name == "NVSHMEM" and not symm_mem.is_nvshmem_available():
        raise RuntimeError("the NVSHMEM backend is not available in this PyTorch build")
    symm_mem.set_backend("NVSHMEM" if name == "NVSHMEM" else "CUDA")
    global _chosen
    _chosen = name


_chosen = "CUDA"


def backend_of(device: torch.device) -> str:
    """The symmetric-memory backend of ``device`` (it may also be chosen outside this module)."""
    get = getattr(symm_mem, "get_backend", None)
    return (get(device) if get is not None else None) or _chosen


def allocate_cuda(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricHeap:
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world_size == 1:
        # A group of one rank (a node of one GPU, the rail of one node) has no peer to map:
        # plain device memory (the NVSHMEM backend cannot rendezvous a group of one).
        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return SymmetricHeap(
            group,
            [local],
            [local.data_ptr()],
            lambda: torch.cuda.synchronize(device),
            backend="CUDA",
        )
    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group.group_name)
    ptrs = list(handle.buffer_ptrs)
    peers: list[torch.Tensor | None] = []
    for r in range(world_size):
        if r == rank:
            peers.append(local)
        elif ptrs[r] == 0:
            # An NVSHMEM peer this GPU cannot map (another node): reached by puts only.
            peers.append(None)
        else:
            peers.append(handle.get_buffer(r, (nbytes,), torch.uint8))

    def barrier() -> None:
        # Host-side barrier: symmetric-memory device barriers do nothing under NVSHMEM.
        torch.cuda.synchronize(device)
        dist.barrier(group)

    local.zero_()
    barrier()
    return SymmetricHeap(
        group,
        peers,
        ptrs,
        barrier,
        keepalive=handle,
        backend=backend_of(device),
    )
