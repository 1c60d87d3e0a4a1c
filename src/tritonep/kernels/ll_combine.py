"""Low-latency combine: expert outputs go straight back to their token's slot, then a weighted sum.

Send phase. Work items are (local expert, source rank) blocks of the slab, spread over the
programs. Each row came from one (source rank, token, top-k column); the program stores it,
several rows at a time, into that source rank's receive buffer ``[token][column][H]`` with
plain NVLink stores; once all its blocks are stored, it adds the number of its blocks for
each source rank to a counter on that rank with one system-scope release. The
counters only grow (every call adds ``E_local`` per sender), so a receiver waits until its
counter of every sender reaches ``(call + 1) * E_local``: no reset, no tags.

Across nodes (``VIA`` other than ``VIA_STORE``), rows for a source rank on another node are
staged in this rank's heap, put row by row into their slots there, and the counter is then
raised by a signal ordered after the puts (:mod:`tritonep.kernels.transport`).

Receive phase. Program ``p`` owns tokens ``p, p + P, ...``: once every sender is done, each
token gets ``sum_k w[t, k] * row(t, k)`` in float32, cast to BF16. A token that names one
expert twice reads that expert's single row twice (dispatch sent it once, at the first column).

Why it is fast: the receive buffer is indexed by (token, top-k column), which is
``max_tokens * top-k`` rows instead of ``num_experts * max_tokens`` (32x smaller at 256 experts,
top-8), every row crosses NVLink once, and the reduction reads local memory only.

Traced launches (``PROFILE``) record, per program, the time spent sending, signalling, waiting
and reducing; ``WAIT_STATS`` adds the time waited per source rank. Both compile out when off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import from_bf16, to_bf16
from .ll_dispatch import finish_launch
from .peer_mask import gave_up, mask_timed_out, masked, wait_peer
from .sync import add_release, aligned_ptr, record_timeout, wait_flag
from .trace import read_clock, write_trace
from .transport import SIGNAL_ADD, VIA_STORE, put_block, signal

PHASE_COMBINE_RECV = tl.constexpr(3)

COMBINE_SEND_CALLS = tl.constexpr(2)
COMBINE_RECV_CALLS = tl.constexpr(3)
COMBINE_ARRIVALS = tl.constexpr(5)


@triton.jit
def ll_combine_kernel(
    x_ptr,  # [E_local, R * M, H] bf16 expert outputs, rows as dispatch packed them
    src_ptr,  # [E_local, R * M] int32 source token of each row
    slot_ptr,  # [E_local, R * M] int32 top-k column of each row
    range_ptr,  # [E_local, R] int64 begin << 32 | count
    topk_idx_ptr,  # [N, K] int64
    topk_weights_ptr,  # [N, K] float32
    num_tokens,
    out_ptr,  # [N, H] bf16
    peer_ptrs,
    rank,
    recv_offset,  # byte offset of buffer set 0 of [M][K_MAX][H] bf16 rows in the heap
    done_offset,  # byte offset of the [R] int64 done counters
    stage_offset,  # byte offset of the staging rows [E_local * R * M][H] (VIA != VIA_STORE)
    gpus_per_node,  # ranks r and r' share a node when r // gpus_per_node == r' // gpus_per_node
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    state_ptr,
    status_ptr,
    timeout_ns,
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE), or the clock of WAIT_STATS
    wait_stats_ptr,  # [R] int64 time spent waiting for each source rank (WAIT_STATS)
    mask_ptr,  # [R] int32 masked peers (SHRINK)
    verdict_ptr,  # [R] int64 this launch's verdict on each source rank (SHRINK)
    skipped_ptr,  # [R] int64 calls whose signal from each rank was not waited for (SHRINK)
    H: tl.constexpr,
    K: tl.constexpr,
    K_MAX: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    M: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    G_P2: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    REDUCE_BW: tl.constexpr,  # channels of a token reduced at a time (power of two)
    PROFILE: tl.constexpr,
    WAIT_STATS: tl.constexpr,
    SHRINK: tl.constexpr = False,  # masked peers are skipped, timeouts mask (peer_mask)
    VIA: tl.constexpr = VIA_STORE,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    c_send = tl.load(state_ptr + COMBINE_SEND_CALLS, volatile=True)
    c_recv = tl.load(state_ptr + COMBINE_RECV_CALLS, volatile=True)
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
        set_off = (c_send % 2) * RECV_SET_BYTES
        rows_in_block = tl.arange(0, ROW_BLOCK)
        flat = tl.arange(0, G_P2 * 128)
        flat_mask = flat < H
        my_base = tl.load(peer_ptrs + rank)
        # One work item per (local expert, source rank) block; ROW_BLOCK rows at a time so
        # that their loads and remote stores are in flight together.
        for item in range(pid, E_LOCAL * NUM_RANKS, num_programs):
            local = item // NUM_RANKS
            src = item % NUM_RANKS
            if PROFILE:
                t0 = read_clock(trace_ptr, USE_CLOCK)
            packed = tl.load(range_ptr + local * NUM_RANKS + src)
            begin = (packed >> 32).to(tl.int32)
            count = (packed & 0xFFFFFFFF).to(tl.int32)
            if SHRINK:  # a peer masked since the dispatch gets nothing back
                count = tl.where(tl.load(mask_ptr + src) != 0, 0, count)
            base = tl.load(peer_ptrs + src)
            remote = (src // gpus_per_node) != (rank // gpus_per_node)
            for first in range(0, count, ROW_BLOCK):
                rmask = (first + rows_in_block) < count
                rows = (local * NUM_RANKS * M + begin + first + rows_in_block).to(tl.int64)
                token = tl.load(src_ptr + rows, mask=rmask).to(tl.int64)
                column = tl.load(slot_ptr + rows, mask=rmask).to(tl.int64)
                mask2 = rmask[:, None] & flat_mask[None, :]
                y = tl.load(x_ptr + rows[:, None] * H + flat[None, :], mask=mask2)
                dst = base + recv_offset + set_off + (token * K_MAX + column) * (H * 2)
                if VIA != VIA_STORE:
                    # A source on another node: stage the rows in this rank's heap first.
                    dst = tl.where(remote, my_base + stage_offset + rows * (H * 2), dst)
                dst = aligned_ptr(dst, tl.bfloat16)
                tl.store(dst[:, None] + flat[None, :], y, mask=mask2)
            if VIA != VIA_STORE:  # noqa: SIM102 - compiled out without a transport
                if remote:
                    pe = tl.load(pe_ptr + src)
                    for r in range(0, count):
                        row = (local * NUM_RANKS * M + begin + r).to(tl.int64)
                        token = tl.load(src_ptr + row).to(tl.int64)
                        column = tl.load(slot_ptr + row).to(tl.int64)
                        offset = recv_offset + set_off + (token * K_MAX + column) * (H * 2)
                        stage = my_base + stage_offset + row * (H * 2)
                        put_block(my_base, base, offset, stage, H * 2, pe, VIA)
            if PROFILE:
                t_send += read_clock(trace_ptr, USE_CLOCK) - t0
        # One counter update per source rank for all of this program's blocks to it (one
        # system-scope release each): its receiver needs every block anyway, so signalling
        # each block as it is stored would only add releases.
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
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
                    add_release((base + done_offset + rank * 8).to(tl.pointer_type(tl.int64)),
                                blocks)  # fmt: skip
                else:
                    signal(my_base, base, done_offset + rank * 8,
                           blocks, SIGNAL_ADD, tl.load(pe_ptr + peer), VIA)  # fmt: skip
        if PROFILE:
            t_send_end = read_clock(trace_ptr, USE_CLOCK)
            t_signal = t_send_end - t1

    if DO_RECV:
        set_off = (c_recv % 2) * RECV_SET_BYTES
        my_base = tl.load(peer_ptrs + rank)
        if PROFILE:
            t0 = read_clock(trace_ptr, USE_CLOCK)
        if pid < num_tokens:
            target = (c_recv + 1) * E_LOCAL
            budget = timeout_ns + tl.zeros((), tl.int64)  # later waits give up after a timeout
            for src in range(NUM_RANKS):
                done = (my_base + done_offset + src * 8).to(tl.pointer_type(tl.int64))
                if WAIT_STATS:
                    w0 = read_clock(trace_ptr, USE_CLOCK)
                if SHRINK:
                    # Calls in which this peer was masked brought no signal from it.
                    expected = (c_recv + 1 - tl.load(skipped_ptr + src)) * E_LOCAL
                    _, ok = wait_peer(done, expected, timeout_ns, tl.load(mask_ptr + src) != 0,
                                      verdict_ptr + src, c_recv + 1, USE_CLOCK,
                                      AT_LEAST=True)  # fmt: skip
                else:
                    _, ok = wait_flag(done, target, budget, USE_CLOCK, AT_LEAST=True)
                if WAIT_STATS:
                    waited = read_clock(trace_ptr, USE_CLOCK) - w0
                    tl.atomic_add(wait_stats_ptr + src, waited, sem="relaxed", scope="gpu")
                if not SHRINK:
                    budget = tl.where(ok, budget, 0)
                    if not ok:
                        record_timeout(status_ptr, src, PHASE_COMBINE_RECV)
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
            t_wait = t1 - t0
        for token in range(pid, num_tokens, num_programs):
            token64 = tl.cast(token, tl.int64)
            ids_ptr = topk_idx_ptr + token64 * K
            rows = my_base + recv_offset + set_off + token64 * K_MAX * (H * 2)
            # A chunk of REDUCE_BW channels at a time; within it every top-k row is loaded
            # without a branch (all K loads in flight together) and summed in top-k order, as
            # the reference sums.
            for c0 in range(0, H, REDUCE_BW):
                cols = c0 + tl.arange(0, REDUCE_BW)
                cmask = cols < H
                acc = tl.zeros((REDUCE_BW,), tl.float32)
                for k in tl.static_range(K):
                    expert = tl.load(ids_ptr + k)
                    valid = (expert >= 0) & (expert < NUM_EXPERTS)
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
                    row = aligned_ptr(rows + column * (H * 2), tl.bfloat16)
                    y = tl.load(row + cols, mask=cmask & valid, other=0.0, cache_modifier=".cg")
                    acc = tl.where(valid, acc + weight * from_bf16(y, not USE_CLOCK), acc)
                tl.store(out_ptr + token64 * H + cols, to_bf16(acc, not USE_CLOCK), mask=cmask)
        if PROFILE:
            t_reduce = read_clock(trace_ptr, USE_CLOCK) - t1

    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(trace_ptr, t_start, t_send_end, t_end, t_send, t_signal, t_wait, t_reduce, 0)
    last = finish_launch(
        state_ptr,
        COMBINE_ARRIVALS,
        COMBINE_SEND_CALLS,
        COMBINE_RECV_CALLS,
        c_send,
        c_recv,
        DO_SEND,
        DO_RECV,
    )
    if SHRINK and DO_RECV:  # noqa: SIM102 - compiled out without SHRINK
        if last:
            mask_timed_out(mask_ptr, verdict_ptr, skipped_ptr, c_recv + 1, NUM_RANKS, True)
