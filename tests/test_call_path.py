"""The call paths of both modes: named arguments, no host synchronization, no compile per
batch size (one per low-latency batch class), errors raised by the next call, timed-out
outputs that cannot pass for data, and the
same results under a process-wide default device and dtype.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.test_low_latency import _expert_outputs, _verify_call
from tritonep.kernels import (
    elastic_combine,
    elastic_dispatch,
    elastic_exchange,
    launcher,
    layout,
    ll_combine,
    ll_dispatch,
    normal_combine,
    normal_copy_combine,
    normal_dispatch,
    normal_notify,
)
from tritonep.modes import low_latency as ll
from tritonep.testing import make_case

LL_SHARED = ll_dispatch.LowLatencyShared
NORMAL_SHARED = normal_dispatch.NormalShared
ELASTIC_SHARED = elastic_exchange.ElasticShared
KERNELS = {
    "ll-dispatch": (
        ll_dispatch.ll_dispatch_kernel,
        ll_dispatch.DispatchCall,
        LL_SHARED,
        ll_dispatch.DispatchVariant,
    ),
    "ll-combine": (
        ll_combine.ll_combine_kernel,
        ll_combine.CombineCall,
        LL_SHARED,
        ll_combine.CombineVariant,
    ),
    "notify": (
        normal_notify.notify_kernel,
        normal_notify.NotifyCall,
        NORMAL_SHARED,
        normal_notify.NotifyVariant,
    ),
    "normal-dispatch": (
        normal_dispatch.normal_dispatch_kernel,
        normal_dispatch.DispatchCall,
        NORMAL_SHARED,
        normal_dispatch.DispatchVariant,
    ),
    "normal-combine": (
        normal_combine.normal_combine_kernel,
        normal_combine.CombineCall,
        NORMAL_SHARED,
        normal_combine.CombineVariant,
    ),
    "layout": (
        layout.dispatch_layout_kernel,
        layout.LayoutCall,
        layout.LayoutShared,
        layout.LayoutVariant,
    ),
    "elastic-dispatch": (
        elastic_dispatch.elastic_dispatch,
        elastic_dispatch.DispatchCall,
        ELASTIC_SHARED,
        elastic_dispatch.DispatchVariant,
    ),
    "elastic-dispatch-epilogue": (
        elastic_dispatch.elastic_dispatch_epilogue,
        elastic_dispatch.EpilogueCall,
        ELASTIC_SHARED,
        elastic_dispatch.EpilogueVariant,
    ),
    "elastic-combine": (
        elastic_combine.elastic_combine,
        elastic_combine.CombineCall,
        ELASTIC_SHARED,
        elastic_combine.CombineVariant,
    ),
    "elastic-combine-epilogue": (
        elastic_combine.elastic_combine_epilogue,
        elastic_combine.ReduceCall,
        ELASTIC_SHARED,
        elastic_combine.ReduceVariant,
    ),
    "copy-combine-sum": (
        normal_copy_combine.copy_combine_sum,
        normal_copy_combine.SumCall,
        normal_copy_combine.SumShared,
        normal_copy_combine.SumVariant,
    ),
    "elastic-barrier": (
        elastic_exchange.elastic_barrier,
        elastic_exchange.BarrierCall,
        ELASTIC_SHARED,
        elastic_exchange.BarrierVariant,
    ),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_bundles_follow_the_kernel_signatures(name):
    """A call bundle and the shared bundle are the kernel's runtime parameters, in order; the
    variant is its constexprs, in order. Integers of a call are not specialized (a new value
    compiles nothing), and every other field of a call is a pointer (``*_ptr``), as the fast
    launch path assumes (it passes their addresses)."""
    kernel, call, shared, variant = KERNELS[name]
    runtime, constexprs = launcher.kernel_params(kernel)
    assert list(call._fields + shared._fields) == runtime
    assert list(variant._fields) == constexprs
    free = launcher.not_specialized(kernel)
    for name in call._fields:
        assert name.endswith("_ptr") or name in free, name
    assert "timeout_us" in free or "timeout_us" not in runtime


def _warm_mode(ctx, tokens=5, **kwargs):
    R, me = ctx.world_size, ctx.rank
    mode = ll.LowLatencyMode(
        None, 8, 256, 4 * R, max_topk=3, device=ctx.device, timeout_s=60, **kwargs
    )
    case = make_case(3, [tokens] * R, 256, 4 * R, 3, "random")
    dev = case.to(ctx.device)
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    return mode, case, x, idx, w


def _host_reads_body(ctx):
    """Dispatch and combine (every variant the body uses made once), then the same calls
    with the launches left out, counting every read of a tensor's value on the host and every
    call a ``torch`` function mode sees."""
    from torch.overrides import TorchFunctionMode

    mode, _, x, idx, w = _warm_mode(ctx)
    stats = torch.zeros(mode.num_local_experts, dtype=torch.int32, device=ctx.device)

    y = torch.zeros(
        mode.num_local_experts, mode.num_ranks * 8, 256, dtype=torch.bfloat16, device=ctx.device
    )

    def calls():
        for use_fp8, hook in [(True, False), (False, True)]:
            _, _, handle, recv_hook = mode.dispatch(
                x, idx, use_fp8=use_fp8, return_recv_hook=hook, recv_stats=stats
            )
            if hook:
                recv_hook()
            _, comb_hook = mode.combine(y, idx, w, handle, return_recv_hook=hook)
            if hook:
                comb_hook()

    calls()
    mode.check()
    reads = []
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    launch = launcher.KernelLaunch.__call__
    try:
        launcher.KernelLaunch.__call__ = lambda self, *args: None
        for name in names:
            setattr(torch.Tensor, name, counted(name))
        with Count():
            calls()
    finally:
        launcher.KernelLaunch.__call__ = launch
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    mode.check()
    mode.destroy()
    return reads, seen


def test_calls_read_nothing_on_the_host(run_ranks):
    """The CPU counterpart of ``torch.cuda.set_sync_debug_mode("error")``: no value of any
    tensor is read on the host (``check_ids`` is off by default), and nothing goes through a
    ``torch`` function mode (as ``torch.set_default_device`` installs)."""
    for reads, seen in run_ranks(2, _host_reads_body):
        assert reads == [] and seen == [], (reads, seen)


def _sync_debug_body(ctx):
    mode, _, x, idx, w = _warm_mode(ctx)
    from tritonep import Buffer

    buffer = Buffer(None, device=ctx.device)
    stats = torch.zeros(mode.num_local_experts, dtype=torch.int32, device=ctx.device)
    E = mode.num_experts

    def calls():
        for use_fp8 in (True, False):
            recv_x, _, handle, _ = mode.dispatch(x, idx, use_fp8=use_fp8, recv_stats=stats)
            y = torch.zeros(
                recv_x[0].shape if use_fp8 else recv_x.shape,
                dtype=torch.bfloat16,
                device=ctx.device,
            )
            mode.combine(y, idx, w, handle)
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
                x, idx, 8, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8
            )
            buffer.low_latency_combine(y, idx, w, handle)

    calls()  # compiles; the buffer's first call sizes its memory (collectives)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mode.check()
    buffer.check()
    mode.destroy()
    buffer.destroy()
    return True


@pytest.mark.gpu(n=2)
def test_calls_do_not_synchronize_on_gpus(run_ranks):
    assert run_ranks(2, _sync_debug_body) == [True, True]


#: A dispatch variant's batch class: (ONE_TOKEN, COUNT_BY_ADDS, BLOCK_ITEMS).
CLASS_FIELDS = ("ONE_TOKEN", "COUNT_BY_ADDS", "BLOCK_ITEMS")


def _variants_body(ctx):
    """Dispatch and combine over batch sizes, each checked against the reference: per step,
    the batch classes its dispatch launches were compiled for and the kernel variants
    (constexprs and Triton's specialization of every argument) asked for so far. Then every
    batch size from 0 to the maximum with the launches left out: the dispatch variants their
    plans hold."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 40, 128, 4 * R, 2
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    # 8 experts over 4 programs: receivers take 2 items together where ids are few.
    mode.count_adds = 64  # the larger batches count by histograms
    keys = set()
    classes = set()
    triton_path = launcher.KernelLaunch._triton_path

    def recording(self, call, shared, grid=None):
        free = launcher.not_specialized(self.fn)
        names = list(call._fields) + list(ll_dispatch.LowLatencyShared._fields)
        args = list(call) + list(shared.args)
        spec = tuple(
            native_specialize_impl(BaseBackend, a, False, n not in free, True)
            for n, a in zip(names, args, strict=True)
        )
        keys.add((self.fn.__name__, tuple(sorted(self.meta.items())), spec))
        if "ONE_TOKEN" in self.meta:
            classes.add(tuple(self.meta[name] for name in CLASS_FIELDS))
        return triton_path(self, call, shared, grid)

    launcher.KernelLaunch._triton_path = recording
    steps = []
    try:
        for step, tokens in enumerate([M, 1, 2, 17, 3, 0, 33, 1, 9, 10]):
            case = make_case(100 + step, [tokens] * R, H, E, K, "random")
            dev = case.to(ctx.device)
            classes.clear()
            recv_x, recv_count, handle, _ = mode.dispatch(dev.x[me], dev.topk_idx[me], use_fp8=True)
            outputs = _expert_outputs(recv_x, True, me)
            combined, _ = mode.combine(outputs, dev.topk_idx[me], dev.topk_weights[me], handle)
            mode.check()
            _verify_call(ctx, case, M, True, False, recv_x, recv_count, handle, outputs, combined)
            steps.append((tokens, sorted(classes), len(keys)))
    finally:
        launcher.KernelLaunch._triton_path = triton_path
    # Every batch size, launches left out (ids of the right shape are all the host looks at).
    launch = launcher.KernelLaunch.__call__
    try:
        launcher.KernelLaunch.__call__ = lambda self, *args: None
        x = torch.zeros(M, H, dtype=torch.bfloat16, device=ctx.device)
        idx = torch.zeros(M, K, dtype=torch.int64, device=ctx.device)
        for tokens in range(M + 1):
            mode.dispatch(x[:tokens], idx[:tokens], use_fp8=True)
    finally:
        launcher.KernelLaunch.__call__ = launch
    planned = sorted(
        tuple(plan[2].meta[name] for name in CLASS_FIELDS)
        for plan in mode._plans.values()
        if "ONE_TOKEN" in plan[2].meta
    )
    mode.check()
    mode.destroy()
    return steps, planned


def test_batch_sizes_compile_one_variant_per_class(run_ranks):
    """Batches of 0 to 40 tokens: one token, few ids (atomic adds, receivers taking 2 items
    together) and many (histograms, one item at a time) are the three dispatch variants
    (a send and a receive launch each on CPU ranks, with the combine's two); each compiles
    once, on the first batch of its class, and later batches of a class, of any size, reuse
    it."""
    one, few, many = (True, True, 2), (False, True, 2), (False, False, 1)
    expected = {40: many, 1: one, 2: few, 17: many, 3: few, 0: few, 33: many, 9: few, 10: many}
    for steps, planned in run_ranks(2, _variants_body):
        launched = set()
        for tokens, classes, variants in steps:
            assert classes == [expected[tokens]], (tokens, classes)
            launched.add(expected[tokens])
            assert variants == 2 + 2 * len(launched), (tokens, steps)
        assert launched == {one, few, many}
        assert planned == sorted([one, few, many]), planned


def _zeroed_outputs(mode):
    """Outputs filled with zeros rather than the suite's 0xFF marker: poison must come from
    the kernels."""
    assert ll.POISON_OUTPUTS  # (the suite's setting) fresh outputs go through mode._poison

    def zeroed(*outputs):
        for t in outputs:
            if t is not None:
                t.zero_()

    mode._poison = zeroed


def _timed_out_body(ctx, phase):
    """Rank 1 skips a dispatch (or a combine); rank 0's call gives up on it after 1 s."""
    from tritonep.errors import WaitTimeoutError

    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 6, 128, 2 * R, 2
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    case = make_case(7, [5, 4], H, E, K, "random")
    dev = case.to(ctx.device)
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    recv_x, recv_count, handle, _ = mode.dispatch(x, idx, use_fp8=True)
    mode.check()
    if me == 1:
        if phase == "combine":  # dispatches once more, then stops before the combine
            mode.dispatch(x, idx, use_fp8=True)
        with contextlib.suppress(WaitTimeoutError):
            mode.destroy()
        return None
    _zeroed_outputs(mode)
    mode.timeout_s = 1.0
    recv_x, recv_count, handle, _ = mode.dispatch(x, idx, use_fp8=True)
    result = {}
    if phase == "dispatch":
        payload, scales = recv_x
        # Rank 0's own block of each expert came; rank 1's is one poison row after it.
        own = [int(r) & 0xFFFFFFFF for r in handle.recv_layout_range[:, 0].tolist()]
        rows = []
        for e, n in enumerate(own):
            begin, count = divmod(int(handle.recv_layout_range[e, 1]), 1 << 32)
            rows.append(
                (
                    int(recv_count[e]),
                    n,
                    begin,
                    count,
                    bool(payload[e, n].view(torch.uint8).eq(0xFF).all()),
                    bool(scales[e, n].isnan().all()),
                    int(handle.recv_src_info[e, n]),
                    int(handle.recv_topk_slot[e, n]),
                )
            )
        result["rows"] = rows
    else:
        out = torch.zeros(idx.shape[0], H, dtype=torch.bfloat16, device=ctx.device)
        mode.combine(_expert_outputs(recv_x, True, me), idx, w, handle, out=out)
        result["combined_nan"] = bool(out.isnan().all())
    # The next call launches, then raises the recorded timeout.
    mode.timeout_s = 30.0
    try:
        mode.dispatch(x, idx, use_fp8=True)
        result["next"] = None
    except WaitTimeoutError as e:
        result["next"] = str(e)
    with contextlib.suppress(WaitTimeoutError):
        mode.destroy()
    return result


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_timed_out_call_poisons_its_outputs(run_ranks, phase):
    result, skipped = run_ranks(2, _timed_out_body, phase)
    assert skipped is None
    assert result["next"] is not None and result["next"].startswith(
        f"rank 0 timed out after 1 s in phase 'low-latency {phase} receive"
    ), result["next"]
    assert "waiting for peer 1" in result["next"]
    if phase == "dispatch":
        for count, own, begin, moved, nan_payload, nan_scales, src, slot in result["rows"]:
            # Counted in recv_count, in no layout_range block, 0xFF bytes: NaN and -1.
            assert (count, begin, moved) == (own + 1, own, 0)
            assert nan_payload and nan_scales and (src, slot) == (-1, -1)
    else:
        assert result["combined_nan"]


def _defaults_body(ctx):
    """The same calls without and with a process-wide default device and dtype."""
    mode, case, x, idx, w = _warm_mode(ctx)
    results = []
    for defaults in (False, True):
        if defaults:
            torch.set_default_device(ctx.device)
            torch.set_default_dtype(torch.bfloat16)
        try:
            recv_x, recv_count, handle, _ = mode.dispatch(x, idx, use_fp8=True)
            outputs = _expert_outputs(recv_x, True, ctx.rank)
            combined, _ = mode.combine(outputs, idx, w, handle)
        finally:
            torch.set_default_device(None)
            torch.set_default_dtype(torch.float32)
        _verify_call(ctx, case, 8, True, False, recv_x, recv_count, handle, outputs, combined)
        results.append([t.cpu() for t in (recv_x[0].view(torch.uint8), recv_count, combined)])
    mode.destroy()
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_process_wide_default_device_and_dtype_change_nothing(run_ranks):
    assert run_ranks(2, _defaults_body) == [True, True]


# -------------------------------------------------------------------------------- normal mode


def _normal_case(ctx, seed, tokens, hidden=128, experts_per_rank=2, topk=3):
    from tritonep.testing import tag_rows

    R = ctx.world_size
    case = tag_rows(make_case(seed, tokens[:R], hidden, experts_per_rank * R, topk, "random"))
    return case, case.to(ctx.device)


def _normal_calls(mode, dev, me, worst):
    """Every kind of normal-mode call: a layout, an exact-size and a worst-case dispatch (with
    the layout given), cached dispatches (BF16 and FP8), combines."""
    from tritonep.reference import quantize_fp8

    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    x8 = tuple(t.to(x.device) for t in quantize_fp8(x.cpu()))

    def calls(exact=True):
        _, per_expert, in_rank = mode.get_dispatch_layout(idx)
        if exact:
            out = mode.dispatch(x, idx, w, per_expert, in_rank)
            mode.combine(out.recv_x, out.handle, out.recv_topk_weights)
        out = mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=worst)
        mode.dispatch(x, handle=out.handle)
        mode.dispatch(x8, handle=out.handle)
        mode.combine(out.recv_x, out.handle, out.recv_topk_weights)  # (padding rows unread)

    return calls


def _normal_host_reads_body(ctx):
    """As ``_host_reads_body``: every normal-mode call but the exact-size dispatch (whose host
    waits for the count, by design) with its launches left out, counting host reads of
    tensors and calls a ``torch`` function mode sees."""
    from torch.overrides import TorchFunctionMode

    from tritonep.modes import normal as nm

    me = ctx.rank
    mode = nm.NormalMode(None, 128, 2 * ctx.world_size, max_topk=3, device=ctx.device, timeout_s=60)
    _, dev = _normal_case(ctx, 5, [7, 4, 9])
    calls = _normal_calls(mode, dev, me, 40)
    calls()  # every variant made once
    mode.check()
    reads, seen = [], []
    names = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    launch = launcher.KernelLaunch.__call__
    try:
        launcher.KernelLaunch.__call__ = lambda self, *args: None
        for name in names:
            setattr(torch.Tensor, name, counted(name))
        with Count():
            calls(exact=False)
    finally:
        launcher.KernelLaunch.__call__ = launch
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    mode.destroy()
    return reads, seen


def test_normal_calls_read_nothing_on_the_host(run_ranks):
    """The normal mode's layout, worst-case and cached dispatches and combines read no tensor
    on the host (``check_ids`` is off by default) and run no ``torch`` function mode."""
    for reads, seen in run_ranks(2, _normal_host_reads_body):
        assert reads == [] and seen == [], (reads, seen)


def _normal_sync_debug_body(ctx):
    from tritonep.modes import normal as nm

    mode = nm.NormalMode(None, 128, 2 * ctx.world_size, max_topk=3, device=ctx.device, timeout_s=60)
    _, dev = _normal_case(ctx, 5, [7, 4, 9, 3])
    calls = _normal_calls(mode, dev, ctx.rank, 64)
    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            calls(exact=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mode.check()
    mode.destroy()
    return True


@pytest.mark.gpu(n=2)
def test_normal_calls_do_not_synchronize_on_gpus(run_ranks):
    assert run_ranks(2, _normal_sync_debug_body) == [True, True]


def _normal_variants_body(ctx, steps):
    """The kernel variants a loop over token counts (different on every rank, random routing)
    asks for: exact-size, worst-case and cached dispatches, combines and layouts; each call
    checked against the reference. Returns the variant count after each step."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tests.test_normal import _combine_input, _verify
    from tritonep.modes import normal as nm

    me, R = ctx.rank, ctx.world_size
    E = 2 * R
    mode = nm.NormalMode(None, 128, E, max_topk=3, device=ctx.device, timeout_s=60)
    keys = set()
    triton_path = launcher.KernelLaunch._triton_path

    def recording(self, call, shared, grid=None):
        free = launcher.not_specialized(self.fn)
        runtime, _ = launcher.kernel_params(self.fn)
        args = [self.placeholder if a is None else a for a in list(call) + list(shared.args)]
        spec = tuple(
            native_specialize_impl(BaseBackend, a, False, n not in free, True)
            for n, a in zip(runtime, args, strict=True)
        )
        keys.add((self.fn.__name__, tuple(sorted(self.meta.items())), spec))
        return triton_path(self, call, shared, grid)

    launcher.KernelLaunch._triton_path = recording
    seen = []
    gen = torch.Generator().manual_seed(17)
    try:
        for step in range(steps):
            tokens = torch.randint(0, 100, (R,), generator=gen).tolist()
            tokens[step % R] = [1, 0, 64, 100, 33, 16][step % 6]
            case, dev = _normal_case(ctx, 300 + step, tokens)
            x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
            worst = sum(tokens)
            for rows in (0, worst):
                _, per_expert, in_rank = mode.get_dispatch_layout(idx)
                out = mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=rows)
                y = _combine_input(out, me)
                combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights)
                _verify(ctx, case, list(case.x), out, combined, combined_w, E, 1, rows, False)
            again = mode.dispatch(x, handle=out.handle)
            assert torch.equal(again.recv_x.view(torch.int16), out.recv_x.view(torch.int16))
            mode.check()
            seen.append(len(keys))
    finally:
        launcher.KernelLaunch._triton_path = triton_path
    mode.destroy()
    return seen


def test_a_new_token_count_compiles_nothing_in_normal_mode(run_ranks):
    """Token counts from 0 to 100 per rank, a different one on each rank and every step: the
    variants of the first step (layout, notify, exact-size, worst-case and cached dispatch,
    combine) serve every later one."""
    for seen in run_ranks(2, _normal_variants_body, 5, timeout=600):
        assert seen == [6] * len(seen), seen


def _normal_zeroed_outputs():
    """Outputs filled with zeros rather than the suite's 0xFF marker: poison must come from
    the kernels."""
    from tritonep.modes import normal as nm

    nm.empty_output = lambda device, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


def _normal_timed_out_body(ctx, phase):
    """Rank 1 makes only the count exchange of a worst-case dispatch (or skips a combine);
    rank 0's call gives up on it after 1 s. Returns what rank 0's outputs hold."""
    from tritonep.errors import WaitTimeoutError
    from tritonep.modes import normal as nm

    me = ctx.rank
    mode = nm.NormalMode(None, 128, 4, max_topk=2, device=ctx.device, timeout_s=60)
    _, dev = _normal_case(ctx, 41, [9, 6], topk=2)
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    out = mode.dispatch(x, idx, w, num_worst_tokens=20)
    mode.check()
    # Rank 0 starts its 1 s call once rank 1's notify is launched: compiling it on an empty
    # cache can take longer than that, and rank 0 would then give up on the counts instead.
    store, launched = dist.distributed_c10d._get_default_store(), "timed-out-notify-launched"
    if me == 1:
        if phase == "dispatch":  # the counts go out, the rows never do
            _, per_expert, in_rank = mode.get_dispatch_layout(idx)
            mode.notify(in_rank, per_expert, x.shape[0], 1, 20)
            store.set(launched, "1")
        with contextlib.suppress(WaitTimeoutError):
            mode.destroy()
        return None
    if phase == "dispatch":
        store.wait([launched])
        store.delete_key(launched)
    _normal_zeroed_outputs()
    mode.timeout_s = 1.0
    result = {}
    if phase == "dispatch":
        out = mode.dispatch(x, idx, w, num_worst_tokens=20)
        n = int(out.handle.host_info[0])
        rows = out.recv_x[:n]
        result["rows"] = n
        result["payload_nan"] = bool(rows.view(torch.int16).eq(-1).all())
        result["src"] = out.handle.recv_src_idx[:n].tolist()
        result["ids"] = out.recv_topk_idx[:n].tolist()
        result["weights_nan"] = bool(out.recv_topk_weights[:n].isnan().all())
    else:
        combined, combined_w = mode.combine(out.recv_x, out.handle, out.recv_topk_weights)
        # Tokens with a row from rank 1 lost it; tokens that went to rank 0 alone did not.
        to_peer = out.handle.is_token_in_rank[:, 1].tolist()
        result["nan"] = [bool(r.isnan().all()) for r in combined]
        result["weights_nan"] = [bool(r.isnan().all()) for r in combined_w]
        result["to_peer"] = to_peer
    mode.timeout_s = 30.0
    try:  # the next call launches, then raises the recorded timeout
        mode.dispatch(x, handle=out.handle)
        result["next"] = None
    except WaitTimeoutError as e:
        result["next"] = str(e)
    with contextlib.suppress(WaitTimeoutError):
        mode.destroy()
    return result


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_timed_out_normal_call_poisons_its_outputs(run_ranks, phase):
    result, skipped = run_ranks(2, _normal_timed_out_body, phase)
    assert skipped is None
    assert result["next"] is not None and result["next"].startswith(
        f"rank 0 timed out after 1 s in phase '{phase} receive, channel"
    ), result["next"]
    if phase == "dispatch":
        # Every row received (rank 0's own among them) is 0xFF bytes: NaN payload and
        # weights, source and ids -1.
        n = result["rows"]
        assert n > 0 and result["payload_nan"] and result["weights_nan"]
        assert result["src"] == [-1] * n and all(ids == [-1, -1] for ids in result["ids"])
    else:
        assert any(result["to_peer"]) and not all(result["to_peer"])
        assert result["nan"] == result["to_peer"] == result["weights_nan"]


def _normal_bad_ids_body(ctx, kind):
    """Rank 0 passes an id outside [-1, E): its call goes on without it, and the next
    dispatch or combine (or this one, for an exact-size dispatch, which reads the host
    anyway) raises after its launches; every rank stays in step."""
    from tests.test_normal import _combine_input, _verify
    from tritonep.modes import normal as nm

    me, R = ctx.rank, ctx.world_size
    E = 2 * R
    mode = nm.NormalMode(None, 128, E, max_topk=3, device=ctx.device, timeout_s=60)
    case, dev = _normal_case(ctx, 61, [9, 6, 7])
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    bad = idx.clone()
    if me == 0:
        bad[4, 2] = -5 if kind == "negative" else E + 3
    errors = []

    def attempt(fn):
        try:
            result = fn()
            errors.append(None)
            return result
        except ValueError as e:
            errors.append(str(e))
            return None

    if kind == "exact":  # the layout kernel records, the host reads the count: raised now
        attempt(lambda: mode.dispatch(x, bad, w))
        first = mode.dispatch(x, idx, w, num_worst_tokens=40)
    elif kind == "dispatch":  # a layout made elsewhere: the dispatch kernel records
        clean = torch.where(bad >= E, -1, bad)
        _, per_expert, in_rank = mode.get_dispatch_layout(clean)
        first = attempt(lambda: mode.dispatch(x, bad, w, per_expert, in_rank, num_worst_tokens=40))
    else:
        first = attempt(lambda: mode.dispatch(x, bad, w, num_worst_tokens=40))
    attempt(lambda: mode.combine(_combine_input(first, me), first.handle, first.recv_topk_weights))
    # Still in step: a clean call matches the reference on every rank.
    out = mode.dispatch(x, idx, w)
    y = _combine_input(out, me)
    combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights)
    _verify(ctx, case, list(case.x), out, combined, combined_w, E, 1, 0, False)
    mode.check()
    mode.destroy()
    return errors


@pytest.mark.parametrize("kind", ["worst", "negative", "exact", "dispatch"])
def test_normal_bad_ids_are_dropped_and_raised_after_the_launches(run_ranks, kind):
    errors = run_ranks(3, _normal_bad_ids_body, kind)
    assert errors[1] == errors[2] == [None, None], errors
    bad = -5 if kind == "negative" else 9
    where = "dispatch" if kind == "dispatch" else "get_dispatch_layout"
    message = f"topk_idx: token 4, column 2 of rank 0's {where} names expert {bad}, outside [-1, 6)"
    if kind == "exact":  # raised by the call that read the host
        assert errors[0][0].startswith(message) and errors[0][1] is None, errors[0]
    else:
        assert errors[0][0] is None and errors[0][1].startswith(message), errors[0]


def _normal_addresses_body(ctx):
    """Every normal-mode launch offered as addresses (the templates of cached dispatches,
    combines and first dispatches) against the tensor bundle Triton's path then gets, field by
    field; every offer is refused, so each launch runs from its bundle and is checked."""
    from tests.test_normal import _combine_input, _verify
    from tritonep.modes import normal as nm

    me, R = ctx.rank, ctx.world_size
    E = 2 * R
    mode = nm.NormalMode(None, 128, E, max_topk=3, device=ctx.device, timeout_s=60)
    case, dev = _normal_case(ctx, 81, [7, 4, 9])
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    events = []  # ("offer" or "bundle", kernel, values as addresses and ints)
    launch_values, call = launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__

    def refused(self, values, shared, *args):
        events.append(("offer", self.fn.__name__, tuple(values)))
        return False

    def bundled(self, bundle, shared, grid=None):
        null = self.placeholder.data_ptr() if self.placeholder is not None else None
        addresses = tuple(
            a.data_ptr() if isinstance(a, torch.Tensor) else null if a is None else a
            for a in bundle
        )
        events.append(("bundle", self.fn.__name__, addresses))
        return call(self, bundle, shared, grid)

    launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__ = refused, bundled
    try:
        for rows in (0, 40):
            out = mode.dispatch(x, idx, w, num_worst_tokens=rows)
            for _ in range(2):  # the second call of each offers its handle's template
                y = _combine_input(out, me)
                combined, combined_w = mode.combine(y, out.handle, out.recv_topk_weights)
                again = mode.dispatch(x, handle=out.handle)
            mode.check()
            _verify(ctx, case, list(case.x), out, combined, combined_w, E, 1, rows, False)
            assert torch.equal(again.recv_x.view(torch.int16), out.recv_x.view(torch.int16))
    finally:
        launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__ = launch_values, call
    mode.destroy()
    offers = [i for i, e in enumerate(events) if e[0] == "offer"]
    # Each offer is followed by the launch of its bundle, with the same values.
    same = all(events[i + 1] == ("bundle", *events[i][1:]) for i in offers)
    return sorted(events[i][1] for i in offers), same


def test_normal_launch_addresses_are_those_of_the_bundles(run_ranks):
    """The normal mode's templates (:meth:`KernelLaunch.launch_values`) hold the addresses
    and ints its named bundles hold: two first dispatches (exact size: notify and dispatch;
    worst case: one dispatch launch that exchanges the counts too), then per handle two
    combines and two cached dispatches, the first of each made from the handle's addresses
    (no bundle: compared here with the bundle the refused offer then launches by name)."""
    names = ["notify_kernel"] + ["normal_dispatch_kernel"] * 6 + ["normal_combine_kernel"] * 4
    expected = sorted(names)
    for offered, same in run_ranks(2, _normal_addresses_body):
        assert offered == expected and same, offered


def _normal_defaults_body(ctx):
    """Every normal-mode call without and with a process-wide default device and dtype."""
    from tritonep.modes import normal as nm

    me = ctx.rank
    mode = nm.NormalMode(None, 128, 2 * ctx.world_size, max_topk=3, device=ctx.device, timeout_s=60)
    _, dev = _normal_case(ctx, 71, [7, 4, 9])
    x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
    results = []
    for defaults in (False, True):
        if defaults:
            torch.set_default_device(ctx.device)
            torch.set_default_dtype(torch.bfloat16)
        try:
            _, per_expert, in_rank = mode.get_dispatch_layout(idx)
            exact = mode.dispatch(x, idx, w, per_expert, in_rank)
            worst = mode.dispatch(x, idx, w, num_worst_tokens=40)
            cached = mode.dispatch(x, handle=exact.handle)
            combined, combined_w = mode.combine(exact.recv_x, exact.handle, exact.recv_topk_weights)
        finally:
            torch.set_default_device(None)
            torch.set_default_dtype(torch.float32)
        tensors = (
            per_expert,
            in_rank,
            exact.recv_x,
            exact.recv_topk_idx,
            worst.recv_x[:5],
            worst.recv_topk_idx,
            cached.recv_x,
            combined,
            combined_w,
        )
        results.append(
            [t.cpu().view(torch.uint8) if t.dtype.is_floating_point else t.cpu() for t in tensors]
        )
    mode.check()
    mode.destroy()
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_normal_calls_are_the_same_under_a_process_wide_default_device_and_dtype(run_ranks):
    assert run_ranks(2, _normal_defaults_body) == [True, True]


def _addresses_body(ctx):
    """Every launch's address values (what the compiled kernel gets on a GPU) against the
    tensor bundle Triton's path gets, field by field; the launches then run from the bundle."""
    mode, case, x, idx, w = _warm_mode(ctx)
    stats = torch.zeros(mode.num_local_experts, dtype=torch.int32, device=ctx.device)
    wait = torch.zeros(mode.num_ranks, dtype=torch.int64, device=ctx.device)
    offered, bundles = [], []
    launch_values, call = launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__

    def refused(self, values, shared, *args):
        offered.append(tuple(values))
        return False

    def bundled(self, bundle, shared):
        bundles.append(tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in bundle))
        return call(self, bundle, shared)

    launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__ = refused, bundled
    try:
        for use_fp8, hook, wait_stats, recv_stats in [
            (True, False, None, stats),
            (False, True, wait, None),
        ]:
            recv_x, recv_count, handle, recv_hook = mode.dispatch(
                x, idx, use_fp8, False, hook, wait_stats, False, recv_stats
            )
            if hook:
                recv_hook()
            outputs = _expert_outputs(recv_x, use_fp8, ctx.rank)
            combined, comb_hook = mode.combine(
                outputs, idx, w, handle, False, hook, None, wait_stats
            )
            if hook:
                comb_hook()
            mode.check()
            _verify_call(
                ctx, case, 8, use_fp8, False, recv_x, recv_count, handle, outputs, combined
            )
    finally:
        launcher.KernelLaunch.launch_values, launcher.KernelLaunch.__call__ = launch_values, call
    mode.destroy()
    return offered, bundles


def test_launch_addresses_are_those_of_the_bundles(run_ranks):
    """The fast path (addresses and ints, :meth:`KernelLaunch.launch_values`) and Triton's
    path (the tensor bundle) get the same arguments: the handle's offsets, the defaults of
    optional pointers, the ints. Every offer is refused here (as for a first call), so each
    call's send is offered, then its send and receive are launched from one bundle."""
    for offered, bundles in run_ranks(2, _addresses_body):
        # FP8 dispatch with statistics, its combine, BF16 dispatch with a hook and wait
        # statistics, its combine: one offer, then a send and a receive bundle each.
        assert (len(offered), len(bundles)) == (4, 8)
        assert offered == bundles[0::2] == bundles[1::2]


def _same_shape_body(ctx):
    """Calls of one shape with new data each time, one after a change of batch size, and bad
    input after those: each checked against the reference, outputs poisoned by the suite."""
    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 8, 256, 4 * R, 3
    mode = ll.LowLatencyMode(None, M, H, E, max_topk=K, device=ctx.device, timeout_s=60)
    stats = torch.zeros(mode.num_local_experts, dtype=torch.int32, device=ctx.device)
    counted = torch.zeros_like(stats)
    kept = None
    for seed, tokens in [(11, 5), (12, 5), (13, 5), (14, 2)]:
        case = make_case(seed, [tokens] * R, H, E, K, "random")
        dev = case.to(ctx.device)
        x, idx, w = dev.x[me], dev.topk_idx[me], dev.topk_weights[me]
        recv_x, recv_count, handle, _ = mode.dispatch(
            x, idx, True, False, False, None, False, stats
        )
        outputs = _expert_outputs(recv_x, True, me)
        combined, _ = mode.combine(outputs, idx, w, handle)
        mode.check()
        _verify_call(ctx, case, M, True, False, recv_x, recv_count, handle, outputs, combined)
        counted += recv_count
        if kept is None:  # the first call's outputs, to be compared after the later calls
            kept = [
                (t, t.clone()) for t in (recv_x[0], recv_x[1], recv_count, handle.block, combined)
            ]
    unchanged = all(
        torch.equal(t.contiguous().view(torch.uint8), c.contiguous().view(torch.uint8))
        for t, c in kept
    )
    errors = []
    for bad in [
        lambda: mode.dispatch(x[:, : H // 2], idx),  # another hidden size
        lambda: mode.dispatch(x.float(), idx),
        lambda: mode.dispatch(x, idx.int()),
        lambda: mode.dispatch(x, idx[:1]),  # ids of another batch size
        lambda: mode.dispatch(x, idx, recv_stats=stats[:1]),
        lambda: mode.combine(outputs, idx[:1], w[:1], handle),  # not the handle's shape
        lambda: mode.combine(outputs[:, :4], idx, w, handle),
        lambda: mode.combine(outputs, idx, w.double(), handle),
        lambda: mode.combine(outputs, idx, w, tuple(handle)),  # not a handle
    ]:
        try:
            bad()
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__)
    # The bad calls launched nothing: a good one still matches the reference. Its recv_count
    # ([E_local], not a view), overwritten by the caller, changes nothing the combine reads
    # (the handle's words share its allocation, past its end).
    recv_x, recv_count, handle, _ = mode.dispatch(x, idx, True)
    assert recv_count.shape == (mode.num_local_experts,) and recv_count._base is None
    counts = recv_count.clone()
    recv_count.fill_(-1)
    outputs = _expert_outputs(recv_x, True, me)
    combined, _ = mode.combine(outputs, idx, w, handle)
    mode.check()
    _verify_call(ctx, case, M, True, False, recv_x, counts, handle, outputs, combined)
    mode.destroy()
    return unchanged, errors, torch.equal(stats, counted) and bool(counted.sum() > 0)


def test_new_data_of_one_shape_and_bad_input_after_it(run_ranks):
    for unchanged, errors, stats_match in run_ranks(2, _same_shape_body):
        assert unchanged  # a later call's outputs are its own
        assert None not in errors, errors
        assert stats_match  # cumulative_local_expert_recv_stats: the sum of the counts
