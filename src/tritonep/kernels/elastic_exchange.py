"""The elastic mode's handshake: every push of rows ends with a tag to every peer.

The elastic mode (:mod:`tritonep.modes.elastic`) moves rows in *exchanges*: a dispatch or a
combine, in which every rank stores rows straight into fixed slots of its peers' heaps and
then tells each peer that it is done. Its heap holds, per rank:

* headers ``[2 parities][R sources][HEADER_WORDS]`` int32: word 0 the tag of the exchange
  (its number + 1), then what the source says about its rows (a dispatch: the number of
  tokens it sent here and, per local expert of this rank, how many of their top-k choices
  name that expert);
* barrier flags ``[R]`` int32;
* two regions of rows, one per parity (exchange ``n`` uses region ``n % 2``).

Exchange ``n`` of a rank stores into region ``n % 2`` of its peers only after it has seen
every peer's tag of exchange ``n - 1``, which each peer sends after it has consumed exchange
``n - 2`` (its epilogue runs before its next exchange on its stream). So two regions suffice
and nothing is ever reset: the tags only grow. Every rank must make the same sequence of
dispatches and combines.

The last program of a launch to finish its stores (:func:`arrive`) sends the tags and waits
(bounded) for the peers' tags; a wait that gives up records the peer in the status and the
exchange ends anyway, so later launches do not wait again (:mod:`tritonep.kernels.sync`).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .phases import ELASTIC_BARRIER
from .profiled import kernel
from .sync import first_lane, limit_ns, record_timeout, wait_all_at_least
from .trace import read_clock


class ElasticShared(NamedTuple):
    """The trailing runtime arguments of every elastic kernel, in their order: what stays the
    same from call to call of one mode (a kernel ignores those it does not need)."""

    peer_ptrs: object  # [R] int64 heap base of every rank
    rank: int  # this rank
    header_offset: int  # byte offset of the headers [2][R][HEADER_WORDS] int32
    barrier_offset: int  # byte offset of the [R] int32 barrier flags
    region_offset: int  # byte offset of region 0 (region 1 follows at + region_bytes)
    region_bytes: int  # bytes of a region
    state_ptr: object  # [8] int64 mode state
    status_ptr: object  # [STATUS_WORDS] int32 status record (kernels.status)
    timeout_us: int  # limit of a wait in microseconds (sync.timeout_us)


class BarrierCall(NamedTuple):
    """The leading runtime arguments of :func:`elastic_barrier`: none."""


class BarrierVariant(NamedTuple):
    """One compiled variant of :func:`elastic_barrier`: its constexprs, in order."""

    NUM_RANKS: int
    BLOCK_RANKS: int
    USE_CLOCK: bool


# int64 words of the mode's state tensor.
EXCHANGES = tl.constexpr(0)  # exchanges completed
ARRIVALS = tl.constexpr(1)  # programs of the running launch done with their stores
BARRIERS = tl.constexpr(2)  # barriers completed
#: host address of ``[written flag, R x (1 + E_local) counts]`` int32 (page-locked), where a
#: push with ``FLAG_HOST_COUNTS`` writes what each source sent here (an exact-size call's read)
HOST_COUNTS = tl.constexpr(3)


@triton.jit
def exchange_number(state_ptr):
    """The number of the exchange this launch takes part in (exchanges completed so far)."""
    return tl.load(state_ptr + EXCHANGES, volatile=True)


@triton.jit
def arrive(state_ptr):
    """Count this program as done with its stores; True in the last program of the launch
    (whose later stores are then ordered after every other program's)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(state_ptr + ARRIVALS, 1, sem="acq_rel", scope="sys")
    return arrived == tl.num_programs(0) - 1


@triton.jit
def header_ptr(
    base, header_offset, parity, source, word, HEADER_WORDS: tl.constexpr, NUM_RANKS: tl.constexpr
):
    """Word ``word`` of the header that ``source`` writes, for exchanges of ``parity``, in the
    heap at ``base`` (vectors broadcast)."""
    at = header_offset + ((parity * NUM_RANKS + source) * HEADER_WORDS + word) * 4
    return (base + at).to(tl.pointer_type(tl.int32))


@triton.jit
def send_tags(
    call,
    peer_base,
    rank,
    ranks,
    header_offset,
    HEADER_WORDS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
):
    """Send exchange ``call``'s tag to every peer (after this program's stores, and so, through
    :func:`arrive`, after every program's)."""
    tag = (call + 1).to(tl.int32)
    theirs = header_ptr(peer_base, header_offset, call % 2, rank, 0, HEADER_WORDS, NUM_RANKS)
    tl.debug_barrier()
    tl.atomic_xchg(
        theirs,
        tag + tl.zeros(ranks.shape, tl.int32),
        mask=ranks < NUM_RANKS,
        sem="release",
        scope="sys",
    )


@triton.jit
def wait_tags(
    call,
    my_base,
    ranks,
    header_offset,
    status_ptr,
    timeout_us,
    PHASE: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    """Wait for every peer's tag of exchange ``call``. Returns whether all came; a missing
    peer is recorded in the status."""
    rmask = ranks < NUM_RANKS
    tag = (call + 1).to(tl.int32)
    mine = header_ptr(my_base, header_offset, call % 2, ranks, 0, HEADER_WORDS, NUM_RANKS)
    targets = tag + tl.zeros(ranks.shape, tl.int32)
    values, ok = wait_all_at_least(
        mine, targets, rmask, limit_ns(timeout_us, status_ptr), USE_CLOCK
    )
    if not ok:
        peer = first_lane(rmask & (values < targets), ranks)
        record_timeout(status_ptr, peer, PHASE, limit_ns(timeout_us, status_ptr))
    return ok


@triton.jit
def wait_for_push(trace_ptr, PDL: tl.constexpr, PROFILE: tl.constexpr, USE_CLOCK: tl.constexpr):
    """An epilogue's start: under ``PDL`` wait for its push's grid (complete, its writes
    visible) before any read. Returns the trace readings before and after the wait (the
    wait phase: how long the launch, started early, sat ready)."""
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    if PDL:
        gdc_wait()
    t_waited = t_start
    if PROFILE:
        t_waited = read_clock(trace_ptr, USE_CLOCK)
    return t_start, t_waited


@triton.jit
def finish_exchange(state_ptr, call):
    """Close exchange ``call`` (in the last program, after its wait): the next launch takes
    part in the next exchange."""
    tl.store(state_ptr + ARRIVALS, 0)
    tl.store(state_ptr + EXCHANGES, call + 1)


@kernel("tritonep::elastic::barrier", do_not_specialize=["timeout_us"])
def elastic_barrier(
    peer_ptrs,  # ElasticShared: [R] int64 heap base of every rank
    rank,  # this rank
    header_offset,  # (unused)
    barrier_offset,  # byte offset of the [R] int32 barrier flags
    region_offset,  # (unused)
    region_bytes,  # (unused)
    state_ptr,  # [8] int64 mode state
    status_ptr,  # [STATUS_WORDS] int32
    timeout_us,  # limit of the wait, in microseconds (sync.timeout_us)
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS as a power of two (at least 2)
    USE_CLOCK: tl.constexpr,  # waits read the GPU clock (not under the interpreter)
):
    """One program: every rank stores its barrier count into every peer, then waits for all."""
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    count = (tl.load(state_ptr + BARRIERS, volatile=True) + 1).to(tl.int32)
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    theirs = (peer_base + barrier_offset + rank * 4).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(
        theirs, count + tl.zeros((BLOCK_RANKS,), tl.int32), mask=rmask, sem="release", scope="sys"
    )
    my_base = tl.load(peer_ptrs + rank)
    mine = (my_base + barrier_offset + ranks * 4).to(tl.pointer_type(tl.int32))
    targets = count + tl.zeros((BLOCK_RANKS,), tl.int32)
    values, ok = wait_all_at_least(
        mine, targets, rmask, limit_ns(timeout_us, status_ptr), USE_CLOCK
    )
    if not ok:
        peer = first_lane(rmask & (values < targets), ranks)
        record_timeout(status_ptr, peer, ELASTIC_BARRIER, limit_ns(timeout_us, status_ptr))
    tl.store(state_ptr + BARRIERS, count.to(tl.int64))
