"""Bad input raises TypeError/ValueError naming the argument, before anything is sent."""

import re

import pytest
import torch

from tritonep.validation import (
    check_dispatch_x,
    check_num_experts,
    check_tensor,
    check_topk_idx,
    check_topk_weights,
)

IDX = torch.tensor([[0, 3], [-1, 2]])
ONE_WORD = torch.ones(2, 1)

TABLE = [
    # (call, exception, message)
    (lambda: check_tensor("x", [1, 2]), TypeError, "x: expected a torch.Tensor, got list"),
    (
        lambda: check_tensor("x", torch.zeros(2, 4), dtype=torch.bfloat16),
        TypeError,
        "x: expected dtype torch.bfloat16, got torch.float32",
    ),
    (
        lambda: check_tensor("x", torch.zeros(2, 4), dtype=(torch.bfloat16, torch.float8_e4m3fn)),
        TypeError,
        "x: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got torch.float32",
    ),
    (
        lambda: check_tensor("x", torch.zeros(2, 4), shape=(None, 8)),
        ValueError,
        "x: expected shape [*, 8], got [2, 4]",
    ),
    (
        lambda: check_tensor("x", torch.zeros(2, 4, 1), shape=(None, 4)),
        ValueError,
        "x: expected shape [*, 4], got [2, 4, 1]",
    ),
    (
        lambda: check_tensor("x", torch.zeros(4, 2).t()),
        ValueError,
        "x: expected a contiguous tensor (call .contiguous() first)",
    ),
    (
        lambda: check_tensor("x", torch.zeros(2), device="meta"),
        ValueError,
        "x: expected a tensor on meta, got cpu",
    ),
    (
        lambda: check_num_experts(10, 4),
        ValueError,
        "num_experts: expected a positive multiple of the number of ranks (4), got 10",
    ),
    (
        lambda: check_num_experts(0, 4),
        ValueError,
        "num_experts: expected a positive multiple of the number of ranks (4), got 0",
    ),
    (lambda: check_num_experts(8.0, 4), TypeError, "num_experts: expected an int, got float"),
    (
        lambda: check_topk_idx("topk_idx", IDX.int(), 2, 4),
        TypeError,
        "topk_idx: expected dtype torch.int64, got torch.int32",
    ),
    (
        lambda: check_topk_idx("topk_idx", IDX, 3, 4),
        ValueError,
        "topk_idx: expected shape [3, *], got [2, 2]",
    ),
    (
        lambda: check_topk_idx("topk_idx", IDX, 2, 3),
        ValueError,
        "topk_idx: expert ids must lie in [-1, 3) (-1 = no expert), found 3",
    ),
    (
        lambda: check_topk_idx("topk_idx", IDX - 1, 2, 8),
        ValueError,
        "topk_idx: expert ids must lie in [-1, 8) (-1 = no expert), found -2",
    ),
    (
        lambda: check_topk_idx("topk_idx", torch.zeros(2, 0, dtype=torch.long), 2, 8),
        ValueError,
        "topk_idx: expected at least one top-k column, got shape [2, 0]",
    ),
    (
        lambda: check_topk_weights("topk_weights", torch.ones(2, 2, dtype=torch.float64), IDX),
        TypeError,
        "topk_weights: expected dtype torch.float32, got torch.float64",
    ),
    (
        lambda: check_topk_weights("topk_weights", torch.ones(2, 3), IDX),
        ValueError,
        "topk_weights: expected shape [2, 2], got [2, 3]",
    ),
    (
        lambda: check_dispatch_x("x", (torch.zeros(2, 200).to(torch.float8_e4m3fn), ONE_WORD)),
        ValueError,
        "x[0]: FP8 rows must be a positive multiple of 16 bytes (H a multiple of 16), "
        "got hidden 200",
    ),
    (
        # hidden 2880: up to ceil(2880 / 32) = 90 words (a float32 per 128 channels is 23)
        lambda: check_dispatch_x(
            "x", (torch.zeros(2, 2880).to(torch.float8_e4m3fn), torch.ones(2, 91))
        ),
        ValueError,
        "x[1]: expected 1 to 90 scale words per token (hidden 2880), got 91",
    ),
]


@pytest.mark.parametrize("call,exc,message", TABLE, ids=[m for _, _, m in TABLE])
def test_bad_input_table(call, exc, message):
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        call()


def test_good_input_passes():
    assert check_topk_idx("topk_idx", IDX, 2, 4) is IDX
    assert check_num_experts(8, 4) == 2
    # FP8 rows of a multiple of 16 bytes with a partial last group of 128 channels: gpt-oss's
    # 2880 (23 float32 scales, or 6 words of packed UE8M0), and 16 (one scale word at most).
    for hidden, words in [(2880, 23), (2880, 6), (16, 1), (208, 7)]:
        q = torch.zeros(2, hidden).to(torch.float8_e4m3fn)
        assert check_dispatch_x("x", (q, torch.ones(2, words))) is q


def _backend_bad_inputs(ctx):
    from tritonep.torch_backend import TorchBackend

    backend = TorchBackend()
    x = torch.randn(4, 128, device=ctx.device).to(torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.long, device=ctx.device)
    w = torch.ones(4, 2, device=ctx.device)
    messages = []
    for call in [
        lambda: backend.dispatch(x, idx, w, num_experts=3),
        lambda: backend.dispatch(x, idx + 7, w, num_experts=4),
        lambda: backend.dispatch(x.float().to(torch.float8_e4m3fn), idx, w, 4),
        lambda: backend.dispatch(
            (x.to(torch.float8_e4m3fn), torch.ones(4, 5, device=ctx.device)), idx, w, 4
        ),
        lambda: backend.dispatch(x, idx[:3], w, 4),
        lambda: backend.low_latency_dispatch(x, idx, 3, 4),
        lambda: backend.low_latency_dispatch(x[:, :100].contiguous(), idx, 8, 4),
        lambda: backend.low_latency_dispatch(x.float(), idx, 8, 4),
    ]:
        try:
            call()
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            messages.append("accepted")
    return messages


def test_torch_backend_rejects_bad_input_on_every_rank(run_ranks):
    expected = [
        "ValueError: num_experts: expected a positive multiple of the number of ranks (2), got 3",
        "ValueError: topk_idx: expert ids must lie in [-1, 4) (-1 = no expert), found 7",
        "TypeError: x: expected dtype torch.bfloat16 (FP8 goes as a tuple (x, scales)), "
        "got torch.float8_e4m3fn",
        "ValueError: x[1]: expected 1 to 4 scale words per token (hidden 128), got 5",
        "ValueError: topk_idx: expected shape [4, *], got [3, 2]",
        "ValueError: x: 4 tokens exceed num_max_dispatch_tokens_per_rank=3",
        "ValueError: x: hidden size must be a positive multiple of 8, got 100",
        "TypeError: x: expected dtype torch.bfloat16, got torch.float32",
    ]
    for messages in run_ranks(2, _backend_bad_inputs):
        assert messages == expected


def _disagree_body(ctx, which):
    from tritonep import Buffer
    from tritonep.modes.internode import InternodeMode
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.modes.normal import NormalMode

    odd = ctx.rank == 1
    hidden = 384 if odd else 256
    experts = 4 * ctx.world_size
    try:
        if which == "normal":
            NormalMode(None, hidden, experts, device=ctx.device)
        elif which == "low_latency":
            LowLatencyMode(None, 8, hidden, experts, device=ctx.device)
        elif which == "modes":  # one rank's mode built for 3 nodes, its peers' for one
            if odd:
                InternodeMode(None, 256, experts, gpus_per_node=1, device=ctx.device)
            else:
                NormalMode(None, 256, experts, device=ctx.device)
        elif which == "buffer_rdma":
            Buffer(num_rdma_bytes=0 if odd else 10**9, device=ctx.device)
        elif which == "buffer_nodes":
            Buffer(gpus_per_node=1 if odd else 3, device=ctx.device)
        elif which == "first_call":
            # Enough bytes for hidden 256: rank 1 alone would find too few for its 384.
            need = Buffer.get_low_latency_rdma_size_hint(8, 256, ctx.world_size, experts)
            buffer = Buffer(num_rdma_bytes=need, device=ctx.device)
            x = torch.zeros(2, hidden, dtype=torch.bfloat16, device=ctx.device)
            idx = torch.zeros(2, 1, dtype=torch.int64, device=ctx.device)
            buffer.low_latency_dispatch(x, idx, 8, experts)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "which, detail",
    [
        ("normal", "NormalMode: the ranks disagree on the configuration: hidden = [256, 384, 256]"),
        (
            "low_latency",
            "LowLatencyMode: the ranks disagree on the configuration: hidden = [256, 384, 256]",
        ),
        (
            "modes",
            "NormalMode: the ranks disagree on the configuration: object = "
            "['NormalMode', 'InternodeMode', 'NormalMode'] on ranks 0..2; ",
        ),
        (
            "buffer_rdma",
            "Buffer: the ranks disagree on the configuration: num_rdma_bytes = "
            "[1000000000, 0, 1000000000] on ranks 0..2",
        ),
        (
            "buffer_nodes",
            "Buffer: the ranks disagree on the configuration: gpus_per_node = "
            "[3, 1, 3] on ranks 0..2",
        ),
        (
            "first_call",
            "Buffer's low-latency mode: the ranks disagree on the configuration: "
            "hidden = [256, 384, 256] on ranks 0..2",
        ),
    ],
)
def test_ranks_that_disagree_all_raise_the_same_error(run_ranks, which, detail):
    # Before any rank can raise alone (and leave its peers waiting in a collective for it).
    messages = run_ranks(3, _disagree_body, which)
    assert messages[0] is not None and messages == [messages[0]] * 3, messages
    assert detail in messages[0]
