"""The layout kernel against the reference layout, poisoned outputs, fresh routing each case;
ids out of range recorded, not raised."""

import pytest
import torch

from tritonep import reference as ref
from tritonep.kernels.layout import DispatchLayout
from tritonep.kernels.status import bad_id_error
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


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _poisoned(tokens, experts, ranks, device):
    out = (
        torch.full((ranks,), -7, dtype=torch.int32, device=device),
        torch.full((experts,), -7, dtype=torch.int32, device=device),
        torch.ones(tokens, ranks, dtype=torch.bool, device=device),
    )
    out[2].view(torch.uint8).fill_(0xFF)  # neither False nor a clean True
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}tok-{c[4]}-{c[5]}p" for c in CASES])
def test_layout_kernel_matches_reference(case):
    tokens, experts, ranks, topk, routing, programs = case
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    device = _device()
    idx = route(gen, tokens, experts, topk, routing).to(device)
    layout = DispatchLayout(device, experts, ranks, num_programs=programs)
    arrivals = layout.shared.args[1]
    arrivals.fill_(0)
    for _ in range(2):  # the arrival counter is left at zero for the next call
        per_rank, per_expert, in_rank = layout(idx, out=_poisoned(tokens, experts, ranks, device))
        want = ref.dispatch_layout(idx, experts, ranks)
        ref.assert_bitwise_equal(per_rank, want.num_tokens_per_rank, "num_tokens_per_rank")
        ref.assert_bitwise_equal(per_expert, want.num_tokens_per_expert, "num_tokens_per_expert")
        ref.assert_bitwise_equal(in_rank, want.is_token_in_rank, "is_token_in_rank")
        assert int(arrivals) == 0
    assert layout.status.synced_record()[0] == 0


@pytest.mark.parametrize("bad", [8, -2, 1 << 40])
def test_ids_out_of_range_count_as_none_and_the_first_is_recorded(bad):
    """Ids outside ``[-1, E)`` go nowhere (as ``-1`` would) and the first of them in token
    order is recorded, whichever program met it; nothing is read on the host."""
    device, experts, ranks = _device(), 8, 2
    gen = torch.Generator().manual_seed(5)
    idx = route(gen, 150, experts, 3, "random")
    idx[140, 2] = 9  # a later offender, in another program's block
    idx[77, 1] = bad
    layout = DispatchLayout(device, experts, ranks, rank=1, num_programs=3)
    got = layout(idx.to(device), out=_poisoned(150, experts, ranks, device))
    clean = torch.where((idx < -1) | (idx >= experts), -1, idx)
    want = ref.dispatch_layout(clean, experts, ranks)
    ref.assert_bitwise_equal(got[0], want.num_tokens_per_rank, "num_tokens_per_rank")
    ref.assert_bitwise_equal(got[1], want.num_tokens_per_expert, "num_tokens_per_expert")
    ref.assert_bitwise_equal(got[2], want.is_token_in_rank, "is_token_in_rank")
    words = layout.status.synced_record()
    assert layout.status.record() == words  # the host copy holds the same record
    message = str(bad_id_error(words, "get_dispatch_layout", experts))
    assert message.startswith(
        f"topk_idx: token 77, column 1 of rank 1's get_dispatch_layout names expert {bad}, "
        "outside [-1, 8)"
    ), message
