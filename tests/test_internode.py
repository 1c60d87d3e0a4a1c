"""Internode modes on emulated nodes: groups of CPU ranks (or GPUs) act as nodes.

Normal mode: outputs must equal the single-node reference bit for bit (rows, local ids,
weights, source indices, per-expert counts, in (source rank, token) order); combine sums within
each node first, so it is compared within two BF16 roundings. Low-latency mode: peers on other
nodes are reached through staging and puts, and everything is bit-exact with the reference.
"""

import pytest
import torch

from tests import test_low_latency as tll
from tests import test_normal as tn
from tests.conftest import gpu_ranks
from tritonep import reference as ref
from tritonep.heap import shared_gpu
from tritonep.kernels.transport import VIA_STORE
from tritonep.modes.internode import InternodeMode
from tritonep.testing import make_case, tag_rows


def _body(
    ctx,
    gpus_per_node,
    tokens,
    hidden,
    experts_per_rank,
    topk,
    routing,
    use_fp8,
    worst=False,
    calls=2,
):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E = experts_per_rank * R
    mode = InternodeMode(None, hidden, E, gpus_per_node, max_topk=topk, device=dev, timeout_s=60)
    # The rail leg goes through staging (copies or NVSHMEM puts); the node leg stores.
    assert mode.rail.transport.via != VIA_STORE.value and mode.node.transport.via == VIA_STORE.value
    for call in range(calls):  # a second call: fresh inputs on a mode that has run
        case = tag_rows(make_case(40 + call, tokens[:R], hidden, E, topk, routing))
        xs = [ref.quantize_fp8(x) for x in case.x] if use_fp8 else list(case.x)
        x = tuple(t.to(dev) for t in xs[me]) if use_fp8 else xs[me].to(dev)
        idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
        rows = sum(tokens[:R]) if worst else 0  # bounds both legs here
        out = mode.dispatch(x, idx, w, expert_alignment=2, num_worst_tokens=rows)
        # A wait that gave up is named (rank, peer, phase) before any comparison, and each op
        # is checked before the next waits on its state.
        mode.check()
        want = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, E, 2)[me]
        n = want.num_recv_tokens
        ref.assert_rows_equal(out.recv_x, want.recv_x, n, f"rank {me} recv_x")
        ids, weights = out.recv_topk_idx, out.recv_topk_weights
        ref.assert_bitwise_equal(ids[:n].cpu(), want.recv_topk_idx, "recv_topk_idx")
        ref.assert_bitwise_equal(weights[:n].cpu(), want.recv_topk_weights, "weights")
        src = out.handle.recv_src_idx.cpu().long()
        assert src[:n].tolist() == want.recv_src_idx.tolist()
        per_expert = out.num_recv_tokens_per_expert
        if worst:
            assert ids.shape[0] == rows and bool((ids[n:] == -1).all())
            assert bool((src[n:] == -1).all()) and int(out.handle.host_info[0]) == n
            per_expert = per_expert.cpu().tolist()
        want_per_expert = want.num_recv_tokens_per_expert
        # On a mismatch, each leg's counts (rows, then per expert) say which leg went wrong.
        assert per_expert == want_per_expert, (
            me,
            call,
            per_expert,
            want_per_expert,
            [h.host_info.tolist() for h in (out.handle.rail, out.handle.node)],
        )

        # Combine: each row comes back scaled by its receiver; sums within 2 BF16 roundings.
        rows = ref.dequantize_fp8(*out.recv_x) if use_fp8 else out.recv_x.float()
        y = torch.nan_to_num(rows * (me + 1) / 4).to(torch.bfloat16)  # padding: poisoned
        combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights)
        mode.check()
        expected = torch.zeros(case.x[me].shape, dtype=torch.float64)
        base = ref.dequantize_fp8(*xs[me]) if use_fp8 else xs[me].float()
        owner = torch.where(case.topk_idx[me] >= 0, case.topk_idx[me] // experts_per_rank, -1)
        for d in range(R):
            went = (owner == d).any(dim=1, keepdim=True)
            expected += torch.where(went, base.double() * (d + 1) / 4, 0.0)
        # Per element: three BF16 roundings (the rows sent, each node's sum, the total) of
        # terms of one sign, each at most 2**-8 relative (BF16 keeps 8 significant bits), so
        # at most about 3 * 2**-8 (FP8 rows at top-8 reach 0.8%).
        err = (combined.double().cpu() - expected).abs()
        assert bool((err <= 3 * 2**-8 * expected.abs()).all()), (me, float(err.max()))
        kept = case.topk_idx[me] >= 0
        torch.testing.assert_close(combined_w.cpu()[kept], case.topk_weights[me][kept])

        # Cached: new rows (every rank's columns reversed) along the same routing.
        new_xs = [t.flip(1) for t in case.x]
        if use_fp8:
            new_xs = [ref.quantize_fp8(t) for t in new_xs]
        again = mode.dispatch(
            tuple(t.to(dev) for t in new_xs[me]) if use_fp8 else new_xs[me].to(dev),
            handle=out.handle,
        )
        mode.check()
        cached = ref.normal_dispatch(new_xs, case.topk_idx, None, E)[me]
        ref.assert_rows_equal(again.recv_x, cached.recv_x, n, f"rank {me} cached")
    mode.destroy()
    return True


# Every shape of group in BF16, two calls where both legs run (2x2) and on the odd group (3x1);
# FP8 with dropped choices where its scales cross both legs (2x2) and the network leg alone
# (4x1). One call elsewhere.
@pytest.mark.parametrize(
    "num_ranks, gpus_per_node, routing, use_fp8",
    [
        (4, 2, "random", False),
        (4, 1, "random", False),
        (4, 4, "random", False),
        (3, 1, "random", False),
        (4, 2, "dropped", True),
        (4, 1, "dropped", True),
    ],
    ids=["bf16-2x2", "bf16-4x1", "bf16-1x4", "bf16-3x1", "fp8-dropped-2x2", "fp8-dropped-4x1"],
)
def test_internode_matches_the_single_node_reference(
    run_ranks, num_ranks, gpus_per_node, routing, use_fp8
):
    tokens = [7, 4, 5, 0]  # ranks 1 and 2 both send: the legs deliver them out of order
    calls = 2 if not use_fp8 and (num_ranks, gpus_per_node) in ((4, 2), (3, 1)) else 1
    results = run_ranks(
        num_ranks,
        _body,
        gpus_per_node,
        tokens,
        128,
        2,
        3,
        routing,
        use_fp8,
        calls=calls,
        timeout=600,
    )
    assert results == [True] * num_ranks


# 3 nodes of one rank; worst-case sizing as 2 nodes of 2 runs in three of the intranode cases
# below (bf16-skewed-worst, fp8-topk8-worst, fp8-h160-worst).
@pytest.mark.parametrize("num_ranks, gpus_per_node", [(3, 1)], ids=["3x1"])
def test_internode_worst_case_sizes(run_ranks, num_ranks, gpus_per_node):
    results = run_ranks(
        num_ranks,
        _body,
        gpus_per_node,
        [7, 4, 5, 0],
        128,
        2,
        3,
        "dropped",
        False,
        True,
        timeout=600,
    )
    assert results == [True] * num_ranks


@pytest.mark.parametrize("name", [n for n in tn.CASES if n not in ("bf16-random", "fp8-dropped")])
def test_internode_runs_the_intranode_cases(run_ranks, name):
    # The single-node suite's other cases (skewed, hidden 2880 top-1, top-8, empty routing,
    # worst-case sizing), as 2 nodes of 2 ranks: one call each (a second call on the same mode
    # runs above, worst-case sizes included).
    tokens, hidden, experts, topk, routing, fp8, worst = tn.CASES[name]
    results = run_ranks(
        4, _body, 2, tokens, hidden, experts, topk, routing, fp8, worst > 0, calls=1, timeout=600
    )
    assert results == [True] * 4


def _release_body(ctx):
    tokens, hidden, experts, topk, routing, fp8, _ = tn.CASES["bf16-random"]
    args = (2, tokens, hidden, experts, topk, routing, fp8, False, 1)  # not worst, one call
    return tn.with_release_steps(2, _body, ctx, *args)


def test_relay_senders_may_release_their_tails_every_few_steps(run_ranks):
    # Staged rows of the network leg put as one range over several steps, as 2 nodes of 2.
    assert run_ranks(4, _release_body, timeout=600) == [True] * 4


def _overflow_body(ctx, rows):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    mode = InternodeMode(None, 128, E, 2, max_topk=3, device=dev, timeout_s=20)
    case = make_case(7, [7, 6, 5, 0], 128, E, 3, "random")
    want = ref.normal_dispatch(list(case.x), case.topk_idx, case.topk_weights, E)[me]
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    out = mode.dispatch(x, idx, num_worst_tokens=rows)
    try:  # (else the next call would raise it, after its launches)
        mode.check()
        outcome = "fits"
    except ValueError as e:  # a WaitTimeoutError (a hang, bounded) fails the test
        assert "num_worst_tokens" in str(e), e
        outcome = "overflow"
    assert outcome == "overflow" or want.num_recv_tokens <= rows
    # Raised once for both legs: the combine raises nothing, and must not wait.
    combined, _ = mode.combine(torch.nan_to_num(out.recv_x), out.handle)
    assert not bool(combined.isnan().any())
    # The ranks stay in step, so an exact-size call is whole.
    mode.check()
    again = mode.dispatch(x, idx)
    ref.assert_rows_equal(again.recv_x, want.recv_x, want.num_recv_tokens, f"rank {me} after")
    mode.check()
    mode.destroy()
    return outcome


def test_internode_worst_case_overflow_is_reported_not_waited_for(run_ranks):
    """Outputs too small for what arrives: the rank says so; a forwarder whose rows overflow
    relays none of them, so no GPU of its node waits for rows that were dropped."""
    results = run_ranks(4, _overflow_body, 4, timeout=300)
    assert "overflow" in results, results


def _gpu_nodes():
    """Ranks and GPUs per node of the GPU tests: the machine's GPUs (up to 4) as 2 nodes."""
    ranks = gpu_ranks()
    return ranks, max(ranks // 2, 1)


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize(
    "use_fp8, worst",
    [(False, False), (True, False), (False, True)],
    ids=["bf16", "fp8", "bf16-worst"],
)
def test_internode_on_gpus_as_2_nodes(run_ranks, use_fp8, worst):
    ranks, per_node = _gpu_nodes()
    tokens = [4096, 100, 0, 2000]
    results = run_ranks(
        ranks, _body, per_node, tokens, 7168, 64, 8, "random", use_fp8, worst, timeout=300
    )
    assert results == [True] * ranks


@pytest.mark.parametrize("num_ranks, gpus_per_node", [(4, 2), (3, 1)], ids=["2x2", "3x1"])
@pytest.mark.parametrize("name", ["fp8-ue8m0-hook", "bf16-skewed-dup"])
def test_low_latency_across_emulated_nodes(run_ranks, num_ranks, gpus_per_node, name):
    tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup = tll.CASES[name]
    results = run_ranks(
        num_ranks,
        tll._ll_body,
        2,
        tokens,
        hidden,
        experts,
        topk,
        routing,
        fp8,
        ue8m0,
        hook,
        dup,
        gpus_per_node,
    )
    assert results == [True] * num_ranks


@pytest.mark.parametrize(
    "name", [n for n in tll.CASES if n not in ("fp8-ue8m0-hook", "bf16-skewed-dup")]
)
def test_low_latency_runs_the_single_node_cases_across_nodes(run_ranks, name):
    # The other cases' shapes through staging and puts, as 2 nodes of one rank (every peer on
    # the other node), one call each: calls with both buffer sets, and peers on the rank's own
    # node beside those on others (2x2, 3x1), run across nodes above.
    tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup = tll.CASES[name]
    results = run_ranks(
        2, tll._ll_body, 1, tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup, 1
    )
    assert results == [True] * 2


@pytest.mark.parametrize("hidden", [384, 200])
def test_logfmt_combine_across_emulated_nodes(run_ranks, hidden):
    """LogFMT slots staged and put whole to the other node (2 nodes of 2 ranks); at hidden
    200, slots whose last group (72 channels) keeps a whole group's bytes (one call; both
    buffer sets at 384)."""
    tokens, _, experts, topk, routing, fp8, ue8m0, hook, dup = tll.CASES["bf16-random"]
    calls = 2 if hidden == 384 else 1
    results = run_ranks(
        4,
        tll._ll_body,
        calls,
        tokens,
        hidden,
        experts,
        topk,
        routing,
        fp8,
        ue8m0,
        hook,
        dup,
        2,
        logfmt=True,
    )
    assert results == [True] * 4


def _nvshmem_normal_body(ctx, use_fp8, per_node):
    from tritonep import heap

    heap.set_backend("NVSHMEM")  # before this process's first symmetric allocation
    assert _body(ctx, per_node, [4096, 100, 0, 2000], 7168, 64, 8, "random", use_fp8)
    mode = InternodeMode(None, 1024, 64, per_node, max_topk=8, device=ctx.device)
    via = (mode.rail.transport.via, mode.node.transport.via)
    mode.destroy()
    return via


@pytest.mark.gpu(n=2)
@pytest.mark.skipif(shared_gpu(), reason="NVSHMEM needs a GPU per rank")
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_internode_rail_leg_with_nvshmem_puts_on_gpus(use_fp8):
    from tritonep.kernels.transport import VIA_NVSHMEM
    from tritonep.launch import spawn

    ranks, per_node = _gpu_nodes()
    results = spawn(_nvshmem_normal_body, ranks, use_fp8, per_node, backend="nccl", timeout=400)
    assert results == [(VIA_NVSHMEM.value, VIA_STORE.value)] * ranks


def _nvshmem_ll_body(ctx, name, per_node):
    from tritonep import heap

    heap.set_backend("NVSHMEM")  # before this process's first symmetric allocation
    name, logfmt = name.removesuffix("-logfmt"), name.endswith("-logfmt")
    _, _, experts, topk, routing, fp8, ue8m0, hook, dup = tll.CASES[name]
    result = tll._ll_body(
        ctx,
        3,
        [128, 0, 77, 128],
        7168 if fp8 else 2048,
        experts * 4,
        topk,
        routing,
        fp8,
        ue8m0,
        hook,
        dup,
        per_node,
        logfmt,
    )
    assert result
    return heap.allocate(4096, device=ctx.device).backend


@pytest.mark.gpu(n=2)
@pytest.mark.skipif(shared_gpu(), reason="NVSHMEM needs a GPU per rank")
@pytest.mark.parametrize(
    "name", ["fp8-random", "bf16-skewed-dup", "fp8-ue8m0-hook", "fp8-random-logfmt"]
)
def test_low_latency_across_2_nodes_with_nvshmem_puts(name):
    from tritonep.launch import spawn

    # Fresh processes: the NVSHMEM backend must be chosen before any allocation.
    ranks, per_node = _gpu_nodes()
    results = spawn(_nvshmem_ll_body, ranks, name, per_node, backend="nccl", timeout=400)
    assert results == ["NVSHMEM"] * ranks


def _stuck_rank_body(ctx):
    """Rank 3 of 2 nodes x 2 GPUs skips the second dispatch; the others report whom they
    waited for. The first call compiles every kernel on every rank, so that none is late
    for the short limit."""
    from tritonep.errors import WaitTimeoutError

    mode = InternodeMode(
        None, 128, 8, 2, max_topk=2, device=ctx.device, max_sms=2, ring_tokens=8, timeout_s=60
    )
    x = torch.ones(4, 128, dtype=torch.bfloat16, device=ctx.device)
    idx = torch.tensor([[0, 7], [2, 6], [4, 1], [6, 3]], device=ctx.device)
    mode.dispatch(x, idx, num_worst_tokens=32)
    mode.check()
    mode.timeout_s = 2.0  # compiles nothing
    if ctx.rank == 3:
        return "skipped"
    try:
        mode.dispatch(x, idx, num_worst_tokens=32)
        mode.check()
    except WaitTimeoutError as e:
        return str(e).split(";")[0]
    return "no error"


def test_internode_timeouts_name_ranks_of_the_whole_group_and_the_leg(run_ranks):
    # The legs are groups of their own (rank 1's rail leg holds ranks 1 and 3, node 1 holds
    # ranks 2 and 3), but errors name ranks as the caller's group does.
    first, *others = run_ranks(4, _stuck_rank_body)
    assert others == [
        "rank 1 timed out after 2 s in phase 'rail notify' waiting for peer 3",
        "rank 2 timed out after 2 s in phase 'node notify' waiting for peer 3",
        "skipped",
    ]
    # Rank 0 needs nothing from rank 3 itself. Whether it waits in vain for rank 1 (stuck in
    # its rail leg until that leg's limit, and its forwarders then) depends on timing: if it
    # does, it names rank 1 and its node leg.
    node_wait = first.startswith("rank 0 timed out after 2 s in phase 'node ")
    assert first == "no error" or (node_wait and first.endswith("waiting for peer 1")), first


def _buffer_body(ctx):
    """Through the DeepEP-like Buffer: per-node counts, dispatch, combine, cached dispatch,
    then low-latency dispatch and combine across the nodes."""
    from tritonep import Buffer

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E, tokens = 2 * R, [6, 0, 5, 4]
    case = tag_rows(make_case(9, tokens, 128, E, 3, "dropped"))
    buffer = Buffer(device=dev, gpus_per_node=2)
    x, idx, w = case.x[me].to(dev), case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    owner_node = torch.where(case.topk_idx[me] >= 0, case.topk_idx[me] // 4, -1)
    assert per_node.cpu().tolist() == [int((owner_node == n).any(1).sum()) for n in range(2)]
    recv_x, recv_idx, _, counts, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_node,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )
    want = ref.normal_dispatch(case.x, case.topk_idx, case.topk_weights, E)[me]
    ref.assert_bitwise_equal(recv_x.cpu(), want.recv_x, f"rank {me} recv_x")
    ref.assert_bitwise_equal(recv_idx.cpu(), want.recv_topk_idx, f"rank {me} recv_topk_idx")
    assert counts == want.num_recv_tokens_per_expert
    combined, _, _ = buffer.combine(recv_x, handle)
    went = in_rank.sum(1, keepdim=True).clamp_min(1).cpu()
    sent = in_rank.any(1).cpu()
    back = combined.float().cpu()[sent] / went[sent]
    torch.testing.assert_close(back, case.x[me].float()[sent], rtol=1e-2, atol=0)
    # Cached: new rows (columns reversed) along the same routing.
    new_xs = [t.flip(1) for t in case.x]
    again, *_ = buffer.dispatch(new_xs[me].to(dev), handle=handle)
    cached = ref.normal_dispatch(new_xs, case.topk_idx, None, E)[me]
    ref.assert_bitwise_equal(again.cpu(), cached.recv_x, f"rank {me} cached")
    # Low-latency calls reach the other node through staging: identity experts give back
    # x times the sum of the valid weights (DeepEP's check), bit for bit with the reference.
    recv, count, ll_handle, _, _ = buffer.low_latency_dispatch(x, idx, 8, E, use_fp8=False)
    got = ref.LowLatencyDispatchResult.from_outputs(recv, count, ll_handle)
    ll_want = ref.low_latency_dispatch(case.x, case.topk_idx, 8, E, use_fp8=False)[me]
    ref.assert_low_latency_dispatch_equal(got, ll_want, me)
    combined, _, _ = buffer.low_latency_combine(recv, idx, w, ll_handle)
    weight = torch.where(case.topk_idx[me] >= 0, case.topk_weights[me], 0).sum(1, keepdim=True)
    expected = (case.x[me].float() * weight).to(torch.bfloat16)
    torch.testing.assert_close(combined.cpu(), expected, rtol=1e-2, atol=1e-2)
    assert buffer._ll.num_nodes == 2
    buffer.destroy()
    return True


def test_buffer_spans_emulated_nodes(run_ranks):
    assert run_ranks(4, _buffer_body) == [True] * 4


def _trace_body(ctx, tmp):
    import json

    from tritonep import Buffer

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    case = make_case(2, [4, 3, 0, 5], 128, 2 * R, 2)
    buffer = Buffer(device=dev, gpus_per_node=2, profile=True)
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    _, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 2 * R)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x, topk_idx=idx, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank
    )
    buffer.combine(recv_x, handle)
    path = buffer.dump_trace(f"{tmp}/internode-{{rank}}.json")
    buffer.destroy()
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {me}
    return sorted({e["name"] for e in events})


def test_internode_traces_show_both_legs(run_ranks, tmp_path):
    for names in run_ranks(4, _trace_body, str(tmp_path)):
        for leg in ("rail", "node"):
            for op in ("notify: notify", "dispatch: send", "dispatch: receive", "combine: send"):
                assert f"{leg} {op}" in names, (leg, op, names)


def _overlap_body(ctx, tmp):
    import json

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    per_node = max(R // 2, 1)
    E = 16 * R
    mode = InternodeMode(None, 7168, E, per_node, max_topk=8, device=dev, profile=True)
    case = make_case(5, [4096] * R, 7168, E, 8, "random")
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    w = case.topk_weights[me].to(dev)
    out = mode.dispatch(x, idx, w, num_worst_tokens=4096 * R)
    handle = out.handle
    # Cached calls launch both legs back to back, so the overlap does not hang on the host's
    # pace. (A full call launches the relay after the node leg's notify: on 2 H100s with nodes
    # of one GPU, one rank's network leg once ended 127 us before that launch.) Even so the
    # host can be late between two launches (once 455 us on one rank, against a network leg
    # of 364 us): of three traced calls (compiled kernels, after one untraced), one that
    # overlaps shows that the legs' kernels are resident at once and the relay reads rows
    # while they arrive.
    out = mode.dispatch(x, handle=handle)
    mode.combine(torch.nan_to_num(out.recv_x), handle)
    overlaps = []
    for call in range(3):
        mode.trace.clear()
        out = mode.dispatch(x, handle=handle)
        mode.combine(torch.nan_to_num(out.recv_x), handle)
        mode.check()
        path = mode.trace.dump(f"{tmp}/overlap-{me}-{call}.json")
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]

        def span(name, events=events):
            picked = [e for e in events if e["name"] == name]
            return min(e["ts"] for e in picked), max(e["ts"] + e["dur"] for e in picked)

        # The reading leg starts while the writing leg still runs.
        names = (
            "rail dispatch: receive",
            "node dispatch: send",
            "node combine: receive",
            "rail combine: send",
        )
        spans = {name: span(name) for name in names}
        print(
            f"overlap rank {me} call {call} (us):",
            {k: (round(a), round(b)) for k, (a, b) in spans.items()},
        )
        overlaps.append(
            (
                spans["node dispatch: send"][0] < spans["rail dispatch: receive"][1],
                spans["rail combine: send"][0] < spans["node combine: receive"][1],
            )
        )
    mode.destroy()
    return any(d for d, _ in overlaps), any(c for _, c in overlaps)


@pytest.mark.gpu(n=2)
def test_internode_legs_run_at_once_on_gpus(run_ranks, tmp_path):
    """The relay reads the network leg's rows while they arrive (and combine likewise): the
    two legs' kernels run at the same time, not one after the other."""
    if shared_gpu():
        # Ranks that share a GPU take turns on it (time slices per process): a rank's second
        # launch can wait for other ranks' slices, whatever this rank's streams allow.
        pytest.skip("needs a GPU per rank (ranks sharing a GPU take turns)")
    ranks, _ = _gpu_nodes()
    assert run_ranks(ranks, _overlap_body, str(tmp_path), timeout=300) == [(True, True)] * ranks


def test_check_reads_both_legs_and_raises_a_timeout_first():
    """An overflow is cleared when its leg's check raises it, so check() must read both legs
    (else the second leg's overflow came back at the next check), and a timeout, which is
    what stops the job, wins over an overflow."""
    from tritonep.errors import WaitTimeoutError

    class Leg:
        def __init__(self, error):
            self.error, self.checks = error, 0

        def check(self):
            self.checks += 1
            if self.error is not None:
                raise self.error

    mode = InternodeMode.__new__(InternodeMode)  # the legs alone: no process group needed
    timeout = WaitTimeoutError(2, 3, "node notify", 1.0)
    mode.rail, mode.node = Leg(ValueError("num_worst_tokens: rail")), Leg(timeout)
    with pytest.raises(WaitTimeoutError) as raised:
        mode.check()
    assert raised.value is timeout and mode.rail.checks == mode.node.checks == 1
    mode.rail, mode.node = Leg(ValueError("num_worst_tokens: rail")), Leg(ValueError("node"))
    with pytest.raises(ValueError, match="rail"):
        mode.check()
    assert mode.node.checks == 1
    mode.rail, mode.node = Leg(None), Leg(None)
    mode.check()
