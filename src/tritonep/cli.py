"""The ``tritonep`` command: ``tritonep bench ...`` and ``tritonep demo ...``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"bench": "benchmarks (see tritonep bench -h)", "demo": "the MoE demo"}
    if not argv or argv[0] not in commands:
        print("usage: tritonep {bench,demo} ...", file=sys.stderr)
        for name, what in commands.items():
            print(f"  {name:6} {what}", file=sys.stderr)
        return 2
    if argv[0] == "bench":
        from .bench.cli import main as bench
    else:
        from .demo import main as bench
    return bench(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
