"""Start N rank processes with ``torch.distributed`` ready: gloo on CPU, NCCL with one GPU per rank.

Three ways in, one set of environment variables (those ``torchrun`` sets, so code written for
this harness also runs under ``torchrun``):

* ``python -m tritonep.launch -n 4 script.py [args]`` runs a script on 4 ranks; the script calls
  :func:`init_distributed` (as it would under ``torchrun``). The first rank to fail stops the
  others and sets the exit status (128 + N for a rank killed by signal N, whose stack the
  fault handler prints);
* :func:`spawn` runs ``fn(ctx, *args)`` on N ranks and returns every rank's result;
* :class:`RankPool` keeps N ranks alive between calls, which is what the test fixture uses, so a
  test suite pays the process start-up and the rendezvous once.

A rank that raises, dies or runs past the time limit makes the call raise :class:`RankFailure`
with that rank's traceback; ranks left waiting on it are killed, so nothing hangs.

Without enough GPUs, ranks run on the CPU over gloo and Triton kernels run under the Triton
interpreter: ``import tritonep`` turns it on where no GPU is usable, and ranks started here on
the CPU of a machine with too few GPUs get ``TRITON_INTERPRET=1`` in their environment, so it
is on before any kernel is defined (:mod:`tritonep.interpret`).
With ``TRITONEP_SHARED_GPU=1`` every rank runs on GPU 0 instead (gloo between the processes,
buffers mapped through CUDA IPC): compiled kernels on real hardware with any number of ranks,
for checking correctness on a one-GPU machine; timings taken that way mean nothing, since the
ranks' kernels take turns on the GPU.

Each rank takes an equal share of the machine's cores for its host work (:func:`rank_threads`).
With ``TRITONEP_STACK_DUMP_S`` set, a rank task of a pool still running after that many seconds
writes every thread's stack, which tells a rank that compiles or waits on a peer from one busy
on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import interpret
from .heap import shared_gpu
from .validation import default_group

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankContext:
    """What a rank knows about itself once the process group is up."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def group(self) -> dist.ProcessGroup:
        """The default process group. Looked up, not stored: a context kept in a module
        global would otherwise keep the group alive past ``destroy_process_group`` into
        interpreter shutdown, where destroying it can abort the process."""
        return default_group(None)

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group)


def gpus_suffice(num_ranks: int) -> bool:
    """One GPU per local rank is available, or ranks share GPU 0 (``TRITONEP_SHARED_GPU=1``)."""
    if shared_gpu():
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks


def default_backend(num_ranks: int) -> str:
    """NCCL with a GPU per local rank; gloo on CPU ranks and for ranks sharing one GPU."""
    return "nccl" if gpus_suffice(num_ranks) and not shared_gpu() else "gloo"


def _host_store(world_size: int) -> dist.TCPStore:
    """The rendezvous store, hosted by the launching process as torchrun's agent hosts it.

    Binding port 0 here and handing the bound port to the ranks leaves no window in which
    another process could take the port (a free port picked and released would leave one).
    """
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def init_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RankContext:
    """Initialize the default process group from the ``torchrun`` environment variables.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or None to pick NCCL when every local rank has a GPU.
        timeout_s: limit for collectives of the process group.
    Returns:
        the rank's :class:`RankContext`; calling again returns the same context.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = default_backend(local_world)
    if backend == "nccl" or shared_gpu():
        device = torch.device("cuda", 0 if shared_gpu() else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        interpret.use_for_cpu_ranks()
    interpret.check(device)  # kernels built for this rank's device, or what to do
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            # Binding a gloo group to a device (ranks sharing a GPU) would make new_group
            # split it, which gloo cannot do.
            kwargs["device_id"] = device
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    return RankContext(rank, world_size, local_rank, device)


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time.

    Attributes:
        rank: the first rank that failed (``-1`` for a time-out with no failed rank).
        details: that rank's traceback, or what is known.
    """

    def __init__(self, rank: int, details: str):
        self.rank, self.details = rank, details
        super().__init__(details)


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # Every rank is a client of the store the launcher hosts (torchrun's convention).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def rank_threads(num_ranks: int) -> int:
    """Host threads for each of ``num_ranks`` ranks on this machine: ``TRITONEP_RANK_THREADS``,
    else ``OMP_NUM_THREADS``, else an equal share of the cores this process may use.

    Without a share every rank takes every core for its host work (the tests' references) and
    the ranks' thread pools spin against each other: on 4 ranks of a 64-core machine the FP8
    internode tests spent 90 s and more in a few host comparisons. ``torchrun`` sets one thread
    per rank for the same reason."""
    for name in ("TRITONEP_RANK_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(name):
            return max(1, int(os.environ[name]))
    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


def _dump_stacks_later(rank: int):
    """With ``TRITONEP_STACK_DUMP_S`` set, a task still running after that many seconds writes
    where every thread of this rank is (and again every interval): a call that a time limit stops
    from outside leaves nothing else to say whether a rank was compiling a kernel or waiting on a
    peer. The stacks go to ``$TRITONEP_STACK_DUMP_DIR/rank<r>.txt`` (stderr without it), and so
    do those of a rank killed by a fatal signal (a segmentation fault in a compiler, say), which
    otherwise says only its exit code. Returns the open file, or None when off."""
    after = os.environ.get("TRITONEP_STACK_DUMP_S")
    if not after:
        return None
    folder = os.environ.get("TRITONEP_STACK_DUMP_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        stream = open(os.path.join(folder, f"rank{rank}.txt"), "a")  # noqa: SIM115
    else:
        stream = os.fdopen(os.dup(2), "w")
    stream.write(f"--- task started {time.strftime('%H:%M:%S')}\n")
    stream.flush()
    faulthandler.dump_traceback_later(float(after), repeat=True, file=stream)
    faulthandler.enable(file=stream, all_threads=True)
    return stream


def _worker(rank, world_size, port, backend, collective_timeout_s, tasks, results):
    os.environ.update(_rank_env(rank, world_size, port))
    torch.set_num_threads(rank_threads(world_size))
    try:
        ctx = init_distributed(backend, collective_timeout_s)
    except BaseException:
        results.put((0, rank, False, traceback.format_exc()))
        return
    results.put((0, rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        stacks = _dump_stacks_later(rank)
        try:
            results.put((task_id, rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            if stacks is not None:
                faulthandler.cancel_dump_traceback_later()
                faulthandler.enable()  # back to stderr before the file closes
                stacks.close()
    # Tear down together (see tests/rank_scripts/allreduce.py).
    dist.barrier()
    dist.destroy_process_group()
    # Then leave at once: the interpreter's own shutdown (torch's and Triton's finalizers) can
    # take seconds, or hang for good, after everything that matters is done. What is left to
    # release goes with the process (the CPU heaps' files were unlinked once mapped), so only
    # the results still in this queue's feeder thread, and the output streams, need flushing.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _cpu_rank_environment(on_cpu: bool):
    """While rank processes start: ``TRITON_INTERPRET=1`` for ranks on the CPU, unless set.

    A spawned process imports the parent's ``__main__`` (which may import the kernels) before
    it runs any code of ours, so only its environment can turn the interpreter on in time; the
    parent's own setting is restored at once (its kernels, and pools it starts later on GPUs,
    keep theirs)."""
    if not on_cpu or os.environ.get(interpret.ENV):
        yield
        return
    os.environ[interpret.ENV] = "1"
    try:
        yield
    finally:
        del os.environ[interpret.ENV]


class RankPool:
    """N rank processes that stay alive between :meth:`run` calls.

    Args:
        num_ranks: processes to start.
        backend: as in :func:`init_distributed` (None: NCCL if there is a GPU for every rank).
        collective_timeout_s: limit of the process group's collectives.
        startup_timeout_s: limit for every rank to start and join the process group.
    After a failed call the pool is :attr:`broken` and must be replaced.
    """

    def __init__(
        self,
        num_ranks: int,
        backend: str | None = None,
        collective_timeout_s: float = 120.0,
        startup_timeout_s: float = 300.0,
    ):
        if backend is None:
            backend = default_backend(num_ranks)
        self.num_ranks, self.backend, self.broken = num_ranks, backend, False
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(num_ranks)]
        self._store = _host_store(num_ranks)
        port = self._store.port
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    num_ranks,
                    port,
                    backend,
                    collective_timeout_s,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            for r in range(num_ranks)
        ]
        with _cpu_rank_environment(backend == "gloo" and not shared_gpu()):
            for p in self._procs:
                p.start()
        self._collect(0, startup_timeout_s, "start")
        self._next_task = 1

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; returns the results ordered by rank.

        Raises:
            RankFailure: a rank raised or died (its traceback is the message), or ranks were
                still running after ``timeout`` seconds (the message names them).
        """
        if self.broken:
            raise RuntimeError("this RankPool is broken by an earlier failure; make a new one")
        task_id, self._next_task = self._next_task, self._next_task + 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        return self._collect(task_id, timeout, "finish")

    def _collect(self, task_id: int, timeout: float, what: str) -> list[Any]:
        done: dict[int, Any] = {}
        failures: list[tuple[int, str]] = []
        deadline = time.monotonic() + timeout
        while len(done) + len(failures) < self.num_ranks:
            now = time.monotonic()
            if failures:
                # Peers of a failed rank may wait on it forever; give them a moment to fail too.
                deadline = min(deadline, now + 5.0)
            if now >= deadline:
                break
            try:
                tid, rank, ok, payload = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                for rank, p in enumerate(self._procs):
                    reported = rank in done or any(r == rank for r, _ in failures)
                    if not p.is_alive() and not reported:
                        failures.append((rank, f"rank {rank} exited with code {p.exitcode}"))
                continue
            if tid != task_id:
                continue
            if ok:
                done[rank] = payload
            else:
                failures.append((rank, payload))
        if failures or len(done) < self.num_ranks:
            failed = dict(failures)
            missing = [r for r in range(self.num_ranks) if r not in done and r not in failed]
            self.close(force=True)
            if failures:
                rank, details = failures[0]
                others = sorted(set(failed) - {rank} | set(missing))
                extra = f"\n(ranks {others} failed or were stopped too)" if others else ""
                raise RankFailure(rank, f"rank {rank} failed:\n{details}{extra}")
            raise RankFailure(-1, f"ranks {missing} did not {what} within {timeout:g} s")
        return [done[r] for r in range(self.num_ranks)]

    def close(self, force: bool = False) -> None:
        """Stop the ranks (``force``: kill them without asking)."""
        self.broken = True
        if not force:
            for q in self._tasks:
                q.put(None)
            # One deadline for all: the ranks stop together (a barrier), so their exits overlap.
            deadline = time.monotonic() + 10.0
            for p in self._procs:
                p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def spawn(
    fn: Callable[..., Any],
    num_ranks: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``num_ranks`` fresh ranks; returns results by rank.

    ``fn`` must be importable by name (defined at module level), as with any spawned process.
    """
    pool = RankPool(num_ranks, backend)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if not pool.broken:
            pool.close()


def main(argv: list[str] | None = None) -> int:
    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m tritonep.launch",
        description="Run a script (or -m module) on N local ranks, like torchrun --nproc_per_node.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--timeout", type=float, help="kill all ranks after this many seconds (default: none)"
    )
    parser.add_argument("-m", dest="module", action="store_true", help="run the target as a module")
    parser.add_argument("target", help="script path (or module name with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    opts = parser.parse_args(argv)
    if opts.nproc < 1:
        parser.error("-n must be at least 1")
    store = _host_store(opts.nproc)
    port = store.port
    cmd = [sys.executable, *(["-m"] if opts.module else []), opts.target, *opts.args]
    on_cpu = not gpus_suffice(opts.nproc)
    procs = []
    for rank in range(opts.nproc):
        env = dict(os.environ, **_rank_env(rank, opts.nproc, port))
        # A rank killed by a signal (an abort in native code) prints where each of its threads
        # was, so the launcher's report of its exit code comes with the cause.
        env.setdefault("PYTHONFAULTHANDLER", "1")
        env.setdefault("OMP_NUM_THREADS", str(rank_threads(opts.nproc)))
        if on_cpu:
            # Kernels run under the interpreter, which must be chosen before any is defined
            # (a script may import the kernels before calling init_distributed).
            env.setdefault(interpret.ENV, "1")
        procs.append(subprocess.Popen(cmd, env=env))
    # One waiter per rank reports its exit the moment it happens, so the first rank to fail is
    # the one named: a peer that dies of the broken connection a few milliseconds later must not
    # be mistaken for the cause (polling would see both exits at once).
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, q=p: exits.put((r, q.wait())), daemon=True).start()
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    code, running = 0, len(procs)
    while running:
        wait_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            rank, returncode = exits.get(timeout=wait_s)
        except queue.Empty:
            why, code = "time limit passed", 124
        else:
            running -= 1
            if returncode == 0:
                continue
            # A rank killed by signal N exits as a shell reports it, 128 + N (not N - 256).
            why = f"rank {rank} exited with code {returncode}"
            code = returncode if returncode > 0 else 128 - returncode
        print(f"tritonep.launch: {why}; stopping the other ranks", file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.kill()
        break
    for p in procs:
        p.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
