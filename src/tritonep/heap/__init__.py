"""The symmetric heap: one same-sized buffer on every rank, addressable by every peer.

:func:`allocate` returns a :class:`SymmetricHeap` with

* ``local``: this rank's bytes, a ``uint8`` tensor on the rank's device;
* ``peer_ptrs``: an int64 device tensor ``[world_size]`` of every rank's base address, valid in
  this process, which is what Triton kernels take (``tl.load(peer_ptrs + peer)`` then a cast to
  a pointer type) to load from and store into peers;
* :meth:`SymmetricHeap.view`: a typed tensor view of any rank's buffer at a byte offset.

Two backends behind one interface:

* GPU: PyTorch symmetric memory (``torch.distributed._symmetric_memory``), the CUDA backend by
  default or NVSHMEM on request (:func:`set_backend` before the first allocation of the process);
  ranks that share one GPU (a gloo group on CUDA devices) map each other's buffers through CUDA
  IPC handles instead, which symmetric memory does not allow;
* CPU: files in shared memory mapped by every rank process, so kernels run with
  ``TRITON_INTERPRET=1`` read, write and signal peers exactly as on GPUs. This is the twin the
  CPU test suite runs on.

A new heap is zero-filled on every rank before :func:`allocate` returns, so flags start at 0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import interpret
from .base import SymmetricHeap

__all__ = ["GUARD_BYTES", "SymmetricHeap", "allocate", "default_device", "set_backend"]

SHARED_GPU_ENV = "TRITONEP_SHARED_GPU"


def shared_gpu() -> bool:
    """Every rank of this machine runs on GPU 0 (``TRITONEP_SHARED_GPU=1``, for tests)."""
    return os.environ.get(SHARED_GPU_ENV, "0") not in ("", "0") and torch.cuda.is_available()


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a rank of ``group`` keeps its buffers: the current CUDA device for NCCL groups
    and for ranks sharing a GPU, else the CPU."""
    group = group or dist.group.WORLD
    if dist.get_backend(group) == "nccl" or shared_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_backend(name: str) -> None:
    """Pick the GPU symmetric-memory backend, ``"CUDA"`` or ``"NVSHMEM"``, before any allocation."""
    from .cuda import set_backend as _set

    _set(name)


#: Zero bytes kept past the end of every heap's regions (:meth:`SymmetricHeap.add_guard`).
GUARD_BYTES = 4096


def allocate(
    nbytes: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> SymmetricHeap:
    """Allocate ``nbytes`` on every rank of ``group`` (collective: every rank must call it),
    and :data:`GUARD_BYTES` more as a guard past them (:meth:`SymmetricHeap.check_guard`).

    Args:
        nbytes: bytes per rank, the same on every rank.
        group: the process group (default: the world).
        device: a CUDA device (symmetric memory) or ``"cpu"`` (shared memory); default: the
            :func:`default_device` of the group.
    """
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
    group = group or dist.group.WORLD
    device = torch.device(device) if device is not None else default_device(group)
    interpret.check(device)  # kernels built for this device, before any runs
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, nbytes, group=group)
    if len(set(sizes)) != 1:
        raise ValueError(f"nbytes: every rank must allocate the same size, got {sizes}")
    total = nbytes + GUARD_BYTES
    if device.type == "cuda" and dist.get_backend(group) != "nccl":
        from .cuda_ipc import allocate_cuda_ipc

        heap = allocate_cuda_ipc(total, group, device)
    elif device.type == "cuda":
        from .cuda import allocate_cuda

        heap = allocate_cuda(total, group, device)
    elif device.type == "cpu":
        from .cpu import allocate_cpu

        heap = allocate_cpu(total, group)
    else:
        raise ValueError(f"device: expected a CUDA device or 'cpu', got {device}")
    heap.add_guard(GUARD_BYTES)
    return heap
