"""Eager calls as users make them: issue 48's loop, host time per call, the kernels' own time.

* :func:`eager_pair_us`: per iteration an L2 flush (a 256 MB memset), an event, a dispatch and
  a combine, an event, with no synchronization inside the loop; the median over ``iters``
  iterations after as many warm-ups, in microseconds (DeepEP's harness, ``bench`` of its
  ``utils/testing.py``, makes the same loop and averages). A call's host time shows in it
  only where it exceeds the device time of an iteration (the flush's included).
* :func:`host_us`: host time per call, calls issued back to back (no synchronization inside
  a run), the median over runs that start together on every rank.
* :func:`kernel_us`: the device time of the kernels one call launches, from the profiler
  (``torch.profiler``), summed per call.
* :func:`process_defaults`: ``torch.set_default_device`` and ``set_default_dtype(bfloat16)``,
  as DeepEP's tests set them, for the loops above run both ways.
* :func:`eager_columns`: all of the above for one dispatch and combine, as a benchmark row's
  columns (``tritonep bench normal|low-latency --eager``).

GPU only: every figure is None on CPU ranks, whose kernels run under the interpreter.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

#: Bytes of the memset that flushes L2 before each iteration (twice an H200's L2 and more).
FLUSH_BYTES = 256 << 20


@contextlib.contextmanager
def process_defaults(device: torch.device, on: bool):
    """Within: ``torch.set_default_device(device)`` and ``torch.set_default_dtype(bfloat16)``
    when ``on`` (what DeepEP's test harness sets), else nothing."""
    if not on:
        yield
        return
    torch.set_default_device(device)
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


def eager_pair_us(
    dispatch, combine, device: torch.device, group=None, iters: int = 50, warmups: int = 50
) -> float | None:
    """Median microseconds from an event before ``dispatch()`` to one after ``combine()``
    (``combine`` takes what ``dispatch`` returned), each iteration after an L2 flush; the
    host synchronizes after the last iteration only."""
    if device.type != "cuda":
        return None
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    for _ in range(warmups):
        combine(dispatch())
    torch.cuda.synchronize(device)
    dist.barrier(group)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        combine(dispatch())
        end.record()
    torch.cuda.synchronize(device)
    dist.barrier(group)
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def host_us(
    fn, device: torch.device, group=None, calls: int = 200, repeats: int = 5
) -> float | None:
    """Median over ``repeats`` runs of the host microseconds per call of ``fn``, ``calls``
    calls back to back; every rank starts each run together."""
    if device.type != "cuda":
        return None
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize(device)
    dist.barrier(group)
    return statistics.median(runs)


def kernel_us(fn, device: torch.device, group=None, calls: int = 20) -> float | None:
    """Device microseconds per call of the kernels ``fn`` launches (the profiler's CUDA kernel
    events, summed, over ``calls`` calls)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()  # (no first-call work in the profile)
    torch.cuda.synchronize(device)
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # The profiler starts at different times on the ranks, and a call's kernels wait for
        # the peers': the ranks start the calls together (the barrier's kernels not counted).
        torch.cuda.synchronize(device)
        dist.barrier(group)
        torch.cuda.synchronize(device)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    dist.barrier(group)
    total = 0.0
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if "nccl" in event.name.lower():
            continue
        total += event.device_time_total if hasattr(event, "device_time_total") else 0.0
    return total / calls


def eager_columns(
    dispatch, combine, device: torch.device, group=None, iters: int = 50
) -> dict[str, float | None]:
    """Columns of a benchmark row (microseconds, this rank's; the caller averages over ranks):
    ``eager_pair_us`` (:func:`eager_pair_us`), ``host_dispatch_us`` and ``host_combine_us``
    (:func:`host_us`; combine of the last dispatch's output), each again with the process-wide
    defaults set (``*_defaults_us``), and ``kernel_pair_us`` (:func:`kernel_us`). ``dispatch()``
    returns what ``combine`` takes; their inputs must not depend on the defaults (built with
    an explicit device and dtype). Empty on CPU ranks."""
    if device.type != "cuda":
        return {}
    columns: dict[str, float | None] = {}
    for suffix, on in (("", False), ("_defaults", True)):
        with process_defaults(device, on):
            columns[f"eager_pair{suffix}_us"] = eager_pair_us(
                dispatch, combine, device, group, iters, iters
            )
            out = dispatch()
            columns[f"host_dispatch{suffix}_us"] = host_us(dispatch, device, group)
            columns[f"host_combine{suffix}_us"] = host_us(
                lambda out=out: combine(out), device, group
            )
    columns["kernel_pair_us"] = kernel_us(lambda: combine(dispatch()), device, group)
    return columns
