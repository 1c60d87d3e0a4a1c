"""The normal mode's combine over copy engines: rows handed back by peer copies, summed by SMs.

After an exact-size dispatch each rank's host knows how many rows it received from every source
(:attr:`~tritonep.modes.normal.NormalHandle.source_rows`), and those rows are contiguous in the
combine's input, in token order. So the rows for source ``s`` go back in peer copies into
``s``'s region for this rank (:mod:`tritonep.modes.copy_combine` issues them: copy engines, no
SM), and ``s`` sums each of its tokens from those regions and its own rows in place, in rank
order, as the ring combine does, in :func:`copy_combine_sum`.

The rows for each peer go in ``CHUNKS`` copies (row ``r`` of ``n`` in chunk ``c`` where
``chunk_start(n, c) <= r < chunk_start(n, c + 1)``: the last chunk ``1 / LAST_SHARE`` of the
rows), and one launch of the sums per chunk waits for that chunk's copies (the peers' flags,
below), so the sums of the tokens whose rows have all come run while the next chunk's copies
move. A launch after the first starts its programs at the first token that can have a row in its
chunk (rows go in token order, so a later chunk's tokens are the last ones), where
:func:`copy_combine_prefix` says: the call waits for that launch alone after its last copy, and
it spreads its few tokens over every program it has. After a chunk's copies the same stream sets
this rank's arrival flag of the chunk at each peer to 1 (a stream memory operation: no SM, so a
launch that waits for SMs beside a GEMM finds the flags there whatever the peers' SMs are
doing). In a launch every program waits for the peers' flags of its chunk, then sums those of
its block of tokens whose last row came in it (the row of token ``t`` in the region of rank
``r`` is ``t``'s position among the tokens that went to ``r``: :func:`copy_combine_prefix`,
launched once a call after the first chunk's copies, writes them for all tokens). In the last
chunk's launch the last program to finish clears this rank's arrival flags, tells every peer it
has read their rows, then waits until every peer has read this rank's. Each region holds one
call's rows, and that wait at the end of a call is what lets the next call's copies start with
no kernel before them (beside a GEMM that holds every SM, they run at once; only the sums wait
for SMs).

Call numbers live on the device (``state_ptr``) and the arrival flags are cleared by the call
that read them, so a CUDA graph of a combine replays with the flags of each new call. Every
wait is bounded; one that gives up records the peer and the phase, and the tokens whose rows it
did not see sum to NaN.

Region of each rank (byte offsets in its heap of :func:`region_layout`): ``[CHUNKS, R]`` int64
flags set to 1 by each source when a chunk of its rows arrived, ``[R]`` int64 flags set by each
peer once it has read this rank's rows, then the rows ``[R - 1, CAPACITY, H]`` bf16 and the
weights ``[R - 1, CAPACITY * MAX_TOPK]`` float32 (``K`` columns a row in a call of top-k
``K``), a slot per source: source ``r``'s is ``(r - rank - 1) mod R``.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .normal_combine import poison_lost, sum_step
from .phases import COPY_COMBINE_DONE, COPY_COMBINE_RECV
from .profiled import kernel
from .status import STATUS_TIMEOUT, record_timeout
from .sync import first_lane, lane, limit_ns, wait_all_at_least

#: Words of the state (``state_ptr``, int64): the last call finished, and the programs of the
#: running one that are done.
CALLS = tl.constexpr(0)
ARRIVALS = tl.constexpr(1)
STATE_WORDS = 2


class RegionLayout(NamedTuple):
    """Byte offsets in each rank's region heap, and its size (the arrival flags at 0:
    ``[CHUNKS, R]`` int64, 1 once source ``r`` has copied its chunk ``c`` of rows here)."""

    done: int  # [R] int64: the last call whose rows from this rank peer r has read
    rows: int  # [R - 1, capacity, H] bf16
    weights: int  # [R - 1, capacity * max_topk] float32
    total: int


def region_layout(
    num_ranks: int, capacity: int, hidden: int, max_topk: int, chunks: int = 1
) -> RegionLayout:
    """Where a rank's region keeps its flags, rows and weights (each part 256-byte aligned)."""

    def up(n: int) -> int:
        return (n + 255) // 256 * 256

    done = chunks * num_ranks * 8
    rows = up(done + num_ranks * 8)
    weights = up(rows + (num_ranks - 1) * capacity * hidden * 2)
    total = up(weights + (num_ranks - 1) * capacity * max_topk * 4)
    return RegionLayout(done, rows, weights, total)


def chunk_start(rows: int, chunk: int, chunks: int, last_share: int) -> int:
    """The first of ``rows`` rows in ``chunk`` of ``chunks`` (chunk ``chunks`` starts at
    ``rows``): the last chunk holds ``1 / last_share`` of the rows, the others share the rest
    equally. The call waits, after the last copy, only for the sums of the tokens whose last
    row that chunk carries: the smaller it is the less, while the sums of the others run beside
    its copies. :func:`first_row` is the same on the device, :func:`row_chunk` the inverse."""
    if chunk <= 0:
        return 0
    if chunk >= chunks:
        return rows
    return (last_share - 1) * rows * chunk // (last_share * (chunks - 1))


@triton.jit
def first_row(rows, chunk, CHUNKS: tl.constexpr, LAST_SHARE: tl.constexpr):
    """:func:`chunk_start` on the device, for ``1 <= chunk < CHUNKS``."""
    return (LAST_SHARE - 1) * rows * chunk // (LAST_SHARE * (CHUNKS - 1))


class PrefixCall(NamedTuple):
    """The runtime arguments of :func:`copy_combine_prefix`."""

    in_rank_ptr: object
    prefix_ptr: object
    num_tokens: int


class SumCall(NamedTuple):
    """The leading runtime arguments of :func:`copy_combine_sum`: what changes per call;
    :class:`SumShared` follows."""

    x_ptr: object
    weights_ptr: object
    in_rank_ptr: object
    prefix_ptr: object
    own_start: int
    num_tokens: int
    K: int
    chunk: int
    bias0_ptr: object
    bias1_ptr: object
    out_ptr: object
    out_weights_ptr: object


class SumShared(NamedTuple):
    """The trailing runtime arguments of :func:`copy_combine_sum`: its owner's."""

    peer_ptrs: object
    state_ptr: object
    status_ptr: object
    rank: int
    timeout_us: int


class SumVariant(NamedTuple):
    """One compiled variant of :func:`copy_combine_sum`: its constexprs, in order."""

    H: int
    NUM_RANKS: int
    CAPACITY: int
    MAX_TOPK: int
    DONE_OFFSET: int
    ROWS_OFFSET: int
    WEIGHTS_OFFSET: int
    HAS_WEIGHTS: bool
    NUM_BIAS: int
    CHUNKS: int
    LAST_SHARE: int
    USE_CLOCK: bool
    BLOCK_TOKENS: int
    BLOCK_WORDS: int
    BLOCK_RANKS: int
    BLOCK_K: int
    X_ALIGNED: bool
    LATER: bool
    STAGES: int | None


@triton.jit
def column_block(in_rank_ptr, start, r, num_tokens, NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens ``start`` to ``start + BLOCK - 1`` of column ``r`` of ``is_token_in_rank``
    (``in_rank_ptr`` as int8): their offsets in the ``[N, R]`` table, which exist, and 1
    where the token went to ``r``."""
    tokens = start + tl.arange(0, BLOCK)
    mask = tokens < num_tokens
    at = tokens.to(tl.int64) * NUM_RANKS + r
    return at, mask, (tl.load(in_rank_ptr + at, mask=mask, other=0) != 0).to(tl.int32)


@kernel("tritonep::normal::copy_combine_prefix", do_not_specialize=["num_tokens"])
def copy_combine_prefix(
    in_rank_ptr,  # [N, R] bool is_token_in_rank of the dispatch
    prefix_ptr,  # [N + CHUNKS, R] int32 out: the prefix, the totals, each chunk's first token
    num_tokens,  # N
    NUM_RANKS: tl.constexpr,  # R
    CHUNKS: tl.constexpr,  # copies per peer and call
    LAST_SHARE: tl.constexpr,  # the last chunk holds 1 / LAST_SHARE of the rows
    BLOCK: tl.constexpr,  # tokens read at a time
    BLOCK_CHUNKS: tl.constexpr,  # CHUNKS as a power of two (at least 2)
):
    """Program ``r``: the exclusive prefix sum of column ``r`` of ``is_token_in_rank``, so
    that the sums find a token's row at rank ``r`` (its position among the tokens that went
    there) in one load; row ``N`` holds the column's total, the rows rank ``r`` holds, and row
    ``N + c`` (``1 <= c < CHUNKS``) the first token whose row at ``r`` could be in chunk ``c``
    (the tokens before it have rows only in earlier chunks there)."""
    r = tl.program_id(0)
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8))
    carry = tl.zeros((), tl.int32)
    for start in range(0, num_tokens, BLOCK):
        at, mask, hit = column_block(in_rank_ptr, start, r, num_tokens, NUM_RANKS, BLOCK)
        tl.store(prefix_ptr + at, carry + tl.cumsum(hit, 0) - hit, mask=mask)
        carry += tl.sum(hit, 0)
    tl.store(prefix_ptr + num_tokens.to(tl.int64) * NUM_RANKS + r, carry)
    if CHUNKS > 1:
        # The prefix grows with the token, so the tokens before the first row of a chunk are
        # those whose prefix lies below it: counted in a second pass, now that the total is
        # known.
        chunks = tl.arange(0, BLOCK_CHUNKS)
        starts = first_row(carry, chunks, CHUNKS, LAST_SHARE)
        before = tl.zeros((BLOCK_CHUNKS,), tl.int32)
        seen = tl.zeros((), tl.int32)
        for start in range(0, num_tokens, BLOCK):
            _, mask, hit = column_block(in_rank_ptr, start, r, num_tokens, NUM_RANKS, BLOCK)
            prefix = seen + tl.cumsum(hit, 0) - hit
            below = mask[:, None] & (prefix[:, None] < starts[None, :])
            before += tl.sum(below.to(tl.int32), 0)
            seen += tl.sum(hit, 0)
        later = (chunks >= 1) & (chunks < CHUNKS)
        at = (num_tokens + chunks).to(tl.int64) * NUM_RANKS + r
        tl.store(prefix_ptr + at, before, mask=later)


@triton.jit
def row_chunk(pos, rows, CHUNKS: tl.constexpr, LAST_SHARE: tl.constexpr):
    """The chunk that carries row ``pos`` of ``rows`` (:func:`chunk_start`'s inverse: the
    number of chunks after the first that start at or before ``pos``)."""
    chunk = tl.zeros_like(pos)
    for c in tl.static_range(1, CHUNKS):
        chunk += (pos >= first_row(rows, c, CHUNKS, LAST_SHARE)).to(pos.dtype)
    return chunk


@triton.jit
def sum_block(
    first,  # the block's first token
    base,  # int64 base address of this rank's region heap
    x_ptr,  # [M, H] bf16 the combine's input: this rank's own rows are read here
    weights_ptr,  # [M, K] float32 their weights (HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] bool is_token_in_rank of the dispatch
    prefix_ptr,  # [N + CHUNKS, R] int32 copy_combine_prefix's
    own_start,  # the first row of x from this rank's own tokens
    num_tokens,  # N, this rank's tokens
    K,  # top-k columns of the weights
    chunk,  # the chunk of rows whose copies precede this launch
    bias0_ptr,  # [N, H] bf16 (NUM_BIAS >= 1)
    bias1_ptr,  # [N, H] bf16 (NUM_BIAS >= 2)
    out_ptr,  # [N, H] bf16 out: the sums
    out_weights_ptr,  # [N, K] float32 out: the summed weights (HAS_WEIGHTS)
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    rank,  # this rank
    timeout_us,  # limit of the waits, in microseconds
    H: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    CAPACITY: tl.constexpr,
    MAX_TOPK: tl.constexpr,
    ROWS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NUM_BIAS: tl.constexpr,
    CHUNKS: tl.constexpr,
    LAST_SHARE: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Wait for the peers' rows of ``chunk``, then sum those of the tokens ``first`` to
    ``first + BLOCK_TOKENS - 1`` whose last row came in it (:func:`copy_combine_sum`'s
    arguments)."""
    ranks = tl.arange(0, BLOCK_RANKS)
    peers = (ranks < NUM_RANKS) & (ranks != rank)
    # Each peer's copy stream sets this chunk's flag of it to 1 after its copies (no SM: the
    # flags are there while this launch waits for SMs, whatever the peers' SMs are doing).
    arrivals = (base + chunk * NUM_RANKS * 8 + ranks * 8).to(tl.pointer_type(tl.int64))
    # After a wait that gave up (the last call's, say) nothing copied can be trusted.
    trusted = tl.load(status_ptr, volatile=True) != STATUS_TIMEOUT
    limit = limit_ns(timeout_us, status_ptr)
    ones = tl.full((BLOCK_RANKS,), 1, tl.int64)
    arrived, ok = wait_all_at_least(arrivals, ones, peers, limit, USE_CLOCK)
    if not ok:
        peer = first_lane(peers & (arrived < ones), ranks)
        record_timeout(status_ptr, peer, COPY_COMBINE_RECV, limit)
    came = (ranks == rank) | ((arrived >= ones) & trusted)

    tokens = first + tl.arange(0, BLOCK_TOKENS)
    tmask = tokens < num_tokens
    hit = tl.load(
        in_rank_ptr + tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :],
        mask=tmask[:, None] & (ranks < NUM_RANKS)[None, :],
        other=0,
    ).to(tl.int32)
    # Each token's row among those that went to each rank: where that rank's copy put it.
    at = tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :]
    pos = tl.load(prefix_ptr + at, mask=(hit > 0), other=0)
    if CHUNKS > 1:  # this launch sums the tokens whose last row came in its chunk
        sent = tl.load(prefix_ptr + num_tokens.to(tl.int64) * NUM_RANKS + ranks, peers, 0)
        sent = sent[None, :]
        from_peer = (hit > 0) & (ranks != rank)[None, :]
        last = tl.max(tl.where(from_peer, row_chunk(pos, sent, CHUNKS, LAST_SHARE), 0), 1)
        tmask = tmask & (last == chunk)
        hit = hit * tmask.to(tl.int32)[:, None]
    pos = pos.to(tl.int64)
    slot = ((ranks - rank - 1 + NUM_RANKS) % NUM_RANKS).to(tl.int64)[None, :] * CAPACITY
    src = base + ROWS_OFFSET + (slot + pos) * (2 * H)
    wsrc = base + WEIGHTS_OFFSET + (slot * MAX_TOPK + pos * K) * 4
    own_row = own_start + lane(pos, ranks, rank)
    if X_ALIGNED:
        # This rank's rows (in x) and weights join the peers' as addresses in the same
        # tensors, which the sums take as 16-byte aligned: a pointer chosen between x and the
        # region would leave Triton unsure of either's alignment, and the loads of every row
        # one BF16 value an instruction.
        own = (ranks == rank)[None, :]
        src = tl.where(own, (x_ptr.to(tl.int64) + own_row * (2 * H))[:, None], src)
        wsrc = tl.where(own, (weights_ptr.to(tl.int64) + own_row * K * 4)[:, None], wsrc)
    ready = hit * came.to(tl.int32)[None, :]
    if tl.max(tmask.to(tl.int32), 0) > 0:  # (a block with no token of this chunk skips)
        sum_step(
            src,
            wsrc,
            ready,
            tokens,
            tmask,
            own_row,
            x_ptr,
            weights_ptr,
            bias0_ptr,
            bias1_ptr,
            out_ptr,
            out_weights_ptr,
            rank,
            K,
            H,
            NUM_RANKS,
            HAS_WEIGHTS,
            NUM_BIAS,
            not X_ALIGNED,  # LOCAL: own rows from x_ptr, where their addresses are not in src
            USE_CLOCK,
            BLOCK_TOKENS,
            BLOCK_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            STAGES,
        )
        if not (ok & trusted):  # a row never came: its token's sum is NaN
            poison_lost(
                hit,
                ready,
                tokens,
                tmask,
                out_ptr,
                out_weights_ptr,
                K,
                H,
                HAS_WEIGHTS,
                BLOCK_TOKENS,
                BLOCK_WORDS,
                BLOCK_K,
            )


@kernel(
    "tritonep::normal::copy_combine_sum",
    do_not_specialize=["own_start", "num_tokens", "K", "chunk", "rank", "timeout_us"],
)
def copy_combine_sum(
    x_ptr,  # [M, H] bf16 the combine's input: this rank's own rows are read here
    weights_ptr,  # [M, K] float32 their weights (HAS_WEIGHTS)
    in_rank_ptr,  # [N, R] bool is_token_in_rank of the dispatch
    prefix_ptr,  # [N + CHUNKS, R] int32 copy_combine_prefix's (tokens before each sent to each
    # rank, the totals, the first token of each chunk at each rank)
    own_start,  # the first row of x from this rank's own tokens
    num_tokens,  # N, this rank's tokens
    K,  # top-k columns of the weights
    chunk,  # the chunk of rows whose copies precede this launch (0 to CHUNKS - 1)
    bias0_ptr,  # [N, H] bf16 (NUM_BIAS >= 1)
    bias1_ptr,  # [N, H] bf16 (NUM_BIAS >= 2)
    out_ptr,  # [N, H] bf16 out: the sums
    out_weights_ptr,  # [N, K] float32 out: the summed weights (HAS_WEIGHTS)
    peer_ptrs,  # [R] int64 base address of every rank's region heap
    state_ptr,  # [STATE_WORDS] int64 this rank's call counter (CALLS) and arrivals
    status_ptr,  # [STATUS_WORDS] int32 (kernels.status)
    rank,  # this rank
    timeout_us,  # limit of the waits, in microseconds (sync.timeout_us)
    H: tl.constexpr,  # hidden size
    NUM_RANKS: tl.constexpr,  # R: ranks of the group
    CAPACITY: tl.constexpr,  # rows of a source's slot in a region
    MAX_TOPK: tl.constexpr,  # weights a slot row has room for
    DONE_OFFSET: tl.constexpr,  # byte offsets in a region (RegionLayout)
    ROWS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,  # sum weights too
    NUM_BIAS: tl.constexpr,  # bias tensors added (0 to 2)
    CHUNKS: tl.constexpr,  # copies (and launches of this kernel) per peer and call
    LAST_SHARE: tl.constexpr,  # the last chunk holds 1 / LAST_SHARE of the rows
    USE_CLOCK: tl.constexpr,  # waits read the GPU clock; else the interpreter's rounding
    BLOCK_TOKENS: tl.constexpr,  # tokens a program sums
    BLOCK_WORDS: tl.constexpr,  # int32 words of a row summed at a time
    BLOCK_RANKS: tl.constexpr,  # NUM_RANKS as a power of two (at least 2)
    BLOCK_K: tl.constexpr,  # power of two >= max(K, 2)
    X_ALIGNED: tl.constexpr,  # x's rows start at 16-byte boundaries
    LATER: tl.constexpr,  # a launch after the first chunk's (from the chunk's first token)
    STAGES: tl.constexpr,  # blocks of the rows loading at once (tl.range's num_stages)
):
    pid = tl.program_id(0)
    ranks = tl.arange(0, BLOCK_RANKS)
    peers = (ranks < NUM_RANKS) & (ranks != rank)
    call = tl.load(state_ptr + CALLS, volatile=True) + 1
    base = tl.load(peer_ptrs + rank)
    first = pid * BLOCK_TOKENS
    if LATER:
        # A later chunk's tokens start where its first row at some peer lies (from the block
        # that holds that token on), and the programs past the last token only count out.
        later = tl.load(
            prefix_ptr + (num_tokens + chunk).to(tl.int64) * NUM_RANKS + ranks,
            mask=peers,
            other=0,
        )
        start = tl.min(tl.where(peers, later, num_tokens), 0)
        first += start // BLOCK_TOKENS * BLOCK_TOKENS
    # (The first launch's programs all have tokens, and a branch around its sums made them
    # 30 % slower on 4x H200: 95-102 us against 72-74; the condition is constant there.)
    if (first < num_tokens) | (not LATER):
        sum_block(
            first,
            base,
            x_ptr,
            weights_ptr,
            in_rank_ptr,
            prefix_ptr,
            own_start,
            num_tokens,
            K,
            chunk,
            bias0_ptr,
            bias1_ptr,
            out_ptr,
            out_weights_ptr,
            status_ptr,
            rank,
            timeout_us,
            H,
            NUM_RANKS,
            CAPACITY,
            MAX_TOPK,
            ROWS_OFFSET,
            WEIGHTS_OFFSET,
            HAS_WEIGHTS,
            NUM_BIAS,
            CHUNKS,
            LAST_SHARE,
            USE_CLOCK,
            BLOCK_TOKENS,
            BLOCK_WORDS,
            BLOCK_RANKS,
            BLOCK_K,
            X_ALIGNED,
            STAGES,
        )
    # The last program of the last chunk: every peer may copy its next call's rows here; then,
    # before the call closes, it waits until every peer has read this rank's rows too, so that
    # this rank's next copies (queued after this launch) find every region free: the copies
    # need no kernel before them, and run beside work that holds every SM.
    tl.debug_barrier()
    if chunk == CHUNKS - 1:
        finished = tl.atomic_add(state_ptr + ARRIVALS, 1, sem="acq_rel", scope="gpu")
        if finished == tl.num_programs(0) - 1:
            # Every launch of the call has read the arrival flags: clear them for the next
            # call's (whose copies come only once this rank's done flag below is seen).
            for c in tl.static_range(CHUNKS):
                cleared = (base + (c * NUM_RANKS + ranks) * 8).to(tl.pointer_type(tl.int64))
                tl.store(cleared, tl.zeros((BLOCK_RANKS,), tl.int64), mask=peers)
            targets = call + tl.zeros((BLOCK_RANKS,), tl.int64)
            theirs = tl.load(peer_ptrs + ranks, mask=peers, other=0) + DONE_OFFSET + rank * 8
            tl.atomic_xchg(
                theirs.to(tl.pointer_type(tl.int64)),
                targets,
                mask=peers,
                sem="release",
                scope="sys",
            )
            mine = (base + DONE_OFFSET + ranks * 8).to(tl.pointer_type(tl.int64))
            limit = limit_ns(timeout_us, status_ptr)
            done, ok = wait_all_at_least(mine, targets, peers, limit, USE_CLOCK)
            if not ok:
                peer = first_lane(peers & (done < targets), ranks)
                record_timeout(status_ptr, peer, COPY_COMBINE_DONE, limit)
            tl.store(state_ptr + ARRIVALS, 0)
            tl.store(state_ptr + CALLS, call)
