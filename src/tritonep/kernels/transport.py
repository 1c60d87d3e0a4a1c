"""How a program hands a block to a peer on another node: stage it, put it, then signal.

Peers of the same node are reached with plain stores into their mapped memory (and a release
on their flag). Peers on other nodes may not be mapped at all, so the kernels write such blocks
into this rank's own heap first (*staging*: an InfiniBand NIC reads only registered memory, and
the heap is registered) and then move them with one of two transports, chosen at compile time:

* ``VIA_NVSHMEM``: NVSHMEM puts from the staged block, then the signal: ``putmem_signal`` for
  a contiguous block, or row puts, a fence and a signal operation;
* ``VIA_COPY``: the same steps as loads from the staged block and stores into the peer's
  mapped memory, then a release on its flag. This is how emulated nodes run where NVSHMEM does
  not (CPU ranks, CUDA IPC heaps), so the staged path is tested everywhere.

Destinations are given twice: as an offset into the peer's heap (``peer_base`` is its mapped
base, which only ``VIA_COPY`` uses) and through this rank's own base (``my_base``), which is
how NVSHMEM names the same offset on another PE. Signals are 64-bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import nvshmem
from .sync import add_release, aligned_ptr, lane, store_release

#: Transports (``VIA``): every peer on this node (no staging), copies, NVSHMEM puts.
VIA_STORE = tl.constexpr(0)
VIA_COPY = tl.constexpr(1)
VIA_NVSHMEM = tl.constexpr(2)

SIGNAL_SET = nvshmem.SIGNAL_SET
SIGNAL_ADD = nvshmem.SIGNAL_ADD

COPY_WORDS = tl.constexpr(4096)


class PeerTransport:
    """How a mode's kernels reach its peers: the host side of the choice above.

    Args:
        heap: the mode's symmetric heap.
        staged: whether any peer is reached through staging (peers on other nodes).
        argument: the mode's argument that decides ``staged``, for the error below.
    Attributes:
        via: ``VIA_STORE`` without staging; else ``VIA_NVSHMEM`` on NVSHMEM heaps and
            ``VIA_COPY`` elsewhere (emulated nodes), as an int for the kernels' ``VIA``.
        name: ``"store"``, ``"copy"`` or ``"nvshmem"``.
        pes: ``[R]`` int32 NVSHMEM PE (world rank) of each rank of the heap's group.
    Raises:
        ValueError: a peer's memory is not mapped here (another node) and nothing is
            staged: kernels would store through a null address. The heap is closed first.
    """

    def __init__(self, heap, staged: bool, argument: str):
        if not staged and not heap.all_mapped:
            heap.close()
            raise ValueError(
                f"{argument}: some ranks' memory is not mapped on this GPU (other nodes of an "
                "NVSHMEM heap), so they must be reached through staging and puts"
            )
        via = VIA_STORE
        if staged:
            via = VIA_NVSHMEM if heap.backend == "NVSHMEM" else VIA_COPY
        self.via = via.value
        self.name = ("store", "copy", "nvshmem")[self.via]
        ranks = range(heap.world_size)
        self.pes = torch.tensor(
            [dist.get_global_rank(heap.group, r) for r in ranks],
            dtype=torch.int32,
            device=heap.device,
        )

    @property
    def options(self) -> dict:
        """Launch options of a kernel that puts through this transport: NVSHMEM's device
        library linked for ``VIA_NVSHMEM``, nothing otherwise."""
        return nvshmem.link_options() if self.via == VIA_NVSHMEM.value else {}


@triton.jit
def copy_bytes(dst_addr, src_addr, nbytes, BLOCK_WORDS: tl.constexpr = COPY_WORDS):
    """Copy ``nbytes`` (a multiple of 16) between 16-byte aligned addresses, after every
    thread's earlier stores to ``src_addr``.

    16-byte vectors (the word count is declared a multiple of 4, else the mask splits every
    access into words), and the next tile loaded before the current one is stored: one
    program moves a tile per load latency, so a tile in flight sets its rate. ``BLOCK_WORDS`` words
    (int32) per step: larger tiles copy faster and take more registers.
    """
    tl.debug_barrier()
    src = aligned_ptr(src_addr, tl.int32)
    dst = aligned_ptr(dst_addr, tl.int32)
    words = tl.multiple_of((tl.cast(nbytes, tl.int64) // 16) * 4, 4)
    offs = tl.arange(0, BLOCK_WORDS)
    tile = tl.load(src + offs, mask=offs < words)
    for start in range(0, words, BLOCK_WORDS):
        ahead = start + BLOCK_WORDS + offs
        tile_ahead = tl.load(src + ahead, mask=ahead < words)
        tl.store(dst + start + offs, tile, mask=start + offs < words)
        tile = tile_ahead


@triton.jit
def put_block_signal(
    my_base,
    peer_base,
    dst_offset,
    src_addr,
    nbytes,
    signal_offset,
    value,
    SIG_OP: tl.constexpr,
    pe,
    VIA: tl.constexpr,
):
    """Move a staged block to a peer, then set or add to its 64-bit signal."""
    if VIA == VIA_NVSHMEM:
        tl.debug_barrier()  # every thread's staging stores come before the put
        nvshmem.putmem_signal_block(
            my_base + dst_offset,
            src_addr,
            nbytes,
            my_base + signal_offset,
            value,
            SIG_OP,
            pe,
        )
    else:
        copy_bytes(peer_base + dst_offset, src_addr, nbytes)
        signal(my_base, peer_base, signal_offset, value, SIG_OP, pe, VIA)


@triton.jit
def put_block(my_base, peer_base, dst_offset, src_addr, nbytes, pe, VIA: tl.constexpr):
    """Move a staged block to a peer; a later :func:`signal` orders it before the signal."""
    if VIA == VIA_NVSHMEM:
        tl.debug_barrier()
        nvshmem.putmem_block(my_base + dst_offset, src_addr, nbytes, pe)
    else:
        copy_bytes(peer_base + dst_offset, src_addr, nbytes)


@triton.jit
def signal(my_base, peer_base, signal_offset, value, SIG_OP: tl.constexpr, pe, VIA: tl.constexpr):
    """Set or add to a peer's 64-bit signal after this program's earlier puts to it."""
    if VIA == VIA_NVSHMEM:
        tl.debug_barrier()
        nvshmem.fence()
        nvshmem.signal_op(my_base + signal_offset, value, SIG_OP, pe)
    else:
        flag = (peer_base + signal_offset).to(tl.pointer_type(tl.int64))
        if SIG_OP == SIGNAL_SET:
            store_release(flag, value)
        else:
            add_release(flag, value)


@triton.jit
def put_ring_slots(
    my_base,
    peer_base,
    ring_offset,
    mirror,
    first,
    last,
    tail_offset,
    tag,
    pe,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    VIA: tl.constexpr,
):
    """Ring positions ``[first, last)`` of a staged mirror ring go to the same slots of the
    peer's ring at ``ring_offset`` (two puts when they wrap around its end); then the peer's
    tail becomes ``tag | last``."""
    if last > first:
        n = last - first
        at = first % RING
        part = tl.minimum(n, RING - at)
        offset = at.to(tl.int64) * SLOT_BYTES
        put_block(
            my_base,
            peer_base,
            ring_offset + offset,
            mirror + offset,
            part.to(tl.int64) * SLOT_BYTES,
            pe,
            VIA,
        )
        if n > part:
            put_block(
                my_base,
                peer_base,
                ring_offset,
                mirror,
                (n - part).to(tl.int64) * SLOT_BYTES,
                pe,
                VIA,
            )
        signal(my_base, peer_base, tail_offset, tag | last.to(tl.int64), SIGNAL_SET, pe, VIA)


@triton.jit
def put_rings(
    my_base,
    peer_base,
    lanes,
    ring_offset,
    rings,
    first,
    last,
    tail_offset,
    tag,
    pe_ptr,
    NUM_RANKS: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    VIA: tl.constexpr,
):
    """A sender's step is complete: every peer ``p`` with ``last[p] > first[p]`` gets its tail
    at ``tail_offset`` set to ``tag | last[p]`` (release), after the ring positions
    ``[first[p], last[p])``. With ``VIA_STORE`` the rows are already in the peers' rings
    (``rings`` point there); staged, they are put from this rank's mirrors ``rings``."""
    if VIA == VIA_STORE:
        tail = (peer_base + tail_offset).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(tail, tag | last.to(tl.int64), mask=last > first, sem="release", scope="sys")
    else:
        for p in range(NUM_RANKS):  # a loop, not unrolled: one put body
            put_ring_slots(
                my_base,
                lane(peer_base, lanes, p),
                ring_offset,
                lane(rings, lanes, p),
                lane(first, lanes, p),
                lane(last, lanes, p),
                tail_offset,
                tag,
                tl.load(pe_ptr + p),
                RING,
                SLOT_BYTES,
                VIA,
            )


@triton.jit
def set_peer_flags(
    my_base,
    peer_base,
    lanes,
    flag_offset,
    values,
    mask,
    pe_ptr,
    NUM_RANKS: tl.constexpr,
    VIA: tl.constexpr,
    SEM: tl.constexpr,
):
    """Set the 64-bit flag at ``flag_offset`` on every peer ``p`` with ``mask[p]`` to
    ``values[p]`` (``peer_base`` and ``values`` are ``[lanes]``): one vector store with ``SEM``
    into mapped peers, else one signal (a release) per peer."""
    if VIA == VIA_STORE:
        flags = (peer_base + flag_offset).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags, values, mask=mask, sem=SEM, scope="sys")
    else:
        for p in range(NUM_RANKS):  # a loop, not unrolled
            if lane(mask.to(tl.int32), lanes, p) > 0:
                signal(
                    my_base,
                    lane(peer_base, lanes, p),
                    flag_offset,
                    lane(values, lanes, p),
                    SIGNAL_SET,
                    tl.load(pe_ptr + p),
                    VIA,
                )
