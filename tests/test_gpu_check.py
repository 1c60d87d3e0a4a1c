"""scripts/gpu_check.sh and the probes under scripts/probes/: the script parses, its steps run
end to end on CPU ranks and leave their logs, and the all-to-all probe checks what it pushed
(a broken script costs a GPU machine's minutes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CPU_ONLY = pytest.mark.skipif(os.environ.get("TRITONEP_SHARED_GPU") == "1", reason="CPU ranks only")


def _run(args, env, timeout=600):
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@CPU_ONLY
def test_tests_step_runs_pytest_and_keeps_its_log(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TESTS=f"{__file__}::test_script_parses")
    proc = _run(["bash", str(SCRIPT), "2", "tests"], env)
    log = (tmp_path / "tests.log").read_text()
    assert "1 passed" in log and "1 passed" in proc.stdout, log[-2000:]


@CPU_ONLY
def test_soak_step_runs_on_cpu_ranks(tmp_path):
    modes = ("normal", "low_latency")
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        SOAK_ARGS=f"--modes {','.join(modes)} --calls 1 --check-every 1",
    )
    env.pop("TRITON_INTERPRET", None)  # the soak sets up its own ranks
    _run(["bash", str(SCRIPT), "2", "soak"], env)
    log = (tmp_path / "soak.log").read_text()
    assert "every checked call matched the reference" in log, log[-2000:]
    for mode in modes:
        assert f"'{mode}': {{'calls': 1, 'checked': 1" in log, log[-2000:]


@CPU_ONLY
@pytest.mark.parametrize("extra", ["", " --per-peer"])
def test_a2a_probe_runs_on_cpu_ranks(extra):
    """Every rank pushes its rows into every peer's heap, each slot checked."""
    probe = ROOT / "scripts" / "probes" / "a2a_probe.py"
    args = f"--ranks 3 --programs 2,4 --rows 5 --words 64 --iters 1 --tok 4 --bw 32{extra}".split()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    log = _run([sys.executable, str(probe), *args], env).stdout
    assert "3 ranks, 5 rows x 64 words to each peer" in log, log
    # One peer per program needs a multiple of the 2 peers: both counts run.
    assert "  2 programs:" in log and "  4 programs:" in log, log


@CPU_ONLY
def test_overlap_probe_runs_on_cpu_ranks():
    """The overlap probe's every variant runs (epilogue launch kind, stream priority,
    operation), each line with its times."""
    probe = ROOT / "scripts" / "probes" / "overlap_probe.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    log = _run([sys.executable, str(probe), "2", "4", "32", "256", "16", "4"], env).stdout
    assert "2 ranks, 4 tokens, hidden 256, top-4 of 16 experts" in log, log
    for pdl in ("True", "False"):
        for priority in ("0", "-1"):
            for op in ("dispatch", "combine"):
                start = f"{op}, PDL {pdl}, priority {priority}: alone "
                (line,) = [line for line in log.splitlines() if line.startswith(start)]
                assert "beside the GEMM: GEMM" in line and "communication" in line, line


@CPU_ONLY
def test_copy_engine_probe_checks_every_call_on_cpu_ranks():
    """The copy-engine probe runs each call and checks its rows (the reduce's sums too)
    before printing its line; a failed check prints FAILED instead."""
    probe = ROOT / "scripts" / "probes" / "copy_engine_probe.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1")
    log = _run([sys.executable, str(probe), "--cpu"], env).stdout
    assert "3 ranks on cpu, 12 tokens x 64 BF16" in log, log
    assert "FAILED" not in log, log
    for call in (
        "dispatch copies", "dispatch gather", "dispatch pipelined", "combine copies",
        "combine reduce", "combine own direct", "combine split",
    ):  # fmt: skip
        assert sum(line.startswith(call + " ") for line in log.splitlines()) == 1, (call, log)
