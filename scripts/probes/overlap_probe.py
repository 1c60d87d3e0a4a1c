"""When each kernel runs while an ElasticBuffer call shares the GPU with a GEMM.

    PYTHONPATH=src python scripts/probes/overlap_probe.py [RANKS] [TOKENS] [GEMM] [HIDDEN]
        [EXPERTS] [TOPK]

``tritonep bench overlap`` gives each side's end; this probe shows why. Per variant (the
epilogue as a programmatic dependent launch or a plain one; the communication stream at the
default or the highest priority) and operation (cached dispatch, combine), communication
launched first, then a BF16 ``[G, G] @ [G, G]`` on the compute stream: the medians of 10
iterations as the benchmark times them, then one iteration under ``torch.profiler`` on rank 0,
printed as a timeline: each kernel's start and end in microseconds from the first kernel's
start. 4096 tokens, hidden 7168, top-8 of 256 experts, random routing, by default. On CPU
ranks (the interpreter, small shapes) every step runs, with no streams and no timeline: a
check that the probe works, not a measurement.
"""

import sys

import torch


def _timeline(prof) -> list[str]:
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and e.time_range.elapsed_us() > 0
        and "nccl" not in e.name.lower()  # the barrier before the iteration
    ]
    if not kernels:
        return ["  (no kernels recorded)"]
    t0 = min(e.time_range.start for e in kernels)
    lines = []
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        start, end = e.time_range.start - t0, e.time_range.end - t0
        lines.append(f"  {start:9.1f} -> {end:9.1f} us  {e.name[:70]}")
    return lines


def _rank(ctx, T, G, H, E, K):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import tritonep.deep_ep as deep_ep
    import tritonep.modes.elastic as elastic
    from tritonep.bench.overlap import _sides_ms
    from tritonep.testing import route

    gen = torch.Generator().manual_seed(5 + ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    a = torch.randn(G, G, generator=gen).to(torch.bfloat16).to(ctx.device)
    b = torch.randn(G, G, generator=gen).to(torch.bfloat16).to(ctx.device)
    c = torch.empty(G, G, dtype=torch.bfloat16, device=ctx.device)

    def gemm():
        torch.mm(a, b, out=c)

    buffer = deep_ep.ElasticBuffer(
        ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True
    )
    recv, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=E)
    mode = buffer.runtime
    ops = {
        "dispatch": lambda after=None: buffer.dispatch(x, handle=handle),
        "combine": lambda after=None: buffer.combine(recv, handle),
    }
    alone, _ = _sides_ms(ctx, gemm, None, None, "gemm-first", 10)
    lines = [f"GEMM alone {alone * 1e3:.1f} us"]
    on_gpu = ctx.device.type == "cuda"
    default = elastic.TUNING
    for pdl in (True, False):
        mode._pdl = pdl and on_gpu
        elastic.TUNING = elastic.Tuning()  # a new object: every plan is made again
        for priority in (0, -1):
            stream = torch.cuda.Stream(ctx.device, priority=priority) if on_gpu else None
            for name, fn in ops.items():
                _, comm_alone = _sides_ms(ctx, None, fn, stream, "comm-first", 10)
                g, m = _sides_ms(ctx, gemm, fn, stream, "comm-first", 10)
                lines.append(
                    f"{name}, PDL {pdl}, priority {priority}: alone {comm_alone * 1e3:.1f} us; "
                    f"beside the GEMM: GEMM {g * 1e3:.1f} us, communication {m * 1e3:.1f} us"
                )
                if not on_gpu:
                    continue
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    dist.barrier()
                    torch.cuda.synchronize()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        fn()
                    gemm()
                    torch.cuda.synchronize()
                if ctx.rank == 0:
                    lines += _timeline(prof)
    elastic.TUNING = default
    buffer.destroy()
    return lines


if __name__ == "__main__":
    from tritonep.launch import spawn

    defaults = (4, 4096, 8192, 7168, 256, 8)
    given = [int(v) for v in sys.argv[1:7]]
    ranks, T, G, H, E, K = (*given, *defaults[len(given) :])
    print(f"{ranks} ranks, {T} tokens, hidden {H}, top-{K} of {E} experts, GEMM {G}^3 BF16")
    for line in spawn(_rank, ranks, T, G, H, E, K, timeout=500)[0]:
        print(line)
