"""Decode through DeepEP V2's ElasticBuffer against the low-latency mode, in CUDA graphs.

    PYTHONPATH=src python scripts/elastic_decode_probe.py [--ranks 4] [--tokens 1,32,128]
        [--hidden 7168] [--experts 256] [--topk 8] [--prefill 4096] [--decode-max N]
        [--kernels] [--tune "combine_rows=4,combine_warps=4;copy_rows=8"] [--trace DIR]

Per batch size, the device time per call (CUDA-graph replays, mean over ranks) of:

* low-latency dispatch (FP8, quantized in the kernel) and combine (BF16, weighted), the V1
  decode path (``Buffer.low_latency_dispatch`` / ``low_latency_combine``);
* elastic dispatch as V2 decodes (``do_cpu_sync=False``, ``do_expand=True``: worst-case
  sizes, each local expert's rows contiguous), of FP8 rows quantized beforehand and of BF16
  rows, and the combine of the expanded rows (summed per token on each rank, then in V2's
  order on the owner).

The bytes differ in kind: the low-latency dispatch moves one FP8 row per (token, rank) and its
combine one BF16 row per (token, expert); the elastic dispatch moves one row per (token,
rank) too, its combine one BF16 row per (token, rank). With ``--prefill N`` it also times an
exact-size (``do_cpu_sync=True``, plain layout) elastic dispatch and combine of N tokens, and
a combine in the expanded layout (the rows of a token's local experts summed before they go
back: a training step's), against the normal mode's (eager medians: both read a count on the
host), under each ``--tune`` configuration too. With ``--kernels``
it also prints, per decode call, each kernel's device time per call on rank 0 (the profiler
over graph replays; it is started once before any timing, as its first start is slow).
With ``--tune`` it times the elastic calls again under each given
:class:`tritonep.modes.elastic.Tuning` (fields as ``name=value``, configurations separated
by ``;``), after the defaults; with ``--trace`` too, it traces under each as well.

With ``--trace DIR`` it then traces, per batch size, the decode calls inside the kernels
(:mod:`tritonep.kernels.trace`; profilers cannot split the elastic dispatch, whose copy
epilogue is a programmatic dependent launch that starts early and waits): 5 calls of each of
low-latency dispatch and combine, elastic FP8 dispatch and combine, captured in CUDA graphs
and replayed (the readings are the last replay's; eager on CPU ranks). It writes each rank's
Chrome trace to ``DIR/decode-<tokens>[-<tuning>]-rank<r>.json`` (Perfetto) and prints rank
0's phases: per kernel, each phase's span and its sub-phases (median|mean over programs and
calls, in us; ``(n)`` where fewer programs than all spent time in one, e.g. the exchange of
the last program of an elastic push only), and each call's path (medians over calls, from its
first program's start): each launch's first start, the end of its first phase in the last
program to end it (the push of an elastic push; the wait of an epilogue), and its last end.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch


def _graph(fn, calls):
    """``fn`` captured ``calls`` times in one CUDA graph (after a warm-up call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return graph


def _profiled(graph, replays):
    """The CUDA kernels of ``replays`` replays of ``graph``: {name: total device us}."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    dist.barrier()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
    return totals


def _kernel_lines(calls_by_name, calls=5, replays=10):
    """Per decode call: each kernel's device time per call (us), this rank's."""
    lines = []
    for name, fn in calls_by_name.items():
        graph = _graph(fn, calls)
        totals = _profiled(graph, replays)
        per = ", ".join(
            f"{kernel.split('(')[0]} {us / (calls * replays):.1f}"
            for kernel, us in sorted(totals.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"        {name}: {per}")
    return lines


def _decode_calls(ctx, opts, elastic, legacy, T, most):
    """The decode calls of a batch of ``T`` tokens per rank: {name: call}."""
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    E, K = opts.experts, opts.topk
    gen = torch.Generator().manual_seed(11 + ctx.rank)
    x = torch.randn(T, opts.hidden, generator=gen).to(torch.bfloat16)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    x8 = tuple(t.to(ctx.device) for t in quantize_fp8(x))
    x = x.to(ctx.device)
    ll = legacy.low_latency_dispatch(x, idx, most, E, use_fp8=True)
    y_ll = torch.randn(ll[0][0].shape, device=ctx.device).to(torch.bfloat16)
    common = dict(
        num_experts=E,
        num_max_tokens_per_rank=opts.decode_max or most,
        do_cpu_sync=False,
        do_expand=True,
    )
    recv, _, recv_w, handle, _ = elastic.dispatch(x, idx, w, **common)
    y = torch.randn(recv.shape, device=ctx.device).to(torch.bfloat16)
    return {
        "LL dispatch FP8": lambda: legacy.low_latency_dispatch(x, idx, most, E, use_fp8=True),
        "LL combine": lambda: legacy.low_latency_combine(y_ll, idx, w, ll[2]),
        "elastic dispatch FP8": lambda: elastic.dispatch(x8, idx, w, **common),
        "elastic dispatch BF16": lambda: elastic.dispatch(x, idx, w, **common),
        "elastic combine": lambda: elastic.combine(y, handle, recv_w),
    }


def _decode_line(ctx, opts, elastic, legacy, T, most, label=""):
    """One batch size: device time per call of each decode call, in CUDA graphs (with a
    ``label``, of the elastic FP8 dispatch and the combine alone)."""
    from tritonep.bench.timing import mean_over_ranks, time_graph

    calls = _decode_calls(ctx, opts, elastic, legacy, T, most)
    if label:
        calls = {k: v for k, v in calls.items() if k in ("elastic dispatch FP8", "elastic combine")}
    times = mean_over_ranks([time_graph(fn, 5, 10) * 1e3 for fn in calls.values()])
    timed = ", ".join(f"{name} {t:.1f} us" for name, t in zip(calls, times, strict=True))
    lines = [f"{T:5d} tokens{label}: {timed}"]
    if opts.kernels:
        lines += _kernel_lines(calls)
    return lines


#: The traced calls: (call name, its launches' names in traces).
TRACED = {
    "LL dispatch FP8": ("low-latency dispatch",),
    "LL combine": ("low-latency combine",),
    "elastic dispatch FP8": ("elastic dispatch", "elastic dispatch epilogue"),
    "elastic combine": ("elastic combine", "elastic combine epilogue"),
}


def _traced(ctx, fn, recorder, calls=5, replays=5):
    """``calls`` traced calls of ``fn`` after a warm-up call (whose launches are dropped):
    captured in one CUDA graph and replayed ``replays`` times on GPUs (the readings buffers
    hold the last replay's), eager on CPU ranks."""
    import torch.distributed as dist

    first = len(recorder.launches)
    on_gpu = ctx.device.type == "cuda"
    stream = torch.cuda.Stream() if on_gpu else None
    if on_gpu:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compiles the traced variants outside the capture
            torch.cuda.synchronize()
            del recorder.launches[first:]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn()
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        return graph  # its memory holds the readings
    fn()
    del recorder.launches[first:]
    for _ in range(calls):
        fn()
    return None


def _phase_text(recorder, kernel):
    """``phase span [sub value, ..., other value]; ...`` of ``kernel``: each value the
    median|mean, ``(n)`` where fewer programs than all spent time in it."""
    from tritonep.modes.trace import phase_medians, phases

    medians = phase_medians(recorder, kernel)
    total = max((n for _, _, n in medians.values()), default=0)
    parts = []
    for phase, subs in phases(kernel):
        if phase not in medians:
            continue
        value, mean, programs = medians[phase]
        inner = []
        for sub in (*subs, f"{phase}: other"):
            if sub in medians:
                v, m, n = medians[sub]
                name = "other" if sub.endswith(": other") else sub
                inner.append(f"{name} {v:.2f}|{m:.2f}" + (f" ({n})" if n < programs else ""))
        head = f"{phase} {value:.2f}|{mean:.2f}"
        parts.append(head + (f" [{', '.join(inner)}]" if inner else ""))
    return f"{kernel} ({total} programs x calls): " + "; ".join(parts)


def _trace_lines(ctx, opts, elastic, legacy, T, most, recorder, config=""):
    """Trace each decode call of ``T`` tokens (under the current tuning, ``config``); dump
    this rank's Chrome trace; rank 0's phases and paths."""
    from tritonep.modes.trace import critical_path

    first = len(recorder.launches)
    calls = _decode_calls(ctx, opts, elastic, legacy, T, most)
    del recorder.launches[first:]  # the calls that made the inputs (and compiled)
    graphs = [_traced(ctx, calls[name], recorder) for name in TRACED]
    tag = "".join(c if c.isalnum() else "-" for c in config)
    path = f"{opts.trace}/decode-{T}{'-' + tag if tag else ''}-rank{ctx.rank}.json"
    recorder.dump(path)
    unit = "us" if ctx.device.type == "cuda" else "logical ticks"
    label = f" [{config}]" if config else ""
    lines = [f"{T:5d} tokens{label}, traced (rank 0, {unit}, median|mean over programs; {path}):"]
    for name, kernels in TRACED.items():
        lines.append(f"    {name}:")
        lines += [f"        {_phase_text(recorder, kernel)}" for kernel in kernels]
        for kernel, points in critical_path(recorder, kernels).items():
            last = points.pop("last")
            at = ", ".join(f"{p} {v:.2f}" for p, v in points.items())
            phases = ", ".join(f"{p} {v:.2f}" for p, v in last.items() if v > 0)
            lines.append(f"        path of {kernel}: {at}; the last program: {phases}")
    del recorder.launches[first:], graphs
    return lines


def _rank(ctx, opts):
    import tritonep.deep_ep as deep_ep
    import tritonep.modes.elastic as mode
    from tritonep.bench.timing import mean_over_ranks, median_ms
    from tritonep.testing import route

    R, H, E, K = ctx.world_size, opts.hidden, opts.experts, opts.topk
    most = max(opts.tokens)
    group = ctx.group
    elastic = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=max(most, opts.prefill, opts.decode_max),
        hidden=H,
        num_topk=K,
        explicitly_destroy=True,
    )
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(most, H, R, E)
    legacy = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    if opts.kernels:  # CUPTI's first start takes long: not inside a timed call
        _profiled(_graph(lambda: torch.ones(1, device=ctx.device).add_(1), 1), 1)
    lines = [
        line for T in opts.tokens for line in _decode_line(ctx, opts, elastic, legacy, T, most)
    ]
    for config in filter(None, (opts.tune or "").split(";")):
        mode.TUNING = mode.Tuning.of(config)
        for T in opts.tokens:
            lines += _decode_line(ctx, opts, elastic, legacy, T, most, f" [{config}]")
        mode.TUNING = mode.Tuning()
    if opts.trace:
        import os

        from tritonep.modes.trace import TraceRecorder

        os.makedirs(opts.trace, exist_ok=True)
        # One recorder for both buffers (one time axis); a second low-latency buffer, whose
        # mode is created traced at its first call.
        recorder = TraceRecorder.of(True, ctx.rank, ctx.device, ctx.device.type == "cuda")
        traced_ll = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
        traced_ll.profile = recorder
        elastic.runtime.trace = recorder
        for config in ["", *filter(None, (opts.tune or "").split(";"))]:
            mode.TUNING = mode.Tuning.of(config)
            for T in opts.tokens:
                lines += _trace_lines(ctx, opts, elastic, traced_ll, T, most, recorder, config)
        mode.TUNING = mode.Tuning()
        elastic.runtime.trace = None
        traced_ll.destroy()
    if opts.prefill:
        T = opts.prefill
        gen = torch.Generator().manual_seed(13 + ctx.rank)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
        idx = route(gen, T, E, K, "random").to(ctx.device)
        recv, _, _, handle, _ = elastic.dispatch(x, idx, num_experts=E)
        expanded, _, _, expanded_handle, _ = elastic.dispatch(x, idx, num_experts=E, do_expand=True)
        per_rank, _, per_expert, in_rank, _ = legacy.get_dispatch_layout(idx, E)
        out = legacy.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
        )
        calls = {
            "normal dispatch": lambda: legacy.dispatch(
                x,
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=idx,
            ),
            "normal combine": lambda: legacy.combine(out[0], out[4]),
            "elastic dispatch": lambda: elastic.dispatch(x, idx, num_experts=E),
            "elastic combine": lambda: elastic.combine(recv, handle),
            "elastic expanded combine": lambda: elastic.combine(expanded, expanded_handle),
        }
        for config in ["", *filter(None, (opts.tune or "").split(";"))]:
            mode.TUNING = mode.Tuning.of(config)
            times = mean_over_ranks([median_ms(fn, 10, 3) * 1e3 for fn in calls.values()])
            lines.append(
                f"{T:5d} tokens (exact sizes, eager{', ' + config if config else ''}): "
                + ", ".join(f"{name} {t:.1f} us" for name, t in zip(calls, times, strict=True))
            )
        mode.TUNING = mode.Tuning()
    elastic.check()
    elastic.destroy()
    legacy.destroy()
    return lines


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", default="1,32,128")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=0)
    parser.add_argument(
        "--decode-max",
        type=int,
        default=0,
        help="num_max_tokens_per_rank of the elastic decode calls (default: the largest "
        "--tokens, the low-latency buffer's; the buffer's own is the largest of --tokens, "
        "--prefill and this)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also print each decode call's kernels with their device time per call (rank 0)",
    )
    parser.add_argument(
        "--tune",
        default="",
        help="Tuning configurations to time the elastic calls under (name=value,...;...)",
    )
    parser.add_argument(
        "--trace",
        default="",
        metavar="DIR",
        help="also trace each decode call inside the kernels: Chrome traces per rank into "
        "DIR, rank 0's phases printed",
    )
    args = parser.parse_args()
    args.tokens = [int(v) for v in args.tokens.split(",")]
    results = spawn(_rank, args.ranks, args, timeout=580)
    print(f"{args.ranks} ranks, hidden {args.hidden}, {args.experts} experts, top-{args.topk}")
    for line in results[0]:
        print(line)


if __name__ == "__main__":
    main()
