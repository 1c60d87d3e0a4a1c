"""The Python cost of an eager low-latency call, measured on CPU: kernels compiled, launch stubbed.

    PYTHONPATH=src python scripts/probes/ll_host_proxy.py [--tokens 128] [--calls 2000]
        [--repeats 7] [--hidden 256] [--experts 16] [--topk 8] [--profile 0]

On CPU ranks the interpreter runs the kernels, so host time there says nothing about a GPU.
This probe runs no kernel at all: every ``KernelLaunch`` believes it holds a compiled kernel
for any key (its launcher a no-op, the device and stream queries stand-ins), and every plan
has a launch of both phases, as on a GPU. What is timed is then the Python a GPU call runs
before its C launcher: checks, allocations, argument building, the launch's own lookups. The
outputs hold garbage; nothing reads them.

One rank (gloo). It prints the median (and least) microseconds of CPU time per call over
``--repeats`` runs of ``--calls`` back-to-back calls of ``deep_ep.Buffer.low_latency_dispatch``
(FP8, with ``cumulative_local_expert_recv_stats``) and ``low_latency_combine``, and of the
mode's own ``dispatch`` and ``combine``, without and with ``torch.set_default_device('cpu')`` and
``torch.set_default_dtype(torch.bfloat16)``. It runs on any tree with ``KernelLaunch``
(``PYTHONPATH=other/src`` to compare). ``--profile N``: the N functions with the most own time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import torch


class _AnyKey(dict):
    """A kept-kernel table that holds an entry for every key."""

    def get(self, key, default=None):
        return self["any"]


def _nothing(*args):
    return None


@contextlib.contextmanager
def stubbed_launches(run_for=lambda call_fields: _nothing):
    """Every ``KernelLaunch`` made inside takes its compiled path, to the launcher
    ``run_for(call_fields)`` (one that does nothing unless given); the device and stream
    queries answer without a GPU. ``scripts/probes/normal_host_proxy.py`` uses it too."""
    from tritonep.kernels import launcher

    init = launcher.KernelLaunch.__init__

    def stub_init(self, fn, grid, meta, call_fields, *args, **kwargs):
        init(self, fn, grid, meta, call_fields, *args, **kwargs)
        self.direct, self.device = True, -1
        self.compiled = _AnyKey(any=(run_for(call_fields), None, None, False, False, ()))

    queries = ("_cuda_getDevice", "_cuda_getCurrentRawStream")
    saved = {name: getattr(torch._C, name, None) for name in queries}
    launcher.KernelLaunch.__init__ = stub_init
    torch._C._cuda_getDevice = lambda: -1
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    try:
        yield
    finally:
        launcher.KernelLaunch.__init__ = init
        for name, fn in saved.items():
            if fn is None:
                delattr(torch._C, name)
            else:
                setattr(torch._C, name, fn)


@contextlib.contextmanager
def _stubbed_launches():
    """:func:`stubbed_launches`, and every low-latency plan has a launch of both phases."""
    from tritonep.modes.low_latency import LowLatencyMode

    plan = LowLatencyMode._plan

    def both_phases(self, *args, **kwargs):
        p = plan(self, *args, **kwargs)
        if p[0] is not None:
            return p
        return p._replace(both=p[1]) if hasattr(p, "_replace") else (p[1], *p[1:])

    LowLatencyMode._plan = both_phases
    try:
        with stubbed_launches():
            yield
    finally:
        LowLatencyMode._plan = plan


@contextlib.contextmanager
def _defaults(on: bool):
    """The process-wide defaults DeepEP's tests set (or nothing)."""
    if not on:
        yield
        return
    torch.set_default_device("cpu")
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


def per_call_us(fn, calls, repeats):
    """Median and least over ``repeats`` runs of the microseconds of this thread's CPU time
    per call (a shared CPU's other work left out)."""
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(runs), min(runs)


def _rank(ctx, args):
    import tritonep.deep_ep as deep_ep
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.testing import route

    device, R = ctx.device, ctx.world_size
    H, E, K, N = args.hidden, args.experts, args.topk, args.tokens
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    idx = route(gen, N, E, K, "random")
    w = torch.rand(N, K, generator=gen)
    stats = torch.zeros(E // R, dtype=torch.int32, device=device)
    lines = [f"CPU, launches stubbed: {N} tokens, hidden {H}, {E} experts, top-{K}"]
    with _stubbed_launches():
        buffer = deep_ep.Buffer(ctx.group, 0, LowLatencyMode.size_hint(N, H, R, E),
                                low_latency_mode=True)  # fmt: skip
        mode = LowLatencyMode(None, N, H, E, max_topk=K, device=device)
        state = {}

        def api_dispatch():
            state["api"] = buffer.low_latency_dispatch(
                x, idx, N, E, cumulative_local_expert_recv_stats=stats, use_fp8=True
            )

        def mode_dispatch():
            state["mode"] = mode.dispatch(x, idx, use_fp8=True, recv_stats=stats)

        api_dispatch()
        mode_dispatch()
        y = torch.zeros(state["api"][0][0].shape, dtype=torch.bfloat16)
        ops = [
            ("deep_ep.Buffer.low_latency_dispatch", api_dispatch),
            ("deep_ep.Buffer.low_latency_combine",
             lambda: buffer.low_latency_combine(y, idx, w, state["api"][2])),
            ("LowLatencyMode.dispatch", mode_dispatch),
            ("LowLatencyMode.combine", lambda: mode.combine(y, idx, w, state["mode"][2])),
        ]  # fmt: skip
        for _, fn in ops:
            fn()
        for defaults in (False, True):
            with _defaults(defaults):
                for name, fn in ops:
                    median, least = per_call_us(fn, args.calls, args.repeats)
                    label = f"{name} ({'with' if defaults else 'no'} defaults)"
                    lines.append(f"{label:58s} {median:6.2f} us/call (least {least:6.2f})")
                    if args.profile:
                        profiler = cProfile.Profile()
                        profiler.enable()
                        for _ in range(args.calls):
                            fn()
                        profiler.disable()
                        text = io.StringIO()
                        stats_ = pstats.Stats(profiler, stream=text)
                        stats_.sort_stats("tottime").print_stats(args.profile)
                        body = text.getvalue().splitlines()
                        start = next(i for i, t in enumerate(body) if "ncalls" in t)
                        lines.append("\n".join(body[start : start + args.profile + 1]))
        mode.destroy()
        buffer.destroy()
    return "\n".join(lines)


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0,
                        help="print the N functions with the most own time per op")  # fmt: skip
    args = parser.parse_args()
    print(spawn(_rank, 1, args, timeout=600)[0], flush=True)


if __name__ == "__main__":
    main()
