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
@pytest.mark.parametrize(
    "part, modes", [("soak-par", ("normal", "low_latency")), ("tests-soak", ("low_latency",))]
)
def test_soak_parts_run_on_cpu_ranks_and_pack_their_logs(tmp_path, part, modes):
    """soak-par, and tests-soak (the GPU tests beside it: all skipped on CPU ranks)."""
    env = dict(os.environ, OUT=str(tmp_path), SOAK_CALLS="2", SOAK_CHECK_EVERY="1",
               SOAK_MODES=" ".join(modes), PACK_CACHE="0")  # fmt: skip
    env.pop("TRITON_INTERPRET", None)  # the soak sets up its own ranks
    proc = subprocess.run(["bash", str(SCRIPT), "2", part], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = {f"./soak-{mode}.log" for mode in modes}
    for mode in modes:
        log = (tmp_path / f"soak-{mode}.log").read_text()
        assert "every checked call matched the reference" in log, log[-2000:]
        assert f"'{mode}': {{'calls': 2, 'checked': 2" in log, log[-2000:]
    if part == "tests-soak":
        log = (tmp_path / "gpu_tests.log").read_text()
        assert " skipped" in log and " failed" not in log, log[-2000:]
        assert "== GPU tests" in proc.stdout, proc.stdout[-2000:]
        logs.add("./gpu_tests.log")
    with tarfile.open(tmp_path / "00-results.tar.gz") as results:
        assert logs <= set(results.getnames())


@pytest.mark.skipif(os.environ.get("TRITONEP_SHARED_GPU") == "1", reason="CPU ranks only")
@pytest.mark.parametrize("extra", ["", "--per-peer"])
def test_a2a_probe_part_runs_on_cpu_ranks(tmp_path, extra):
    """The a2a part: every rank pushes its rows into every peer's heap, each slot checked."""
    args = f"--rows 5 --words 64 --iters 1 --tok 4 --bw 32 {extra}"
    env = dict(os.environ, OUT=str(tmp_path), A2A_PROGRAMS="2,4", A2A_ARGS=args,
               PACK_CACHE="0", TRITON_INTERPRET="1")  # fmt: skip
    proc = subprocess.run(["bash", str(SCRIPT), "3", "a2a"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "a2a_probe.log").read_text()
    assert "3 ranks, 5 rows x 64 words to each peer" in log, log
    # One peer per program needs a multiple of the 2 peers: both counts run.
    assert "  2 programs:" in log and "  4 programs:" in log, log
