"""Normal-mode notify: every rank learns how many tokens each peer sends it, per channel and expert.

The count exchange that comes before the payload. Program ``p`` counts the tokens of each
channel (a contiguous token range) that go to rank ``p`` and stores those counts, with the
number of top-k entries for each of ``p``'s experts, into ``p``'s notify row for this rank,
encoded ``-n - 1`` so that zero always means "not arrived yet". It then waits (bounded) for
the row that rank ``p`` stored here, decodes it and zeroes it for a later call. The last
program to arrive turns the rows of all sources into the receiver's layout:

* ``recv_count[s, c]``: tokens that channel ``c`` of source ``s`` sends here;
* ``recv_start[s, c]``: the first output row of that stream, so that rows come ordered by
  source rank, then by channel (hence by source token index);
* ``host_info = [total rows, tokens per local expert rounded up to the alignment...]``, the
  only numbers the host reads in exact mode.

Two options serve the relay across nodes (:mod:`tritonep.modes.internode`): the per-channel
counts may be given instead of counted (``COUNTS_GIVEN``: a relay knows what it will forward
before its rows arrive), and a row may carry ``EXTRA`` more words per peer (``extra_ptr`` sent,
``extra_out_ptr`` received), with which a source tells the relay what to forward where.
``CHANNEL_MAJOR`` lays the received rows out channel by channel (then by source), so that each
channel's rows are one contiguous range.

The exchange itself is :func:`count_exchange`, which a program runs for one peer or several:
:func:`notify_kernel` runs it for one peer per program; a worst-case first dispatch (no host
read between the counts and the rows) runs it in its senders, one launch fewer, and its
receivers wait for the layout (:func:`await_counts`). An exact-size notify (``HOST_COPY``) also
writes the total, the counts per local expert, the rows from each source and the most tokens
any rank dispatched (each row carries its source's token count) into page-locked host words,
then a flag, which the host polls instead of copying the counts back.

Why it is cheap: one small launch of ``R`` programs, a few hundred bytes per peer, no atomics
on data. Rows alternate between two sets by call parity; a rank can only store into a set
again after every peer has finished the call that last read it, so the zeroing never races.
Token counts, the alignment and the output size are run-time values: a new batch compiles
nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .phases import NOTIFY
from .status import fence_system
from .sync import STATUS_OVERFLOW, elapsed_ns, keep_waiting, limit_ns, record_timeout, start_clock
from .trace import read_clock, trace_role
from .transport import VIA_STORE, put_block

# Device state counters (int64) of the normal mode.
NOTIFY_CALLS = tl.constexpr(0)
NOTIFY_ARRIVALS = tl.constexpr(1)
#: The tag of the last count exchange whose layout is out, in a launch that waits for it
#: (the dispatch's call number + 1: :func:`await_counts`).
NOTIFY_READY = tl.constexpr(6)
#: The host address of the words an exact-size notify writes for the host (``HOST_COPY``):
#: ``[written flag, rows received, aligned tokens per local expert..., rows from each
#: source..., the most tokens any rank dispatched]`` int32, page-locked.
HOST_COUNTS = tl.constexpr(7)


#: Warps of a notify launch.
NOTIFY_WARPS = 4


def row_block(words: int, warps: int) -> int:
    """``BLOCK_ROW`` of a launch of ``warps`` warps whose notify rows use ``words`` words: a
    power of two of at least one word a thread, so that no word is read by several threads
    and the wait's reductions span every warp (:func:`notify_receive`)."""
    return max(triton.next_power_of_2(words), 32 * warps)


class NotifyCall(NamedTuple):
    """The leading runtime arguments of :func:`notify_kernel`: what changes per call."""

    counts_ptr: object
    num_tokens: int
    per_expert_ptr: object
    extra_ptr: object
    alignment: int
    max_rows: int
    recv_count_ptr: object
    recv_start_ptr: object
    host_info_ptr: object
    extra_out_ptr: object
    trace_ptr: object


class NotifyVariant(NamedTuple):
    """One compiled variant of :func:`notify_kernel`: its constexprs, in order."""

    NUM_RANKS: int
    NUM_CHANNELS: int
    E_LOCAL: int
    ROW_WORDS: int
    SET_BYTES: int
    NOTIFY_OFFSET: int
    STAGE_OFFSET: int
    EXTRA: int
    COUNTS_GIVEN: bool
    CHANNEL_MAJOR: bool
    HOST_COPY: bool
    USE_CLOCK: bool
    BLOCK_TOKENS: int
    BLOCK_CHANNELS: int
    BLOCK_EXPERTS: int
    BLOCK_RANKS: int
    BLOCK_EXTRA: int
    BLOCK_ROW: int
    PROFILE: bool
    VIA: int


@triton.jit
def channel_counts(
    counts_ptr,  # [N, R] bool is_token_in_rank, or [R, C] int32 counts (COUNTS_GIVEN)
    num_tokens,  # N, tokens of this rank
    peer,  # the destination rank counted for
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    COUNTS_GIVEN: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    """``[BLOCK_CHANNELS]`` tokens of each channel that go to rank ``peer`` (lanes past the
    channels hold junk): counted from ``is_token_in_rank``, or read where they are given."""
    channels = tl.arange(0, BLOCK_CHANNELS)
    if COUNTS_GIVEN:
        given = counts_ptr.to(tl.pointer_type(tl.int32)) + peer * NUM_CHANNELS
        counts = tl.load(given + channels, mask=channels < NUM_CHANNELS, other=0)
    else:
        in_rank = counts_ptr.to(tl.pointer_type(tl.int8))
        chunk = tl.maximum(tl.cdiv(num_tokens, NUM_CHANNELS), 1)
        counts = tl.zeros((BLOCK_CHANNELS,), tl.int32)
        for first in range(0, num_tokens, BLOCK_TOKENS):
            tokens = first + tl.arange(0, BLOCK_TOKENS)
            hit = tl.load(
                in_rank + tokens.to(tl.int64) * NUM_RANKS + peer, mask=tokens < num_tokens, other=0
            )
            # The last bin (past every channel) collects the tokens that go elsewhere.
            counts += tl.histogram(
                tl.where(hit != 0, tokens // chunk, BLOCK_CHANNELS - 1), BLOCK_CHANNELS
            )
    return counts


@triton.jit
def notify_send(
    counts,  # [BLOCK_CHANNELS] int32 tokens of each channel for peer
    num_tokens,  # N, this rank's tokens (the row's last word)
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank
    extra_ptr,  # [R, EXTRA] int32 sent to each peer (EXTRA > 0)
    peer,  # the destination rank
    rank,  # this rank
    row_offset,  # heap byte offset of this rank's row in peer's heap
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    NUM_CHANNELS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    EXTRA: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
    BLOCK_EXTRA: tl.constexpr,
    VIA: tl.constexpr,
):
    """Store this rank's row for ``peer`` (channel counts, expert entries, extra words, this
    rank's token count, each ``-n - 1``) at ``row_offset`` of ``peer``'s heap, directly or
    staged and put. No flag: the receiver waits for every word to be non-zero."""
    channels = tl.arange(0, BLOCK_CHANNELS)
    experts = tl.arange(0, BLOCK_EXPERTS)
    xs = tl.arange(0, BLOCK_EXTRA)
    peer_base = tl.load(peer_ptrs + peer)
    row = peer_base + row_offset
    if VIA != VIA_STORE:  # staged in this rank's heap, then put into the peer's row
        row = tl.load(peer_ptrs + rank) + STAGE_OFFSET + peer * ROW_WORDS * 4
    words = row.to(tl.pointer_type(tl.int32))
    tl.store(words + channels, -counts - 1, mask=channels < NUM_CHANNELS)
    entries = tl.load(per_expert_ptr + peer * E_LOCAL + experts, mask=experts < E_LOCAL)
    tl.store(words + NUM_CHANNELS + experts, -entries - 1, mask=experts < E_LOCAL)
    if EXTRA > 0:
        more = tl.load(extra_ptr + peer * EXTRA + xs, mask=xs < EXTRA)
        tl.store(words + NUM_CHANNELS + E_LOCAL + xs, -more - 1, mask=xs < EXTRA)
    tl.store(words + NUM_CHANNELS + E_LOCAL + EXTRA, tl.zeros((), tl.int32) - num_tokens - 1)
    if VIA != VIA_STORE:
        put_block(
            tl.load(peer_ptrs + rank),
            peer_base,
            row_offset,
            row,
            ROW_WORDS * 4,
            tl.load(pe_ptr + peer),
            VIA,
        )


@triton.jit
def notify_receive(
    my_row,  # *int32 the row of source peer in this rank's heap
    peer,  # the source rank
    timeout_ns,  # int64 limit of the wait
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    recv_count_ptr,  # [R, C] int32 out: tokens each (source, channel) sends here
    decoded_ptr,  # [R * E_LOCAL + R] int32 out: expert entries, then tokens, of each source
    extra_out_ptr,  # [R, EXTRA] int32 out: the extra words of each source (EXTRA > 0)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    EXTRA: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    """Wait (bounded) for the row of source ``peer`` at ``my_row`` (every word non-zero once
    it arrived), decode it into the channel counts, expert entries, extra words and the
    source's token count, and zero it. A source that never arrived counts as sending
    nothing; the timeout is recorded.

    The row is one vector of ``BLOCK_ROW`` words, at least one a thread (:func:`row_block`):
    each word is read by one thread, and whether to wait on is a reduction over every warp,
    the clock included, so all threads leave the wait together. (Words held by every warp
    and reduced within each would let one warp leave and zero the row while another still
    waits for it, and put their barriers out of step.)"""
    words = tl.arange(0, BLOCK_ROW)
    used = words < NUM_CHANNELS + E_LOCAL + EXTRA + 1
    is_channel = words < NUM_CHANNELS
    is_expert = (words >= NUM_CHANNELS) & (words < NUM_CHANNELS + E_LOCAL)
    is_extra = (words >= NUM_CHANNELS + E_LOCAL) & (words < NUM_CHANNELS + E_LOCAL + EXTRA)
    is_tokens = words == NUM_CHANNELS + E_LOCAL + EXTRA
    clock = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int64)
    row = tl.load(my_row + words, mask=used, other=-1, volatile=True)
    in_time = elapsed_ns(clock, spins, USE_CLOCK) < timeout_ns
    while tl.max(tl.where((row == 0) & in_time, 1, 0), 0) > 0:
        spins += 1
        row = tl.load(my_row + words, mask=used, other=-1, volatile=True)
        in_time = elapsed_ns(clock, spins, USE_CLOCK) < timeout_ns
    arrived = tl.min(tl.where(row != 0, 1, 0), 0) > 0
    if not arrived:
        record_timeout(status_ptr, peer, NOTIFY, timeout_ns)
    value = tl.where(arrived, -row - 1, 0)
    tl.store(recv_count_ptr + peer * NUM_CHANNELS + words, value, mask=is_channel)
    tl.store(decoded_ptr + peer * E_LOCAL + words - NUM_CHANNELS, value, mask=is_expert)
    if EXTRA > 0:
        extra_at = extra_out_ptr + peer * EXTRA + words - NUM_CHANNELS - E_LOCAL
        tl.store(extra_at, value, mask=is_extra)
    tokens_at = decoded_ptr + NUM_RANKS * E_LOCAL + peer + words - NUM_CHANNELS - E_LOCAL - EXTRA
    tl.store(tokens_at, value, mask=is_tokens)
    tl.debug_barrier()  # every thread has read the row before any zeroes it
    tl.store(my_row + words, tl.zeros((BLOCK_ROW,), tl.int32), mask=used)


@triton.jit
def lay_out_rows(
    recv_count_ptr,  # [R, C] int32 tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 out: first output row of each (source, channel)
    decoded_ptr,  # [R * E_LOCAL + R] int32 expert entries, then tokens, of each source
    host_info_ptr,  # [1 + E_LOCAL] int32 out: total rows, aligned tokens per local expert
    alignment,  # round the entries per local expert up to a multiple of this
    max_rows,  # rows the outputs hold (worst-case mode), 0 = unlimited
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    state_ptr,  # [8] int64 device call counters (and the host words' address, HOST_COPY)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
    HOST_COPY: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
):
    """The last program: the first output row of every (source, channel) stream, the total
    and the aligned entries per local expert (with ``HOST_COPY`` also into host memory, then
    a flag); an overflow of ``max_rows`` is recorded."""
    channels = tl.arange(0, BLOCK_CHANNELS)
    experts = tl.arange(0, BLOCK_EXPERTS)
    ranks = tl.arange(0, BLOCK_RANKS)
    grid = ranks[:, None] * NUM_CHANNELS + channels[None, :]
    gmask = (ranks[:, None] < NUM_RANKS) & (channels[None, :] < NUM_CHANNELS)
    n = tl.load(recv_count_ptr + grid, mask=gmask, other=0, volatile=True)
    if CHANNEL_MAJOR:
        flat = tl.reshape(tl.trans(n), (BLOCK_CHANNELS * BLOCK_RANKS,))
        start = tl.trans(tl.reshape(tl.cumsum(flat, 0) - flat, (BLOCK_CHANNELS, BLOCK_RANKS)))
    else:
        flat = tl.reshape(n, (BLOCK_RANKS * BLOCK_CHANNELS,))
        start = tl.reshape(tl.cumsum(flat, 0) - flat, (BLOCK_RANKS, BLOCK_CHANNELS))
    tl.store(recv_start_ptr + grid, start, mask=gmask)
    total = tl.sum(flat, 0)
    per_source = tl.load(
        decoded_ptr + ranks[:, None] * E_LOCAL + experts[None, :],
        mask=(ranks[:, None] < NUM_RANKS) & (experts[None, :] < E_LOCAL),
        other=0,
        volatile=True,
    )
    per_expert = tl.sum(per_source, 0)
    per_expert = (per_expert + alignment - 1) // alignment * alignment
    tl.store(host_info_ptr, total)
    tl.store(host_info_ptr + 1 + experts, per_expert, mask=experts < E_LOCAL)
    if (max_rows > 0) & (total > max_rows):
        record_timeout(status_ptr, -1, NOTIFY, 0, total, STATUS_OVERFLOW)
    if HOST_COPY:  # the host waits for these words (exact size), flag last
        host = tl.load(state_ptr + HOST_COUNTS).to(tl.pointer_type(tl.int32))
        tl.store(host + 1, total)
        tl.store(host + 2 + experts, per_expert, mask=experts < E_LOCAL)
        # Then the rows from each source (the copy-engine combine sizes its copies by them).
        tl.store(host + 2 + E_LOCAL + ranks, tl.sum(n, 1), mask=ranks < NUM_RANKS)
        # And the most tokens any rank dispatched: the same on every rank, so that all
        # choose the same combine by it.
        at = decoded_ptr + NUM_RANKS * E_LOCAL + ranks
        most = tl.max(tl.load(at, mask=ranks < NUM_RANKS, other=0, volatile=True), 0)
        tl.store(host + 2 + E_LOCAL + NUM_RANKS, most)
        tl.debug_barrier()  # every thread's words stored before any thread's fence and flag
        fence_system()
        tl.store(host, 1)


@triton.jit
def count_exchange(
    first,  # the first peer this program exchanges counts with
    step,  # then every step-th peer after it
    counts_ptr,  # [N, R] bool is_token_in_rank, or [R, C] int32 counts (COUNTS_GIVEN)
    num_tokens,  # N
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank
    extra_ptr,  # [R, EXTRA] int32 sent to each peer (EXTRA > 0)
    alignment,  # round the entries per local expert up to a multiple of this
    max_rows,  # rows the outputs hold (worst-case mode), 0 = unlimited
    recv_count_ptr,  # [R, C] int32 out: tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 out: first output row of each (source, channel)
    host_info_ptr,  # [1 + E_LOCAL] int32 out: total rows, aligned tokens per local expert
    extra_out_ptr,  # [R, EXTRA] int32 out: the extra words of each source (EXTRA > 0)
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # int64 limit of every wait
    decoded_ptr,  # [R * E_LOCAL + R] int32 workspace: expert entries, then tokens, of each source
    ready_tag,  # stored into state[NOTIFY_READY] once the layout is out (READY)
    NUM_RANKS: tl.constexpr,
    NUM_CHANNELS: tl.constexpr,
    E_LOCAL: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    SET_BYTES: tl.constexpr,
    NOTIFY_OFFSET: tl.constexpr,
    STAGE_OFFSET: tl.constexpr,
    EXTRA: tl.constexpr,
    COUNTS_GIVEN: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
    HOST_COPY: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_EXTRA: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    VIA: tl.constexpr,
    READY: tl.constexpr,
):
    """This program's share of the count exchange (constexprs as :func:`notify_kernel`'s):
    store its rows into peers ``first, first + step, ...``, then wait for theirs. The program
    that finishes the last peer lays out the received rows and (``READY``: a launch whose
    other programs wait for the layout, :func:`await_counts`) stores ``ready_tag`` into
    ``state[NOTIFY_READY]``. All rows are stored before any is awaited, so a program that
    serves several peers never waits for a peer that waits for it (the interpreter runs a
    rank's programs one after another)."""
    call = tl.load(state_ptr + NOTIFY_CALLS, volatile=True)
    set_off = (call % 2) * SET_BYTES
    for peer in range(first, NUM_RANKS, step):
        counts = channel_counts(
            counts_ptr,
            num_tokens,
            peer,
            NUM_RANKS,
            NUM_CHANNELS,
            COUNTS_GIVEN,
            BLOCK_TOKENS,
            BLOCK_CHANNELS,
        )
        notify_send(
            counts,
            num_tokens,
            per_expert_ptr,
            extra_ptr,
            peer,
            rank,
            NOTIFY_OFFSET + set_off + rank * ROW_WORDS * 4,
            peer_ptrs,
            pe_ptr,
            NUM_CHANNELS,
            E_LOCAL,
            ROW_WORDS,
            STAGE_OFFSET,
            EXTRA,
            BLOCK_CHANNELS,
            BLOCK_EXPERTS,
            BLOCK_EXTRA,
            VIA,
        )
    rows = tl.load(peer_ptrs + rank) + NOTIFY_OFFSET + set_off
    for peer in range(first, NUM_RANKS, step):
        notify_receive(
            (rows + peer * ROW_WORDS * 4).to(tl.pointer_type(tl.int32)),
            peer,
            timeout_ns,
            status_ptr,
            recv_count_ptr,
            decoded_ptr,
            extra_out_ptr,
            NUM_RANKS,
            NUM_CHANNELS,
            E_LOCAL,
            EXTRA,
            USE_CLOCK,
            BLOCK_ROW,
        )
    # The program that finishes the last peer lays out the received rows.
    served = tl.maximum(tl.cdiv(NUM_RANKS - first, step), 0)
    if served > 0:
        tl.debug_barrier()
        done = tl.atomic_add(state_ptr + NOTIFY_ARRIVALS, served, sem="acq_rel", scope="gpu")
        if done + served == NUM_RANKS:
            lay_out_rows(
                recv_count_ptr,
                recv_start_ptr,
                decoded_ptr,
                host_info_ptr,
                alignment,
                max_rows,
                status_ptr,
                state_ptr,
                NUM_RANKS,
                NUM_CHANNELS,
                E_LOCAL,
                CHANNEL_MAJOR,
                HOST_COPY,
                BLOCK_CHANNELS,
                BLOCK_EXPERTS,
                BLOCK_RANKS,
            )
            tl.store(state_ptr + NOTIFY_ARRIVALS, 0)
            tl.store(state_ptr + NOTIFY_CALLS, call + 1)
            if READY:
                tl.debug_barrier()
                tl.atomic_xchg(state_ptr + NOTIFY_READY, ready_tag, sem="release", scope="gpu")


@triton.jit
def await_counts(
    ready_tag,  # the value the count exchange of this launch stores when its layout is out
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_ns,  # int64 limit of the exchange's own waits
    PHASE: tl.constexpr,  # the phase a timeout names
    USE_CLOCK: tl.constexpr,
):
    """Wait (bounded) until :func:`count_exchange` of this launch has laid out the received
    rows; returns whether it has. The exchange's programs wait at most ``timeout_ns`` for
    their peers, so this waits twice that; a wait that gives up is recorded as this rank's
    own (peer ``rank``) in ``PHASE``. Under the interpreter the exchange's programs come
    first: the flag is there at the first read."""
    limit = 2 * timeout_ns
    start = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int32)
    # Read by an atomic, which one thread makes and all receive: every thread sees one value.
    done = tl.atomic_add(state_ptr + NOTIFY_READY, 0, sem="relaxed", scope="gpu") >= ready_tag
    while keep_waiting(done, start, limit, spins, USE_CLOCK):
        spins += 1
        done = tl.atomic_add(state_ptr + NOTIFY_READY, 0, sem="relaxed", scope="gpu") >= ready_tag
    if done:
        done = tl.atomic_add(state_ptr + NOTIFY_READY, 0, sem="acquire", scope="gpu") >= ready_tag
    else:
        record_timeout(status_ptr, rank, PHASE, limit)
    tl.debug_barrier()
    return done


@triton.jit(do_not_specialize=["num_tokens", "alignment", "max_rows", "timeout_us"])
def notify_kernel(
    # What changes from call to call (NotifyCall).
    counts_ptr,  # [N, R] bool is_token_in_rank, or [R, C] int32 counts (COUNTS_GIVEN)
    num_tokens,  # N
    per_expert_ptr,  # [E] int32 top-k entries per global expert on this rank
    extra_ptr,  # [R, EXTRA] int32 sent to each peer (EXTRA > 0)
    alignment,  # round the entries per local expert up to a multiple of this
    max_rows,  # rows the outputs hold (worst-case mode), 0 = unlimited
    recv_count_ptr,  # [R, C] int32 out: tokens each (source, channel) sends here
    recv_start_ptr,  # [R, C] int32 out: first output row of each (source, channel)
    host_info_ptr,  # [1 + E_LOCAL] int32 out: total rows, aligned tokens per local expert
    extra_out_ptr,  # [R, EXTRA] int32 out: the extra words of each source (EXTRA > 0)
    trace_ptr,  # [R * SLOTS + 1] int64 readings (PROFILE)
    # What stays from call to call (normal_dispatch.NormalShared).
    peer_ptrs,  # [R] int64 heap base addresses
    pe_ptr,  # [R] int32 NVSHMEM PE of each rank
    rank,  # this rank
    state_ptr,  # [8] int64 device call counters
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    timeout_us,  # limit of every wait, in microseconds (sync.timeout_us)
    decoded_ptr,  # [R * E_LOCAL + R] int32 workspace: expert entries, then tokens, of each source
    NUM_RANKS: tl.constexpr,  # ranks of the group
    NUM_CHANNELS: tl.constexpr,  # channels of the call
    E_LOCAL: tl.constexpr,  # experts per rank
    ROW_WORDS: tl.constexpr,  # int32 words per notify row (> NUM_CHANNELS + E_LOCAL + EXTRA)
    SET_BYTES: tl.constexpr,  # bytes of one set of rows ([R][ROW_WORDS])
    NOTIFY_OFFSET: tl.constexpr,  # heap byte offset of set 0 of the notify rows
    STAGE_OFFSET: tl.constexpr,  # heap byte offset of the staged rows [R dest][ROW_WORDS] (VIA)
    EXTRA: tl.constexpr,  # extra words per row (at NUM_CHANNELS + E_LOCAL)
    COUNTS_GIVEN: tl.constexpr,  # channel counts given (counts_ptr), not counted
    CHANNEL_MAJOR: tl.constexpr,  # received rows ordered by channel, then source
    HOST_COPY: tl.constexpr,  # also write the count into host memory (exact size)
    USE_CLOCK: tl.constexpr,  # on a GPU (else the interpreter)
    BLOCK_TOKENS: tl.constexpr,  # tokens counted at a time
    BLOCK_CHANNELS: tl.constexpr,  # power of two > NUM_CHANNELS (a bin for other ranks)
    BLOCK_EXPERTS: tl.constexpr,  # power of two >= max(E_LOCAL, 2)
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BLOCK_EXTRA: tl.constexpr,  # power of two >= max(EXTRA, 2)
    BLOCK_ROW: tl.constexpr,  # words of a row read at a time (:func:`row_block`)
    PROFILE: tl.constexpr,  # record traces
    VIA: tl.constexpr,  # how rows reach peers (transport)
):
    timeout_ns = limit_ns(timeout_us, status_ptr)
    if PROFILE:
        t_start = read_clock(trace_ptr, USE_CLOCK)
    # Program p exchanges counts with rank p.
    count_exchange(
        tl.program_id(0),
        NUM_RANKS,
        counts_ptr,
        num_tokens,
        per_expert_ptr,
        extra_ptr,
        alignment,
        max_rows,
        recv_count_ptr,
        recv_start_ptr,
        host_info_ptr,
        extra_out_ptr,
        peer_ptrs,
        pe_ptr,
        rank,
        state_ptr,
        status_ptr,
        timeout_ns,
        decoded_ptr,
        0,  # ready_tag: not stored (READY off)
        NUM_RANKS,
        NUM_CHANNELS,
        E_LOCAL,
        ROW_WORDS,
        SET_BYTES,
        NOTIFY_OFFSET,
        STAGE_OFFSET,
        EXTRA,
        COUNTS_GIVEN,
        CHANNEL_MAJOR,
        HOST_COPY,
        USE_CLOCK,
        BLOCK_TOKENS,
        BLOCK_CHANNELS,
        BLOCK_EXPERTS,
        BLOCK_RANKS,
        BLOCK_EXTRA,
        BLOCK_ROW,
        VIA,
        False,  # READY: no program of this launch waits for the layout
    )
    if PROFILE:
        trace_role(trace_ptr, t_start, read_clock(trace_ptr, USE_CLOCK), True, 0, USE_CLOCK)
