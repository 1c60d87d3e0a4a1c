"""Peer copies one at a time against one batch: do the gaps between copy-engine copies go?

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/probes/batch_copy_probe.py [--ranks 4] [--rows 3700] [--iters 20]

Every rank at once copies the combine's bytes into its 3 peers' symmetric memory, as the
copy-engine combine does (``tritonep.modes.copy_combine``): per peer ``rows`` rows of hidden
7168 BF16 in two chunks (four fifths, then a fifth) and, with the first chunk, ``rows x 8``
float32 weights, issued

* ``single``: one ``cuMemcpyDtoDAsync`` per copy, in turn on one stream;
* ``rows only``: the same without the weights' copies;
* ``batch``: each chunk's copies in one ``cuMemcpyBatchAsync`` (CUDA 12.8+);
* ``batch all``: every copy of the call in one batch;

and, so that no two sources write into one rank at once, ``pair K``: ranks ``r`` and
``r ^ 1`` copy the same bytes (159 MB at the default rows) to each other only, in ``K``
copies one by one, or (``pair batch K``) in one batch: the pieces' time over one copy's is
what separates copies issued one by one. Each is timed back to back (``iters`` calls between
two CUDA events, median of 5, the slowest rank) and replayed from a CUDA graph where the
driver lets it be captured; the data of the three-peer calls are checked after each.

Prediction (4x H200, rows 3700: 159 MB remote per rank; one 53 MB copy moves 375-387 GB/s
alone; a 2x H200 timeline showed a copy starting 5-7 us after the one before it ends):
``single`` about 450 us (420 of copies, 8 gaps); if the driver runs a batch's copies back to
back on one engine without the gaps, ``batch`` about 425 us and ``batch all`` 420; if it
spreads them over engines at once, 580 or more (three peers' copies at once took 584-734 us
against 420 in turn).

Measured (4x H200, 2026-11-28, ``docs/bench/copy-combine-batch-stages-4xh200-2026-11-28.log``):
the three-peer calls back to back drift apart and collide (647-692 us whichever the form);
the pairs show the gaps: one copy 410.4 us, 6 copies 431.1, 12 copies 454.3 (about 4 us a
copy), a batch of 6 or 12 413.0 / 412.8. A batch is not captured (CUDA error 900, 580
drivers).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonep.heap import allocate
from tritonep.modes.copy_combine import _CopyAttributes

HIDDEN, TOPK = 7168, 8


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    one = lib.cuMemcpyDtoDAsync_v2
    one.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    one.restype = ctypes.c_int
    batch, with_fail = None, False
    for name, fail in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        if hasattr(lib, name):
            batch, with_fail = getattr(lib, name), fail
            break
    return one, batch, with_fail


def _worker(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29577))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    dev = torch.device("cuda", rank)
    rows, R = args.rows, world
    row_bytes, w_bytes = 2 * HIDDEN, 4 * TOPK * rows
    slot = rows * row_bytes + w_bytes
    heap = allocate(max(R * slot, 3 * rows * 2 * HIDDEN), None, dev)
    x = torch.randn(R * rows, HIDDEN, device=dev).to(torch.bfloat16)
    w = torch.randn(R * rows, TOPK, device=dev)
    peers = [(rank + k) % R for k in range(1, R)]
    cut = rows - rows // 5
    # (dst, src, bytes) per chunk: chunk 0 the rows up to cut and the weights, chunk 1 the rest.
    chunks: list[list[tuple[int, int, int]]] = [[], []]
    for s in peers:
        base = heap.view(s, torch.uint8, (slot,), rank * slot).data_ptr()
        xs, ws = x.data_ptr() + s * rows * row_bytes, w.data_ptr() + s * rows * 4 * TOPK
        chunks[0].append((base, xs, cut * row_bytes))
        chunks[0].append((base + rows * row_bytes, ws, w_bytes))
        chunks[1].append((base + cut * row_bytes, xs + cut * row_bytes, (rows - cut) * row_bytes))
    one, batch, with_fail = _driver()
    if rank == 0:
        print(
            f"ranks {R}, rows {rows} a peer, {3 * slot / 1e6:.1f} MB remote a rank; "
            f"batch entry: {'v1' if with_fail else 'v2' if batch else 'none'}",
            flush=True,
        )

    def run_batch(copies, stream):
        n = len(copies)
        dsts = (ctypes.c_uint64 * n)(*[c[0] for c in copies])
        srcs = (ctypes.c_uint64 * n)(*[c[1] for c in copies])
        sizes = (ctypes.c_size_t * n)(*[c[2] for c in copies])
        attrs = (_CopyAttributes * 1)(_CopyAttributes(1))  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        idx = (ctypes.c_size_t * 1)(0)
        tail = (ctypes.byref(ctypes.c_size_t(0)),) if with_fail else ()  # the failure index
        rc = batch(
            dsts, srcs, sizes, ctypes.c_size_t(n), attrs, idx, ctypes.c_size_t(1), *tail,
            ctypes.c_void_p(stream),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"cuMemcpyBatchAsync: {rc}")

    def one_by_one(copies, stream):
        for d, s, n in copies:
            rc = one(d, s, n, ctypes.c_void_p(stream))
            if rc:
                raise RuntimeError(f"cuMemcpyDtoDAsync: {rc}")

    def single(stream):
        for chunk in chunks:
            one_by_one(chunk, stream)

    def rows_only(stream):
        for chunk in chunks:
            one_by_one([c for c in chunk if c[2] != w_bytes], stream)

    def batched(stream):
        for chunk in chunks:
            run_batch(chunk, stream)

    def batched_all(stream):
        run_batch(chunks[0] + chunks[1], stream)

    def check(name, weights=True):
        torch.cuda.synchronize()
        dist.barrier()
        ok = torch.ones(1, device=dev)
        # Each rank checks what it sent by reading it back from the peer's slot.
        for s in peers:
            sent = heap.view(s, torch.bfloat16, (rows, HIDDEN), rank * slot)
            sent_w = heap.view(s, torch.float32, (rows, TOPK), rank * slot + rows * row_bytes)
            if not (
                torch.equal(sent, x[s * rows : (s + 1) * rows])
                and (not weights or torch.equal(sent_w, w[s * rows : (s + 1) * rows]))
            ):
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"  {name}: data {'ok' if ok.item() == 1 else 'WRONG'}", flush=True)

    methods = {"single": single, "rows only": rows_only}
    if batch is not None:
        methods.update({"batch": batched, "batch all": batched_all})
    # Pairs (rank r and r ^ 1) copy the same bytes to each other only, in k pieces: no two
    # sources ever write into one rank, so the pieces' cost over one copy is the gaps'.
    partner = rank ^ 1
    total = 3 * rows * row_bytes
    pair_base = heap.view(partner, torch.uint8, (slot,), 0).data_ptr()
    for k in (1, 6, 12):
        piece = total // k
        pieces = [(pair_base + i * piece, x.data_ptr() + i * piece, piece) for i in range(k)]

        def pair_single(stream, pieces=pieces):
            one_by_one(pieces, stream)

        def pair_batch(stream, pieces=pieces):
            run_batch(pieces, stream)

        methods[f"pair {k}"] = pair_single
        if batch is not None and k > 1:
            methods[f"pair batch {k}"] = pair_batch
    stream = torch.cuda.Stream(dev)
    for name, fn in methods.items():
        heap.local.fill_(0xFF)
        torch.cuda.synchronize()
        dist.barrier()
        try:
            with torch.cuda.stream(stream):
                fn(stream.cuda_stream)
        except RuntimeError as e:
            print(f"rank {rank} {name}: {e}", flush=True)
            continue
        if not name.startswith("pair"):
            check(name, name != "rows only")
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            for _ in range(args.iters):
                fn(stream.cuda_stream)
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / args.iters)
        t = torch.tensor([statistics.median(times)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        g_us = float("nan")
        try:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                fn(stream.cuda_stream)
            reps = []
            for _ in range(5):
                torch.cuda.synchronize()
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    a.record(stream)
                    for _ in range(args.iters):
                        graph.replay()
                    b.record(stream)
                b.synchronize()
                reps.append(a.elapsed_time(b) * 1000 / args.iters)
            g = torch.tensor([statistics.median(reps)], device=dev)
            dist.all_reduce(g, op=dist.ReduceOp.MAX)
            g_us = g.item()
        except Exception as e:  # (a probe: say what the capture refused)
            if rank == 0:
                print(f"  {name}: no graph ({type(e).__name__}: {str(e)[:120]})", flush=True)
            torch.cuda.synchronize()
        if rank == 0:
            gb = 3 * slot / t.item() / 1e3
            print(
                f"  {name:10s} back to back {t.item():7.1f} us ({gb:5.1f} GB/s remote), "
                f"graph {g_us:7.1f} us",
                flush=True,
            )
    dist.barrier()
    heap.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rows", type=int, default=3700)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    mp.spawn(_worker, args=(args.ranks, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
