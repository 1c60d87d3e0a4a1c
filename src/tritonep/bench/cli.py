"""``tritonep bench`` (also ``python -m tritonep.bench``): run a sweep, print, save, plot.

::

    tritonep bench normal --ranks 4            # 4096 tokens, hidden 7168, top-8, 256 experts
    tritonep bench normal --ranks 4 --tokens sweep --csv normal.csv --plot normal.png
    tritonep bench low-latency --ranks 2,4 --tokens 1,32,128,256 --topk 4,8
    tritonep bench internode --ranks 4 --gpus-per-node 2     # 2 emulated nodes of 2 GPUs
    tritonep bench normal --ranks 4 --launch COMBINE_SEND_TILE=16384 --launch COMBINE_WARPS=8
    tritonep bench report normal.csv --markdown BENCHMARKS.md --section normal-4xh200
    tritonep bench low-latency --ranks 4 --trace trace-{rank}.json
    tritonep bench trace-summary trace-*.json   # time per kernel and phase, over programs

Every option that takes a value takes a comma-separated list; the sweep is their product (one
spawn of ranks per rank count). On a machine without enough GPUs the ranks run on the CPU
(gloo, kernels under the Triton interpreter) at small default shapes: the numbers then say
nothing about speed, but every code path runs (CI does this).
"""

from __future__ import annotations

import argparse
import sys
import types

from ..heap import shared_gpu
from ..launch import gpus_suffice, spawn
from . import report

#: Token sweeps for ``--tokens sweep``.
SWEEPS = {
    "normal": [128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "low-latency": [1, 8, 32, 64, 128, 256],
    "internode": [128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}

# Defaults: (on GPUs, on CPU ranks).
DEFAULTS = {
    "normal": {"tokens": ("4096", "16"), "hidden": ("7168", "256"), "topk": ("8", "4"),
               "experts": ("256", "16"), "iters": (30, 2)},
    "low-latency": {"tokens": ("128", "8"), "hidden": ("7168", "256"), "topk": ("8", "4"),
                    "experts": ("256", "16"), "iters": (50, 2)},
}  # fmt: skip
DEFAULTS["internode"] = DEFAULTS["normal"]

#: Measured all-to-all ceiling of 4x H200 (remote GB/s per rank), the plot's reference line.
NVLINK_CEILING_GBPS = 370.0


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class _Progress:
    """Rank 0's progress: a tqdm bar when tqdm is installed, else a line per point."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.bar = enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="point", file=sys.stderr)
            except ImportError:
                pass

    def __call__(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            cells = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
            print(cells, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rank_main(ctx, mode: str, opts: types.SimpleNamespace) -> list[dict]:
    from .internode import internode_rank
    from .low_latency import low_latency_rank
    from .normal import normal_rank

    points = len(opts.tokens) * len(opts.hidden) * len(opts.topk) * len(opts.experts)
    if mode == "normal":
        points *= len(opts.sms) * len(opts.chunk) * len(opts.ring)
    from ..modes import normal as normal_mode

    launch = getattr(opts, "launch", {})
    normal_mode.set_launch_constants(**launch)
    if getattr(opts, "nvshmem", False):  # --nvshmem: before this rank process allocates
        from ..heap import set_backend

        set_backend("NVSHMEM")
    progress = _Progress(points, enabled=ctx.rank == 0 and not opts.quiet)
    try:
        run = {"normal": normal_rank, "low-latency": low_latency_rank,
               "internode": internode_rank}[mode]  # fmt: skip
        rows = run(ctx, opts, progress)
    finally:
        progress.close()
    if launch:  # rows say which launch shape they measured (as the kernels read it)
        tag = " ".join(f"{k}={getattr(normal_mode, k)}" for k in launch)
        rows = [dict(row, launch=tag) for row in rows]
    if opts.trace and mode != "internode":  # (internode traces: Buffer(profile=True))
        from .traced import trace_calls

        written = trace_calls(ctx, mode, opts, opts.trace)
        if ctx.rank == 0:
            print(f"kernel traces: {written} (one file per rank)", flush=True)
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonep bench", description="tritonep beside the torch backend, same run."
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("normal", "low-latency", "internode"):
        p = sub.add_parser(mode, help=f"time {mode} dispatch and combine")
        p.add_argument("--ranks", default="4", help="rank counts, e.g. 2,4")
        p.add_argument("--tokens", default=None, help="tokens per rank, or 'sweep'")
        p.add_argument("--hidden", default=None)
        p.add_argument("--topk", default=None)
        p.add_argument("--experts", default=None)
        p.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
        p.add_argument("--csv", default=None, help="write every row here")
        p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
        p.add_argument("--ceiling", type=float, default=NVLINK_CEILING_GBPS,
                       help="NVLink ceiling line of the plot, remote GB/s per rank")  # fmt: skip
        p.add_argument("--compare", default=None, help="also time this DeepEP-like module")
        p.add_argument("--quiet", action="store_true", help="no progress output")
        p.add_argument("--trace", default=None, help="trace a few calls into this file ({rank})")
        if mode in ("normal", "internode"):
            p.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                           help="set a launch constant of the normal-mode kernels (repeatable; "
                           "tritonep.modes.normal.LAUNCH_CONSTANTS)")  # fmt: skip
        if mode == "normal":
            p.add_argument("--sms", default=None, help="SM budgets (default 24; CPU: 4)")
            p.add_argument("--chunk", default="16", help="tokens per sender step")
            p.add_argument("--ring", default=None, help="ring slots (default 128; CPU: 64)")
        elif mode == "low-latency":
            p.add_argument("--bf16", action="store_true", help="dispatch BF16 instead of FP8")
            p.add_argument("--logfmt", action="store_true",
                           help="combine in LogFMT-10 (DeepEP's use_logfmt)")  # fmt: skip
            p.add_argument("--gpus-per-node", type=int, default=None,
                           help="ranks per emulated node (default: one node)")  # fmt: skip
        else:
            p.add_argument("--gpus-per-node", type=int, default=2, help="GPUs per emulated node")
        if mode in ("low-latency", "internode"):
            p.add_argument("--nvshmem", action="store_true",
                           help="NVSHMEM heaps: NVSHMEM puts to other nodes (as on a cluster) "
                           "instead of staged copies")  # fmt: skip
    r = sub.add_parser("report", help="CSV -> table, markdown section, plot")
    r.add_argument("csv", nargs="+", help="CSV files (their rows one after another)")
    r.add_argument("--markdown", default=None, help="update this markdown file")
    r.add_argument("--section", default="results", help="section marker name in it")
    r.add_argument("--columns", default=None, help="CSV columns of the markdown table")
    r.add_argument("--plot", default=None)
    r.add_argument("--ceiling", type=float, default=NVLINK_CEILING_GBPS)
    t = sub.add_parser("trace-summary", help="kernel trace files -> time per kernel and phase")
    t.add_argument("traces", nargs="+", help="Chrome trace JSON files written by --trace")
    return parser


def _launch_constants(settings: list[str]) -> dict[str, int]:
    """``["NAME=VALUE", ...]`` -> ``{NAME: VALUE}``, checked here before any rank starts."""
    from ..modes.normal import LAUNCH_CONSTANTS, check_launch_constants

    values = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or not value.strip().isdigit():
            raise SystemExit(f"tritonep bench: --launch expects NAME=VALUE with NAME one of "
                             f"{', '.join(LAUNCH_CONSTANTS)}, got {setting!r}")  # fmt: skip
        values[name.strip()] = int(value)
    try:
        check_launch_constants(values)
    except ValueError as e:
        raise SystemExit(f"tritonep bench: --launch {e}") from None
    return values


def _options(args: argparse.Namespace, on_gpu: bool) -> types.SimpleNamespace:
    pick = 0 if on_gpu else 1
    defaults = DEFAULTS[args.mode]
    tokens = args.tokens or defaults["tokens"][pick]
    opts = types.SimpleNamespace(
        tokens=SWEEPS[args.mode] if tokens == "sweep" else _ints(tokens),
        hidden=_ints(args.hidden or defaults["hidden"][pick]),
        topk=_ints(args.topk or defaults["topk"][pick]),
        experts=_ints(args.experts or defaults["experts"][pick]),
        iters=args.iters or defaults["iters"][pick],
        compare=args.compare,
        quiet=args.quiet,
        trace=args.trace,
    )
    if args.mode in ("normal", "internode"):
        opts.launch = _launch_constants(args.launch)
    if args.mode == "normal":
        opts.sms = _ints(args.sms or ("24" if on_gpu else "4"))
        opts.chunk = _ints(args.chunk)
        opts.ring = _ints(args.ring or ("128" if on_gpu else "64"))
    elif args.mode == "low-latency":
        opts.bf16 = args.bf16
        opts.logfmt = args.logfmt
    if args.mode in ("low-latency", "internode"):
        opts.gpus_per_node = args.gpus_per_node
        opts.nvshmem = args.nvshmem
    return opts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "report":
        rows = [row for path in args.csv for row in report.read_csv(path)]
        report.print_table(rows)
        if args.markdown:
            columns = args.columns.split(",") if args.columns else None
            table = report.markdown_table(rows, columns)
            report.update_markdown(args.markdown, args.section, table)
        if args.plot:
            report.plot(rows, args.plot, args.ceiling)
        return 0
    if args.mode == "trace-summary":
        from .traced import summarize

        report.print_table(summarize(args.traces))
        return 0
    if shared_gpu():
        print("tritonep bench: ranks that share one GPU (TRITONEP_SHARED_GPU) take turns on it, "
              "so nothing can be timed that way", file=sys.stderr)  # fmt: skip
        return 2
    rows = []
    for ranks in _ints(args.ranks):
        on_gpu = gpus_suffice(ranks)
        opts = _options(args, on_gpu)
        where = "GPUs" if on_gpu else "CPU ranks (Triton interpreter: correctness, not speed)"
        print(f"tritonep bench {args.mode}: {ranks} ranks on {where}", file=sys.stderr)
        rows += spawn(_rank_main, ranks, args.mode, opts, timeout=3600)[0]
    report.print_table(rows)
    if args.csv:
        report.write_csv(rows, args.csv)
    if args.plot:
        report.plot(rows, args.plot, args.ceiling)
    return 0
