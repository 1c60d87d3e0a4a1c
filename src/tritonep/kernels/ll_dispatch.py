"""Low-latency dispatch: quantize each token on the fly and store it straight into the owner's slot.

Send phase, token-major. Program ``p`` owns a contiguous run of tokens. It first counts (atomic
adds into its own scratch row for a few ids, histograms for many) the tokens per expert of the
whole batch and of the tokens before its run, so it knows the slot of each of its tokens in each
expert's block without asking any other program: slots follow token order (a token that names an
expert twice is sent there once). Then, per token, it loads the row once, quantizes it once (FP8
e4m3 per 128 channels, or keeps BF16) and stores one message per distinct expert into the owner's
receive slab ``[local_expert][source_rank][slot]`` with plain NVLink stores: a 16-byte header
(token index, top-k column, payload reference), the payload and the scales. The payload crosses to
an owner once, however many of its experts the token chose: the token's first message to that owner
carries it, its other messages there are headers whose reference names that message (its index in
the owner's buffer set; a carrier names itself).

Counts. Each program adds the messages it stored for each expert to a per-expert counter (release).
The program whose add brings an expert to its total publishes that expert's count with a
system-scope release of ``call << 32 | count`` on the owner's flag; an expert that no token chose
gets its zero count from program ``e % S`` (``S`` programs have tokens, at least one). No program
ever waits for another in this phase. The call number tags the flag value, so a stale count of an
earlier call is never mistaken for a new one and no flag needs resetting between calls.

Receive phase. Work items are (local expert, source rank) pairs, spread over the programs.
An item waits (bounded) for the counts of its source and of the earlier sources (one read of
all their flags, repeated until they are there), so its block starts at ``begin`` = the sum of
the earlier counts; it copies its messages' payloads (found through their references), several
at a time, into the packed output ``recv_x[expert, begin : begin + count]`` and records
``(begin, count)``. Blocks are therefore in source-rank order, the same order as the reference,
and outputs are deterministic. A program takes ``ITEMS`` of its items at a time: for small
batches, whose counts all come at once, its items together (one wait, their messages in one
list: the dependent reads of counts, headers and payloads are paid once); for larger ones one at
a time, so that it packs one while the next one's counts are still on the way.

Across nodes (``VIA`` other than ``VIA_STORE``), messages for an owner on another node are
built in this rank's staging slab ``[expert][slot]`` instead; the program that publishes the
expert's count moves the block in one put whose signal is the count
(:mod:`tritonep.kernels.transport`). Owners on this node still get plain stores.

Why it is fast: one launch, no host synchronization, no count exchange before the data (the count
follows the data on the same path), a token's payload crosses NVLink once per destination rank
rather than once per expert (at top-8 over 256 experts on 4 ranks, 2.7 payloads a token instead of
6), and every token is read and quantized once however many experts it goes to (quantizing, whose
quotients must round as IEEE division does, is the costly part of a token's send; an expert-major
send repeats it top-k times per token). Slot numbering follows token order, not the order of any
atomic (counting adds commute), so outputs are deterministic. Messages to owners on other nodes
(staged, then put per expert block) each carry their payload.

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
from .peer_mask import mask_timed_out, masked, wait_peer
from .sync import aligned_ptr, any_set, lane, limit_ns, record_timeout, wait_tile
from .trace import read_clock, write_trace
from .transport import SIGNAL_SET, VIA_STORE, put_block_signal

PHASE_DISPATCH_RECV = tl.constexpr(2)

# Device state (int64), shared with the combine kernel module: row ``r`` of ``[8, P]``. The
# call counters are per program (program ``p`` keeps its own in column ``p``): a program reads
# its counter at its start and writes the next value at its end, and only the same program of
# the next launch reads it again, so no program waits on another to advance it. Counting the
# programs of a launch (an atomic per program at its end, ~0.9 us more per launch on one H100,
# BENCHMARKS.md) is left to shrink mode, whose last program settles the verdicts.
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


@triton.jit
def call_number(state_ptr, calls):
    """This program's call counter of row ``calls``: the launches of that phase before this one."""
    return tl.load(state_ptr + calls * tl.num_programs(0) + tl.program_id(0), volatile=True)


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
    ARRIVE: tl.constexpr,
):
    """Advance this program's call counters of the phases it ran.

    With ``ARRIVE``, also counts the programs that got here and returns whether this one is
    the last (every other program's work is done); without, returns False."""
    num_programs = tl.num_programs(0)
    column = tl.program_id(0)
    tl.debug_barrier()  # every thread of the program has read its counter long before
    if DO_SEND:
        tl.store(state_ptr + send_calls * num_programs + column, c_send + 1)
    if DO_RECV:
        tl.store(state_ptr + recv_calls * num_programs + column, c_recv + 1)
    last = False
    if ARRIVE:
        arrived = tl.atomic_add(state_ptr + arrivals * num_programs, 1, sem="acq_rel",
                                scope="gpu")  # fmt: skip
        last = arrived == num_programs - 1
        if last:
            tl.store(state_ptr + arrivals * num_programs, 0)
    return last


@triton.jit
def first_choices(ids, ks, K: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Which of ``[T, K_P2]`` top-k ids get a message: ids of an expert that no earlier
    column of the same row names (a token that names an expert twice is sent once)."""
    valid = (ids >= 0) & (ids < NUM_EXPERTS) & (ks[None, :] < K)
    for j in tl.static_range(K - 1):
        column = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
        valid = valid & ~((ids == column[:, None]) & (ks[None, :] > j))
    return valid


@triton.jit
def _listed(m, starts, ends, begin, local, src, item_lanes, NUM_RANKS: tl.constexpr,
            M: tl.constexpr):  # fmt: skip
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
    return (m_local * NUM_RANKS + m_src) * M + slot, row, m_local


@triton.jit(do_not_specialize=["num_tokens", "timeout_us"])
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
    state_ptr,  # [STATE_ROWS, P] int64 call counters per program (and shrink's arrivals)
    scratch_ptr,  # [P, 3 * BINS + TOKEN_WORDS] int32 per-program slot counters and lists
    expert_done_ptr,  # [BINS] int32 messages stored per expert in this launch, zero between
    out_x_ptr,  # [E_local, R * M, H] bf16, or the e4m3 output viewed as uint8
    out_scales_ptr,  # [E_local, G, R * M] float32, or [E_local, G / 4, R * M] int32 as bytes
    out_src_ptr,  # [E_local, R * M] int32
    out_slot_ptr,  # [E_local, R * M] int32 top-k column of each row
    out_count_ptr,  # [E_local] int32
    out_range_ptr,  # [E_local, R] int64
    status_ptr,  # [STATUS_WORDS] int32
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    trace_ptr,  # [P * SLOTS + 1] int64 readings (PROFILE), or the clock of WAIT_STATS
    wait_stats_ptr,  # [R] int64 time spent waiting for each source rank (WAIT_STATS)
    mask_ptr,  # [R] int32 masked peers (SHRINK)
    verdict_ptr,  # [R] int64 this launch's verdict on each source rank (SHRINK)
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
    PACK_UE8M0: tl.constexpr,  # scales as exponent bytes, four to an int32 (implies USE_UE8M0)
    DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COUNT_BY_ADDS: tl.constexpr,  # count the ids by atomic adds, else by histograms
    K_P2: tl.constexpr,
    G_P2: tl.constexpr,
    R_P2: tl.constexpr,  # power of two >= NUM_RANKS
    BINS: tl.constexpr,  # power of two >= max(NUM_EXPERTS, 2): one bin per expert
    MSG_BLOCK: tl.constexpr,
    ITEMS: tl.constexpr,  # work items a receiving program moves together (power of two)
    PROFILE: tl.constexpr,
    WAIT_STATS: tl.constexpr,
    SHRINK: tl.constexpr = False,  # masked peers are skipped, timeouts mask (peer_mask)
    VIA: tl.constexpr = VIA_STORE,
    ONE_TOKEN: tl.constexpr = False,  # num_tokens == 1, known when compiling
):
    # The batch size is not specialized (a decode step's batch changes from step to step, and
    # a compile inside a call keeps every peer waiting), except for one token: a send whose
    # loops and masks fold away is 0.6 us faster (8.1 against 8.8 us on one H100, BENCHMARKS.md).
    if ONE_TOKEN:
        num_tokens = 1
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    G: tl.constexpr = H // 128
    groups = tl.arange(0, G_P2)
    channels = tl.arange(0, 128)
    gmask = groups < G
    row_offs = groups[:, None] * 128 + channels[None, :]
    row_mask = gmask[:, None]
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
        set_off = (c_send % 2) * RECV_SET_BYTES
        flag_set_off = (c_send % 2) * FLAG_SET_BYTES
        if PROFILE:
            t0 = read_clock(trace_ptr, USE_CLOCK)
        ks = tl.arange(0, K_P2)
        experts = tl.arange(0, BINS)
        my_base = tl.load(peer_ptrs + rank)
        # This program's tokens: a contiguous run, so that slots follow token order.
        per_program = tl.cdiv(num_tokens, num_programs)
        first_token = tl.minimum(pid * per_program, num_tokens)
        last_token = tl.minimum(first_token + per_program, num_tokens)
        expert_owners = experts // E_LOCAL
        owner_bases = tl.load(peer_ptrs + expert_owners, mask=experts < NUM_EXPERTS, other=0)
        if SHRINK:  # experts of masked peers are chosen by no token: no message, no count
            expert_dead = masked(mask_ptr, expert_owners, experts < NUM_EXPERTS)
        # Tokens per expert, of the whole batch and of the tokens before this program's. Few
        # ids: one atomic add per chosen id into this program's scratch row (the batch's count
        # in the low word of tally[e], the earlier tokens' in the high word), as many adds as
        # ids. Many ids: two histograms, whose cost (~0.9 us each for 256 bins) does not grow
        # with the ids but which all programs' adds together exceed beyond ~32K adds (one H100,
        # top-8: adds save 1.0 us at 1-32 tokens, cost 0.2-0.7 us more at 128-256). Programs
        # without tokens count nothing; the programs with tokens publish the zero counts.
        next_slot = scratch_ptr + pid * (3 * BINS + TOKEN_WORDS)
        tally = next_slot.to(tl.pointer_type(tl.int64))
        senders = tl.maximum(tl.cdiv(num_tokens, tl.maximum(per_program, 1)), 1)
        total = tl.zeros((BINS,), tl.int32)
        before = tl.zeros((BINS,), tl.int32)
        # The first token's row is loaded now, so that its memory latency passes while the
        # ids are counted; each token's send then loads the next one's. Past the program's run
        # no group is loaded. (The mask is a tile compare, not `row_mask & scalar`: Triton
        # 3.9's interpreter splats a scalar comparison as int32, which no mask accepts.)
        x_next = tl.load(
            x_ptr + tl.cast(first_token, tl.int64) * H + row_offs,
            mask=(groups < tl.where(first_token < last_token, G, 0))[:, None],
            other=0.0,
        )
        if COUNT_BY_ADDS:
            tl.store(tally + experts, tl.zeros((BINS,), tl.int64))
            tl.debug_barrier()
        for start in range(0, tl.where(pid < senders, num_tokens, 0), BLOCK_N):
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
            if COUNT_BY_ADDS:
                tl.atomic_add(tally + tl.where(chosen, ids, 0),
                              tl.where(earlier, (1 << 32) + 1, 1), mask=chosen, sem="relaxed",
                              scope="cta")  # fmt: skip
            else:
                binned = tl.reshape(tl.where(chosen, ids, 0).to(tl.int32), (BLOCK_N * K_P2,))
                total += tl.histogram(binned, BINS, mask=tl.reshape(chosen, (BLOCK_N * K_P2,)))
                before += tl.histogram(binned, BINS, mask=tl.reshape(earlier, (BLOCK_N * K_P2,)))
        if COUNT_BY_ADDS:  # (the load waits for the adds: a round trip to the L2)
            tl.debug_barrier()
            tallied = tl.load(tally + experts, cache_modifier=".cg")
            total = tallied.to(tl.int32)
            before = (tallied >> 32).to(tl.int32)
            tl.debug_barrier()
        # next_slot[e]: the slot of this program's next token for expert e.
        dests = (next_slot + 3 * BINS).to(tl.pointer_type(tl.int64))
        keys = next_slot + 3 * BINS + 32
        indexes = keys + 16
        refs = indexes + 16
        # A token's columns as a [column k, column j] tile, for finding each column's payload.
        col_k = ks[:, None] + 0 * ks[None, :]
        col_j = ks[None, :] + 0 * ks[:, None]
        tl.store(next_slot + experts, before)
        tl.debug_barrier()
        for token in range(first_token, last_token):
            ids = tl.load(topk_idx_ptr + tl.cast(token, tl.int64) * K + ks, mask=ks < K, other=-1)
            valid = tl.reshape(first_choices(ids[None, :], ks, K, NUM_EXPERTS), (K_P2,))
            if SHRINK:
                valid = valid & ~masked(mask_ptr, ids // E_LOCAL, valid)
            ids = tl.where(valid, ids, 0).to(tl.int32)
            slots = tl.load(next_slot + ids, mask=valid, other=0)
            tl.debug_barrier()
            tl.store(next_slot + ids, slots + 1, mask=valid)
            # Quantize the token once, then store it to each of its experts.
            x = x_next
            x_next = tl.load(
                x_ptr + tl.cast(token + 1, tl.int64) * H + row_offs,
                mask=(groups < tl.where(token + 1 < last_token, G, 0))[:, None],
                other=0.0,
            )
            if USE_FP8:
                q, scale = quantize_groups(from_bf16(x, not USE_CLOCK), USE_UE8M0, not USE_CLOCK)
                q = e4m3_bits(q, not USE_CLOCK)
            # Where each message goes, computed for all columns at once; then one message per
            # column, its address read back (scalar loads, no cross-warp reductions).
            owners = ids // E_LOCAL
            msgs = tl.load(peer_ptrs + owners, mask=valid, other=0) + recv_offset + set_off
            msgs += (((ids % E_LOCAL) * NUM_RANKS + rank) * M).to(tl.int64) * MSG_BYTES
            if VIA != VIA_STORE:
                # An owner on another node: the message goes to this rank's staging slab,
                # whose block of the expert is put there once the block is complete.
                far = (owners // gpus_per_node) != (rank // gpus_per_node)
                staged = my_base + stage_offset + ids.to(tl.int64) * (M * MSG_BYTES)
                msgs = tl.where(far, staged, msgs)
            msgs += slots.to(tl.int64) * MSG_BYTES
            tl.store(dests + ks, tl.where(valid, msgs, 0), mask=ks < K)
            # The payload crosses to an owner once: the first column of each owner reached
            # by stores carries it, the owner's other columns only a header that names that
            # message (index in the owner's buffer set). Staged messages all carry it. The
            # [column, earlier column] tile is read back from the scratch row: built from
            # the vectors in registers it takes two layout changes, which cost more.
            key = tl.where(valid, owners, -1)
            if VIA != VIA_STORE:
                key = tl.where(far, -1, key)
            tl.store(keys + ks, key)
            tl.store(indexes + ks, ((ids % E_LOCAL) * NUM_RANKS + rank) * M + slots)
            tl.debug_barrier()
            key_k = tl.load(keys + col_k)
            same = ((tl.load(keys + col_j) == key_k) & (key_k >= 0)) | (col_j == col_k)
            first = tl.min(tl.where(same, col_j, K_P2), axis=1)
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
                        q_ptr = aligned_ptr(msg + HEADER_BYTES, tl.uint8)
                        tl.store(q_ptr + row_offs, q, mask=row_mask)
                        scale_ptr = aligned_ptr(msg + HEADER_BYTES + H, tl.float32)
                        tl.store(scale_ptr + groups, scale, mask=gmask)
                    else:
                        x_dst = aligned_ptr(msg + HEADER_BYTES, tl.bfloat16)
                        tl.store(x_dst + row_offs, x, mask=row_mask)
            tl.debug_barrier()
        if PROFILE:
            t1 = read_clock(trace_ptr, USE_CLOCK)
        # Count this program's messages as stored. The program whose add completes an expert
        # (brings its count to the total) publishes the count; program e % senders publishes the
        # zero count of an expert that no token chose. Nothing waits here. The counters are
        # this GPU's, so GPU scope suffices: release/acquire orderings compose, and the
        # publisher's system-scope release then orders every program's messages before the
        # count for the owner (a system-scope add here costs ~0.6 us more per launch).
        mine = tl.load(next_slot + experts) - before
        tl.debug_barrier()
        done = tl.atomic_add(expert_done_ptr + experts, mine, mask=mine > 0, sem="acq_rel",
                             scope="gpu")  # fmt: skip
        completed = (mine > 0) & (done + mine == total)
        tl.store(expert_done_ptr + experts, 0, mask=completed)  # ready for the next call
        publish = completed | ((total == 0) & (experts % senders == pid) & (experts < NUM_EXPERTS))
        if SHRINK:
            publish = publish & ~expert_dead
        flags = flag_offset + flag_set_off + ((experts % E_LOCAL) * NUM_RANKS + rank) * 8
        values = ((c_send + 1) << 32) | total.to(tl.int64)
        nearby = publish
        if VIA != VIA_STORE:
            nearby = publish & ((expert_owners // gpus_per_node) == (rank // gpus_per_node))
        peer_base = tl.where(nearby, owner_bases, 0)
        tl.debug_barrier()
        tl.atomic_xchg((peer_base + flags).to(tl.pointer_type(tl.int64)), values, mask=nearby,
                       sem="release", scope="sys")  # fmt: skip
        if VIA != VIA_STORE:
            # Experts on other nodes: one put of the staged block each, the count its signal.
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
                    my_base, tl.load(peer_ptrs + owner),
                    recv_offset + set_off + ((local * NUM_RANKS + rank) * M) * MSG_BYTES,
                    my_base + stage_offset + expert.to(tl.int64) * (M * MSG_BYTES),
                    count.to(tl.int64) * MSG_BYTES,
                    flag_offset + flag_set_off + (local * NUM_RANKS + rank) * 8,
                    ((c_send + 1) << 32) | count.to(tl.int64), SIGNAL_SET,
                    tl.load(pe_ptr + owner), VIA,
                )  # fmt: skip
        tl.debug_barrier()
        if PROFILE:
            t_send_end = read_clock(trace_ptr, USE_CLOCK)
            t_quantize_send += t1 - t0
            t_count_send += t_send_end - t1

    if DO_RECV:
        set_off = (c_recv % 2) * RECV_SET_BYTES
        flag_set_off = (c_recv % 2) * FLAG_SET_BYTES
        my_base = tl.load(peer_ptrs + rank)
        set_base = my_base + recv_offset + set_off
        msgs = tl.arange(0, MSG_BLOCK)
        sources = tl.arange(0, R_P2)
        item_lanes = tl.arange(0, ITEMS)
        scale_lanes = tl.arange(0, G_P2 * MSG_BLOCK)
        flat = tl.arange(0, G_P2 * 128)
        flat_mask = flat < H
        # After one wait gives up, the program's later waits give up at once, so a launch
        # ends within about one timeout however many waits it has.
        budget = timeout_us.to(tl.int64) * 1000
        # Work items are (local expert, source rank) pairs; a block starts after the blocks of
        # the earlier sources, whose counts it reads from their flags (in source-rank order,
        # so the output is deterministic and matches the reference). A program takes its
        # items ITEMS at a time and moves them as one: one wait for all their counts, then
        # their messages together, so the dependent reads (counts, headers, payloads) are
        # paid once per group rather than once per item.
        for group in range(0, tl.cdiv(E_LOCAL * NUM_RANKS, num_programs), ITEMS):
            items = pid + (group + item_lanes) * num_programs
            live = items < E_LOCAL * NUM_RANKS
            local = tl.where(live, items // NUM_RANKS, 0)
            me_src = tl.where(live, items % NUM_RANKS, 0)
            if PROFILE:
                t0 = read_clock(trace_ptr, USE_CLOCK)
            flag_rows = my_base + flag_offset + flag_set_off + local * NUM_RANKS * 8
            if SHRINK:  # shrink mode settles each source's outcome with the other programs
                begin = tl.zeros((ITEMS,), tl.int32)
                count = tl.zeros((ITEMS,), tl.int32)
                for j in tl.static_range(ITEMS):
                    item_begin = tl.zeros((), tl.int32)
                    item_count = tl.zeros((), tl.int32)
                    item_live = lane(live.to(tl.int32), item_lanes, j) != 0
                    item_src = tl.where(item_live, lane(me_src, item_lanes, j), -1)
                    item_row = lane(flag_rows, item_lanes, j)
                    for src in range(0, item_src + 1):
                        timeout_ns = limit_ns(timeout_us, status_ptr)
                        flag = (item_row + src * 8).to(tl.pointer_type(tl.int64))
                        if WAIT_STATS:
                            w0 = read_clock(trace_ptr, USE_CLOCK)
                        value, ok = wait_peer(flag, c_recv + 1, timeout_ns,
                                              tl.load(mask_ptr + src) != 0, verdict_ptr + src,
                                              c_recv + 1, USE_CLOCK, SHIFT=32)  # fmt: skip
                        if WAIT_STATS:
                            waited = read_clock(trace_ptr, USE_CLOCK) - w0
                            tl.atomic_add(wait_stats_ptr + src, waited, sem="relaxed",
                                          scope="gpu")  # fmt: skip
                        # A source given up on contributes nothing (it is masked at the end).
                        item_begin += item_count
                        item_count = tl.where(ok, (value & 0xFFFFFFFF).to(tl.int32), 0)
                    begin = tl.where(item_lanes == j, item_begin, begin)
                    count = tl.where(item_lanes == j, item_count, count)
            else:
                # Every count of the group in one vector read, usually all there; else the
                # read repeats (bounded) until they are.
                wanted = live[:, None] & (sources[None, :] <= me_src[:, None])
                count_flags = (flag_rows[:, None] + sources[None, :] * 8).to(
                    tl.pointer_type(tl.int64))  # fmt: skip
                tagged, missing, waited, limit = wait_tile(
                    count_flags, wanted, c_recv + 1, budget, timeout_us, status_ptr, USE_CLOCK,
                    SHIFT=32, TIMED=WAIT_STATS,
                )  # fmt: skip
                if any_set(missing):
                    # Name the first (item, source) still missing; it contributes nothing.
                    lanes = item_lanes[:, None] * R_P2 + sources[None, :]
                    gone = tl.min(tl.min(tl.where(missing, lanes, ITEMS * R_P2), axis=1), 0)
                    record_timeout(status_ptr, gone % R_P2, PHASE_DISPATCH_RECV, limit,
                                   lane(local, item_lanes, gone // R_P2))  # fmt: skip
                    budget = budget * 0
                if WAIT_STATS:  # the time until each source's counts were all there
                    tl.atomic_add(wait_stats_ptr + sources, tl.max(waited, axis=0),
                                  mask=tl.max(wanted.to(tl.int32), axis=0) > 0, sem="relaxed",
                                  scope="gpu")  # fmt: skip
                counts = tl.where(wanted & ~missing, (tagged & 0xFFFFFFFF).to(tl.int32), 0)
                begin = tl.sum(tl.where(sources[None, :] < me_src[:, None], counts, 0), axis=1)
                count = tl.sum(tl.where(sources[None, :] == me_src[:, None], counts, 0), axis=1)
            if PROFILE:
                t1 = read_clock(trace_ptr, USE_CLOCK)
                t_wait += t1 - t0
            count = tl.where(live, count, 0)
            # The group's messages as one list: item j's come after those of items < j.
            ends = tl.cumsum(count, axis=0)
            starts = ends - count
            group_msgs = tl.sum(count, axis=0)
            for first in range(0, group_msgs, MSG_BLOCK):
                m = first + msgs
                mmask = m < group_msgs
                index, row_in, m_local = _listed(m, starts, ends, begin, local, me_src,
                                                 item_lanes, NUM_RANKS, M)  # fmt: skip
                msg = set_base + index.to(tl.int64) * MSG_BYTES
                rows = (m_local * NUM_RANKS * M + row_in).to(tl.int64)
                header = aligned_ptr(msg, tl.int32)
                source_token = tl.load(header, mask=mmask, cache_modifier=".cg")
                column = tl.load(header + 1, mask=mmask, cache_modifier=".cg")
                # The message that carries the payload (this one, or the first message of
                # the same token to this rank, for another expert).
                ref = tl.load(header + 2, mask=mmask, other=0, cache_modifier=".cg")
                payload = set_base + ref.to(tl.int64) * MSG_BYTES + HEADER_BYTES
                tl.store(out_src_ptr + rows, source_token, mask=mmask)
                tl.store(out_slot_ptr + rows, column, mask=mmask)
                mask2 = mmask[:, None] & flat_mask[None, :]
                dst = rows[:, None] * H + flat[None, :]
                if USE_FP8:
                    # Bytes move as bytes: out_x_ptr is the e4m3 output viewed as uint8.
                    q_ptr = aligned_ptr(payload, tl.uint8)
                    q = tl.load(q_ptr[:, None] + flat[None, :], mask=mask2, cache_modifier=".cg")
                    tl.store(out_x_ptr + dst, q, mask=mask2)
                    # Scales go column-major per expert (the row index fastest), the layout
                    # TMA-based grouped GEMMs read. One lane per (group, message), messages
                    # fastest, so neighbouring lanes store neighbouring rows of one group; a
                    # [messages, groups] tile costs a layout change through shared memory
                    # (1.2 us more per dispatch at 128 tokens, BENCHMARKS.md).
                    s_m = first + scale_lanes % MSG_BLOCK
                    s_group = scale_lanes // MSG_BLOCK
                    s_mask = (s_group < G) & (s_m < group_msgs)
                    s_index, s_row, s_local = _listed(s_m, starts, ends, begin, local, me_src,
                                                      item_lanes, NUM_RANKS, M)  # fmt: skip
                    s_header = aligned_ptr(set_base + s_index.to(tl.int64) * MSG_BYTES, tl.int32)
                    s_ref = tl.load(s_header + 2, mask=s_mask, other=0, cache_modifier=".cg")
                    s_src = set_base + s_ref.to(tl.int64) * MSG_BYTES + HEADER_BYTES + H
                    scale = tl.load(aligned_ptr(s_src, tl.float32) + s_group, mask=s_mask,
                                    cache_modifier=".cg")  # fmt: skip
                    row = s_row.to(tl.int64)
                    if PACK_UE8M0:
                        # A power-of-two float32 scale is its exponent byte; byte g % 4 of
                        # int32 column g // 4 (out_scales_ptr is that int32 tensor as bytes).
                        e8 = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
                        s_column = s_local * ((G + 3) // 4) + s_group // 4
                        dst_s = (s_column * (NUM_RANKS * M) + row) * 4 + s_group % 4
                        tl.store(out_scales_ptr + dst_s, e8, mask=s_mask)
                    else:
                        s_column = s_local * G + s_group
                        tl.store(out_scales_ptr + s_column * (NUM_RANKS * M) + row, scale,
                                 mask=s_mask)  # fmt: skip
                else:
                    x_src = aligned_ptr(payload, tl.bfloat16)[:, None] + flat[None, :]
                    x = tl.load(x_src, mask=mask2, cache_modifier=".cg")
                    tl.store(out_x_ptr + dst, x, mask=mask2)
            packed = (begin.to(tl.int64) << 32) | count
            tl.store(out_range_ptr + local * NUM_RANKS + me_src, packed, mask=live)
            tl.store(out_count_ptr + local, begin + count, mask=live & (me_src == NUM_RANKS - 1))
            if PROFILE:
                t_pack += read_clock(trace_ptr, USE_CLOCK) - t1

    if PROFILE:
        t_end = read_clock(trace_ptr, USE_CLOCK)
        write_trace(
            trace_ptr, t_start, t_send_end, t_end, t_quantize_send, t_count_send, t_wait,
            t_pack, 0, USE_CLOCK,
        )  # fmt: skip
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
