"""The DeepEP interface, checked the way DeepEP's own tests check DeepEP.

Written as DeepEP user code: ``import tritonep.deep_ep as deep_ep`` and nothing else of
tritonep. Rows carry their source rank and token index, so every received row is checked for
its origin; counts per rank and per expert must equal an all-reduced expectation; combine of
a dispatch divided by the number of ranks each token went to must give the token back;
low-latency combine must give ``x * sum of the valid weights``; repeated runs must give
identical results (bit for bit, compared by hash).
"""

import hashlib
import os

import pytest
import torch
import torch.distributed as dist

import tritonep.deep_ep as deep_ep
from tests.conftest import gpu_ranks


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 0 for equal tensors, small for close ones."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, tuple):  # FP8 rows and their scales
            h.update(digest(*t).encode())
        elif t is not None:
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _inputs(rank, num_tokens, hidden, num_experts, topk, device, seed):
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    # Rows carry their origin: the source rank, then the token index.
    x[:, 0] = rank
    x[:, 1] = torch.arange(num_tokens) % 256
    x[:, 2] = torch.arange(num_tokens) // 256
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(topk, dim=-1).indices
    topk_idx[torch.rand(num_tokens, topk, generator=gen) < 0.2] = -1
    topk_weights = torch.rand(num_tokens, topk, generator=gen) + 0.1
    return x.to(device), topk_idx.to(device), topk_weights.to(device)


def _gather(t: torch.Tensor, group_size: int, num_rows: list[int]) -> list[torch.Tensor]:
    """Every rank's tensor (rows may differ in number): padded all-gather."""
    most = max(num_rows)
    padded = torch.zeros(most, *t.shape[1:], dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(group_size)]
    dist.all_gather(parts, padded)
    return [p[:n].cpu() for p, n in zip(parts, num_rows, strict=True)]


def _padded_groups(x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` as float32 ``[..., ceil(H / 128), 128]``, zero-padded as DeepEP pads."""
    return torch.nn.functional.pad(x.float(), (0, -x.shape[-1] % 128)).unflatten(-1, (-1, 128))


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test quantizer: e4m3 ``[N, H]`` and float32 scales ``[N, ceil(H / 128)]``."""
    groups = _padded_groups(x)
    amax = groups.abs().amax(dim=2).clamp(min=1e-4)
    q = (groups * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).flatten(1)
    return q[:, : x.shape[1]].contiguous(), amax / 448.0


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (_padded_groups(q) * scales.unsqueeze(2)).flatten(1)[:, : q.shape[1]]


def _intranode_body(
    ctx, tokens, hidden, experts_per_rank, topk, gpus_per_node=None, variant="bf16"
):
    """DeepEP's intranode test; ``variant``: "bf16", "fp8" (a tuple of e4m3 rows and scales),
    "worst" (``num_worst_tokens``: padded outputs, no host synchronization) or "copies" (BF16,
    the combines of exact-size handles over copy engines: ``copy_combine_tokens``)."""
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    group = dist.group.WORLD
    num_experts = experts_per_rank * R
    N = tokens[rank]
    x, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, topk, dev, seed=7)
    all_x = _gather(x, R, tokens[:R])
    all_idx = _gather(topk_idx, R, tokens[:R])
    use_fp8 = variant == "fp8"
    worst = sum(tokens[:R]) if variant == "worst" else 0
    if use_fp8:
        x_in = per_token_cast_to_fp8(x)
        all_q = _gather(x_in[0].view(torch.uint8), R, tokens[:R])
        all_scales = _gather(x_in[1], R, tokens[:R])
    else:
        x_in = x
    # The rows this rank must receive, in order: by source rank, then source token.
    first = rank * experts_per_rank
    mine = [((ids >= first) & (ids < first + experts_per_rank)).any(1) for ids in all_idx]
    sources = [(s, t) for s in range(R) for t in range(tokens[s]) if bool(mine[s][t])]

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    if gpus_per_node:  # as torchrun sets it on a cluster: the group then spans nodes
        os.environ["LOCAL_WORLD_SIZE"] = str(gpus_per_node)
    try:
        copies = max(tokens) if variant == "copies" else 0
        buffer = deep_ep.Buffer(
            group, int(1e9), int(1e9), copy_combine_tokens=copies, copy_combine_min_tokens=0
        )
    finally:
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
        buffer.get_dispatch_layout(topk_idx, num_experts)
    )
    if gpus_per_node:
        owner_node = torch.where(topk_idx >= 0, topk_idx // (experts_per_rank * gpus_per_node), -1)
        per_node = [int((owner_node == n).any(1).sum()) for n in range(R // gpus_per_node)]
        assert num_tokens_per_rdma_rank.cpu().tolist() == per_node
    else:
        assert num_tokens_per_rdma_rank is None
    # The layout against a direct count.
    owner = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1).cpu()
    want_in_rank = torch.stack([(owner == r).any(1) for r in range(R)], 1)
    assert torch.equal(is_token_in_rank.cpu(), want_in_rank)
    assert num_tokens_per_rank.cpu().tolist() == want_in_rank.sum(0).tolist()
    gbl_per_rank = num_tokens_per_rank.clone()
    gbl_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_per_rank)
    dist.all_reduce(gbl_per_expert)

    hashes = set()
    # Repeated runs must agree bit for bit, whatever the config: ours, DeepEP's defaults (as
    # SGLang builds them, by keyword), DeepEP's positional tuning-table form.
    configs = [
        deep_ep.Buffer.get_dispatch_config(R),
        deep_ep.Config(num_sms=20, num_max_nvl_chunked_send_tokens=6),
        deep_ep.Config(24, 8, 256, 6, 128),
    ]
    for config in configs:
        recv_x, recv_topk_idx, recv_topk_weights, recv_per_expert, handle, event = buffer.dispatch(
            x_in,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            config=config,
            previous_event=deep_ep.Buffer.capture(),
            async_finish=True,
            num_worst_tokens=worst,
        )
        event.current_stream_wait()
        num_recv = int(gbl_per_rank[rank])
        assert num_recv == len(sources)
        per_expert = gbl_per_expert.view(R, -1)[rank].tolist()
        if worst:  # padded to the worst case: ids -1 and weights 0 past the received rows
            assert recv_topk_idx.shape[0] == worst
            assert bool((recv_topk_idx[num_recv:] == -1).all())
            assert bool((recv_topk_weights[num_recv:] == 0).all())
            # An empty list, as DeepEP returns (a list would need a host read); the counts
            # stay on the device in the handle.
            assert recv_per_expert == [] and handle.host_info[1:].tolist() == per_expert
        else:
            assert recv_topk_idx.shape[0] == num_recv and recv_per_expert == per_expert
        payload = recv_x[0] if use_fp8 else recv_x
        if not use_fp8:
            # Every row names its origin: the expected token, in order.
            src_rank = payload[:num_recv, 0].float().cpu().long()
            src_token = payload[:num_recv, 1].float() + 256 * payload[:num_recv, 2].float()
            assert list(zip(src_rank.tolist(), src_token.long().tolist(), strict=True)) == sources
        for row, (s, t) in enumerate(sources):
            if use_fp8:  # e4m3 bytes and scales as the source quantized them
                assert torch.equal(payload[row].cpu().view(torch.uint8), all_q[s][t]), row
                assert torch.equal(recv_x[1][row].cpu(), all_scales[s][t]), row
            else:
                assert torch.equal(payload[row].cpu(), all_x[s][t]), (rank, row)
            ids = all_idx[s][t]
            local = torch.where((ids >= first) & (ids < first + experts_per_rank), ids - first, -1)
            assert torch.equal(recv_topk_idx[row].cpu(), local), (rank, row)
        assert bool((recv_topk_weights[recv_topk_idx < 0] == 0).all())

        rows = per_token_cast_back(*recv_x).to(torch.bfloat16) if use_fp8 else recv_x
        combined_x, combined_w, event = buffer.combine(
            rows, handle, topk_weights=recv_topk_weights, async_finish=True
        )
        event.current_stream_wait()
        went = is_token_in_rank.sum(1, keepdim=True).clamp_min(1)
        sent = is_token_in_rank.any(1)
        want = per_token_cast_back(*x_in).to(torch.bfloat16) if use_fp8 else x
        if bool(sent.any()):
            back = combined_x.float()[sent] / went[sent]
            assert calc_diff(back, want.float()[sent]) < 5e-6
        kept = topk_idx >= 0
        assert torch.allclose(combined_w[kept], topk_weights[kept])
        valid = (payload[:num_recv], recv_x[1][:num_recv]) if use_fp8 else recv_x[:num_recv]
        hashes.add(
            digest(
                valid,
                recv_topk_idx[:num_recv],
                recv_topk_weights[:num_recv],
                combined_x,
                combined_w,
            )
        )
    assert len(hashes) == 1

    if not gpus_per_node:
        _check_handle_items(handle, rank, is_token_in_rank)
        # Without top-k, as DeepEP allows: the layout arguments route the rows.
        plain_x, plain_idx, plain_w, plain_per_expert, plain_handle, _ = buffer.dispatch(
            x_in,
            num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            config=config,
            num_worst_tokens=worst,
        )
        assert plain_idx is None and plain_w is None
        assert plain_per_expert == ([] if worst else per_expert)
        plain_rows = plain_x[0] if use_fp8 else plain_x
        assert torch.equal(
            plain_rows[:num_recv].view(torch.uint8), payload[:num_recv].view(torch.uint8)
        )
        assert torch.equal(plain_handle.recv_src_idx, handle.recv_src_idx)
        plain_back, plain_w_back, _ = buffer.combine(rows, plain_handle)
        assert plain_w_back is None and torch.equal(plain_back, combined_x)
        with pytest.raises(ValueError, match="is_token_in_rank"):
            buffer.dispatch(x_in, num_tokens_per_expert=num_tokens_per_expert)
    # Cached mode: the handle moves new rows along the same routing.
    cached_x, cached_idx, _, _, _, _ = buffer.dispatch(x * 2, handle=handle)
    assert cached_idx is None
    want_rows = torch.stack([all_x[s][t] for s, t in sources]) if sources else all_x[0][:0]
    assert torch.equal(cached_x[:num_recv].cpu(), (want_rows.float() * 2).to(torch.bfloat16))
    # Ids next to a handle would be ignored: rejected, as DeepEP asserts.
    with pytest.raises(ValueError, match="topk_idx: must be None with a handle"):
        buffer.dispatch(x, handle=handle, topk_idx=topk_idx)
    if variant == "copies":  # every combine of the test went over the copy engines
        assert int(buffer._normal.copy_combine.state[0]) == len(configs) + 1
    buffer.destroy()
    return True


def _check_handle_items(handle, rank, is_token_in_rank):
    """The handle is DeepEP's six-item tuple, each item with DeepEP's meaning."""
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = (
        handle
    )
    assert len(handle) == 6 and handle[0] is rank_prefix_matrix and handle[-1] is send_head
    R = is_token_in_rank.shape[1]
    received = torch.tensor([int(handle.recv_count[s].sum()) for s in range(R)])
    # [i][rank]: rows this rank receives from ranks 0..i (other ranks' columns: -1).
    assert rank_prefix_matrix.shape == (R, R) and rank_prefix_matrix.dtype == torch.int32
    assert rank_prefix_matrix[:, rank].tolist() == received.cumsum(0).tolist()
    others = [c for c in range(R) if c != rank]
    assert bool((rank_prefix_matrix[:, others] == -1).all())
    # Tokens sent to each rank through channels 0..c: the last channel holds them all.
    sent = is_token_in_rank.to(torch.int32).sum(0)
    assert tuple(channel_prefix.shape) == tuple(handle.recv_count.shape)
    assert torch.equal(channel_prefix[:, -1], sent)
    assert bool((channel_prefix[:, 1:] >= channel_prefix[:, :-1]).all())
    assert bool((recv_channel_prefix[:, 0] == 0).all())
    assert torch.equal(recv_channel_prefix + handle.recv_start[:, :1], handle.recv_start)
    assert recv_src_idx is handle.recv_src_idx and in_rank is handle.is_token_in_rank
    # Each token's index among the rows sent to a rank, -1 where it is not sent.
    for r in range(R):
        col = send_head[:, r]
        assert col[~is_token_in_rank[:, r]].eq(-1).all()
        assert col[is_token_in_rank[:, r]].tolist() == list(range(int(sent[r])))


def _through_ue8m0(values: torch.Tensor) -> torch.Tensor:
    """Integers ``values`` (each alone in its group of channels) after e4m3 with a
    power-of-two scale: e4m3 holds 4 significant bits, so 127 comes back as 128."""
    scale = torch.exp2(torch.ceil(torch.log2(values.clamp(min=1e-4) / 448.0)))
    return ((values / scale).to(torch.float8_e4m3fn).float() * scale).round()


def _low_latency_body(ctx, tokens, hidden, experts_per_rank, topk, use_fp8, use_ue8m0=False):
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    num_experts = experts_per_rank * R
    num_max = max(tokens[:R])
    N = tokens[rank]
    x, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, topk, dev, seed=9)
    # As DeepEP's test: every channel but the last group holds the source rank + 1 (never
    # zero, so that a combine that drops rows cannot match), the last group the token index;
    # constant groups survive FP8 exactly (integers up to 256 survive BF16). The last group
    # may be partial (its ``tail`` channels).
    assert N <= 256
    tail = hidden - (hidden - 1) // 128 * 128
    x = torch.full((N, hidden), float(rank + 1), dtype=torch.bfloat16, device=dev)
    x[:, -tail:] = torch.arange(N, device=dev).to(torch.bfloat16).unsqueeze(1)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max, hidden, R, num_experts)
    buffer = deep_ep.Buffer(
        dist.group.WORLD, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // R
    )
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    for e in range(num_experts):
        counts[e] = int((topk_idx == e).any(1).sum())
    dist.all_reduce(counts)
    stats = torch.zeros(experts_per_rank, dtype=torch.int32, device=dev)
    hashes = set()
    for _ in range(3):
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x,
            topk_idx,
            num_max,
            num_experts,
            cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8,
            round_scale=use_ue8m0,
            use_ue8m0=use_ue8m0,
            async_finish=False,
            return_recv_hook=True,
        )
        hook()
        if use_fp8:  # DeepEP's layout: column-major scales (its tests call .contiguous())
            assert recv_x[1].stride()[1] == 1
            assert recv_x[1].dtype == (torch.int32 if use_ue8m0 else torch.float32)
        rows = deep_ep_dequant(recv_x) if use_fp8 else recv_x.float()
        mine = counts[rank * experts_per_rank : (rank + 1) * experts_per_rank]
        assert torch.equal(recv_count, mine)
        src_info, layout_range = handle[0], handle[1]
        for e in range(experts_per_rank):
            n = int(recv_count[e])
            block = rows[e, :n].cpu()
            begin = (layout_range[e].cpu() >> 32).tolist()
            count = (layout_range[e].cpu() & 0xFFFFFFFF).tolist()
            for s in range(R):
                rank_part = block[begin[s] : begin[s] + count[s], :-tail].round()
                assert bool((rank_part == s + 1).all()), (e, s)
            assert sum(count) == n
            token = src_info[e, :n].cpu().float().unsqueeze(1).expand(n, tail)
            if use_fp8 and use_ue8m0:
                token = _through_ue8m0(token)
            assert torch.equal(block[:, -tail:].round(), token), e
        y = rows.to(torch.bfloat16)
        combined, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=True
        )
        hook()
        # What the experts saw: power-of-two scales round token indices above 16 (e4m3 holds
        # 4 significant bits), so the combine returns those rounded values.
        seen = x.float()
        if use_fp8 and use_ue8m0:
            seen[:, -tail:] = _through_ue8m0(seen[:, -tail:])
        expected = seen * (topk_weights * (topk_idx >= 0)).sum(1, keepdim=True)
        if N:
            assert calc_diff(combined.float(), expected) < 1e-5
        payload = recv_x[0] if use_fp8 else recv_x
        valid = [payload[e, : int(recv_count[e])] for e in range(experts_per_rank)]
        hashes.add(digest(*valid, recv_count, combined))
    assert torch.equal(stats, mine * 3)
    assert len(hashes) == 1
    buffer.destroy()
    return True


def _shrink_body(ctx, use_fp8):
    """DeepEP's shrink checks with the mask set by hand: the last rank and the others mask
    each other, so counts, rows and the combine leave the masked side out; once every rank
    unmasks at the same call, everything is whole again."""
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    experts_per_rank, hidden, num_max = 2, 256, 6
    num_experts = experts_per_rank * R
    N = [6, 0, 5, 4][rank]
    _, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, 3, dev, seed=11)
    x = torch.full((N, hidden), float(rank + 1), dtype=torch.bfloat16, device=dev)  # never 0
    all_idx = [None] * R
    dist.all_gather_object(all_idx, topk_idx.cpu())
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max, hidden, R, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, enable_shrink=True)
    last = R - 1
    for peer in range(last) if rank == last else [last]:
        buffer.low_latency_update_mask_buffer(peer, True)
    mask_status = torch.zeros(R, dtype=torch.int32, device=dev)
    masks = []
    for masked_call in (True, False):
        buffer.low_latency_query_mask_buffer(mask_status)
        masks.append(mask_status.tolist())
        live = [s for s in range(R) if not mask_status[s]]
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, num_max, num_experts, use_fp8=use_fp8, return_recv_hook=True
        )
        hook()
        rows = deep_ep_dequant(recv_x) if use_fp8 else recv_x.float()
        for e in range(experts_per_rank):
            expert = rank * experts_per_rank + e
            want = sum(int((all_idx[s] == expert).any(1).sum()) for s in live)
            assert int(recv_count[e]) == want
            count = (handle[1][e].cpu() & 0xFFFFFFFF).tolist()
            begin = (handle[1][e].cpu() >> 32).tolist()
            for s in range(R):
                block = rows[e, begin[s] : begin[s] + count[s], 0].cpu()
                assert count[s] == 0 if s not in live else bool((block == s + 1).all())
        combined, _, hook = buffer.low_latency_combine(
            rows.to(torch.bfloat16), topk_idx, topk_weights, handle, return_recv_hook=True
        )
        hook()
        owner_live = torch.tensor([s in live for s in range(R)], device=dev)
        valid = (topk_idx >= 0) & owner_live[topk_idx.clamp(min=0) // experts_per_rank]
        expected = x.float() * (topk_weights * valid).sum(1, keepdim=True)
        if N:
            assert calc_diff(combined.float(), expected) < 1e-5
        if masked_call:
            buffer.low_latency_clean_mask_buffer()
    errors = []
    for call in [
        lambda: buffer.low_latency_update_mask_buffer(R, True),
        lambda: buffer.low_latency_query_mask_buffer(mask_status.long()),
        lambda: deep_ep.Buffer(dist.group.WORLD).low_latency_clean_mask_buffer(),
    ]:
        try:
            call()
            errors.append("accepted")
        except (TypeError, ValueError, RuntimeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    buffer.destroy()
    return masks, errors


# FP8, DeepEP's default and the one whose rows need dequantizing here; BF16 rows of masked
# peers are checked in test_shrink, under the same mode this interface passes them to.
@pytest.mark.parametrize("use_fp8", [True], ids=["fp8"])
def test_shrink_like_deep_ep(run_ranks, use_fp8):
    for rank, (masks, errors) in enumerate(run_ranks(3, _shrink_body, use_fp8)):
        assert masks[0] == ([1, 1, 0] if rank == 2 else [0, 0, 1])
        assert masks[1] == [0, 0, 0]
        assert errors == [
            "ValueError: rank_to_mask: expected a rank in [0, 3), got 3",
            "TypeError: mask_status: expected dtype torch.int32, got torch.int64",
            "RuntimeError: low_latency_clean_mask_buffer: needs a Buffer constructed with "
            "enable_shrink=True",
        ]


def deep_ep_dequant(recv_x):
    """DeepEP's ``per_token_cast_back``: int32 scales are four UE8M0 exponent bytes each."""
    q, scales = recv_x
    scales = scales.contiguous()
    groups = _padded_groups(q)
    if scales.dtype == torch.int32:
        scales = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        scales = scales[..., : groups.shape[-2]]
    return (groups * scales.unsqueeze(-1)).flatten(-2)[..., : q.shape[-1]]


# Three ranks cover what two did (rank 1 has no tokens, ranks 0 and 2 some); DeepEP's tests run
# at any group size, and 2 ranks of each mode are tested in the modes' own files.
@pytest.mark.parametrize("num_ranks", [3])
@pytest.mark.parametrize("variant", ["bf16", "fp8", "worst", "copies"])
def test_intranode_like_deep_ep(run_ranks, num_ranks, variant):
    results = run_ranks(num_ranks, _intranode_body, [13, 0, 9], 256, 2, 3, None, variant)
    assert results == [True] * num_ranks


def test_internode_like_deep_ep(run_ranks):
    # 4 CPU ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2, as torchrun would set it).
    assert run_ranks(4, _intranode_body, [13, 0, 9, 6], 256, 2, 3, 2) == [True] * 4


@pytest.mark.parametrize(
    "use_fp8, use_ue8m0, hidden",
    [
        (False, False, 256),
        (True, False, 256),
        (True, True, 512),
        (True, False, 200),
        (True, True, 200),
    ],
    ids=["bf16", "fp8", "fp8-ue8m0", "fp8-h200", "fp8-ue8m0-h200"],
)
def test_low_latency_like_deep_ep(run_ranks, use_fp8, use_ue8m0, hidden):
    # Packed UE8M0: DeepEP's multiple of 512; and hidden sizes DeepEP V1 does not take, as V2
    # does: 200, whose last group of 128 channels holds 72 (one packed column).
    assert (
        run_ranks(3, _low_latency_body, [6, 0, 5], hidden, 2, 3, use_fp8, use_ue8m0) == [True] * 3
    )


def _logfmt_body(ctx, tokens, hidden, experts_per_rank, topk):
    """DeepEP's LogFMT check: experts that return their input, inputs mostly below 1 (DeepEP's
    ``randn * 0.1``), so ``combine == x * sum of valid weights`` up to LogFMT's error; plain
    and zero-copy."""
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    num_experts = experts_per_rank * R
    num_max = max(tokens[:R])
    N = tokens[rank]
    _, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, topk, dev, seed=13)
    torch.manual_seed(rank)
    x = (torch.randn(N, hidden) * 0.1).to(torch.bfloat16).to(dev)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max, hidden, R, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True)
    expected = x.float() * (topk_weights * (topk_idx >= 0)).sum(1, keepdim=True)
    for zero_copy in (False, True):
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, num_max, num_experts, use_fp8=False
        )
        rows = recv_x
        if zero_copy:  # expert outputs written straight into the buffer's tensor
            rows = buffer.get_next_low_latency_combine_buffer(handle)
            rows.copy_(recv_x)
        plain, _, _ = buffer.low_latency_combine(rows, topk_idx, topk_weights, handle)
        # out=: the result lands in the caller's tensor (poisoned: every row must be written).
        out = torch.full_like(plain, float("nan"))
        into, _, _ = buffer.low_latency_combine(rows, topk_idx, topk_weights, handle, out=out)
        assert into is out and torch.equal(into, plain)
        combined, _, _ = buffer.low_latency_combine(
            rows, topk_idx, topk_weights, handle, use_logfmt=True, zero_copy=zero_copy
        )
        if N:
            exact = calc_diff(plain.float(), expected)
            diff = calc_diff(combined.float(), expected)
            # LogFMT's error (here ~2e-7) is above BF16's (~4e-8): the rows were encoded;
            # and far below a broken code's.
            assert exact < 1e-5 and 2 * exact < diff < 1e-5, (exact, diff)
    buffer.destroy()
    return True


def test_logfmt_combine_like_deep_ep(run_ranks):
    assert run_ranks(3, _logfmt_body, [6, 0, 5], 256, 2, 3) == [True] * 3


@pytest.mark.gpu(n=1)
def test_deep_ep_interface_on_gpus(run_ranks):
    R = gpu_ranks()
    assert run_ranks(R, _intranode_body, [512, 0, 300, 77], 2048, 8, 8) == [True] * R
    assert run_ranks(R, _low_latency_body, [128, 0, 100, 77], 7168, 8, 8, True) == [True] * R
    assert run_ranks(R, _logfmt_body, [128, 0, 100, 77], 7168, 8, 8) == [True] * R


@pytest.mark.gpu(n=2)
def test_deep_ep_at_2880_on_gpus(run_ranks):
    """gpt-oss's hidden size through DeepEP's interface: FP8 normal dispatch (23 scales a
    row, the last for 64 channels), low-latency FP8 with float32 and packed UE8M0 scales, and
    a LogFMT combine."""
    R = gpu_ranks()
    tokens = [512, 0, 300, 77]
    assert run_ranks(R, _intranode_body, tokens, 2880, 8, 4, None, "fp8") == [True] * R
    assert run_ranks(R, _intranode_body, tokens, 2880, 8, 4, None, "worst") == [True] * R
    for use_ue8m0 in (False, True):
        args = ([128, 0, 100, 77], 2880, 8, 4, True, use_ue8m0)
        assert run_ranks(R, _low_latency_body, *args) == [True] * R
    assert run_ranks(R, _logfmt_body, [128, 0, 100, 77], 2880, 8, 4) == [True] * R


#: DeepEP's ``Buffer`` (V1 API, release 1.2): every public method's arguments in order, with
#: their defaults. Ours must take each of them, in this order, with the same default (we may
#: take more: ``num_nodes`` of the size hint).
DEEP_EP_SIGNATURES = {
    "__init__": "group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, "
    "use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None",
    "capture": "",
    "clean_low_latency_buffer": "num_max_dispatch_tokens_per_rank, hidden, num_experts",
    "combine": "x, handle, topk_weights=None, bias=None, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False",
    "destroy": "",
    "dispatch": "x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, "
    "is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, "
    "expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False",
    "get_combine_config": "num_ranks",
    "get_comm_stream": "",
    "get_dispatch_config": "num_ranks",
    "get_dispatch_layout": "topk_idx, num_experts, previous_event=None, async_finish=False, "
    "allocate_on_comm_stream=False",
    "get_local_buffer_tensor": "dtype, size=None, offset=0, use_rdma_buffer=False",
    "get_low_latency_rdma_size_hint": "num_max_dispatch_tokens_per_rank, hidden, num_ranks, "
    "num_experts",
    "get_next_low_latency_combine_buffer": "handle",
    "internode_combine": "x, handle, topk_weights=None, bias=None, config=None, "
    "previous_event=None, async_finish=False, allocate_on_comm_stream=False",
    "internode_dispatch": "x, handle=None, num_tokens_per_rank=None, "
    "num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, "
    "topk_idx=None, topk_weights=None, expert_alignment=1, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False",
    "is_sm90_compiled": "",
    "low_latency_clean_mask_buffer": "",
    "low_latency_combine": "x, topk_idx, topk_weights, handle, use_logfmt=False, "
    "zero_copy=False, async_finish=False, return_recv_hook=False, out=None, "
    "combine_wait_recv_cost_stats=None",
    "low_latency_dispatch": "x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, "
    "return_recv_hook=False",
    "low_latency_query_mask_buffer": "mask_status",
    "low_latency_update_mask_buffer": "rank_to_mask, mask=False",
    "set_num_sms": "new_num_sms",
}


def _arguments(fn) -> list[str]:
    import inspect

    return [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


def test_signatures_match_deep_ep():
    for name, spec in DEEP_EP_SIGNATURES.items():
        theirs = [a for a in spec.split(", ") if a]
        ours = _arguments(getattr(deep_ep.Buffer, name))
        # Each of DeepEP's arguments, in DeepEP's order, with DeepEP's default.
        assert [a for a in ours if a in theirs] == theirs, (name, ours)
        assert all("=" in a for a in ours if a not in theirs), (name, ours)
    # Config: DeepEP's names, order and defaults; the top-k id dtype.
    assert _arguments(deep_ep.Config) == [
        "num_sms=20",
        "num_max_nvl_chunked_send_tokens=6",
        "num_max_nvl_chunked_recv_tokens=256",
        "num_max_rdma_chunked_send_tokens=6",
        "num_max_rdma_chunked_recv_tokens=256",
    ]
    assert {"Buffer", "Config", "EventOverlap", "topk_idx_t"} <= set(deep_ep.__all__)
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.Buffer.num_sms == 20
    config = deep_ep.Config(num_sms=24, num_max_nvl_chunked_send_tokens=8)
    assert (config.num_channels, config.num_max_nvl_chunked_send_tokens) == (12, 8)
    assert deep_ep.Config(20, 6, 256, 6, 128).num_max_rdma_chunked_recv_tokens == 128
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
        deep_ep.Buffer.get_local_buffer_tensor(None, torch.bfloat16)
    deep_ep.Buffer.set_num_sms(24)
    try:
        assert deep_ep.Buffer.get_dispatch_config(4).num_sms == 24
    finally:
        deep_ep.Buffer.set_num_sms(20)


NAMES = """
import json
import torch
from tritonep.modes import low_latency as ll, normal as nm
from tritonep.kernels import elastic_combine as ec, elastic_dispatch as ed, normal_notify
kernels = [ll.DISPATCH_KERNEL, ll.COMBINE_KERNEL, normal_notify.notify_kernel,
           nm.normal_dispatch.normal_dispatch_kernel, nm.normal_combine.normal_combine_kernel,
           ed.elastic_dispatch, ed.elastic_dispatch_epilogue, ec.elastic_combine,
           ec.elastic_combine_epilogue]
print(json.dumps([torch._C._demangle(k.__name__) for k in kernels]))
"""


def test_kernel_names_as_deep_ep_benchmarks_find_them():
    """DeepEP's ``bench_kineto`` finds kernels by a substring of the profiler's (demangled)
    name: each of a call's kernels must name its call once, and when a call launches two
    kernels (a receive hook), trace events are found by ``::dispatch`` and ``::combine``.
    Names are given when compiling, so they are read in a process without the interpreter."""
    import json
    import subprocess
    import sys

    # Compiled, not interpreted: without a GPU, importing tritonep would choose the
    # interpreter, so the choice is made explicit.
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", NAMES], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout)
    assert names == [
        "tritonep::low_latency::dispatch()",
        "tritonep::low_latency::combine()",
        "notify_kernel",  # a normal dispatch: notify, then the dispatch kernel
        "normal_dispatch_kernel",
        "normal_combine_kernel",
        "tritonep::elastic::dispatch_impl()",
        "tritonep::elastic::dispatch_copy_epilogue_impl()",
        "tritonep::elastic::combine_impl()",
        "tritonep::elastic::combine_reduce_epilogue_impl()",
    ]
