"""Normal-mode dispatch on fixed receive slots: every row stored once per destination rank,
straight at its final index in that rank's receive buffer (a prototype, not yet a mode).

Two launches and no receiver programs:

1. :func:`slots_notify_kernel` (one program): this rank counts its tokens per destination rank
   and stores the count vector into every rank's count matrix (an all-gather of the ``[R, R]``
   matrix ``C[source, destination]``, each word tagged with the call number), then waits
   (bounded) for every source's row. From the matrix it writes ``info``: the rows it will
   receive, where its own rows start at each destination (``sum of C[s, d] for s < rank``),
   and where each source's rows start here. A peer's row for call ``k`` also says that the
   peer has finished call ``k - 1``, so its receive buffer is free to write.
2. :func:`slots_dispatch_kernel` (``P`` programs, each a contiguous token range): every program
   works out the final row of each of its tokens at each destination (a prefix count of the
   tokens before it), then pushes each token's row to each of its destinations, with tensor
   memory accelerator copies through host-side tensor descriptors on every peer's view of the
   receive buffer (``VIA_TMA``), or with wide plain stores through peer addresses. Each
   program then adds one to its arrival counter at every destination (release), and the last
   program waits (bounded) until every source's ``P`` programs have arrived here, then takes
   them back off the counters (each call starts from zero, so calls with different program
   counts share a heap; a source's next call adds only after this rank's next count word).

Rows arrive ordered by source rank, then by token: the receive buffer's first ``info[0]`` rows
are the dispatch output, and a copy into a fresh tensor (any kernel on all SMs) is optional.

The heap of every rank holds the count matrix (``int64 [R, R]``, at offset 0), the arrival
counters (``int64 [R]``) and the receive buffer (``[max_rows, hidden]`` of the rows' dtype),
at the offsets :func:`heap_bytes` gives. A rank's rows for itself take the same path as the
others (its own descriptor, its own address).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from .phases import DISPATCH_RECV, NOTIFY
from .status import record_timeout
from .sync import add_release, limit_ns, wait_tile

# The interpreter has no inline assembly, and its copies complete before they return.
_ASYNC_FENCE = tl.constexpr(not knobs.runtime.interpret)


def heap_bytes(num_ranks: int, max_rows: int, hidden: int, itemsize: int) -> tuple[int, int, int]:
    """The heap of ``num_ranks`` ranks receiving up to ``max_rows`` rows of ``hidden``
    elements of ``itemsize`` bytes: ``(arrivals_offset, recv_offset, total_bytes)``, the count
    matrix at offset 0. Each region starts on a 128-byte boundary (TMA wants 16)."""
    arrivals = -(-num_ranks * num_ranks * 8 // 128) * 128
    recv = arrivals + -(-num_ranks * 8 // 128) * 128
    return arrivals, recv, recv + max_rows * hidden * itemsize


@triton.jit
def bulk_stores_done():
    """Wait until this thread's bulk (TMA) stores have been written, not only read out of
    shared memory, and order them before its later generic-proxy accesses (the release)."""
    if _ASYNC_FENCE:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
            "=r",
            [],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


# Counts, ranks and the limit reach the kernels unspecialized: a new batch compiles nothing.
@triton.jit(do_not_specialize=["num_tokens", "rank", "timeout_us"])
def slots_notify_kernel(
    in_rank_ptr,  # int8/bool [num_tokens, NUM_RANKS]: token t goes to rank d
    num_tokens,  # tokens of this rank
    peer_ptrs,  # int64 [NUM_RANKS]: every rank's heap base address
    rank,  # this rank
    state_ptr,  # int64 [1]: calls made so far (advanced here)
    info_ptr,  # int32 [1 + 3 * NUM_RANKS] out: total, send_base[R], recv_start[R], recv_count[R]
    status_ptr,  # int32 status words: a timeout is recorded here
    timeout_us,  # bound of the wait, microseconds
    NUM_RANKS: tl.constexpr,
    USE_CLOCK: tl.constexpr,  # a GPU clock bounds the wait (spins under the interpreter)
    BLOCK_TOKENS: tl.constexpr,  # tokens counted per step
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS rounded up to a power of two
):
    """Count, all-gather the count matrix (tagged words, count matrix at heap offset 0), wait,
    and write this rank's offsets into ``info``. One program."""
    call = tl.load(state_ptr) + 1
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    counts = tl.zeros((BLOCK_RANKS,), tl.int64)
    for first in range(0, num_tokens, BLOCK_TOKENS):
        tokens = (first + tl.arange(0, BLOCK_TOKENS)).to(tl.int64)
        hit = tl.load(
            in_rank_ptr + tokens[:, None] * NUM_RANKS + ranks[None, :],
            mask=(tokens < num_tokens)[:, None] & rmask[None, :],
            other=0,
        )
        counts += tl.sum((hit != 0).to(tl.int64), 0)
    # One aligned 8-byte store per word: a reader sees the old word or the whole new one.
    word = (call << 32) | counts
    for peer in range(NUM_RANKS):
        row = tl.load(peer_ptrs + peer).to(tl.pointer_type(tl.int64)) + rank * NUM_RANKS
        tl.store(row + ranks, word, mask=rmask)
    mine = tl.load(peer_ptrs + rank).to(tl.pointer_type(tl.int64))
    cells = mine + ranks[:, None] * NUM_RANKS + ranks[None, :]
    active = rmask[:, None] & rmask[None, :]
    limit = limit_ns(timeout_us, status_ptr)
    values, missing, _, limit = wait_tile(
        cells, active, call, limit, timeout_us, status_ptr, USE_CLOCK, SHIFT=32
    )
    late = tl.max(tl.where(missing, ranks[:, None], -1))
    if late >= 0:
        record_timeout(status_ptr, late, NOTIFY, limit)
    counted = values - ((values >> 32) << 32)
    matrix = tl.where(active & ~missing, counted, 0).to(tl.int32)  # [source, destination]
    before_me = (ranks < rank)[:, None]
    send_base = tl.sum(tl.where(before_me, matrix, 0), 0)  # [dest]
    column = tl.sum(tl.where(ranks[None, :] == rank, matrix, 0), 1)  # [source]: rows from each
    recv_start = tl.cumsum(column, 0) - column
    tl.store(info_ptr, tl.sum(column, 0))
    tl.store(info_ptr + 1 + ranks, send_base, mask=rmask)
    tl.store(info_ptr + 1 + NUM_RANKS + ranks, recv_start, mask=rmask)
    tl.store(info_ptr + 1 + 2 * NUM_RANKS + ranks, column, mask=rmask)
    tl.store(state_ptr, call)


@triton.jit
def plan_rows(
    in_rank_ptr,  # int8/bool [num_tokens, NUM_RANKS]
    plan_ptr,  # int32 [num_tokens, NUM_RANKS] out: final row at each rank, -1 where not sent
    info_ptr,  # int32 [1 + 3 * NUM_RANKS]: send_base at 1 + d
    t0,  # this program's first token
    t1,  # one past its last token
    NUM_RANKS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,  # tokens per step
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS rounded up to a power of two
):
    """Row of each token of ``[t0, t1)`` at each destination: the rows of this rank there
    start at ``send_base[d]`` and keep token order, so a token's row is that base plus the
    tokens before it that go there (counted over ``[0, t0)`` first, a few steps)."""
    ranks = tl.arange(0, BLOCK_RANKS)
    rmask = ranks < NUM_RANKS
    before = tl.load(info_ptr + 1 + ranks, mask=rmask, other=0)
    for first in range(0, t0, BLOCK_TOKENS):
        tokens = (first + tl.arange(0, BLOCK_TOKENS)).to(tl.int64)
        cells = tokens[:, None] * NUM_RANKS + ranks[None, :]
        hit = tl.load(in_rank_ptr + cells, mask=(tokens < t0)[:, None] & rmask[None, :], other=0)
        before += tl.sum((hit != 0).to(tl.int32), 0)
    for first in range(t0, t1, BLOCK_TOKENS):
        tokens = (first + tl.arange(0, BLOCK_TOKENS)).to(tl.int64)
        cells = tokens[:, None] * NUM_RANKS + ranks[None, :]
        live = (tokens < t1)[:, None] & rmask[None, :]
        hit = (tl.load(in_rank_ptr + cells, mask=live, other=0) != 0).to(tl.int32)
        rows = before[None, :] + tl.cumsum(hit, 0) - hit
        tl.store(plan_ptr + cells, tl.where(hit != 0, rows, -1), mask=live)
        before += tl.sum(hit, 0)
    tl.debug_barrier()  # every thread's plan stores before any thread reads them


@triton.jit
def store_box(
    d: tl.constexpr, coords, tile, desc0, desc1, desc2, desc3, desc4, desc5, desc6, desc7
):
    """Store ``tile`` through destination ``d``'s descriptor (Triton indexes no list of them)."""
    if d == 0:
        desc0.store(coords, tile)
    if d == 1:
        desc1.store(coords, tile)
    if d == 2:
        desc2.store(coords, tile)
    if d == 3:
        desc3.store(coords, tile)
    if d == 4:
        desc4.store(coords, tile)
    if d == 5:
        desc5.store(coords, tile)
    if d == 6:
        desc6.store(coords, tile)
    if d == 7:
        desc7.store(coords, tile)


@triton.jit
def push_tma(
    x_desc,
    desc0,
    desc1,
    desc2,
    desc3,
    desc4,
    desc5,
    desc6,
    desc7,
    plan_ptr,
    t0,
    t1,
    max_rows,
    NUM_RANKS: tl.constexpr,
    BOXES: tl.constexpr,
    BOX_ROWS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Each token's row as ``BOXES`` boxes ``[1, BOX_ROWS, BOX_COLS]`` of the row viewed as
    ``[hidden / BOX_COLS, BOX_COLS]``: loaded once, stored through each destination's
    descriptor at the token's row there; a rank the token skips gets row ``max_rows``, outside
    its descriptor, which the copy engine drops (no branch in the pipelined loop)."""
    for i in tl.range(t0 * BOXES, t1 * BOXES, num_stages=STAGES):
        token = i // BOXES
        part = (i % BOXES) * BOX_ROWS
        tile = x_desc.load([token, part, 0])
        for d in tl.static_range(NUM_RANKS):
            row = tl.load(plan_ptr + token.to(tl.int64) * NUM_RANKS + d)
            row = tl.where(row < 0, max_rows, row)
            store_box(
                d, [row, part, 0], tile, desc0, desc1, desc2, desc3, desc4, desc5, desc6, desc7
            )
    tl.debug_barrier()
    bulk_stores_done()


@triton.jit
def load_rows(ptrs, mask, STREAM: tl.constexpr):
    """Rows read once: with ``STREAM`` marked evict-first, so they leave L2 before others."""
    if STREAM:
        return tl.load(ptrs, mask=mask, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask)


@triton.jit
def push_stores(
    x_ptr,
    plan_ptr,
    peer_ptrs,
    recv_offset,
    rank,
    t0,
    t1,
    HIDDEN: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    STREAM: tl.constexpr,
):
    """Each ``[BLOCK_T, BLOCK_H]`` tile of rows loaded once (the next one before the current
    one is stored) and stored with plain wide stores at every destination's rows. With
    ``ROTATE`` program ``p`` of rank ``r`` stores to rank ``(r + p + j) % R`` at step ``j``:
    at each step the ranks' programs ``p`` aim at ``R`` different ranks, and one rank's programs
    at several, instead of every sender at rank 0 first. With ``STREAM`` the rows are read
    with evict-first (each is read once) and stored streaming (``.cs``: no line of a peer's
    rows is read again by this GPU)."""
    cols = tl.arange(0, BLOCK_H)
    out_ty = x_ptr.dtype.element_ty
    first_rank = (rank + tl.program_id(0)) % NUM_RANKS if ROTATE else 0
    for first in range(t0, t1, BLOCK_T):
        tokens = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = tokens < t1
        src = x_ptr + tokens[:, None] * HIDDEN
        v = load_rows(src + cols[None, :], live[:, None] & (cols < HIDDEN)[None, :], STREAM)
        for h0 in range(0, HIDDEN, BLOCK_H):
            h = h0 + cols
            hn = h + BLOCK_H
            v_next = load_rows(src + hn[None, :], live[:, None] & (hn < HIDDEN)[None, :], STREAM)
            for j in tl.static_range(NUM_RANKS):
                d = (first_rank + j) % NUM_RANKS
                rows = tl.load(plan_ptr + tokens * NUM_RANKS + d, mask=live, other=-1)
                base = tl.load(peer_ptrs + d) + recv_offset
                dst = tl.multiple_of(base.to(tl.pointer_type(out_ty)), 16)
                m = (rows >= 0)[:, None] & (h < HIDDEN)[None, :]
                out = dst + rows.to(tl.int64)[:, None] * HIDDEN + h[None, :]
                if STREAM:
                    tl.store(out, v, mask=m, cache_modifier=".cs")
                else:
                    tl.store(out, v, mask=m)
            v = v_next


@triton.jit
def arrive_and_wait(
    peer_ptrs,
    rank,
    arrivals_offset,
    timeout_us,
    status_ptr,
    NUM_RANKS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    """Count this program's rows in at every destination (after all of its stores), and in the
    last program wait until every source's programs have counted theirs in here, then subtract
    them, so the next call waits for its own program count whatever this one's was. Nothing
    adds to a counter meanwhile: a source's next call adds only after it has read this rank's
    next count word, written by a later launch. The last program runs last under the
    interpreter too, so no program waits on one that cannot start."""
    programs = tl.num_programs(0)
    for d in range(NUM_RANKS):
        counter = tl.load(peer_ptrs + d) + arrivals_offset
        add_release(counter.to(tl.pointer_type(tl.int64)) + rank, 1)
    if tl.program_id(0) == programs - 1:
        ranks = tl.arange(0, BLOCK_RANKS)
        mine = (tl.load(peer_ptrs + rank) + arrivals_offset).to(tl.pointer_type(tl.int64))
        active = (ranks < NUM_RANKS)[:, None]
        cells = mine + ranks[:, None] + tl.zeros((1, 1), tl.int64)
        limit = limit_ns(timeout_us, status_ptr)
        _, missing, _, limit = wait_tile(
            cells,
            active,
            programs,
            limit,
            timeout_us,
            status_ptr,
            USE_CLOCK,
            AT_LEAST=True,
        )
        late = tl.max(tl.where(missing, ranks[:, None], -1))
        if late >= 0:
            record_timeout(status_ptr, late, DISPATCH_RECV, limit)
        # A source that timed out keeps its count: the status already fails every later call.
        taken = tl.zeros((BLOCK_RANKS, 1), tl.int64) - programs
        tl.atomic_add(cells, taken, mask=active & ~missing, sem="relaxed", scope="sys")


@triton.jit(do_not_specialize=["rank", "num_tokens", "max_rows", "timeout_us"])
def slots_dispatch_kernel(
    x_ptr,  # [num_tokens, hidden] rows of this rank (plain stores; None with VIA_TMA)
    x_desc,  # descriptor of x as [num_tokens, hidden / BOX_COLS, BOX_COLS] (VIA_TMA)
    desc0,  # descriptor of rank 0's receive buffer as [max_rows, hidden / BOX_COLS, BOX_COLS]
    desc1,  # ... of rank 1's (each None past NUM_RANKS, and without VIA_TMA)
    desc2,
    desc3,
    desc4,
    desc5,
    desc6,
    desc7,
    in_rank_ptr,  # int8/bool [num_tokens, NUM_RANKS]: token t goes to rank d
    plan_ptr,  # int32 [num_tokens, NUM_RANKS] scratch: each token's row at each rank
    info_ptr,  # int32 [1 + 3 * NUM_RANKS] from the notify: send_base at 1 + d
    peer_ptrs,  # int64 [NUM_RANKS]: every rank's heap base address
    rank,  # this rank
    num_tokens,  # tokens of this rank
    max_rows,  # rows of every receive buffer
    arrivals_offset,  # byte offset of the arrival counters in every heap
    recv_offset,  # byte offset of the receive buffer in every heap
    status_ptr,  # int32 status words: a timeout is recorded here
    timeout_us,  # bound of the wait, microseconds
    NUM_RANKS: tl.constexpr,
    HIDDEN: tl.constexpr,  # elements per row
    VIA_TMA: tl.constexpr,  # bulk copies through the descriptors, else plain stores
    BOXES: tl.constexpr,  # TMA boxes per row
    BOX_ROWS: tl.constexpr,  # rows of the row's [hidden / BOX_COLS, BOX_COLS] view per box
    STAGES: tl.constexpr,  # boxes in flight in the TMA loop
    BLOCK_T: tl.constexpr,  # tokens per tile of the plain-store loop
    BLOCK_H: tl.constexpr,  # elements per tile row of the plain-store loop
    BLOCK_TOKENS: tl.constexpr,  # tokens per step of the row plan
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS rounded up to a power of two
    USE_CLOCK: tl.constexpr,  # a GPU clock bounds the wait (spins under the interpreter)
    ROTATE: tl.constexpr = False,  # plain stores: each program starts at its own destination
    STREAM: tl.constexpr = False,  # plain stores: evict-first loads, streaming (.cs) stores
):
    """Push this program's contiguous token range to every destination at the rows the notify
    gave, then count in and (last program) wait for every source."""
    chunk = tl.cdiv(num_tokens, tl.num_programs(0))
    t0 = tl.minimum(tl.program_id(0) * chunk, num_tokens)
    t1 = tl.minimum(t0 + chunk, num_tokens)
    plan_rows(in_rank_ptr, plan_ptr, info_ptr, t0, t1, NUM_RANKS, BLOCK_TOKENS, BLOCK_RANKS)
    if VIA_TMA:
        push_tma(
            x_desc,
            desc0,
            desc1,
            desc2,
            desc3,
            desc4,
            desc5,
            desc6,
            desc7,
            plan_ptr,
            t0,
            t1,
            max_rows,
            NUM_RANKS,
            BOXES,
            BOX_ROWS,
            STAGES,
        )
    else:
        push_stores(
            x_ptr,
            plan_ptr,
            peer_ptrs,
            recv_offset,
            rank,
            t0,
            t1,
            HIDDEN,
            NUM_RANKS,
            BLOCK_T,
            BLOCK_H,
            ROTATE,
            STREAM,
        )
    arrive_and_wait(
        peer_ptrs,
        rank,
        arrivals_offset,
        timeout_us,
        status_ptr,
        NUM_RANKS,
        BLOCK_RANKS,
        USE_CLOCK,
    )
