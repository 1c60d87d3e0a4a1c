"""The normal mode's combine over copy engines: each source's rows go back in one peer copy.

:class:`CopyCombine` serves :meth:`~tritonep.modes.normal.NormalMode.combine` for handles of
exact-size dispatches (their host knows the rows received from every source) when the mode was
made with ``copy_combine_tokens``, for calls large enough that it beats the rings
(:data:`MIN_TOKENS`: :meth:`CopyCombine.serves`). Per call:

1. for each of :data:`CHUNKS` chunks, one copy per peer, in turn (copy engines; a chunk's
   copies in one batch of the driver where it allows): that chunk of the rows this rank
   received from the peer (contiguous in ``x``, in token order; with the first chunk, their
   weights), into this rank's slot of the peer's region (free: the previous call's sums ended
   only once every peer had read it), then this rank's arrival flag of the chunk at every peer
   (a stream memory operation); the first chunk's on the caller's stream (on the legacy
   default stream, which takes no batch, between two events on the copies' stream), the others
   on a stream of their own after them;
2. on the caller's stream, after the first chunk's copies,
   :func:`~tritonep.kernels.normal_copy_combine.copy_combine_prefix` (each token's row at each
   rank), then one launch per chunk of
   :func:`~tritonep.kernels.normal_copy_combine.copy_combine_sum`, which waits on the device
   for the peers' arrival flags of its chunk and sums the tokens whose rows have all come with
   it: the peers' rows and this rank's own (read in place) in rank order, plus the bias. So the
   sums of one chunk run while the next chunk's rows move, and the call ends a chunk's sums
   after its last copy; the caller's stream then waits for this rank's own last copies (they
   read ``x``).

No SM moves a row: beside a GEMM that holds every SM the copies still run, and only the sums
wait for SMs. The region costs ``(R - 1) * copy_combine_tokens * (2 H + 4 max_topk)`` bytes of
symmetric memory per rank.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist
import triton

from ..heap import allocate
from ..kernels import normal_copy_combine as ncc
from ..kernels.launcher import KernelLaunch, Shared
from ..kernels.sync import use_clock

#: Tokens a program of the sum kernel sums, and BF16 values of a row at a time (GPU, CPU).
#: On 2x H200 (4096 tokens, hidden 7168) 8 tokens of 512 values summed in 55-57 us where 4 of
#: 1024 took 63-64 (and 2 of 1024, 2 or 4 of 2048, 8 or 16 with 8 warps no less).
_BLOCK_TOKENS = {True: 8, False: 4}
#: Tokens a program sums in the launches after the first: those of the last chunks, few, which
#: the call waits for after its last copy, spread over more programs (2x H200, 4096 tokens: the
#: last launch 42 / 26 / 24 / 28 us with 1 / 2 / 4 / 8 tokens a program).
_BLOCK_TOKENS_LATER = {True: 2, False: 2}
_BLOCK_ELEMS = {True: 512, False: 64}
#: BF16 values of a row at a time in the later launches: with two tokens a program, 1024 keep
#: 8 warps loading 16 bytes a thread (512 would load 8).
_BLOCK_ELEMS_LATER = {True: 1024, False: 64}
#: Tokens of ``is_token_in_rank`` the prefix kernel reads at a time (GPU, CPU): its passes
#: over a column wait for each load in turn, so a GPU takes 4096 tokens in one.
_PREFIX_TOKENS = {True: 4096, False: 16}
#: Blocks of the rows a program of the sum kernel loads ahead (``tl.range``'s ``num_stages``;
#: GPU, CPU: the interpreter does not pipeline). On 4x H200 (4096 tokens, two chunks) the first
#: launch's sums took 68.6 us with three against 100 with one, whose loads of a block wait for
#: the sums of the block before; the combine 466.9-467.2 us eager against 489.7-490.7 (with two:
#: 470.8). The rings' sums, whose rows come slot by slot, lost with three (their combine 663-665
#: us against 614), so they load as before.
_STAGES = {True: 3, False: None}
#: Warps of a program of the sum kernel: on 4x H200 the sums of 8 tokens of 512 values took
#: 85-86 us with 8 warps against 121 with 4 (on 2x H200 57-61 us either way).
_NUM_WARPS = 8
#: Copies per peer and call, each followed by a launch of the sums: the default of
#: ``NormalMode(copy_combine_chunks=...)``, read when a mode is made. The sums of one chunk run
#: while the next moves, so the call ends with the last chunk's sums, of ``1 / LAST_SHARE[R]``
#: of the rows (``normal_copy_combine.chunk_start``); each copy more costs about 5 us and a
#: flag write.
#: On 4x H200 (4096 tokens) one and two chunks take 527 / 484 us a combine replayed from a
#: graph (three took longer: each chunk more adds a gap before each peer's copy); beside a GEMM
#: two end 1.31x the GEMM alone from a host start, 1.07x queued.
CHUNKS = 2
#: The last chunk holds ``1 / LAST_SHARE[R]`` of each peer's rows at ``R`` ranks (a fifth at
#: rank counts not listed): the default of ``NormalMode(copy_combine_last_share=...)``, read
#: when a mode is made. The first launch's sums, of the other rows, should end when the last
#: copies do; at 2 ranks the copies (one peer's rows) are short beside the sums, so the last
#: chunk is larger. 2x H200 (4096 tokens, two chunks): a third 196.0-199.0 us replayed from a
#: graph, a quarter 206.7-206.9, a fifth 210.2-211.1; 4x H200: a fifth 492.6-494.4, a quarter
#: 500.5-501.6, a sixth 496.2-498.5. 3 ranks take the value between; more than 4 are unmeasured.
LAST_SHARE = {2: 3, 3: 4, 4: 5}


#: The fewest tokens (on the rank with the most) for which a combine takes the copy engines at
#: ``R`` ranks (rank counts not listed: :data:`MIN_TOKENS_OTHERS`): the default of
#: ``NormalMode(copy_combine_min_tokens=...)``, read when a mode is made. Smaller calls take the
#: rings: a copy-engine call spends about 70-80 us of host time at 2 ranks (110-150 at 4), which
#: eager calls wait for, and its copies and flags cost the device more than the rings' small
#: launches. Each value is the fewest measured tokens at which two chunks beat the rings by a
#: tenth, eager and replayed from a graph (BENCHMARKS.md): 4x H200, 2048 tokens, 264 / 274 us
#: against 325 / 323 (1024: 169 / 171 against 179 / 177, host-bound); 2x H200, 2048 tokens
#: lose eager (171 against 143), 4096 win (192 / 192 against 259 / 257).
MIN_TOKENS = {2: 3072, 4: 2048}
MIN_TOKENS_OTHERS = 3072


def default_min_tokens(num_ranks: int) -> int:
    """The fewest tokens for which a combine takes the copy engines at ``num_ranks`` ranks
    unless the mode says otherwise (:data:`MIN_TOKENS`)."""
    return MIN_TOKENS.get(num_ranks, MIN_TOKENS_OTHERS)


def default_last_share(num_ranks: int) -> int:
    """The last chunk's share (``1 / this`` of a peer's rows) at ``num_ranks`` ranks unless the
    mode says otherwise: :data:`LAST_SHARE`'s, or a fifth."""
    return LAST_SHARE.get(num_ranks, 5)


class CopyCombine:
    """The copy-engine combine of one normal mode (a collective: every rank makes it).

    Args:
        group: the mode's process group.
        hidden: hidden size ``H``.
        max_topk: the most weights a row carries.
        capacity: the most tokens a rank dispatches (a region holds that many rows per source).
        device: the mode's device.
        status: the mode's :class:`~tritonep.kernels.status.Status` (its waits record there).
        timeout_us: limit of every wait (:func:`~tritonep.kernels.sync.timeout_us`).
        chunks: copies per peer and call (:data:`CHUNKS`; the same on every rank).
        last_share: the last chunk holds ``1 / last_share`` of each peer's rows
            (:func:`default_last_share` of the rank count; the same on every rank).
        min_tokens: the fewest tokens, on the rank with the most, for which a combine takes
            this path (:func:`default_min_tokens` of the rank count; the same on every rank).
    """

    def __init__(
        self,
        group,
        hidden,
        max_topk,
        capacity,
        device,
        status,
        timeout_us: int,
        chunks: int | None = None,
        last_share: int | None = None,
        min_tokens: int | None = None,
    ):
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.hidden, self.max_topk, self.capacity = hidden, max_topk, capacity
        self.chunks = CHUNKS if chunks is None else chunks
        R, me = self.num_ranks, self.rank
        self.last_share = default_last_share(R) if last_share is None else last_share
        self.min_tokens = default_min_tokens(R) if min_tokens is None else min_tokens
        self.layout = ncc.region_layout(R, capacity, hidden, max_topk, self.chunks)
        self.heap = allocate(self.layout.total, group, device)
        self.device = self.heap.device
        self.state = torch.zeros(ncc.STATE_WORDS, dtype=torch.int64, device=self.device)
        self.status = status
        # The peers in the order this rank copies to them, one at a time, starting with the one
        # after it: while the ranks keep pace, each step's copies form a permutation, every
        # destination receiving one (4x H200: one copy alone moves 375 GB/s, while three at
        # once on three streams took 617-734 us for what three in turn move in about 420).
        self.peers = [(me + k) % R for k in range(1, R)]
        # Where this rank's rows and weights for each peer go: its slot in the peer's region.
        self._rows_to, self._weights_to = {}, {}
        for s in self.peers:
            slot = (me - s - 1) % R
            self._rows_to[s] = self.heap.view(
                s,
                torch.bfloat16,
                (capacity, hidden),
                self.layout.rows + slot * capacity * hidden * 2,
            )
            self._weights_to[s] = self.heap.view(
                s,
                torch.float32,
                (capacity * max_topk,),
                self.layout.weights + slot * capacity * max_topk * 4,
            )
        # This rank's arrival flag of each chunk at each peer: set to 1 after the chunk's copies.
        self._arrived = {
            s: [self.heap.view(s, torch.int64, (1,), (c * R + me) * 8) for c in range(self.chunks)]
            for s in self.peers
        }
        gpu = self.device.type == "cuda"
        self._gpu = gpu
        self._device_index = self.device.index if gpu else -1
        self._rows_at = {s: view.data_ptr() for s, view in self._rows_to.items()}
        self._weights_at = {s: view.data_ptr() for s, view in self._weights_to.items()}
        self._driver = _Driver.load() if gpu else None
        self._events: list[int] = []
        if self._driver is not None:
            # A chunk's copies: rows and weights to each peer.
            self._copy_list = _CopyList(2 * len(self.peers))
            # Each chunk's flag writes, made once: one driver call per chunk and call.
            self._signals = [
                self._driver.writes([self._arrived[s][c].data_ptr() for s in self.peers], 1)
                for c in range(self.chunks)
            ]
        if self._driver is not None and self.chunks > 1:
            # The copies' own stream, and the events that order it with the caller's: after the
            # first chunk's copies, after the last's (copies' stream) and, on the legacy default
            # stream, before the first's.
            self._copy_stream = torch.cuda.Stream(self.device)
            self._events = [self._driver.event() for _ in range(3)]
        self._lanes = triton.next_power_of_2(max(R, 2))
        self._sums: dict[tuple, KernelLaunch] = {}
        # Each token's row at each rank, written by a launch per call (copy_combine_prefix):
        # [tokens + chunks, R] int32, grown (at least doubled) for more tokens; a buffer once
        # used stays alive, since a CUDA graph may hold its address.
        self._prefix = torch.empty(
            (capacity + self.chunks) * R, dtype=torch.int32, device=self.device
        )
        self._old_prefixes: list[torch.Tensor] = []
        prefix_meta = {
            "NUM_RANKS": R,
            "CHUNKS": self.chunks,
            "LAST_SHARE": self.last_share,
            "BLOCK": _PREFIX_TOKENS[self._gpu],
            "BLOCK_CHUNKS": triton.next_power_of_2(max(self.chunks, 2)),
            "num_warps": 8,
        }
        self._prefix_plan = KernelLaunch(
            ncc.copy_combine_prefix,
            (R,),
            prefix_meta,
            ncc.PrefixCall._fields,
            (0, 1),
            self.state,
        )
        self._no_shared = Shared.of(())
        self.timeout_us = timeout_us

    @property
    def timeout_us(self) -> int:
        return self._timeout_us

    @timeout_us.setter
    def timeout_us(self, value: int) -> None:
        self._timeout_us = value
        self._shared = Shared.of(
            ncc.SumShared(self.heap.peer_ptrs, self.state, self.status.words, self.rank, value)
        )

    def _sum_plan(
        self, has_weights: bool, num_bias: int, block_k: int, x_aligned: bool, later: bool
    ) -> KernelLaunch:
        """The sums' launch for these arguments, for the first chunk or (``later``) the
        others."""
        gpu = self._gpu
        variant = ncc.SumVariant(
            H=self.hidden,
            NUM_RANKS=self.num_ranks,
            CAPACITY=self.capacity,
            MAX_TOPK=self.max_topk,
            DONE_OFFSET=self.layout.done,
            ROWS_OFFSET=self.layout.rows,
            WEIGHTS_OFFSET=self.layout.weights,
            HAS_WEIGHTS=has_weights,
            NUM_BIAS=num_bias,
            CHUNKS=self.chunks,
            LAST_SHARE=self.last_share,
            USE_CLOCK=use_clock(self.device),
            BLOCK_TOKENS=(_BLOCK_TOKENS_LATER if later else _BLOCK_TOKENS)[gpu],
            BLOCK_WORDS=(_BLOCK_ELEMS_LATER if later else _BLOCK_ELEMS)[gpu] // 2,
            BLOCK_RANKS=self._lanes,
            BLOCK_K=block_k,
            X_ALIGNED=x_aligned,
            LATER=later,
            STAGES=_STAGES[gpu],
        )
        # (No fused multiply-adds, as in the rings' sums: the kernel only adds.)
        meta = {**variant._asdict(), "num_warps": _NUM_WARPS, "enable_fp_fusion": False}
        fields = ncc.SumCall._fields
        pointers = tuple(i for i, name in enumerate(fields) if name.endswith("_ptr"))
        plan = KernelLaunch(ncc.copy_combine_sum, (1,), meta, fields, pointers, self.state)
        self._sums[(has_weights, num_bias, block_k, x_aligned, later)] = plan
        return plan

    def serves(self, handle) -> bool:
        """Whether a combine along ``handle`` takes this path: an exact-size dispatch's (its
        host knows each source's rows) in which no rank dispatched more tokens than the region
        holds and some rank at least :attr:`min_tokens`. Every rank answers the same: the
        count exchange gave each the same ``most_tokens``."""
        most = handle.most_tokens
        return handle.source_rows is not None and self.min_tokens <= most <= self.capacity

    def __call__(self, x, handle, topk_weights, terms: tuple, K: int, block_k: int, out, out_w):
        """Combine ``x`` (``[M, H]`` BF16, checked) along ``handle`` (with ``source_rows``) into
        ``out`` (``[N, H]`` BF16) and, with ``topk_weights`` (``[M, K]`` float32), ``out_w``;
        ``terms``: up to two ``[N, H]`` BF16 bias tensors."""
        if self._gpu and torch._C._cuda_getDevice() != self._device_index:
            with torch.cuda.device(self.device):  # (launches and copies on the mode's device)
                return self(x, handle, topk_weights, terms, K, block_k, out, out_w)
        rows = handle.source_rows
        if max(rows) > self.capacity:
            raise ValueError(
                f"handle: {max(rows)} rows from one source exceed copy_combine_tokens="
                f"{self.capacity}"
            )
        starts = [0] * self.num_ranks
        for s in range(1, self.num_ranks):
            starts[s] = starts[s - 1] + rows[s - 1]
        # Rows of x at 16-byte boundaries (as a fresh tensor's are: the mode's hidden size is a
        # multiple of 8) are read 16 bytes a load.
        x_aligned = x.data_ptr() % 16 == 0
        key = (topk_weights is not None, len(terms), block_k, x_aligned, False)
        plan = self._sums.get(key) or self._sum_plan(*key)
        N = handle.num_tokens
        if (N + self.chunks) * self.num_ranks > self._prefix.numel():
            self._old_prefixes.append(self._prefix)
            size = max((N + self.chunks) * self.num_ranks, 2 * self._prefix.numel())
            self._prefix = torch.empty(size, dtype=torch.int32, device=self.device)
        prefix = ncc.PrefixCall(handle.is_token_in_rank, self._prefix, N)
        call = ncc.SumCall(
            x_ptr=x,
            weights_ptr=topk_weights,
            in_rank_ptr=handle.is_token_in_rank,
            prefix_ptr=self._prefix,
            own_start=starts[self.rank],
            num_tokens=N,
            K=K,
            chunk=0,
            bias0_ptr=terms[0] if terms else None,
            bias1_ptr=terms[1] if len(terms) > 1 else None,
            out_ptr=out,
            out_weights_ptr=out_w,
        )
        grid = (max(1, triton.cdiv(N, _BLOCK_TOKENS[self._gpu])),)
        later, later_grid = plan, grid  # (the launches after the first chunk's)
        if self.chunks > 1:
            later_key = (*key[:-1], True)
            later = self._sums.get(later_key) or self._sum_plan(*later_key)
            later_grid = (max(1, triton.cdiv(N, _BLOCK_TOKENS_LATER[self._gpu])),)
        driver = self._driver
        if driver is None or self.chunks == 1:
            # Each chunk's copies then its sums, on the caller's stream (CPU ranks: plain
            # copies, done when they return).
            for c in range(self.chunks):
                self._copy(x, topk_weights, K, rows, starts, c, None)
                if c == 0:
                    self._prefix_plan(prefix, self._no_shared)
                    plan(call, self._shared, grid)
                else:
                    later(call._replace(chunk=c), self._shared, later_grid)
            return
        # The first chunk's copies on the caller's stream, the others on the copies' own
        # stream after them; the sums on the caller's stream after the first chunk's copies.
        stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        copies, events = self._copy_stream.cuda_stream, self._events
        # (The event follows the first chunk's flag writes: a copy queued on the other stream
        # before them would hold them back, and the peers' sums with them, 2x H200.)
        if stream:
            self._copy(x, topk_weights, K, rows, starts, 0, stream)
            driver.record(events[0], stream)
            driver.wait(copies, events[0])
        else:
            # The legacy default stream takes no batch of copies (_Driver.copies): the first
            # chunk's go on the copies' stream between two events, the caller's stream going
            # on after them as it would after its own.
            driver.record(events[2], stream)
            driver.wait(copies, events[2])
            self._copy(x, topk_weights, K, rows, starts, 0, copies)
            driver.record(events[0], copies)
            driver.wait(stream, events[0])
        for c in range(1, self.chunks):
            self._copy(x, topk_weights, K, rows, starts, c, copies)
        driver.record(events[1], copies)
        # (After the first chunk's copies, not before them: a kernel waits for an SM, and
        # the copies should not wait with it beside work that holds every SM.)
        self._prefix_plan(prefix, self._no_shared)
        plan(call, self._shared, grid)
        # A later launch waits for the peers' flags of its chunk on the device, not for this
        # rank's copies (whose event its start would follow by 8-12 us, 4x H200): the call
        # waits for the last chunk's sums alone after the last copies. The caller's stream
        # then joins the copies', which read x.
        for c in range(1, self.chunks):
            later(call._replace(chunk=c), self._shared, later_grid)
        driver.wait(stream, events[1])

    def _copy(self, x, topk_weights, K: int, rows, starts, chunk: int, stream) -> None:
        """Chunk ``chunk`` of each peer's rows (with the first, all their weights) into this
        rank's slot of its region: one copy per peer on ``stream`` (None: the caller's), in
        turn (:attr:`peers`' order), straight through the driver in one batch
        (:meth:`_Driver.copies`), then this rank's arrival flag of the chunk at every peer; on
        CPU ranks plain copies and stores."""
        driver, chunks, share = self._driver, self.chunks, self.last_share
        if driver is None:
            for s in self.peers:
                n, a = rows[s], starts[s]
                lo, hi = (ncc.chunk_start(n, c, chunks, share) for c in (chunk, chunk + 1))
                if hi > lo:
                    self._rows_to[s][lo:hi].copy_(x[a + lo : a + hi])
                if chunk == 0 and n and topk_weights is not None:
                    self._weights_to[s][: n * K].copy_(topk_weights[a : a + n].view(n * K))
            for s in self.peers:
                self._arrived[s][chunk].fill_(1)
            return
        if stream is None:
            stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        row_bytes, x_at = 2 * self.hidden, x.data_ptr()
        w_at = topk_weights.data_ptr() if topk_weights is not None and chunk == 0 else 0
        batch = self._copy_list
        for s in self.peers:
            n, a = rows[s], starts[s]
            lo, hi = (ncc.chunk_start(n, c, chunks, share) for c in (chunk, chunk + 1))
            if hi > lo:
                batch.add(
                    self._rows_at[s] + lo * row_bytes,
                    x_at + (a + lo) * row_bytes,
                    (hi - lo) * row_bytes,
                )
            if w_at and n:
                batch.add(self._weights_at[s], w_at + a * K * 4, n * K * 4)
        driver.copies(batch, stream)
        if self.peers:
            driver.signal(stream, self._signals[chunk])

    def destroy(self) -> None:
        """Release the region (collective)."""
        if self._driver is not None:
            for event in self._events:
                self._driver.destroy_event(event)
        self._events = []
        self.heap.close()


#: ``CU_STREAM_MEM_OP_WRITE_VALUE_32``.
_WRITE_VALUE_32 = 2


class _MemOp(ctypes.Structure):
    """``CUstreamBatchMemOpParams`` as a write of a value (48 bytes, as the union is)."""

    _fields_ = [
        ("operation", ctypes.c_uint32),
        ("address", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("alias", ctypes.c_uint64),
        ("pad", ctypes.c_uint64),
    ]


#: ``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``.
_SRC_ACCESS_ORDER_STREAM = 1


class _CopyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: the source's access order, two location hints (type and id,
    zero: none) and flags (24 bytes)."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_type", ctypes.c_int),
        ("src_id", ctypes.c_int),
        ("dst_type", ctypes.c_int),
        ("dst_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class _CopyList:
    """Copies gathered for one driver call (:meth:`_Driver.copies`): device addresses and
    sizes in arrays the driver reads, made once and refilled each call."""

    def __init__(self, capacity: int):
        self.dsts = (ctypes.c_uint64 * capacity)()
        self.srcs = (ctypes.c_uint64 * capacity)()
        self.sizes = (ctypes.c_size_t * capacity)()
        self.count = 0

    def add(self, dst: int, src: int, nbytes: int) -> None:
        """``nbytes`` from ``src`` to ``dst``, after the copies added before."""
        i = self.count
        self.dsts[i], self.srcs[i], self.sizes[i] = dst, src, nbytes
        self.count = i + 1


class _Driver:
    """The CUDA driver calls of a copy-engine combine (ctypes): peer copies, a chunk's in one
    batch where the driver allows (a copy on its own costs 3.0 us of host time on an H200
    host, against 6-9 us for ``Tensor.copy_``, whose stream bookkeeping a copy between
    addresses does not need), events between its streams, and the stream memory operations
    that set its flags. Stream capture records them all but the batch, as it records torch's
    own copies and waits. A failure raises ``RuntimeError`` naming the call."""

    _loaded: _Driver | None = None

    def __init__(self, lib):
        self._memcpy = lib.cuMemcpyDtoDAsync_v2
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._create = lib.cuEventCreate
        self._create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._record = lib.cuEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._destroy = lib.cuEventDestroy_v2
        self._destroy.argtypes = [ctypes.c_void_p]
        self._batch = lib.cuStreamBatchMemOp_v2
        self._batch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
        self._capturing = lib.cuStreamIsCapturing
        self._capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        calls = (
            self._memcpy,
            self._create,
            self._record,
            self._wait,
            self._destroy,
            self._batch,
            self._capturing,
        )
        # A batch of copies (drivers of CUDA 12.8 on: ``_v2`` from CUDA 13, without the
        # failure index of the first form): one driver call, whose copies the engines run
        # without the 2-4 us that each copy issued on its own leaves before the next (4x H200:
        # 159 MB to one peer in 6 copies 431 us, in 12 454 us, as one copy or a batch of 6 or
        # 12 410-413 us, scripts/probes/batch_copy_probe.py; a combine's first chunk to three
        # peers 334.5 us against 337 in three copies, one after another all the same). Stream
        # capture refuses it (CUDA error 900 on 580 drivers): captured calls copy one by one.
        self._copies, self._copies_fail = None, False
        for name, fail in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            if hasattr(lib, name):
                self._copies, self._copies_fail = getattr(lib, name), fail
                self._copies.restype = ctypes.c_int
                break
        # Every copy's attributes: the source read in stream order (after the work before
        # the batch), no location hints.
        self._attrs = (_CopyAttributes * 1)(_CopyAttributes(_SRC_ACCESS_ORDER_STREAM))
        self._attrs_index = (ctypes.c_size_t * 1)(0)
        for f in calls:
            f.restype = ctypes.c_int

    @classmethod
    def load(cls) -> _Driver:
        if cls._loaded is None:
            cls._loaded = cls(ctypes.CDLL("libcuda.so.1"))
        return cls._loaded

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``nbytes`` from ``src`` to ``dst`` (device addresses; a peer's, mapped here) on
        ``stream``, after the work queued there."""
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def copies(self, batch: _CopyList, stream: int) -> None:
        """The copies in ``batch`` on ``stream``, after the work queued there, and empty
        ``batch``: in one batch where the driver has one and ``stream`` is neither the legacy
        default stream nor being captured, else one call per copy, in ``batch``'s order."""
        count, batch.count = batch.count, 0
        # (The legacy default stream, 0, takes no batch: CUDA error 1.)
        if count > 1 and stream and self._copies is not None:
            status = ctypes.c_int(0)  # (the driver's answers: one per call, as threads may call)
            self._check(self._capturing(stream, ctypes.byref(status)), "cuStreamIsCapturing")
            if status.value == 0:  # CU_STREAM_CAPTURE_STATUS_NONE
                tail = (ctypes.byref(ctypes.c_size_t(0)),) if self._copies_fail else ()
                result = self._copies(
                    batch.dsts,
                    batch.srcs,
                    batch.sizes,
                    ctypes.c_size_t(count),
                    self._attrs,
                    self._attrs_index,
                    ctypes.c_size_t(1),
                    *tail,
                    ctypes.c_void_p(stream),
                )
                self._check(result, "cuMemcpyBatchAsync")
                return
        for i in range(count):
            self.copy(batch.dsts[i], batch.srcs[i], batch.sizes[i], stream)

    def event(self) -> int:
        """A new event of the current context (no timing: the cheapest to record and wait)."""
        event = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(event), 0x2), "cuEventCreate")  # DISABLE_TIMING
        return event.value or 0

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream`` (after the work queued there)."""
        self._check(self._record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """Make the work queued next on ``stream`` wait for ``event``'s (stream capture
        follows it, forking and joining streams as torch's own waits do)."""
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")

    @staticmethod
    def writes(addresses: list[int], value: int):
        """Stream memory operations that store the 32-bit ``value`` at each address (the low
        word of an int64 flag), each after the work before it on the stream is done and
        visible (the driver's default: a system-wide fence first); :meth:`signal` issues them."""
        ops = (_MemOp * len(addresses))()
        for op, address in zip(ops, addresses, strict=True):
            op.operation, op.address, op.value = _WRITE_VALUE_32, address, value
        return ops

    def signal(self, stream: int, ops) -> None:
        """Issue ``ops`` (:meth:`writes`) on ``stream``, in one driver call."""
        self._check(self._batch(stream, len(ops), ops, 0), "cuStreamBatchMemOp")

    def destroy_event(self, event: int) -> None:
        self._check(self._destroy(event), "cuEventDestroy")

    @staticmethod
    def _check(result: int, name: str) -> None:
        if result:
            raise RuntimeError(f"copy-engine combine: {name} failed: CUDA error {result}")
