"""The README's first command works as a user runs it: the demo runs and checks itself."""

import subprocess
import sys

from tests.conftest import machine_gpus, user_env


def test_demo_runs_and_passes_its_checks(tmp_path):
    # `python -m tritonep.demo` as the README writes it, in a user's environment: nothing of
    # this suite's (no TRITON_INTERPRET), so the demo picks the Triton backend by itself. Its
    # 4 ranks run on GPUs where there are 4, else on CPU ranks; a machine with 1 to 3 GPUs
    # runs one rank per GPU instead (the interpreter is for machines without GPUs).
    gpus = machine_gpus()
    args = [] if gpus == 0 or gpus >= 4 else ["--ranks", str(gpus)]
    command = [sys.executable, "-m", "tritonep.demo", *args]
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=user_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every received row matches the reference" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    ranks = int(args[1]) if args else 4
    assert [r[0] for r in rows] == [str(r) for r in range(ranks)]
    assert all(r[6] == "True" for r in rows)  # the heap ring
