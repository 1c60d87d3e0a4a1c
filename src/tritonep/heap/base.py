"""The backend-independent face of a symmetric heap."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import HeapGuardError


class SymmetricHeap:
    """Same-sized byte buffers, one per rank of a group, each mapped into every rank.

    Attributes:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        nbytes: bytes per rank.
        device: where the buffers live.
        backend: ``"CUDA"`` or ``"NVSHMEM"`` (symmetric memory), ``"IPC"`` (ranks sharing a
            GPU) or ``"CPU"`` (shared memory); only NVSHMEM heaps take NVSHMEM puts.
        local: ``uint8 [nbytes]``, this rank's buffer.
        peer_ptrs: ``int64 [world_size]`` on ``device``, base address of each rank's buffer
            (0 for an NVSHMEM peer that this GPU cannot map, on another node).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        peers: Sequence[torch.Tensor | None],
        peer_ptrs: Sequence[int],
        barrier: Callable[[], None],
        keepalive: object = None,
        release: Callable[[], None] | None = None,
        backend: str = "CPU",
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # None for a peer this GPU cannot map (another node): reached by NVSHMEM puts only.
        self._peers: list[torch.Tensor | None] | None = list(peers)
        local = self._peers[self.rank]
        if local is None:
            raise ValueError(f"peers: this rank's own buffer (index {self.rank}) is missing")
        self.local = local
        self.nbytes = self.local.numel()
        self.device = self.local.device
        self.peer_ptrs = torch.tensor(list(peer_ptrs), dtype=torch.int64, device=self.device)
        #: Every peer's buffer is mapped here, so kernels may store into any of them.
        self.all_mapped = all(p is not None for p in self._peers)
        self._barrier = barrier
        self._keepalive = keepalive
        self._release = release
        self.backend = backend
        self._guard: torch.Tensor | None = None  # add_guard

    def view(
        self, rank: int, dtype: torch.dtype, shape: Sequence[int], offset: int = 0
    ) -> torch.Tensor:
        """Typed view of rank ``rank``'s buffer: ``shape`` of ``dtype`` at byte ``offset``."""
        if self._peers is None:
            raise RuntimeError("this symmetric heap was closed")
        itemsize = dtype.itemsize
        count = 1
        for size in shape:
            count *= size
        if offset % itemsize != 0:
            raise ValueError(f"offset: {offset} is not a multiple of the {dtype} size {itemsize}")
        if offset < 0 or offset + count * itemsize > self.nbytes:
            raise ValueError(
                f"offset: [{offset}, {offset + count * itemsize}) lies outside the heap of "
                f"{self.nbytes} bytes"
            )
        peer = self._peers[rank]
        if peer is None:
            raise ValueError(
                f"rank: rank {rank}'s heap is not mapped on this GPU (another node); "
                "it is reached through NVSHMEM puts only"
            )
        raw = peer[offset : offset + count * itemsize]
        return raw.view(dtype).view(tuple(shape))

    def add_guard(self, guard_bytes: int) -> None:
        """Keep the last ``guard_bytes`` of every buffer as a guard: out of reach of
        :meth:`view` (``nbytes`` shrinks), zero as allocated, so that :meth:`check_guard` finds
        a kernel that wrote past the regions it was given (a peer's or this rank's)."""
        if not 0 < guard_bytes < self.nbytes:
            raise ValueError(f"guard_bytes: expected 1 to {self.nbytes - 1}, got {guard_bytes}")
        self.nbytes -= guard_bytes
        self._guard = self.local[self.nbytes :]
        self.local = self.local[: self.nbytes]

    def check_guard(self) -> None:
        """Raise :class:`~tritonep.errors.HeapGuardError` if a byte of this rank's guard is
        no longer zero (waits for the device). Without a guard, or once closed, nothing."""
        guard = self._guard
        if guard is None or self._peers is None:
            return
        written = torch.nonzero(guard).flatten().tolist()
        if written:
            raise HeapGuardError(self.rank, written[0], len(written))

    def barrier(self) -> None:
        """Wait until every rank has reached this point and its earlier device work is done."""
        self._barrier()

    def close(self) -> None:
        """Drop this rank's mappings (collective: call on every rank)."""
        if self._peers is None:
            return
        self.barrier()
        self._peers = None
        # An empty tensor, not None: `local` stays a tensor for every reader, and the mapping
        # is released all the same.
        self.local = self.local.new_empty(0)
        self._guard = None
        self._keepalive = None
        if self._release is not None:
            self._release()
        if self.device.type == "cpu":
            # Kernels on CPU ranks run in Triton's interpreter, whose launches leave reference
            # cycles holding tensors; collected at interpreter exit instead, they can make a
            # gloo worker thread free tensors of an earlier collective after finalization has
            # begun, which aborts the process.
            gc.collect()

    def close_checked(self, check) -> None:
        """:meth:`close` after ``check()`` (a mode's check of its waits), whatever that raises;
        then its error is raised. A peer that stopped answering never reaches the close's
        barrier, which then fails by the process group's own timeout: that failure becomes
        the cause of the error ``check`` raised, which stays the one reported."""
        try:
            check()
        except Exception as failed:
            try:
                self.close()
            except Exception as close_failed:
                raise failed from close_failed
            raise
        self.close()

    def __repr__(self) -> str:
        return (
            f"SymmetricHeap(rank={self.rank}, world_size={self.world_size}, "
            f"nbytes={self.nbytes}, device={self.device}, backend={self.backend})"
        )
