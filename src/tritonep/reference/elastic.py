"""Elastic mode semantics (DeepEP V2's ``ElasticBuffer``): dispatch layouts and ordered combine.

Dispatch, seen from destination rank ``d`` (``E_local`` experts per rank, ``K`` choices):

* every source rank ``s`` sends each of its tokens with at least one expert on ``d`` once;
  received tokens are ordered by source rank, then source token (the *plain* layout), and
  carry the source's ids made local (``id - d * E_local`` where the expert is on ``d``,
  ``-1`` elsewhere), its weights unchanged and its scale packs unchanged;
* the *expanded* layout has one row per (received token, local expert it chose): expert
  ``e``'s rows are contiguous, in received-token order, starting at the sum of the earlier
  experts' counts each rounded up to ``expert_alignment``; a token's row for its choice
  ``k`` is ``expanded_row[token, k]`` (``-1`` where choice ``k`` is not local);
* per local expert: the number of choices naming it (unaligned), its aligned count, and the
  prefix sums of the handle (:class:`ElasticDispatchResult`).

Combine on owner rank ``s``, token ``t``: the rank-level rows (each rank's row for the token:
on that rank, the float32 sum of its expanded rows in top-k order, rounded to BF16) are added
to float32 ``bias_0 + bias_1`` in the order of the top-k column of each rank's last choice,
then rounded to BF16 once (DeepEP V2's ``refs.combine`` with reductions per rank). Without
reductions per rank, each choice's own row is added in top-k order instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .normal import align_up

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class ElasticDispatchResult:
    """What one destination rank receives (all on the CPU).

    Attributes:
        recv_x: ``[M, H]`` plain rows (the dtype of ``x``).
        recv_sf: ``[M, G]`` scale packs, or None.
        recv_topk_idx: ``[M, K]`` int64 local expert ids, ``-1`` elsewhere.
        recv_topk_weights: ``[M, K]`` float32 as sent, or None.
        src_global: ``[M]`` int64 ``source_rank * num_max_tokens + source token``.
        first_col: ``[M]`` int64 ``source_rank * K`` + the first column naming this rank.
        expanded_row: ``[M, K]`` int64 row of each local choice in the expanded layout.
        num_unaligned: per local expert, the choices naming it.
        num_aligned: the same, rounded up to the alignment.
        psum_rank: ``[R]`` inclusive prefix sum of the tokens from each source.
        psum_expert_plain: inclusive prefix sum of ``num_aligned``.
        psum_expert_expand: each expert's first expanded row plus its unaligned count.
    """

    recv_x: torch.Tensor
    recv_sf: torch.Tensor | None
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    src_global: torch.Tensor
    first_col: torch.Tensor
    expanded_row: torch.Tensor
    num_unaligned: list[int]
    num_aligned: list[int]
    psum_rank: list[int]
    psum_expert_plain: list[int]
    psum_expert_expand: list[int]

    @property
    def num_recv_tokens(self) -> int:
        return self.src_global.numel()

    @property
    def num_expanded_tokens(self) -> int:
        return sum(self.num_aligned)

    def expand(self, rows: torch.Tensor, fill=None) -> torch.Tensor:
        """``rows`` ([M, ...], one per received token) in the expanded layout; padding rows
        hold ``fill`` (None: zeros)."""
        out = torch.zeros(self.num_expanded_tokens, *rows.shape[1:], dtype=rows.dtype)
        if fill is not None:
            out.fill_(fill)
        for i in range(self.num_recv_tokens):
            for row in self.expanded_row[i].tolist():
                if row >= 0:
                    out[row] = rows[i]
        return out

    def expand_weights(self) -> torch.Tensor:
        """``[rows]`` float32: each expanded row's weight (zeros in padding rows)."""
        weights = self.recv_topk_weights
        if weights is None:
            raise ValueError("expand_weights: the tokens were dispatched without topk_weights")
        out = torch.zeros(self.num_expanded_tokens, dtype=torch.float32)
        for i in range(self.num_recv_tokens):
            for k, row in enumerate(self.expanded_row[i].tolist()):
                if row >= 0:
                    out[row] = weights[i, k]
        return out


def elastic_dispatch(
    xs: Sequence[XLike],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor] | None,
    num_experts: int,
    num_max_tokens: int,
    expert_alignment: int = 1,
) -> list[ElasticDispatchResult]:
    """What every rank receives. ``xs[s]`` is BF16 ``[N_s, H]`` or (e4m3, packs)."""
    R = len(xs)
    E_local = num_experts // R
    results = []
    for d in range(R):
        first, end = d * E_local, (d + 1) * E_local
        rows, sfs, ids, weights, src, cols = [], [], [], [], [], []
        per_source = []
        for s in range(R):
            x_s = xs[s]
            x, sf = x_s if isinstance(x_s, tuple) else (x_s, None)
            idx = topk_idx[s].cpu()
            K = idx.shape[1]
            local = (idx >= first) & (idx < end)
            chosen = local.any(1).nonzero().flatten()
            per_source.append(chosen.numel())
            rows.append(x.cpu()[chosen])
            if sf is not None:
                sfs.append(sf.cpu()[chosen])
            ids.append(torch.where(local, idx - first, -1)[chosen])
            if topk_weights is not None:
                weights.append(topk_weights[s].cpu()[chosen])
            src.append(s * num_max_tokens + chosen)
            cols.append(s * K + local.int().argmax(1)[chosen])
        recv_idx = torch.cat(ids)
        unaligned = [int((recv_idx == e).sum()) for e in range(E_local)]
        aligned = [align_up(n, expert_alignment) for n in unaligned]
        starts = [sum(aligned[:e]) for e in range(E_local)]
        expanded = torch.full(recv_idx.shape, -1, dtype=torch.int64)
        filled = [0] * E_local
        for i in range(recv_idx.shape[0]):
            for k in range(recv_idx.shape[1]):
                e = int(recv_idx[i, k])
                if e >= 0:
                    expanded[i, k] = starts[e] + filled[e]
                    filled[e] += 1
        results.append(
            ElasticDispatchResult(
                torch.cat(rows),
                torch.cat(sfs) if sfs else None,
                recv_idx,
                torch.cat(weights) if topk_weights is not None else None,
                torch.cat(src),
                torch.cat(cols),
                expanded,
                unaligned,
                aligned,
                torch.tensor(per_source).cumsum(0).tolist(),
                torch.tensor(aligned).cumsum(0).tolist(),
                [starts[e] + unaligned[e] for e in range(E_local)],
            )
        )
    return results


def reduction_order(ids: Sequence[int], num_local_experts: int) -> list[int]:
    """The ranks a token went to, in the order a combine adds their rows: by the top-k column
    of each rank's last choice."""
    last: dict[int, int] = {}
    for k, e in enumerate(ids):
        if e >= 0:
            last[e // num_local_experts] = k
    return sorted(last, key=lambda rank: last[rank])


def rank_partials(expanded_x: torch.Tensor, expanded_row: torch.Tensor) -> torch.Tensor:
    """``[M, H]`` BF16: each received token's expanded rows summed in float32 in top-k order,
    rounded (what a rank sends back in an expanded combine with reductions per rank)."""
    out = torch.zeros(expanded_row.shape[0], expanded_x.shape[1], dtype=torch.float32)
    for i in range(expanded_row.shape[0]):
        for row in expanded_row[i].tolist():
            if row >= 0:
                out[i] += expanded_x[row].float()
    return out.to(torch.bfloat16)


def elastic_combine(
    rank_rows: Sequence[torch.Tensor],
    src_global: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    num_max_tokens: int,
    num_local_experts: int,
    bias: Sequence[tuple[torch.Tensor, ...]] | None = None,
) -> list[torch.Tensor]:
    """Each owner's combined ``[N, H]`` BF16 from the rank-level rows: ``rank_rows[d]`` holds
    rank ``d``'s row for each token it received (whose global index is ``src_global[d]``)."""
    R = len(rank_rows)
    hidden = rank_rows[0].shape[1]
    rows_of: dict[tuple[int, int], torch.Tensor] = {}
    for d in range(R):
        for i, g in enumerate(src_global[d].tolist()):
            rows_of[(g, d)] = rank_rows[d][i].cpu()
    out = []
    for s in range(R):
        idx = topk_idx[s].cpu()
        acc = _bias_sum(bias[s] if bias is not None else (), idx.shape[0], hidden)
        for t in range(idx.shape[0]):
            for d in reduction_order(idx[t].tolist(), num_local_experts):
                acc[t] += rows_of[(s * num_max_tokens + t, d)].float()
        out.append(acc.to(torch.bfloat16))
    return out


def elastic_combine_unreduced(
    expanded_x: Sequence[torch.Tensor],
    results: Sequence[ElasticDispatchResult],
    topk_idx: Sequence[torch.Tensor],
    num_max_tokens: int,
    bias: Sequence[tuple[torch.Tensor, ...]] | None = None,
) -> list[torch.Tensor]:
    """Each owner's combined rows when every expanded row goes back alone: float32
    ``bias_0 + bias_1``, then each choice's own row in top-k order, rounded once."""
    row_of: dict[tuple[int, int], torch.Tensor] = {}
    for d, result in enumerate(results):
        for i, g in enumerate(result.src_global.tolist()):
            for k, row in enumerate(result.expanded_row[i].tolist()):
                if row >= 0:
                    row_of[(g, k)] = expanded_x[d][row].cpu()
    hidden = expanded_x[0].shape[1]
    out = []
    for s in range(len(results)):
        idx = topk_idx[s].cpu()
        acc = _bias_sum(bias[s] if bias is not None else (), idx.shape[0], hidden)
        for t in range(idx.shape[0]):
            for k, e in enumerate(idx[t].tolist()):
                if e >= 0:
                    acc[t] += row_of[(s * num_max_tokens + t, k)].float()
        out.append(acc.to(torch.bfloat16))
    return out


def _bias_sum(terms: tuple[torch.Tensor, ...], num_tokens: int, hidden: int) -> torch.Tensor:
    """float32 ``bias_0 + bias_1`` (zeros without bias), the start of every combined row."""
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    if terms:
        acc = terms[0].cpu().float()
        for term in terms[1:]:
            acc = acc + term.cpu().float()
    return acc.clone()
