"""Where the eager time of ElasticBuffer's prefill calls goes.

    PYTHONPATH=src python scripts/probes/elastic_exact_probe.py RANKS OUT [TOKENS HIDDEN EXPERTS]
    (TRITONEP_PROBE_PROFILE=1: also a torch profiler trace of 3 exact-size dispatches and
    combines of rank 0, into OUT, with its tables)

Per call kind (exact-size dispatch, dispatch without the host read, cached dispatch, combine;
top-8, random routing), the eager median of 10 calls and, after a synchronization, when one
call returns to the host and when its work is done. In a profiler trace the gap between the
``cudaStreamSynchronize`` of the count's read and the epilogue's ``cuLaunchKernelEx`` is the
host's work while the GPU idles.
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    calls = {
        "dispatch exact": lambda: elastic.dispatch(x, idx, w, num_experts=E),
        "dispatch worst": lambda: elastic.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False),
        "dispatch cached": lambda: elastic.dispatch(x, handle=handle),
        "combine": lambda: elastic.combine(recv, handle),
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
    if os.environ.get("TRITONEP_PROBE_PROFILE"):
        from torch.profiler import ProfilerActivity, profile

        for name in ("dispatch exact", "combine"):
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
    elastic.destroy()
    return lines


if __name__ == "__main__":
    from tritonep.launch import spawn

    ranks, out = int(sys.argv[1]), sys.argv[2]
    T, H, E = (int(v) for v in (sys.argv[3:6] if len(sys.argv) > 5 else (4096, 7168, 256)))
    print(f"{ranks} ranks, {T} tokens x {H} BF16, top-8 of {E} experts, random routing")
    for line in spawn(_rank, ranks, T, H, E, 8, out, timeout=300)[0]:
        print(line)
