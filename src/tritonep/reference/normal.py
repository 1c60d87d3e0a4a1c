"""Normal (high-throughput) mode semantics: exact-size dispatch and per-rank-reduced combine.

Dispatch, seen from destination rank ``d``:

* every source rank ``s`` sends each of its tokens that has at least one expert on ``d``,
  **once**, however many of its top-k experts live on ``d``;
* received rows are ordered by source rank, then by source token index;
* the received top-k ids are local expert ids on ``d`` (``global_id - d * E_local``) and ``-1``
  for experts elsewhere (or dropped choices); the received weights are the sender's weights
  where the id is local and ``0`` elsewhere, so each weight arrives on exactly one rank;
* the count of each local expert is the number of received top-k entries naming it, rounded up
  to a multiple of ``expert_alignment``;
* FP8 input ``(x_e4m3, scales)`` travels unchanged: payload bytes and scales are copied.

Combine is the transpose: every rank hands back one row per received row, and source token
``t`` gets the sum, accumulated in float32, of the rows returned by each rank it was sent to
(summed over ranks in rank order), plus the optional bias, cast to the rows' dtype. Weights
returned with the rows are summed the same way (in float32). A token sent nowhere gets zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import expert_owner

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class NormalDispatchResult:
    """What one destination rank receives.

    Attributes:
        recv_x: ``[M, H]`` in the dtype of ``x``, or ``(e4m3 [M, H], scales [M, S])``.
        recv_topk_idx: ``[M, K]`` int64 local expert ids, ``-1`` where the expert is elsewhere.
        recv_topk_weights: ``[M, K]`` float32 (``0`` where the id is ``-1``), or None.
        num_recv_tokens_per_expert: per local expert, entries received, aligned up.
        recv_src_rank: ``[M]`` int64 source rank of each row.
        recv_src_idx: ``[M]`` int64 token index of each row on its source rank.
    """

    recv_x: XLike
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int]
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor

    @property
    def num_recv_tokens(self) -> int:
        return self.recv_src_idx.numel()


def _rows(x: XLike, index: torch.Tensor) -> XLike:
    if isinstance(x, tuple):
        return x[0][index], x[1][index]
    return x[index]


def _cat(parts: list[XLike]) -> XLike:
    pairs = [p for p in parts if isinstance(p, tuple)]
    if pairs:
        assert len(pairs) == len(parts), "parts: every part is a pair or none is"
        return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def normal_dispatch(
    xs: Sequence[XLike],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor] | None,
    num_experts: int,
    expert_alignment: int = 1,
) -> list[NormalDispatchResult]:
    """Dispatch the inputs of all ranks; returns what each rank receives (list indexed by rank).

    Args:
        xs: per rank, ``[N_r, H]`` BF16 (any dtype) or ``(e4m3 [N_r, H], scales [N_r, S])``.
        topk_idx: per rank, ``[N_r, K]`` int64 global expert ids in ``[-1, num_experts)``.
        topk_weights: per rank, ``[N_r, K]`` float32, or None.
        num_experts: experts in total, a multiple of the number of ranks.
        expert_alignment: round each local expert's count up to a multiple of this.
    """
    num_ranks = len(xs)
    experts_per_rank = num_experts // num_ranks
    owners = [expert_owner(idx.long(), num_experts, num_ranks) for idx in topk_idx]
    results = []
    for dst in range(num_ranks):
        xs_in, ids_in, weights_in, src_rank, src_idx = [], [], [], [], []
        for src in range(num_ranks):
            on_dst = owners[src] == dst
            tokens = on_dst.any(dim=1).nonzero().squeeze(1)
            xs_in.append(_rows(xs[src], tokens))
            local = topk_idx[src].long()[tokens] - dst * experts_per_rank
            ids_in.append(torch.where(on_dst[tokens], local, -1))
            if topk_weights is not None:
                w = topk_weights[src][tokens].float()
                weights_in.append(torch.where(on_dst[tokens], w, torch.zeros_like(w)))
            src_rank.append(torch.full_like(tokens, src))
            src_idx.append(tokens)
        recv_topk_idx = torch.cat(ids_in)
        counts = [
            align_up(int((recv_topk_idx == e).sum()), expert_alignment)
            for e in range(experts_per_rank)
        ]
        results.append(
            NormalDispatchResult(
                recv_x=_cat(xs_in),
                recv_topk_idx=recv_topk_idx,
                recv_topk_weights=torch.cat(weights_in) if topk_weights is not None else None,
                num_recv_tokens_per_expert=counts,
                recv_src_rank=torch.cat(src_rank),
                recv_src_idx=torch.cat(src_idx),
            )
        )
    return results


def normal_combine(
    recv_xs: Sequence[torch.Tensor],
    dispatched: Sequence[NormalDispatchResult],
    num_tokens: Sequence[int],
    recv_topk_weights: Sequence[torch.Tensor] | None = None,
    bias: Sequence[torch.Tensor | tuple[torch.Tensor, ...]] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Combine rows handed back by every rank; returns ``(combined_x, combined_weights)`` per rank.

    Args:
        recv_xs: per rank, ``[M_d, H]`` rows, one per row that rank received in dispatch.
        dispatched: the dispatch results (for the source of every row).
        num_tokens: per rank, its number of tokens ``N_r``.
        recv_topk_weights: per rank, ``[M_d, K]`` weights handed back with the rows, or None.
        bias: per rank, ``[N_r, H]`` tensor or tuple of tensors added to the sum, or None.
    Returns:
        per rank, ``[N_r, H]`` in the rows' dtype and ``[N_r, K]`` float32 weights (or None).
    """
    num_ranks = len(recv_xs)
    hidden = recv_xs[0].shape[1]
    out = []
    for src in range(num_ranks):
        device = recv_xs[0].device
        acc = torch.zeros(num_tokens[src], hidden, dtype=torch.float32, device=device)
        acc_w = None
        if recv_topk_weights is not None:
            topk = recv_topk_weights[0].shape[1]
            acc_w = torch.zeros(num_tokens[src], topk, dtype=torch.float32, device=device)
        for dst in range(num_ranks):
            mine = dispatched[dst].recv_src_rank == src
            rows = dispatched[dst].recv_src_idx[mine]
            acc.index_add_(0, rows, recv_xs[dst][mine].float())
            if acc_w is not None and recv_topk_weights is not None:
                acc_w.index_add_(0, rows, recv_topk_weights[dst][mine].float())
        rank_bias = bias[src] if bias is not None else None
        if rank_bias is not None:
            terms = rank_bias if isinstance(rank_bias, tuple) else (rank_bias,)
            for term in terms:
                acc += term.float()
        out.append((acc.to(recv_xs[0].dtype), acc_w))
    return out
