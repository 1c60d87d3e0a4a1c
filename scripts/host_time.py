"""Host time of eager calls, with and without process-wide torch defaults.

    PYTHONPATH=src python scripts/host_time.py [--ranks 1] [--tokens 128] [--calls 300]
        [--hidden 7168] [--experts 288] [--topk 8] [--normal] [--reverse] [--profile 12]

Every rank makes the same calls. For each operation it prints the host time per call, the
median over ``--repeats`` runs of ``--calls`` calls issued back to back (no synchronization
inside a run), once in a plain process and once after ``torch.set_default_device('cuda')`` and
``torch.set_default_dtype(torch.bfloat16)`` (what DeepEP's test harness does), then how many
launches of the timed calls went through Triton's own launch path (``JITFunction.run``: its
binding and cache key) instead of straight to the compiled kernel; that count should be 0.

Operations: low-latency dispatch (FP8, with ``cumulative_local_expert_recv_stats``) and
combine, through ``tritonep.deep_ep.Buffer`` (what users call) and through
``LowLatencyMode`` (the mode alone); with ``--normal`` also the normal mode's cached dispatch,
worst-case dispatch, combine, a combine and a cached dispatch each with a handle it has not
launched with (as a training step's), and exact-size dispatch (whose host waits for the count),
through ``NormalMode`` and through ``tritonep.deep_ep.Buffer`` (its stream handling included:
calls without ``async_finish`` run on the current stream, and on GPUs a cached dispatch and a
combine with ``async_finish=True`` time the communication stream and its events), and
``tritonep.deep_ep.ElasticBuffer``'s worst-case, exact-size and cached dispatch and combine.
Each line also splits the time on GPUs into this project's Python (the same calls with the
kernel launches left out) and the launches. The script also runs on a tree from before issue
48 (``PYTHONPATH=prev/src``), whose modes check ids on the host by default (a synchronization
per call, counted in its figures, as its users get it).

It first prints the time of the first dispatch and combine (their compiling included, on an
empty ``TRITON_CACHE_DIR``). With ``--ranks`` above 1 (one GPU each) it also times the eager
loop of issue 48: per
iteration an L2 flush (a 256 MB memset), an event, a dispatch and a combine, an event; the
events' median over 50 iterations after 50 warm-ups.

On CPU ranks (no GPU) the launches are left out altogether: the figures are this project's
Python alone, under the interpreter's process.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import io
import pstats
import statistics
import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _defaults(device, on: bool):
    """The process-wide defaults DeepEP's tests set (or nothing)."""
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


@contextlib.contextmanager
def _launches_left_out():
    """Every low-latency launch (and every launch through ``launcher.launch``) is skipped."""
    from tritonep.kernels import launcher

    bundled = getattr(launcher, "KernelLaunch", None)  # (absent from trees before issue 48)
    call, launch = bundled.__call__ if bundled is not None else None, launcher.launch
    # (trees with launches from addresses: they launch, so nothing is left to launch after)
    values = getattr(bundled, "launch_values", None)
    if bundled is not None:
        bundled.__call__ = lambda self, *args: None
    if values is not None:
        bundled.launch_values = lambda self, values, shared, aligned=None, grid=None: True
    launcher.launch = lambda fn, grid, args, meta: None
    # An exact-size normal dispatch waits for the count its notify writes to host memory:
    # without the launch, it reads the count the last real one wrote (same inputs).
    from tritonep.modes import normal

    received = getattr(normal.NormalMode, "_received_count", None)
    if received is not None:
        normal.NormalMode._received_count = lambda self: self._host_view[1]
    # So does an exact-size ElasticBuffer dispatch, for the counts its push writes there.
    elastic = None
    with contextlib.suppress(ImportError):
        from tritonep.modes import elastic
    read = getattr(getattr(elastic, "ElasticMode", None), "_read_counts", None)
    if read is not None:
        elastic.ElasticMode._read_counts = lambda self, view, words: view[1 : 1 + words]
    try:
        yield
    finally:
        if received is not None:
            normal.NormalMode._received_count = received
        if read is not None:
            elastic.ElasticMode._read_counts = read
        launcher.launch = launch
        if bundled is not None:
            bundled.__call__ = call
        if values is not None:
            bundled.launch_values = values


@contextlib.contextmanager
def _count_triton_path(counts: list):
    """Counts the launches that go through Triton's binding (``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def counting(self, *args, **kwargs):
        counts.append(self.__name__)
        return original(self, *args, **kwargs)

    JITFunction.run = counting
    try:
        yield
    finally:
        JITFunction.run = original


def _per_call_us(fn, calls, repeats, device, group):
    """Median and least over ``repeats`` runs of the host microseconds per call of ``fn``,
    issued back to back; the ranks start each run together."""
    import torch.distributed as dist

    runs = []
    for _ in range(repeats):
        _sync(device)
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    _sync(device)
    return statistics.median(runs), min(runs)


def _report(name, fn, args, device, group, on_gpu, lines, profile):
    """Time ``fn`` plainly and with its launches left out; count Triton-path launches."""
    slow: list = []
    with _count_triton_path(slow), contextlib.nullcontext() if on_gpu else _launches_left_out():
        whole, least = _per_call_us(fn, args.calls, args.repeats, device, group)
    line = f"{name:58s} {whole:7.1f} us/call (least {least:5.1f})"
    if on_gpu:
        with _launches_left_out():
            python, _ = _per_call_us(fn, args.calls, args.repeats, device, None)
        line += f", Python {python:5.1f}, launches {whole - python:5.1f}"
    line += f"; Triton-path launches: {len(slow)}"
    lines.append(line)
    if profile:
        profiler = cProfile.Profile()
        with contextlib.nullcontext() if on_gpu else _launches_left_out():
            profiler.enable()
            for _ in range(args.calls):
                fn()
            profiler.disable()
        _sync(device)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
        body = text.getvalue().splitlines()
        start = next(i for i, t in enumerate(body) if "ncalls" in t)
        lines.append("\n".join(body[start : start + profile + 1]))


def _low_latency(ctx, args, group, lines, on_gpu):
    import tritonep.deep_ep as deep_ep
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.testing import route

    device, R = ctx.device, ctx.world_size
    H, E, K, N = args.hidden, args.experts, args.topk, args.tokens
    if not on_gpu:
        H, E, K = 256, 8 * R, 4
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(device)
    idx = route(gen, N, E, K, "random").to(device)
    w = torch.rand(N, K, generator=gen).to(device)
    buffer = deep_ep.Buffer(group, 0, LowLatencyMode.size_hint(N, H, R, E), low_latency_mode=True)
    stats = torch.zeros(E // R, dtype=torch.int32, device=device)
    # Built as the buffer builds its own (max_topk at its default): the same kernel variants.
    mode = LowLatencyMode(group, N, H, E, device=device)
    new_tree = "recv_stats" in inspect.signature(mode.dispatch).parameters
    state = {}

    def api_dispatch():
        state["api"] = buffer.low_latency_dispatch(
            x, idx, N, E, cumulative_local_expert_recv_stats=stats, use_fp8=True
        )

    def mode_dispatch():
        if new_tree:
            state["mode"] = mode.dispatch(x, idx, use_fp8=True, recv_stats=stats)
        else:  # a tree before issue 48: the Buffer added the statistic itself
            state["mode"] = mode.dispatch(x, idx, use_fp8=True)
            stats.add_(state["mode"][1])

    # The first call of each (its variants compiled, or loaded from Triton's cache).
    start = time.perf_counter()
    api_dispatch()
    _sync(device)
    first = time.perf_counter() - start
    y = torch.zeros(state["api"][0][0].shape, dtype=torch.bfloat16, device=device)
    start = time.perf_counter()
    buffer.low_latency_combine(y, idx, w, state["api"][2])
    _sync(device)
    lines.append(f"first calls (compile or cache load included): dispatch {first:.2f} s, "
                 f"combine {time.perf_counter() - start:.2f} s")  # fmt: skip
    mode_dispatch()
    ops = [
        ("deep_ep.Buffer.low_latency_dispatch", api_dispatch),
        ("deep_ep.Buffer.low_latency_combine",
         lambda: buffer.low_latency_combine(y, idx, w, state["api"][2])),
        ("LowLatencyMode.dispatch", mode_dispatch),
        ("LowLatencyMode.combine", lambda: mode.combine(y, idx, w, state["mode"][2])),
    ]  # fmt: skip
    for fn in (f for _, f in ops):  # every variant compiled before any timing
        fn()
    _sync(device)
    for defaults in (False, True):
        with _defaults(device, defaults):
            for name, fn in ops[::-1] if args.reverse else ops:
                label = f"{name} ({'with' if defaults else 'no'} defaults)"
                _report(label, fn, args, device, group, on_gpu, lines, args.profile)
    if R > 1 and on_gpu:
        for defaults in (False, True):
            with _defaults(device, defaults):
                pair = _eager_loop(buffer, x, idx, w, y, N, E, stats, device, group)
            lines.append(f"eager loop, L2 flushed, dispatch + combine "
                         f"({'with' if defaults else 'no'} defaults): {pair:.1f} us")  # fmt: skip
    mode.check()
    buffer.check()
    mode.destroy()
    buffer.destroy()


def _eager_loop(buffer, x, idx, w, y, N, E, stats, device, group, iters=50):
    """Issue 48's loop (:func:`tritonep.bench.eager.eager_pair_us`, DeepEP's harness): per
    iteration an L2 flush, an event, a dispatch, a combine, an event."""
    from tritonep.bench.eager import eager_pair_us

    def dispatch():
        return buffer.low_latency_dispatch(
            x, idx, N, E, cumulative_local_expert_recv_stats=stats, use_fp8=True
        )[2]

    return eager_pair_us(
        dispatch, lambda handle: buffer.low_latency_combine(y, idx, w, handle), device, group,
        iters, iters,
    )  # fmt: skip


def _normal(ctx, args, group, lines, on_gpu):
    from tritonep.modes.normal import NormalMode
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    device, R = ctx.device, ctx.world_size
    H, E, K, N = args.hidden, args.experts, args.topk, args.tokens
    if not on_gpu:
        H, E, K = 256, 8 * R, 4
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(device)
    idx = route(gen, N, E, K, "random").to(device)
    w = torch.rand(N, K, generator=gen).to(device)
    x8 = tuple(t.to(device) for t in quantize_fp8(x.cpu()))
    mode = NormalMode(group, H, E, max_topk=K, device=device)
    _sync(device)
    start = time.perf_counter()
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    out = mode.dispatch(x, idx, w, per_expert, in_rank)
    _sync(device)
    first = [("layout and exact-size dispatch", time.perf_counter() - start)]
    y = out.recv_x.clone()
    worst = N * R
    ops = [
        ("NormalMode cached dispatch", lambda: mode.dispatch(x, handle=out.handle)),
        ("NormalMode cached dispatch FP8", lambda: mode.dispatch(x8, handle=out.handle)),
        ("NormalMode worst-case dispatch",
         lambda: mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=worst)),
        ("NormalMode combine", lambda: mode.combine(y, out.handle)),
    ]  # fmt: skip
    if on_gpu:  # its host waits for the count: the notify kernel must run
        ops.append(("NormalMode exact-size dispatch (waits for the count)",
                    lambda: mode.dispatch(x, idx, w, per_expert, in_rank)))  # fmt: skip
    ops += _new_handle_ops(mode, args, x, idx, w, per_expert, in_rank, worst, on_gpu)
    buffer_ops, buffer = _deep_ep_normal_ops(ctx, group, x, idx, w, E, worst, on_gpu)
    ops += buffer_ops
    for name, fn in ops:  # the first call of each (its variants compiled or loaded)
        start = time.perf_counter()
        fn()
        _sync(device)
        first.append((name, time.perf_counter() - start))
    lines.append(
        "normal first calls (compile or cache load included): "
        + ", ".join(f"{name} {t:.2f} s" for name, t in first)
    )
    for defaults in (False, True):
        with _defaults(device, defaults):
            for name, fn in ops[::-1] if args.reverse else ops:
                label = f"{name} ({'with' if defaults else 'no'} defaults)"
                _report(label, fn, args, device, group, on_gpu, lines, args.profile)
    if on_gpu and hasattr(mode, "_received_count"):
        exact = next(fn for name, fn in ops if name.startswith("NormalMode exact-size"))
        whole, waited = _less_wait(mode, exact, args, device, group)
        lines.append(
            f"{'NormalMode exact-size dispatch, less its wait':58s} {whole - waited:7.1f} "
            f"us/call (the wait for the count: {waited:5.1f} us)"
        )
    mode.check()
    mode.destroy()
    buffer.destroy()
    while _ELASTIC:
        _ELASTIC.pop().destroy()


def _new_handle_ops(mode, args, x, idx, w, per_expert, in_rank, worst, on_gpu):
    """A combine and a cached dispatch each with a handle it has not launched with yet, as a
    training step's calls find theirs (the other operations reuse one handle): handles of
    worst-case dispatches made beforehand, one for each call the timing makes."""
    uses = 2 * (2 * args.calls * args.repeats + args.calls * (1 + bool(args.profile))) + 1
    with contextlib.nullcontext() if on_gpu else _launches_left_out():
        fresh = [
            mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=worst).handle
            for _ in range(2 * uses)
        ]
    y = torch.zeros(worst, x.shape[1], dtype=torch.bfloat16, device=x.device)
    to_combine, to_dispatch = iter(fresh[::2]), iter(fresh[1::2])
    return [
        ("NormalMode combine, new handle", lambda: mode.combine(y, next(to_combine))),
        (
            "NormalMode cached dispatch, new handle",
            lambda: mode.dispatch(x, handle=next(to_dispatch)),
        ),
    ]


def _less_wait(mode, fn, args, device, group):
    """Host microseconds per call of ``fn`` (an exact-size dispatch of ``mode``), and of
    them the mean spent waiting for the count (``NormalMode._received_count``)."""
    waits = []
    received = mode._received_count

    def timed():
        start = time.perf_counter()
        count = received()
        waits.append(time.perf_counter() - start)
        return count

    mode._received_count = timed
    try:
        whole, _ = _per_call_us(fn, args.calls, args.repeats, device, group)
    finally:
        del mode._received_count
    return whole, statistics.mean(waits) * 1e6


def _deep_ep_normal_ops(ctx, group, x, idx, w, E, worst, on_gpu):
    """(name, call) of the normal calls through a ``tritonep.deep_ep.Buffer`` (its first
    dispatch run), and the buffer."""
    import tritonep.deep_ep as deep_ep

    buffer = deep_ep.Buffer(group, 1 << 30, 0)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    layout = (per_rank, None, in_rank, per_expert, idx, w)
    first = buffer.dispatch(x, None, *layout)
    handle, y = first[4], first[0].clone()
    ops = [
        ("deep_ep.Buffer cached dispatch", lambda: buffer.dispatch(x, handle)),
        ("deep_ep.Buffer worst-case dispatch",
         lambda: buffer.dispatch(x, None, *layout, num_worst_tokens=worst)),
        ("deep_ep.Buffer combine", lambda: buffer.combine(y, handle)),
    ]  # fmt: skip
    if on_gpu:
        ops.append(("deep_ep.Buffer exact-size dispatch (waits for the count)",
                    lambda: buffer.dispatch(x, None, *layout)))  # fmt: skip
        # On the communication stream, with its events (what async_finish asks for).
        ops += [
            ("deep_ep.Buffer cached dispatch, async_finish",
             lambda: buffer.dispatch(x, handle, async_finish=True)),
            ("deep_ep.Buffer combine, async_finish",
             lambda: buffer.combine(y, handle, async_finish=True)),
        ]  # fmt: skip
    if hasattr(deep_ep, "ElasticBuffer"):
        ops += _elastic_ops(group, x, idx, w, E, on_gpu)
    return ops, buffer


def _elastic_ops(group, x, idx, w, E, on_gpu):
    """(name, call) of ``deep_ep.ElasticBuffer``'s dispatch (worst-case sizes, no host read,
    and cached) and combine, their first calls run."""
    import tritonep.deep_ep as deep_ep

    N, H = x.shape
    elastic = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=N, hidden=H, num_topk=idx.shape[1], explicitly_destroy=True
    )
    first = elastic.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False)
    handle, y = first[3], first[0].clone()
    elastic.dispatch(x, idx, w, num_experts=E)  # (the counts an exact-size call reads)
    ops = [
        ("deep_ep.ElasticBuffer worst-case dispatch",
         lambda: elastic.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False)),
        ("deep_ep.ElasticBuffer exact-size dispatch (waits for the count)",
         lambda: elastic.dispatch(x, idx, w, num_experts=E)),
        ("deep_ep.ElasticBuffer cached dispatch", lambda: elastic.dispatch(x, handle=handle)),
        ("deep_ep.ElasticBuffer combine", lambda: elastic.combine(y, handle)),
    ]  # fmt: skip
    if on_gpu:
        ops.append(("deep_ep.ElasticBuffer combine, async",
                    lambda: elastic.combine(y, handle, async_with_compute_stream=True,
                                            allocate_on_comm_stream=True)))  # fmt: skip
    _ELASTIC.append(elastic)
    return ops


#: ElasticBuffers to destroy after the timings.
_ELASTIC: list = []


def _rank(ctx, args):
    import torch.distributed as dist

    on_gpu = ctx.device.type == "cuda"
    group = dist.group.WORLD
    shape = (f"hidden {args.hidden}, {args.experts} experts, top-{args.topk}" if on_gpu
             else f"hidden 256, {8 * ctx.world_size} experts, top-4")  # fmt: skip
    where = torch.cuda.get_device_name(ctx.device) if on_gpu else "CPU, launches left out"
    lines = [f"rank {ctx.rank} of {ctx.world_size}, {where}, {args.tokens} tokens, {shape}"]
    _low_latency(ctx, args, group, lines, on_gpu)
    if args.normal:
        _normal(ctx, args, group, lines, on_gpu)
    return "\n".join(lines)


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--normal", action="store_true", help="also the normal mode's calls")
    parser.add_argument("--reverse", action="store_true",
                        help="time the operations in reverse order (the modes' first)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0,
                        help="print the N functions with the most own time per op")  # fmt: skip
    args = parser.parse_args()
    results = spawn(_rank, args.ranks, args, timeout=1800)
    for text in results if isinstance(results, list) else [results]:
        print(text, flush=True)


if __name__ == "__main__":
    main()
