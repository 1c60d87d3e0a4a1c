"""Normal-mode dispatch: each token crosses NVLink once per destination rank, through channel rings.

The tokens of a rank are split into ``C`` channels (contiguous token ranges). Program ``c < C``
is the *sender* of channel ``c``; program ``C + c`` is its *receiver*. Every rank holds, per
channel and source rank, a ring of ``RING`` slots; a slot holds one token: the payload words,
the FP8 scales, then a small record (source token index, local top-k ids, weights).

Sender. It walks its channel ``TOK`` tokens at a time. A token goes to every rank that holds
one of its experts (``is_token_in_rank``), once. The block's payload is loaded once and stored
into the slots of all its destination rings (plain NVLink stores, 16-byte vectors), with the
top-k ids already turned into the destination's local ids (``-1`` elsewhere) and the weights
zeroed where the expert is elsewhere. Then one system-scope release per destination publishes
the new *tail*. Before reusing a slot it waits (bounded) for the receiver's *head*.

Receiver. It polls the tails of all its source rings at once and copies whatever has arrived,
``ROWS`` slots per source per step, into the exact output rows
``recv_start[source, channel] + i`` that the notify step computed: rows come ordered by
source rank, then by source token. After each step it returns the new heads to the senders.

With ``LOCAL`` (every launch whose input is complete before it starts: all but a relay's
second leg) a token's row for this rank itself never enters a ring: the receiver's own lane
reads the channel's tokens straight from the input, ``ROWS`` per step beside the rows that
arrived from peers, and stores them (payload, scales and record) into their output rows
``recv_start[rank, channel] + i``. The senders then store only into peers: under the
all-to-all load of every rank at once, 12 programs push about 290 GB/s into the peers, close
to all NVLink then carries (BENCHMARKS.md), so a sender that also wrote the local copies spent
part of that on them, while the receivers' own lane stayed empty.

Flags are tagged with the call number (``call << 32 | position``), so a stale flag of an
earlier call never passes for a new one and nothing is reset between calls. At the end of a
call every receiver stores ``(call + 1) << 32`` into the heads of its sources: the ring is
free for the next call, which senders check before their first store. It does the same for
the channels the call leaves unused, so the next call may use a larger SM budget.

Why it is fast: senders and receivers run at once (one cooperative launch), a token's payload
is read from memory once whatever its number of destinations, all destinations are fed in
the same step (every NVLink peer busy), and the only host work is the launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

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

PHASE_DISPATCH_SEND = tl.constexpr(11)
PHASE_DISPATCH_RECV = tl.constexpr(12)
PHASE_DISPATCH_RELAY = tl.constexpr(15)

DISPATCH_CALLS = tl.constexpr(2)
DISPATCH_ARRIVALS = tl.constexpr(3)


@triton.jit
def column(matrix, lanes, index):
    """Column ``index`` of a ``[rows, lanes]`` tensor (Triton has no dynamic indexing)."""
    return tl.sum(tl.where(lanes[None, :] == index, matrix, 0), 1)


@triton.jit
def rows_before(hit, ROWS: tl.constexpr):
    """Exclusive prefix sum down the rows of a small ``[ROWS, lanes]`` int32 tensor.

    A masked sum over a ``[ROWS, ROWS, lanes]`` broadcast: Triton 3.6's scan lowering fails
    for some layouts of small 2-D tensors, and ``ROWS`` is at most a few dozen here.
    """
    rows = tl.arange(0, ROWS)
    earlier = (rows[None, :] < rows[:, None]).to(tl.int32)  # [row, earlier row]
    return tl.sum(earlier[:, :, None] * hit[None, :, :], 1)


@triton.jit
def channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS: tl.constexpr,
                   BOUNDS: tl.constexpr):  # fmt: skip
    """``(first, end)`` tokens of a channel: an equal split of the tokens, or with ``BOUNDS``
    the range ``bounds_ptr`` gives (a relay's channel: the rows that one channel of the network
    leg delivered)."""
    if BOUNDS:
        t0 = tl.load(bounds_ptr + channel)
        t1 = tl.load(bounds_ptr + channel + 1)
    else:
        chunk = tl.cdiv(num_tokens, NUM_CHANNELS)
        t0 = channel * chunk
        t1 = tl.minimum(t0 + chunk, num_tokens)
    return t0, t1


@triton.jit
def finish_call(state_ptr, call, ARRIVALS: tl.constexpr, CALLS: tl.constexpr):
    """The last program of a launch advances the call counter."""
    tl.debug_barrier()
    arrived = tl.atomic_add(state_ptr + ARRIVALS, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + ARRIVALS, 0)
        tl.store(state_ptr + CALLS, call + 1)


@triton.jit
def free_rings(call, channel, head_offset, rank, my_base, peer_base, ranks, rmask, pe_ptr,
               NUM_RANKS: tl.constexpr, NUM_CHANNELS: tl.constexpr, MAX_CHANNELS: tl.constexpr,
               VIA: tl.constexpr):  # fmt: skip
    """Mark the rings this receiver drains free for the next call, in every source's heads.

    The receiver of channel ``c`` also frees channels ``c + C, c + 2 C, ...`` that this call
    leaves unused: a later call may use more channels (a larger SM budget), and its senders
    wait for a head tagged with their call before the first store into any ring.
    """
    freed = tl.zeros((ranks.shape[0],), tl.int64) + ((call + 1) << 32)
    for c in range(channel, MAX_CHANNELS, NUM_CHANNELS):
        head_at = head_offset + (c * NUM_RANKS + rank) * 8  # in each source's heap
        set_peer_flags(my_base, peer_base, ranks, head_at, freed, rmask, pe_ptr, NUM_RANKS, VIA,
                       SEM="release")  # fmt: skip


@triton.jit
def dispatch_send(
    channel,
    call,
    x_ptr,
    scales_ptr,
    topk_idx_ptr,
    topk_weights_ptr,
    in_rank_ptr,
    src_tag_ptr,
    num_tokens,
    peer_ptrs,
    rank,
    ring_offset,
    tail_offset,
    head_offset,
    stage_offset,
    pe_ptr,
    status_ptr,
    timeout_ns,
    bounds_ptr,
    ready_ptr,
    W: tl.constexpr,
    G: tl.constexpr,
    K,  # top-k columns of the id and weight rows (a runtime value: one variant per K_P2)
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    META_OFF: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    TOK: tl.constexpr,
    BW: tl.constexpr,
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    G_P2: tl.constexpr,
    VIA: tl.constexpr,
    BOUNDS: tl.constexpr,
    AWAIT: tl.constexpr,
    RANKS_FROM_IDS: tl.constexpr,
    LOCAL: tl.constexpr,
    RELEASE_STEPS: tl.constexpr,
    trace_ptr,
    PROFILE: tl.constexpr,
):
    """The sender of channel ``channel``: walk its tokens, feed every destination ring (with
    ``LOCAL``, every ring but this rank's own). Returns the time it waited (with ``PROFILE``;
    0 otherwise)."""
    ranks = tl.arange(0, R_P2)
    rmask = ranks < NUM_RANKS
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    my_base = tl.load(peer_ptrs + rank)
    words = tl.arange(0, BW)
    ks = tl.arange(0, K_P2)
    kmask = ks < K
    groups = tl.arange(0, G_P2)
    gmask = groups < G
    tag = call << 32
    t0, t1 = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
    pair = channel * NUM_RANKS + rank
    ring_at = ring_offset + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)  # in each peer
    ring = peer_base + ring_at
    if VIA != VIA_STORE:
        # Rows are built in this rank's mirror of each destination's ring, then put there.
        mirror_pairs = (channel * NUM_RANKS + ranks).to(tl.int64)
        ring = my_base + stage_offset + mirror_pairs * (RING_STRIDE * SLOT_BYTES)
    head_flag = my_base + head_offset + (channel * NUM_RANKS + ranks) * 8
    head_flag = head_flag.to(tl.pointer_type(tl.int64))
    sent = tl.zeros((R_P2,), tl.int32)
    released = tl.zeros((R_P2,), tl.int64)  # last head value read, per destination
    budget = timeout_ns + tl.zeros((), tl.int64)
    waited = tl.zeros((), tl.int64)
    announced = sent  # rows up to here are announced by the tails
    unannounced = tl.zeros((), tl.int32)  # steps copied but not yet announced
    for first in range(t0, t1, TOK):
        tokens = first + tl.arange(0, TOK)
        tmask = tokens < t1
        tokens64 = tokens.to(tl.int64)
        if AWAIT:  # relayed rows: wait until the network leg has written them here
            if PROFILE:
                t_w = read_clock(trace_ptr, USE_CLOCK)
            # Flags only grow (the reading launch's call + 1), so "at least" is "this call's".
            _, arrived = wait_all_at_least(ready_ptr + tokens64, (call + 1).to(tl.int32), tmask,
                                           budget, USE_CLOCK, True)  # fmt: skip
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
            if not arrived:
                record_timeout(status_ptr, -1, PHASE_DISPATCH_RELAY, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
            # Rows not arrived are not read. (A tile compare, not `tmask & arrived`: Triton
            # 3.9's interpreter splats a scalar comparison as int32, which no mask accepts.)
            tmask = tokens < tl.where(arrived, t1, 0)
        at_rank = tokens64[:, None] * NUM_RANKS + ranks[None, :]
        if RANKS_FROM_IDS:  # a relay learns the destinations from the rows themselves
            ids = tl.load(
                topk_idx_ptr + tokens64[:, None] * K + ks[None, :],
                mask=tmask[:, None] & kmask[None, :],
                other=-1,
            )
            owner = tl.where(ids >= 0, ids // E_LOCAL, -1)
            hit = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), 1)
            tl.store(in_rank_ptr + at_rank, hit.to(tl.int8),
                     mask=(tokens < t1)[:, None] & rmask[None, :])  # fmt: skip
        else:
            hit = tl.load(in_rank_ptr + at_rank, mask=tmask[:, None] & rmask[None, :], other=0)
        hit = (hit != 0).to(tl.int32)
        if LOCAL:  # this rank's receiver copies its own rows from the input
            hit = tl.where(ranks[None, :] == rank, 0, hit)
        before = rows_before(hit, TOK)
        count = tl.sum(hit, 0)
        position = sent[None, :] + before
        # The slots must be free: the receiver has moved its head far enough, in this call.
        target = tag | tl.maximum(sent + count - RING, 0).to(tl.int64)
        blocked = (count > 0) & (released < target)
        ok = tl.max(blocked.to(tl.int32), 0) == 0
        if not ok:
            if unannounced > 0:
                # The slots waited for are freed only once the receivers have the rows held
                # back: announce them first.
                put_rings(my_base, peer_base, ranks, ring_at, ring, announced, sent,
                          tail_offset + pair * 8, tag, pe_ptr, NUM_RANKS, RING, SLOT_BYTES,
                          VIA)  # fmt: skip
                announced = sent
                unannounced = unannounced * 0
            if PROFILE:
                t_w = read_clock(trace_ptr, USE_CLOCK)
            values, ok = wait_all_at_least(head_flag, target, blocked, budget, USE_CLOCK)
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
            released = tl.where(blocked, values, released)
            if not ok:
                peer = first_lane(blocked & (released < target), ranks)
                record_timeout(status_ptr, peer, PHASE_DISPATCH_SEND, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
        # After a timeout (budget spent) the program stores and publishes nothing more: tails
        # past a skipped step would hand its slots, stale, to healthy peers as this call's
        # rows; unpublished, those peers time out too and name this rank.
        if ok & (budget > 0):
            slot = (position % RING).to(tl.int64)
            dst = ring[None, :] + slot * SLOT_BYTES  # [TOK, R_P2] slot addresses
            # The loads of the next chunk are issued before the stores of this one, so a chunk
            # costs about one memory latency however many destinations it has.
            rows = x_ptr + tokens64[:, None] * W
            v = tl.load(rows + words[None, :], mask=tmask[:, None] & (words < W)[None, :])
            for w0 in range(0, W, BW):
                w = w0 + words
                wn = w + BW
                v_next = tl.load(rows + wn[None, :], mask=tmask[:, None] & (wn < W)[None, :])
                for d in tl.static_range(NUM_RANKS):
                    to_d = column(hit, ranks, d) > 0
                    p = aligned_ptr(column(dst, ranks, d), tl.int32)
                    tl.store(p[:, None] + w[None, :], v, mask=to_d[:, None] & (w < W)[None, :])
                v = v_next
            if HAS_SCALES:
                s = tl.load(
                    scales_ptr + tokens64[:, None] * G + groups[None, :],
                    mask=tmask[:, None] & gmask[None, :],
                )
                for d in tl.static_range(NUM_RANKS):
                    to_d = column(hit, ranks, d) > 0
                    p = aligned_ptr(column(dst, ranks, d) + W * 4, tl.int32)
                    gto = to_d[:, None] & gmask[None, :]
                    tl.store(p[:, None] + groups[None, :], s, mask=gto)
            if HAS_TOPK:
                ids = tl.load(
                    topk_idx_ptr + tokens64[:, None] * K + ks[None, :],
                    mask=tmask[:, None] & kmask[None, :],
                    other=-1,
                )
                owner = tl.where(ids >= 0, ids // E_LOCAL, -1)
                if HAS_WEIGHTS:
                    weights = tl.load(
                        topk_weights_ptr + tokens64[:, None] * K + ks[None, :],
                        mask=tmask[:, None] & kmask[None, :],
                        other=0.0,
                    )
            source = tokens
            if HAS_TAG:  # a row's origin further back (the internode forwarders use it)
                source = tl.load(src_tag_ptr + tokens64, mask=tmask, other=0)
            for d in tl.static_range(NUM_RANKS):
                to_d = column(hit, ranks, d) > 0
                record = aligned_ptr(column(dst, ranks, d) + META_OFF * 4, tl.int32)
                tl.store(record, source, mask=to_d)
                if HAS_TOPK:
                    local = tl.where(owner == d, ids - d * E_LOCAL, -1).to(tl.int32)
                    kto = to_d[:, None] & kmask[None, :]
                    tl.store(record[:, None] + 1 + ks[None, :], local, mask=kto)
                    if HAS_WEIGHTS:
                        wrec = record.to(tl.pointer_type(tl.float32))
                        mine = tl.where(owner == d, weights, 0.0)
                        tl.store(wrec[:, None] + 1 + K + ks[None, :], mine, mask=kto)
            tl.debug_barrier()
            # One system-scope release per RELEASE_STEPS steps and at the channel's end: each
            # waits for the stores before it to reach the peers.
            unannounced += 1
            if (unannounced >= RELEASE_STEPS) | (first + TOK >= t1):
                put_rings(my_base, peer_base, ranks, ring_at, ring, announced, sent + count,
                          tail_offset + pair * 8, tag, pe_ptr, NUM_RANKS, RING, SLOT_BYTES,
                          VIA)  # fmt: skip
                announced = sent + count
                unannounced = unannounced * 0
        sent += count
    return waited


@triton.jit
def dispatch_receive(
    channel,
    call,
    peer_ptrs,
    rank,
    ring_offset,
    tail_offset,
    head_offset,
    pe_ptr,
    recv_count_ptr,
    recv_start_ptr,
    host_info_ptr,
    out_x_ptr,
    out_scales_ptr,
    out_topk_idx_ptr,
    out_weights_ptr,
    out_src_ptr,
    max_rows,
    status_ptr,
    timeout_ns,
    ready_ptr,
    relay_call_ptr,
    x_ptr,
    scales_ptr,
    topk_idx_ptr,
    topk_weights_ptr,
    in_rank_ptr,
    src_tag_ptr,
    num_tokens,
    bounds_ptr,
    W: tl.constexpr,
    G: tl.constexpr,
    K,  # top-k columns of the id and weight rows (a runtime value: one variant per K_P2)
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,  # channels the rings are allocated for
    RING: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    META_OFF: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BW: tl.constexpr,
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    G_P2: tl.constexpr,
    VIA: tl.constexpr,
    BOUNDS: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    row_map_ptr,
    ROW_MAP: tl.constexpr,
    trace_ptr,
    PROFILE: tl.constexpr,
):
    """The receiver of channel ``channel``: drain the rings of every source into the outputs
    (with ``LOCAL``, this rank's own lane of each step reads the channel's tokens straight from
    the input instead). Returns the time it polled without progress (with ``PROFILE``; 0
    otherwise)."""
    ranks = tl.arange(0, R_P2)
    rmask = ranks < NUM_RANKS
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    my_base = tl.load(peer_ptrs + rank)
    words = tl.arange(0, BW)
    ks = tl.arange(0, K_P2)
    kmask = ks < K
    groups = tl.arange(0, G_P2)
    gmask = groups < G
    tag = call << 32
    count = tl.load(recv_count_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    start = tl.load(recv_start_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    steps = tl.arange(0, ROWS)
    lane = ranks[:, None] + 0 * steps[None, :]  # [R_P2, ROWS] source rank of each tile row
    # The own lane walks the channel's tokens ROWS at a time, from own_tok to own_end; a
    # token for this rank lands at recv_start[rank, channel] + (this rank's tokens before it).
    own_tok = tl.zeros((), tl.int32)
    own_end = own_tok
    own_next = own_tok
    if LOCAL:
        own = lane == rank
        count = tl.where(ranks == rank, 0, count)
        own_tok, own_end = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
        own_next = tl.load(recv_start_ptr + rank * NUM_CHANNELS + channel)
        earlier = (steps[None, :] < steps[:, None]).to(tl.int32)  # [row, earlier row]
        x_addr = x_ptr.to(tl.int64, bitcast=True)
        scales_addr = scales_ptr.to(tl.int64, bitcast=True)
    else:
        own = lane < 0
    pair = channel * NUM_RANKS + ranks
    ring = my_base + ring_offset + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)
    tail_flag = (my_base + tail_offset + pair * 8).to(tl.pointer_type(tl.int64))
    head_at = head_offset + (channel * NUM_RANKS + rank) * 8  # in each source's heap
    head = tl.zeros((R_P2,), tl.int32)
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int64)
    pending = tl.sum(count, 0)
    if PUBLISH:
        published = relay_flag(relay_call_ptr)
    waited = tl.zeros((), tl.int64)
    while ((pending > 0) | (own_tok < own_end)) & (
        elapsed_ns(clock, spins, USE_CLOCK) < timeout_ns
    ):
        if PROFILE:
            t_w = read_clock(trace_ptr, USE_CLOCK)
        waiting = head < count
        tails = tl.atomic_add(tail_flag, 0, mask=waiting, sem="acquire", scope="sys")
        arrived = tl.where(waiting & (tails >= tag), (tails & 0xFFFFFFFF).to(tl.int32), head)
        take = tl.minimum(arrived - head, ROWS)
        if (tl.max(take, 0) > 0) | (own_tok < own_end):
            tl.debug_barrier()
            i = steps[None, :]
            slot = ((head[:, None] + i) % RING).to(tl.int64)
            row = (start[:, None] + head[:, None] + i).to(tl.int64)
            live = i < take[:, None]
            src = ring[:, None] + slot * SLOT_BYTES
            token = 0 * lane
            if LOCAL:
                # The own lane: the next ROWS tokens of the channel, those for this rank live.
                mine = own_tok + steps
                hit = tl.load(in_rank_ptr + mine.to(tl.int64) * NUM_RANKS + rank,
                              mask=mine < own_end, other=0) != 0  # fmt: skip
                hit32 = hit.to(tl.int32)
                before = tl.sum(earlier * hit32[None, :], 1)
                token = tl.where(own, mine[None, :], token)
                row = tl.where(own, (own_next + before)[None, :].to(tl.int64), row)
                live = tl.where(own, hit[None, :], live)
                src = tl.where(own, x_addr + token.to(tl.int64) * (W * 4), src)
                own_next += tl.sum(hit32, 0)
                own_tok += ROWS
            live = live & (row < max_rows)  # worst-case outputs drop the overflow
            src = tl.reshape(src, (R_P2 * ROWS,))
            row = tl.reshape(row, (R_P2 * ROWS,))
            live = tl.reshape(live, (R_P2 * ROWS,))
            mine = tl.reshape(own, (R_P2 * ROWS,))
            token = tl.reshape(token, (R_P2 * ROWS,)).to(tl.int64)
            out = row  # where the row's payload goes; its record and flag stay at ``row``
            if ROW_MAP:
                # The caller's final order, written here instead of a gather of every row
                # afterwards (the internode mode's (source rank, token) order).
                out = tl.load(row_map_ptr + row, mask=live, other=0).to(tl.int64)
            p = aligned_ptr(src, tl.int32)[:, None]
            v = tl.load(p + words[None, :], mask=live[:, None] & (words < W)[None, :],
                        cache_modifier=".cg")  # fmt: skip
            for w0 in range(0, W, BW):
                w = w0 + words
                wn = w + BW
                mn = live[:, None] & (wn < W)[None, :]
                v_next = tl.load(p + wn[None, :], mask=mn, cache_modifier=".cg")
                m2 = live[:, None] & (w < W)[None, :]
                tl.store(out_x_ptr + out[:, None] * W + w[None, :], v, mask=m2)
                v = v_next
            if HAS_SCALES:
                m2 = live[:, None] & gmask[None, :]
                at = src + W * 4
                if LOCAL:
                    at = tl.where(mine, scales_addr + token * (G * 4), at)
                p = aligned_ptr(at, tl.int32)
                v = tl.load(p[:, None] + groups[None, :], mask=m2, cache_modifier=".cg")
                tl.store(out_scales_ptr + out[:, None] * G + groups[None, :], v, mask=m2)
            from_ring = live & ~mine
            record = aligned_ptr(src + META_OFF * 4, tl.int32)
            source = tl.load(record, mask=from_ring, cache_modifier=".cg")
            if LOCAL:
                if HAS_TAG:  # a row's origin further back
                    tagged = tl.load(src_tag_ptr + token, mask=live & mine, other=0)
                    source = tl.where(mine, tagged, source)
                else:
                    source = tl.where(mine, token.to(tl.int32), source)
            tl.store(out_src_ptr + row, source, mask=live)
            if HAS_TOPK:
                m2 = live[:, None] & kmask[None, :]
                at = record[:, None] + 1 + ks[None, :]
                local = tl.load(at, mask=from_ring[:, None] & kmask[None, :],
                                cache_modifier=".cg").to(tl.int64)  # fmt: skip
                if HAS_WEIGHTS:
                    at = record.to(tl.pointer_type(tl.float32))[:, None] + 1 + K + ks[None, :]
                    wv = tl.load(at, mask=from_ring[:, None] & kmask[None, :],
                                 cache_modifier=".cg")  # fmt: skip
                if LOCAL:
                    m_own = (live & mine)[:, None] & kmask[None, :]
                    at = token[:, None] * K + ks[None, :]
                    ids = tl.load(topk_idx_ptr + at, mask=m_own, other=-1)
                    here = (ids >= 0) & (ids // E_LOCAL == rank)
                    local = tl.where(mine[:, None], tl.where(here, ids - rank * E_LOCAL, -1),
                                     local)  # fmt: skip
                    if HAS_WEIGHTS:
                        wo = tl.load(topk_weights_ptr + at, mask=m_own, other=0.0)
                        wv = tl.where(mine[:, None], tl.where(here, wo, 0.0), wv)
                tl.store(out_topk_idx_ptr + row[:, None] * K + ks[None, :], local, mask=m2)
                if HAS_WEIGHTS:
                    tl.store(out_weights_ptr + row[:, None] * K + ks[None, :], wv, mask=m2)
            if PUBLISH:
                publish_rows(ready_ptr + row, published, live)
            head += take
            tl.debug_barrier()
            # Relaxed: the slots' loads have returned (their values are stored), so nothing
            # can move past this store that a sender's overwrite could affect; a release
            # would add a system-wide fence to every step.
            set_peer_flags(my_base, peer_base, ranks, head_at, tag | head.to(tl.int64),
                           take > 0, pe_ptr, NUM_RANKS, VIA, SEM="relaxed")  # fmt: skip
            clock = start_clock(USE_CLOCK)  # progress: the limit counts idle time only
            spins = tl.zeros((), tl.int64)
        else:
            spins += 1
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
        pending = tl.sum(count - head, 0)
    if pending > 0:
        peer = first_lane(head < count, ranks)
        record_timeout(status_ptr, peer, PHASE_DISPATCH_RECV, timeout_ns, channel)
    # Every ring of this channel is free for the next call, whatever it carried.
    tl.debug_barrier()
    free_rings(call, channel, head_offset, rank, my_base, peer_base, ranks, rmask, pe_ptr,
               NUM_RANKS, NUM_CHANNELS, MAX_CHANNELS, VIA)  # fmt: skip
    if PAD_ROWS:
        total = tl.load(host_info_ptr)
        pad = tl.arange(0, 128)
        for first in range(total + channel * 128, max_rows, NUM_CHANNELS * 128):
            rows = (first + pad).to(tl.int64)
            rm = rows < max_rows
            tl.store(out_src_ptr + rows, tl.full((128,), -1, tl.int32), mask=rm)
            if HAS_TOPK:
                m2 = rm[:, None] & kmask[None, :]
                at = rows[:, None] * K + ks[None, :]
                tl.store(out_topk_idx_ptr + at, tl.full((128, K_P2), -1, tl.int64), mask=m2)
                if HAS_WEIGHTS:
                    tl.store(out_weights_ptr + at, tl.zeros((128, K_P2), tl.float32), mask=m2)
    return waited


@triton.jit(do_not_specialize=["timeout_us", "K"])
def normal_dispatch_kernel(
    x_ptr,  # [N, W] int32: the payload rows as words (BF16 or e4m3)
    scales_ptr,  # [N, G] float32 as int32 (FP8 input only)
    topk_idx_ptr,  # [N, K] int64 global expert ids (not in cached mode)
    topk_weights_ptr,  # [N, K] float32 (optional)
    in_rank_ptr,  # [N, R] int8
    src_tag_ptr,  # [N] int32 recorded as each row's source index instead of its token (HAS_TAG)
    num_tokens,
    peer_ptrs,  # [R] int64 heap base addresses
    rank,
    ring_offset,  # byte offset of the rings [C][R source][RING][SLOT_BYTES]
    tail_offset,  # byte offset of the tails [C][R source] int64 (written by senders)
    head_offset,  # byte offset of the heads [C][R destination] int64 (written by receivers)
    stage_offset,  # byte offset of the mirror rings [C][R destination] (VIA != VIA_STORE)
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    state_ptr,  # [8] int64 device call counters
    recv_count_ptr,  # [R, C] int32 tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 first output row of each (source, channel)
    host_info_ptr,  # [1 + E_local] int32, [0] = rows received
    out_x_ptr,  # [max_rows, W] int32
    out_scales_ptr,  # [max_rows, G] int32
    out_topk_idx_ptr,  # [max_rows, K] int64
    out_weights_ptr,  # [max_rows, K] float32
    out_src_ptr,  # [max_rows] int32 source token index
    max_rows,
    status_ptr,  # [STATUS_WORDS] int32
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    ready_ptr,  # [rows] int32 per-row flags: awaited on the input (AWAIT), set on the output
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    row_map_ptr,  # [max_rows] int32 output position of each row (ROW_MAP)
    K,  # top-k columns of the id and weight rows (not specialized: one variant per K_P2)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE)
    W: tl.constexpr,  # payload words per token
    G: tl.constexpr,  # scale words per token (FP8)
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,
    RING: tl.constexpr,  # slots used per ring in this call
    RING_STRIDE: tl.constexpr,  # slots allocated per ring
    SLOT_BYTES: tl.constexpr,
    META_OFF: tl.constexpr,  # word offset of the record in a slot, a multiple of 4
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    PAD_ROWS: tl.constexpr,  # worst-case outputs: mark rows past the received ones
    USE_CLOCK: tl.constexpr,
    TOK: tl.constexpr,
    ROWS: tl.constexpr,
    BW: tl.constexpr,  # words per row a sender moves per step
    RBW: tl.constexpr,  # words per row a receiver moves per step
    R_P2: tl.constexpr,
    K_P2: tl.constexpr,
    G_P2: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr = VIA_STORE,
    BOUNDS: tl.constexpr = False,  # channels are the ranges in bounds_ptr, not equal splits
    AWAIT: tl.constexpr = False,  # wait for each input row's flag (call + 1) before reading it
    RANKS_FROM_IDS: tl.constexpr = False,  # compute is_token_in_rank from the ids, and store it
    PUBLISH: tl.constexpr = False,  # flag each output row once written
    LOCAL: tl.constexpr = True,  # receivers copy this rank's own rows from the input
    RELEASE_STEPS: tl.constexpr = 1,  # sender steps per tail release
    ROW_MAP: tl.constexpr = False,  # row i's payload (and scales) go to row_map[i]: a
    # permutation that keeps the rows past the received ones (worst-case padding) together
):
    # Own rows are read by the receivers while the senders run: the input rows and their
    # destinations must be there before the launch, not written by it.
    tl.static_assert(not (LOCAL and (AWAIT or RANKS_FROM_IDS)))
    timeout_ns = limit_ns(timeout_us, status_ptr)
    pid = tl.program_id(0)
    call = tl.load(state_ptr + DISPATCH_CALLS, volatile=True)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    sends = pid < NUM_CHANNELS
    if sends:
        waited = dispatch_send(
            pid,
            call,
            x_ptr,
            scales_ptr,
            topk_idx_ptr,
            topk_weights_ptr,
            in_rank_ptr,
            src_tag_ptr,
            num_tokens,
            peer_ptrs,
            rank,
            ring_offset,
            tail_offset,
            head_offset,
            stage_offset,
            pe_ptr,
            status_ptr,
            timeout_ns,
            bounds_ptr,
            ready_ptr,
            W,
            G,
            K,
            E_LOCAL,
            NUM_RANKS,
            NUM_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            META_OFF,
            HAS_SCALES,
            HAS_TOPK,
            HAS_WEIGHTS,
            HAS_TAG,
            USE_CLOCK,
            TOK,
            BW,
            R_P2,
            K_P2,
            G_P2,
            VIA,
            BOUNDS,
            AWAIT,
            RANKS_FROM_IDS,
            LOCAL,
            RELEASE_STEPS,
            trace_ptr,
            PROFILE,
        )
    else:
        waited = dispatch_receive(
            pid - NUM_CHANNELS,
            call,
            peer_ptrs,
            rank,
            ring_offset,
            tail_offset,
            head_offset,
            pe_ptr,
            recv_count_ptr,
            recv_start_ptr,
            host_info_ptr,
            out_x_ptr,
            out_scales_ptr,
            out_topk_idx_ptr,
            out_weights_ptr,
            out_src_ptr,
            max_rows,
            status_ptr,
            timeout_ns,
            ready_ptr,
            relay_call_ptr,
            x_ptr,
            scales_ptr,
            topk_idx_ptr,
            topk_weights_ptr,
            in_rank_ptr,
            src_tag_ptr,
            num_tokens,
            bounds_ptr,
            W,
            G,
            K,
            E_LOCAL,
            NUM_RANKS,
            NUM_CHANNELS,
            MAX_CHANNELS,
            RING,
            RING_STRIDE,
            SLOT_BYTES,
            META_OFF,
            HAS_SCALES,
            HAS_TOPK,
            HAS_WEIGHTS,
            HAS_TAG,
            PAD_ROWS,
            USE_CLOCK,
            ROWS,
            RBW,
            R_P2,
            K_P2,
            G_P2,
            VIA,
            BOUNDS,
            PUBLISH,
            LOCAL,
            row_map_ptr,
            ROW_MAP,
            trace_ptr,
            PROFILE,
        )
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), sends, waited,
                   USE_CLOCK)  # fmt: skip
    finish_call(state_ptr, call, DISPATCH_ARRIVALS, DISPATCH_CALLS)
