"""Normal-mode combine: rows return along the channels of the dispatch and are summed per token.

The transpose of :mod:`.normal_dispatch`, over a second set of rings. On the rank that holds
the experts, program ``c < C`` (the *sender* of channel ``c``) hands back, for every source
rank at once, the rows that channel ``c`` of that source delivered: they are contiguous in the
combine input (``recv_start[source, c]`` on), so they stream in order into the source's ring
``(c, this rank)``, ``ROWS`` per source per step, each step published by a tagged tail. It never
blocks on one source: a full ring only skips that source for the step, so no cycle of full
rings can form between ranks.

On the rank that owns the tokens, program ``C + c`` (the *receiver* of channel ``c``) walks
its channel's tokens in order, ``TOK`` at a time. A token's row from rank ``d`` sits in ring
``(c, d)`` at the token's position among the channel's tokens sent to ``d`` (a running count
over ``is_token_in_rank``), so no index travels. It waits for the tails to cover the block, sums
the rows in float32 in rank order (a token sent nowhere gets zeros), adds the bias, stores
BF16, and returns the heads. With ``LOCAL`` (every launch but a relay's) a token's row from
this rank itself never enters a ring: the receiver reads it straight from the combine input
(``recv_start[rank, c]`` on, in the same order), so the senders move only rows that cross
NVLink.

Why it is fast: every row crosses NVLink once and no row is copied within a rank, each rank
has already reduced its own experts' outputs for a token into one row, the reduction reads
local memory only, and the sum costs no extra pass over the data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import from_bf16, to_bf16
from .normal_dispatch import channel_tokens, column, finish_call, free_rings, rows_before
from .sync import (
    aligned_ptr,
    elapsed_ns,
    first_lane,
    limit_ns,
    publish_rows,
    record_timeout,
    relay_flag,
    start_clock,
    wait_all_at_least,
)
from .trace import read_clock, trace_role
from .transport import VIA_STORE, put_rings, set_peer_flags

PHASE_COMBINE_SEND = tl.constexpr(13)
PHASE_COMBINE_RECV = tl.constexpr(14)
PHASE_COMBINE_RELAY = tl.constexpr(16)

COMBINE_CALLS = tl.constexpr(4)
COMBINE_ARRIVALS = tl.constexpr(5)


@triton.jit
def first_tile(x_words, start, sent, count, limit, steps, words, W: tl.constexpr,
               R_P2: tl.constexpr, ROWS: tl.constexpr, ZEROS: tl.constexpr, row_map_ptr,
               ROW_MAP: tl.constexpr):  # fmt: skip
    """The first payload tile ``[R_P2 * ROWS, BW]`` of a sender step: for every source rank,
    the next rows it still wants (``start + sent`` on, at most ``ROWS``, fewer than
    ``count - sent`` read as nothing). Rows from ``limit`` on read as zeros (``ZEROS``) or as
    row ``limit - 1`` (fewer registers). With ``ROW_MAP``, row ``r`` is read from input row
    ``row_map[r]``."""
    i = steps[None, :]
    row = tl.reshape((start[:, None] + sent[:, None] + i).to(tl.int64), (R_P2 * ROWS,))
    want = tl.reshape(i < (count - sent)[:, None], (R_P2 * ROWS,))
    if ZEROS:
        want = want & (row < limit)
    else:
        row = tl.minimum(row, tl.maximum(limit - 1, 0))
    if ROW_MAP:
        row = tl.load(row_map_ptr + row, mask=want, other=0).to(tl.int64)
    at = x_words + row[:, None] * W + words[None, :]
    return tl.load(at, mask=want[:, None] & (words < W)[None, :], other=0)


@triton.jit
def combine_send(
    channel,
    call,
    x_ptr,
    weights_ptr,
    recv_count_ptr,
    recv_start_ptr,
    peer_ptrs,
    rank,
    ring_offset,
    tail_offset,
    head_offset,
    stage_offset,
    pe_ptr,
    status_ptr,
    timeout_ns,
    num_rows,
    bounds_ptr,
    ready_ptr,
    H: tl.constexpr,
    K,  # top-k columns of the id and weight rows (a runtime value: one variant per K_P2)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BW: tl.constexpr,
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    VIA: tl.constexpr,
    AWAIT: tl.constexpr,
    LOCAL: tl.constexpr,
    RELEASE_STEPS: tl.constexpr,
    row_map_ptr,
    ROW_MAP: tl.constexpr,
    trace_ptr,
    PROFILE: tl.constexpr,
):
    """The sender of channel ``channel``: stream rows back to every source rank. Returns the
    time it polled without progress (with ``PROFILE``; 0 otherwise)."""
    W: tl.constexpr = H // 2
    tag = call << 32
    ranks = tl.arange(0, R_P2)
    rmask = ranks < NUM_RANKS
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    my_base = tl.load(peer_ptrs + rank)
    words = tl.arange(0, BW)
    ks = tl.arange(0, K_P2)
    kmask = ks < K

    count = tl.load(recv_count_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    if LOCAL:  # this rank's own rows are read from the input by its receiver
        count = tl.where(ranks == rank, 0, count)
    start = tl.load(recv_start_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    pair = channel * NUM_RANKS + rank
    ring_at = ring_offset + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)  # in each peer
    ring = peer_base + ring_at
    if VIA != VIA_STORE:
        # Rows are built in this rank's mirror of each source rank's ring, then put there.
        mirror_pairs = (channel * NUM_RANKS + ranks).to(tl.int64)
        ring = my_base + stage_offset + mirror_pairs * (RING_STRIDE * SLOT_BYTES)
    head_flag = my_base + head_offset + (channel * NUM_RANKS + ranks) * 8
    head_flag = head_flag.to(tl.pointer_type(tl.int64))
    sent = tl.zeros((R_P2,), tl.int32)
    steps = tl.arange(0, ROWS)
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    LAST: tl.constexpr = (W - 1) // BW * BW  # first word of a row's last tile
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int64)
    pending = tl.sum(count, 0)
    # Rows past the input (worst-case outputs that overflowed) or past what the relay will
    # flag (a relay that dropped its rows) are not read: the last row goes back in their
    # place, or zeros from a relay (whose rows past the limit were never written); the
    # overflow is reported, no source waits and nothing is read out of bounds.
    limit = num_rows
    if AWAIT:
        limit = tl.minimum(limit, tl.load(bounds_ptr + NUM_CHANNELS))
    # A step's heads and first tile are read before the previous step's release (a tile holds
    # every row a source still wants, up to ``ROWS``; a full ring only masks its stores), so
    # a step costs about one memory latency.
    heads = tl.atomic_add(head_flag, 0, mask=sent < count, sem="acquire", scope="sys")
    if not AWAIT:
        v = first_tile(x_words, start, sent, count, limit, steps, words, W, R_P2, ROWS, AWAIT,
                       row_map_ptr, ROW_MAP)  # fmt: skip
    starved = pending < 0  # waiting on the other leg's rows rather than on a peer
    waited = tl.zeros((), tl.int64)
    announced = sent  # rows up to here are announced by the tails
    unannounced = tl.zeros((), tl.int32)  # steps copied but not yet announced
    while (pending > 0) & (elapsed_ns(clock, spins, USE_CLOCK) < timeout_ns):
        if PROFILE:
            t_w = read_clock(trace_ptr, USE_CLOCK)
        waiting = sent < count
        # Free slots in this call; a head still tagged with an earlier call frees none.
        consumed = (heads & 0xFFFFFFFF).to(tl.int32)
        space = tl.where(waiting & ((heads >> 32) == call), RING - (sent - consumed), 0)
        take = tl.minimum(tl.minimum(space, count - sent), ROWS)
        if AWAIT:
            # Relayed rows: only those the other leg has flagged (a prefix per source; the
            # tile is read again after the flags, never before).
            nth = steps[None, :]
            at = (start[:, None] + sent[:, None] + nth).to(tl.int64)
            want = nth < take[:, None]
            flag = tl.atomic_add(ready_ptr + at, 0, mask=want, sem="acquire", scope="gpu")
            late = want & (at < limit) & (flag != (call + 1).to(tl.int32))
            ready = tl.min(tl.where(late, nth, ROWS), 1)
            starved = tl.max(take - ready, 0) > 0
            take = tl.minimum(take, ready)
            tl.debug_barrier()
            v = first_tile(x_words, start, sent, sent + take, limit, steps, words, W, R_P2,
                           ROWS, AWAIT, row_map_ptr, ROW_MAP)  # fmt: skip
        if tl.max(take, 0) > 0:
            i = steps[None, :]
            slot = ((sent[:, None] + i) % RING).to(tl.int64)
            dst = tl.reshape(ring[:, None] + slot * SLOT_BYTES, (R_P2 * ROWS,))
            row = tl.reshape((start[:, None] + sent[:, None] + i).to(tl.int64), (R_P2 * ROWS,))
            live = tl.reshape(i < take[:, None], (R_P2 * ROWS,))
            held = live
            if AWAIT:
                held = live & (row < limit)
            else:
                row = tl.minimum(row, tl.maximum(limit - 1, 0))
            if ROW_MAP:  # the input in the caller's order (no scatter of every row before)
                row = tl.load(row_map_ptr + row, mask=held, other=0).to(tl.int64)
            p = aligned_ptr(dst, tl.int32)
            rows = x_words + row[:, None] * W
            if HAS_WEIGHTS:
                m2 = live[:, None] & kmask[None, :]
                wv = tl.load(weights_ptr + row[:, None] * K + ks[None, :],
                             mask=held[:, None] & kmask[None, :], other=0.0)  # fmt: skip
            for w0 in range(0, LAST, BW):
                w = w0 + words
                wn = w + BW
                v_next = tl.load(rows + wn[None, :], mask=held[:, None] & (wn < W)[None, :],
                                 other=0)  # fmt: skip
                tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < W)[None, :])
                v = v_next
            w = LAST + words
            if AWAIT:  # the next tile is read after its flags, at the top of the next step
                tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < W)[None, :])
            else:
                v_next = first_tile(x_words, start, sent + take, count, limit, steps, words, W,
                                    R_P2, ROWS, AWAIT, row_map_ptr, ROW_MAP)  # fmt: skip
                tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < W)[None, :])
                v = v_next
            if HAS_WEIGHTS:
                wp = p.to(tl.pointer_type(tl.float32))
                tl.store(wp[:, None] + W + ks[None, :], wv, mask=m2)
            sent += take
            pending = tl.sum(count - sent, 0)
            heads = tl.atomic_add(head_flag, 0, mask=sent < count, sem="acquire", scope="sys")
            tl.debug_barrier()
            # One system-scope release per RELEASE_STEPS steps and after the last rows: each
            # waits for the stores before it to reach the peers.
            unannounced += 1
            if (unannounced >= RELEASE_STEPS) | (pending == 0):
                put_rings(my_base, peer_base, ranks, ring_at, ring, announced, sent,
                          tail_offset + pair * 8, tag, pe_ptr, NUM_RANKS, RING, SLOT_BYTES,
                          VIA)  # fmt: skip
                announced = sent
                unannounced = unannounced * 0
            clock = start_clock(USE_CLOCK)
            spins = tl.zeros((), tl.int64)
        else:
            if unannounced > 0:
                # Nothing fits: the slots come back only once the receivers have the rows
                # held back, so announce them before polling.
                tl.debug_barrier()
                put_rings(my_base, peer_base, ranks, ring_at, ring, announced, sent,
                          tail_offset + pair * 8, tag, pe_ptr, NUM_RANKS, RING, SLOT_BYTES,
                          VIA)  # fmt: skip
                announced = sent
                unannounced = unannounced * 0
            heads = tl.atomic_add(head_flag, 0, mask=waiting, sem="acquire", scope="sys")
            spins += 1
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
    if pending > 0:
        if starved:
            record_timeout(status_ptr, -1, PHASE_COMBINE_RELAY, timeout_ns, channel)
        else:
            peer = first_lane(sent < count, ranks)
            record_timeout(status_ptr, peer, PHASE_COMBINE_SEND, timeout_ns, channel)
    return waited


@triton.jit
def combine_receive(
    channel,
    call,
    in_rank_ptr,
    num_tokens,
    bias0_ptr,
    bias1_ptr,
    peer_ptrs,
    rank,
    ring_offset,
    tail_offset,
    head_offset,
    pe_ptr,
    out_ptr,
    out_weights_ptr,
    status_ptr,
    timeout_ns,
    bounds_ptr,
    ready_ptr,
    relay_call_ptr,
    H: tl.constexpr,
    K,  # top-k columns of the id and weight rows (a runtime value: one variant per K_P2)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,  # channels the rings are allocated for
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NUM_BIAS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    TOK: tl.constexpr,
    BW: tl.constexpr,
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    VIA: tl.constexpr,
    BOUNDS: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    x_ptr,
    weights_ptr,
    recv_start_ptr,
    num_rows,
    trace_ptr,
    PROFILE: tl.constexpr,
):
    """The receiver of channel ``channel``: sum each token's rows from all ranks (with
    ``LOCAL``, this rank's own rows straight from the input ``x_ptr``). Returns the time it
    waited for rows (with ``PROFILE``; 0 otherwise)."""
    W: tl.constexpr = H // 2
    tag = call << 32
    ranks = tl.arange(0, R_P2)
    rmask = ranks < NUM_RANKS
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    my_base = tl.load(peer_ptrs + rank)
    ks = tl.arange(0, K_P2)
    kmask = ks < K

    t0, t1 = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
    if PUBLISH:
        published = relay_flag(relay_call_ptr)
    pair = channel * NUM_RANKS + ranks
    ring = my_base + ring_offset + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)
    tail_flag = (my_base + tail_offset + pair * 8).to(tl.pointer_type(tl.int64))
    head_at = head_offset + (channel * NUM_RANKS + rank) * 8  # in each expert rank's heap
    taken = tl.zeros((R_P2,), tl.int32)
    arrived = tl.zeros((R_P2,), tl.int64)  # last tail value read, per expert rank
    budget = timeout_ns + tl.zeros((), tl.int64)
    waited = tl.zeros((), tl.int64)
    elems = tl.arange(0, 2 * BW)
    own = ranks < 0
    if LOCAL:
        own = ranks == rank
        # This rank's rows for the channel's tokens, in token order from here on (the order
        # its sender would have streamed them into its own ring).
        own_first = tl.load(recv_start_ptr + rank * NUM_CHANNELS + channel)
        last_row = tl.maximum(num_rows - 1, 0)
    for first in range(t0, t1, TOK):
        tokens = first + tl.arange(0, TOK)
        tmask = tokens < t1
        tokens64 = tokens.to(tl.int64)
        hit = tl.load(
            in_rank_ptr + tokens64[:, None] * NUM_RANKS + ranks[None, :],
            mask=tmask[:, None] & rmask[None, :],
            other=0,
        )
        hit = (hit != 0).to(tl.int32)
        count = tl.sum(hit, 0)
        target = tag | (taken + count).to(tl.int64)
        blocked = (count > 0) & (arrived < target) & ~own
        ok = tl.max(blocked.to(tl.int32), 0) == 0
        if not ok:
            if PROFILE:
                t_w = read_clock(trace_ptr, USE_CLOCK)
            values, ok = wait_all_at_least(tail_flag, target, blocked, budget, USE_CLOCK)
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
            arrived = tl.where(blocked, values, arrived)
            if not ok:
                peer = first_lane(blocked & (arrived < target), ranks)
                record_timeout(status_ptr, peer, PHASE_COMBINE_RECV, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
        # A row that never arrived is read as zeros: the host raises from the status.
        ready = hit * ((arrived >= target) | own).to(tl.int32)[None, :]
        nth = taken[None, :] + rows_before(hit, TOK)  # [TOK, R_P2] position in each ring
        slot = (nth % RING).to(tl.int64)
        src = ring[None, :] + slot * SLOT_BYTES  # [TOK, R_P2]
        if LOCAL:
            # Rows past the input (worst-case outputs that overflowed) read as the last row,
            # as the sender would have sent them.
            own_row = tl.minimum(own_first + column(nth, ranks, rank), last_row).to(tl.int64)
        for e0 in range(0, H, 2 * BW):
            e = e0 + elems
            em = e < H
            acc = tl.zeros((TOK, 2 * BW), tl.float32)
            for d in tl.static_range(NUM_RANKS):
                from_d = column(ready, ranks, d) > 0
                p = aligned_ptr(column(src, ranks, d), tl.bfloat16)
                if LOCAL:
                    p = tl.where(rank == d, x_ptr + own_row * H, p)
                y = tl.load(
                    p[:, None] + e[None, :],
                    mask=from_d[:, None] & em[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                acc += from_bf16(y, not USE_CLOCK)
            m2 = tmask[:, None] & em[None, :]
            at = tokens64[:, None] * H + e[None, :]
            if NUM_BIAS >= 1:
                acc += from_bf16(tl.load(bias0_ptr + at, mask=m2, other=0.0), not USE_CLOCK)
            if NUM_BIAS >= 2:
                acc += from_bf16(tl.load(bias1_ptr + at, mask=m2, other=0.0), not USE_CLOCK)
            tl.store(out_ptr + at, to_bf16(acc, not USE_CLOCK), mask=m2)
        if HAS_WEIGHTS:
            wacc = tl.zeros((TOK, K_P2), tl.float32)
            for d in tl.static_range(NUM_RANKS):
                from_d = column(ready, ranks, d) > 0
                wp = column(src, ranks, d).to(tl.pointer_type(tl.float32)) + W
                if LOCAL:
                    wp = tl.where(rank == d, weights_ptr + own_row * K, wp)
                wv = tl.load(
                    wp[:, None] + ks[None, :],
                    mask=from_d[:, None] & kmask[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                wacc += wv
            at = tokens64[:, None] * K + ks[None, :]
            tl.store(out_weights_ptr + at, wacc, mask=tmask[:, None] & kmask[None, :])
        if PUBLISH:
            publish_rows(ready_ptr + tokens64, published, tmask)
        taken += count
        tl.debug_barrier()
        # Relaxed: the rows' loads have returned (their sums are stored), so a sender's
        # overwrite cannot reach them; a release would add a system-wide fence per block.
        set_peer_flags(my_base, peer_base, ranks, head_at, tag | taken.to(tl.int64),
                       (count > 0) & ~own, pe_ptr, NUM_RANKS, VIA, SEM="relaxed")  # fmt: skip
    tl.debug_barrier()
    free_rings(call, channel, head_offset, rank, my_base, peer_base, ranks, rmask, pe_ptr,
               NUM_RANKS, NUM_CHANNELS, MAX_CHANNELS, VIA)  # fmt: skip
    return waited


@triton.jit(do_not_specialize=["timeout_us", "K"])
def normal_combine_kernel(
    x_ptr,  # [M, H] bf16 rows to hand back, one per row received in dispatch
    weights_ptr,  # [M, K] float32 weights handed back with the rows (optional)
    in_rank_ptr,  # [N, R] int8 is_token_in_rank of the dispatch
    num_tokens,
    num_rows,  # M
    bias0_ptr,  # [N, H] bf16 (optional)
    bias1_ptr,  # [N, H] bf16 (optional)
    recv_count_ptr,  # [R, C] int32 rows each (source, channel) delivered here
    recv_start_ptr,  # [R, C] int32 first row of each (source, channel)
    peer_ptrs,
    rank,
    ring_offset,  # byte offset of the rings [C][R expert rank][RING][SLOT_BYTES]
    tail_offset,  # [C][R expert rank] int64 on the token owner (written by senders)
    head_offset,  # [C][R token owner] int64 on the expert rank (written by receivers)
    stage_offset,  # byte offset of the mirror rings [C][R token owner] (VIA != VIA_STORE)
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    state_ptr,
    out_ptr,  # [N, H] bf16
    out_weights_ptr,  # [N, K] float32 (optional)
    status_ptr,
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS); with AWAIT, [C] is the
    # number of input rows the relay flags (the others are not read)
    ready_ptr,  # [rows] int32 per-row flags: awaited on the input (AWAIT), set on the output
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    row_map_ptr,  # [M] int32 row of x that holds each received row (ROW_MAP)
    K,  # top-k columns of the weight rows (not specialized: one variant per K_P2)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE)
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NUM_BIAS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    TOK: tl.constexpr,
    ROWS: tl.constexpr,
    BW: tl.constexpr,  # words (2 BF16 values) per copy step; the sum runs over 2 * BW values
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr = VIA_STORE,
    BOUNDS: tl.constexpr = False,  # token channels are the ranges in bounds_ptr
    AWAIT: tl.constexpr = False,  # wait for each input row's flag (call + 1) before sending it
    PUBLISH: tl.constexpr = False,  # flag each output token once summed
    LOCAL: tl.constexpr = True,  # receivers read this rank's own rows from x (off with AWAIT)
    RELEASE_STEPS: tl.constexpr = 1,  # sender steps per tail release
    ROW_MAP: tl.constexpr = False,  # received row r is row row_map[r] of x (senders only)
):
    # The receivers read own rows in the received order: a map is for relays (no LOCAL).
    tl.static_assert(not (LOCAL and ROW_MAP))
    timeout_ns = limit_ns(timeout_us, status_ptr)
    pid = tl.program_id(0)
    call = tl.load(state_ptr + COMBINE_CALLS, volatile=True)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    sends = pid < NUM_CHANNELS
    if sends:
        waited = combine_send(
            pid,
            call,
            x_ptr,
            weights_ptr,
            recv_count_ptr,
            recv_start_ptr,
            peer_ptrs,
            rank,
            ring_offset,
            tail_offset,
            head_offset,
            stage_offset,
            pe_ptr,
            status_ptr,
            timeout_ns,
            num_rows,
            bounds_ptr,
            ready_ptr,
            H,
            K,
            NUM_RANKS,
            NUM_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            HAS_WEIGHTS,
            USE_CLOCK,
            ROWS,
            BW,
            R_P2,
            K_P2,
            VIA,
            AWAIT,
            LOCAL,
            RELEASE_STEPS,
            row_map_ptr,
            ROW_MAP,
            trace_ptr,
            PROFILE,
        )
    else:
        waited = combine_receive(
            pid - NUM_CHANNELS,
            call,
            in_rank_ptr,
            num_tokens,
            bias0_ptr,
            bias1_ptr,
            peer_ptrs,
            rank,
            ring_offset,
            tail_offset,
            head_offset,
            pe_ptr,
            out_ptr,
            out_weights_ptr,
            status_ptr,
            timeout_ns,
            bounds_ptr,
            ready_ptr,
            relay_call_ptr,
            H,
            K,
            NUM_RANKS,
            NUM_CHANNELS,
            MAX_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            HAS_WEIGHTS,
            NUM_BIAS,
            USE_CLOCK,
            TOK,
            BW,
            R_P2,
            K_P2,
            VIA,
            BOUNDS,
            PUBLISH,
            LOCAL,
            x_ptr,
            weights_ptr,
            recv_start_ptr,
            num_rows,
            trace_ptr,
            PROFILE,
        )
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), sends, waited,
                   USE_CLOCK)  # fmt: skip
    finish_call(state_ptr, call, COMBINE_ARRIVALS, COMBINE_CALLS)
