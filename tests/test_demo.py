"""The README's first command keeps working: the demo runs and checks itself."""

import os
import subprocess
import sys

import torch


def test_demo_runs_and_passes_its_checks():
    # 4 ranks, on GPUs where there are 4, else on CPU ranks; a machine with fewer GPUs runs
    # one rank per GPU instead (the interpreter is for machines without GPUs).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = 4 if gpus == 0 or gpus >= 4 else gpus
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "tritonep.demo", "--ranks", str(ranks)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every received row matches the reference" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == [str(r) for r in range(ranks)]
    assert all(r[6] == "True" for r in rows)  # the heap ring
