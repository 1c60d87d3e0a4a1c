"""Triton-distributed's expert-parallel layer interfaces, on the modes.

* :class:`EPAll2AllLayer` -- training and prefill (normal mode): rows grouped by local expert,
  ready for a grouped GEMM, and a combine that reduces a token's copies on their rank first;
* :class:`EPLowLatencyAllToAllLayer` -- decoding (low-latency mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..heap import default_device
from ..modes.low_latency import LowLatencyHandle, LowLatencyMode
from ..modes.normal import Config, NormalHandle, NormalMode
from ..validation import check_tensor, check_topk_idx


def _check_group(group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    if (rank, world_size) != (dist.get_rank(group), dist.get_world_size(group)):
        raise ValueError(
            f"rank, world_size: ({rank}, {world_size}) do not match the process group "
            f"({dist.get_rank(group)}, {dist.get_world_size(group)})"
        )


@dataclass
class EPLayoutDesc:
    """Where the rows of :meth:`EPAll2AllLayer.dispatch` came from (what combine needs).

    Attributes:
        handle: the normal-mode handle (one row per (source token, this rank)).
        copy_row: ``[M_copies]`` int64, the received row each output row copies.
        copy_topk: ``[M_copies]`` int64, the top-k column of that copy.
        tokens_per_expert: ``[E_local]`` int64 rows per local expert (a device tensor).
        expert_offsets: ``[E_local + 1]`` int64 first output row of each local expert, then
            the total (``rows of expert e = expert_offsets[e]:expert_offsets[e + 1]``).
        tokens_per_expert_list: the same counts as a list of int (for grouped GEMMs that
            take host sizes).
    """

    handle: NormalHandle
    copy_row: torch.Tensor
    copy_topk: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert_list: list[int]


class EPAll2AllLayer:
    """Normal-mode all-to-all for training and prefill, with the interface of
    Triton-distributed's ``EPAll2AllLayer``.

    A token crosses NVLink once per destination rank; there it is copied once per local
    expert it chose (Triton-distributed's "skipped token" scheme), and the copies are grouped
    by local expert. Combine reduces a token's copies on their rank in float32 -- each copy
    its own expert output -- and only that sum crosses NVLink back.

    Args:
        ep_group: the expert-parallel process group; every rank constructs the layer together.
        max_tokens: most tokens a rank dispatches per call.
        hidden: hidden size (a multiple of 8).
        topk: experts per token.
        rank, world_size: this rank and the group size (checked against ``ep_group``).
        num_tot_experts: experts in total, a multiple of ``world_size``.
        local_world_size: ranks per node; must equal ``world_size`` (one node).
        dtype: token dtype; must be ``torch.bfloat16``.
        weight_dtype: dtype of the returned routing weights (``float32`` or ``bfloat16``);
            weights travel as float32.
        num_sm: SM budget of each call on GPUs (an even number).
        enable_local_combine: accepted for Triton-distributed's signature. Copies are always
            reduced on their rank, in float32, before anything crosses NVLink: that is both the
            fastest and the most accurate choice, so there is no other path.
    """

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        max_tokens: int,
        hidden: int,
        topk: int,
        rank: int,
        num_tot_experts: int,
        local_world_size: int,
        world_size: int,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.float32,
        num_sm: int = 24,
        enable_local_combine: bool = True,
    ):
        group = ep_group or dist.group.WORLD
        _check_group(group, rank, world_size)
        if local_world_size != world_size:
            raise ValueError(
                f"local_world_size: the layer runs within one node, so it must equal "
                f"world_size ({world_size}), got {local_world_size}"
            )
        if dtype != torch.bfloat16:
            raise TypeError(f"dtype: expected torch.bfloat16, got {dtype}")
        if weight_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"weight_dtype: expected torch.float32 or bfloat16, got {weight_dtype}")
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens: expected an int >= 0, got {max_tokens}")
        if not isinstance(num_sm, int) or num_sm < 2 or num_sm % 2:
            raise ValueError(f"num_sm: expected an even int >= 2, got {num_sm}")
        self.max_tokens, self.hidden, self.topk = max_tokens, hidden, topk
        self.num_experts, self.weight_dtype = num_tot_experts, weight_dtype
        self.enable_local_combine = enable_local_combine
        self.mode = NormalMode(
            group, hidden, num_tot_experts, max_topk=topk,
            max_sms=num_sm if default_device(group).type == "cuda" else None,
        )  # fmt: skip
        self.config = Config(num_sms=num_sm) if self.mode.device.type == "cuda" else None

    def dispatch(
        self,
        tokens: torch.Tensor,
        expert_ids: torch.Tensor,
        routing_weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, EPLayoutDesc]:
        """Send tokens to their experts' ranks; return the copies grouped by local expert.

        Args:
            tokens: ``[N, hidden]`` BF16, ``N <= max_tokens``.
            expert_ids: ``[N, topk]`` int64 or int32 global expert ids; a dropped choice is
                ``-1`` or ``num_tot_experts`` (Triton-distributed's convention).
            routing_weights: ``[N, topk]`` float32 or BF16.
        Returns:
            ``(output [M_copies, hidden] BF16, weights [M_copies] weight_dtype, layout_desc)``:
            one row per (received token, local expert it chose), rows of local expert ``e``
            at ``layout_desc.expert_offsets[e]:expert_offsets[e + 1]``, each expert's rows in
            (source rank, source token) order; ``weights`` holds each copy's routing weight
            (apply it in the expert computation: combine sums the rows as given). The output
            size is exact, so the host waits for the received count (one synchronization).
        """
        mode = self.mode
        check_tensor("tokens", tokens, dtype=torch.bfloat16, shape=(None, self.hidden),
                     device=mode.device)  # fmt: skip
        num_tokens = tokens.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(f"tokens: {num_tokens} rows exceed max_tokens={self.max_tokens}")
        check_tensor("expert_ids", expert_ids, dtype=(torch.int64, torch.int32),
                     shape=(num_tokens, self.topk), device=mode.device)  # fmt: skip
        check_tensor("routing_weights", routing_weights, dtype=(torch.float32, torch.bfloat16),
                     shape=(num_tokens, self.topk), device=mode.device)  # fmt: skip
        ids = expert_ids.long()
        # Triton-distributed marks a dropped choice with id == num_experts; the modes use -1.
        check_topk_idx("expert_ids", ids, num_tokens, self.num_experts + 1, mode.device,
                       mode.check_ids)  # fmt: skip
        ids = torch.where(ids == self.num_experts, -1, ids)
        out = mode.dispatch(tokens, ids, routing_weights.float().contiguous(), config=self.config)
        recv_idx, recv_w = out.recv_topk_idx, out.recv_topk_weights
        # Copies in (local expert, received row) order: a stable sort of the row-major
        # (row, column) pairs by expert keeps each expert's rows in source order.
        rows, cols = (recv_idx >= 0).nonzero(as_tuple=True)
        experts = recv_idx[rows, cols]
        order = torch.argsort(experts, stable=True)
        copy_row, copy_topk = rows[order], cols[order]
        # The dispatch already counted the top-k entries per local expert (= copies) on the
        # host: no second read of the device.
        counts = out.num_recv_tokens_per_expert
        per_expert = torch.tensor(counts, dtype=torch.int64, device=mode.device)
        offsets = torch.zeros(mode.num_local_experts + 1, dtype=torch.int64, device=mode.device)
        torch.cumsum(per_expert, 0, out=offsets[1:])
        desc = EPLayoutDesc(out.handle, copy_row, copy_topk, per_expert, offsets, counts)
        output = out.recv_x.index_select(0, copy_row)
        weights = recv_w[copy_row, copy_topk].to(self.weight_dtype)
        return output, weights, desc

    def combine(self, expert_output: torch.Tensor, layout_desc: EPLayoutDesc) -> torch.Tensor:
        """Bring the expert outputs back: ``[N, hidden]`` BF16, for each token the sum of the
        rows of all its copies.

        Args:
            expert_output: ``[M_copies, hidden]`` BF16, row for row as :meth:`dispatch`
                returned them (weights already applied, if the model weights them).
            layout_desc: from the matching :meth:`dispatch`.
        Returns:
            ``[N, hidden]`` BF16. A token's copies on one rank are summed there in float32
            and rounded to BF16 once; the ranks' sums are added in float32.
        """
        if not isinstance(layout_desc, EPLayoutDesc):
            raise TypeError(
                f"layout_desc: expected an EPLayoutDesc, got {type(layout_desc).__name__}"
            )
        copies = layout_desc.copy_row.shape[0]
        check_tensor("expert_output", expert_output, dtype=torch.bfloat16,
                     shape=(copies, self.hidden), device=self.mode.device)  # fmt: skip
        handle = layout_desc.handle
        partial = torch.zeros(handle.num_rows, self.hidden, dtype=torch.float32,
                              device=self.mode.device)  # fmt: skip
        partial.index_add_(0, layout_desc.copy_row, expert_output.float())
        out, _ = self.mode.combine(partial.to(torch.bfloat16), handle)
        return out

    def finalize(self) -> None:
        """Release the layer's memory (collective)."""
        self.mode.destroy()


class EPLowLatencyAllToAllLayer:
    """Low-latency all-to-all for decoding, with the interface of
    Triton-distributed's ``EPLowLatencyAllToAllLayer``.

    Args:
        max_m: most tokens a rank dispatches per call.
        hidden: hidden size, a multiple of 8 (e.g. 2880: FP8 scales per 128 channels, the
            last of them for a partial group of 64).
        topk: experts per token (1 to 16).
        online_quant_fp8: quantize to FP8 inside dispatch; False sends BF16.
        rank, num_experts, local_world_size, world_size: the group's shape; ``rank`` and
            ``world_size`` must match the process group; ``local_world_size`` ranks share a
            node (peers on other nodes are reached through staging and puts).
        fp8_gsize: channels per scale; must be 128.
        dtype: token dtype; must be ``torch.bfloat16``.
        enable_profiling: record kernel traces (per-program phase timings) of every call, for
            :meth:`dump_dispatch_trace` and :meth:`dump_combine_trace`.
        group: the process group (default: the world).
    """

    def __init__(
        self,
        max_m: int,
        hidden: int,
        topk: int,
        online_quant_fp8: bool,
        rank: int,
        num_experts: int,
        local_world_size: int,
        world_size: int,
        fp8_gsize: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        enable_profiling: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        group = group or dist.group.WORLD
        _check_group(group, rank, world_size)
        if fp8_gsize != 128:
            raise ValueError(f"fp8_gsize: only 128 is supported, got {fp8_gsize}")
        if dtype != torch.bfloat16:
            raise TypeError(f"dtype: expected torch.bfloat16, got {dtype}")
        if (
            not isinstance(local_world_size, int)
            or local_world_size < 1
            or (world_size % local_world_size)
        ):
            raise ValueError(
                f"local_world_size: expected a divisor of world_size ({world_size}), "
                f"got {local_world_size}"
            )
        self.topk, self.online_quant_fp8 = topk, online_quant_fp8
        self.local_world_size = local_world_size
        self.mode = LowLatencyMode(
            group, max_m, hidden, num_experts, max_topk=max(topk, 1), profile=enable_profiling,
            gpus_per_node=local_world_size,
        )  # fmt: skip

    def dispatch(
        self,
        send_tokens: torch.Tensor,
        send_scales: torch.Tensor | None,
        topk_indices: torch.Tensor,
    ):
        """Send each token to the ranks of its top-k experts.

        Args:
            send_tokens: ``[N, hidden]`` BF16, ``N <= max_m``.
            send_scales: must be None (tokens are quantized here when FP8 is on).
            topk_indices: ``[N, topk]`` int64 global expert ids, ``-1`` for none.
        Returns:
            ``(recv_token, recv_scale, expert_recv_count, dispatch_meta)``: ``recv_token``
            ``[E_local, world_size * max_m, hidden]`` (e4m3 or BF16), ``recv_scale``
            ``[E_local, world_size * max_m, ceil(hidden / 128)]`` float32, column-major within each
            expert as TMA-based grouped GEMMs read it (None for BF16), ``expert_recv_count``
            ``[E_local]`` int32; ``dispatch_meta`` goes to :meth:`combine`.
        """
        if send_scales is not None:
            raise ValueError("send_scales: pre-quantized input is not supported; pass BF16 tokens")
        recv, count, handle, _ = self.mode.dispatch(
            send_tokens, topk_indices, use_fp8=self.online_quant_fp8
        )
        recv_token, recv_scale = recv if self.online_quant_fp8 else (recv, None)
        return recv_token, recv_scale, count, handle

    def combine(
        self,
        send_tokens: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        dispatch_meta: LowLatencyHandle,
        zero_copy: bool = False,
    ) -> torch.Tensor:
        """Bring expert outputs back and reduce them with the routing weights.

        Args:
            send_tokens: ``[E_local, world_size * max_m, hidden]`` BF16 expert outputs, rows
                as :meth:`dispatch` packed them.
            topk_indices: ``[N, topk]`` int64, as given to :meth:`dispatch`.
            topk_weights: ``[N, topk]`` float32.
            dispatch_meta: from :meth:`dispatch`.
            zero_copy: ``send_tokens`` is the mode's combine buffer
                (``self.mode.get_next_combine_buffer``).
        Returns:
            ``[N, hidden]`` BF16: each token's top-k-weighted sum of its experts' outputs.
        """
        out, _ = self.mode.combine(
            send_tokens, topk_indices, topk_weights, dispatch_meta, zero_copy
        )
        return out

    def dump_dispatch_trace(self, path: str) -> str:
        """Write this rank's dispatch kernel traces as Chrome trace JSON; returns the path.

        ``path`` may contain ``{rank}``. Needs ``enable_profiling=True``.
        """
        return self._dump(path, "low-latency dispatch")

    def dump_combine_trace(self, path: str) -> str:
        """Write this rank's combine kernel traces as Chrome trace JSON; returns the path.

        ``path`` may contain ``{rank}``. Needs ``enable_profiling=True``.
        """
        return self._dump(path, "low-latency combine")

    def _dump(self, path: str, kernel: str) -> str:
        if self.mode.trace is None:
            raise RuntimeError("enable_profiling: construct the layer with enable_profiling=True")
        return str(self.mode.trace.dump(path.format(rank=self.mode.rank), (kernel,)))

    def finalize(self) -> None:
        """Release the layer's memory (collective)."""
        self.mode.destroy()
