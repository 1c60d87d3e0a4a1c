"""Low-latency dispatch: quantize each token on the fly and store it straight into the owner's slot.

Send phase: each program counts the batch's tokens per expert (so it knows every slot of its
own tokens without asking another program), loads and quantizes each of its tokens once, and
stores one message per distinct expert into the owner's receive slab
``[local_expert][source_rank][slot]``; a token's payload crosses to an owner once. The program
that completes an expert's count publishes it, tagged with the call number, after the data.
Receive phase: each (local expert, source rank) item waits (bounded) for the counts of its
source and the earlier ones, then packs its messages into ``recv_x`` in source-rank order, so
outputs are deterministic. A failed wait leaves a poison row; bad ids are recorded in the
status. A compiled variant serves a class of batch sizes (one token, few ids counted by
atomic adds, many ids counted by histograms); the token count within a class is a runtime
value. docs/design/low_latency.md gives the whole design and why it is fast.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .fp8 import e4m3_bits, from_bf16, quantize_groups
from .peer_mask import mask_timed_out, masked, wait_peer
from .phases import LL_DISPATCH_IDS, LL_DISPATCH_RECV
from .status import first_bad_id, record_bad_id
from .sync import (
    aligned_ptr,
    any_set,
    call_number,
    finish_launch,
    lane,
    limit_ns,
    record_timeout,
    wait_tile,
)
from .trace import read_clock, write_trace
from .transport import SIGNAL_SET, VIA_STORE, put_block_signal

# Device state (int64), shared with the combine kernel module: row ``r`` of ``[8, P]``. The
# call counters are per program (program ``p`` keeps its own in column ``p``): a program reads
# its counter at its start and writes the next value at its end, and only the same program of
# the next launch reads it again, so no program waits on another to advance it. Counting the
# programs of a launch (an atomic per program at its end, about a microsecond per launch) is
# left to shrink mode, whose last program settles the verdicts.
DISPATCH_SEND_CALLS = tl.constexpr(0)
DISPATCH_RECV_CALLS = tl.constexpr(1)
DISPATCH_ARRIVALS = tl.constexpr(4)  # (column 0)
#: Rows of the device state.
STATE_ROWS = 8

#: Count by atomic adds while all programs' adds together stay within this many (see the send
#: phase), by histograms beyond (``COUNT_BY_ADDS``, chosen by the host from the shapes).
COUNT_ADDS = 32768

HEADER_BYTES = tl.constexpr(16)
#: int32 words of a sender program's scratch row after its three ``[BINS]`` lists, for the
#: token being sent (top-k at most 16): its messages' addresses (int64), then per column the
#: owner key, the message index and the payload reference (int32).
TOKEN_WORDS = tl.constexpr(80)


class LowLatencyShared(NamedTuple):
    """The trailing runtime arguments of both low-latency kernels, in their order: what stays
    the same from call to call of one mode (see the kernels' signatures for each)."""

    peer_ptrs: object
    pe_ptr: object
    rank: int
    state_ptr: object
    scratch_ptr: object
    expert_done_ptr: object
    status_ptr: object
    timeout_us: int
    mask_ptr: object
    verdict_ptr: object
    skipped_ptr: object


class DispatchCall(NamedTuple):
    """The leading runtime arguments of :func:`ll_dispatch_kernel`, in its order: what changes
    from call to call."""

    x_ptr: object
    topk_idx_ptr: object
    num_tokens: int
    out_x_ptr: object
    out_scales_ptr: object
    out_src_ptr: object
    out_count_ptr: object
    out_range_ptr: object
    recv_stats_ptr: object
    wait_stats_ptr: object
    trace_ptr: object


class DispatchVariant(NamedTuple):
    """One compiled variant of :func:`ll_dispatch_kernel`: its constexprs, in its order."""

    H: int
    K: int
    NUM_EXPERTS: int
    NUM_RANKS: int
    MAX_TOKENS: int
    MSG_BYTES: int
    RECV_SET_BYTES: int
    FLAG_SET_BYTES: int
    RECV_OFFSET: int
    FLAG_OFFSET: int
    STAGE_OFFSET: int
    GPUS_PER_NODE: int
    USE_FP8: bool
    USE_UE8M0: bool
    PACK_UE8M0: bool
    DO_SEND: bool
    DO_RECV: bool
    USE_CLOCK: bool
    BLOCK_N: int
    COUNT_BY_ADDS: bool
    ONE_TOKEN: bool
    BLOCK_K: int
    BLOCK_SCALES: int
    BLOCK_RANKS: int
    BINS: int
    BLOCK_MSGS: int
    BLOCK_ITEMS: int
    PROFILE: bool
    WAIT_STATS: bool
    RECV_STATS: bool
    SHRINK: bool
    VIA: int


@triton.jit
def first_choices(ids, ks, K: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Which of ``[T, BLOCK_K]`` top-k ids get a message: ids of an expert that no earlier
    column of the same row names (a token that names an expert twice is sent once)."""
    valid = (ids >= 0) & (ids < NUM_EXPERTS) & (ks[None, :] < K)
    for j in tl.static_range(K - 1):
        column = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
        valid = valid & ~((ids == column[:, None]) & (ks[None, :] > j))
    return valid


@triton.jit
def _listed(
    m,
    starts,
    ends,
    begin,
    local,
    src,
    item_lanes,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
):
    """Where positions ``m`` of a group's message list lie. The list holds the messages of the
    group's items (``local`` expert, ``src`` rank) one item after another, item ``j``'s from
    ``starts[j]`` to ``ends[j]``. Returns each position's message index in the buffer set
    (``[local expert][source rank][slot]``), its output row within its expert's block (its
    item's ``begin`` + slot) and its local expert."""
    at = tl.sum((m[:, None] >= ends[None, :]).to(tl.int32), axis=1)[:, None] == item_lanes[None, :]
    slot = m - tl.sum(tl.where(at, starts[None, :], 0), axis=1)
    m_local = tl.sum(tl.where(at, local[None, :], 0), axis=1)
    m_src = tl.sum(tl.where(at, src[None, :], 0), axis=1)
    row = tl.sum(tl.where(at, begin[None, :], 0), axis=1) + slot
    return (m_local * NUM_RANKS + m_src) * MAX_TOKENS + slot, row, m_local


@triton.jit(do_not_specialize=["num_tokens", "timeout_us"])
def ll_dispatch_kernel(
    # What changes from call to call (DispatchCall).
    x_ptr,  # [N, H] bf16 tokens
    topk_idx_ptr,  # [N, K] int64 global expert ids, -1 for none
    num_tokens,  # N
    out_x_ptr,  # [E_local, R * MAX_TOKENS, H] bf16, or e4m3 (USE_FP8)
    out_scales_ptr,  # [E_local, G, R * MAX_TOKENS] float32,
    # or [E_local, G / 4, R * MAX_TOKENS] int32 (PACK_UE8M0)
    out_src_ptr,  # [2, E_local, R * MAX_TOKENS] int32: each row's source token, then top-k column
    out_count_ptr,  # [E_local] int32 rows of each local expert
    out_range_ptr,  # [E_local, R] int64 begin << 32 | count of each source rank's block
    recv_stats_ptr,  # [E_local] int32 each expert's rows are added to it (RECV_STATS)
    wait_stats_ptr,  # [R] int64 time spent waiting for each source rank (WAIT_STATS)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE), or the clock of WAIT_STATS
    # What stays from call to call (LowLatencyShared).
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [STATE_ROWS, P] int64 call counters per program (and shrink's arrivals)
    scratch_ptr,  # [P, 3 * BINS + TOKEN_WORDS] int32 per-program slot counters and lists
    expert_done_ptr,  # [BINS] int32 messages stored per expert in this launch, zero between
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    mask_ptr,  # [R] int32 masked peers (SHRINK)
    verdict_ptr,  # [2, R] int64 this launch's verdict on each source rank, row 0 (SHRINK)
    skipped_ptr,  # [R] int64 (the combine's; unused here)
    H: tl.constexpr,  # hidden size
    K: tl.constexpr,  # top-k
    NUM_EXPERTS: tl.constexpr,  # experts in all
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    MAX_TOKENS: tl.constexpr,  # max tokens per rank
    MSG_BYTES: tl.constexpr,  # a message: header, payload, scales
    RECV_SET_BYTES: tl.constexpr,  # a buffer set of the receive slabs
    FLAG_SET_BYTES: tl.constexpr,  # a buffer set of the count flags
    RECV_OFFSET: tl.constexpr,  # heap byte offset of buffer set 0 of the receive slabs
    FLAG_OFFSET: tl.constexpr,  # heap byte offset of buffer set 0 of the count flags
    STAGE_OFFSET: tl.constexpr,  # heap byte offset of the staging slabs [E][MAX_TOKENS] (VIA)
    GPUS_PER_NODE: tl.constexpr,  # ranks r, r' share a node when r // it == r' // it
    USE_FP8: tl.constexpr,  # quantize to e4m3 with a float32 scale per (partial) 128 channels
    USE_UE8M0: tl.constexpr,  # scales rounded up to powers of two
    PACK_UE8M0: tl.constexpr,  # scales as exponent bytes, four to an int32 (implies USE_UE8M0)
    DO_SEND: tl.constexpr,  # run the send phase
    DO_RECV: tl.constexpr,  # run the receive phase
    USE_CLOCK: tl.constexpr,  # on a GPU (else the interpreter)
    BLOCK_N: tl.constexpr,  # tokens whose ids are counted at a time
    COUNT_BY_ADDS: tl.constexpr,  # senders count the ids by atomic adds, else by histograms
    ONE_TOKEN: tl.constexpr,  # num_tokens == 1, known when compiling
    BLOCK_K: tl.constexpr,  # power of two >= max(K, 2)
    BLOCK_SCALES: tl.constexpr,  # power of two >= ceil(H / 128)
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BINS: tl.constexpr,  # power of two >= max(NUM_EXPERTS, 2): one bin per expert
    BLOCK_MSGS: tl.constexpr,  # messages a receiving program copies at a time
    BLOCK_ITEMS: tl.constexpr,  # (expert, source) items a receiving program moves together
    PROFILE: tl.constexpr,  # record traces
    WAIT_STATS: tl.constexpr,  # add the time waited per source rank to wait_stats_ptr
    RECV_STATS: tl.constexpr,  # add the rows per expert to recv_stats_ptr
    SHRINK: tl.constexpr,  # masked peers are skipped, timeouts mask (peer_mask)
    VIA: tl.constexpr,  # how staged blocks reach other nodes (transport)
):
    c_send = call_number(state_ptr, DISPATCH_SEND_CALLS)
    c_recv = call_number(state_ptr, DISPATCH_RECV_CALLS)
    # Trace: sub-phase totals (quantize and send, count send, wait, pack).
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    t_send_end = t_start
    t_quantize_send = tl.zeros((), tl.int64)
    t_count_send = tl.zeros((), tl.int64)
    t_wait = tl.zeros((), tl.int64)
    t_pack = tl.zeros((), tl.int64)
    if DO_SEND:
        # One token: a send whose loops and masks fold away with the count known when
        # compiling is 0.6 us faster (8.1 against 8.8 us on one H100, BENCHMARKS.md).
        if ONE_TOKEN:
            num_tokens = 1
        t_quantize_send, t_count_send, t_send_end = _send(
            x_ptr,
            topk_idx_ptr,
            num_tokens,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            c_send,
            scratch_ptr,
            expert_done_ptr,
            status_ptr,
            mask_ptr,
            H,
            K,
            NUM_EXPERTS,
            NUM_RANKS,
            MAX_TOKENS,
            MSG_BYTES,
            RECV_SET_BYTES,
            FLAG_SET_BYTES,
            RECV_OFFSET,
            FLAG_OFFSET,
            STAGE_OFFSET,
            GPUS_PER_NODE,
            USE_FP8,
            USE_UE8M0,
            USE_CLOCK,
            BLOCK_N,
            BLOCK_K,
            BLOCK_SCALES,
            BINS,
            PROFILE,
            SHRINK,
            VIA,
            COUNT_BY_ADDS,
        )
    if DO_RECV:
        t_wait, t_pack = _receive(
            c_recv,
            out_x_ptr,
            out_scales_ptr,
            out_src_ptr,
            out_count_ptr,
            out_range_ptr,
            recv_stats_ptr,
            wait_stats_ptr,
            trace_ptr,
            peer_ptrs,
            rank,
            status_ptr,
            timeout_us,
            mask_ptr,
            verdict_ptr,
            H,
            NUM_EXPERTS,
            NUM_RANKS,
            MAX_TOKENS,
            MSG_BYTES,
            RECV_SET_BYTES,
            FLAG_SET_BYTES,
            RECV_OFFSET,
            FLAG_OFFSET,
            PACK_UE8M0,
            USE_FP8,
            USE_CLOCK,
            BLOCK_SCALES,
            BLOCK_RANKS,
            BLOCK_MSGS,
            BLOCK_ITEMS,
            PROFILE,
            WAIT_STATS,
            RECV_STATS,
            SHRINK,
        )
    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(
            trace_ptr,
            t_start,
            t_send_end,
            t_end,
            t_quantize_send,
            t_count_send,
            t_wait,
            t_pack,
            0,
            USE_CLOCK,
        )
    last = finish_launch(
        state_ptr,
        DISPATCH_ARRIVALS,
        DISPATCH_SEND_CALLS,
        DISPATCH_RECV_CALLS,
        c_send,
        c_recv,
        DO_SEND,
        DO_RECV,
        SHRINK and DO_RECV,
    )
    if SHRINK and DO_RECV:  # noqa: SIM102 - compiled out without SHRINK
        if last:
            mask_timed_out(mask_ptr, verdict_ptr, verdict_ptr, c_recv + 1, NUM_RANKS, False)


@triton.jit
def _send(
    x_ptr,
    topk_idx_ptr,
    num_tokens,
    trace_ptr,
    peer_ptrs,
    pe_ptr,
    rank,
    c_send,
    scratch_ptr,
    expert_done_ptr,
    status_ptr,
    mask_ptr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    MSG_BYTES: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    FLAG_SET_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    GPUS_PER_NODE: tl.constexpr,
    USE_FP8: tl.constexpr,
    USE_UE8M0: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BINS: tl.constexpr,
    PROFILE: tl.constexpr,
    SHRINK: tl.constexpr,
    VIA: tl.constexpr,
    COUNT_BY_ADDS: tl.constexpr,
):
    """The send phase of this program: count the batch's ids, store its tokens' messages,
    publish the counts it completes. Returns the trace's (quantize and send, count send)
    totals and the send phase's end."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    set_off = (c_send % 2) * RECV_SET_BYTES
    t0 = tl.zeros((), tl.int64)
    if PROFILE:
        t0 = read_clock(trace_ptr, USE_CLOCK)
    # This program's tokens: a contiguous run, so that slots follow token order.
    per_program = tl.cdiv(num_tokens, num_programs)
    first_token = tl.minimum(pid * per_program, num_tokens)
    last_token = tl.minimum(first_token + per_program, num_tokens)
    senders = tl.maximum(tl.cdiv(num_tokens, tl.maximum(per_program, 1)), 1)
    next_slot = scratch_ptr + pid * (3 * BINS + TOKEN_WORDS)
    # The first token's row is loaded now, so that its memory latency passes while the ids are
    # counted; each token's send then loads the next one's. (A tile compare, not `mask &
    # scalar`: Triton 3.9's interpreter splats a scalar comparison as int32, which no mask
    # accepts.)
    groups = tl.arange(0, BLOCK_SCALES)
    row_offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    x_next = tl.load(
        x_ptr + tl.cast(first_token, tl.int64) * H + row_offs,
        mask=row_offs < tl.where(first_token < last_token, H, 0),
        other=0.0,
    )
    if COUNT_BY_ADDS:
        total, before, bad = _count_by_adds(
            topk_idx_ptr,
            tl.where(pid < senders, num_tokens, 0),
            first_token,
            next_slot,
            mask_ptr,
            K,
            NUM_EXPERTS,
            NUM_RANKS,
            BLOCK_N,
            BLOCK_K,
            BINS,
            SHRINK,
        )
    else:
        total, before, bad = _count_by_histograms(
            topk_idx_ptr,
            tl.where(pid < senders, num_tokens, 0),
            first_token,
            mask_ptr,
            K,
            NUM_EXPERTS,
            NUM_RANKS,
            BLOCK_N,
            BLOCK_K,
            BINS,
            SHRINK,
        )
    # An id outside [-1, NUM_EXPERTS): every counting program saw it, program 0 records it.
    if bad & (pid == 0):
        token, column, bad_id = first_bad_id(
            topk_idx_ptr, num_tokens, K, NUM_EXPERTS, BLOCK_K, BLOCK_N
        )
        record_bad_id(status_ptr, rank, LL_DISPATCH_IDS, token, column, bad_id)
    # next_slot[e]: the slot of this program's next token for expert e.
    tl.store(next_slot + tl.arange(0, BINS), before)
    tl.debug_barrier()
    _send_tokens(
        x_ptr,
        topk_idx_ptr,
        x_next,
        first_token,
        last_token,
        next_slot,
        peer_ptrs,
        rank,
        set_off,
        mask_ptr,
        H,
        K,
        NUM_EXPERTS,
        NUM_RANKS,
        MAX_TOKENS,
        MSG_BYTES,
        RECV_OFFSET,
        STAGE_OFFSET,
        GPUS_PER_NODE,
        USE_FP8,
        USE_UE8M0,
        USE_CLOCK,
        BLOCK_K,
        BLOCK_SCALES,
        BINS,
        SHRINK,
        VIA,
    )
    t1 = t0
    if PROFILE:
        t1 = read_clock(trace_ptr, USE_CLOCK)
    _publish_counts(
        total,
        before,
        next_slot,
        senders,
        c_send,
        expert_done_ptr,
        peer_ptrs,
        pe_ptr,
        rank,
        mask_ptr,
        NUM_EXPERTS,
        NUM_RANKS,
        MAX_TOKENS,
        MSG_BYTES,
        RECV_SET_BYTES,
        FLAG_SET_BYTES,
        RECV_OFFSET,
        FLAG_OFFSET,
        STAGE_OFFSET,
        GPUS_PER_NODE,
        BINS,
        SHRINK,
        VIA,
    )
    tl.debug_barrier()
    t_end = t0
    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
    return t1 - t0, t_end - t1, t_end


@triton.jit
def _batch_ids(
    topk_idx_ptr,
    start,
    num_tokens,
    first_token,
    mask_ptr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHRINK: tl.constexpr,
):
    """A block of the batch's ids: ``[BLOCK_N, BLOCK_K]`` ids, which of them get a message,
    which belong to tokens before ``first_token``, and which lie outside ``[-1, NUM_EXPERTS)``."""
    ks = tl.arange(0, BLOCK_K)
    tokens = start + tl.arange(0, BLOCK_N)
    ids = tl.load(
        topk_idx_ptr + tokens[:, None].to(tl.int64) * K + ks[None, :],
        mask=(tokens[:, None] < num_tokens) & (ks[None, :] < K),
        other=-1,
    )
    chosen = first_choices(ids, ks, K, NUM_EXPERTS)
    if SHRINK:
        chosen = chosen & ~masked(mask_ptr, ids // E_LOCAL, chosen)
    earlier = chosen & (tokens[:, None] < first_token)
    bad = (ids < -1) | (ids >= NUM_EXPERTS)
    return ids, chosen, earlier, bad


@triton.jit
def _count_by_adds(
    topk_idx_ptr,
    num_tokens,
    first_token,
    next_slot,
    mask_ptr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BINS: tl.constexpr,
    SHRINK: tl.constexpr,
):
    """Tokens per expert of the first ``num_tokens`` of the batch and of those before
    ``first_token``: one atomic add per chosen id into this program's scratch row (the batch's
    count in the low word of ``tally[e]``, the earlier tokens' in the high word), as many adds
    as ids. Cheaper than histograms for few ids (decode batches of up to a few dozen tokens
    at top-8), dearer for a few hundred tokens. Ids outside ``[-1, NUM_EXPERTS)`` add to
    ``tally[BINS]`` in the same instruction. Returns ``(total, before, bad)``."""
    experts = tl.arange(0, BINS)
    tally = next_slot.to(tl.pointer_type(tl.int64))
    tl.store(tally + experts, tl.zeros((BINS,), tl.int64))
    tl.store(tally + BINS, 0)
    tl.debug_barrier()
    for start in range(0, num_tokens, BLOCK_N):
        ids, chosen, earlier, bad = _batch_ids(
            topk_idx_ptr,
            start,
            num_tokens,
            first_token,
            mask_ptr,
            K,
            NUM_EXPERTS,
            NUM_EXPERTS // NUM_RANKS,
            BLOCK_N,
            BLOCK_K,
            SHRINK,
        )
        tl.atomic_add(
            tally + tl.where(chosen, ids, BINS),
            tl.where(earlier, (1 << 32) + 1, 1),
            mask=chosen | bad,
            sem="relaxed",
            scope="cta",
        )
    tl.debug_barrier()  # (the load waits for the adds: a round trip to the L2)
    tallied = tl.load(tally + experts, cache_modifier=".cg")
    bad = tl.load(tally + BINS, cache_modifier=".cg") != 0
    tl.debug_barrier()
    return tallied.to(tl.int32), (tallied >> 32).to(tl.int32), bad


@triton.jit
def _count_by_histograms(
    topk_idx_ptr,
    num_tokens,
    first_token,
    mask_ptr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BINS: tl.constexpr,
    SHRINK: tl.constexpr,
):
    """:func:`_count_by_adds` by two histograms per block of ids, whose cost (~0.9 us each for
    256 bins) does not grow with the ids but which all programs' adds together exceed beyond
    ~32K adds. Returns ``(total, before, bad)``."""
    total = tl.zeros((BINS,), tl.int32)
    before = tl.zeros((BINS,), tl.int32)
    seen = tl.zeros((BLOCK_N, BLOCK_K), tl.int1)
    for start in range(0, num_tokens, BLOCK_N):
        ids, chosen, earlier, bad = _batch_ids(
            topk_idx_ptr,
            start,
            num_tokens,
            first_token,
            mask_ptr,
            K,
            NUM_EXPERTS,
            NUM_EXPERTS // NUM_RANKS,
            BLOCK_N,
            BLOCK_K,
            SHRINK,
        )
        binned = tl.reshape(tl.where(chosen, ids, 0).to(tl.int32), (BLOCK_N * BLOCK_K,))
        total += tl.histogram(binned, BINS, mask=tl.reshape(chosen, (BLOCK_N * BLOCK_K,)))
        before += tl.histogram(binned, BINS, mask=tl.reshape(earlier, (BLOCK_N * BLOCK_K,)))
        seen = seen | bad
    return total, before, any_set(seen)


@triton.jit
def _send_tokens(
    x_ptr,
    topk_idx_ptr,
    x_next,
    first_token,
    last_token,
    next_slot,
    peer_ptrs,
    rank,
    set_off,
    mask_ptr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    MSG_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    GPUS_PER_NODE: tl.constexpr,
    USE_FP8: tl.constexpr,
    USE_UE8M0: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BINS: tl.constexpr,
    SHRINK: tl.constexpr,
    VIA: tl.constexpr,
):
    """Store the messages of tokens ``[first_token, last_token)``: per token, load the row once
    (``x_next`` holds the first), quantize it once, and store one message per distinct expert
    into its owner's slab (or this rank's staging slab) at the expert's next slot."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    ks = tl.arange(0, BLOCK_K)
    groups = tl.arange(0, BLOCK_SCALES)
    gmask = groups < (H + 127) // 128  # the last group may be partial
    # A message's scales start at the first 16-byte boundary after its e4m3 payload (aligned
    # stores whatever H is; modes.low_latency.message_bytes).
    SCALES_AT: tl.constexpr = HEADER_BYTES + (H + 15) // 16 * 16
    row_offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    row_mask = row_offs < H  # (a partial group's missing channels load as zeros)
    my_base = tl.load(peer_ptrs + rank)
    dests = (next_slot + 3 * BINS).to(tl.pointer_type(tl.int64))
    keys = next_slot + 3 * BINS + 32
    indexes = keys + 16
    refs = indexes + 16
    # A token's columns as a [column k, column j] tile, for finding each column's payload.
    col_k = ks[:, None] + 0 * ks[None, :]
    col_j = ks[None, :] + 0 * ks[:, None]
    for token in range(first_token, last_token):
        ids = tl.load(topk_idx_ptr + tl.cast(token, tl.int64) * K + ks, mask=ks < K, other=-1)
        valid = tl.reshape(first_choices(ids[None, :], ks, K, NUM_EXPERTS), (BLOCK_K,))
        if SHRINK:
            valid = valid & ~masked(mask_ptr, ids // E_LOCAL, valid)
        ids = tl.where(valid, ids, 0).to(tl.int32)
        slots = tl.load(next_slot + ids, mask=valid, other=0)
        tl.debug_barrier()
        tl.store(next_slot + ids, slots + 1, mask=valid)
        # Quantize the token once, then store it to each of its experts.
        x = x_next
        # (A tile compare, not `row_mask & scalar`: Triton 3.9's interpreter splats a scalar
        # comparison as int32, which no mask accepts.)
        x_next = tl.load(
            x_ptr + tl.cast(token + 1, tl.int64) * H + row_offs,
            mask=row_offs < tl.where(token + 1 < last_token, H, 0),
            other=0.0,
        )
        if USE_FP8:
            q, scale = quantize_groups(from_bf16(x, not USE_CLOCK), USE_UE8M0, not USE_CLOCK)
            q = e4m3_bits(q, not USE_CLOCK)
        # Where each message goes, computed for all columns at once; then one message per
        # column, its address read back (scalar loads, no cross-warp reductions).
        owners = ids // E_LOCAL
        msgs = tl.load(peer_ptrs + owners, mask=valid, other=0) + RECV_OFFSET + set_off
        msgs += (((ids % E_LOCAL) * NUM_RANKS + rank) * MAX_TOKENS).to(tl.int64) * MSG_BYTES
        if VIA != VIA_STORE:
            # An owner on another node: the message goes to this rank's staging slab, whose
            # block of the expert is put there once the block is complete.
            far = (owners // GPUS_PER_NODE) != (rank // GPUS_PER_NODE)
            staged = my_base + STAGE_OFFSET + ids.to(tl.int64) * (MAX_TOKENS * MSG_BYTES)
            msgs = tl.where(far, staged, msgs)
        msgs += slots.to(tl.int64) * MSG_BYTES
        tl.store(dests + ks, tl.where(valid, msgs, 0), mask=ks < K)
        # The payload crosses to an owner once: the first column of each owner reached by
        # stores carries it, the owner's other columns only a header that names that message
        # (index in the owner's buffer set). Staged messages all carry it. The [column,
        # earlier column] tile is read back from the scratch row: built from the vectors in
        # registers it takes two layout changes, which cost more.
        key = tl.where(valid, owners, -1)
        if VIA != VIA_STORE:
            key = tl.where(far, -1, key)
        tl.store(keys + ks, key)
        tl.store(indexes + ks, ((ids % E_LOCAL) * NUM_RANKS + rank) * MAX_TOKENS + slots)
        tl.debug_barrier()
        key_k = tl.load(keys + col_k)
        same = ((tl.load(keys + col_j) == key_k) & (key_k >= 0)) | (col_j == col_k)
        first = tl.min(tl.where(same, col_j, BLOCK_K), axis=1)
        ref = tl.sum(tl.where(col_j == first[:, None], tl.load(indexes + col_j), 0), axis=1)
        # -ref - 1 marks a header-only message.
        tl.store(refs + ks, tl.where(first == ks, ref, -ref - 1))
        tl.debug_barrier()
        for k in tl.static_range(K):
            msg = tl.load(dests + k)
            ref = tl.load(refs + k)
            if msg != 0:
                header = aligned_ptr(msg, tl.int32)
                tl.store(header, token)
                tl.store(header + 1, k)
                tl.store(header + 2, tl.where(ref >= 0, ref, -ref - 1))
            if (msg != 0) & (ref >= 0):
                if USE_FP8:
                    # (fields at offsets from the hinted message address: sync.aligned_ptr)
                    q_ptr = aligned_ptr(msg, tl.uint8) + HEADER_BYTES
                    tl.store(q_ptr + row_offs, q, mask=row_mask)
                    scale_ptr = aligned_ptr(msg, tl.float32) + SCALES_AT // 4
                    tl.store(scale_ptr + groups, scale, mask=gmask)
                else:
                    x_dst = aligned_ptr(msg, tl.bfloat16) + HEADER_BYTES // 2
                    tl.store(x_dst + row_offs, x, mask=row_mask)
        tl.debug_barrier()


@triton.jit
def _publish_counts(
    total,
    before,
    next_slot,
    senders,
    c_send,
    expert_done_ptr,
    peer_ptrs,
    pe_ptr,
    rank,
    mask_ptr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    MSG_BYTES: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    FLAG_SET_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    GPUS_PER_NODE: tl.constexpr,
    BINS: tl.constexpr,
    SHRINK: tl.constexpr,
    VIA: tl.constexpr,
):
    """Count this program's messages as stored. The program whose add completes an expert
    (brings its count to the total) publishes the count; program ``e % senders`` publishes
    the zero count of an expert that no token chose. Nothing waits here. The counters are this
    GPU's, so GPU scope suffices: release/acquire orderings compose, and the publisher's
    system-scope release then orders every program's messages before the count for the owner
    (a system-scope add here costs ~0.6 us more per launch)."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    pid = tl.program_id(0)
    experts = tl.arange(0, BINS)
    set_off = (c_send % 2) * RECV_SET_BYTES
    flag_set_off = (c_send % 2) * FLAG_SET_BYTES
    expert_owners = experts // E_LOCAL
    owner_bases = tl.load(peer_ptrs + expert_owners, mask=experts < NUM_EXPERTS, other=0)
    mine = tl.load(next_slot + experts) - before
    tl.debug_barrier()
    done = tl.atomic_add(expert_done_ptr + experts, mine, mask=mine > 0, sem="acq_rel", scope="gpu")
    completed = (mine > 0) & (done + mine == total)
    tl.store(expert_done_ptr + experts, 0, mask=completed)  # ready for the next call
    publish = completed | ((total == 0) & (experts % senders == pid) & (experts < NUM_EXPERTS))
    if SHRINK:  # experts of masked peers are chosen by no token: no message, no count
        publish = publish & ~masked(mask_ptr, expert_owners, experts < NUM_EXPERTS)
    flags = FLAG_OFFSET + flag_set_off + ((experts % E_LOCAL) * NUM_RANKS + rank) * 8
    values = ((c_send + 1) << 32) | total.to(tl.int64)
    nearby = publish
    if VIA != VIA_STORE:
        nearby = publish & ((expert_owners // GPUS_PER_NODE) == (rank // GPUS_PER_NODE))
    peer_base = tl.where(nearby, owner_bases, 0)
    tl.debug_barrier()
    tl.atomic_xchg(
        (peer_base + flags).to(tl.pointer_type(tl.int64)),
        values,
        mask=nearby,
        sem="release",
        scope="sys",
    )
    if VIA != VIA_STORE:
        # Experts on other nodes: one put of the staged block each, the count its signal.
        my_base = tl.load(peer_ptrs + rank)
        far = (publish & ~nearby).to(tl.int32)
        listed = tl.cumsum(far, axis=0) - far
        far_experts = next_slot + BINS
        far_totals = far_experts + BINS
        tl.store(far_experts + listed, experts, mask=far > 0)
        tl.store(far_totals + listed, total, mask=far > 0)
        tl.debug_barrier()
        for i in range(tl.sum(far, axis=0)):
            expert = tl.load(far_experts + i)
            count = tl.load(far_totals + i)
            owner = expert // E_LOCAL
            local = expert % E_LOCAL
            put_block_signal(
                my_base,
                tl.load(peer_ptrs + owner),
                RECV_OFFSET + set_off + ((local * NUM_RANKS + rank) * MAX_TOKENS) * MSG_BYTES,
                my_base + STAGE_OFFSET + expert.to(tl.int64) * (MAX_TOKENS * MSG_BYTES),
                count.to(tl.int64) * MSG_BYTES,
                FLAG_OFFSET + flag_set_off + (local * NUM_RANKS + rank) * 8,
                ((c_send + 1) << 32) | count.to(tl.int64),
                SIGNAL_SET,
                tl.load(pe_ptr + owner),
                VIA,
            )


@triton.jit
def _receive(
    c_recv,
    out_x_ptr,
    out_scales_ptr,
    out_src_ptr,
    out_count_ptr,
    out_range_ptr,
    recv_stats_ptr,
    wait_stats_ptr,
    trace_ptr,
    peer_ptrs,
    rank,
    status_ptr,
    timeout_us,
    mask_ptr,
    verdict_ptr,
    H: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    MSG_BYTES: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    FLAG_SET_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    PACK_UE8M0: tl.constexpr,
    USE_FP8: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_MSGS: tl.constexpr,
    BLOCK_ITEMS: tl.constexpr,
    PROFILE: tl.constexpr,
    WAIT_STATS: tl.constexpr,
    RECV_STATS: tl.constexpr,
    SHRINK: tl.constexpr,
):
    """The receive phase of this program. Work items are (local expert, source rank) pairs; a
    block starts after the blocks of the earlier sources, whose counts it reads from their
    flags (in source-rank order, so the output is deterministic and matches the reference).
    A program takes its items ``BLOCK_ITEMS`` at a time and moves them as one: one wait for
    all their counts, then their messages together, so the dependent reads (counts, headers,
    payloads) are paid once per group rather than once per item. Returns the trace's (wait,
    pack) totals."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    set_off = (c_recv % 2) * RECV_SET_BYTES
    flag_set_off = (c_recv % 2) * FLAG_SET_BYTES
    my_base = tl.load(peer_ptrs + rank)
    set_base = my_base + RECV_OFFSET + set_off
    item_lanes = tl.arange(0, BLOCK_ITEMS)
    # After one wait gives up, the program's later waits give up at once, so a launch ends
    # within about one timeout however many waits it has.
    budget = timeout_us.to(tl.int64) * 1000
    t_wait = tl.zeros((), tl.int64)
    t_pack = tl.zeros((), tl.int64)
    for group in range(0, tl.cdiv(E_LOCAL * NUM_RANKS, num_programs), BLOCK_ITEMS):
        items = pid + (group + item_lanes) * num_programs
        live = items < E_LOCAL * NUM_RANKS
        local = tl.where(live, items // NUM_RANKS, 0)
        me_src = tl.where(live, items % NUM_RANKS, 0)
        t0 = t_wait
        if PROFILE:
            t0 = read_clock(trace_ptr, USE_CLOCK)
        flag_rows = my_base + FLAG_OFFSET + flag_set_off + local * NUM_RANKS * 8
        if SHRINK:  # shrink mode settles each source's outcome with the other programs
            begin, count = _wait_settled(
                flag_rows,
                live,
                me_src,
                item_lanes,
                c_recv,
                wait_stats_ptr,
                trace_ptr,
                status_ptr,
                timeout_us,
                mask_ptr,
                verdict_ptr,
                USE_CLOCK,
                BLOCK_ITEMS,
                WAIT_STATS,
            )
            gave_up = False
            own_missing = tl.zeros((BLOCK_ITEMS,), tl.int1)
        else:
            begin, count, own_missing, gave_up, budget = _wait_counts(
                flag_rows,
                live,
                local,
                me_src,
                item_lanes,
                c_recv,
                budget,
                wait_stats_ptr,
                trace_ptr,
                status_ptr,
                timeout_us,
                USE_CLOCK,
                BLOCK_RANKS,
                BLOCK_ITEMS,
                WAIT_STATS,
            )
        t1 = t0
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
            t_wait += t1 - t0
        count = tl.where(live, count, 0)
        # A missing source's block is one poison row: no messages to move.
        moved = tl.where(own_missing, 0, count)
        _pack_group(
            set_base,
            begin,
            moved,
            local,
            me_src,
            item_lanes,
            out_x_ptr,
            out_scales_ptr,
            out_src_ptr,
            H,
            NUM_RANKS * E_LOCAL,
            NUM_RANKS,
            MAX_TOKENS,
            MSG_BYTES,
            PACK_UE8M0,
            USE_FP8,
            BLOCK_SCALES,
            BLOCK_MSGS,
            BLOCK_ITEMS,
        )
        if gave_up:
            _poison_rows(
                begin,
                own_missing & live,
                local,
                item_lanes,
                out_x_ptr,
                out_scales_ptr,
                out_src_ptr,
                H,
                E_LOCAL,
                NUM_RANKS,
                MAX_TOKENS,
                PACK_UE8M0,
                USE_FP8,
                BLOCK_SCALES,
                BLOCK_ITEMS,
            )
        packed = (begin.to(tl.int64) << 32) | moved
        tl.store(out_range_ptr + local * NUM_RANKS + me_src, packed, mask=live)
        last_source = live & (me_src == NUM_RANKS - 1)
        tl.store(out_count_ptr + local, begin + count, mask=last_source)
        if RECV_STATS:
            tl.atomic_add(
                recv_stats_ptr + local, begin + count, mask=last_source, sem="relaxed", scope="gpu"
            )
        if PROFILE:
            t_pack += read_clock(trace_ptr, USE_CLOCK) - t1
    return t_wait, t_pack


@triton.jit
def _wait_counts(
    flag_rows,
    live,
    local,
    me_src,
    item_lanes,
    c_recv,
    budget,
    wait_stats_ptr,
    trace_ptr,
    status_ptr,
    timeout_us,
    USE_CLOCK: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_ITEMS: tl.constexpr,
    WAIT_STATS: tl.constexpr,
):
    """Every count a group of items needs in one vector read, usually all there; else the
    read repeats (bounded) until they are. Returns each item's ``begin`` and ``count``, which
    items' own source gave up (``own_missing``), whether any wait gave up, and the budget
    left. A source that gave up counts as one (poison) row, so that every later block keeps
    its place and the poisoned one stands out."""
    sources = tl.arange(0, BLOCK_RANKS)
    wanted = live[:, None] & (sources[None, :] <= me_src[:, None])
    count_flags = (flag_rows[:, None] + sources[None, :] * 8).to(tl.pointer_type(tl.int64))
    tagged, missing, waited, limit = wait_tile(
        count_flags,
        wanted,
        c_recv + 1,
        budget,
        timeout_us,
        status_ptr,
        USE_CLOCK,
        SHIFT=32,
        TIMED=WAIT_STATS,
    )
    if WAIT_STATS:  # the time until each source's counts were all there
        tl.atomic_add(
            wait_stats_ptr + sources,
            tl.max(waited, axis=0),
            mask=tl.max(wanted.to(tl.int32), axis=0) > 0,
            sem="relaxed",
            scope="gpu",
        )
    counts = tl.where(wanted & ~missing, (tagged & 0xFFFFFFFF).to(tl.int32), 0)
    own_missing = tl.zeros((BLOCK_ITEMS,), tl.int1)
    gave_up = any_set(missing)
    if gave_up:
        # Name the first (item, source) still missing.
        lanes = item_lanes[:, None] * BLOCK_RANKS + sources[None, :]
        gone = tl.min(tl.min(tl.where(missing, lanes, BLOCK_ITEMS * BLOCK_RANKS), axis=1), 0)
        record_timeout(
            status_ptr,
            gone % BLOCK_RANKS,
            LL_DISPATCH_RECV,
            limit,
            lane(local, item_lanes, gone // BLOCK_RANKS),
        )
        budget = budget * 0
        counts = tl.where(missing, 1, counts)
        own = (sources[None, :] == me_src[:, None]) & missing
        own_missing = tl.sum(own.to(tl.int32), axis=1) > 0
    begin = tl.sum(tl.where(sources[None, :] < me_src[:, None], counts, 0), axis=1)
    count = tl.sum(tl.where(sources[None, :] == me_src[:, None], counts, 0), axis=1)
    return begin, count, own_missing, gave_up, budget


@triton.jit
def _wait_settled(
    flag_rows,
    live,
    me_src,
    item_lanes,
    c_recv,
    wait_stats_ptr,
    trace_ptr,
    status_ptr,
    timeout_us,
    mask_ptr,
    verdict_ptr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ITEMS: tl.constexpr,
    WAIT_STATS: tl.constexpr,
):
    """:func:`_wait_counts` in shrink mode: each source's outcome is settled with the other
    programs, and a source given up on contributes nothing (it is masked at the end)."""
    begin = tl.zeros((BLOCK_ITEMS,), tl.int32)
    count = tl.zeros((BLOCK_ITEMS,), tl.int32)
    for j in tl.static_range(BLOCK_ITEMS):
        item_begin = tl.zeros((), tl.int32)
        item_count = tl.zeros((), tl.int32)
        item_live = lane(live.to(tl.int32), item_lanes, j) != 0
        item_src = tl.where(item_live, lane(me_src, item_lanes, j), -1)
        item_row = lane(flag_rows, item_lanes, j)
        for src in range(0, item_src + 1):
            timeout_ns = limit_ns(timeout_us, status_ptr)
            flag = (item_row + src * 8).to(tl.pointer_type(tl.int64))
            w0 = tl.zeros((), tl.int64)
            if WAIT_STATS:
                w0 = read_clock(trace_ptr, USE_CLOCK)
            value, ok = wait_peer(
                flag,
                c_recv + 1,
                timeout_ns,
                tl.load(mask_ptr + src) != 0,
                verdict_ptr + src,
                c_recv + 1,
                USE_CLOCK,
                SHIFT=32,
            )
            if WAIT_STATS:
                waited = read_clock(trace_ptr, USE_CLOCK) - w0
                tl.atomic_add(wait_stats_ptr + src, waited, sem="relaxed", scope="gpu")
            item_begin += item_count
            item_count = tl.where(ok, (value & 0xFFFFFFFF).to(tl.int32), 0)
        begin = tl.where(item_lanes == j, item_begin, begin)
        count = tl.where(item_lanes == j, item_count, count)
    return begin, count


@triton.jit
def _pack_group(
    set_base,
    begin,
    count,
    local,
    me_src,
    item_lanes,
    out_x_ptr,
    out_scales_ptr,
    out_src_ptr,
    H: tl.constexpr,
    ITEMS_TOTAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    MSG_BYTES: tl.constexpr,
    PACK_UE8M0: tl.constexpr,
    USE_FP8: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_MSGS: tl.constexpr,
    BLOCK_ITEMS: tl.constexpr,
):
    """Copy a group's messages, ``BLOCK_MSGS`` at a time, into the packed outputs: item ``j``'s
    ``count[j]`` messages to rows ``begin[j]...`` of its expert's block. The group's messages
    form one list: item j's come after those of items < j."""
    G: tl.constexpr = (H + 127) // 128
    SCALES_AT: tl.constexpr = HEADER_BYTES + (H + 15) // 16 * 16
    msgs = tl.arange(0, BLOCK_MSGS)
    scale_lanes = tl.arange(0, BLOCK_SCALES * BLOCK_MSGS)
    flat = tl.arange(0, BLOCK_SCALES * 128)
    flat_mask = flat < H
    out_slot_ptr = (
        out_src_ptr + ITEMS_TOTAL * MAX_TOKENS
    )  # the second half of [2, E_local, R * MAX_TOKENS]
    ends = tl.cumsum(count, axis=0)
    starts = ends - count
    group_msgs = tl.sum(count, axis=0)
    for first in range(0, group_msgs, BLOCK_MSGS):
        m = first + msgs
        mmask = m < group_msgs
        index, row_in, m_local = _listed(
            m, starts, ends, begin, local, me_src, item_lanes, NUM_RANKS, MAX_TOKENS
        )
        msg = set_base + index.to(tl.int64) * MSG_BYTES
        rows = (m_local * NUM_RANKS * MAX_TOKENS + row_in).to(tl.int64)
        header = aligned_ptr(msg, tl.int32)
        source_token = tl.load(header, mask=mmask, cache_modifier=".cg")
        column = tl.load(header + 1, mask=mmask, cache_modifier=".cg")
        # The message that carries the payload (this one, or the first message of the same
        # token to this rank, for another expert).
        ref = tl.load(header + 2, mask=mmask, other=0, cache_modifier=".cg")
        message = set_base + ref.to(tl.int64) * MSG_BYTES
        tl.store(out_src_ptr + rows, source_token, mask=mmask)
        tl.store(out_slot_ptr + rows, column, mask=mmask)
        mask2 = mmask[:, None] & flat_mask[None, :]
        dst = rows[:, None] * H + flat[None, :]
        if USE_FP8:
            # Bytes move as bytes (out_x_ptr is the e4m3 output).
            q_ptr = aligned_ptr(message, tl.uint8) + HEADER_BYTES
            q = tl.load(q_ptr[:, None] + flat[None, :], mask=mask2, cache_modifier=".cg")
            tl.store(out_x_ptr.to(tl.pointer_type(tl.uint8)) + dst, q, mask=mask2)
            # Scales go column-major per expert (the row index fastest), the layout TMA-based
            # grouped GEMMs read. One lane per (group, message), messages fastest, so
            # neighbouring lanes store neighbouring rows of one group; a [messages, groups]
            # tile would cost a layout change through shared memory.
            s_m = first + scale_lanes % BLOCK_MSGS
            s_group = scale_lanes // BLOCK_MSGS
            s_mask = (s_group < G) & (s_m < group_msgs)
            s_index, s_row, s_local = _listed(
                s_m, starts, ends, begin, local, me_src, item_lanes, NUM_RANKS, MAX_TOKENS
            )
            s_header = aligned_ptr(set_base + s_index.to(tl.int64) * MSG_BYTES, tl.int32)
            s_ref = tl.load(s_header + 2, mask=s_mask, other=0, cache_modifier=".cg")
            s_src = set_base + s_ref.to(tl.int64) * MSG_BYTES
            scale = tl.load(
                aligned_ptr(s_src, tl.float32) + SCALES_AT // 4 + s_group,
                mask=s_mask,
                cache_modifier=".cg",
            )
            row = s_row.to(tl.int64)
            if PACK_UE8M0:
                # A power-of-two float32 scale is its exponent byte; byte g % 4 of int32
                # column g // 4 (out_scales_ptr is that int32 tensor).
                e8 = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
                s_column = s_local * ((G + 3) // 4) + s_group // 4
                dst_s = (s_column * (NUM_RANKS * MAX_TOKENS) + row) * 4 + s_group % 4
                tl.store(out_scales_ptr.to(tl.pointer_type(tl.uint8)) + dst_s, e8, mask=s_mask)
            else:
                s_column = s_local * G + s_group
                tl.store(
                    out_scales_ptr + s_column * (NUM_RANKS * MAX_TOKENS) + row, scale, mask=s_mask
                )
        else:
            x_src = (aligned_ptr(message, tl.bfloat16) + HEADER_BYTES // 2)[:, None] + flat[None, :]
            x = tl.load(x_src, mask=mask2, cache_modifier=".cg")
            tl.store(out_x_ptr + dst, x, mask=mask2)


@triton.jit
def _poison_rows(
    begin,
    poisoned,
    local,
    item_lanes,
    out_x_ptr,
    out_scales_ptr,
    out_src_ptr,
    H: tl.constexpr,
    E_LOCAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    PACK_UE8M0: tl.constexpr,
    USE_FP8: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_ITEMS: tl.constexpr,
):
    """Fill the row at ``begin`` of each ``poisoned`` item's block with 0xFF bytes: its payload
    and scales read as NaN, its source token and column as -1. Runs only after a timeout."""
    G: tl.constexpr = (H + 127) // 128
    ROWS: tl.constexpr = NUM_RANKS * MAX_TOKENS
    flat = tl.arange(0, BLOCK_SCALES * 128)
    groups = tl.arange(0, BLOCK_SCALES)
    for j in tl.static_range(BLOCK_ITEMS):
        if lane(poisoned.to(tl.int32), item_lanes, j) != 0:
            expert = lane(local, item_lanes, j).to(tl.int64)
            at = lane(begin, item_lanes, j)
            row = expert * ROWS + at
            if USE_FP8:
                tl.store(
                    out_x_ptr.to(tl.pointer_type(tl.uint8)) + row * H + flat, 0xFF, mask=flat < H
                )
                if PACK_UE8M0:  # exponent byte g % 4 of int32 column g // 4
                    column = expert * ((G + 3) // 4) + groups // 4
                    scales = out_scales_ptr.to(tl.pointer_type(tl.uint8))
                    tl.store(scales + (column * ROWS + at) * 4 + groups % 4, 0xFF, mask=groups < G)
                else:
                    scales = out_scales_ptr.to(tl.pointer_type(tl.int32))
                    tl.store(scales + (expert * G + groups) * ROWS + at, -1, mask=groups < G)
            else:
                bits = out_x_ptr.to(tl.pointer_type(tl.int16))
                tl.store(bits + row * H + flat, -1, mask=flat < H)
            tl.store(out_src_ptr + row, -1)
            tl.store(out_src_ptr + E_LOCAL * ROWS + row, -1)
