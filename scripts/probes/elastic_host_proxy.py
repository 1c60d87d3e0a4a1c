"""The Python cost of eager ElasticBuffer calls, measured on CPU: launches stubbed after warm-up.

    PYTHONPATH=src python scripts/probes/elastic_host_proxy.py [--tokens 16] [--calls 300]
        [--repeats 5] [--hidden 256] [--experts 16] [--topk 4] [--profile 0]

On CPU ranks the interpreter runs the kernels, so their host time says nothing about a GPU.
Here one rank (gloo) makes each call once for real (the handle and the plans come from real
kernels), then every ``KernelLaunch`` is switched to a launcher that does nothing (the
device and stream queries answer without a GPU, as in ``ll_host_proxy.py``), and what is
timed is the Python a GPU call runs before its C launchers: checks, plans, allocations,
argument building. It prints the median and least microseconds of this thread's CPU time
per call over ``--repeats`` runs of ``--calls`` calls: cached dispatch, combine and
worst-case dispatch (``do_cpu_sync=False``), without and with the process-wide defaults
DeepEP's tests set. ``--profile N``: the N functions with the most own time, per call kind.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import warnings

import torch
from ll_host_proxy import _AnyKey, _defaults, _nothing, per_call_us


def _stub_every_launch() -> None:
    """Every ``KernelLaunch`` alive takes its compiled path to a launcher that does nothing."""
    from tritonep.kernels import launcher

    with warnings.catch_warnings():  # (isinstance on torch's deprecated aliases warns)
        warnings.simplefilter("ignore")
        launches = [o for o in gc.get_objects() if isinstance(o, launcher.KernelLaunch)]
    for obj in launches:
        obj.direct, obj.device, obj._hot = True, -1, None
        obj.compiled = _AnyKey(any=(_nothing, None, None, False, False, ()))
    torch._C._cuda_getDevice = lambda: -1
    torch._C._cuda_getCurrentRawStream = lambda device: 0


def _rank(ctx, args):
    import tritonep.deep_ep as deep_ep
    from tritonep.testing import route

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = route(gen, T, E, K, "random")
    w = torch.rand(T, K, generator=gen)
    buffer = deep_ep.ElasticBuffer(
        ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True
    )
    recv, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=E)
    calls = {
        "ElasticBuffer cached dispatch": lambda: buffer.dispatch(x, handle=handle),
        "ElasticBuffer combine": lambda: buffer.combine(recv, handle),
        "ElasticBuffer worst-case dispatch": lambda: buffer.dispatch(
            x, idx, w, num_experts=E, do_cpu_sync=False
        ),
    }
    for fn in calls.values():  # real kernels: every plan and variant made
        fn()
    _stub_every_launch()
    lines = [f"CPU, launches stubbed: {T} tokens, hidden {H}, {E} experts, top-{K}"]
    for defaults in (False, True):
        for name, fn in calls.items():
            with _defaults(defaults):
                for _ in range(20):
                    fn()
                median, least = per_call_us(fn, args.calls, args.repeats)
                label = f"{name} ({'with' if defaults else 'no'} defaults)"
                lines.append(f"{label:<56} {median:6.2f} us/call (least {least:6.2f})")
                if args.profile and not defaults:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.calls):
                        fn()
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
                    lines += out.getvalue().splitlines()[6:]
    return lines


if __name__ == "__main__":
    from tritonep.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--profile", type=int, default=0)
    args = p.parse_args()
    for line in spawn(_rank, 1, args, timeout=900)[0]:
        print(line)
