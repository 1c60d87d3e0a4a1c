"""DeepEP V2's ``ElasticBuffer`` through ``tritonep.deep_ep``, checked as strictly as V2's own
test: received rows, ids, weights and scale packs per source rank bit for bit against the
reference (:mod:`tritonep.reference.elastic`), counts and prefix sums, the expanded layout
folding back to the plain one, zeroed padding, cached dispatches equal to uncached ones,
repeated calls equal, and combine equal to the reference that sums in DeepEP V2's order.
Outputs are poisoned (tests/conftest.py), so a row no kernel wrote cannot pass.
"""

import functools
import hashlib
import json

import pytest
import torch
import torch.distributed as dist

import tritonep.deep_ep as deep_ep
from tests.conftest import gpu_ranks
from tritonep import quantize_fp8
from tritonep.reference import pack_ue8m0
from tritonep.reference.elastic import (
    elastic_combine,
    elastic_combine_unreduced,
    elastic_dispatch,
    rank_partials,
)


def _choices(gen, num_tokens, num_experts, topk, masked):
    """Distinct experts per token, a share of the choices dropped (``-1``)."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    idx = scores.topk(topk, dim=-1).indices
    idx[torch.rand(num_tokens, topk, generator=gen) < masked] = -1
    return idx


def _inputs(rank, tokens, hidden, num_experts, topk, fp8, seed):
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    n = tokens[rank]
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    idx = _choices(gen, n, num_experts, topk, 0.2)
    weights = torch.rand(n, topk, generator=gen)
    if fp8 in ("quantized", "quantized-ue8m0"):
        # What tritonep.quantize_fp8 makes of the rows: ceil(H / 128) float32 scales (a
        # partial last group has its own), or those as UE8M0 packs, ceil(ceil(H / 128) / 4).
        ue8m0 = fp8 == "quantized-ue8m0"
        q, sf = quantize_fp8(x, use_ue8m0=ue8m0)
        assert sf.shape == (n, -(-hidden // 128))
        x = (q, pack_ue8m0(sf) if ue8m0 else sf)
    elif fp8:  # e4m3 bytes from random bits (any value travels), float32 or UE8M0 packs
        q = torch.randint(0, 256, (n, hidden), generator=gen, dtype=torch.uint8)
        q[(q & 0x7F) == 0x7F] = 0  # no NaN encodings: torch.equal must hold
        packs = -(-hidden // 128)
        sf = (
            torch.rand(n, packs, generator=gen)
            if fp8 == "f32"
            else torch.randint(0, 1 << 30, (n, -(-packs // 4)), generator=gen, dtype=torch.int32)
        )
        x = (q.view(torch.float8_e4m3fn), sf)
    return x, idx, weights


def _gather_inputs(ctx, tokens, hidden, num_experts, topk, fp8, seed):
    """Every rank's inputs (each rank draws them all from the same seeds)."""
    return [_inputs(r, tokens, hidden, num_experts, topk, fp8, seed) for r in range(ctx.world_size)]


def _summands(rows, hidden, seed):
    """BF16 values that are 2^26, -2^26 or about 1, each a third of the time: a float32 sum of
    them depends on the order of its terms (2^26 + 1 - 2^26 is 0, 2^26 - 2^26 + 1 is 1), so a
    combine that adds the rows of a token in another order than the reference fails."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (rows, hidden), generator=gen)
    small = torch.randn(rows, hidden, generator=gen)
    big = torch.where(kind == 0, 2.0**26, -(2.0**26))
    return torch.where(kind == 2, small, big).to(torch.bfloat16)


def _to(x, dev):
    return tuple(t.to(dev) for t in x) if isinstance(x, tuple) else x.to(dev)


def _bf16_rows(recv_x):
    return recv_x[0].view(torch.uint8) if isinstance(recv_x, tuple) else recv_x


def _check_plain(recv_x, recv_idx, recv_w, handle, ref, num_recv, exact):
    """The plain layout against the reference, bit for bit."""
    payload, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    rows = payload.shape[0]
    assert rows == num_recv if exact else rows >= num_recv
    assert torch.equal(_bf16_rows(payload[:num_recv].cpu()), _bf16_rows(ref.recv_x))
    if sf is not None:
        assert torch.equal(sf[:num_recv].cpu(), ref.recv_sf)
    assert torch.equal(recv_idx[:num_recv].cpu(), ref.recv_topk_idx)
    assert torch.equal(recv_w[:num_recv].cpu(), ref.recv_topk_weights)
    meta = handle.recv_src_metadata.cpu()
    assert torch.equal(meta[:num_recv, 0].long(), ref.src_global)
    assert torch.equal(meta[:num_recv, 1].long(), ref.first_col)
    # Worst-case rows past the received ones are marked, never data.
    assert bool((recv_idx[num_recv:] == -1).all()) and bool((recv_w[num_recv:] == 0).all())
    assert bool((meta[num_recv:] == -1).all())


def _digest(*tensors) -> str:
    """One hash of the bytes of ``tensors`` (tuples opened)."""
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, tuple):
            h.update(_digest(*t).encode())
        elif t is not None:
            h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rows(x, n):
    """The first ``n`` rows of a tensor or of each tensor of a tuple."""
    return tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n]


def _check_dst_slots(slots, all_idx, rank, experts_per_rank, num_ranks):
    """Each choice's slot on its destination: the token's rank among this rank's tokens that
    go there (``-1`` for no choice)."""
    idx = all_idx[rank]
    owner = torch.where(idx >= 0, idx // experts_per_rank, -1)
    want = torch.full(idx.shape, -1, dtype=torch.int32)
    for d in range(num_ranks):
        goes = (owner == d).any(1)
        order = goes.int().cumsum(0) - 1
        want = torch.where(owner == d, order[:, None].expand_as(idx).int(), want)
    assert torch.equal(slots.cpu(), want)


def _check_counts(handle, ref, exact):
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == ref.psum_rank
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == ref.num_unaligned
    if exact:
        assert handle.num_recv_tokens == ref.num_recv_tokens
        assert handle.num_recv_tokens_per_expert_list == ref.num_aligned
    else:
        assert handle.num_recv_tokens_per_expert_list == []
    want = ref.psum_expert_expand if handle.do_expand else ref.psum_expert_plain
    assert handle.psum_num_recv_tokens_per_expert.tolist() == want


def _check_expanded(recv_x, recv_w, handle, ref, zeroed):
    """The expanded layout: every local choice's row, folded back, equals the plain row;
    padding rows are zero when asked."""
    payload, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    n = ref.num_recv_tokens
    rows = ref.expanded_row
    assert torch.equal(handle.recv_src_metadata[:n, 2:].cpu().long(), rows)
    used = rows[rows >= 0]
    want = ref.expand(_bf16_rows(ref.recv_x))
    assert torch.equal(_bf16_rows(payload.cpu())[used], want[used])
    if sf is not None:
        assert torch.equal(sf.cpu()[used], ref.expand(ref.recv_sf)[used])
        if isinstance(recv_x, tuple) and sf.shape[0] > 1:  # TMA-aligned column-major packs
            assert sf.stride() == (1, -(-sf.shape[0] // 4) * 4)
    assert torch.equal(recv_w.cpu()[used], ref.expand_weights()[used])
    if zeroed:
        pads = torch.ones(ref.num_expanded_tokens, dtype=torch.bool)
        pads[used] = False
        assert not bool(_bf16_rows(payload.cpu())[: ref.num_expanded_tokens][pads].any())
        assert not bool(recv_w.cpu()[: ref.num_expanded_tokens][pads].any())
        if sf is not None:
            assert not bool(sf.cpu()[: ref.num_expanded_tokens][pads].any())


def _elastic_body(
    ctx,
    tokens,
    hidden,
    experts_per_rank,
    topk,
    fp8=None,
    exact=True,
    alignment=1,
    num_bias=1,
    reduce_per_rank=True,
    defaults=False,
):
    try:
        return _elastic_calls(
            ctx, tokens, hidden, experts_per_rank, topk, fp8, exact, alignment, num_bias,
            reduce_per_rank, defaults,
        )  # fmt: skip
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


def _elastic_calls(
    ctx,
    tokens,
    hidden,
    experts_per_rank,
    topk,
    fp8,
    exact,
    alignment,
    num_bias,
    reduce_per_rank,
    defaults,
):
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    group = dist.group.WORLD
    num_experts = experts_per_rank * R
    M = max(tokens[:R]) + 1
    inputs = _gather_inputs(ctx, tokens[:R], hidden, num_experts, topk, fp8, seed=3)
    all_x = [i[0] for i in inputs]
    all_idx = [i[1] for i in inputs]
    all_w = [i[2] for i in inputs]
    refs = elastic_dispatch(all_x, all_idx, all_w, num_experts, M, alignment)
    ref = refs[rank]
    x, idx, weights = _to(all_x[rank], dev), all_idx[rank].to(dev), all_w[rank].to(dev)
    if defaults:  # what DeepEP's test harness sets, process-wide: around every call below
        torch.set_default_device(ctx.device)
        torch.set_default_dtype(torch.bfloat16)
    buffer = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=M,
        hidden=hidden,
        num_topk=topk,
        use_fp8_dispatch=False,
        allow_multiple_reduction=reduce_per_rank,
        explicitly_destroy=True,
    )
    assert buffer.get_logical_domain_size() == (1, R)
    stats = torch.zeros(experts_per_rank, dtype=torch.int32, device=dev)
    common = dict(num_experts=num_experts, expert_alignment=alignment, do_cpu_sync=exact)
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, idx, weights, cumulative_local_expert_recv_stats=stats, **common
    )
    event.current_stream_wait() if event.event is not None else None
    n = ref.num_recv_tokens
    assert torch.equal(handle.topk_idx.cpu(), idx.cpu()) and handle.topk_idx is not idx
    assert stats.tolist() == ref.num_unaligned
    _check_counts(handle, ref, exact)
    _check_plain(recv_x, recv_idx, recv_w, handle, ref, n, exact)
    _check_dst_slots(handle.dst_buffer_slot_idx, all_idx, rank, experts_per_rank, R)
    # The same call again: the same bits everywhere (rows come in a fixed order).
    again = buffer.dispatch(x, idx, weights, **common)
    first = [_rows(recv_x, n), recv_idx[:n], recv_w[:n], handle.recv_src_metadata]
    assert _digest(*[_rows(t, n) for t in again[:3]], again[3].recv_src_metadata) == _digest(*first)
    # Expanded, with TMA-aligned packs and zeroed padding.
    ex_x, ex_idx, ex_w, ex_handle, _ = buffer.dispatch(
        x,
        idx,
        weights,
        do_expand=True,
        use_tma_aligned_col_major_sf=True,
        do_zero_padding=True,
        **common,
    )
    assert ex_idx is None and ex_w.dim() == 1
    _check_counts(ex_handle, ref, exact)
    _check_expanded(ex_x, ex_w, ex_handle, ref, zeroed=True)
    # Cached: the same rows again (no ids given), then expanded with the expanded handle.
    c_x, c_idx, c_w, c_handle, _ = buffer.dispatch(x, handle=handle)
    assert c_handle is handle and c_w is None
    assert torch.equal(_bf16_rows(c_x)[:n].cpu(), _bf16_rows(recv_x)[:n].cpu())
    assert torch.equal(c_idx[:n], recv_idx[:n])
    ce_x, _, ce_w, _, _ = buffer.dispatch(
        x, topk_weights=weights, handle=ex_handle, do_expand=True, use_tma_aligned_col_major_sf=True
    )
    used = ref.expanded_row[ref.expanded_row >= 0]
    assert torch.equal(_bf16_rows(ce_x).cpu()[used], _bf16_rows(ex_x).cpu()[used])
    assert torch.equal(ce_w.cpu()[used], ex_w.cpu()[used])

    # Combine: each rank returns, per received token, a row that names it; expanded rows
    # differ per choice, so the per-rank sums and their order matter.
    y = _summands(recv_x[0].shape[0] if fp8 else recv_x.shape[0], hidden, 50 + rank)
    ey = _summands(ex_handle.num_expanded_tokens, hidden, 70 + rank)
    all_bias = [
        tuple(_summands(tokens[s], hidden, 90 + 7 * s + b) for b in range(num_bias))
        for s in range(R)
    ]
    bias = tuple(b.to(dev) for b in all_bias[rank])
    bias_arg = None if num_bias == 0 else bias[0] if num_bias == 1 else bias
    out, out_w, _ = buffer.combine(y.to(dev), handle, recv_w, bias=bias_arg)
    ys = [None] * R
    dist.all_gather_object(ys, y[:n])
    srcs = [r.src_global for r in refs]
    want = elastic_combine(ys, srcs, all_idx, M, experts_per_rank, all_bias)[rank]
    assert torch.equal(out.cpu(), want), (out.cpu() - want).abs().max()
    kept = all_idx[rank] >= 0
    assert torch.equal(out_w.cpu()[kept], all_w[rank][kept])
    assert not bool(out_w.cpu()[~kept].any())
    # Expanded combine (weights handed back from the expanded rows).
    ex_weights = ex_w if reduce_per_rank else None
    e_out, e_w, _ = buffer.combine(ey.to(dev), ex_handle, ex_weights, bias=bias_arg)
    eys = [None] * R
    dist.all_gather_object(eys, ey)
    if reduce_per_rank:
        partial = [rank_partials(eys[d], refs[d].expanded_row) for d in range(R)]
        want = elastic_combine(partial, srcs, all_idx, M, experts_per_rank, all_bias)[rank]
        assert torch.equal(e_w.cpu()[kept], all_w[rank][kept])
    else:
        want = elastic_combine_unreduced(eys, refs, all_idx, M, all_bias)[rank]
        assert e_w is None
    assert torch.equal(e_out.cpu(), want), (e_out.cpu() - want).abs().max()
    buffer.destroy()
    return True


@pytest.mark.parametrize(
    "tokens, fp8, exact, alignment, num_bias, reduce_per_rank",
    [
        ([7, 0], None, True, 1, 1, True),
        ([7, 0, 5], None, False, 4, 2, True),
        ([6, 3], "f32", True, 4, 0, True),
        ([5, 0, 7], "ue8m0", False, 1, 1, True),
        ([7, 2, 5], None, True, 2, 2, False),
        # two push programs of two blocks each: the counts before a program's range
        ([37, 20], None, False, 2, 0, True),
    ],
    ids=[
        "bf16",
        "bf16-worst-align4-3ranks",
        "fp8",
        "fp8-ue8m0-worst-3ranks",
        "bf16-unreduced",
        "bf16-two-programs",
    ],
)
def test_elastic_dispatch_combine(
    run_ranks, tokens, fp8, exact, alignment, num_bias, reduce_per_rank
):
    """Dispatch (plain, expanded, cached) and combine (plain, expanded) against the reference
    on CPU ranks. Hidden 136 (BF16) and 272 (FP8: a partial last group of 128 channels)."""
    hidden = 272 if fp8 else 136
    R = len(tokens)
    args = (tokens, hidden, 3, 4, fp8, exact, alignment, num_bias, reduce_per_rank)
    assert run_ranks(R, _elastic_body, *args) == [True] * R


def _tuned_body(ctx, fields, *args):
    """:func:`_elastic_body` under the elastic mode's ``Tuning`` with ``fields`` changed."""
    import dataclasses

    import tritonep.modes.elastic as mode

    saved = mode.TUNING
    mode.TUNING = dataclasses.replace(saved, **fields)
    try:
        return _elastic_body(ctx, *args)
    finally:
        mode.TUNING = saved


@pytest.mark.parametrize(
    "tokens, exact", [([37, 20], False), ([7, 2, 5], True)], ids=["worst", "exact-3ranks"]
)
def test_expanded_rows_summed_before_the_push_match_the_reference(run_ranks, tokens, exact):
    """The expanded combine of large batches, its rows summed per token on every SM before
    a plain push (:func:`~tritonep.kernels.elastic_combine.elastic_combine_sums`, what
    combines of more than a decode batch's tokens take on GPUs), gives the reference's bits
    (rows, weights, biases), as the push's own sums."""
    R = len(tokens)
    args = (tokens, 136, 3, 4, None, exact, 2, 2, True)
    assert run_ranks(R, _tuned_body, {"sum_first_tokens": 0}, *args) == [True] * R


def test_epilogues_on_one_sm_match_the_reference(run_ranks):
    """With ``Tuning.epilogue_sms`` the copy and reduce epilogues run on that many programs
    (what a caller beside a persistent GEMM may want): one program walks every block of the
    received rows and of the tokens, and gives the reference's bits."""
    args = ([37, 20], 136, 3, 4, None, False, 2, 2, True)
    assert run_ranks(2, _tuned_body, {"epilogue_sms": 1}, *args) == [True] * 2


def _plans_body(ctx):
    """Exact-size dispatches and combines whose received counts differ from call to call (as
    a training step's do), checked against the reference; returns how many plans and
    launches the mode keeps."""
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=6, hidden=64, num_topk=2, explicitly_destroy=True
    )
    received = set()
    for seed in range(4):
        inputs = _gather_inputs(ctx, [6] * R, 64, 4 * R, 2, None, seed=10 + seed)
        refs = elastic_dispatch(*[[i[k] for i in inputs] for k in range(3)], 4 * R, 6, 1)
        x, idx, w = (t.to(dev) for t in inputs[rank])
        recv_x, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=4 * R)
        n = refs[rank].num_recv_tokens
        assert handle.num_recv_tokens == n and torch.equal(
            recv_x.cpu(), _bf16_rows(refs[rank].recv_x)
        )
        received.add(n)
        out, _, _ = buffer.combine(recv_x, handle)
        assert out.shape == (6, 64) and not bool(out.isnan().any())
    mode = buffer.runtime
    sizes = [
        len(received),
        len(mode._epilogue_plans),
        len(mode._combine_plans),
        len(mode._launches),
    ]
    buffer.destroy()
    return sizes


def test_plans_do_not_follow_the_received_count(run_ranks):
    """A plan is per call shape and tile, not per received count: four exact-size calls with
    different counts keep one copy-epilogue plan, one combine plan and four launches (push,
    copy, combine push, reduce)."""
    for received, *kept in run_ranks(2, _plans_body):
        assert received > 1 and kept == [1, 1, 4]


def _skipped_exact_body(ctx):
    """Rank 1 skips an exact-size dispatch: rank 0's host, which waits for the counts its
    push writes to host memory, raises the push's timeout, naming rank, peer and phase;
    then a new buffer on both ranks dispatches exactly again."""
    import contextlib
    import time

    from tritonep.errors import WaitTimeoutError

    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    limit = 1 if dev.type == "cuda" else 0.1
    inputs = _gather_inputs(ctx, [6] * R, 64, 4 * R, 2, None, seed=21)
    x, idx, w = (t.to(dev) for t in inputs[rank])

    def build(seconds):
        return deep_ep.ElasticBuffer(
            dist.group.WORLD,
            num_max_tokens_per_rank=6,
            hidden=64,
            num_topk=2,
            num_gpu_timeout_secs=seconds,
            explicitly_destroy=True,
        )

    buffer = build(limit)
    error, took = None, 0.0
    if rank == 0:
        start = time.monotonic()
        try:
            buffer.dispatch(x, idx, w, num_experts=4 * R)
        except WaitTimeoutError as e:
            error = str(e)
        took = time.monotonic() - start
    dist.barrier()
    with contextlib.suppress(WaitTimeoutError):  # the same timeout, reported again
        buffer.destroy()
    buffer = build(100)
    refs = elastic_dispatch(*[[i[k] for i in inputs] for k in range(3)], 4 * R, 6, 1)
    recv_x, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=4 * R)
    n = refs[rank].num_recv_tokens
    exact = handle.num_recv_tokens == n and torch.equal(recv_x.cpu(), _bf16_rows(refs[rank].recv_x))
    buffer.destroy()
    return error, took, exact


def test_a_skipped_exact_size_dispatch_raises_a_named_timeout(run_ranks):
    """The counts of an exact-size dispatch reach the host without a copy, and so does a
    timeout of the push that was to send them: rank 0 raises within the limit."""
    (error, took, exact0), (none, _, exact1) = run_ranks(2, _skipped_exact_body)
    assert none is None and exact0 and exact1
    assert error is not None and error.startswith("rank 0 timed out after"), error
    assert "peer 1" in error and "elastic" in error and took < 30, (error, took)


def test_elastic_calls_under_a_process_wide_default_device_and_dtype(run_ranks):
    """The same checks with ``torch.set_default_device`` and ``set_default_dtype(bfloat16)``
    set around every call (DeepEP's harness sets them; the calls turn torch function modes
    off and pass every device and dtype)."""
    args = ([5, 0, 7], 272, 3, 4, "ue8m0", False, 1, 1, True, True)
    assert run_ranks(3, _elastic_body, *args) == [True] * 3


@pytest.mark.parametrize("fp8", ["quantized", "quantized-ue8m0"])
def test_elastic_takes_what_quantize_fp8_makes(run_ranks, fp8):
    """The scales of :func:`tritonep.quantize_fp8` (as the low-latency mode returns them
    too) are what the elastic mode takes, at a hidden size with a partial last group (208:
    two float32 scales, the last for 80 channels, or one UE8M0 pack)."""
    args = ([6, 0, 4], 208, 2, 3, fp8, True, 2, 1, True)
    assert run_ranks(3, _elastic_body, *args) == [True] * 3


def _dispatch_meta(fp8):
    return dict(
        K=8,
        BLOCK_K=8,
        NUM_EXPERTS=256,
        BLOCK_EXPERTS=256,
        E_LOCAL=64,
        BLOCK_COUNTS=128,
        NUM_RANKS=4,
        BLOCK_RANKS=4,
        ROW_WORDS=1792 if fp8 else 3584,
        BLOCK_WORDS=512,
        G=56 if fp8 else 0,
        BLOCK_GROUPS=64 if fp8 else 2,
        RECORD_BYTES=7680 if fp8 else 14464,
        PAYLOAD_BYTES=7168 if fp8 else 14336,
        SCALE_BYTES=224 if fp8 else 0,
        HEADER_WORDS=1028,
        BLOCK_TOKENS=16,
        SCAN_BLOCK_TOKENS=128,
        HAS_SF=fp8,
        USE_CLOCK=True,
    )


#: The trailing arguments every elastic kernel takes (elastic_exchange.ElasticShared).
SHARED_SIGNATURE = {
    "peer_ptrs": "*i64",
    "rank": "i32",
    "header_offset": "i32",
    "barrier_offset": "i32",
    "region_offset": "i32",
    "region_bytes": "i32",
    "state_ptr": "*i64",
    "status_ptr": "*i32",
    "timeout_us": "i32",
}

#: Every elastic kernel at DeepEP's default sizes (hidden 7168, top-8, 256 experts, 4 ranks):
#: (kernel, profiler name, signature, constexprs).
ELASTIC_KERNELS = [
    (
        "elastic_dispatch",
        "dispatch_impl",
        {
            "x_ptr": "*i32",
            "sf_ptr": "*i32",
            "sf_token_stride": "i32",
            "sf_group_stride": "i32",
            "topk_ptr": "*i64",
            "weights_ptr": "*fp32",
            "num_tokens": "i32",
            "max_tokens": "i32",
            "totals_ptr": "*i32",
            "recv_counts_ptr": "*i32",
            "stats_ptr": "*i32",
            "ids_copy_ptr": "*i64",
            "slots_ptr": "*i32",
            "flags": "i32",
            "trace_ptr": "*i64",
            **SHARED_SIGNATURE,
        },
        _dispatch_meta(True),
    ),
    (
        "elastic_dispatch_epilogue",
        "dispatch_copy_epilogue_impl",
        {
            "recv_counts_ptr": "*i32",
            "max_tokens": "i32",
            "alignment": "i32",
            "num_rows": "i32",
            "num_out_rows": "i32",
            "out_words_ptr": "*i32",
            "out_sf_ptr": "*i32",
            "out_sf_token_stride": "i32",
            "out_sf_group_stride": "i32",
            "out_ids_ptr": "*i64",
            "out_weights_ptr": "*fp32",
            "out_meta_ptr": "*i32",
            "out_slots_ptr": "*i32",
            "psum_rank_ptr": "*i32",
            "psum_expert_ptr": "*i32",
            "unaligned_ptr": "*i32",
            "flags": "i32",
            "trace_ptr": "*i64",
            **SHARED_SIGNATURE,
        },
        dict(
            K=8,
            BLOCK_K=8,
            NUM_RANKS=4,
            BLOCK_RANKS=4,
            E_LOCAL=64,
            BLOCK_LOCAL_EXPERTS=64,
            ROW_WORDS=1792,
            BLOCK_WORDS=512,
            G=56,
            BLOCK_GROUPS=64,
            RECORD_BYTES=7680,
            PAYLOAD_BYTES=7168,
            SCALE_BYTES=224,
            BLOCK_ROWS=16,
            BLOCK_FILL=128,
            EXPAND=True,
            HAS_SF=True,
        ),
    ),
    (
        "elastic_combine",
        "combine_impl",
        {
            "x_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "meta_ptr": "*i32",
            "slots_ptr": "*i32",
            "psum_rank_ptr": "*i32",
            "max_tokens": "i32",
            "has_weights": "i32",
            "trace_ptr": "*i64",
            **SHARED_SIGNATURE,
        },
        dict(
            H=7168,
            K=8,
            BLOCK_K=8,
            NUM_RANKS=4,
            BLOCK_RANKS=4,
            COMBINE_RECORD_BYTES=14368,
            HEADER_WORDS=1028,
            BLOCK_ROWS=8,
            BLOCK_CHANNELS=1024,
            EXPAND=True,
            MULTI=True,
            USE_CLOCK=True,
        ),
    ),
    (
        "elastic_combine_epilogue",
        "combine_reduce_epilogue_impl",
        {
            "topk_ptr": "*i64",
            "bias0_ptr": "*bf16",
            "bias1_ptr": "*bf16",
            "out_ptr": "*bf16",
            "out_weights_ptr": "*fp32",
            "num_tokens": "i32",
            "max_tokens": "i32",
            "num_bias": "i32",
            "has_weights": "i32",
            "trace_ptr": "*i64",
            **SHARED_SIGNATURE,
        },
        dict(
            H=7168,
            K=8,
            BLOCK_K=8,
            NUM_EXPERTS=256,
            E_LOCAL=64,
            SLOTS=4,
            RANK_SLOTS=True,
            COMBINE_RECORD_BYTES=14368,
            BLOCK_TOKENS=8,
            BLOCK_CHANNELS=1024,
            USE_CLOCK=True,
        ),
    ),
    (
        "elastic_barrier",
        "barrier",
        dict(SHARED_SIGNATURE),
        dict(NUM_RANKS=4, BLOCK_RANKS=4, USE_CLOCK=True),
    ),
    (
        "elastic_combine_sums",
        "combine_sums_impl",
        {
            "x_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "meta_ptr": "*i32",
            "psum_rank_ptr": "*i32",
            "sums_ptr": "*bf16",
            "sum_weights_ptr": "*fp32",
            "has_weights": "i32",
            "trace_ptr": "*i64",
            **SHARED_SIGNATURE,
        },
        dict(
            H=7168, K=8, BLOCK_K=8, NUM_RANKS=4, BLOCK_ROWS=8, BLOCK_CHANNELS=1024, USE_CLOCK=True
        ),
    ),
]


@pytest.mark.parametrize("kernel", ELASTIC_KERNELS, ids=[k[0] for k in ELASTIC_KERNELS])
def test_elastic_kernels_compile_under_their_profiler_names(kernel):
    """Each kernel compiles for Hopper, and its symbol demangles to the name profilers show
    and DeepEP's benchmark looks for (``tritonep::elastic::dispatch_impl()`` contains
    ``dispatch_impl``, and ``dispatch_copy_epilogue_impl`` does not)."""
    import re

    pytest.importorskip("triton.backends.nvidia")
    ptx = _elastic_ptx(kernel)
    (symbol,) = re.findall(r"\.entry (\w+)", ptx)
    assert torch._C._demangle(symbol) == f"tritonep::elastic::{kernel[1]}()"


def _elastic_job(kernel, **extra) -> list:
    from tests.test_kernels_compile import _job

    name, _, signature, meta = kernel
    module = "tritonep.kernels." + (
        "elastic_exchange"
        if name == "elastic_barrier"
        else "elastic_combine"
        if "combine" in name
        else "elastic_dispatch"
    )
    meta = {**meta, **extra}
    signature = {**signature, **dict.fromkeys(meta, "constexpr")}
    return _job(module, name, signature, meta, {"num_warps": 8})


@functools.cache
def _elastic_variants() -> dict[str, dict]:
    """The variants these tests read (plain, PDL, traced) of the elastic kernels, compiled in
    one process, which pays Triton's and tritonep's imports once."""
    from tests.test_kernels_compile import _compile

    extras = ({}, {"PDL": True}, {"PROFILE": True, "USE_CLOCK": True})
    jobs = [_elastic_job(k, **e) for k in ELASTIC_KERNELS[:4] for e in extras]
    return _compile(jobs + [_elastic_job(k) for k in ELASTIC_KERNELS[4:]])


def _elastic_ptx(kernel, **extra) -> str:
    from tests.test_kernels_compile import _compile

    job = _elastic_job(kernel, **extra)
    key = json.dumps(job)
    result = _elastic_variants().get(key) or _compile([job])[key]
    assert "ptx" in result, result["error"][-3000:]
    return result["ptx"]


@pytest.mark.parametrize("push, epilogue", [(0, 1), (2, 3)], ids=["dispatch", "combine"])
def test_elastic_epilogue_is_a_programmatic_dependent_of_its_push(push, epilogue):
    """On sm_90 the push lets its epilogue launch (griddepcontrol.launch_dependents) once its
    rows are stored and the epilogue waits for the push's grid (griddepcontrol.wait) before
    anything else; the default variants (the interpreter's, or GPUs before sm_90) carry
    neither."""
    pytest.importorskip("triton.backends.nvidia")
    push_ptx = _elastic_ptx(ELASTIC_KERNELS[push], PDL=True)
    epilogue_ptx = _elastic_ptx(ELASTIC_KERNELS[epilogue], PDL=True)
    assert "griddepcontrol.launch_dependents" in push_ptx
    assert "griddepcontrol.wait" not in push_ptx
    # The push releases its epilogue after its rows' stores, not before: a released epilogue
    # holds every SM until the push ends (beside a GEMM, the GEMM would wait for both).
    push_body = push_ptx[push_ptx.index(".entry") :]
    release = push_body.index("griddepcontrol.launch_dependents")
    assert release > push_body.rindex("st.global.v4.b32")
    assert "griddepcontrol.wait" in epilogue_ptx
    # The wait comes before the epilogue's first load from memory.
    body = epilogue_ptx[epilogue_ptx.index(".entry") :]
    assert body.index("griddepcontrol.wait") < body.index("ld.global")
    for kernel in (ELASTIC_KERNELS[push], ELASTIC_KERNELS[epilogue]):
        assert "griddepcontrol" not in _elastic_ptx(kernel)


def test_elastic_rows_move_in_16_byte_vectors():
    """Every row an elastic kernel moves goes in 16-byte vectors, peers' records included:
    their addresses come from loaded heap bases, whose alignment Triton cannot see unless the
    kernel states it; without that a BF16 row moves one value per store (a combine push of
    4096 tokens on 4x H200 took 2.6 times as long)."""
    pytest.importorskip("triton.backends.nvidia")
    dispatch, copy, combine, reduce = (_elastic_ptx(k) for k in ELASTIC_KERNELS[:4])
    plain = _elastic_ptx(ELASTIC_KERNELS[2], EXPAND=False)  # one row per received token
    sums = _elastic_ptx(ELASTIC_KERNELS[5])
    assert "st.global.v4.b32" in sums and "ld.global.v4.b32" in sums
    assert "st.global.v4.b32" in dispatch  # rows into the peers' records
    assert "st.global.v4.b32" in copy  # records into the outputs
    for push in (combine, plain):
        assert "st.global.v4.b32" in push and "st.global.b16" not in push
    assert "ld.global.cg.v4.b32" in reduce and "ld.global.cg.b16" not in reduce


#: DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` (v2.1.0): every public method's arguments in
#: order, with their defaults. Ours take each of them, in this order, with the same default.
V2_SIGNATURES = {
    "__init__": "group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, "
    "num_topk=0, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, "
    "allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=3, "
    "num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, "
    "explicitly_destroy=False",
    "destroy": "",
    "get_buffer_size_hint": "group, num_max_tokens_per_rank, hidden, num_topk=0, "
    "use_fp8_dispatch=False, allow_hybrid_mode=True, allow_multiple_reduction=True",
    "barrier": "use_comm_stream=True, with_cpu_sync=False, sequential=True",
    "capture": "",
    "get_comm_stream": "",
    "get_physical_domain_size": "",
    "get_logical_domain_size": "",
    "get_theoretical_num_sms": "num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, "
    "nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50",
    "get_theoretical_num_qps": "num_sms",
    "dispatch": "x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, "
    "num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, "
    "num_qps=0, previous_event=None, previous_event_before_epilogue=None, "
    "async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None, "
    "do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False, "
    "use_tma_aligned_col_major_sf=False",
    "combine": "x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, "
    "previous_event=None, previous_event_before_epilogue=None, "
    "async_with_compute_stream=False, allocate_on_comm_stream=False",
    "engram_write": "storage, sf=None",
    "engram_fetch": "indices, num_qps=0, use_tma_aligned_col_major_sf=False",
    "pp_send": "t, dst_rank_idx, num_sms=0",
    "pp_recv": "t, src_rank_idx, num_sms=0",
    "agrs_new_session": "enabled=True",
    "all_gather": "t",
}
EP_HANDLE = (
    "do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx, "
    "num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list, "
    "psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert, "
    "num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx, "
    "token_metadata_at_forward, channel_linked_list"
)


def _arguments(fn) -> list[str]:
    import inspect

    return [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


def test_signatures_match_deep_ep_v2():
    for name, spec in V2_SIGNATURES.items():
        theirs = [a for a in spec.split(", ") if a]
        ours = _arguments(getattr(deep_ep.ElasticBuffer, name))
        assert [a for a in ours if a in theirs] == theirs, (name, ours)
        assert all("=" in a for a in ours if a not in theirs), (name, ours)
    theirs = EP_HANDLE.split(", ")
    assert _arguments(deep_ep.EPHandle)[: len(theirs)] == theirs
    assert {"ElasticBuffer", "EPHandle", "get_physical_domain_size"} <= set(deep_ep.__all__)
    assert deep_ep.__version__ == "2.1.0"


def _errors_body(ctx):
    """Bad arguments raise before any kernel runs, naming the argument; V2's experimental
    features raise NotImplementedError naming the feature."""
    R, dev = ctx.world_size, ctx.device
    group = dist.group.WORLD
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=64, num_topk=2)
    assert buffer.num_bytes == deep_ep.ElasticBuffer.get_buffer_size_hint(group, 4, 64, 2)
    assert buffer.num_bytes % (2 << 20) == 0
    assert buffer.get_physical_domain_size() == (1, R) == deep_ep.get_physical_domain_size(group)
    assert buffer.get_theoretical_num_sms(4 * R, 2) % 2 == 0
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(3, 2, dtype=torch.int64, device=dev)
    errors = []
    calls = [
        lambda: buffer.dispatch(x, idx),  # no num_experts
        lambda: buffer.dispatch(x.float(), idx, num_experts=4 * R),
        lambda: buffer.dispatch(x[:, :60], idx, num_experts=4 * R),  # 120-byte rows
        lambda: buffer.dispatch(
            torch.zeros(5, 64, dtype=torch.bfloat16, device=dev),
            torch.zeros(5, 2, dtype=torch.int64, device=dev),
            num_experts=4 * R,
        ),
        lambda: buffer.dispatch(x, idx, num_experts=4 * R, do_zero_padding=True),
        lambda: buffer.dispatch(x, idx.int(), num_experts=4 * R),
        lambda: buffer.dispatch(x, idx, num_experts=4 * R, num_qps=1000),
        lambda: buffer.engram_fetch(idx),
        lambda: buffer.pp_send(x, 0),
        lambda: buffer.all_gather(x),
        lambda: deep_ep.ElasticBuffer(group, num_cpu_bytes=1 << 21, num_bytes=1 << 22),
    ]
    for call in calls:
        try:
            call()
            errors.append("accepted")
        except (TypeError, ValueError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {str(e).split(':')[0]}")
    # Not a call's worth of memory: refused with the size it needs.
    small = deep_ep.ElasticBuffer(group, num_bytes=1 << 16)
    try:
        small.dispatch(x, idx, num_experts=4 * R, num_max_tokens_per_rank=4096)
        errors.append("accepted")
    except ValueError as e:
        errors.append("ValueError: " + ("get_buffer_size_hint" in str(e)) * "size hint")
    small.destroy()
    buffer.destroy()
    return errors


def test_elastic_errors(run_ranks):
    for errors in run_ranks(2, _errors_body):
        assert errors == [
            "ValueError: num_experts",
            "TypeError: x",
            "ValueError: x",
            "ValueError: num_max_tokens_per_rank",
            "ValueError: do_zero_padding",
            "TypeError: topk_idx",
            "ValueError: num_qps",
            "NotImplementedError: Engram (remote KV-cache fetch) is not implemented in tritonep",
            "NotImplementedError: pipeline-parallel send/recv (PP) is not implemented in tritonep",
            "NotImplementedError: all-gather reduce-scatter (AGRS, all_gather) is not "
            "implemented in tritonep",
            "NotImplementedError: num_cpu_bytes",
            "ValueError: size hint",
        ]


def _graph_body(ctx, num_tokens, hidden, experts_per_rank, topk):
    """Decode as V2 serves it: worst-case sizes, the expanded layout, dispatch and combine in
    one CUDA graph, replayed with new inputs; every replay equals eager calls. Also events:
    ``previous_event`` and ``async_with_compute_stream`` give the same results."""
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    group = dist.group.WORLD
    num_experts = experts_per_rank * R
    buffer = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=num_tokens,
        hidden=hidden,
        num_topk=topk,
        explicitly_destroy=True,
    )
    common = dict(num_experts=num_experts, expert_alignment=16, do_cpu_sync=False, do_expand=True)

    def step(x, idx, w):
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, w, **common)
        y = recv_x * 2  # an "expert" that doubles its rows (padding rows: whatever they hold)
        out, out_w, _ = buffer.combine(y, handle, recv_w)
        return recv_x, recv_w, handle.recv_src_metadata, out, out_w

    def inputs(seed):
        x, idx, w = _inputs(rank, [num_tokens] * R, hidden, num_experts, topk, None, seed)
        return x.to(dev), idx.to(dev), w.to(dev)

    static = inputs(1)
    eager = step(*static)  # warm-up: compiles every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    for seed in (2, 3):
        fresh = inputs(seed)
        for t, new in zip(static, fresh, strict=True):
            t.copy_(new)
        graph.replay()
        want = step(*fresh)
        torch.cuda.synchronize()
        n = int(want[2][:, 0].ge(0).sum())
        got_rows = captured[2][:n, 2:]
        used = got_rows[got_rows >= 0].long()
        assert torch.equal(captured[2], want[2])
        assert torch.equal(captured[0][used], want[0][used])
        assert torch.equal(captured[1][used], want[1][used])
        assert torch.equal(captured[3], want[3]) and torch.equal(captured[4], want[4])
    # Events: the same results through previous_event and an asynchronous finish.
    x, idx, w = inputs(4)
    sync = buffer.dispatch(x, idx, w, num_experts=num_experts)
    late = buffer.dispatch(
        x,
        idx,
        w,
        num_experts=num_experts,
        previous_event=buffer.capture(),
        allocate_on_comm_stream=True,
        async_with_compute_stream=True,
    )
    late[-1].current_stream_wait()
    assert torch.equal(sync[0], late[0]) and torch.equal(sync[1], late[1])
    out_sync = buffer.combine(sync[0], sync[3], sync[2])
    out_late = buffer.combine(
        sync[0], sync[3], sync[2], previous_event=buffer.capture(), async_with_compute_stream=True
    )
    out_late[-1].current_stream_wait()
    assert torch.equal(out_sync[0], out_late[0]) and torch.equal(out_sync[1], out_late[1])
    # An exact-size dispatch reads its counts on the host: under a capture it raises before
    # it launches anything, and the buffer works on.
    with pytest.raises(ValueError, match="do_cpu_sync"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        buffer.dispatch(x, idx, w, num_experts=num_experts)
    again = buffer.dispatch(x, idx, w, num_experts=num_experts)
    assert torch.equal(again[0], sync[0]) and torch.equal(again[1], sync[1])
    buffer.barrier()
    buffer.check()
    buffer.destroy()
    del eager
    return True


@pytest.mark.gpu(n=1)
def test_elastic_on_gpus(run_ranks):
    R = gpu_ranks()
    tokens = [512, 0, 300, 77][:R]
    for fp8, exact, alignment, reduce_per_rank in [
        (None, True, 1, True),
        ("f32", False, 128, True),
        ("ue8m0", True, 64, True),
        (None, False, 16, False),
    ]:
        args = (tokens, 7168, 8, 8, fp8, exact, alignment, 2, reduce_per_rank)
        assert run_ranks(R, _elastic_body, *args, timeout=900) == [True] * R
    # gpt-oss's hidden size (2880: rows of 5760 BF16 bytes, FP8 with a partial last group).
    for fp8 in (None, "f32"):
        args = ([300, 40, 0, 200][:R], 2880, 8, 4, fp8, True, 1, 1, True)
        assert run_ranks(R, _elastic_body, *args, timeout=900) == [True] * R
    assert run_ranks(R, _graph_body, 128, 7168, 8, 8) == [True] * R


@pytest.mark.parametrize("index", range(4), ids=[k[0] for k in ELASTIC_KERNELS[:4]])
def test_elastic_traces_are_compiled_in_only_when_asked(index):
    """``PROFILE`` adds clock reads (the GPU's global timer) and the stores of the readings;
    without it a kernel reads the clock only in its bounded waits (the pushes' last program),
    the epilogues never."""
    pytest.importorskip("triton.backends.nvidia")
    kernel = ELASTIC_KERNELS[index]
    untraced = _elastic_ptx(kernel).count("globaltimer")
    traced = _elastic_ptx(kernel, PROFILE=True, USE_CLOCK=True).count("globaltimer")
    assert traced > untraced
    if "epilogue" in kernel[0]:
        assert untraced == 0
