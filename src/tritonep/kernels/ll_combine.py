"""Low-latency combine: expert outputs go straight back to their token's slot, then a weighted sum.

Send phase: programs store the rows of (local expert, source rank) blocks into the source
rank's receive buffer ``[token][top-k column][H]`` (optionally LogFMT-10 encoded), then raise a
counter on that rank that only grows, so no reset is needed. Receive phase: once every sender
is done, each token gets ``sum_k w[t, k] * row(t, k)`` in float32, cast to BF16; a program
whose wait gave up writes NaN into its rows. docs/design/low_latency.md gives the whole
design and why it is fast.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .fp8 import from_bf16, to_bf16
from .logfmt import decode, encode_groups
from .peer_mask import gave_up, mask_timed_out, masked, wait_peer
from .phases import LL_COMBINE_IDS, LL_COMBINE_RECV
from .status import first_bad_id, record_bad_id
from .sync import (
    add_release,
    aligned_ptr,
    any_set,
    call_number,
    finish_launch,
    limit_ns,
    record_timeout,
    wait_tile,
)
from .trace import read_clock, write_trace
from .transport import SIGNAL_ADD, VIA_STORE, put_block, signal

COMBINE_SEND_CALLS = tl.constexpr(2)
COMBINE_RECV_CALLS = tl.constexpr(3)
COMBINE_ARRIVALS = tl.constexpr(5)  # (column 0)


class CombineCall(NamedTuple):
    """The leading runtime arguments of :func:`ll_combine_kernel`, in its order: what changes
    from call to call (its trailing ones are :class:`~.ll_dispatch.LowLatencyShared`)."""

    x_ptr: object
    src_ptr: object
    slot_ptr: object
    range_ptr: object
    topk_idx_ptr: object
    topk_weights_ptr: object
    num_tokens: int
    out_ptr: object
    wait_stats_ptr: object
    trace_ptr: object


class CombineVariant(NamedTuple):
    """One compiled variant of :func:`ll_combine_kernel`: its constexprs, in its order."""

    H: int
    K: int
    K_MAX: int
    NUM_EXPERTS: int
    NUM_RANKS: int
    MAX_TOKENS: int
    RECV_SET_BYTES: int
    SLOT_BYTES: int
    RECV_OFFSET: int
    DONE_OFFSET: int
    STAGE_OFFSET: int
    GPUS_PER_NODE: int
    DO_SEND: bool
    DO_RECV: bool
    USE_CLOCK: bool
    BLOCK_SCALES: int
    BLOCK_RANKS: int
    BLOCK_ROWS: int
    BLOCK_CHANNELS: int
    PROFILE: bool
    WAIT_STATS: bool
    SHRINK: bool
    VIA: int
    LOGFMT: bool
    BLOCK_GROUPS: int


@triton.jit(do_not_specialize=["num_tokens", "timeout_us"])
def ll_combine_kernel(
    # What changes from call to call (CombineCall).
    x_ptr,  # [E_local, R * MAX_TOKENS, H] bf16 expert outputs, rows as dispatch packed them
    src_ptr,  # [E_local, R * MAX_TOKENS] int32 source token of each row
    slot_ptr,  # [E_local, R * MAX_TOKENS] int32 top-k column of each row
    range_ptr,  # [E_local, R] int64 begin << 32 | count
    topk_idx_ptr,  # [N, K] int64 global expert ids, -1 for none
    topk_weights_ptr,  # [N, K] float32
    num_tokens,  # N
    out_ptr,  # [N, H] bf16
    wait_stats_ptr,  # [R] int64 time spent waiting for each source rank (WAIT_STATS)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE), or the clock of WAIT_STATS
    # What stays from call to call (ll_dispatch.LowLatencyShared).
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [STATE_ROWS, P] int64 call counters per program (and shrink's arrivals)
    scratch_ptr,  # (the dispatch's; unused here)
    expert_done_ptr,  # (the dispatch's; unused here)
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    mask_ptr,  # [R] int32 masked peers (SHRINK)
    verdict_ptr,  # [2, R] int64 this launch's verdict on each source rank, row 1 (SHRINK)
    skipped_ptr,  # [R] int64 calls whose signal from each rank was not waited for (SHRINK)
    H: tl.constexpr,  # hidden size
    K: tl.constexpr,  # top-k
    K_MAX: tl.constexpr,  # top-k columns of a token's receive slots
    NUM_EXPERTS: tl.constexpr,  # experts in all
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    MAX_TOKENS: tl.constexpr,  # max tokens per rank
    RECV_SET_BYTES: tl.constexpr,  # a buffer set of the receive slots
    SLOT_BYTES: tl.constexpr,  # a row's slot: 256 bytes per group, then [G] (log_amin, step)
    RECV_OFFSET: tl.constexpr,  # heap byte offset of buffer set 0 of the [MAX_TOKENS][K_MAX] slots
    DONE_OFFSET: tl.constexpr,  # heap byte offset of the [R] int64 done counters
    STAGE_OFFSET: tl.constexpr,  # heap offset of the staging slots [E_local * R * MAX_TOKENS] (VIA)
    GPUS_PER_NODE: tl.constexpr,  # ranks r, r' share a node when r // it == r' // it
    DO_SEND: tl.constexpr,  # run the send phase
    DO_RECV: tl.constexpr,  # run the receive phase
    USE_CLOCK: tl.constexpr,  # on a GPU (else the interpreter)
    BLOCK_SCALES: tl.constexpr,  # power of two >= ceil(H / 128)
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BLOCK_ROWS: tl.constexpr,  # rows a sending program moves at a time
    BLOCK_CHANNELS: tl.constexpr,  # channels of a token reduced at a time (power of two)
    PROFILE: tl.constexpr,  # record traces
    WAIT_STATS: tl.constexpr,  # add the time waited per source rank to wait_stats_ptr
    SHRINK: tl.constexpr,  # masked peers are skipped, timeouts mask (peer_mask)
    VIA: tl.constexpr,  # how rows reach other nodes (transport)
    LOGFMT: tl.constexpr,  # rows travel as LogFMT-10 (:mod:`.logfmt`)
    BLOCK_GROUPS: tl.constexpr,  # 128-channel groups encoded at a time (power of two)
):
    verdict_ptr += NUM_RANKS  # the combine's row
    c_send = call_number(state_ptr, COMBINE_SEND_CALLS)
    c_recv = call_number(state_ptr, COMBINE_RECV_CALLS)
    # Trace: sub-phase totals (send, signal, wait, reduce).
    t_start = tl.zeros((), tl.int64)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    t_send_end = t_start
    t_send = tl.zeros((), tl.int64)
    t_signal = tl.zeros((), tl.int64)
    t_wait = tl.zeros((), tl.int64)
    t_reduce = tl.zeros((), tl.int64)
    if DO_SEND:
        t_send = _send_rows(
            x_ptr,
            src_ptr,
            slot_ptr,
            range_ptr,
            trace_ptr,
            peer_ptrs,
            pe_ptr,
            rank,
            c_send,
            mask_ptr,
            H,
            K_MAX,
            NUM_EXPERTS,
            NUM_RANKS,
            MAX_TOKENS,
            RECV_SET_BYTES,
            SLOT_BYTES,
            RECV_OFFSET,
            STAGE_OFFSET,
            GPUS_PER_NODE,
            USE_CLOCK,
            BLOCK_SCALES,
            BLOCK_ROWS,
            PROFILE,
            SHRINK,
            VIA,
            LOGFMT,
            BLOCK_GROUPS,
        )
        t1 = t_start
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
        _signal_sources(
            peer_ptrs, pe_ptr, rank, mask_ptr, NUM_EXPERTS, NUM_RANKS, DONE_OFFSET, SHRINK, VIA
        )
        if PROFILE:
            t_send_end = read_clock(trace_ptr, USE_CLOCK)
            t_signal = t_send_end - t1
    if DO_RECV:
        t0 = t_start
        if PROFILE:
            t0 = read_clock(trace_ptr, USE_CLOCK)
        failed = _wait_senders(
            num_tokens,
            c_recv,
            wait_stats_ptr,
            trace_ptr,
            peer_ptrs,
            rank,
            status_ptr,
            timeout_us,
            mask_ptr,
            verdict_ptr,
            skipped_ptr,
            NUM_EXPERTS,
            NUM_RANKS,
            DONE_OFFSET,
            USE_CLOCK,
            BLOCK_RANKS,
            WAIT_STATS,
            SHRINK,
        )
        t1 = t0
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
            t_wait = t1 - t0
        _reduce_tokens(
            topk_idx_ptr,
            topk_weights_ptr,
            num_tokens,
            out_ptr,
            failed,
            c_recv,
            peer_ptrs,
            rank,
            status_ptr,
            mask_ptr,
            verdict_ptr,
            H,
            K,
            K_MAX,
            NUM_EXPERTS,
            NUM_RANKS,
            RECV_SET_BYTES,
            SLOT_BYTES,
            RECV_OFFSET,
            USE_CLOCK,
            BLOCK_CHANNELS,
            SHRINK,
            LOGFMT,
        )
        if PROFILE:
            t_reduce = read_clock(trace_ptr, USE_CLOCK) - t1
    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(
            trace_ptr, t_start, t_send_end, t_end, t_send, t_signal, t_wait, t_reduce, 0, USE_CLOCK
        )
    last = finish_launch(
        state_ptr,
        COMBINE_ARRIVALS,
        COMBINE_SEND_CALLS,
        COMBINE_RECV_CALLS,
        c_send,
        c_recv,
        DO_SEND,
        DO_RECV,
        SHRINK and DO_RECV,
    )
    if SHRINK and DO_RECV:  # noqa: SIM102 - compiled out without SHRINK
        if last:
            mask_timed_out(mask_ptr, verdict_ptr, skipped_ptr, c_recv + 1, NUM_RANKS, True)


@triton.jit
def _send_rows(
    x_ptr,
    src_ptr,
    slot_ptr,
    range_ptr,
    trace_ptr,
    peer_ptrs,
    pe_ptr,
    rank,
    c_send,
    mask_ptr,
    H: tl.constexpr,
    K_MAX: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    GPUS_PER_NODE: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    PROFILE: tl.constexpr,
    SHRINK: tl.constexpr,
    VIA: tl.constexpr,
    LOGFMT: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Store this program's (local expert, source rank) blocks into their source ranks' slots,
    ``BLOCK_ROWS`` rows at a time so that their loads and remote stores are in flight
    together. Returns the trace's send total."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    G: tl.constexpr = (H + 127) // 128  # the last group may be partial
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    set_off = (c_send % 2) * RECV_SET_BYTES
    rows_in_block = tl.arange(0, BLOCK_ROWS)
    flat = tl.arange(0, BLOCK_SCALES * 128)
    flat_mask = flat < H
    my_base = tl.load(peer_ptrs + rank)
    t_send = tl.zeros((), tl.int64)
    for item in range(pid, E_LOCAL * NUM_RANKS, num_programs):
        local = item // NUM_RANKS
        src = item % NUM_RANKS
        t0 = t_send
        if PROFILE:
            t0 = read_clock(trace_ptr, USE_CLOCK)
        packed = tl.load(range_ptr + local * NUM_RANKS + src)
        begin = (packed >> 32).to(tl.int32)
        count = (packed & 0xFFFFFFFF).to(tl.int32)
        if SHRINK:  # a peer masked since the dispatch gets nothing back
            count = tl.where(tl.load(mask_ptr + src) != 0, 0, count)
        base = tl.load(peer_ptrs + src)
        remote = (src // GPUS_PER_NODE) != (rank // GPUS_PER_NODE)
        for first in range(0, count, BLOCK_ROWS):
            rmask = (first + rows_in_block) < count
            rows = (local * NUM_RANKS * MAX_TOKENS + begin + first + rows_in_block).to(tl.int64)
            token = tl.load(src_ptr + rows, mask=rmask).to(tl.int64)
            column = tl.load(slot_ptr + rows, mask=rmask).to(tl.int64)
            mask2 = rmask[:, None] & flat_mask[None, :]
            dst = base + RECV_OFFSET + set_off + (token * K_MAX + column) * SLOT_BYTES
            if VIA != VIA_STORE:
                # A source on another node: stage the rows in this rank's heap first.
                dst = tl.where(remote, my_base + STAGE_OFFSET + rows * SLOT_BYTES, dst)
            if LOGFMT:
                _send_logfmt(
                    x_ptr + rows * H, dst, rmask, H, G, BLOCK_GROUPS, BLOCK_ROWS, USE_CLOCK
                )
            else:
                y = tl.load(x_ptr + rows[:, None] * H + flat[None, :], mask=mask2)
                tl.store(aligned_ptr(dst, tl.bfloat16)[:, None] + flat[None, :], y, mask=mask2)
        if VIA != VIA_STORE:  # noqa: SIM102 - compiled out without a transport
            if remote:
                pe = tl.load(pe_ptr + src)
                for r in range(0, count):
                    row = (local * NUM_RANKS * MAX_TOKENS + begin + r).to(tl.int64)
                    token = tl.load(src_ptr + row).to(tl.int64)
                    column = tl.load(slot_ptr + row).to(tl.int64)
                    offset = RECV_OFFSET + set_off + (token * K_MAX + column) * SLOT_BYTES
                    stage = my_base + STAGE_OFFSET + row * SLOT_BYTES
                    put_block(
                        my_base, base, offset, stage, SLOT_BYTES if LOGFMT else H * 2, pe, VIA
                    )
        if PROFILE:
            t_send += read_clock(trace_ptr, USE_CLOCK) - t0
    return t_send


@triton.jit
def _signal_sources(
    peer_ptrs,
    pe_ptr,
    rank,
    mask_ptr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    DONE_OFFSET: tl.constexpr,
    SHRINK: tl.constexpr,
    VIA: tl.constexpr,
):
    """One counter update per source rank for all of this program's blocks to it (one
    system-scope release each): its receiver needs every block anyway, so signalling each
    block as it is stored would only add releases."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    my_base = tl.load(peer_ptrs + rank)
    for peer in range(NUM_RANKS):
        blocks = tl.zeros((), tl.int64)
        for item in range(pid, E_LOCAL * NUM_RANKS, num_programs):
            if item % NUM_RANKS == peer:
                blocks += 1
        if SHRINK:
            blocks = tl.where(tl.load(mask_ptr + peer) != 0, 0, blocks)
        if blocks > 0:
            base = tl.load(peer_ptrs + peer)
            if VIA == VIA_STORE:
                add_release((base + DONE_OFFSET + rank * 8).to(tl.pointer_type(tl.int64)), blocks)
            else:
                signal(
                    my_base,
                    base,
                    DONE_OFFSET + rank * 8,
                    blocks,
                    SIGNAL_ADD,
                    tl.load(pe_ptr + peer),
                    VIA,
                )


@triton.jit
def _wait_senders(
    num_tokens,
    c_recv,
    wait_stats_ptr,
    trace_ptr,
    peer_ptrs,
    rank,
    status_ptr,
    timeout_us,
    mask_ptr,
    verdict_ptr,
    skipped_ptr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    DONE_OFFSET: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    WAIT_STATS: tl.constexpr,
    SHRINK: tl.constexpr,
):
    """Wait until every sender's rows for this rank are stored. A rank without tokens waits
    too (one program): its wait is what keeps it from running ahead of its peers by more than
    one call, and so from overwriting the buffer set they still read (several combines of one
    dispatch, each sending). Returns whether a wait gave up (never in shrink mode, where the
    peer is masked instead)."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    my_base = tl.load(peer_ptrs + rank)
    failed = tl.zeros((), tl.int1)
    if tl.program_id(0) < tl.maximum(num_tokens, 1):
        if SHRINK:
            timeout_ns = limit_ns(timeout_us, status_ptr)
            for src in range(NUM_RANKS):
                w0 = tl.zeros((), tl.int64)
                if WAIT_STATS:
                    w0 = read_clock(trace_ptr, USE_CLOCK)
                # Calls in which this peer was masked brought no signal from it.
                expected = (c_recv + 1 - tl.load(skipped_ptr + src)) * E_LOCAL
                done = (my_base + DONE_OFFSET + src * 8).to(tl.pointer_type(tl.int64))
                wait_peer(
                    done,
                    expected,
                    timeout_ns,
                    tl.load(mask_ptr + src) != 0,
                    verdict_ptr + src,
                    c_recv + 1,
                    USE_CLOCK,
                    AT_LEAST=True,
                )
                if WAIT_STATS:
                    waited = read_clock(trace_ptr, USE_CLOCK) - w0
                    tl.atomic_add(wait_stats_ptr + src, waited, sem="relaxed", scope="gpu")
        else:
            # Every sender's counter in one read, usually all there; else the read repeats
            # (bounded) until they are.
            sources = tl.arange(0, BLOCK_RANKS)[None, :]
            done = (my_base + DONE_OFFSET + sources * 8).to(tl.pointer_type(tl.int64))
            _, missing, waited, limit = wait_tile(
                done,
                sources < NUM_RANKS,
                (c_recv + 1) * E_LOCAL,
                timeout_us.to(tl.int64) * 1000,
                timeout_us,
                status_ptr,
                USE_CLOCK,
                AT_LEAST=True,
                TIMED=WAIT_STATS,
            )
            failed = any_set(missing)
            if failed:  # name the first sender still missing
                gone = tl.min(tl.min(tl.where(missing, sources, BLOCK_RANKS), axis=1), axis=0)
                record_timeout(status_ptr, gone, LL_COMBINE_RECV, limit)
            if WAIT_STATS:  # the time until each sender's rows were all there
                tl.atomic_add(
                    wait_stats_ptr + sources,
                    waited,
                    mask=sources < NUM_RANKS,
                    sem="relaxed",
                    scope="gpu",
                )
    return failed


@triton.jit
def _reduce_tokens(
    topk_idx_ptr,
    topk_weights_ptr,
    num_tokens,
    out_ptr,
    failed,
    c_recv,
    peer_ptrs,
    rank,
    status_ptr,
    mask_ptr,
    verdict_ptr,
    H: tl.constexpr,
    K: tl.constexpr,
    K_MAX: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    RECV_OFFSET: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    SHRINK: tl.constexpr,
    LOGFMT: tl.constexpr,
):
    """Each of this program's tokens (``p, p + P, ...``) gets the weighted sum of its top-k
    rows, in top-k order as the reference sums, in float32 to BF16; NaN where ``failed`` (a
    wait gave up: not every row came)."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    G: tl.constexpr = (H + 127) // 128  # the last group may be partial
    set_off = (c_recv % 2) * RECV_SET_BYTES
    my_base = tl.load(peer_ptrs + rank)
    bad_seen = tl.zeros((), tl.int1)
    # Added to every weight: NaN makes every sum NaN; 0 changes no sum (the sums start at +0,
    # so the -0 it turns into +0 adds nothing either way).
    poison = tl.where(failed, float("nan"), 0.0)
    for token in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        token64 = tl.cast(token, tl.int64)
        ids_ptr = topk_idx_ptr + token64 * K
        rows = my_base + RECV_OFFSET + set_off + token64 * K_MAX * SLOT_BYTES
        # A chunk of BLOCK_CHANNELS channels at a time; within it every top-k row is loaded without
        # a branch (all K loads in flight together).
        for c0 in range(0, H, BLOCK_CHANNELS):
            if LOGFMT:  # channels as [groups, 128]: parameters are read once per group
                groups = c0 // 128 + tl.arange(0, BLOCK_CHANNELS // 128)
                cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
                acc = tl.zeros((BLOCK_CHANNELS // 128, 128), tl.float32)
            else:
                cols = c0 + tl.arange(0, BLOCK_CHANNELS)
                acc = tl.zeros((BLOCK_CHANNELS,), tl.float32)
            cmask = cols < H
            for k in tl.static_range(K):
                expert = tl.load(ids_ptr + k)
                valid = (expert >= 0) & (expert < NUM_EXPERTS)
                bad_seen = bad_seen | (expert < -1) | (expert >= NUM_EXPERTS)
                if SHRINK:  # the experts of a masked or given-up peer add nothing
                    owner = expert // E_LOCAL
                    dead = masked(mask_ptr, owner, valid)
                    dead = dead | gave_up(verdict_ptr, owner, c_recv + 1, valid)
                    valid = valid & ~dead
                # A token that names an expert twice got its row once, at the first column.
                column = tl.full((), k, tl.int64)
                for j in tl.static_range(k):
                    first = (tl.load(ids_ptr + j) == expert) & (column == k)
                    column = tl.where(first, j, column)
                weight = tl.load(topk_weights_ptr + token64 * K + k)
                row = rows + column * SLOT_BYTES
                # An invalid expert reads nothing: its bound is 0 (a tile compare, not
                # `mask & valid`: Triton 3.9's interpreter splats a scalar comparison as int32,
                # which no mask accepts).
                if LOGFMT:
                    value = _load_logfmt(row, groups, groups < tl.where(valid, G, 0), H, USE_CLOCK)
                else:
                    y = tl.load(
                        aligned_ptr(row, tl.bfloat16) + cols,
                        mask=cols < tl.where(valid, H, 0),
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    value = from_bf16(y, not USE_CLOCK)
                # Rows not read are 0: a weight of 0 adds nothing, without a select per
                # channel.
                acc += (tl.where(valid, weight, 0.0) + poison) * value
            tl.store(out_ptr + token64 * H + cols, to_bf16(acc, not USE_CLOCK), mask=cmask)
    if bad_seen:  # the first such id of the batch, whichever program records it
        token, column, bad_id = first_bad_id(topk_idx_ptr, num_tokens, K, NUM_EXPERTS, 16, 64)
        record_bad_id(status_ptr, rank, LL_COMBINE_IDS, token, column, bad_id)


@triton.jit
def _send_logfmt(
    src,
    dst,
    rmask,
    H: tl.constexpr,
    G: tl.constexpr,
    GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    """Store the BF16 rows at ``src [ROWS]`` to the slots at ``dst [ROWS]`` as LogFMT, GROUPS
    groups at a time: each group encoded or unchanged, and its parameters (:mod:`.logfmt`).
    A partial last group (``H`` not a multiple of 128) is a group of its channels alone; its
    slot keeps a whole group's 256 bytes, which its codes may fill."""
    lane = tl.arange(0, 128)[None, None, :]
    quad = tl.arange(0, 32)[None, None, :]
    slot = aligned_ptr(dst, tl.uint8)[:, None, None]
    raw = aligned_ptr(dst, tl.bfloat16)[:, None, None]
    params = aligned_ptr(dst + G * 256, tl.float32)[:, None]
    rows = src[:, None, None]
    EMULATE: tl.constexpr = not USE_CLOCK
    for g0 in range(0, G, GROUPS):
        gi = g0 + tl.arange(0, GROUPS)
        live = rmask[:, None] & (gi < G)[None, :]
        at = (gi * 128)[None, :, None] + lane
        y = tl.load(rows + at, mask=live[:, :, None] & (at < H), other=0.0)
        encoded, low, high, log_amin, step = encode_groups(
            from_bf16(y, EMULATE), at < H, H % 128 != 0, EMULATE
        )
        # Channel c of group g: code byte at 256 g + c, BF16 at byte 2 (128 g + c); its high
        # bits in byte 256 g + 128 + c // 4.
        as_code = (live & encoded)[:, :, None]
        tl.store(slot + (gi * 256)[None, :, None] + lane, low, mask=as_code)
        tl.store(slot + (gi * 256 + 128)[None, :, None] + quad, high, mask=as_code)
        tl.store(raw + at, y, mask=(live & ~encoded)[:, :, None] & (at < H))
        tl.store(params + gi[None, :] * 2, log_amin, mask=live)
        tl.store(params + gi[None, :] * 2 + 1, step, mask=live)


@triton.jit
def _load_logfmt(row, groups, gmask, H: tl.constexpr, USE_CLOCK: tl.constexpr):
    """Float32 ``[GR, 128]`` values of groups ``groups [GR]`` of the LogFMT slot at ``row``
    (groups off in ``gmask [GR]``: 0). Every load is issued at once, whether the group was
    encoded or not: one round trip. The high bits are loaded as the bytes they travel in and
    spread over their four channels in registers (a per-channel gather would need a layout
    change through shared memory)."""
    lane = tl.arange(0, 128)[None, :]
    mask = gmask[:, None] & ((groups * 128)[:, None] + lane < H)
    params = aligned_ptr(row + (H + 127) // 128 * 256, tl.float32) + groups * 2
    log_amin = tl.load(params, mask=gmask, other=0.0, cache_modifier=".cg")[:, None]
    step = tl.load(params + 1, mask=gmask, other=0.0, cache_modifier=".cg")[:, None]
    slot = aligned_ptr(row, tl.uint8) + (groups * 256)[:, None]
    low = tl.load(slot + lane, mask=mask, other=0, cache_modifier=".cg")
    quad = tl.arange(0, 32)[None, :]
    packed = tl.load(
        slot + 128 + quad, mask=gmask[:, None] & (quad < 32), other=0, cache_modifier=".cg"
    ).to(tl.int32)
    # Channel 4 q + j from bits 2 j of byte q: join (j = 0, 2) with (1, 3) -> index 2 i + j'.
    high = tl.join(tl.join(packed & 3, (packed >> 4) & 3), tl.join((packed >> 2) & 3, packed >> 6))
    high = tl.reshape(high, (groups.shape[0], 128))
    raw = tl.load(
        aligned_ptr(row, tl.bfloat16) + (groups * 128)[:, None] + lane,
        mask=mask,
        other=0.0,
        cache_modifier=".cg",
    )
    value = decode(low, high, log_amin, step)
    return tl.where(step > 0, value, from_bf16(raw, not USE_CLOCK))
