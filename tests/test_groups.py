"""Expert-parallel groups smaller than the world (data parallel x expert parallel).

Four ranks form two expert-parallel groups of two, strided ({0, 2} and {1, 3}) so that a
rank's number in its group differs from its world rank. Both groups run at once, each on its
own inputs, and every output is checked against the reference of its group. Across nodes each
group spans two nodes of one GPU, so the mode makes its rail and node groups inside one
expert-parallel group while the other group makes its own.
"""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests import test_low_latency as tll
from tests import test_normal as tn
from tritonep import Buffer
from tritonep import reference as ref
from tritonep.buffer import ranks_per_node
from tritonep.modes import normal as nm
from tritonep.modes.internode import InternodeMode
from tritonep.modes.low_latency import LowLatencyMode
from tritonep.testing import make_case, tag_rows, verify_low_latency_call

H, EXPERTS_PER_RANK, TOPK = 128, 2, 3


def _ep_group(ctx):
    """This rank's group; every rank creates every group, in the same order."""
    groups = [dist.new_group(list(range(i, ctx.world_size, 2))) for i in range(2)]
    return groups[ctx.rank % 2], ctx.rank % 2


def _normal(ctx, group, which, internode):
    me, R, dev = dist.get_rank(group), dist.get_world_size(group), ctx.device
    E = EXPERTS_PER_RANK * R
    if internode:
        mode = InternodeMode(group, H, E, 1, max_topk=TOPK, device=dev, timeout_s=60)
    else:
        mode = nm.NormalMode(group, H, E, max_topk=TOPK, device=dev, timeout_s=60)
    for call in range(2):
        # The groups route differently (the seed) and send different numbers of tokens.
        tokens = [[6, 9], [0, 4]][which]
        case = tag_rows(make_case(300 + 10 * which + call, tokens, H, E, TOPK, "dropped"))
        idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
        out = mode.dispatch(case.x[me].to(dev), idx, w, expert_alignment=2)
        bias = (case.x[me] * 0.5).to(torch.bfloat16).to(dev)
        y = tn._combine_input(out, me)
        # Internode with one GPU per node: each node's sum is one row, so the sums across
        # the nodes round as the single-node reference does (bit for bit).
        combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights, bias)
        tn._verify(
            SimpleNamespace(rank=me), case, list(case.x), out, combined, combined_w, E, 2, 0, True
        )
    mode.check()
    mode.destroy()
    return mode.rail.group if internode else None


def _low_latency(ctx, group, which):
    me, R, dev = dist.get_rank(group), dist.get_world_size(group), ctx.device
    E, M = EXPERTS_PER_RANK * R, 8
    mode = LowLatencyMode(group, M, H, E, max_topk=TOPK, device=dev, timeout_s=60)
    for call in range(2):  # both buffer sets
        case = make_case(400 + 10 * which + call, [[5, 8], [3, 0]][which], H, E, TOPK)
        dev_case = case.to(dev)
        recv_x, recv_count, handle, _ = mode.dispatch(dev_case.x[me], dev_case.topk_idx[me])
        outputs = tll._expert_outputs(recv_x, True, me)
        combined, _ = mode.combine(
            outputs, dev_case.topk_idx[me], dev_case.topk_weights[me], handle
        )
        mode.check()
        verify_low_latency_call(
            me, case, M, True, False, recv_x, recv_count, handle, outputs, combined, group=group
        )
    mode.destroy()


def _layout(ctx, group, which):
    """The public buffer's layout counts ranks of its group, not of the world."""
    buffer = Buffer(group, device=ctx.device)
    R = dist.get_world_size(group)
    idx = make_case(500 + which, [7] * R, H, EXPERTS_PER_RANK * R, TOPK).topk_idx[0]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        idx.to(ctx.device), EXPERTS_PER_RANK * R
    )
    want = ref.dispatch_layout(idx, EXPERTS_PER_RANK * R, R)
    ref.assert_bitwise_equal(per_rank.cpu(), want.num_tokens_per_rank, "per rank")
    ref.assert_bitwise_equal(per_expert.cpu(), want.num_tokens_per_expert, "per expert")
    ref.assert_bitwise_equal(in_rank.cpu(), want.is_token_in_rank, "is_token_in_rank")
    buffer.destroy()


def _nodes_body(ctx):
    """How buffers find a group's nodes: world rank // LOCAL_WORLD_SIZE."""
    group, _ = _ep_group(ctx)
    uneven = dist.new_group([0, 1, 2])  # every rank makes it; rank 3 is no member
    saved = os.environ["LOCAL_WORLD_SIZE"]
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # nodes {0, 1} and {2, 3}
        found = [ranks_per_node(group), ranks_per_node(dist.group.WORLD)]
        if ctx.rank != 3:
            with pytest.raises(ValueError, match="node by node, as many on each node"):
                ranks_per_node(uneven)
        os.environ["LOCAL_WORLD_SIZE"] = "4"
        found.append(ranks_per_node(group))
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = saved
    return found


def test_buffers_find_a_groups_nodes(run_ranks):
    # A strided group has one rank on each node: two nodes of one GPU; the world: two of two.
    assert run_ranks(4, _nodes_body) == [[1, 2, None]] * 4


def _cycles_body(ctx):
    """Modes made and destroyed in a loop make their legs' groups once."""
    known = dist.distributed_c10d._world.pg_names
    group, _ = _ep_group(ctx)
    counts = []
    for ep, per_node in [(dist.group.WORLD, 2), (group, 1)]:
        for _ in range(3):
            InternodeMode(ep, H, 8, per_node, max_topk=TOPK, device=ctx.device).destroy()
            counts.append(len(known))
    return counts[1:3] == counts[:1] * 2 and counts[4:] == counts[3:4] * 2


def test_modes_made_in_a_loop_make_no_new_groups(run_ranks):
    assert run_ranks(4, _cycles_body) == [True] * 4


def _body(ctx, kind):
    group, which = _ep_group(ctx)
    if kind == "internode":
        # Rank 3 is no member, so it knows one group fewer than the others: the legs' groups
        # (named by torch.distributed after that number) must still meet.
        dist.new_group([0, 1, 2])
    if kind == "low_latency":
        _low_latency(ctx, group, which)
    elif kind == "layout":
        _layout(ctx, group, which)
    else:
        # Across nodes twice: the second mode reuses the legs' groups of the first.
        legs = [
            _normal(ctx, group, which, internode=kind == "internode")
            for _ in range(2 if kind == "internode" else 1)
        ]
        assert legs[-1] is legs[0]
    return dist.get_rank(group)


@pytest.mark.parametrize("kind", ["normal", "low_latency", "internode", "layout"])
def test_expert_parallel_groups_inside_the_world(run_ranks, kind):
    assert run_ranks(4, _body, kind, timeout=300) == [0, 0, 1, 1]
