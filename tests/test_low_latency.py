"""Low-latency mode against the reference, on CPU ranks (interpreter) and on GPUs.

Every call poisons its outputs first, uses fresh random inputs, and checks every valid row,
scale, source index, count and layout range (independent of block order), then combine.
Everything is bit-exact against the reference, on GPUs and under the interpreter alike (the
kernels round BF16 and e4m3 on the bits there, where the interpreter's conversions are off).
"""

import time

import pytest
import torch
import torch.distributed as dist

from tests.conftest import gpu_ranks
from tritonep import reference as ref
from tritonep.modes import low_latency as ll
from tritonep.testing import make_case, static_inputs, timeout_message, verify_low_latency_call


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _expert_fn(rows, global_expert):
    """A different, exactly known "expert" per global id: scale by (id + 1) / 8."""
    return (rows * ((global_expert + 1) / 8)).to(torch.bfloat16)


def _verify_call(
    ctx, case, M, use_fp8, ue8m0, recv_x, recv_count, handle, outputs, combined, logfmt=False
):
    """Check one dispatch and combine of this rank against the reference, bit for bit (a
    LogFMT combine within its error bound)."""
    verify_low_latency_call(
        ctx.rank,
        case,
        M,
        use_fp8,
        ue8m0,
        recv_x,
        recv_count,
        handle,
        outputs,
        combined,
        logfmt=logfmt,
    )


def _with_special_groups(outputs):
    """Expert outputs for LogFMT whose first rows hold the groups it treats apart: all
    zeros, small values, NaN and Inf (sent unchanged), and a value of 1 (too large)."""
    outputs = outputs.clone()
    H = outputs.shape[2]
    full = H // 128 * 128
    # A zero in every group: codes then span 32 octaves (the coarsest steps, ~1% error), so
    # a combine that skipped LogFMT would miss the reference in most channels.
    outputs[:, :, :full:128] = 0
    # A partial last group: a zero in even rows only. Odd rows show whether its smallest
    # magnitude is taken over its own channels (its missing ones, loaded as zeros, must not
    # count: they would coarsen every code).
    outputs[:, ::2, full::128] = 0
    small = torch.linspace(-0.9, 0.9, 128, device=outputs.device).to(torch.bfloat16)
    outputs[:, 0, :128] = 0
    outputs[:, 1, :128] = small
    outputs[:, 1, 64] = 0
    outputs[:, 2, H - 1] = float("nan")
    outputs[:, 3, 0] = float("inf")
    outputs[:, 3, H - 2] = 1
    return outputs


def _expert_outputs(recv_x, use_fp8, rank):
    """Apply the known experts to received rows (on the rows' device); padding rows -> 0."""
    payload, scales = recv_x if use_fp8 else (recv_x, None)
    if use_fp8 and scales.dtype == torch.int32:  # packed UE8M0 exponent bytes
        scales = ref.unpack_ue8m0(scales, -(-payload.shape[-1] // 128))
    rows = ref.dequantize_fp8(payload, scales) if use_fp8 else payload.float()
    E_local = rows.shape[0]
    global_ids = (torch.arange(E_local, device=rows.device) + rank * E_local).view(E_local, 1, 1)
    outputs = _expert_fn(rows, global_ids)
    return torch.where(torch.isnan(outputs), 0, outputs)  # poisoned rows past the count


def _assert_scale_layout(scales, mode, packed):
    """Scales are column-major within each expert (token index fastest), as DeepEP returns
    them for TMA: ``[E_local, R * M, columns]`` with strides ``(columns * R * M, 1, R * M)``."""
    rows = mode.num_ranks * mode.max_tokens
    groups = -(-mode.hidden // 128)  # a partial last group has a scale of its own
    columns = -(-groups // 4) if packed else groups
    assert scales.dtype == (torch.int32 if packed else torch.float32)
    assert scales.shape == (mode.num_local_experts, rows, columns)
    assert scales.stride()[:2] == (columns * rows, 1)
    assert scales.stride(2) == (rows if columns > 1 else 1)  # one column: a unit stride


def _ll_body(
    ctx,
    calls,
    tokens,
    hidden,
    experts,
    topk,
    routing,
    use_fp8,
    ue8m0,
    hook,
    dup,
    gpus_per_node=None,
    logfmt=False,
    count_adds=None,
):
    R, me = ctx.world_size, ctx.rank
    experts = experts * R
    M = max(max(tokens), 1)
    mode = ll.LowLatencyMode(
        None,
        M,
        hidden,
        experts,
        max_topk=max(topk, 2),
        device=ctx.device,
        timeout_s=60,
        gpus_per_node=gpus_per_node,
    )
    if count_adds is not None:
        mode.count_adds = count_adds
    for call in range(calls):  # odd and even calls use different buffer sets
        # LogFMT cases: most groups below 1 (encoded), some above (sent unchanged).
        case = make_case(
            1000 * call + 7,
            tokens[:R],
            hidden,
            experts,
            topk,
            routing,
            scale=0.3 if logfmt else 1.0,
        )
        if dup:  # a token that names one expert twice is sent there once
            for idx in case.topk_idx:
                if idx.shape[0] and topk > 1:
                    idx[0, 1] = idx[0, 0]
        dev = case.to(ctx.device)
        recv_x, recv_count, handle, recv_hook = mode.dispatch(
            dev.x[me],
            dev.topk_idx[me],
            use_fp8=use_fp8,
            use_ue8m0=bool(ue8m0),
            return_recv_hook=hook,
            pack_ue8m0=ue8m0 == "packed",
        )
        assert (recv_hook is not None) == hook
        if use_fp8:
            _assert_scale_layout(recv_x[1], mode, ue8m0 == "packed")
        if hook:
            recv_hook()
        mode.check()
        outputs = _expert_outputs(recv_x, use_fp8, me)
        if logfmt:
            outputs = _with_special_groups(outputs)
        combined, comb_hook = mode.combine(
            outputs,
            dev.topk_idx[me],
            dev.topk_weights[me],
            handle,
            return_recv_hook=hook,
            use_logfmt=logfmt,
        )
        if hook:
            comb_hook()
        mode.check()
        _verify_call(
            ctx, case, M, use_fp8, ue8m0, recv_x, recv_count, handle, outputs, combined, logfmt
        )
    mode.destroy()
    return True


CASES = {
    # name: (tokens per rank, hidden, experts per rank, topk, routing, fp8, ue8m0, hook, dup)
    "bf16-random": ([5, 0, 7, 3], 256, 4, 3, "random", False, False, False, False),
    "fp8-random": ([6, 4, 0, 2], 384, 2, 2, "random", True, False, False, False),
    "fp8-ue8m0-hook": ([3, 5, 2, 4], 128, 3, 4, "dropped", True, True, True, False),
    # DeepEP's use_ue8m0: exponent bytes packed four to an int32 (5 groups: 2 columns)
    "fp8-ue8m0-packed": ([4, 0, 6, 3], 640, 2, 3, "random", True, "packed", False, False),
    "bf16-skewed-dup": ([4, 4, 4, 4], 128, 2, 3, "skewed", False, False, True, True),
    "bf16-topk1": ([2, 3, 1, 0], 128, 1, 1, "random", False, False, False, False),
    "fp8-topk16": ([3, 2, 3, 1], 128, 8, 16, "random", True, False, False, True),
    "empty": ([0, 0, 0, 0], 128, 2, 2, "random", True, False, False, False),
    # Hidden sizes that are not multiples of 128 (gpt-oss's 2880, small): a partial last group
    # with a scale of its own. 200: rows of 400 BF16 bytes, FP8 rows of 200 (scales from the
    # next 16-byte boundary); 584: 5 groups, packed in 2 int32 columns.
    "bf16-h200": ([5, 0, 7, 3], 200, 2, 3, "random", False, False, False, False),
    "fp8-h200-dup": ([6, 4, 0, 2], 200, 2, 2, "random", True, False, False, True),
    "fp8-ue8m0-packed-h584-hook": ([4, 0, 6, 3], 584, 2, 3, "random", True, "packed", True, False),
}


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_low_latency_matches_reference(run_ranks, num_ranks, name):
    # Both buffer sets (odd and even calls) on 3 ranks, one call on 2.
    tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup = CASES[name]
    calls = 2 if num_ranks == 3 else 1
    args = (tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup)
    assert run_ranks(num_ranks, _ll_body, calls, *args) == [True] * num_ranks


@pytest.mark.parametrize("name", ["bf16-random", "bf16-skewed-dup", "fp8-topk16"])
def test_low_latency_counts_by_histograms(run_ranks, name):
    """Senders count the batch's ids by atomic adds when there are few (every case above on
    CPU ranks), by histograms when there are many: here the histograms, forced (both buffer
    sets in the first case, one call in the others)."""
    tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup = CASES[name]
    calls = 2 if name == "bf16-random" else 1
    args = (calls, tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup)
    assert run_ranks(3, _ll_body, *args, count_adds=0) == [True] * 3


@pytest.mark.parametrize(
    "name", ["bf16-random", "fp8-ue8m0-hook", "bf16-skewed-dup", "fp8-topk16", "bf16-h200"]
)
def test_logfmt_combine_matches_reference(run_ranks, name):
    """``use_logfmt``: every channel within LogFMT's error bound of the reference's LogFMT
    round trip, most of them bit-identical; special groups (zeros, NaN, Inf, 1) included, and
    a partial last group (hidden 200: 72 channels). Both buffer sets in the first case, one
    call in the others."""
    tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup = CASES[name]
    if hidden % 128 == 0:
        hidden = max(hidden, 256)  # two groups: one encoded, one not, in the special rows
    calls = 2 if name == "bf16-random" else 1
    args = (calls, tokens, hidden, experts, topk, routing, fp8, ue8m0, hook, dup)
    assert run_ranks(3, _ll_body, *args, logfmt=True) == [True] * 3


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8-ue8m0-packed-hook", "logfmt"])
def test_low_latency_at_2880_on_gpus(run_ranks, name):
    """gpt-oss's hidden size (23 groups of 128 channels, the last of 64) on 4 GPUs (2 where
    fewer), strict against the reference: BF16, FP8 with float32 or packed UE8M0 scales,
    LogFMT; gpt-oss's 128 experts and top-4 on 4 ranks."""
    use_fp8 = name.startswith("fp8")
    ue8m0 = "packed" if "ue8m0" in name else False
    R = gpu_ranks()
    args = ([128, 0, 77, 128], 2880, 128 // R, 4, "random", use_fp8, ue8m0, "hook" in name, True)
    run_ranks(R, _ll_body, 3, *args, logfmt=name == "logfmt")


@pytest.mark.gpu(n=2)
@pytest.mark.parametrize(
    "name",
    ["bf16-random", "fp8-random", "fp8-ue8m0-hook", "fp8-ue8m0-packed", "fp8-topk16", "logfmt"],
)
def test_low_latency_on_gpus_larger(run_ranks, name):
    logfmt = name == "logfmt"
    _, _, experts, topk, routing, fp8, ue8m0, hook, dup = CASES["fp8-random" if logfmt else name]
    tokens = [128, 0, 77, 128]
    run_ranks(
        gpu_ranks(),
        _ll_body,
        3,
        tokens,
        7168 if name == "fp8-random" else 2048,
        experts * 8,
        topk,
        routing,
        fp8,
        ue8m0,
        hook,
        dup,
        logfmt=logfmt,
    )


def _graph_body(ctx, replays):
    """One captured graph of dispatch -> experts -> combine, replayed with new inputs."""
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 32, 512, 4 * R, 3
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    x, idx, w = static_inputs(M, H, K, ctx.device)

    def load(seed):
        return make_case(seed, [M] * R, H, E, K, "dropped").copy_to(me, x, idx, w)

    def step():
        recv_x, recv_count, handle, _ = mode.dispatch(x, idx, use_fp8=True)
        outputs = _expert_outputs(recv_x, True, me)
        combined, _ = mode.combine(outputs, idx, w, handle)
        return recv_x, recv_count, handle, outputs, combined

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(0)
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            results = step()
    torch.cuda.synchronize()
    for replay in range(replays):
        case = load(1 + replay)
        graph.replay()
        torch.cuda.synchronize()
        mode.check()
        _verify_call(ctx, case, M, True, False, *results)
    mode.destroy()
    return replays


def _two_batch_body(ctx, use_fp8, hook):
    """Two micro-batches in flight, as two-batch overlap runs them: dispatch A, dispatch B,
    then combine A, combine B, each send before the other's receive when hooks are used."""
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 6, 256, 3 * R, 3
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    for step in range(2):  # the second step starts on the other buffer set's parity
        cases = [
            make_case(70 + 10 * step + b, [6, 2, 5, 0][:R], H, E, K, "dropped") for b in range(2)
        ]
        devs = [case.to(ctx.device) for case in cases]
        sent = [
            mode.dispatch(d.x[me], d.topk_idx[me], use_fp8=use_fp8, return_recv_hook=hook)
            for d in devs
        ]
        if hook:
            for *_, recv_hook in sent:
                recv_hook()
        outputs = [_expert_outputs(recv_x, use_fp8, me) for recv_x, *_ in sent]
        combined = [
            mode.combine(y, d.topk_idx[me], d.topk_weights[me], handle, return_recv_hook=hook)
            for y, d, (_, _, handle, _) in zip(outputs, devs, sent, strict=True)
        ]
        if hook:
            for _, comb_hook in combined:
                comb_hook()
        mode.check()
        for case, (recv_x, count, handle, _), y, (out, _) in zip(
            cases, sent, outputs, combined, strict=True
        ):
            _verify_call(ctx, case, M, use_fp8, False, recv_x, count, handle, y, out)
    mode.destroy()
    return True


@pytest.mark.parametrize("use_fp8, hook", [(True, True), (False, False)])
def test_two_micro_batches_in_flight(run_ranks, use_fp8, hook):
    assert run_ranks(2, _two_batch_body, use_fp8, hook) == [True, True]


@pytest.mark.gpu(n=2)
def test_cuda_graph_replayed_100_times_with_new_inputs(run_ranks):
    n = gpu_ranks()
    assert run_ranks(n, _graph_body, 100) == [100] * n


def _payload_once_body(ctx, use_fp8):
    """Inspect this rank's receive slab after one dispatch: which messages carry a payload."""
    R, me, M, H, E_local, K = ctx.world_size, ctx.rank, 6, 256, 4, 4
    mode = ll.LowLatencyMode(None, M, H, E_local * R, max_topk=K, device=ctx.device)
    recv_set = mode.heap.local[mode.layout.recv : mode.layout.recv + mode.layout.recv_set]
    recv_set.fill_(0xFF)  # poison: payload bytes that no one writes stay 0xFF
    mode.heap.barrier()
    case = make_case(5, [M] * R, H, E_local * R, K)  # 4 of 8 or 12 experts: shared owners
    _, _, handle, _ = mode.dispatch(
        case.x[me].to(ctx.device), case.topk_idx[me].to(ctx.device), use_fp8=use_fp8
    )
    mode.check()
    msg_bytes = ll.message_bytes(H, use_fp8)
    messages = recv_set.cpu()[: E_local * R * M * msg_bytes].view(E_local, R, M, msg_bytes)
    ranges = handle.recv_layout_range.cpu()
    carried, header_only, poisoned, wrong_refs = {}, 0, 0, 0
    for local in range(E_local):
        for src in range(R):
            for slot in range(int(ranges[local, src]) & 0xFFFFFFFF):
                msg = messages[local, src, slot]
                token, column, payload_at = msg[:12].view(torch.int32).tolist()
                at = (local * R + src) * M + slot
                wrong_refs += int(case.topk_idx[src][token, column]) != me * E_local + local
                if payload_at == at:
                    carried[(src, token)] = carried.get((src, token), 0) + 1
                    continue
                header_only += 1
                poisoned += bool((msg[16:] == 0xFF).all())
                # It names the message of the same token that carries the payload.
                l2, s2, slot2 = payload_at // (R * M), payload_at // M % R, payload_at % M
                ref_token = messages[l2, s2, slot2, :4].view(torch.int32).item()
                wrong_refs += (s2, ref_token, l2 != local) != (src, token, True)
    # One payload per (source rank, token) with an expert here; the token's other copies here
    # are headers, and their payload bytes were never written.
    expected = {
        (src, t)
        for src in range(R)
        for t in range(M)
        if ((case.topk_idx[src][t] // E_local) == me).any()
    }
    copies = sum(int(((case.topk_idx[src] // E_local) == me).sum()) for src in range(R))
    mode.destroy()
    return (
        set(carried) == expected and set(carried.values()) == {1},
        header_only == copies - len(expected) > 0,
        poisoned == header_only,
        wrong_refs == 0,
    )


@pytest.mark.parametrize("use_fp8", [False, True])
def test_a_token_crosses_to_each_rank_once(run_ranks, use_fp8):
    """However many of its experts a rank holds, a token's payload is stored there once: its
    other messages to that rank are headers naming the message that carries it."""
    assert run_ranks(2, _payload_once_body, use_fp8) == [(True, True, True, True)] * 2


def _unchecked_ids_body(ctx):
    """Ids outside [-1, E) are dropped by the kernels, nothing else changes, and the next call
    raises (after its launches, so the ranks stay in step); so does ``check()`` for a
    combine's own bad ids. No host check (``check_ids`` is off by default)."""
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 6, 128, 4 * R, 3
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device)
    case = make_case(5, [M] * R, H, E, K, "random")
    bad = [idx.clone() for idx in case.topk_idx]
    for idx in bad:
        idx[0, 0], idx[1, 2] = E + 3, -5
    for idx in case.topk_idx:
        idx[0, 0], idx[1, 2] = -1, -1
    dev_x, dev_bad = case.x[me].to(ctx.device), bad[me].to(ctx.device)
    weights = case.topk_weights[me].to(ctx.device)
    recv_x, recv_count, handle, _ = mode.dispatch(dev_x, dev_bad, use_fp8=False)
    outputs = _expert_outputs(recv_x, False, me)
    combined = torch.empty(M, H, dtype=torch.bfloat16, device=ctx.device)
    errors = []
    try:
        mode.combine(outputs, dev_bad, weights, handle, out=combined)
    except ValueError as e:
        errors.append(str(e))
    mode.check()  # raised once
    _verify_call(ctx, case, M, False, False, recv_x, recv_count, handle, outputs, combined)
    # The buffer goes on: good ids, then a combine whose own ids are bad.
    good = case.topk_idx[me].to(ctx.device)
    recv_x, recv_count, handle, _ = mode.dispatch(dev_x, good, use_fp8=False)
    outputs = _expert_outputs(recv_x, False, me)
    combined, _ = mode.combine(outputs, good, weights, handle)
    _verify_call(ctx, case, M, False, False, recv_x, recv_count, handle, outputs, combined)
    later = good.clone()
    later[4, 1] = -7
    mode.combine(outputs, later, weights, handle)
    try:
        mode.check()
    except ValueError as e:
        errors.append(str(e))
    mode.check()
    mode.destroy()
    return errors


def test_out_of_range_ids_are_dropped_and_raised_by_the_next_call(run_ranks):
    for rank, errors in enumerate(run_ranks(2, _unchecked_ids_body)):
        assert len(errors) == 2, errors
        assert errors[0].startswith(
            f"topk_idx: token 0, column 0 of rank {rank}'s low-latency dispatch names expert 11, "
            "outside [-1, 8)"
        ), errors[0]
        assert errors[1].startswith(
            f"topk_idx: token 4, column 1 of rank {rank}'s low-latency combine names expert -7"
        ), errors[1]


def _skip_body(ctx, phase):
    """Rank 1 skips ``phase`` (dispatch, or combine after a dispatch); rank 0 must raise."""
    mode = ll.LowLatencyMode(
        None, 4, 128, 2 * ctx.world_size, max_topk=2, device=ctx.device, timeout_s=30.0
    )
    x = torch.randn(3, 128, device=ctx.device).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]], device=ctx.device)
    if phase == "combine":
        recv_x, _, handle, _ = mode.dispatch(x, idx, use_fp8=False)
    if ctx.rank == 1:
        return "skipped"
    mode.timeout_s = 1.0
    if phase == "dispatch":
        return timeout_message(lambda: mode.dispatch(x, idx, use_fp8=False), mode.check)
    weights = torch.ones(3, 2, device=ctx.device)
    return timeout_message(lambda: mode.combine(recv_x, idx, weights, handle), mode.check)


@pytest.mark.parametrize(
    "phase, message",
    [
        ("dispatch", "rank 0 timed out after 1 s in phase 'low-latency dispatch receive, expert "),
        # The combine receiver waits per source rank (one arrival count each, no expert).
        ("combine", "rank 0 timed out after 1 s in phase 'low-latency combine receive'"),
    ],
)
def test_a_rank_that_skips_a_call_makes_the_others_raise(run_ranks, phase, message):
    results = run_ranks(2, _skip_body, phase)
    assert results[1] == "skipped"
    assert results[0].startswith(message) and "waiting for peer 1" in results[0], results[0]


def _run_ahead_body(ctx):
    """Three combines of one dispatch, each of other rows. The rank without tokens has nothing
    to reduce; were it not to wait for its peers' rows all the same, nothing would hold it
    back, and its third combine would overwrite the buffer set its peers are still to read
    for their first (the sleep lets it run ahead)."""
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 4, 256, 2 * R, 2
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    case = make_case(91, [4, 0, 3][:R], H, E, K, "dropped")
    dev = case.to(ctx.device)
    recv_x, recv_count, handle, _ = mode.dispatch(dev.x[me], dev.topk_idx[me], use_fp8=False)
    base = _expert_outputs(recv_x, False, me)
    outputs = [(base.float() * (call + 1)).to(torch.bfloat16) for call in range(3)]
    if case.x[me].shape[0]:
        time.sleep(2.0)
    combined = [
        mode.combine(y, dev.topk_idx[me], dev.topk_weights[me], handle)[0].clone() for y in outputs
    ]
    for y, out in zip(outputs, combined, strict=True):
        _verify_call(ctx, case, M, False, False, recv_x, recv_count, handle, y, out)
    mode.destroy()
    return True


def test_a_rank_without_tokens_does_not_run_ahead(run_ranks):
    assert run_ranks(3, _run_ahead_body) == [True] * 3


def _bad_input_body(ctx):
    mode = ll.LowLatencyMode(
        None, 4, 256, 2 * ctx.world_size, max_topk=4, device=ctx.device, check_ids=True
    )
    x = torch.randn(5, 256, device=ctx.device).to(torch.bfloat16)
    idx = torch.zeros(5, 2, dtype=torch.long, device=ctx.device)
    messages = []
    for call in [
        lambda: mode.dispatch(x, idx),
        lambda: mode.dispatch(x[:4, :128].contiguous(), idx[:4]),
        lambda: mode.dispatch(x[:4].float(), idx[:4]),
        lambda: mode.dispatch(x[:4], idx[:4] + 2 * ctx.world_size),
        lambda: mode.dispatch(x[:4], torch.zeros(4, 5, dtype=torch.long, device=ctx.device)),
    ]:
        try:
            call()
            messages.append("accepted")
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    _, _, handle, _ = mode.dispatch(x[:3], idx[:3])
    recv_x = torch.zeros(2, 2 * 4, 256, dtype=torch.bfloat16, device=ctx.device)
    weights = torch.ones(3, 2, device=ctx.device)
    launched = mode.state.clone()  # the call counters: a launch would move them
    for call in [
        lambda: mode.combine(recv_x, idx, torch.ones(5, 2, device=ctx.device), handle),
        lambda: mode.combine(recv_x, idx[:2], weights[:2], handle),
        lambda: mode.combine(recv_x, idx[:3, :1].contiguous(), weights[:, :1].contiguous(), handle),
        lambda: mode.combine(recv_x[:, :, :128], idx[:3], weights, handle),
        lambda: mode.combine(recv_x, idx[:3], weights.double(), handle),
        lambda: mode.combine(recv_x, idx[:3], weights, handle, out=x[:4]),
    ]:
        try:
            call()
            messages.append("accepted")
        except (TypeError, ValueError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    messages.append(bool(torch.equal(launched, mode.state)))
    mode.destroy()
    return messages


def test_bad_input_raises_before_launch(run_ranks):
    for messages in run_ranks(2, _bad_input_body):
        assert messages == [
            "ValueError: x: 5 tokens exceed num_max_dispatch_tokens_per_rank=4",
            "ValueError: x: expected shape [*, 256], got [4, 128]",
            "TypeError: x: expected dtype torch.bfloat16, got torch.float32",
            "ValueError: topk_idx: expert ids must lie in [-1, 4) (-1 = no expert), found 4",
            "ValueError: topk_idx: top-k 5 exceeds max_topk=4",
            # combine: ids of the dispatch's shape only (more tokens would read past the set)
            "ValueError: topk_idx: shape [5, 2] differs from that of the dispatch whose "
            "handle this is, [3, 2]",
            "ValueError: topk_idx: shape [2, 2] differs from that of the dispatch whose "
            "handle this is, [3, 2]",
            "ValueError: topk_idx: shape [3, 1] differs from that of the dispatch whose "
            "handle this is, [3, 2]",
            "ValueError: x: expected shape [2, 8, 256], got [2, 8, 128]",
            "TypeError: topk_weights: expected dtype torch.float32, got torch.float64",
            "ValueError: out: expected shape [3, 256], got [4, 256]",
            True,  # nothing above launched a kernel
        ]


def test_buffer_is_no_larger_than_deepeps():
    # DeepEP needs 1.9 GB for 128 tokens, hidden 7168, 256 experts on 4 ranks.
    assert ll.LowLatencyMode.size_hint(128, 7168, 4, 256) < 1.1e9
