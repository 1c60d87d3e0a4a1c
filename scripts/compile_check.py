"""Does a new token count compile anything? A loop over random token counts, in each mode.

    PYTHONPATH=src TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile_check.py --ranks 4
        [--steps 20] [--max-tokens 8192] [--ll-max-tokens 512] [--hidden 7168]

Every rank runs ``--steps`` steps; each step draws this rank's token count at random from 1 to
``--max-tokens`` (low-latency mode: to ``--ll-max-tokens``), routes them at random and makes
every kind of call of each mode: normal mode (exact-size dispatch with its layout, worst-case
dispatch, cached BF16 and FP8 dispatches, combine), low-latency mode (FP8 dispatch with
``cumulative_local_expert_recv_stats``, combine). After each step it prints the seconds the
step took and how many kernel variants Triton holds per kernel (its own cache of compiled
variants on this device); after the first step of each mode those numbers must not grow.

On an empty ``TRITON_CACHE_DIR`` the first step of each mode also gives the first call's time
with compiling included (the lead's "first call" figure; issue 48: low-latency 7.0 s, normal
5.9 s, first FP8 dispatch +3.7 s).
"""

from __future__ import annotations

import argparse
import time

import torch


def _variants(kernels, device) -> list[int]:
    """Compiled variants Triton holds for each kernel on ``device``."""
    counts = []
    for k in kernels:
        entry = k.device_caches.get(device.index)
        counts.append(len(entry[0]) if entry else 0)
    return counts


def _rank(ctx, args):
    import torch.distributed as dist

    from tritonep.kernels import layout, normal_combine, normal_dispatch, normal_notify
    from tritonep.modes import low_latency as ll
    from tritonep.modes.normal import NormalMode
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    device, R, me = ctx.device, ctx.world_size, ctx.rank
    H, E, K = args.hidden, args.experts, args.topk
    lines = [f"rank {me} of {R}, {torch.cuda.get_device_name(device)}"]
    gen = torch.Generator().manual_seed(1234 + me)
    normal = NormalMode(None, H, E, max_topk=K, device=device)
    low = ll.LowLatencyMode(None, args.ll_max_tokens, H, E, max_topk=K, device=device)
    stats = torch.zeros(E // R, dtype=torch.int32, device=device)
    kernels = {
        "normal": [
            layout.dispatch_layout_kernel,
            normal_notify.notify_kernel,
            normal_dispatch.normal_dispatch_kernel,
            normal_combine.normal_combine_kernel,
        ],
        "low-latency": [ll.DISPATCH_KERNEL, ll.COMBINE_KERNEL],
    }

    def normal_step(n):
        x = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(device)
        idx = route(gen, n, E, K, "random").to(device)
        w = torch.rand(n, K, generator=gen).to(device)
        x8 = tuple(t.to(device) for t in quantize_fp8(x.cpu()))
        _, per_expert, in_rank = normal.get_dispatch_layout(idx)
        out = normal.dispatch(x, idx, w, per_expert, in_rank)
        normal.combine(out.recv_x, out.handle, out.recv_topk_weights)
        worst = normal.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=n * R)
        normal.dispatch(x, handle=worst.handle)
        normal.dispatch(x8, handle=out.handle)
        normal.combine(torch.nan_to_num(worst.recv_x), worst.handle)

    def low_latency_step(n):
        x = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(device)
        idx = route(gen, n, E, K, "random").to(device)
        w = torch.rand(n, K, generator=gen).to(device)
        recv_x, _, handle, _ = low.dispatch(x, idx, use_fp8=True, recv_stats=stats)
        y = torch.zeros(recv_x[0].shape, dtype=torch.bfloat16, device=device)
        low.combine(y, idx, w, handle)

    for name, step, most in [
        ("normal", normal_step, args.max_tokens),
        ("low-latency", low_latency_step, args.ll_max_tokens),
    ]:
        for i in range(args.steps):
            n = int(torch.randint(1, most + 1, (1,), generator=gen))
            torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            step(n)
            torch.cuda.synchronize(device)
            took = time.perf_counter() - start
            counts = _variants(kernels[name], device)
            lines.append(f"{name} step {i:2d}: {n:5d} tokens, {took:7.3f} s, variants {counts}")
        dist.barrier()
    normal.check()
    low.check()
    normal.destroy()
    low.destroy()
    return "\n".join(lines)


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--ll-max-tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()
    results = spawn(_rank, args.ranks, args, timeout=3600)
    for text in results if isinstance(results, list) else [results]:
        print(text, flush=True)


if __name__ == "__main__":
    main()
