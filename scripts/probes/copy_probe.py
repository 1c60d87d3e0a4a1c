"""How fast one program copies rows: the limit the normal-mode kernels run into.

    PYTHONPATH=src python scripts/probes/copy_probe.py [--rows 4096] [--programs 12]

The normal mode moves every row twice inside its programs (a sender loads a token and stores it
into the destination rings, a receiver copies it from its ring into the output), with a budget
of 24 SMs: 12 senders and 12 receivers, so the copy loop of one program, not only NVLink, can
set the pace. This probe times formulations of that copy loop on one GPU (rows of 7168 BF16 =
3584 words, each program a contiguous run of rows), as the time of a launch replayed from a
CUDA graph, and prints per-program GB/s (bytes copied over time over programs):

* ``tile``: a ``[TOK, BW]`` tile per step, the next one loaded before the current one is
  stored (the kernels' loop today), for several tile shapes and warp counts;
* ``pipelined``: the same loop as one ``tl.range`` with ``num_stages`` (asynchronous copies
  into shared memory);
* ``tma``: tensor-memory-accelerator loads and stores through device-side descriptors,
  pipelined the same way;
* ``staged``: the staged transport's ``copy_bytes`` (emulated nodes move their network leg
  with it), each program one contiguous byte range, beside ``staged words``, its earlier form
  (4-byte accesses, no tile in flight).

``--only staged`` runs the variants whose name starts with that word.

``--peer`` writes into the memory of GPU 1 instead (a machine with two GPUs): what one program
moves over NVLink, the pace of the normal mode's senders (its stores into peers' rings), for
the tile loop with several warp counts and store cache policies, and for TMA stores.
``--pull`` reads GPU 0's memory by kernels on GPU 1 instead (loads over NVLink, stores to local
memory): whether a program pulls faster than it pushes, since a load's bytes in flight are
bounded by the tiles held, not by the stores a program may have outstanding.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tritonep.bench.timing import graph_median_us
from tritonep.kernels.transport import copy_bytes


@triton.jit
def copy_tile(src_addr, dst_addr, n_rows, W: tl.constexpr, TOK: tl.constexpr, BW: tl.constexpr,
              CACHE: tl.constexpr = "", AHEAD: tl.constexpr = 1):  # fmt: skip
    """A ``[TOK, BW]`` tile per step, the next loaded before the current is stored, from a
    source and into a destination each given by a pointer or an address (this GPU's memory or
    a peer's), with a store cache policy, and one or two tiles in flight."""
    pid = tl.program_id(0)
    chunk = tl.cdiv(n_rows, tl.num_programs(0))
    r0 = pid * chunk
    r1 = tl.minimum(r0 + chunk, n_rows)
    words = tl.arange(0, BW)
    src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16)
    for first in range(r0, r1, TOK):
        rows = (first + tl.arange(0, TOK)).to(tl.int64)
        rmask = rows < r1
        s = src + rows[:, None] * W
        d = dst + rows[:, None] * W
        v = tl.load(s + words[None, :], mask=rmask[:, None] & (words < W)[None, :])
        if AHEAD == 2:
            v1 = tl.load(s + BW + words[None, :], mask=rmask[:, None] & (BW + words < W)[None, :])
        for w0 in range(0, W, BW):
            w = w0 + words
            wn = w + AHEAD * BW
            v_next = tl.load(s + wn[None, :], mask=rmask[:, None] & (wn < W)[None, :])
            tl.store(d + w[None, :], v, mask=rmask[:, None] & (w < W)[None, :],
                     cache_modifier=CACHE)  # fmt: skip
            if AHEAD == 2:
                v = v1
                v1 = v_next
            else:
                v = v_next


@triton.jit
def copy_pipelined(
    src, dst, n_rows, W: tl.constexpr, TOK: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr
):
    pid = tl.program_id(0)
    chunk = tl.cdiv(n_rows, tl.num_programs(0))
    r0 = pid * chunk
    r1 = tl.minimum(r0 + chunk, n_rows)
    words = tl.arange(0, BW)
    n_w: tl.constexpr = (W + BW - 1) // BW
    steps = tl.cdiv(r1 - r0, TOK) * n_w
    for i in tl.range(0, steps, num_stages=STAGES):
        rows = (r0 + (i // n_w) * TOK + tl.arange(0, TOK)).to(tl.int64)
        w = (i % n_w) * BW + words
        m = (rows < r1)[:, None] & (w < W)[None, :]
        v = tl.load(src + rows[:, None] * W + w[None, :], mask=m)
        tl.store(dst + rows[:, None] * W + w[None, :], v, mask=m)


@triton.jit
def copy_tma(src, dst_addr, n_rows, W: tl.constexpr, TOK: tl.constexpr, BW: tl.constexpr,
             STAGES: tl.constexpr):  # fmt: skip
    """TMA loads and stores through device-side descriptors, pipelined, into a destination
    given by its address."""
    pid = tl.program_id(0)
    chunk = tl.cdiv(n_rows, tl.num_programs(0))
    r0 = pid * chunk
    r1 = tl.minimum(r0 + chunk, n_rows)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16)
    sdesc = tl.make_tensor_descriptor(src, shape=[r1, W], strides=[W, 1], block_shape=[TOK, BW])
    ddesc = tl.make_tensor_descriptor(dst, shape=[r1, W], strides=[W, 1], block_shape=[TOK, BW])
    n_w: tl.constexpr = (W + BW - 1) // BW
    steps = tl.cdiv(r1 - r0, TOK) * n_w
    for i in tl.range(0, steps, num_stages=STAGES):
        r = r0 + (i // n_w) * TOK
        w = (i % n_w) * BW
        ddesc.store([r, w], sdesc.load([r, w]))


@triton.jit
def copy_staged(src, dst, n_rows, W: tl.constexpr):
    chunk = tl.cdiv(n_rows, tl.num_programs(0)).to(tl.int64) * W * 4
    first = tl.program_id(0) * chunk
    nbytes = tl.minimum(chunk, n_rows.to(tl.int64) * W * 4 - first)
    if nbytes > 0:
        base_src = src.to(tl.int64, bitcast=True) + first
        base_dst = dst.to(tl.int64, bitcast=True) + first
        copy_bytes(base_dst, base_src, nbytes)


@triton.jit
def copy_staged_words(src, dst, n_rows, W: tl.constexpr):
    chunk = tl.cdiv(n_rows, tl.num_programs(0)).to(tl.int64) * W
    first = tl.program_id(0) * chunk
    words = tl.minimum(chunk, n_rows.to(tl.int64) * W - first)
    offs = tl.arange(0, 1024)
    for start in range(0, words, 1024):
        mask = start + offs < words
        tl.store(dst + first + start + offs, tl.load(src + first + start + offs, mask=mask),
                 mask=mask)  # fmt: skip


@triton.jit
def copy_staged_ahead(src, dst, n_rows, W: tl.constexpr, TILE: tl.constexpr, AHEAD: tl.constexpr):
    """``copy_bytes`` with ``TILE``-word tiles, one (its own loop) or two tiles in flight."""
    chunk = tl.cdiv(n_rows, tl.num_programs(0)).to(tl.int64) * W
    first = tl.program_id(0) * chunk
    words = tl.multiple_of(tl.minimum(chunk, n_rows.to(tl.int64) * W - first) // 4 * 4, 4)
    if AHEAD == 1:
        base_src = src.to(tl.int64, bitcast=True) + first * 4
        base_dst = dst.to(tl.int64, bitcast=True) + first * 4
        if words > 0:
            copy_bytes(base_dst, base_src, words * 4, TILE)
    else:
        s = tl.multiple_of(src + first, 16)
        d = tl.multiple_of(dst + first, 16)
        offs = tl.arange(0, TILE)
        t0 = tl.load(s + offs, mask=offs < words)
        t1 = tl.load(s + TILE + offs, mask=TILE + offs < words)
        for start in range(0, words, TILE):
            nxt = start + 2 * TILE + offs
            t2 = tl.load(s + nxt, mask=nxt < words)
            tl.store(d + start + offs, t0, mask=start + offs < words)
            t0 = t1
            t1 = t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--programs", type=str, default="12")
    parser.add_argument("--words", type=int, default=3584)
    parser.add_argument("--only", default="", help="variants whose name starts with this")
    parser.add_argument("--peer", action="store_true", help="write into GPU 1's memory")
    parser.add_argument("--pull", action="store_true", help="read GPU 0's memory from GPU 1")
    args = parser.parse_args()
    if args.peer or args.pull:
        peer_probe(args)
        return
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    W, n = args.words, args.rows
    src = torch.randint(-(2**30), 2**30, (n, W), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    variants = []
    for warps in (4, 8, 16, 32):
        for tok, bw in ((8, 512), (8, 1024), (16, 512), (32, 256), (4, 2048), (32, 512)):
            variants.append((f"tile {tok}x{bw} w{warps}", copy_tile, dict(TOK=tok, BW=bw),
                             warps))  # fmt: skip
    for warps in (4, 8, 16):
        for tok, bw in ((8, 512), (32, 256), (16, 1024)):
            for stages in (2, 3, 4):
                variants.append((f"pipelined {tok}x{bw} s{stages} w{warps}", copy_pipelined,
                                 dict(TOK=tok, BW=bw, STAGES=stages), warps))  # fmt: skip
    for warps in (1, 4, 8):
        for tok, bw in ((8, 256), (32, 256), (64, 128), (16, 256)):
            for stages in (2, 4, 6):
                variants.append((f"tma {tok}x{bw} s{stages} w{warps}", copy_tma,
                                 dict(TOK=tok, BW=bw, STAGES=stages), warps))  # fmt: skip
    for warps in (4, 8, 16):
        variants.append((f"staged w{warps}", copy_staged, {}, warps))
        variants.append((f"staged words w{warps}", copy_staged_words, {}, warps))
        for tile, ahead in ((4096, 1), (8192, 1), (4096, 2), (2048, 2), (16384, 1)):
            variants.append((f"staged tile {tile} ahead {ahead} w{warps}", copy_staged_ahead,
                             dict(TILE=tile, AHEAD=ahead), warps))  # fmt: skip
    variants = [v for v in variants if v[0].startswith(args.only)]
    print(f"{n} rows x {W} words ({nbytes / 1e6:.1f} MB), torch {torch.__version__}, "
          f"triton {triton.__version__}, {torch.cuda.get_device_name()}")  # fmt: skip
    t = graph_median_us(lambda: dst.copy_(src), calls=20, replays=10)
    print(f"torch copy_ (whole GPU): {t:.1f} us, {nbytes / t / 1e3:.0f} GB/s")
    time_variants(variants, args.programs, src, dst)


def peer_probe(args) -> None:
    """Per-program GB/s of copies from GPU 0's memory into GPU 1's: by kernels on GPU 0
    (stores over NVLink) or, with ``--pull``, on GPU 1 (loads over NVLink)."""
    here = 1 if args.pull else 0
    torch.cuda.set_device(here)
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=f"cuda:{here}")
    )
    W, n = args.words, args.rows
    src = torch.randint(-(2**30), 2**30, (n, W), dtype=torch.int32, device="cuda:0")
    dst = torch.zeros((n, W), dtype=torch.int32, device="cuda:1")
    # A copy between two GPUs makes torch enable the source GPU's access to the other's
    # memory: one each way, so that kernels on either GPU may read or write the other's.
    dst.copy_(src)
    src[:1].copy_(dst[:1])
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    nbytes = src.numel() * 4
    variants = []
    for warps in (4, 8, 16, 32):
        for tok, bw in ((16, 512), (32, 512), (8, 512), (32, 256)):
            variants.append((f"tile {tok}x{bw} w{warps}", copy_tile,
                             dict(TOK=tok, BW=bw), warps))  # fmt: skip
    if not args.pull:
        for cache in (".cg", ".cs", ".wt"):
            for warps in (8, 16):
                variants.append((f"tile 16x512 {cache} w{warps}", copy_tile,
                                 dict(TOK=16, BW=512, CACHE=cache), warps))  # fmt: skip
    for warps in (8, 16, 32):
        for tok, bw in ((16, 512), (8, 512)):
            variants.append((f"tile {tok}x{bw} ahead 2 w{warps}", copy_tile,
                             dict(TOK=tok, BW=bw, AHEAD=2), warps))  # fmt: skip
    if not args.pull:
        for warps in (1, 4, 8):
            for tok, bw in ((32, 256), (64, 128), (16, 256)):
                for stages in (2, 4, 6):
                    variants.append((f"tma {tok}x{bw} s{stages} w{warps}", copy_tma,
                                     dict(TOK=tok, BW=bw, STAGES=stages), warps))  # fmt: skip
    variants = [v for v in variants if v[0].startswith(args.only)]
    print(f"{n} rows x {W} words ({nbytes / 1e6:.1f} MB) from GPU 0 into GPU 1 by kernels on "
          f"GPU {here}, {torch.cuda.get_device_name()}")  # fmt: skip
    # A copy between devices cannot be captured in a graph: events around eager copies.
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    t = sorted(times)[len(times) // 2]
    print(f"torch copy_ to the peer: {t:.1f} us, {nbytes / t / 1e3:.0f} GB/s")
    time_variants(variants, args.programs, src, dst, pull=args.pull)


def time_variants(variants, programs_list: str, src, dst, pull: bool = False) -> None:
    """Time every variant (name, kernel, constexprs, warps) at each program count of
    ``programs_list`` ("12,24"), copying ``src`` into ``dst`` (on this GPU or a peer; with
    ``pull``, ``src`` is the peer's and the kernels run beside ``dst``), and check the copy."""
    n, W = src.shape
    nbytes = src.numel() * 4
    for programs in (int(p) for p in programs_list.split(",")):
        print(f"\n{programs} programs; per-program GB/s = bytes / time / programs")
        results = []
        for name, kernel, meta, warps in variants:
            dst.zero_()
            torch.cuda.synchronize(dst.device)
            target = dst.data_ptr() if kernel in (copy_tile, copy_tma) and not pull else dst
            source = src.data_ptr() if pull else src

            def launch(kernel=kernel, meta=meta, warps=warps, programs=programs, target=target,
                       source=source):  # fmt: skip
                kernel[(programs,)](source, target, n, W=W, **meta, num_warps=warps)

            try:
                t = graph_median_us(launch, calls=20, replays=10)
                torch.cuda.synchronize(src.device)
                ok = torch.equal(src, dst.to(src.device))
            except Exception as e:  # a shape a variant cannot compile: say so, go on
                print(f"  {name:34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            results.append((t, name, ok))
            print(
                f"  {name:34s} {t:8.1f} us  {nbytes / t / 1e3 / programs:6.1f} GB/s/program"
                f"  {nbytes / t / 1e3:6.0f} GB/s{'' if ok else '  WRONG RESULT'}",
                flush=True,
            )
        results.sort()
        print("fastest:", ", ".join(f"{name} {t:.1f} us" for t, name, _ in results[:5]))


if __name__ == "__main__":
    main()
