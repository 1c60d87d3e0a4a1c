"""Where the buffers' calls run: synchronous calls on the caller's stream with no stream or
event work, asynchronous ones on the communication stream, every call after the last.

The CPU tests drive :class:`tritonep.buffer.CallStreams` with stand-in streams and events that
log every operation; the GPU tests count the real operations inside ``deep_ep.Buffer`` and
``deep_ep.ElasticBuffer`` calls and check their outputs on the default stream, on a stream of
the caller's, with events and in a CUDA graph.
"""

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import tritonep.deep_ep as deep_ep
from tests.conftest import gpu_ranks
from tests.test_normal import _combine_input, _verify
from tritonep.buffer import CallStreams
from tritonep.testing import make_case, static_inputs, tag_rows

# --------------------------------------------------------------------- CPU: stand-ins


class _World:
    """Stand-ins for torch.cuda's streams and events; ``log`` lists what was done."""

    def __init__(self):
        self.log: list[tuple] = []
        self.capturing = False
        ids = itertools.count(100)
        world = self

        class Event:
            def __init__(self, *args, **kwargs):
                self.name = f"event{next(ids)}"

            def record(self, stream=None):
                world.log.append(("record", self.name, (stream or world.current).cuda_stream))

        class Stream:
            def __init__(self, device=None, raw=None):
                self.cuda_stream = raw if raw is not None else next(ids)
                self.device = device

            def wait_event(self, event):
                world.log.append(("wait_event", self.cuda_stream, event.name))

            def wait_stream(self, other):
                world.log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

        self.Event, self.Stream = Event, Stream
        self.current = Stream(0, raw=7)

    @contextlib.contextmanager
    def stream(self, s):
        saved, self.current = self.current, s
        self.log.append(("enter", s.cuda_stream))
        try:
            yield
        finally:
            self.current = saved


@pytest.fixture
def world(monkeypatch):
    w = _World()
    monkeypatch.setattr(torch.cuda, "Event", w.Event)
    monkeypatch.setattr(torch.cuda, "Stream", w.Stream)
    monkeypatch.setattr(torch.cuda, "stream", w.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: w.current)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: w.capturing)
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda device: w.current.cuda_stream, raising=False
    )
    monkeypatch.setattr(
        torch.Tensor,
        "record_stream",
        lambda t, s: w.log.append(("record_stream", int(t.flatten()[0]), s.cuda_stream)),
    )
    return w


def test_synchronous_calls_on_one_stream_do_no_stream_work(world):
    streams = CallStreams()
    for _ in range(3):
        streams.on_current(0, None)
    assert world.log == []
    event = world.Event()
    streams.on_current(0, SimpleNamespace(event=event))  # an EventOverlap, say
    assert world.log == [("wait_event", 7, event.name)]


def test_a_call_from_another_stream_waits_for_the_last_calls_stream(world):
    streams = CallStreams()
    streams.on_current(0, None)
    world.current = world.Stream(0, raw=9)
    streams.on_current(0, None)
    streams.on_current(0, None)
    assert world.log == [("wait_stream", 9, 7)]
    streams.join()  # already on the last call's stream
    world.current = world.Stream(0, raw=11)
    streams.join()  # e.g. check(): reads what the kernels wrote
    assert world.log[1:] == [("wait_stream", 11, 9)]


def test_capture_waits_for_no_stream_outside_it(world):
    streams = CallStreams()
    streams.on_current(0, None)
    world.current, world.capturing = world.Stream(0, raw=9), True
    streams.on_current(0, None)
    assert world.log == []
    world.current, world.capturing = world.Stream(0, raw=7), False
    streams.on_current(0, None)  # after the capture: follows the captured stream's calls
    assert world.log == [("wait_stream", 7, 9)]


def test_asynchronous_calls_fork_record_and_join(world):
    streams = CallStreams()
    inputs = (torch.tensor([1]), None, (torch.tensor([2]),))
    result, compute = streams.on_comm(0, None, inputs, lambda: "out")
    assert result == "out" and compute is world.current
    comm = streams.comm.cuda_stream
    fork = world.log[0][1]
    assert world.log == [
        ("record", fork, 7),
        ("wait_event", comm, fork),
        ("record_stream", 1, comm),
        ("record_stream", 2, comm),
        ("enter", comm),
    ]
    world.log.clear()
    event = streams.finish(compute, True, (torch.tensor([3]),))
    assert world.log == [("record_stream", 3, 7), ("record", event.event.name, comm)]
    world.log.clear()
    # The next synchronous call, on the caller's stream, follows the communication stream.
    streams.on_current(0, None)
    assert world.log == [("wait_stream", 7, comm)]


def test_an_asynchronous_call_after_previous_event_still_follows_the_last_call(world):
    streams = CallStreams()
    streams.on_current(0, None)  # a call on stream 7
    event = world.Event()
    streams.on_comm(0, SimpleNamespace(event=event), (), lambda: None)
    comm = streams.comm.cuda_stream
    # It waits for the event (not for stream 7's later work), and for the last call.
    assert world.log == [
        ("wait_event", comm, event.name),
        ("wait_stream", comm, 7),
        ("enter", comm),
    ]


def test_inputs_stay_in_use_when_the_call_raises_after_its_launches(world):
    streams = CallStreams()

    def raises():
        raise ValueError("an error an earlier call recorded")

    with pytest.raises(ValueError, match="earlier call"):
        streams.on_comm(0, None, (torch.tensor([5]),), raises)
    comm = streams.comm.cuda_stream
    assert ("record_stream", 5, comm) in world.log
    assert world.current.cuda_stream == 7  # the caller's stream is current again
    world.log.clear()
    streams.on_current(0, None)
    assert world.log == [("wait_stream", 7, comm)]


# --------------------------------------------------------------------------------- GPU

#: (class, method) pairs whose calls count as stream or event work.
_STREAM_WORK = (
    (torch.cuda.Event, "record"),
    (torch.cuda.Stream, "wait_event"),
    (torch.cuda.Stream, "wait_stream"),
    (torch.Tensor, "record_stream"),
)


@contextlib.contextmanager
def _counting_stream_work(counts: dict):
    """Counts the stream and event operations (and stream switches) made inside."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _STREAM_WORK]
    switch = torch.cuda.stream

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    for owner, name, fn in saved:
        setattr(owner, name, counted(name, fn))
    torch.cuda.stream = counted("stream", switch)
    try:
        yield counts
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        torch.cuda.stream = switch


def _v1_streams_body(ctx):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    N, H, E, K = 64, 512, 4 * R, 3
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, 0)

    def calls(x, idx, w, **flags):
        """Layout, dispatch and combine; returns the dispatch's outputs and the combine's."""
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            x, None, per_rank, None, in_rank, per_expert, idx, w, **flags
        )
        assert (event.event is not None) == bool(flags.get("async_finish"))
        if event.event is not None:
            event.current_stream_wait()
        if flags.get("num_worst_tokens"):
            assert counts == []  # DeepEP's return: the counts stay on the device
            counts = handle.host_info[1:]
        out = SimpleNamespace(
            recv_x=recv_x,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_tokens_per_expert=counts,
            handle=handle,
        )
        combine_flags = {k: v for k, v in flags.items() if k != "num_worst_tokens"}
        combined, combined_w, event = buffer.combine(
            _combine_input(out, me), handle, recv_w, **combine_flags
        )
        if event.event is not None:
            event.current_stream_wait()
        return out, combined, combined_w

    def step(seed, **flags):
        """:func:`calls` on a fresh case; returns the case too."""
        case = tag_rows(make_case(seed, [N] * R, H, E, K, "dropped"))
        x, idx, w = (t[me].to(dev) for t in (case.x, case.topk_idx, case.topk_weights))
        return case, *calls(x, idx, w, **flags)

    def check(case, out, combined, combined_w, worst=0):
        _verify(ctx, case, list(case.x), out, combined, combined_w, E, 1, worst, False)

    check(*step(1))  # compiles, and makes the mode
    # Synchronous calls on the stream of the last call: no stream or event work at all.
    with _counting_stream_work({}) as counts:
        outputs = step(2)
    assert counts == {}, counts
    check(*outputs)
    # On a stream of the caller's: the first call waits for the last one's stream, once.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with _counting_stream_work({}) as counts:
            outputs = step(3)
        assert counts.get("wait_stream") == 1 and "record_stream" not in counts, counts
        assert "stream" not in counts, counts
        check(*outputs)
        with _counting_stream_work({}) as counts:
            outputs = step(4)
        assert counts == {}, counts
        check(*outputs)
    torch.cuda.current_stream().wait_stream(side)
    # async_finish and allocate_on_comm_stream: the communication stream and its events.
    with _counting_stream_work({}) as counts:
        outputs = step(5, async_finish=True, previous_event=deep_ep.Buffer.capture())
    assert counts.get("stream") == 2 and counts.get("record_stream", 0) > 0, counts
    check(*outputs)
    check(*step(6, allocate_on_comm_stream=True))
    # An asynchronous cached dispatch, then a synchronous one on the caller's stream before
    # waiting for the first's event: the buffer still runs them one after the other.
    case, out, _, _ = step(7)
    first = tag_rows(make_case(8, [N] * R, H, E, K, "dropped"))
    second = tag_rows(make_case(9, [N] * R, H, E, K, "dropped"))
    early = buffer.dispatch(first.x[me].to(dev), out.handle, async_finish=True)
    late = buffer.dispatch(second.x[me].to(dev), out.handle)
    early[-1].current_stream_wait()
    for got, new in ((early[0], first), (late[0], second)):
        moved = buffer.dispatch(new.x[me].to(dev), out.handle)[0]  # alone, in stream order
        assert torch.equal(got, moved)
    # A CUDA graph captured on torch's capture stream after eager calls on this one.
    x, idx, w = static_inputs(N, H, K, dev)
    worst = N * R
    tag_rows(make_case(10, [N] * R, H, E, K, "dropped")).copy_to(me, x, idx, w)
    calls(x, idx, w, num_worst_tokens=worst)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls(x, idx, w, num_worst_tokens=worst)
    for seed in (11, 12):
        case = tag_rows(make_case(seed, [N] * R, H, E, K, "dropped")).copy_to(me, x, idx, w)
        graph.replay()
        torch.cuda.synchronize()
        check(case, *captured, worst=worst)
    # Eager again after the capture: the calls follow the captured stream's.
    check(*step(13))
    buffer.destroy()
    return True


@pytest.mark.gpu(n=1)
def test_deep_ep_buffer_streams_on_gpus(run_ranks):
    n = gpu_ranks()
    assert run_ranks(n, _v1_streams_body, timeout=600) == [True] * n


def _v2_streams_body(ctx):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    N, H, E, K = 64, 512, 4 * R, 3
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=N, hidden=H, num_topk=K
    )
    case = make_case(21, [N] * R, H, E, K, "dropped")
    x, idx, w = (t[me].to(dev) for t in (case.x, case.topk_idx, case.topk_weights))

    def step(**flags):
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(x, idx, w, num_experts=E, **flags)
        if event.event is not None:
            event.current_stream_wait()
        out, out_w, event = buffer.combine(recv_x * 2, handle, recv_w, **flags)
        if event.event is not None:
            event.current_stream_wait()
        return recv_x, recv_idx, recv_w, handle.recv_src_metadata, out, out_w

    want = step()  # on the default stream, as the other tests check it

    def same(got):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    with _counting_stream_work({}) as counts:
        got = step()
    assert counts == {}, counts
    same(got)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with _counting_stream_work({}) as counts:
            got = step()
        assert counts.get("wait_stream") == 1 and "record_stream" not in counts, counts
        same(got)
        with _counting_stream_work({}) as counts:
            got = step()
        assert counts == {}, counts
        same(got)
    torch.cuda.current_stream().wait_stream(side)
    with _counting_stream_work({}) as counts:
        got = step(
            previous_event=buffer.capture(),
            async_with_compute_stream=True,
            allocate_on_comm_stream=True,
        )
    assert counts.get("stream", 0) >= 2 and counts.get("record_stream", 0) > 0, counts
    same(got)
    buffer.barrier()
    buffer.check()
    buffer.destroy()
    return True


@pytest.mark.gpu(n=1)
def test_elastic_buffer_streams_on_gpus(run_ranks):
    n = gpu_ranks()
    assert run_ranks(n, _v2_streams_body, timeout=600) == [True] * n
