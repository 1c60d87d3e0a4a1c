"""Which side of a normal-mode channel sets the pace: senders or receivers.

    PYTHONPATH=src python scripts/probes/normal_probe.py [--ranks 1] [--tokens 4096]
        [--rings 128,512] [--chunks 16] [--launch NAME=VALUE ...]

For each ring size and send chunk, times cached BF16 dispatch, FP8 dispatch and combine
(CUDA events: the median of eager calls, and per call of CUDA-graph replays, the device time)
and then runs a few traced calls of each, printing per kernel the median and slowest program
of the sender and the receiver role and the launch's span. With a ring larger than a
channel's tokens a sender never waits for its receiver, so its time is its own speed; if the
receivers then finish much later, they are the limit.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def _rank(ctx, opts):
    from tritonep.bench.timing import median_ms, time_graph
    from tritonep.bench.traced import summarize
    from tritonep.modes import normal
    from tritonep.modes.normal import Config, NormalMode
    from tritonep.modes.trace import TraceRecorder
    from tritonep.reference.fp8 import quantize_fp8
    from tritonep.testing import route

    if opts.launch:
        normal.set_launch_constants(**opts.launch)
    H, E, K, N = opts.hidden, 256, 8, opts.tokens
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, N, E, K, "random").to(ctx.device)
    w = torch.rand(N, K, generator=gen).to(ctx.device)
    x_fp8 = tuple(t.to(ctx.device) for t in quantize_fp8(x.cpu()))
    recorder = TraceRecorder(ctx.rank, ctx.device, 1e-3)
    mode = NormalMode(None, H, E, max_topk=K, device=ctx.device, check_ids=False,
                      max_sms=opts.sms, ring_tokens=max(opts.rings))  # fmt: skip
    lines = []
    for ring in opts.rings:
        for chunk in opts.chunks:
            config = Config(num_sms=opts.sms, nvl_send_chunk=chunk, nvl_recv_buffer_tokens=ring)
            _, per_expert, in_rank = mode.get_dispatch_layout(idx)
            out = mode.dispatch(x, idx, w, per_expert, in_rank, config=config)
            out8 = mode.dispatch(x_fp8, idx, w, per_expert, in_rank, config=config)
            y = torch.randn(out.handle.num_rows, H, device=ctx.device).to(torch.bfloat16)
            calls = (
                lambda h=out.handle: mode.dispatch(x, handle=h),
                lambda h=out8.handle: mode.dispatch(x_fp8, handle=h),
                lambda h=out.handle, y=y: mode.combine(y, h),
            )
            times = [median_ms(fn, opts.iters, 3) for fn in calls]
            # Device time without the host: eager medians that exceed it are host-bound.
            graphs = [time_graph(fn, 5, 10) for fn in calls] if ctx.device.type == "cuda" else []
            # BF16 dispatch with combine, then FP8 dispatch alone: one trace each, since both
            # dispatches run the same kernel and the summary groups programs by kernel.
            traced = (
                ("", lambda c=calls: (c[0](), c[2]())),
                ("FP8 ", calls[1]),
            )
            roles = []
            for label, fn in traced:
                mode.trace = recorder
                recorder.clear()
                for _ in range(3):
                    fn()
                mode.check()
                mode.trace = None
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "trace.json")
                    recorder.dump(path)
                    rows = summarize([path])
                roles += [
                    f"{label}{r['kernel'].split()[-1]} {r['slice']}: "
                    f"{r['median_us']:.0f}/{r['max_us']:.0f} (span {r['launch_span_us']:.0f})"
                    for r in rows
                ]
            roles = "; ".join(roles)
            lines.append(
                f"ring {ring:4d} chunk {chunk:2d}: dispatch {times[0] * 1e3:6.1f} us, FP8 "
                f"{times[1] * 1e3:6.1f} us, combine {times[2] * 1e3:6.1f} us | graph "
                f"{', '.join(f'{t * 1e3:.1f}' for t in graphs)} us | traced median/"
                f"slowest program us: {roles}"
            )
    mode.destroy()
    return lines


def main() -> None:
    from tritonep.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--rings", default="128,512")
    parser.add_argument("--chunks", default="16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    args.rings = [int(v) for v in args.rings.split(",")]
    args.chunks = [int(v) for v in args.chunks.split(",")]
    args.launch = {k: int(v) for k, v in (item.split("=") for item in args.launch)}
    results = spawn(_rank, args.ranks, args, timeout=600)
    print(f"{args.ranks} rank(s), {args.tokens} tokens, hidden {args.hidden}, {args.sms} SMs, "
          f"launch constants {args.launch or 'default'}")  # fmt: skip
    for lines in zip(*results, strict=True):
        print(lines[0] if len(set(lines)) == 1 else "\n".join(lines))


if __name__ == "__main__":
    main()
