"""Dispatch layout: where each token goes, computed from the router's top-k expert ids.

Experts are spread evenly and contiguously over ranks: expert ``e`` lives on rank
``e // (num_experts // num_ranks)`` as local expert ``e % (num_experts // num_ranks)``.
An expert id of ``-1`` means "no expert" (a dropped choice) and sends nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchLayout(NamedTuple):
    """Layout of one rank's tokens.

    Attributes:
        num_tokens_per_rank: ``[R]`` int32, tokens that have at least one expert on each rank.
        num_tokens_per_expert: ``[E]`` int32, top-k entries that name each expert.
        is_token_in_rank: ``[N, R]`` bool, whether a token must be sent to a rank.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def expert_owner(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Rank that owns each expert id (``-1`` stays ``-1``), same shape as ``topk_idx``."""
    experts_per_rank = num_experts // num_ranks
    return torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> DispatchLayout:
    """Layout of ``topk_idx`` ``[N, K]`` (int64, ids in ``[-1, num_experts)``)."""
    num_tokens = topk_idx.shape[0]
    owner = expert_owner(topk_idx.long(), num_experts, num_ranks)
    is_token_in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    for rank in range(num_ranks):
        is_token_in_rank[:, rank] = (owner == rank).any(dim=1)
    valid = topk_idx[topk_idx >= 0].long()
    num_tokens_per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
    return DispatchLayout(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)
