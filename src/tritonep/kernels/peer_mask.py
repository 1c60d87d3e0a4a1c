"""Shrink mode of the low-latency kernels: a peer that stops answering is masked, calls go on.

A serving job whose rank dies should lose that rank's experts, not the job. A low-latency
launch compiled with ``SHRINK`` reads an ``[R]`` int32 *mask* (1 = masked): it sends nothing to
a masked peer, waits for nothing from it, and drops the top-k choices of the experts it owns
(as if their ids were ``-1``). A wait that gives up then raises nothing: the peer is masked
instead, and the call completes without it.

Agreement. Several programs of one launch wait for the same peer, each with its own deadline,
so a peer that answers just at the limit could be seen by one and not by another, and the
programs would then disagree on counts and row offsets. Each (peer, call) therefore gets one
*verdict*: the first program to decide (it saw the peer's signal, or its wait gave up) writes
``tag << 1 | timed_out`` with a compare-and-swap, and every other program adopts it. The tag is
the launch's call number, so verdicts need no reset. A program that skipped a wait because the
verdict already says "timed out" costs nothing, so a launch waits about one timeout per dead
peer however many waits it has.

Masking happens between launches. The last program of a receiving launch masks every peer
whose verdict says "timed out" (:func:`mask_timed_out`); the mask never changes while a launch
runs, so the send phase and the receive phase of one launch see the same mask, and host-side
updates apply in stream order. It also counts, per peer, the calls whose signal was not waited
for, so that a peer masked in step with this rank (both sides masking each other at the same
call) can be unmasked later: counters that only grow then still line up.

Without ``SHRINK`` none of this is compiled: the launch records a timeout for the host to raise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sync import load_acquire, wait_flag


@triton.jit
def masked(mask_ptr, ranks, active):
    """Whether each ``active`` rank is masked (plain loads: the mask is fixed during a launch)."""
    return tl.load(mask_ptr + ranks, mask=active, other=0) != 0


@triton.jit
def settle(verdict_ptr, tag, timed_out):
    """Agree on one verdict per (peer, call); returns the agreed ``timed_out``."""
    mine = (tag.to(tl.int64) << 1) | timed_out.to(tl.int64)
    old = tl.atomic_add(verdict_ptr, 0, sem="acquire", scope="gpu")
    decided = (old >> 1) == tag
    prev = old
    if not decided:
        prev = tl.atomic_cas(verdict_ptr, old, mine, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    agreed = tl.where(decided, old, tl.where(prev == old, mine, prev))
    return (agreed & 1) != 0


@triton.jit
def wait_peer(
    flag_ptr,
    target,
    timeout_ns,
    peer_masked,
    verdict_ptr,
    tag,
    USE_CLOCK: tl.constexpr,
    SHIFT: tl.constexpr = 0,
    AT_LEAST: tl.constexpr = False,
):
    """:func:`~tritonep.kernels.sync.wait_flag` for a peer that may be masked or dead.

    Returns ``(value, arrived)``. A masked peer, or one this call has already given up on, is
    not waited for; otherwise the wait's outcome is settled with the launch's other programs,
    and ``arrived`` is the agreed outcome (a flag that arrived after another program gave up
    counts as not arrived; one that another program saw counts as arrived and is read again).
    """
    value = tl.zeros((), tl.int64)
    arrived = tl.zeros((), tl.int1)
    if not peer_masked:
        known = tl.atomic_add(verdict_ptr, 0, sem="acquire", scope="gpu")
        if known != ((tag.to(tl.int64) << 1) | 1):
            value, ok = wait_flag(flag_ptr, target, timeout_ns, USE_CLOCK, SHIFT, AT_LEAST)
            timed_out = settle(verdict_ptr, tag, ok == 0)
            if (ok == 0) & (timed_out == 0):
                value = load_acquire(flag_ptr)
            arrived = timed_out == 0
    return value, arrived


@triton.jit
def gave_up(verdict_ptr, peers, tag, active):
    """Whether this call's verdict on each ``active`` peer is "timed out"."""
    verdicts = tl.load(verdict_ptr + peers, mask=active, other=0, volatile=True)
    return verdicts == ((tag.to(tl.int64) << 1) | 1)


@triton.jit
def mask_timed_out(
    mask_ptr, verdict_ptr, skipped_ptr, tag, NUM_RANKS: tl.constexpr, COUNT_SKIPS: tl.constexpr
):
    """Run by the last program of a receiving launch: mask the peers this call gave up on and
    (``COUNT_SKIPS``) count the calls each peer was not waited for."""
    for peer in range(NUM_RANKS):
        out = gave_up(verdict_ptr, peer, tag, True)
        if COUNT_SKIPS:
            skip = out | (tl.load(mask_ptr + peer) != 0)
            tl.store(skipped_ptr + peer, tl.load(skipped_ptr + peer) + 1, mask=skip)
        tl.store(mask_ptr + peer, 1, mask=out)
