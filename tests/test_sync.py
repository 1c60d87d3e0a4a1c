"""The bounded ring wait of kernels.sync, on flags within one warp and on wider ones (the two
loops of ``wait_all_at_least``), run under the interpreter: what it returns when every flag is
there, when one comes while it waits, and when one never comes."""

import threading
import time

import pytest
import torch
import triton
import triton.language as tl

from tritonep import interpret
from tritonep.kernels.sync import WARP_LANES, wait_all_at_least

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


@pytest.mark.parametrize("lanes", [8, 2 * WARP_LANES], ids=["one-warp", "wider"])
def test_a_ring_wait_sees_a_flag_set_while_it_waits(lanes):
    targets = torch.randint(1, 1000, (lanes,), dtype=torch.int64)
    flags = targets.clone()
    late = int(torch.randint(0, lanes, ()))
    flags[late] -= 1
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
    targets = torch.randint(1, 1000, (lanes,), dtype=torch.int64)
    flags = targets.clone()
    late = int(torch.randint(0, lanes, ()))
    flags[late] -= 1
    values, ok, took = _wait(flags, targets, 0.3)
    assert ok == 0 and took >= 0.3
    assert torch.equal(values, flags)  # the last read, the missing flag included
