"""Timing helpers shared by the benchmarks: CUDA events, medians, CUDA-graph replays."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def median_event_ms(pairs) -> float:
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def median_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of ``fn()`` over ``iters`` eager calls, after ``warmup`` calls and a barrier."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]  # fmt: skip
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return median_event_ms(marks)


def time_pair(first, second, iters: int, warmup: int) -> tuple[float, float]:
    """Median ms of ``first()`` and of ``second()`` when run back to back ``iters`` times."""
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    dist.barrier()
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for m in marks:
        m[0].record()
        first()
        m[1].record()
        second()
        m[2].record()
    torch.cuda.synchronize()
    return median_event_ms([(m[0], m[1]) for m in marks]), median_event_ms(
        [(m[1], m[2]) for m in marks]
    )


def time_graph(fn, calls: int, replays: int) -> float:
    """ms per call of ``fn`` captured ``calls`` times in one CUDA graph: the device time,
    free of the host's launch overhead."""
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


def mean_over_ranks(values) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device="cuda")
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()
