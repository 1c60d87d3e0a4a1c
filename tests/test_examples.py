"""The examples run as their docstrings say (CPU ranks here, through the launcher)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--gpus-per-node", "1"],
        ["--checkpoint", "full"],
        ["--compile", "--checkpoint", "selective"],
    ],
    ids=["one-node", "2-nodes", "full-checkpoint", "compiled-selective-checkpoint"],
)
def test_train_moe_example(extra):
    cmd = [sys.executable, "-m", "tritonep.launch", "-n", "2", "--timeout", "300",
           str(EXAMPLES / "train_moe.py"), "--steps", "2", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
    # Both streams: whether the ranks got through their steps tells a crash in them from one
    # at exit.
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    assert "first step matches the dense layer" in proc.stdout
    assert proc.stdout.count("mean loss") == 2
