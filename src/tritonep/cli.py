"""The ``tritonep`` command: ``tritonep bench``, ``tritonep soak``, ``tritonep demo``."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "bench": "benchmarks beside the torch backend (see tritonep bench -h)",
    "soak": "randomized calls checked against the reference (see tritonep soak -h)",
    "demo": "the MoE demo, checked against a dense layer",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every command's help: the description as written, and each option's default after its
    help, except where the help says it (``default`` in the text) or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or action.default == []
        if nothing or action.default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"tritonep {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        out = sys.stdout if asked else sys.stderr
        print("usage: tritonep {bench,soak,demo} ... | --version", file=out)
        for name, what in COMMANDS.items():
            print(f"  {name:6} {what}", file=out)
        return 0 if asked else 2
    if argv[0] == "bench":
        from .bench.cli import main as command
    elif argv[0] == "soak":
        from .soak import main as command
    else:
        from .demo import main as command
    return command(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
