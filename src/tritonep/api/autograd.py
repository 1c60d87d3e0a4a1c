"""Normal-mode dispatch and combine as autograd functions, for training.

Each operation's backward pass is the other operation in cached mode, on the same handle:

* ``dispatch`` sends every token once to each rank that holds one of its experts; its
  gradient sums the received rows' gradients back into the token (a combine), and the
  gradient of a routing weight comes from the one rank that owns that expert;
* ``combine`` sums the rows of every rank into the token; its gradient hands the token's
  gradient to each of those rows (a cached dispatch: no layout, no count exchange, no host
  synchronization).

So a backward pass moves exactly the bytes of its forward pass, in the opposite direction.

FP8: with ``use_fp8=True`` the forward quantizes ``x`` (e4m3, one float32 scale per 128
channels), sends FP8 and hands the experts the de-quantized BF16 rows; the backward stays BF16
and treats the quantization as the identity (the straight-through estimator), so the wire is
halved forward and exact backward.

Activation checkpointing: pass the handle of an earlier dispatch with the same routing
(``handle=``) and the recomputed forward moves only ``x``. ``torch.compile``: both functions
are opaque to Dynamo (``torch.compiler.disable``): the graph breaks around each call, because
exact-size outputs need a host read of the received count and the kernels are launched from
Python; the code around them still compiles.

Worst-case sizing (``num_worst_tokens``) works too: padding rows are zero on the way in and
their gradients are dropped on the way back, so they never touch expert weights.
"""

from __future__ import annotations

import torch

from ..modes.normal import NormalHandle
from ..reference.fp8 import dequantize_fp8, quantize_fp8
from .buffer import Buffer


def _padding(handle: NormalHandle, device: torch.device) -> torch.Tensor | None:
    """``[M, 1]`` bool, True on padding rows (worst-case outputs), or None for exact outputs."""
    if handle.num_recv_tokens >= 0:
        return None
    rows = torch.arange(handle.num_rows, device=device)
    return (rows >= handle.host_info[0]).unsqueeze(1)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, handle, use_fp8, worst):
        payload = quantize_fp8(x) if use_fp8 else x
        recv_idx = recv_w = per_expert_list = None
        if handle is None:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
            recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
                payload, topk_idx=topk_idx, topk_weights=topk_weights,
                num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                is_token_in_rank=in_rank, num_worst_tokens=worst,
            )  # fmt: skip
            ctx.mark_non_differentiable(recv_idx)
        else:
            recv_x, *_ = buffer.dispatch(payload, handle=handle)
        if use_fp8:
            recv_x = dequantize_fp8(*recv_x).to(torch.bfloat16)
        padding = _padding(handle, recv_x.device)
        if padding is not None:
            recv_x = recv_x.masked_fill(padding, 0)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(recv_idx)
        return recv_x, recv_idx, recv_w, per_expert_list, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_w, _grad_list, _grad_handle):
        (recv_idx,) = ctx.saved_tensors
        handle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_rows, handle.hidden, dtype=torch.bfloat16,
                                      device=recv_idx.device)  # fmt: skip
        grad_recv_x = grad_recv_x.to(torch.bfloat16)
        padding = _padding(handle, grad_recv_x.device)
        if padding is not None:
            grad_recv_x = grad_recv_x.masked_fill(padding, 0)
        weights = None
        if grad_recv_w is not None and recv_idx is not None and ctx.needs_input_grad[1]:
            # A rank's weight for an expert it does not own is a constant zero, not the weight.
            weights = torch.where(recv_idx >= 0, grad_recv_w.float(), 0.0).contiguous()
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.contiguous(), handle, weights)
        return grad_x, grad_w, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, handle):
        out, _, _ = buffer.combine(x, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx, grad_out):
        handle = ctx.handle
        grad_x, *_ = ctx.buffer.dispatch(grad_out.to(torch.bfloat16).contiguous(), handle=handle)
        padding = _padding(handle, grad_x.device)
        if padding is not None:
            grad_x = grad_x.masked_fill(padding, 0)
        return grad_x, None, None


@torch.compiler.disable
def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    handle: NormalHandle | None = None,
    use_fp8: bool = False,
    num_worst_tokens: int = 0,
):
    """Differentiable normal-mode dispatch.

    Args:
        buffer: the group's :class:`~tritonep.api.Buffer`.
        x: ``[N, H]`` BF16 tokens (gradients flow to it).
        topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none (no gradient).
        topk_weights: ``[N, K]`` float32 routing weights (gradients flow to them), or None.
        num_experts: experts in total (not needed with ``handle``).
        handle: a handle of an earlier dispatch with the same routing: cached mode, only ``x``
            moves (no count exchange, no host synchronization); ``topk_idx``,
            ``topk_weights`` and ``num_experts`` are then ignored, the routing outputs are
            None (keep those of the first dispatch) and no gradient reaches the weights.
        use_fp8: send FP8 (the experts still get BF16 rows; the backward is BF16).
        num_worst_tokens: if > 0, fixed-size outputs and no host synchronization.
    Returns:
        ``(recv_x [M, H] BF16, recv_topk_idx [M, K] int64 local ids or -1,
        recv_topk_weights [M, K] float32 or None, num_recv_tokens_per_expert, handle)``, as
        :meth:`~tritonep.api.Buffer.dispatch` returns them (less the event).
    """
    if handle is None and not isinstance(num_experts, int):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    return _Dispatch.apply(
        x, topk_weights, buffer, topk_idx, num_experts, handle, use_fp8, num_worst_tokens
    )


@torch.compiler.disable
def combine(buffer: Buffer, x: torch.Tensor, handle: NormalHandle) -> torch.Tensor:
    """Differentiable normal-mode combine.

    Args:
        buffer: the buffer of the matching :func:`dispatch`.
        x: ``[M, H]`` BF16, one row per received row, each rank's experts already reduced
            into it (gradients flow to it).
        handle: from :func:`dispatch`.
    Returns:
        ``[N, H]`` BF16, the sum over ranks of the rows of each token.
    """
    return _Combine.apply(x, buffer, handle)
