"""scripts/gpu_check.sh, the one command every device call runs: it parses, and a part runs
end to end on CPU ranks (a broken script costs a device call's minutes)."""

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(os.environ.get("TRITONEP_SHARED_GPU") == "1", reason="CPU ranks only")
def test_soak_par_runs_on_cpu_ranks_and_packs_its_logs(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), SOAK_CALLS="2", SOAK_CHECK_EVERY="1",
               SOAK_MODES="normal low_latency")  # fmt: skip
    env.pop("TRITON_INTERPRET", None)  # the soak sets up its own ranks
    proc = subprocess.run(["bash", str(SCRIPT), "2", "soak-par"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in ("normal", "low_latency"):
        log = (tmp_path / f"soak-{mode}.log").read_text()
        assert "every checked call matched the reference" in log, log[-2000:]
        assert f"'{mode}': {{'calls': 2, 'checked': 2" in log, log[-2000:]
    with tarfile.open(tmp_path / "00-results.tar.gz") as results:
        assert {"./soak-normal.log", "./soak-low_latency.log"} <= set(results.getnames())
