"""The rank harness: results by rank, failures with the failing rank's traceback, no hangs."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import machine_gpus, user_env
from tritonep.launch import RankFailure, rank_threads, spawn

SCRIPTS = Path(__file__).parent / "rank_scripts"


def _sum_ranks(ctx, offset):
    t = torch.tensor([float(ctx.rank + offset)], device=ctx.device)
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, float(t.item()), ctx.backend


def _raise_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        raise KeyError(f"broken expert table on rank {ctx.rank}")
    dist.barrier()  # the others wait for the failed rank
    return ctx.rank


def _sleep(ctx, seconds):
    time.sleep(seconds if ctx.rank == 0 else 0)
    return ctx.rank


def _threads(ctx):
    return torch.get_num_threads()


def _sum_ranks_and_threads(ctx, offset):
    return (*_sum_ranks(ctx, offset)[:3], _threads(ctx))


def test_ranks_take_the_host_threads_they_are_given(monkeypatch):
    """``TRITONEP_RANK_THREADS`` caps each rank's host threads (runs sharing a machine)."""
    monkeypatch.setenv("TRITONEP_RANK_THREADS", "3")  # no default on a 2-core machine
    assert spawn(_threads, 2) == [3, 3]


def test_spawn_returns_results_by_rank_and_ranks_share_the_cores(monkeypatch):
    """Results come back in rank order. Without a setting, each rank takes an equal share of
    the cores (at least one): ranks that each take them all spin against each other in their
    host work."""
    monkeypatch.delenv("TRITONEP_RANK_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = max(1, len(os.sched_getaffinity(0)) // 3)
    results = spawn(_sum_ranks_and_threads, 3, 10)
    assert results == [(0, 3, 33.0, share), (1, 3, 33.0, share), (2, 3, 33.0, share)]
    assert rank_threads(3) == share and rank_threads(10**6) == 1


def _sleep_in_a_named_frame(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


def test_a_long_task_writes_every_ranks_stacks(monkeypatch, tmp_path):
    """``TRITONEP_STACK_DUMP_S``: a task still running after that long writes where each
    rank's threads are, one file per rank, and nothing once the task has ended."""
    monkeypatch.setenv("TRITONEP_STACK_DUMP_S", "0.5")
    monkeypatch.setenv("TRITONEP_STACK_DUMP_DIR", str(tmp_path))
    assert spawn(_sleep_in_a_named_frame, 2, 1.3) == [0, 1]
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.startswith("--- task started") and "_sleep_in_a_named_frame" in text
        assert 1 <= text.count("Timeout (0:00:00.500000)!") <= 3, text


def _crash_in_a_named_frame(ctx, crash_rank):
    if ctx.rank == crash_rank:
        import ctypes

        ctypes.string_at(0)  # a segmentation fault, as a crashing compiler would raise
    time.sleep(0.5)
    return ctx.rank


def test_a_rank_killed_by_a_fatal_signal_writes_its_stacks(monkeypatch, tmp_path):
    """A rank that dies of a signal says no more than its exit code; with
    ``TRITONEP_STACK_DUMP_S`` its file names where it was."""
    monkeypatch.setenv("TRITONEP_STACK_DUMP_S", "60")
    monkeypatch.setenv("TRITONEP_STACK_DUMP_DIR", str(tmp_path))
    with pytest.raises(RankFailure, match="rank 1 exited with code -11"):
        spawn(_crash_in_a_named_frame, 2, 1, timeout=60)
    text = (tmp_path / "rank1.txt").read_text()
    assert "Segmentation fault" in text and "_crash_in_a_named_frame" in text, text
    assert "Segmentation fault" not in (tmp_path / "rank0.txt").read_text()


def test_pool_reports_the_failing_rank_and_recovers(run_ranks):
    with pytest.raises(RankFailure) as info:
        run_ranks(3, _raise_on_rank, 2, timeout=60)
    assert info.value.rank == 2
    assert "KeyError: 'broken expert table on rank 2'" in str(info.value)
    assert "Traceback" in str(info.value)
    # A new pool replaces the broken one.
    assert [r[2] for r in run_ranks(3, _sum_ranks, 0)] == [3.0, 3.0, 3.0]


def test_pool_time_limit_names_the_late_rank(run_ranks):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 2 s"):
        run_ranks(2, _sleep, 60, timeout=2)
    assert time.monotonic() - start < 30


def _launch(script, n, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tritonep.launch",
            "-n",
            str(n),
            "--timeout",
            str(timeout),
            str(script),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout + 60,
    )


def test_cli_runs_a_torchrun_script():
    proc = _launch(SCRIPTS / "allreduce.py", 3, 120)
    assert proc.returncode == 0, proc.stderr
    # Ranks share stdout, so their lines may interleave; each must say it passed.
    assert sorted(re.findall(r"rank \d/3 ok", proc.stdout)) == [f"rank {r}/3 ok" for r in range(3)]


def test_cli_stops_all_ranks_when_one_fails():
    start = time.monotonic()
    proc = _launch(SCRIPTS / "fail_on_rank1.py", 2, 120)
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    assert time.monotonic() - start < 100


def test_cli_shows_where_a_rank_aborted():
    # A rank killed by a signal leaves no Python traceback of its own: the launcher turns on
    # the fault handler, so its stack comes with the exit code.
    proc = _launch(SCRIPTS / "abort_on_rank1.py", 2, 120)
    assert proc.returncode == 128 + 6, proc.stderr  # SIGABRT, as a shell reports it
    assert "rank 1 exited with code -6" in proc.stderr
    assert "Fatal Python error: Aborted" in proc.stderr
    assert "expert_table_check" in proc.stderr


def test_spawn_from_a_script_that_imports_tritonep_at_the_top(tmp_path):
    """Spawned ranks import the script again before any code of tritonep's runs in them; with
    a user's environment (no TRITON_INTERPRET) they still build their kernels for the right
    backend: the interpreter on CPU ranks, inherited from the script's process."""
    command = [sys.executable, str(SCRIPTS / "user_script.py"), "spawn"]
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=user_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    backend = "''" if machine_gpus() >= 2 else "'1'"  # TRITON_INTERPRET seen by each rank
    assert f"spawn: [(True, {backend}), (True, {backend})]" in proc.stdout, proc.stdout


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="2 GPUs, or none (CPU ranks)")
def test_torchrun_script_with_its_own_process_group(tmp_path):
    """torchrun starts a script that imports tritonep and makes its own process group (gloo on
    CPU ranks): the kernels run under the interpreter without being told to."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, "--nproc_per_node=2", str(SCRIPTS / "user_script.py")]
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env=user_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert sorted(re.findall(r"rank \d/2 ok", proc.stdout)) == ["rank 0/2 ok", "rank 1/2 ok"]
