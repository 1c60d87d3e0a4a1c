"""The torch backend (all_to_all_single) must produce the reference results bit for bit."""

import pytest
import torch

from tritonep import reference as ref
from tritonep.testing import make_case, tag_rows
from tritonep.torch_backend import TorchBackend

CASES = [
    # (num_tokens per rank, hidden, experts, topk, routing)
    ([7, 0, 12, 5], 256, 8, 3, "random"),
    ([9, 9, 9, 9], 128, 12, 1, "skewed"),
    ([4, 11, 0, 6], 128, 16, 8, "dropped"),
    ([3, 2, 5, 4], 128, 4, 4, "empty"),
    ([16, 1, 8, 3], 384, 32, 16, "random"),
]


def _normal_body(ctx, seed, tokens, hidden, experts, topk, routing, alignment, fp8):
    R = ctx.world_size
    case = tag_rows(make_case(seed, tokens[:R], hidden, experts, topk, routing))
    xs = [ref.quantize_fp8(x) for x in case.x] if fp8 else case.x
    # Alignment only rounds the per-expert counts; rows are the same for every alignment.
    all_out = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, experts, alignment)
    expected = all_out[ctx.rank]
    dev = case.to(ctx.device)
    x = tuple(t.to(ctx.device) for t in xs[ctx.rank]) if fp8 else dev.x[ctx.rank]
    backend = TorchBackend()

    layout = backend.get_dispatch_layout(dev.topk_idx[ctx.rank], experts)
    exp_layout = ref.dispatch_layout(case.topk_idx[ctx.rank], experts, R)
    for got, want in zip(layout, exp_layout, strict=True):
        ref.assert_bitwise_equal(got, want, f"rank {ctx.rank} layout")

    recv_x, recv_idx, recv_w, counts, handle = backend.dispatch(
        x, dev.topk_idx[ctx.rank], dev.topk_weights[ctx.rank], experts, alignment
    )
    if fp8:
        ref.assert_bitwise_equal(recv_x[0], expected.recv_x[0], "recv_x payload")
        ref.assert_bitwise_equal(recv_x[1], expected.recv_x[1], "recv_x scales")
    else:
        ref.assert_bitwise_equal(recv_x, expected.recv_x, "recv_x")
        # Tagged rows name their origin: source rank and token index.
        if recv_x.shape[0]:
            assert torch.equal(recv_x[:, 0].long().cpu(), expected.recv_src_rank)
            src_idx = recv_x[:, 1].long() + 256 * recv_x[:, 2].long()
            assert torch.equal(src_idx.cpu(), expected.recv_src_idx)
    ref.assert_bitwise_equal(recv_idx, expected.recv_topk_idx, "recv_topk_idx")
    ref.assert_bitwise_equal(recv_w, expected.recv_topk_weights, "recv_topk_weights")
    assert counts == expected.num_recv_tokens_per_expert

    # Combine: each rank hands back rows (here: its received rows scaled by rank + 1).
    back = [
        ((r.recv_x[0].float() if fp8 else r.recv_x.float()) * (d + 1)).to(torch.bfloat16)
        for d, r in enumerate(all_out)
    ]
    want = ref.normal_combine(
        back, all_out, tokens[:R], recv_topk_weights=[o.recv_topk_weights for o in all_out]
    )[ctx.rank]
    combined, combined_w = backend.combine(back[ctx.rank].to(ctx.device), handle, recv_w)
    ref.assert_bitwise_equal(combined, want[0], "combined_x")
    ref.assert_bitwise_equal(combined_w, want[1], "combined_topk_weights")
    return recv_x[0].shape[0] if fp8 else recv_x.shape[0]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[4] + str(i) for i, c in enumerate(CASES)])
def test_normal_mode(run_ranks, num_ranks, case):
    tokens, hidden, experts, topk, routing = case
    experts = experts - experts % num_ranks or num_ranks
    topk = min(topk, experts)
    received = run_ranks(
        num_ranks, _normal_body, 1000 + num_ranks, tokens, hidden, experts, topk, routing, 1, False
    )
    assert len(received) == num_ranks


@pytest.mark.parametrize("alignment,fp8", [(4, False), (1, True), (128, True)])
def test_normal_mode_fp8_and_alignment(run_ranks, alignment, fp8):
    run_ranks(3, _normal_body, 7, [6, 0, 9], 256, 6, 2, "random", alignment, fp8)


def _low_latency_body(
    ctx, seed, tokens, max_tokens, hidden, experts, topk, routing, use_fp8, ue8m0
):
    R = ctx.world_size
    case = make_case(seed, tokens[:R], hidden, experts, topk, routing)
    expected_all = ref.low_latency_dispatch(
        case.x, case.topk_idx, max_tokens, experts, use_fp8, ue8m0
    )
    dev = case.to(ctx.device)
    backend = TorchBackend()
    recv_x, recv_count, handle = backend.low_latency_dispatch(
        dev.x[ctx.rank], dev.topk_idx[ctx.rank], max_tokens, experts, use_fp8, ue8m0
    )
    got = ref.LowLatencyDispatchResult.from_outputs(recv_x, recv_count, handle)
    ref.assert_low_latency_dispatch_equal(got, expected_all[ctx.rank], ctx.rank)

    # Combine with "experts" that scale their rows by (global expert id + 1).
    E_local = experts // R
    outputs = []
    for d, o in enumerate(expected_all):
        rows = ref.dequantize_fp8(o.recv_x, o.recv_x_scales) if use_fp8 else o.recv_x.float()
        factor = (torch.arange(E_local) + d * E_local + 1).view(E_local, 1, 1)
        outputs.append((rows * factor).to(torch.bfloat16))
    want = ref.low_latency_combine(outputs, case.topk_idx, case.topk_weights, expected_all)[
        ctx.rank
    ]
    combined = backend.low_latency_combine(
        outputs[ctx.rank].to(ctx.device), dev.topk_idx[ctx.rank], dev.topk_weights[ctx.rank], handle
    )
    ref.assert_bitwise_equal(combined, want, "low-latency combined")


LL_CASES = [
    ([5, 0, 8, 3], 8, 256, 8, 3, "random", True, False),
    ([8, 8, 8, 8], 8, 128, 12, 4, "skewed", True, True),
    ([2, 7, 0, 6], 9, 128, 16, 16, "dropped", False, False),
    ([0, 0, 0, 0], 4, 128, 8, 2, "random", True, False),
]


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("case", LL_CASES, ids=[f"{c[5]}{i}" for i, c in enumerate(LL_CASES)])
def test_low_latency_mode(run_ranks, num_ranks, case):
    tokens, max_tokens, hidden, experts, topk, routing, use_fp8, ue8m0 = case
    experts = experts - experts % num_ranks or num_ranks
    topk = min(topk, experts)
    run_ranks(
        num_ranks,
        _low_latency_body,
        77 + num_ranks,
        tokens,
        max_tokens,
        hidden,
        experts,
        topk,
        routing,
        use_fp8,
        ue8m0,
    )
