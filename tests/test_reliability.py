"""Numerical edge cases: finite inputs never become NaN, NaN and Inf rows pass through.

Rows hold zeros, subnormals, the largest BF16 values, a NaN, +Inf and -Inf, and both modes
(BF16 and FP8) must match the reference bit for bit, with a NaN wherever it has one (the sign
and payload of a NaN are the hardware's choice). Then, explicitly: no finite input row turns
into NaN anywhere (an all-zero 128-group keeps a non-zero scale), and a row that holds NaN or
Inf stays non-finite instead of crashing or spreading to other rows.
FP8 e4m3 has no infinity, so in FP8 an infinite value arrives as NaN (its group's scale is
infinite); in BF16 every bit arrives as sent.
"""

import contextlib
import os

import pytest
import torch

from tests import test_low_latency as tll
from tests import test_normal as tn
from tests.conftest import gpu_ranks, skip_unless_ranks_fit
from tritonep import reference as ref
from tritonep.heap import shared_gpu
from tritonep.modes import low_latency as ll
from tritonep.modes import normal as nm
from tritonep.testing import Case, make_case

BF16_MAX = torch.finfo(torch.bfloat16).max
BF16_TINY = torch.finfo(torch.bfloat16).smallest_normal / 4  # a subnormal
SPECIAL = {"nan": 5, "inf": 6, "-inf": 7}  # rows that hold a non-finite value


def extreme_case(num_ranks: int, hidden: int, experts: int, topk: int) -> Case:
    """Every rank: 9 rows of edge values (row 8 is ordinary), random routing."""
    case = make_case(31, [9] * num_ranks, hidden, experts, topk)
    xs = []
    for x in case.x:
        x = x.clone()
        x[0] = 0
        x[1] = BF16_TINY
        x[2, 0::2], x[2, 1::2] = BF16_MAX, -BF16_MAX
        x[3] = x[3] * 1e-30
        x[4] = x[4] * 1e30
        x[SPECIAL["nan"], 3] = float("nan")
        x[SPECIAL["inf"], 130 % hidden] = float("inf")
        x[SPECIAL["-inf"], 0] = float("-inf")
        xs.append(x)
    return Case(xs, case.topk_idx, case.topk_weights, case.num_experts)


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x.float()).all(dim=1)


def _low_latency_body(ctx, use_fp8):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    hidden, experts, topk = 256, 2 * R, 2
    case = extreme_case(R, hidden, experts, topk)
    mode = ll.LowLatencyMode(None, 9, hidden, experts, max_topk=topk, device=dev, timeout_s=60)
    recv_x, recv_count, handle, _ = mode.dispatch(
        case.x[me].to(dev), case.topk_idx[me].to(dev), use_fp8=use_fp8
    )
    rows = ref.dequantize_fp8(*recv_x) if use_fp8 else recv_x.float()
    outputs = rows.to(torch.bfloat16)  # identity experts: the rows go back as they came
    combined, _ = mode.combine(
        outputs, case.topk_idx[me].to(dev), case.topk_weights[me].to(dev), handle
    )
    mode.check()
    tll._verify_call(ctx, case, 9, use_fp8, False, recv_x, recv_count, handle, outputs, combined)
    # Every received row: non-finite exactly when its source row was.
    for e in range(experts // R):
        n = int(recv_count[e])
        tokens = handle.recv_src_info[e, :n].long().cpu()
        sources = _source_ranks(handle.recv_layout_range[e].cpu(), n)
        sent_finite = (
            torch.stack(
                [
                    _finite_rows(case.x[s][t : t + 1])[0]
                    for s, t in zip(sources, tokens.tolist(), strict=True)
                ]
            )
            if n
            else torch.zeros(0, dtype=torch.bool)
        )
        assert torch.equal(_finite_rows(rows[e, :n].cpu()), sent_finite), f"rank {me} expert {e}"
    _check_combined(case, me, combined)
    mode.destroy()
    return True


def _source_ranks(packed_ranges: torch.Tensor, n: int) -> list[int]:
    begin, count = ref.unpack_range(packed_ranges)
    owner = [0] * n
    for src, (b, c) in enumerate(zip(begin.tolist(), count.tolist(), strict=True)):
        owner[b : b + c] = [src] * c
    return owner


def _check_combined(case, me, combined):
    """Tokens with finite rows combine to values without NaN; the others do not crash."""
    finite_in = _finite_rows(case.x[me])
    got = combined.float().cpu()
    assert not torch.isnan(got[finite_in]).any(), f"rank {me}: NaN from finite inputs"
    routed = (case.topk_idx[me] >= 0).any(dim=1)
    for row in SPECIAL.values():
        if routed[row]:
            assert not torch.isfinite(got[row]).all(), f"rank {me}: row {row} became finite"


def _normal_body(ctx, use_fp8):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    hidden, experts, topk = 256, 2 * R, 2
    case = extreme_case(R, hidden, experts, topk)
    xs = [ref.quantize_fp8(x) for x in case.x] if use_fp8 else list(case.x)
    mode = nm.NormalMode(None, hidden, experts, max_topk=topk, device=dev, timeout_s=60)
    idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    x = tuple(t.to(dev) for t in xs[me]) if use_fp8 else xs[me].to(dev)
    out = mode.dispatch(x, idx, w, per_expert, in_rank)
    rows = ref.dequantize_fp8(*out.recv_x) if use_fp8 else out.recv_x.float()
    y = rows.to(torch.bfloat16)
    combined, _ = mode.combine(y, out.handle)
    mode.check()
    wants = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, experts)
    tn._check_dispatch(me, out, wants[me], use_fp8, 0, 1)
    ys = [
        (ref.dequantize_fp8(*want.recv_x) if use_fp8 else want.recv_x.float()).to(torch.bfloat16)
        for want in wants
    ]
    expected, _ = ref.normal_combine(ys, wants, [x.shape[0] for x in case.x])[me]
    ref.assert_bitwise_equal(combined.cpu(), expected, f"rank {me} combined")
    _check_combined(case, me, combined)
    mode.destroy()
    return True


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_edge_values_match_the_reference_and_stay_contained(run_ranks, mode, use_fp8):
    body = _normal_body if mode == "normal" else _low_latency_body
    assert run_ranks(2, body, use_fp8) == [True, True]


# ----------------------------------------------------------------------- fault injection
def _lone_limit_s(device) -> float:
    """The limit of rank 0's calls while its peers stay away: 1 s on GPUs, 0.1 s under the
    interpreter (no live peer is waited for under it, so no peer can be late for it)."""
    return 1.0 if device.type == "cuda" else 0.1


def _rank0_alone(me, call):
    """Rank 0 makes ``call`` while its peer stays away: ``(WaitTimeoutError message or None,
    seconds taken)`` on rank 0, ``(None, 0.0)`` elsewhere."""
    import time

    from tritonep.errors import WaitTimeoutError

    error, took = None, 0.0
    if me == 0:
        start = time.monotonic()
        try:
            call()
        except WaitTimeoutError as e:
            error = str(e)
        took = time.monotonic() - start
    return error, took


def _assert_rank0_timed_out_at_its_limit(results):
    (error, took, limit), (none, _, _) = results
    assert none is None
    assert error.startswith(f"rank 0 timed out after {limit:g} s in phase"), error
    assert "peer 1" in error and took < 30


def _recover_body(ctx, mode_name):
    """Rank 1 skips a call: rank 0 raises within the timeout, naming the phase and the peer;
    then both ranks destroy the buffer, build a new one and get correct results."""
    from tritonep.errors import WaitTimeoutError

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    hidden, experts, topk = 128, 2 * R, 2
    case = make_case(3, [4] * R, hidden, experts, topk)
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)

    def build(timeout_s):
        if mode_name == "normal":
            return nm.NormalMode(
                None, hidden, experts, max_topk=topk, device=dev, timeout_s=timeout_s
            )
        return ll.LowLatencyMode(
            None, 4, hidden, experts, max_topk=topk, device=dev, timeout_s=timeout_s
        )

    def call(mode):
        if mode_name == "normal":
            return mode.dispatch(x, idx).recv_x
        recv_x, recv_count, handle, _ = mode.dispatch(x, idx, use_fp8=False)
        mode.check()
        return ref.LowLatencyDispatchResult.from_outputs(recv_x, recv_count, handle)

    limit = _lone_limit_s(dev)
    mode = build(limit)
    error, took = _rank0_alone(me, lambda: call(mode))
    with contextlib.suppress(WaitTimeoutError):  # the same timeout, reported again
        mode.destroy()
    # The default limit now: rank 1 skipped the first call, so it compiles its kernels only
    # now (seconds with a cold cache), while rank 0's kernel already waits for it.
    mode = build(100.0)
    got = call(mode)
    mode.destroy()
    if mode_name == "normal":
        want = ref.normal_dispatch(case.x, case.topk_idx, None, experts)[me].recv_x
        ref.assert_bitwise_equal(got.cpu(), want, f"rank {me} after recovery")
    else:
        want = ref.low_latency_dispatch(case.x, case.topk_idx, 4, experts, False)[me]
        ref.assert_low_latency_dispatch_equal(got, want, me)
    return error, took, limit


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_skipped_call_raises_then_a_new_buffer_works(run_ranks, mode):
    _assert_rank0_timed_out_at_its_limit(run_ranks(2, _recover_body, mode))


def _buffer_with_a_call(ctx, mode_name, seed):
    """A :class:`tritonep.Buffer` and a call of ``mode_name`` (normal: a cached dispatch,
    which has no host read of its own; ``internode``: the same across 2 emulated nodes;
    low-latency: a BF16 dispatch), made once by every rank under the default limit and
    checked."""
    from tritonep import Buffer

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    hidden, experts, topk = 128, 2 * R, 2
    case = make_case(seed, [4] * R, hidden, experts, topk)
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    w = case.topk_weights[me].to(dev)
    buffer = Buffer(None, device=dev, gpus_per_node=R // 2 if mode_name == "internode" else None)
    if mode_name in ("normal", "internode"):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
        *_, handle, _ = buffer.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        call = lambda: buffer.dispatch(x, handle=handle)
    else:
        call = lambda: buffer.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
    call()
    buffer.check()
    return buffer, call


def _timeout_change_body(ctx, mode_name):
    """A Buffer's ``timeout_s`` assigned after its mode exists reaches the mode's kernels:
    both ranks make one call under the default 100 s, the limit drops (to 1 s on GPUs), and
    rank 0 calls again alone."""
    from tritonep.errors import WaitTimeoutError

    me = ctx.rank
    buffer, call = _buffer_with_a_call(ctx, mode_name, 4)
    buffer.timeout_s = limit = _lone_limit_s(ctx.device)
    error, took = _rank0_alone(me, lambda: (call(), buffer.check()))
    with contextlib.suppress(WaitTimeoutError):  # the same timeout, reported again
        buffer.destroy()
    return error, took, limit


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_timeout_set_on_a_buffer_reaches_modes_already_built(run_ranks, mode):
    _assert_rank0_timed_out_at_its_limit(run_ranks(2, _timeout_change_body, mode))


def _later_calls_body(ctx, mode_name):
    """Rank 1 stops answering after one call. Rank 0 times out under a short limit (1 s on
    GPUs), then makes three more calls under the longest limit there is (about 35 minutes):
    each must raise the first error at once, since the kernels read the recorded timeout and
    no longer wait."""
    from tritonep.errors import WaitTimeoutError
    from tritonep.kernels.sync import MAX_TIMEOUT_S

    me = ctx.rank
    buffer, call = _buffer_with_a_call(ctx, mode_name, 5)
    errors, limit = [], _lone_limit_s(ctx.device)
    if me == 0:
        buffer.timeout_s = limit
        for _ in range(4):
            try:
                call()
                buffer.check()
                errors.append(None)
            except WaitTimeoutError as e:
                errors.append(str(e))
            buffer.timeout_s = MAX_TIMEOUT_S
    with contextlib.suppress(WaitTimeoutError):  # the same timeout, reported again
        buffer.destroy()
    return errors, limit


@pytest.mark.parametrize("mode", ["normal", "low_latency", "internode"])
def test_after_a_timeout_later_calls_raise_at_once(run_ranks, mode):
    """Without the recorded timeout cutting later waits short, the second call would wait
    out its 35-minute limit and the rank pool's 120 s would fail the test. Across 2 nodes of
    2 ranks each leg has its own status: both must stop waiting."""
    (errors, limit), *others = run_ranks(
        4 if mode == "internode" else 2,
        _later_calls_body,
        mode,
        timeout=120 if mode != "internode" else 240,
    )
    assert all(n == [] for n, _ in others)
    peer = 2 if mode == "internode" else 1  # across nodes: rank 0's rail partner first
    assert errors[0].startswith(f"rank 0 timed out after {limit:g} s in phase"), errors[0]
    assert f"waiting for peer {peer};" in errors[0], errors[0]
    assert errors == [errors[0]] * 4, errors  # the first error, its limit included


def _variants_body(ctx):
    """Kernel variants Triton holds after calls of 5 tokens and of 1 token (its own dispatch
    variant) under the default limit, then after calls under a 2 s limit (low-latency mode
    also with batches of other sizes: 1, 16, 7 tokens)."""
    from tritonep.kernels import (
        normal_combine,
        normal_dispatch,
        normal_notify,
    )

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    hidden, experts, topk = 128, 2 * R, 2
    low = ll.LowLatencyMode(None, 16, hidden, experts, max_topk=topk, device=dev)
    normal = nm.NormalMode(None, hidden, experts, max_topk=topk, device=dev)
    kernels = [
        ll.DISPATCH_KERNEL,
        ll.COMBINE_KERNEL,
        normal_notify.notify_kernel,
        normal_dispatch.normal_dispatch_kernel,
        normal_combine.normal_combine_kernel,
    ]

    def calls(tokens, seed):
        case = make_case(seed, [tokens] * R, hidden, experts, topk)
        x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
        recv_x, _, handle, _ = low.dispatch(x, idx, use_fp8=True)
        low.combine(
            tll._expert_outputs(recv_x, True, me), idx, case.topk_weights[me].to(dev), handle
        )
        low.check()
        if tokens == 5:
            result = normal.dispatch(x, idx)
            normal.combine(result.recv_x, result.handle)
            normal.check()

    def compiled():  # Triton's own cache of each kernel on this device
        return [len(k.device_caches[dev.index][0]) for k in kernels]

    calls(5, 80)
    calls(1, 79)
    before = compiled()
    low.timeout_s = normal.timeout_s = 2.0
    for seed, tokens in enumerate([5, 1, 16, 7]):
        calls(tokens, 81 + seed)
    after = compiled()
    low.destroy()
    normal.destroy()
    return before, after


@pytest.mark.gpu(n=2)
def test_a_new_limit_or_batch_size_compiles_no_kernel(run_ranks):
    """A limit assigned between calls (warm up under a long one, then shorten it, as shrink
    mode wants) and the changing batch of a decode step reuse the compiled kernels: a compile
    in the middle of a call would keep the peers waiting for seconds (tests/test_shrink.py
    masked a live peer that way when a 2 s limit made the kernels take it as an int32)."""
    for before, after in run_ranks(2, _variants_body):
        assert min(before) >= 1 and after == before


def _slow_rank_body(ctx):
    """One rank arrives 2 s late; everyone's results stay exact."""
    import time

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    case = make_case(8, [5] * R, 128, 2 * R, 2)
    mode = nm.NormalMode(None, 128, 2 * R, max_topk=2, device=dev, timeout_s=60)
    if me == R - 1:
        time.sleep(2)
    out = mode.dispatch(case.x[me].to(dev), case.topk_idx[me].to(dev))
    want = ref.normal_dispatch(case.x, case.topk_idx, None, 2 * R)[me].recv_x
    ref.assert_bitwise_equal(out.recv_x.cpu(), want, f"rank {me}")
    mode.destroy()
    return True


def test_a_slow_rank_does_not_change_results(run_ranks):
    assert run_ranks(3, _slow_rank_body) == [True] * 3


def _cycles_body(ctx, cycles, what):
    """Create and destroy modes (``what``: "modes", both single-node modes; "internode", the
    mode across 2 emulated nodes; "buffer", a Buffer that built both of its modes) ``cycles``
    times; no mapping of a heap may stay behind."""
    import gc

    from tritonep import Buffer
    from tritonep.modes.internode import InternodeMode

    def heap_mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum("tritonep-" in line for line in f)

    R, dev = ctx.world_size, ctx.device
    E = 2 * R
    before = heap_mappings()
    kept = []  # destroyed objects stay referenced: destroy itself must release the memory
    for _ in range(cycles):
        if what == "modes":
            made = [
                nm.NormalMode(None, 128, E, max_topk=2, device=dev),
                ll.LowLatencyMode(None, 8, 128, E, max_topk=2, device=dev),
            ]
        elif what == "internode":
            made = [InternodeMode(None, 128, E, 2, max_topk=2, device=dev)]
        else:
            buffer = Buffer(device=dev)
            buffer.clean_low_latency_buffer(8, 128, E)  # builds the low-latency mode
            idx = torch.zeros(2, 1, dtype=torch.int64, device=dev)
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
            buffer.dispatch(
                torch.zeros(2, 128, dtype=torch.bfloat16, device=dev),
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=idx,
            )
            made = [buffer]
        for thing in made:
            thing.destroy()
        kept += made
    gc.collect()
    return before, heap_mappings()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
@pytest.mark.parametrize("what, num_ranks", [("modes", 2), ("buffer", 2), ("internode", 4)])
def test_destroy_releases_every_heap(run_ranks, what, num_ranks):
    # Every heap a cycle maps is counted, and the count must come back to 0: one cycle left
    # behind fails the test. Three cycles also build each heap again after a destroy (its
    # name and the group's bookkeeping reused).
    for before, after in run_ranks(num_ranks, _cycles_body, 3, what, timeout=600):
        assert after == before == 0, (before, after)


def test_soak_across_emulated_nodes(capfd):
    from tritonep.soak import main

    skip_unless_ranks_fit(4)

    # Seeds 1-4 draw every kind of call (see test_soak_seeds_draw_every_kind_of_call).
    args = [
        "--ranks",
        "4",
        "--modes",
        "internode,low_latency_internode",
        "--calls",
        "4",
        "--check-every",
        "1",
        "--seed",
        "1",
    ]
    assert main(args) == 0
    out = capfd.readouterr().out
    assert "'internode': {'calls': 4, 'checked': 4" in out
    assert "'low_latency_internode': {'calls': 4, 'checked': 4" in out


def test_soak_checks_every_call_on_cpu_ranks(capfd):
    from tritonep.soak import main

    skip_unless_ranks_fit(3)

    # Seeds 2-5 draw every kind of call (see test_soak_seeds_draw_every_kind_of_call).
    args = [
        "--ranks",
        "3",
        "--calls",
        "4",
        "--check-every",
        "1",
        "--seed",
        "2",
        "--progress",
        "2",
        "--progress-s",
        "1e9",
    ]
    assert main(args) == 0
    out = capfd.readouterr().out
    assert "'normal': {'calls': 4, 'checked': 4" in out
    assert "'low_latency': {'calls': 4, 'checked': 4" in out
    # Progress says where a stopped run continues: seeds done, checks, the next seed.
    assert "normal: 2/4 calls (seeds 2-3, 2 checked, all matched)" in out
    assert "low_latency: 4/4 calls (seeds 2-5, 4 checked, all matched)" in out
    assert "continue with --seed 4" in out


@pytest.mark.parametrize("num_ranks, seeds", [(3, range(2, 6)), (4, range(1, 5))])
def test_soak_seeds_draw_every_kind_of_call(num_ranks, seeds):
    """The short soaks above check each call, so a few calls prove what many would, as long
    as their seeds draw every kind of call: each routing, BF16 and FP8, top-1 and wider, a
    rank with no token, one with a single token and one with the most. (Worst-case sizing,
    cached calls and the receive hook are drawn after these from the same generator; seeds
    that draw both values of each were chosen when these were.)"""
    from tritonep.soak import _params
    from tritonep.testing import ROUTINGS

    drawn = set()
    for seed in seeds:
        tokens, topk, routing, use_fp8, _ = _params(seed, 6, num_ranks, 8, 8 * num_ranks)
        drawn |= {routing, ("fp8", use_fp8), ("top-1", topk == 1)}
        drawn |= {("tokens", n) for n in tokens if n in (0, 1, 6)}
    want = {*ROUTINGS, ("fp8", False), ("fp8", True), ("top-1", False)}
    want |= {("tokens", 0), ("tokens", 1), ("tokens", 6)}
    assert want <= drawn, want - drawn


# -------------------------------------------------------------------------- on GPUs only
def _sleep_kernel_body(ctx):
    """The last rank's stream is held up by a sleep kernel before each call (about 50 ms);
    results stay exact and nothing times out."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    case = make_case(12, [300] * R, 1024, 8 * R, 4)
    normal = nm.NormalMode(None, 1024, 8 * R, max_topk=4, device=dev, timeout_s=30)
    low = ll.LowLatencyMode(None, 300, 1024, 8 * R, max_topk=4, device=dev, timeout_s=30)
    x, idx = case.x[me].to(dev), case.topk_idx[me].to(dev)
    for _ in range(3):
        if me == R - 1:
            torch.cuda._sleep(100_000_000)  # cycles: tens of ms at GPU clocks
        out = normal.dispatch(x, idx)
        want = ref.normal_dispatch(case.x, case.topk_idx, None, 8 * R)[me].recv_x
        ref.assert_bitwise_equal(out.recv_x.cpu(), want, f"rank {me} normal")
        if me == R - 1:
            torch.cuda._sleep(100_000_000)
        recv_x, count, handle, _ = low.dispatch(x, idx, use_fp8=False)
        low.check()
        got = ref.LowLatencyDispatchResult.from_outputs(recv_x, count, handle)
        want_ll = ref.low_latency_dispatch(case.x, case.topk_idx, 300, 8 * R, False)[me]
        ref.assert_low_latency_dispatch_equal(got, want_ll, me)
    normal.destroy()
    low.destroy()
    return True


@pytest.mark.gpu(n=2)
def test_a_rank_slowed_by_a_sleep_kernel_stays_exact(run_ranks):
    R = gpu_ranks()
    assert run_ranks(R, _sleep_kernel_body, timeout=240) == [True] * R


def _gpu_cycles_body(ctx, cycles):
    R, dev = ctx.world_size, ctx.device

    # Symmetric memory has its own allocator: watch the device's free memory, not only
    # PyTorch's caching allocator. The first cycle warms up (kernels, allocator pools).
    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        return total - free, torch.cuda.memory_allocated(dev)

    def cycle():
        for mode in (
            nm.NormalMode(None, 2048, 8 * R, max_topk=8, device=dev),
            ll.LowLatencyMode(None, 128, 2048, 8 * R, max_topk=8, device=dev),
        ):
            mode.destroy()

    cycle()
    before = used()
    for _ in range(cycles):
        cycle()
    return before, used()


@pytest.mark.gpu(n=1)
@pytest.mark.skipif(shared_gpu(), reason="ranks sharing a GPU see each other's memory")
def test_destroy_releases_gpu_memory(run_ranks):
    """Every GPU of the machine, one rank each (one GPU: one rank, its own heaps still made
    and freed through symmetric memory)."""
    for (device_before, torch_before), (device_after, torch_after) in run_ranks(
        gpu_ranks(), _gpu_cycles_body, 50, timeout=300
    ):
        print(
            f"device memory in use {device_before} -> {device_after} B, torch's allocator "
            f"{torch_before} -> {torch_after} B after 50 cycles"
        )
        assert torch_after <= torch_before + (1 << 20), (torch_before, torch_after)
        # One buffer set is about 100 MB here: 50 leaked ones would be gigabytes.
        assert device_after <= device_before + (64 << 20), (device_before, device_after)


def test_a_timeout_without_a_single_peer_says_so():
    """The relay between the internode legs waits on its own GPU: no peer to blame there (the
    network leg's own timeout names the peer)."""
    from tritonep.errors import WaitTimeoutError

    relay = str(WaitTimeoutError(3, -1, "dispatch relay (rows from the network leg)", 2.0))
    assert relay.startswith("rank 3 timed out after 2 s in phase 'dispatch relay")
    assert "no single peer" in relay and "peer -1" not in relay
    assert "waiting for peer 1; that peer is stuck" in str(WaitTimeoutError(0, 1, "notify", 1))


def test_a_status_keeps_its_host_copy_on_the_host_under_a_default_device():
    """The host copy of a mode's status is host memory whatever torch's default device is:
    under ``torch.set_default_device('cuda')`` (DeepEP's test harness) a buffer made without
    a device would land on the GPU, and pinning it fails. The meta device stands in here."""
    from tritonep.kernels.status import RECORD_WORDS, Status

    torch.set_default_device("meta")
    try:
        status = Status(torch.device("cpu"))
    finally:
        torch.set_default_device(None)
    assert status.host.device.type == "cpu" and status.words.device.type == "cpu"
    assert status.record() == [0] * RECORD_WORDS
