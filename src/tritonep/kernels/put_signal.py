"""Store a block into a peer's heap and raise a flag there; wait for such a flag.

The smallest complete use of the symmetric heap, and the pattern every mode builds on: the
sender's program writes the payload with plain stores, then publishes it with a system-scope
release on the receiver's flag; the receiver acquires the flag (bounded wait) and may then read
the payload. One program per call: this is a correctness building block, not a fast copy.

Plain stores reach the peers whose memory this GPU can map (one host, or one NVLink domain).
Across a network the same step is one NVSHMEM ``putmem_signal``: the payload, then the flag set
on the peer once the payload is there (``via="nvshmem"``, on heaps of the NVSHMEM backend).
The receiving side is the same wait either way. Over InfiniBand the source must lie in the
NVSHMEM heap too (or be registered with NVSHMEM), which is why the modes stage rows in their
own heap before putting them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ..heap import SymmetricHeap
from . import phases
from .nvshmem import SIGNAL_SET, link_options, putmem_signal_block
from .phases import SIGNAL
from .sync import (
    DEFAULT_TIMEOUT_S,
    limit_ns,
    new_status,
    raise_on_timeout,
    record_timeout,
    store_release,
    timeout_us,
    use_clock,
    wait_flag,
)


@triton.jit
def put_signal_kernel(
    src_ptr, num_elems, peer_ptrs, peer, data_offset, flag_offset, value, BLOCK: tl.constexpr
):
    base = tl.load(peer_ptrs + peer)
    dst_ptr = (base + data_offset).to(tl.pointer_type(src_ptr.dtype.element_ty))
    for block in range(0, tl.cdiv(num_elems, BLOCK)):
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_elems
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    store_release((base + flag_offset).to(tl.pointer_type(tl.int32)), value)


@triton.jit
def put_signal_nvshmem_kernel(
    src_ptr, nbytes, peer_ptrs, rank, pe, data_offset, flag_offset, value
):
    # NVSHMEM names the destination by this rank's own (symmetric) address plus the peer's PE.
    base = tl.load(peer_ptrs + rank)
    putmem_signal_block(
        base + data_offset, src_ptr, nbytes, base + flag_offset, value, SIGNAL_SET, pe
    )


@triton.jit(do_not_specialize=["timeout_us"])
def wait_signal_kernel(
    peer_ptrs, rank, peer, flag_offset, value, timeout_us, status_ptr, USE_CLOCK: tl.constexpr
):
    base = tl.load(peer_ptrs + rank)
    flag = (base + flag_offset).to(tl.pointer_type(tl.int32))
    timeout_ns = limit_ns(timeout_us, status_ptr)
    _, ok = wait_flag(flag, value, timeout_ns, USE_CLOCK)
    if not ok:
        record_timeout(status_ptr, peer, SIGNAL, timeout_ns)


def _check_offset(name: str, heap: SymmetricHeap, offset: int, nbytes: int, align: int) -> None:
    if offset % align != 0 or offset < 0 or offset + nbytes > heap.nbytes:
        raise ValueError(
            f"{name}: {offset} must be a multiple of {align} with {nbytes} bytes inside the "
            f"{heap.nbytes}-byte heap"
        )


def put_signal(
    heap: SymmetricHeap,
    src: torch.Tensor,
    peer: int,
    data_offset: int,
    flag_offset: int,
    value: int,
    via: str = "store",
) -> None:
    """Copy ``src`` into ``peer``'s heap at ``data_offset``, then set its int32 flag to ``value``.

    Args:
        heap: the symmetric heap.
        src: contiguous tensor on the heap's device (any dtype).
        peer: destination rank.
        data_offset: byte offset of the payload in the peer's heap (multiple of 16).
        flag_offset: byte offset of the int32 flag in the peer's heap (multiple of 4; of 8
            with ``via="nvshmem"``, whose signals are 64-bit: the flag's next 4 bytes are
            zeroed).
        value: non-zero int32 flag value (a phase tag).
        via: ``"store"`` (the GPU stores into the mapped peer memory) or ``"nvshmem"`` (one
            NVSHMEM put with signal; needs a heap of the NVSHMEM backend).
    """
    if via not in ("store", "nvshmem"):
        raise ValueError(f"via: expected 'store' or 'nvshmem', got {via!r}")
    if via == "nvshmem" and heap.backend != "NVSHMEM":
        raise ValueError(
            f"via: 'nvshmem' needs a heap of the NVSHMEM backend (heap.set_backend('NVSHMEM') "
            f"before the first allocation); this heap's backend is {heap.backend}"
        )
    if src.device != heap.device or not src.is_contiguous():
        raise ValueError(f"src: expected a contiguous tensor on {heap.device}")
    if not 0 <= peer < heap.world_size:
        raise ValueError(f"peer: expected a rank in [0, {heap.world_size}), got {peer}")
    nbytes = src.numel() * src.element_size()
    _check_offset("data_offset", heap, data_offset, nbytes, 16)
    _check_offset(
        "flag_offset", heap, flag_offset, 8 if via == "nvshmem" else 4, 8 if via == "nvshmem" else 4
    )
    if via == "nvshmem":
        pe = dist.get_global_rank(heap.group, peer)  # NVSHMEM numbers PEs by world rank
        put_signal_nvshmem_kernel[(1,)](
            src,
            nbytes,
            heap.peer_ptrs,
            heap.rank,
            pe,
            data_offset,
            flag_offset,
            value,
            **link_options(),
        )
        return
    put_signal_kernel[(1,)](
        src, src.numel(), heap.peer_ptrs, peer, data_offset, flag_offset, value, BLOCK=1024
    )


def wait_signal(
    heap: SymmetricHeap,
    flag_offset: int,
    value: int,
    peer: int = -1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Wait until this rank's int32 flag at ``flag_offset`` equals ``value``.

    Synchronizes with the device to read the outcome.

    Raises:
        WaitTimeoutError: naming this rank, ``peer`` and the phase, if ``timeout_s`` passed.
    """
    _check_offset("flag_offset", heap, flag_offset, 4, 4)
    status = new_status(heap.device)
    wait_signal_kernel[(1,)](
        heap.peer_ptrs,
        heap.rank,
        peer,
        flag_offset,
        value,
        timeout_us(timeout_s),
        status,
        USE_CLOCK=use_clock(heap.device),
    )
    raise_on_timeout(status, heap.rank, phases.NAMES)
