"""What a given number of programs can push to every peer at once: the normal mode's ceiling.

    PYTHONPATH=src python scripts/probes/a2a_probe.py [--ranks 4] [--rows 3674]
        [--programs 8,12,16,24]

Every rank runs one kernel of P programs at the same time as the others. The rows of a rank
(7168 BF16 = 3584 words each) are split into P contiguous ranges; a program loads a tile of its
rows once and stores it into every peer's symmetric heap (the slot of its source rank there),
the way a normal-mode dispatch sender feeds its destinations, but with nothing else: no flags,
no records, no ring. ``--per-peer`` gives each program one peer instead (programs split over
the peers, the way copy-engine and NCCL all-to-all ceilings are measured). 3674 rows
to each of 3 peers is what a rank sends in the benchmark's dispatch (4096 tokens, top-8 of 256
experts on 4 ranks: 158 MB over NVLink) and what a combine sends back.

It prints, per program count, the kernel's median time (CUDA events, 20 launches after a
barrier each, the median over launches, then the slowest rank) and remote GB/s per rank:
the time a normal-mode sender role with that many programs cannot beat for the same bytes.
Every peer's slot is checked against the rows it should hold. ``--graph N`` times launches
replayed from a CUDA graph of N instead (device time per launch, no launch overhead), the way
the low-latency figures are taken: with the low-latency mode's bytes (``--rows 115 --words
1852``: 128 tokens whose FP8 messages reach about 0.9 of the peers each; ``--rows 256``: the
combine's BF16 rows, one per remote top-k copy, 2 of 8 copies per peer) and 128 programs, it
gives the time those bytes take over NVLink with nothing else.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def push_rows(src_ptr, peer_ptrs, rank, n_rows, slot_bytes, W: tl.constexpr,
              NUM_RANKS: tl.constexpr, TOK: tl.constexpr, BW: tl.constexpr,
              PER_PEER: tl.constexpr):  # fmt: skip
    """Store rows ``[r0, r1)`` of this rank into slot ``rank`` of every peer (or, with
    ``PER_PEER``, of one peer: programs ``p`` serve peer ``p % (R - 1)`` after this rank)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if PER_PEER:
        lanes = programs // (NUM_RANKS - 1)
        which = pid % (NUM_RANKS - 1)
        pid = pid // (NUM_RANKS - 1)
        programs = lanes
    chunk = tl.cdiv(n_rows, programs)
    r0 = pid * chunk
    r1 = tl.minimum(r0 + chunk, n_rows)
    words = tl.arange(0, BW)
    for first in range(r0, r1, TOK):
        rows = (first + tl.arange(0, TOK)).to(tl.int64)
        live = rows < r1
        src = src_ptr + rows[:, None] * W
        v = tl.load(src + words[None, :], mask=live[:, None] & (words < W)[None, :])
        for w0 in range(0, W, BW):
            w = w0 + words
            wn = w + BW
            v_next = tl.load(src + wn[None, :], mask=live[:, None] & (wn < W)[None, :])
            m = live[:, None] & (w < W)[None, :]
            for d in tl.static_range(NUM_RANKS):
                serve = d != rank
                if PER_PEER:
                    serve = d == (rank + 1 + which) % NUM_RANKS
                if serve:
                    base = tl.load(peer_ptrs + d) + rank * slot_bytes
                    dst = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
                    tl.store(dst + rows[:, None] * W + w[None, :], v, mask=m)
            v = v_next


def _rows(rank: int, n: int, W: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-(2**30), 2**30, (n, W), generator=gen, dtype=torch.int32).to(device)


def _check(heap, me, n, W, slot_bytes, programs) -> None:
    """Every peer's rows must be in their slot of this rank's heap."""
    heap.barrier()
    for s in range(heap.world_size):
        if s != me:
            got = heap.view(me, torch.int32, (n, W), s * slot_bytes)
            if not torch.equal(got, _rows(s, n, W, heap.device)):
                raise AssertionError(f"rank {me}: rows of rank {s} wrong ({programs} programs)")


def _graph(launch, count: int):
    """A function that replays ``count`` launches captured in one CUDA graph (the modes' graph
    figures are taken this way)."""
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            launch()
    return graph.replay


def _timed_us(run, heap) -> float:
    """Microseconds of one ``run`` on this rank, started after every rank has cleared its slots
    (the check afterwards sees what this run wrote); CPU ranks (the Triton interpreter) only
    run it, their time is 1."""
    heap.local.zero_()
    heap.barrier()
    if heap.device.type != "cuda":
        run()
        return 1.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _rank(ctx, opts):
    import torch.distributed as dist

    from tritonep import heap as heaps

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    W, n = opts.words, opts.rows
    slot_bytes = n * W * 4
    remote = (R - 1) * slot_bytes
    heap = heaps.allocate(R * slot_bytes, ctx.group, dev)
    src = _rows(me, n, W, dev)
    lines = []
    for programs in opts.programs:
        if opts.per_peer and programs % (R - 1):
            continue

        def launch(programs=programs):
            push_rows[(programs,)](src, heap.peer_ptrs, me, n, slot_bytes, W=W, NUM_RANKS=R,
                                   TOK=opts.tok, BW=opts.bw, PER_PEER=opts.per_peer,
                                   num_warps=opts.warps)  # fmt: skip

        # After a barrier every rank launches at once; in a graph the ranks drift apart
        # between its launches, so its figure is a lower bound.
        graphed = opts.graph if opts.graph and dev.type == "cuda" else 0
        run = _graph(launch, graphed) if graphed else launch
        times = [_timed_us(run, heap) / max(graphed, 1) for _ in range(opts.iters + 3)][3:]
        _check(heap, me, n, W, slot_bytes, programs)
        ranks = [0.0] * R
        dist.all_gather_object(ranks, sorted(times)[len(times) // 2])
        t = max(ranks)
        label = f", graph of {graphed}" if graphed else ""
        lines.append(f"{programs:3d} programs{label}: {t:7.1f} us (ranks {min(ranks):.1f}-"
                     f"{t:.1f}), {remote / t / 1e3:6.1f} GB/s remote per rank, "
                     f"{remote / t / 1e3 / programs:5.1f} per program")  # fmt: skip
    heap.close()
    return lines


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=3674)
    parser.add_argument("--words", type=int, default=3584)
    parser.add_argument("--programs", default="8,12,16,24")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tok", type=int, default=16)
    parser.add_argument("--bw", type=int, default=512)
    parser.add_argument("--warps", type=int, default=16)
    parser.add_argument("--per-peer", action="store_true")
    parser.add_argument("--graph", type=int, default=0,
                        help="time launches replayed from a CUDA graph of this many")  # fmt: skip
    args = parser.parse_args()
    args.programs = [int(p) for p in args.programs.split(",")]
    results = spawn(_rank, args.ranks, args, timeout=600)
    mode = "one peer per program" if args.per_peer else "every peer per program"
    print(f"{args.ranks} ranks, {args.rows} rows x {args.words} words to each peer "
          f"({args.rows * args.words * 4 * (args.ranks - 1) / 1e6:.1f} MB remote per rank), "
          f"{mode}, tile {args.tok}x{args.bw}, {args.warps} warps")  # fmt: skip
    for line in results[0]:
        print(line)


if __name__ == "__main__":
    main()
