"""Low-latency dispatch: quantize each token on the fly and store it straight into the owner's slot.

Send phase. Program ``p`` owns the global experts ``p, p + P, ...``. For each, it scans the
top-k ids (a few KB), numbers the tokens that chose the expert in token order (a token that
names the expert twice counts once) and stores one message per token into the owner's receive
slab ``[local_expert][source_rank][slot]`` with plain NVLink stores: a 16-byte header (token
index, top-k column), the payload (FP8 e4m3 quantized here, per 128 channels, or BF16) and the
scales, a few tokens at a time. Then it publishes the count with one system-scope release store of
``call << 32 | count``: the call number tags the value, so a stale count of an earlier call is
never mistaken for a new one and nothing needs resetting between calls.

Receive phase. Work items are (local expert, source rank) pairs, spread over the programs.
An item waits (bounded) for the counts of its source and of the earlier sources, so its block
starts at ``begin`` = the sum of the earlier counts; it copies its messages, several at a
time, into the packed output ``recv_x[expert, begin : begin + count]`` and records
``(begin, count)``. Blocks are therefore in source-rank order, the same order as the
reference, and outputs are deterministic.

Across nodes (``VIA`` other than ``VIA_STORE``), messages for an owner on another node are
built in this rank's staging slab ``[expert][slot]`` instead, then moved in one put whose signal
is the count (:mod:`tritonep.kernels.transport`); owners on this node still get plain stores.

Why it is fast: one launch, no host synchronization, no count exchange before the data (the
count follows the data on the same path), every byte crosses NVLink once, and the work of
one expert stays in one program so slot numbering needs no atomics.

Both phases can run in one launch (the GPU default, launched cooperatively so that all
programs are resident) or as two launches (the receive hook, and the Triton interpreter, which
runs programs one after another). Two buffer sets alternate between calls (``call % 2``); the
call counters live on the device, so captured CUDA graphs replay correctly.

Traced launches (``PROFILE``) record, per program, the time spent quantizing and sending,
sending counts, waiting and packing; ``WAIT_STATS`` adds the time waited per source rank
(:mod:`tritonep.kernels.trace`). Both compile out when off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import e4m3_bits, from_bf16, quantize_groups
from .sync import aligned_ptr, record_timeout, store_release, wait_flag
from .trace import read_clock, write_trace
from .transport import SIGNAL_SET, VIA_STORE, put_block_signal

PHASE_DISPATCH_RECV = tl.constexpr(2)

# Device state counters (int64), shared with the combine kernel module.
DISPATCH_SEND_CALLS = tl.constexpr(0)
DISPATCH_RECV_CALLS = tl.constexpr(1)
DISPATCH_ARRIVALS = tl.constexpr(4)

HEADER_BYTES = tl.constexpr(16)


@triton.jit
def finish_launch(
    state_ptr,
    arrivals,
    send_calls,
    recv_calls,
    c_send,
    c_recv,
    DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr,
):
    """The last program of a launch advances the call counters of the phases it ran."""
    tl.debug_barrier()
    arrived = tl.atomic_add(state_ptr + arrivals, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + arrivals, 0)
        if DO_SEND:
            tl.store(state_ptr + send_calls, c_send + 1)
        if DO_RECV:
            tl.store(state_ptr + recv_calls, c_recv + 1)


@triton.jit
def ll_dispatch_kernel(
    x_ptr,  # [N, H] bf16
    topk_idx_ptr,  # [N, K] int64
    num_tokens,
    peer_ptrs,  # [R] int64 heap base addresses
    rank,
    recv_offset,  # byte offset of buffer set 0 of the receive slabs in the heap
    flag_offset,  # byte offset of buffer set 0 of the count flags
    stage_offset,  # byte offset of the staging slabs [E][M] messages (VIA != VIA_STORE)
    gpus_per_node,  # ranks r and r' share a node when r // gpus_per_node == r' // gpus_per_node
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    state_ptr,  # [8] int64 local call counters
    scratch_ptr,  # [P, 2, M] int32 per-program token lists
    out_x_ptr,  # [E_local, R * M, H] bf16, or the e4m3 output viewed as uint8
    out_scales_ptr,  # [E_local, R * M, G] float32
    out_src_ptr,  # [E_local, R * M] int32
    out_slot_ptr,  # [E_local, R * M] int32 top-k column of each row
    out_count_ptr,  # [E_local] int32
    out_range_ptr,  # [E_local, R] int64
    status_ptr,  # [4] int32
    timeout_ns,
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE), or the clock of WAIT_STATS
    wait_stats_ptr,  # [R] int64 time spent waiting for each source rank (WAIT_STATS)
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    M: tl.constexpr,  # max tokens per rank
    MSG_BYTES: tl.constexpr,
    RECV_SET_BYTES: tl.constexpr,
    FLAG_SET_BYTES: tl.constexpr,
    USE_FP8: tl.constexpr,
    USE_UE8M0: tl.constexpr,
    DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_P2: tl.constexpr,
    G_P2: tl.constexpr,
    MSG_BLOCK: tl.constexpr,
    TOK_BLOCK: tl.constexpr,
    PROFILE: tl.constexpr,
    WAIT_STATS: tl.constexpr,
    VIA: tl.constexpr = VIA_STORE,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    G: tl.constexpr = H // 128
    groups = tl.arange(0, G_P2)
    channels = tl.arange(0, 128)
    gmask = groups < G
    row_offs = groups[:, None] * 128 + channels[None, :]
    row_mask = gmask[:, None]
    c_send = tl.load(state_ptr + DISPATCH_SEND_CALLS, volatile=True)
    c_recv = tl.load(state_ptr + DISPATCH_RECV_CALLS, volatile=True)
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
        set_off = (c_send % 2) * RECV_SET_BYTES
        flag_set_off = (c_send % 2) * FLAG_SET_BYTES
        scratch_tok = scratch_ptr + pid * 2 * M
        scratch_k = scratch_tok + M
        ks = tl.arange(0, K_P2)
        for expert in range(pid, NUM_EXPERTS, num_programs):
            if PROFILE:
                t0 = read_clock(trace_ptr, USE_CLOCK)
            # Number the tokens that chose this expert, in token order.
            count = tl.zeros((), tl.int32)
            for start in range(0, num_tokens, BLOCK_N):
                tokens = start + tl.arange(0, BLOCK_N)
                tmask = tokens < num_tokens
                ids = tl.load(
                    topk_idx_ptr + tokens[:, None] * K + ks[None, :],
                    mask=tmask[:, None] & (ks[None, :] < K),
                    other=-1,
                )
                match = ids == expert
                hit = tl.max(match.to(tl.int32), axis=1)
                first_k = tl.min(tl.where(match, ks[None, :], K_P2), axis=1)
                slot = count + tl.cumsum(hit, axis=0) - hit
                tl.store(scratch_tok + slot, tokens, mask=hit > 0)
                tl.store(scratch_k + slot, first_k, mask=hit > 0)
                count += tl.sum(hit, axis=0)
            tl.debug_barrier()

            owner = expert // E_LOCAL
            local = expert % E_LOCAL
            base = tl.load(peer_ptrs + owner)
            dst_offset = recv_offset + set_off + ((local * NUM_RANKS + rank) * M) * MSG_BYTES
            block = base + dst_offset
            remote = (owner // gpus_per_node) != (rank // gpus_per_node)
            if VIA != VIA_STORE:
                # An owner on another node: build the messages in this rank's staging slab,
                # then put them there in one piece with the count as its signal.
                stage = tl.load(peer_ptrs + rank) + stage_offset
                stage += tl.cast(expert, tl.int64) * (M * MSG_BYTES)
                block = tl.where(remote, stage, block)
            # TOK_BLOCK tokens at a time, so that their loads and stores overlap.
            for first in range(0, count, TOK_BLOCK):
                j = first + tl.arange(0, TOK_BLOCK)
                jmask = j < count
                token = tl.load(scratch_tok + j, mask=jmask, other=0)
                msg = block + j.to(tl.int64) * MSG_BYTES
                header = aligned_ptr(msg, tl.int32)
                tl.store(header, token, mask=jmask)
                tl.store(header + 1, tl.load(scratch_k + j, mask=jmask), mask=jmask)
                mask3 = jmask[:, None, None] & row_mask[None, :, :]
                x_src = x_ptr + token.to(tl.int64)[:, None, None] * H + row_offs[None, :, :]
                x = tl.load(x_src, mask=mask3, other=0.0)
                if USE_FP8:
                    flat_groups = tl.reshape(from_bf16(x, not USE_CLOCK), (TOK_BLOCK * G_P2, 128))
                    q, scale = quantize_groups(flat_groups, USE_UE8M0)
                    q = tl.reshape(e4m3_bits(q, not USE_CLOCK), (TOK_BLOCK, G_P2, 128))
                    q_ptr = aligned_ptr(msg + HEADER_BYTES, tl.uint8)
                    tl.store(q_ptr[:, None, None] + row_offs[None, :, :], q, mask=mask3)
                    scale_ptr = aligned_ptr(msg + HEADER_BYTES + H, tl.float32)
                    scale = tl.reshape(scale, (TOK_BLOCK, G_P2))
                    smask = jmask[:, None] & gmask[None, :]
                    tl.store(scale_ptr[:, None] + groups[None, :], scale, mask=smask)
                else:
                    x_dst = aligned_ptr(msg + HEADER_BYTES, tl.bfloat16)[:, None, None]
                    tl.store(x_dst + row_offs[None, :, :], x, mask=mask3)
            if PROFILE:
                t1 = read_clock(trace_ptr, USE_CLOCK)
            flag = flag_offset + flag_set_off + (local * NUM_RANKS + rank) * 8
            value = ((c_send + 1) << 32) | count.to(tl.int64)
            if VIA == VIA_STORE:
                store_release((base + flag).to(tl.pointer_type(tl.int64)), value)
            else:
                if remote:
                    put_block_signal(
                        tl.load(peer_ptrs + rank), base, dst_offset, block,
                        count.to(tl.int64) * MSG_BYTES, flag, value, SIGNAL_SET,
                        tl.load(pe_ptr + owner), VIA,
                    )  # fmt: skip
                else:
                    store_release((base + flag).to(tl.pointer_type(tl.int64)), value)
            tl.debug_barrier()
            if PROFILE:
                t2 = read_clock(trace_ptr, USE_CLOCK)
                t_quantize_send += t1 - t0
                t_count_send += t2 - t1
        if PROFILE:
            t_send_end = read_clock(trace_ptr, USE_CLOCK)

    if DO_RECV:
        set_off = (c_recv % 2) * RECV_SET_BYTES
        flag_set_off = (c_recv % 2) * FLAG_SET_BYTES
        my_base = tl.load(peer_ptrs + rank)
        msgs = tl.arange(0, MSG_BLOCK)
        flat = tl.arange(0, G_P2 * 128)
        flat_mask = flat < H
        # After one wait gives up, the program's later waits give up at once, so a launch
        # ends within about one timeout however many waits it has.
        budget = timeout_ns + tl.zeros((), tl.int64)
        # One work item per (local expert, source rank): its block starts after the blocks of
        # the earlier sources, whose counts it reads from their flags (in source-rank order,
        # so the output is deterministic and matches the reference).
        for item in range(pid, E_LOCAL * NUM_RANKS, num_programs):
            local = item // NUM_RANKS
            me_src = item % NUM_RANKS
            if PROFILE:
                t0 = read_clock(trace_ptr, USE_CLOCK)
            begin = tl.zeros((), tl.int32)
            count = tl.zeros((), tl.int32)
            for src in range(0, me_src + 1):
                flag = my_base + flag_offset + flag_set_off + (local * NUM_RANKS + src) * 8
                if WAIT_STATS:
                    w0 = read_clock(trace_ptr, USE_CLOCK)
                value, ok = wait_flag(
                    flag.to(tl.pointer_type(tl.int64)), c_recv + 1, budget, USE_CLOCK, SHIFT=32
                )
                if WAIT_STATS:
                    waited = read_clock(trace_ptr, USE_CLOCK) - w0
                    tl.atomic_add(wait_stats_ptr + src, waited, sem="relaxed", scope="gpu")
                budget = tl.where(ok, budget, 0)
                if not ok:
                    record_timeout(status_ptr, src, PHASE_DISPATCH_RECV, local)
                # A timed-out source contributes nothing; the host raises from the status.
                begin += count
                count = tl.where(ok, (value & 0xFFFFFFFF).to(tl.int32), 0)
            if PROFILE:
                t1 = read_clock(trace_ptr, USE_CLOCK)
                t_wait += t1 - t0
            block = (local * NUM_RANKS + me_src) * M * MSG_BYTES
            block = my_base + recv_offset + set_off + block
            # MSG_BLOCK messages at a time, so that their loads are in flight together.
            for first in range(0, count, MSG_BLOCK):
                mmask = (first + msgs) < count
                msg = block + (first + msgs).to(tl.int64) * MSG_BYTES
                rows = (local * NUM_RANKS * M + begin + first + msgs).to(tl.int64)
                header = aligned_ptr(msg, tl.int32)
                token = tl.load(header, mask=mmask, cache_modifier=".cg")
                column = tl.load(header + 1, mask=mmask, cache_modifier=".cg")
                tl.store(out_src_ptr + rows, token, mask=mmask)
                tl.store(out_slot_ptr + rows, column, mask=mmask)
                mask2 = mmask[:, None] & flat_mask[None, :]
                dst = rows[:, None] * H + flat[None, :]
                if USE_FP8:
                    # Bytes move as bytes: out_x_ptr is the e4m3 output viewed as uint8.
                    q_ptr = aligned_ptr(msg + HEADER_BYTES, tl.uint8)
                    q = tl.load(q_ptr[:, None] + flat[None, :], mask=mask2, cache_modifier=".cg")
                    tl.store(out_x_ptr + dst, q, mask=mask2)
                    scale_ptr = aligned_ptr(msg + HEADER_BYTES + H, tl.float32)
                    smask = mmask[:, None] & gmask[None, :]
                    scale_src = scale_ptr[:, None] + groups[None, :]
                    scale = tl.load(scale_src, mask=smask, cache_modifier=".cg")
                    tl.store(
                        out_scales_ptr + rows[:, None] * G + groups[None, :], scale, mask=smask
                    )
                else:
                    x_src = aligned_ptr(msg + HEADER_BYTES, tl.bfloat16)[:, None] + flat[None, :]
                    x = tl.load(x_src, mask=mask2, cache_modifier=".cg")
                    tl.store(out_x_ptr + dst, x, mask=mask2)
            packed = (begin.to(tl.int64) << 32) | count
            tl.store(out_range_ptr + local * NUM_RANKS + me_src, packed)
            if me_src == NUM_RANKS - 1:
                tl.store(out_count_ptr + local, begin + count)
            if PROFILE:
                t_pack += read_clock(trace_ptr, USE_CLOCK) - t1

    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(
            trace_ptr, t_start, t_send_end, t_end, t_quantize_send, t_count_send, t_wait,
            t_pack, 0,
        )  # fmt: skip
    finish_launch(
        state_ptr,
        DISPATCH_ARRIVALS,
        DISPATCH_SEND_CALLS,
        DISPATCH_RECV_CALLS,
        c_send,
        c_recv,
        DO_SEND,
        DO_RECV,
    )
