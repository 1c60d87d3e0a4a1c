"""Communication beside a GEMM: how much of it the GEMM hides, and what it costs the GEMM.

Training overlaps dispatch and combine with expert GEMMs, so a dispatch that holds 24 SMs
slows the GEMM beside it, and one that waits for SMs the GEMM holds finishes late. Per point
(tokens, hidden, top-k, experts), per path, per operation and per start order, the ranks time:

* ``path``: ``rings`` (:class:`~tritonep.modes.normal.NormalMode`, channel rings on ``--sms``
  SMs) or ``slots`` (:class:`~tritonep.deep_ep.ElasticBuffer`: fixed receive slots, its
  push on its default SMs, a copy or reduce epilogue on every SM), and for the combine
  ``copies`` (the rings' mode combining over copy engines: ``copy_combine_tokens``, no SM
  moving rows, the sums on every SM; with ``--copy-chunks 1,2`` a path ``copies[C]`` per chunk
  count instead); with ``--tune CONFIG``
  also ``slots[CONFIG]``, the same calls under :meth:`~tritonep.modes.elastic.Tuning.of`
  ``(CONFIG)`` (``epilogue_sms=16``: the epilogues on the push's SMs);
* ``op``: a cached dispatch (BF16, the layout of an earlier call) or a combine;
* ``priority``: the communication stream at the default priority or at the highest (DeepEP
  makes its communication stream high-priority; tritonep's stays at the default, which
  measured as well or better here: BENCHMARKS.md, "Beside a GEMM");
* ``order``: communication launched first, then the GEMM, or the other way round; for the
  slots also ``gemm-first-deferred``: the GEMM first, then the call, whose epilogue waits for
  the GEMM (``previous_event_before_epilogue``), so that with a carveout the push runs on the
  SMs the GEMM leaves and the epilogue on every SM after it (DeepEP V2's way to overlap);
* ``carveout`` (``--carveout``): SMs the GEMM leaves free (torch's experimental SM carveout,
  :func:`gemm_carveout`), as frameworks that overlap communication with their GEMMs limit the
  GEMMs' SMs; whether the BLAS library honoured it shows in ``gemm_alone_us``;
* ``blas`` (``--blas``): the library of torch's matmuls, ``default`` or ``cublaslt``
  (:func:`blas_library`); on the 4x H200 measured, cuBLAS ignored the carveout and cuBLASLt
  honoured it;
* ``start`` (``--start``): ``host``, the start event recorded just before the first launch,
  so that the host time of the launches launched first counts (the GEMM starts only once the
  host has launched the communication before it); or ``queued``, both sides queued behind a
  device-side wait (about a millisecond of ``torch.cuda._sleep`` on the compute stream before
  the start event), as in a training step whose host runs ahead of its GPU: device time only
  (a run in which some host launched after the wait ended is run again; more such runs than
  timed ones raise).

Each iteration the ranks meet (a barrier, then a device synchronization), the compute stream
records a start event, the communication stream waits for it, and both kinds of work are
launched in ``order``: a BF16 GEMM ``[G, G] @ [G, G]`` on the compute stream, the operation on
the communication stream, each followed by an event. Columns (medians over ``iters``, mean over
ranks, microseconds from the start event): ``gemm_us`` and ``comm_us`` (each side's end),
``both_us`` (the later end); ``gemm_alone_us`` and ``comm_alone_us`` (each timed alone the
same way, the GEMM under the row's carveout), ``gemm_full_us`` (the GEMM alone on every SM);
``gemm_slowdown`` (``gemm_us / gemm_alone_us``), ``finish_ratio`` (``both_us /
gemm_alone_us``: 1.0 is communication hidden entirely), ``full_finish_ratio`` (``both_us /
gemm_full_us``: what the carveout costs counted too) and ``serial_us`` (the sum of the two
alone).

On CPU ranks there are no streams: the two run one after the other under the host clock, and
the times, of interpreted kernels, say nothing about GPUs (the rows say so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from ..testing import route
from .timing import mean_over_ranks

#: The communication stream's priorities, by name: torch maps -1 to the highest it has.
PRIORITIES = {"default": 0, "high": -1}
ORDERS = ("comm-first", "gemm-first")
#: The slots' third order: the GEMM first, then the call, its epilogue after the GEMM.
DEFERRED = "gemm-first-deferred"
WARMUPS = 2  # iterations before the timed ones
STARTS = ("host", "queued")
#: Cycles of the device-side wait before a ``queued`` start: about a millisecond, longer than
#: the host takes to launch either side.
QUEUE_CYCLES = 2_000_000


@contextlib.contextmanager
def gemm_carveout(sms: int):
    """Within: torch's matmuls leave ``sms`` SMs free (its experimental SM carveout, as a
    framework that overlaps communication with its GEMMs sets it; cuBLASLt honours it, cuBLAS
    did not on the GPUs measured: :func:`blas_library`); 0: no change."""
    if not sms:
        yield
        return
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        raise RuntimeError("--carveout: this torch has no SM carveout for matmuls")
    before = torch._C._get_sm_carveout_experimental()
    with warnings.catch_warnings():  # (torch warns that the setting is experimental)
        warnings.simplefilter("ignore")
        setter(sms)
    try:
        yield
    finally:
        setter(before)


def _sides_ms(
    ctx, gemm, comm, stream, order: str, iters: int, start_at: str = "host"
) -> tuple[float, float]:
    """Median ms from a common start to the end of ``gemm()`` (compute stream) and of
    ``comm(after)`` (on ``stream``), launched in ``order``; ``after`` is the event that ends
    the GEMM in the order :data:`DEFERRED` (on GPUs), else None. A side given as None is left
    out (its time NaN). ``start_at``: one of :data:`STARTS`."""
    names = [name for name, fn in (("comm", comm), ("gemm", gemm)) if fn is not None]
    if order != "comm-first":
        names.reverse()
    ends: dict[str, list[float]] = {name: [] for name in names}
    late = 0  # queued runs whose device-side wait ended before every host had launched
    while len(ends[names[0]]) < iters + WARMUPS:
        dist.barrier()
        if ctx.device.type != "cuda":
            began = time.perf_counter()
            for name in names:
                if name == "gemm":
                    gemm()
                else:
                    comm(None)
                ends[name].append((time.perf_counter() - began) * 1e3)
            continue
        torch.cuda.synchronize(ctx.device)
        if start_at == "queued":
            torch.cuda._sleep(QUEUE_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        marks = {}
        for name in names:
            marks[name] = torch.cuda.Event(enable_timing=True)
            if name == "gemm":
                gemm()
                marks[name].record()
            else:
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    comm(marks.get("gemm") if order == DEFERRED else None)
                    marks[name].record()
        started = start_at == "queued" and start.query()  # (the wait is over: launched late)
        torch.cuda.synchronize(ctx.device)
        if start_at == "queued" and _any_rank(started, ctx.device):
            # Not a queued start on some rank (its host was slower than the wait): the run
            # does not count, on every rank alike.
            late += 1
            if late > iters:
                raise RuntimeError(
                    f"--start queued: in {late} runs a host launched after the device-side "
                    f"wait of {QUEUE_CYCLES} cycles ended; the start was not queued"
                )
            continue
        for name, end in marks.items():
            ends[name].append(start.elapsed_time(end))
    medians = {name: statistics.median(t[WARMUPS:]) for name, t in ends.items()}
    return medians.get("gemm", float("nan")), medians.get("comm", float("nan"))


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank (a collective)."""
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _paths(ctx, opts, x, idx, w, E, K):
    """``({path: (dispatch, combine, sms, tuning)}, teardowns)``: each path's cached dispatch
    and combine of ``x`` (after one full dispatch made their layout; each takes ``after``, an
    event its epilogue waits for, or None), its SM count and the elastic ``Tuning`` its calls
    take (None: the default); then what releases the buffers."""
    from ..deep_ep import ElasticBuffer
    from ..kernels.sync import timeout_us
    from ..modes.copy_combine import CopyCombine
    from ..modes.elastic import Tuning
    from ..modes.normal import Config, NormalMode

    T, H = x.shape
    rings = NormalMode(
        None,
        H,
        E,
        max_topk=max(K, 2),
        device=ctx.device,
        check_ids=False,
        max_sms=opts.sms,
        ring_tokens=opts.ring,
        copy_combine_tokens=T,
        copy_combine_min_tokens=0,  # (at any --tokens)
    )
    config = Config(num_sms=opts.sms, nvl_recv_buffer_tokens=opts.ring)
    _, per_expert, in_rank = rings.get_dispatch_layout(idx)
    copied = rings.dispatch(x, idx, w, per_expert, in_rank, config=config).handle
    handle = dataclasses.replace(copied, source_rows=None)  # (without: the rings combine)
    y = torch.randn(handle.num_rows, H, device=ctx.device).to(torch.bfloat16)
    slots = ElasticBuffer(
        ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True
    )
    recv, _, _, slot_handle, _ = slots.dispatch(x, idx, w, num_experts=E)
    paths: dict[str, tuple] = {
        "rings": (  # (no epilogue to defer)
            lambda after: rings.dispatch(x, handle=handle),
            lambda after: rings.combine(y, handle),
            opts.sms,
            None,
        ),
    }
    # The combine over copy engines (no dispatch path): the mode's own, or one per chunk
    # count asked for, each swapped into the mode for its calls.
    copy_combines = {"copies": rings.copy_combine}
    limit_us = timeout_us(rings.timeout_s)
    for chunks in getattr(opts, "copy_chunks", []):
        copy_combines[f"copies[{chunks}]"] = CopyCombine(
            rings.group, H, max(K, 2), T, rings.device, rings.status, limit_us, chunks
        )
    if len(copy_combines) > 1:
        del copy_combines["copies"]

    def combine_over(copy_combine):
        def call(after):
            rings.copy_combine = copy_combine
            return rings.combine(y, copied)

        return call

    for name, copy_combine in copy_combines.items():
        paths[name] = (None, combine_over(copy_combine), 0, None)
    for tune in ["", *opts.tune]:
        paths[f"slots[{tune}]" if tune else "slots"] = (
            lambda after: slots.dispatch(
                x, handle=slot_handle, previous_event_before_epilogue=after
            ),
            lambda after: slots.combine(recv, slot_handle, previous_event_before_epilogue=after),
            slot_handle.num_sms,
            Tuning.of(tune) if tune else None,
        )
    own = rings.copy_combine

    def teardown():
        for copy_combine in copy_combines.values():
            if copy_combine is not own and copy_combine is not None:
                copy_combine.destroy()
        rings.copy_combine = own
        rings.destroy()

    return paths, (teardown, slots.destroy)


def _point(ctx, opts, T, H, E, K) -> list[dict]:
    from ..modes import elastic

    gen = torch.Generator().manual_seed(3000 + ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    G = opts.gemm
    a = torch.randn(G, G, generator=gen).to(torch.bfloat16).to(ctx.device)
    b = torch.randn(G, G, generator=gen).to(torch.bfloat16).to(ctx.device)
    c = torch.empty(G, G, dtype=torch.bfloat16, device=ctx.device)

    def gemm():
        torch.mm(a, b, out=c)

    on_gpu = ctx.device.type == "cuda"
    streams = {
        name: torch.cuda.Stream(ctx.device, priority=p) if on_gpu else None
        for name, p in PRIORITIES.items()
    }
    rows = []
    paths, teardowns = _paths(ctx, opts, x, idx, w, E, K)
    default = elastic.TUNING
    try:
        gemm_full = {
            start_at: _sides_ms(ctx, gemm, None, None, "gemm-first", opts.iters, start_at)[0]
            for start_at in opts.start
        }  # the GEMM alone on every SM: what a carveout costs it shows against this
        for start_at, carveout, (path, (dispatch, combine, sms, tuning)) in itertools.product(
            opts.start, opts.carveout, paths.items()
        ):
            elastic.TUNING = tuning or default  # read by every call; swapped between paths
            with gemm_carveout(carveout):
                gemm_alone, _ = _sides_ms(ctx, gemm, None, None, "gemm-first", opts.iters, start_at)
            for op, fn in (("dispatch", dispatch), ("combine", combine)):
                if fn is None:
                    continue
                orders = (*ORDERS, DEFERRED) if path.startswith("slots") else ORDERS
                for priority, order in itertools.product(PRIORITIES, orders):
                    stream = streams[priority]
                    _, alone = _sides_ms(ctx, None, fn, stream, order, opts.iters, start_at)
                    with gemm_carveout(carveout):
                        g, m = _sides_ms(ctx, gemm, fn, stream, order, opts.iters, start_at)
                    vals = mean_over_ranks([gemm_full[start_at], gemm_alone, alone, g, m])
                    g_full, g_alone, alone, g, m = (v * 1e3 for v in vals)
                    rows.append(
                        {
                            "mode": "overlap",
                            "tokens": T,
                            "hidden": H,
                            "topk": K,
                            "experts": E,
                            "ranks": ctx.world_size,
                            "gemm": G,
                            "blas": opts.blas,
                            "carveout": carveout,
                            "start": start_at,
                            "path": path,
                            "sms": sms,
                            "op": op,
                            "priority": priority,
                            "order": order,
                            "gemm_full_us": g_full,
                            "gemm_alone_us": g_alone,
                            "comm_alone_us": alone,
                            "gemm_us": g,
                            "comm_us": m,
                            "both_us": max(g, m),
                            "serial_us": g_alone + alone,
                            "gemm_slowdown": g / g_alone,
                            "finish_ratio": max(g, m) / g_alone,
                            "full_finish_ratio": max(g, m) / g_full,
                        }
                    )
    finally:
        elastic.TUNING = default
        for release in teardowns:
            release()
    return rows


@contextlib.contextmanager
def blas_library(name: str, device: torch.device):
    """Within: torch's matmuls on GPUs through ``name`` (``default``: as torch picks;
    ``cublaslt``: cuBLASLt, the library that honours the SM carveout)."""
    if name == "default" or device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    with warnings.catch_warnings():  # (torch warns that the setting is experimental)
        warnings.simplefilter("ignore")
        torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def overlap_rank(ctx, opts, progress) -> list[dict]:
    """Every point of the sweep on this rank: a list of rows (rank-averaged)."""
    rows = []
    with blas_library(opts.blas, ctx.device):
        for T, H, K, E in itertools.product(opts.tokens, opts.hidden, opts.topk, opts.experts):
            point = _point(ctx, opts, T, H, E, K)
            for row in point:
                progress(row)
            rows += point
    return rows
