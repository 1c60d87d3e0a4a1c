"""The layout kernel against the reference layout, poisoned outputs, fresh routing each case."""

import pytest
import torch

from tritonep import reference as ref
from tritonep.kernels.layout import dispatch_layout
from tritonep.testing import route

CASES = [
    # tokens, experts, ranks, topk, routing, programs
    (0, 8, 2, 2, "random", 1),
    (1, 4, 4, 1, "random", 2),
    (37, 12, 3, 3, "dropped", 3),
    (200, 16, 4, 8, "skewed", 4),
    (130, 30, 5, 16, "random", 2),
    (64, 8, 8, 4, "empty", 1),
    (150, 256, 4, 8, "random", 3),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}tok-{c[4]}-{c[5]}p" for c in CASES])
def test_layout_kernel_matches_reference(case):
    tokens, experts, ranks, topk, routing, programs = case
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    idx = route(gen, tokens, experts, topk, routing).to(device)
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):  # the arrival counter is left at zero for the next call
        poisoned = (
            torch.full((ranks,), -7, dtype=torch.int32, device=device),
            torch.full((experts,), -7, dtype=torch.int32, device=device),
            torch.ones(tokens, ranks, dtype=torch.bool, device=device),
        )
        poisoned[2].view(torch.uint8).fill_(0xFF)  # neither False nor a clean True
        per_rank, per_expert, in_rank = dispatch_layout(
            idx, experts, ranks, arrivals, programs, out=poisoned
        )
        want = ref.dispatch_layout(idx, experts, ranks)
        ref.assert_bitwise_equal(per_rank, want.num_tokens_per_rank, "num_tokens_per_rank")
        ref.assert_bitwise_equal(per_expert, want.num_tokens_per_expert, "num_tokens_per_expert")
        ref.assert_bitwise_equal(in_rank, want.is_token_in_rank, "is_token_in_rank")
        assert int(arrivals) == 0
