"""The public low-latency APIs (Buffer, Triton-distributed's layer) against the reference."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import gpu_ranks
from tests.test_low_latency import _expert_outputs, _verify_call
from tests.test_normal import _combine_input, _to, _verify
from tritonep import Buffer
from tritonep.heap import shared_gpu
from tritonep.integrations import EPLowLatencyAllToAllLayer
from tritonep.testing import make_case, static_inputs


def _buffer_body(ctx, hook):
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 5, 256, 4 * R, 3
    buffer = Buffer(
        None,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
        low_latency_mode=True,
        device=ctx.device,
    )
    stats = torch.zeros(E // R, dtype=torch.int32, device=ctx.device)
    total = torch.zeros(E // R, dtype=torch.int32)
    for call in range(3):
        case = make_case(50 + call, [M, 3, 0, 4][:R], H, E, K, "dropped")
        x, idx = case.x[me].to(ctx.device), case.topk_idx[me].to(ctx.device)
        w = case.topk_weights[me].to(ctx.device)
        recv_x, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=hook
        )
        assert (recv_hook is not None) == hook and event.event is None
        if hook:
            recv_hook()
        assert len(handle) == 8 and handle[2:5] == (M, H, E)
        total += recv_count.cpu()
        outputs = _expert_outputs(recv_x, True, me)
        buf = buffer.get_next_low_latency_combine_buffer(handle)
        buf.copy_(outputs)
        combined, event, comb_hook = buffer.low_latency_combine(
            buf, idx, w, handle, zero_copy=True, return_recv_hook=hook
        )
        if hook:
            comb_hook()
        buffer.check()
        _verify_call(ctx, case, M, True, False, recv_x, recv_count, handle, outputs, combined)
    assert torch.equal(stats.cpu(), total)  # the DeepEP statistic: received per local expert
    with pytest.raises(ValueError, match="must stay"):
        buffer.low_latency_dispatch(x, idx, M + 1, E)
    buffer.destroy()
    return True


@pytest.mark.parametrize("hook", [False, True])
def test_buffer_low_latency(run_ranks, hook):
    assert run_ranks(2, _buffer_body, hook) == [True, True]


def _layer_body(ctx, online_quant_fp8, H=128):
    R, me = ctx.world_size, ctx.rank
    M, E, K = 4, 2 * R, 2
    layer = EPLowLatencyAllToAllLayer(M, H, K, online_quant_fp8, me, E, R, R)
    case = make_case(9, [M] * R, H, E, K, "random")
    x, idx = case.x[me].to(ctx.device), case.topk_idx[me].to(ctx.device)
    w = case.topk_weights[me].to(ctx.device)
    recv_token, recv_scale, count, meta = layer.dispatch(x, None, idx)
    assert (recv_scale is not None) == online_quant_fp8
    recv = (recv_token, recv_scale) if online_quant_fp8 else recv_token
    outputs = _expert_outputs(recv, online_quant_fp8, me)
    combined = layer.combine(outputs, idx, w, meta)
    layer.mode.check()
    _verify_call(ctx, case, M, online_quant_fp8, False, recv, count, meta, outputs, combined)
    with pytest.raises(ValueError, match="send_scales"):
        layer.dispatch(x, torch.ones(M, 1, device=ctx.device), idx)
    layer.finalize()
    return True


@pytest.mark.parametrize("fp8", [True, False])
def test_seed_low_latency_layer(run_ranks, fp8):
    assert run_ranks(2, _layer_body, fp8) == [True, True]


def test_seed_low_latency_layer_at_a_partial_group(run_ranks):
    # Hidden 200: the last group of 128 channels holds 72 and has a scale of its own.
    assert run_ranks(2, _layer_body, True, 200) == [True, True]


def _layer_arg_errors(ctx):
    messages = []
    bad = [dict(rank=5), dict(fp8_gsize=64), dict(dtype=torch.float16), dict(local_world_size=3)]
    for kwargs in bad:
        args = dict(
            max_m=4,
            hidden=128,
            topk=2,
            online_quant_fp8=True,
            rank=ctx.rank,
            num_experts=4,
            local_world_size=2,
            world_size=2,
        )
        args.update(kwargs)
        try:
            EPLowLatencyAllToAllLayer(**args)
        except (TypeError, ValueError) as e:
            messages.append(str(e).split(":")[0])
    return messages


def test_seed_layer_rejects_bad_arguments(run_ranks):
    want = ["rank, world_size", "fp8_gsize", "dtype", "local_world_size"]
    assert run_ranks(2, _layer_arg_errors) == [want] * 2


def _layout_body(ctx):
    from tritonep import reference as ref
    from tritonep.testing import route

    buffer = Buffer(None, device=ctx.device)
    for seed, tokens in enumerate([0, 5, 300]):
        idx = route(torch.Generator().manual_seed(seed), tokens, 16, 4, "dropped").to(ctx.device)
        per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(idx, 16)
        assert per_rdma is None and event.event is None
        want = ref.dispatch_layout(idx.cpu(), 16, ctx.world_size)
        ref.assert_bitwise_equal(per_rank.cpu(), want.num_tokens_per_rank, "per rank")
        ref.assert_bitwise_equal(per_expert.cpu(), want.num_tokens_per_expert, "per expert")
        ref.assert_bitwise_equal(in_rank.cpu(), want.is_token_in_rank, "is_token_in_rank")
    with pytest.raises(ValueError, match="num_experts"):
        buffer.get_dispatch_layout(idx, 15)
    return True


def test_buffer_dispatch_layout(run_ranks):
    assert run_ranks(2, _layout_body) == [True, True]


def _buffer_normal_body(ctx, num_tokens, use_fp8, async_finish, copy_combine_tokens=0):
    """DeepEP's intranode checks through Buffer: rows carry their source; counts per rank and
    per expert match an all-gathered expectation; combine(dispatch(x)) / ranks reached == x
    (over the rings, or over copy engines with ``copy_combine_tokens``)."""
    from tritonep import reference as ref
    from tritonep.testing import tag_rows

    R, me = ctx.world_size, ctx.rank
    H, E, K = 256, 8 * R, 4
    buffer = Buffer(
        None, device=ctx.device, copy_combine_tokens=copy_combine_tokens, copy_combine_min_tokens=0
    )
    case = tag_rows(make_case(77, [num_tokens] * R, H, E, K, "dropped"))
    x, idx = case.x[me].to(ctx.device), case.topk_idx[me].to(ctx.device)
    w = case.topk_weights[me].to(ctx.device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    previous = Buffer.capture()
    send = tuple(t.to(ctx.device) for t in ref.quantize_fp8(case.x[me])) if use_fp8 else x
    recv_x, recv_idx, recv_w, per_expert_list, handle, event = buffer.dispatch(
        send,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
        previous_event=previous,
        async_finish=async_finish,
    )
    assert (event.event is not None) == (async_finish and ctx.device.type == "cuda")
    event.current_stream_wait()
    rows = ref.dequantize_fp8(*recv_x) if use_fp8 else recv_x.float()
    # Every row says where it came from: channel 0 = source rank, 1 and 2 = token index.
    got_src = rows[:, 0].round().long().cpu()
    got_token = (rows[:, 1] + 256 * rows[:, 2]).round().long().cpu()
    if not use_fp8:
        assert torch.equal(got_token, handle.recv_src_idx.cpu().long())
    # Counts per source rank and per expert against an all-gathered expectation.
    gathered = [torch.zeros(R, dtype=torch.int32, device=ctx.device) for _ in range(R)]
    torch.distributed.all_gather(gathered, per_rank)
    want_per_src = torch.stack([g[me] for g in gathered]).cpu()
    assert torch.equal(torch.bincount(got_src, minlength=R).to(torch.int32), want_per_src)
    assert bool((got_src[1:] >= got_src[:-1]).all()), "rows are ordered by source rank"
    all_per_expert = [torch.zeros(E, dtype=torch.int32, device=ctx.device) for _ in range(R)]
    torch.distributed.all_gather(all_per_expert, per_expert)
    mine = torch.stack(all_per_expert).sum(0)[me * (E // R) : (me + 1) * (E // R)]
    assert per_expert_list == mine.cpu().tolist()
    for local in range(E // R):
        assert int((recv_idx == local).sum()) == per_expert_list[local]
    # combine(dispatch(x)) divided by the ranks each token reached is x (BF16 payloads).
    combined, combined_w, event = buffer.combine(
        recv_x if not use_fp8 else rows.to(torch.bfloat16),
        handle,
        topk_weights=recv_w,
        async_finish=async_finish,
    )
    event.current_stream_wait()
    reached = in_rank.sum(1, keepdim=True).clamp_min(1)
    # What was sent, as combine got it back (FP8 rows de-quantized and rounded to BF16).
    sent_x = ref.dequantize_fp8(*ref.quantize_fp8(case.x[me])).to(torch.bfloat16) if use_fp8 else x
    # DeepEP's measure: 1 - 2 <a, b> / (|a|^2 + |b|^2), over the tokens sent somewhere.
    a, b = (combined.float() / reached).double(), sent_x.to(ctx.device).double()
    sent = in_rank.any(1)
    a, b = a[sent], b[sent]
    diff = 1 - 2 * (a * b).sum() / (a * a + b * b).sum().clamp_min(1e-30)
    assert float(diff) < 5e-6, float(diff)
    # Weights come back summed: each weight arrives on exactly one rank.
    assert torch.equal(combined_w, torch.where(idx >= 0, w, torch.zeros_like(w)))
    copies = buffer._normal.copy_combine
    assert (copies is not None and int(copies.state[0]) == 1) == bool(copy_combine_tokens)
    # Cached mode moves only x: new rows (every rank's columns reversed) along the same routing.
    new_xs = [t.flip(1) for t in case.x]
    if use_fp8:
        new_xs = [ref.quantize_fp8(t) for t in new_xs]
    again = buffer.dispatch(_to(new_xs[me], ctx.device), handle=handle)[0]
    want = ref.normal_dispatch(new_xs, case.topk_idx, None, E)[me]
    ref.assert_rows_equal(again, want.recv_x, want.num_recv_tokens, f"rank {me} cached")
    buffer.check()
    buffer.destroy()
    return True


@pytest.mark.parametrize("use_fp8", [False, True])
def test_buffer_normal_deep_ep_checks(run_ranks, use_fp8):
    assert run_ranks(2, _buffer_normal_body, 37, use_fp8, False) == [True, True]


def test_buffer_normal_deep_ep_checks_with_copy_engine_combine(run_ranks):
    assert run_ranks(3, _buffer_normal_body, 37, False, False, 40) == [True] * 3


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize("copy_combine_tokens", [0, 3000], ids=["rings", "copy-engines"])
@pytest.mark.parametrize("async_finish", [False, True])
def test_buffer_normal_deep_ep_checks_on_gpus(run_ranks, async_finish, copy_combine_tokens):
    # (with async_finish the calls run on the buffer's communication stream, the copies too)
    n = gpu_ranks()
    args = (3000, False, async_finish, copy_combine_tokens)
    assert run_ranks(n, _buffer_normal_body, *args) == [True] * n


def _buffer_graph_body(ctx, replays):
    """Buffer calls of both modes in CUDA graphs, as serving code captures them: the
    communication stream, its events and the receive statistic inside the capture; every
    replay, with new inputs, against the reference."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    N, H, E, K = 64, 512, 4 * R, 3
    buffer = Buffer(device=dev, timeout_s=60)
    x, idx, w = static_inputs(N, H, K, dev)
    stats = torch.zeros(E // R, dtype=torch.int32, device=dev)

    def load(seed):
        return make_case(seed, [N] * R, H, E, K, "dropped").copy_to(me, x, idx, w)

    def normal_step():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
            num_worst_tokens=N * R,
        )
        out = SimpleNamespace(
            recv_x=recv_x,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_tokens_per_expert=counts,
            handle=handle,
        )
        combined, combined_w, _ = buffer.combine(_combine_input(out, me), handle, recv_w)
        return out, combined, combined_w

    def ll_step():
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, idx, N, E, cumulative_local_expert_recv_stats=stats
        )
        outputs = _expert_outputs(recv_x, True, me)
        combined, _, _ = buffer.low_latency_combine(outputs, idx, w, handle)
        return recv_x, recv_count, handle, outputs, combined

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(0)
        normal_step()  # compile outside the capture
        eager_count = ll_step()[1]
        torch.cuda.synchronize()
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
        with torch.cuda.graph(graphs[0], stream=stream):
            normal = normal_step()
        with torch.cuda.graph(graphs[1], stream=stream):
            low_latency = ll_step()
    torch.cuda.synchronize()
    total = eager_count.cpu()  # the statistic counts the eager call too
    for replay in range(replays):
        case = load(1 + replay)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        buffer.check()
        _verify(ctx, case, list(case.x), *normal, E, 1, N * R, False)
        _verify_call(ctx, case, N, True, False, *low_latency)
        total += low_latency[1].cpu()
    assert torch.equal(stats.cpu(), total), "replays add to the receive statistic"
    buffer.destroy()
    return replays


@pytest.mark.gpu(n=2)
def test_buffer_calls_in_cuda_graphs_replayed_with_new_inputs(run_ranks):
    replays = 3 if shared_gpu() else 30  # ranks sharing one GPU take turns on it
    results = run_ranks(gpu_ranks(), _buffer_graph_body, replays, timeout=240)
    assert results == [replays] * gpu_ranks()
