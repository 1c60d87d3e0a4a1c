"""DeepEP's API on tritonep: both modes, every result checked by hand with plain torch.

Code written for DeepEP runs after one changed import (``import deep_ep`` becomes the import
below). Run it like any torchrun script, on GPUs (one per rank) or, without them, on CPU ranks
(gloo, Triton's interpreter):

    python -m tritonep.launch -n 2 examples/deepep_quickstart.py
    torchrun --nproc_per_node=4 examples/deepep_quickstart.py

Each rank makes every rank's tokens from fixed seeds, so it can work out with plain torch what
it must receive and what must come back:

* normal mode (training, prefill): ``get_dispatch_layout``, ``dispatch`` (one row per token and
  destination rank, top-k ids mapped to local experts), experts that scale each row by its
  local weights, and ``combine`` (the sum over ranks: ``x * sum(topk_weights)``);
* low-latency mode (decode): ``low_latency_dispatch`` (a fixed slab per local expert, the first
  ``recv_count`` rows filled) and ``low_latency_combine`` of the slabs as the experts'
  outputs (the weighted sum: ``x * sum(topk_weights)`` again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonep.deep_ep as deep_ep
from tritonep.launch import init_distributed

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 12, 256, 4, 4


def make_inputs(rank: int, num_experts: int):
    """Rank ``rank``'s tokens ``[T, H]`` bf16, distinct top-k expert ids ``[T, K]`` int64 and
    weights ``[T, K]`` float32, from a seed every rank knows."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    topk_idx = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(TOKENS)]
    )
    topk_weights = torch.rand(TOKENS, TOPK, generator=gen)
    return x, topk_idx.to(deep_ep.topk_idx_t), topk_weights


def rows(t: torch.Tensor) -> list:
    """The rows of ``t`` as a sorted list: what arrived, whatever the order."""
    return sorted(map(tuple, t.float().tolist()))


def main() -> None:
    ctx = init_distributed()
    group, me, R, dev = dist.group.WORLD, ctx.rank, ctx.world_size, ctx.device
    E = EXPERTS_PER_RANK * R
    inputs = [make_inputs(r, E) for r in range(R)]
    x, topk_idx, topk_weights = (t.to(dev) for t in inputs[me])
    owner = [idx // EXPERTS_PER_RANK for _, idx, _ in inputs]  # each id's rank, per source
    # What combine must give back: every expert returns the token, weighted by its weight.
    expected_out = inputs[me][0].float() * inputs[me][2].sum(dim=1, keepdim=True)

    # Normal mode.
    buffer = deep_ep.Buffer(group, int(1e8), 0, explicitly_destroy=True)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    mine = torch.stack([(owner[me] == r).any(dim=1) for r in range(R)], dim=1)
    assert torch.equal(in_rank.cpu(), mine), "is_token_in_rank"
    assert torch.equal(per_rank.cpu(), mine.sum(dim=0)), "num_tokens_per_rank"
    assert torch.equal(per_expert.cpu(), torch.bincount(inputs[me][1].flatten(), minlength=E))

    recv_x, recv_idx, recv_weights, recv_per_expert, handle, _ = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    # Rows come from rank 0's tokens first, then rank 1's, ..., each source in token order.
    sent_here = [(owner[src] == me).any(dim=1) for src in range(R)]
    want_x = torch.cat([inputs[src][0][sent_here[src]] for src in range(R)])
    want_idx = torch.cat([inputs[src][1][sent_here[src]] for src in range(R)])
    want_w = torch.cat([inputs[src][2][sent_here[src]] for src in range(R)])
    local = want_idx // EXPERTS_PER_RANK == me  # ids of this rank's experts become 0..E/R-1
    want_local_idx = torch.where(local, want_idx - me * EXPERTS_PER_RANK, -1)
    assert torch.equal(recv_x.cpu(), want_x), "recv_x"
    assert torch.equal(recv_idx.cpu(), want_local_idx), "recv_topk_idx"
    assert torch.equal(recv_weights.cpu(), torch.where(local, want_w, 0.0)), "recv_topk_weights"
    want_counts = [int((want_local_idx == e).sum()) for e in range(EXPERTS_PER_RANK)]
    assert recv_per_expert == want_counts, "num_recv_tokens_per_expert_list"

    # The experts: each received row scaled by the weights of this rank's experts it chose.
    y = (recv_x.float() * recv_weights.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    combined_x, _, _ = buffer.combine(y, handle)
    torch.testing.assert_close(combined_x.float().cpu(), expected_out, rtol=2e-2, atol=2e-2)

    # Low-latency mode: at most 16 tokens per rank per call, BF16 (use_fp8=True sends FP8).
    max_tokens = 16
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, HIDDEN, R, E)
    ll_buffer = deep_ep.Buffer(
        group,
        0,
        num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=EXPERTS_PER_RANK,
        explicitly_destroy=True,
    )
    recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(
        x, topk_idx, max_tokens, E, use_fp8=False
    )
    assert recv_x.shape == (EXPERTS_PER_RANK, R * max_tokens, HIDDEN)
    for e in range(EXPERTS_PER_RANK):
        expert = me * EXPERTS_PER_RANK + e
        chose = [(inputs[src][1] == expert).any(dim=1) for src in range(R)]
        want = torch.cat([inputs[src][0][chose[src]] for src in range(R)])
        count = int(recv_count[e])
        assert count == len(want), f"recv_count of local expert {e}"
        assert rows(recv_x[e, :count].cpu()) == rows(want), f"rows of local expert {e}"

    # The slabs as the experts' outputs (identity experts): combine weights and sums them.
    combined_x, _, _ = ll_buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    torch.testing.assert_close(combined_x.float().cpu(), expected_out, rtol=2e-2, atol=2e-2)

    buffer.destroy()
    ll_buffer.destroy()
    print(f"rank {me}/{R}: normal and low-latency mode match the hand computation", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
