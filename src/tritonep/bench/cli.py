"""``tritonep bench`` (also ``python -m tritonep.bench``): run a sweep, print, save, plot.

::

    tritonep bench normal --ranks 4            # 4096 tokens, hidden 7168, top-8, 256 experts
    tritonep bench normal --ranks 4 --tokens sweep --csv normal.csv --plot normal.png
    tritonep bench low-latency --ranks 2,4 --tokens 1,32,128,256 --topk 4,8
    tritonep bench internode --ranks 4 --gpus-per-node 2     # 2 emulated nodes of 2 GPUs
    tritonep bench normal --ranks 4 --launch COMBINE_SEND_TILE=16384 --launch COMBINE_WARPS=8
    tritonep bench report normal.csv --markdown BENCHMARKS.md --section normal-4xh200
    tritonep bench low-latency --ranks 4 --trace trace-{rank}.json
    tritonep bench low-latency --ranks 4 --eager  # + eager loop, with/without torch defaults
    tritonep bench trace-summary trace-*.json   # time per kernel and phase, over programs
    tritonep bench overlap --ranks 4    # dispatch / combine beside a GEMM on another stream

Every option that takes a value takes a comma-separated list; the sweep is their product (one
spawn of ranks per rank count). Each row goes to the CSV as soon as its point is measured, so
an interrupted sweep keeps what it measured; progress goes to standard error (a tqdm bar where
tqdm is installed) and the table to standard output.

On a machine without enough GPUs the ranks run on the CPU (gloo, kernels under the Triton
interpreter) at small default shapes and sweeps: every code path runs (CI does this), and the
times, wall-clock microseconds of interpreted kernels, say nothing about GPU speed. Such rows
say so (``device``), and so do their table, plot and traces.
"""

from __future__ import annotations

import argparse
import sys
import types

from ..cli import HelpFormatter
from ..heap import shared_gpu
from ..launch import gpus_suffice, spawn
from . import report

#: Token sweeps for ``--tokens sweep``: (on GPUs, on CPU ranks). Under the interpreter a
#: point takes seconds to minutes, so the CPU sweeps stay small.
SWEEPS = {
    "normal": ([128, 256, 512, 1024, 2048, 4096, 8192, 16384], [4, 8, 16, 32]),
    "low-latency": ([1, 8, 32, 64, 128, 256], [1, 2, 4, 8]),
    "internode": ([128, 256, 512, 1024, 2048, 4096, 8192, 16384], [4, 8, 16, 32]),
    "overlap": ([512, 1024, 2048, 4096, 8192], [4, 8, 16]),
}

# Defaults of the sweep options, as on the command line: (on GPUs, on CPU ranks).
DEFAULTS: dict[str, dict[str, tuple[str, str]]] = {
    "normal": {
        "tokens": ("4096", "16"),
        "hidden": ("7168", "256"),
        "topk": ("8", "4"),
        "experts": ("256", "16"),
    },
    "low-latency": {
        "tokens": ("128", "8"),
        "hidden": ("7168", "256"),
        "topk": ("8", "4"),
        "experts": ("256", "16"),
    },
}
DEFAULTS["internode"] = DEFAULTS["normal"]
DEFAULTS["overlap"] = DEFAULTS["normal"]
#: Timed iterations: (on GPUs, on CPU ranks).
DEFAULT_ITERS = {
    "normal": (30, 2),
    "low-latency": (50, 2),
    "internode": (30, 2),
    "overlap": (20, 1),
}
#: Normal-mode configuration defaults: (on GPUs, on CPU ranks); ``gemm``: the overlap's GEMM.
CONFIG_DEFAULTS = {"sms": ("24", "4"), "ring": ("128", "64"), "gemm": ("8192", "64")}

#: The all-to-all ceiling of 4x H200 (remote GB/s per rank), the plot's reference line.
NVLINK_CEILING_GBPS = 370.0


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


#: Columns that name a point in a progress line.
POINT_COLUMNS = (
    *("ranks", "tokens", "hidden", "topk", "experts", "sms", "chunk", "ring"),
    *("path", "op", "priority", "order"),
)


class _Progress:
    """Rank 0's record of finished points: each row tagged and appended to the CSV, and
    progress on standard error (a tqdm bar when tqdm is installed, else a line per point)."""

    def __init__(self, total: int, enabled: bool, csv: str | None, tags: dict):
        self.total, self.done, self.enabled, self.bar = total, 0, enabled, None
        self.csv, self.tags = csv, tags
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="point", file=sys.stderr)
            except ImportError:
                pass

    def __call__(self, row: dict) -> None:
        row.update(self.tags)  # the list the rank returns holds the same dicts
        if self.csv:
            report.append_csv(row, self.csv)
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            point = ", ".join(f"{k} {row[k]}" for k in POINT_COLUMNS if k in row)
            print(f"point {self.done}/{self.total} done: {point}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rank_main(ctx, mode: str, opts: types.SimpleNamespace) -> list[dict]:
    from .internode import internode_rank
    from .low_latency import low_latency_rank
    from .normal import normal_rank
    from .overlap import ORDERS, PRIORITIES, overlap_rank

    points = len(opts.tokens) * len(opts.hidden) * len(opts.topk) * len(opts.experts)
    if mode == "normal":
        points *= len(opts.sms) * len(opts.chunk) * len(opts.ring)
    elif mode == "overlap":  # rows: starts x carveouts x paths x 2 operations x ... x orders
        orders = len(ORDERS) + (1 + len(opts.tune)) * (len(ORDERS) + 1)  # (slots: deferred)
        points *= len(opts.start) * len(opts.carveout) * 2 * len(PRIORITIES) * orders
    from ..modes import normal as normal_mode

    launch = getattr(opts, "launch", {})
    normal_mode.set_launch_constants(**launch)
    if getattr(opts, "nvshmem", False):  # --nvshmem: before this rank process allocates
        from ..heap import set_backend

        set_backend("NVSHMEM")
    tags = {"device": report.device_name(ctx.device)}
    if launch:  # rows say which launch shape they measured (as the kernels read it)
        tags["launch"] = " ".join(f"{k}={getattr(normal_mode, k)}" for k in launch)
    me = ctx.rank == 0
    progress = _Progress(points, me and not opts.quiet, opts.csv if me else None, tags)
    try:
        run = {
            "normal": normal_rank,
            "low-latency": low_latency_rank,
            "internode": internode_rank,
            "overlap": overlap_rank,
        }[mode]
        rows = run(ctx, opts, progress)
    finally:
        progress.close()
    if opts.trace and mode in ("normal", "low-latency"):  # (internode traces: Buffer(profile=True))
        from .traced import trace_calls

        written = trace_calls(ctx, mode, opts, opts.trace)
        if me:
            print(f"kernel traces: {written} (one file per rank)", file=sys.stderr, flush=True)
    return rows


def _by_device(mode: str, name: str) -> str:
    """``(default: G on GPUs, C on CPU ranks)`` for an option whose default depends on where
    the ranks run."""
    if name == "iters":
        gpu, cpu = (str(n) for n in DEFAULT_ITERS[mode])
    else:
        gpu, cpu = DEFAULTS[mode][name] if name in DEFAULTS[mode] else CONFIG_DEFAULTS[name]
    return f"(default: {gpu} on GPUs, {cpu} on CPU ranks)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonep bench", description=__doc__, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode in ("normal", "low-latency", "internode"):
        gpu_sweep, cpu_sweep = (",".join(map(str, t)) for t in SWEEPS[mode])
        p = sub.add_parser(
            mode,
            help=f"time {mode} dispatch and combine",
            description=f"Time {mode} dispatch and combine beside the torch backend.\n"
            "Options take comma-separated lists; the sweep is their product.",
            formatter_class=HelpFormatter,
        )
        p.add_argument("--ranks", default="4", help="rank counts, e.g. 2,4")
        p.add_argument(
            "--tokens",
            help=f"tokens per rank, or 'sweep' ({gpu_sweep} on GPUs, "
            f"{cpu_sweep} on CPU ranks) {_by_device(mode, 'tokens')}",
        )
        p.add_argument("--hidden", help=f"hidden sizes {_by_device(mode, 'hidden')}")
        p.add_argument("--topk", help=f"experts per token {_by_device(mode, 'topk')}")
        p.add_argument("--experts", help=f"experts in all {_by_device(mode, 'experts')}")
        p.add_argument(
            "--iters", type=int, help=f"timed calls per measurement {_by_device(mode, 'iters')}"
        )
        p.add_argument(
            "--csv", help="write every row here, each as soon as it is measured (default: none)"
        )
        p.add_argument("--plot", help="write a PNG plot here; needs matplotlib (default: none)")
        p.add_argument(
            "--ceiling",
            type=float,
            default=NVLINK_CEILING_GBPS,
            help="the plot's NVLink ceiling line, remote GB/s per rank (not drawn for CPU ranks)",
        )
        p.add_argument(
            "--compare",
            help="also time this module with DeepEP's Buffer "
            "interface, e.g. deep_ep (skipped, with a note, if it does not import; default: none)",
        )
        p.add_argument("--quiet", action="store_true", help="no progress output")
        if mode in ("normal", "low-latency"):
            p.add_argument(
                "--eager",
                action="store_true",
                help="also time an eager loop (L2 flushed, dispatch + combine) and the host "
                "time per call, with and without torch.set_default_device/dtype, and the "
                "kernels' own time (GPUs only)",
            )
        p.add_argument(
            "--trace",
            metavar="PATH",
            help="after the sweep, trace a few calls into PATH per rank (with "
            "{rank} in it); see trace-summary (default: none)",
        )
        if mode in ("normal", "internode"):
            p.add_argument(
                "--launch",
                action="append",
                default=[],
                metavar="NAME=VALUE",
                help="set a launch constant of the normal-mode kernels (repeatable; "
                "tritonep.modes.normal.LAUNCH_CONSTANTS; default: the module's values)",
            )
        if mode == "normal":
            p.add_argument("--sms", help=f"SM budgets {_by_device(mode, 'sms')}")
            p.add_argument("--chunk", default="16", help="tokens per sender step")
            p.add_argument("--ring", help=f"ring slots per channel {_by_device(mode, 'ring')}")
            p.add_argument(
                "--copy-combine",
                action="store_true",
                help="also time the combine over copy engines (NormalMode copy_combine_tokens)",
            )
            p.add_argument(
                "--copy-chunks",
                help="chunks of the combine over copy engines to time, e.g. 1,2 (each a mode "
                "of its own: tritonep.modes.copy_combine.CHUNKS; implies --copy-combine; "
                "default: the module's)",
            )
            p.add_argument(
                "--copy-share",
                help="the last chunk's share of the rows in the combine over copy engines, "
                "e.g. 4,5 for a quarter and a fifth (each a mode of its own: NormalMode "
                "copy_combine_last_share; implies --copy-combine; default: by rank count)",
            )
        elif mode == "low-latency":
            p.add_argument("--bf16", action="store_true", help="dispatch BF16 instead of FP8")
            p.add_argument(
                "--logfmt", action="store_true", help="combine in LogFMT-10 (DeepEP's use_logfmt)"
            )
            p.add_argument(
                "--gpus-per-node", type=int, help="ranks per emulated node (default: one node)"
            )
        else:
            p.add_argument("--gpus-per-node", type=int, default=2, help="GPUs per emulated node")
        if mode in ("low-latency", "internode"):
            p.add_argument(
                "--nvshmem",
                action="store_true",
                help="NVSHMEM heaps: NVSHMEM puts to other nodes (as on a cluster) "
                "instead of staged copies",
            )
    o = sub.add_parser(
        "overlap",
        help="time dispatch and combine beside a GEMM",
        description="Cached dispatch and combine on a communication stream beside a BF16\n"
        "GEMM on the compute stream, started together, for the channel rings and the fixed\n"
        "slots (tritonep.bench.overlap). Options take comma-separated lists.",
        formatter_class=HelpFormatter,
    )
    o.add_argument("--ranks", default="4", help="rank counts, e.g. 2,4")
    o.add_argument("--tokens", help=f"tokens per rank {_by_device('overlap', 'tokens')}")
    o.add_argument("--hidden", help=f"hidden sizes {_by_device('overlap', 'hidden')}")
    o.add_argument("--topk", help=f"experts per token {_by_device('overlap', 'topk')}")
    o.add_argument("--experts", help=f"experts in all {_by_device('overlap', 'experts')}")
    o.add_argument("--iters", type=int, help=f"timed runs {_by_device('overlap', 'iters')}")
    o.add_argument("--sms", type=int, help=f"SMs of the rings {_by_device('overlap', 'sms')}")
    o.add_argument("--gemm", type=int, help=f"the GEMM's M = N = K {_by_device('overlap', 'gemm')}")
    o.add_argument(
        "--csv", help="write every row here, each as soon as it is measured (default: none)"
    )
    o.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="CONFIG",
        help="also time the slots under this elastic Tuning, e.g. epilogue_sms=16 "
        "(repeatable; default: none)",
    )
    o.add_argument(
        "--copy-chunks",
        help="chunk counts of the combine over copy engines, e.g. 1,2: a path copies[C] each "
        "(tritonep.modes.copy_combine.CHUNKS; default: one path, copies, of the module's)",
    )
    o.add_argument(
        "--carveout",
        default="0",
        help="SMs the GEMM leaves free (torch's experimental SM carveout, which cuBLASLt "
        "honours: see --blas; 0: none)",
    )
    o.add_argument(
        "--blas",
        default="default",
        choices=("default", "cublaslt"),
        help="the library of torch's matmuls (cublaslt honours --carveout)",
    )
    o.add_argument(
        "--start",
        default="host",
        help="host: timed from the first launch (its host time counts); queued: both sides "
        "queued behind a device-side wait first (device time only); e.g. host,queued",
    )
    o.add_argument("--quiet", action="store_true", help="no progress output")
    r = sub.add_parser(
        "report",
        help="CSV -> table, markdown section, plot",
        description="Print a CSV written by --csv as a table; update a markdown section\n"
        "or write a plot from it.",
        formatter_class=HelpFormatter,
    )
    r.add_argument("csv", nargs="+", help="CSVs written by --csv (their rows one after another)")
    r.add_argument("--markdown", help="update this markdown file (default: none)")
    r.add_argument(
        "--section",
        default="results",
        help="the section to replace: between <!-- bench:NAME --> markers",
    )
    r.add_argument(
        "--columns", help="comma-separated CSV columns of the markdown table (default: all)"
    )
    r.add_argument("--plot", help="write a PNG plot here; needs matplotlib (default: none)")
    r.add_argument(
        "--ceiling",
        type=float,
        default=NVLINK_CEILING_GBPS,
        help="the plot's NVLink ceiling line, remote GB/s per rank",
    )
    t = sub.add_parser(
        "trace-summary",
        help="kernel trace files -> time per kernel and phase",
        description="Per kernel and phase of traces written by --trace (or\n"
        "Buffer.dump_trace): the median and slowest program's time and the launch's span.\n"
        "GPU traces are in microseconds (columns *_us); CPU ranks' traces in the\n"
        "interpreter's logical ticks (*_ticks), which order events but are not time.",
        formatter_class=HelpFormatter,
    )
    t.add_argument("traces", nargs="+", help="Chrome trace JSON files")
    return parser


def _launch_constants(settings: list[str]) -> dict[str, int]:
    """``["NAME=VALUE", ...]`` -> ``{NAME: VALUE}``, checked here before any rank starts."""
    from ..modes.normal import LAUNCH_CONSTANTS, check_launch_constants

    values = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or not value.strip().isdigit():
            raise SystemExit(
                f"tritonep bench: --launch expects NAME=VALUE with NAME one of "
                f"{', '.join(LAUNCH_CONSTANTS)}, got {setting!r}"
            )
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
        tokens=SWEEPS[args.mode][pick] if tokens == "sweep" else _ints(tokens),
        hidden=_ints(args.hidden or defaults["hidden"][pick]),
        topk=_ints(args.topk or defaults["topk"][pick]),
        experts=_ints(args.experts or defaults["experts"][pick]),
        iters=args.iters or DEFAULT_ITERS[args.mode][pick],
        compare=getattr(args, "compare", None),
        quiet=args.quiet,
        trace=getattr(args, "trace", None),
        csv=args.csv,
        eager=getattr(args, "eager", False),
    )
    if args.mode in ("normal", "internode"):
        opts.launch = _launch_constants(args.launch)
    if args.mode == "normal":
        opts.sms = _ints(args.sms or CONFIG_DEFAULTS["sms"][pick])
        opts.chunk = _ints(args.chunk)
        opts.ring = _ints(args.ring or CONFIG_DEFAULTS["ring"][pick])
        opts.copy_combine = args.copy_combine or bool(args.copy_chunks or args.copy_share)
        opts.copy_chunks = _ints(args.copy_chunks) if args.copy_chunks else [None]
        opts.copy_share = _ints(args.copy_share) if args.copy_share else [None]
    elif args.mode == "low-latency":
        opts.bf16 = args.bf16
        opts.logfmt = args.logfmt
    elif args.mode == "overlap":
        opts.sms = args.sms or int(CONFIG_DEFAULTS["sms"][pick])
        opts.gemm = args.gemm or int(CONFIG_DEFAULTS["gemm"][pick])
        opts.ring = int(CONFIG_DEFAULTS["ring"][pick])
        opts.tune = args.tune
        opts.copy_chunks = _ints(args.copy_chunks) if args.copy_chunks else []
        opts.carveout = _ints(args.carveout)
        from .overlap import STARTS

        opts.blas = args.blas
        opts.start = args.start.split(",")
        unknown = sorted(set(opts.start) - set(STARTS))
        if unknown:
            raise SystemExit(f"--start: {', '.join(unknown)}: expected {' or '.join(STARTS)}")
    if args.mode in ("low-latency", "internode"):
        opts.gpus_per_node = args.gpus_per_node
        opts.nvshmem = args.nvshmem
    return opts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "plot", None):  # before a run that may take hours, not after it
        try:
            report.require_matplotlib()
        except RuntimeError as e:
            print(f"tritonep bench: --plot {e}", file=sys.stderr)
            return 2
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
        print(
            "tritonep bench: ranks that share one GPU (TRITONEP_SHARED_GPU) take turns on it, "
            "so nothing can be timed that way",
            file=sys.stderr,
        )
        return 2
    if args.csv:
        open(args.csv, "w").close()  # a path that cannot be written fails now; rows follow
    rows = []
    for ranks in _ints(args.ranks):
        on_gpu = gpus_suffice(ranks)
        opts = _options(args, on_gpu)
        where = "GPUs" if on_gpu else report.INTERPRETER_NOTE
        print(f"tritonep bench {args.mode}, {ranks} ranks: {where}", file=sys.stderr)
        rows += spawn(_rank_main, ranks, args.mode, opts, timeout=3600)[0]
    report.print_table(rows)
    if args.csv:
        report.write_csv(rows, args.csv)  # the same rows, under every column any of them has
    if getattr(args, "plot", None):
        report.plot(rows, args.plot, args.ceiling)
    return 0
