"""Test harness: run a test body on N rank processes, on GPUs when there are enough of them.

Rank pools are kept for the whole session (one per rank count), so the suite pays process
start-up and rendezvous once per size. A failing or hanging body fails the test with the
failing rank's traceback and the pool is replaced.
"""

import os
import sys

import torch

import tritonep  # noqa: F401  (before any test module defines a kernel: it picks the backend)

# Every rank process inherits it, whichever test module it imports: outputs are filled with a
# marker before each call, so a row that no kernel wrote cannot pass for a right one.
os.environ.setdefault("TRITONEP_POISON_OUTPUTS", "1")

import pytest

from tritonep.heap import shared_gpu
from tritonep.launch import RankPool, gpus_suffice

#: Set for this suite's processes (``import tritonep`` sets the first on CPU-only machines).
SUITE_SETTINGS = ("TRITON_INTERPRET", "TRITONEP_POISON_OUTPUTS")


def user_env(**extra: str) -> dict[str, str]:
    """The environment a user's command starts with: this one without :data:`SUITE_SETTINGS`,
    with the path to this source tree."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_SETTINGS}
    return dict(env, PYTHONPATH=os.pathsep.join(sys.path), **extra)


def machine_gpus() -> int:
    """GPUs the rank processes may use: with ``TRITONEP_SHARED_GPU=1`` four ranks share GPU 0."""
    if shared_gpu():
        return 4
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_ranks() -> int:
    """Ranks for a GPU test: every GPU of the machine, up to 4."""
    return min(4, machine_gpus())


def skip_unless_ranks_fit(num_ranks: int) -> None:
    """On a GPU machine every rank runs on a GPU: rank counts beyond its GPUs are left to the
    CPU suite rather than run under the interpreter there (whose numpy the GPU image need not
    suit)."""
    gpus = machine_gpus()
    if gpus and num_ranks > gpus:
        pytest.skip(f"{num_ranks} ranks, {gpus} GPUs (covered by the CPU suite)")


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(n, fn, *args, timeout=...)`` runs ``fn(ctx, *args)`` on n ranks."""
    pools: dict[int, RankPool] = {}

    def run(num_ranks, fn, *args, timeout=300.0, **kwargs):
        skip_unless_ranks_fit(num_ranks)
        pool = pools.get(num_ranks)
        if pool is None or pool.broken:
            pool = pools[num_ranks] = RankPool(num_ranks)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    yield run
    for pool in pools.values():
        if not pool.broken:
            pool.close()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not gpus_suffice(
            item.get_closest_marker("gpu").kwargs.get("n", 1)
        ):
            item.add_marker(skip)
