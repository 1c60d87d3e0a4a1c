"""Timing helpers shared by the benchmarks: medians of many timed calls, CUDA-graph replays.

On GPUs every call is bracketed by CUDA events (device time, queued back to back); on CPU ranks
(kernels under the interpreter, synchronous) by the host clock. Ranks start each measurement
together (a barrier after the warm-up).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def _mark():
    if _on_gpu():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _ms(start, end) -> float:
    return start.elapsed_time(end) if _on_gpu() else (end - start) * 1e3


def _sync() -> None:
    if _on_gpu():
        torch.cuda.synchronize()


def median_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, after ``warmup`` calls and a barrier."""
    return time_pair(fn, None, iters, warmup)[0]


def time_pair(first, second, iters: int, warmup: int) -> tuple[float, float]:
    """Median ms of ``first()`` and of ``second()`` (if given) run back to back ``iters``
    times; ``second``'s median is NaN when it is None."""
    calls = [first] if second is None else [first, second]
    if not _on_gpu():
        warmup = min(warmup, 1)  # the interpreter has nothing to warm up but the compile
    for _ in range(warmup):
        for fn in calls:
            fn()
    _sync()
    dist.barrier()
    marks = []
    for _ in range(iters):
        row = [_mark()]
        for fn in calls:
            fn()
            row.append(_mark())
        marks.append(row)
    _sync()
    medians = [statistics.median(_ms(m[i], m[i + 1]) for m in marks) for i in range(len(calls))]
    return medians[0], medians[1] if second is not None else float("nan")


def time_graph(fn, calls: int, replays: int) -> float:
    """ms per call of ``fn`` captured ``calls`` times in one CUDA graph: the device time,
    free of the host's launch overhead. NaN on CPU ranks (no graphs there)."""
    if not _on_gpu():
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (compiles) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def graph_median_us(fn, calls: int = 10, replays: int = 20) -> float:
    """us per call of ``fn`` captured ``calls`` times in one CUDA graph: the median over
    ``replays`` replays, each timed by CUDA events. For one-process probes (GPU only, no
    barrier between ranks); :func:`time_graph` is the benchmarks' version."""
    fn()  # warm up (compiles) outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def mean_over_ranks(values) -> list[float]:
    """The mean over ranks of each value (NaN stays NaN)."""
    device = "cuda" if _on_gpu() and dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()
