"""The ``torch`` backend: dispatch and combine with ``all_to_all_single`` plus permutes.

This is what users would write without tritonep (Megatron-Core's default dispatcher does the
same), and every benchmark measures it beside tritonep. It produces exactly the results of
:mod:`tritonep.reference` for the calling rank, over gloo on CPU or NCCL on GPUs.

Its costs are the ones tritonep removes: the split sizes must reach the host before the
payload moves (one device-to-host sync per dispatch), and the rows are permuted before the
send and after the receive by separate kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .reference.fp8 import quantize_fp8
from .reference.layout import DispatchLayout, dispatch_layout, expert_owner
from .reference.low_latency import pack_range
from .reference.normal import align_up
from .validation import (
    check_dispatch_x,
    check_hidden,
    check_num_experts,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
)

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _as_sendable(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret dtypes that collectives may not support (FP8, BF16 on gloo) as raw bytes."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16):
        return t.view(torch.uint8)
    return t


def _all_to_all_rows(
    rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group
) -> torch.Tensor:
    """Exchange rows: ``send_counts[r]`` rows go to rank ``r``, ``recv_counts[r]`` come from it."""
    wire = _as_sendable(rows.contiguous())
    shape = (sum(recv_counts), *wire.shape[1:])
    out = torch.empty(shape, dtype=wire.dtype, device=wire.device)
    dist.all_to_all_single(out, wire, recv_counts, send_counts, group=group)
    return out.view(rows.dtype) if wire.dtype != rows.dtype else out


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of one int64 count row per peer: ``counts[R, ...] -> received[R, ...]``."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


@dataclass
class TorchDispatchHandle:
    """What combine needs from a normal dispatch.

    Attributes:
        send_index: ``[S]`` int64 source token of every sent row, grouped by destination rank.
        send_counts: rows sent to each rank.
        recv_counts: rows received from each rank.
        num_tokens: tokens on this rank before dispatch.
    """

    send_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


@dataclass
class TorchLowLatencyHandle:
    """What low-latency combine needs from dispatch.

    Attributes:
        recv_src_info: ``[E_local, R * max_tokens]`` int32 source token index per row.
        recv_layout_range: ``[E_local, R]`` int64 packed ``begin << 32 | count``.
        send_key: ``[S]`` int64 ``expert * N + token`` of every sent row, ascending.
        send_counts / recv_counts: rows per peer.
        recv_slot: ``[S']`` flat slab row (``expert * R * max + row``) of every received row.
        num_max_tokens_per_rank, hidden, num_experts: the call's sizes.
    """

    recv_src_info: torch.Tensor
    recv_layout_range: torch.Tensor
    send_key: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    recv_slot: torch.Tensor
    num_max_tokens_per_rank: int
    hidden: int
    num_experts: int


class TorchBackend:
    """Dispatch and combine through ``torch.distributed.all_to_all_single``.

    Args:
        group: the expert-parallel process group (default: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)

    # ----------------------------------------------------------------------------- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)`` for ``topk_idx [N, K]`` int64."""
        check_num_experts(num_experts, self.num_ranks)
        check_topk_idx("topk_idx", topk_idx, None, num_experts)
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(
        self,
        x: XLike,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        expert_alignment: int = 1,
    ) -> tuple[XLike, torch.Tensor, torch.Tensor | None, list[int], TorchDispatchHandle]:
        """Send each token once to every rank that holds one of its experts.

        Args:
            x: ``[N, H]`` BF16, or ``(e4m3 [N, H], scales [N, S])`` (4-byte words, moved
                unchanged).
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
            topk_weights: ``[N, K]`` float32, or None.
            num_experts: experts in total.
            expert_alignment: round per-expert counts up to a multiple of this.
        Returns:
            ``recv_x`` (``[M, H]`` or a tuple like ``x``), ``recv_topk_idx [M, K]`` int64 local
            ids (``-1`` elsewhere), ``recv_topk_weights [M, K]`` float32 (or None), the
            per-local-expert counts (list of int) and a handle for :meth:`combine`.
        """
        experts_per_rank = check_num_experts(num_experts, self.num_ranks)
        payload = check_dispatch_x("x", x)
        num_tokens = payload.shape[0]
        check_topk_idx("topk_idx", topk_idx, num_tokens, num_experts, device=payload.device)
        if topk_weights is not None:
            check_topk_weights("topk_weights", topk_weights, topk_idx)

        owner = expert_owner(topk_idx, num_experts, self.num_ranks)
        per_rank = [(owner == r).any(dim=1).nonzero().squeeze(1) for r in range(self.num_ranks)]
        send_index = torch.cat(per_rank)
        send_counts_t = torch.tensor([t.numel() for t in per_rank], dtype=torch.int64)
        recv_counts_t = _exchange_counts(send_counts_t.to(payload.device), self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()  # host sync

        def move(t: torch.Tensor) -> torch.Tensor:
            return _all_to_all_rows(t[send_index], send_counts, recv_counts, self.group)

        recv_x: XLike = (move(x[0]), move(x[1])) if isinstance(x, tuple) else move(x)
        recv_global = move(topk_idx)
        on_me = expert_owner(recv_global, num_experts, self.num_ranks) == self.rank
        recv_topk_idx = torch.where(on_me, recv_global - self.rank * experts_per_rank, -1)
        recv_topk_weights = None
        if topk_weights is not None:
            w = move(topk_weights)
            recv_topk_weights = torch.where(on_me, w, torch.zeros_like(w))
        counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=experts_per_rank)
        per_expert = [align_up(int(c), expert_alignment) for c in counts.tolist()]
        handle = TorchDispatchHandle(send_index, send_counts, recv_counts, num_tokens)
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle

    def combine(
        self,
        x: torch.Tensor,
        handle: TorchDispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Send every received row back and sum the rows of each token in float32.

        Args:
            x: ``[M, H]`` BF16, one row per row received in dispatch.
            handle: from :meth:`dispatch`.
            topk_weights: ``[M, K]`` float32 to sum along, or None.
            bias: ``[N, H]`` tensor or tuple of tensors added to the sum, or None.
        Returns:
            ``combined_x [N, H]`` in the dtype of ``x`` and ``combined_topk_weights [N, K]``
            float32 (or None).
        """
        check_tensor("x", x, shape=(sum(handle.recv_counts), None))
        back = _all_to_all_rows(x, handle.recv_counts, handle.send_counts, self.group)
        acc = torch.zeros(handle.num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        acc.index_add_(0, handle.send_index, back.float())
        for term in (bias if isinstance(bias, tuple) else (bias,)) if bias is not None else ():
            acc += term.float()
        combined_w = None
        if topk_weights is not None:
            check_tensor(
                "topk_weights", topk_weights, dtype=torch.float32, shape=(x.shape[0], None)
            )
            w = _all_to_all_rows(topk_weights, handle.recv_counts, handle.send_counts, self.group)
            combined_w = torch.zeros(
                handle.num_tokens, w.shape[1], dtype=torch.float32, device=x.device
            )
            combined_w.index_add_(0, handle.send_index, w)
        return acc.to(x.dtype), combined_w

    # ------------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        use_fp8: bool = True,
        use_ue8m0: bool = False,
    ):
        """Send each token to each distinct expert of its top-k, into per-expert slabs.

        Args:
            x: ``[N, H]`` BF16, ``N <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
            num_max_dispatch_tokens_per_rank: slab rows per source rank.
            num_experts: experts in total.
            use_fp8: quantize to e4m3 with per-128 float32 scales (a partial last group of
                its own).
            use_ue8m0: round the scales up to powers of two.
        Returns:
            ``recv_x`` (``[E_local, R * max, H]``; with FP8 a tuple with the scales
            ``[E_local, R * max, ceil(H / 128)]``), ``recv_count [E_local]`` int32 and a handle.
        """
        experts_per_rank = check_num_experts(num_experts, self.num_ranks)
        check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None))
        num_tokens, hidden = x.shape
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}"
            )
        check_hidden("x", hidden, 8)  # BF16 rows of a multiple of 16 bytes
        check_topk_idx("topk_idx", topk_idx, num_tokens, num_experts, device=x.device)
        device, R, max_tokens = x.device, self.num_ranks, num_max_dispatch_tokens_per_rank

        # One row per (token, distinct expert), sorted by expert (hence by destination rank).
        topk = topk_idx.shape[1]
        later_dup = torch.zeros_like(topk_idx, dtype=torch.bool)
        for k in range(1, topk):
            later_dup[:, k] = (topk_idx[:, :k] == topk_idx[:, k : k + 1]).any(dim=1)
        valid = (topk_idx >= 0) & ~later_dup
        token = torch.arange(num_tokens, device=device).unsqueeze(1).expand_as(topk_idx)[valid]
        expert = topk_idx[valid]
        order = torch.argsort(expert * max(num_tokens, 1) + token)
        token, expert = token[order], expert[order]

        # Per (destination rank, local expert) counts; the receiver needs them for its layout.
        per_expert = torch.bincount(expert, minlength=num_experts).view(R, experts_per_rank)
        recv_per_expert = _exchange_counts(per_expert.to(device), self.group)  # [src, local]
        send_counts = per_expert.sum(dim=1).tolist()  # host sync
        recv_counts = recv_per_expert.sum(dim=1).tolist()

        payload, scales = quantize_fp8(x, use_ue8m0=use_ue8m0) if use_fp8 else (x, None)

        def move(t: torch.Tensor) -> torch.Tensor:
            return _all_to_all_rows(t, send_counts, recv_counts, self.group)

        recv_payload, recv_token, recv_expert = move(payload[token]), move(token), move(expert)
        # Received rows come grouped by source rank, each group sorted by (expert, token); the
        # slab of local expert e stacks the blocks of sources 0, 1, ... in that order.
        local = recv_expert - self.rank * experts_per_rank
        src = torch.repeat_interleave(
            torch.arange(R, device=device), torch.tensor(recv_counts, device=device)
        )
        block_begin = torch.cumsum(recv_per_expert, dim=0) - recv_per_expert  # [src, local]
        first_row_of_src = torch.cumsum(torch.tensor(recv_counts, device=device), 0)
        first_row_of_src = first_row_of_src - torch.tensor(recv_counts, device=device)
        first_of_expert_in_src = torch.cumsum(recv_per_expert, dim=1) - recv_per_expert
        pos = torch.arange(local.numel(), device=device) - first_row_of_src[src]
        row = block_begin[src, local] + pos - first_of_expert_in_src[src, local]
        slot = local * (R * max_tokens) + row

        rows_total = experts_per_rank * R * max_tokens
        slab = torch.zeros(rows_total, hidden, dtype=payload.dtype, device=device)
        slab[slot] = recv_payload
        src_info = torch.full((rows_total,), -1, dtype=torch.int32, device=device)
        src_info[slot] = recv_token.to(torch.int32)
        recv_x: XLike = slab.view(experts_per_rank, R * max_tokens, hidden)
        if scales is not None:
            groups = scales.shape[1]  # ceil(hidden / 128)
            scale_slab = torch.zeros(rows_total, groups, dtype=torch.float32, device=device)
            scale_slab[slot] = move(scales[token])
            recv_x = (recv_x, scale_slab.view(experts_per_rank, R * max_tokens, groups))
        recv_count = recv_per_expert.sum(dim=0).to(torch.int32)
        handle = TorchLowLatencyHandle(
            recv_src_info=src_info.view(experts_per_rank, R * max_tokens),
            recv_layout_range=pack_range(block_begin.t(), recv_per_expert.t()).contiguous(),
            send_key=expert * max(num_tokens, 1) + token,
            send_counts=send_counts,
            recv_counts=recv_counts,
            recv_slot=slot,
            num_max_tokens_per_rank=max_tokens,
            hidden=hidden,
            num_experts=num_experts,
        )
        return recv_x, recv_count, handle

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: TorchLowLatencyHandle,
    ) -> torch.Tensor:
        """Bring expert outputs back and reduce them with the routing weights.

        Args:
            x: ``[E_local, R * max, H]`` BF16 expert outputs, laid out as dispatch received.
            topk_idx: ``[N, K]`` int64, the ids given to dispatch.
            topk_weights: ``[N, K]`` float32.
            handle: from :meth:`low_latency_dispatch`.
        Returns:
            ``[N, H]`` in the dtype of ``x``: ``sum_k w[t, k] * out(expert_k, t)`` in float32.
        """
        experts_per_rank = handle.num_experts // self.num_ranks
        rows_per_expert = self.num_ranks * handle.num_max_tokens_per_rank
        check_tensor("x", x, shape=(experts_per_rank, rows_per_expert, handle.hidden))
        check_topk_weights("topk_weights", topk_weights, topk_idx)
        flat = x.reshape(experts_per_rank * rows_per_expert, handle.hidden)
        back = _all_to_all_rows(
            flat[handle.recv_slot], handle.recv_counts, handle.send_counts, self.group
        )
        # back[i] is the output for send_key[i]; find the row of every (token, k) by its key.
        num_tokens = topk_idx.shape[0]
        tokens = torch.arange(num_tokens, device=x.device)
        acc = torch.zeros(num_tokens, handle.hidden, dtype=torch.float32, device=x.device)
        for k in range(topk_idx.shape[1]):
            ids = topk_idx[:, k]
            key = ids.clamp_min(0) * max(num_tokens, 1) + tokens
            rows = torch.searchsorted(handle.send_key, key).clamp_max(max(back.shape[0] - 1, 0))
            if back.shape[0] == 0:
                continue
            term = topk_weights[:, k].unsqueeze(1) * back[rows].float()
            acc += torch.where((ids >= 0).unsqueeze(1), term, torch.zeros_like(term))
        return acc.to(x.dtype)
