"""Write the PTX of every kernel variant the compile tests build, for comparing two trees.

    PYTHONPATH=src python scripts/ptx_dump.py OUT_DIR

Compiles each variant of ``tests/test_kernels_compile.py``'s ``KERNELS`` for sm_90 (no GPU
needed) and writes ``OUT_DIR/<index>-<kernel><variant>.ptx`` with source line records and comments
left out, so that a change that should not alter what runs (a refactor) can be checked by
``diff -r`` of the directories written from the two trees. A variant that fails to compile
is written as ``ERROR`` and its traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, os.getcwd())
    import tests.test_kernels_compile as compile_tests

    compiled = compile_tests._compiled_kernels()
    for i, kernel in enumerate(compile_tests.KERNELS):
        result = compiled[json.dumps(compile_tests._job(*kernel))]
        text = result.get("ptx") or "ERROR\n" + result["error"]
        lines = [ln for ln in text.splitlines() if not re.match(r"\s*(\.loc|\.file|//)", ln)]
        text = re.sub(r"\.section\s+\.debug.*", "", "\n".join(lines), flags=re.S)
        (out / f"{i:03d}-{kernel[1]}{compile_tests._id(kernel)}.ptx").write_text(text)
    print(f"{len(compile_tests.KERNELS)} variants in {out}")


if __name__ == "__main__":
    main()
