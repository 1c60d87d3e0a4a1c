"""Time DeepEP (or any module with its ``Buffer`` interface) at a benchmark point, same run.

``--compare deep_ep`` imports ``deep_ep``; a name that does not import is skipped with a note.
Because :mod:`tritonep.deep_ep` has the same interface, ``--compare tritonep.deep_ep`` runs this
code anywhere (the tests do).
"""

from __future__ import annotations

import importlib
import sys

import torch
import torch.distributed as dist

from .timing import mean_over_ranks, median_ms, time_pair


def load(name: str | None, rank: int):
    """The module ``--compare`` names, or None when there is none or it does not import (rank 0
    then says why on standard error)."""
    if not name:
        return None
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if rank == 0:
            print(f"--compare {name}: not importable here ({e}); skipped", file=sys.stderr)
        return None


def normal_point(module, x, topk_idx, topk_weights, num_experts, iters) -> dict:
    """Cached dispatch and combine (what DeepEP's own tests time), mean over ranks."""
    buffer = module.Buffer(dist.group.WORLD, int(1e9), 0)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    y = torch.ones_like(recv_x)
    t_disp = median_ms(lambda: buffer.dispatch(x, handle=handle), iters, 3)
    t_comb = median_ms(lambda: buffer.combine(y, handle), iters, 3)
    buffer.destroy()
    t_disp, t_comb = mean_over_ranks([t_disp, t_comb])
    return {"deep_ep_dispatch_us": t_disp * 1e3, "deep_ep_combine_us": t_comb * 1e3}


def low_latency_point(
    module, x, topk_idx, topk_weights, num_experts, max_tokens, use_fp8, iters, logfmt=False
):
    """Low-latency dispatch and combine back to back, mean over ranks."""
    R = dist.get_world_size()
    hidden = x.shape[1]
    size = module.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, R, num_experts)
    buffer = module.Buffer(
        dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=num_experts // R
    )
    state = {}

    def dispatch():
        state["d"] = buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, use_fp8=use_fp8
        )

    dispatch()
    # The expert outputs the tritonep side combines (randn * 0.1, as DeepEP's benchmark).
    y = torch.randn(num_experts // R, R * max_tokens, hidden, device=x.device) * 0.1
    y = y.to(torch.bfloat16)

    def combine():
        buffer.low_latency_combine(y, topk_idx, topk_weights, state["d"][2], use_logfmt=logfmt)

    t_disp, t_comb = time_pair(dispatch, combine, iters, 3)
    buffer.destroy()
    t_disp, t_comb = mean_over_ranks([t_disp, t_comb])
    return {"deep_ep_dispatch_us": t_disp * 1e3, "deep_ep_combine_us": t_comb * 1e3}
