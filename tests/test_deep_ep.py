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
        if t is not None:
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


def _intranode_body(ctx, tokens, hidden, experts_per_rank, topk, gpus_per_node=None):
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    group = dist.group.WORLD
    num_experts = experts_per_rank * R
    N = tokens[rank]
    x, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, topk, dev, seed=7)
    all_x = _gather(x, R, tokens[:R])
    all_idx = _gather(topk_idx, R, tokens[:R])

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    if gpus_per_node:  # as torchrun sets it on a cluster: the group then spans nodes
        os.environ["LOCAL_WORLD_SIZE"] = str(gpus_per_node)
    try:
        buffer = deep_ep.Buffer(group, int(1e9), int(1e9))
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
    for _ in range(3):  # repeated runs must agree bit for bit
        recv_x, recv_topk_idx, recv_topk_weights, recv_per_expert, handle, event = (
            buffer.dispatch(
                x, num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                topk_weights=topk_weights, config=deep_ep.Buffer.get_dispatch_config(R),
                previous_event=deep_ep.Buffer.capture(), async_finish=True,
            )
        )  # fmt: skip
        event.current_stream_wait()
        assert recv_x.shape[0] == int(gbl_per_rank[rank])
        assert recv_per_expert == gbl_per_expert.view(R, -1)[rank].tolist()
        # Every row names its origin; it must be that token, with its routing, in order.
        src_rank = recv_x[:, 0].float().cpu().long()
        src_token = (recv_x[:, 1].float() + 256 * recv_x[:, 2].float()).cpu().long()
        order = (src_rank * 1_000_000 + src_token).tolist()
        assert order == sorted(order), "rows ordered by source rank, then token"
        mine = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        for row in range(recv_x.shape[0]):
            s, t = int(src_rank[row]), int(src_token[row])
            assert torch.equal(recv_x[row].cpu(), all_x[s][t]), (rank, row)
            ids = all_idx[s][t]
            local = torch.where((ids >= mine.start) & (ids < mine.stop), ids - mine.start, -1)
            assert torch.equal(recv_topk_idx[row].cpu(), local), (rank, row)
        assert bool((recv_topk_weights[recv_topk_idx < 0] == 0).all())

        combined_x, combined_w, event = buffer.combine(
            recv_x, handle, topk_weights=recv_topk_weights, async_finish=True
        )
        event.current_stream_wait()
        went = is_token_in_rank.sum(1, keepdim=True).clamp_min(1)
        sent = is_token_in_rank.any(1)
        if bool(sent.any()):
            back = combined_x.float()[sent] / went[sent]
            assert calc_diff(back, x.float()[sent]) < 5e-6
        kept = topk_idx >= 0
        assert torch.allclose(combined_w[kept], topk_weights[kept])
        hashes.add(digest(recv_x, recv_topk_idx, recv_topk_weights, combined_x, combined_w))
    assert len(hashes) == 1

    # Cached mode: the handle moves new rows along the same routing.
    cached_x, cached_idx, _, _, _, _ = buffer.dispatch(x * 2, handle=handle)
    assert cached_idx is None
    assert torch.equal(cached_x, (recv_x.float() * 2).to(torch.bfloat16))
    buffer.destroy()
    return True


def _low_latency_body(ctx, tokens, hidden, experts_per_rank, topk, use_fp8, use_ue8m0=False):
    R, rank, dev = ctx.world_size, ctx.rank, ctx.device
    num_experts = experts_per_rank * R
    num_max = max(tokens[:R])
    N = tokens[rank]
    x, topk_idx, topk_weights = _inputs(rank, N, hidden, num_experts, topk, dev, seed=9)
    # Rows of small integers survive FP8 exactly: the source rank + 1 (never zero, so that a
    # combine that drops rows cannot match), and the token index.
    x = torch.full((N, hidden), float(rank + 1), dtype=torch.bfloat16, device=dev)
    x[:, -128:] = (torch.arange(N, device=dev) % 16).to(torch.bfloat16).unsqueeze(1)
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
            x, topk_idx, num_max, num_experts, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0, async_finish=False,
            return_recv_hook=True,
        )  # fmt: skip
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
                assert bool((block[begin[s] : begin[s] + count[s], 0].round() == s + 1).all())
            assert sum(count) == n
            token = src_info[e, :n].cpu().long()
            assert torch.equal(block[:, -1].round(), (token % 16).float())
        y = rows.to(torch.bfloat16)
        combined, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=True
        )
        hook()
        expected = x.float() * (topk_weights * (topk_idx >= 0)).sum(1, keepdim=True)
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


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
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
    if scales.dtype == torch.int32:
        scales = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        scales = scales[..., : q.shape[-1] // 128]
    groups = q.float().unflatten(-1, (q.shape[-1] // 128, 128))
    return (groups * scales.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_intranode_like_deep_ep(run_ranks, num_ranks):
    assert run_ranks(num_ranks, _intranode_body, [13, 0, 9], 256, 2, 3) == [True] * num_ranks


def test_internode_like_deep_ep(run_ranks):
    # 4 CPU ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2, as torchrun would set it).
    assert run_ranks(4, _intranode_body, [13, 0, 9, 6], 256, 2, 3, 2) == [True] * 4


@pytest.mark.parametrize(
    "use_fp8, use_ue8m0", [(False, False), (True, False), (True, True)],
    ids=["bf16", "fp8", "fp8-ue8m0"],
)  # fmt: skip
def test_low_latency_like_deep_ep(run_ranks, use_fp8, use_ue8m0):
    hidden = 512 if use_ue8m0 else 256  # packed UE8M0: DeepEP's multiple of 512
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


def test_signatures_match_deep_ep():
    import inspect

    params = inspect.signature(deep_ep.Buffer.__init__).parameters
    assert list(params)[1:5] == ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode"]
    assert deep_ep.Buffer.num_sms == 20
    config = deep_ep.Config(20, 6, 256, 6, 128)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    for name in [
        "get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
        "low_latency_combine", "get_next_low_latency_combine_buffer", "clean_low_latency_buffer",
        "get_low_latency_rdma_size_hint", "set_num_sms", "get_dispatch_config",
        "get_combine_config", "capture", "destroy", "low_latency_update_mask_buffer",
        "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer",
    ]:  # fmt: skip
        assert callable(getattr(deep_ep.Buffer, name)), name
    update = inspect.signature(deep_ep.Buffer.low_latency_update_mask_buffer).parameters
    assert list(update)[1:] == ["rank_to_mask", "mask"] and update["mask"].default is False
    assert "enable_shrink" in params
    dispatch = inspect.signature(deep_ep.Buffer.dispatch).parameters
    assert list(dispatch)[1:] == [
        "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
        "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment",
        "num_worst_tokens", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream",
    ]  # fmt: skip
    deep_ep.Buffer.set_num_sms(24)
    try:
        assert deep_ep.Buffer.get_dispatch_config(4).num_sms == 24
    finally:
        deep_ep.Buffer.set_num_sms(20)
