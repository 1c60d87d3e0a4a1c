"""Low-latency benchmark: one rank's measurements (imported by spawned ranks by name)."""

from __future__ import annotations

import torch

from ..testing import route
from .timing import mean_over_ranks, time_graph, time_pair


def _low_latency_point(ctx, mode, baseline, opts, T, max_tokens):
    """Time one token count: tritonep per call and in graphs, then the torch backend."""
    H, E, K = opts.hidden, opts.experts, opts.topk
    use_fp8 = not opts.bf16
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    rows = mode.num_ranks * max_tokens
    y = torch.randn(mode.num_local_experts, rows, H, device=ctx.device).to(torch.bfloat16)
    state = {}

    def dispatch():
        state["d"] = mode.dispatch(x, idx, use_fp8=use_fp8)

    def combine():
        mode.combine(y, idx, w, state["d"][2])

    def base_dispatch():
        state["b"] = baseline.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=use_fp8)

    def base_combine():
        baseline.low_latency_combine(y, idx, w, state["b"][2])

    t_disp, t_comb = time_pair(dispatch, combine, opts.iters, 10)
    mode.check()
    recv_rows = int(state["d"][1].sum())
    g_disp, g_comb = time_graph(dispatch, 10, 20), time_graph(combine, 10, 20)
    mode.check()
    b_disp, b_comb = time_pair(base_dispatch, base_combine, max(opts.iters // 5, 5), 3)
    msg = H + H // 128 * 4 if use_fp8 else 2 * H
    vals = mean_over_ranks([t_disp, t_comb, g_disp, g_comb, b_disp, b_comb, recv_rows])
    t_disp, t_comb, g_disp, g_comb, b_disp, b_comb, recv_rows = vals
    return {
        "tokens": T,
        "hidden": H,
        "topk": K,
        "experts": E,
        "ranks": mode.num_ranks,
        "dispatch_us": t_disp * 1e3,
        "combine_us": t_comb * 1e3,
        "graph_dispatch_us": g_disp * 1e3,
        "graph_combine_us": g_comb * 1e3,
        "torch_dispatch_us": b_disp * 1e3,
        "torch_combine_us": b_comb * 1e3,
        # DeepEP's accounting: bytes received (local rank included) over time.
        "dispatch_GBps": recv_rows * msg / (t_disp * 1e-3) / 1e9,
        "combine_GBps": recv_rows * 2 * H / (t_comb * 1e-3) / 1e9,
    }


def low_latency_rank(ctx, opts):
    from ..modes.low_latency import LowLatencyMode
    from ..torch_backend import TorchBackend

    sweep = [int(t) for t in opts.tokens.split(",")]
    max_tokens = max(sweep)
    # No host read of the ids per call: that is a GPU sync, which decode loops avoid.
    mode = LowLatencyMode(
        None,
        max_tokens,
        opts.hidden,
        opts.experts,
        max_topk=max(opts.topk, 2),
        device=ctx.device,
        check_ids=False,
    )
    baseline = TorchBackend()
    rows = [_low_latency_point(ctx, mode, baseline, opts, T, max_tokens) for T in sweep]
    mode.destroy()
    return rows
