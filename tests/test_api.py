"""The public low-latency APIs (DeepEP-like Buffer, seed layer) against the reference."""

import pytest
import torch

from tests.test_low_latency import _expert_outputs, _verify_call
from tritonep.api import Buffer, EPLowLatencyAllToAllLayer
from tritonep.testing import make_case


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
        assert len(handle) == 6 and handle[2:5] == (M, H, E)
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


def _layer_body(ctx, online_quant_fp8):
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 4, 128, 2 * R, 2
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


def _layer_arg_errors(ctx):
    messages = []
    for kwargs in [dict(rank=5), dict(fp8_gsize=64), dict(dtype=torch.float16)]:
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
    assert run_ranks(2, _layer_arg_errors) == [["rank, world_size", "fp8_gsize", "dtype"]] * 2


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
