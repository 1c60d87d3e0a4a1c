"""Normal-mode dispatch and combine as differentiable PyTorch operators, for training.

Each operation's backward pass is the other operation in cached mode, on the same handle:

* ``dispatch`` sends every token once to each rank that holds one of its experts; its
  gradient sums the received rows' gradients back into the token (a combine), and the
  gradient of a routing weight comes from the one rank that owns that expert;
* ``combine`` sums the rows of every rank into the token; its gradient hands the token's
  gradient to each of those rows (a cached dispatch: no layout, no count exchange, no host
  synchronization).

So a backward pass moves exactly the bytes of its forward pass, in the opposite direction.

The three operations are registered custom operators (``torch.ops.tritonep.dispatch``,
``dispatch_cached`` and ``combine``, :mod:`torch.library`) with their autograd formulas and
shape functions, so that

* ``torch.compile`` traces through them without a graph break (``fullgraph=True`` works):
  with worst-case sizing (``num_worst_tokens``) every shape is static; with exact sizing the
  received row count is a data-dependent size (an unbacked symbol) that the code after the
  dispatch must accept, and the per-expert counts are a host tensor. Expert code that picks
  rows with data-dependent shapes (``nonzero``, boolean masks) breaks the graph there, as
  anywhere; the operators themselves never do;
* selective activation checkpointing can name them in its policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): saving their outputs
  means the recomputed forward moves no bytes. Plain activation checkpointing recomputes the
  dispatch, which gives the same rows in the same order (receivers order rows by source rank
  and token, not by arrival), so the recomputation matches what the forward saved.

A selective-checkpointing policy that keeps the communication::

    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts)

    SAVED = {torch.ops.tritonep.dispatch.default, torch.ops.tritonep.combine.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    out = checkpoint(moe_layer, x, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(policy))

A handle is a :class:`DispatchHandle`: a one-element int64 host tensor that names the mode's
handle in a registry, plus the sizes the shape functions need. The registry entry lives as
long as any tensor sharing that id tensor's memory (views, the copies autograd saves for the
backward, the compiled graph's saved values), so nothing is released by hand.

FP8: with ``use_fp8=True`` the forward quantizes ``x`` (e4m3, one float32 scale per 128
channels), sends FP8 and hands the experts the de-quantized BF16 rows; the backward stays BF16
and treats the quantization as the identity (the straight-through estimator), so the wire is
halved forward and exact backward.

Worst-case sizing (``num_worst_tokens``): padding rows are zero on the way in and their
gradients are dropped on the way back, so they never touch expert weights.
"""

from __future__ import annotations

import itertools
import sys
from typing import NamedTuple

import torch

from ..buffer import Buffer, buffer_by_key
from ..kernels.fp8 import dequantize_fp8, quantize_fp8
from ..modes.internode import InternodeHandle
from ..modes.normal import NormalHandle


class DispatchHandle(NamedTuple):
    """What :func:`combine` and cached dispatches need from a :func:`dispatch`.

    Attributes:
        id: ``[1]`` int64 host tensor naming the mode's handle in the registry.
        buffer_key: :attr:`Buffer.key` of the buffer that made it.
        num_tokens: ``N``, this rank's tokens.
        num_rows: ``M``, rows of the dispatch outputs (a data-dependent size under
            ``torch.compile`` in exact mode).
    """

    id: torch.Tensor
    buffer_key: int
    num_tokens: int
    num_rows: int


_HANDLES: dict[int, NormalHandle | InternodeHandle] = {}
_NEXT_ID = itertools.count(1)


class _Entry(bytearray):
    """The memory of an id tensor: dropped with the last tensor sharing it, and with it the
    registry entry (a tensor made by ``torch.frombuffer`` keeps its buffer alive)."""

    def __init__(self, key: int):
        super().__init__(key.to_bytes(8, sys.byteorder, signed=True))
        self.key = key

    def __del__(self):
        handles = _HANDLES  # None during interpreter shutdown
        if handles is not None:
            handles.pop(self.key, None)


def _register(handle: NormalHandle | InternodeHandle) -> torch.Tensor:
    key = next(_NEXT_ID)
    _HANDLES[key] = handle
    return torch.frombuffer(_Entry(key), dtype=torch.int64)


def _lookup(handle_id: torch.Tensor) -> NormalHandle | InternodeHandle:
    handle = _HANDLES.get(int(handle_id[0]))
    if handle is None:
        raise ValueError(
            f"handle: no dispatch handle {int(handle_id[0])} (released, or not made by "
            "tritonep.integrations.autograd.dispatch in this process)"
        )
    return handle


def _expert_rows(recv_x, use_fp8: bool, handle) -> torch.Tensor:
    """What the experts get: BF16 rows (de-quantized from FP8), padding rows of worst-case
    outputs zero. ``recv_x`` is the dispatch's own fresh output, so it is zeroed in place."""
    rows = dequantize_fp8(*recv_x) if use_fp8 else recv_x
    if handle.num_recv_tokens < 0:
        index = torch.arange(handle.num_rows, device=rows.device)
        rows.masked_fill_((index >= handle.host_info[0]).unsqueeze(1), 0)
    return rows


def _rows_back(ctx, handle_id, grad_rows: torch.Tensor, weights: torch.Tensor | None):
    """The backward of both dispatches: a combine of the rows' gradients (and weights')."""
    return torch.ops.tritonep.combine(
        grad_rows.to(torch.bfloat16).contiguous(), handle_id, weights, ctx.buffer_key,
        ctx.num_tokens,
    )  # fmt: skip


# --- dispatch -------------------------------------------------------------------------------


@torch.library.custom_op("tritonep::dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    buffer_key: int,
    num_experts: int,
    use_fp8: bool,
    num_worst_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    buffer = buffer_by_key(buffer_key)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        quantize_fp8(x) if use_fp8 else x, topk_idx=topk_idx, topk_weights=topk_weights,
        num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
        is_token_in_rank=in_rank, num_worst_tokens=num_worst_tokens,
    )  # fmt: skip
    recv_x = _expert_rows(recv_x, use_fp8, handle)
    if recv_w is None:
        recv_w = recv_x.new_empty(recv_x.shape[0], 0, dtype=torch.float32)
    if isinstance(counts, torch.Tensor):
        counts = counts.clone()  # an output may not alias the mode's memory
    else:
        counts = torch.tensor(counts, dtype=torch.int32)
    return recv_x, recv_idx, recv_w, counts, _register(handle)


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, buffer_key, num_experts, use_fp8, num_worst_tokens):
    rows = num_worst_tokens if num_worst_tokens > 0 else torch.library.get_ctx().new_dynamic_size()
    local = num_experts // buffer_by_key(buffer_key).group_size
    k = topk_idx.shape[1] if topk_weights is not None else 0
    return (
        x.new_empty(rows, x.shape[1], dtype=torch.bfloat16),
        topk_idx.new_empty(rows, topk_idx.shape[1]),
        x.new_empty(rows, k, dtype=torch.float32),
        # Exact sizes: the host already holds the counts; worst-case: they stay on the device.
        x.new_empty(local, dtype=torch.int32, device=x.device if num_worst_tokens > 0 else "cpu"),
        torch.empty(1, dtype=torch.int64),
    )


def _dispatch_setup(ctx, inputs, output):
    x, _, topk_weights, buffer_key, *_ = inputs
    _, recv_idx, _, _, handle_id = output
    ctx.has_weights = topk_weights is not None
    # The ids only mask the weights' gradient: kept when there are weights.
    ctx.save_for_backward(recv_idx if ctx.has_weights else None, handle_id)
    ctx.buffer_key, ctx.num_tokens = buffer_key, x.shape[0]


def _dispatch_backward(ctx, grad_recv_x, _grad_idx, grad_recv_w, _grad_counts, _grad_id):
    recv_idx, handle_id = ctx.saved_tensors
    weights = None
    if ctx.has_weights and ctx.needs_input_grad[2]:
        # A rank's weight for an expert it does not own is a constant zero, not the weight.
        weights = torch.where(recv_idx >= 0, grad_recv_w.float(), 0.0).contiguous()
    grad_x, grad_w = _rows_back(ctx, handle_id, grad_recv_x, weights)
    return grad_x, None, grad_w if weights is not None else None, None, None, None, None


_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# --- cached dispatch ------------------------------------------------------------------------


@torch.library.custom_op("tritonep::dispatch_cached", mutates_args=())
def _dispatch_cached(
    x: torch.Tensor, handle_id: torch.Tensor, buffer_key: int, num_rows: int, use_fp8: bool
) -> torch.Tensor:
    handle = _lookup(handle_id)
    recv_x, *_ = buffer_by_key(buffer_key).dispatch(
        quantize_fp8(x) if use_fp8 else x, handle=handle
    )
    return _expert_rows(recv_x, use_fp8, handle)


@_dispatch_cached.register_fake
def _(x, handle_id, buffer_key, num_rows, use_fp8):
    return x.new_empty(num_rows, x.shape[1], dtype=torch.bfloat16)


def _dispatch_cached_setup(ctx, inputs, output):
    x, handle_id, buffer_key, *_ = inputs
    ctx.save_for_backward(handle_id)
    ctx.buffer_key, ctx.num_tokens = buffer_key, x.shape[0]


def _dispatch_cached_backward(ctx, grad_recv_x):
    (handle_id,) = ctx.saved_tensors
    grad_x, _ = _rows_back(ctx, handle_id, grad_recv_x, None)
    return grad_x, None, None, None, None


_dispatch_cached.register_autograd(_dispatch_cached_backward, setup_context=_dispatch_cached_setup)


# --- combine --------------------------------------------------------------------------------


@torch.library.custom_op("tritonep::combine", mutates_args=())
def _combine(
    x: torch.Tensor,
    handle_id: torch.Tensor,
    topk_weights: torch.Tensor | None,
    buffer_key: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    handle = _lookup(handle_id)
    out, out_w, _ = buffer_by_key(buffer_key).combine(x, handle, topk_weights)
    if out_w is None:
        out_w = out.new_empty(out.shape[0], 0, dtype=torch.float32)
    return out, out_w


@_combine.register_fake
def _(x, handle_id, topk_weights, buffer_key, num_tokens):
    k = topk_weights.shape[1] if topk_weights is not None else 0
    return (
        x.new_empty(num_tokens, x.shape[1], dtype=torch.bfloat16),
        x.new_empty(num_tokens, k, dtype=torch.float32),
    )


def _combine_setup(ctx, inputs, output):
    x, handle_id, _, buffer_key, _ = inputs
    ctx.save_for_backward(handle_id)
    ctx.buffer_key, ctx.num_rows = buffer_key, x.shape[0]


def _combine_backward(ctx, grad_out, _grad_w):
    # The summed weights are the dispatch backward's business (its combine); a combine of
    # rows has no weights input that needs a gradient.
    (handle_id,) = ctx.saved_tensors
    grad_x = torch.ops.tritonep.dispatch_cached(
        grad_out.to(torch.bfloat16).contiguous(), handle_id, ctx.buffer_key, ctx.num_rows, False
    )
    return grad_x, None, None, None, None


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# --- the functions callers use --------------------------------------------------------------


def _check_handle(buffer: Buffer, handle) -> None:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            "handle: expected a DispatchHandle from tritonep.integrations.autograd.dispatch, "
            f"got {type(handle).__name__}"
        )
    if handle.buffer_key != buffer.key:
        raise ValueError(f"handle: made by the buffer with key {handle.buffer_key}, not this "
                         f"one (key {buffer.key})")  # fmt: skip


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    handle: DispatchHandle | None = None,
    use_fp8: bool = False,
    num_worst_tokens: int = 0,
):
    """Differentiable normal-mode dispatch (``torch.ops.tritonep.dispatch``, or
    ``dispatch_cached`` with a handle).

    Args:
        buffer: the group's :class:`~tritonep.Buffer`.
        x: ``[N, H]`` BF16 tokens (gradients flow to it).
        topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none (no gradient).
        topk_weights: ``[N, K]`` float32 routing weights (gradients flow to them), or None.
        num_experts: experts in total (not needed with ``handle``).
        handle: the :class:`DispatchHandle` of an earlier dispatch with the same routing:
            cached mode, only ``x`` moves (no count exchange, no host synchronization);
            ``topk_idx``, ``topk_weights`` and ``num_experts`` are then ignored, the routing
            outputs are None (keep those of the first dispatch) and no gradient reaches the
            weights.
        use_fp8: send FP8 (the experts still get BF16 rows; the backward is BF16).
        num_worst_tokens: if > 0, fixed-size outputs and no host synchronization.
    Returns:
        ``(recv_x [M, H] BF16, recv_topk_idx [M, K] int64 local ids or -1,
        recv_topk_weights [M, K] float32 or None, num_recv_tokens_per_expert [E_local] int32,
        handle)``: rows ordered by source rank then source token, as
        :meth:`~tritonep.Buffer.dispatch` returns them; the per-expert counts are a host
        tensor with exact sizes and a device tensor in worst-case mode.
    """
    if handle is not None:
        _check_handle(buffer, handle)
        recv_x = torch.ops.tritonep.dispatch_cached(
            x, handle.id, buffer.key, handle.num_rows, use_fp8
        )
        return recv_x, None, None, None, handle
    if not isinstance(num_experts, int):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx: expected a tensor, got {type(topk_idx).__name__}")
    recv_x, recv_idx, recv_w, counts, handle_id = torch.ops.tritonep.dispatch(
        x, topk_idx, topk_weights, buffer.key, num_experts, use_fp8, num_worst_tokens
    )
    handle = DispatchHandle(handle_id, buffer.key, x.shape[0], recv_x.shape[0])
    return recv_x, recv_idx, recv_w if topk_weights is not None else None, counts, handle


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Differentiable normal-mode combine (``torch.ops.tritonep.combine``).

    Args:
        buffer: the buffer of the matching :func:`dispatch`.
        x: ``[M, H]`` BF16, one row per received row, each rank's experts already reduced
            into it (gradients flow to it).
        handle: from :func:`dispatch`.
    Returns:
        ``[N, H]`` BF16, the sum over ranks of the rows of each token.
    """
    _check_handle(buffer, handle)
    out, _ = torch.ops.tritonep.combine(x, handle.id, None, buffer.key, handle.num_tokens)
    return out
