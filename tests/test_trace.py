"""Kernel traces and wait statistics on CPU ranks (the interpreter's logical clock).

The trace of every rank must hold, for every program that ran, the send and receive slices of
each call, in order, with the kernel's sub-phases inside them; the JSON must be what Perfetto
reads (``traceEvents`` of complete events). Wait statistics must name every source rank.
"""

import json

import pytest
import torch

from tests.conftest import machine_gpus
from tritonep import Buffer
from tritonep.integrations import EPLowLatencyAllToAllLayer
from tritonep.modes.trace import PHASES
from tritonep.testing import make_case

TOKENS = [6, 0, 5]  # per rank


def _trace_body(ctx, tmp):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, hidden, experts, topk = TOKENS[:R], 256, 4 * R, 3
    layer = EPLowLatencyAllToAllLayer(
        max(tokens), hidden, topk, True, me, experts, R, R, enable_profiling=True
    )
    for call in range(2):
        case = make_case(call, tokens, hidden, experts, topk)
        idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
        recv, _, _, meta = layer.dispatch(case.x[me].to(dev), None, idx)
        y = torch.ones(recv.shape, dtype=torch.bfloat16, device=dev)
        layer.combine(y, idx, w, meta)
    paths = [
        layer.dump_dispatch_trace(f"{tmp}/dispatch-{{rank}}.json"),
        layer.dump_combine_trace(f"{tmp}/combine-{{rank}}.json"),
    ]
    layer.finalize()
    return paths


# Traces hold microseconds as floats with nanosecond digits; their sums round.
ROUNDING_US = 1e-6


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_traces_show_every_phase_in_order(run_ranks, num_ranks, tmp_path):
    results = run_ranks(num_ranks, _trace_body, str(tmp_path))
    seen = {"low-latency dispatch": set(), "low-latency combine": set()}
    for rank, paths in enumerate(results):
        for path, kernel in zip(
            paths, ["low-latency dispatch", "low-latency combine"], strict=True
        ):
            assert path == f"{tmp_path}/{kernel.split()[1]}-{rank}.json"
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            slices = [e for e in events if e["ph"] == "X"]
            assert all(e["pid"] == rank and e["dur"] >= 0 for e in slices)
            # On GPUs every slice names the SM its program ran on; CPU ranks have none.
            for e in slices:
                if machine_gpus():
                    assert 0 <= e["args"]["sm"] < 1024, e
                else:
                    assert "sm" not in e["args"], e
            (_, send_names), (_, recv_names) = PHASES[kernel]
            names = {e["name"] for e in slices}
            assert {f"{kernel}: send", f"{kernel}: receive"} <= names
            seen[kernel] |= names
            # A phase with no work (a rank without tokens sends nothing in dispatch and sums
            # nothing in combine) may take less than one tick of a GPU's timer, and a slice of
            # zero time is left out; the logical clock of CPU ranks always advances.
            idle = {"send"} if kernel.endswith("dispatch") else {"receive"}
            optional = idle if machine_gpus() and TOKENS[rank] == 0 else set()
            for call in (0, 1):
                for program in {e["tid"] for e in slices}:
                    mine = [e for e in slices if e["tid"] == program and e["args"]["call"] == call]
                    envelopes = {e["name"].split(": ")[1]: e for e in mine if ": " in e["name"]}
                    assert {"send", "receive"} - optional <= set(envelopes), (rank, program)
                    send, recv = envelopes.get("send"), envelopes.get("receive")
                    if send and recv:  # send first
                        assert send["ts"] + send["dur"] <= recv["ts"] + ROUNDING_US
                    for e in mine:
                        if e["name"] in send_names:
                            parent = send
                        elif e["name"] in recv_names:
                            parent = recv
                        else:
                            continue
                        assert parent is not None, (rank, program, e["name"])
                        assert parent["ts"] <= e["ts"] + ROUNDING_US
                        assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + ROUNDING_US
    # Every sub-phase shows on some rank. Not necessarily on each: a rank without tokens
    # reduces nothing, which on a GPU can take less than one tick of its timer, and a slice
    # of zero time is left out (seen on an H100 for the combine's reduce).
    for kernel, names in seen.items():
        (_, send_names), (_, recv_names) = PHASES[kernel]
        assert set(send_names) | set(recv_names) <= names, kernel


def _stats_body(ctx):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, hidden, experts, topk = [4, 3, 0][:R], 128, 2 * R, 2
    case = make_case(5, tokens, hidden, experts, topk)
    buffer = Buffer(device=dev)
    idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    dispatch_waits = torch.zeros(R, dtype=torch.int64, device=dev)
    combine_waits = torch.zeros(R, dtype=torch.int64, device=dev)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(
        case.x[me].to(dev),
        idx,
        max(tokens),
        experts,
        use_fp8=False,
        dispatch_wait_recv_cost_stats=dispatch_waits,
    )
    buffer.low_latency_combine(recv, idx, w, handle, combine_wait_recv_cost_stats=combine_waits)
    with pytest.raises(ValueError, match="wait_stats"):
        buffer.low_latency_combine(
            recv, idx, w, handle, combine_wait_recv_cost_stats=dispatch_waits[:1]
        )
    buffer.check()
    buffer.destroy()
    return dispatch_waits.tolist(), combine_waits.tolist()


def test_wait_statistics_cover_every_source_rank(run_ranks):
    results = run_ranks(3, _stats_body)
    for dispatch_waits, combine_waits in results:
        assert all(v > 0 for v in dispatch_waits), dispatch_waits
        # Combine receivers wait for every source, the rank without tokens too (its wait keeps
        # it within a call of its peers).
        assert all(v > 0 for v in combine_waits), combine_waits


def _dispatch_and_combine(buffer, case, me, dev, experts):
    """One normal-mode dispatch (layout first) and combine of rank ``me``'s part of ``case``;
    returns its input rows, ids and the dispatch handle."""
    x, idx, w = case.x[me].to(dev), case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    _, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_tokens_per_expert=per_expert,
        is_token_in_rank=in_rank,
    )
    buffer.combine(recv_x, handle)
    return x, idx, handle


def _buffer_trace_body(ctx, tmp):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, hidden, experts, topk = [5, 3, 0][:R], 128, 2 * R, 2
    case = make_case(7, tokens, hidden, experts, topk)
    buffer = Buffer(device=dev, profile=True)
    x, idx, _ = _dispatch_and_combine(buffer, case, me, dev, experts)
    buffer.low_latency_dispatch(x, idx, max(tokens), experts)
    path = buffer.dump_trace(f"{tmp}/buffer-{{rank}}.json")
    buffer.destroy()
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]


def test_buffer_traces_both_modes_on_one_time_axis(run_ranks, tmp_path):
    for events in run_ranks(2, _buffer_trace_body, str(tmp_path)):
        names = [e["name"] for e in events]
        for name in [
            "normal notify: notify",
            "normal dispatch: send",
            "normal dispatch: receive",
            "normal combine: send",
            "normal combine: receive",
            "copy",
            "reduce",
            "low-latency dispatch: send",
            "quantize and send",
        ]:
            assert name in names, name
        # A normal-mode program's span is split into the time it waited and the rest, laid
        # end to end inside it: their durations add up to the span's.
        spans = {}
        for e in events:
            key = (e["args"]["kernel"], e["args"]["call"], e["tid"])
            if ": " in e["name"]:
                spans[key] = e
        for key, span in spans.items():
            if not key[0].startswith("normal") or key[0] == "normal notify":
                continue
            subs = [
                e
                for e in events
                if ": " not in e["name"]
                and (e["args"]["kernel"], e["args"]["call"], e["tid"]) == key
            ]
            assert {e["name"] for e in subs} <= {"wait", "copy", "reduce"}, key
            assert subs, key
            assert abs(sum(e["dur"] for e in subs) - span["dur"]) <= ROUNDING_US, key
            assert all(span["ts"] <= e["ts"] + ROUNDING_US for e in subs), key
        first = {}
        for e in events:
            first.setdefault(e["name"].split(":")[0], e["ts"])
        # Calls appear in the order they were made.
        order = ["normal notify", "normal dispatch", "normal combine", "low-latency dispatch"]
        assert [first[k] for k in order] == sorted(first[k] for k in order)


def _cleared_trace_body(ctx, tmp):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, hidden, experts, topk = [5, 3][:R], 128, 2 * R, 2
    case = make_case(8, tokens, hidden, experts, topk)
    buffer = Buffer(device=dev, profile=True)
    buffer.clear_trace()  # before any call: nothing to drop
    x, _, handle = _dispatch_and_combine(buffer, case, me, dev, experts)
    buffer.check()
    buffer.clear_trace()
    buffer.dispatch(x, handle=handle)
    path = buffer.dump_trace(f"{tmp}/cleared-{{rank}}.json")
    buffer.destroy()
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]


def test_cleared_traces_keep_only_later_calls(run_ranks, tmp_path):
    """What ``bench --trace`` relies on to drop its warm-up call: after ``clear_trace`` the
    file holds the cached dispatch made since, and no earlier launch."""
    for events in run_ranks(2, _cleared_trace_body, str(tmp_path)):
        kernels = {e["args"]["kernel"] for e in events}
        assert kernels == {"normal dispatch"}, kernels
        # One call, numbered as the kernel's second (numbers keep counting across a clear).
        assert {e["args"]["call"] for e in events} == {1}


def _elastic_calls(buffer, x, idx, w, experts):
    """An exact-size plain dispatch and combine, then a decode-shaped one (expanded, worst-case
    sizes, no host read): every output on the host (of the expanded layout, the rows the
    handle names: the others are never written)."""
    outs = []
    for expand, sync in ((False, True), (True, False)):
        recv, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x, idx, w, num_experts=experts, do_expand=expand, do_cpu_sync=sync
        )
        y = torch.ones(recv[0].shape, dtype=torch.bfloat16, device=recv[0].device)
        combined, combined_w, _ = buffer.combine(y, handle, recv_w)
        meta = handle.recv_src_metadata.cpu()
        if expand:
            rows = meta[:, 2:][meta[:, 2:] >= 0].long()
            recv, recv_w = tuple(t.cpu()[rows] for t in recv), recv_w.cpu()[rows]
        outs += [recv, recv_idx, recv_w, combined, combined_w, meta]
        outs.append(handle.psum_num_recv_tokens_per_expert)
    flat = [t for o in outs for t in (o if isinstance(o, tuple) else (o,)) if t is not None]
    return [t.cpu() for t in flat]


def _elastic_trace_body(ctx, tmp):
    import tritonep.deep_ep as deep_ep
    from tritonep import quantize_fp8
    from tritonep.modes.trace import TraceRecorder

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, hidden, experts, topk = TOKENS[:R], 256, 4 * R, 3
    case = make_case(3, tokens, hidden, experts, topk)
    x = tuple(t.to(dev) for t in quantize_fp8(case.x[me]))
    idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    buffer = deep_ep.ElasticBuffer(
        ctx.group, num_max_tokens_per_rank=max(tokens), hidden=hidden, num_topk=topk
    )
    untraced = _elastic_calls(buffer, x, idx, w, experts)
    buffer.runtime.trace = TraceRecorder.of(True, me, buffer.runtime.device, False)
    traced = _elastic_calls(buffer, x, idx, w, experts)
    buffer.runtime.check()
    path = buffer.runtime.trace.dump(f"{tmp}/elastic-{me}.json")
    tables = {k: trace_tables(buffer.runtime.trace, k) for k in ELASTIC}
    buffer.destroy()
    same = [torch.equal(a, b) for a, b in zip(untraced, traced, strict=True)]
    with open(path) as f:
        return same, [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"], tables


ELASTIC = ("elastic dispatch", "elastic dispatch epilogue", "elastic combine")
ELASTIC += ("elastic combine epilogue",)


def trace_tables(recorder, kernel):
    """Per launch of ``kernel``: ``[P, SLOTS]`` readings, as lists."""
    from tritonep.modes.trace import SLOTS

    return [
        lc.readings[:-1].view(-1, SLOTS).tolist() for lc in recorder.launches if lc.kernel == kernel
    ]


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_elastic_traces_show_every_phase_in_order(run_ranks, num_ranks, tmp_path):
    from tritonep.modes.trace import END, FIRST_PHASE, SEND_END, START

    for same, slices, tables in run_ranks(num_ranks, _elastic_trace_body, str(tmp_path)):
        # Traced calls return what untraced ones do, every output.
        assert same and all(same), [i for i, s in enumerate(same) if not s]
        for kernel in ELASTIC:
            (send, send_subs), (recv, recv_subs) = PHASES[kernel]
            launches = tables[kernel]
            assert len(launches) == 2, kernel  # two calls, one launch each
            for call, table in enumerate(launches):
                for program, row in enumerate(table):
                    # Every program ran both phases, in order (the logical clock always
                    # advances), its sub-phases within their phase.
                    assert row[START] < row[SEND_END] < row[END], (kernel, call, program)
                    subs = row[FIRST_PHASE : FIRST_PHASE + len(send_subs) + len(recv_subs)]
                    assert all(v >= 0 for v in subs), (kernel, program, row)
                    assert sum(subs[: len(send_subs)]) <= row[SEND_END] - row[START]
                    assert sum(subs[len(send_subs) :]) <= row[END] - row[SEND_END]
                    if send_subs:
                        assert all(v > 0 for v in subs[: len(send_subs)]), (kernel, row)
                mine = [s for s in slices if s["args"]["kernel"] == kernel]
                names = {s["name"] for s in mine if s["args"]["call"] == call}
                assert {f"{kernel}: {send}", f"{kernel}: {recv}"} <= names, (kernel, names)
            if kernel.endswith("epilogue"):
                continue
            # In each push exactly one program (the last to arrive) exchanged: it sent the
            # headers (or the tag), then waited, and ended after every other program.
            for table in launches:
                # The sub-phases after the arrive: headers (or tag) and wait.
                at = FIRST_PHASE + len(send_subs) + 1
                extra = [row[at : at + 2] for row in table]
                exchanged = [p for p, (sent, waited) in enumerate(extra) if sent > 0 and waited > 0]
                assert len(exchanged) == 1, extra
                assert table[exchanged[0]][END] == max(row[END] for row in table)
        # A call's launches in order: the push's exchange ends before its epilogue starts
        # (CPU ranks: no programmatic dependent launch), the dispatch before the combine.
        order = [tables[k] for k in ELASTIC]
        for call in range(2):
            ends = [max(r[END] for r in t[call]) for t in order]
            starts = [min(r[START] for r in t[call]) for t in order]
            assert all(ends[i] < starts[i + 1] for i in range(3)), (ends, starts)
