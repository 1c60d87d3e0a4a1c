"""Dispatch layout in one launch: tokens per rank, tokens per expert, and is_token_in_rank.

Each program takes a strided share of the token blocks, writes ``is_token_in_rank`` for them
and keeps its per-rank and per-expert counts in registers (a histogram), then stores them as
one row of a small workspace. The last program to arrive (an arrival counter it resets) sums
the rows into the outputs. No memset and no atomics on the outputs, so it needs no zeroed
buffers and the sums are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import launch


@triton.jit(do_not_specialize=["K"])
def dispatch_layout_kernel(
    topk_idx_ptr,  # [N, K] int64
    num_tokens,
    per_rank_ptr,  # [R] int32
    per_expert_ptr,  # [E] int32
    in_rank_ptr,  # [N, R] bool, written as int8
    partial_ptr,  # [P, BINS + R_P2] int32 workspace
    arrivals_ptr,  # [1] int32, zero between launches
    K,  # top-k columns (not specialized: one variant per K_P2)
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_P2: tl.constexpr,
    R_P2: tl.constexpr,
    BINS: tl.constexpr,  # power of two >= NUM_EXPERTS: one bin per expert
    P_P2: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    ks = tl.arange(0, K_P2)
    ranks = tl.arange(0, R_P2)
    bins = tl.arange(0, BINS)
    expert_counts = tl.zeros((BINS,), tl.int32)
    rank_counts = tl.zeros((R_P2,), tl.int32)
    for start in range(pid * BLOCK_N, num_tokens, num_programs * BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        tmask = tokens < num_tokens
        ids = tl.load(
            topk_idx_ptr + tokens[:, None].to(tl.int64) * K + ks[None, :],
            mask=tmask[:, None] & (ks[None, :] < K),
            other=-1,
        )
        valid = (ids >= 0) & (ids < NUM_EXPERTS)
        owner = tl.where(valid, ids // E_LOCAL, -1)
        hits = (owner[:, :, None] == ranks[None, None, :]).to(tl.int32)
        in_rank = tl.max(hits, axis=1)  # [BLOCK_N, R_P2]
        dst = in_rank_ptr + tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :]
        tl.store(dst, in_rank.to(tl.int8), mask=tmask[:, None] & (ranks[None, :] < NUM_RANKS))
        rank_counts += tl.sum(in_rank, axis=0)
        binned = tl.reshape(tl.where(valid, ids, 0).to(tl.int32), (BLOCK_N * K_P2,))
        expert_counts += tl.histogram(binned, BINS, mask=tl.reshape(valid, (BLOCK_N * K_P2,)))
    row = partial_ptr + pid * (BINS + R_P2)
    tl.store(row + bins, expert_counts)
    tl.store(row + BINS + ranks, rank_counts)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_programs - 1:
        programs = tl.arange(0, P_P2)
        pmask = programs[:, None] < num_programs
        rows = partial_ptr + programs[:, None] * (BINS + R_P2)
        experts = tl.sum(tl.load(rows + bins[None, :], mask=pmask, other=0, volatile=True), axis=0)
        tl.store(per_expert_ptr + bins, experts, mask=bins < NUM_EXPERTS)
        per_rank = tl.sum(
            tl.load(rows + BINS + ranks[None, :], mask=pmask, other=0, volatile=True), axis=0
        )
        tl.store(per_rank_ptr + ranks, per_rank, mask=ranks < NUM_RANKS)
        tl.store(arrivals_ptr, 0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    arrivals: torch.Tensor | None = None,
    num_programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)`` of ``topk_idx [N, K]`` int64 (ids outside ``[0, E)`` count
    as none). Arguments are assumed checked (see :mod:`tritonep.validation`).

    Args:
        arrivals: a zeroed ``[1]`` int32 tensor on the same device, reused across calls on one
            stream (the kernel leaves it zero); None allocates one.
        num_programs: programs to launch (default: enough for the tokens, at most one per SM).
        out: optional preallocated outputs, in the order returned.
    """
    num_tokens, topk = topk_idx.shape
    device = topk_idx.device
    block_n = 64
    if num_programs is None:
        limit = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
        num_programs = max(1, min(limit, triton.cdiv(num_tokens, block_n)))
    bins = _next_pow2(num_experts)
    r_p2 = _next_pow2(max(num_ranks, 2))
    if out is None:
        out = (
            torch.empty(num_ranks, dtype=torch.int32, device=device),
            torch.empty(num_experts, dtype=torch.int32, device=device),
            torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device),
        )
    per_rank, per_expert, in_rank = out
    partial = torch.empty(num_programs, bins + r_p2, dtype=torch.int32, device=device)
    if arrivals is None:
        arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    launch(
        dispatch_layout_kernel,
        (num_programs,),
        (
            topk_idx,
            num_tokens,
            per_rank,
            per_expert,
            in_rank.view(torch.int8),
            partial,
            arrivals,
            topk,
        ),
        dict(
            NUM_EXPERTS=num_experts,
            NUM_RANKS=num_ranks,
            BLOCK_N=block_n,
            K_P2=_next_pow2(max(topk, 2)),
            R_P2=r_p2,
            BINS=bins,
            P_P2=_next_pow2(max(num_programs, 2)),
        ),
    )
    return per_rank, per_expert, in_rank
