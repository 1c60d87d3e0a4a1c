"""The Python cost of eager normal-mode calls, measured on CPU: kernels compiled, launch stubbed.

    PYTHONPATH=src python scripts/probes/normal_host_proxy.py [--tokens 128] [--calls 1000]
        [--repeats 9] [--hidden 2048] [--experts 16] [--topk 8] [--only NAME] [--profile 0]

On CPU ranks the interpreter runs the kernels, so host time there says nothing about a GPU.
This probe runs no kernel at all: every ``KernelLaunch`` believes it holds a compiled kernel
for any key (its launcher a no-op, the device and stream queries stand-ins), except that the
notify kernel's stand-in writes a received count (every token, to this one rank) into its
``host_info`` output, so that an exact-size dispatch sizes its outputs as on a GPU. What is
timed is then the Python a GPU call runs before its C launchers: checks, allocations (CPU
ones: on a GPU each costs more, about 2 us), argument building, the launches' own lookups.
The outputs hold garbage; nothing reads them.

One rank (gloo). For each operation it prints the least and the median, over ``--repeats``
runs of ``--calls`` back-to-back calls, of the microseconds of this thread's CPU time per
call. Operations: ``NormalMode`` cached dispatch (BF16, FP8; with the same handle, and with a
handle not launched with before, as a training step's calls find theirs), worst-case and
exact-size first dispatches (layout given, as ``scripts/host_time.py --normal`` calls them), a
worst-case dispatch that computes its layout, combine (also with a new handle each call); then
the same through ``tritonep.deep_ep.Buffer``
(DeepEP's V1 interface, on CPU without its stream handling). It runs on any tree with
``KernelLaunch.launch_values`` (``PYTHONPATH=other/src`` to compare); compare trees with
interleaved runs, the least of each. ``--profile N``: the N functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats

import torch

# The launch stubs and the timing of ll_host_proxy.py (this script's folder is on sys.path).
from ll_host_proxy import per_call_us, stubbed_launches

#: Leading arguments of a compiled kernel's C launcher before the kernel's own.
_LAUNCHER_ARGS = 13


def _notify_stand_in(host_info: int, tokens: int, state: int):
    """A launcher for notify that writes the received count into ``host_info``: every token
    (one rank); and, where the mode keeps host words for it (their address in the state's
    last word), into them, then their flag."""

    def run(*args):
        count = args[_LAUNCHER_ARGS + tokens]
        ctypes.c_int32.from_address(args[_LAUNCHER_ARGS + host_info]).value = count
        host = ctypes.c_int64.from_address(args[_LAUNCHER_ARGS + state] + 7 * 8).value
        if host:
            ctypes.c_int32.from_address(host + 4).value = count
            ctypes.c_int32.from_address(host).value = 1

    return run


def _stand_in(call_fields):
    """Each launch's stand-in: notify's writes its count, the others do nothing."""
    from tritonep.kernels.normal_dispatch import NormalShared
    from tritonep.kernels.normal_notify import NotifyCall

    if tuple(call_fields) == NotifyCall._fields:
        state = len(call_fields) + NormalShared._fields.index("state_ptr")
        return _notify_stand_in(
            call_fields.index("host_info_ptr"), call_fields.index("num_tokens"), state
        )
    return lambda *args: None


def _ops(ctx, args):
    """(name, call) of every operation timed, made once their first calls ran."""
    import tritonep.deep_ep as deep_ep
    from tritonep.modes.normal import NormalMode
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    R = ctx.world_size
    H, E, K, N = args.hidden, args.experts, args.topk, args.tokens
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    idx = route(gen, N, E, K, "random")
    w = torch.rand(N, K, generator=gen)
    x8 = quantize_fp8(x)
    # 12 channels, as the GPU default (24 SMs): the same alignments of the count tensors.
    mode = NormalMode(ctx.group, H, E, max_topk=K, device=ctx.device, max_sms=24)
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    out = mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=N * R)
    y = out.recv_x.clone()
    worst = N * R
    # A training step uses each handle once or twice: a combine or a cached dispatch of a
    # handle it has not launched with yet (each takes the next of these).
    fresh = [
        mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=N * R).handle
        for _ in range(2 * (args.calls * args.repeats + 1))
    ]
    to_combine, to_dispatch = iter(fresh[::2]), iter(fresh[1::2])
    ops = [
        ("NormalMode cached dispatch", lambda: mode.dispatch(x, handle=out.handle)),
        ("NormalMode cached dispatch, a new handle",
         lambda: mode.dispatch(x, handle=next(to_dispatch))),
        ("NormalMode combine, a new handle", lambda: mode.combine(y, next(to_combine))),
        ("NormalMode cached dispatch FP8", lambda: mode.dispatch(x8, handle=out.handle)),
        ("NormalMode worst-case dispatch",
         lambda: mode.dispatch(x, idx, w, per_expert, in_rank, num_worst_tokens=worst)),
        ("NormalMode exact-size dispatch",
         lambda: mode.dispatch(x, idx, w, per_expert, in_rank)),
        ("NormalMode worst-case dispatch, layout inside",
         lambda: mode.dispatch(x, idx, w, num_worst_tokens=worst)),
        ("NormalMode combine", lambda: mode.combine(y, out.handle)),
        ("NormalMode get_dispatch_layout", lambda: mode.get_dispatch_layout(idx)),
    ]  # fmt: skip
    buffer = deep_ep.Buffer(ctx.group, 1 << 20, 0)
    per_rank, _, per_expert_b, in_rank_b, _ = buffer.get_dispatch_layout(idx, E)
    first = buffer.dispatch(x, None, per_rank, None, in_rank_b, per_expert_b, idx, w)
    handle = first[4]
    yb = first[0].clone()
    ops += [
        ("deep_ep.Buffer cached dispatch", lambda: buffer.dispatch(x, handle)),
        ("deep_ep.Buffer worst-case dispatch",
         lambda: buffer.dispatch(x, None, per_rank, None, in_rank_b, per_expert_b, idx, w,
                                 num_worst_tokens=worst)),
        ("deep_ep.Buffer exact-size dispatch",
         lambda: buffer.dispatch(x, None, per_rank, None, in_rank_b, per_expert_b, idx, w)),
        ("deep_ep.Buffer combine", lambda: buffer.combine(yb, handle)),
        ("deep_ep.Buffer get_dispatch_layout", lambda: buffer.get_dispatch_layout(idx, E)),
    ]  # fmt: skip
    return ops, (mode, buffer)


def _rank(ctx, args):
    H, E, K, N = args.hidden, args.experts, args.topk, args.tokens
    lines = [f"CPU, launches stubbed: {N} tokens, hidden {H}, {E} experts, top-{K}"]
    with stubbed_launches(_stand_in):
        ops, owners = _ops(ctx, args)
        ops = [(name, fn) for name, fn in ops if args.only is None or args.only in name]
        for _, fn in ops:
            fn()
        for name, fn in ops:
            median, least = per_call_us(fn, args.calls, args.repeats)
            lines.append(f"{name:48s} least {least:6.2f} median {median:6.2f} us/call")
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    fn()
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
                body = text.getvalue().splitlines()
                start = next(i for i, t in enumerate(body) if "ncalls" in t)
                lines.append("\n".join(body[start : start + args.profile + 1]))
        for owner in owners:
            owner.destroy()
    return "\n".join(lines)


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--only", help="time only the operations whose name holds this")
    parser.add_argument("--profile", type=int, default=0,
                        help="print the N functions with the most own time per op")  # fmt: skip
    args = parser.parse_args()
    print(spawn(_rank, 1, args, timeout=900)[0], flush=True)


if __name__ == "__main__":
    main()
