"""Where the eager time of ElasticBuffer's prefill calls goes.

    PYTHONPATH=src python scripts/probes/elastic_exact_probe.py RANKS OUT [TOKENS HIDDEN EXPERTS]
    (TRITONEP_PROBE_PROFILE=1: also a torch profiler trace of 3 exact-size dispatches and
    combines of rank 0, into OUT, with its tables; TRITONEP_PROBE_MARKS=1: also host marks
    inside 30 exact-size and 30 worst-case dispatches, medians of each step;
    TRITONEP_PROBE_SMS=16,32: also both combines with their push on that many SMs;
    TRITONEP_PROBE_TUNE="combine_warps=16;...": also both combines under each Tuning, then
    under the default again)

Per call kind (exact-size dispatch, dispatch without the host read, cached dispatch, combine,
combine of the expanded layout; top-8, random routing), the eager median of 10 calls and, after
a synchronization, when one call returns to the host and when its work is done. In a profiler
trace the gap between the ``cudaStreamSynchronize`` of the count's read and the epilogue's
``cuLaunchKernelEx`` is the host's work while the GPU idles.
"""

import itertools
import os
import sys
import time

import torch
import torch.distributed as dist


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _marks(call_of, calls: int = 30) -> list[str]:
    """Medians over ``calls`` calls of the host's steps inside an exact-size and a worst-case
    dispatch (``call_of(exact)`` makes one), from marks taken around the mode's methods: what
    the host does while the device waits for the copy epilogue's launch."""
    import statistics

    import tritonep.modes.elastic as mode

    marks: dict[str, float] = {}
    originals = {}

    def around(name, before, after):
        original = originals[name] = getattr(mode.ElasticMode, name)

        def marked(self, *args):
            if before:
                marks[before if isinstance(before, str) else before(args)] = time.perf_counter()
            result = original(self, *args)
            if after:
                marks[after if isinstance(after, str) else after(args)] = time.perf_counter()
            return result

        setattr(mode.ElasticMode, name, marked)

    around("_read_counts", "read starts", "read")
    around("_dispatch_outputs", "outputs", "outputs done")
    around(
        "_launch",
        lambda a: "epilogue" if "epilogue" in a[3] else "push",
        lambda a: "epilogue done" if "epilogue" in a[3] else "push done",
    )
    lines = []
    try:
        for exact in (True, False):
            rows: dict[str, list[float]] = {}
            for i in range(calls + 5):
                start = time.perf_counter()
                call_of(exact)()
                end = time.perf_counter()
                if i < 5:
                    continue
                steps = [("start", start), *sorted(marks.items(), key=lambda m: m[1])]
                steps.append(("return", end))
                for (a, t0), (b, t1) in itertools.pairwise(steps):
                    rows.setdefault(f"{a} -> {b}", []).append((t1 - t0) * 1e6)
                marks.clear()
            kind = "exact-size" if exact else "worst-case"
            for step, us in rows.items():
                lines.append(f"{kind} dispatch, {step}: median {statistics.median(us):.1f} us")
    finally:
        for name, original in originals.items():
            setattr(mode.ElasticMode, name, original)
    return lines


def _rank(ctx, T, H, E, K, out_dir):
    import tritonep.deep_ep as deep_ep
    from tritonep.bench.timing import median_ms
    from tritonep.testing import route

    elastic = deep_ep.ElasticBuffer(
        ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True
    )
    gen = torch.Generator().manual_seed(13 + ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    recv, _, _, handle, _ = elastic.dispatch(x, idx, w, num_experts=E)
    expanded, _, _, expanded_handle, _ = elastic.dispatch(x, idx, num_experts=E, do_expand=True)
    calls = {
        "dispatch exact": lambda: elastic.dispatch(x, idx, w, num_experts=E),
        "dispatch worst": lambda: elastic.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False),
        "dispatch cached": lambda: elastic.dispatch(x, handle=handle),
        "combine": lambda: elastic.combine(recv, handle),
        "combine expanded": lambda: elastic.combine(expanded, expanded_handle),
    }
    lines = []
    for name, fn in calls.items():
        ms = median_ms(fn, 10, 3)
        _sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        lines.append(
            f"{name}: eager median {ms * 1e3:.1f} us; one call: host returns after "
            f"{1e6 * (t1 - t0):.1f} us, done after {1e6 * (t2 - t0):.1f} us"
        )
    import tritonep.modes.elastic as mode

    for config in filter(None, os.environ.get("TRITONEP_PROBE_TUNE", "").split(";")):
        default = mode.TUNING
        mode.TUNING = mode.Tuning.of(config)
        for name in ("combine", "combine expanded"):
            ms = median_ms(calls[name], 10, 3)
            lines.append(f"{name} [{config}]: eager median {ms * 1e3:.1f} us")
        mode.TUNING = default
        for name in ("combine", "combine expanded"):
            ms = median_ms(calls[name], 10, 3)
            lines.append(f"{name} [default, again]: eager median {ms * 1e3:.1f} us")
    for sms in filter(None, os.environ.get("TRITONEP_PROBE_SMS", "").split(",")):
        for name, (data, hdl) in (
            ("combine", (recv, handle)),
            ("combine expanded", (expanded, expanded_handle)),
        ):
            ms = median_ms(
                lambda d=data, h=hdl, n=int(sms): elastic.combine(d, h, num_sms=n), 10, 3
            )
            lines.append(f"{name}, push on {sms} SMs: eager median {ms * 1e3:.1f} us")
    if os.environ.get("TRITONEP_PROBE_MARKS"):

        def call_of(exact):
            return lambda: elastic.dispatch(x, idx, w, num_experts=E, do_cpu_sync=exact)

        lines += _marks(call_of)
    if os.environ.get("TRITONEP_PROBE_PROFILE"):
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(out_dir, exist_ok=True)
        for name in ("dispatch exact", "combine", "combine expanded"):
            _sync()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    calls[name]()
                _sync()
            if ctx.rank == 0:
                stem = name.replace(" ", "_")
                prof.export_chrome_trace(os.path.join(out_dir, f"elastic-{stem}.json"))
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
                lines += [f"--- {name}: by self CPU time", table]
                table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=8)
                lines += [f"--- {name}: by device time", table]
    elastic.destroy()
    return lines


if __name__ == "__main__":
    from tritonep.launch import spawn

    ranks, out = int(sys.argv[1]), sys.argv[2]
    T, H, E = (int(v) for v in (sys.argv[3:6] if len(sys.argv) > 5 else (4096, 7168, 256)))
    print(f"{ranks} ranks, {T} tokens x {H} BF16, top-8 of {E} experts, random routing")
    for line in spawn(_rank, ranks, T, H, E, 8, out, timeout=300)[0]:
        print(line)
