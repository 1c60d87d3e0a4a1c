"""Normal-mode dispatch: each token crosses NVLink once per destination rank, through channel rings.

The tokens of a rank are split into ``C`` channels (contiguous token ranges). Program ``c < C``
is the *sender* of channel ``c``; program ``C + c`` is its *receiver*. Every rank holds, per
channel and source rank, a ring of ``RING`` slots; a slot holds one token: the payload words,
the FP8 scales, then a small record (source token index, local top-k ids, weights).

Sender. It walks its channel ``BLOCK_TOKENS`` tokens at a time. A token goes to every rank that
holds one of its experts (``is_token_in_rank``), once. The block's payload is loaded once and
stored into the slots of all its destination rings (plain NVLink stores, 16-byte vectors), with
the top-k ids already turned into the destination's local ids (``-1`` elsewhere) and the
weights zeroed where the expert is elsewhere. Then one system-scope release per destination
publishes the new *tail*. Before reusing a slot it waits (bounded) for the receiver's *head*.

Receiver. It polls the tails of all its source rings at once and copies whatever has arrived,
``BLOCK_ROWS`` slots per source per step, into the exact output rows
``recv_start[source, channel] + i`` that the notify step computed: rows come ordered by
source rank, then by source token. After each step it returns the new heads to the senders.

With ``LOCAL`` (every launch whose input is complete before it starts: all but a relay's
second leg) a token's row for this rank itself never enters a ring: the receiver's own lane
reads the channel's tokens straight from the input, ``BLOCK_ROWS`` per step beside the rows
that arrived from peers, and stores them (payload, scales and record) into their output rows
``recv_start[rank, channel] + i``. The senders then store only into peers: under the
all-to-all load of every rank at once, 12 programs push about 290 GB/s into the peers, close
to all NVLink then carries (BENCHMARKS.md), so a sender that also wrote the local copies spent
part of that on them, while the receivers' own lane stayed empty.

Flags are tagged with the call number (``call << 32 | position``), so a stale flag of an
earlier call never passes for a new one and nothing is reset between calls. At the end of a
call every receiver stores ``(call + 1) << 32`` into the heads of its sources: the ring is
free for the next call, which senders check before their first store. It does the same for
the channels the call leaves unused, so the next call may use a larger SM budget.

Failures. An id outside ``[-1, NUM_EXPERTS)`` goes nowhere; the sender that meets one records
the first such id of the batch (token order) in the status (:mod:`tritonep.kernels.status`),
which the host raises on the next call. A receiver that finds a timeout recorded when it ends
(its own wait, or any earlier one) fills every output row of its channel with 0xFF bytes:
NaN payload, scales and weights, source ``-1`` and top-k ids ``-1``, so a failed call never
returns rows that pass for data.

With ``EXCHANGE`` (a worst-case first dispatch: the host reads no count between notify and
the rows) the launch runs the count exchange of :mod:`.normal_notify` first: sender ``c``
exchanges counts with ranks ``c, c + C, ...``, the last to finish lays out the received rows
and releases a flag tagged with this launch's call number, for which the receivers wait
(bounded). Under the interpreter the senders run first, so the flag is set when the
receivers look.

Why it is fast: senders and receivers run at once (one cooperative launch), a token's payload
is read from memory once whatever its number of destinations, all destinations are fed in
the same step (every NVLink peer busy), and the only host work is the launch. Token counts,
top-k and the output size are run-time values: a new batch compiles nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .normal_notify import await_counts, count_exchange
from .phases import DISPATCH_COUNTS, DISPATCH_IDS, DISPATCH_RECV, DISPATCH_RELAY, DISPATCH_SEND
from .status import STATUS_TIMEOUT, first_bad_id, record_bad_id
from .sync import (
    aligned_ptr,
    finish_launch,
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
    wait_flag,
)
from .trace import read_clock, trace_role
from .transport import VIA_STORE, put_rings, set_peer_flags

DISPATCH_CALLS = tl.constexpr(2)
DISPATCH_ARRIVALS = tl.constexpr(3)

#: Rows a receiver pads or poisons at a time.
BLOCK_FILL = tl.constexpr(128)


class NormalShared(NamedTuple):
    """The trailing runtime arguments of the three normal-mode kernels (notify, dispatch,
    combine), in their order: what stays the same from call to call of one mode."""

    peer_ptrs: object
    pe_ptr: object
    rank: int
    state_ptr: object
    status_ptr: object
    timeout_us: int
    decoded_ptr: object


class DispatchCall(NamedTuple):
    """The leading runtime arguments of :func:`normal_dispatch_kernel`: what changes per call
    (None: a pointer the variant does not read)."""

    x_ptr: object
    scales_ptr: object
    topk_idx_ptr: object
    topk_weights_ptr: object
    in_rank_ptr: object
    src_tag_ptr: object
    num_tokens: int
    K: int
    recv_count_ptr: object
    recv_start_ptr: object
    host_info_ptr: object
    per_expert_ptr: object
    alignment: int
    out_x_ptr: object
    out_scales_ptr: object
    out_topk_idx_ptr: object
    out_weights_ptr: object
    out_src_ptr: object
    max_rows: int
    bounds_ptr: object
    ready_ptr: object
    relay_call_ptr: object
    row_map_ptr: object
    trace_ptr: object


class DispatchVariant(NamedTuple):
    """One compiled variant of :func:`normal_dispatch_kernel`: its constexprs, in order."""

    ROW_WORDS: int
    SCALE_WORDS: int
    E_LOCAL: int
    NUM_RANKS: int
    NUM_CHANNELS: int
    MAX_CHANNELS: int
    RING: int
    RING_STRIDE: int
    SLOT_BYTES: int
    RECORD_WORD: int
    RING_OFFSET: int
    TAIL_OFFSET: int
    HEAD_OFFSET: int
    STAGE_OFFSET: int
    HAS_SCALES: bool
    HAS_TOPK: bool
    HAS_WEIGHTS: bool
    HAS_TAG: bool
    PAD_ROWS: bool
    BOUNDS: bool
    AWAIT: bool
    RANKS_FROM_IDS: bool
    PUBLISH: bool
    LOCAL: bool
    ROW_MAP: bool
    RELEASE_STEPS: int
    USE_CLOCK: bool
    BLOCK_TOKENS: int
    BLOCK_ROWS: int
    BLOCK_SEND_WORDS: int
    BLOCK_RECV_WORDS: int
    BLOCK_RANKS: int
    BLOCK_K: int
    BLOCK_SCALES: int
    EXCHANGE: bool
    NOTIFY_ROW_WORDS: int
    NOTIFY_SET_BYTES: int
    NOTIFY_OFFSET: int
    NOTIFY_STAGE_OFFSET: int
    BLOCK_COUNT_TOKENS: int
    BLOCK_CHANNELS: int
    BLOCK_EXPERTS: int
    BLOCK_NOTIFY_ROW: int
    PROFILE: bool
    VIA: int


# ------------------------------------------------------------------------------ shared helpers


@triton.jit
def channel_tokens(
    channel,  # the channel of this program
    num_tokens,  # N, tokens of this rank
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    NUM_CHANNELS: tl.constexpr,
    BOUNDS: tl.constexpr,
):
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
def finish_call(
    state_ptr,  # [8] int64 device call counters
    call,  # this launch's call number
    ARRIVALS: tl.constexpr,
    CALLS: tl.constexpr,
):
    """The last program of a launch advances the launch's call counter ``state[CALLS]``;
    returns whether this program is that one.

    One counter for the whole launch, not one per program (:func:`.sync.call_number`): the
    number of programs follows the SM budget, which may change from call to call."""
    last = finish_launch(state_ptr + ARRIVALS, 0, 0, 0, call, call, False, False, True)
    if last:
        # (Released: receivers that wait for it then read what every program recorded.)
        tl.atomic_xchg(state_ptr + CALLS, call + 1, sem="release", scope="gpu")
    return last


@triton.jit
def free_rings(
    call,  # this launch's call number
    channel,  # the channel of this program
    head_offset,  # heap byte offset of the heads [C][R dest] int64
    rank,  # this rank
    my_base,  # int64 heap base of this rank
    peer_base,  # [BLOCK_RANKS] int64 heap base of each rank
    ranks,  # [BLOCK_RANKS] int32 rank lanes
    rmask,  # [BLOCK_RANKS] bool lanes that are ranks of the group
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,
    VIA: tl.constexpr,
):
    """Mark the rings this receiver drains free for the next call, in every source's heads.

    The receiver of channel ``c`` also frees channels ``c + C, c + 2 C, ...`` that this call
    leaves unused: a later call may use more channels (a larger SM budget), and its senders
    wait for a head tagged with their call before the first store into any ring.
    """
    freed = tl.zeros((ranks.shape[0],), tl.int64) + ((call + 1) << 32)
    for c in range(channel, MAX_CHANNELS, NUM_CHANNELS):
        head_at = head_offset + (c * NUM_RANKS + rank) * 8  # in each source's heap
        set_peer_flags(
            my_base, peer_base, ranks, head_at, freed, rmask, pe_ptr, NUM_RANKS, VIA, SEM="release"
        )


@triton.jit
def timed_out(
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
):
    """Whether a timeout is recorded (by this launch or an earlier one): outputs are poison."""
    return tl.load(status_ptr, volatile=True) == STATUS_TIMEOUT


@triton.jit
def peer_heaps(
    peer_ptrs,  # [R] int64 heap base addresses
    rank,  # this rank
    NUM_RANKS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
):
    """``(ranks, rmask, peer_base, my_base)``: the ``[BLOCK_RANKS]`` rank lanes and which of
    them are ranks of the group, every rank's int64 heap base, and this rank's."""
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    my_base = tl.load(peer_ptrs + rank)
    return ranks, rmask, peer_base, my_base


@triton.jit
def send_rings(
    channel,  # the channel this program sends
    rank,  # this rank
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    NUM_RANKS: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RING_OFFSET: tl.constexpr,
    TAIL_OFFSET: tl.constexpr,
    HEAD_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    VIA: tl.constexpr,
):
    """A sender's rings, one per destination rank (constexprs as the kernels'), as one tuple
    ``(ranks, peer_base, my_base, pe_ptr, ring_at, ring, tail_at, head_flag)``: the rank
    lanes, every rank's heap base and this rank's, the PEs, the heap offset of this rank's
    ring in every destination, the ``[BLOCK_RANKS]`` addresses its rows are built at (the
    destination's ring, or with ``VIA`` this rank's mirror of it), the heap offset of its tail
    there, and the pointers to the int64 heads the destinations return here."""
    ranks, _rmask, peer_base, my_base = peer_heaps(peer_ptrs, rank, NUM_RANKS, BLOCK_RANKS)
    pair = channel * NUM_RANKS + rank
    ring_at = RING_OFFSET + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)  # in each peer
    ring = peer_base + ring_at
    if VIA != VIA_STORE:
        # Rows are built in this rank's mirror of each destination's ring, then put there.
        mirror_pairs = (channel * NUM_RANKS + ranks).to(tl.int64)
        ring = my_base + STAGE_OFFSET + mirror_pairs * (RING_STRIDE * SLOT_BYTES)
    head_flag = (my_base + HEAD_OFFSET + (channel * NUM_RANKS + ranks) * 8).to(
        tl.pointer_type(tl.int64)
    )
    tail_at = TAIL_OFFSET + pair * 8
    return ranks, peer_base, my_base, pe_ptr, ring_at, ring, tail_at, head_flag


@triton.jit
def announce(
    rings,  # the sender's rings (send_rings)
    announced,  # [BLOCK_RANKS] int32 rows of each ring its tail already announces
    upto,  # [BLOCK_RANKS] int32 rows of each ring written so far
    tag,  # int64 this call's tag (call << 32)
    NUM_RANKS: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    VIA: tl.constexpr,
):
    """Publish a sender's rows ``[announced, upto)`` of every ring: one system-scope release
    of each tail (with ``VIA``, after putting the rows from this rank's mirrors)."""
    ranks, peer_base, my_base, pe_ptr, ring_at, ring, tail_at, _head_flag = rings
    put_rings(
        my_base,
        peer_base,
        ranks,
        ring_at,
        ring,
        announced,
        upto,
        tail_at,
        tag,
        pe_ptr,
        NUM_RANKS,
        RING,
        SLOT_BYTES,
        VIA,
    )


@triton.jit
def receive_rings(
    channel,  # the channel this program receives
    rank,  # this rank
    ranks,  # [BLOCK_RANKS] int32 rank lanes
    my_base,  # int64 heap base of this rank
    NUM_RANKS: tl.constexpr,
    RING_STRIDE: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RING_OFFSET: tl.constexpr,
    TAIL_OFFSET: tl.constexpr,
    HEAD_OFFSET: tl.constexpr,
):
    """A receiver's rings, one per source rank, in this rank's heap (constexprs as the
    kernels'): ``(ring, tail_flag, head_at)``, the ``[BLOCK_RANKS]`` ring addresses, the
    pointers to their tails, and the heap offset of the head this rank returns to every
    source."""
    pair = channel * NUM_RANKS + ranks
    ring = my_base + RING_OFFSET + pair.to(tl.int64) * (RING_STRIDE * SLOT_BYTES)
    tail_flag = (my_base + TAIL_OFFSET + pair * 8).to(tl.pointer_type(tl.int64))
    return ring, tail_flag, HEAD_OFFSET + (channel * NUM_RANKS + rank) * 8


@triton.jit
def step_ids(
    topk_idx_ptr,  # [N, K] int64 global expert ids
    tokens,  # [BLOCK_TOKENS] int32 the step's tokens
    tmask,  # [BLOCK_TOKENS] bool the step's tokens that exist (and have arrived)
    K,  # top-k columns
    NUM_EXPERTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``[BLOCK_TOKENS, BLOCK_K]`` int64 top-k ids of a step's tokens (``-1`` in masked lanes),
    and where they lie outside ``[-1, NUM_EXPERTS)`` (int32 1s: reduced once, after the
    channel, rather than a block-wide reduction per step)."""
    ks = tl.arange(0, BLOCK_K)
    ids = tl.load(
        topk_idx_ptr + tokens.to(tl.int64)[:, None] * K + ks[None, :],
        mask=tmask[:, None] & (ks < K)[None, :],
        other=-1,
    )
    return ids, ((ids < -1) | (ids >= NUM_EXPERTS)).to(tl.int32)


@triton.jit
def step_destinations(
    ids,  # [BLOCK_TOKENS, BLOCK_K] int64 the step's top-k ids
    tokens,  # [BLOCK_TOKENS] int32 the step's tokens
    tmask,  # [BLOCK_TOKENS] bool the step's tokens that exist (and have arrived)
    t1,  # int32 the channel's end token
    in_rank_ptr,  # [N, R] int8 is_token_in_rank (stored with RANKS_FROM_IDS)
    rank,  # this rank
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RANKS_FROM_IDS: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
):
    """``[BLOCK_TOKENS, BLOCK_RANKS]`` int32, 1 where a token of the step goes to a rank
    through a ring: ``is_token_in_rank``, or (``RANKS_FROM_IDS``, a relay) the ranks of its
    ``ids``, which are then stored as ``is_token_in_rank``; with ``LOCAL`` never this rank
    (its receiver copies its own rows from the input)."""
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    at_rank = tokens.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :]
    if RANKS_FROM_IDS:
        owner = tl.where(ids >= 0, ids // E_LOCAL, -1)
        hit = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), 1)
        tl.store(
            in_rank_ptr + at_rank, hit.to(tl.int8), mask=(tokens < t1)[:, None] & rmask[None, :]
        )
    else:
        hit = tl.load(in_rank_ptr + at_rank, mask=tmask[:, None] & rmask[None, :], other=0)
    hit = (hit != 0).to(tl.int32)
    if LOCAL:
        hit = tl.where(ranks[None, :] == rank, 0, hit)
    return hit


@triton.jit
def store_step(
    x_ptr,  # [N, ROW_WORDS] int32 payload words
    scales_ptr,  # [N, SCALE_WORDS] int32 scale words (HAS_SCALES)
    topk_weights_ptr,  # [N, K] float32 (HAS_WEIGHTS)
    src_tag_ptr,  # [N] int32 each row's recorded source (HAS_TAG)
    tokens,  # [BLOCK_TOKENS] int32 the step's tokens
    tmask,  # [BLOCK_TOKENS] bool the step's tokens that exist (and have arrived)
    ids,  # [BLOCK_TOKENS, BLOCK_K] int64 the step's global top-k ids
    hit,  # [BLOCK_TOKENS, BLOCK_RANKS] int32 1 where a token goes to a rank's ring
    dst,  # [BLOCK_TOKENS, BLOCK_RANKS] int64 slot address of each token in each ring
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RECORD_WORD: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    BLOCK_SEND_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """Store a step's tokens into the slots ``dst`` (``[BLOCK_TOKENS, BLOCK_RANKS]``
    addresses) of every destination ``hit`` names: payload words, scales, then the record
    (source, the destination's local top-k ids, weights zeroed where the expert is
    elsewhere)."""
    ranks = tl.arange(0, BLOCK_RANKS)
    words = tl.arange(0, BLOCK_SEND_WORDS)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    groups = tl.arange(0, BLOCK_SCALES)
    gmask = groups < SCALE_WORDS
    tokens64 = tokens.to(tl.int64)
    # The loads of the next chunk are issued before the stores of this one, so a chunk costs
    # about one memory latency however many destinations it has.
    rows = x_ptr + tokens64[:, None] * ROW_WORDS
    v = tl.load(rows + words[None, :], mask=tmask[:, None] & (words < ROW_WORDS)[None, :])
    for w0 in range(0, ROW_WORDS, BLOCK_SEND_WORDS):
        w = w0 + words
        wn = w + BLOCK_SEND_WORDS
        v_next = tl.load(rows + wn[None, :], mask=tmask[:, None] & (wn < ROW_WORDS)[None, :])
        for d in tl.static_range(NUM_RANKS):
            to_d = lane(hit, ranks, d) > 0
            p = aligned_ptr(lane(dst, ranks, d), tl.int32)
            tl.store(p[:, None] + w[None, :], v, mask=to_d[:, None] & (w < ROW_WORDS)[None, :])
        v = v_next
    if HAS_SCALES:
        s = tl.load(
            scales_ptr + tokens64[:, None] * SCALE_WORDS + groups[None, :],
            mask=tmask[:, None] & gmask[None, :],
        )
        for d in tl.static_range(NUM_RANKS):
            to_d = lane(hit, ranks, d) > 0
            p = aligned_ptr(lane(dst, ranks, d) + ROW_WORDS * 4, tl.int32)
            tl.store(p[:, None] + groups[None, :], s, mask=to_d[:, None] & gmask[None, :])
    if HAS_TOPK:
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
        to_d = lane(hit, ranks, d) > 0
        record = aligned_ptr(lane(dst, ranks, d) + RECORD_WORD * 4, tl.int32)
        tl.store(record, source, mask=to_d)
        if HAS_TOPK:
            local = tl.where(owner == d, ids - d * E_LOCAL, -1).to(tl.int32)
            kto = to_d[:, None] & kmask[None, :]
            tl.store(record[:, None] + 1 + ks[None, :], local, mask=kto)
            if HAS_WEIGHTS:
                wrec = record.to(tl.pointer_type(tl.float32))
                tl.store(
                    wrec[:, None] + 1 + K + ks[None, :],
                    tl.where(owner == d, weights, 0.0),
                    mask=kto,
                )


@triton.jit
def dispatch_send(
    channel,  # the channel this program sends
    call,  # this launch's call number
    inputs,  # (x, scales, topk_idx, topk_weights, in_rank, src_tag) pointers, as the kernel's
    num_tokens,  # N
    K,  # top-k columns
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    ready_ptr,  # [N] int32 per-token flags awaited before reading a token (AWAIT)
    trace_ptr,  # readings (PROFILE)
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # NormalShared (limit in ns)
    row_format,  # constexpr (ROW_WORDS, SCALE_WORDS, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, HAS_TAG)
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    ring_shape,  # constexpr (RING, RING_STRIDE, SLOT_BYTES, RECORD_WORD), as the kernel's
    ring_offsets,  # constexpr (RING_OFFSET, TAIL_OFFSET, HEAD_OFFSET, STAGE_OFFSET)
    BOUNDS: tl.constexpr,
    AWAIT: tl.constexpr,
    RANKS_FROM_IDS: tl.constexpr,
    LOCAL: tl.constexpr,
    RELEASE_STEPS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_SEND_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The sender of ``channel`` (constexprs as :func:`normal_dispatch_kernel`'s): walk its
    tokens, feed every destination ring (with ``LOCAL``, every ring but this rank's own).
    Returns the time it waited (with ``PROFILE``; 0 otherwise)."""
    x_ptr, scales_ptr, topk_idx_ptr, topk_weights_ptr, in_rank_ptr, src_tag_ptr = inputs
    RING: tl.constexpr = ring_shape[0]
    RING_STRIDE: tl.constexpr = ring_shape[1]
    SLOT_BYTES: tl.constexpr = ring_shape[2]
    RECORD_WORD: tl.constexpr = ring_shape[3]
    RING_OFFSET: tl.constexpr = ring_offsets[0]
    TAIL_OFFSET: tl.constexpr = ring_offsets[1]
    HEAD_OFFSET: tl.constexpr = ring_offsets[2]
    STAGE_OFFSET: tl.constexpr = ring_offsets[3]
    ROW_WORDS: tl.constexpr = row_format[0]
    SCALE_WORDS: tl.constexpr = row_format[1]
    HAS_SCALES: tl.constexpr = row_format[2]
    HAS_TOPK: tl.constexpr = row_format[3]
    HAS_WEIGHTS: tl.constexpr = row_format[4]
    HAS_TAG: tl.constexpr = row_format[5]
    tag = call << 32
    t0, t1 = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
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
    ranks, _peer_base, _my_base, _pe_ptr, _ring_at, ring, _tail_at, head_flag = rings
    sent = tl.zeros((BLOCK_RANKS,), tl.int32)
    released = tl.zeros((BLOCK_RANKS,), tl.int64)  # last head value read, per destination
    budget = timeout_ns + tl.zeros((), tl.int64)
    waited = tl.zeros((), tl.int64)
    bad = tl.zeros((BLOCK_TOKENS, BLOCK_K), tl.int32)  # ids outside [-1, E) met, per lane
    announced = sent  # rows up to here are announced by the tails
    unannounced = tl.zeros((), tl.int32)  # steps copied but not yet announced
    for first in range(t0, t1, BLOCK_TOKENS):
        tokens = first + tl.arange(0, BLOCK_TOKENS)
        tmask = tokens < t1
        if AWAIT:  # relayed rows: wait until the network leg has written them here
            if PROFILE:
                t_w = read_clock(trace_ptr, USE_CLOCK)
            # Flags only grow (the reading launch's call + 1), so "at least" is "this call's".
            _, arrived = wait_all_at_least(
                ready_ptr + tokens.to(tl.int64),
                (call + 1).to(tl.int32),
                tmask,
                budget,
                USE_CLOCK,
                True,
            )
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
            if not arrived:
                record_timeout(status_ptr, -1, DISPATCH_RELAY, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
            # Rows not arrived are not read. (A tile compare, not `tmask & arrived`: Triton
            # 3.9's interpreter splats a scalar comparison as int32, which no mask accepts.)
            tmask = tokens < tl.where(arrived, t1, 0)
        if HAS_TOPK or RANKS_FROM_IDS:
            ids, bad_here = step_ids(topk_idx_ptr, tokens, tmask, K, E_LOCAL * NUM_RANKS, BLOCK_K)
            bad = bad | bad_here
        else:
            ids = tl.full((BLOCK_TOKENS, BLOCK_K), -1, tl.int64)
        hit = step_destinations(
            ids,
            tokens,
            tmask,
            t1,
            in_rank_ptr,
            rank,
            E_LOCAL,
            NUM_RANKS,
            RANKS_FROM_IDS,
            LOCAL,
            BLOCK_RANKS,
        )
        count = tl.sum(hit, 0)
        position = sent[None, :] + rows_before(hit, BLOCK_TOKENS)
        # The slots must be free: the receiver has moved its head far enough, in this call.
        target = tag | tl.maximum(sent + count - RING, 0).to(tl.int64)
        blocked = (count > 0) & (released < target)
        ok = tl.max(blocked.to(tl.int32), 0) == 0
        if not ok:
            if unannounced > 0:
                # The slots waited for are freed only once the receivers have the rows held
                # back: announce them first.
                announce(rings, announced, sent, tag, NUM_RANKS, RING, SLOT_BYTES, VIA)
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
                record_timeout(status_ptr, peer, DISPATCH_SEND, timeout_ns, channel)
                budget = tl.zeros((), tl.int64)
        # After a timeout (budget spent) the program stores and publishes nothing more: tails
        # past a skipped step would hand its slots, stale, to healthy peers as this call's
        # rows; unpublished, those peers time out too and name this rank.
        if ok & (budget > 0):
            dst = ring[None, :] + (position % RING).to(tl.int64) * SLOT_BYTES  # slot addresses
            store_step(
                x_ptr,
                scales_ptr,
                topk_weights_ptr,
                src_tag_ptr,
                tokens,
                tmask,
                ids,
                hit,
                dst,
                K,
                ROW_WORDS,
                SCALE_WORDS,
                E_LOCAL,
                NUM_RANKS,
                RECORD_WORD,
                HAS_SCALES,
                HAS_TOPK,
                HAS_WEIGHTS,
                HAS_TAG,
                BLOCK_SEND_WORDS,
                BLOCK_RANKS,
                BLOCK_K,
                BLOCK_SCALES,
            )
            tl.debug_barrier()
            # One system-scope release per RELEASE_STEPS steps and at the channel's end: each
            # waits for the stores before it to reach the peers.
            unannounced += 1
            if (unannounced >= RELEASE_STEPS) | (first + BLOCK_TOKENS >= t1):
                announce(rings, announced, sent + count, tag, NUM_RANKS, RING, SLOT_BYTES, VIA)
                announced = sent + count
                unannounced = unannounced * 0
        sent += count
    if tl.max(tl.max(bad, 1), 0) > 0:  # the error path: the batch's first bad id, whichever
        # sender met one
        token, col, bad_id = first_bad_id(
            topk_idx_ptr, num_tokens, K, E_LOCAL * NUM_RANKS, BLOCK_K, BLOCK_TOKENS
        )
        record_bad_id(status_ptr, rank, DISPATCH_IDS, token, col, bad_id)
    return waited


# ---------------------------------------------------------------------------------- receiver


@triton.jit
def own_lane(
    own,  # [BLOCK_RANKS, BLOCK_ROWS] bool lanes of this rank's own rows
    own_tok,  # int32 the own lane's next token of the channel
    own_end,  # int32 the channel's end token
    own_next,  # int32 the own lane's next output row
    in_rank_ptr,  # [N, R] int8 is_token_in_rank
    x_addr,  # int64 address of the [N, ROW_WORDS] int32 input payload
    rank,  # this rank
    row,  # [BLOCK_RANKS, BLOCK_ROWS] int64 output row of each ring row
    live,  # [BLOCK_RANKS, BLOCK_ROWS] bool ring rows to copy
    src,  # [BLOCK_RANKS, BLOCK_ROWS] int64 slot address of each ring row
    NUM_RANKS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """The own lane of a receiver's step (``LOCAL``): the next ``BLOCK_ROWS`` tokens of the
    channel from ``own_tok`` on, those for this rank live, read from the input at ``x_addr``
    into rows ``own_next + (this rank's tokens before it)``. Returns the step's ``(token,
    row, live, src)`` tiles with the own lane filled in, and the number of own rows."""
    steps = tl.arange(0, BLOCK_ROWS)
    earlier = (steps[None, :] < steps[:, None]).to(tl.int32)  # [row, earlier row]
    mine = own_tok + steps
    hit = (
        tl.load(in_rank_ptr + mine.to(tl.int64) * NUM_RANKS + rank, mask=mine < own_end, other=0)
        != 0
    )
    hit32 = hit.to(tl.int32)
    before = tl.sum(earlier * hit32[None, :], 1)
    token = tl.where(own, mine[None, :], 0)
    row = tl.where(own, (own_next + before)[None, :].to(tl.int64), row)
    live = tl.where(own, hit[None, :], live)
    src = tl.where(own, x_addr + token.to(tl.int64) * (ROW_WORDS * 4), src)
    return token, row, live, src, tl.sum(hit32, 0)


@triton.jit
def copy_rows(
    src,  # [F] int64 slot address of each row (input row address for own rows)
    row,  # [F] int64 output row of each row
    live,  # [F] bool rows to copy
    mine,  # [F] bool this rank's own rows, read from the input (LOCAL)
    token,  # [F] int64 input token of each own row (LOCAL)
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    scales_addr,  # int64 address of the [N, SCALE_WORDS] int32 input scales (LOCAL)
    topk_idx_ptr,  # [N, K] int64 global expert ids (LOCAL and HAS_TOPK)
    topk_weights_ptr,  # [N, K] float32 (LOCAL and HAS_WEIGHTS)
    src_tag_ptr,  # [N] int32 recorded sources (LOCAL and HAS_TAG)
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    rank,  # this rank
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    RECORD_WORD: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    LOCAL: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """Copy the ``live`` rows of a step (flat ``[lanes * BLOCK_ROWS]`` tiles: ``src`` the
    slot, or for ``mine`` rows the input row of ``token``, and ``row`` the output row) into
    the outputs: payload and scales (at ``row_map[row]`` with ``ROW_MAP``), then the source,
    local top-k ids and weights (at ``row``)."""
    out_x_ptr, out_scales_ptr, out_topk_idx_ptr, out_weights_ptr, out_src_ptr = outputs
    words = tl.arange(0, BLOCK_RECV_WORDS)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    groups = tl.arange(0, BLOCK_SCALES)
    gmask = groups < SCALE_WORDS
    out = row  # where the row's payload goes; its record and flag stay at ``row``
    if ROW_MAP:
        # The caller's final order, written here instead of a gather of every row afterwards
        # (the internode mode's (source rank, token) order).
        out = tl.load(row_map_ptr + row, mask=live, other=0).to(tl.int64)
    p = aligned_ptr(src, tl.int32)[:, None]
    v = tl.load(
        p + words[None, :], mask=live[:, None] & (words < ROW_WORDS)[None, :], cache_modifier=".cg"
    )
    for w0 in range(0, ROW_WORDS, BLOCK_RECV_WORDS):
        w = w0 + words
        wn = w + BLOCK_RECV_WORDS
        v_next = tl.load(
            p + wn[None, :], mask=live[:, None] & (wn < ROW_WORDS)[None, :], cache_modifier=".cg"
        )
        tl.store(
            out_x_ptr + out[:, None] * ROW_WORDS + w[None, :],
            v,
            mask=live[:, None] & (w < ROW_WORDS)[None, :],
        )
        v = v_next
    if HAS_SCALES:
        m2 = live[:, None] & gmask[None, :]
        at = src + ROW_WORDS * 4
        if LOCAL:
            at = tl.where(mine, scales_addr + token * (SCALE_WORDS * 4), at)
        v = tl.load(
            aligned_ptr(at, tl.int32)[:, None] + groups[None, :], mask=m2, cache_modifier=".cg"
        )
        tl.store(out_scales_ptr + out[:, None] * SCALE_WORDS + groups[None, :], v, mask=m2)
    from_ring = live & ~mine
    record = aligned_ptr(src + RECORD_WORD * 4, tl.int32)
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
        ring_lanes = from_ring[:, None] & kmask[None, :]
        local = tl.load(
            record[:, None] + 1 + ks[None, :], mask=ring_lanes, cache_modifier=".cg"
        ).to(tl.int64)
        if HAS_WEIGHTS:
            at = record.to(tl.pointer_type(tl.float32))[:, None] + 1 + K + ks[None, :]
            wv = tl.load(at, mask=ring_lanes, cache_modifier=".cg")
        if LOCAL:
            m_own = (live & mine)[:, None] & kmask[None, :]
            at = token[:, None] * K + ks[None, :]
            ids = tl.load(topk_idx_ptr + at, mask=m_own, other=-1)
            here = (ids >= 0) & (ids // E_LOCAL == rank)
            local = tl.where(mine[:, None], tl.where(here, ids - rank * E_LOCAL, -1), local)
            if HAS_WEIGHTS:
                wo = tl.load(topk_weights_ptr + at, mask=m_own, other=0.0)
                wv = tl.where(mine[:, None], tl.where(here, wo, 0.0), wv)
        tl.store(out_topk_idx_ptr + row[:, None] * K + ks[None, :], local, mask=m2)
        if HAS_WEIGHTS:
            tl.store(out_weights_ptr + row[:, None] * K + ks[None, :], wv, mask=m2)


@triton.jit
def fill_rows(
    first,  # first row to fill
    end,  # end of the rows to fill (exclusive)
    max_rows,  # rows the outputs hold
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    K,  # top-k columns
    POISON: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """Rows ``[first, end)`` (below ``max_rows``) as padding (source and top-k ids ``-1``,
    weights 0) or, with ``POISON``, as 0xFF bytes throughout (NaN payload, scales and
    weights; source and ids ``-1``)."""
    out_x_ptr, out_scales_ptr, out_topk_idx_ptr, out_weights_ptr, out_src_ptr = outputs
    ks = tl.arange(0, BLOCK_K)
    fill = tl.arange(0, BLOCK_FILL)
    words = tl.arange(0, BLOCK_RECV_WORDS)
    groups = tl.arange(0, BLOCK_SCALES)
    for at in range(first, end, BLOCK_FILL):
        rows = (at + fill).to(tl.int64)
        rm = (rows < end) & (rows < max_rows)
        tl.store(out_src_ptr + rows, tl.full((BLOCK_FILL,), -1, tl.int32), mask=rm)
        if HAS_TOPK:
            m2 = rm[:, None] & (ks < K)[None, :]
            at_k = rows[:, None] * K + ks[None, :]
            tl.store(out_topk_idx_ptr + at_k, tl.full((BLOCK_FILL, BLOCK_K), -1, tl.int64), mask=m2)
            if HAS_WEIGHTS:
                if POISON:
                    weights = tl.full((BLOCK_FILL, BLOCK_K), float("nan"), tl.float32)
                else:
                    weights = tl.zeros((BLOCK_FILL, BLOCK_K), tl.float32)
                tl.store(out_weights_ptr + at_k, weights, mask=m2)
        if POISON:
            out = rows
            if ROW_MAP:
                out = tl.load(row_map_ptr + rows, mask=rm, other=0).to(tl.int64)
            for w0 in range(0, ROW_WORDS, BLOCK_RECV_WORDS):
                w = w0 + words
                tl.store(
                    out_x_ptr + out[:, None] * ROW_WORDS + w[None, :],
                    tl.full((BLOCK_FILL, BLOCK_RECV_WORDS), -1, tl.int32),
                    mask=rm[:, None] & (w < ROW_WORDS)[None, :],
                )
            if HAS_SCALES:
                tl.store(
                    out_scales_ptr + out[:, None] * SCALE_WORDS + groups[None, :],
                    tl.full((BLOCK_FILL, BLOCK_SCALES), -1, tl.int32),
                    mask=rm[:, None] & (groups < SCALE_WORDS)[None, :],
                )


@triton.jit
def pad_channel_rows(
    channel,  # the channel this program receives
    host_info_ptr,  # [1 + E_LOCAL] int32, [0] = rows received
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    max_rows,  # rows the outputs hold
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    PAD_ROWS: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """With ``PAD_ROWS``, a receiver's share of the rows past the received ones as padding
    (constexprs as :func:`normal_dispatch_kernel`'s)."""
    if PAD_ROWS:  # rows past the received ones, this channel's share of them
        total = tl.load(host_info_ptr)
        for first in range(total + channel * BLOCK_FILL, max_rows, NUM_CHANNELS * BLOCK_FILL):
            fill_rows(
                first,
                first + BLOCK_FILL,
                max_rows,
                outputs,
                row_map_ptr,
                K,
                False,
                ROW_WORDS,
                SCALE_WORDS,
                HAS_SCALES,
                HAS_TOPK,
                HAS_WEIGHTS,
                ROW_MAP,
                BLOCK_RECV_WORDS,
                BLOCK_K,
                BLOCK_SCALES,
            )


@triton.jit
def copy_step(
    head,  # [BLOCK_RANKS] int32 slots of each source's ring already copied
    take,  # [BLOCK_RANKS] int32 slots of each ring to copy in this step
    start,  # [BLOCK_RANKS] int32 first output row of each source's rows of the channel
    ring,  # [BLOCK_RANKS] int64 address of each source's ring
    own_tok,  # int32 the own lane's next token of the channel (LOCAL)
    own_end,  # int32 the channel's end token (LOCAL)
    own_next,  # int32 the own lane's next output row (LOCAL)
    x_addr,  # int64 address of the [N, ROW_WORDS] int32 input payload (LOCAL)
    scales_addr,  # int64 address of the [N, SCALE_WORDS] int32 input scales (LOCAL)
    topk_idx_ptr,  # [N, K] int64 global expert ids (LOCAL and HAS_TOPK)
    topk_weights_ptr,  # [N, K] float32 (LOCAL and HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] int8 destinations of each token (LOCAL)
    src_tag_ptr,  # [N] int32 recorded sources (LOCAL and HAS_TAG)
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    max_rows,  # rows the outputs hold
    ready_ptr,  # [max_rows] int32 per-row flags set once a row is written (PUBLISH)
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    published,  # int32 the flag value of this call's rows (PUBLISH)
    rank,  # this rank
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RECORD_WORD: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """Copy one receiver step into the outputs (constexprs as :func:`normal_dispatch_kernel`'s):
    ``take`` slots of each source's ring from ``head`` on into rows ``start + head`` on, and
    with ``LOCAL`` the own lane's next ``BLOCK_ROWS`` tokens from the input; rows at or past
    ``max_rows`` are dropped. Returns the own rows copied (0 without ``LOCAL``)."""
    FLAT: tl.constexpr = BLOCK_RANKS * BLOCK_ROWS  # rows of a step, flattened
    i = tl.arange(0, BLOCK_ROWS)[None, :]
    slot = ((head[:, None] + i) % RING).to(tl.int64)
    row = (start[:, None] + head[:, None] + i).to(tl.int64)
    live = i < take[:, None]
    src = ring[:, None] + slot * SLOT_BYTES
    sources = tl.arange(0, BLOCK_RANKS)[:, None] + 0 * i  # source rank of each row
    own = sources < 0
    if LOCAL:
        own = sources == rank  # the own lane: rows read from the input
    token = tl.zeros((BLOCK_RANKS, BLOCK_ROWS), tl.int32)
    taken = tl.zeros((), tl.int32)
    if LOCAL:
        token, row, live, src, taken = own_lane(
            own,
            own_tok,
            own_end,
            own_next,
            in_rank_ptr,
            x_addr,
            rank,
            row,
            live,
            src,
            NUM_RANKS,
            ROW_WORDS,
            BLOCK_ROWS,
        )
    live = live & (row < max_rows)  # worst-case outputs drop the overflow
    row = tl.reshape(row, (FLAT,))
    live = tl.reshape(live, (FLAT,))
    copy_rows(
        tl.reshape(src, (FLAT,)),
        row,
        live,
        tl.reshape(own, (FLAT,)),
        tl.reshape(token, (FLAT,)).to(tl.int64),
        outputs,
        scales_addr,
        topk_idx_ptr,
        topk_weights_ptr,
        src_tag_ptr,
        row_map_ptr,
        rank,
        K,
        ROW_WORDS,
        SCALE_WORDS,
        E_LOCAL,
        RECORD_WORD,
        HAS_SCALES,
        HAS_TOPK,
        HAS_WEIGHTS,
        HAS_TAG,
        LOCAL,
        ROW_MAP,
        BLOCK_RECV_WORDS,
        BLOCK_K,
        BLOCK_SCALES,
    )
    if PUBLISH:
        publish_rows(ready_ptr + row, published, live)
    return taken


@triton.jit
def drain_rings(
    count,  # [BLOCK_RANKS] int32 rows each source sends over this channel (own rank: 0 with LOCAL)
    start,  # [BLOCK_RANKS] int32 first output row of each source's rows
    ring,  # [BLOCK_RANKS] int64 address of each source's ring here
    tail_flag,  # [BLOCK_RANKS] pointers to each ring's tail (int64, tagged)
    head_at,  # heap byte offset of this rank's head in each source's heap
    tag,  # int64 this call's tag (call << 32)
    own_tok,  # int32 the own lane's first token (LOCAL)
    own_end,  # int32 the channel's end token (LOCAL)
    own_next,  # int32 the own lane's first output row (LOCAL)
    x_addr,  # int64 address of the [N, ROW_WORDS] int32 input payload (LOCAL)
    scales_addr,  # int64 address of the [N, SCALE_WORDS] int32 input scales (LOCAL)
    topk_idx_ptr,  # [N, K] int64 global expert ids (LOCAL and HAS_TOPK)
    topk_weights_ptr,  # [N, K] float32 (LOCAL and HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] int8 destinations of each token (LOCAL)
    src_tag_ptr,  # [N] int32 recorded sources (LOCAL and HAS_TAG)
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    max_rows,  # rows the outputs hold
    ready_ptr,  # [max_rows] int32 per-row flags set once a row is written (PUBLISH)
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    published,  # int32 the flag value of this call's rows (PUBLISH)
    trace_ptr,  # int64 readings (PROFILE)
    ranks,  # [BLOCK_RANKS] int32 rank lanes
    peer_base,  # [BLOCK_RANKS] int64 heap base of each rank
    my_base,  # int64 heap base of this rank
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    timeout_ns,  # int64 limit of the wait without progress
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RING: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RECORD_WORD: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_TAG: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    ROW_MAP: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The receiving loop (constexprs as :func:`normal_dispatch_kernel`'s): poll the tails of
    every source ring, copy what has arrived (and with ``LOCAL`` the own lane's next tokens)
    a step at a time, and return the heads to the sources; stop once every row is copied or
    ``timeout_ns`` passed without progress. Returns ``(head, waited)``: the slots copied from
    each source and the time it polled without progress (with ``PROFILE``; 0 otherwise)."""
    head = tl.zeros((BLOCK_RANKS,), tl.int32)
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int32)  # reads since the last progress
    pending = tl.sum(count, 0)
    waited = tl.zeros((), tl.int64)
    while keep_waiting((pending <= 0) & (own_tok >= own_end), clock, timeout_ns, spins, USE_CLOCK):
        if PROFILE:
            t_w = read_clock(trace_ptr, USE_CLOCK)
        waiting = head < count
        tails = tl.atomic_add(tail_flag, 0, mask=waiting, sem="acquire", scope="sys")
        arrived = tl.where(waiting & (tails >= tag), (tails & 0xFFFFFFFF).to(tl.int32), head)
        take = tl.minimum(arrived - head, BLOCK_ROWS)
        if (tl.max(take, 0) > 0) | (own_tok < own_end):
            tl.debug_barrier()
            taken = copy_step(
                head,
                take,
                start,
                ring,
                own_tok,
                own_end,
                own_next,
                x_addr,
                scales_addr,
                topk_idx_ptr,
                topk_weights_ptr,
                in_rank_ptr,
                src_tag_ptr,
                outputs,
                max_rows,
                ready_ptr,
                row_map_ptr,
                published,
                rank,
                K,
                ROW_WORDS,
                SCALE_WORDS,
                E_LOCAL,
                NUM_RANKS,
                RING,
                SLOT_BYTES,
                RECORD_WORD,
                HAS_SCALES,
                HAS_TOPK,
                HAS_WEIGHTS,
                HAS_TAG,
                PUBLISH,
                LOCAL,
                ROW_MAP,
                BLOCK_ROWS,
                BLOCK_RECV_WORDS,
                BLOCK_RANKS,
                BLOCK_K,
                BLOCK_SCALES,
            )
            if LOCAL:
                own_next += taken
                own_tok += BLOCK_ROWS
            head += take
            tl.debug_barrier()
            # Relaxed: the slots' loads have returned (their values are stored), so nothing
            # can move past this store that a sender's overwrite could affect; a release
            # would add a system-wide fence to every step.
            set_peer_flags(
                my_base,
                peer_base,
                ranks,
                head_at,
                tag | head.to(tl.int64),
                take > 0,
                pe_ptr,
                NUM_RANKS,
                VIA,
                SEM="relaxed",
            )
            clock = start_clock(USE_CLOCK)  # progress: the limit counts idle time only
            spins = spins * 0
        else:
            spins += 1
            if PROFILE:
                waited += read_clock(trace_ptr, USE_CLOCK) - t_w
        pending = tl.sum(count - head, 0)
    return head, waited


@triton.jit
def dispatch_receive(
    channel,  # the channel this program receives
    call,  # this launch's call number
    inputs,  # (x, scales, topk_idx, topk_weights, in_rank, src_tag) pointers, as the kernel's
    num_tokens,  # N
    K,  # top-k columns
    recv_count_ptr,  # [R, C] int32 tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 first output row of each (source, channel)
    host_info_ptr,  # from notify
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    max_rows,  # rows the outputs hold
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    ready_ptr,  # [max_rows] int32 per-row flags set once a row is written (PUBLISH)
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    trace_ptr,  # as the kernel's
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # NormalShared (limit in ns)
    row_format,  # constexpr (ROW_WORDS, SCALE_WORDS, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, HAS_TAG)
    ROW_MAP: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    MAX_CHANNELS: tl.constexpr,
    ring_shape,  # constexpr (RING, RING_STRIDE, SLOT_BYTES, RECORD_WORD), as the kernel's
    ring_offsets,  # constexpr (RING_OFFSET, TAIL_OFFSET, HEAD_OFFSET, STAGE_OFFSET)
    PAD_ROWS: tl.constexpr,
    BOUNDS: tl.constexpr,
    PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    PROFILE: tl.constexpr,
    VIA: tl.constexpr,
):
    """The receiver of ``channel`` (constexprs as :func:`normal_dispatch_kernel`'s): drain
    the rings of every source into the outputs (with ``LOCAL``, this rank's own lane of each
    step reads the channel's tokens straight from the input instead). Returns the time it
    polled without progress (with ``PROFILE``; 0 otherwise)."""
    x_ptr, scales_ptr, topk_idx_ptr, topk_weights_ptr, in_rank_ptr, src_tag_ptr = inputs
    RING: tl.constexpr = ring_shape[0]
    RING_STRIDE: tl.constexpr = ring_shape[1]
    SLOT_BYTES: tl.constexpr = ring_shape[2]
    RECORD_WORD: tl.constexpr = ring_shape[3]
    RING_OFFSET: tl.constexpr = ring_offsets[0]
    TAIL_OFFSET: tl.constexpr = ring_offsets[1]
    HEAD_OFFSET: tl.constexpr = ring_offsets[2]
    ROW_WORDS: tl.constexpr = row_format[0]
    SCALE_WORDS: tl.constexpr = row_format[1]
    HAS_SCALES: tl.constexpr = row_format[2]
    HAS_TOPK: tl.constexpr = row_format[3]
    HAS_WEIGHTS: tl.constexpr = row_format[4]
    HAS_TAG: tl.constexpr = row_format[5]
    ranks, rmask, peer_base, my_base = peer_heaps(peer_ptrs, rank, NUM_RANKS, BLOCK_RANKS)
    tag = call << 32
    count = tl.load(recv_count_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    start = tl.load(recv_start_ptr + ranks * NUM_CHANNELS + channel, mask=rmask, other=0)
    # The own lane walks the channel's tokens BLOCK_ROWS at a time, from own_tok to own_end; a
    # token for this rank lands at recv_start[rank, channel] + (this rank's tokens before it).
    own_tok = tl.zeros((), tl.int32)
    own_end = own_tok
    own_next = own_tok
    if LOCAL:
        count = tl.where(ranks == rank, 0, count)
        own_tok, own_end = channel_tokens(channel, num_tokens, bounds_ptr, NUM_CHANNELS, BOUNDS)
        own_next = tl.load(recv_start_ptr + rank * NUM_CHANNELS + channel)
    x_addr = x_ptr.to(tl.int64, bitcast=True)
    scales_addr = scales_ptr.to(tl.int64, bitcast=True)
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
    published = tl.zeros((), tl.int32)
    if PUBLISH:
        published = relay_flag(relay_call_ptr)
    head, waited = drain_rings(
        count,
        start,
        ring,
        tail_flag,
        head_at,
        tag,
        own_tok,
        own_end,
        own_next,
        x_addr,
        scales_addr,
        topk_idx_ptr,
        topk_weights_ptr,
        in_rank_ptr,
        src_tag_ptr,
        outputs,
        max_rows,
        ready_ptr,
        row_map_ptr,
        published,
        trace_ptr,
        ranks,
        peer_base,
        my_base,
        pe_ptr,
        rank,
        timeout_ns,
        K,
        ROW_WORDS,
        SCALE_WORDS,
        E_LOCAL,
        NUM_RANKS,
        RING,
        SLOT_BYTES,
        RECORD_WORD,
        HAS_SCALES,
        HAS_TOPK,
        HAS_WEIGHTS,
        HAS_TAG,
        PUBLISH,
        LOCAL,
        ROW_MAP,
        USE_CLOCK,
        BLOCK_ROWS,
        BLOCK_RECV_WORDS,
        BLOCK_RANKS,
        BLOCK_K,
        BLOCK_SCALES,
        PROFILE,
        VIA,
    )
    pending = tl.sum(count - head, 0)
    if pending > 0:
        peer = first_lane(head < count, ranks)
        record_timeout(status_ptr, peer, DISPATCH_RECV, timeout_ns, channel)
    # Every ring of this channel is free for the next call, whatever it carried.
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
    pad_channel_rows(
        channel,
        host_info_ptr,
        outputs,
        max_rows,
        row_map_ptr,
        K,
        ROW_WORDS,
        SCALE_WORDS,
        NUM_CHANNELS,
        HAS_SCALES,
        HAS_TOPK,
        HAS_WEIGHTS,
        PAD_ROWS,
        ROW_MAP,
        BLOCK_RECV_WORDS,
        BLOCK_K,
        BLOCK_SCALES,
    )
    return waited


@triton.jit
def exchange_counts(
    pid,  # this program
    call,  # this launch's call number
    in_rank_ptr,  # [N, R] int8 is_token_in_rank
    num_tokens,  # N
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank
    alignment,  # round the entries per local expert up to a multiple of this
    max_rows,  # rows the outputs hold
    recv_count_ptr,  # [R, C] int32 out: tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 out: first output row of each (source, channel)
    host_info_ptr,  # [1 + E_LOCAL] int32 out: rows received, aligned tokens per local expert
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # NormalShared
    timeout_ns,  # the launch's limit so far
    decoded_ptr,  # [R * E_LOCAL + R] int32 workspace
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    notify,  # constexpr (NOTIFY_ROW_WORDS, NOTIFY_SET_BYTES, NOTIFY_OFFSET, NOTIFY_STAGE_OFFSET)
    USE_CLOCK: tl.constexpr,
    counting,  # constexpr (BLOCK_COUNT_TOKENS, BLOCK_CHANNELS, BLOCK_EXPERTS, BLOCK_NOTIFY_ROW)
    BLOCK_RANKS: tl.constexpr,
    VIA: tl.constexpr,
):
    """The count exchange inside the dispatch launch (:mod:`.normal_notify`, one launch less
    on the host): sender ``c`` exchanges counts with ranks ``c, c + C, ...``, the last to
    finish lays out the rows; a receiver waits for that layout (bounded). Returns the limit
    of the program's waits from here on (a wait of the exchange may have given up: then 0),
    or -1 for a receiver whose wait for the layout gave up (recorded)."""
    NOTIFY_ROW_WORDS: tl.constexpr = notify[0]
    NOTIFY_SET_BYTES: tl.constexpr = notify[1]
    NOTIFY_OFFSET: tl.constexpr = notify[2]
    NOTIFY_STAGE_OFFSET: tl.constexpr = notify[3]
    BLOCK_COUNT_TOKENS: tl.constexpr = counting[0]
    BLOCK_CHANNELS: tl.constexpr = counting[1]
    BLOCK_EXPERTS: tl.constexpr = counting[2]
    BLOCK_NOTIFY_ROW: tl.constexpr = counting[3]
    if pid < NUM_CHANNELS:
        count_exchange(
            pid,
            NUM_CHANNELS,
            in_rank_ptr,
            num_tokens,
            per_expert_ptr,
            per_expert_ptr,  # extra_ptr: not read (no extra words)
            alignment,
            max_rows,
            recv_count_ptr,
            recv_start_ptr,
            host_info_ptr,
            decoded_ptr,  # extra_out_ptr: not written (no extra words)
            peer_ptrs,
            pe_ptr,
            rank,
            state_ptr,
            status_ptr,
            timeout_ns,
            decoded_ptr,
            call + 1,
            NUM_RANKS,
            NUM_CHANNELS,
            E_LOCAL,
            NOTIFY_ROW_WORDS,
            NOTIFY_SET_BYTES,
            NOTIFY_OFFSET,
            NOTIFY_STAGE_OFFSET,
            0,  # EXTRA
            False,  # COUNTS_GIVEN
            False,  # CHANNEL_MAJOR
            False,  # HOST_COPY: no host read (worst-case outputs)
            USE_CLOCK,
            BLOCK_COUNT_TOKENS,
            BLOCK_CHANNELS,
            BLOCK_EXPERTS,
            BLOCK_RANKS,
            2,  # BLOCK_EXTRA
            BLOCK_NOTIFY_ROW,
            VIA,
            True,  # READY: the receivers wait for the layout
        )
        limit = limit_ns(timeout_us, status_ptr)
    else:
        ok = await_counts(
            call + 1, rank, state_ptr, status_ptr, timeout_ns, DISPATCH_COUNTS, USE_CLOCK
        )
        limit = tl.where(ok, limit_ns(timeout_us, status_ptr), -1)
    return limit


@triton.jit
def poison_share(
    channel,  # the channel this program receives
    max_rows,  # rows the outputs hold
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    K,  # top-k columns
    ROW_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROW_MAP: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """This receiver's share of all ``max_rows`` output rows as poison: a receiver that never
    learnt where its channel's rows go (a failed call)."""
    for first in range(channel * BLOCK_FILL, max_rows, NUM_CHANNELS * BLOCK_FILL):
        fill_rows(
            first,
            first + BLOCK_FILL,
            max_rows,
            outputs,
            row_map_ptr,
            K,
            True,
            ROW_WORDS,
            SCALE_WORDS,
            HAS_SCALES,
            HAS_TOPK,
            HAS_WEIGHTS,
            ROW_MAP,
            BLOCK_RECV_WORDS,
            BLOCK_K,
            BLOCK_SCALES,
        )


@triton.jit
def settle_receiver(
    channel,  # the channel this program receives
    call,  # this launch's call number
    laid_out,  # whether this receiver learnt where its channel's rows go
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds
    recv_count_ptr,  # [R, C] int32 rows each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 first output row of each (source, channel)
    outputs,  # (out_x, out_scales, out_topk_idx, out_weights, out_src) pointers, as the kernel's
    max_rows,  # rows the outputs hold
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    K,  # top-k columns
    row_format,  # constexpr (ROW_WORDS, SCALE_WORDS, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, HAS_TAG)
    ROW_MAP: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_RECV_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
):
    """A receiver's end: arrive with the launch's other programs and, on a GPU, wait
    (bounded) until every one has; then, if any wait of the call gave up, poison every row of
    its channel from every source (without a layout, its share of every row: poison_share).
    Programs run side by side on a GPU, so a receiver that finished before another's wait
    gave up would otherwise leave its rows as data in a failed call; the interpreter runs them
    one after another (no wait: it would never end)."""
    ROW_WORDS: tl.constexpr = row_format[0]
    SCALE_WORDS: tl.constexpr = row_format[1]
    HAS_SCALES: tl.constexpr = row_format[2]
    HAS_TOPK: tl.constexpr = row_format[3]
    HAS_WEIGHTS: tl.constexpr = row_format[4]
    last = finish_call(state_ptr, call, DISPATCH_ARRIVALS, DISPATCH_CALLS)
    if USE_CLOCK and not last:
        # The others' waits end within their limits: this one waits for the longest.
        limit = 2 * limit_ns(timeout_us, status_ptr)
        wait_flag(state_ptr + DISPATCH_CALLS, call + 1, limit, USE_CLOCK, AT_LEAST=True)
    if not laid_out:  # (exchange_counts gave up) no row can be placed: poison them all
        poison_share(
            channel,
            max_rows,
            outputs,
            row_map_ptr,
            K,
            ROW_WORDS,
            SCALE_WORDS,
            NUM_CHANNELS,
            HAS_SCALES,
            HAS_TOPK,
            HAS_WEIGHTS,
            ROW_MAP,
            BLOCK_RECV_WORDS,
            BLOCK_K,
            BLOCK_SCALES,
        )
    elif timed_out(status_ptr):
        for source in range(NUM_RANKS):
            first = tl.load(recv_start_ptr + source * NUM_CHANNELS + channel)
            end = first + tl.load(recv_count_ptr + source * NUM_CHANNELS + channel)
            fill_rows(
                first,
                end,
                max_rows,
                outputs,
                row_map_ptr,
                K,
                True,
                ROW_WORDS,
                SCALE_WORDS,
                HAS_SCALES,
                HAS_TOPK,
                HAS_WEIGHTS,
                ROW_MAP,
                BLOCK_RECV_WORDS,
                BLOCK_K,
                BLOCK_SCALES,
            )


# ------------------------------------------------------------------------------------- entry


@triton.jit(do_not_specialize=["num_tokens", "K", "alignment", "max_rows", "timeout_us"])
def normal_dispatch_kernel(
    # What changes from call to call (DispatchCall).
    x_ptr,  # [N, H] bf16 or e4m3 tokens, read as [N, ROW_WORDS] int32 words
    scales_ptr,  # [N, SCALE_WORDS] 4-byte scale words (HAS_SCALES)
    topk_idx_ptr,  # [N, K] int64 global expert ids (HAS_TOPK)
    topk_weights_ptr,  # [N, K] float32 (HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] bool is_token_in_rank (computed and stored with RANKS_FROM_IDS)
    src_tag_ptr,  # [N] int32 recorded as each row's source index instead of its token (HAS_TAG)
    num_tokens,  # N
    K,  # top-k columns of the id and weight rows (tiles are BLOCK_K wide)
    recv_count_ptr,  # [R, C] int32 tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 first output row of each (source, channel)
    host_info_ptr,  # [1 + E_LOCAL] int32, [0] = rows received
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank (EXCHANGE)
    alignment,  # round the entries per local expert up to a multiple of this (EXCHANGE)
    out_x_ptr,  # [max_rows, H] out, like x
    out_scales_ptr,  # [max_rows, SCALE_WORDS] out (HAS_SCALES)
    out_topk_idx_ptr,  # [max_rows, K] int64 out: local expert ids (HAS_TOPK)
    out_weights_ptr,  # [max_rows, K] float32 out (HAS_WEIGHTS)
    out_src_ptr,  # [max_rows] int32 out: source token index (or tag) of each row
    max_rows,  # rows the outputs hold
    bounds_ptr,  # [C + 1] int32 first token of each channel (BOUNDS)
    ready_ptr,  # [rows] int32 per-row flags: awaited on the input (AWAIT), set on the output
    relay_call_ptr,  # int64 call counter of the launch that awaits the flags set here (PUBLISH)
    row_map_ptr,  # [max_rows] int32 output position of each row's payload (ROW_MAP)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE)
    # What stays from call to call (NormalShared).
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    decoded_ptr,  # [R * E_LOCAL + R] int32 the count exchange's workspace (EXCHANGE)
    ROW_WORDS: tl.constexpr,  # int32 words of a token's payload
    SCALE_WORDS: tl.constexpr,  # scale words per token (HAS_SCALES)
    E_LOCAL: tl.constexpr,  # experts per rank
    NUM_RANKS: tl.constexpr,  # ranks of the group
    NUM_CHANNELS: tl.constexpr,  # channels of the call (C)
    MAX_CHANNELS: tl.constexpr,  # channels the rings are allocated for
    RING: tl.constexpr,  # slots used per ring in this call
    RING_STRIDE: tl.constexpr,  # slots allocated per ring
    SLOT_BYTES: tl.constexpr,  # bytes of a slot
    RECORD_WORD: tl.constexpr,  # word offset of the record in a slot, a multiple of 4
    RING_OFFSET: tl.constexpr,  # heap byte offset of the rings [C][R source][RING_STRIDE]
    TAIL_OFFSET: tl.constexpr,  # heap byte offset of the tails [C][R source] int64 (senders')
    HEAD_OFFSET: tl.constexpr,  # heap byte offset of the heads [C][R dest] int64 (receivers')
    STAGE_OFFSET: tl.constexpr,  # heap byte offset of the mirror rings [C][R dest] (VIA)
    HAS_SCALES: tl.constexpr,  # FP8 input: scale words travel with the payload
    HAS_TOPK: tl.constexpr,  # top-k ids travel (not in cached mode)
    HAS_WEIGHTS: tl.constexpr,  # top-k weights travel
    HAS_TAG: tl.constexpr,  # sources recorded from src_tag_ptr
    PAD_ROWS: tl.constexpr,  # worst-case outputs: mark rows past the received ones
    BOUNDS: tl.constexpr,  # channels are the ranges in bounds_ptr, not equal splits
    AWAIT: tl.constexpr,  # wait for each input row's flag (call + 1) before reading it
    RANKS_FROM_IDS: tl.constexpr,  # compute is_token_in_rank from the ids, and store it
    PUBLISH: tl.constexpr,  # flag each output row once written
    LOCAL: tl.constexpr,  # receivers copy this rank's own rows from the input
    ROW_MAP: tl.constexpr,  # row i's payload (and scales) go to row_map[i]: a permutation
    # that keeps the rows past the received ones (worst-case padding) together
    RELEASE_STEPS: tl.constexpr,  # sender steps per tail release
    USE_CLOCK: tl.constexpr,  # on a GPU (else the interpreter)
    BLOCK_TOKENS: tl.constexpr,  # tokens a sender moves per step
    BLOCK_ROWS: tl.constexpr,  # rows a receiver moves per source and step
    BLOCK_SEND_WORDS: tl.constexpr,  # words per row a sender moves at a time
    BLOCK_RECV_WORDS: tl.constexpr,  # words per row a receiver moves at a time
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BLOCK_K: tl.constexpr,  # power of two >= max(K, 2)
    BLOCK_SCALES: tl.constexpr,  # power of two >= max(SCALE_WORDS, 2)
    EXCHANGE: tl.constexpr,  # the count exchange runs here first (normal_notify's, fused)
    NOTIFY_ROW_WORDS: tl.constexpr,  # notify's ROW_WORDS (EXCHANGE)
    NOTIFY_SET_BYTES: tl.constexpr,  # notify's SET_BYTES (EXCHANGE)
    NOTIFY_OFFSET: tl.constexpr,  # heap byte offset of the notify rows (EXCHANGE)
    NOTIFY_STAGE_OFFSET: tl.constexpr,  # heap byte offset of the staged notify rows (EXCHANGE)
    BLOCK_COUNT_TOKENS: tl.constexpr,  # tokens counted at a time (EXCHANGE)
    BLOCK_CHANNELS: tl.constexpr,  # power of two > NUM_CHANNELS (EXCHANGE)
    BLOCK_EXPERTS: tl.constexpr,  # power of two >= max(E_LOCAL, 2) (EXCHANGE)
    BLOCK_NOTIFY_ROW: tl.constexpr,  # notify row words read at a time (EXCHANGE, row_block)
    PROFILE: tl.constexpr,  # record traces
    VIA: tl.constexpr,  # how rows reach peers (transport)
):
    # Own rows are read by the receivers while the senders run: the input rows and their
    # destinations must be there before the launch, not written by it.
    tl.static_assert(not (LOCAL and (AWAIT or RANKS_FROM_IDS)))
    timeout_ns = limit_ns(timeout_us, status_ptr)
    pid = tl.program_id(0)
    call = tl.load(state_ptr + DISPATCH_CALLS, volatile=True)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    # Payload and scales move as 4-byte words whatever their dtype.
    x_ptr = x_ptr.to(tl.pointer_type(tl.int32))
    scales_ptr = scales_ptr.to(tl.pointer_type(tl.int32))
    out_x_ptr = out_x_ptr.to(tl.pointer_type(tl.int32))
    out_scales_ptr = out_scales_ptr.to(tl.pointer_type(tl.int32))
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8))
    # What the role helpers take as one argument each (constexpr tuples stay compile-time).
    inputs = (x_ptr, scales_ptr, topk_idx_ptr, topk_weights_ptr, in_rank_ptr, src_tag_ptr)
    outputs = (out_x_ptr, out_scales_ptr, out_topk_idx_ptr, out_weights_ptr, out_src_ptr)
    row_format: tl.constexpr = (ROW_WORDS, SCALE_WORDS, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, HAS_TAG)
    ring_shape: tl.constexpr = (RING, RING_STRIDE, SLOT_BYTES, RECORD_WORD)
    ring_offsets: tl.constexpr = (RING_OFFSET, TAIL_OFFSET, HEAD_OFFSET, STAGE_OFFSET)
    notify: tl.constexpr = (NOTIFY_ROW_WORDS, NOTIFY_SET_BYTES, NOTIFY_OFFSET, NOTIFY_STAGE_OFFSET)
    counting: tl.constexpr = (BLOCK_COUNT_TOKENS, BLOCK_CHANNELS, BLOCK_EXPERTS, BLOCK_NOTIFY_ROW)
    sends = pid < NUM_CHANNELS
    waited = tl.zeros((), tl.int64)
    if EXCHANGE:  # the senders exchange the counts first; the receivers wait for the layout
        timeout_ns = exchange_counts(
            pid,
            call,
            in_rank_ptr,
            num_tokens,
            per_expert_ptr,
            alignment,
            max_rows,
            recv_count_ptr,
            recv_start_ptr,
            host_info_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            state_ptr,
            status_ptr,
            timeout_us,
            timeout_ns,
            decoded_ptr,
            E_LOCAL,
            NUM_RANKS,
            NUM_CHANNELS,
            notify,
            USE_CLOCK,
            counting,
            BLOCK_RANKS,
            VIA,
        )
    if sends:
        waited = dispatch_send(
            pid,
            call,
            inputs,
            num_tokens,
            K,
            bounds_ptr,
            ready_ptr,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            status_ptr,
            timeout_ns,
            row_format,
            E_LOCAL,
            NUM_RANKS,
            NUM_CHANNELS,
            ring_shape,
            ring_offsets,
            BOUNDS,
            AWAIT,
            RANKS_FROM_IDS,
            LOCAL,
            RELEASE_STEPS,
            USE_CLOCK,
            BLOCK_TOKENS,
            BLOCK_SEND_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            BLOCK_SCALES,
            PROFILE,
            VIA,
        )
    elif timeout_ns >= 0:  # (else the layout never came: settle_receiver poisons)
        waited = dispatch_receive(
            pid - NUM_CHANNELS,
            call,
            inputs,
            num_tokens,
            K,
            recv_count_ptr,
            recv_start_ptr,
            host_info_ptr,
            outputs,
            max_rows,
            bounds_ptr,
            ready_ptr,
            relay_call_ptr,
            row_map_ptr,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            status_ptr,
            timeout_ns,
            row_format,
            ROW_MAP,
            E_LOCAL,
            NUM_RANKS,
            NUM_CHANNELS,
            MAX_CHANNELS,
            ring_shape,
            ring_offsets,
            PAD_ROWS,
            BOUNDS,
            PUBLISH,
            LOCAL,
            USE_CLOCK,
            BLOCK_ROWS,
            BLOCK_RECV_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            BLOCK_SCALES,
            PROFILE,
            VIA,
        )
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), sends, waited, USE_CLOCK)
    if sends:
        finish_call(state_ptr, call, DISPATCH_ARRIVALS, DISPATCH_CALLS)
    else:
        settle_receiver(
            pid - NUM_CHANNELS,
            call,
            timeout_ns >= 0,
            state_ptr,
            status_ptr,
            timeout_us,
            recv_count_ptr,
            recv_start_ptr,
            outputs,
            max_rows,
            row_map_ptr,
            K,
            row_format,
            ROW_MAP,
            NUM_RANKS,
            NUM_CHANNELS,
            USE_CLOCK,
            BLOCK_RECV_WORDS,
            BLOCK_K,
            BLOCK_SCALES,
        )
