"""Normal-mode notify: every rank learns how many tokens each peer sends it, per channel and expert.

The count exchange that comes before the payload. Program ``p`` counts the tokens of each
channel (a contiguous token range) that go to rank ``p`` and stores those counts, with the
number of top-k entries for each of ``p``'s experts, into ``p``'s notify row for this rank,
encoded ``-n - 1`` so that zero always means "not arrived yet". It then waits (bounded) for
the row that rank ``p`` stored here, decodes it and zeroes it for a later call. The last
program to arrive turns the rows of all sources into the receiver's layout:

* ``recv_count[s, c]``: tokens that channel ``c`` of source ``s`` sends here;
* ``recv_start[s, c]``: the first output row of that stream, so that rows come ordered by
  source rank, then by channel (hence by source token index);
* ``host_info = [total rows, tokens per local expert rounded up to the alignment...]``, the
  only numbers the host reads in exact mode.

Two options serve the relay across nodes (:mod:`tritonep.modes.internode`): the per-channel
counts may be given instead of counted (``COUNTS_GIVEN``: a relay knows what it will forward
before its rows arrive), and a row may carry ``EXTRA`` more words per peer (``extra_ptr`` sent,
``extra_out_ptr`` received), with which a source tells the relay what to forward where.
``CHANNEL_MAJOR`` lays the received rows out channel by channel (then by source), so that each
channel's rows are one contiguous range.

Why it is cheap: one small launch of ``R`` programs, a few hundred bytes per peer, no atomics
on data. Rows alternate between two sets by call parity; a rank can only store into a set
again after every peer has finished the call that last read it, so the zeroing never races.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sync import STATUS_OVERFLOW, elapsed_ns, limit_ns, record_timeout, start_clock
from .trace import read_clock, trace_role
from .transport import VIA_STORE, put_block

PHASE_NOTIFY = tl.constexpr(10)

# Device state counters (int64) of the normal mode.
NOTIFY_CALLS = tl.constexpr(0)
NOTIFY_ARRIVALS = tl.constexpr(1)


@triton.jit
def all_nonzero(a, b, c):
    """Whether no word of three masked vectors (masked lanes read ``-1``) is zero."""
    return (
        tl.min(tl.where(a != 0, 1, 0), 0)
        * tl.min(tl.where(b != 0, 1, 0), 0)
        * tl.min(tl.where(c != 0, 1, 0), 0)
    ) > 0


@triton.jit(do_not_specialize=["timeout_us"])
def notify_kernel(
    in_rank_ptr,  # [N, R] int8 (is_token_in_rank), or [R, C] int32 counts (COUNTS_GIVEN)
    num_tokens,
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank
    peer_ptrs,  # [R] int64 heap base addresses
    rank,
    notify_offset,  # byte offset of set 0 of the notify rows [R][ROW] int32
    stage_offset,  # byte offset of the staged rows [R destination][ROW] (VIA != VIA_STORE)
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    state_ptr,  # [8] int64 device call counters
    decoded_ptr,  # [R, E_LOCAL] int32 workspace: expert counts from each source
    recv_count_ptr,  # [R, C] int32 out
    recv_start_ptr,  # [R, C] int32 out
    host_info_ptr,  # [1 + E_LOCAL] int32 out: total rows, aligned tokens per local expert
    max_rows,  # rows the outputs hold (worst-case mode), 0 = unlimited
    extra_ptr,  # [R, EXTRA] int32 sent to each peer (EXTRA > 0)
    extra_out_ptr,  # [R, EXTRA] int32 received from each source (EXTRA > 0)
    status_ptr,  # [STATUS_WORDS] int32
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    trace_ptr,  # [R * SLOTS + 1] int64 readings (PROFILE)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    ALIGN: tl.constexpr,
    ROW: tl.constexpr,  # int32 words per notify row (>= NUM_CHANNELS + E_LOCAL)
    SET_BYTES: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    C_P2: tl.constexpr,  # power of two > NUM_CHANNELS (the last bin collects other ranks)
    E_P2: tl.constexpr,
    R_P2: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr = VIA_STORE,
    COUNTS_GIVEN: tl.constexpr = False,
    EXTRA: tl.constexpr = 0,  # extra words per row (at NUM_CHANNELS + E_LOCAL)
    X_P2: tl.constexpr = 2,
    CHANNEL_MAJOR: tl.constexpr = False,
):
    timeout_ns = limit_ns(timeout_us, status_ptr)
    peer = tl.program_id(0)
    call = tl.load(state_ptr + NOTIFY_CALLS, volatile=True)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    set_off = (call % 2) * SET_BYTES
    channels = tl.arange(0, C_P2)
    experts = tl.arange(0, E_P2)

    # Send: per-channel token counts and per-expert entry counts for rank `peer`.
    if COUNTS_GIVEN:
        given = in_rank_ptr.to(tl.pointer_type(tl.int32)) + peer * NUM_CHANNELS
        counts = tl.load(given + channels, mask=channels < NUM_CHANNELS, other=0)
    else:
        chunk = tl.cdiv(num_tokens, NUM_CHANNELS)
        counts = tl.zeros((C_P2,), tl.int32)
        for first in range(0, num_tokens, BLOCK_N):
            tokens = first + tl.arange(0, BLOCK_N)
            column = in_rank_ptr + tokens.to(tl.int64) * NUM_RANKS + peer
            hit = tl.load(column, mask=tokens < num_tokens, other=0)
            channel = tl.where(hit != 0, tokens // tl.maximum(chunk, 1), C_P2 - 1)
            counts += tl.histogram(channel, C_P2)
    peer_base = tl.load(peer_ptrs + peer)
    row_offset = notify_offset + set_off + rank * ROW * 4
    row = peer_base + row_offset
    if VIA != VIA_STORE:  # staged in this rank's heap, then put into the peer's row
        row = tl.load(peer_ptrs + rank) + stage_offset + peer * ROW * 4
    peer_row = row.to(tl.pointer_type(tl.int32))
    tl.store(peer_row + channels, -counts - 1, mask=channels < NUM_CHANNELS)
    entries = tl.load(per_expert_ptr + peer * E_LOCAL + experts, mask=experts < E_LOCAL)
    tl.store(peer_row + NUM_CHANNELS + experts, -entries - 1, mask=experts < E_LOCAL)
    xs = tl.arange(0, X_P2)
    xmask = xs < EXTRA
    if EXTRA > 0:
        more = tl.load(extra_ptr + peer * EXTRA + xs, mask=xmask)
        tl.store(peer_row + NUM_CHANNELS + E_LOCAL + xs, -more - 1, mask=xmask)
    if VIA != VIA_STORE:
        # No signal: the receiver waits for every word to be non-zero.
        put_block(tl.load(peer_ptrs + rank), peer_base, row_offset, row, ROW * 4,
                  tl.load(pe_ptr + peer), VIA)  # fmt: skip

    # Receive the row of source `peer`: every value is non-zero once it has arrived.
    my_row = tl.load(peer_ptrs + rank) + notify_offset + set_off + peer * ROW * 4
    my_row = my_row.to(tl.pointer_type(tl.int32))
    cmask = channels < NUM_CHANNELS
    emask = experts < E_LOCAL
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int64)
    my_extra = my_row + NUM_CHANNELS + E_LOCAL
    got_c = tl.load(my_row + channels, mask=cmask, other=-1, volatile=True)
    got_e = tl.load(my_row + NUM_CHANNELS + experts, mask=emask, other=-1, volatile=True)
    got_x = tl.load(my_extra + xs, mask=xmask, other=-1, volatile=True)
    arrived = all_nonzero(got_c, got_e, got_x)
    while (not arrived) & (elapsed_ns(clock, spins, USE_CLOCK) < timeout_ns):
        spins += 1
        got_c = tl.load(my_row + channels, mask=cmask, other=-1, volatile=True)
        got_e = tl.load(my_row + NUM_CHANNELS + experts, mask=emask, other=-1, volatile=True)
        got_x = tl.load(my_extra + xs, mask=xmask, other=-1, volatile=True)
        arrived = all_nonzero(got_c, got_e, got_x)
    if not arrived:
        record_timeout(status_ptr, peer, PHASE_NOTIFY, timeout_ns)
    # A source that never arrived counts as sending nothing; the host raises from the status.
    got_c = tl.where(arrived, -got_c - 1, 0)
    got_e = tl.where(arrived, -got_e - 1, 0)
    tl.store(recv_count_ptr + peer * NUM_CHANNELS + channels, got_c, mask=cmask)
    tl.store(decoded_ptr + peer * E_LOCAL + experts, got_e, mask=emask)
    tl.store(my_row + channels, tl.zeros((C_P2,), tl.int32), mask=cmask)
    tl.store(my_row + NUM_CHANNELS + experts, tl.zeros((E_P2,), tl.int32), mask=emask)
    if EXTRA > 0:
        tl.store(extra_out_ptr + peer * EXTRA + xs, tl.where(arrived, -got_x - 1, 0), mask=xmask)
        tl.store(my_extra + xs, tl.zeros((X_P2,), tl.int32), mask=xmask)

    # The last program lays out the received rows: source rank major, then channel.
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), True, 0, USE_CLOCK)
    tl.debug_barrier()
    done = tl.atomic_add(state_ptr + NOTIFY_ARRIVALS, 1, sem="acq_rel", scope="gpu")
    if done == NUM_RANKS - 1:
        ranks = tl.arange(0, R_P2)
        grid = ranks[:, None] * NUM_CHANNELS + channels[None, :]
        gmask = (ranks[:, None] < NUM_RANKS) & cmask[None, :]
        n = tl.load(recv_count_ptr + grid, mask=gmask, other=0, volatile=True)
        if CHANNEL_MAJOR:
            flat = tl.reshape(tl.trans(n), (C_P2 * R_P2,))
            start = tl.trans(tl.reshape(tl.cumsum(flat, 0) - flat, (C_P2, R_P2)))
        else:
            flat = tl.reshape(n, (R_P2 * C_P2,))
            start = tl.reshape(tl.cumsum(flat, 0) - flat, (R_P2, C_P2))
        tl.store(recv_start_ptr + grid, start, mask=gmask)
        total = tl.sum(flat, 0)
        per_source = tl.load(
            decoded_ptr + ranks[:, None] * E_LOCAL + experts[None, :],
            mask=(ranks[:, None] < NUM_RANKS) & emask[None, :],
            other=0,
            volatile=True,
        )
        per_expert = tl.sum(per_source, 0)
        per_expert = (per_expert + ALIGN - 1) // ALIGN * ALIGN
        tl.store(host_info_ptr, total)
        tl.store(host_info_ptr + 1 + experts, per_expert, mask=emask)
        if (max_rows > 0) & (total > max_rows):
            record_timeout(status_ptr, -1, PHASE_NOTIFY, 0, total, STATUS_OVERFLOW)
        tl.store(state_ptr + NOTIFY_ARRIVALS, 0)
        tl.store(state_ptr + NOTIFY_CALLS, call + 1)
