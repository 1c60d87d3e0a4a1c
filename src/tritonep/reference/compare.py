"""Comparisons that tests use against the reference, strict about every valid byte.

Values compare bit for bit (``-0`` differs from ``+0``), except that any NaN matches any NaN.

Low-latency receive slabs may hold their per-source blocks in any order, so they are compared
block by block through the layout ranges; the blocks must also tile ``[0, recv_count)`` exactly.
"""

from __future__ import annotations

import torch

from .low_latency import LowLatencyDispatchResult, unpack_range


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, so -0 differs from +0."""
    if t.dtype.is_floating_point:
        return t.view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
    return t


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: got {tuple(got.shape)} {got.dtype}, expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    got, expected = got.cpu(), expected.cpu()
    diff = _bits(got) != _bits(expected)
    if got.dtype.is_floating_point:
        # A NaN matches any NaN: IEEE leaves the sign and payload of a NaN that arithmetic
        # makes to the hardware (x86 CPUs make a negative one, NVIDIA GPUs a positive one).
        diff &= ~(got.float().isnan() & expected.float().isnan())
    if diff.any():
        where = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} elements differ, first at {where}")


def assert_rows_equal(got, expected, rows: int, what: str) -> None:
    """The first ``rows`` rows of ``got`` against ``expected``, bit for bit; both are a tensor
    or an FP8 pair (payload, scales), as dispatch outputs are."""
    if isinstance(expected, tuple):
        assert_bitwise_equal(got[0][:rows].cpu(), expected[0], what)
        assert_bitwise_equal(got[1][:rows].cpu(), expected[1], f"{what} scales")
    else:
        assert_bitwise_equal(got[:rows].cpu(), expected, what)


def assert_low_latency_dispatch_equal(
    got: LowLatencyDispatchResult, expected: LowLatencyDispatchResult, rank: int = 0
) -> None:
    """Every valid row, scale, source index, count and range, independent of block order."""
    assert_bitwise_equal(got.recv_count.cpu(), expected.recv_count.cpu(), f"rank {rank} recv_count")
    num_local, num_ranks = expected.recv_layout_range.shape
    for local in range(num_local):
        total = int(expected.recv_count[local])
        covered = torch.zeros(total, dtype=torch.int32)
        for src in range(num_ranks):
            where = f"rank {rank} expert {local} source {src}"
            g_begin, g_count = (int(v) for v in unpack_range(got.recv_layout_range[local, src]))
            e_begin, e_count = (
                int(v) for v in unpack_range(expected.recv_layout_range[local, src])
            )
            if g_count != e_count:
                raise AssertionError(f"{where}: got {g_count} rows, expected {e_count}")
            if g_count and (g_begin < 0 or g_begin + g_count > total):
                raise AssertionError(f"{where}: block [{g_begin}, +{g_count}) outside [0, {total})")
            covered[g_begin : g_begin + g_count] += 1
            g_rows = slice(g_begin, g_begin + g_count)
            e_rows = slice(e_begin, e_begin + e_count)
            assert_bitwise_equal(
                got.recv_src_info[local, g_rows],
                expected.recv_src_info[local, e_rows],
                f"{where} src_info",
            )
            assert_bitwise_equal(
                got.recv_x[local, g_rows], expected.recv_x[local, e_rows], f"{where} payload"
            )
            if expected.recv_x_scales is not None:
                if got.recv_x_scales is None:
                    raise AssertionError(f"{where} scales: none received")
                assert_bitwise_equal(
                    got.recv_x_scales[local, g_rows],
                    expected.recv_x_scales[local, e_rows],
                    f"{where} scales",
                )
        if total and not bool((covered == 1).all()):
            raise AssertionError(f"rank {rank} expert {local}: blocks do not tile [0, {total})")
