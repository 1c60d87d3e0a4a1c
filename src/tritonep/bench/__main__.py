"""``python -m tritonep.bench MODE [options]``: see :mod:`tritonep.bench.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
