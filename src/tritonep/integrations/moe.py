"""An MoE layer on tritonep, and the same layer computed densely on one process.

The layer: a router (top-k over softmax scores), one matrix per expert, and between them the
expert-parallel all-to-all. Each rank holds ``E / R`` experts; a forward pass

1. routes the rank's tokens (``topk_idx``, ``topk_weights``),
2. dispatches them to the experts' ranks,
3. applies every local expert a received row chose, weighting its output there (so a token's
   outputs on one rank are summed before they cross NVLink),
4. combines the rows back into the tokens.

Normal mode (:func:`.autograd.dispatch` / ``combine``) is differentiable: gradients reach the
input, the router and the experts. Low-latency mode (decode) is forward-only.
:func:`dense_moe` is the reference every test compares against.
"""

from __future__ import annotations

import torch

from ..buffer import Buffer
from ..kernels.fp8 import dequantize_fp8
from . import autograd


def init_params(hidden: int, num_experts: int, seed: int = 0):
    """Router ``[H, E]`` float32 and experts ``[E, H, H]`` float32, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, num_experts, generator=gen) / hidden**0.5
    experts = torch.randn(num_experts, hidden, hidden, generator=gen) / hidden**0.5
    return router, experts


def route(x: torch.Tensor, router: torch.Tensor, topk: int):
    """Top-k over softmax scores: ``(topk_idx [N, K] int64, topk_weights [N, K] float32)``;
    the weights are differentiable with respect to ``x`` and ``router``."""
    probs = torch.softmax(x.float() @ router.float(), dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    return ids, weights


def dense_moe(x: torch.Tensor, router: torch.Tensor, experts: torch.Tensor, topk: int):
    """The layer on one process, in float32: ``sum_k w_k * (x @ W_{e_k})``, ``[N, H]``."""
    ids, weights = route(x, router, topk)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(topk):
        y = torch.einsum("nh,nhd->nd", x.float(), experts[ids[:, k]].float())
        out = out + weights[:, k : k + 1] * y
    return out


def local_experts(
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """Apply the local experts to the received rows of a normal-mode dispatch.

    Args:
        recv_x: ``[M, H]`` BF16 received rows.
        recv_topk_idx: ``[M, K]`` int64 local expert ids (``-1`` elsewhere).
        recv_topk_weights: ``[M, K]`` float32.
        experts: ``[E_local, H, H]`` this rank's expert matrices.
    Returns:
        ``[M, H]`` float32: per row, the weighted sum of its local experts' outputs (one
        matmul per expert over the rows that chose it, as a grouped GEMM would do).
    """
    rows, cols = (recv_topk_idx >= 0).nonzero(as_tuple=True)
    chosen = recv_topk_idx[rows, cols]
    out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for e in range(experts.shape[0]):
        pick = chosen == e
        r, c = rows[pick], cols[pick]
        y = recv_x[r].float() @ experts[e].float()
        out = out.index_add(0, r, recv_topk_weights[r, c].unsqueeze(1) * y)
    return out


class MoELayer(torch.nn.Module):
    """The MoE layer of one rank.

    Args:
        buffer: the group's :class:`~tritonep.Buffer`.
        router: ``[H, E]`` float32, the same on every rank (a replicated parameter: its
            gradient on a rank covers that rank's tokens).
        experts: ``[E, H, H]``, all experts; the rank keeps its ``E / R`` as a parameter.
        topk: experts per token.
        mode: ``"normal"`` (differentiable) or ``"low_latency"`` (forward only; BF16 or FP8).
        use_fp8: send FP8 (the experts still see BF16 rows).
        max_tokens: most tokens per rank (low-latency mode).
        num_worst_tokens: normal mode: if > 0, fixed-size dispatch outputs and no host
            synchronization (see :func:`tritonep.integrations.autograd.dispatch`).
    """

    def __init__(
        self,
        buffer: Buffer,
        router: torch.Tensor,
        experts: torch.Tensor,
        topk: int,
        mode: str = "normal",
        use_fp8: bool = False,
        max_tokens: int = 128,
        num_worst_tokens: int = 0,
    ):
        super().__init__()
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"mode: expected 'normal' or 'low_latency', got {mode!r}")
        num_experts = router.shape[1]
        per_rank = num_experts // buffer.group_size
        first = buffer.rank * per_rank
        self.buffer, self.topk, self.mode = buffer, topk, mode
        self.use_fp8, self.max_tokens, self.num_experts = use_fp8, max_tokens, num_experts
        self.num_worst_tokens = num_worst_tokens
        self.router = torch.nn.Parameter(router.clone())
        self.experts = torch.nn.Parameter(experts[first : first + per_rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[N, H]`` BF16 -> ``[N, H]`` BF16."""
        ids, weights = route(x, self.router, self.topk)
        if self.mode == "low_latency":
            return self._low_latency(x, ids, weights)
        recv_x, recv_idx, recv_w, _, handle = autograd.dispatch(
            self.buffer, x, ids, weights, self.num_experts, use_fp8=self.use_fp8,
            num_worst_tokens=self.num_worst_tokens,
        )  # fmt: skip
        y = local_experts(recv_x, recv_idx, recv_w, self.experts)
        return autograd.combine(self.buffer, y.to(torch.bfloat16), handle)

    @torch.no_grad()
    def _low_latency(self, x, ids, weights):
        recv, _, handle, _, _ = self.buffer.low_latency_dispatch(
            x, ids, self.max_tokens, self.num_experts, use_fp8=self.use_fp8
        )
        if self.use_fp8:
            recv = dequantize_fp8(*recv, dtype=torch.float32)
        y = torch.bmm(recv.float(), self.experts.float()).to(torch.bfloat16)
        out, _, _ = self.buffer.low_latency_combine(y, ids, weights.detach(), handle)
        return out
