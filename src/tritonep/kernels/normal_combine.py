"""Normal-mode combine: rows return along the channels of the dispatch and are summed per token.

The transpose of :mod:`.normal_dispatch`, over a second set of rings. On the rank that holds
the experts, program ``c < C`` (the *sender* of channel ``c``) hands back, for every source
rank at once, the rows that channel ``c`` of that source delivered: they are contiguous in the
combine input (``recv_start[source, c]`` on), so they stream in order into the source's ring
``(c, this rank)``, ``BLOCK_ROWS`` per source per step, each step published by a tagged tail.
It never blocks on one source: a full ring only skips that source for the step, so no cycle of
full rings can form between ranks.

On the rank that owns the tokens, program ``C + c`` (the *receiver* of channel ``c``) walks
its channel's tokens in order, ``BLOCK_TOKENS`` at a time. A token's row from rank ``d`` sits in
ring ``(c, d)`` at the token's position among the channel's tokens sent to ``d`` (a running
count over ``is_token_in_rank``), so no index travels. It waits for the tails to cover the
block, sums the rows in float32 in rank order (a token sent nowhere gets zeros), adds the bias,
stores BF16, and returns the heads. With ``LOCAL`` (every launch but a relay's) a token's row
from this rank itself never enters a ring: the receiver reads it straight from the combine
input (``recv_start[rank, c]`` on, in the same order), so the senders move only rows that cross
NVLink. A token one of whose rows never arrived (a wait that gave up) sums to NaN, and so do
its weights: a failed call never returns sums that pass for data.

Why it is fast: every row crosses NVLink once and no row is copied within a rank, each rank
has already reduced its own experts' outputs for a token into one row, the reduction reads
local memory only, and the sum costs no extra pass over the data. Token and row counts and
top-k are run-time values: a new batch compiles nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .fp8 import from_bf16, to_bf16
from .normal_dispatch import (
    announce,
    channel_tokens,
    finish_call,
    free_rings,
    peer_heaps,
    receive_rings,
    send_rings,
)
from .phases import COMBINE_RECV, COMBINE_RELAY, COMBINE_SEND
from .sync import (
    aligned_ptr,
    first_lane,
    keep_waiting,
    lane,
    limit_ns,
    publish_rows,
    record_timeout,
    relay_flag,
    rows_before,
    start_clock,
    wait_all_at_least,
)
from .trace import read_clock, trace_role
from .transport import set_peer_flags

COMBINE_CALLS = tl.constexpr(4)
COMBINE_ARRIVALS = tl.constexpr(5)


class CombineCall(NamedTuple):
    """The leading runtime arguments of :func:`normal_combine_kernel`: what changes per call
    (None: a pointer the variant does not read)."""

    x_ptr: object
    weights_ptr: object
    in_rank_ptr: object
    num_tokens: int
    num_rows: int
    K: int
    bias0_ptr: object
    bias1_ptr: object
    recv_count_ptr: object
    recv_start_ptr: object
    out_ptr: object
    out_weights_ptr: object
    bounds_ptr: object
    ready_ptr: object
    relay_call_ptr: object
    row_map_ptr: object
    trace_ptr: object


class CombineVariant(NamedTuple):
    """One compiled variant of :func:`normal_combine_kernel`: its constexprs, in order."""

    H: int
    NUM_RANKS: int
    NUM_CHANNELS: int
    MAX_CHANNELS: int
    RING: int
    RING_STRIDE: int
    SLOT_BYTES: int
    RING_OFFSET: int
    TAIL_OFFSET: int
    HEAD_OFFSET: int
    STAGE_OFFSET: int
    HAS_WEIGHTS: bool
    NUM_BIAS: int
    BOUNDS: bool
    AWAIT: bool
    PUBLISH: bool
    LOCAL: bool
    X_ALIGNED: bool
    ROW_MAP: bool
    RELEASE_STEPS: int
    USE_CLOCK: bool
    BLOCK_TOKENS: int
    BLOCK_ROWS: int
    BLOCK_WORDS: int
    BLOCK_RANKS: int
    BLOCK_K: int
    PROFILE: bool
    VIA: int


# ------------------------------------------------------------------------------------ sender


@triton.jit
def first_tile(
    x_words,  # [M, ROW_WORDS] int32 the rows to hand back, as words
    start,  # [BLOCK_RANKS] int32 first input row of each source rank's stream
    sent,  # [BLOCK_RANKS] int32 rows of each stream sent so far
    count,  # [BLOCK_RANKS] int32 rows of each stream to read (fewer than BLOCK_ROWS: masked)
    limit,  # int32 rows of the input that may be read
    row_map_ptr,  # [M] int32 input row of each received row (ROW_MAP)
    ROW_WORDS: tl.constexpr,  # int32 words of a row
    ZEROS: tl.constexpr,  # rows from limit on read as zeros, not as row limit - 1
    ROW_MAP: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    """The first payload tile ``[BLOCK_RANKS * BLOCK_ROWS, BLOCK_WORDS]`` of a sender step: for
    every source rank, the next rows it still wants (``start + sent`` on, at most
    ``BLOCK_ROWS``, fewer than ``count - sent`` read as nothing). Rows from ``limit`` on read as
    zeros (``ZEROS``) or as row ``limit - 1`` (fewer registers). With ``ROW_MAP``, row ``r`` is
    read from input row ``row_map[r]``."""
    FLAT: tl.constexpr = BLOCK_RANKS * BLOCK_ROWS
    i = tl.arange(0, BLOCK_ROWS)[None, :]
    words = tl.arange(0, BLOCK_WORDS)
    row = tl.reshape((start[:, None] + sent[:, None] + i).to(tl.int64), (FLAT,))
    want = tl.reshape(i < (count - sent)[:, None], (FLAT,))
    if ZEROS:
        want = want & (row < limit)
    else:
        row = tl.minimum(row, tl.maximum(limit - 1, 0))
    if ROW_MAP:
        row = tl.load(row_map_ptr + row, mask=want, other=0).to(tl.int64)
    at = x_words + row[:, None] * ROW_WORDS + words[None, :]
    return tl.load(at, mask=want[:, None] & (words < ROW_WORDS)[None, :], other=0)


@triton.jit
def send_step(
    v,  # [BLOCK_RANKS * BLOCK_ROWS, BLOCK_WORDS] int32 the step's first payload tile
    x_words,  # [M, H // 2] int32 the rows to hand back, as words
    weights_ptr,  # [M, K] float32 (HAS_WEIGHTS)
    ring,  # [BLOCK_RANKS] int64 addresses the rows are built at (rings or mirrors)
    start,  # [BLOCK_RANKS] int32 first input row of each source rank's stream
    sent,  # [BLOCK_RANKS] int32 rows of each stream sent so far
    take,  # [BLOCK_RANKS] int32 rows of each stream to send in this step
    count,  # [BLOCK_RANKS] int32 rows of each stream
    limit,  # int32 input rows that may be read
    row_map_ptr,  # [M] int32 input row of each received row (ROW_MAP)
    K,  # top-k columns
    H: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    AWAIT: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Store ``take`` rows per source (its tile ``v`` already loaded) into the source's ring
    slots ``sent`` on, with their weights; returns the next step's first tile (read before
    this step's last stores, except from a relay, whose rows are read after their flags)."""
    ROW_WORDS: tl.constexpr = H // 2
    LAST: tl.constexpr = (
        (ROW_WORDS - 1) // BLOCK_WORDS * BLOCK_WORDS
    )  # first word of a row's last tile
    FLAT: tl.constexpr = BLOCK_RANKS * BLOCK_ROWS
    steps = tl.arange(0, BLOCK_ROWS)
    words = tl.arange(0, BLOCK_WORDS)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    i = steps[None, :]
    slot = ((sent[:, None] + i) % RING).to(tl.int64)
    dst = tl.reshape(ring[:, None] + slot * SLOT_BYTES, (FLAT,))
    row = tl.reshape((start[:, None] + sent[:, None] + i).to(tl.int64), (FLAT,))
    live = tl.reshape(i < take[:, None], (FLAT,))
    held = live
    if AWAIT:
        held = live & (row < limit)
    else:
        row = tl.minimum(row, tl.maximum(limit - 1, 0))
    if ROW_MAP:  # the input in the caller's order (no scatter of every row before)
        row = tl.load(row_map_ptr + row, mask=held, other=0).to(tl.int64)
    p = aligned_ptr(dst, tl.int32)
    rows = x_words + row[:, None] * ROW_WORDS
    if HAS_WEIGHTS:
        wv = tl.load(
            weights_ptr + row[:, None] * K + ks[None, :],
            mask=held[:, None] & kmask[None, :],
            other=0.0,
        )
    for w0 in range(0, LAST, BLOCK_WORDS):
        w = w0 + words
        wn = w + BLOCK_WORDS
        v_next = tl.load(
            rows + wn[None, :], mask=held[:, None] & (wn < ROW_WORDS)[None, :], other=0
        )
        tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < ROW_WORDS)[None, :])
        v = v_next
    w = LAST + words
    if AWAIT:  # the next tile is read after its flags, at the top of the next step
        tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < ROW_WORDS)[None, :])
    else:
        v_next = first_tile(
            x_words,
            start,
            sent + take,
            count,
            limit,
            row_map_ptr,
            ROW_WORDS,
            AWAIT,
            ROW_MAP,
            BLOCK_RANKS,
            BLOCK_ROWS,
            BLOCK_WORDS,
        )
        tl.store(p[:, None] + w[None, :], v, mask=live[:, None] & (w < ROW_WORDS)[None, :])
        v = v_next
    if HAS_WEIGHTS:
        wp = p.to(tl.pointer_type(tl.float32))
        tl.store(wp[:, None] + ROW_WORDS + ks[None, :], wv, mask=live[:, None] & kmask[None, :])
    return v


@triton.jit
def flagged_rows(
    ready_ptr,  # [M] int32 per-row flags the other leg sets to call + 1 once a row is written
    call,  # this launch's call number
    start,  # [BLOCK_RANKS] int32 first input row of each source rank's stream
    sent,  # [BLOCK_RANKS] int32 rows of each stream sent so far
    take,  # [BLOCK_RANKS] int32 rows of each stream the rings have room for
    limit,  # int32 rows the relay flags (the others are never waited for)
    BLOCK_ROWS: tl.constexpr,
):
    """Of a relay's next ``take`` rows per stream, the prefix the other leg has flagged
    (AWAIT): ``(take, starved)``, the rows that may be sent and whether any stream waits on
    the other leg rather than on ring space. The rows are read after this, never before."""
    nth = tl.arange(0, BLOCK_ROWS)[None, :]
    at = (start[:, None] + sent[:, None] + nth).to(tl.int64)
    want = nth < take[:, None]
    flag = tl.atomic_add(ready_ptr + at, 0, mask=want, sem="acquire", scope="gpu")
    late = want & (at < limit) & (flag != (call + 1).to(tl.int32))
    ready = tl.min(tl.where(late, nth, BLOCK_ROWS), 1)
    starved = tl.max(take - ready, 0) > 0
    tl.debug_barrier()
    return tl.minimum(take, ready), starved


@triton.jit
def stream_rows(
    count,  # [BLOCK_RANKS] int32 rows to send to each source rank (own rank: 0 with LOCAL)
    start,  # [BLOCK_RANKS] int32 first input row of each source rank's stream
    rings,  # the sender's rings (normal_dispatch.send_rings)
    limit,  # int32 input rows that may be read
    x_words,  # [M, H // 2] int32 the rows to hand back, as words
    weights_ptr,  # [M, K] float32 (HAS_WEIGHTS)
    ready_ptr,  # [M] int32 per-row flags set by the other leg (AWAIT)
    row_map_ptr,  # [M] int32 input row of each received row (ROW_MAP)
    trace_ptr,  # int64 readings (PROFILE)
    call,  # this launch's call number
    timeout_ns,  # int64 limit of the wait without progress
    K,  # top-k columns
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    AWAIT: tl.constexpr,
    ROW_MAP: tl.constexpr,
    RELEASE_STEPS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The sending loop (constexprs as :func:`normal_combine_kernel`'s): stream each source
    rank's rows into its ring as space and (``AWAIT``) the other leg's flags allow, never
    blocking on one source, and publish the tails; stop once every row is sent or
    ``timeout_ns`` passed without progress. Returns ``(sent, starved, waited)``: the rows sent
    per source rank, whether the last wait was on the other leg's rows, and the time it polled
    without progress (with ``PROFILE``; 0 otherwise)."""
    ROW_WORDS: tl.constexpr = H // 2
    _ranks, _peer_base, _my_base, _pe_ptr, _ring_at, ring, _tail_at, head_flag = rings
    tag = call << 32
    sent = tl.zeros((BLOCK_RANKS,), tl.int32)
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int32)  # reads since the last progress
    pending = tl.sum(count, 0)
    # A step's heads and first tile are read before the previous step's release (a tile holds
    # every row a source still wants, up to BLOCK_ROWS; a full ring only masks its stores), so
    # a step costs about one memory latency.
    heads = tl.atomic_add(head_flag, 0, mask=sent < count, sem="acquire", scope="sys")
    if not AWAIT:
        v = first_tile(
            x_words,
            start,
            sent,
            count,
            limit,
            row_map_ptr,
            ROW_WORDS,
            AWAIT,
            ROW_MAP,
            BLOCK_RANKS,
            BLOCK_ROWS,
            BLOCK_WORDS,
        )
    starved = pending < 0  # waiting on the other leg's rows rather than on a peer
    waited = tl.zeros((), tl.int64)
    announced = sent  # rows up to here are announced by the tails
    unannounced = tl.zeros((), tl.int32)  # steps copied but not yet announced
    while keep_waiting(pending <= 0, clock, timeout_ns, spins, USE_CLOCK):
        if PROFILE:
            t_w = read_clock(trace_ptr, USE_CLOCK)
        waiting = sent < count
        # Free slots in this call; a head still tagged with an earlier call frees none.
        consumed = (heads & 0xFFFFFFFF).to(tl.int32)
        space = tl.where(waiting & ((heads >> 32) == call), RING - (sent - consumed), 0)
        take = tl.minimum(tl.minimum(space, count - sent), BLOCK_ROWS)
        if AWAIT:
            take, starved = flagged_rows(ready_ptr, call, start, sent, take, limit, BLOCK_ROWS)
            v = first_tile(
                x_words,
                start,
                sent,
                sent + take,
                limit,
                row_map_ptr,
                ROW_WORDS,
                AWAIT,
                ROW_MAP,
                BLOCK_RANKS,
                BLOCK_ROWS,
                BLOCK_WORDS,
            )
        moved = tl.max(take, 0) > 0
        if moved:
            v = send_step(
                v,
                x_words,
                weights_ptr,
                ring,
                start,
                sent,
                take,
                count,
                limit,
                row_map_ptr,
                K,
                H,
                RING,
                SLOT_BYTES,
                HAS_WEIGHTS,
                AWAIT,
                ROW_MAP,
                BLOCK_ROWS,
                BLOCK_WORDS,
                BLOCK_RANKS,
                BLOCK_K,
            )
            sent += take
            pending = tl.sum(count - sent, 0)
            heads = tl.atomic_add(head_flag, 0, mask=sent < count, sem="acquire", scope="sys")
            tl.debug_barrier()
            unannounced += 1
            # One system-scope release per RELEASE_STEPS steps and after the last rows: each
            # waits for the stores before it to reach the peers.
            due = (unannounced >= RELEASE_STEPS) | (pending == 0)
        else:
            # Nothing fits: the slots come back only once the receivers have the rows held
            # back, so announce them before polling.
            due = unannounced > 0
        if due:
            if not moved:
                tl.debug_barrier()
            announce(rings, announced, sent, tag, NUM_RANKS, RING, SLOT_BYTES, VIA)
            announced = sent
            unannounced = unannounced * 0
        if moved:
            clock = start_clock(USE_CLOCK)
            spins = spins * 0
        else:
            heads = tl.atomic_add(head_flag, 0, mask=waiting, sem="acquire", scope="sys")
            spins += 1
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
    return sent, starved, waited


@triton.jit
def combine_send(
    channel,  # the channel this program sends
    call,  # this launch's call number
    x_ptr,  # [M, H] bf16 rows to hand back
    weights_ptr,  # [M, K] float32 (HAS_WEIGHTS)
    num_rows,  # M
    K,  # top-k columns
    recv_count_ptr,  # [R, C] int32 rows each (source, channel) delivered here
    recv_start_ptr,  # [R, C] int32 the dispatch's streams
    bounds_ptr,  # [C + 1] int32; [C] = input rows the relay flags (AWAIT)
    ready_ptr,  # [M] int32 per-row flags set by the other leg (AWAIT)
    row_map_ptr,  # [M] int32 input row of each received row (ROW_MAP)
    trace_ptr,  # as the kernel's
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # NormalShared (limit in ns)
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RING_OFFSET: tl.constexpr,
    TAIL_OFFSET: tl.constexpr,
    HEAD_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    AWAIT: tl.constexpr,
    LOCAL: tl.constexpr,
    ROW_MAP: tl.constexpr,
    RELEASE_STEPS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The sender of ``channel`` (constexprs as :func:`normal_combine_kernel`'s): stream rows
    back to every source rank. Returns the time it polled without progress (with
    ``PROFILE``; 0 otherwise)."""
    rings = send_rings(
        channel,
        rank,
        peer_ptrs,
        pe_ptr,
        NUM_RANKS,
        RING_STRIDE,
        SLOT_BYTES,
        RING_OFFSET,
        TAIL_OFFSET,
        HEAD_OFFSET,
        STAGE_OFFSET,
        BLOCK_RANKS,
        VIA,
    )
    ranks = rings[0]
    rmask = ranks < NUM_RANKS
    count = tl.load(recv_count_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    if LOCAL:  # this rank's own rows are read from the input by its receiver
        count = tl.where(ranks == rank, 0, count)
    start = tl.load(recv_start_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    # Rows past the input (worst-case outputs that overflowed) or past what the relay will
    # flag (a relay that dropped its rows) are not read: the last row goes back in their
    # place, or zeros from a relay (whose rows past the limit were never written); the
    # overflow is reported, no source waits and nothing is read out of bounds.
    limit = num_rows
    if AWAIT:
        limit = tl.minimum(limit, tl.load(bounds_ptr + NUM_CHANNELS))
    sent, starved, waited = stream_rows(
        count,
        start,
        rings,
        limit,
        x_words,
        weights_ptr,
        ready_ptr,
        row_map_ptr,
        trace_ptr,
        call,
        timeout_ns,
        K,
        H,
        NUM_RANKS,
        RING,
        SLOT_BYTES,
        HAS_WEIGHTS,
        AWAIT,
        ROW_MAP,
        RELEASE_STEPS,
        USE_CLOCK,
        BLOCK_ROWS,
        BLOCK_WORDS,
        BLOCK_RANKS,
        BLOCK_K,
        PROFILE,
        VIA,
    )
    pending = tl.sum(count - sent, 0)
    if pending > 0:
        if starved:
            record_timeout(status_ptr, -1, COMBINE_RELAY, timeout_ns, channel)
        else:
            peer = first_lane(sent < count, ranks)
            record_timeout(status_ptr, peer, COMBINE_SEND, timeout_ns, channel)
    return waited


# ---------------------------------------------------------------------------------- receiver


@triton.jit
def sum_step(
    src,  # [BLOCK_TOKENS, BLOCK_RANKS] int64 address of each token's row from each rank
    wsrc,  # [BLOCK_TOKENS, BLOCK_RANKS] int64 address of that row's weights (HAS_WEIGHTS)
    ready,  # [BLOCK_TOKENS, BLOCK_RANKS] int32 1 where that row is to be summed
    tokens,  # [BLOCK_TOKENS] int32 the step's tokens
    tmask,  # [BLOCK_TOKENS] bool the step's tokens that exist (and have arrived)
    own_row,  # [BLOCK_TOKENS] int64 row of x holding each token's own row (LOCAL)
    x_ptr,  # [M, H] bf16 this rank's own rows (LOCAL)
    weights_ptr,  # [M, K] float32 their weights (LOCAL and HAS_WEIGHTS)
    bias0_ptr,  # [N, H] bf16 (NUM_BIAS >= 1)
    bias1_ptr,  # [N, H] bf16 (NUM_BIAS >= 2)
    out_ptr,  # [N, H] bf16 out: the sums
    out_weights_ptr,  # [N, K] float32 out: the summed weights (HAS_WEIGHTS)
    rank,  # this rank
    K,  # top-k columns
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NUM_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # blocks of the rows loading at once (tl.range's num_stages); None: 1
):
    """Sum a step's tokens: for each, the rows of every rank ``ready`` says (``src``: their
    addresses ``[BLOCK_TOKENS, BLOCK_RANKS]``, ring slots or the copy-engine combine's
    region; this rank's row from ``x_ptr`` at ``own_row`` with ``LOCAL``) in float32, in rank
    order, plus the bias; stores BF16 sums and the summed weights."""
    ranks = tl.arange(0, BLOCK_RANKS)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    elems = tl.arange(0, 2 * BLOCK_WORDS)
    tokens64 = tokens.to(tl.int64)
    for e0 in tl.range(0, H, 2 * BLOCK_WORDS, num_stages=STAGES):
        e = e0 + elems
        em = e < H
        acc = tl.zeros((BLOCK_TOKENS, 2 * BLOCK_WORDS), tl.float32)
        for d in tl.static_range(NUM_RANKS):
            from_d = lane(ready, ranks, d) > 0
            p = aligned_ptr(lane(src, ranks, d), tl.bfloat16)
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
        wacc = tl.zeros((BLOCK_TOKENS, BLOCK_K), tl.float32)
        for d in tl.static_range(NUM_RANKS):
            from_d = lane(ready, ranks, d) > 0
            wp = lane(wsrc, ranks, d).to(tl.pointer_type(tl.float32))
            if LOCAL:
                wp = tl.where(rank == d, weights_ptr + own_row * K, wp)
            wacc += tl.load(
                wp[:, None] + ks[None, :],
                mask=from_d[:, None] & kmask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
        at = tokens64[:, None] * K + ks[None, :]
        tl.store(out_weights_ptr + at, wacc, mask=tmask[:, None] & kmask[None, :])


@triton.jit
def poison_lost(
    hit,  # [BLOCK_TOKENS, BLOCK_RANKS] int32 1 where a token has a row from a rank
    ready,  # [BLOCK_TOKENS, BLOCK_RANKS] int32 1 where that row came
    tokens,  # [BLOCK_TOKENS] int32 the step's tokens
    tmask,  # [BLOCK_TOKENS] bool the step's tokens that exist (and have arrived)
    out_ptr,  # [N, H] bf16 out: the sums
    out_weights_ptr,  # [N, K] float32 out: the summed weights (HAS_WEIGHTS)
    K,  # top-k columns
    H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Overwrite with NaN the sums (and weights) of a step's tokens one of whose rows never
    came (``hit`` but not ``ready``): a pass of its own, after the sums', so that their loop
    stays as it is while every row comes."""
    tl.debug_barrier()  # after every thread's stores of the sums
    lost = tmask & (tl.max(hit - ready, 1) > 0)
    tokens64 = tokens.to(tl.int64)
    elems = tl.arange(0, 2 * BLOCK_WORDS)
    out_bits = out_ptr.to(tl.pointer_type(tl.int16))  # 0xFFFF: a BF16 NaN
    for e0 in range(0, H, 2 * BLOCK_WORDS):
        e = e0 + elems
        tl.store(
            out_bits + tokens64[:, None] * H + e[None, :],
            tl.full((BLOCK_TOKENS, 2 * BLOCK_WORDS), -1, tl.int16),
            mask=lost[:, None] & (e < H)[None, :],
        )
    if HAS_WEIGHTS:
        ks = tl.arange(0, BLOCK_K)
        tl.store(
            out_weights_ptr + tokens64[:, None] * K + ks[None, :],
            tl.full((BLOCK_TOKENS, BLOCK_K), float("nan"), tl.float32),
            mask=lost[:, None] & (ks < K)[None, :],
        )


@triton.jit
def combine_receive(
    channel,  # the channel this program receives
    call,  # this launch's call number
    x_ptr,  # [M, H] bf16 this rank's own rows (LOCAL)
    weights_ptr,  # [M, K] float32 their weights (LOCAL and HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] int8 is_token_in_rank of the dispatch
    num_tokens,  # N
    num_rows,  # M
    K,  # top-k columns
    bias0_ptr,  # [N, H] bf16 (NUM_BIAS >= 1)
    bias1_ptr,  # [N, H] bf16 (NUM_BIAS >= 2)
    recv_start_ptr,  # [R, C] int32 first row of each (source, channel) in x
    out_ptr,  # [N, H] bf16 out: the sums
    out_weights_ptr,  # as the kernel's
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    ready_ptr,  # [N] int32 per-token flags set once summed (PUBLISH)
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    trace_ptr,  # as the kernel's
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # NormalShared (limit in ns)
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RING_OFFSET: tl.constexpr,
    TAIL_OFFSET: tl.constexpr,
    HEAD_OFFSET: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NUM_BIAS: tl.constexpr,
    BOUNDS: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The receiver of ``channel`` (constexprs as :func:`normal_combine_kernel`'s): sum each
    token's rows from all ranks (with ``LOCAL``, this rank's own rows straight from the input
    ``x_ptr``). Returns the time it waited for rows (with ``PROFILE``; 0 otherwise)."""
    tag = call << 32
    ranks, rmask, peer_base, my_base = peer_heaps(peer_ptrs, rank, NUM_RANKS, BLOCK_RANKS)
    t0, t1 = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
    if PUBLISH:
        published = relay_flag(relay_call_ptr)
    ring, tail_flag, head_at = receive_rings(
        channel,
        rank,
        ranks,
        my_base,
        NUM_RANKS,
        RING_STRIDE,
        SLOT_BYTES,
        RING_OFFSET,
        TAIL_OFFSET,
        HEAD_OFFSET,
    )
    taken = tl.zeros((BLOCK_RANKS,), tl.int32)
    arrived = tl.zeros((BLOCK_RANKS,), tl.int64)  # last tail value read, per expert rank
    budget = timeout_ns + tl.zeros((), tl.int64)
    waited = tl.zeros((), tl.int64)
    own = ranks < 0
    own_first = tl.zeros((), tl.int32)
    last_row = tl.zeros((), tl.int32)
    if LOCAL:
        own = ranks == rank
        # This rank's rows for the channel's tokens, in token order from here on (the order
        # its sender would have streamed them into its own ring).
        own_first = tl.load(recv_start_ptr + rank * NUM_CHANNELS + channel)
        last_row = tl.maximum(num_rows - 1, 0)
    for first in range(t0, t1, BLOCK_TOKENS):
        tokens = first + tl.arange(0, BLOCK_TOKENS)
        tmask = tokens < t1
        hit = tl.load(
            in_rank_ptr + tokens.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :],
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
                record_timeout(status_ptr, peer, COMBINE_RECV, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
        # A row that never arrived is not read: its token's sum is NaN.
        ready = hit * ((arrived >= target) | own).to(tl.int32)[None, :]
        nth = taken[None, :] + rows_before(hit, BLOCK_TOKENS)  # position in each ring
        src = ring[None, :] + (nth % RING).to(tl.int64) * SLOT_BYTES  # [BLOCK_TOKENS, lanes]
        wsrc = src + 2 * H  # a ring slot's weights follow its row
        own_row = tl.zeros((BLOCK_TOKENS,), tl.int64)
        if LOCAL:
            # Rows past the input (worst-case outputs that overflowed) read as the last row,
            # as the sender would have sent them.
            own_row = tl.minimum(own_first + lane(nth, ranks, rank), last_row).to(tl.int64)
            if X_ALIGNED:
                # This rank's rows and weights join the ring slots' as addresses, which the
                # sums take as 16-byte aligned: a pointer chosen between x and a slot would
                # leave Triton unsure of either's alignment, and every row would load one
                # BF16 value an instruction.
                src = tl.where(own[None, :], (x_ptr.to(tl.int64) + own_row * (2 * H))[:, None], src)
                own_weights = weights_ptr.to(tl.int64) + own_row * K * 4
                wsrc = tl.where(own[None, :], own_weights[:, None], wsrc)
        sum_step(
            src,
            wsrc,
            ready,
            tokens,
            tmask,
            own_row,
            x_ptr,
            weights_ptr,
            bias0_ptr,
            bias1_ptr,
            out_ptr,
            out_weights_ptr,
            rank,
            K,
            H,
            NUM_RANKS,
            HAS_WEIGHTS,
            NUM_BIAS,
            LOCAL and not X_ALIGNED,  # own rows from x_ptr where src lacks them
            USE_CLOCK,
            BLOCK_TOKENS,
            BLOCK_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            None,  # STAGES: the rows come slot by slot; loading ahead slowed the rings (4x H200)
        )
        if not ok:  # a row never came: its token's sum is NaN
            poison_lost(
                hit,
                ready,
                tokens,
                tmask,
                out_ptr,
                out_weights_ptr,
                K,
                H,
                HAS_WEIGHTS,
                BLOCK_TOKENS,
                BLOCK_WORDS,
                BLOCK_K,
            )
        if PUBLISH:
            publish_rows(ready_ptr + tokens.to(tl.int64), published, tmask)
        taken += count
        tl.debug_barrier()
        # Relaxed: the rows' loads have returned (their sums are stored), so a sender's
        # overwrite cannot reach them; a release would add a system-wide fence per block.
        set_peer_flags(
            my_base,
            peer_base,
            ranks,
            head_at,
            tag | taken.to(tl.int64),
            (count > 0) & ~own,
            pe_ptr,
            NUM_RANKS,
            VIA,
            SEM="relaxed",
        )
    tl.debug_barrier()
    free_rings(
        call,
        channel,
        HEAD_OFFSET,
        rank,
        my_base,
        peer_base,
        ranks,
        rmask,
        pe_ptr,
        NUM_RANKS,
        NUM_CHANNELS,
        MAX_CHANNELS,
        VIA,
    )
    return waited


# ------------------------------------------------------------------------------------- entry


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "K", "timeout_us"])
def normal_combine_kernel(
    # What changes from call to call (CombineCall).
    x_ptr,  # [M, H] bf16 rows to hand back, one per row received in dispatch
    weights_ptr,  # [M, K] float32 weights handed back with the rows (HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] bool is_token_in_rank of the dispatch
    num_tokens,  # N
    num_rows,  # M
    K,  # top-k columns of the weight rows (tiles are BLOCK_K wide)
    bias0_ptr,  # [N, H] bf16 (NUM_BIAS >= 1)
    bias1_ptr,  # [N, H] bf16 (NUM_BIAS >= 2)
    recv_count_ptr,  # [R, C] int32 rows each (source, channel) delivered here
    recv_start_ptr,  # [R, C] int32 first row of each (source, channel)
    out_ptr,  # [N, H] bf16 out
    out_weights_ptr,  # [N, K] float32 out (HAS_WEIGHTS)
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS); with AWAIT, [C] is the
    # number of input rows the relay flags (the others are not read)
    ready_ptr,  # [rows] int32 per-row flags: awaited on the input (AWAIT), set on the output
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    row_map_ptr,  # [M] int32 row of x that holds each received row (ROW_MAP)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE)
    # What stays from call to call (normal_dispatch.NormalShared).
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    decoded_ptr,  # (notify's workspace; unused here)
    H: tl.constexpr,  # hidden size
    NUM_RANKS: tl.constexpr,  # ranks of the group
    NUM_CHANNELS: tl.constexpr,  # channels of the dispatch (C)
    MAX_CHANNELS: tl.constexpr,  # channels the rings are allocated for
    RING: tl.constexpr,  # slots used per ring in this call
    RING_STRIDE: tl.constexpr,  # slots allocated per ring
    SLOT_BYTES: tl.constexpr,  # bytes of a slot: a row, then its weights
    RING_OFFSET: tl.constexpr,  # heap byte offset of the rings [C][R expert rank][RING_STRIDE]
    TAIL_OFFSET: tl.constexpr,  # heap byte offset of the tails [C][R expert rank] (senders')
    HEAD_OFFSET: tl.constexpr,  # heap byte offset of the heads [C][R owner] (receivers')
    STAGE_OFFSET: tl.constexpr,  # heap byte offset of the mirror rings [C][R owner] (VIA)
    HAS_WEIGHTS: tl.constexpr,  # weights travel and are summed
    NUM_BIAS: tl.constexpr,  # bias tensors added to the sums (0 to 2)
    BOUNDS: tl.constexpr,  # token channels are the ranges in bounds_ptr
    AWAIT: tl.constexpr,  # wait for each input row's flag (call + 1) before sending it
    PUBLISH: tl.constexpr,  # flag each output token once summed
    LOCAL: tl.constexpr,  # receivers read this rank's own rows from x (off with AWAIT)
    X_ALIGNED: tl.constexpr,  # x's rows start at 16-byte boundaries (LOCAL)
    ROW_MAP: tl.constexpr,  # received row r is row row_map[r] of x (senders only)
    RELEASE_STEPS: tl.constexpr,  # sender steps per tail release
    USE_CLOCK: tl.constexpr,  # on a GPU (else the interpreter)
    BLOCK_TOKENS: tl.constexpr,  # tokens a receiver sums per step
    BLOCK_ROWS: tl.constexpr,  # rows a sender moves per source and step
    BLOCK_WORDS: tl.constexpr,  # words (2 BF16 values) per row moved at a time; sums run over
    # 2 * BLOCK_WORDS values
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BLOCK_K: tl.constexpr,  # power of two >= max(K, 2)
    PROFILE: tl.constexpr,  # record traces
    VIA: tl.constexpr,  # how rows reach peers (transport)
):
    # The receivers read own rows in the received order: a map is for relays (no LOCAL).
    tl.static_assert(not (LOCAL and ROW_MAP))
    timeout_ns = limit_ns(timeout_us, status_ptr)
    pid = tl.program_id(0)
    call = tl.load(state_ptr + COMBINE_CALLS, volatile=True)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8))
    sends = pid < NUM_CHANNELS
    if sends:
        waited = combine_send(
            pid,
            call,
            x_ptr,
            weights_ptr,
            num_rows,
            K,
            recv_count_ptr,
            recv_start_ptr,
            bounds_ptr,
            ready_ptr,
            row_map_ptr,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            status_ptr,
            timeout_ns,
            H,
            NUM_RANKS,
            NUM_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            RING_OFFSET,
            TAIL_OFFSET,
            HEAD_OFFSET,
            STAGE_OFFSET,
            HAS_WEIGHTS,
            AWAIT,
            LOCAL,
            ROW_MAP,
            RELEASE_STEPS,
            USE_CLOCK,
            BLOCK_ROWS,
            BLOCK_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            PROFILE,
            VIA,
        )
    else:
        waited = combine_receive(
            pid - NUM_CHANNELS,
            call,
            x_ptr,
            weights_ptr,
            in_rank_ptr,
            num_tokens,
            num_rows,
            K,
            bias0_ptr,
            bias1_ptr,
            recv_start_ptr,
            out_ptr,
            out_weights_ptr,
            bounds_ptr,
            ready_ptr,
            relay_call_ptr,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            status_ptr,
            timeout_ns,
            H,
            NUM_RANKS,
            NUM_CHANNELS,
            MAX_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            RING_OFFSET,
            TAIL_OFFSET,
            HEAD_OFFSET,
            HAS_WEIGHTS,
            NUM_BIAS,
            BOUNDS,
            PUBLISH,
            LOCAL,
            X_ALIGNED,
            USE_CLOCK,
            BLOCK_TOKENS,
            BLOCK_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            PROFILE,
            VIA,
        )
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), sends, waited, USE_CLOCK)
    finish_call(state_ptr, call, COMBINE_ARRIVALS, COMBINE_CALLS)
