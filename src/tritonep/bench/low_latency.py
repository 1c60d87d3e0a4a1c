"""Low-latency benchmark: one rank's measurements (imported by spawned ranks by name)."""

from __future__ import annotations

import itertools

import torch

from ..testing import route
from . import compare
from .eager import eager_columns
from .timing import mean_over_ranks, time_graph, time_pair


def _low_latency_point(ctx, mode, baseline, rival, opts, T, topk, max_tokens):
    """Time one token count: tritonep per call and in graphs, then the torch backend."""
    H, E, K = mode.hidden, mode.num_experts, topk
    use_fp8 = not opts.bf16
    logfmt = opts.logfmt
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, T, E, K, "random").to(ctx.device)
    w = torch.rand(T, K, generator=gen).to(ctx.device)
    rows = mode.num_ranks * max_tokens
    # Expert outputs of a typical scale (DeepEP's benchmark: randn * 0.1), which LogFMT
    # encodes almost everywhere.
    y = (torch.randn(mode.num_local_experts, rows, H, device=ctx.device) * 0.1).to(torch.bfloat16)
    state = {}

    def dispatch():
        state["d"] = mode.dispatch(x, idx, use_fp8=use_fp8)

    def combine():
        mode.combine(y, idx, w, state["d"][2], use_logfmt=logfmt)

    def base_dispatch():
        state["b"] = baseline.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=use_fp8)

    def base_combine():
        baseline.low_latency_combine(y, idx, w, state["b"][2])

    t_disp, t_comb = time_pair(dispatch, combine, opts.iters, 10)
    mode.check()
    recv_rows: float = int(state["d"][1].sum())
    g_disp, g_comb = time_graph(dispatch, 10, 20), time_graph(combine, 10, 20)
    mode.check()
    b_disp, b_comb = time_pair(
        base_dispatch, base_combine, max(opts.iters // 5, min(5, opts.iters)), 3
    )
    msg = H + -(-H // 128) * 4 if use_fp8 else 2 * H
    # A LogFMT row: 10 bits a channel and 8 bytes a group (every group encoded).
    combine_msg = H * 10 // 8 + -(-H // 128) * 8 if logfmt else 2 * H
    sent_disp, sent_comb = _remote_bytes(idx.cpu(), mode, msg, combine_msg)
    vals = mean_over_ranks(
        [t_disp, t_comb, g_disp, g_comb, b_disp, b_comb, recv_rows, sent_disp, sent_comb]
    )
    t_disp, t_comb, g_disp, g_comb, b_disp, b_comb, recv_rows, sent_disp, sent_comb = vals
    row = {
        "mode": "low-latency",
        "tokens": T,
        "hidden": H,
        "topk": K,
        "experts": E,
        "ranks": mode.num_ranks,
        "gpus_per_node": mode.gpus_per_node,
        "transport": mode.transport.name,
        "dispatch_dtype": "fp8" if use_fp8 else "bf16",
        "combine_dtype": "logfmt" if logfmt else "bf16",
        "dispatch_us": t_disp * 1e3,
        "combine_us": t_comb * 1e3,
        "graph_dispatch_us": g_disp * 1e3,
        "graph_combine_us": g_comb * 1e3,
        "torch_dispatch_us": b_disp * 1e3,
        "torch_combine_us": b_comb * 1e3,
        # DeepEP's accounting: bytes received (local rank included) over time.
        "dispatch_GBps": recv_rows * msg / (t_disp * 1e-3) / 1e9,
        "combine_GBps": recv_rows * combine_msg / (t_comb * 1e-3) / 1e9,
        # Bytes that crossed to other ranks (the mean rank sends what the mean rank receives).
        "dispatch_remote_GBps": sent_disp / (t_disp * 1e-3) / 1e9,
        "combine_remote_GBps": sent_comb / (t_comb * 1e-3) / 1e9,
    }
    if getattr(opts, "eager", False):
        columns = eager_columns(
            lambda: mode.dispatch(x, idx, use_fp8=use_fp8),
            lambda d: mode.combine(y, idx, w, d[2], use_logfmt=logfmt),
            ctx.device,
        )
        row.update(zip(columns, mean_over_ranks(list(columns.values())), strict=True))
        mode.check()
    if rival is not None:
        row.update(
            compare.low_latency_point(rival, x, idx, w, E, max_tokens, use_fp8, opts.iters, logfmt)
        )
    return row


def _remote_bytes(idx, mode, msg, combine_msg):
    """Bytes this rank's dispatch and combine move to other ranks for top-k ids ``idx``.

    Dispatch stores a token's payload once per peer on its node (its other messages there are
    16-byte headers) and once per expert on other nodes (staged blocks); combine returns one
    row per (token, expert)."""
    R, rank, per_node = mode.num_ranks, mode.rank, mode.gpus_per_node
    # Distinct experts of each token (a repeated id is sent once, -1 not at all).
    chosen = torch.nn.functional.one_hot(idx + 1, mode.num_experts + 1)[..., 1:].any(dim=1)
    messages = chosen.view(len(idx), R, mode.num_local_experts).sum(dim=2)  # [T, R]
    peers = torch.arange(R)
    remote = peers != rank
    near = remote & (peers // per_node == rank // per_node)
    carriers = int((messages[:, near] > 0).sum()) + int(messages[:, remote & ~near].sum())
    sent = int(messages[:, remote].sum())
    return carriers * msg + (sent - carriers) * 16, sent * combine_msg


def low_latency_rank(ctx, opts, progress):
    """Every point of the sweep on this rank: a list of rows (rank-averaged)."""
    from ..modes.low_latency import LowLatencyMode
    from ..torch_backend import TorchBackend

    max_tokens = max(opts.tokens)
    baseline = TorchBackend()
    rival = compare.load(opts.compare, ctx.rank)
    rows = []
    for hidden, experts, topk in itertools.product(opts.hidden, opts.experts, opts.topk):
        # No host read of the ids per call: that is a GPU sync, which decode loops avoid.
        mode = LowLatencyMode(
            None,
            max_tokens,
            hidden,
            experts,
            max_topk=max(topk, 2),
            device=ctx.device,
            check_ids=False,
            gpus_per_node=getattr(opts, "gpus_per_node", None),
        )
        for tokens in opts.tokens:
            row = _low_latency_point(ctx, mode, baseline, rival, opts, tokens, topk, max_tokens)
            rows.append(row)
            progress(row)
        mode.destroy()
    return rows
