"""Dispatch on fixed receive slots: each row stored once per destination, at its final index.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/probes/slot_dispatch_probe.py [--ranks 4] [--tokens 4096]
        [--programs 4,8,12,16] [--methods store,store-rs32,tma-row] [--cpu]

Every rank routes its tokens (random top-8 of 256 experts, hidden 7168 BF16) and runs the
prototype of :mod:`tritonep.kernels.normal_slots`: a one-program count exchange (the ``[R, R]``
count matrix all-gathered, so each source's rows have a known base at each destination), then
``P`` sender programs that store each token's row once per destination rank straight at its
final row of that rank's receive buffer (symmetric memory), and count themselves in; the last
program waits for every source. Methods:

* ``store``: ``[16, 1024]`` tiles of rows loaded once, stored with plain wide stores (16 warps);
* ``tma``: TMA through host-side ``TensorDescriptor``s on every peer's view of its receive
  buffer: a row viewed as ``[28, 256]``, loaded through a local descriptor in boxes
  ``[1, 4, 256]`` (2 KB, 7 per row; 28 is no power of two) and stored through each
  destination's descriptor at the token's row (4 warps, 3 stages);
* ``tma-row``: the same with one box ``[1, 32, 256]`` per row, the 4 rows past the row's 28
  dropped by the copy engine (out of the descriptor's bounds), like DeepEP V2's one bulk copy
  per token.

For each method and program count it checks the receive buffer (poisoned before) and the
epilogue's copy against a direct gather of every source's rows, then prints: the kernel alone
(``kernel``: CUDA events around the dispatch launch, started together after a barrier, the
count exchange done, the launch enqueued before the start event: device time), the epilogue
alone (``epi``: a fresh ``torch.empty`` and ``copy_`` of the received rows, all SMs, device
time), the whole call eager without and with the epilogue (``call``,
``call+epi``: count exchange, the host reading the row count as exact-size outputs need,
dispatch, epilogue) and the whole call with epilogue replayed from a CUDA graph (``graph``), the
median of ``--iters`` per rank, then the slowest rank; and GB/s in DeepEP's accounting
(``logical``: received bytes, this rank's own rows included, over the time) and over NVLink
(``remote``: bytes from peers over the time). A line is printed as soon as its configuration
is measured; a configuration that fails prints ``FAILED`` with the rank and the error (wrong
rows: the sweep goes on; anything else, a wait's timeout included: it stops there).

Predictions (4x H200, written before any number existed; received per rank about 14.7k rows =
211 MB, 158 MB of it remote; the box's ceiling about 370 GB/s remote = 430 us; the rings today
602 us whole call). Plain stores from what ``a2a_probe.py`` measured (12 programs with the same
tiles and warps, nothing else to do: 500-542 us, about 25 GB/s a program); ``tma-row`` from the
TMA probe in the hardware notes (4 / 8 / 16 programs: 142 / 266 / 285 GB/s, here a bit less:
a fourth store per row for this rank's own rows, the row plan); ``tma`` moves 2 KB a copy, and
Triton waits for each store's shared-memory read before the next (one staging buffer for all
destinations), so it is latency-bound:

=========  ========  =========  ============  ===========
method     programs  kernel us  remote GB/s   call+epi us
=========  ========  =========  ============  ===========
store      4         1580       100           1730
store      8         790        200           940
store      12        560        280           710
store      16        480        330           630
tma        4         2600       60            2750
tma        8         1300       120           1450
tma        12        880        180           1030
tma        16        660        240           810
tma-row    4         1260       125           1410
tma-row    8         660        240           810
tma-row    12        575        275           725
tma-row    16        545        290           695
=========  ========  =========  ============  ===========

The count exchange 10-20 us, the host read of the count 20-40 us, the epilogue 90-110 us
(422 MB through HBM); the graph saves the host read (5-40 us). So no configuration reaches the
issue's 450 GB/s logical whole call with the epilogue (it needs 470 us); plain stores at 16
programs without the epilogue come closest (about 410 GB/s logical, 500-520 us a call).

Second round: plain stores faster at 16 programs or fewer, and no epilogue. Measured first
(4x H200, 4096 tokens, rank 0 receives 14834 rows = 212.7 MB, 159.4 MB remote): ``store`` at
8 / 12 / 16 programs 590 / 556 / 536 us kernel, epilogue 108 us, graph with epilogue
755 / 718 / 682 us; so a graphed call without the epilogue is the kernel plus 40-55 us (count
exchange, launch gaps). The receive buffer is the output: ``recv[:total]``, rows ordered by
source rank, then token, valid until this rank's next dispatch on the buffer starts (peers
write it again only after reading this rank's next count word, written by that call's count
exchange; DeepEP V1's low-latency mode and TensorRT-LLM's all-to-all hand out views on the
same rule). ``call`` and ``graph`` (no epilogue) are the headline; ``+epi`` for reference.
Methods (``STORE_METHODS``) and predictions, written before any number existed:

* ``store-rot``: destinations rotated per program. The stores are fire-and-forget, so senders
  queue on one peer only when its link's write queue fills; 3-6 % off the kernel.
* ``store-rs``: that, with evict-first loads of x and streaming (``.cs``) stores: the rows
  read once no longer push the received rows (written into this GPU's L2 by the peers) out
  early; 1-3 % more.
* ``store-rs32``: that, with ``[32, 1024]`` tiles on 32 warps: twice the bytes in flight a
  program with the same registers a thread. 8 programs gain most (today 8 -> 16 programs only
  gains 9 %, so one program's rate is not all that limits 16), about 15 % at 8, 10 % at 16;
  less than that would give, as ptxas caps 1024 threads at 64 registers and spills about
  200 bytes a thread (the 16-warp tiles use 95-102 registers, no spill).

==========  ========  =========  ==========================  ===========
method      programs  kernel us  graph us, no epilogue        graph GB/s
==========  ========  =========  ==========================  ===========
store       8         590        640                          332
store       16        536        580                          367
store-rot   8         560        610                          349
store-rot   16        510        555                          383
store-rs    8         550        600                          355
store-rs    16        500        545                          390
store-rs32  8         500        545                          390
store-rs32  16        480        525                          405
==========  ========  =========  ==========================  ===========

So the best is predicted at 405 GB/s logical, about 50 us short of the 450 GB/s target (472
us): the kernel would need about 430 us, the box's remote ceiling (370 GB/s).

On CPU ranks (``--cpu``, or fewer GPUs than ranks) the kernels run under the Triton interpreter
with tiny shapes (3 ranks, 12 tokens, hidden 224, 24 experts, top-4, 2 and 3 programs): all
three methods run there (the interpreter implements host-side descriptors and drops
out-of-bounds boxes), times mean nothing; the data check is what counts.
"""

from __future__ import annotations

import argparse
import statistics

import torch

GPU_SHAPE = dict(tokens=4096, hidden=7168, experts=256, topk=8, programs="4,8,12,16")
CPU_SHAPE = dict(tokens=12, hidden=224, experts=24, topk=4, programs="2,3")
POISON = -1  # int16 0xFFFF: a BF16 NaN, so an unwritten row never compares equal
#: The docstring's predictions (4x H200): (method, programs) -> (kernel us, call+epi us).
PREDICTED = {
    ("store", 4): (1580, 1730), ("store", 8): (790, 940), ("store", 12): (560, 710),
    ("store", 16): (480, 630), ("tma", 4): (2600, 2750), ("tma", 8): (1300, 1450),
    ("tma", 12): (880, 1030), ("tma", 16): (660, 810), ("tma-row", 4): (1260, 1410),
    ("tma-row", 8): (660, 810), ("tma-row", 12): (575, 725), ("tma-row", 16): (545, 695),
}  # fmt: skip


#: The second round's predictions: (method, programs) -> (kernel us, graph us no epilogue).
PREDICTED_NO_EPI = {
    ("store", 8): (590, 640), ("store", 16): (536, 580), ("store-rot", 8): (560, 610),
    ("store-rot", 16): (510, 555), ("store-rs", 8): (550, 600), ("store-rs", 16): (500, 545),
    ("store-rs32", 8): (500, 545), ("store-rs32", 16): (480, 525),
}  # fmt: skip
#: Plain-store methods: (ROTATE, STREAM, BLOCK_T on GPU, warps). ``store-rot``: each program
#: starts at destination ``(rank + program) % R``; ``store-rs``: that, evict-first loads and
#: streaming (``.cs``) stores; ``store-rs32``: that with ``[32, 1024]`` tiles on 32 warps
#: (twice the bytes in flight a program, the same registers a thread).
STORE_METHODS = {
    "store": (False, False, 16, 16),
    "store-rot": (True, False, 16, 16),
    "store-rs": (True, True, 16, 16),
    "store-rs32": (True, True, 32, 32),
}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _inputs(opts, R, dev):
    """Every source's rows and routing (each rank makes all of them from the same seeds)."""
    from tritonep.reference.layout import expert_owner
    from tritonep.testing import route

    xs, in_ranks = [], []
    for s in range(R):
        gen = torch.Generator().manual_seed(1000 + s)
        idx = route(gen, opts.tokens, opts.experts, opts.topk, "random")
        owner = expert_owner(idx, opts.experts, R)
        in_rank = torch.stack([(owner == d).any(1) for d in range(R)], 1).to(torch.int8)
        dgen = torch.Generator(device=dev).manual_seed(2000 + s)
        x = torch.randn(opts.tokens, opts.hidden, generator=dgen, device=dev)
        xs.append(x.to(torch.bfloat16))
        in_ranks.append(in_rank.to(dev))
    return xs, in_ranks


class Prototype:
    """One rank's buffers and launches of the prototype."""

    def __init__(self, ctx, opts):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from tritonep import heap as heaps
        from tritonep.kernels import normal_slots as slots
        from tritonep.kernels.status import new_status
        from tritonep.kernels.sync import timeout_us, use_clock

        self.slots, self.opts = slots, opts
        R, me, dev = ctx.world_size, ctx.rank, ctx.device
        self.R, self.me, self.dev, self.H = R, me, dev, opts.hidden
        self.max_rows = R * opts.tokens
        self.arrivals, self.recv_offset, nbytes = slots.heap_bytes(R, self.max_rows, self.H, 2)
        self.heap = heaps.allocate(nbytes, ctx.group, dev)
        self.recv = self.heap.view(me, torch.bfloat16, (self.max_rows, self.H), self.recv_offset)
        xs, in_ranks = _inputs(opts, R, dev)
        self.x, self.in_rank = xs[me], in_ranks[me]
        self.expected = torch.cat([x[m[:, me] != 0] for x, m in zip(xs, in_ranks, strict=True)])
        self.from_me = int((self.in_rank[:, me] != 0).sum())
        del xs
        self.state = torch.zeros(1, dtype=torch.int64, device=dev)
        self.info = torch.zeros(1 + 3 * R, dtype=torch.int32, device=dev)
        self.plan = torch.empty(opts.tokens, R, dtype=torch.int32, device=dev)
        self.status = new_status(dev)
        self.timeout = timeout_us(opts.timeout)
        self.clock = use_clock(dev)
        self.cols = min(256, self.H & -self.H)  # a box's columns: a power of two, 512 B at most
        if self.cols < 8:
            raise ValueError(f"--hidden: {self.H} is not a multiple of 8")
        parts = self.H // self.cols

        def desc(t, rows, box_rows):
            return TensorDescriptor(t, [rows, parts, self.cols], [self.H, self.cols, 1],
                                    [1, box_rows, self.cols])  # fmt: skip

        self.descs = {}
        fits = parts & -parts  # the largest power of two dividing the parts
        for name, box in (("tma", min(fits, 32)), ("tma-row", _pow2(parts))):
            peers = [self.heap.view(d, torch.bfloat16, (self.max_rows, self.H), self.recv_offset)
                     for d in range(R)]  # fmt: skip
            self.descs[name] = (
                desc(self.x, opts.tokens, box),
                [desc(p, self.max_rows, box) for p in peers],
                -(-parts // box),
                box,
            )

    def notify(self, warmup: bool = False):
        R = self.R
        kernel = self.slots.slots_notify_kernel
        args = (
            self.in_rank, self.opts.tokens, self.heap.peer_ptrs, self.me, self.state, self.info,
            self.status, self.timeout,
        )  # fmt: skip
        meta = dict(NUM_RANKS=R, USE_CLOCK=self.clock, BLOCK_TOKENS=1024 if self.clock else 8,
                    BLOCK_RANKS=_pow2(R), num_warps=4)  # fmt: skip
        if warmup:
            kernel.warmup(*args, grid=(1,), **meta)
        else:
            kernel[(1,)](*args, **meta)

    def dispatch(self, method: str, programs: int, warmup: bool = False):
        R, gpu = self.R, self.clock
        tma = method not in STORE_METHODS
        rotate, stream, block_t, warps = STORE_METHODS.get(method, (False, False, 16, 4))
        x_desc, descs, boxes, box_rows = self.descs.get(method, (None, [], 1, 1))
        descs = list(descs) + [None] * (8 - len(descs))
        args = (
            None if tma else self.x, x_desc, *descs, self.in_rank, self.plan, self.info,
            self.heap.peer_ptrs, self.me, self.opts.tokens, self.max_rows,
            self.arrivals, self.recv_offset, self.status, self.timeout,
        )  # fmt: skip
        meta = dict(NUM_RANKS=R, HIDDEN=self.H, VIA_TMA=tma, BOXES=boxes, BOX_ROWS=box_rows,
                    STAGES=3, BLOCK_T=block_t if gpu else 4, BLOCK_H=1024 if gpu else 128,
                    BLOCK_TOKENS=1024 if gpu else 8, BLOCK_RANKS=_pow2(R), USE_CLOCK=gpu,
                    ROTATE=rotate, STREAM=stream, num_warps=warps)  # fmt: skip
        kernel = self.slots.slots_dispatch_kernel
        if warmup:
            kernel.warmup(*args, grid=(programs,), **meta)
        else:
            kernel[(programs,)](*args, **meta)

    def compile(self, method: str, programs: int):
        """Compile before the first call on every rank (GPU only): ranks that compile at
        different speeds would otherwise spend a wait's bound on each other."""
        if self.clock:
            try:
                self.notify(warmup=True)
                self.dispatch(method, programs, warmup=True)
            except Exception as e:  # then the first call compiles; the waits' bound allows it
                if self.me == 0:
                    print(f"(warmup failed, compiling at the first call: {e!r:.200})")
        self.heap.barrier()

    def epilogue(self, total: int) -> torch.Tensor:
        out = torch.empty(total, self.H, dtype=torch.bfloat16, device=self.dev)
        out.copy_(self.recv[:total])
        return out

    def call(self, method, programs, epilogue: bool):
        self.notify()
        total = int(self.info[0].item())  # exact-size outputs: the host learns the count
        self.dispatch(method, programs)
        return self.epilogue(total) if epilogue else self.recv[:total]

    def check_status(self):
        from tritonep.kernels.phases import NAMES
        from tritonep.kernels.status import raise_on_timeout

        raise_on_timeout(self.status, self.me, NAMES)

    def check(self, got: torch.Tensor, what: str):
        """``got`` must be the expected rows, and the receive buffer past them untouched."""
        self.check_status()
        total = self.expected.shape[0]
        if got.shape[0] != total or not torch.equal(got, self.expected):
            raise AssertionError(f"rank {self.me}: {what}: received rows differ")
        rest = self.recv[total:].view(torch.int16)
        if rest.numel() and not bool((rest == POISON).all()):
            raise AssertionError(f"rank {self.me}: {what}: rows past {total} were written")


def _timed(fn, heap, iters: int, before=None, device_only: bool = False) -> float:
    """Median us of ``fn()`` over ``iters`` runs, each after ``before()`` and a barrier (every
    rank starts together); 1.0 on CPU ranks (one run, no clock worth reading). With
    ``device_only`` the GPU first sleeps half a millisecond, so that the host has enqueued
    ``fn``'s launches (and built their descriptors) before the start event: device time."""
    if heap.device.type != "cuda":
        if before:
            before()
        heap.barrier()
        fn()
        return 1.0
    times = []
    for _ in range(iters + 2):
        if before:
            before()
        heap.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if device_only:
            torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def _measure(proto: Prototype, method: str, programs: int, iters: int) -> dict[str, float]:
    heap = proto.heap
    proto.compile(method, programs)
    # Correctness first: poisoned receive buffer, one call, then its epilogue's copy.
    proto.recv.view(torch.int16).fill_(POISON)
    heap.barrier()
    got = proto.call(method, programs, epilogue=False)
    heap.barrier()
    proto.check(got, f"{method}, {programs} programs")
    proto.check(proto.epilogue(got.shape[0]), f"{method}, {programs} programs, epilogue")
    total = got.shape[0]

    def kernel():
        proto.dispatch(method, programs)

    t = {
        "kernel": _timed(kernel, heap, iters, proto.notify, device_only=True),
        "epi": _timed(lambda: proto.epilogue(total), heap, iters, device_only=True),
        "call": _timed(lambda: proto.call(method, programs, False), heap, iters),
        "call+epi": _timed(lambda: proto.call(method, programs, True), heap, iters),
        "graph": float("nan"),
        "graph+epi": float("nan"),
    }
    if proto.dev.type == "cuda" and not proto.opts.no_graph:
        t["graph"] = _graph_us(proto, method, programs, total, iters, epilogue=False)
    if proto.dev.type == "cuda" and not proto.opts.no_graph:
        t["graph+epi"] = _graph_us(proto, method, programs, total, iters, epilogue=True)
    proto.check_status()
    return t


def _graph_us(
    proto: Prototype, method: str, programs: int, total: int, iters: int, epilogue: bool
) -> float:
    """us of a whole call (with or without the epilogue) replayed from a CUDA graph; NaN (and
    no graphs for the rest of the run) where capturing fails, which every rank finds alike."""
    graph, outs = torch.cuda.CUDAGraph(), []
    proto.heap.barrier()
    try:
        with torch.cuda.graph(graph):
            proto.notify()
            proto.dispatch(method, programs)
            outs.append(proto.epilogue(total) if epilogue else proto.recv[:total])
    except Exception as e:
        if proto.me == 0:
            print(f"graph capture failed, no graphs from here: {type(e).__name__}: {e}"[:300])
        proto.opts.no_graph = True
        torch.cuda.synchronize()
        return float("nan")
    us = _timed(graph.replay, proto.heap, iters)
    proto.heap.barrier()
    what = "graph replay" + (" with epilogue" if epilogue else "")
    proto.check(outs[0], f"{method}, {programs} programs, {what}")
    return us


def _report(method, programs, per_rank) -> str:
    """One table line: each figure from the slowest rank, bytes averaged over the ranks."""
    t = per_rank[0][0]
    worst = {k: max(r[0][k] for r in per_rank) for k in t}
    key = (method, programs)
    if key in PREDICTED_NO_EPI:
        predicted = "kernel {}, graph {}".format(*PREDICTED_NO_EPI[key])
    elif key in PREDICTED:
        predicted = "kernel {}, call+epi {}".format(*PREDICTED[key])
    else:
        predicted = "-"
    logical = statistics.mean(r[1] for r in per_rank) / 1e3
    remote = statistics.mean(r[2] for r in per_rank) / 1e3
    line = (f"{method:10s} {programs:5d} {worst['kernel']:7.1f} {worst['call']:7.1f} "
            f"{worst['graph']:7.1f} {worst['epi']:6.1f} {worst['call+epi']:8.1f} "
            f"{worst['graph+epi']:9.1f} | {logical / worst['kernel']:5.0f} "
            f"{remote / worst['kernel']:5.0f} | {logical / worst['call']:5.0f} "
            f"{logical / worst['graph']:5.0f} | {logical / worst['call+epi']:8.0f} "
            f"{logical / worst['graph+epi']:9.0f} | {predicted}")  # fmt: skip
    print(line, flush=True)
    return line


def _rank(ctx, opts):
    import torch.distributed as dist

    proto = Prototype(ctx, opts)
    R, me = ctx.world_size, ctx.rank
    recv_bytes = proto.expected.shape[0] * opts.hidden * 2
    remote_bytes = recv_bytes - proto.from_me * opts.hidden * 2
    lines = []
    if me == 0:
        print(f"{R} ranks on {ctx.device.type}, {opts.tokens} tokens x {opts.hidden} BF16, "
              f"top-{opts.topk} of {opts.experts} experts; rank 0 receives "
              f"{proto.expected.shape[0]} rows ({recv_bytes / 1e6:.1f} MB, "
              f"{remote_bytes / 1e6:.1f} MB remote)", flush=True)  # fmt: skip
        head = (f"{'method':10s} {'progs':>5s} {'kernel':>7s} {'call':>7s} {'graph':>7s} "
                f"{'epi':>6s} {'call+epi':>8s} {'graph+epi':>9s} | {'kernel log/rem':>11s} | "
                f"{'call':>5s} {'graph':>5s} | {'call+epi':>8s} {'graph+epi':>9s} | "
                "predicted us")  # fmt: skip
        print(head + "\n" + "-" * len(head), flush=True)
    for method in opts.methods:
        for programs in opts.programs:
            try:
                t = _measure(proto, method, programs, opts.iters)
            except Exception as e:  # told to every rank, so that all stop or go on together
                t = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            per_rank = [None] * R
            dist.all_gather_object(per_rank, (t, recv_bytes, remote_bytes))
            failed = [(r, res[0]) for r, res in enumerate(per_rank) if isinstance(res[0], str)]
            if failed:
                if me == 0:
                    for r, error in failed:
                        print(f"{method:8s} {programs:5d} FAILED on rank {r}: {error}", flush=True)
                # Wrong rows leave the call counters in step; anything else may not.
                if all(e.startswith("AssertionError") for _, e in failed):
                    continue
                proto.heap.close()
                return lines
            if me == 0:
                lines.append(_report(method, programs, per_rank))
    proto.heap.close()
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
    parser.add_argument("--programs", help="comma-separated program counts")
    parser.add_argument("--methods", default="store,tma,tma-row")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    parser.add_argument("--limit", type=float, help="seconds the whole run may take (220; CPU 900)")
    parser.add_argument("--timeout", type=float, help="seconds a wait may take (30; CPU 300)")
    args = parser.parse_args()
    ranks = args.ranks or 4
    cpu = args.cpu or not gpus_suffice(ranks)
    if cpu and args.ranks is None:
        ranks = 3
    for key, value in (CPU_SHAPE if cpu else GPU_SHAPE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.programs = [int(p) for p in args.programs.split(",")]
    args.methods = args.methods.split(",")
    if cpu:
        args.iters = 1
    if args.timeout is None:
        # The interpreter counts a wait in spins of an assumed 1 ms, and CPU ranks on a busy
        # machine drift apart by seconds.
        args.timeout = 300.0 if cpu else 30.0
    backend = "gloo" if cpu else None
    limit = args.limit or (900.0 if cpu else 220.0)
    spawn(_rank, ranks, args, backend=backend, timeout=limit)


if __name__ == "__main__":
    main()
