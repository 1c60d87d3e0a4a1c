"""The copy-engine combine's driver calls, on a stand-in for libcuda: which copies go in one
batch and which one by one (no GPU needed)."""

from __future__ import annotations

import ctypes

import pytest

from tritonep.modes.copy_combine import _CopyList, _Driver


class _FakeLib:
    """The entry points :class:`_Driver` takes, recording what they are called with;
    ``capturing`` is the status ``cuStreamIsCapturing`` reports."""

    def __init__(self, batch: str | None, capturing: int = 0, batch_result: int = 0):
        self.calls: list[tuple] = []
        self.capturing = capturing
        self.batch_result = batch_result

        def entry(name, body=None):
            def call(*args):
                self.calls.append((name, args))
                return body(*args) if body else 0

            setattr(self, name, call)

        def is_capturing(stream, status):
            status._obj.value = self.capturing
            return 0

        def batch_call(dsts, srcs, sizes, count, attrs, attrs_index, num_attrs, *rest):
            n = count.value
            self.calls[-1] = (
                "batch",
                [(dsts[i], srcs[i], sizes[i]) for i in range(n)],
                attrs[0].src_access_order,
                num_attrs.value,
                len(rest),  # the failure index (first form) and the stream
                rest[-1].value,
            )
            return self.batch_result

        for name in (
            "cuMemcpyDtoDAsync_v2",
            "cuEventCreate",
            "cuEventRecord",
            "cuStreamWaitEvent",
            "cuEventDestroy_v2",
            "cuStreamBatchMemOp_v2",
        ):
            entry(name)
        entry("cuStreamIsCapturing", is_capturing)
        if batch is not None:
            entry(batch, batch_call)


COPIES = [(0x1000, 0x2000, 64), (0x3000, 0x4000, 16), (0x5000, 0x6000, 128)]


def _issue(lib, stream: int, copies=COPIES):
    driver = _Driver(lib)
    batch = _CopyList(4)
    for copy in copies:
        batch.add(*copy)
    driver.copies(batch, stream)
    assert batch.count == 0  # emptied for the next chunk
    return [c for c in lib.calls if c[0] != "cuStreamIsCapturing"]


@pytest.mark.parametrize("entry", ["cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"])
def test_a_chunks_copies_go_in_one_batch(entry):
    lib = _FakeLib(entry)
    calls = _issue(lib, stream=0x77)
    # One batch, in the order added, each copy's source read in stream order; the first form
    # also takes the address of a failure index before the stream.
    assert calls == [("batch", COPIES, 1, 1, 2 if entry == "cuMemcpyBatchAsync" else 1, 0x77)]


@pytest.mark.parametrize(
    "case, lib, stream",
    [
        ("legacy default stream", _FakeLib("cuMemcpyBatchAsync_v2"), 0),
        ("being captured", _FakeLib("cuMemcpyBatchAsync_v2", capturing=1), 0x77),
        ("no batch entry", _FakeLib(None), 0x77),
    ],
)
def test_copies_go_one_by_one_where_a_batch_cannot(case, lib, stream):
    calls = _issue(lib, stream)
    assert [c[0] for c in calls] == ["cuMemcpyDtoDAsync_v2"] * 3, case
    assert [c[1][:3] for c in calls] == COPIES
    assert all(c[1][3] == stream for c in calls)


def test_a_single_copy_needs_no_batch():
    calls = _issue(_FakeLib("cuMemcpyBatchAsync_v2"), 0x77, COPIES[:1])
    assert [c[0] for c in calls] == ["cuMemcpyDtoDAsync_v2"]


def test_a_failed_batch_raises_naming_the_call():
    lib = _FakeLib("cuMemcpyBatchAsync_v2", batch_result=1)
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync failed: CUDA error 1"):
        _issue(lib, 0x77)


def test_copy_attributes_have_the_drivers_layout():
    from tritonep.modes.copy_combine import _CopyAttributes

    assert ctypes.sizeof(_CopyAttributes) == 24  # CUmemcpyAttributes
