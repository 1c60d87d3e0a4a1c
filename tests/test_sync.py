"""The bounded waits of kernels.sync, run under the interpreter: the ring wait on flags within
one warp and on wider ones (the two loops of ``wait_all_at_least``) and the tile wait
(``wait_tile``), each when every flag is there, when one comes while it waits, and when one
never comes."""

import threading
import time

import pytest
import torch
import triton
import triton.language as tl

from tritonep import interpret
from tritonep.kernels.sync import (
    STATUS_TIMEOUT,
    STATUS_WORDS,
    WARP_LANES,
    wait_all_at_least,
    wait_tile,
)

pytestmark = pytest.mark.skipif(
    not interpret.interpreting(), reason="runs its kernel under the interpreter (CPU tensors)"
)


@triton.jit
def _wait_kernel(
    flags_addr,  # int64 address of the [N] int64 flags (read as a peer's heap is, by address)
    targets_ptr,  # [N] int64 the value each flag must reach
    values_ptr,  # [N] int64 out: the flags as the wait last read them
    ok_ptr,  # [1] int32 out: whether every flag got there in time
    timeout_ns,  # limit of the wait
    N: tl.constexpr,  # flags
):
    lanes = tl.arange(0, N)
    flags = (flags_addr + lanes * 8).to(tl.pointer_type(tl.int64))
    targets = tl.load(targets_ptr + lanes)
    values, ok = wait_all_at_least(flags, targets, lanes < N, timeout_ns, False)
    tl.store(values_ptr + lanes, values)
    tl.store(ok_ptr, ok.to(tl.int32))


def _wait(flags: torch.Tensor, targets: torch.Tensor, timeout_s: float):
    values = torch.full_like(flags, -7)  # poisoned: a lane the kernel leaves shows
    ok = torch.full((1,), -7, dtype=torch.int32)
    start = time.monotonic()
    _wait_kernel[(1,)](flags.data_ptr(), targets, values, ok, int(timeout_s * 1e9), flags.numel())
    return values, int(ok.item()), time.monotonic() - start


@pytest.mark.parametrize("lanes", [8, 2 * WARP_LANES], ids=["one-warp", "wider"])
def test_a_ring_wait_returns_every_flag_once_all_are_there(lanes):
    targets = torch.randint(1, 1000, (lanes,), dtype=torch.int64)
    flags = targets + torch.randint(0, 3, (lanes,), dtype=torch.int64)
    values, ok, _ = _wait(flags, targets, 5.0)
    assert ok == 1
    assert torch.equal(values, flags)


def _one_late(lanes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random targets, flags at them but one (``late``), which is one short."""
    targets = torch.randint(1, 1000, (lanes,), dtype=torch.int64)
    flags = targets.clone()
    late = int(torch.randint(0, lanes, ()))
    flags[late] -= 1
    return targets, flags, late


@pytest.mark.parametrize("lanes", [8, 2 * WARP_LANES], ids=["one-warp", "wider"])
def test_a_ring_wait_sees_a_flag_set_while_it_waits(lanes):
    targets, flags, late = _one_late(lanes)
    setter = threading.Timer(0.2, lambda: flags.__setitem__(late, targets[late] + 5))
    setter.start()
    values, ok, took = _wait(flags, targets, 30.0)
    setter.join()
    assert ok == 1 and took >= 0.2
    expected = targets.clone()
    expected[late] += 5
    assert torch.equal(values, expected)


@pytest.mark.parametrize("lanes", [8, 2 * WARP_LANES], ids=["one-warp", "wider"])
def test_a_ring_wait_gives_up_at_its_limit_and_says_so(lanes):
    targets, flags, _ = _one_late(lanes)
    values, ok, took = _wait(flags, targets, 0.3)
    assert ok == 0 and took >= 0.3
    assert torch.equal(values, flags)  # the last read, the missing flag included


@triton.jit
def _tile_kernel(
    flags_addr,  # int64 address of the [ROWS, COLS] int64 tagged flags (tag << 32 | payload)
    tag,  # the tag every flag must carry
    budget_ns,  # int64 the longest the wait may take
    timeout_us,  # the launch's limit (sync.limit_ns), in microseconds
    status_ptr,  # [STATUS_WORDS] int32: a timeout recorded there leaves no time to wait
    values_ptr,  # [ROWS, COLS] int64 out: each flag from the read that found it
    missing_ptr,  # [ROWS, COLS] int8 out: the flags still missing at the limit
    limit_ptr,  # [1] int64 out: the limit the wait had
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    lanes = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    flags = (flags_addr + lanes * 8).to(tl.pointer_type(tl.int64))
    values, missing, _, limit = wait_tile(
        flags, lanes >= 0, tag, budget_ns, timeout_us, status_ptr, False, SHIFT=32
    )
    tl.store(values_ptr + lanes, values)
    tl.store(missing_ptr + lanes, missing.to(tl.int8))
    tl.store(limit_ptr, limit)


def _tile(flags: torch.Tensor, tag: int, timeout_s: float, status=None):
    values = torch.full_like(flags, -7)
    missing = torch.full(flags.shape, -7, dtype=torch.int8)
    limit = torch.full((1,), -7, dtype=torch.int64)
    if status is None:
        status = torch.zeros(STATUS_WORDS, dtype=torch.int32)
    rows, cols = flags.shape
    start = time.monotonic()
    _tile_kernel[(1,)](
        flags.data_ptr(),
        tag,
        1 << 40,
        int(timeout_s * 1e6),
        status,
        values,
        missing,
        limit,
        rows,
        cols,
    )
    return values, missing.bool(), int(limit.item()), time.monotonic() - start


def _tagged(tag: int, rows: int, cols: int) -> torch.Tensor:
    return (tag << 32) | torch.randint(0, 1 << 20, (rows, cols), dtype=torch.int64)


def test_a_tile_wait_returns_each_flag_from_the_read_that_found_it():
    tag = int(torch.randint(2, 1000, ()))
    flags = _tagged(tag, 4, 8)
    values, missing, _, _ = _tile(flags, tag, 5.0)
    assert not missing.any() and torch.equal(values, flags)
    # One flag of the call before, tagged anew while the wait polls.
    late = (int(torch.randint(0, 4, ())), int(torch.randint(0, 8, ())))
    old = flags.clone()
    flags[late] = ((tag - 1) << 32) | 3
    setter = threading.Timer(0.2, lambda: flags.__setitem__(late, old[late]))
    setter.start()
    values, missing, _, took = _tile(flags, tag, 30.0)
    setter.join()
    assert not missing.any() and took >= 0.2
    assert torch.equal(values, old)


def test_a_tile_wait_names_the_flags_missing_at_its_limit():
    tag = int(torch.randint(2, 1000, ()))
    flags = _tagged(tag, 4, 8)
    late = (int(torch.randint(0, 4, ())), int(torch.randint(0, 8, ())))
    flags[late] = ((tag - 1) << 32) | 3
    expected = torch.zeros(4, 8, dtype=torch.bool)
    expected[late] = True
    values, missing, limit, took = _tile(flags, tag, 0.3)
    assert torch.equal(missing, expected) and limit == 300_000_000 and took >= 0.3
    assert torch.equal(values[~expected], flags[~expected])
    # A timeout already recorded: no time to wait, the same flag missing.
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32)
    status[0] = STATUS_TIMEOUT.value
    _, missing, limit, took = _tile(flags, tag, 30.0, status)
    assert torch.equal(missing, expected) and limit == 0 and took < 5.0
