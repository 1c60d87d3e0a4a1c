"""Normal mode against the reference, on CPU ranks (interpreter) and on GPUs.

Every call poisons its outputs first and uses fresh random inputs whose rows carry their source
rank and token index. Dispatch must give, bit for bit, the reference's received rows (BF16
payload, or FP8 bytes and scales), local top-k ids, weights, source indices and per-expert
counts; combine must give the reference's float32 sums, rounded to BF16, bit for bit (the
kernel adds the ranks' rows in the same order). Worst-case outputs must pad with ids ``-1``;
cached dispatches must move new payloads along the old routing.
"""

import contextlib
import re
import time
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import gpu_ranks
from tritonep import reference as ref
from tritonep.errors import WaitTimeoutError
from tritonep.heap import shared_gpu
from tritonep.kernels.normal_copy_combine import chunk_start, copy_combine_prefix, row_chunk
from tritonep.modes import copy_combine as cc
from tritonep.modes import normal as nm
from tritonep.testing import make_case, static_inputs, tag_rows, timeout_message


def _payload(case, use_fp8):
    """Per-rank dispatch inputs on the CPU: BF16 rows, or their FP8 quantization."""
    if not use_fp8:
        return list(case.x)
    return [ref.quantize_fp8(x) for x in case.x]


def _to(x, device):
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


def _expert_rows(recv_x, rank):
    """A known function of the received rows, as each rank's experts would hand back."""
    rows = ref.dequantize_fp8(*recv_x) if isinstance(recv_x, tuple) else recv_x.float()
    return (rows * ((rank + 1) / 8)).to(torch.bfloat16)


def _check_dispatch(me, out, want, use_fp8, worst, alignment):
    n = want.num_recv_tokens
    ref.assert_rows_equal(out.recv_x, want.recv_x, n, f"rank {me} recv_x")
    ref.assert_bitwise_equal(out.recv_topk_idx[:n].cpu(), want.recv_topk_idx, "recv_topk_idx")
    ref.assert_bitwise_equal(
        out.recv_topk_weights[:n].cpu(), want.recv_topk_weights, "recv_topk_weights"
    )
    src = out.handle.recv_src_idx[:n].cpu().long()
    ref.assert_bitwise_equal(src, want.recv_src_idx, f"rank {me} recv_src_idx")
    per_expert = out.num_recv_tokens_per_expert
    if worst:
        assert out.recv_topk_idx.shape[0] == worst
        assert bool((out.recv_topk_idx[n:] == -1).all()), "padding rows must carry id -1"
        assert bool((out.recv_topk_weights[n:] == 0).all())
        assert int(out.handle.host_info[0]) == n
        per_expert = per_expert.cpu().tolist()
    else:
        assert out.recv_topk_idx.shape[0] == n and out.handle.num_recv_tokens == n
    assert per_expert == want.num_recv_tokens_per_expert, (per_expert, alignment)


def _verify(ctx, case, xs, out, combined, combined_w, experts, alignment, worst, bias):
    """Check one dispatch and its combine of this rank against the reference, bit for bit."""
    me = ctx.rank
    use_fp8 = isinstance(xs[0], tuple)
    wants = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, experts, alignment)
    _check_dispatch(me, out, wants[me], use_fp8, worst, alignment)
    ys = [_expert_rows(w.recv_x, d) for d, w in enumerate(wants)]
    expected, expected_w = ref.normal_combine(
        ys,
        wants,
        [x.shape[0] for x in case.x],
        [w.recv_topk_weights for w in wants],
        [(x * 0.5).to(torch.bfloat16) for x in case.x] if bias else None,
    )[me]
    ref.assert_bitwise_equal(combined.cpu(), expected, f"rank {me} combined")
    # Weights come back exactly when they went out: a combine that dropped them must fail.
    assert (combined_w is None) == (expected_w is None), f"rank {me}: combined weights"
    if combined_w is not None:
        ref.assert_bitwise_equal(combined_w.cpu(), expected_w, f"rank {me} combined weights")
    return wants


def _combine_input(out, rank):
    """The experts' rows for the received rows (rows past the received ones: anything)."""
    y = _expert_rows(out.recv_x, rank)
    return torch.where(torch.isnan(y), 0, y)  # poisoned padding rows


def _normal_body(
    ctx,
    calls,
    tokens,
    hidden,
    experts,
    topk,
    routing,
    use_fp8,
    worst,
    config,
    copy_tokens=0,
    copy_chunks=None,
    misaligned_x=False,
    copy_share=None,
    copy_min=0,
):
    R, me = ctx.world_size, ctx.rank
    experts *= R
    mode = nm.NormalMode(
        None,
        hidden,
        experts,
        max_topk=max(topk, 2),
        device=ctx.device,
        timeout_s=60,
        copy_combine_tokens=copy_tokens,
        copy_combine_chunks=copy_chunks,
        copy_combine_last_share=copy_share,
        copy_combine_min_tokens=copy_min,
    )
    if copy_tokens:  # rows and weights of the copy-engine combine's region: NaN until copied
        region = mode.copy_combine
        region.heap.local[region.layout.rows :].fill_(255)
        region.heap.barrier()
    alignment = 4
    for call in range(calls):  # calls use fresh inputs; flags are tagged by call
        case = tag_rows(make_case(100 * call + 11, tokens[:R], hidden, experts, topk, routing))
        xs = _payload(case, use_fp8)
        idx = case.topk_idx[me].to(ctx.device)
        weights = case.topk_weights[me].to(ctx.device)
        _, per_expert, in_rank = mode.get_dispatch_layout(idx)
        out = mode.dispatch(
            _to(xs[me], ctx.device),
            idx,
            weights,
            per_expert,
            in_rank,
            None,
            alignment,
            worst,
            config,
        )
        # Combine: every rank hands back a known function of what it received.
        bias = (case.x[me] * 0.5).to(torch.bfloat16).to(ctx.device)
        y = _combine_input(out, me)
        if misaligned_x:  # the same values 2 bytes past a 16-byte boundary
            y = torch.empty(y.numel() + 1, dtype=y.dtype, device=y.device)[1:].view_as(y).copy_(y)
        combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights, bias)
        _verify(ctx, case, xs, out, combined, combined_w, experts, alignment, worst, True)
        # Every rank learns the most tokens any rank dispatched (exact size: the host reads
        # it with the counts).
        assert out.handle.most_tokens == (-1 if worst else max(tokens[:R]))

        # Cached: new payloads along the same routing, no notify.
        new = tag_rows(make_case(100 * call + 12, tokens[:R], hidden, experts, topk, routing))
        new_xs = _payload(new, use_fp8)
        again = mode.dispatch(_to(new_xs[me], ctx.device), handle=out.handle)
        assert again.recv_topk_idx is None and again.num_recv_tokens_per_expert is None
        want = ref.normal_dispatch(new_xs, case.topk_idx, None, experts)[me]
        ref.assert_rows_equal(again.recv_x, want.recv_x, want.num_recv_tokens, "cached x")
    rings = [o for o in mode._plans if isinstance(o, nm.CombineOptions)]
    if not copy_tokens:  # the rings' variants: one for an input off 16 bytes, if one came
        assert rings and any(not o.x_aligned for o in rings) == misaligned_x
    if copy_tokens:
        # Exact-size handles take the copy engines where the rank with the most tokens has
        # at least copy_min and at most copy_tokens; the others, and worst-case handles (no
        # counts on the host), the rings: on every rank alike, whatever its own tokens.
        copies = not worst and copy_min <= max(tokens[:R]) <= copy_tokens
        assert int(mode.copy_combine.state[0]) == (calls if copies else 0)
        # (the sums' variants: by the input's alignment, then for the first chunk or later)
        keys = list(mode.copy_combine._sums)
        assert {key[3] for key in keys} == ({not misaligned_x} if copies else set())
        later = {False, True} if mode.copy_combine.chunks > 1 else {False}
        assert {key[4] for key in keys} == (later if copies else set())
    mode.check()
    mode.destroy()
    return True


CASES = {
    # name: (tokens per rank, hidden, experts per rank, topk, routing, fp8, worst rows)
    "bf16-random": ([13, 0, 9, 5], 256, 3, 3, "random", False, 0),
    "fp8-dropped": ([7, 11, 3, 0], 384, 2, 4, "dropped", True, 0),
    "bf16-skewed-worst": ([8, 8, 8, 8], 128, 2, 2, "skewed", False, 40),
    "bf16-h2880-topk1": ([6, 3, 5, 2], 2880, 2, 1, "random", False, 0),
    "fp8-topk8-worst": ([10, 4, 7, 9], 128, 4, 8, "random", True, 48),
    # FP8 with a partial last group of 128 channels: gpt-oss's 2880 (23 scales a row, the
    # last for 64 channels) and 160 (2, the last for 32).
    "fp8-h2880": ([6, 3, 5, 2], 2880, 2, 2, "random", True, 0),
    "fp8-h160-worst": ([7, 11, 3, 0], 160, 2, 4, "dropped", True, 48),
    "empty": ([4, 0, 3, 2], 128, 2, 2, "empty", False, 0),
}


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_normal_matches_reference(run_ranks, num_ranks, name):
    # A second call on the same mode (fresh inputs, flags of the next call) on 3 ranks.
    tokens, hidden, experts, topk, routing, fp8, worst = CASES[name]
    calls = 2 if num_ranks == 3 else 1
    results = run_ranks(
        num_ranks, _normal_body, calls, tokens, hidden, experts, topk, routing, fp8, worst, None
    )
    assert results == [True] * num_ranks


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("name", ["bf16-random", "fp8-dropped", "empty", "bf16-skewed-worst"])
def test_copy_engine_combine_matches_reference(run_ranks, num_ranks, name):
    # Two calls: the second's rows replace the first's in every region (stale rows would
    # show); a worst-case handle (no counts on the host) takes the rings instead.
    tokens, hidden, experts, topk, routing, fp8, worst = CASES[name]
    args = (2, tokens, hidden, experts, topk, routing, fp8, worst, None, 16)
    assert run_ranks(num_ranks, _normal_body, *args) == [True] * num_ranks


@pytest.mark.parametrize("chunks, misaligned, share", [(2, True, 2), (3, False, 6)])
def test_copy_engine_combine_in_chunks_matches_reference(run_ranks, chunks, misaligned, share):
    # Two copies per peer and call, or three: more chunks than some sources have rows (empty
    # chunks), tokens summed by the launch after their last row's chunk; the last chunk half
    # the rows or a sixth. An input off a 16-byte boundary takes the sums' other way to this
    # rank's own rows.
    tokens, hidden, experts, topk, routing, fp8, worst = CASES["bf16-random"]
    args = (2, tokens, hidden, experts, topk, routing, fp8, worst, None, 16, chunks, misaligned)
    args += (share,)
    assert run_ranks(3, _normal_body, *args) == [True] * 3


@pytest.mark.parametrize(
    "copy_tokens, copy_min",
    [(16, 10), (16, 14), (12, 0)],
    ids=["most-above-min", "most-below-min", "most-above-capacity"],
)
def test_combine_takes_copy_engines_by_the_most_tokens_of_any_rank(
    run_ranks, copy_tokens, copy_min
):
    # Ranks of 13, 0 and 9 tokens: all take the copy engines when 13 is within [copy_min,
    # copy_tokens], whatever their own count (the 9-token rank with a minimum of 10 too), and
    # all take the rings otherwise: a minimum above 13, or 13 tokens beyond the region's
    # capacity (which no longer raises). Both calls match the reference either way.
    tokens, hidden, experts, topk, routing, fp8, worst = CASES["bf16-random"]
    args = (2, tokens, hidden, experts, topk, routing, fp8, worst, None, copy_tokens, None)
    args += (False, None, copy_min)
    assert run_ranks(3, _normal_body, *args) == [True] * 3


@pytest.mark.parametrize("misaligned", [False, True])
def test_rings_combine_reads_own_rows_aligned_or_not(run_ranks, misaligned):
    # This rank's own rows join the ring slots' as addresses when the input is 16-byte aligned,
    # and are read from x by pointer when it is not: both sum as the reference does.
    tokens, hidden, experts, topk, routing, fp8, worst = CASES["bf16-random"]
    args = (2, tokens, hidden, experts, topk, routing, fp8, worst, None, 0, None, misaligned)
    assert run_ranks(3, _normal_body, *args) == [True] * 3


@triton.jit
def _row_chunks(out_ptr, rows, CHUNKS: tl.constexpr, LAST_SHARE: tl.constexpr, BLOCK: tl.constexpr):
    pos = tl.arange(0, BLOCK)
    chunk = row_chunk(pos, rows + tl.zeros_like(pos), CHUNKS, LAST_SHARE)
    tl.store(out_ptr + pos, chunk, mask=pos < rows)


def test_the_sums_find_each_row_in_the_chunk_its_copy_carried():
    # The device's row_chunk against the host's split (chunk_start), empty chunks included.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for chunks, share in ((1, 4), (2, 4), (3, 4), (4, 4), (2, 5), (3, 5), (2, 6), (3, 8)):
        for n in (1, 2, 3, 5, 8, 13, 40):
            got = torch.full((64,), -1, dtype=torch.int32, device=device)
            _row_chunks[(1,)](got, n, CHUNKS=chunks, LAST_SHARE=share, BLOCK=64)
            expected = [
                c
                for c in range(chunks)
                for _ in range(
                    chunk_start(n, c, chunks, share), chunk_start(n, c + 1, chunks, share)
                )
            ]
            assert got[:n].tolist() == expected, (chunks, share, n)
    # The last chunk holds 1 / share of the rows, the others share the rest.
    assert [chunk_start(40, c, 3, 4) for c in range(4)] == [0, 15, 30, 40]
    assert [chunk_start(48, c, 2, 6) for c in range(3)] == [0, 40, 48]


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_the_prefix_gives_each_token_its_row_at_each_rank(chunks):
    # copy_combine_prefix against torch's cumulative sum, over several blocks and a partial
    # one; with chunks, each later chunk's first token at each rank: no token before it has a
    # row there in that chunk or a later one, and the token after the last row before the
    # chunk is it.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5 + chunks)
    share = cc.default_last_share(4)
    for tokens, ranks in ((0, 2), (37, 3), (50, 4)):
        in_rank = (torch.rand(tokens, ranks, generator=gen) < 0.6).to(device)
        got = torch.full(((tokens + chunks) * ranks,), -1, dtype=torch.int32, device=device)
        block_chunks = triton.next_power_of_2(max(chunks, 2))
        copy_combine_prefix[(ranks,)](
            in_rank, got, tokens, NUM_RANKS=ranks, CHUNKS=chunks, LAST_SHARE=share, BLOCK=16,
            BLOCK_CHUNKS=block_chunks,
        )  # fmt: skip
        got = got.view(tokens + chunks, ranks).cpu()
        counts = in_rank.to(torch.int32).cumsum(0) if tokens else in_rank.to(torch.int32)
        want = torch.cat([torch.zeros(1, ranks, dtype=torch.int32, device=device), counts])
        assert torch.equal(got[: tokens + 1], want.to(torch.int32).cpu()), (tokens, ranks)
        for c in range(1, chunks):
            for r in range(ranks):
                total = int(want[tokens, r])
                start = chunk_start(total, c, chunks, share)
                rows_at = [t for t in range(tokens) if bool(in_rank[t, r])]
                expected = rows_at[start - 1] + 1 if start > 0 else 0
                assert int(got[tokens + c, r]) == expected, (tokens, ranks, c, r)


def _copy_limits_body(ctx):
    """Bad values of the copy-engine combine's arguments raise, naming them."""
    with pytest.raises(ValueError, match="copy_combine_tokens: expected an int >= 0"):
        nm.NormalMode(None, 128, 2 * ctx.world_size, device=ctx.device, copy_combine_tokens=-1)
    with pytest.raises(ValueError, match="copy_combine_chunks: expected an int >= 1, got 0"):
        nm.NormalMode(
            None, 128, 2 * ctx.world_size, device=ctx.device, copy_combine_tokens=4,
            copy_combine_chunks=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="copy_combine_last_share: expected an int >= 2, got 1"):
        nm.NormalMode(
            None, 128, 2 * ctx.world_size, device=ctx.device, copy_combine_tokens=4,
            copy_combine_last_share=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="copy_combine_min_tokens: expected an int >= 0, got -1"):
        nm.NormalMode(
            None, 128, 2 * ctx.world_size, device=ctx.device, copy_combine_tokens=4,
            copy_combine_min_tokens=-1,
        )  # fmt: skip
    from tritonep import Buffer

    with pytest.raises(ValueError, match="copy_combine_min_tokens: expected an int >= 0 or None"):
        Buffer(None, device=ctx.device, copy_combine_tokens=4, copy_combine_min_tokens=-1)
    return True


def test_copy_engine_combine_arguments_are_checked(run_ranks):
    assert run_ranks(2, _copy_limits_body) == [True, True]


@pytest.mark.parametrize("name", ["bf16-random", "bf16-skewed-worst"])
def test_one_rank_matches_reference(run_ranks, name):
    # A group of one rank: every row stays local (the rank lanes of a step are half masked).
    tokens, hidden, experts, topk, routing, fp8, worst = CASES[name]
    assert run_ranks(
        1, _normal_body, 2, tokens, hidden, experts, topk, routing, fp8, worst, None
    ) == [True]


def with_release_steps(release_steps, body, *args):
    """``body(*args)`` with tails released every ``release_steps`` sender steps and 2 combine
    rows per rank and step (so that a channel takes several steps), as the launch constants
    were afterwards."""
    old = nm.set_launch_constants(SEND_RELEASE_STEPS=release_steps, STEP_ROWS=4)
    try:
        return body(*args)
    finally:
        nm.set_launch_constants(**old)


def _release_body(ctx, name, release_steps):
    tokens, hidden, experts, topk, routing, fp8, worst = CASES[name]
    config = nm.Config(num_sms=4, nvl_send_chunk=2, nvl_recv_buffer_tokens=64)  # 2-token steps
    return with_release_steps(
        release_steps,
        _normal_body,
        ctx,
        1,
        tokens,
        hidden,
        experts,
        topk,
        routing,
        fp8,
        worst,
        config,
    )


@pytest.mark.parametrize("release_steps", [2, 4])
@pytest.mark.parametrize("name", ["bf16-random", "fp8-topk8-worst"])
def test_senders_may_release_their_tails_every_few_steps(run_ranks, name, release_steps):
    assert run_ranks(2, _release_body, name, release_steps) == [True] * 2


def _scale_words(x, kind):
    """FP8 inputs whose scales are other 4-byte words than float32 per 128 channels, as DeepEP
    users pass them: column-major float32, packed UE8M0 int32, one float32 per token."""
    if kind == "column-major":
        q, s = ref.quantize_fp8(x)
        return q, s.t().contiguous().t()
    if kind == "ue8m0-packed":
        q, s = ref.quantize_fp8(x, use_ue8m0=True)
        return q, ref.pack_ue8m0(s)
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-4)  # per token
    return (x.float() / (amax / 448)).to(torch.float8_e4m3fn), amax / 448


def _scale_words_body(ctx, hidden, kinds, gpus_per_node=None):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    experts, topk = 2 * R, 3
    if gpus_per_node is None:
        mode = nm.NormalMode(None, hidden, experts, max_topk=topk, device=dev, timeout_s=60)
    else:
        from tritonep.modes.internode import InternodeMode

        mode = InternodeMode(
            None, hidden, experts, gpus_per_node, max_topk=topk, device=dev, timeout_s=60
        )
    for call, kind in enumerate(kinds):
        case = tag_rows(make_case(40 + call, [6, 3, 0, 5][:R], hidden, experts, topk, "random"))
        xs = [_scale_words(x, kind) for x in case.x]
        idx = case.topk_idx[me].to(dev)
        out = mode.dispatch(_to(xs[me], dev), idx, case.topk_weights[me].to(dev))
        want = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, experts)[me]
        assert out.recv_x[1].dtype == xs[me][1].dtype and out.recv_x[1].is_contiguous()
        ref.assert_rows_equal(out.recv_x, want.recv_x, want.num_recv_tokens, f"{kind} x")
        # Cached: new rows (columns reversed, scales of their own) along the same routing.
        new_xs = [_scale_words(x.flip(1), kind) for x in case.x]
        again = mode.dispatch(_to(new_xs[me], dev), handle=out.handle)
        want = ref.normal_dispatch(new_xs, case.topk_idx, None, experts)[me]
        ref.assert_rows_equal(again.recv_x, want.recv_x, want.num_recv_tokens, f"{kind} cached")
    mode.check()
    mode.destroy()
    return True


KINDS = ["column-major", "ue8m0-packed", "per-token"]


def test_scales_of_any_layout_and_dtype_travel_unchanged(run_ranks):
    # One mode for all kinds: the launch of each scale width is its own.
    assert run_ranks(3, _scale_words_body, 1024, KINDS) == [True] * 3


def test_scales_of_any_layout_and_dtype_cross_emulated_nodes(run_ranks):
    assert run_ranks(4, _scale_words_body, 1024, KINDS, 2) == [True] * 4


@pytest.mark.parametrize("num_ranks, gpus_per_node", [(2, None), (4, 2)], ids=["node", "2x2"])
def test_scales_of_a_partial_group_travel_unchanged(run_ranks, num_ranks, gpus_per_node):
    # Hidden 208: FP8 rows of 13 x 16 bytes, 2 scales (the last for 80 channels), packed in
    # one UE8M0 word; within a node, and across emulated nodes (the internode mode).
    results = run_ranks(num_ranks, _scale_words_body, 208, KINDS, gpus_per_node)
    assert results == [True] * num_ranks


GPU_CASES = {
    # name: (tokens per rank, hidden, experts per rank at 4 ranks, topk, routing, fp8, worst,
    #        (num_sms, ring slots) or None)
    "bf16-4096-h7168-top8": ([4096] * 4, 7168, 64, 8, "random", False, 0, None),
    "fp8-4096-h7168-top8": ([4096] * 4, 7168, 64, 8, "random", True, 0, None),
    "bf16-uneven-h4096-skewed": ([1, 0, 8192, 300], 4096, 16, 4, "skewed", False, 0, None),
    "bf16-h2880-top1-worst": ([2000, 513, 0, 77], 2880, 8, 1, "dropped", False, 9000, None),
    "fp8-h2048-small-rings": ([3000, 2500, 10, 0], 2048, 8, 8, "random", True, 0, (4, 8)),
    "bf16-h2048-empty": ([500, 20, 0, 7], 2048, 8, 4, "empty", False, 0, None),
    # gpt-oss's hidden size with FP8: 23 scales a row, the last for 64 channels.
    "fp8-h2880-top4": ([4096, 1000, 0, 77], 2880, 32, 4, "random", True, 0, None),
    "fp8-h2880-worst": ([2000, 513, 0, 77], 2880, 8, 4, "dropped", True, 9000, None),
}


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_normal_on_gpus(run_ranks, name):
    tokens, hidden, experts, topk, routing, fp8, worst, cfg = GPU_CASES[name]
    R = gpu_ranks()
    experts = experts * 4 // R
    config = nm.Config(num_sms=cfg[0], nvl_recv_buffer_tokens=cfg[1]) if cfg else None
    results = run_ranks(
        R,
        _normal_body,
        2,
        tokens,
        hidden,
        experts,
        topk,
        routing,
        fp8,
        worst,
        config,
        timeout=240,
    )
    assert results == [True] * R


def _changing_budget_body(ctx, budgets):
    """Consecutive calls with different SM budgets (channel counts) on one mode: a call that
    uses more channels than the last must find the extra rings free."""
    R, me = ctx.world_size, ctx.rank
    experts = 2 * R
    mode = nm.NormalMode(None, 128, experts, max_topk=2, device=ctx.device, max_sms=6, timeout_s=5)
    for call, sms in enumerate(budgets):
        case = tag_rows(make_case(70 + call, [9, 5, 7][:R], 128, experts, 2, "random"))
        config = nm.Config(num_sms=sms, nvl_recv_buffer_tokens=16)
        x, idx = case.x[me].to(ctx.device), case.topk_idx[me].to(ctx.device)
        w = case.topk_weights[me].to(ctx.device)
        out = mode.dispatch(x, idx, w, config=config)
        combined, combined_w = mode.combine(
            _combine_input(out, me), out.handle, out.recv_topk_weights
        )
        _verify(ctx, case, list(case.x), out, combined, combined_w, experts, 1, 0, False)
    mode.check()
    mode.destroy()
    return True


def test_sender_steps_fit_the_ring_and_the_tile():
    """A step of more tokens than the ring has slots would wait for slots only its own later
    rows free (on a GPU: a timeout; the interpreter's guard keeps CPU ranks from reaching it)."""
    for ring in (1, 3, 8, 12, 100, 128):
        for chunk in (1, 6, 8, 16, 32, 64):
            config = nm.Config(nvl_send_chunk=chunk, nvl_recv_buffer_tokens=ring)
            for tile in (4, 8, 64):
                tok = nm._step_tokens(config, tile)
                assert tok & (tok - 1) == 0 and 1 <= tok <= min(ring, tile, 32), (ring, chunk)
                assert tok >= min(chunk, 32, tile, 1 << (ring.bit_length() - 1)), (ring, chunk)
    assert nm._step_tokens(nm.Config(), 16) == 16
    assert nm._step_tokens(nm.Config(nvl_send_chunk=6, nvl_recv_buffer_tokens=6), 16) == 4


def test_calls_may_change_the_sm_budget(run_ranks):
    assert run_ranks(2, _changing_budget_body, [2, 6, 4, 2, 6]) == [True, True]


def _overflow_body(ctx, rows):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    experts = 2 * R
    mode = nm.NormalMode(None, 128, experts, max_topk=2, device=dev, timeout_s=20)
    case = make_case(9, [9, 7, 8][:R], 128, experts, 2, "random")
    want = ref.normal_dispatch(list(case.x), case.topk_idx, case.topk_weights, experts)[me]
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    out = mode.dispatch(x, idx, num_worst_tokens=rows)
    # The combine input sits in front of NaN rows: a sender that reads past its rows (to hand
    # back the ones that overflowed) would sum NaN into some token.
    padded = torch.full((rows + 64, 128), float("nan"), dtype=torch.bfloat16, device=dev)
    padded[:rows] = torch.nan_to_num(out.recv_x)
    try:  # (else the next call would raise it, after its launches)
        mode.check()
        outcome = "fits"
    except ValueError as e:  # a wait that timed out (WaitTimeoutError) fails the test
        assert "num_worst_tokens" in str(e), e
        assert want.num_recv_tokens > rows
        outcome = "overflow"
    combined, _ = mode.combine(padded[:rows], out.handle)  # the overflow was raised once
    assert not bool(combined.isnan().any()), f"rank {me} read past the combine input"
    assert outcome == "overflow" or want.num_recv_tokens <= rows
    # An overflow is reported once; the mode stays in step with its peers, so the next call,
    # sized exactly, is whole and checks clean.
    again = mode.dispatch(x, idx)
    ref.assert_bitwise_equal(again.recv_x.cpu(), want.recv_x, f"rank {me} after the overflow")
    mode.check()
    mode.destroy()
    return outcome


def test_worst_case_overflow_is_reported_and_combine_stays_in_bounds(run_ranks):
    """More rows arrive than worst-case outputs hold: the rank says so, and combine neither
    waits for the dropped rows nor reads past its input."""
    results = run_ranks(3, _overflow_body, 6, timeout=300)
    assert "overflow" in results, results


def _overflow_then_timeout_body(ctx):
    """A worst-case dispatch overflows on some rank and nobody checks; then rank 0 dispatches
    alone. The overflow must not hide the timeout: rank 0's check() raises the timeout, and
    its later calls give up their waits at once (under a 35-minute limit)."""
    from tritonep.kernels.sync import MAX_TIMEOUT_S

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    experts = 2 * R
    mode = nm.NormalMode(None, 128, experts, max_topk=2, device=dev)
    case = make_case(9, [9, 7][:R], 128, experts, 2, "random")
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    mode.dispatch(x, idx, num_worst_tokens=2)  # every rank receives more than 2 rows
    errors = []
    if me == 0:
        mode.timeout_s = 1.0
        for _ in range(2):
            # The dispatch raises what was recorded before it (the overflow, or the timeout
            # that replaced it), after its launches; check() raises the timeout.
            for step in (lambda: mode.dispatch(x, idx, num_worst_tokens=2), mode.check):
                try:
                    step()
                    errors.append(None)
                except (WaitTimeoutError, ValueError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
            mode.timeout_s = MAX_TIMEOUT_S
    with contextlib.suppress(WaitTimeoutError, ValueError):
        mode.destroy()
    return errors


def test_an_unchecked_overflow_does_not_hide_a_later_timeout(run_ranks):
    errors, none = run_ranks(2, _overflow_then_timeout_body, timeout=120)
    assert none == []
    dispatched, checked = errors[0::2], errors[1::2]
    assert checked[0].startswith("WaitTimeoutError: rank 0 timed out after 1 s"), errors
    assert checked == [checked[0]] * 2, errors
    # The first dispatch read the overflow before its count exchange gave up (or, on CPU
    # ranks, whose launches end before the call returns, the timeout that replaced it).
    assert (
        dispatched[0] is None
        or dispatched[0] == checked[0]
        or (dispatched[0].startswith("ValueError: num_worst_tokens"))
    ), errors
    assert dispatched[1] == checked[0], errors


def _two_batch_body(ctx, worst):
    """Two micro-batches, as two-batch overlap runs them: dispatch A, dispatch B, combine A,
    combine B, then cached dispatches along A's and B's handles: each handle stays valid after
    the other batch's calls."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    H, E, K = 256, 3 * R, 3
    mode = nm.NormalMode(None, H, E, max_topk=K, device=dev, timeout_s=60)
    cases = [
        tag_rows(make_case(80 + b, [[7, 3, 9], [2, 8, 0]][b][:R], H, E, K, "dropped"))
        for b in range(2)
    ]
    rows = 40 if worst else 0
    outs = [
        mode.dispatch(
            c.x[me].to(dev),
            c.topk_idx[me].to(dev),
            c.topk_weights[me].to(dev),
            num_worst_tokens=rows,
        )
        for c in cases
    ]
    combined = [
        mode.combine(_combine_input(out, me), out.handle, out.recv_topk_weights) for out in outs
    ]
    for case, out, (y, y_w) in zip(cases, outs, combined, strict=True):
        _verify(SimpleNamespace(rank=me), case, list(case.x), out, y, y_w, E, 1, rows, False)
    for case, out in zip(cases, outs, strict=True):
        again = mode.dispatch(
            (case.x[me].float() * 2).to(torch.bfloat16).to(dev), handle=out.handle
        )
        want = ref.normal_dispatch(list(case.x), case.topk_idx, None, E)[me]
        n = want.num_recv_tokens
        doubled = (want.recv_x.float() * 2).to(torch.bfloat16)
        ref.assert_bitwise_equal(again.recv_x[:n].cpu(), doubled, f"rank {me} cached")
    mode.check()
    mode.destroy()
    return True


def _run_ahead_body(ctx):
    """Three combines and three cached dispatches of one dispatch, with rows scaled by 1, 2
    and 4 (exact in BF16 and in every sum), while the ranks with tokens sleep first: the rank
    without tokens, which has nothing to receive in combine, must not get ahead of them far
    enough to overwrite rows they have yet to read."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    H, E, K = 256, 2 * R, 2
    mode = nm.NormalMode(None, H, E, max_topk=K, device=dev, timeout_s=60)
    case = tag_rows(make_case(93, [7, 0, 5][:R], H, E, K, "dropped"))
    out = mode.dispatch(
        case.x[me].to(dev), case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    )
    y = _combine_input(out, me)
    if case.x[me].shape[0]:
        time.sleep(2.0)
    factors = (1, 2, 4)
    results = [
        mode.combine((y.float() * f).to(torch.bfloat16), out.handle, out.recv_topk_weights)
        for f in factors
    ]
    combined = [c.clone() for c, _ in results]
    again = [
        mode.dispatch(
            (case.x[me].float() * f).to(torch.bfloat16).to(dev), handle=out.handle
        ).recv_x.clone()
        for f in factors
    ]
    _verify(ctx, case, list(case.x), out, combined[0], results[0][1], E, 1, 0, False)
    for f, c, a in zip(factors, combined, again, strict=True):
        want = (combined[0].float() * f).to(torch.bfloat16)
        ref.assert_bitwise_equal(c.cpu(), want.cpu(), f"rank {me} combine x{f}")
        want = (out.recv_x.float() * f).to(torch.bfloat16)
        ref.assert_bitwise_equal(a.cpu(), want.cpu(), f"rank {me} cached dispatch x{f}")
    mode.destroy()
    return True


def test_a_rank_without_tokens_does_not_run_ahead(run_ranks):
    assert run_ranks(3, _run_ahead_body) == [True] * 3


@pytest.mark.parametrize("worst", [False, True])
def test_two_micro_batches_in_flight(run_ranks, worst):
    assert run_ranks(3, _two_batch_body, worst) == [True] * 3


def _graph_body(ctx, replays):
    """Worst-case dispatch -> experts -> combine captured in one CUDA graph, replayed with new
    inputs of the same shapes; every replay is checked against the reference."""
    R, me = ctx.world_size, ctx.rank
    N, H, E, K = 256, 1024, 8 * R, 4
    worst = N * R
    mode = nm.NormalMode(None, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    x, idx, w = static_inputs(N, H, K, ctx.device)

    def load(seed):
        return tag_rows(make_case(seed, [N] * R, H, E, K, "dropped")).copy_to(me, x, idx, w)

    def step():
        _, per_expert, in_rank = mode.get_dispatch_layout(idx)
        out = mode.dispatch(x, idx, w, per_expert, in_rank, None, 1, worst)
        y = _combine_input(out, me)
        combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights)
        return out, combined, combined_w

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(0)
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, combined, combined_w = step()
    torch.cuda.synchronize()
    for replay in range(replays):
        case = load(1 + replay)
        graph.replay()
        torch.cuda.synchronize()
        mode.check()
        _verify(ctx, case, list(case.x), out, combined, combined_w, E, 1, worst, False)
    mode.destroy()
    return replays


def _copy_graph_body(ctx, replays):
    """An exact-size dispatch, then a cached dispatch -> experts -> copy-engine combine along its
    handle captured in one CUDA graph, replayed with new rows on the same routing; every
    replay's sums checked against the reference (the flags of each replay are its own)."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    N, H, E, K = 256, 1024, 8 * R, 4
    mode = nm.NormalMode(
        None, H, E, max_topk=K, device=dev, timeout_s=60, copy_combine_tokens=N,
        copy_combine_min_tokens=0,
    )  # fmt: skip
    x, idx, w = static_inputs(N, H, K, dev)
    case = tag_rows(make_case(0, [N] * R, H, E, K, "random")).copy_to(me, x, idx, w)
    first = mode.dispatch(x, idx, w)

    def step():
        out = mode.dispatch(x, handle=first.handle)
        return mode.combine(_combine_input(out, me), first.handle, first.recv_topk_weights)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            combined, combined_w = step()
    torch.cuda.synchronize()
    for replay in range(replays):
        new = tag_rows(make_case(1 + replay, [N] * R, H, E, K, "random"))
        x.copy_(new.x[me])
        graph.replay()
        torch.cuda.synchronize()
        mode.check()
        wants = ref.normal_dispatch(new.x, case.topk_idx, case.topk_weights, E)
        ys = [_expert_rows(want.recv_x, d) for d, want in enumerate(wants)]
        weights = [want.recv_topk_weights for want in wants]
        expected, expected_w = ref.normal_combine(ys, wants, [N] * R, weights)[me]
        ref.assert_bitwise_equal(combined.cpu(), expected, f"rank {me} replay {replay}")
        ref.assert_bitwise_equal(combined_w.cpu(), expected_w, f"rank {me} replay {replay} w")
    assert int(mode.copy_combine.state[0]) == replays + 1
    mode.destroy()
    return replays


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize("name", ["bf16-4096-h7168-top8", "bf16-uneven-h4096-skewed"])
def test_copy_engine_combine_on_gpus(run_ranks, name):
    tokens, hidden, experts, topk, routing, fp8, worst, _ = GPU_CASES[name]
    R = gpu_ranks()
    args = (2, tokens, hidden, experts * 4 // R, topk, routing, fp8, worst, None, 8192)
    assert run_ranks(R, _normal_body, *args, timeout=240) == [True] * R


@pytest.mark.gpu(n=2)
def test_copy_engine_combine_cuda_graph_replayed_with_new_rows(run_ranks):
    replays = 5 if shared_gpu() else 30
    assert run_ranks(gpu_ranks(), _copy_graph_body, replays, timeout=240) == [replays] * gpu_ranks()


@pytest.mark.gpu(n=2)
def test_worst_case_cuda_graph_replayed_with_new_inputs(run_ranks):
    # 50 replays; 5 where the ranks share one GPU (they take turns on it: ~8 s a replay).
    replays = 5 if shared_gpu() else 50
    assert run_ranks(gpu_ranks(), _graph_body, replays, timeout=240) == [replays] * gpu_ranks()


def _skip_body(ctx, phase):
    """Rank 1 skips ``phase`` (dispatch, or combine after a dispatch); rank 0 must raise."""
    copies = 8 if phase == "copy combine" else 0
    mode = nm.NormalMode(
        None, 128, 2 * ctx.world_size, device=ctx.device, timeout_s=30.0,
        copy_combine_tokens=copies, copy_combine_min_tokens=0,
    )  # fmt: skip
    x = torch.randn(3, 128, device=ctx.device).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]], device=ctx.device)
    if phase in ("combine", "copy combine"):
        out = mode.dispatch(x, idx)
    if ctx.rank == 1:
        return "skipped"
    mode.timeout_s = 1.0
    if phase == "dispatch":
        return timeout_message(lambda: mode.dispatch(x, idx))
    if phase == "worst-case dispatch":  # one launch: its senders exchange the counts
        outs = []
        message = timeout_message(
            lambda: outs.append(mode.dispatch(x, idx, num_worst_tokens=8)), mode.check
        )
        # Rank 0's own rows (all 3 tokens) arrived, but a failed call returns nothing that
        # passes for data.
        out = outs[0]
        assert (out.recv_topk_idx == -1).all(), out.recv_topk_idx
        assert (out.handle.recv_src_idx == -1).all(), out.handle.recv_src_idx
        received = int(out.handle.host_info[0])
        assert received == 3 and out.recv_x[:received].isnan().all(), out.recv_x
        return message
    if copies:  # tokens 1 and 2 have a row from rank 1, which never came: they sum to NaN
        sums = []
        message = timeout_message(
            lambda: sums.append(mode.combine(out.recv_x, out.handle)[0]), mode.check
        )
        assert not sums[0][0].isnan().any() and sums[0][1:].isnan().all(), sums[0]
        return message
    return timeout_message(lambda: mode.combine(out.recv_x, out.handle), mode.check)


@pytest.mark.parametrize(
    "phase, message",
    [
        (
            "dispatch",
            "rank 0 timed out after 1 s in phase 'notify' waiting for peer 1; that "
            "peer is stuck, crashed, or called with different arguments",
        ),
        (
            "worst-case dispatch",
            "rank 0 timed out after 1 s in phase 'notify' waiting for peer 1; that "
            "peer is stuck, crashed, or called with different arguments",
        ),
        # Rank 0's combine receivers wait for rank 1's rows of its tokens, which never come.
        # Several channels wait at once on separate GPUs: whichever gives up first is named.
        (
            "combine",
            r"rank 0 timed out after 1 s in phase 'combine receive, channel \d+' "
            r"waiting for peer 1; that peer is stuck, crashed, or called with "
            r"different arguments",
        ),
        (
            "copy combine",
            "rank 0 timed out after 1 s in phase 'copy combine receive' waiting for peer 1; "
            "that peer is stuck, crashed, or called with different arguments",
        ),
    ],
)
def test_a_rank_that_skips_a_call_makes_the_others_raise(run_ranks, phase, message):
    raised, skipped = run_ranks(2, _skip_body, phase)
    assert re.fullmatch(message, raised), raised
    assert skipped == "skipped"


def _launches_body(ctx):
    """The kernels each first dispatch launches, in order, and whether its outputs match the
    reference (3 ranks, 2 channels: a sender exchanges counts with two peers)."""
    from tritonep.kernels import launcher

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    mode = nm.NormalMode(None, 128, 2 * R, max_topk=2, device=dev, max_sms=4, timeout_s=60)
    launched = []
    triton_path = launcher.KernelLaunch._triton_path

    def counted(self, *args, **kwargs):
        launched.append(getattr(self.fn, "__name__", None) or self.fn.fn.__name__)
        return triton_path(self, *args, **kwargs)

    launcher.KernelLaunch._triton_path = counted
    kernels = {}
    try:
        for call, worst in enumerate((0, 24, 0, 24)):
            case = tag_rows(make_case(call + 7, [5, 8, 3], 128, 2 * R, 2, "random"))
            idx, weights = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
            _, per_expert, in_rank = mode.get_dispatch_layout(idx)
            del launched[:]
            x = case.x[me].to(dev)
            out = mode.dispatch(x, idx, weights, per_expert, in_rank, num_worst_tokens=worst)
            kernels[worst] = list(launched)
            want = ref.normal_dispatch(case.x, case.topk_idx, case.topk_weights, 2 * R)[me]
            _check_dispatch(me, out, want, False, worst, 1)
    finally:
        launcher.KernelLaunch._triton_path = triton_path
    mode.check()
    mode.destroy()
    return kernels


def test_a_worst_case_first_dispatch_is_one_launch(run_ranks):
    """No host read between the count exchange and the rows: the dispatch launch's senders
    exchange the counts first (one launch on the host); an exact-size dispatch reads the
    count between its two launches."""
    for kernels in run_ranks(3, _launches_body):
        assert kernels == {
            0: ["notify_kernel", "normal_dispatch_kernel"],
            24: ["normal_dispatch_kernel"],
        }


def _stuck_destination_body(ctx):
    """Rank 2 sends its counts (worst-case sizes: no host read) but never moves rows, so in
    the second call its rings are still full of the first call's rows: rank 0's sender times
    out on them in its first step, whose tokens also go to rank 1."""
    me, dev, R = ctx.rank, ctx.device, ctx.world_size
    config = nm.Config(num_sms=2, nvl_send_chunk=2, nvl_recv_buffer_tokens=8)
    mode = nm.NormalMode(
        None, 128, 2 * R, max_topk=2, device=dev, max_sms=2, ring_tokens=8, timeout_s=2.0
    )
    result = "no error"
    for call in range(2):
        if me == 2:
            in_rank = torch.zeros(0, R, dtype=torch.bool, device=dev)
            per_expert = torch.zeros(2 * R, dtype=torch.int32, device=dev)
            mode.notify(in_rank, per_expert, 0, 1, 32, config)
            continue
        # Rank 0: tokens 0 and 1 go to ranks 1 and 2, the other six to rank 1 only.
        ids = [[2, 4], [2, 4]] + [[2, -1]] * 6 if me == 0 else [[0, 2]] * 8
        x = torch.full((8, 128), float(100 * call + me), device=dev).to(torch.bfloat16)
        mode.dispatch(x, torch.tensor(ids, device=dev), num_worst_tokens=32, config=config)
        try:
            mode.check()
        except WaitTimeoutError as e:
            result = str(e).split(";")[0]
            break
    return result


def test_a_sender_that_timed_out_sends_nothing_more(run_ranks):
    # Rank 0's later steps go to rank 1 only; had they still been published, rank 1 would
    # read the stale rows of the skipped step as this call's (and raise nothing).
    results = run_ranks(3, _stuck_destination_body)
    assert results == [
        "rank 0 timed out after 2 s in phase 'dispatch send, channel 0' waiting for peer 2",
        "rank 1 timed out after 2 s in phase 'dispatch receive, channel 0' waiting for peer 0",
        "no error",
    ]


def _bad_input_body(ctx):
    R, dev = ctx.world_size, ctx.device
    # check_ids: ids out of range raise here too (without it, the next call raises them).
    mode = nm.NormalMode(None, 256, 4 * R, max_topk=4, device=dev, max_sms=4, check_ids=True)
    x = torch.randn(5, 256, device=dev).to(torch.bfloat16)
    idx = torch.zeros(5, 2, dtype=torch.long, device=dev)
    w = torch.ones(5, 2, device=dev)
    out = mode.dispatch(x, idx, w)
    y = torch.zeros(out.handle.num_rows, 256, dtype=torch.bfloat16, device=dev)
    mode.combine(y, out.handle)  # a good call between the bad ones keeps the ranks in step
    messages = []
    for call in [
        lambda: mode.dispatch(x.float(), idx),
        lambda: mode.dispatch(x[:, :128].contiguous(), idx),
        lambda: mode.dispatch(x, idx + 4 * R),
        lambda: mode.dispatch(x, idx[:4]),
        lambda: mode.dispatch(x, torch.zeros(5, 5, dtype=torch.long, device=dev)),
        lambda: mode.dispatch(x, idx, w.double()),
        lambda: mode.dispatch(x, idx, None, None, torch.zeros(5, R, dtype=torch.bool)),
        lambda: mode.dispatch(x, idx, num_worst_tokens=-1),
        lambda: mode.dispatch(x, idx, config=nm.Config(num_sms=64)),
        lambda: mode.dispatch(x, handle=(1, 2)),
        lambda: mode.dispatch(x, idx, row_map=torch.zeros(5, dtype=torch.int32, device=dev)),
        lambda: mode.dispatch(
            x,
            handle=out.handle,
            row_map=torch.zeros(out.handle.num_rows, dtype=torch.int64, device=dev),
        ),
        lambda: mode.combine(torch.cat([y, y[:1], x[:1]]), out.handle),
        lambda: mode.combine(y, out.handle, bias=x[:4]),
        lambda: mode.combine(y, out.handle, topk_weights=torch.ones(y.shape[0], 9, device=dev)),
    ]:
        try:
            call()
            messages.append("accepted")
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    mode.destroy()
    return messages, out.handle.num_rows


def test_bad_input_raises_before_launch(run_ranks):
    for messages, rows in run_ranks(2, _bad_input_body):
        assert messages == [
            "TypeError: x: expected dtype torch.bfloat16 (FP8 goes as a tuple (x, scales)), "
            "got torch.float32",
            "ValueError: x: expected hidden size 256, got 128",
            "ValueError: topk_idx: expert ids must lie in [-1, 8) (-1 = no expert), found 8",
            "ValueError: topk_idx: expected shape [5, *], got [4, 2]",
            "ValueError: topk_idx: top-k 5 exceeds max_topk=4",
            "TypeError: topk_weights: expected dtype torch.float32, got torch.float64",
            "ValueError: num_tokens_per_expert, is_token_in_rank: give both (from "
            "get_dispatch_layout) or neither",
            "ValueError: num_worst_tokens: expected an int >= 0, got -1",
            "ValueError: config: num_sms must lie in [2, 4] for this buffer, got 64",
            "TypeError: handle: expected a NormalHandle, got tuple",
            "ValueError: row_map: only in cached mode (the handle of a dispatch)",
            "TypeError: row_map: expected dtype torch.int32, got torch.int64",
            f"ValueError: x: expected shape [{rows}, 256], got [{rows + 1 + min(rows, 1)}, 256]",
            "ValueError: bias: expected shape [5, 256], got [4, 256]",
            "ValueError: topk_weights: top-k 9 outside [1, 4]",
        ]
