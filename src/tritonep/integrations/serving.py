"""The call shapes serving frameworks wrap all-to-all backends in, with no dependency on them.

* :class:`PrepareFinalize` -- vLLM's split: ``prepare`` = quantize + dispatch, the experts
  run, ``finalize`` = combine + top-k weighted reduce into the caller's output tensor;
* :class:`TwoPhaseDispatcher` -- SGLang's split for two-batch overlap: ``dispatch_a`` /
  ``combine_a`` start the transfer and return at once, ``dispatch_b`` / ``combine_b`` finish
  it, so another micro-batch can compute in between.

Both sit on one :class:`~tritonep.Buffer` and take ``mode="low_latency"`` (decode:
per-expert slabs ``[E_local, R * max_tokens, H]``, FP8 optional, no host synchronization) or
``mode="normal"`` (prefill: one row per (token, rank), exact sizes). The experts' input is
the dispatch output itself (no copy), low-latency ``finalize`` reduces straight into the
caller's output, and the low-latency halves leave no program spinning while the caller
computes between them.

Example (vLLM style, decode)::

    pf = PrepareFinalize(buffer, num_experts=256, max_tokens_per_rank=128, use_fp8=True)
    p = pf.prepare(hidden_states, topk_weights, topk_ids)
    y = grouped_gemm(p.tokens, p.scales, p.expert_num_tokens)   # [E_local, R*128, H] BF16
    pf.finalize(output, y, topk_weights, topk_ids, p)           # output: [N, H] BF16

Example (SGLang style, two micro-batches)::

    d = TwoPhaseDispatcher(buffer, num_experts=256, max_tokens_per_rank=128)
    s0 = d.dispatch_a(x0, topk_idx0, topk_weights0)
    attention(micro_batch_1)                                    # overlaps the transfer
    p0 = d.dispatch_b(s0)
    c0 = d.combine_a(experts(p0), p0)
    ...
    out0 = d.combine_b(c0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..buffer import Buffer
from ..kernels.fp8 import quantize_fp8

MODES = ("low_latency", "normal")


@dataclass
class Prepared:
    """What :meth:`PrepareFinalize.prepare` / :meth:`TwoPhaseDispatcher.dispatch_b` return.

    Attributes:
        tokens: low-latency: ``[E_local, R * max_tokens, H]`` e4m3 or BF16 slabs; normal:
            ``[M, H]`` BF16 (or e4m3) rows, one per (token, this rank).
        scales: float32 scales per 128 channels matching ``tokens`` (``ceil(H / 128)`` of
            them per row), or None for BF16.
        expert_num_tokens: low-latency: ``[E_local]`` int32 valid rows per slab; normal: the
            per-local-expert row counts (a list of int).
        topk_ids: normal mode: ``[M, K]`` int64 local expert ids of each row (``-1``
            elsewhere); None in low-latency mode (rows are already per expert).
        topk_weights: normal mode: ``[M, K]`` float32 weights of each row; else None.
        handle: for the combine.
        routing: the ``(topk_ids, topk_weights)`` the dispatch was given (for the combine).
    """

    tokens: torch.Tensor
    scales: torch.Tensor | None
    expert_num_tokens: torch.Tensor | list[int]
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    handle: Any
    routing: tuple[torch.Tensor, torch.Tensor]


class _Adapter:
    def __init__(
        self,
        buffer: Buffer,
        num_experts: int,
        mode: str = "low_latency",
        max_tokens_per_rank: int = 128,
        use_fp8: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.buffer, self.num_experts, self.mode = buffer, num_experts, mode
        self.max_tokens, self.use_fp8 = max_tokens_per_rank, use_fp8

    def _send(self, x, topk_ids, topk_weights, hook: bool):
        """Start (``hook=True``) or run a dispatch; returns ``(finish, done)`` where
        ``finish()`` gives the :class:`Prepared`."""
        b = self.buffer
        if self.mode == "low_latency":
            recv, count, handle, _, recv_hook = b.low_latency_dispatch(
                x, topk_ids, self.max_tokens, self.num_experts, use_fp8=self.use_fp8,
                return_recv_hook=hook,
            )  # fmt: skip
            tokens, scales = recv if self.use_fp8 else (recv, None)

            def finish():
                if recv_hook is not None:
                    recv_hook()
                return Prepared(tokens, scales, count, None, None, handle, (topk_ids, topk_weights))

            return finish
        payload = quantize_fp8(x) if self.use_fp8 else x
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(topk_ids, self.num_experts)
        recv, idx, weights, counts, handle, event = b.dispatch(
            payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_ids, topk_weights=topk_weights,
            async_finish=hook,
        )  # fmt: skip
        tokens, scales = recv if self.use_fp8 else (recv, None)

        def finish():
            event.current_stream_wait()
            return Prepared(tokens, scales, counts, idx, weights, handle, (topk_ids, topk_weights))

        return finish

    def _combine(self, expert_output, topk_ids, topk_weights, prepared: Prepared, hook: bool,
                 out: torch.Tensor | None = None):  # fmt: skip
        """Start or run a combine; ``finish()`` gives the result (low-latency mode: written
        into ``out`` when given)."""
        b = self.buffer
        if self.mode == "low_latency":
            out, _, recv_hook = b.low_latency_combine(
                expert_output, topk_ids, topk_weights, prepared.handle, return_recv_hook=hook,
                out=out,
            )  # fmt: skip

            def finish():
                if recv_hook is not None:
                    recv_hook()
                return out

            return finish
        out, _, event = b.combine(expert_output, prepared.handle, async_finish=hook)

        def finish():
            event.current_stream_wait()
            return out

        return finish


class PrepareFinalize(_Adapter):
    """vLLM-style prepare (quantize + dispatch) and finalize (combine + weighted reduce).

    Args:
        buffer: the group's :class:`~tritonep.Buffer`.
        num_experts: experts in total.
        mode: ``"low_latency"`` (batched per-expert slabs) or ``"normal"`` (one row per
            (token, rank)).
        max_tokens_per_rank: most tokens per rank (low-latency slab size).
        use_fp8: quantize to e4m3 with float32 scales per 128 channels before sending.
    """

    def prepare(
        self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> Prepared:
        """Quantize and dispatch ``a1`` ``[N, H]`` BF16 with ``topk_ids`` ``[N, K]`` int64 and
        ``topk_weights`` ``[N, K]`` float32; returns the experts' input (:class:`Prepared`)."""
        return self._send(a1, topk_ids, topk_weights, hook=False)()

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        prepared: Prepared,
    ) -> None:
        """Combine the expert outputs into ``output`` ``[N, H]`` BF16.

        ``fused_expert_output`` is, in low-latency mode, ``[E_local, R * max_tokens, H]`` BF16
        (unweighted; the top-k weights are applied here), and in normal mode ``[M, H]`` BF16,
        one row per prepared row with the row's local experts already weighted and summed.
        ``topk_weights`` ``[N, K]`` float32 and ``topk_ids`` ``[N, K]`` int64 are those given
        to :meth:`prepare` (used in low-latency mode); ``prepared`` is what it returned.
        """
        # Low-latency mode reduces straight into a BF16 contiguous ``output``; otherwise the
        # sums are copied there.
        direct = output.dtype == torch.bfloat16 and output.is_contiguous()
        out = self._combine(fused_expert_output, topk_ids, topk_weights, prepared, False,
                            output if direct else None)()  # fmt: skip
        if out is not output:
            output.copy_(out)


class TwoPhaseDispatcher(_Adapter):
    """SGLang-style halves: ``*_a`` starts a transfer, ``*_b`` finishes it.

    Args: as :class:`PrepareFinalize`. In low-latency mode the halves are the send and the
    receive hook (no SM waits in between); in normal mode ``*_a`` runs the kernels on the
    buffer's communication stream and ``*_b`` makes the current stream wait for them.
    """

    def dispatch_a(self, hidden_states, topk_idx, topk_weights):
        """Start dispatching ``hidden_states`` ``[N, H]`` BF16 with ``topk_idx`` ``[N, K]``
        int64 and ``topk_weights`` ``[N, K]`` float32; returns a state for :meth:`dispatch_b`."""
        return self._send(hidden_states, topk_idx, topk_weights, hook=True)

    def dispatch_b(self, state) -> Prepared:
        """Finish the dispatch started by the :meth:`dispatch_a` that returned ``state``:
        the experts' input (:class:`Prepared`)."""
        return state()

    def combine_a(self, expert_output: torch.Tensor, prepared: Prepared):
        """Start combining ``expert_output`` (the layout of :meth:`PrepareFinalize.finalize`)
        of the rows in ``prepared`` (from :meth:`dispatch_b`); returns a state for
        :meth:`combine_b`."""
        topk_idx, topk_weights = prepared.routing
        return self._combine(expert_output, topk_idx, topk_weights, prepared, hook=True)

    def combine_b(self, state) -> torch.Tensor:
        """Finish the combine started by the :meth:`combine_a` that returned ``state``:
        ``[N, H]`` BF16."""
        return state()
