"""GPU heap through CUDA IPC handles, for ranks that share one GPU.

Symmetric memory refuses ranks whose allocations live on the same device, yet several processes
on one GPU are the only way to run multi-rank kernels on real hardware when a machine has fewer
GPUs than ranks (see ``TRITONEP_SHARED_GPU`` in :mod:`tritonep.launch`). Each rank allocates an
ordinary CUDA buffer, exports its IPC handle, and opens every peer's handle, so the kernels see
the same ``peer_ptrs`` they see on symmetric memory. The handles travel over the process group
(gloo), whose barrier is also the heap's barrier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from .base import SymmetricHeap


def allocate_cuda_ipc(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricHeap:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # A block that was shared stays allocated until every peer has dropped its mapping and its
    # owner collects it: collect the blocks of heaps closed since the last allocation.
    torch.cuda.ipc_collect()
    local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    handles: list[Any] = [None] * world_size
    # (rebuild function, its arguments): what torch.multiprocessing pickles for a CUDA tensor.
    dist.all_gather_object(handles, reduce_tensor(local), group=group)
    peers = [local if r == rank else handles[r][0](*handles[r][1]) for r in range(world_size)]

    def barrier() -> None:
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def release() -> None:
        barrier()  # every rank has dropped its mappings
        torch.cuda.ipc_collect()

    barrier()
    return SymmetricHeap(
        group, peers, [p.data_ptr() for p in peers], barrier, release=release, backend="IPC"
    )
