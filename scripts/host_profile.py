"""Where the host time of an eager call goes: cProfile over many calls of each operation.

    PYTHONPATH=src python scripts/host_profile.py [--tokens 512] [--calls 200] [--top 18]

One rank (GPU 0, or a CPU rank under the interpreter, where it means little). For each of
normal cached dispatch, normal combine, normal full dispatch, low-latency dispatch and
low-latency combine it prints the host time per call (wall clock of the calls issued back to
back, then one device sync) beside the device time of the same call replayed from a CUDA graph
where it can be, and the functions with the most own time under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def _profile(name, fn, calls, top):
    for _ in range(5):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"\n=== {name}: {issued / calls * 1e6:.1f} us/call issued, "
          f"{total / calls * 1e6:.1f} us/call with the final sync")  # fmt: skip
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    print("\n".join(lines[start : start + top + 1]))


def _rank(ctx, tokens, calls, top):
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.modes.normal import NormalMode
    from tritonep.testing import route

    hidden, experts, topk = (7168, 256, 8) if ctx.device.type == "cuda" else (256, 16, 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, tokens, experts, topk, "random").to(ctx.device)
    w = torch.rand(tokens, topk, generator=gen).to(ctx.device)

    mode = NormalMode(None, hidden, experts, max_topk=topk, device=ctx.device, check_ids=False)
    config = mode.default_config
    _, per_expert, in_rank = mode.get_dispatch_layout(idx)
    out = mode.dispatch(x, idx, w, per_expert, in_rank, config=config)
    y = out.recv_x.clone()
    _profile("normal cached dispatch", lambda: mode.dispatch(x, handle=out.handle), calls, top)
    _profile("normal combine", lambda: mode.combine(y, out.handle), calls, top)
    _profile("normal full dispatch",
             lambda: mode.dispatch(x, idx, w, per_expert, in_rank, config=config), calls, top)
    mode.check()
    mode.destroy()

    ll = LowLatencyMode(None, tokens, hidden, experts, max_topk=topk, device=ctx.device,
                        check_ids=False)  # fmt: skip
    state = {}

    def ll_dispatch():
        state["d"] = ll.dispatch(x, idx)

    ll_dispatch()
    expert_out = torch.zeros(state["d"][0][0].shape, dtype=torch.bfloat16, device=ctx.device)
    _profile("low-latency dispatch", ll_dispatch, calls, top)
    handle = state["d"][2]
    _profile("low-latency combine", lambda: ll.combine(expert_out, idx, w, handle), calls, top)
    ll.destroy()


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    spawn(_rank, 1, args.tokens, args.calls, args.top, timeout=600)


if __name__ == "__main__":
    main()
