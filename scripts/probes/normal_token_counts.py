"""Does a new token count compile anything in the normal mode? (issue 48, item 5)

    PYTHONPATH=src python scripts/probes/normal_token_counts.py [--ranks 1] [--steps 20]

Each rank runs ``--steps`` steps with a token count drawn from 1 to ``--max-tokens`` (8192 on
GPUs; log-uniform, a different one per rank and step, random routing): a layout, an exact-size
and a worst-case dispatch, a cached dispatch (BF16 and FP8) and combines. It prints, per step,
the token count, the step's time and the launches that went through Triton's own path
(``KernelLaunch._triton_path``: a variant not yet launched, compiled or loaded from the cache)
and the variants Triton compiled in the step. After the first step both should be 0.
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def _rank(ctx, steps, max_tokens):
    from triton import knobs

    from tritonep.kernels import launcher
    from tritonep.modes.normal import NormalMode
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    on_gpu = ctx.device.type == "cuda"
    H, E, K = (7168, 288, 8) if on_gpu else (256, 8 * ctx.world_size, 4)
    mode = NormalMode(None, H, E, max_topk=K, device=ctx.device)
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(1)
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    lines = []
    for step in range(steps):
        N = max(1, int(math.exp(torch.rand(1, generator=gen).item() * math.log(max_tokens))))
        x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(ctx.device)
        idx = route(gen, N, E, K, "random").to(ctx.device)
        w = torch.rand(N, K, generator=gen).to(ctx.device)
        x8 = tuple(t.to(ctx.device) for t in quantize_fp8(x.cpu()))
        before, compiles = launcher.triton_path_launches, len(compiled)
        start = time.perf_counter()
        _, per_expert, in_rank = mode.get_dispatch_layout(idx)
        out = mode.dispatch(x, idx, w, per_expert, in_rank)
        mode.combine(out.recv_x, out.handle, out.recv_topk_weights)
        worst = mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=N * ctx.world_size)
        mode.dispatch(x, handle=worst.handle)
        mode.dispatch(x8, handle=worst.handle)
        mode.combine(worst.recv_x, worst.handle, worst.recv_topk_weights)
        mode.check()
        if on_gpu:
            torch.cuda.synchronize()
        lines.append(
            f"rank {ctx.rank} step {step:2d}: {N:5d} tokens, {time.perf_counter() - start:7.3f} s, "
            f"Triton-path launches {launcher.triton_path_launches - before}, "
            f"compiles {len(compiled) - compiles}"
        )
    knobs.runtime.jit_post_compile_hook = None
    mode.destroy()
    return "\n".join(lines)


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    max_tokens = args.max_tokens or (8192 if torch.cuda.is_available() else 96)
    results = spawn(_rank, args.ranks, args.steps, max_tokens, timeout=1800)
    for text in results if isinstance(results, list) else [results]:
        print(text, flush=True)


if __name__ == "__main__":
    main()
