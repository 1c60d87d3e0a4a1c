"""The eager low-latency pair against token count and the size of the L2 flush before it.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/probes/ll_eager_flush_probe.py [--ranks 4] [--tokens 1,16,32,48,64,128]
        [--flush-mb 0,64,256]

DeepEP's test loop flushes L2 (a 256 MB memset) before each dispatch + combine pair; the flush
gives every rank's host time to queue its pair before the GPUs reach it, so the pair's time
is its kernels' unless a host is slower than the flush. This probe times the pair as
``tritonep bench low-latency --eager`` does (:func:`tritonep.bench.eager.eager_pair_us`: FP8
dispatch, BF16 combine, hidden 7168, top-8 of 256 experts, random routing, the median of 50
after 50) with other flush sizes (0: none, the host the limit), and prints the mean over ranks
per token count and flush (NaN on CPU ranks, which have no CUDA events).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def _rank(ctx, tokens_list: list[int], flushes_mb: list[int]) -> list[tuple[int, int, float]]:
    from tritonep.bench import eager
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.testing import route

    H, E, K = 7168, 256, 8
    most = max(tokens_list)
    mode = LowLatencyMode(None, most, H, E, max_topk=K, device=ctx.device, check_ids=False)
    rows = []
    default_flush = eager.FLUSH_BYTES
    try:
        for T in tokens_list:
            gen = torch.Generator().manual_seed(1000 + ctx.rank)
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
            idx = route(gen, T, E, K, "random").to(ctx.device)
            w = torch.rand(T, K, generator=gen).to(ctx.device)
            shape = (mode.num_local_experts, mode.num_ranks * most, H)
            y = (torch.randn(shape, device=ctx.device) * 0.1).to(torch.bfloat16)

            def dispatch(x=x, idx=idx):
                return mode.dispatch(x, idx, use_fp8=True)

            def combine(out, y=y, idx=idx, w=w):
                return mode.combine(y, idx, w, out[2])

            for mb in flushes_mb:
                eager.FLUSH_BYTES = mb << 20 if mb else 16
                us = eager.eager_pair_us(dispatch, combine, ctx.device)
                mean = torch.tensor([float("nan") if us is None else us], device=ctx.device)
                dist.all_reduce(mean)
                rows.append((T, mb, mean.item() / ctx.world_size))
    finally:
        eager.FLUSH_BYTES = default_flush
    mode.check()
    mode.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", default="1,16,32,48,64,128")
    parser.add_argument("--flush-mb", default="0,64,256")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    flushes = [int(f) for f in args.flush_mb.split(",")]
    from tritonep.launch import spawn

    rows = spawn(_rank, args.ranks, tokens, flushes, timeout=600)[0]
    for T, mb, us in rows:
        print(f"tokens {T:4d} flush {mb:5d} MB: eager pair {us:7.1f} us")


if __name__ == "__main__":
    main()
