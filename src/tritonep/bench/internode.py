"""Internode benchmark (emulated nodes on one host): time and bytes of each leg, one rank.

The rail (network) leg is staged and copied over NVLink by default, or NVSHMEM puts with
``--nvshmem`` (the path a cluster takes; on one host NVSHMEM moves them over NVLink).

At each token count: the cached dispatch and the combine of
:class:`~tritonep.modes.internode.InternodeMode`, and each leg alone in cached mode (the rail
leg: the network leg of a real cluster; the node leg: NVLink), with the rows and bytes each
leg moves per rank, beside the ``torch`` backend and the cost model's prediction for emulated
nodes (legs sharing NVLink).
"""

from __future__ import annotations

import itertools

import torch

from ..costmodel import Links, Traffic, predict
from ..testing import route
from .timing import mean_over_ranks, median_ms


def _point(ctx, mode, baseline, opts, num_tokens, topk):
    H, E = mode.hidden, mode.num_experts
    gen = torch.Generator().manual_seed(4000 + ctx.rank)
    x = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, num_tokens, E, topk, "random").to(ctx.device)
    out = mode.dispatch(x, idx)
    handle = out.handle
    y = torch.ones(handle.num_rows, H, dtype=torch.bfloat16, device=ctx.device)
    rail_x = mode.rail.dispatch(x, handle=handle.rail).recv_x
    t_disp = median_ms(lambda: mode.dispatch(x, handle=handle), opts.iters, 3)
    t_comb = median_ms(lambda: mode.combine(y, handle), opts.iters, 3)
    t_rail = median_ms(lambda: mode.rail.dispatch(x, handle=handle.rail), opts.iters, 3)
    t_node = median_ms(
        lambda: mode.node.dispatch(rail_x, handle=handle.node, src_tag=handle.tag),
        opts.iters,
        3,
    )
    mode.check()
    t_torch = median_ms(lambda: baseline.dispatch(x, idx, None, E), max(opts.iters // 4, 1), 1)
    # Rows per leg: what arrived over the rail from other nodes, what the forwarder sent on to
    # other GPUs of its node, and the final rows (DeepEP's accounting).
    rail_count = handle.rail.recv_count.sum(dim=1)
    network = float(rail_count.sum() - rail_count[mode.node_index])
    sent_on = handle.node.is_token_in_rank.clone()
    sent_on[:, mode.local_index] = False
    nvlink = float(sent_on.sum())
    vals = mean_over_ranks(
        [t_disp, t_comb, t_rail, t_node, t_torch, network, nvlink, handle.num_rows]
    )
    t_disp, t_comb, t_rail, t_node, t_torch, network, nvlink, rows = vals
    row_bytes = 2 * H
    model = predict(Traffic(network, nvlink, rows), H, links=Links(), shared_links=True)
    return {
        "mode": "internode",
        "tokens": num_tokens,
        "hidden": H,
        "topk": topk,
        "experts": E,
        "ranks": ctx.world_size,
        "gpus_per_node": mode.gpus_per_node,
        "transport": mode.rail.transport.name,
        "dispatch_us": t_disp * 1e3,
        "dispatch_GBps": rows * row_bytes / (t_disp * 1e-3) / 1e9,
        "combine_us": t_comb * 1e3,
        "rail_leg_us": t_rail * 1e3,
        "node_leg_us": t_node * 1e3,
        "network_MB": network * row_bytes / 1e6,
        "nvlink_MB": nvlink * row_bytes / 1e6,
        "model_dispatch_us": model["dispatch_us"],
        "torch_dispatch_us": t_torch * 1e3,
    }


def internode_rank(ctx, opts, progress):
    """Every point of the sweep on this rank: a list of rows (rank-averaged)."""
    from ..modes.internode import InternodeMode
    from ..torch_backend import TorchBackend

    baseline = TorchBackend()
    rows = []
    for hidden, experts, topk in itertools.product(opts.hidden, opts.experts, opts.topk):
        mode = InternodeMode(
            None,
            hidden,
            experts,
            opts.gpus_per_node,
            max_topk=max(topk, 2),
            device=ctx.device,
            check_ids=False,
        )
        for tokens in opts.tokens:
            row = _point(ctx, mode, baseline, opts, tokens, topk)
            rows.append(row)
            progress(row)
        mode.destroy()
    return rows
