"""Normal-mode dispatch and combine over copy engines: rows moved by peer copies, no SMs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/probes/copy_engine_probe.py [--ranks 4] [--tokens 4096] [--gemm 8192]
        [--iters 20] [--cpu]

A cached call (the layout of an earlier exact-size dispatch, whose host read can bring the
``[R, R]`` matrix of rows from each source to each destination along with its count) knows on
the host where every source's rows go at every destination, so the rows can travel by
``cudaMemcpyAsync`` between this GPU and a peer's symmetric memory: copy engines, no SM. The
receive buffer is the output (rows by source rank, then token; a view, as the fixed-slot probe
hands out). Per rank:

* ``dispatch copies``: the rows to each peer already packed contiguous (in a plain tensor),
  one copy per peer, each on its own stream, this rank's own rows gathered into its receive
  buffer by SMs; then a device barrier (every rank's copies done). The floor of the design.
* ``dispatch gather``: the same after one gather (``index_select``, all SMs) packs the rows
  for every peer, peer by peer, into the send buffer: a whole cached dispatch.
* ``dispatch pipelined``: a gather per peer, its copy started as soon as its rows are packed.
* ``combine copies``: each expert rank's output rows of a source are already contiguous (the
  dispatch's order): one copy per peer straight from them into the source's combine region,
  then the device barrier.
* ``combine reduce``: that, then the source sums each token's rows from every rank (a Triton
  kernel on all SMs, FP32 sums in rank order): a whole combine.
* ``combine own direct``: the same, this rank's own rows not copied (a local copy also takes
  a copy engine): the reduce reads them where they are.
* ``combine split``: that, each peer's rows in two copies on two streams (more copies in
  flight at once).

Each is checked first (receive regions poisoned; the rows against a direct gather, the sums
against a PyTorch sum), then timed: ``alone`` (CUDA events after a barrier, the slowest
rank), ``graph`` (the same replayed from a CUDA graph) and, with ``--gemm G``, beside a BF16
``[G, G] @ [G, G]`` on the compute stream, communication launched first, as ``tritonep bench
overlap`` times the rings and the slots (``gemm`` / ``comm``: each side's end; ``finish``:
both done over the GEMM alone; timed from the first launch, and, ``q``, with both sides
queued behind a device-side wait, as the GEMM alone is timed). GB/s in DeepEP's accounting
(received rows, own included, over the time) and remote. ``--clocks N`` then prints rank 0's
SM clock and power while the ranks run N GEMMs, N copies-only dispatches, and both at once;
``--trace`` what one copies-only dispatch ran on rank 0's GPU (copy engines or kernels).

Predictions (4x H200, written before any number existed; rank 0 receives about 14.8k rows =
212 MB, 159 MB of it remote, 53 MB a peer; copy engines measured 323-367 GB/s remote per rank
at 32-128 MiB a peer, ``../shared/HARDWARE.md``; a gather of 212 MB reads and writes it,
about 100-140 us on all SMs; the GEMM alone about 1440 us; the rings today 598-633 us and
finish 1.11-1.20x beside it, the slots 704-754 us and 1.21-1.31x):

===================  ========  =====  ==================
call                 alone us  GB/s   finish beside GEMM
===================  ========  =====  ==================
dispatch copies      475       445    1.01
dispatch gather      610       350    1.10
dispatch pipelined   540       395    1.10
combine copies       475       445    1.01
combine reduce       550       385    1.06
===================  ========  =====  ==================

Second round, written after the first measurements (graph: dispatch copies 545-631 us, combine
copies 480-546, combine reduce 513-570; queued beside the GEMM 1.03-1.06): the local copy of
the combine's own rows (53 MB) shares the copy engines with the peers' copies; left to the
reduce, the call should take about 490 us, and two copies per peer about 470 (the 450 GB/s
target: 472 us).

On CPU ranks (``--cpu``, or fewer GPUs than ranks) the copies are plain ``copy_`` into peers'
shared memory, the reduce runs under the Triton interpreter, with tiny shapes; the checks are
what counts there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from tritonep.kernels.fp8 import to_bf16

GPU_SHAPE = dict(tokens=4096, hidden=7168, experts=256, topk=8)
CPU_SHAPE = dict(tokens=12, hidden=64, experts=24, topk=4)
POISON = -1  # int16 0xFFFF: a BF16 NaN, so an unwritten row never compares equal
PREDICTED = {  # call -> (us, finish beside the GEMM)
    "dispatch copies": (475, 1.01),
    "dispatch gather": (610, 1.10),
    "dispatch pipelined": (540, 1.10),
    "dispatch turn": (430, 1.01),
    "dispatch turn gathered": (460, 1.06),
    "dispatch turn + copy out": (560, 1.10),
    "dispatch pull": (440, 1.01),
    "dispatch pull gathered": (515, 1.06),
    "combine copies": (475, 1.01),
    "combine reduce": (550, 1.06),
    "combine own direct": (490, 1.06),
    "combine split": (470, 1.06),
}


@triton.jit
def reduce_kernel(
    rows_ptr,  # [max_rows, HIDDEN] bf16: this rank's combine region, rows by expert rank
    own_ptr,  # [rows, HIDDEN] bf16: this rank's own expert outputs (OWN >= 0)
    index_ptr,  # [tokens, NUM_RANKS] int32: each token's row from each rank, -1 if none
    out_ptr,  # [tokens, HIDDEN] bf16: each token's sum over ranks
    HIDDEN: tl.constexpr,  # row width in elements
    NUM_RANKS: tl.constexpr,  # ranks summed, in order
    OWN: tl.constexpr,  # this rank, whose rows are read from own_ptr; -1: all from rows_ptr
    BLOCK_H: tl.constexpr,  # columns per program
    EMULATE: tl.constexpr,  # under the interpreter: round to BF16 on the bits, as GPUs do
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for rank in tl.static_range(NUM_RANKS):
        row = tl.load(index_ptr + token * NUM_RANKS + rank)
        # A token that went to no expert of ``rank`` adds nothing (row -1 reads nothing).
        mask = (cols < HIDDEN) & (tl.zeros_like(cols) + row >= 0)
        base = own_ptr if rank == OWN else rows_ptr
        acc += tl.load(base + row.to(tl.int64) * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, to_bf16(acc, EMULATE), mask=cols < HIDDEN)


def _routing(opts, R):
    """Every source's tokens per destination rank (each rank makes all from the same seeds)."""
    from tritonep.reference.layout import expert_owner
    from tritonep.testing import route

    to = []  # to[s][d]: int64 token indices of source s that go to rank d, ascending
    for s in range(R):
        gen = torch.Generator().manual_seed(1000 + s)
        idx = route(gen, opts.tokens, opts.experts, opts.topk, "random")
        owner = expert_owner(idx, opts.experts, R)
        to.append([torch.nonzero((owner == d).any(1)).flatten() for d in range(R)])
    return to


def _rows(seed: int, n: int, hidden: int, dev) -> torch.Tensor:
    gen = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(n, hidden, generator=gen, device=dev).to(torch.bfloat16)


class CopyEngineA2A:
    """One rank's buffers, streams and calls."""

    def __init__(self, ctx, opts):
        from tritonep import heap as heaps

        R, me, dev, H = ctx.world_size, ctx.rank, ctx.device, opts.hidden
        self.R, self.me, self.dev, self.H, self.opts = R, me, dev, H, opts
        to = _routing(opts, R)
        self.counts = [[len(to[s][d]) for d in range(R)] for s in range(R)]
        c = self.counts
        # Dispatch: at rank d, source s's rows start at the rows of the sources before it.
        self.dispatch_base = [[sum(c[q][d] for q in range(s)) for d in range(R)] for s in range(R)]
        # Combine: at source s, expert rank d's rows start at the rows of the ranks before it.
        self.combine_base = [[sum(c[s][q] for q in range(d)) for d in range(R)] for s in range(R)]
        self.received = sum(c[s][me] for s in range(R))
        self.max_rows = R * opts.tokens
        region = self.max_rows * H * 2
        self.heap = heaps.allocate(3 * region, ctx.group, dev)
        self.recv = [self.heap.view(d, torch.bfloat16, (self.max_rows, H), 0) for d in range(R)]
        self.back = [
            self.heap.view(d, torch.bfloat16, (self.max_rows, H), region) for d in range(R)
        ]
        self.x = _rows(2000 + me, opts.tokens, H, dev)
        self.peers = [(me + k) % R for k in range(1, R)]  # each rank starts at another peer
        self.to = [t.to(dev) for t in to[me]]
        self.order = torch.cat([self.to[d] for d in self.peers])
        self.send = torch.empty(len(self.order), H, dtype=torch.bfloat16, device=dev)
        self.send_at = {}
        at = 0
        for d in self.peers:
            self.send_at[d] = at
            at += c[me][d]
        # The send buffer in the heap, that peers pull from: rank s packs its rows for each
        # peer in its own order of peers, so the rows for d start at ``send_from[s][d]``.
        self.send_heap = [self.heap.view(d, torch.bfloat16, (self.max_rows, H), 2 * region)
                          for d in range(R)]  # fmt: skip
        self.send_from = []
        for s in range(R):
            at, starts = 0, {}
            for k in range(1, R):
                starts[(s + k) % R] = at
                at += c[s][(s + k) % R]
            self.send_from.append(starts)
        # Where pulled rows land (a plain tensor: the call's output), and a copy out of the
        # receive region (the push design's epilogue).
        self.pulled = torch.empty(self.max_rows, H, dtype=torch.bfloat16, device=dev)
        # Combine input: this rank's expert outputs, one row per received (token, source).
        self.y = _rows(3000 + me, self.received, H, dev)
        index = torch.full((opts.tokens, R), -1, dtype=torch.int32)
        for d in range(R):
            index[to[me][d], d] = self.combine_base[me][d] + torch.arange(
                c[me][d], dtype=torch.int32
            )
        self.index = index.clone().to(dev)
        # The same, this rank's own rows as rows of y (the reduce reads them there).
        own = self.dispatch_base[me][me] + torch.arange(c[me][me], dtype=torch.int32)
        index[to[me][me], me] = own
        self.index_own = index.to(dev)
        self.out = torch.empty(opts.tokens, H, dtype=torch.bfloat16, device=dev)
        gpu = dev.type == "cuda"
        self.streams = {d: torch.cuda.Stream(dev) for d in self.peers} if gpu else {}
        self.more_streams = {d: torch.cuda.Stream(dev) for d in self.peers} if gpu else {}
        # Copies in turn: one stream for all of them, peers in this rank's rotated order.
        self.turn_stream = torch.cuda.Stream(dev) if gpu else None
        self.used: set = set()  # the streams of the call under way
        self._gemm = None
        handle = getattr(self.heap, "_keepalive", None)
        self.device_barrier = handle.barrier if gpu and hasattr(handle, "barrier") else None
        # What a direct gather gives: the rows each source sends here, and the rows each
        # expert rank sends back here.
        self.expected_recv = torch.cat(
            [_rows(2000 + s, opts.tokens, H, dev)[to[s][me]] for s in range(R)]
        )
        self.expected_back = torch.cat(
            [
                _rows(3000 + d, sum(c[s][d] for s in range(R)), H, dev)[
                    self.dispatch_base[me][d] : self.dispatch_base[me][d] + c[me][d]
                ]
                for d in range(R)
            ]
        )
        self.heap.barrier()

    def gemm(self):
        """The BF16 ``[G, G] @ [G, G]`` that communication is timed beside (made once)."""
        if self._gemm is None:
            G = self.opts.gemm
            a = torch.randn(G, G, device=self.dev, dtype=torch.bfloat16)
            b = torch.randn(G, G, device=self.dev, dtype=torch.bfloat16)
            c = torch.empty(G, G, device=self.dev, dtype=torch.bfloat16)
            self._gemm = lambda: torch.mm(a, b, out=c)
        return self._gemm

    # ---- the calls ------------------------------------------------------------------------

    def _copy(self, d, dst: torch.Tensor, src: torch.Tensor, after=None, stream=None):
        """``dst.copy_(src)`` on peer ``d``'s stream (or ``stream``), after ``after`` (an
        event) if given."""
        stream = stream or self.streams.get(d)
        if stream is None:
            dst.copy_(src)
            return
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self.used.add(stream)

    def _start(self):
        """An event on the current stream that the peers' streams wait for (GPU), else None."""
        if not self.streams:
            return None
        start = torch.cuda.Event()
        start.record()
        return start

    def _finish(self):
        """The current stream waits for this call's copies (only the streams it used: under
        graph capture, waiting for a stream outside the capture fails), then for every
        rank's."""
        current = torch.cuda.current_stream(self.dev) if self.streams else None
        for stream in self.used:
            current.wait_stream(stream)
        self.used = set()
        if self.device_barrier is not None:
            self.device_barrier(channel=0)
        else:
            self.heap.barrier()

    def dispatch(self, how: str):
        me, c = self.me, self.counts
        start = self._start()
        if how == "gather":
            torch.index_select(self.x, 0, self.order, out=self.send)
            start = self._start()
        for d in self.peers:
            at, n = self.send_at[d], c[me][d]
            src = self.send[at : at + n]
            if how == "pipelined":
                torch.index_select(self.x, 0, self.to[d], out=src)
                start = self._start()
            base = self.dispatch_base[me][d]
            self._copy(d, self.recv[d][base : base + n], src, start)
        base = self.dispatch_base[me][me]
        torch.index_select(self.x, 0, self.to[me], out=self.recv[me][base : base + c[me][me]])
        self._finish()

    def dispatch_turn(self, gather: bool, copy_out: bool = False):
        """Pushes in turn on one stream, peers in rotated order (while ranks keep pace each
        step's copies form a permutation); with ``gather`` the rows of each peer are packed
        (SMs, caller's stream) just before its copy, the next gather beside the copy; with
        ``copy_out`` the received rows then go from the region to a plain tensor (the
        output a call hands out)."""
        me, c = self.me, self.counts
        start = self._start()
        for d in self.peers:
            at, n = self.send_at[d], c[me][d]
            src = self.send[at : at + n]
            if gather:
                torch.index_select(self.x, 0, self.to[d], out=src)
                start = self._start()
            base = self.dispatch_base[me][d]
            self._copy(d, self.recv[d][base : base + n], src, start, self.turn_stream)
        base = self.dispatch_base[me][me]
        torch.index_select(self.x, 0, self.to[me], out=self.recv[me][base : base + c[me][me]])
        self._finish()
        if copy_out:
            self.pulled[: self.received].copy_(self.recv[me][: self.received])

    def dispatch_pull(self, gather: bool):
        """Each rank packs its rows for every peer into its heap (once, or with ``gather`` in
        the call), then, after a device barrier, copies from each peer in turn (its peers in
        rotated order: each step a permutation) straight into the plain output tensor."""
        me, c = self.me, self.counts
        if gather:
            torch.index_select(self.x, 0, self.order, out=self.send_heap[me][: len(self.order)])
            self._barrier()
        start = self._start()
        for s in self.peers:
            at, n = self.send_from[s][me], c[s][me]
            base = self.dispatch_base[s][me]
            src = self.send_heap[s][at : at + n]
            self._copy(s, self.pulled[base : base + n], src, start, self.turn_stream)
        base = self.dispatch_base[me][me]
        torch.index_select(self.x, 0, self.to[me], out=self.pulled[base : base + c[me][me]])
        self._finish()

    def _barrier(self):
        if self.device_barrier is not None:
            self.device_barrier(channel=0)
        else:
            self.heap.barrier()

    def combine(self, reduce: bool, own_direct: bool = False, split: int = 1):
        """Each expert rank's rows back to their sources, then (``reduce``) the sums. With
        ``own_direct`` this rank's own rows stay where they are and the reduce reads them
        there; ``split`` copies per peer, each on a stream of its own (1 or 2)."""
        me, c, H = self.me, self.counts, self.H
        start = self._start()
        for d in self.peers:
            at, n = self.dispatch_base[d][me], c[d][me]
            base = self.combine_base[d][me]
            half = n // 2 if split == 2 else n
            self._copy(d, self.back[d][base : base + half], self.y[at : at + half], start)
            if half < n:
                dst, src = self.back[d][base + half : base + n], self.y[at + half : at + n]
                self._copy(d, dst, src, start, self.more_streams.get(d))
        if not own_direct:
            at, n, base = self.dispatch_base[me][me], c[me][me], self.combine_base[me][me]
            self.back[me][base : base + n].copy_(self.y[at : at + n])
        self._finish()
        if reduce:
            gpu = self.dev.type == "cuda"
            block = 1024 if gpu else 64
            grid = (self.opts.tokens, triton.cdiv(H, block))
            index = self.index_own if own_direct else self.index
            reduce_kernel[grid](self.back[me], self.y, index, self.out, HIDDEN=H,
                                NUM_RANKS=self.R, OWN=me if own_direct else -1, BLOCK_H=block,
                                EMULATE=not gpu, num_warps=4)  # fmt: skip

    # ---- checks ---------------------------------------------------------------------------

    def check(self, what: str):
        n = self.received
        got = self.recv[self.me][:n]
        if not torch.equal(got, self.expected_recv):
            raise AssertionError(f"rank {self.me}: {what}: received rows differ")
        if n < self.max_rows and not bool(
            (self.recv[self.me][n:].view(torch.int16) == POISON).all()
        ):
            raise AssertionError(f"rank {self.me}: {what}: rows past {n} were written")

    def check_pulled(self, what: str):
        n = self.received
        if not torch.equal(self.pulled[:n], self.expected_recv):
            raise AssertionError(f"rank {self.me}: {what}: received rows differ")

    def check_combine(self, what: str, reduced: bool, own_direct: bool = False):
        me, sent = self.me, sum(self.counts[self.me])
        got, expected = self.back[me][:sent], self.expected_back
        if own_direct:  # this rank's own rows were not copied: the peers' only
            mine = slice(self.combine_base[me][me], self.combine_base[me][me] + self.counts[me][me])
            keep = torch.ones(sent, dtype=torch.bool, device=self.dev)
            keep[mine] = False
            got, expected = got[keep], expected[keep]
        if not torch.equal(got, expected):
            raise AssertionError(f"rank {me}: {what}: rows sent back differ")
        if reduced:
            rows = torch.cat([self.expected_back.float(), torch.zeros(1, self.H, device=self.dev)])
            index = self.index.long().clone()
            index[index < 0] = sent  # the zero row
            expected = torch.zeros(self.opts.tokens, self.H, device=self.dev)
            for r in range(self.R):
                expected += rows[index[:, r]]
            if not torch.equal(self.out, expected.to(torch.bfloat16)):
                raise AssertionError(f"rank {self.me}: {what}: sums differ")

    def poison(self):
        self.recv[self.me].view(torch.int16).fill_(POISON)
        self.back[self.me].view(torch.int16).fill_(POISON)
        self.out.view(torch.int16).fill_(POISON)
        self.pulled.view(torch.int16).fill_(POISON)
        self.heap.barrier()


def _calls(a2a: CopyEngineA2A):
    """Each timed call: (name, function, check)."""
    return [
        ("dispatch copies", lambda: a2a.dispatch("copies"), a2a.check),
        ("dispatch gather", lambda: a2a.dispatch("gather"), a2a.check),
        ("dispatch pipelined", lambda: a2a.dispatch("pipelined"), a2a.check),
        ("dispatch turn", lambda: a2a.dispatch_turn(False), a2a.check),
        ("dispatch turn gathered", lambda: a2a.dispatch_turn(True), a2a.check),
        ("dispatch turn + copy out", lambda: a2a.dispatch_turn(True, True), a2a.check_pulled),
        ("dispatch pull", lambda: a2a.dispatch_pull(False), a2a.check_pulled),
        ("dispatch pull gathered", lambda: a2a.dispatch_pull(True), a2a.check_pulled),
        ("combine copies", lambda: a2a.combine(False), lambda w: a2a.check_combine(w, False)),
        ("combine reduce", lambda: a2a.combine(True), lambda w: a2a.check_combine(w, True)),
        (
            "combine own direct",
            lambda: a2a.combine(True, own_direct=True),
            lambda w: a2a.check_combine(w, True, own_direct=True),
        ),
        (
            "combine split",
            lambda: a2a.combine(True, own_direct=True, split=2),
            lambda w: a2a.check_combine(w, True, own_direct=True),
        ),
    ]


def _alone_us(a2a: CopyEngineA2A, fn, iters: int) -> float:
    if a2a.dev.type != "cuda":
        fn()
        return float("nan")
    times = []
    for _ in range(iters + 2):
        a2a.heap.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def _graph_us(a2a: CopyEngineA2A, fn, iters: int) -> float:
    if a2a.dev.type != "cuda" or a2a.opts.no_graph:
        return float("nan")
    graph = torch.cuda.CUDAGraph()
    a2a.heap.barrier()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:
        if a2a.me == 0:
            print(f"graph capture failed, no graphs from here: {type(e).__name__}: {e}"[:300])
        a2a.opts.no_graph = True
        torch.cuda.synchronize()
        a2a.heap.barrier()
        return float("nan")
    return _alone_us(a2a, graph.replay, iters)


def _beside_gemm(ctx, a2a: CopyEngineA2A, fn, iters: int) -> list[float]:
    """GEMM alone, then the GEMM's and the communication's ends beside each other, for each
    start of ``tritonep bench overlap`` (host, queued), us, communication launched first."""
    from tritonep.bench.overlap import STARTS, _sides_ms

    if a2a.dev.type != "cuda" or not a2a.opts.gemm:
        return [float("nan")] * (1 + 2 * len(STARTS))
    gemm = a2a.gemm()
    stream = torch.cuda.Stream(a2a.dev)
    alone, _ = _sides_ms(ctx, gemm, None, stream, "comm-first", iters, "queued")
    ends = [alone * 1e3]
    for start_at in STARTS:
        g, m = _sides_ms(ctx, gemm, lambda after: fn(), stream, "comm-first", iters, start_at)
        ends += [g * 1e3, m * 1e3]
    return ends


def _clocks(ctx, a2a: CopyEngineA2A, iters: int) -> None:
    """Rank 0 prints its GPU's SM clock and power (``nvidia-smi`` every 100 ms) while every
    rank runs ``iters`` GEMMs, ``iters`` copies-only dispatches, then both at once (a dispatch
    on a second stream beside each GEMM): whether what the GEMM loses beside the copies is
    clock (the power limit) rather than SMs."""
    import subprocess

    import torch.distributed as dist

    gemm = a2a.gemm()
    side = torch.cuda.Stream(a2a.dev)
    fields = "clocks.sm,power.draw,power.limit,temperature.gpu"
    for phase in ("gemm", "copies", "gemm + copies"):
        dist.barrier()
        torch.cuda.synchronize()
        sampler = None
        if a2a.me == 0:
            sampler = subprocess.Popen(
                ["nvidia-smi", "-i", str(a2a.dev.index), f"--query-gpu={fields}",
                 "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        began = time.perf_counter()
        for i in range(iters):
            if phase != "gemm":
                side.wait_stream(torch.cuda.current_stream(a2a.dev))
                with torch.cuda.stream(side):
                    a2a.dispatch("copies")
            if phase != "copies":
                gemm()
            if i % 16 == 15:  # a bounded queue: the sampler sees steady work
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - began) * 1e3 / iters
        if sampler is not None:
            sampler.terminate()
            out = sampler.communicate()[0]
            rows = []
            for line in out.splitlines():
                try:
                    rows.append([float(v) for v in line.split(",")])
                except ValueError:
                    continue
            if rows:
                sm, power, limit, temp = (statistics.median(col) for col in zip(*rows, strict=True))
                print(f"{phase:14s} {ms:7.3f} ms an iteration | SM clock {sm:6.0f} MHz, power "
                      f"{power:5.0f} of {limit:4.0f} W, {temp:3.0f} C ({len(rows)} samples)",
                      flush=True)  # fmt: skip
            else:
                print(f"{phase:14s} {ms:7.3f} ms an iteration | nvidia-smi: {out[:200]!r}")


def _trace(a2a: CopyEngineA2A) -> None:
    """Rank 0 prints what ran on its GPU during one copies-only dispatch (torch's profiler):
    whether the peer copies ran on copy engines (``Memcpy``) or as kernels."""
    from torch.profiler import ProfilerActivity, profile

    a2a.heap.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a2a.dispatch("copies")
        torch.cuda.synchronize()
    a2a.heap.barrier()
    if a2a.me == 0:
        for e in prof.events():
            if e.device_type.name == "CUDA":
                print(f"  {e.name[:70]:70s} {e.device_time:8.1f} us", flush=True)


def _rank(ctx, opts):
    import torch.distributed as dist

    a2a = CopyEngineA2A(ctx, opts)
    R, me, H = ctx.world_size, ctx.rank, opts.hidden
    recv_bytes = a2a.received * H * 2
    remote_bytes = recv_bytes - a2a.counts[me][me] * H * 2
    if me == 0:
        print(
            f"{R} ranks on {ctx.device.type}, {opts.tokens} tokens x {H} BF16, top-{opts.topk} "
            f"of {opts.experts} experts; rank 0 receives {a2a.received} rows "
            f"({recv_bytes / 1e6:.1f} MB, {remote_bytes / 1e6:.1f} MB remote)",
            flush=True,
        )
        head = (
            f"{'call':24s} {'alone':>7s} {'graph':>7s} | {'logical':>7s} {'remote':>6s} | "
            f"{'gemm alone':>10s} | {'gemm':>7s} {'comm':>7s} {'finish':>6s} | "
            f"{'q gemm':>7s} {'q comm':>7s} {'q fin':>6s} | predicted"
        )
        print(head + "\n" + "-" * len(head), flush=True)
    lines = []
    # The copies-only dispatch sends the send buffer as it stands: pack it once.
    torch.index_select(a2a.x, 0, a2a.order, out=a2a.send)
    torch.index_select(a2a.x, 0, a2a.order, out=a2a.send_heap[me][: len(a2a.order)])
    a2a.heap.barrier()

    def agreed(name, step, *args) -> object:
        """``step(*args)`` on every rank; its result, or None on every rank once any rank failed
        (each failure printed by rank 0), so that all ranks stop together."""
        try:
            result = step(*args)
        except Exception as e:
            result = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        per_rank = [None] * R
        dist.all_gather_object(per_rank, result)
        failed = [(r, res) for r, res in enumerate(per_rank) if isinstance(res, str)]
        if me == 0:
            for r, error in failed:
                print(f"{name:24s} FAILED on rank {r}: {error}", flush=True)
        return None if failed else per_rank

    def checked(name, fn, check):
        a2a.poison()
        fn()
        a2a.heap.barrier()
        check(name)
        return True

    def timed(name, fn, check):
        t = (_alone_us(a2a, fn, opts.iters), _graph_us(a2a, fn, opts.iters),
             *_beside_gemm(ctx, a2a, fn, opts.iters))  # fmt: skip
        a2a.heap.barrier()
        check(name + ", after timing")
        return t, recv_bytes, remote_bytes

    for name, fn, check in _calls(a2a):
        if opts.only and not any(name.startswith(w) for w in opts.only.split(",")):
            continue
        # The rows first, on every rank, then the timing: a rank whose check fails stops
        # all of them before any waits in a barrier that the others will not reach.
        if agreed(name, checked, name, fn, check) is None:
            opts.clocks = 0
            break
        per_rank = agreed(name, timed, name, fn, check)
        if per_rank is None:
            opts.clocks = 0
            break
        if me == 0:
            worst = [max(r[0][i] for r in per_rank) for i in range(7)]
            alone, graph, gemm_alone, gemm, comm, q_gemm, q_comm = worst
            logical = statistics.mean(r[1] for r in per_rank) / 1e3
            remote = statistics.mean(r[2] for r in per_rank) / 1e3
            finish = max(gemm, comm) / gemm_alone
            q_finish = max(q_gemm, q_comm) / gemm_alone
            p_us, p_finish = PREDICTED[name]
            line = (f"{name:24s} {alone:7.1f} {graph:7.1f} | {logical / alone:7.0f} "
                    f"{remote / alone:6.0f} | {gemm_alone:10.1f} | {gemm:7.1f} {comm:7.1f} "
                    f"{finish:6.2f} | {q_gemm:7.1f} {q_comm:7.1f} {q_finish:6.2f} | "
                    f"{p_us} us, {p_finish:.2f}")  # fmt: skip
            print(line, flush=True)
            lines.append(line)
    if opts.trace and a2a.dev.type == "cuda":
        _trace(a2a)
    if opts.clocks and a2a.dev.type == "cuda" and opts.gemm:
        _clocks(ctx, a2a, opts.clocks)
    a2a.heap.close()
    return lines


def main() -> None:
    from tritonep.launch import gpus_suffice, spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="default 4 (3 on CPU)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks, tiny shapes")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--topk", type=int)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--gemm", type=int, default=8192, help="the GEMM's M = N = K (0: none)")
    parser.add_argument(
        "--clocks", type=int, default=0, help="GEMMs per phase of the clock check (0: none)"
    )
    parser.add_argument("--trace", action="store_true", help="what one dispatch ran, rank 0")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    parser.add_argument("--only", help="comma-separated starts of the calls to run")
    parser.add_argument("--limit", type=float, help="seconds the whole run may take (240; CPU 600)")
    args = parser.parse_args()
    ranks = args.ranks or 4
    cpu = args.cpu or not gpus_suffice(ranks)
    if cpu and args.ranks is None:
        ranks = 3
    for key, value in (CPU_SHAPE if cpu else GPU_SHAPE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cpu:
        args.iters, args.gemm = 1, 0
    spawn(
        _rank,
        ranks,
        args,
        backend="gloo" if cpu else None,
        timeout=args.limit or (600.0 if cpu else 240.0),
    )


if __name__ == "__main__":
    main()
