"""Layer interfaces of the seed documents, on top of the modes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..modes.low_latency import LowLatencyHandle, LowLatencyMode


class EPLowLatencyAllToAllLayer:
    """Low-latency all-to-all for decoding, with the seed layer's interface.

    Args:
        max_m: most tokens a rank dispatches per call.
        hidden: hidden size (a multiple of 128).
        topk: experts per token (1 to 16).
        online_quant_fp8: quantize to FP8 inside dispatch; False sends BF16.
        rank, num_experts, local_world_size, world_size: the group's shape; ``rank`` and
            ``world_size`` must match the process group.
        fp8_gsize: channels per scale; must be 128.
        dtype: token dtype; must be ``torch.bfloat16``.
        enable_profiling: must be False until kernel traces exist.
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
        if (rank, world_size) != (dist.get_rank(group), dist.get_world_size(group)):
            raise ValueError(
                f"rank, world_size: ({rank}, {world_size}) do not match the process group "
                f"({dist.get_rank(group)}, {dist.get_world_size(group)})"
            )
        if fp8_gsize != 128:
            raise ValueError(f"fp8_gsize: only 128 is supported, got {fp8_gsize}")
        if dtype != torch.bfloat16:
            raise TypeError(f"dtype: expected torch.bfloat16, got {dtype}")
        if enable_profiling:
            raise NotImplementedError("enable_profiling: kernel traces are not available yet")
        self.topk, self.online_quant_fp8 = topk, online_quant_fp8
        self.local_world_size = local_world_size
        self.mode = LowLatencyMode(group, max_m, hidden, num_experts, max_topk=max(topk, 1))

    def dispatch(
        self,
        send_tokens: torch.Tensor,
        send_scales: torch.Tensor | None,
        topk_indices: torch.Tensor,
    ):
        """Returns ``(recv_token, recv_scale, expert_recv_count, dispatch_meta)``.

        ``recv_token`` is ``[E_local, world_size * max_m, hidden]`` (e4m3 or BF16),
        ``recv_scale`` ``[E_local, world_size * max_m, hidden / 128]`` float32 (None for BF16),
        ``expert_recv_count`` ``[E_local]`` int32; ``dispatch_meta`` goes to :meth:`combine`.
        ``send_scales`` must be None: tokens arrive in BF16 and are quantized here.
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
        """``[N, hidden]`` BF16: each token's top-k-weighted sum of its experts' outputs."""
        out, _ = self.mode.combine(
            send_tokens, topk_indices, topk_weights, dispatch_meta, zero_copy
        )
        return out

    def finalize(self) -> None:
        """Release the layer's memory (collective)."""
        self.mode.destroy()
