"""The slot dispatch prototype (kernels/normal_slots.py) against the reference dispatch.

Every rank makes every rank's inputs from one fresh seed, poisons its receive buffer, runs the
count exchange and the dispatch (plain stores, TMA boxes that split a row, one TMA box per row
whose tail lies past the row, plain stores from rotated destinations with cache hints), and
compares the received rows with the reference's, four calls in a row with new inputs (the call
counters and arrival counters carry over), each call with its own program count: counts that
change from call to call on one heap, token counts that no program count divides, and programs
left without tokens.
"""

import random

import pytest
import torch

from tritonep.reference.layout import expert_owner
from tritonep.reference.normal import normal_dispatch
from tritonep.testing import route

HIDDEN = 224  # 7 boxes of 32 columns: no power of two, as 7168 = 28 x 256 is not
EXPERTS = 12
TOPK = 3
POISON = -1  # int16 0xFFFF, a BF16 NaN: an unwritten row never equals a reference row


def _case(seed, R, tokens):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for n in tokens]
    idx = [route(gen, n, EXPERTS, TOPK, "random") for n in tokens]
    in_rank = [
        torch.stack([(expert_owner(i, EXPERTS, R) == d).any(1) for d in range(R)], 1).to(torch.int8)
        for i in idx
    ]
    return xs, idx, in_rank


def _descriptor(t, rows, box_rows):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [rows, HIDDEN // 32, 32], [HIDDEN, 32, 1], [1, box_rows, 32])


def _slots_body(ctx, seed, tokens, program_counts):
    from tritonep import heap as heaps
    from tritonep.kernels import normal_slots as slots
    from tritonep.kernels.phases import NAMES
    from tritonep.kernels.status import new_status, raise_on_timeout
    from tritonep.kernels.sync import timeout_us, use_clock

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    max_rows = sum(tokens)
    arrivals, recv_offset, nbytes = slots.heap_bytes(R, max_rows, HIDDEN, 2)
    heap = heaps.allocate(nbytes, ctx.group, dev)
    recv = heap.view(me, torch.bfloat16, (max_rows, HIDDEN), recv_offset)
    peers = [heap.view(d, torch.bfloat16, (max_rows, HIDDEN), recv_offset) for d in range(R)]
    state = torch.zeros(1, dtype=torch.int64, device=dev)
    info = torch.zeros(1 + 3 * R, dtype=torch.int32, device=dev)
    status = new_status(dev)
    block_ranks = 1 << (R - 1).bit_length()
    rows_seen = []
    # (TMA, box rows, boxes per row, rotated, streaming): plain stores, one box of 1 row x 32
    # (7 a row), 8 rows (1 a row), plain stores from rotated destinations with cache hints.
    methods = [
        (False, 1, 1, False, False),
        (True, 1, 7, False, False),
        (True, 8, 1, False, False),
        (False, 1, 1, True, True),
    ]
    for step, ((tma, box_rows, boxes, rotate, stream), programs) in enumerate(
        zip(methods, program_counts, strict=True)
    ):
        xs, idx, in_rank = _case(seed + step, R, tokens)
        want = normal_dispatch(xs, idx, None, EXPERTS)[me].recv_x
        x, mine = xs[me].to(dev), in_rank[me].to(dev)
        plan = torch.empty(tokens[me], R, dtype=torch.int32, device=dev)
        recv.view(torch.int16).fill_(POISON)
        heap.barrier()
        slots.slots_notify_kernel[(1,)](
            mine,
            tokens[me],
            heap.peer_ptrs,
            me,
            state,
            info,
            status,
            timeout_us(60.0),
            NUM_RANKS=R,
            USE_CLOCK=use_clock(dev),
            BLOCK_TOKENS=4,
            BLOCK_RANKS=block_ranks,
        )
        descs = [_descriptor(p, max_rows, box_rows) for p in peers] if tma else []
        slots.slots_dispatch_kernel[(programs,)](
            None if tma else x,
            _descriptor(x, tokens[me], box_rows) if tma else None,
            *(descs + [None] * (8 - len(descs))),
            mine,
            plan,
            info,
            heap.peer_ptrs,
            me,
            tokens[me],
            max_rows,
            arrivals,
            recv_offset,
            status,
            timeout_us(60.0),
            NUM_RANKS=R,
            HIDDEN=HIDDEN,
            VIA_TMA=tma,
            BOXES=boxes,
            BOX_ROWS=box_rows,
            STAGES=2,
            BLOCK_T=4,
            BLOCK_H=128,
            BLOCK_TOKENS=4,
            BLOCK_RANKS=block_ranks,
            USE_CLOCK=use_clock(dev),
            ROTATE=rotate,
            STREAM=stream,
        )
        heap.barrier()
        raise_on_timeout(status, me, NAMES)
        total = int(info[0])
        assert total == want.shape[0], (step, total, want.shape[0])
        assert torch.equal(recv[:total].cpu(), want), f"step {step}: received rows differ"
        rest = recv[total:].view(torch.int16)
        assert bool((rest == POISON).all()), f"step {step}: rows past {total} were written"
        rows_seen.append(total)
    heap.close()
    return rows_seen


# Program counts per call (plain stores, TMA split rows, TMA whole rows, rotated plain
# stores). 2 ranks: 7 and 12 tokens over 2, 3, 5 and 3 programs (7 / 5: the last program has
# none). 3 ranks: 3, then 2, then 4, then 5 (fewer programs after more, then more again;
# rotations starting at every rank).
@pytest.mark.parametrize(
    ("tokens", "programs"),
    [((7, 12), (2, 3, 5, 3)), ((5, 9, 6), (3, 2, 4, 5))],
    ids=["2 ranks", "3 ranks"],
)
def test_slot_dispatch_matches_the_reference(run_ranks, tokens, programs):
    seed = random.randrange(1 << 30)
    R = len(tokens)
    seen = run_ranks(R, _slots_body, seed, list(tokens), list(programs), timeout=600)
    # Every rank received rows in every step (top-3 of 12 experts reaches each rank often).
    for rows in seen:
        assert all(n > 0 for n in rows), (seed, seen)
