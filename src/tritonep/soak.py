"""Soak: thousands of randomized dispatch/combine calls per mode, checked against the reference.

``python -m tritonep.soak --ranks 4 --calls 10000 --check-every 100`` runs, per mode, calls
with random token counts (0 included), top-k, routing (random, skewed, dropped, empty), BF16 or
FP8 payloads and, in normal mode, worst-case or exact sizing and cached calls. Every rank draws
the same parameters from the call's seed, so they stay in step without talking; every
``check_every``-th call (and the first and last) is compared with :mod:`tritonep.reference`
bit for bit. Any mismatch or timeout stops the run with the call's seed, so it can be replayed.
Call ``c`` draws from seed ``--seed + c``, so a long soak can be split into runs that continue
one another (``--seed 4000 --calls 6000`` after ``--calls 4000``).
Modes ``internode`` and ``low_latency_internode`` treat groups of ``--gpus-per-node`` ranks
as nodes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from . import reference as ref
from .heap import shared_gpu
from .launch import gpus_suffice, spawn
from .testing import ROUTINGS, make_case, verify_low_latency_call


def _params(seed: int, max_tokens: int, num_ranks: int, max_topk: int, num_experts: int):
    rng = random.Random(seed)
    tokens = [rng.choice([0, 1, rng.randint(0, max_tokens), max_tokens]) for _ in range(num_ranks)]
    topk = rng.randint(1, min(max_topk, num_experts))
    return tokens, topk, rng.choice(ROUTINGS), rng.random() < 0.5, rng


def _normal_call(ctx, mode, seed, opts, check):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, topk, routing, use_fp8, rng = _params(seed, opts.tokens, R, opts.topk, opts.experts)
    case = make_case(seed, tokens, opts.hidden, opts.experts, topk, routing)
    xs = [ref.quantize_fp8(x) for x in case.x] if use_fp8 else list(case.x)
    x = tuple(t.to(dev) for t in xs[me]) if use_fp8 else xs[me].to(dev)
    idx, w = case.topk_idx[me].to(dev), case.topk_weights[me].to(dev)
    worst = sum(tokens) if rng.random() < 0.3 else 0
    out = mode.dispatch(x, idx, w, num_worst_tokens=worst)
    if rng.random() < 0.3:  # cached: the same routing moves the payload again
        out.recv_x = mode.dispatch(x, handle=out.handle).recv_x
    rows = ref.dequantize_fp8(*out.recv_x) if use_fp8 else out.recv_x.float()
    rows = torch.nan_to_num(rows)  # padding rows of worst-case outputs hold anything
    combined, _ = mode.combine(rows.to(torch.bfloat16), out.handle)
    if not check:
        return
    wants = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, opts.experts)
    want, n = wants[me], wants[me].num_recv_tokens
    ref.assert_rows_equal(out.recv_x, want.recv_x, n, f"seed {seed} recv_x")
    ref.assert_bitwise_equal(out.recv_topk_idx[:n].cpu(), want.recv_topk_idx, f"seed {seed} ids")
    ys = [
        (ref.dequantize_fp8(*d.recv_x) if use_fp8 else d.recv_x.float()).to(torch.bfloat16)
        for d in wants
    ]
    expected, _ = ref.normal_combine(ys, wants, tokens)[me]
    if getattr(mode, "num_nodes", 1) == 1:
        ref.assert_bitwise_equal(combined.cpu(), expected, f"seed {seed} combined")
    else:  # sums within each node are rounded to BF16 before the network: two roundings
        torch.testing.assert_close(combined.cpu(), expected, rtol=2e-2, atol=1e-2,
                                   msg=f"seed {seed} combined")  # fmt: skip


def _low_latency_call(ctx, mode, seed, opts, check):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, topk, routing, use_fp8, rng = _params(seed, opts.tokens, R, opts.topk, opts.experts)
    case = make_case(seed, tokens, opts.hidden, opts.experts, topk, routing)
    idx = case.topk_idx[me].to(dev)
    hook = rng.random() < 0.5
    recv_x, count, handle, recv_hook = mode.dispatch(
        case.x[me].to(dev), idx, use_fp8=use_fp8, return_recv_hook=hook
    )
    if recv_hook is not None:
        recv_hook()
    rows = ref.dequantize_fp8(*recv_x) if use_fp8 else recv_x.float()
    outputs = torch.nan_to_num(rows).to(torch.bfloat16)  # rows past the counts hold anything
    combined, _ = mode.combine(outputs, idx, case.topk_weights[me].to(dev), handle)
    if check:
        mode.check()
        verify_low_latency_call(
            me, case, opts.tokens, use_fp8, False, recv_x, count, handle, outputs, combined
        )


def _rank_main(ctx, opts):
    from .modes.internode import InternodeMode
    from .modes.low_latency import LowLatencyMode
    from .modes.normal import NormalMode

    report = {}
    for name in opts.modes:
        if name == "normal":
            mode = NormalMode(None, opts.hidden, opts.experts, max_topk=opts.topk,
                              device=ctx.device, timeout_s=opts.timeout)  # fmt: skip
            step = _normal_call
        elif name == "internode":
            mode = InternodeMode(None, opts.hidden, opts.experts, opts.gpus_per_node,
                                 max_topk=opts.topk, device=ctx.device,
                                 timeout_s=opts.timeout)  # fmt: skip
            step = _normal_call
        else:
            nodes = name == "low_latency_internode"
            mode = LowLatencyMode(None, opts.tokens, opts.hidden, opts.experts,
                                  max_topk=opts.topk, device=ctx.device, timeout_s=opts.timeout,
                                  gpus_per_node=opts.gpus_per_node if nodes else None,
                                  )  # fmt: skip
            step = _low_latency_call
        start, checks = time.monotonic(), 0
        last = start
        for call in range(opts.calls):
            check = call % opts.check_every == 0 or call == opts.calls - 1
            step(ctx, mode, opts.seed + call, opts, check)
            checks += check
            now = time.monotonic()
            # Every N calls, and at least every --progress-s seconds: a run stopped from outside
            # (a device's time limit) then still says exactly where to continue.
            due = opts.progress and (call + 1) % opts.progress == 0
            if ctx.rank == 0 and (due or now - last >= opts.progress_s):
                last = now
                print(f"{name}: {call + 1}/{opts.calls} calls (seeds {opts.seed}-"
                      f"{opts.seed + call}, {checks} checked, all matched), "
                      f"{now - start:.0f} s; continue with --seed {opts.seed + call + 1}",
                      flush=True)  # fmt: skip
        mode.destroy()  # raises if any wait timed out
        report[name] = {"calls": opts.calls, "checked": checks,
                        "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m tritonep.soak", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4, help="rank processes")
    parser.add_argument(
        "--modes",
        default="normal,low_latency",
        help="comma-separated: normal, low_latency, internode, low_latency_internode",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=2, help="node size of the *internode modes"
    )
    parser.add_argument("--calls", type=int, default=10000, help="calls per mode")
    parser.add_argument(
        "--check-every", type=int, default=100, help="compare every Nth call with the reference"
    )
    parser.add_argument(
        "--tokens", type=int, help="most tokens per rank (default: 256 on GPUs, 6 on CPU ranks)"
    )
    parser.add_argument(
        "--hidden", type=int, help="hidden size (default: 2048 on GPUs, 128 on CPU ranks)"
    )
    parser.add_argument("--experts", type=int, help="experts in all (default: 8 per rank)")
    parser.add_argument("--topk", type=int, default=8, help="most experts per token")
    parser.add_argument("--seed", type=int, default=0, help="call c draws from seed + c")
    parser.add_argument("--timeout", type=float, default=60.0, help="kernel wait limit, s")
    parser.add_argument("--progress", type=int, default=1000, help="print every N calls")
    parser.add_argument(
        "--progress-s", type=float, default=60.0, help="and at least every this many seconds"
    )
    opts = parser.parse_args(argv)
    on_gpu = gpus_suffice(opts.ranks)
    opts.modes = opts.modes.split(",")
    opts.tokens = opts.tokens or (256 if on_gpu else 6)
    opts.hidden = opts.hidden or (2048 if on_gpu else 128)
    opts.experts = opts.experts or 8 * opts.ranks
    reports = spawn(_rank_main, opts.ranks, opts, timeout=24 * 3600)
    where = "CPU ranks"
    if on_gpu:
        where = "ranks sharing GPU 0" if shared_gpu() else "GPUs"
    print(f"soak on {opts.ranks} {where}: {reports[0]}")
    print("every checked call matched the reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
