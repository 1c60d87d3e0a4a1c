"""Elastic dispatch: every rank stores each token once into a fixed slot of every rank it goes
to, then one epilogue on all SMs lays the received rows out (plain or expanded per expert).

:func:`elastic_dispatch` (shown by profilers as ``tritonep::elastic::dispatch_impl``): program
``p`` of ``P`` takes the ``p``-th of ``P`` equal token ranges. It first counts, over the tokens
before its range, how many go to each rank and how many choose each expert (a scan of their
ids), so that it knows, without any atomics, each of its tokens' slot on every destination
(the token's rank among the tokens of this source that go there) and, per chosen expert, the
token's rank among this source's tokens of that expert. It stores into the destination's
region ``[source][slot]`` a record: the payload, the scale packs (FP8), and the token's
metadata (:data:`META_WORDS`); each payload word is read once and stored to every
destination. The last program to finish sends each destination a header
(tokens and per-expert counts, then the tag), waits for every source's header and decodes
them into ``recv_counts [R, 1 + E_local]``.

:func:`elastic_dispatch_epilogue` (``tritonep::elastic::dispatch_copy_epilogue_impl``) reads
the received records in (source rank, source token) order: row ``i`` of the plain layout, or,
expanded, one row per (token, local expert) at ``start[expert] + (rows of that expert from
earlier sources) + the token's rank among its source's tokens of that expert``, each expert's
block padded to the alignment (zeroed on request). Rows therefore come in the same order on
every call: deterministic by construction, cached or not.

:func:`dispatch_push` and :func:`copy_share` are the two kernels' bodies.

Why it is cheap: one store per (token, destination rank) crosses NVLink, no ring, no slot
atomics and no receiver programs spinning on data; the copy into the caller's layout reads
local memory on every SM.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .elastic_exchange import (
    HOST_COUNTS,
    arrive,
    exchange_number,
    finish_exchange,
    header_ptr,
    send_tags,
    wait_for_push,
    wait_tags,
)
from .phases import ELASTIC_DISPATCH
from .profiled import kernel
from .status import fence_system
from .sync import aligned_ptr, lane, rows_before
from .trace import read_clock, write_trace


#: int32 words of a record's metadata: source token, first local top-k column, reduction
#: slot, then per top-k column the local expert id (``-1`` elsewhere), the token's rank among
#: its source's tokens of that expert, and the weight (float32 bits).
def meta_words(topk: int) -> int:
    return 3 + 3 * topk


# Bits of the run-time ``flags`` of the two kernels (run-time, so that one compiled variant
# serves every combination).
FLAG_WEIGHTS = tl.constexpr(1)  # top-k weights travel with the rows
FLAG_STATS = tl.constexpr(2)  # the push adds the received choices to stats_ptr
FLAG_COPY_IDS = tl.constexpr(4)  # the push copies the ids for the handle
FLAG_SLOTS = tl.constexpr(8)  # the push writes each choice's destination slot
FLAG_ZERO_PAD = tl.constexpr(16)  # the epilogue zeroes the expanded layout's padding rows
FLAG_META = tl.constexpr(32)  # the epilogue writes the handle (metadata, prefix sums)
FLAG_HOST_COUNTS = tl.constexpr(64)  # the push also writes the counts to host memory


class DispatchCall(NamedTuple):
    """The leading runtime arguments of :func:`elastic_dispatch`, in its order: what changes
    from call to call (tensors, or their addresses); :class:`~.elastic_exchange.ElasticShared`
    follows."""

    x_ptr: object
    sf_ptr: object
    sf_token_stride: int
    sf_group_stride: int
    topk_ptr: object
    weights_ptr: object
    num_tokens: int
    max_tokens: int
    totals_ptr: object
    recv_counts_ptr: object
    stats_ptr: object
    ids_copy_ptr: object
    slots_ptr: object
    flags: int
    trace_ptr: object


class DispatchVariant(NamedTuple):
    """One compiled variant of :func:`elastic_dispatch`: its constexprs, in its order."""

    K: int
    BLOCK_K: int
    NUM_EXPERTS: int
    BLOCK_EXPERTS: int
    E_LOCAL: int
    BLOCK_COUNTS: int
    NUM_RANKS: int
    BLOCK_RANKS: int
    ROW_WORDS: int
    BLOCK_WORDS: int
    G: int
    BLOCK_GROUPS: int
    RECORD_BYTES: int
    PAYLOAD_BYTES: int
    SCALE_BYTES: int
    HEADER_WORDS: int
    BLOCK_TOKENS: int
    SCAN_BLOCK_TOKENS: int
    HAS_SF: bool
    USE_CLOCK: bool
    PDL: bool
    PROFILE: bool


class EpilogueCall(NamedTuple):
    """The leading runtime arguments of :func:`elastic_dispatch_epilogue`, in its order."""

    recv_counts_ptr: object
    max_tokens: int
    alignment: int
    num_rows: int
    num_out_rows: int
    out_words_ptr: object
    out_sf_ptr: object
    out_sf_token_stride: int
    out_sf_group_stride: int
    out_ids_ptr: object
    out_weights_ptr: object
    out_meta_ptr: object
    out_slots_ptr: object
    psum_rank_ptr: object
    psum_expert_ptr: object
    unaligned_ptr: object
    flags: int
    trace_ptr: object


class EpilogueVariant(NamedTuple):
    """One compiled variant of :func:`elastic_dispatch_epilogue`: its constexprs, in its order."""

    K: int
    BLOCK_K: int
    NUM_RANKS: int
    BLOCK_RANKS: int
    E_LOCAL: int
    BLOCK_LOCAL_EXPERTS: int
    ROW_WORDS: int
    BLOCK_WORDS: int
    G: int
    BLOCK_GROUPS: int
    RECORD_BYTES: int
    PAYLOAD_BYTES: int
    SCALE_BYTES: int
    BLOCK_ROWS: int
    BLOCK_FILL: int
    EXPAND: bool
    HAS_SF: bool
    PDL: bool
    PROFILE: bool
    USE_CLOCK: bool


@triton.jit
def load_choices(topk_ptr, tokens, tmask, ks, K: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """``[T, BLOCK_K]`` raw int64 ids, int32 ids (``-1`` for none or out of range) and validity."""
    at = tokens.to(tl.int64)[:, None] * K + ks[None, :]
    raw = tl.load(topk_ptr + at, mask=tmask[:, None] & (ks < K)[None, :], other=-1)
    valid = (raw >= 0) & (raw < NUM_EXPERTS)
    return raw, tl.where(valid, raw, -1).to(tl.int32), valid


@triton.jit
def owners(ids, valid, ranks, E_LOCAL: tl.constexpr):
    """``[T, BLOCK_K]`` rank owning each choice (``-1`` none) and ``[T, BLOCK_RANKS]`` 1 where
    the token goes to each rank."""
    owner = tl.where(valid, ids // E_LOCAL, -1)
    hit = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), 1)
    return owner, hit


@triton.jit
def ranks_before(
    topk_ptr,
    end,
    ranks,
    ks,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``[BLOCK_RANKS]``: tokens of ``[0, end)`` that go to each rank (a token's first slot on
    each destination)."""
    sent = tl.zeros(ranks.shape, tl.int32)
    for first in range(0, end, BLOCK_TOKENS):
        tokens = first + tl.arange(0, BLOCK_TOKENS)
        _, ids, valid = load_choices(topk_ptr, tokens, tokens < end, ks, K, NUM_EXPERTS)
        _, hit = owners(ids, valid, ranks, E_LOCAL)
        sent += tl.sum(hit, 0)
    return sent


@triton.jit
def experts_before(
    topk_ptr,
    end,
    ks,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``[BLOCK_EXPERTS]``: choices of each expert among the tokens ``[0, end)``."""
    chosen = tl.zeros((BLOCK_EXPERTS,), tl.int32)
    for first in range(0, end, BLOCK_TOKENS):
        tokens = first + tl.arange(0, BLOCK_TOKENS)
        _, ids, valid = load_choices(topk_ptr, tokens, tokens < end, ks, K, NUM_EXPERTS)
        flat = tl.reshape(tl.where(valid, ids, 0), (BLOCK_TOKENS * BLOCK_K,))
        chosen += tl.histogram(
            flat, BLOCK_EXPERTS, mask=tl.reshape(valid, (BLOCK_TOKENS * BLOCK_K,))
        )
    return chosen


@triton.jit
def expert_ranks(ids, valid, chosen, BLOCK_TOKENS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[T, BLOCK_K]``: each choice's rank among this source's choices of its expert, given
    ``chosen`` (``[BLOCK_EXPERTS]`` choices of each expert before the block)."""
    FLAT: tl.constexpr = BLOCK_TOKENS * BLOCK_K
    flat = tl.reshape(ids, (FLAT,))
    fvalid = tl.reshape(valid, (FLAT,))
    token = tl.arange(0, FLAT) // BLOCK_K
    earlier = (flat[:, None] == flat[None, :]) & (token[None, :] < token[:, None]) & fvalid[None, :]
    within = tl.sum(earlier.to(tl.int32), 1)
    before = tl.gather(chosen, tl.where(fvalid, flat, 0), 0)
    return tl.reshape(tl.where(fvalid, before + within, -1), (BLOCK_TOKENS, BLOCK_K))


@triton.jit
def reduction_slots(owner, ranks, ks, BLOCK_K: tl.constexpr):
    """Per (token, rank): ``[T, BLOCK_RANKS]`` the position of the rank in the order in which a
    combine sums the token's rows (ranks ordered by the top-k column of their last choice, as
    DeepEP V2's reference sums them) and ``[T, BLOCK_RANKS]`` the rank's first top-k column."""
    same = owner[:, :, None] == owner[:, None, :]  # [T, k, k']
    later = same & (ks[None, None, :] > ks[None, :, None])
    last = (owner >= 0) & (tl.max(later.to(tl.int32), 2) == 0)  # [T, k]
    is_rank = owner[:, :, None] == ranks[None, None, :]  # [T, k, r]
    last_col = tl.max(tl.where(is_rank, ks[None, :, None], -1), 1)  # [T, r]
    first_col = tl.min(tl.where(is_rank, ks[None, :, None], BLOCK_K), 1)
    before = last[:, :, None] & (ks[None, :, None] < last_col[:, None, :])
    return tl.sum(before.to(tl.int32), 1), first_col


@triton.jit
def store_meta(rec, tokens, go, first_col, slot, local, ranked, weights, ks, K, has_weights):
    """Store the metadata of the records of the block's tokens ``go`` at ``rec`` ([T] int64,
    each record's metadata words)."""
    kmask = go[:, None] & (ks < K)[None, :]
    meta = aligned_ptr(rec, tl.int32)
    tl.store(meta, tokens, mask=go)
    tl.store(meta + 1, first_col, mask=go)
    tl.store(meta + 2, slot, mask=go)
    tl.store(meta[:, None] + 3 + ks[None, :], local, mask=kmask)
    tl.store(meta[:, None] + 3 + K + ks[None, :], ranked, mask=kmask)
    if has_weights:
        tl.store(
            meta[:, None] + 3 + 2 * K + ks[None, :], weights.to(tl.int32, bitcast=True), mask=kmask
        )


@triton.jit
def store_payloads(
    recs,
    hit,
    ranks,
    tokens,
    tmask,
    x_ptr,
    sf_ptr,
    sf_token_stride,
    sf_group_stride,
    NUM_RANKS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    HAS_SF: tl.constexpr,
):
    """Store the rows (and scale packs) of the block's tokens into their records ``recs``
    ([T, BLOCK_RANKS] int64 on each destination, where ``hit``): each word is read once and
    stored to every destination, so a step waits for one load, not one per destination."""
    rows = tokens.to(tl.int64)
    words = tl.arange(0, BLOCK_WORDS)
    for w0 in range(0, ROW_WORDS, BLOCK_WORDS):
        w = w0 + words
        m = tmask[:, None] & (w < ROW_WORDS)[None, :]
        v = tl.load(x_ptr + rows[:, None] * ROW_WORDS + w[None, :], mask=m)
        for d in range(NUM_RANKS):
            go = lane(hit, ranks, d) > 0
            dst = aligned_ptr(lane(recs, ranks, d), tl.int32)
            tl.store(dst[:, None] + w[None, :], v, mask=m & go[:, None])
    if HAS_SF:
        g = tl.arange(0, BLOCK_GROUPS)
        m = tmask[:, None] & (g < G)[None, :]
        packs = tl.load(
            sf_ptr + rows[:, None] * sf_token_stride + g[None, :] * sf_group_stride, mask=m
        )
        for d in range(NUM_RANKS):
            go = lane(hit, ranks, d) > 0
            dst = aligned_ptr(lane(recs, ranks, d), tl.int32) + PAYLOAD_BYTES // 4
            tl.store(dst[:, None] + g[None, :], packs, mask=m & go[:, None])


@triton.jit
def send_headers(
    call,
    peer_base,
    rank,
    ranks,
    header_offset,
    totals_ptr,
    NUM_RANKS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_COUNTS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
):
    """The last program: each destination's header (tokens and per-expert counts), then the
    tags."""
    rmask = ranks < NUM_RANKS
    cols = tl.arange(0, BLOCK_COUNTS)
    grid = rmask[:, None] & (cols < 1 + E_LOCAL)[None, :]
    # Column 0: tokens sent to the rank; column 1 + e: choices of its local expert e.
    at = tl.where(
        cols[None, :] == 0, ranks[:, None], NUM_RANKS + ranks[:, None] * E_LOCAL + cols[None, :] - 1
    )
    counts = tl.load(totals_ptr + at, mask=grid, other=0, volatile=True)
    parity = call % 2
    words = header_ptr(
        peer_base[:, None], header_offset, parity, rank, 1 + cols[None, :], HEADER_WORDS, NUM_RANKS
    )
    tl.store(words, counts, mask=grid)
    send_tags(call, peer_base, rank, ranks, header_offset, HEADER_WORDS, NUM_RANKS)


@triton.jit
def decode_headers(
    call,
    my_base,
    ranks,
    header_offset,
    recv_counts_ptr,
    stats_ptr,
    NUM_RANKS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_COUNTS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    has_stats,
    state_ptr,
    to_host,
):
    """The last program, once every source's tag came: the counts of every source
    (``recv_counts[s] = [tokens, choices of each local expert...]``), and with ``to_host``
    the same into the host words at ``HOST_COUNTS``, their flag last: the host of an
    exact-size call polls it instead of copying the counts once the launch has ended."""
    cols = tl.arange(0, BLOCK_COUNTS)
    grid = (ranks < NUM_RANKS)[:, None] & (cols < 1 + E_LOCAL)[None, :]
    mine = header_ptr(
        my_base, header_offset, call % 2, ranks[:, None], 1 + cols[None, :], HEADER_WORDS, NUM_RANKS
    )
    got = tl.load(mine, mask=grid, other=0, volatile=True)
    at = ranks[:, None] * (1 + E_LOCAL) + cols[None, :]
    tl.store(recv_counts_ptr + at, got, mask=grid)
    if to_host:
        host = tl.load(state_ptr + HOST_COUNTS).to(tl.pointer_type(tl.int32))
        tl.store(host + 1 + at, got, mask=grid)
        tl.debug_barrier()  # every thread's words stored before any thread's fence and flag
        fence_system()
        tl.store(host, 1)
    if has_stats:
        experts = cols - 1
        emask = (cols >= 1) & (cols < 1 + E_LOCAL)
        stats = tl.load(stats_ptr + experts, mask=emask, other=0)
        tl.store(stats_ptr + experts, stats + tl.sum(got, 0), mask=emask)


@triton.jit
def store_block_meta(
    recs,
    hit,
    owner,
    pos,
    raw,
    ids,
    valid,
    chosen,
    tokens,
    tmask,
    ranks,
    ks,
    weights_ptr,
    ids_copy_ptr,
    slots_ptr,
    flags,
    has_weights,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """A block's metadata: into each destination's records (``recs``, after the payload and
    scales) the token's first top-k column there, its reduction slot, its local expert ids
    with their ranks among the earlier tokens' (``chosen``: the experts counted so far) and
    its weights; here, the copy of the ids and each choice's slot on its destination
    (``pos``), as ``flags`` ask."""
    ranked = expert_ranks(ids, valid, chosen, BLOCK_TOKENS, BLOCK_K)
    slot, first_col = reduction_slots(owner, ranks, ks, BLOCK_K)
    weights = tl.zeros((BLOCK_TOKENS, BLOCK_K), tl.float32)
    at = tokens.to(tl.int64)[:, None] * K + ks[None, :]
    kmask = tmask[:, None] & (ks < K)[None, :]
    if has_weights:
        weights = tl.load(weights_ptr + at, mask=kmask, other=0.0)
    if (flags & FLAG_COPY_IDS) != 0:
        tl.store(ids_copy_ptr + at, raw, mask=kmask)
    if (flags & FLAG_SLOTS) != 0:
        mine = owner[:, :, None] == ranks[None, None, :]
        dst_slot = tl.sum(tl.where(mine, pos[:, None, :], 0), 2)
        tl.store(slots_ptr + at, tl.where(owner >= 0, dst_slot, -1), mask=kmask)
    for d in range(NUM_RANKS):
        go = lane(hit, ranks, d) > 0
        if tl.max(go.to(tl.int32), 0) > 0:
            store_meta(
                lane(recs, ranks, d) + PAYLOAD_BYTES + SCALE_BYTES,
                tokens,
                go,
                lane(first_col, ranks, d),
                lane(slot, ranks, d),
                tl.where(owner == d, ids - d * E_LOCAL, -1),
                ranked,
                weights,
                ks,
                K,
                has_weights,
            )


@triton.jit
def exchange_headers(
    call,
    peer_ptrs,
    peer_base,
    rank,
    ranks,
    header_offset,
    totals_ptr,
    recv_counts_ptr,
    stats_ptr,
    has_stats,
    state_ptr,
    status_ptr,
    timeout_us,
    flags,
    trace_ptr,
    t_arrive,
    NUM_RANKS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_COUNTS: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    PROFILE: tl.constexpr,
):
    """The last program's exchange: this rank's totals into every peer's header, the bounded
    wait for every peer's, then their counts decoded here. Returns its trace readings (the
    headers' time after the arrival, the wait's)."""
    t_headers = tl.zeros((), tl.int64)
    t_wait = tl.zeros((), tl.int64)
    my_base = tl.load(peer_ptrs + rank)
    send_headers(
        call,
        peer_base,
        rank,
        ranks,
        header_offset,
        totals_ptr,
        NUM_RANKS,
        E_LOCAL,
        BLOCK_COUNTS,
        HEADER_WORDS,
    )
    if PROFILE:
        t_headers = read_clock(trace_ptr, USE_CLOCK)
    wait_tags(
        call,
        my_base,
        ranks,
        header_offset,
        status_ptr,
        timeout_us,
        ELASTIC_DISPATCH,
        HEADER_WORDS,
        NUM_RANKS,
        USE_CLOCK,
    )
    if PROFILE:
        t_wait = read_clock(trace_ptr, USE_CLOCK) - t_headers
        t_headers = t_headers - t_arrive
    decode_headers(
        call,
        my_base,
        ranks,
        header_offset,
        recv_counts_ptr,
        stats_ptr,
        NUM_RANKS,
        E_LOCAL,
        BLOCK_COUNTS,
        HEADER_WORDS,
        has_stats,
        state_ptr,
        (flags & FLAG_HOST_COUNTS) != 0,
    )
    finish_exchange(state_ptr, call)
    return t_headers, t_wait


@triton.jit
def dispatch_push(
    x_ptr,
    sf_ptr,
    sf_token_stride,
    sf_group_stride,
    topk_ptr,
    weights_ptr,
    num_tokens,
    max_tokens,
    peer_ptrs,
    rank,
    header_offset,
    region_offset,
    region_bytes,
    state_ptr,
    totals_ptr,
    recv_counts_ptr,
    stats_ptr,
    ids_copy_ptr,
    slots_ptr,
    status_ptr,
    timeout_us,
    flags,
    trace_ptr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_COUNTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    SCAN_BLOCK_TOKENS: tl.constexpr,
    HAS_SF: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PROFILE: tl.constexpr,
):
    """The body of :func:`elastic_dispatch`: this program's records, its arrival and, in the
    last program, the exchange of the headers. Returns its trace readings (push end, arrival;
    scan, stores, headers and wait times)."""
    t_scan = tl.zeros((), tl.int64)
    t_stores = tl.zeros((), tl.int64)
    t_headers = tl.zeros((), tl.int64)
    t_wait = tl.zeros((), tl.int64)
    pid = tl.program_id(0)
    has_weights = (flags & FLAG_WEIGHTS) != 0
    has_stats = (flags & FLAG_STATS) != 0
    call = exchange_number(state_ptr)
    region = region_offset + (call % 2) * region_bytes
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    ks = tl.arange(0, BLOCK_K)
    peer_base = tl.load(peer_ptrs + ranks, mask=rmask, other=0)
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    per = tl.cdiv(num_tokens, tl.num_programs(0))
    t0 = tl.minimum(pid * per, num_tokens)
    t1 = tl.minimum(t0 + per, num_tokens)
    if PROFILE:
        t_scan = read_clock(trace_ptr, USE_CLOCK)
    # Only the earlier tokens' ranks come before the first rows (they give the slots); their
    # experts are counted while those rows are in flight.
    sent = ranks_before(
        topk_ptr, t0, ranks, ks, K, NUM_EXPERTS, E_LOCAL, SCAN_BLOCK_TOKENS, BLOCK_K
    )
    chosen = tl.zeros((BLOCK_EXPERTS,), tl.int32)
    if PROFILE:
        t_stores = read_clock(trace_ptr, USE_CLOCK)
        t_scan = t_stores - t_scan
    for first in range(t0, t1, BLOCK_TOKENS):
        tokens = first + tl.arange(0, BLOCK_TOKENS)
        tmask = tokens < t1
        raw, ids, valid = load_choices(topk_ptr, tokens, tmask, ks, K, NUM_EXPERTS)
        owner, hit = owners(ids, valid, ranks, E_LOCAL)
        hit = hit * tmask[:, None].to(tl.int32)
        pos = sent[None, :] + rows_before(hit, BLOCK_TOKENS)  # [T, R] slot on each destination
        # [T, BLOCK_RANKS] each token's record on each destination.
        spots = (rank * max_tokens + pos).to(tl.int64)
        recs = peer_base[None, :] + region + spots * RECORD_BYTES
        store_payloads(
            recs,
            hit,
            ranks,
            tokens,
            tmask,
            x_words,
            sf_ptr,
            sf_token_stride,
            sf_group_stride,
            NUM_RANKS,
            ROW_WORDS,
            BLOCK_WORDS,
            G,
            BLOCK_GROUPS,
            PAYLOAD_BYTES,
            HAS_SF,
        )
        if first == t0:
            chosen += experts_before(
                topk_ptr, t0, ks, K, NUM_EXPERTS, BLOCK_EXPERTS, SCAN_BLOCK_TOKENS, BLOCK_K
            )
        store_block_meta(
            recs,
            hit,
            owner,
            pos,
            raw,
            ids,
            valid,
            chosen,
            tokens,
            tmask,
            ranks,
            ks,
            weights_ptr,
            ids_copy_ptr,
            slots_ptr,
            flags,
            has_weights,
            K,
            BLOCK_K,
            E_LOCAL,
            NUM_RANKS,
            BLOCK_TOKENS,
            PAYLOAD_BYTES,
            SCALE_BYTES,
        )
        sent += tl.sum(hit, 0)
        flat = tl.reshape(tl.where(valid & tmask[:, None], ids, 0), (BLOCK_TOKENS * BLOCK_K,))
        fmask = tl.reshape(valid & tmask[:, None], (BLOCK_TOKENS * BLOCK_K,))
        chosen += tl.histogram(flat, BLOCK_EXPERTS, mask=fmask)
    if t0 >= t1:  # no tokens of its own (the last program's counts are the totals)
        chosen += experts_before(
            topk_ptr, t0, ks, K, NUM_EXPERTS, BLOCK_EXPERTS, SCAN_BLOCK_TOKENS, BLOCK_K
        )
    if PROFILE:
        t_stores = read_clock(trace_ptr, USE_CLOCK) - t_stores
    if pid == tl.num_programs(0) - 1:  # its range ends the tokens: its counts are the totals
        tl.store(totals_ptr + ranks, sent, mask=rmask)
        experts = tl.arange(0, BLOCK_EXPERTS)
        tl.store(totals_ptr + NUM_RANKS + experts, chosen, mask=experts < NUM_EXPERTS)
    t_push_end = tl.zeros((), tl.int64)
    if PROFILE:
        t_push_end = read_clock(trace_ptr, USE_CLOCK)
    last = arrive(state_ptr)
    if PDL:
        # This program's rows are out: the epilogue's grid may launch once every program
        # has come here, its launch overlapping the last program's wait for the peers (the
        # epilogue waits, gdc_wait, for this grid to complete before it reads anything).
        # Not earlier: an epilogue launched at the start would hold every SM, spinning,
        # for the whole push, and keep a GEMM on another stream off them.
        gdc_launch_dependents()
    t_arrive = t_push_end
    if PROFILE:
        t_arrive = read_clock(trace_ptr, USE_CLOCK)
    if last:
        t_headers, t_wait = exchange_headers(
            call,
            peer_ptrs,
            peer_base,
            rank,
            ranks,
            header_offset,
            totals_ptr,
            recv_counts_ptr,
            stats_ptr,
            has_stats,
            state_ptr,
            status_ptr,
            timeout_us,
            flags,
            trace_ptr,
            t_arrive,
            NUM_RANKS,
            E_LOCAL,
            BLOCK_COUNTS,
            HEADER_WORDS,
            USE_CLOCK,
            PROFILE,
        )
    return t_push_end, t_arrive, t_scan, t_stores, t_headers, t_wait


@kernel(
    "tritonep::elastic::dispatch_impl",
    do_not_specialize=[
        "sf_token_stride",
        "sf_group_stride",
        "num_tokens",
        "max_tokens",
        "flags",
        "timeout_us",
    ],
)
def elastic_dispatch(
    # DispatchCall: what changes from call to call
    x_ptr,  # [N, ROW_WORDS] int32 words of the rows (BF16 or e4m3 bytes)
    sf_ptr,  # [N, G] 4-byte scale packs, viewed as int32, any strides (HAS_SF)
    sf_token_stride,  # strides of sf_ptr, in packs
    sf_group_stride,
    topk_ptr,  # [N, K] int64 expert ids, -1 for none
    weights_ptr,  # [N, K] float32 (FLAG_WEIGHTS)
    num_tokens,  # N: this rank's tokens
    max_tokens,  # slots per source rank in a region (num_max_tokens_per_rank)
    totals_ptr,  # [R + E] int32 scratch: the last token range's counts, for the headers
    recv_counts_ptr,  # [R, 1 + E_LOCAL] int32 out: what each source sent here
    stats_ptr,  # [E_LOCAL] int32, choices received added in (FLAG_STATS)
    ids_copy_ptr,  # [N, K] int64 out: a copy of the ids (FLAG_COPY_IDS)
    slots_ptr,  # [N, K] int32 out: each choice's slot on its destination (FLAG_SLOTS)
    flags,  # FLAG_WEIGHTS | FLAG_STATS | FLAG_COPY_IDS | FLAG_SLOTS | FLAG_HOST_COUNTS
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE; kernels.trace), else unused
    # ElasticShared (elastic_exchange): the mode's, the same on every call
    peer_ptrs,  # [R] int64 heap base of every rank
    rank,  # this rank
    header_offset,  # byte offset of the headers [2][R][HEADER_WORDS] int32
    barrier_offset,  # (unused)
    region_offset,  # byte offset of region 0 (region 1 follows at + region_bytes)
    region_bytes,  # bytes of a region
    state_ptr,  # [8] int64 mode state (elastic_exchange)
    status_ptr,  # [STATUS_WORDS] int32 status record (kernels.status)
    timeout_us,  # limit of a wait in microseconds (sync.timeout_us)
    K: tl.constexpr,  # top-k: choices per token
    BLOCK_K: tl.constexpr,  # K as a power of two (at least 2)
    NUM_EXPERTS: tl.constexpr,  # experts in all
    BLOCK_EXPERTS: tl.constexpr,  # NUM_EXPERTS as a power of two
    E_LOCAL: tl.constexpr,  # experts per rank
    BLOCK_COUNTS: tl.constexpr,  # next power of two of E_LOCAL + 1
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS as a power of two (at least 2)
    ROW_WORDS: tl.constexpr,  # int32 words of a row
    BLOCK_WORDS: tl.constexpr,  # words moved per step
    G: tl.constexpr,  # scale packs per row
    BLOCK_GROUPS: tl.constexpr,  # G as a power of two (at least 2)
    RECORD_BYTES: tl.constexpr,  # bytes of a record
    PAYLOAD_BYTES: tl.constexpr,  # bytes of its payload (16-byte aligned)
    SCALE_BYTES: tl.constexpr,  # bytes of its scale packs (16-byte aligned)
    HEADER_WORDS: tl.constexpr,  # int32 words of a header
    BLOCK_TOKENS: tl.constexpr,  # tokens per block
    SCAN_BLOCK_TOKENS: tl.constexpr,  # tokens per block of the scan of the earlier tokens' ids
    HAS_SF: tl.constexpr,  # the rows come with scale packs (FP8)
    USE_CLOCK: tl.constexpr,  # waits read the GPU clock (not under the interpreter)
    PDL: tl.constexpr = False,  # the epilogue is a programmatic dependent launch (sm_90+)
    PROFILE: tl.constexpr = False,  # record a trace (push: scan, stores; exchange below)
):
    # Trace: the push phase (scan, stores) ends where the program arrives; the exchange phase
    # is the arrive and, in the last program, the headers, the wait for the peers' tags and
    # the decoding of their counts (the rest of the phase).
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    t_push_end, t_arrive, t_scan, t_stores, t_headers, t_wait = dispatch_push(
        x_ptr,
        sf_ptr,
        sf_token_stride,
        sf_group_stride,
        topk_ptr,
        weights_ptr,
        num_tokens,
        max_tokens,
        peer_ptrs,
        rank,
        header_offset,
        region_offset,
        region_bytes,
        state_ptr,
        totals_ptr,
        recv_counts_ptr,
        stats_ptr,
        ids_copy_ptr,
        slots_ptr,
        status_ptr,
        timeout_us,
        flags,
        trace_ptr,
        K,
        BLOCK_K,
        NUM_EXPERTS,
        BLOCK_EXPERTS,
        E_LOCAL,
        BLOCK_COUNTS,
        NUM_RANKS,
        BLOCK_RANKS,
        ROW_WORDS,
        BLOCK_WORDS,
        G,
        BLOCK_GROUPS,
        RECORD_BYTES,
        PAYLOAD_BYTES,
        SCALE_BYTES,
        HEADER_WORDS,
        BLOCK_TOKENS,
        SCAN_BLOCK_TOKENS,
        HAS_SF,
        USE_CLOCK,
        PDL,
        PROFILE,
    )
    if PROFILE:
        write_trace(
            trace_ptr,
            t_start,
            t_push_end,
            read_clock(trace_ptr, USE_CLOCK),
            t_scan,
            t_stores,
            t_arrive - t_push_end,
            t_headers,
            t_wait,
            USE_CLOCK,
        )


@triton.jit
def received_layout(
    recv_counts_ptr, ranks, els, alignment, NUM_RANKS: tl.constexpr, E_LOCAL: tl.constexpr
):
    """From the decoded counts: ``[BLOCK_RANKS]`` each source's first and end row,
    ``[BLOCK_LOCAL_EXPERTS]`` each local expert's choices and first expanded row (blocks
    aligned), and ``[BLOCK_RANKS, BLOCK_LOCAL_EXPERTS]`` the first expanded row of each
    (source, expert)."""
    rmask = ranks < NUM_RANKS
    emask = els < E_LOCAL
    row = recv_counts_ptr + ranks * (1 + E_LOCAL)
    tokens = tl.load(row, mask=rmask, other=0)
    per = tl.load(row[:, None] + 1 + els[None, :], mask=rmask[:, None] & emask[None, :], other=0)
    src_end = tl.cumsum(tokens, 0)
    chosen = tl.sum(per, 0)
    aligned = (chosen + alignment - 1) // alignment * alignment
    expert_start = tl.cumsum(aligned, 0) - aligned
    start = expert_start[None, :] + tl.cumsum(per, 0) - per
    return src_end - tokens, src_end, chosen, aligned, expert_start, start


@triton.jit
def write_prefix_sums(
    psum_rank_ptr,
    psum_expert_ptr,
    unaligned_ptr,
    ranks,
    els,
    src_end,
    chosen,
    aligned,
    expert_start,
    NUM_RANKS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    EXPAND: tl.constexpr,
):
    """The handle's prefix sums (DeepEP V2's meanings): rows per source, inclusive; per local
    expert, inclusive aligned counts (plain) or the block start plus the real count (expand)."""
    tl.store(psum_rank_ptr + ranks, src_end, mask=ranks < NUM_RANKS)
    emask = els < E_LOCAL
    if EXPAND:
        tl.store(psum_expert_ptr + els, expert_start + chosen, mask=emask)
    else:
        tl.store(psum_expert_ptr + els, expert_start + aligned, mask=emask)
    tl.store(unaligned_ptr + els, chosen, mask=emask)


@triton.jit
def copy_rows(
    src,
    dst_rows,
    live,
    out_words,
    out_sf,
    out_sf_token_stride,
    out_sf_group_stride,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    HAS_SF: tl.constexpr,
):
    """Copy the payload and scale packs of records ``src`` ([B] int64) to output rows
    ``dst_rows`` where ``live``."""
    words = tl.arange(0, BLOCK_WORDS)
    rows = dst_rows.to(tl.int64)
    rec = aligned_ptr(src, tl.int32)
    for w0 in range(0, ROW_WORDS, BLOCK_WORDS):
        w = w0 + words
        m = live[:, None] & (w < ROW_WORDS)[None, :]
        v = tl.load(rec[:, None] + w[None, :], mask=m, cache_modifier=".cg")
        tl.store(out_words + rows[:, None] * ROW_WORDS + w[None, :], v, mask=m)
    if HAS_SF:
        g = tl.arange(0, BLOCK_GROUPS)
        m = live[:, None] & (g < G)[None, :]
        v = tl.load(
            (aligned_ptr(src, tl.int32) + PAYLOAD_BYTES // 4)[:, None] + g[None, :],
            mask=m,
            cache_modifier=".cg",
        )
        at = rows[:, None] * out_sf_token_stride + g[None, :] * out_sf_group_stride
        tl.store(out_sf + at, v, mask=m)


@triton.jit
def copy_expanded(
    src,
    dst,
    live,
    ks,
    out_words,
    out_sf,
    out_sf_token_stride,
    out_sf_group_stride,
    K: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    HAS_SF: tl.constexpr,
):
    """Copy the payload and scale packs of records ``src`` ([B] int64) to each of their
    expanded rows ``dst`` ([B, BLOCK_K], ``-1`` none): each word is read once and written
    up to ``K`` times, the writes unrolled so that they overlap. The reads are masked by
    ``live`` alone, not by ``dst``, so that they need not wait for the metadata loads that
    give ``dst``."""
    words = tl.arange(0, BLOCK_WORDS)
    rec = aligned_ptr(src, tl.int32)
    for w0 in range(0, ROW_WORDS, BLOCK_WORDS):
        w = w0 + words
        wmask = w < ROW_WORDS
        v = tl.load(
            rec[:, None] + w[None, :], mask=live[:, None] & wmask[None, :], cache_modifier=".cg"
        )
        for k in tl.static_range(K):
            rows = lane(dst, ks, k)
            m = (live & (rows >= 0))[:, None] & wmask[None, :]
            tl.store(out_words + rows.to(tl.int64)[:, None] * ROW_WORDS + w[None, :], v, mask=m)
    if HAS_SF:
        g = tl.arange(0, BLOCK_GROUPS)
        gmask = g < G
        v = tl.load(
            (aligned_ptr(src, tl.int32) + PAYLOAD_BYTES // 4)[:, None] + g[None, :],
            mask=live[:, None] & gmask[None, :],
            cache_modifier=".cg",
        )
        for k in tl.static_range(K):
            rows = lane(dst, ks, k).to(tl.int64)
            m = (live & (rows >= 0))[:, None] & gmask[None, :]
            at = rows[:, None] * out_sf_token_stride + g[None, :] * out_sf_group_stride
            tl.store(out_sf + at, v, mask=m)


@triton.jit
def mark_unused_rows(
    pid,
    num_programs,
    total,
    num_rows,
    out_ids,
    out_weights,
    out_meta,
    out_slots,
    ks,
    K: tl.constexpr,
    EXPAND: tl.constexpr,
    has_weights,
    write_meta,
    BLOCK_FILL: tl.constexpr,
):
    """Rows ``[total, num_rows)`` of worst-case outputs: metadata, slots and (plain) ids
    ``-1``, weights 0. Markers only: the payload rows stay unwritten, so the cost follows the
    received rows, not the worst case."""
    kmask = ks < K
    for r0 in range(total + pid * BLOCK_FILL, num_rows, num_programs * BLOCK_FILL):
        i = r0 + tl.arange(0, BLOCK_FILL)
        pad = i < num_rows
        rows = i.to(tl.int64)
        m2 = pad[:, None] & kmask[None, :]
        if not EXPAND:
            tl.store(out_ids + rows[:, None] * K + ks[None, :], -1, mask=m2)
            if has_weights:
                tl.store(out_weights + rows[:, None] * K + ks[None, :], 0.0, mask=m2)
        if write_meta:
            row = out_meta + rows * (K + 2)
            tl.store(row, -1, mask=pad)
            tl.store(row + 1, -1, mask=pad)
            tl.store(row[:, None] + 2 + ks[None, :], -1, mask=m2)
            tl.store(out_slots + rows, -1, mask=pad)


@triton.jit
def zero_padding(
    pid,
    num_programs,
    chosen,
    aligned,
    expert_start,
    els,
    out_words,
    out_sf,
    out_sf_token_stride,
    out_sf_group_stride,
    out_weights,
    E_LOCAL: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    HAS_SF: tl.constexpr,
    has_weights,
    BLOCK_ROWS: tl.constexpr,
):
    """Zero the rows between each expert's last row and the next aligned start."""
    words = tl.arange(0, BLOCK_WORDS)
    g = tl.arange(0, BLOCK_GROUPS)
    for e in range(pid, E_LOCAL, num_programs):
        first = lane(expert_start + chosen, els, e)
        pads = lane(aligned - chosen, els, e)
        for r0 in range(0, pads, BLOCK_ROWS):
            n = r0 + tl.arange(0, BLOCK_ROWS)
            live = n < pads
            rows = (first + n).to(tl.int64)
            for w0 in range(0, ROW_WORDS, BLOCK_WORDS):
                w = w0 + words
                tl.store(
                    out_words + rows[:, None] * ROW_WORDS + w[None, :],
                    0,
                    mask=live[:, None] & (w < ROW_WORDS)[None, :],
                )
            if HAS_SF:
                at = rows[:, None] * out_sf_token_stride + g[None, :] * out_sf_group_stride
                tl.store(out_sf + at, 0, mask=live[:, None] & (g < G)[None, :])
            if has_weights:
                tl.store(out_weights + rows, 0.0, mask=live)


@triton.jit
def copy_received_block(
    i,
    total,
    src_start,
    src_end,
    ranks,
    start_flat,
    ks,
    rec_base,
    max_tokens,
    num_out_rows,
    out_words,
    out_sf,
    out_sf_token_stride,
    out_sf_group_stride,
    out_ids,
    out_weights,
    out_meta,
    out_slots,
    has_weights,
    write_meta,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_LOCAL_EXPERTS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    EXPAND: tl.constexpr,
    HAS_SF: tl.constexpr,
):
    """Received rows ``i`` ([BLOCK_ROWS], those below ``total`` live) into the caller's
    layout, from their records in the region at ``rec_base``, with the handle's rows."""
    kmask = ks < K
    live = i < total
    source = tl.sum((src_end[None, :] <= i[:, None]).to(tl.int32), 1)
    source = tl.where(live, source, 0)
    pos = i - tl.sum(tl.where(ranks[None, :] == source[:, None], src_start[None, :], 0), 1)
    spot = (source * max_tokens + pos).to(tl.int64)
    rec = rec_base + spot * RECORD_BYTES
    meta = aligned_ptr(rec, tl.int32) + (PAYLOAD_BYTES + SCALE_BYTES) // 4
    m2 = live[:, None] & kmask[None, :]
    local = tl.load(meta[:, None] + 3 + ks[None, :], mask=m2, other=-1, cache_modifier=".cg")
    weights = tl.load(
        meta[:, None] + 3 + 2 * K + ks[None, :], mask=m2, other=0, cache_modifier=".cg"
    )
    weights = weights.to(tl.float32, bitcast=True)
    if EXPAND:
        ranked = tl.load(
            meta[:, None] + 3 + K + ks[None, :], mask=m2, other=0, cache_modifier=".cg"
        )
        at = tl.reshape(
            source[:, None] * BLOCK_LOCAL_EXPERTS + tl.maximum(local, 0),
            (BLOCK_ROWS * BLOCK_K,),
        )
        block_start = tl.reshape(tl.gather(start_flat, at, 0), (BLOCK_ROWS, BLOCK_K))
        dst = tl.where(
            (local >= 0) & (block_start + ranked < num_out_rows), block_start + ranked, -1
        )
        copy_expanded(
            rec,
            dst,
            live,
            ks,
            out_words,
            out_sf,
            out_sf_token_stride,
            out_sf_group_stride,
            K,
            ROW_WORDS,
            BLOCK_WORDS,
            G,
            BLOCK_GROUPS,
            PAYLOAD_BYTES,
            HAS_SF,
        )
        if has_weights:
            tl.store(out_weights + dst.to(tl.int64), weights, mask=m2 & (dst >= 0))
    else:
        dst = tl.full((BLOCK_ROWS, BLOCK_K), -1, tl.int32)
        copy_rows(
            rec,
            i,
            live,
            out_words,
            out_sf,
            out_sf_token_stride,
            out_sf_group_stride,
            ROW_WORDS,
            BLOCK_WORDS,
            G,
            BLOCK_GROUPS,
            PAYLOAD_BYTES,
            HAS_SF,
        )
        rows2 = i.to(tl.int64)[:, None] * K + ks[None, :]
        tl.store(out_ids + rows2, local.to(tl.int64), mask=m2)
        if has_weights:
            tl.store(out_weights + rows2, weights, mask=m2)
    if write_meta:
        token = tl.load(meta, mask=live, other=-1, cache_modifier=".cg")
        first_col = tl.load(meta + 1, mask=live, other=-1, cache_modifier=".cg")
        slot = tl.load(meta + 2, mask=live, other=-1, cache_modifier=".cg")
        row = out_meta + i.to(tl.int64) * (K + 2)
        tl.store(row, source * max_tokens + token, mask=live)
        tl.store(row + 1, source * K + first_col, mask=live)
        tl.store(row[:, None] + 2 + ks[None, :], dst, mask=m2)
        tl.store(out_slots + i, slot, mask=live)


@triton.jit
def copy_share(
    call,
    pid,
    num_programs,
    t_waited,
    recv_counts_ptr,
    peer_ptrs,
    rank,
    region_offset,
    region_bytes,
    max_tokens,
    alignment,
    num_rows,
    num_out_rows,
    out_words,
    out_sf,
    out_sf_token_stride,
    out_sf_group_stride,
    out_ids,
    out_weights,
    out_meta,
    out_slots,
    psum_rank_ptr,
    psum_expert_ptr,
    unaligned_ptr,
    flags,
    trace_ptr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_LOCAL_EXPERTS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    RECORD_BYTES: tl.constexpr,
    PAYLOAD_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
    EXPAND: tl.constexpr,
    HAS_SF: tl.constexpr,
    PROFILE: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    """Program ``pid`` of ``num_programs``'s share of the copy epilogue of exchange ``call``
    (the body of :func:`elastic_dispatch_epilogue`): its blocks of received rows, the markers
    of unused rows, the padding, and (``pid`` 0) the prefix sums. Returns its trace readings
    after the layout, the rows and the markers (``t_waited`` untraced)."""
    region = region_offset + (call % 2) * region_bytes
    my_base = tl.load(peer_ptrs + rank)
    ranks = tl.arange(0, BLOCK_RANKS)
    els = tl.arange(0, BLOCK_LOCAL_EXPERTS)
    ks = tl.arange(0, BLOCK_K)
    has_weights = (flags & FLAG_WEIGHTS) != 0
    write_meta = (flags & FLAG_META) != 0
    src_start, src_end, chosen, aligned, expert_start, start = received_layout(
        recv_counts_ptr, ranks, els, alignment, NUM_RANKS, E_LOCAL
    )
    # Rows past the outputs (only if the ranks disagreed on num_max_tokens_per_rank) are not
    # written; rows of worst-case outputs past the received ones are marked (ids -1).
    total = tl.minimum(tl.sum(tl.where(ranks < NUM_RANKS, src_end - src_start, 0), 0), num_rows)
    if write_meta & (pid == 0):
        write_prefix_sums(
            psum_rank_ptr,
            psum_expert_ptr,
            unaligned_ptr,
            ranks,
            els,
            src_end,
            chosen,
            aligned,
            expert_start,
            NUM_RANKS,
            E_LOCAL,
            EXPAND,
        )
    start_flat = tl.reshape(start, (BLOCK_RANKS * BLOCK_LOCAL_EXPERTS,))
    t_laid = t_waited
    if PROFILE:
        t_laid = read_clock(trace_ptr, USE_CLOCK)
    for i0 in range(pid * BLOCK_ROWS, total, num_programs * BLOCK_ROWS):
        copy_received_block(
            i0 + tl.arange(0, BLOCK_ROWS),
            total,
            src_start,
            src_end,
            ranks,
            start_flat,
            ks,
            my_base + region,
            max_tokens,
            num_out_rows,
            out_words,
            out_sf,
            out_sf_token_stride,
            out_sf_group_stride,
            out_ids,
            out_weights,
            out_meta,
            out_slots,
            has_weights,
            write_meta,
            K,
            BLOCK_K,
            BLOCK_LOCAL_EXPERTS,
            ROW_WORDS,
            BLOCK_WORDS,
            G,
            BLOCK_GROUPS,
            RECORD_BYTES,
            PAYLOAD_BYTES,
            SCALE_BYTES,
            BLOCK_ROWS,
            EXPAND,
            HAS_SF,
        )
    t_copied = t_laid
    if PROFILE:
        t_copied = read_clock(trace_ptr, USE_CLOCK)
    mark_unused_rows(
        pid,
        num_programs,
        total,
        num_rows,
        out_ids,
        out_weights,
        out_meta,
        out_slots,
        ks,
        K,
        EXPAND,
        has_weights,
        write_meta,
        BLOCK_FILL,
    )
    t_marked = t_copied
    if PROFILE:
        t_marked = read_clock(trace_ptr, USE_CLOCK)
    if EXPAND:  # noqa: SIM102 (compiled in or out; the inner test runs)
        if (flags & FLAG_ZERO_PAD) != 0:
            zero_padding(
                pid,
                num_programs,
                chosen,
                aligned,
                expert_start,
                els,
                out_words,
                out_sf,
                out_sf_token_stride,
                out_sf_group_stride,
                out_weights,
                E_LOCAL,
                ROW_WORDS,
                BLOCK_WORDS,
                G,
                BLOCK_GROUPS,
                HAS_SF,
                has_weights,
                BLOCK_ROWS,
            )
    return t_laid, t_copied, t_marked


@kernel(
    "tritonep::elastic::dispatch_copy_epilogue_impl",
    do_not_specialize=[
        "max_tokens",
        "alignment",
        "num_rows",
        "num_out_rows",
        "out_sf_token_stride",
        "out_sf_group_stride",
        "flags",
        "timeout_us",
    ],
)
def elastic_dispatch_epilogue(
    # EpilogueCall: what changes from call to call
    recv_counts_ptr,  # [R, 1 + E_LOCAL] int32 from elastic_dispatch
    max_tokens,  # slots per source rank in a region (num_max_tokens_per_rank)
    alignment,  # expert_alignment
    num_rows,  # rows of recv_src_metadata (and of the plain outputs)
    num_out_rows,  # rows of recv_x (expanded: more than num_rows)
    out_words_ptr,  # [rows, ROW_WORDS] int32 words of recv_x
    out_sf_ptr,  # [rows, G] int32 view of the scale packs (HAS_SF), strides below
    out_sf_token_stride,  # strides of out_sf_ptr, in packs
    out_sf_group_stride,
    out_ids_ptr,  # [rows, K] int64 local expert ids (plain)
    out_weights_ptr,  # [rows, K] (plain) or [rows] (EXPAND) float32 (FLAG_WEIGHTS)
    out_meta_ptr,  # [tokens, K + 2] int32 recv_src_metadata (FLAG_META)
    out_slots_ptr,  # [tokens] int32 reduction slot of each received token (FLAG_META)
    psum_rank_ptr,  # [R] int32 out (FLAG_META)
    psum_expert_ptr,  # [E_LOCAL] int32 out (FLAG_META)
    unaligned_ptr,  # [E_LOCAL] int32 out (FLAG_META)
    flags,  # FLAG_WEIGHTS | FLAG_ZERO_PAD | FLAG_META
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE; kernels.trace), else unused
    # ElasticShared (elastic_exchange): the mode's, the same on every call
    peer_ptrs,  # [R] int64 heap base of every rank
    rank,  # this rank
    header_offset,  # (unused)
    barrier_offset,  # (unused)
    region_offset,  # byte offset of region 0 (region 1 follows at + region_bytes)
    region_bytes,  # bytes of a region
    state_ptr,  # [8] int64 mode state (the exchange is closed: its number is EXCHANGES - 1)
    status_ptr,  # (unused)
    timeout_us,  # (unused)
    K: tl.constexpr,  # top-k: choices per token
    BLOCK_K: tl.constexpr,  # K as a power of two (at least 2)
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS as a power of two (at least 2)
    E_LOCAL: tl.constexpr,  # experts per rank
    BLOCK_LOCAL_EXPERTS: tl.constexpr,  # E_LOCAL as a power of two (at least 2)
    ROW_WORDS: tl.constexpr,  # int32 words of a row
    BLOCK_WORDS: tl.constexpr,  # words moved per step
    G: tl.constexpr,  # scale packs per row
    BLOCK_GROUPS: tl.constexpr,  # G as a power of two (at least 2)
    RECORD_BYTES: tl.constexpr,  # bytes of a dispatch record
    PAYLOAD_BYTES: tl.constexpr,  # bytes of its payload (16-byte aligned)
    SCALE_BYTES: tl.constexpr,  # bytes of its scale packs (16-byte aligned)
    BLOCK_ROWS: tl.constexpr,  # received tokens per block
    BLOCK_FILL: tl.constexpr,  # rows per block of the unused rows' markers
    EXPAND: tl.constexpr,  # expanded layout: a row per (token, local expert)
    HAS_SF: tl.constexpr,  # the rows come with scale packs (FP8)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of elastic_dispatch
    PROFILE: tl.constexpr = False,  # record a trace (wait; layout, rows, marks, padding)
    USE_CLOCK: tl.constexpr = False,  # traces read the GPU clock (not under the interpreter)
):
    # The push's grid (counts, state, and the records, which its last program saw every peer
    # finish) first; the copy phase is its sub-phases after it.
    t_start, t_waited = wait_for_push(trace_ptr, PDL, PROFILE, USE_CLOCK)
    t_laid, t_copied, t_marked = copy_share(
        tl.load(state_ptr, volatile=True) - 1,
        tl.program_id(0),
        tl.num_programs(0),
        t_waited,
        recv_counts_ptr,
        peer_ptrs,
        rank,
        region_offset,
        region_bytes,
        max_tokens,
        alignment,
        num_rows,
        num_out_rows,
        out_words_ptr,
        out_sf_ptr,
        out_sf_token_stride,
        out_sf_group_stride,
        out_ids_ptr,
        out_weights_ptr,
        out_meta_ptr,
        out_slots_ptr,
        psum_rank_ptr,
        psum_expert_ptr,
        unaligned_ptr,
        flags,
        trace_ptr,
        K,
        BLOCK_K,
        NUM_RANKS,
        BLOCK_RANKS,
        E_LOCAL,
        BLOCK_LOCAL_EXPERTS,
        ROW_WORDS,
        BLOCK_WORDS,
        G,
        BLOCK_GROUPS,
        RECORD_BYTES,
        PAYLOAD_BYTES,
        SCALE_BYTES,
        BLOCK_ROWS,
        BLOCK_FILL,
        EXPAND,
        HAS_SF,
        PROFILE,
        USE_CLOCK,
    )
    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(
            trace_ptr,
            t_start,
            t_waited,
            t_end,
            t_laid - t_waited,
            t_copied - t_laid,
            t_marked - t_copied,
            t_end - t_marked,
            0,
            USE_CLOCK,
        )
