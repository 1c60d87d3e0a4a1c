"""Shrink mode of the low-latency kernels: masked peers are skipped, a dead peer gets masked.

Every rank checks its own outputs against the reference of the inputs as shrink mode sees them
(:func:`tritonep.reference.without_ranks`: a masked rank sends nothing, choices of its experts
are dropped), bit for bit, with outputs poisoned before each call, and without collectives
(a dead rank would not take part in them).
"""

import pytest

from tests.conftest import gpu_ranks
from tests.test_low_latency import _expert_outputs
from tritonep import reference as ref
from tritonep.modes import low_latency as ll
from tritonep.testing import make_case


def _call(ctx, mode, case, use_fp8, hook, dead_dispatch, dead_combine, skip_combine=False):
    """One dispatch and combine of this rank, checked against the reference in which the
    ranks ``dead_dispatch`` (and for the combine ``dead_combine``) are masked."""
    me, M, E = ctx.rank, mode.max_tokens, case.num_experts
    dev = case.to(ctx.device)
    recv_x, recv_count, handle, recv_hook = mode.dispatch(
        dev.x[me], dev.topk_idx[me], use_fp8=use_fp8, return_recv_hook=hook
    )
    if hook:
        recv_hook()
    xs, ids = ref.without_ranks(case.x, case.topk_idx, E, dead_dispatch)
    wants = ref.low_latency_dispatch(xs, ids, M, E, use_fp8)
    got = ref.LowLatencyDispatchResult.from_outputs(recv_x, recv_count, handle)
    ref.assert_low_latency_dispatch_equal(got, wants[me], me)
    if skip_combine:
        return
    outputs = _expert_outputs(recv_x, use_fp8, me)
    combined, comb_hook = mode.combine(
        outputs, dev.topk_idx[me], dev.topk_weights[me], handle, return_recv_hook=hook
    )
    if hook:
        comb_hook()
    # Every rank's expert outputs as that rank computes them from the reference rows (they
    # are bit-equal to what it received), then the combine with the dead owners' ids dropped.
    ys = [
        _expert_outputs((w.recv_x, w.recv_x_scales) if use_fp8 else w.recv_x, use_fp8, r)
        for r, w in enumerate(wants)
    ]
    _, combine_ids = ref.without_ranks(case.x, case.topk_idx, E, dead_combine)
    weights = [w if r not in dead_combine else w[:0] for r, w in enumerate(case.topk_weights)]
    expected = ref.low_latency_combine(ys, combine_ids, weights, wants)[me]
    ref.assert_bitwise_equal(combined.cpu(), expected, f"rank {me} combined")


def _mask(mode):
    return [int(v) for v in mode.peer_mask.tolist()]


def _explicit_body(ctx, gpus_per_node):
    """The last rank and the others mask each other, then everyone unmasks (in step)."""
    R, me = ctx.world_size, ctx.rank
    last = R - 1
    mode = ll.LowLatencyMode(
        None,
        6,
        256,
        2 * R,
        max_topk=3,
        device=ctx.device,
        timeout_s=60,
        enable_shrink=True,
        gpus_per_node=gpus_per_node,
    )
    others = set(range(last))
    for peer in others if me == last else {last}:
        mode.peer_mask[peer] = 1
    seen = []
    for call, use_fp8 in enumerate([True, False, True]):
        case = make_case(50 + call, [6, 3, 5, 0][:R], 256, 2 * R, 3, "random")
        dead = others if me == last else {last}
        _call(ctx, mode, case, use_fp8, call == 1, dead, dead)
        seen.append(_mask(mode))
    mode.peer_mask.zero_()  # every rank at the same call: the counters still line up
    for call, use_fp8 in enumerate([False, True]):
        case = make_case(60 + call, [4, 6, 2, 5][:R], 256, 2 * R, 3, "dropped")
        _call(ctx, mode, case, use_fp8, call == 1, set(), set())
    mode.check()
    mode.destroy()
    return seen


def _assert_masks_seen(seen):
    """Each rank saw the masks of ``_explicit_body`` (the last rank and the others masking
    each other) at all three of its queries."""
    last = len(seen) - 1
    for rank, masks in enumerate(seen):
        want = [1] * last + [0] if rank == last else [0] * last + [1]
        assert masks == [want] * 3


@pytest.mark.parametrize("num_ranks,gpus_per_node", [(3, None), (4, 2)])
def test_masked_peers_are_skipped_and_can_be_unmasked_in_step(run_ranks, num_ranks, gpus_per_node):
    _assert_masks_seen(run_ranks(num_ranks, _explicit_body, gpus_per_node))


def _dead_peer_body(ctx, fail_at, timeout_s):
    """The last rank stops calling at ``fail_at``: the others mask it and go on without it."""
    R, me = ctx.world_size, ctx.rank
    last = R - 1
    mode = ll.LowLatencyMode(
        None, 5, 128, 2 * R, max_topk=2, device=ctx.device, timeout_s=60, enable_shrink=True
    )
    # Every kernel variant of the test, compiled by every rank under a long limit first: a
    # limit shorter than a peer's compilation would mask a live peer (seen on GPUs). A batch
    # of one token (rank 2's below) has a dispatch variant of its own.
    some, one = [5, 2, 4, 3], [1, 1, 1, 1]
    warm_up = [(False, False, some), (True, False, some), (False, True, some), (True, False, one)]
    if ctx.device.type != "cuda":
        # The interpreter builds no variants: one call (the FP8 one the timed calls begin
        # with) brings every rank's Python up to speed before the short limit.
        warm_up = warm_up[1:2]
    for call, (use_fp8, hook, tokens) in enumerate(warm_up):
        case = make_case(60 + call, tokens[:R], 128, 2 * R, 2, "random")
        _call(ctx, mode, case, use_fp8, hook, set(), set())
    mode.timeout_s = timeout_s
    if me == last:
        if fail_at == "combine":  # dispatches once more, then stops before the combine
            case = make_case(71, [3, 5, 1, 4][:R], 128, 2 * R, 2, "random")
            _call(ctx, mode, case, True, False, set(), set(), skip_combine=True)
        mode.destroy()  # waits in the collective for the others
        return None
    masks = [_mask(mode)]
    case = make_case(71, [3, 5, 1, 4][:R], 128, 2 * R, 2, "random")
    # Dies at dispatch: its rows are missing, and its experts are dropped from the combine
    # (it is masked once the dispatch gave up on it). Dies at combine: the dispatch is whole.
    at_dispatch = {last} if fail_at == "dispatch" else set()
    _call(ctx, mode, case, True, False, at_dispatch, {last})
    masks.append(_mask(mode))
    for call in range(2):  # masked from now on: nothing is waited for
        case = make_case(72 + call, [4, 4, 0, 2][:R], 128, 2 * R, 2, "skewed")
        _call(ctx, mode, case, call == 0, call == 1, {last}, {last})
    masks.append(_mask(mode))
    mode.check()  # no error: the dead peer was masked, not reported
    mode.destroy()
    return masks


@pytest.mark.parametrize("fail_at", ["dispatch", "combine"])
def test_a_dead_peer_is_masked_and_the_others_go_on(run_ranks, fail_at):
    # Under the interpreter a live peer on a loaded CPU may take seconds to send (its programs
    # run one after another): the limit leaves it room, and the dead peer costs that much.
    results = run_ranks(3, _dead_peer_body, fail_at, 5.0)
    assert results[2] is None
    for masks in results[:2]:
        assert masks == [[0, 0, 0], [0, 0, 1], [0, 0, 1]]


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize("fail_at", ["dispatch", "combine"])
def test_a_dead_peer_is_masked_on_gpus(run_ranks, fail_at):
    R = gpu_ranks()
    results = run_ranks(R, _dead_peer_body, fail_at, 2.0)
    assert results[-1] is None
    for masks in results[:-1]:
        assert masks == [[0] * R, [0] * (R - 1) + [1], [0] * (R - 1) + [1]]


@pytest.mark.gpu(n=2)
def test_masked_peers_are_skipped_on_gpus(run_ranks):
    _assert_masks_seen(run_ranks(gpu_ranks(), _explicit_body, None))
