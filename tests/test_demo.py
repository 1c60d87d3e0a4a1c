"""The README's first command keeps working: the demo runs and checks itself."""

import os
import subprocess
import sys


def test_demo_runs_and_passes_its_checks():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "tritonep.demo", "--ranks", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every received row matches the reference" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert all(r[6] == "True" for r in rows)  # the heap ring
