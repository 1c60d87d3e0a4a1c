"""The examples run as their docstrings say, in a user's environment (CPU ranks here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import machine_gpus, user_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAUNCH = [sys.executable, "-m", "tritonep.launch", "-n", "2", "--timeout", "300"]
# torchrun on a free port; its ranks learn nothing from it about the Triton backend.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(command, tmp_path):
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=user_env(), timeout=360
    )
    # Both streams: whether the ranks got through their work tells a crash in it from one at
    # exit.
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize(
    "start, extra",
    [
        # Each option of the example runs once; the options meet in two runs, each of whose
        # starts its ranks and imports torch afresh. Full checkpointing runs the dispatch
        # again in the backward pass; the compiled, selectively checkpointed layer crosses
        # 2 emulated nodes.
        (TORCHRUN, ["--checkpoint", "full"]),
        (LAUNCH, ["--gpus-per-node", "1", "--compile", "--checkpoint", "selective"]),
    ],
    ids=["torchrun-one-node-full-checkpoint", "2-nodes-compiled-selective-checkpoint"],
)
def test_train_moe_example(tmp_path, start, extra):
    if start is TORCHRUN and 0 < machine_gpus() < 2:
        pytest.skip("2 GPUs, or none (CPU ranks)")
    out = _run([*start, str(EXAMPLES / "train_moe.py"), "--steps", "2", *extra], tmp_path)
    assert "first step matches the dense layer" in out
    assert out.count("mean loss") == 2


def test_deepep_quickstart_example(tmp_path):
    out = _run([*LAUNCH, str(EXAMPLES / "deepep_quickstart.py")], tmp_path)
    # Ranks share stdout, so their lines may run together; each must say it passed.
    said = re.findall(r"rank \d/2: normal and low-latency mode match the hand computation", out)
    assert sorted(said) == [
        f"rank {r}/2: normal and low-latency mode match the hand computation" for r in range(2)
    ]
