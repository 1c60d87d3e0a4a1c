"""Dispatch layout in one launch: tokens per rank, tokens per expert, and is_token_in_rank.

Each program takes a strided share of the token blocks, writes ``is_token_in_rank`` for them
and keeps its per-rank and per-expert counts in registers (a histogram), then stores them as
one row of a small workspace. The last program to arrive (an arrival counter it resets) sums
the rows into the outputs. No memset and no atomics on the outputs, so it needs no zeroed
buffers and the sums are deterministic.

Ids outside ``[-1, num_experts)`` count as none; a program that meets one finds the first in
token order and records it (rank, token, column, id) in its owner's status
(:mod:`tritonep.kernels.status`), which the owner's next dispatch raises. Token counts and
top-k are run-time values: one compiled variant per (experts, ranks, top-k rounded up to a
power of two) serves every batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launcher import KernelLaunch, Shared
from .phases import LAYOUT_IDS
from .status import Status, first_bad_id, record_bad_id

#: Tokens a program counts at a time.
BLOCK_TOKENS = 64
#: Workspace rows the last program sums at a time.
BLOCK_PROGRAMS = 16


class LayoutCall(NamedTuple):
    """The leading runtime arguments of :func:`dispatch_layout_kernel`: what changes per call."""

    topk_idx_ptr: object
    num_tokens: int
    K: int
    per_rank_ptr: object
    per_expert_ptr: object
    in_rank_ptr: object


class LayoutShared(NamedTuple):
    """The trailing runtime arguments of :func:`dispatch_layout_kernel`: its owner's."""

    partial_ptr: object
    arrivals_ptr: object
    status_ptr: object
    rank: int


class LayoutVariant(NamedTuple):
    """One compiled variant of :func:`dispatch_layout_kernel`: its constexprs, in order."""

    NUM_EXPERTS: int
    NUM_RANKS: int
    BLOCK_TOKENS: int
    BLOCK_K: int
    BLOCK_RANKS: int
    BLOCK_EXPERTS: int
    BLOCK_PROGRAMS: int


@triton.jit
def count_block(
    topk_idx_ptr,  # [N, K] int64 global expert ids
    tokens,  # [BLOCK_TOKENS] int32 the block's tokens
    num_tokens,  # N, tokens of this rank
    K,  # top-k columns
    in_rank_ptr,  # [N, R] bool out: is_token_in_rank
    NUM_EXPERTS: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
):
    """Write ``is_token_in_rank`` of a block of ``tokens``; returns its per-rank and per-expert
    counts and where its ids lie outside ``[-1, NUM_EXPERTS)`` (int32 1s)."""
    E_LOCAL: tl.constexpr = NUM_EXPERTS // NUM_RANKS
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_RANKS)
    tmask = tokens < num_tokens
    ids = tl.load(
        topk_idx_ptr + tokens[:, None].to(tl.int64) * K + ks[None, :],
        mask=tmask[:, None] & (ks[None, :] < K),
        other=-1,
    )
    valid = (ids >= 0) & (ids < NUM_EXPERTS)
    bad = ((ids < -1) | (ids >= NUM_EXPERTS)).to(tl.int32)
    owner = tl.where(valid, ids // E_LOCAL, -1)
    hits = (owner[:, :, None] == ranks[None, None, :]).to(tl.int32)
    in_rank = tl.max(hits, axis=1)  # [BLOCK_TOKENS, BLOCK_RANKS]
    dst = in_rank_ptr + tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :]
    tl.store(dst, in_rank.to(tl.int8), mask=tmask[:, None] & (ranks[None, :] < NUM_RANKS))
    binned = tl.reshape(tl.where(valid, ids, 0).to(tl.int32), (tokens.shape[0] * BLOCK_K,))
    per_expert = tl.histogram(
        binned, BLOCK_EXPERTS, mask=tl.reshape(valid, (tokens.shape[0] * BLOCK_K,))
    )
    return tl.sum(in_rank, axis=0), per_expert, bad


@triton.jit(do_not_specialize=["num_tokens", "K"])
def dispatch_layout_kernel(
    topk_idx_ptr,  # [N, K] int64 global expert ids, -1 for none
    num_tokens,  # N
    K,  # top-k columns (tiles are BLOCK_K wide)
    per_rank_ptr,  # [R] int32 out: tokens that go to each rank
    per_expert_ptr,  # [E] int32 out: top-k entries naming each expert
    in_rank_ptr,  # [N, R] bool out (stored as bytes)
    partial_ptr,  # [programs, BLOCK_EXPERTS + BLOCK_RANKS] int32 workspace: a row per program
    arrivals_ptr,  # [1] int32 arrival counter, zero between launches
    status_ptr,  # [STATUS_WORDS] int32: the first bad id is recorded there (kernels.status)
    rank,  # this rank, as the record names it
    NUM_EXPERTS: tl.constexpr,  # experts in total
    NUM_RANKS: tl.constexpr,  # ranks of the group
    BLOCK_TOKENS: tl.constexpr,  # tokens counted at a time
    BLOCK_K: tl.constexpr,  # power of two >= max(K, 2)
    BLOCK_RANKS: tl.constexpr,  # power of two >= max(NUM_RANKS, 2)
    BLOCK_EXPERTS: tl.constexpr,  # power of two >= NUM_EXPERTS: one histogram bin per expert
    BLOCK_PROGRAMS: tl.constexpr,  # workspace rows summed at a time
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    in_rank_ptr = in_rank_ptr.to(tl.pointer_type(tl.int8))
    ranks = tl.arange(0, BLOCK_RANKS)
    bins = tl.arange(0, BLOCK_EXPERTS)
    expert_counts = tl.zeros((BLOCK_EXPERTS,), tl.int32)
    rank_counts = tl.zeros((BLOCK_RANKS,), tl.int32)
    bad = tl.zeros((BLOCK_TOKENS, BLOCK_K), tl.int32)  # reduced once, after the blocks
    for start in range(pid * BLOCK_TOKENS, num_tokens, num_programs * BLOCK_TOKENS):
        tokens = start + tl.arange(0, BLOCK_TOKENS)
        per_rank, per_expert, bad_here = count_block(
            topk_idx_ptr,
            tokens,
            num_tokens,
            K,
            in_rank_ptr,
            NUM_EXPERTS,
            NUM_RANKS,
            BLOCK_K,
            BLOCK_RANKS,
            BLOCK_EXPERTS,
        )
        rank_counts += per_rank
        expert_counts += per_expert
        bad = bad | bad_here
    if tl.max(tl.max(bad, 1), 0) > 0:  # the error path: the first bad id in token order
        # (whichever program met one finds the same)
        token, column, bad_id = first_bad_id(
            topk_idx_ptr, num_tokens, K, NUM_EXPERTS, BLOCK_K, BLOCK_TOKENS
        )
        record_bad_id(status_ptr, rank, LAYOUT_IDS, token, column, bad_id)
    row = partial_ptr + pid * (BLOCK_EXPERTS + BLOCK_RANKS)
    tl.store(row + bins, expert_counts)
    tl.store(row + BLOCK_EXPERTS + ranks, rank_counts)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == num_programs - 1:
        experts = tl.zeros((BLOCK_EXPERTS,), tl.int32)
        per_rank = tl.zeros((BLOCK_RANKS,), tl.int32)
        for first in range(0, num_programs, BLOCK_PROGRAMS):
            programs = first + tl.arange(0, BLOCK_PROGRAMS)
            rows = partial_ptr + programs[:, None] * (BLOCK_EXPERTS + BLOCK_RANKS)
            pmask = programs[:, None] < num_programs
            experts += tl.sum(
                tl.load(rows + bins[None, :], mask=pmask, other=0, volatile=True), axis=0
            )
            per_rank += tl.sum(
                tl.load(rows + BLOCK_EXPERTS + ranks[None, :], mask=pmask, other=0, volatile=True),
                axis=0,
            )
        tl.store(per_expert_ptr + bins, experts, mask=bins < NUM_EXPERTS)
        tl.store(per_rank_ptr + ranks, per_rank, mask=ranks < NUM_RANKS)
        tl.store(arrivals_ptr, 0)


def default_programs(device: torch.device) -> int:
    """Most programs of a layout launch: one per SM (4 under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class DispatchLayout:
    """``get_dispatch_layout`` for one owner (a mode, a buffer): its workspace, its status and
    its compiled variants, kept across calls.

    Args:
        device: where the ids live.
        num_experts: experts in total.
        num_ranks: ranks of the group.
        status: the owner's :class:`~tritonep.kernels.status.Status` (bad ids are recorded
            there), or None for one of its own.
        rank: this rank, as a bad-id record names it.
        num_programs: most programs per launch (default: :func:`default_programs`).
    """

    def __init__(
        self,
        device: torch.device,
        num_experts: int,
        num_ranks: int,
        status: Status | None = None,
        rank: int = 0,
        num_programs: int | None = None,
    ):
        self.device, self.num_experts, self.num_ranks = device, num_experts, num_ranks
        self.status = status if status is not None else Status(device)
        self.max_programs = num_programs or default_programs(device)
        self._bins = triton.next_power_of_2(num_experts)
        self._lanes = triton.next_power_of_2(max(num_ranks, 2))
        partial = torch.empty(
            self.max_programs, self._bins + self._lanes, dtype=torch.int32, device=device
        )
        arrivals = torch.zeros(1, dtype=torch.int32, device=device)
        self.shared = Shared.of(LayoutShared(partial, arrivals, self.status.words, rank))
        self._plans: dict[int, KernelLaunch] = {}

    def _plan(self, block_k: int) -> KernelLaunch:
        variant = LayoutVariant(
            NUM_EXPERTS=self.num_experts,
            NUM_RANKS=self.num_ranks,
            BLOCK_TOKENS=BLOCK_TOKENS,
            BLOCK_K=block_k,
            BLOCK_RANKS=self._lanes,
            BLOCK_EXPERTS=self._bins,
            BLOCK_PROGRAMS=BLOCK_PROGRAMS,
        )
        pointers = tuple(i for i, name in enumerate(LayoutCall._fields) if name.endswith("_ptr"))
        plan = KernelLaunch(
            dispatch_layout_kernel,
            (self.max_programs,),
            variant._asdict(),
            LayoutCall._fields,
            pointers,
        )
        self._plans[block_k] = plan
        return plan

    def __call__(self, topk_idx: torch.Tensor, num_programs: int | None = None, out=None):
        """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)`` of ``topk_idx`` (``[N, K]`` int64 on ``device``,
        checked by the caller); ``out``: the three outputs, preallocated."""
        num_tokens, topk = topk_idx.shape
        block_k = 2 if topk <= 2 else 1 << (topk - 1).bit_length()
        plan = self._plans.get(block_k) or self._plan(block_k)
        device = self.device
        if out is None:
            out = (
                torch.empty(self.num_ranks, dtype=torch.int32, device=device),
                torch.empty(self.num_experts, dtype=torch.int32, device=device),
                torch.empty((num_tokens, self.num_ranks), dtype=torch.bool, device=device),
            )
        if num_programs is None:
            num_programs = min(self.max_programs, -(-num_tokens // BLOCK_TOKENS)) or 1
        per_rank, per_expert, in_rank = out
        plan(
            LayoutCall(topk_idx, num_tokens, topk, per_rank, per_expert, in_rank),
            self.shared,
            (num_programs,),
        )
        return out


def dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    num_programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)`` of ``topk_idx [N, K]`` int64 (ids outside ``[0, E)`` count
    as none), through a :class:`DispatchLayout` made for this call (owners keep theirs).

    Args:
        num_programs: programs to launch (default: enough for the tokens, at most one per SM).
        out: optional preallocated outputs, in the order returned.
    """
    layout = DispatchLayout(topk_idx.device, num_experts, num_ranks, num_programs=num_programs)
    return layout(topk_idx, num_programs, out)
