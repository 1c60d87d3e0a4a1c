"""``python -m tritonep.bench MODE [options]``: see :mod:`tritonep.bench`."""

from __future__ import annotations

import argparse
import csv
import sys

import torch

from ..launch import spawn
from .low_latency import low_latency_rank
from .normal import normal_rank


def _print_table(rows):
    cols = list(rows[0])
    print("  ".join(f"{c:>17}" for c in cols))
    for r in rows:
        print(
            "  ".join(f"{r[c]:>17.1f}" if isinstance(r[c], float) else f"{r[c]:>17}" for c in cols)
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonep.bench")
    parser.add_argument("mode", choices=["low-latency", "normal"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--tokens", default=None, help="comma-separated tokens per rank (128; normal: 4096)"
    )
    parser.add_argument("--sms", default="24", help="normal: comma-separated SM budgets")
    parser.add_argument("--chunk", default="8", help="normal: comma-separated send chunks")
    parser.add_argument("--ring", default="128", help="normal: comma-separated ring slots")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--bf16", action="store_true", help="dispatch BF16 instead of FP8")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--csv", default=None)
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs GPUs", file=sys.stderr)
        return 2
    if opts.tokens is None:
        opts.tokens = "4096" if opts.mode == "normal" else "128"
    opts.sms_list = [int(v) for v in opts.sms.split(",")]
    opts.chunk_list = [int(v) for v in opts.chunk.split(",")]
    opts.ring_list = [int(v) for v in opts.ring.split(",")]
    rank_fn = normal_rank if opts.mode == "normal" else low_latency_rank
    rows = spawn(rank_fn, opts.ranks, opts, backend="nccl", timeout=560)[0]
    _print_table(rows)
    if opts.csv:
        with open(opts.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
