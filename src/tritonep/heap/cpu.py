"""CPU twin of the symmetric heap: a shared-memory file per rank, mapped by every rank.

Each rank creates its file, every rank maps every file, and each rank then unlinks its own
name: the mappings stay valid until the processes drop them, and nothing is left on disk.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from .base import SymmetricHeap


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def allocate_cpu(nbytes: int, group: dist.ProcessGroup) -> SymmetricHeap:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)

    def path(r: int) -> str:
        return os.path.join(_shm_dir(), f"tritonep-{token[0]}-{r}")

    local = torch.from_file(path(rank), shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group)
    try:
        peers = [
            local
            if r == rank
            else torch.from_file(path(r), shared=True, size=nbytes, dtype=torch.uint8)
            for r in range(world_size)
        ]
        dist.barrier(group)
    finally:
        os.unlink(path(rank))
    local.zero_()
    dist.barrier(group)
    return SymmetricHeap(
        group, peers, [p.data_ptr() for p in peers], barrier=lambda: dist.barrier(group)
    )
