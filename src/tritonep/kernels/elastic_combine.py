"""Elastic combine: every rank stores one row per received token back into a fixed slot of the
token's owner, then one epilogue on all SMs sums each token's rows in a fixed order.

:func:`elastic_combine` (``tritonep::elastic::combine_impl``), on the rank that holds the
experts: program ``p`` takes work items ``p, p + P, ...``, an item being a block of
``BLOCK_ROWS`` received tokens and a chunk of ``BLOCK_CHANNELS`` channels. A token's
row is the input row (plain layout), or the float32 sum of its expanded rows in top-k order,
rounded to BF16 (expand layout, ``MULTI``); it goes to the owner's region at
``[slot][source token]`` with the token's top-k weights, ``slot`` being this rank's place in
the order in which the owner sums the token's rows (``reduction_slots`` of
:mod:`.elastic_dispatch`, fixed at dispatch). Without ``MULTI`` (expand layout) every expanded
row goes back alone, to slot ``k`` of its top-k column. The last program sends the tags and
waits for every rank's.

:func:`elastic_combine_sums` (``tritonep::elastic::combine_sums_impl``), before the push of a
large combine of expanded rows (``MULTI``): the same per-token sums, on every SM, into a
``[tokens, H]`` scratch that the push then sends as a plain layout, bit for bit the rows it
would have summed itself.

:func:`elastic_combine_epilogue` (``tritonep::elastic::combine_reduce_epilogue_impl``), on the
owner: for each token, float32 ``bias_0 + bias_1``, then each slot's row added in slot order
(the ranks by the column of their last choice, or the top-k columns), rounded to BF16 once: the
order of DeepEP V2's reference (``deep_ep/utils/refs.py``), so results match it bit for bit.
Weight ``k`` comes from the row of the rank that holds expert ``k``.

:func:`combine_push` and :func:`reduce_share` are the two kernels' bodies.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .elastic_dispatch import load_choices
from .elastic_exchange import (
    arrive,
    exchange_number,
    finish_exchange,
    send_tags,
    wait_for_push,
    wait_tags,
)
from .fp8 import from_bf16, to_bf16
from .phases import ELASTIC_COMBINE
from .profiled import kernel
from .sync import aligned_ptr, lane
from .trace import read_clock, write_trace


class CombineCall(NamedTuple):
    """The leading runtime arguments of :func:`elastic_combine`, in its order: what changes
    from call to call; :class:`~.elastic_exchange.ElasticShared` follows."""

    x_ptr: object
    weights_ptr: object
    meta_ptr: object
    slots_ptr: object
    psum_rank_ptr: object
    max_tokens: int
    has_weights: int
    trace_ptr: object


class CombineVariant(NamedTuple):
    """One compiled variant of :func:`elastic_combine`: its constexprs, in its order."""

    H: int
    K: int
    BLOCK_K: int
    NUM_RANKS: int
    BLOCK_RANKS: int
    COMBINE_RECORD_BYTES: int
    HEADER_WORDS: int
    BLOCK_ROWS: int
    BLOCK_CHANNELS: int
    EXPAND: bool
    MULTI: bool
    USE_CLOCK: bool
    PDL: bool
    PROFILE: bool


class SumsCall(NamedTuple):
    """The runtime arguments of :func:`elastic_combine_sums`, in its order."""

    x_ptr: object
    weights_ptr: object
    meta_ptr: object
    psum_rank_ptr: object
    sums_ptr: object
    sum_weights_ptr: object
    has_weights: int
    trace_ptr: object


class SumsVariant(NamedTuple):
    """One compiled variant of :func:`elastic_combine_sums`: its constexprs, in its order."""

    H: int
    K: int
    BLOCK_K: int
    NUM_RANKS: int
    BLOCK_ROWS: int
    BLOCK_CHANNELS: int
    USE_CLOCK: bool
    PROFILE: bool


class ReduceCall(NamedTuple):
    """The leading runtime arguments of :func:`elastic_combine_epilogue`, in its order."""

    topk_ptr: object
    bias0_ptr: object
    bias1_ptr: object
    out_ptr: object
    out_weights_ptr: object
    num_tokens: int
    max_tokens: int
    num_bias: int
    has_weights: int
    trace_ptr: object


class ReduceVariant(NamedTuple):
    """One compiled variant of :func:`elastic_combine_epilogue`: its constexprs, in its order."""

    H: int
    K: int
    BLOCK_K: int
    NUM_EXPERTS: int
    E_LOCAL: int
    SLOTS: int
    RANK_SLOTS: bool
    COMBINE_RECORD_BYTES: int
    BLOCK_TOKENS: int
    BLOCK_CHANNELS: int
    USE_CLOCK: bool
    PDL: bool
    PROFILE: bool


@triton.jit
def slot_rows(region, slot, token, max_tokens, COMBINE_RECORD_BYTES: tl.constexpr):
    """Address of slot ``slot`` of token ``token`` in a combine region (vectors broadcast): a
    multiple of 16 bytes (the regions and records are), which :func:`~.sync.aligned_ptr` tells
    Triton so that the rows move in 16-byte vectors rather than one BF16 value at a time."""
    return region + (slot * max_tokens + token).to(tl.int64) * COMBINE_RECORD_BYTES


@triton.jit
def row_values(
    x_ptr,
    rows,
    i,
    live,
    h,
    hmask,
    ks,
    H: tl.constexpr,
    K: tl.constexpr,
    EXPAND: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Channels ``h`` of each token's row: the input row ``i``, or with ``EXPAND`` the float32
    sum of its expanded rows ``rows`` in top-k order, rounded to BF16. The top-k loop is
    unrolled: its loads are independent and overlap; only the sum keeps the top-k order."""
    if EXPAND:
        acc = tl.zeros((i.shape[0], h.shape[0]), tl.float32)
        for k in tl.static_range(K):
            r = lane(rows, ks, k)
            m = live & (r >= 0)
            y = tl.load(
                x_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * H + h[None, :],
                mask=m[:, None] & hmask[None, :],
                other=0.0,
            )
            acc = tl.where(m[:, None], acc + from_bf16(y, EMULATE), acc)
        y = to_bf16(acc, EMULATE)
    else:
        y = tl.load(
            x_ptr + i.to(tl.int64)[:, None] * H + h[None, :],
            mask=live[:, None] & hmask[None, :],
        )
    return y


@triton.jit
def row_weights(weights_ptr, rows, i, live, ks, K: tl.constexpr, EXPAND: tl.constexpr):
    """``[B, BLOCK_K]`` top-k weights of each token: row ``i`` of ``[rows, K]`` weights, or
    with ``EXPAND`` each choice's expanded row's weight (0 where the choice is elsewhere)."""
    kmask = live[:, None] & (ks < K)[None, :]
    if EXPAND:
        w = tl.load(
            weights_ptr + tl.maximum(rows, 0).to(tl.int64), mask=kmask & (rows >= 0), other=0.0
        )
    else:
        w = tl.load(weights_ptr + i.to(tl.int64)[:, None] * K + ks[None, :], mask=kmask)
    return w


@triton.jit
def send_sums(
    x_ptr,
    weights_ptr,
    rows,
    i,
    live,
    dst,
    h0,
    ks,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    EXPAND: tl.constexpr,
    has_weights,
    EMULATE: tl.constexpr,
):
    """Store channels ``[h0, h0 + BLOCK_CHANNELS)`` of each token's row (:func:`row_values`)
    at ``dst`` ([B] int64), and with the first channels its weights (:func:`row_weights`)."""
    h = h0 + tl.arange(0, BLOCK_CHANNELS)
    y = row_values(x_ptr, rows, i, live, h, h < H, ks, H, K, EXPAND, EMULATE)
    out = aligned_ptr(dst, tl.bfloat16)
    tl.store(out[:, None] + h[None, :], y, mask=live[:, None] & (h < H)[None, :])
    if (has_weights != 0) & (h0 == 0):
        w = row_weights(weights_ptr, rows, i, live, ks, K, EXPAND)
        wp = (dst + 2 * H).to(tl.pointer_type(tl.float32))
        tl.store(wp[:, None] + ks[None, :], w, mask=live[:, None] & (ks < K)[None, :])


@triton.jit
def send_expanded(
    x_ptr,
    rows,
    live,
    owner_base,
    region,
    token,
    max_tokens,
    h0,
    ks,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    COMBINE_RECORD_BYTES: tl.constexpr,
):
    """Without reductions here: channels ``[h0, h0 + BLOCK_CHANNELS)`` of every expanded row
    to slot ``k`` (its top-k column), the top-k loop unrolled so that the copies overlap."""
    h = h0 + tl.arange(0, BLOCK_CHANNELS)
    hmask = h < H
    for k in tl.static_range(K):
        r = lane(rows, ks, k)
        m2 = (live & (r >= 0))[:, None] & hmask[None, :]
        out = slot_rows(owner_base + region, k, token, max_tokens, COMBINE_RECORD_BYTES)
        out = aligned_ptr(out, tl.bfloat16)
        y = tl.load(x_ptr + tl.maximum(r, 0).to(tl.int64)[:, None] * H + h[None, :], mask=m2)
        tl.store(out[:, None] + h[None, :], y, mask=m2)


@triton.jit
def push_rows(
    x_ptr,
    weights_ptr,
    meta_ptr,
    slots_ptr,
    start,
    total,
    num_items,
    ranks,
    peer_base,
    region,
    max_tokens,
    ks,
    has_weights,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    COMBINE_RECORD_BYTES: tl.constexpr,
    EXPAND: tl.constexpr,
    MULTI: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """This program's work items, each loaded, then stored: plain rows, per-token sums of
    expanded rows (``MULTI``), or every expanded row alone."""
    pid = tl.program_id(0)
    for item in range(pid, num_items, tl.num_programs(0)):
        # Its [B] received tokens, rotated to start at ``start`` (none past the last item),
        # its first channel, and per token the heap base of its owner and its index there.
        i = (item // NUM_CHUNKS) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        h0 = (item % NUM_CHUNKS) * BLOCK_CHANNELS
        live = i < total
        i = i + start
        i = tl.where(i < total, i, i - total)
        src = tl.load(meta_ptr + i.to(tl.int64) * (K + 2), mask=live, other=0)
        source = src // max_tokens
        owner_base = tl.sum(tl.where(ranks[None, :] == source[:, None], peer_base[None, :], 0), 1)
        token = src % max_tokens
        rows = tl.full((BLOCK_ROWS, BLOCK_K), -1, tl.int32)
        if EXPAND:
            meta = meta_ptr + i.to(tl.int64) * (K + 2)
            rows = tl.load(
                meta[:, None] + 2 + ks[None, :],
                mask=live[:, None] & (ks < K)[None, :],
                other=-1,
            )
        if EXPAND & (not MULTI):
            send_expanded(
                x_ptr,
                rows,
                live,
                owner_base,
                region,
                token,
                max_tokens,
                h0,
                ks,
                H,
                K,
                BLOCK_CHANNELS,
                COMBINE_RECORD_BYTES,
            )
        else:
            slot = tl.load(slots_ptr + i, mask=live, other=0)
            dst = slot_rows(owner_base + region, slot, token, max_tokens, COMBINE_RECORD_BYTES)
            send_sums(
                x_ptr,
                weights_ptr,
                rows,
                i,
                live,
                dst,
                h0,
                ks,
                H,
                K,
                BLOCK_CHANNELS,
                EXPAND,
                has_weights,
                EMULATE,
            )


@triton.jit
def combine_push(
    x_ptr,
    weights_ptr,
    meta_ptr,
    slots_ptr,
    psum_rank_ptr,
    peer_ptrs,
    rank,
    header_offset,
    region_offset,
    region_bytes,
    max_tokens,
    state_ptr,
    status_ptr,
    timeout_us,
    has_weights,
    trace_ptr,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    COMBINE_RECORD_BYTES: tl.constexpr,
    HEADER_WORDS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    EXPAND: tl.constexpr,
    MULTI: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    PDL: tl.constexpr,
    PROFILE: tl.constexpr,
):
    """The body of :func:`elastic_combine`: this program's rows, its arrival and, in the last
    program, the tags and the wait for the peers'. Returns its trace readings (rows start,
    push end, arrival; tag and wait times)."""
    t_tag = tl.zeros((), tl.int64)
    t_wait = tl.zeros((), tl.int64)
    call = exchange_number(state_ptr)
    region = region_offset + (call % 2) * region_bytes
    ranks = tl.arange(0, BLOCK_RANKS)
    ks = tl.arange(0, BLOCK_K)
    peer_base = tl.load(peer_ptrs + ranks, mask=ranks < NUM_RANKS, other=0)
    total = tl.load(psum_rank_ptr + NUM_RANKS - 1)
    # The received tokens are in source order, and every rank walks them together: in that
    # order all ranks would push to source 0 first, then to source 1, each receiver taking
    # every sender's rows at once while other links idle. Each rank starts instead with the
    # tokens of the next rank (its own come last), so that at any moment the ranks push to
    # different owners.
    start = tl.load(psum_rank_ptr + rank)
    start = tl.where(start < total, start, 0)
    # Work items: (block of BLOCK_ROWS received tokens, chunk of BLOCK_CHANNELS channels), so
    # that a decode batch of a few tokens still spreads over every program.
    NUM_CHUNKS: tl.constexpr = (H + BLOCK_CHANNELS - 1) // BLOCK_CHANNELS
    num_items = tl.cdiv(total, BLOCK_ROWS) * NUM_CHUNKS
    t_rows = tl.zeros((), tl.int64)
    if PROFILE:
        t_rows = read_clock(trace_ptr, USE_CLOCK)
    push_rows(
        x_ptr,
        weights_ptr,
        meta_ptr,
        slots_ptr,
        start,
        total,
        num_items,
        ranks,
        peer_base,
        region,
        max_tokens,
        ks,
        has_weights,
        H,
        K,
        BLOCK_K,
        NUM_CHUNKS,
        BLOCK_ROWS,
        BLOCK_CHANNELS,
        COMBINE_RECORD_BYTES,
        EXPAND,
        MULTI,
        not USE_CLOCK,
    )
    t_push_end = tl.zeros((), tl.int64)
    if PROFILE:
        t_push_end = read_clock(trace_ptr, USE_CLOCK)
    last = arrive(state_ptr)
    if PDL:
        # This program's rows are out: the reduce epilogue may launch (as in the dispatch's
        # push, elastic_dispatch.dispatch_push: not earlier, or it would hold every SM).
        gdc_launch_dependents()
    t_arrive = t_push_end
    if PROFILE:
        t_arrive = read_clock(trace_ptr, USE_CLOCK)
    if last:
        my_base = tl.load(peer_ptrs + rank)
        send_tags(call, peer_base, rank, ranks, header_offset, HEADER_WORDS, NUM_RANKS)
        if PROFILE:
            t_tag = read_clock(trace_ptr, USE_CLOCK)
        wait_tags(
            call,
            my_base,
            ranks,
            header_offset,
            status_ptr,
            timeout_us,
            ELASTIC_COMBINE,
            HEADER_WORDS,
            NUM_RANKS,
            USE_CLOCK,
        )
        if PROFILE:
            t_wait = read_clock(trace_ptr, USE_CLOCK) - t_tag
            t_tag = t_tag - t_arrive
        finish_exchange(state_ptr, call)
    return t_rows, t_push_end, t_arrive, t_tag, t_wait


@kernel(
    "tritonep::elastic::combine_impl",
    do_not_specialize=["max_tokens", "has_weights", "timeout_us"],
)
def elastic_combine(
    # CombineCall: what changes from call to call
    x_ptr,  # [rows, H] bf16: one row per received token, or per expanded slot (EXPAND)
    weights_ptr,  # [rows, K] (plain) or [rows] (EXPAND) float32 (has_weights)
    meta_ptr,  # [tokens, K + 2] int32 recv_src_metadata of the dispatch
    slots_ptr,  # [tokens] int32 each received token's reduction slot
    psum_rank_ptr,  # [R] int32 rows received per source, inclusive (the last: all)
    max_tokens,  # slots per source rank in a region (num_max_tokens_per_rank)
    has_weights,  # 1: top-k weights go back with the rows (run-time: no variant of its own)
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
    H: tl.constexpr,  # hidden size: channels of a row
    K: tl.constexpr,  # top-k: choices per token
    BLOCK_K: tl.constexpr,  # K as a power of two (at least 2)
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS as a power of two (at least 2)
    # bytes of a combine record: H bf16 values, then K float32 weights
    COMBINE_RECORD_BYTES: tl.constexpr,
    HEADER_WORDS: tl.constexpr,  # int32 words of a header
    BLOCK_ROWS: tl.constexpr,  # rows per block
    BLOCK_CHANNELS: tl.constexpr,  # channels moved per step
    EXPAND: tl.constexpr,  # expanded layout: a row per (token, local expert)
    MULTI: tl.constexpr,  # EXPAND: reduce a token's rows here before sending one
    USE_CLOCK: tl.constexpr,  # waits read the GPU clock (not under the interpreter)
    PDL: tl.constexpr = False,  # the epilogue is a programmatic dependent launch (sm_90+)
    PROFILE: tl.constexpr = False,  # record a trace (push: rows; exchange: arrive, tag, wait)
):
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    t_rows, t_push_end, t_arrive, t_tag, t_wait = combine_push(
        x_ptr,
        weights_ptr,
        meta_ptr,
        slots_ptr,
        psum_rank_ptr,
        peer_ptrs,
        rank,
        header_offset,
        region_offset,
        region_bytes,
        max_tokens,
        state_ptr,
        status_ptr,
        timeout_us,
        has_weights,
        trace_ptr,
        H,
        K,
        BLOCK_K,
        NUM_RANKS,
        BLOCK_RANKS,
        COMBINE_RECORD_BYTES,
        HEADER_WORDS,
        BLOCK_ROWS,
        BLOCK_CHANNELS,
        EXPAND,
        MULTI,
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
            t_push_end - t_rows,
            t_arrive - t_push_end,
            t_tag,
            t_wait,
            0,
            USE_CLOCK,
        )


@kernel("tritonep::elastic::combine_sums_impl", do_not_specialize=["has_weights", "timeout_us"])
def elastic_combine_sums(
    x_ptr,  # [rows, H] bf16: the expanded rows
    weights_ptr,  # [rows] float32 each expanded row's weight (has_weights)
    meta_ptr,  # [tokens, K + 2] int32 recv_src_metadata of the dispatch
    psum_rank_ptr,  # [R] int32 rows received per source, inclusive (the last: all)
    sums_ptr,  # [tokens, H] bf16 out: each received token's sum
    sum_weights_ptr,  # [tokens, K] float32 out: its weights, 0 for choices elsewhere
    has_weights,  # 1: weights too (run-time: no variant of its own)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE; kernels.trace), else unused
    # ElasticShared (elastic_exchange), as every elastic launch takes it: unused here
    peer_ptrs,
    rank,
    header_offset,
    barrier_offset,
    region_offset,
    region_bytes,
    state_ptr,
    status_ptr,
    timeout_us,
    H: tl.constexpr,  # hidden size: channels of a row
    K: tl.constexpr,  # top-k: choices per token
    BLOCK_K: tl.constexpr,  # K as a power of two (at least 2)
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    BLOCK_ROWS: tl.constexpr,  # received tokens per block
    BLOCK_CHANNELS: tl.constexpr,  # channels per work item
    USE_CLOCK: tl.constexpr,  # read the GPU clock (not under the interpreter)
    PROFILE: tl.constexpr = False,  # record a trace (sums)
):
    """The local half of a combine of expanded rows, on every SM before the push: each
    received token's rows summed in top-k order (float32, rounded to BF16 once, as the push
    would), so that the push, on few SMs, only moves one row per token: summing there, those
    SMs would wait on K loads for every row they store."""
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    ks = tl.arange(0, BLOCK_K)
    total = tl.load(psum_rank_ptr + NUM_RANKS - 1)
    NUM_CHUNKS: tl.constexpr = (H + BLOCK_CHANNELS - 1) // BLOCK_CHANNELS
    num_items = tl.cdiv(total, BLOCK_ROWS) * NUM_CHUNKS
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        i = (item // NUM_CHUNKS) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        h0 = (item % NUM_CHUNKS) * BLOCK_CHANNELS
        h = h0 + tl.arange(0, BLOCK_CHANNELS)
        live = i < total
        hmask = h < H
        kmask = live[:, None] & (ks < K)[None, :]
        meta = meta_ptr + i.to(tl.int64) * (K + 2)
        rows = tl.load(meta[:, None] + 2 + ks[None, :], mask=kmask, other=-1)
        y = row_values(x_ptr, rows, i, live, h, hmask, ks, H, K, True, not USE_CLOCK)
        m2 = live[:, None] & hmask[None, :]
        tl.store(sums_ptr + i.to(tl.int64)[:, None] * H + h[None, :], y, mask=m2)
        if (has_weights != 0) & (h0 == 0):
            w = row_weights(weights_ptr, rows, i, live, ks, K, True)
            tl.store(sum_weights_ptr + i.to(tl.int64)[:, None] * K + ks[None, :], w, mask=kmask)
    if PROFILE:
        zero = tl.zeros((), tl.int64)
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(trace_ptr, t_start, t_start, t_end, zero, zero, zero, zero, zero, USE_CLOCK)


@triton.jit
def weight_slots(owner, ks):
    """``[T, BLOCK_K]`` number of ranks before a token's rank ``k`` in its summation order (the
    reduction slot holding weight ``k``), and ``[T]`` the number of ranks."""
    same = owner[:, :, None] == owner[:, None, :]  # [T, k, k']
    later = same & (ks[None, None, :] > ks[None, :, None])
    last = (owner >= 0) & (tl.max(later.to(tl.int32), 2) == 0)  # [T, k']
    last_col = tl.max(tl.where(same, ks[None, None, :], -1), 2)  # [T, k]: its rank's last column
    before = last[:, None, :] & (ks[None, None, :] < last_col[:, :, None])
    return tl.sum(before.to(tl.int32), 2), tl.sum(last.to(tl.int32), 1)


@triton.jit
def reduce_share(
    call,
    pid,
    num_programs,
    topk_ptr,
    bias0_ptr,
    bias1_ptr,
    out_ptr,
    out_weights_ptr,
    num_tokens,
    peer_ptrs,
    rank,
    region_offset,
    region_bytes,
    max_tokens,
    num_bias,
    has_weights,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    SLOTS: tl.constexpr,
    RANK_SLOTS: tl.constexpr,
    COMBINE_RECORD_BYTES: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program ``pid`` of ``num_programs``'s share of the reduce epilogue of exchange ``call``
    (the body of :func:`elastic_combine_epilogue`): its work items of this rank's tokens,
    summed in the fixed slot order."""
    region = tl.load(peer_ptrs + rank) + region_offset + (call % 2) * region_bytes
    ks = tl.arange(0, BLOCK_K)
    hs = tl.arange(0, BLOCK_CHANNELS)
    # Work items: (block of BLOCK_TOKENS tokens, chunk of BLOCK_CHANNELS channels), so that a
    # decode batch spreads over the programs; the slots' loads are unrolled so that they
    # overlap, the sum keeping the slot order.
    NUM_CHUNKS: tl.constexpr = (H + BLOCK_CHANNELS - 1) // BLOCK_CHANNELS
    num_items = tl.cdiv(num_tokens, BLOCK_TOKENS) * NUM_CHUNKS
    for item in range(pid, num_items, num_programs):
        tokens = (item // NUM_CHUNKS) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        h0 = (item % NUM_CHUNKS) * BLOCK_CHANNELS
        tmask = tokens < num_tokens
        _, ids, valid = load_choices(topk_ptr, tokens, tmask, ks, K, NUM_EXPERTS)
        owner = tl.where(valid, ids // E_LOCAL, -1)
        weight_slot, num_slots = weight_slots(owner, ks)
        rows = tokens.to(tl.int64)
        h = h0 + hs
        m2 = tmask[:, None] & (h < H)[None, :]
        at = rows[:, None] * H + h[None, :]
        acc = tl.zeros((BLOCK_TOKENS, BLOCK_CHANNELS), tl.float32)
        if num_bias >= 1:
            acc = from_bf16(tl.load(bias0_ptr + at, mask=m2, other=0.0), EMULATE)
        if num_bias == 2:
            acc = acc + from_bf16(tl.load(bias1_ptr + at, mask=m2, other=0.0), EMULATE)
        for j in tl.static_range(SLOTS):
            if RANK_SLOTS:
                used = tmask & (j < num_slots)
            else:
                used = tmask & (lane(valid.to(tl.int32), ks, j) > 0)
            src = aligned_ptr(
                slot_rows(region, j, tokens, max_tokens, COMBINE_RECORD_BYTES), tl.bfloat16
            )
            y = tl.load(
                src[:, None] + h[None, :],
                mask=used[:, None] & (h < H)[None, :],
                other=0.0,
                cache_modifier=".cg",  # written by peers: not from this SM's L1
            )
            acc = tl.where(used[:, None], acc + from_bf16(y, EMULATE), acc)
        tl.store(out_ptr + at, to_bf16(acc, EMULATE), mask=m2)
        if (has_weights != 0) & (h0 == 0):
            kmask = tmask[:, None] & (ks < K)[None, :]
            at_w = (
                slot_rows(region, weight_slot, tokens[:, None], max_tokens, COMBINE_RECORD_BYTES)
                + 2 * H
            )
            w = tl.load(
                at_w.to(tl.pointer_type(tl.float32)) + ks[None, :],
                mask=kmask & valid,
                other=0.0,
                cache_modifier=".cg",
            )
            tl.store(out_weights_ptr + rows[:, None] * K + ks[None, :], w, mask=kmask)


@kernel(
    "tritonep::elastic::combine_reduce_epilogue_impl",
    do_not_specialize=["num_tokens", "max_tokens", "num_bias", "has_weights", "timeout_us"],
)
def elastic_combine_epilogue(
    # ReduceCall: what changes from call to call
    topk_ptr,  # [N, K] int64 the dispatch's ids (this rank's tokens)
    bias0_ptr,  # [N, H] bf16 (num_bias >= 1)
    bias1_ptr,  # [N, H] bf16 (num_bias == 2)
    out_ptr,  # [N, H] bf16
    out_weights_ptr,  # [N, K] float32 (has_weights)
    num_tokens,  # N: this rank's tokens
    max_tokens,  # slots per source rank in a region (num_max_tokens_per_rank)
    num_bias,  # bias tensors, 0 to 2 (run-time, as has_weights)
    has_weights,  # 1: weights come back too (run-time: no variant of its own)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE; kernels.trace), else unused
    # ElasticShared (elastic_exchange): the mode's, the same on every call
    peer_ptrs,  # [R] int64 heap base of every rank
    rank,  # this rank
    header_offset,  # (unused)
    barrier_offset,  # (unused)
    region_offset,  # byte offset of region 0 (region 1 follows at + region_bytes)
    region_bytes,  # bytes of a region
    state_ptr,  # [8] int64 mode state (elastic_exchange)
    status_ptr,  # (unused)
    timeout_us,  # (unused)
    H: tl.constexpr,  # hidden size: channels of a row
    K: tl.constexpr,  # top-k: choices per token
    BLOCK_K: tl.constexpr,  # K as a power of two (at least 2)
    NUM_EXPERTS: tl.constexpr,  # experts in all
    E_LOCAL: tl.constexpr,  # experts per rank
    SLOTS: tl.constexpr,  # slots per token
    RANK_SLOTS: tl.constexpr,  # a slot per destination rank (else per top-k column)
    COMBINE_RECORD_BYTES: tl.constexpr,  # bytes of a combine record
    BLOCK_TOKENS: tl.constexpr,  # tokens per block
    BLOCK_CHANNELS: tl.constexpr,  # channels moved per step
    USE_CLOCK: tl.constexpr,  # waits read the GPU clock (not under the interpreter)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of elastic_combine
    PROFILE: tl.constexpr = False,  # record a trace (wait; reduce)
):
    EMULATE: tl.constexpr = not USE_CLOCK
    # The push's grid (state, and the rows, which its last program saw every peer finish)
    # first; the reduce phase is the rest.
    t_start, t_waited = wait_for_push(trace_ptr, PDL, PROFILE, USE_CLOCK)
    reduce_share(
        tl.load(state_ptr, volatile=True) - 1,
        tl.program_id(0),
        tl.num_programs(0),
        topk_ptr,
        bias0_ptr,
        bias1_ptr,
        out_ptr,
        out_weights_ptr,
        num_tokens,
        peer_ptrs,
        rank,
        region_offset,
        region_bytes,
        max_tokens,
        num_bias,
        has_weights,
        H,
        K,
        BLOCK_K,
        NUM_EXPERTS,
        E_LOCAL,
        SLOTS,
        RANK_SLOTS,
        COMBINE_RECORD_BYTES,
        BLOCK_TOKENS,
        BLOCK_CHANNELS,
        EMULATE,
    )
    if PROFILE:
        zero = tl.zeros((), tl.int64)
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(trace_ptr, t_start, t_waited, t_end, zero, zero, zero, zero, zero, USE_CLOCK)
