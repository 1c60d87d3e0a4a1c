"""Normal-mode benchmark: one rank's measurements (imported by spawned ranks by name).

Times, at each token count, with CUDA events around every call (median of ``iters``, mean over
ranks), after warm-up:

* dispatch in cached mode (the layout of an earlier call: what DeepEP's tests time), BF16 and
  FP8; and the full dispatch (notify, the host read of the received count, and the payload);
* combine of the BF16 rows (with ``--copy-combine`` also over copy engines: ``copy_combine_us``,
  ``graph_copy_combine_us``, its ``copy_chunks`` and ``copy_share``; ``--copy-chunks 1,2`` and
  ``--copy-share 4,5`` make a mode per chunk count and last chunk's share);
* cached dispatch and combine replayed from a CUDA graph (device time, no launch overhead);
* the kernels alone (``kernel_*_us``: the profiler's device time of the kernels a cached
  dispatch or a combine launches, as DeepEP V2's test reports them; GPUs only);
* the ``torch`` backend (NCCL ``all_to_all_single`` with its permutes and host sync), same
  inputs, same run;
* with ``--eager``, cached dispatch and combine as an eager loop, with and without the
  process-wide torch defaults (:func:`~tritonep.bench.eager.eager_columns`).

Bandwidth two ways: DeepEP's accounting (received bytes, local rank included, over time) and
remote bytes (received from other ranks) over time.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..reference.fp8 import quantize_fp8
from ..testing import route
from . import compare
from .eager import eager_columns, kernel_us
from .timing import mean_over_ranks, median_ms, time_graph


def _point(ctx, mode, baseline, rival, opts, num_tokens, topk, config):
    H, E, K, R = mode.hidden, mode.num_experts, topk, ctx.world_size
    gen = torch.Generator().manual_seed(2000 + ctx.rank)
    x = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, num_tokens, E, K, "random").to(ctx.device)
    w = torch.rand(num_tokens, K, generator=gen).to(ctx.device)
    x_fp8 = tuple(t.to(ctx.device) for t in quantize_fp8(x.cpu()))
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    state = {}

    def full_dispatch():
        state["out"] = mode.dispatch(x, idx, w, per_expert, in_rank, config=config)

    full_dispatch()
    copied = state["out"].handle
    handle = dataclasses.replace(copied, source_rows=None)  # (without: the rings combine)
    y = torch.randn(handle.num_rows, H, device=ctx.device).to(torch.bfloat16)
    t_full = median_ms(full_dispatch, opts.iters, 3)
    t_bf16 = median_ms(lambda: mode.dispatch(x, handle=handle), opts.iters, 3)
    fp8_handle = mode.dispatch(x_fp8, idx, w, per_expert, in_rank, config=config).handle
    t_fp8 = median_ms(lambda: mode.dispatch(x_fp8, handle=fp8_handle), opts.iters, 3)
    t_comb = median_ms(lambda: mode.combine(y, handle), opts.iters, 3)
    # Device time: cached dispatch and combine need no host synchronization, so they replay
    # from a CUDA graph; the gap to the eager times is the host's launch overhead.
    g_bf16 = time_graph(lambda: mode.dispatch(x, handle=handle), 5, 10)
    g_fp8 = time_graph(lambda: mode.dispatch(x_fp8, handle=fp8_handle), 5, 10)
    g_comb = time_graph(lambda: mode.combine(y, handle), 5, 10)
    k_bf16 = kernel_us(lambda: mode.dispatch(x, handle=handle), ctx.device)
    k_fp8 = kernel_us(lambda: mode.dispatch(x_fp8, handle=fp8_handle), ctx.device)
    k_comb = kernel_us(lambda: mode.combine(y, handle), ctx.device)
    mode.check()

    def base_dispatch():
        state["b"] = baseline.dispatch(x, idx, w, E)

    base_dispatch()
    y_base = y[: sum(state["b"][4].recv_counts)]
    base_iters = max(opts.iters // 4, min(5, opts.iters))
    t_bdisp = median_ms(base_dispatch, base_iters, 2)
    t_bcomb = median_ms(lambda: baseline.combine(y_base, state["b"][4]), base_iters, 2)

    recv: float = handle.num_recv_tokens
    local: float = int(handle.recv_count[ctx.rank].sum())
    vals = [t_full, t_bf16, t_fp8, t_comb, g_bf16, g_fp8, g_comb, t_bdisp, t_bcomb, recv, local]
    vals = mean_over_ranks(vals)
    t_full, t_bf16, t_fp8, t_comb, g_bf16, g_fp8, g_comb, t_bdisp, t_bcomb, recv, local = vals
    bf16_bytes, fp8_bytes = 2 * H, H + -(-H // 128) * 4
    remote = recv - local

    def gbps(rows, row_bytes, ms):
        return rows * row_bytes / (ms * 1e-3) / 1e9

    row = {
        "mode": "normal",
        "tokens": num_tokens,
        "hidden": H,
        "topk": K,
        "experts": E,
        "ranks": R,
        "sms": config.num_sms,
        "dispatch_us": t_bf16 * 1e3,
        "dispatch_GBps": gbps(recv, bf16_bytes, t_bf16),
        "dispatch_remote_GBps": gbps(remote, bf16_bytes, t_bf16),
        "fp8_dispatch_us": t_fp8 * 1e3,
        "fp8_dispatch_GBps": gbps(recv, fp8_bytes, t_fp8),
        "fp8_remote_GBps": gbps(remote, fp8_bytes, t_fp8),
        "combine_us": t_comb * 1e3,
        "combine_GBps": gbps(recv, bf16_bytes, t_comb),
        "combine_remote_GBps": gbps(remote, bf16_bytes, t_comb),
        "graph_dispatch_us": g_bf16 * 1e3,
        "graph_fp8_dispatch_us": g_fp8 * 1e3,
        "graph_combine_us": g_comb * 1e3,
        "full_dispatch_us": t_full * 1e3,
        **_kernel_columns(recv, bf16_bytes, fp8_bytes, k_bf16, k_fp8, k_comb),
        "torch_dispatch_us": t_bdisp * 1e3,
        "torch_combine_us": t_bcomb * 1e3,
    }
    if mode.copy_combine is not None:  # the same combine over copy engines
        t_copy = median_ms(lambda: mode.combine(y, copied), opts.iters, 3)
        g_copy = time_graph(lambda: mode.combine(y, copied), 5, 10)
        mode.check()
        t_copy, g_copy = mean_over_ranks([t_copy, g_copy])
        row["copy_combine_us"] = t_copy * 1e3
        row["copy_combine_GBps"] = gbps(recv, bf16_bytes, t_copy)
        row["graph_copy_combine_us"] = g_copy * 1e3
    if getattr(opts, "eager", False):
        columns = eager_columns(
            lambda: mode.dispatch(x, handle=handle), lambda _: mode.combine(y, handle), ctx.device
        )
        row.update(zip(columns, mean_over_ranks(list(columns.values())), strict=True))
        mode.check()
    if rival is not None:
        row.update(compare.normal_point(rival, x, idx, w, E, opts.iters))
    return row


def _kernel_columns(recv, bf16_bytes, fp8_bytes, k_bf16, k_fp8, k_comb) -> dict:
    """The kernels' own time (us, mean over ranks; NaN off GPUs) and GB/s in DeepEP's
    accounting over it (received bytes, local rank included), as DeepEP V2's test reports its
    kernels."""
    names = ("kernel_dispatch", "kernel_fp8_dispatch", "kernel_combine")
    if None in (k_bf16, k_fp8, k_comb):
        return {f"{n}_{u}": float("nan") for n in names for u in ("us", "GBps")}
    times = mean_over_ranks([k_bf16, k_fp8, k_comb])
    columns = {}
    for name, us, row_bytes in zip(names, times, (bf16_bytes, fp8_bytes, bf16_bytes), strict=True):
        columns[f"{name}_us"] = us
        columns[f"{name}_GBps"] = recv * row_bytes / (us * 1e-6) / 1e9
    return columns


def normal_rank(ctx, opts, progress):
    """Every point of the sweep on this rank: a list of rows (rank-averaged)."""
    from ..modes.normal import Config
    from ..torch_backend import TorchBackend

    baseline = TorchBackend()
    rival = compare.load(opts.compare, ctx.rank)
    rows = []
    sweep = itertools.product(
        getattr(opts, "copy_chunks", [None]),
        getattr(opts, "copy_share", [None]),
        opts.hidden,
        opts.experts,
        opts.topk,
    )
    for copy_chunks, copy_share, hidden, experts, topk in sweep:
        mode = _mode(ctx, opts, hidden, experts, topk, copy_chunks, copy_share)
        for tokens, sms, chunk, ring in itertools.product(
            opts.tokens, opts.sms, opts.chunk, opts.ring
        ):
            config = Config(num_sms=sms, nvl_send_chunk=chunk, nvl_recv_buffer_tokens=ring)
            row = _point(ctx, mode, baseline, rival, opts, tokens, topk, config)
            row.update(chunk=chunk, ring=ring)
            if mode.copy_combine is not None:
                row["copy_chunks"] = mode.copy_combine.chunks
                row["copy_share"] = mode.copy_combine.last_share
            rows.append(row)
            progress(row)
        mode.destroy()
    return rows


def _mode(
    ctx,
    opts,
    hidden: int,
    experts: int,
    topk: int,
    copy_chunks: int | None,
    copy_share: int | None,
):
    """The sweep's mode for one (hidden, experts, top-k, chunks and last chunk's share of the
    copy-engine combine)."""
    from ..modes.normal import NormalMode

    return NormalMode(
        None,
        hidden,
        experts,
        max_topk=max(topk, 2),
        device=ctx.device,
        check_ids=False,
        max_sms=max(opts.sms),
        ring_tokens=max(opts.ring),
        copy_combine_tokens=max(opts.tokens) if getattr(opts, "copy_combine", False) else 0,
        copy_combine_chunks=copy_chunks,
        copy_combine_last_share=copy_share,
        # (Every size over the copy engines, so that the rows show where they beat the rings:
        # a mode's default takes them from copy_combine.MIN_TOKENS on.)
        copy_combine_min_tokens=0,
    )
