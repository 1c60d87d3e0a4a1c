"""Benchmark results out: the terminal table, CSV, a PNG plot and the tables of BENCHMARKS.md.

The CSV is the record; the plot and the markdown tables are generated from it, so a figure in
BENCHMARKS.md can always be traced to a file and the command that wrote it. Rows measured on
CPU ranks (``device`` column) are interpreter runs: their table, markdown and plot say so, and
the plot draws no NVLink ceiling beside them.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

#: Columns of the markdown tables, in order, with their headings (those present are used).
TABLE_COLUMNS = {
    "launch": "launch constants",
    "ranks": "ranks",
    "tokens": "tokens",
    "hidden": "hidden",
    "topk": "top-k",
    "experts": "experts",
    "gpus_per_node": "GPUs per node",
    "transport": "to other nodes",
    "sms": "SMs",
    "dispatch_dtype": "dispatch dtype",
    "combine_dtype": "combine dtype",
    "dispatch_us": "dispatch us",
    "dispatch_GBps": "dispatch GB/s",
    "dispatch_remote_GBps": "remote GB/s",
    "fp8_dispatch_us": "FP8 dispatch us",
    "fp8_dispatch_GBps": "FP8 GB/s",
    "fp8_remote_GBps": "FP8 remote GB/s",
    "combine_us": "combine us",
    "combine_GBps": "combine GB/s",
    "combine_remote_GBps": "combine remote GB/s",
    "rail_leg_us": "network leg us",
    "node_leg_us": "NVLink leg us",
    "network_MB": "network MB",
    "nvlink_MB": "NVLink MB",
    "model_dispatch_us": "model us",
    "graph_dispatch_us": "graph dispatch us",
    "graph_fp8_dispatch_us": "graph FP8 dispatch us",
    "graph_combine_us": "graph combine us",
    "kernel_dispatch_us": "kernel dispatch us",
    "kernel_dispatch_GBps": "kernel dispatch GB/s",
    "kernel_fp8_dispatch_us": "kernel FP8 dispatch us",
    "kernel_fp8_dispatch_GBps": "kernel FP8 GB/s",
    "kernel_combine_us": "kernel combine us",
    "kernel_combine_GBps": "kernel combine GB/s",
    "torch_dispatch_us": "torch dispatch us",
    "torch_combine_us": "torch combine us",
    "deep_ep_dispatch_us": "DeepEP dispatch us",
    "deep_ep_combine_us": "DeepEP combine us",
    "eager_pair_us": "eager pair us",
    "eager_pair_defaults_us": "eager pair, defaults us",
    "host_dispatch_us": "host dispatch us",
    "host_combine_us": "host combine us",
}


#: The ``device`` of rows measured on CPU ranks, and what to say beside them.
INTERPRETER = "cpu-interpreter"
INTERPRETER_NOTE = (
    "CPU ranks under the Triton interpreter, whose times (wall-clock us) check that every "
    "code path runs and say nothing of GPU speed"
)


def device_name(device) -> str:
    """A row's ``device``: ``cuda`` (kernels on GPUs) or :data:`INTERPRETER` (CPU ranks)."""
    return "cuda" if device.type == "cuda" else INTERPRETER


def interpreted(rows: list[dict]) -> bool:
    """Whether any row was measured on CPU ranks."""
    return any(row.get("device") == INTERPRETER for row in rows)


#: Columns of ratios near 1, printed to two decimals (the rest to one).
RATIO_SUFFIXES = ("_ratio", "_slowdown")


def _cell(value, column: str = "") -> str:
    if isinstance(value, float):
        digits = 2 if column.endswith(RATIO_SUFFIXES) else 1
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[dict]) -> None:
    """Every column of ``rows``, aligned, on the terminal."""
    cols = list(dict.fromkeys(c for row in rows for c in row))
    cells = [[_cell(row.get(c, ""), c) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    print("  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for r in cells:
        print("  ".join(f"{v:>{w}}" for v, w in zip(r, widths, strict=True)))
    if interpreted(rows):
        print(f"(device {INTERPRETER}: {INTERPRETER_NOTE})")


def write_csv(rows: list[dict], path: str | Path) -> None:
    """``rows`` under every column any of them has."""
    cols = list(dict.fromkeys(c for row in rows for c in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)


def append_csv(row: dict, path: str | Path) -> None:
    """Add ``row`` to the CSV at ``path``, under the header its first row wrote (an empty file
    gets the header of ``row``), so that a run stopped midway keeps the points it measured;
    columns the header lacks wait for :func:`write_csv` at the end of the run."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    cols = next(csv.reader([text.partition("\n")[0]])) if text else list(row)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        if not text:
            writer.writeheader()
        writer.writerow(row)


def read_csv(path: str | Path) -> list[dict]:
    """Rows with numbers parsed back (ints stay ints)."""

    def parse(value: str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value

    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A markdown table of ``columns`` (CSV column names, in that order), by default of the
    known columns present in ``rows``."""
    cols = columns or [c for c in TABLE_COLUMNS if any(c in row for row in rows)]
    lines = [
        "| " + " | ".join(TABLE_COLUMNS.get(c, c) for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(_cell(row.get(c, ""), c) for c in cols) + " |" for row in rows]
    if interpreted(rows):
        lines.append(f"\nDevice {INTERPRETER}: {INTERPRETER_NOTE}.")
    return "\n".join(lines)


def update_markdown(path: str | Path, section: str, text: str) -> None:
    """Replace what lies between ``<!-- bench:SECTION -->`` and ``<!-- /bench:SECTION -->`` in
    ``path`` with ``text`` (the markers are appended first if missing)."""
    path = Path(path)
    doc = path.read_text() if path.exists() else ""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = f"{begin}\n{text}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc)
    else:
        doc = doc.rstrip("\n") + f"\n\n{block}\n"
    path.write_text(doc)


#: Columns that make a measured configuration; a sweep over several of them draws one line
#: per configuration (points of different configurations joined would zig-zag).
CONFIG_COLUMNS = ("mode", "ranks", "gpus_per_node", "hidden", "topk", "experts")


def require_matplotlib():
    """matplotlib's pyplot (headless), or a RuntimeError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # an optional extra
        raise RuntimeError(
            "needs matplotlib: pip install matplotlib (or tritonep's extras: "
            "pip install -e '.[extras]' in a clone)"
        ) from e
    return plt


def plot(rows: list[dict], path: str | Path, ceiling_gbps: float | None = None) -> list[str]:
    """Latency and bandwidth against tokens per rank, tritonep beside the baselines, with the
    NVLink ceiling (remote GB/s per rank) as a line; one line per configuration of a sweep
    (the parameters that vary name it). Rows of CPU ranks get no ceiling and a title that
    says they are interpreter runs. Needs matplotlib. Returns the labels drawn."""
    plt = require_matplotlib()
    on_cpu = interpreted(rows)
    if on_cpu:
        ceiling_gbps = None  # a GPU's link beside interpreted kernels compares nothing
    groups: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["tokens"]):
        groups.setdefault(tuple(row.get(k) for k in CONFIG_COLUMNS), []).append(row)
    varying = [i for i in range(len(CONFIG_COLUMNS)) if len({c[i] for c in groups}) > 1]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    latency = [
        ("dispatch_us", "tritonep dispatch", "C0", "-"),
        ("combine_us", "tritonep combine", "C1", "-"),
        # Device time (calls replayed from a CUDA graph): what decoding under graphs sees.
        ("graph_dispatch_us", "tritonep dispatch, CUDA graph", "C0", "-."),
        ("graph_combine_us", "tritonep combine, CUDA graph", "C1", "-."),
        ("torch_dispatch_us", "torch dispatch", "C0", ":"),
        ("torch_combine_us", "torch combine", "C1", ":"),
        ("deep_ep_dispatch_us", "DeepEP dispatch", "C0", "--"),
        ("deep_ep_combine_us", "DeepEP combine", "C1", "--"),
    ]
    bandwidth = [
        ("dispatch_remote_GBps", "dispatch (remote)", "C0", "-"),
        ("combine_remote_GBps", "combine (remote)", "C1", "-"),
        ("dispatch_GBps", "dispatch (DeepEP accounting)", "C2", "-"),
        ("combine_GBps", "combine (DeepEP accounting)", "C3", "-"),
    ]
    labels = []
    for number, (config, group) in enumerate(groups.items()):
        tag = ", ".join(f"{CONFIG_COLUMNS[i]} {config[i]}" for i in varying)
        marker = "osd^v<>ph*"[number % 10]
        tokens = [r["tokens"] for r in group]
        for axes, series in ((lat, latency), (bw, bandwidth)):
            for key, label, color, style in series:
                values = [r.get(key) for r in group]
                if any(v is not None and v == v for v in values):  # not all missing or NaN
                    label = f"{label} ({tag})" if tag else label
                    axes.plot(tokens, values, style, color=color, marker=marker, label=label)
                    labels.append(label)
    lat.set_xscale("log", base=2)
    clock = "wall-clock us, interpreted" if on_cpu else "us"
    lat.set(yscale="log", xlabel="tokens per rank", ylabel=f"time per call ({clock})")
    lat.legend(fontsize=7)
    if ceiling_gbps:
        bw.axhline(ceiling_gbps, color="k", ls="--", lw=1, label="NVLink ceiling (remote)")
        labels.append("NVLink ceiling (remote)")
    top = max([ceiling_gbps or 0] + [y for line in bw.get_lines() for y in line.get_ydata()])
    bw.set_ylim(0, 1.4 * top if top > 0 else 1)  # room above the ceiling for the legend
    bw.set_xscale("log", base=2)
    bw.set(xlabel="tokens per rank", ylabel="GB/s per rank")
    bw.legend(fontsize=7)
    first = next(iter(groups))
    common = ", ".join(
        f"{CONFIG_COLUMNS[i]} {first[i]}"
        for i in range(len(CONFIG_COLUMNS))
        if i not in varying and first[i] is not None
    )
    title = f"tritonep: {common}"
    if on_cpu:
        title += f"\n{INTERPRETER_NOTE}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels
