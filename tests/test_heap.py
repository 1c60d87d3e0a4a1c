"""Symmetric heap and the put/signal kernel: the same bodies run on CPU ranks and on GPUs."""

import time

import pytest
import torch

from tests.conftest import gpu_ranks
from tritonep import heap
from tritonep.errors import HeapGuardError, WaitTimeoutError
from tritonep.heap import shared_gpu
from tritonep.kernels.put_signal import put_signal, wait_signal

DATA_OFFSET, FLAG_OFFSET = 1024, 0


def _ring_body(ctx, rounds, num_elems, backend=None, via="store"):
    """Each rank puts a block into the next rank and raises its flag, for several rounds."""
    if backend is not None:
        heap.set_backend(backend)
    h = heap.allocate(DATA_OFFSET + 4 * num_elems, device=ctx.device)
    assert h.peer_ptrs.dtype == torch.int64 and h.peer_ptrs.shape == (ctx.world_size,)
    assert h.peer_ptrs.device == ctx.device
    assert int(h.peer_ptrs[ctx.rank]) == h.local.data_ptr()
    R, me = ctx.world_size, ctx.rank
    nxt, prev = (me + 1) % R, (me - 1) % R
    gen = torch.Generator().manual_seed(1234)
    for it in range(1, rounds + 1):
        # Fresh random blocks every round, known to every rank.
        blocks = [
            torch.randint(-(2**31), 2**31 - 1, (num_elems,), generator=gen, dtype=torch.int32)
            for _ in range(R)
        ]
        # Poison my receive area so a missing write shows.
        h.view(me, torch.int32, (num_elems,), DATA_OFFSET).fill_(-7)
        h.barrier()
        put_signal(h, blocks[me].to(ctx.device), nxt, DATA_OFFSET, FLAG_OFFSET, it, via=via)
        try:
            wait_signal(h, FLAG_OFFSET, value=it, peer=prev, timeout_s=30)
        except WaitTimeoutError as e:
            # What did arrive: the flag word, the block, or the put landed in this rank's own
            # buffer (a destination translated wrongly)?
            flag = int(h.view(me, torch.int64, (1,), FLAG_OFFSET).cpu()[0])
            got = h.view(me, torch.int32, (num_elems,), DATA_OFFSET).cpu()
            raise AssertionError(
                f"rank {me} round {it} via {via}: flag {flag}, block from {prev} "
                f"{'arrived' if torch.equal(got, blocks[prev]) else 'missing'}, own block "
                f"{'here' if torch.equal(got, blocks[me]) else 'not here'}"
            ) from e
        got = h.view(me, torch.int32, (num_elems,), DATA_OFFSET).cpu()
        assert torch.equal(got, blocks[prev]), f"rank {me} round {it}: wrong block from {prev}"
        h.barrier()  # every rank's block has arrived
        # Through this rank's mapping of the next rank's buffer: the block put there.
        there = h.view(nxt, torch.int32, (num_elems,), DATA_OFFSET).cpu()
        assert torch.equal(there, blocks[me]), f"rank {me} round {it}: peer view of {nxt}"
        h.barrier()  # before any rank poisons its buffer for the next round
    h.close()
    return True


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_put_signal_ring(run_ranks, num_ranks):
    assert run_ranks(num_ranks, _ring_body, 3, 1000) == [True] * num_ranks


def _timeout_body(ctx, timeout_s):
    h = heap.allocate(4096, device=ctx.device)
    prev = (ctx.rank - 1) % ctx.world_size
    start = time.monotonic()
    try:
        # Nobody raises this flag: the wait must give up and say who waited for whom.
        wait_signal(h, FLAG_OFFSET, value=12345, peer=prev, timeout_s=timeout_s)
    except WaitTimeoutError as e:
        elapsed = time.monotonic() - start
        assert (e.rank, e.peer, e.phase) == (ctx.rank, prev, "signal")
        message = str(e)
    else:
        raise AssertionError("the wait did not time out")
    # The process (and its device) is still usable: the heap works after the timeout.
    h.barrier()
    put_signal(
        h,
        torch.arange(8, dtype=torch.int32, device=ctx.device),
        (ctx.rank + 1) % ctx.world_size,
        64,
        4,
        1,
    )
    wait_signal(h, 4, 1, peer=prev, timeout_s=30)
    h.close()
    return message, elapsed


def test_wait_times_out_with_a_clear_error(run_ranks):
    results = run_ranks(2, _timeout_body, 0.2)
    for rank, (message, elapsed) in enumerate(results):
        assert (
            f"rank {rank} timed out after 0.2 s in phase 'signal' waiting for peer {1 - rank}"
            in message
        )
        assert elapsed < 30


def _views_body(ctx):
    h = heap.allocate(256, device=ctx.device)
    errors = []
    for args in [(ctx.rank, torch.int32, (65,), 0), (ctx.rank, torch.int32, (4,), 2)]:
        try:
            h.view(*args)
        except ValueError as e:
            errors.append(str(e).split(":")[0])
    with pytest.raises(ValueError, match="data_offset"):
        put_signal(h, torch.zeros(64, dtype=torch.int32, device=ctx.device), 0, 16, 0, 1)
    with pytest.raises(ValueError, match="peer"):
        put_signal(
            h, torch.zeros(4, dtype=torch.int32, device=ctx.device), ctx.world_size, 16, 0, 1
        )
    h.close()
    return errors


def test_view_and_offset_checks(run_ranks):
    assert run_ranks(2, _views_body) == [["offset", "offset"]] * 2


def _guard_body(ctx):
    """Rank 0 writes one byte past the end of rank 1's regions (as an out-of-bounds kernel
    would): rank 1's check names it, rank 0's heap stays clean, views cannot reach the guard,
    and the modes' checks read the guard too."""
    from tritonep.modes.low_latency import LowLatencyMode
    from tritonep.modes.normal import NormalMode

    h = heap.allocate(256, device=ctx.device)
    assert h.nbytes == 256 and h.local.numel() == 256
    with pytest.raises(ValueError, match="offset"):
        h.view(ctx.rank, torch.uint8, (1,), 256)
    h.check_guard()
    h.barrier()
    if ctx.rank == 0:
        h._peers[1][256 + 7] = 1
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
    h.barrier()
    found = None
    try:
        h.check_guard()
    except HeapGuardError as e:
        found = (e.rank, e.first, e.count, "out of bounds" in str(e))
    h.close()
    h.check_guard()  # closed: nothing to check
    for mode in (
        NormalMode(None, 128, 8, max_topk=2, device=ctx.device, timeout_s=20),
        LowLatencyMode(None, 8, 128, 8, max_topk=2, device=ctx.device, timeout_s=20),
    ):
        mode.check()
        mode.heap._guard[-1] = 5  # the last byte of this rank's guard
        with pytest.raises(HeapGuardError, match=f"rank {ctx.rank}: 1 bytes past"):
            mode.check()
        mode.heap._guard.zero_()
        mode.destroy()
    return found


def test_a_write_past_a_heap_is_found(run_ranks):
    assert run_ranks(2, _guard_body) == [None, (1, 7, 1, True)]


def _mismatch_body(ctx):
    try:
        heap.allocate(4096 + 128 * ctx.rank, device=ctx.device)
    except ValueError as e:
        return str(e)
    return "no error"


def test_every_rank_rejects_mismatched_sizes(run_ranks):
    for message in run_ranks(3, _mismatch_body):
        assert message == "nbytes: every rank must allocate the same size, got [4096, 4224, 4352]"


@pytest.mark.gpu(n=2)
def test_put_signal_ring_large_block_on_gpus(run_ranks):
    n = gpu_ranks()
    assert run_ranks(n, _ring_body, 5, 1 << 20) == [True] * n


@pytest.mark.gpu(n=2)
@pytest.mark.skipif(shared_gpu(), reason="NVSHMEM needs a GPU per rank")
@pytest.mark.parametrize("via", ["store", "nvshmem"])
def test_put_signal_ring_nvshmem_backend(via):
    from tritonep.launch import spawn

    n = gpu_ranks()
    results = spawn(_ring_body, n, 3, 1 << 16, "NVSHMEM", via, backend="nccl", timeout=300)
    assert results == [True] * n


def _nvshmem_refused_body(ctx):
    h = heap.allocate(4096, device=ctx.device)
    assert h.backend in ("CPU", "IPC", "CUDA")
    try:
        with pytest.raises(ValueError, match="via: 'nvshmem' needs a heap of the NVSHMEM"):
            put_signal(h, torch.ones(4, device=ctx.device), 0, 1024, 0, 1, via="nvshmem")
        with pytest.raises(ValueError, match="via: expected 'store' or 'nvshmem'"):
            put_signal(h, torch.ones(4, device=ctx.device), 0, 1024, 0, 1, via="rdma")
    finally:
        h.close()
    return True


def test_nvshmem_puts_need_an_nvshmem_heap(run_ranks):
    assert run_ranks(2, _nvshmem_refused_body) == [True, True]


def test_a_timeout_stays_the_error_when_the_release_fails_too():
    """A dead peer never reaches the release's barrier: the timeout is still what is raised,
    with the barrier's failure as its cause; a clean check releases and raises nothing."""
    from types import SimpleNamespace

    from tritonep.errors import WaitTimeoutError
    from tritonep.heap.base import SymmetricHeap

    def barrier_fails():
        raise RuntimeError("barrier timed out")

    def timed_out():
        raise WaitTimeoutError(0, 1, "notify", 1.0)

    heap = SimpleNamespace(close=barrier_fails)
    with pytest.raises(WaitTimeoutError, match="waiting for peer 1") as raised:
        SymmetricHeap.close_checked(heap, timed_out)
    assert isinstance(raised.value.__cause__, RuntimeError)
    closed = []
    SymmetricHeap.close_checked(SimpleNamespace(close=lambda: closed.append(1)), lambda: None)
    assert closed == [1]
