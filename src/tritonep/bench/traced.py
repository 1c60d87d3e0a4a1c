"""``--trace PATH``: a few traced calls after the sweep, written as Chrome trace JSON per rank.

The calls use the sweep's first shape and a buffer built with ``profile=True``, so their
timings come from timer readings inside the kernels (see :mod:`tritonep.modes.trace`); the
sweep itself always runs untraced.
"""

from __future__ import annotations

import torch

from ..buffer import Buffer
from ..modes.trace import TICKS
from ..testing import route


def trace_calls(ctx, mode: str, opts, path: str, calls: int = 3) -> str:
    """Run ``calls`` dispatch + combine pairs traced, after one whose readings are dropped
    (it compiles the profiled kernels, and a rank done compiling first waits inside them for
    its peers: 0.4-0.7 s of "wait" in the first 4-GPU traces); returns this rank's trace
    file."""
    tokens, hidden, experts, topk = opts.tokens[0], opts.hidden[0], opts.experts[0], opts.topk[0]
    gen = torch.Generator().manual_seed(3000 + ctx.rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = route(gen, tokens, experts, topk, "random").to(ctx.device)
    w = torch.rand(tokens, topk, generator=gen).to(ctx.device)
    buffer = Buffer(device=ctx.device, profile=True, check_ids=False)
    for call in range(calls + 1):
        if call == 1:
            buffer.check()
            buffer.clear_trace()
        if mode == "normal":
            _, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
            recv_x, _, _, _, handle, _ = buffer.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                is_token_in_rank=in_rank,
            )  # fmt: skip
            buffer.combine(recv_x, handle)
        else:
            recv, _, handle, _, _ = buffer.low_latency_dispatch(
                x, idx, max(opts.tokens), experts, use_fp8=not opts.bf16
            )
            shape = recv[0].shape if isinstance(recv, tuple) else recv.shape
            y = (torch.randn(shape, device=ctx.device) * 0.1).to(torch.bfloat16)
            buffer.low_latency_combine(y, idx, w, handle, use_logfmt=opts.logfmt)
    buffer.check()
    written = buffer.dump_trace(path)
    buffer.destroy()
    return written


def summarize(paths: list[str]) -> list[dict]:
    """Per kernel and slice of trace files: how long its programs spent there.

    For every launch, a slice's duration is taken over the programs that have it (median and
    largest), and the launch's span from its first program start to its last program end;
    each figure is then the median over the launches (calls and ranks) of that kernel.
    Durations are microseconds on GPUs (columns ``*_us``), the interpreter's logical ticks on
    CPU ranks (columns ``*_ticks``, which order events but are not time).
    """
    import json
    import statistics

    per_launch: dict[tuple, list[float]] = {}
    spans: dict[tuple, tuple[float, float]] = {}
    ticks = False
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        clock = trace.get("otherData", {}).get("clock")
        # Traces without a clock note: GPU slices name their SM, the interpreter's do not.
        ticks |= clock == TICKS if clock else not any("sm" in e.get("args", {}) for e in events)
        for e in events:
            if e.get("ph") != "X":
                continue
            launch = (e["args"]["kernel"], e["pid"], e["args"]["call"])
            name = e["name"]
            if ": " not in name and "phase" in e["args"]:  # a sub-phase: say of which phase
                name = f"{e['args']['phase']}: {name}"  # (normal senders and receivers both wait)
            per_launch.setdefault((*launch, name), []).append(e["dur"])
            begin, end = spans.get(launch, (e["ts"], e["ts"] + e["dur"]))
            spans[launch] = (min(begin, e["ts"]), max(end, e["ts"] + e["dur"]))
    rows: dict[tuple, dict] = {}
    for (kernel, rank, call, name), durations in per_launch.items():
        row = rows.setdefault((kernel, name), {"kernel": kernel, "slice": name, "launches": 0,
                                               "programs": [], "median": [], "max": [],
                                               "span": []})  # fmt: skip
        begin, end = spans[(kernel, rank, call)]
        row["launches"] += 1
        row["programs"].append(len(durations))
        row["median"].append(statistics.median(durations))
        row["max"].append(max(durations))
        row["span"].append(end - begin)
    unit = "ticks" if ticks else "us"
    return [
        {"kernel": r["kernel"], "slice": r["slice"], "launches": r["launches"],
         "programs": int(statistics.median(r["programs"])),
         f"median_{unit}": round(statistics.median(r["median"]), 2),
         f"max_{unit}": round(statistics.median(r["max"]), 2),
         f"launch_span_{unit}": round(statistics.median(r["span"]), 2)}
        for r in rows.values()
    ]  # fmt: skip
