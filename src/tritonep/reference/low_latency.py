"""Low-latency (decode) mode semantics: fixed per-expert receive slabs and a weighted combine.

Dispatch, seen from the rank that owns local expert ``e``:

* every source rank sends each of its tokens to each **distinct** expert among the token's
  top-k ids (a token that names one expert twice is sent there once; ``-1`` sends nothing);
* optionally quantized on the way (FP8 e4m3 per 128 channels, the last group partial where
  ``H`` is not a multiple of 128, see :mod:`.fp8`);
* expert ``e`` gets a slab ``[R * max_tokens_per_rank, H]``: the rows from one source rank form
  one contiguous block in the sender's token order; ``recv_src_info`` holds each row's token
  index on its source rank, ``recv_count[e]`` the number of valid rows, and
  ``recv_layout_range[e, s]`` packs ``(begin, count)`` of source ``s``'s block as
  ``begin << 32 | count`` in int64;
* the blocks of one expert may come in any order on a GPU (whichever source arrives first claims
  the next rows), so the reference orders them by source rank and comparisons go through the
  layout ranges (:mod:`.compare`); rows past ``recv_count[e]`` are undefined.

Combine: expert outputs go back to their source tokens, and token ``t`` gets
``sum_k w[t, k] * row(expert_k, t)`` accumulated in float32 over ``k`` in order, skipping
``-1`` ids, cast to the dtype of the expert outputs (a token with no valid id gets zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .fp8 import num_groups, quantize_fp8, unpack_ue8m0
from .logfmt import logfmt_round_trip


@dataclass
class LowLatencyDispatchResult:
    """What one rank receives for its local experts.

    Attributes:
        recv_x: ``[E_local, R * max_tokens, H]`` e4m3 (FP8 mode) or the input dtype.
        recv_x_scales: ``[E_local, R * max_tokens, ceil(H / 128)]`` float32, or None without
            FP8.
        recv_src_info: ``[E_local, R * max_tokens]`` int32 source token index of each row.
        recv_count: ``[E_local]`` int32 valid rows per local expert.
        recv_layout_range: ``[E_local, R]`` int64, ``begin << 32 | count`` per source rank.
    """

    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_src_info: torch.Tensor
    recv_count: torch.Tensor
    recv_layout_range: torch.Tensor

    @classmethod
    def from_outputs(cls, recv_x, recv_count: torch.Tensor, handle) -> LowLatencyDispatchResult:
        """Collect what an implementation returned (on any device) for comparison, on the CPU.

        ``recv_x`` is the slab or a ``(slab, scales)`` tuple (scales float32, or int32 packed
        UE8M0 bytes, which are unpacked; any strides); ``handle`` has ``recv_src_info`` and
        ``recv_layout_range``.
        """
        payload, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        if scales is not None and scales.dtype == torch.int32:
            scales = unpack_ue8m0(scales.cpu(), num_groups(payload.shape[-1]))
        return cls(
            payload.cpu(),
            None if scales is None else scales.cpu(),
            handle.recv_src_info.cpu(),
            recv_count.cpu(),
            handle.recv_layout_range.cpu(),
        )


def pack_range(begin: torch.Tensor | int, count: torch.Tensor | int):
    """``(begin, count)`` -> ``begin << 32 | count`` (int64)."""
    if isinstance(begin, int) and isinstance(count, int):
        return (begin << 32) | count
    return (torch.as_tensor(begin).long() << 32) | torch.as_tensor(count).long()


def unpack_range(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_range`: ``(begin, count)`` as int64 tensors."""
    return packed >> 32, packed & 0xFFFFFFFF


def tokens_for_expert(topk_idx: torch.Tensor, expert: int) -> torch.Tensor:
    """Ascending indices of the tokens whose top-k names ``expert`` (each token once)."""
    return (topk_idx == expert).any(dim=1).nonzero().squeeze(1)


def low_latency_dispatch(
    xs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    num_max_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool = True,
    use_ue8m0: bool = False,
) -> list[LowLatencyDispatchResult]:
    """Dispatch the ``[N_r, H]`` inputs of all ranks; returns what each rank receives.

    Args:
        xs: per rank, ``[N_r, H]`` BF16 tokens, ``N_r <= num_max_tokens_per_rank``.
        topk_idx: per rank, ``[N_r, K]`` int64 global expert ids in ``[-1, num_experts)``.
        num_max_tokens_per_rank: slab rows per source rank.
        num_experts: experts in total, a multiple of the number of ranks.
        use_fp8: quantize to e4m3 with per-128 scales; else send ``xs`` unchanged.
        use_ue8m0: round scales up to powers of two.
    """
    num_ranks = len(xs)
    experts_per_rank = num_experts // num_ranks
    max_rows = num_ranks * num_max_tokens_per_rank
    payloads = [quantize_fp8(x, use_ue8m0=use_ue8m0) if use_fp8 else (x, None) for x in xs]
    hidden = xs[0].shape[1]
    device = xs[0].device
    results = []
    for dst in range(num_ranks):
        dtype = payloads[0][0].dtype
        recv_x = torch.zeros(experts_per_rank, max_rows, hidden, dtype=dtype, device=device)
        recv_scales = None
        if use_fp8:
            recv_scales = torch.zeros(
                experts_per_rank, max_rows, num_groups(hidden), dtype=torch.float32, device=device
            )
        src_info = torch.full((experts_per_rank, max_rows), -1, dtype=torch.int32, device=device)
        count = torch.zeros(experts_per_rank, dtype=torch.int32, device=device)
        layout_range = torch.zeros(experts_per_rank, num_ranks, dtype=torch.int64, device=device)
        for local in range(experts_per_rank):
            begin = 0
            for src in range(num_ranks):
                tokens = tokens_for_expert(topk_idx[src], dst * experts_per_rank + local)
                end = begin + tokens.numel()
                q, scale = payloads[src]
                recv_x[local, begin:end] = q[tokens]
                if recv_scales is not None:
                    recv_scales[local, begin:end] = scale[tokens]
                src_info[local, begin:end] = tokens.to(torch.int32)
                layout_range[local, src] = pack_range(begin, tokens.numel())
                begin = end
            count[local] = begin
        results.append(LowLatencyDispatchResult(recv_x, recv_scales, src_info, count, layout_range))
    return results


def source_rows(dispatched: LowLatencyDispatchResult, local: int, src: int, num_tokens: int):
    """Map token index on ``src`` -> row of local expert ``local`` (``-1`` where not sent)."""
    begin, count = (int(v) for v in unpack_range(dispatched.recv_layout_range[local, src]))
    device = dispatched.recv_src_info.device
    row_of = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    rows = torch.arange(begin, begin + count, device=device)
    row_of[dispatched.recv_src_info[local, begin : begin + count].long()] = rows
    return row_of


def without_ranks(
    xs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    num_experts: int,
    masked: set[int] | frozenset[int],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What shrink mode makes of the inputs when the ranks in ``masked`` are masked.

    Seen from a rank that masks them: they send nothing (their inputs become empty), and every
    choice of one of their experts is dropped (id ``-1``). Feed the result to
    :func:`low_latency_dispatch` and :func:`low_latency_combine` for that rank's outputs.
    """
    experts_per_rank = num_experts // len(xs)
    out_x, out_idx = [], []
    for rank, (x, idx) in enumerate(zip(xs, topk_idx, strict=True)):
        if rank in masked:
            x, idx = x[:0], idx[:0]
        else:
            owners = torch.div(idx, experts_per_rank, rounding_mode="floor")
            dead = torch.isin(owners, torch.tensor(sorted(masked), dtype=idx.dtype))
            idx = torch.where((idx >= 0) & dead, -1, idx)
        out_x.append(x)
        out_idx.append(idx)
    return out_x, out_idx


def low_latency_combine(
    expert_outputs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    dispatched: Sequence[LowLatencyDispatchResult],
    logfmt: bool = False,
) -> list[torch.Tensor]:
    """Weighted combine; returns ``[N_r, H]`` per rank in the dtype of the expert outputs.

    Args:
        expert_outputs: per rank, ``[E_local, R * max_tokens, H]`` rows laid out as received.
        topk_idx: per rank, ``[N_r, K]`` the ids used in dispatch.
        topk_weights: per rank, ``[N_r, K]`` float32 routing weights.
        dispatched: per rank, its dispatch result (only layout ranges and source info are read).
        logfmt: rows travel as LogFMT-10 (:func:`~tritonep.reference.logfmt.logfmt_round_trip`).
    """
    num_ranks = len(expert_outputs)
    experts_per_rank = expert_outputs[0].shape[0]
    hidden = expert_outputs[0].shape[2]
    out = []
    for src in range(num_ranks):
        idx = topk_idx[src].long()
        num_tokens, topk = idx.shape
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=idx.device)
        row_cache: dict[int, torch.Tensor] = {}
        for k in range(topk):
            for expert in idx[:, k].unique().tolist():
                if expert < 0:
                    continue
                dst, local = divmod(expert, experts_per_rank)
                if expert not in row_cache:
                    row_cache[expert] = source_rows(dispatched[dst], local, src, num_tokens)
                tokens = (idx[:, k] == expert).nonzero().squeeze(1)
                rows = row_cache[expert][tokens]
                if (rows < 0).any():
                    raise ValueError(f"rank {dst} expert {local} lacks rows from rank {src}")
                values = expert_outputs[dst][local, rows]
                values = logfmt_round_trip(values) if logfmt else values.float()
                acc[tokens] += topk_weights[src][tokens, k].float().unsqueeze(1) * values
        out.append(acc.to(expert_outputs[0].dtype))
    return out
