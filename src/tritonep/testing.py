"""Inputs for tests and benchmarks: per-rank tokens, routing and weights from a seed.

Every rank can rebuild the inputs of every other rank from the same seed, so a rank can check
its own outputs against :mod:`tritonep.reference` without gathering anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import reference as ref
from .errors import WaitTimeoutError

ROUTINGS = ("random", "skewed", "dropped", "empty")


@dataclass
class Case:
    """Inputs of all ranks (lists indexed by rank; tensors on the CPU).

    Attributes:
        x: per rank ``[N_r, H]`` BF16.
        topk_idx: per rank ``[N_r, K]`` int64 global expert ids (``-1`` = none).
        topk_weights: per rank ``[N_r, K]`` float32, non-zero even where the id is ``-1``, so
            that tests see whether dropped choices are really skipped.
        num_experts: experts in total.
    """

    x: list[torch.Tensor]
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    num_experts: int

    @property
    def num_ranks(self) -> int:
        return len(self.x)

    def to(self, device: torch.device | str) -> Case:
        return Case(
            [t.to(device) for t in self.x],
            [t.to(device) for t in self.topk_idx],
            [t.to(device) for t in self.topk_weights],
            self.num_experts,
        )

    def copy_to(
        self, rank: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Case:
        """Copy ``rank``'s inputs into tensors that keep their storage (the static inputs of
        a captured CUDA graph, from :func:`static_inputs`); returns this case."""
        x.copy_(self.x[rank])
        topk_idx.copy_(self.topk_idx[rank])
        topk_weights.copy_(self.topk_weights[rank])
        return self


def static_inputs(num_tokens: int, hidden: int, topk: int, device: torch.device):
    """Empty ``x`` ``[N, H]`` BF16, ``topk_idx`` ``[N, K]`` int64 and ``topk_weights``
    ``[N, K]`` float32 for a CUDA graph to capture; :meth:`Case.copy_to` refills them."""
    return (
        torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device),
        torch.empty(num_tokens, topk, dtype=torch.int64, device=device),
        torch.empty(num_tokens, topk, dtype=torch.float32, device=device),
    )


def route(
    gen: torch.Generator, num_tokens: int, num_experts: int, topk: int, routing: str
) -> torch.Tensor:
    """``[num_tokens, topk]`` int64 expert ids, distinct within a token (``-1`` aside).

    ``random``: uniform; ``skewed``: every token names expert 0 first (one hot expert);
    ``dropped``: uniform with about a third of the choices ``-1``; ``empty``: all ``-1``.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
    if topk > num_experts:
        raise ValueError(f"topk: {topk} distinct experts out of {num_experts} are impossible")
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if routing == "skewed":
        scores[:, 0] = 2.0
    idx = scores.topk(topk, dim=1).indices
    if routing == "dropped":
        idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.33, -1, idx)
    if routing == "empty":
        idx = torch.full_like(idx, -1)
    return idx.long()


def make_case(
    seed: int,
    num_tokens: list[int],
    hidden: int,
    num_experts: int,
    topk: int,
    routing: str = "random",
    scale: float = 1.0,
) -> Case:
    """Random inputs for ``len(num_tokens)`` ranks, identical on every rank for one seed."""
    gen = torch.Generator().manual_seed(seed)
    xs, ids, weights = [], [], []
    for n in num_tokens:
        xs.append((torch.randn(n, hidden, generator=gen) * scale).to(torch.bfloat16))
        idx = route(gen, n, num_experts, topk, routing)
        ids.append(idx)
        weights.append(torch.rand(n, topk, generator=gen) + 0.01)
    return Case(xs, ids, weights, num_experts)


def tag_rows(case: Case) -> Case:
    """Make every row carry its origin: channel 0 = source rank, channels 1 and 2 = token index
    modulo 256 and divided by 256.

    All are integers below 257, exact in BF16, so a received row tells where it came from.
    """
    xs = []
    for rank, x in enumerate(case.x):
        x = x.clone()
        if x.shape[0]:
            x[:, 0] = rank
            tokens = torch.arange(x.shape[0])
            x[:, 1] = (tokens % 256).to(torch.bfloat16)
            x[:, 2] = (tokens // 256).to(torch.bfloat16)
        xs.append(x)
    return Case(xs, case.topk_idx, case.topk_weights, case.num_experts)


def _gather(obj, group=None):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def verify_low_latency_call(
    rank,
    case,
    max_tokens,
    use_fp8,
    use_ue8m0,
    recv_x,
    recv_count,
    handle,
    outputs,
    combined,
    group=None,
    logfmt=False,
) -> None:
    """Check one low-latency dispatch and combine of ``rank`` against the reference, bit for
    bit (collective: every rank calls it). ``outputs`` are the expert outputs combine was
    given; the reference combines them with the layout each rank actually produced. ``rank``
    is this rank's number in ``group`` (default: the whole world), whose members gather.
    With ``logfmt`` (a LogFMT combine) see :func:`assert_logfmt_combine_close`."""
    experts = case.num_experts
    want = ref.low_latency_dispatch(case.x, case.topk_idx, max_tokens, experts, use_fp8, use_ue8m0)[
        rank
    ]
    got = ref.LowLatencyDispatchResult.from_outputs(recv_x, recv_count, handle)
    ref.assert_low_latency_dispatch_equal(got, want, rank)
    # Only the valid rows travel (rows past the largest count are never read).
    valid = max(int(recv_count.max()) if recv_count.numel() else 0, 1)
    all_out = _gather(outputs[:, :valid].cpu(), group)
    compact = dataclasses.replace(
        got,
        recv_x=got.recv_x[:, :valid].view(torch.uint8),
        recv_x_scales=None,
        recv_src_info=got.recv_src_info[:, :valid],
    )
    all_got = _gather(compact, group)
    expected = ref.low_latency_combine(
        all_out, case.topk_idx, case.topk_weights, all_got, logfmt=logfmt
    )[rank]
    if not logfmt:
        ref.assert_bitwise_equal(combined.cpu(), expected, f"rank {rank} combined")
        return
    bounds = [ref.logfmt_error_bound(y) for y in all_out]
    weights = [w.abs() for w in case.topk_weights]
    bound = ref.low_latency_combine(bounds, case.topk_idx, weights, all_got)[rank]
    assert_logfmt_combine_close(combined.cpu(), expected, bound, f"rank {rank} combined")


def assert_logfmt_combine_close(got, expected, bound, what, min_exact=0.9) -> None:
    """A LogFMT combine against the reference: every channel within ``bound`` (float32, the
    weighted sum of one code step per term) plus BF16 rounding, NaN where the reference has
    NaN, and at least ``min_exact`` of the channels bit-identical (approximate ``log2`` and
    ``exp2`` on GPUs move a code only at a rounding boundary, so a systematic error such as
    a code off by one everywhere stays in the bound but fails this)."""
    got, expected = got.float(), expected.float()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN in other places"
    slack = bound + expected.abs() * 2.0**-7
    err = (got - expected).abs()
    bad = (err > slack) & ~nan
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} channels off, first {i}: got {got[tuple(i)]}, "
            f"expected {expected[tuple(i)]}, allowed error {slack[tuple(i)]}"
        )
    if got.numel():
        exact = ((got == expected) | nan).float().mean().item()
        assert exact >= min_exact, f"{what}: only {exact:.1%} of channels bit-identical"


def timeout_message(*calls) -> str:
    """Run ``calls`` in order: the message of the :class:`WaitTimeoutError` one of them
    raised, or ``"no error"``."""
    try:
        for call in calls:
            call()
    except WaitTimeoutError as e:
        return str(e)
    return "no error"
